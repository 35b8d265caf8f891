"""`l47 score` and the scoring ledger on a synthetic model: CE / KLD figures against a dense float64
re-computation, TSV rows; the ledger: one per base model under $L47_HOME, keyed by content (a re-saved copy of a
document is the same document), appended before scoring, a corrupt line / another model's ledger refused with
nothing appended (exit 2 from the CLI)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from l47.app.cli import app
from l47.dumps import SCHEMA_VERSION, DumpMeta, write_dump
from l47.errors import L47Error
from l47.model.gguf_io import open_gguf
from l47.data.ledger import Ledger, default_ledger_path
from l47.model.names import ROLES
from l47.app.score import ScoreArgs, run_score
from l47.solvers.bundle import requantize_target, write_bundle
from l47.testing.synth import SynthDims, synth_dump_arrays, write_synth_gguf
from l47.model.weights import load_tail_weights

DIMS = SynthDims(n=256, f=64, r=32, hc=4, V=512, n_layers=3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("w")
    base = write_synth_gguf(d / "base.gguf", DIMS, seed=0, unknown_type_tensor=True)
    g = open_gguf(base)
    w = load_tail_weights(g, policy="strata")
    dW = torch.randn(w.W_sd.shape, generator=torch.Generator().manual_seed(1)) * 0.05
    raw, _ = requantize_target(g, w.target, w.W_sd + dW)
    bundle = write_bundle(base, d / "bundle.gguf", w.target, raw, {"method": "test"})
    dumps = []
    for i in range(2):
        a = synth_dump_arrays(DIMS, 24, seed=i)
        a["tokens"] = (a["tokens"] % DIMS.V).astype(np.int32)
        meta = DumpMeta(schema_version=SCHEMA_VERSION, doc_id=f"doc{i}", layer=DIMS.n_layers - 1, n=DIMS.n,
                        f=DIMS.f, hc=DIMS.hc, r=DIMS.r, V=DIMS.V, model=g.sha256(),
                        engine={"name": "synthetic", "version": "0", "settings": {}}, inj_convention="raw",
                        hh_precision="f32", provenance={r: "written" for r in ROLES}, text="")
        dumps.append(write_dump(d / f"doc{i}.safetensors", a, meta))
    return dict(dir=d, base=base, bundle=bundle, dumps=dumps)


def _dense(w, d, W):
    from l47.tail.forward import full_logits, mix_of_dump

    z = full_logits(mix_of_dump(d, w, W_sd=W), w).double()
    return torch.log_softmax(z, -1)


def test_score_figures_match_dense_reference_and_ledger(world, tmp_path):
    from l47.dumps import read_dump
    from l47.model.weights import edited_weight

    ledger = tmp_path / "ledger.jsonl"
    tsv = tmp_path / "pos.tsv"
    res = run_score(ScoreArgs(world["base"], tuple(world["dumps"]), world["bundle"], tsv, ledger=ledger))
    w = load_tail_weights(world["base"], policy="strata")
    W_new, bsha = edited_weight(w, world["bundle"])
    d = read_dump(world["dumps"][0])
    lb, ln = _dense(w, d, None), _dense(w, d, W_new)
    t = torch.tensor(np.asarray(d.tokens[1:]), dtype=torch.long)
    ar = torch.arange(len(t))
    assert abs(res.docs[0].ce + lb[ar, t].mean().item()) < 1e-5
    kl = (lb.exp() * (lb - ln)).sum(-1).mean().item()
    assert kl > 1e-6 and abs(res.docs[0].kld - kl) < 1e-6 + 1e-4 * kl
    rows = list(csv.reader(open(tsv), delimiter="\t"))
    assert rows[0][-1] == "kld" and len(rows) == 1 + 2 * 24
    entries = Ledger.open(ledger, w.model_sha256).entries()
    assert len(entries) == 2 and all(e.bundle_sha256 == bsha and e.command == "score" for e in entries)
    assert [e.doc_sha256 for e in entries] == [read_dump(p).sha256 for p in world["dumps"]]


def _token_sha(path) -> str:
    """Independent of l47: sha256 of the dump's token ids as little-endian int32, read with safetensors."""
    import hashlib

    from safetensors.numpy import load_file

    return hashlib.sha256(load_file(str(path))["tokens"].astype("<i4").tobytes()).hexdigest()


def test_default_ledger_is_per_base_model_and_keyed_by_content(world, tmp_path):
    """No --ledger: $L47_HOME/ledgers/<base sha>.jsonl, whatever the output folder; the entry is the sha256 of
    the token ids, so a re-saved copy (new file name and doc_id, other file bytes) is the same document."""
    import shutil
    from dataclasses import replace as dc_replace

    from l47.dumps import doc_hash, read_dump

    base_sha = open_gguf(world["base"]).sha256()
    run_score(ScoreArgs(world["base"], tuple(world["dumps"][:1]), tsv=tmp_path / "a" / "x.tsv"))
    p = default_ledger_path(base_sha)
    assert p.parent.parent == Path(os.environ["L47_HOME"]) and p.name == f"{base_sha}.jsonl"
    d = read_dump(world["dumps"][0])
    copy = write_dump(tmp_path / "renamed.safetensors", {k: np.array(v) for k, v in d.arrays().items()},
                      dc_replace(d.meta, doc_id="a-new-name"))
    assert doc_hash(copy) != doc_hash(world["dumps"][0])  # other file bytes ...
    run_score(ScoreArgs(world["base"], (copy,), tsv=tmp_path / "b" / "y.tsv"))
    led = Ledger.open(None, base_sha)
    assert led.path == p
    shas = [e.doc_sha256 for e in led.entries()]
    assert shas == [_token_sha(world["dumps"][0])] * 2  # ... one document, found by content
    head = json.loads(p.read_text().splitlines()[0])
    assert head == {"schema": "l47.ledger/1", "base_sha256": base_sha}
    shutil.rmtree(tmp_path / "a")


def test_ledger_appended_before_scoring(world, tmp_path, monkeypatch):
    """A run killed while scoring has already recorded the document."""
    import l47.app.score as score_mod

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(score_mod, "score_dump", boom)
    ledger = tmp_path / "l.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_score(ScoreArgs(world["base"], tuple(world["dumps"][:1]), ledger=ledger))
    base_sha = open_gguf(world["base"]).sha256()
    assert [e.doc_sha256 for e in Ledger.open(ledger, base_sha).entries()] == [_token_sha(world["dumps"][0])]


def test_corrupt_ledger_refused_and_untouched(world, tmp_path):
    base_sha = open_gguf(world["base"]).sha256()
    p = tmp_path / "l.jsonl"
    head = json.dumps({"schema": "l47.ledger/1", "base_sha256": base_sha})
    entry = json.dumps({"doc_sha256": "a" * 64, "bundle_sha256": "b" * 64, "command": "x", "time": 1,
                        "event": "scored"})
    p.write_text(f"{head}\n{entry}\nnot json\n")
    before = p.read_bytes()
    with pytest.raises(L47Error, match="line 3"):
        Ledger.open(p, base_sha)
    r = CliRunner().invoke(app, ["score", "--model", str(world["base"]), "--ledger", str(p), str(world["dumps"][0])])
    assert r.exit_code == 2 and "line 3" in r.output and str(p) in r.output.replace("\n", "")
    assert p.read_bytes() == before


def test_ledger_of_another_base_model_or_not_json_lines(world, tmp_path):
    base_sha = open_gguf(world["base"]).sha256()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"schema": "l47.ledger/1", "base_sha256": "0" * 64}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"doc_sha256": "a", "bundle_sha256": "b", "command": "x", "time": 1}\n')
    for p, field in ((other, "base_sha256"), (plain, "line 1")):
        before = p.read_bytes()
        r = CliRunner().invoke(app, ["score", "--model", str(world["base"]), "--ledger", str(p),
                                     str(world["dumps"][0])])
        assert r.exit_code == 2 and field in r.output and "Traceback" not in r.output, r.output
        assert p.read_bytes() == before  # nothing appended
    assert base_sha != "0" * 64


def test_cli_bad_input_one_line_no_traceback(world, tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"nope" * 10)
    r = CliRunner().invoke(app, ["score", "--model", str(bad), str(world["dumps"][0])])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["inspect", str(world["base"])])
    assert r.exit_code == 0 and "ffn_down_shexp" in r.output and "unknown(200)" in r.output
