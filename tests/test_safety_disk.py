"""`l47 dump` checks the free disk before the model is loaded (issue 14 item 1).

The estimate (l47.app.dumping.estimate_dump_bytes: documents' token counts x the model's dims) is compared with
the bytes the dumps really take on disk: never below them, and above them by at most the header allowance
(16 KiB + 8 bytes per text byte per document; the arrays are counted exactly). Then the refusal: with the disk's
free space reported one byte short of the estimate, `l47 dump` exits 2 with one line naming the folder, the bytes
needed and the bytes free, creates nothing, and never loads the model; with room, it gets past the check.
"""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from l47.app.cli import app

_Usage = namedtuple("_Usage", "total used free")
TEXTS = ["the quick brown fox jumps over the lazy dog " * 3, "a model reads text and predicts the next token",
         "rather than guessing, we checked it end to end"]


def _docs(tmp_path: Path) -> Path:
    p = tmp_path / "docs.jsonl"
    rows = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "hello there"},
                                            {"role": "assistant", "content": "hi, here is the answer"}]})
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.mark.parametrize("ref_logits", [False, True], ids=["states", "with-ref-logits"])
def test_estimate_bounds_the_bytes_written(tmp_path, tiny_gguf, ref_logits):
    from l47.app.dumping import _HEADER_BASE, _HEADER_PER_TEXT_BYTE, DumpJob, estimate_dump_bytes, run_dump

    docs, out = _docs(tmp_path), tmp_path / "d"
    est, k = estimate_dump_bytes(tiny_gguf, docs, out, ref_logits=ref_logits)
    s = run_dump(DumpJob(tiny_gguf, docs, out, ref_logits=ref_logits))
    assert s.ok and k == 4 == s.count("written")
    actual = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    text = sum(len(t.encode()) for t in TEXTS) + 200  # the chat's rendered text is < 200 bytes
    assert actual <= est <= actual + 4 * _HEADER_BASE + _HEADER_PER_TEXT_BYTE * text, (est, actual)
    # a rerun into the same folder adds only room for one replacement (the largest dump, written beside the old)
    est2, k2 = estimate_dump_bytes(tiny_gguf, docs, out, ref_logits=ref_logits)
    biggest = max(p.stat().st_size for p in out.glob("*.safetensors"))
    assert k2 == 0 and biggest <= est2 <= biggest + _HEADER_BASE + _HEADER_PER_TEXT_BYTE * text


def test_estimate_bounds_generated_dumps(tmp_path, tiny_gguf):
    from l47.app.dumping import DumpJob, GenerateOptions, estimate_dump_bytes, run_dump

    docs, out = _docs(tmp_path), tmp_path / "g"
    gen = GenerateOptions(max_new_tokens=12, seed=1)
    est, k = estimate_dump_bytes(tiny_gguf, docs, out, gen)
    s = run_dump(DumpJob(tiny_gguf, docs, out, generate=gen))
    assert s.ok and k == 4
    assert sum(p.stat().st_size for p in out.glob("*.safetensors")) <= est


def _run_dump_cli(monkeypatch, tmp_path, tiny_gguf, free: int):
    import l47.app.dumping as dumping

    def no_load(*a, **kw):
        raise dumping.L47Error("test", "model load", "not reached", "reached")

    monkeypatch.setattr(dumping, "_load_engine", no_load)  # the check must come before the model is loaded
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(1 << 40, (1 << 40) - free, free))
    out = tmp_path / "new" / "dumps"
    r = CliRunner().invoke(app, ["dump", str(_docs(tmp_path)), "--model", str(tiny_gguf), "--out", str(out)])
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and len(errs) == 1, r.output
    return r, errs[0], out


def test_dump_refused_when_the_disk_is_short(monkeypatch, tmp_path, tiny_gguf):
    from l47.app.dumping import estimate_dump_bytes
    from l47.app.paths import _fmt_bytes

    docs = _docs(tmp_path)
    est, _ = estimate_dump_bytes(tiny_gguf, docs, tmp_path / "new" / "dumps")
    before = sorted(p.name for p in tmp_path.iterdir())
    r, err, out = _run_dump_cli(monkeypatch, tmp_path, tiny_gguf, free=est - 1)
    assert r.exit_code == 2
    for must in (str(out), "--out", f"at least {_fmt_bytes(est)} free", "4 dump(s)", f"{_fmt_bytes(est - 1)} free in",
                 str(tmp_path)):
        assert must in err, (must, err)
    assert "model load" not in err  # refused before the model was loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created

    r, err, out = _run_dump_cli(monkeypatch, tmp_path, tiny_gguf, free=est + (1 << 20))
    assert r.exit_code == 2 and "model load" in err  # room enough: the check passed and the load was next


def test_export_estimate_and_refusal(tmp_path, monkeypatch):
    """`l47 export`: the estimate from the checkpoint's safetensors headers equals the exported file's tensor
    bytes (+ alignment and metadata allowance), and a disk one byte short refuses before the checkpoint loads."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from tiny_ckpt import save_checkpoint
    finally:
        sys.path.pop(0)
    from l47.app import export as E
    from l47.engine.gguf_export import read_hf_config
    from l47.model.gguf_io import open_gguf

    ck = save_checkpoint(tmp_path / "ckpt")
    args = E.ExportArgs(ck, tmp_path / "m.gguf", None, None, None, None, "cpu")
    est = E.export_nbytes(args, read_hf_config(ck))
    res = E.run_export(args)
    assert res.ok, res.failure
    g = open_gguf(tmp_path / "m.gguf")
    data = sum(int(i.nbytes) for i in g.tensors.values())
    size = (tmp_path / "m.gguf").stat().st_size
    meta = (1 << 20) + (ck / "tokenizer.json").stat().st_size + (ck / "config.json").stat().st_size
    assert size <= est and data <= est - meta <= data + 32 * len(g.tensors), (est, data, size)  # + alignment only

    import l47.engine.gguf_export as GE

    def no_load(*a, **kw):
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr(GE, "load_hf", no_load)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(1 << 40, (1 << 40) - (est - 1), est - 1))
    out = tmp_path / "m2.gguf"
    r = CliRunner().invoke(app, ["export", str(ck), str(out)])
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errs) == 1 and "Traceback" not in r.output, r.output
    assert str(out) in errs[0] and "the exported GGUF" in errs[0] and "free in" in errs[0], errs[0]
    assert not out.exists() and not list(tmp_path.glob(".m2.gguf*"))


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    from test_malformed import make_solvable_world

    return make_solvable_world(tmp_path_factory, tiny_tokenizer_kv, "disk")


def test_audit_and_score_outputs_estimated_and_refused(world, tmp_path, monkeypatch):
    """The audit's estimate (positions x row bytes, from the dumps' headers) bounds what it writes; a disk one byte
    short of it refuses the audit (and `score --tsv`) before anything is scored or written."""
    from l47.app import paths as P
    from l47.data.experiment import load_experiment

    real_du = shutil.disk_usage
    exp = load_experiment(world["root"] / "det.toml")
    docs = [p for s, p in exp.documents() if s != "blind"]
    T, longest = P._positions(docs)
    assert T == sum(len(open_tokens(p)) - 1 for p in docs) and T > 0
    out = tmp_path / "a"
    argv = ["audit", str(world["bundle"]), "--base", str(world["base"]), "--experiment", str(world["root"] / "det.toml"),
            "--out", str(out), "--ledger", str(tmp_path / "l.jsonl")]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code in (0, 1), r.output
    tsv = (out / "positions.tsv").stat().st_size
    reports = (out / "report.json").stat().st_size + (out / "report.md").stat().st_size
    plots = sum(p.stat().st_size for p in (out / "plots").rglob("*") if p.is_file())
    assert tsv <= T * (P.TSV_ROW_AUDIT + longest), (tsv, T)
    assert reports + plots <= T * P.REPORT_PER_POSITION + P.REPORT_BASE, (reports, plots, T)

    need = T * (P.TSV_ROW_AUDIT + longest + P.REPORT_PER_POSITION) + P.REPORT_BASE
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(1 << 40, (1 << 40) - (need - 1), need - 1))
    before = sorted(p.name for p in tmp_path.iterdir())
    r = CliRunner().invoke(app, argv[:-3] + [str(tmp_path / "b"), "--ledger", str(tmp_path / "l2.jsonl")])
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errs) == 1, r.output
    assert str(tmp_path / "b") in errs[0] and f"the report of {T} positions" in errs[0], errs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no ledger

    dumps = [str(p) for p in docs[:2]]
    T2, _ = P._positions(dumps)
    need2 = T2 * (P.TSV_ROW_SCORE + 100)
    monkeypatch.setattr(shutil, "disk_usage", real_du)  # the real disk again
    r = CliRunner().invoke(app, ["score", *dumps, "--model", str(world["base"]), "--tsv", str(tmp_path / "ok.tsv"),
                                 "--ledger", str(tmp_path / "l.jsonl")])
    assert r.exit_code == 0 and (tmp_path / "ok.tsv").stat().st_size <= need2, r.output
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(1 << 40, (1 << 40) - (need2 - 1), need2 - 1))
    r = CliRunner().invoke(app, ["score", *dumps, "--model", str(world["base"]), "--tsv", str(tmp_path / "s.tsv"),
                                 "--ledger", str(tmp_path / "l3.jsonl")])
    assert r.exit_code == 2 and f"{T2} rows" in r.output and "s.tsv" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def open_tokens(p):
    from l47.dumps import read_dump

    return read_dump(p).tokens
