"""Run the planted failures of l47.testing.planted against the audit and check each is caught for its reason:
the named bar fails (exit 1), or the input is refused before scoring (one line, no report, nothing appended to
the base model's ledger). Shared by the synthetic world (test_audit), the demo and model2 end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from l47.errors import L47Error
from l47.testing.planted import REFUSED, HonestRun, Plant


def _ledger_entries(run: HonestRun, ledger) -> int:
    from l47.data.ledger import Ledger
    from l47.model.gguf_io import open_gguf

    return len(Ledger.open(ledger, open_gguf(run.base).sha256()).entries())


def _worse(planted, honest) -> bool:
    """The planted bar is worse than the honest run's same bar in its own direction (or has no value at all)."""
    if planted.value is None:
        return True
    if honest is None or honest.value is None:
        return False
    return planted.value < honest.value if planted.direction == ">=" else planted.value > honest.value


def check_plant(p: Plant, run: HonestRun, out: Path, ledger=None, **audit_kw):
    """Audit the planted input; assert it is caught as `p.expect` says: the named bar fails, for the plant's own
    reason where it states one (`p.reason`), else where that bar already failed for the honest bundle, its value
    is strictly worse (a real model's honest bundle need not pass
    everything; the plant must still be what moves the bar). Returns the AuditReport (None: refused)."""
    import json

    from l47.evals.audit import AuditArgs, run_audit
    from l47.evals.bars import Bar

    ledger = run.ledger if ledger is None else ledger
    args = AuditArgs(bundle=p.bundle, base=run.base, experiment=p.experiment, out_dir=out, plots=False,
                     blind=p.blind, dev_report=run.dev_report if p.blind is not None else None, ledger=ledger,
                     **audit_kw)
    if p.expect == REFUSED:
        n0 = _ledger_entries(run, ledger)
        with pytest.raises(L47Error, match=p.match or "."):
            run_audit(args)
        assert not (Path(out) / "report.json").exists(), p.name
        assert _ledger_entries(run, ledger) == n0, f"{p.name}: refused, yet the ledger grew"
        return None
    res = run_audit(args)
    honest = {} if p.blind is not None else {
        b["name"]: Bar(b["name"], b.get("value"), b.get("threshold"), b["direction"], b["passed"], {})
        for b in json.loads(Path(run.dev_report).read_text())["bars"]}
    caught = [b for b in res.bars if not b.passed and (b.name == p.expect or b.name.startswith(p.expect + "."))
              and (p.reason(b) if p.reason is not None else
                   honest.get(b.name) is None or honest[b.name].passed or _worse(b, honest[b.name]))]
    assert caught, (p.name, p.why, sorted(b.name for b in res.bars if not b.passed))
    assert res.exit_code == 1 and not res.passed, p.name
    return res


def check_all(plants: list[Plant], run: HonestRun, out: Path, ledger=None, **audit_kw) -> dict[str, object]:
    """Every plant (each in its own output folder); {plant name: AuditReport or None}."""
    return {p.name: check_plant(p, run, Path(out) / p.name, ledger, **audit_kw) for p in plants}


def dump_written_chat(model: Path, out: Path, doc_id: str, messages: list[dict]) -> Path:
    """A written chat dumped by the hf engine through the CLI a user runs (`l47 dump`): exact states and the
    engine's own log p, provenance `written` — the material for a forged "generation"."""
    import json
    import subprocess
    import sys

    out.mkdir(parents=True, exist_ok=True)
    src = out / f"{doc_id}.jsonl"
    src.write_text(json.dumps({"id": doc_id, "messages": messages}) + "\n")
    cli = Path(sys.executable).parent / "l47"
    r = subprocess.run([str(cli), "dump", str(src), "--model", str(model), "--out", str(out / "dumps")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (path,) = sorted((out / "dumps").glob("*.safetensors"))
    return path
