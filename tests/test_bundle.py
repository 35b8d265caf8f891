"""Re-quantisation, bundle writing, overlays and transplant on a synthetic qwen4exp GGUF.

Byte identity is checked with our tolerant reader AND gguf-py's own GGUFReader where the file has no unknown
types (an independent parser); re-quantised values are checked against gguf.quants (bit-exact reference)."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch

from l47.errors import L47Error
from l47.model.gguf_io import open_gguf
from l47.model.names import PROVENANCE_PREFIX
from l47.solvers.bundle import requantize_target, transplant, write_bundle, write_overlay
from l47.testing.synth import SynthDims, write_synth_gguf
from l47.model.weights import load_tail_weights

DIMS = SynthDims(n=256, f=64, r=32, hc=4, V=512, n_layers=3)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    p = tmp_path_factory.mktemp("b") / "base.gguf"
    write_synth_gguf(p, DIMS, seed=0, unknown_type_tensor=False)
    return p


def _edit(w, rows=slice(0, 8)):
    dW = torch.zeros_like(w.W_sd)
    dW[rows] = torch.randn(dW[rows].shape, generator=torch.Generator().manual_seed(0)) * 0.05
    return dW


def test_requantize_matches_gguf_reference_and_keeps_unchanged_blocks(base):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    raw_new, W_q = requantize_target(g, w.target, w.W_sd + _edit(w))
    ref = gguf.quants.quantize((w.W_sd + _edit(w)).numpy(), gguf.GGMLQuantizationType.Q8_0)
    old = np.asarray(g.raw(w.target))
    changed = (raw_new.reshape(-1, 34) != old.reshape(-1, 34)).any(1).reshape(DIMS.n, -1)
    assert changed[:8].any() and not changed[8:].any()  # rows 8.. untouched: original bytes kept
    np.testing.assert_array_equal(raw_new[:8], ref[:8])  # edited rows: the ggml reference rule, bit for bit
    deq = gguf.quants.dequantize(raw_new, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(W_q.numpy(), deq)


def test_bundle_differs_only_in_target_and_provenance(base, tmp_path):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    raw_new, _ = requantize_target(g, w.target, w.W_sd + _edit(w))
    out = write_bundle(base, tmp_path / "b.gguf", w.target, raw_new, {"method": "test", "config": {"a": 1}})
    a, b = gguf.GGUFReader(base), gguf.GGUFReader(out)  # independent parser
    ta = {t.name: t for t in a.tensors}
    for t in b.tensors:
        same = bytes(np.asarray(t.data).tobytes()) == bytes(np.asarray(ta[t.name].data).tobytes())
        assert same == (t.name != w.target), t.name
    ka = {f.name for f in a.fields.values()}
    extra = {f.name for f in b.fields.values()} - ka
    assert extra == {PROVENANCE_PREFIX + "method", PROVENANCE_PREFIX + "config"}


def test_bundle_refuses_base_as_output(base):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    with pytest.raises(L47Error, match="base"):
        write_bundle(base, base, w.target, np.asarray(g.raw(w.target)), {})


def test_bundle_is_deterministic(base, tmp_path):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    shas = []
    for i in range(2):
        raw_new, _ = requantize_target(g, w.target, w.W_sd + _edit(w))
        p = write_bundle(base, tmp_path / f"b{i}.gguf", w.target, raw_new, {"method": "t", "seed": "0"})
        shas.append(hashlib.sha256(p.read_bytes()).hexdigest())
    assert shas[0] == shas[1]


def test_overlay_transplant_round_trip(base, tmp_path):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    raw_new, _ = requantize_target(g, w.target, w.W_sd + _edit(w))
    full = write_bundle(base, tmp_path / "full.gguf", w.target, raw_new, {"method": "t"})
    ov = write_overlay(base, tmp_path / "ov.gguf", w.target, raw_new, {"method": "t"})
    o = open_gguf(ov)
    assert w.target in o.tensors and len(o.tensors) < len(g.tensors)
    r = transplant(ov, base, tmp_path / "t.gguf")
    assert r["changed"] == [w.target]
    t, f = open_gguf(tmp_path / "t.gguf"), open_gguf(full)
    for n in g.tensors:
        assert np.array_equal(np.asarray(t.raw(n)), np.asarray(f.raw(n))), n


def test_transplant_refuses_mismatched_overlay(base, tmp_path):
    other = tmp_path / "other.gguf"
    write_synth_gguf(other, SynthDims(n=256, f=96, r=32, hc=4, V=512, n_layers=3), seed=1,
                     unknown_type_tensor=False)
    g = open_gguf(other)
    w = load_tail_weights(g, policy="exact")
    ov = write_overlay(other, tmp_path / "ov.gguf", w.target, np.asarray(g.raw(w.target)), {})
    with pytest.raises(L47Error, match="as in the base"):
        transplant(ov, base, tmp_path / "t.gguf")
    assert not (tmp_path / "t.gguf").exists()


def test_non_q8_target_refused(base, tmp_path):
    g = open_gguf(base)
    w = load_tail_weights(g, policy="exact")
    with pytest.raises(L47Error, match="Q8_0"):
        requantize_target(g, "output_hc_up.weight", w.oup)
