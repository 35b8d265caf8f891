"""l47.testing.synth: the synthetic GGUF has the layout, types, metadata and scales it promises.

Independent references: gguf.GGUFReader for the file structure, gguf.quants for every dequantization (it
dequantizes Q6_K too), and a float64 numpy re-derivation of DESIGN §1's tail forward for the logit scale.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from l47.model import names
from l47.errors import L47Error
from l47.model.gguf_io import open_gguf
from l47.testing.synth import REAL_DIMS, UNKNOWN_TYPE_ID, SynthDims, synth_dump_arrays, write_synth_gguf

HEADS = ["Q8_0", "Q6_K"]
D = SynthDims()
L = D.n_layers - 1


def _w(g, name) -> np.ndarray:
    """f64 weights via gguf.quants (the independent dequantizer), LOGICAL shape."""
    ti = g.info(name)
    return gguf.quants.dequantize(np.asarray(g.raw(name)), Q(ti.ggml_type)).astype(np.float64).reshape(ti.shape)


def _tail_logits_f64(g, d: SynthDims, a: dict) -> np.ndarray:
    """DESIGN §1 in float64, straight from the equations (no l47 code)."""
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    W_sd = _w(g, names.target_tensor(d.n_layers - 1))  # [n, f]
    onorm = _w(g, names.OUTPUT_HC_NORM.gguf).reshape(d.hc, d.n)  # [hc, n]
    odown = _w(g, names.OUTPUT_HC_DOWN.gguf)[:d.r]  # [r, hc·n]
    oup = _w(g, names.OUTPUT_HC_UP.gguf)  # [hc·n, r]
    head = _w(g, names.OUTPUT.gguf)  # [V, n]
    ys = a["hh"].astype(np.float64) @ W_sd.T  # [T, n]
    bo = a["yr"] + sig(a["sgv"].astype(np.float64))[:, None] * ys  # [T, n]
    Rp = a["R"] + bo[:, None, :] * 2 * sig(a["inj"].astype(np.float64) / 4)[:, :, None]  # [T, hc, n]
    xn = Rp * onorm / np.sqrt((Rp**2).mean(-1, keepdims=True) + 1e-6)  # [T, hc, n]
    pre = xn.reshape(len(xn), -1) @ odown.T / 4  # [T, r]
    lo = pre * sig(pre)  # [T, r]
    mix = (xn * sig((lo @ oup.T).reshape(-1, d.hc, d.n))).mean(1)  # [T, n]
    return mix @ head.T  # [T, V]


@pytest.mark.parametrize("head_type", HEADS)
def test_layout_types_metadata(tmp_path, head_type):
    p = write_synth_gguf(tmp_path / "s.gguf", D, seed=0, head_type=head_type)
    g = open_gguf(p)
    assert g.arch() == names.ARCH
    expect_kv = {names.K_BLOCK_COUNT: 3, names.K_EMBED: 256, names.K_SHEXP_FF: 64, names.K_HC_COUNT: 4,
                 names.K_HC_LOWRANK: 32, names.K_VOCAB: 1024}
    for k, v in expect_kv.items():
        assert g.get(names.key(k)) == v and g.kv_types[names.key(k)] == gguf.GGUFValueType.UINT32
    assert g.get(names.key(names.K_RMS_EPS)) == pytest.approx(1e-6, rel=1e-7)
    hcn = D.hc * D.n
    expect = {  # name → (type, logical shape): the seed file's types
        names.target_tensor(L): ("Q8_0", (D.n, D.f)),
        names.gguf_name(names.FFN_GATE_SHEXP, L): ("Q8_0", (D.f, D.n)),
        names.gguf_name(names.FFN_UP_SHEXP, L): ("Q8_0", (D.f, D.n)),
        names.gguf_name(names.FFN_HC_NORM, L): ("F32", (hcn,)),
        names.gguf_name(names.FFN_HC_DOWN, L): ("BF16", (D.r, hcn)),
        names.gguf_name(names.FFN_HC_UP, L): ("BF16", (hcn, D.r)),
        names.gguf_name(names.FFN_HC_INJECT, L): ("BF16", (D.hc, hcn)),
        names.OUTPUT.gguf: (head_type, (D.V, D.n)),
        names.OUTPUT_HC_DOWN.gguf: ("BF16", (D.r, hcn)),
        names.OUTPUT_HC_UP.gguf: ("BF16", (hcn, D.r)),
        names.OUTPUT_HC_NORM.gguf: ("F32", (hcn,)),
    }
    for name, (tname, shape) in expect.items():
        ti = g.info(name)
        assert (ti.type_name, ti.shape) == (tname, shape), name
    unk = g.info(names.gguf_name(names.FFN_DOWN_EXPS, 0))
    assert unk.ggml_type == UNKNOWN_TYPE_ID and unk.nbytes is None
    with pytest.raises(L47Error, match="unknown"):
        g.raw(unk.name)
    assert {names.layer_of(n) for n in g.tensors} == {None, *range(D.n_layers)}  # every layer has a tensor


def test_weight_scales_and_logits_are_o1_to_10(tmp_path):
    head = "Q6_K"  # the seed layout's head type (l47.model.quants writes it)
    g = open_gguf(write_synth_gguf(tmp_path / "s.gguf", D, seed=3, head_type=head))
    # std of N samples has relative standard error 1/sqrt(2N) < 1 % here; 5 % leaves room for quantization
    W_sd = _w(g, names.target_tensor(L))
    assert W_sd.std() == pytest.approx(1 / math.sqrt(D.f), rel=0.05) and abs(W_sd.mean()) < 0.01
    assert _w(g, names.OUTPUT_HC_DOWN.gguf).std() == pytest.approx(1 / math.sqrt(D.hc * D.n), rel=0.05)
    assert _w(g, names.OUTPUT_HC_UP.gguf).std() == pytest.approx(1 / math.sqrt(D.r), rel=0.05)
    onorm = _w(g, names.OUTPUT_HC_NORM.gguf)
    assert onorm.mean() == pytest.approx(1, abs=0.02) and onorm.std() == pytest.approx(0.1, rel=0.1)

    a = synth_dump_arrays(D, 96, seed=3)
    logits = _tail_logits_f64(g, D, a)  # [T, V]
    assert np.isfinite(logits).all()
    assert 1 < logits.std() < 10  # O(1–10)
    assert np.abs(logits).max() < 50
    lp = logits - logits.max(1, keepdims=True)
    p = np.exp(lp) / np.exp(lp).sum(1, keepdims=True)
    ent = -(p * np.log(p)).sum(1)  # nats
    assert 0.5 < ent.mean() < 0.8 * math.log(D.V)  # neither one-hot nor uniform
    # ΔW reaches the logits: a 10 % change of W_sd moves them visibly (the whole point of the fixture)
    a_scaled = {**a, "hh": a["hh"] * 1.1}  # same as W_sd·1.1
    dlog = np.abs(_tail_logits_f64(g, D, a_scaled) - logits).mean()
    assert 0.01 < dlog < 1  # measured ~0.06 at seed 3: visible, not dominant


def test_deterministic_and_seeded(tmp_path):
    p1 = write_synth_gguf(tmp_path / "a.gguf", D, seed=5, head_type="Q8_0")
    p2 = write_synth_gguf(tmp_path / "b.gguf", D, seed=5, head_type="Q8_0")
    p3 = write_synth_gguf(tmp_path / "c.gguf", D, seed=6, head_type="Q8_0")
    assert p1.read_bytes() == p2.read_bytes() and p1.read_bytes() != p3.read_bytes()
    a, b, c = synth_dump_arrays(D, 8, 5), synth_dump_arrays(D, 8, 5), synth_dump_arrays(D, 8, 6)
    assert all(np.array_equal(a[k], b[k]) for k in a) and not np.array_equal(a["R"], c["R"])


def test_no_unknown_tensor_readable_by_gguf_reader_extra_rows_and_fallback(tmp_path):
    d = SynthDims(n=96, f=32, r=8, hc=2, V=50, n_layers=2, extra_down_rows=4)
    with pytest.warns(UserWarning, match="Q8_0 instead of Q6_K"):
        p = write_synth_gguf(tmp_path / "s.gguf", d, seed=1, unknown_type_tensor=False)
    g, r = open_gguf(p), gguf.GGUFReader(p)
    assert g.info(names.OUTPUT.gguf).type_name == "Q8_0"
    assert g.info(names.OUTPUT_HC_DOWN.gguf).shape == (8 + 4, 2 * 96)
    assert names.gguf_name(names.FFN_DOWN_EXPS, 0) not in g.tensors
    for t in r.tensors:  # the independent reader sees the same tensors and bytes
        assert t.data.tobytes() == np.asarray(g.raw(t.name)).tobytes()
        assert tuple(reversed(t.shape.tolist())) == g.info(t.name).shape
    with pytest.raises(L47Error, match="f"):
        write_synth_gguf(tmp_path / "bad.gguf", SynthDims(f=40))
    with pytest.raises(L47Error, match="head_type"):
        write_synth_gguf(tmp_path / "bad.gguf", D, head_type="Q9_9")


def test_dump_arrays_schema_and_scales():
    T = 64
    a = synth_dump_arrays(D, T, seed=0)
    spec = {"tokens": ((T + 1,), np.int32), "R": ((T, D.hc, D.n), np.float32), "inj": ((T, D.hc), np.float32),
            "hh": ((T, D.f), np.float32), "sgv": ((T,), np.float32), "yr": ((T, D.n), np.float32),
            "role": ((T,), np.uint8)}
    assert set(a) == set(spec)
    for k, (shape, dt) in spec.items():
        assert a[k].shape == shape and a[k].dtype == dt, k
        assert np.isfinite(a[k]).all(), k
    assert 0 <= a["tokens"].min() and a["tokens"].max() < D.V
    assert set(np.unique(a["role"])) <= set(range(len(names.ROLES))) and len(np.unique(a["role"])) > 1
    rms = np.sqrt((a["R"] ** 2).mean())
    assert 1 <= rms <= 3
    assert np.abs(a["inj"]).mean() > 4  # gates 2σ(inj/4) mostly saturated
    assert np.corrcoef(a["R"][:, 0].ravel(), a["R"][:, 1].ravel())[0, 1] > 0.3  # streams share a component


def test_real_dims_constant():
    assert (REAL_DIMS.n, REAL_DIMS.f, REAL_DIMS.r, REAL_DIMS.hc, REAL_DIMS.V, REAL_DIMS.n_layers) == \
        (2560, 640, 320, 4, 248_320, 48)
