"""`l47 score` and the scoring ledger on a synthetic model: CE / KLD figures against a dense float64
re-computation, TSV rows, ledger appends (explicit and via $L47_LEDGER), corrupt ledger refused."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from l47.app.cli import app
from l47.dumps import SCHEMA_VERSION, DumpMeta, write_dump
from l47.errors import L47Error
from l47.model.gguf_io import open_gguf
from l47.data.ledger import append_ledger, read_ledger
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
    entries = read_ledger(ledger)
    assert len(entries) == 2 and all(e.bundle_sha256 == bsha and e.command == "score" for e in entries)


def test_ledger_from_environment(world, tmp_path, monkeypatch):
    monkeypatch.setenv("L47_LEDGER", str(tmp_path / "env.jsonl"))
    run_score(ScoreArgs(world["base"], tuple(world["dumps"][:1])))
    assert len(read_ledger(tmp_path / "env.jsonl")) == 1


def test_corrupt_ledger_refused_and_untouched(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text('{"doc_sha256": "a", "bundle_sha256": "b", "command": "x", "time": 1}\nnot json\n')
    before = p.read_bytes()
    with pytest.raises(L47Error, match="line 2"):
        append_ledger(p, [("c", "d")], "score")
    assert p.read_bytes() == before


def test_cli_bad_input_one_line_no_traceback(world, tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"nope" * 10)
    r = CliRunner().invoke(app, ["score", "--model", str(bad), str(world["dumps"][0])])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["inspect", str(world["base"])])
    assert r.exit_code == 0 and "ffn_down_shexp" in r.output and "unknown(200)" in r.output
