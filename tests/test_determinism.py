"""Determinism (issue 14 item 8): the same inputs give the same bytes.

* `l47 dump` of the same documents from copies of the input file in two folders, into two output folders:
  byte-identical dump files (the dump records the input's file name and line, not its folder).
* `l47 solve` twice (two output folders) and `l47 audit` twice on the same inputs: byte-identical bundles and
  solve records' figures, and the same report.json apart from timestamps and the output folder's own paths.
The world is test_malformed's (synthetic tail states; thresholds relaxed so its documents are accepted): the
figures themselves do not matter here, only that two runs agree to the byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from test_malformed import make_solvable_world


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    return make_solvable_world(tmp_path_factory, tiny_tokenizer_kv, "det")


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return r


def test_solve_and_audit_twice_same_bytes(world, tmp_path):
    root = world["root"]
    runs = []
    for k in ("a", "b"):
        out = tmp_path / k
        out.mkdir()
        r = _cli("solve", root / "det.toml", "--out", out / "bundle.gguf", "--ledger", out / "ledger.jsonl")
        assert r.exit_code == 0, r.output
        r = _cli("audit", out / "bundle.gguf", "--base", world["base"], "--experiment", root / "det.toml",
                 "--out", out / "audit", "--no-plots", "--ledger", out / "ledger.jsonl")
        assert r.exit_code in (0, 1), r.output
        runs.append(out)
    a, b = runs
    assert (a / "bundle.gguf").read_bytes() == (b / "bundle.gguf").read_bytes()
    ra, rb = (json.loads((x / "bundle.gguf.solve.json").read_text()) for x in runs)
    assert ra["claims"] == rb["claims"] and ra["touched"] == rb["touched"]
    ja, jb = ((x / "audit" / "report.json").read_text().replace(str(x), "<OUT>") for x in runs)
    assert _no_time(json.loads(ja)) == _no_time(json.loads(jb))
    assert (a / "audit" / "positions.tsv").read_bytes() == (b / "audit" / "positions.tsv").read_bytes()


def _no_time(d):
    if isinstance(d, dict):
        return {k: _no_time(v) for k, v in d.items() if k not in ("time", "timestamp", "created", "started",
                                                                   "finished", "elapsed_s", "wall_s")}
    if isinstance(d, list):
        return [_no_time(x) for x in d]
    return d


def test_dump_from_another_folder_same_bytes(tiny_gguf, tmp_path):
    """The same documents, from copies of the input file in two folders, dumped into two folders: the same dump
    bytes (before: the dump's `source` held the input's absolute path, so every demo folder gave other dump
    hashes and another bundle — its provenance lists the dumps' sha256)."""
    from l47.app.dumping import DumpJob, run_dump

    docs = "\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(
        ["Rather than guess, measure it end to end."])) + "\n"
    outs = []
    for k in ("x", "y"):
        src = tmp_path / k / "in" / "docs.jsonl"
        src.parent.mkdir(parents=True)
        src.write_text(docs)
        s = run_dump(DumpJob(tiny_gguf, src, tmp_path / k / "dumps", policy="exact"))
        assert s.ok and s.count("written") == 1
        outs.append(tmp_path / k / "dumps")
    for name in ("d0",):
        fa = next(outs[0].glob(f"{name}*.safetensors"))
        fb = outs[1] / fa.name
        assert fa.read_bytes() == fb.read_bytes(), name
    from l47.dumps import read_dump

    src = read_dump(next(outs[0].glob("d0*.safetensors"))).meta.source
    assert src["input"] == "docs.jsonl" and src["where"] == "docs.jsonl:1" and str(tmp_path) not in json.dumps(src)
