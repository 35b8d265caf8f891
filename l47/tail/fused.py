"""Fused vocabulary reductions on CUDA (Triton): the [R, C] logits of a head pass are read once, or never stored.

Notation used for tensor shapes (as in l47.tail.stream):
    R   rows    P   pairs (base rows 0..P-1, edited rows P..2P-1)    n   hidden    V   vocabulary
    B   vocabulary tile of a kernel (BN columns)    NT  tiles over V    k   top-k

Tile partials. Each kernel program reduces one [rows, B] tile t of logits z to, per row,
    m_t   = max_{v∈t} z_v                                    [R, NT] f32
    s_t   = Σ_{v∈t} exp(z_v − m_t)                           [R, NT] f32 (≤ B terms, tree sum)
    sz_t  = Σ_{v∈t} exp(z_v − m_t) · z_v                     [R, NT] f32
    A_t   = Σ_{v∈t} exp(zb_v − mb_t) · (zb_v − zn_v)         [P, NT] f32 (pairs: base row i against edited row P+i)
    top   = the k largest z_v of the tile, descending, ties by the lower id     [R, NT, k] f32 + int32 ids
and `combine` folds the tiles in f64 exactly as the streaming accumulator folds its chunks (l47.tail.stream):
    m = max_t m_t,  s = Σ_t exp(m_t − m) s_t,  lse = m + log s,  H = lse − Σ_t exp(m_t − m) sz_t / s,
    KL = Σ_t exp(mb_t − mb) A_t / sb − lseb + lsen,  top-k over the tiles' candidates (tile order = id order, so a
    stable sort keeps the lower id first among equal logits).

Two producers of the same partials:
    reduce_partials   logits already computed (the f32 path: one cuBLAS GEMM per vocabulary chunk), read once
    split_fp16_partials  the head GEMM itself in split fp16 on tensor cores, the reductions in its epilogue; the
                      logits never reach memory (except the per-run check's rows, `z_out`)

Split fp16 (precision "split-fp16"). Each row of an operand is scaled by a power of two so that its largest |value|
lies in [2¹⁴, 2¹⁵) (fp16 max 65504), then split into fp16 hi + lo (lo = fp16(x·s − hi)): hi + lo represents x·s to
2⁻²² relative (lo normal) or 2⁻²⁵ absolute (lo subnormal, ≤ 2⁻³⁹ of the row's largest value). The product
z = (hi·hi + hi·lo + lo·hi) / (s_x · s_h) drops lo·lo (≤ 2⁻²² |x_i h_i|); fp16 × fp16 products are exact in f32 and
the tensor cores accumulate in f32; the scales are exact powers of two. `torch_partials` is the same arithmetic in
torch (any device), the reference the tests hold the kernels to.

Triton is imported lazily: without it (or off CUDA) the toolkit uses the streaming accumulator.
"""

from __future__ import annotations

import math

import torch

from l47.tail.topk import topk_lowest_id

FP16_TOP_EXP = 15  # row scale puts max |x·s| in [2^(FP16_TOP_EXP-1), 2^FP16_TOP_EXP)
MAX_ROWS = 8192  # rows per kernel launch (the partials of one launch: R · NT · (3 + 2k) · 4 bytes)


# ----------------------------------------------------------------------------------------------------------
# split fp16 operands


def split_fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, n] f32 -> (hi [R, n] f16, lo [R, n] f16, inv [R] f32) with (hi + lo) · inv ≈ x (module docstring)."""
    amax = x.abs().amax(1)  # [R]
    _, ex = torch.frexp(amax)  # amax ∈ [2^(ex−1), 2^ex) (ex = 0 for a zero row)
    shift = (FP16_TOP_EXP - ex).to(torch.int32)  # [R]
    one = torch.ones_like(amax)
    xs = x * torch.ldexp(one, shift)[:, None]  # [R, n] exact (power of two)
    hi = xs.to(torch.float16)
    lo = (xs - hi.float()).to(torch.float16)
    return hi, lo, torch.ldexp(one, -shift)


def split_fp16_logits(xp, hp, lo: int, hi: int) -> torch.Tensor:
    """z [R, C] f32 of vocabulary rows lo..hi-1 from split operands (xp, hp as split_fp16 returns): three GEMMs of
    fp16 operands with f32 accumulation and output (cuBLAS on CUDA; f32 GEMMs off CUDA, where the fp16 × fp16
    products are exact)."""
    xh, xl, xi = xp
    hh, hl, hinv = hp[0][lo:hi], hp[1][lo:hi], hp[2][lo:hi]
    if xh.is_cuda:
        def mm(a, b):
            return torch.mm(a, b.T, out_dtype=torch.float32)
    else:
        def mm(a, b):
            return a.float() @ b.float().T
    z = mm(xh, hh)  # [R, C] hi·hi
    z += mm(xh, hl)  # hi·lo
    z += mm(xl, hh)  # lo·hi
    return z.mul_(xi[:, None]).mul_(hinv[None, :])  # exact power-of-two rescale


# ----------------------------------------------------------------------------------------------------------
# tile partials: the reference (torch) producer and the combination


def torch_partials(z: torch.Tensor, pairs: int, tile: int, k: int, lo: int = 0):
    """Tile partials (module docstring) of logits z [R, C] (vocabulary ids lo..lo+C-1) in f32 with torch ops.
    Returns (m, s, sz, A, top_v, top_i) with NT = ceil(C / tile)."""
    R, C = z.shape
    NT = -(-C // tile)
    zp = torch.full((R, NT * tile), -math.inf, dtype=z.dtype, device=z.device)
    zp[:, :C] = z
    zt = zp.view(R, NT, tile)  # [R, NT, B]
    valid = torch.zeros(NT * tile, dtype=torch.bool, device=z.device)
    valid[:C] = True
    valid = valid.view(NT, tile)
    m = zt.amax(2)  # [R, NT]
    e = torch.exp(zt - m[..., None])  # [R, NT, B]
    s = e.sum(2)
    sz = torch.where(valid, e * zt, 0.0).sum(2)
    A = None
    if pairs:
        A = torch.where(valid, e[:pairs] * (zt[:pairs] - zt[pairs:]), 0.0).sum(2)  # [P, NT]
    top_v = top_i = None
    if k:
        # descending, ties by the lower id: stable sort of the tile in id order
        o = torch.sort(zt, dim=2, descending=True, stable=True).indices[..., :k]  # [R, NT, k]
        top_v = torch.gather(zt, 2, o)
        top_i = (o + torch.arange(NT, device=z.device)[None, :, None] * tile + lo).to(torch.int32)
    return m, s, sz, A, top_v, top_i


def combine(parts, k: int, pairs: int, entropy: bool):
    """Fold tile partials `parts` = (m, s, sz, A, top_v, top_i) as the producers return them (concatenated over
    tiles in id order, [R, NT]; A None or unused without pairs) into the Streamed fields (f64):
    (lse [R], top_v [R, k] f32, top_i [R, k] int64, entropy [R] | None, kl [P] | None)."""
    m, s, sz, A, top_v, top_i = parts
    mm = m.amax(1)  # [R] exact
    w = torch.exp(m.double() - mm.double()[:, None])  # [R, NT] f64 rescale of each tile
    sd = (w * s.double()).sum(1)  # [R]
    lse = mm.double() + torch.log(sd)
    ent = None
    if entropy:
        ent = lse - (w * sz.double()).sum(1) / sd
    kl = None
    if pairs:
        kl = (w[:pairs] * A.double()).sum(1) / sd[:pairs] - lse[:pairs] + lse[pairs:]
    tv = ti = None
    if k:
        tv, ti = top_of_tiles(m, top_v, top_i, k)
    return lse, tv, ti, ent, kl


def top_of_tiles(m: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, k: int):
    """The row's top-k (descending, ties by the lower id) from the tiles' maxima m [R, NT] and their top-k lists
    top_v / top_i [R, NT, k] (tiles in id order, each list descending with equal logits lowest id first):
    (values [R, k] f32, ids [R, k] int64).

    Only the k tiles with the largest maxima (ties: the lower tile) can hold the row's top k: those k tiles hold k
    values ≥ t (t = the k-th largest maximum); any element of another tile is < t, or = t and then in a tile
    after every chosen tile whose maximum is t, so k chosen values precede it. So the k × k candidates of those
    tiles, put back in id order, are ranked instead of all NT × k (at V 248,320: 25 per row instead of 9,700)."""
    R, NT = m.shape
    kk = top_v.shape[2]
    if NT > k:
        _, tiles = topk_lowest_id(m, k)  # [R, k]
        tiles = torch.sort(tiles, dim=1).values[..., None].expand(R, k, kk)  # id order
        top_v, top_i = torch.gather(top_v, 1, tiles), torch.gather(top_i, 1, tiles)  # [R, k, k]
    cv, ci = top_v.reshape(R, -1), top_i.reshape(R, -1)  # candidates in id order of their tiles
    # the k largest, ties by the lower candidate position (= the lower id)
    tv, o = topk_lowest_id(cv, k)
    return tv, torch.gather(ci, 1, o).long()


# ----------------------------------------------------------------------------------------------------------
# Triton kernels (lazy)

_K = {}


def available(x: torch.Tensor) -> bool:
    """True when the fused kernels can run on x's device (CUDA and Triton importable), or when the torch
    reference backend is selected (`use_torch_backend`: the same partials from torch ops, any device; tests)."""
    if _K.get("torch"):
        return True
    if not x.is_cuda:
        return False
    if "ok" not in _K:
        try:
            _build()
            _K["ok"] = True
        except ImportError:
            _K["ok"] = False
    return _K["ok"]


def use_torch_backend(on: bool = True) -> None:
    """Produce the tile partials with `torch_partials` instead of the Triton kernels (any device): the dispatcher
    (l47.tail.stream) can then be exercised on the CPU."""
    _K.clear()
    if on:
        _K["torch"] = True


def _build():
    from l47.tail import fused_kernels as fk  # imports triton (optional, CUDA only): when a kernel is built

    _K["reduce"], _K["split"], _K["cdiv"] = fk.reduce_kernel, fk.split_kernel, fk.cdiv
    _K["split_stacked"] = fk.split_kernel_stacked


# kernel shapes (set by the bench's sweep on one H200; any value is correct)
REDUCE_BM, REDUCE_BN = 16, 256
SPLIT_CFG = dict(BM=128, BN=128, BK=64, GROUP=4, num_warps=8, num_stages=3, PROMOTE=True, STACK=True)
# STACK: split_kernel_stacked (BM = base + edited rows of BM/2 pairs, one accumulator; BK 64 fits 3 stages). One
# H200, 2026-12-04 01:50 UTC (docs/BENCHMARKS.md): kernel alone 66,727 paired positions/s at GROUP 4 (GROUP 8 / 16
# within 0.6 %, 32 −3 %), split_kernel's old default 59,213 in the same sweep; max logit error 1.24e-5 (promotion
# every 64 terms) vs 1.02e-5, the f32 GEMM's 1.61e-5. A head whose width is no multiple of BK takes SPLIT_BK_MIN.
SPLIT_BK_MIN = 32


def _alloc(R, P, NT, k, dev):
    f = dict(dtype=torch.float32, device=dev)
    return (torch.empty(R, NT, **f), torch.empty(R, NT, **f), torch.empty(R, NT, **f),
            torch.empty(max(P, 1), NT, **f), torch.empty(R, NT, max(k, 1), **f),
            torch.empty(R, NT, max(k, 1), dtype=torch.int32, device=dev))


def _store(parts, got, t0: int) -> None:
    """Write torch_partials' tiles into the partial arrays at tile offset t0."""
    for dst, src in zip(parts, got):
        if src is not None:
            dst[: src.shape[0], t0: t0 + src.shape[1]] = src


class ReducePartials:
    """Tile partials of an f32 head pass computed chunk by chunk (`add` each chunk's logits, then `result`)."""

    def __init__(self, R: int, pairs: int, V: int, k: int, device):
        self.NT = -(-V // REDUCE_BN)
        self.R, self.P, self.k = R, pairs, k
        self.parts = _alloc(R, pairs, self.NT, k, device)

    def add(self, z: torch.Tensor, lo: int) -> None:
        """Fold logits z [R, C] of vocabulary ids lo..lo+C-1 (lo a multiple of the tile) in."""
        R, C = z.shape
        assert lo % REDUCE_BN == 0 and z.stride(1) == 1
        m, s, sz, A, tv, ti = self.parts
        if _K.get("torch"):
            t0 = lo // REDUCE_BN
            _store(self.parts, torch_partials(z, self.P, REDUCE_BN, self.k, lo), t0)
            return
        cd = _K["cdiv"]
        _K["reduce"][(cd(R, REDUCE_BM), cd(C, REDUCE_BN))](
            z, z.stride(0), R, self.P, C, self.NT, lo // REDUCE_BN, lo, m, s, sz, A, tv, ti,
            BM=REDUCE_BM, BN=REDUCE_BN, KTOP=self.k, PAIRED=self.P > 0, num_warps=4)

    def result(self, entropy: bool):
        m, s, sz, A, tv, ti = self.parts
        return combine((m, s, sz, A if self.P else None, tv, ti), self.k, self.P, entropy)


def split_cfg(n: int, cfg: dict | None = None) -> dict:
    """The split kernel's config for rows of width n: SPLIT_CFG (with `cfg` over it), its BK lowered to
    SPLIT_BK_MIN (4 stages) when n is no multiple of it. The caller checks n % SPLIT_BK_MIN == 0 (`_fused_ok`)."""
    c = dict(SPLIT_CFG, **(cfg or {}))
    if n % c["BK"]:
        c.update(BK=SPLIT_BK_MIN, num_stages=4)
    return c


def split_fp16_partials(xp, hp, pairs: int, k: int, z_out: torch.Tensor | None = None, cfg: dict | None = None):
    """Tile partials of the split-fp16 head pass over all of V for the rows of xp (split_fp16 of mix [R, n]);
    with `z_out` [R, V] f32 the logits are written too (the per-run check's rows; split_kernel with pairs writes
    the base rows only, the stacked kernel every row)."""
    c = split_cfg(xp[0].shape[1], cfg)
    xh, xl, xi = xp
    hh, hl, hinv = hp
    R, n = xh.shape
    V = hh.shape[0]
    NT = -(-V // c["BN"])
    rows = pairs if pairs else R
    parts = _alloc(R, pairs, NT, k, xh.device)
    m, s, sz, A, tv, ti = parts
    if _K.get("torch"):
        z = split_fp16_logits(xp, hp, 0, V)  # [R, V]: the reference backend is for small tests
        if z_out is not None:
            z_out.copy_(z)
        _store(parts, torch_partials(z, pairs, c["BN"], k), 0)
        return parts
    cd = _K["cdiv"]
    if c.get("STACK"):  # split_kernel_stacked: rows i and P + i share a program (pairs: base and edited)
        Ps = pairs if pairs else -(-R // 2)
        _K["split_stacked"][(cd(Ps, c["BM"] // 2) * NT,)](
            xh, xl, xi, hh, hl, hinv, R, Ps, V, n, NT, m, s, sz, A, tv, ti, z_out if z_out is not None else m,
            BM=c["BM"], BN=c["BN"], BK=c["BK"], GROUP=c["GROUP"], KTOP=k, PAIRED=pairs > 0,
            WRITE_Z=z_out is not None, PROMOTE=c["PROMOTE"], num_warps=c["num_warps"], num_stages=c["num_stages"])
        return parts
    grid = (cd(rows, c["BM"]) * NT,)
    _K["split"][grid](xh, xl, xi, hh, hl, hinv, rows, pairs, V, n, NT, m, s, sz, A, tv, ti,
                      z_out if z_out is not None else m,
                      BM=c["BM"], BN=c["BN"], BK=c["BK"], GROUP=c["GROUP"], KTOP=k, PAIRED=pairs > 0,
                      WRITE_Z=z_out is not None, PROMOTE=c["PROMOTE"], num_warps=c["num_warps"], num_stages=c["num_stages"])
    return parts
