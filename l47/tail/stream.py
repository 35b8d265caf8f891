"""The one streaming accumulator over the vocabulary: every head pass of the toolkit goes through `stream_head`.

Notation used for tensor shapes:
    R   rows (positions; for a pair of heads base rows 0..P-1 and edited rows P..2P-1)    P   pairs
    n   hidden size    V   vocabulary    C   vocabulary chunk    k   top-k

The head `W_out` [V, n] is the runtime head with `output.scale` already folded in (l47.model.weights), so every
reduction below sees the logits the engine computes: z = W_out · mix.

Online reductions over chunks z_c = mix · W_out[c]ᵀ [R, C] (max-rescaled, so nothing overflows):
    m     = max_v z_v                                           [R]    running max (its value, exact in f32)
    s     = Σ_v exp(z_v − m)                                    [R]    lse = m + log s
    sz    = Σ_v exp(z_v − m) · z_v                              [R]    entropy H = lse − sz / s
    A     = Σ_v exp(zb_v − mb) · (zb_v − zn_v)                  [P]    KL(base ‖ edited) = A / sb − lseb + lsen
    μ     = Σ_v exp(z_v − m) · W_out[v] / s                     [R, n] E_p[W_out] (Fisher, ∂lse/∂mix)
    top-k = the k largest logits and their ids                  [R, k]
When the running max grows, earlier sums are rescaled by α = exp(m_old − m_new).

Tie-break (one rule everywhere, l47.tail.topk): among equal logits the LOWER token id ranks first (argmax, top-k,
Fisher top-K).

Precision:
    head GEMM   "f32": plain f32 matmul (TF32 is the caller's switch; the bench turns it off).
                "split-fp16" (CUDA): rows of both operands scaled by powers of two and split into fp16 hi + lo
                (l47.tail.fused); z = (hi·hi + hi·lo + lo·hi) / scales on fp16 tensor cores with f32 accumulation
                and output. The default on CUDA ("auto") after the per-run check.
                "split-bf16" (CUDA): each operand split into bf16 hi + lo (lo = bf16(x − hi)); z = hi·hi + hi·lo + lo·hi
                as bf16 tensor-core GEMMs with f32 accumulation and f32 output.
                Off CUDA the split products are formed in f32, where fp16 × fp16 and bf16 × bf16 are exact.
                `check_precision` measures the split against f64 beside the f32 path.
    reductions  f64 sums across chunks (within a chunk: f64 for s and A, f32 row-dots for sz). Without float64 on the
                device (MPS; `Numerics.no_f64`), the within-chunk partial sums are f32 on the device and every
                running accumulator (m, s, sz, A, μ) lives on the CPU in f64 — [R]-sized transfers per chunk.
                On CUDA with Triton (l47.tail.fused; not for μ): f32 sums within vocabulary tiles of 128–256
                logits, f64 across tiles; the f32 path's logits are read once by one kernel per chunk, the
                split-fp16 path reduces in the GEMM's epilogue and never writes logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from l47.errors import L47Error
from l47.model.weights import PRECISIONS, SPLITS, Numerics
from l47.tail import fused
from l47.tail.topk import topk_lowest_id

DEFAULT_CHUNK = 8192  # vocabulary rows per head pass; [R, C] f32 temporaries stay small
CHECK_ROWS = 64  # positions of the first pass recomputed in f64 by the per-run precision check
SPLIT_MAX_RATIO = 2.0  # a split precision is kept only if its max |logit error| ≤ 2× the f32 path's on the check rows
AUTO_SPLIT = "split-fp16"  # what "auto" tries on CUDA
SUM_BLOCK = 32767  # CPU: elements per f64 block of VocabAccumulator._sum: below torch's parallel grain (32,768), so
# each block runs on the calling thread — no OpenMP region to stall at when other processes share the cores
FUSED = True  # use l47.tail.fused where it can run (CUDA + Triton); the bench switches it off for comparisons


# ----------------------------------------------------------------------------------------------------------
# the head GEMM in the run's precision (l47.model.weights.Numerics holds the choice and the check's figures)


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32 -> (hi, lo) bf16 with hi + lo ≈ x to ~2⁻¹⁶ relative."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [R, n] · b [C, n]ᵀ of bf16 operands, f32 accumulation and output [R, C]."""
    if a.is_cuda:
        return torch.mm(a, b.T, out_dtype=torch.float32)
    return a.float() @ b.float().T  # bf16 × bf16 products are exact in f32


def _head_parts(head: torch.Tensor, num: Numerics, split: str = "split-bf16"):
    """The head's split parts for `split` (bf16: (hi, lo); fp16: (hi, lo, inv scales)), cached on `num`."""
    key = (head.data_ptr(), tuple(head.shape), head._version)
    got = num._parts.get(split)
    if got is None or got[0] != key:
        got = num._parts[split] = (key, fused.split_fp16(head) if split == "split-fp16" else split_bf16(head))
    return got[1]


def head_logits(x: torch.Tensor, head: torch.Tensor, lo: int, hi: int, num: Numerics | None = None,
                x_parts=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of vocabulary rows lo..hi-1: x [R, n] · head[lo:hi]ᵀ -> [R, C] f32, in the run's precision
    (written into `out` [R, C] when given)."""
    prec = "f32" if num is None else (num.used or num.precision)
    if prec == "split-fp16":
        return fused.split_fp16_logits(x_parts if x_parts is not None else fused.split_fp16(x),
                                       _head_parts(head, num, prec), lo, hi)
    if prec != "split-bf16":
        return torch.mm(x, head[lo:hi].T, out=out)  # [R, C]
    hh, hl = _head_parts(head, num)
    xh, xl = x_parts if x_parts is not None else split_bf16(x)
    z = _mm_f32(xh, hh[lo:hi])  # [R, C] hi·hi
    z += _mm_f32(xh, hl[lo:hi])  # hi·lo
    z += _mm_f32(xl, hh[lo:hi])  # lo·hi
    return z


def split_parts(x: torch.Tensor, precision: str | None):
    """The row operand's parts for head_logits in `precision` (None for f32)."""
    if precision == "split-fp16":
        return fused.split_fp16(x)
    if precision == "split-bf16":
        return split_bf16(x)
    return None


@torch.no_grad()
def check_precision(mix: torch.Tensor, head: torch.Tensor, num: Numerics, chunk: int = DEFAULT_CHUNK) -> None:
    """Resolve `num.precision` for this run. "auto": AUTO_SPLIT on CUDA if its max |logit error| against f64 on up
    to CHECK_ROWS rows of `mix` is ≤ SPLIT_MAX_RATIO × the f32 path's, else f32 (and `num.note` says so); f32
    elsewhere. An explicit split precision is measured and recorded too (never silently replaced). The split's
    logits are those of the kernel the run uses (the fused kernel where it runs)."""
    if num.used is not None:
        return
    want = num.precision
    if want not in PRECISIONS + ("auto",):
        raise L47Error("--precision", "precision", "f32, split-fp16, split-bf16 or auto", repr(want))
    if want == "f32" or (want == "auto" and not mix.is_cuda):
        num.used = "f32"
        return
    split = want if want in SPLITS else AUTO_SPLIT
    R = mix.shape[0]
    rows = torch.linspace(0, R - 1, min(R, CHECK_ROWS), device=mix.device).round().long().unique()
    x = mix[rows]  # [r, n]
    xp = split_parts(x, split)
    split_num = Numerics(precision=split, used=split, _parts=num._parts)
    zfull = None
    if split == "split-fp16" and _fused_ok(x, head, split):
        zfull = torch.empty(x.shape[0], head.shape[0], dtype=torch.float32, device=x.device)  # [r, V]: r ≤ 64
        fused.split_fp16_partials(xp, _head_parts(head, split_num, split), 0, 1, z_out=zfull)
    e32 = esp = 0.0
    for lo in range(0, head.shape[0], chunk):
        hi = min(head.shape[0], lo + chunk)
        ref = _f64_logits(x, head[lo:hi], num.no_f64)  # [r, C] f64 (CPU when the device has no f64)
        e32 = max(e32, float((head_logits(x, head, lo, hi).to(ref.device, ref.dtype) - ref).abs().max()))
        zs = zfull[:, lo:hi] if zfull is not None else head_logits(x, head, lo, hi, split_num, xp)
        esp = max(esp, float((zs.to(ref.device, ref.dtype) - ref).abs().max()))
    num._parts = split_num._parts
    num.err_f32, num.err_split, num.split = e32, esp, split
    num.used, num.note = decide_precision(want, e32, esp, len(rows), split)


def decide_precision(want: str, err_f32: float, err_split: float, rows: int,
                     split: str = AUTO_SPLIT) -> tuple[str, str]:
    """The per-run rule: "auto" keeps the split precision only if its max |logit error| ≤ SPLIT_MAX_RATIO × the
    f32 path's (both against f64 on the same `rows` positions); an explicit request is honoured (its error is
    recorded)."""
    if want == "auto" and err_split > SPLIT_MAX_RATIO * err_f32:
        return "f32", (f"{split} max |logit error| {err_split:.3g} > {SPLIT_MAX_RATIO:g}x the f32 path's "
                       f"{err_f32:.3g} on {rows} positions: fell back to f32")
    return split, ""


def _f64_logits(x: torch.Tensor, rows: torch.Tensor, no_f64: bool) -> torch.Tensor:
    if no_f64:
        x, rows = x.cpu(), rows.cpu()
    return x.double() @ rows.double().T


# ----------------------------------------------------------------------------------------------------------
# the accumulator


@dataclass(frozen=True)
class Streamed:
    """What one pass returns (f64 where a reduction; on the CPU when the device has no float64)."""

    lse: torch.Tensor  # [R] f64
    top_v: torch.Tensor  # [R, k] logits (f32), descending, ties by lower id
    top_i: torch.Tensor  # [R, k] int64
    entropy: torch.Tensor | None  # [R] f64
    kl: torch.Tensor | None  # [P] f64 KL(rows 0..P-1 ‖ rows P..2P-1), not clamped
    mu: torch.Tensor | None  # [R, n] f64 E_p[W_out]


class VocabAccumulator:
    """Online reductions (module docstring) over vocabulary chunks for R rows."""

    def __init__(self, R: int, device, *, topk: int = 0, entropy: bool = False, pairs: int = 0, mu_dim: int = 0,
                 no_f64: bool = False, dtype=torch.float32):
        self.rdev = torch.device("cpu") if no_f64 else torch.device(device)  # where the f64 sums live
        self.no_f64 = no_f64
        f64 = dict(dtype=torch.float64, device=self.rdev)
        self.m = torch.full((R,), -math.inf, **f64)  # running max
        self.s = torch.zeros(R, **f64)
        self.sz = torch.zeros(R, **f64) if entropy else None
        self.A = torch.zeros(pairs, **f64) if pairs else None
        self.mu = torch.zeros(R, mu_dim, **f64) if mu_dim else None
        self.k, self.P = topk, pairs
        self.top_v = torch.full((R, topk), -math.inf, dtype=dtype, device=device)  # logits' dtype
        self.top_i = torch.zeros((R, topk), dtype=torch.long, device=device)
        self._bufs: dict[str, torch.Tensor] = {}

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """Row sums of x [R, C] as f64 on the accumulators' device (f32 partials when the device has no f64).
        On the CPU the rows are cast into a reused f64 block of ~SUM_BLOCK elements and summed there: the same f64
        sums (bit for bit on one thread; on several, torch splits a long row by thread count and block shape, as it
        does between any two shapes) as x.sum(1, dtype=float64), whose per-element cast is not vectorised (~20x slower on one
        thread: 27 ms against 1.4 ms for [512, 8192])."""
        if self.no_f64:
            return x.sum(1).to(self.rdev, torch.float64)
        if x.is_cuda or x.device.type != "cpu":
            return x.sum(1, dtype=torch.float64)
        R, C = x.shape
        rows = max(1, SUM_BLOCK // max(C, 1))
        out = torch.empty(R, dtype=torch.float64)
        buf = self._buf("f64", torch.empty(0, C, dtype=torch.float64), min(R, rows))  # [≤ rows, C] f64
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            torch.sum(buf[: r1 - r0].copy_(x[r0:r1]), 1, out=out[r0:r1])
        return out

    def _f64(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.rdev, torch.float64)

    def _buf(self, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """A reused [rows, C] scratch tensor (fresh multi-MB allocations cost page faults on the CPU)."""
        n = rows * like.shape[1]
        b = self._bufs.get(name)
        if b is None or b.numel() < n or b.dtype != like.dtype or b.device != like.device:
            b = self._bufs[name] = torch.empty(n, dtype=like.dtype, device=like.device)
        return b[:n].view(rows, like.shape[1])

    def update(self, z: torch.Tensor, lo: int, head_rows: torch.Tensor | None = None) -> None:
        """Fold chunk logits z [R, C] (vocabulary ids lo..lo+C-1) in; head_rows [C, n] is needed for μ."""
        cm, ci = z.max(1)  # [R] chunk max and its FIRST index (lowest id on ties)
        m_new = torch.maximum(self.m, self._f64(cm))
        alpha = torch.exp(self.m - m_new)  # [R] rescale of earlier sums (exp(−inf) = 0 on the first chunk)
        e = torch.sub(z, m_new.to(z.device, z.dtype)[:, None], out=self._buf("e", z, z.shape[0])).exp_()  # [R, C]
        self.s = self.s * alpha + self._sum(e)
        if self.sz is not None:
            self.sz = self.sz * alpha + self._f64(_rowdot(e, z))  # Σ e·z without a [R, C] temporary
        if self.A is not None:
            P = self.P
            # the logit difference first (splitting it into Σe·zb − Σe·zn cancels catastrophically in f32)
            d = torch.sub(z[:P], z[P:], out=self._buf("d", z, P)).mul_(e[:P])  # [P, C] e_b·(z_b − z_n)
            self.A = self.A * alpha[:P] + self._sum(d)
        if self.mu is not None:
            self.mu = self.mu * alpha[:, None] + self._f64(e @ head_rows)  # [R, n]
        self.m = m_new
        if self.k:
            self._merge_top(z, lo, cm, ci)

    def _merge_top(self, z, lo, cm, ci):
        rows = None  # all rows
        if self.k == 1:
            v, i = cm[:, None], ci[:, None]
        else:
            # a row whose chunk max is not above its running k-th logit keeps its top-k (an equal logit of this
            # chunk has a higher id and ranks after): only the other rows go through top-k — same result
            need = cm > self.top_v[:, -1]  # [R]
            if not bool(need.all()):
                rows = need.nonzero().flatten()
                if rows.numel() == 0:
                    return
                z = z[rows]  # [r, C]
            v, i = topk_lowest_id(z, self.k)  # [r, k]
        tv, ti = (self.top_v, self.top_i) if rows is None else (self.top_v[rows], self.top_i[rows])
        allv = torch.cat([tv, v], 1)
        alli = torch.cat([ti, i + lo], 1)
        # earlier chunks (lower ids) first in the concatenation and a stable sort: ties keep the lowest id
        order = torch.sort(allv, dim=1, descending=True, stable=True).indices[:, : self.k]
        if rows is None:
            self.top_v = torch.gather(allv, 1, order)
            self.top_i = torch.gather(alli, 1, order)
        else:
            self.top_v[rows] = torch.gather(allv, 1, order)
            self.top_i[rows] = torch.gather(alli, 1, order)

    def result(self) -> Streamed:
        lse = self.m + torch.log(self.s)  # [R]
        P = self.P
        return Streamed(
            lse=lse, top_v=self.top_v, top_i=self.top_i,
            entropy=None if self.sz is None else lse - self.sz / self.s,
            kl=None if self.A is None else self.A / self.s[:P] - lse[:P] + lse[P:],
            mu=None if self.mu is None else self.mu / self.s[:, None],
        )


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row dot products [R] of two [R, C] tensors as a batched matmul (no [R, C] product temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def stream_head(mix: torch.Tensor, head: torch.Tensor, num: Numerics | None = None, *, chunk: int = DEFAULT_CHUNK,
                topk: int = 0, entropy: bool = False, pairs: int = 0, mu: bool = False,
                drop: torch.Tensor | None = None) -> Streamed:
    """One pass over the head for the rows of mix [R, n]: lse always; top-k, entropy, KL of the row pairs
    (rows i and pairs + i, `pairs` = R/2) and μ = E_p[W_out] on request. No grad. Never forms [R, V].
    drop [R, k] token ids: each row's distribution without them (their logits −inf in the chunk they fall in; the
    rest of a near-certain token's row is summed, not 1 − p): lse, top-k and μ only. Many parameters because each
    keyword asks one more reduction of the same pass (one accumulator, one pass over the head)."""
    num = num or Numerics()
    if drop is not None and (entropy or pairs):
        raise ValueError("stream_head: drop serves lse, top-k and μ (entropy and pair KL need every token)")
    with torch.no_grad():
        check_precision(mix, head, num, chunk)
        if not mu and drop is None and not num.no_f64 and _fused_ok(mix, head, num.used):
            return _stream_fused(mix, head, num, chunk, topk, entropy, pairs)
        x_parts = split_parts(mix, num.used)
        acc = VocabAccumulator(mix.shape[0], mix.device, topk=topk, entropy=entropy, pairs=pairs,
                               mu_dim=head.shape[1] if mu else 0, no_f64=num.no_f64, dtype=mix.dtype)
        V = head.shape[0]
        zbuf = torch.empty(mix.shape[0] * min(chunk, V), dtype=mix.dtype, device=mix.device)
        for lo in range(0, V, chunk):
            hi = min(V, lo + chunk)
            out = zbuf[: mix.shape[0] * (hi - lo)].view(mix.shape[0], hi - lo)  # reused [R, C]
            z = head_logits(mix, head, lo, hi, num, x_parts, out)
            if drop is not None:
                r, k = torch.nonzero((drop >= lo) & (drop < hi), as_tuple=True)
                z[r, drop[r, k] - lo] = -math.inf
            acc.update(z, lo, head[lo:hi] if mu else None)
        return acc.result()


def _fused_ok(mix: torch.Tensor, head: torch.Tensor, precision: str | None) -> bool:
    if not (FUSED and mix.dtype == torch.float32 and fused.available(mix)):
        return False
    return precision != "split-fp16" or head.shape[1] % fused.SPLIT_BK_MIN == 0


def _stream_fused(mix, head, num, chunk, topk, entropy, pairs) -> Streamed:
    """stream_head on CUDA through l47.tail.fused (no μ): rows in blocks of ≤ fused.MAX_ROWS (pairs kept
    together), tile partials folded in f64."""
    R = mix.shape[0]
    if R > fused.MAX_ROWS:
        step = fused.MAX_ROWS // 2 if pairs else fused.MAX_ROWS
        n_rows = pairs if pairs else R
        parts = []
        for i in range(0, n_rows, step):
            j = min(n_rows, i + step)
            sub = torch.cat([mix[i:j], mix[pairs + i:pairs + j]]) if pairs else mix[i:j]
            parts.append(_stream_fused(sub, head, num, chunk, topk, entropy, (j - i) if pairs else 0))
        return _cat_streamed(parts, pairs)
    if num.used == "split-fp16":
        p = fused.split_fp16_partials(fused.split_fp16(mix), _head_parts(head, num, "split-fp16"), pairs, topk)
        lse, tv, ti, ent, kl = fused.combine(p, topk, pairs, entropy)
    else:
        V = head.shape[0]
        chunk = -(-chunk // fused.REDUCE_BN) * fused.REDUCE_BN  # a whole number of tiles
        acc = fused.ReducePartials(R, pairs, V, topk, mix.device)
        x_parts = split_parts(mix, num.used)
        zbuf = torch.empty(R * min(chunk, V), dtype=mix.dtype, device=mix.device)
        for lo in range(0, V, chunk):
            hi = min(V, lo + chunk)
            acc.add(head_logits(mix, head, lo, hi, num, x_parts, zbuf[: R * (hi - lo)].view(R, hi - lo)), lo)
        lse, tv, ti, ent, kl = acc.result(entropy)
    if not topk:
        tv = torch.empty(R, 0, dtype=mix.dtype, device=mix.device)
        ti = torch.empty(R, 0, dtype=torch.long, device=mix.device)
    return Streamed(lse=lse, top_v=tv, top_i=ti, entropy=ent, kl=kl, mu=None)


def _cat_streamed(parts: list[Streamed], pairs: int) -> Streamed:
    """Row blocks of one pass back in row order (pairs: every block is [base block; edited block])."""
    def cat(name):
        xs = [getattr(p, name) for p in parts]
        if xs[0] is None:
            return None
        if not pairs or name == "kl":
            return torch.cat(xs)
        h = [x.shape[0] // 2 for x in xs]
        return torch.cat([x[:k] for x, k in zip(xs, h)] + [x[k:] for x, k in zip(xs, h)])
    return Streamed(lse=cat("lse"), top_v=cat("top_v"), top_i=cat("top_i"), entropy=cat("entropy"), kl=cat("kl"),
                    mu=None)


# ----------------------------------------------------------------------------------------------------------
# differentiable log-sum-exp and KL for the solvers (recomputing backward passes through the same accumulator)


class _StreamedLSE(torch.autograd.Function):
    """lse(mix·W_outᵀ) [R] over each row's vocabulary without its `drop` ids (None: every token), in mix's dtype
    (f64 with `drop`); backward ∂lse/∂mix = μ = E_p[W_out] over the same tokens (one more streamed pass)."""

    @staticmethod
    def forward(ctx, mix, head, num, chunk, drop):
        ctx.save_for_backward(mix, head)
        ctx.num, ctx.chunk, ctx.drop = num, chunk, drop
        f64 = drop is not None and not (num is not None and num.no_f64)  # no float64 on an MPS device
        return stream_head(mix.detach(), head, num, chunk=chunk, drop=drop).lse.to(
            mix.device, torch.float64 if f64 else mix.dtype)

    @staticmethod
    def backward(ctx, g):
        mix, head = ctx.saved_tensors
        mu = stream_head(mix.detach(), head, ctx.num, chunk=ctx.chunk, mu=True, drop=ctx.drop).mu
        return mu.to(mix.device, mix.dtype) * g.to(mix.dtype)[:, None], None, None, None, None


class _StreamedKL(torch.autograd.Function):
    """KL(p_base ‖ p_new) [P] with p = softmax(mix·W_outᵀ); gradient w.r.t. mix_new only:
    ∂KL/∂z_new = p_new − p_base -> ∂KL/∂mix_new = μ_new − μ_base (one more streamed pass over both)."""

    @staticmethod
    def forward(ctx, mix_new, mix_base, head, num, chunk):
        both = torch.cat([mix_base, mix_new.detach()], 0)  # [2P, n]
        ctx.save_for_backward(both, head)
        ctx.num, ctx.chunk = num, chunk
        return stream_head(both, head, num, chunk=chunk, pairs=mix_base.shape[0]).kl.to(mix_new.device,
                                                                                         mix_new.dtype)

    @staticmethod
    def backward(ctx, g):
        both, head = ctx.saved_tensors
        P = both.shape[0] // 2
        mu = stream_head(both, head, ctx.num, chunk=ctx.chunk, mu=True).mu  # [2P, n] f64
        return ((mu[P:] - mu[:P]).to(both.device, both.dtype)) * g[:, None], None, None, None, None


def streamed_lse(mix: torch.Tensor, head: torch.Tensor, num: Numerics | None = None,
                 chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log-sum-exp over the full vocabulary [R] (mix's dtype out, f64 inside)."""
    return _StreamedLSE.apply(mix, head, num, chunk, None)


def streamed_lse_without(mix: torch.Tensor, head: torch.Tensor, drop: torch.Tensor, num: Numerics | None = None,
                         chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log Σ_{v ∉ drop_r} exp z_rv per row [R] (f64 out; mix's dtype where the device has no
    float64): the rest of each row's vocabulary beside the ids drop [R, k]."""
    return _StreamedLSE.apply(mix, head, num, chunk, drop)


def streamed_kl(mix_new: torch.Tensor, mix_base: torch.Tensor, head: torch.Tensor, num: Numerics | None = None,
                chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable KL(base ‖ new) per position [P] over the full vocabulary (gradient to mix_new only)."""
    return _StreamedKL.apply(mix_new, mix_base.detach(), head, num, chunk)
