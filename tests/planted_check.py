"""Run the planted failures of l47.testing.planted against the audit and check each is caught for its reason:
the named bar fails (exit 1), or the input is refused before scoring (one line, no report, nothing appended to
the base model's ledger). Shared by the synthetic world (test_audit), the demo and model2 end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from l47.errors import L47Error
from l47.testing.planted import REFUSED, HonestRun, Plant


def _ledger_entries(run: HonestRun) -> int:
    from l47.data.ledger import Ledger
    from l47.model.gguf_io import open_gguf

    return len(Ledger.open(None, open_gguf(run.base).sha256()).entries())


def check_plant(p: Plant, run: HonestRun, out: Path, **audit_kw):
    """Audit the planted input; assert it is caught as `p.expect` says. Returns the AuditReport (None: refused)."""
    from l47.evals.audit import AuditArgs, run_audit

    args = AuditArgs(bundle=p.bundle, base=run.base, experiment=p.experiment, out_dir=out, plots=False,
                     blind=p.blind, dev_report=run.dev_report if p.blind is not None else None, **audit_kw)
    if p.expect == REFUSED:
        n0 = _ledger_entries(run)
        with pytest.raises(L47Error, match=p.match or "."):
            run_audit(args)
        assert not (Path(out) / "report.json").exists(), p.name
        assert _ledger_entries(run) == n0, f"{p.name}: refused, yet the ledger grew"
        return None
    res = run_audit(args)
    failed = {b.name for b in res.bars if not b.passed}
    assert any(n == p.expect or n.startswith(p.expect + ".") for n in failed), (p.name, p.why, sorted(failed))
    assert res.exit_code == 1 and not res.passed, p.name
    return res


def check_all(plants: list[Plant], run: HonestRun, out: Path, **audit_kw) -> dict[str, object]:
    """Every plant (each in its own output folder); {plant name: AuditReport or None}."""
    return {p.name: check_plant(p, run, Path(out) / p.name, **audit_kw) for p in plants}
