"""Split-fp16 head GEMM and the fused tile-partials path (l47.tail.fused) against float64 references.

References and tolerances:
  - split fp16 operands: (hi + lo) · inv represents x to ≤ 2⁻²² |x| + 2⁻²⁵ · inv (lo normal / subnormal; module
    docstring), checked element by element on rows spanning 2⁻²⁰..2¹² in scale.
  - split-fp16 logits (off CUDA the fp16 products are formed exactly in f32): max |z − z_f64| ≤ 2× the plain f32
    GEMM's on the same rows — the per-run rule on CUDA — while a plain fp16 GEMM misses it by orders of magnitude.
  - tile partials folded in f64 (`combine`) against dense f64 over the full [T, V] logits of the same f32 values:
    lse ≤ 1e-5 nats, entropy ≤ 1e-4, KL ≤ 1e-6 + 1e-4·KL (tests/test_stream.py's tolerances, the audit's own),
    top-k ids equal, ties by the lower id across tile and chunk borders.
  - stream_head through the fused dispatcher (torch reference backend, row blocks, pairs) against the streaming
    accumulator on the same inputs: the same tolerances, top-k ids equal.
"""

from __future__ import annotations

import math

import pytest
import torch

from l47.model.weights import Numerics
from l47.tail import fused
from l47.tail.stream import check_precision, decide_precision, stream_head


def _dense_topk(z, k):
    """Top-k ids of z [R, V] in f64, descending, ties by the lower id."""
    o = torch.sort(z, dim=1, descending=True, stable=True).indices
    return o[:, :k]


def test_split_fp16_representation_and_logit_error():
    g = torch.Generator().manual_seed(21)
    scales = 2.0 ** torch.linspace(-20, 12, 40)
    x = torch.randn(40, 256, generator=g) * scales[:, None]
    x[3] = 0.0  # a zero row
    x[5, :128] *= 1e-9  # a row with a wide dynamic range inside it
    hi, lo, inv = fused.split_fp16(x)
    assert hi.dtype == lo.dtype == torch.float16 and torch.isfinite(hi.float()).all()
    rep = (hi.double() + lo.double()) * inv.double()[:, None]
    bound = 2.0 ** -22 * x.double().abs() + 2.0 ** -25 * inv.double()[:, None]
    assert ((rep - x.double()).abs() <= bound).all()
    assert ((hi.float().abs().amax(1) < 2 ** 15) & ((hi.float().abs().amax(1) >= 2 ** 14) | (x.abs().amax(1) == 0))).all()

    head = torch.randn(3000, 256, generator=g) * 0.06
    head[7] *= 1e-4  # rows of other scales in the head too
    xs = torch.randn(48, 256, generator=g) * 2
    ref = xs.double() @ head.double().T
    e32 = float((xs @ head.T - ref).abs().max())
    hp = fused.split_fp16(head)
    z = fused.split_fp16_logits(fused.split_fp16(xs), hp, 0, 3000)
    esp = float((z.double() - ref).abs().max())
    assert esp <= 2 * e32, (esp, e32)
    plain = (xs.half().float() @ head.half().float().T).double()
    assert float((plain - ref).abs().max()) > 50 * e32
    # chunks give the same logits as the whole
    assert torch.equal(fused.split_fp16_logits(fused.split_fp16(xs), hp, 1000, 2000), z[:, 1000:2000])
    # the per-run check measures it, and "auto"'s rule keeps split-fp16 at this error
    num = Numerics(precision="split-fp16")
    check_precision(xs, head, num, chunk=1000)
    assert num.used == "split-fp16" and num.split == "split-fp16"
    assert num.err_split == pytest.approx(esp, rel=1e-6) and num.err_f32 == pytest.approx(e32, rel=1e-6)
    assert decide_precision("auto", num.err_f32, num.err_split, 48, "split-fp16") == ("split-fp16", "")
    assert num.record()["max_logit_err_split"] == num.err_split


@pytest.mark.parametrize("integer", [False, True])
def test_tile_partials_combine_match_dense(integer):
    g = torch.Generator().manual_seed(22)
    P, V, n = 20, 2000, 24
    if integer:  # integer logits: exact ties inside tiles and across tile and chunk borders
        head = torch.randint(-3, 4, (V, n), generator=g).float()
        mb = torch.randint(-2, 3, (P, n), generator=g).float()
        mn = torch.randint(-2, 3, (P, n), generator=g).float()
    else:
        head = torch.randn(V, n, generator=g) * 0.7
        mb = torch.randn(P, n, generator=g)
        mn = mb + 0.05 * torch.randn(P, n, generator=g)
    both = torch.cat([mb, mn])
    z32 = both @ head.T
    tile, k, chunk = 64, 5, 640  # chunks are whole tiles; the last tile is partial (2000 = 31·64 + 16)
    got = [fused.torch_partials(z32[:, lo:lo + chunk], P, tile, k, lo) for lo in range(0, V, chunk)]
    parts = [torch.cat([p[i] for p in got], 1) for i in range(6)]
    lse, tv, ti, ent, kl = fused.combine(parts, k, P, True)
    z = z32.double()
    ls = torch.log_softmax(z, -1)
    p = ls.exp()
    assert torch.allclose(lse, torch.logsumexp(z, -1), atol=1e-5)
    assert torch.allclose(ent, -(p * ls).sum(-1), atol=1e-4)
    klr = (p[:P] * (ls[:P] - ls[P:])).sum(-1)
    assert klr.mean() > 1e-3
    assert torch.allclose(kl, klr, atol=1e-6, rtol=1e-4)
    assert torch.equal(ti, _dense_topk(z, k))
    assert torch.equal(tv, torch.gather(z32, 1, ti))


@pytest.mark.parametrize("precision", ["f32", "split-fp16"])
def test_stream_head_fused_dispatch_matches_accumulator(precision, monkeypatch):
    """The fused path of stream_head (row blocks of ≤ MAX_ROWS with pairs kept together, chunks of whole tiles,
    partials folded in f64), run with the torch reference backend, against the streaming accumulator."""
    g = torch.Generator().manual_seed(23)
    P, V, n = 13, 3000, 64
    head = torch.randn(V, n, generator=g) * 0.5
    mb = torch.randn(P, n, generator=g)
    mn = mb + 0.05 * torch.randn(P, n, generator=g)
    both = torch.cat([mb, mn])
    ref = stream_head(both, head, Numerics(precision=precision), chunk=700, topk=4, entropy=True, pairs=P)
    monkeypatch.setattr(fused, "MAX_ROWS", 8)  # 13 pairs -> blocks of 4 pairs
    monkeypatch.setattr(fused, "REDUCE_BN", 128)
    monkeypatch.setitem(fused.SPLIT_CFG, "BN", 256)
    fused.use_torch_backend(True)
    try:
        got = stream_head(both, head, Numerics(precision=precision), chunk=700, topk=4, entropy=True, pairs=P)
        single = stream_head(mb, head, Numerics(precision=precision), chunk=700, topk=1)
    finally:
        fused.use_torch_backend(False)
    assert torch.allclose(got.lse, ref.lse, atol=1e-5)
    assert torch.allclose(got.entropy, ref.entropy, atol=1e-4)
    assert ref.kl.mean() > 1e-3
    assert torch.allclose(got.kl, ref.kl, atol=1e-6, rtol=1e-4)
    assert torch.equal(got.top_i, ref.top_i) and torch.allclose(got.top_v, ref.top_v, atol=1e-5)
    assert got.mu is None and torch.allclose(single.lse, ref.lse[:P], atol=1e-5)
    assert torch.equal(single.top_i[:, 0], ref.top_i[:P, 0])
    z = both.double() @ head.double().T
    assert torch.allclose(got.lse, torch.logsumexp(z, -1), atol=1e-5)
    assert math.isfinite(float(got.kl.sum()))


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_top_of_tiles_equals_ranking_every_candidate(k):
    """fused.top_of_tiles ranks only the candidates of the k tiles with the largest maxima: the same values and ids
    as ranking every tile's candidates (the previous combine), and as a stable sort of the logits, on integer logits
    with exact ties inside and across tiles (values in a range of 3 or 7), NT from 1 to 40."""
    from l47.tail.topk import topk_lowest_id

    g = torch.Generator().manual_seed(k)
    for NT, span in ((1, 3), (k, 3), (k + 1, 7), (13, 3), (40, 7), (40, 3)):
        tile, R = 16, 37
        z = torch.randint(0, span, (R, NT * tile), generator=g).float()
        z[:, -3:] = -math.inf  # a partial last tile, as at the end of V
        m, _, _, _, top_v, top_i = fused.torch_partials(z, 0, tile, k)
        tv, ti = fused.top_of_tiles(m, top_v, top_i, k)
        cv, ci = top_v.reshape(R, -1), top_i.reshape(R, -1)
        rv, o = topk_lowest_id(cv, k)
        assert torch.equal(tv, rv) and torch.equal(ti, torch.gather(ci, 1, o).long()), (NT, span)
        kk = min(k, z.shape[1])
        ref = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :kk]
        assert torch.equal(ti[:, :kk], ref), (NT, span)


def test_split_cfg_lowers_bk_for_a_head_width_that_is_no_multiple():
    """The split kernel's BK 64 default serves widths that are multiples of 64 (n 2560); any multiple of
    SPLIT_BK_MIN takes BK 32 at 4 stages, and stream_head's fused path accepts it; other widths take the streaming
    accumulator."""
    from l47.tail.stream import _fused_ok

    assert fused.split_cfg(2560) == fused.SPLIT_CFG and fused.SPLIT_CFG["BK"] == 64
    c = fused.split_cfg(96)
    assert (c["BK"], c["num_stages"]) == (fused.SPLIT_BK_MIN, 4) and c["STACK"] == fused.SPLIT_CFG["STACK"]
    assert fused.split_cfg(96, dict(BK=32, num_stages=3))["num_stages"] == 3
    fused.use_torch_backend(True)
    try:
        x = torch.zeros(2, 96)
        assert _fused_ok(x, torch.zeros(10, 96), "split-fp16") and not _fused_ok(x[:, :40], torch.zeros(10, 40),
                                                                                 "split-fp16")
    finally:
        fused.use_torch_backend(False)
