"""The exact layer-L tail forward: dump states + runtime weights (+ ΔW) -> next-token statistics.

Notation used for tensor shapes:
    T   positions (row t predicts tokens[t+1])     n   hidden size      f   shared-expert width
    hc  hyper-connection streams                    r   HC low rank      V   vocabulary
    C   vocabulary chunk (the head is streamed; [T, V] is never materialised at real size)
    k   top-k

Equations (DESIGN §1, checked against transformers' Qwen4Exp):
    ys   = (W_sd + ΔW) · hh                                   [T, n]
    bo   = yr + σ(sgv) · ys                                   [T, n]
    R'_c = R_c + bo · 2σ(inj_c / hc)                          [T, hc, n]
    xn_c = R'_c ⊙ w_onorm_c · rsqrt(mean_d R'_c² + eps)      [T, hc, n]
    lo   = silu((W_odown · flat(xn)) / hc)                    [T, r]      flat: stream-major c·n + d
    mix  = (1/hc) Σ_c xn_c ⊙ σ(W_oup · lo)_c                  [T, n]
    logits = W_out · mix (· output.scale)                     [T, V]

Precision: every matmul and elementwise step in f32; every reduction over the vocabulary (log-sum-exp,
entropy, KL, expectations) accumulated in f64 across chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from l47.model.weights import TailWeights, as_f32

DEFAULT_CHUNK = 8192  # vocabulary rows per head pass; [T, C] f32 temporaries stay small


# ----------------------------------------------------------------------------------------------------------
# the forward up to the head


def tail_mix(R, inj, hh, sgv, yr, w: TailWeights, W_sd: torch.Tensor | None = None,
             dW: torch.Tensor | None = None) -> torch.Tensor:
    """Mixer output `mix` [T, n] (the head's input). `W_sd` replaces the model's matrix (e.g. a re-quantised
    edit); `dW` is added to it (differentiable). All f32."""
    W = w.W_sd if W_sd is None else W_sd  # [n, f]
    ys = hh @ W.T  # [T, n]
    if dW is not None:
        ys = ys + hh @ dW.T  # [T, n]
    return mix_from_ys(ys, R, inj, sgv, yr, w)


def mix_from_ys(ys, R, inj, sgv, yr, w: TailWeights) -> torch.Tensor:
    """The rest of the tail from the shared expert's output ys = W·hh [T, n] to `mix` [T, n] (the solvers make ys
    a leaf to get ∂/∂ys of logit functionals). All f32."""
    T = ys.shape[0]
    bo = yr + torch.sigmoid(sgv)[:, None] * ys  # [T, n]
    Rp = R + bo[:, None, :] * (2.0 * torch.sigmoid(inj / w.hc))[:, :, None]  # [T, hc, n]
    xn = Rp * torch.rsqrt(Rp.pow(2).mean(-1, keepdim=True) + w.eps) * w.onorm  # [T, hc, n]
    lo = F.silu((xn.reshape(T, w.hc * w.n) @ w.odown.T) / w.hc)  # [T, r]
    gate = torch.sigmoid(lo @ w.oup.T).reshape(T, w.hc, w.n)  # [T, hc, n]
    return (gate * xn).mean(1)  # [T, n]


def dump_tensors(dump, device) -> dict[str, torch.Tensor]:
    """The five state arrays of a dump as f32 tensors on `device`."""
    return {k: as_f32(getattr(dump, k), device) for k in ("R", "inj", "hh", "sgv", "yr")}


def mix_of_dump(dump, w: TailWeights, W_sd=None, dW=None, rows=None) -> torch.Tensor:
    """`tail_mix` of a dump (optionally only the positions `rows`)."""
    s = dump_tensors(dump, w.device)
    if rows is not None:
        idx = torch.as_tensor(rows, dtype=torch.long, device=w.device)
        s = {k: v[idx] for k, v in s.items()}
    return tail_mix(s["R"], s["inj"], s["hh"], s["sgv"], s["yr"], w, W_sd=W_sd, dW=dW)


def head_chunk(mix: torch.Tensor, w: TailWeights, lo: int, hi: int) -> torch.Tensor:
    """Logits for vocabulary rows lo..hi-1: [T, C] f32."""
    z = mix @ w.head[lo:hi].T  # [T, C]
    if w.head_scale is not None:
        z = z * (w.head_scale if w.head_scale.numel() == 1 else w.head_scale[lo:hi])
    return z


def logits_at(mix: torch.Tensor, w: TailWeights, ids: torch.Tensor) -> torch.Tensor:
    """Logits of chosen token ids. ids [k] -> [T, k]; ids [T, k] -> [T, k] (per-position ids). Differentiable."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=mix.device)
    if ids.ndim == 1:
        z = mix @ w.head[ids].T  # [T, k]
        if w.head_scale is not None:
            z = z * (w.head_scale if w.head_scale.numel() == 1 else w.head_scale[ids])
        return z
    z = torch.einsum("tn,tkn->tk", mix, w.head[ids])  # [T, k]
    if w.head_scale is not None:
        z = z * (w.head_scale if w.head_scale.numel() == 1 else w.head_scale[ids])
    return z


def full_logits(mix: torch.Tensor, w: TailWeights) -> torch.Tensor:
    """[T, V] logits — only for tests and tiny vocabularies."""
    return head_chunk(mix, w, 0, w.V)


# ----------------------------------------------------------------------------------------------------------
# streaming statistics


@dataclass(frozen=True)
class HeadStats:
    """Per-position next-token statistics of one forward (numpy, f64 where a reduction)."""

    lse: np.ndarray  # [T] f64  log-sum-exp of the logits
    logp_target: np.ndarray  # [T] f64
    argmax: np.ndarray  # [T] int64
    top_ids: np.ndarray  # [T, k] int64
    top_logp: np.ndarray  # [T, k] f64
    entropy: np.ndarray  # [T] f64 (nats)
    set_logp: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [T, |S|] f64 log p of listed ids

    @property
    def T(self) -> int:
        return int(self.lse.shape[0])


@dataclass(frozen=True)
class PairedStats:
    """Base vs edited statistics from one streamed pass."""

    base: HeadStats
    new: HeadStats
    kld: np.ndarray  # [T] f64  KL(base ‖ edited)
    dlogp: np.ndarray  # [T] f64  log p_new(target) − log p_base(target)
    same_top: np.ndarray  # [T] bool
    dp: np.ndarray  # [T] f64  p_new(target) − p_base(target)


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row dot products [T] of two [T, C] tensors as a batched matmul (no [T, C] product temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


class _Acc:
    """Running per-row log-sum-exp accumulators over vocabulary chunks (online max rescaling, f64 sums)."""

    def __init__(self, T: int, k: int, device, dtype=torch.float32):
        self.m = torch.full((T,), -math.inf, dtype=torch.float64, device=device)  # running max
        self.s = torch.zeros(T, dtype=torch.float64, device=device)  # Σ exp(z − m)
        self.sz = torch.zeros(T, dtype=torch.float64, device=device)  # Σ exp(z − m)·z (entropy)
        self.top_v = torch.full((T, k), -math.inf, dtype=dtype, device=device)
        self.top_i = torch.zeros((T, k), dtype=torch.long, device=device)
        self.k = k

    def update(self, z: torch.Tensor, lo: int):
        """Fold chunk logits z [T, C] in; returns exp(z − m_new) [T, C], the rescale factor [T] f64 and Σ e·z [T]."""
        cm, ci = z.max(1)  # [T] chunk max and its index (argmax for k = 1 without a top-k kernel)
        m_new = torch.maximum(self.m, cm.double())
        alpha = torch.exp(self.m - m_new)  # [T] rescale of previous sums (exp(-inf) = 0 on first chunk)
        e = torch.exp(z - m_new.to(z.dtype)[:, None])  # [T, C] f32
        self.s = self.s * alpha + e.sum(1, dtype=torch.float64)
        ez = rowdot(e, z)  # [T] Σ e·z without a [T, C] temporary
        self.sz = self.sz * alpha + ez.double()
        self.m = m_new
        if self.k == 1:
            v, i = cm[:, None], ci[:, None]
        else:
            v, i = torch.topk(z, min(self.k, z.shape[1]), dim=1)  # [T, k]
        allv = torch.cat([self.top_v, v], 1)
        alli = torch.cat([self.top_i, i + lo], 1)
        # earlier chunks first in the concatenation and a stable sort: ties keep the lowest id, as argmax does
        order = torch.sort(allv, dim=1, descending=True, stable=True).indices[:, : self.k]
        self.top_v = torch.gather(allv, 1, order)
        self.top_i = torch.gather(alli, 1, order)
        return e, alpha, ez

    @property
    def lse(self) -> torch.Tensor:
        return self.m + torch.log(self.s)

    @property
    def entropy(self) -> torch.Tensor:
        return self.lse - self.sz / self.s


def _finish(acc: _Acc, z_target: torch.Tensor, sets: dict[str, torch.Tensor]) -> HeadStats:
    lse = acc.lse
    return HeadStats(
        lse=lse.cpu().numpy(),
        logp_target=(z_target.double() - lse).cpu().numpy(),
        argmax=acc.top_i[:, 0].cpu().numpy(),
        top_ids=acc.top_i.cpu().numpy(),
        top_logp=(acc.top_v.double() - lse[:, None]).cpu().numpy(),
        entropy=acc.entropy.cpu().numpy(),
        set_logp={k: (v.double() - lse[:, None]).cpu().numpy() for k, v in sets.items()},
    )


def _target_logit(mix, w, targets):
    return logits_at(mix, w, targets[:, None])[:, 0]  # [T]


@torch.no_grad()
def head_stats(mix: torch.Tensor, w: TailWeights, targets, token_sets: dict | None = None, topk: int = 5,
               chunk: int = DEFAULT_CHUNK) -> HeadStats:
    """One streamed pass over the head: lse, log p(target), argmax, top-k, entropy, log p of token sets."""
    targets = torch.tensor(np.asarray(targets), dtype=torch.long, device=mix.device)
    acc = _Acc(mix.shape[0], topk, mix.device, mix.dtype)
    for lo in range(0, w.V, chunk):
        acc.update(head_chunk(mix, w, lo, min(w.V, lo + chunk)), lo)
    sets = {k: logits_at(mix, w, torch.as_tensor(list(v), dtype=torch.long)) for k, v in (token_sets or {}).items()}
    return _finish(acc, _target_logit(mix, w, targets), sets)


@torch.no_grad()
def paired_stats(mix_base: torch.Tensor, mix_new: torch.Tensor, w: TailWeights, targets,
                 token_sets: dict | None = None, topk: int = 5, chunk: int = DEFAULT_CHUNK) -> PairedStats:
    """Base and edited statistics and KL(base ‖ edited) in one streamed pass (one [2T, n] × [n, C] matmul
    per chunk)."""
    T = mix_base.shape[0]
    targets = torch.tensor(np.asarray(targets), dtype=torch.long, device=mix_base.device)
    both = torch.cat([mix_base, mix_new], 0)  # [2T, n]
    acc = _Acc(2 * T, topk, both.device, both.dtype)
    # A = Σ exp(z_b − m_b)·(z_b − z_n), rescaled with the base rows' running max, f64
    A = torch.zeros(T, dtype=torch.float64, device=both.device)
    for lo in range(0, w.V, chunk):
        z = head_chunk(both, w, lo, min(w.V, lo + chunk))  # [2T, C]
        e, alpha, ez = acc.update(z, lo)
        # Σ e_b·(z_b − z_n): the logit difference first (splitting it into Σe·z_b − Σe·z_n cancels
        # catastrophically in f32), summed in f64
        A = A * alpha[:T] + (e[:T] * (z[:T] - z[T:])).sum(1, dtype=torch.float64)
    sets = {k: logits_at(both, w, torch.as_tensor(list(v), dtype=torch.long)) for k, v in (token_sets or {}).items()}
    zt = _target_logit(both, w, torch.cat([targets, targets]))
    allst = _finish(acc, zt, sets)
    lse = acc.lse
    kld = (A / acc.s[:T] - lse[:T] + lse[T:]).clamp_min(0.0)  # KL ≥ 0; clamp only rounding below zero
    base, new = _split(allst, T)
    dlogp = new.logp_target - base.logp_target
    return PairedStats(base=base, new=new, kld=kld.cpu().numpy(), dlogp=dlogp,
                       same_top=base.argmax == new.argmax,
                       dp=np.exp(new.logp_target) - np.exp(base.logp_target))


def _split(s: HeadStats, T: int) -> tuple[HeadStats, HeadStats]:
    def part(sl):
        return HeadStats(lse=s.lse[sl], logp_target=s.logp_target[sl], argmax=s.argmax[sl], top_ids=s.top_ids[sl],
                         top_logp=s.top_logp[sl], entropy=s.entropy[sl],
                         set_logp={k: v[sl] for k, v in s.set_logp.items()})
    return part(slice(0, T)), part(slice(T, 2 * T))


# ----------------------------------------------------------------------------------------------------------
# convenience over dump files


def score_dump(w: TailWeights, dump, *, token_ids: dict | None = None, W_sd=None, dW=None, topk: int = 5,
               chunk: int = DEFAULT_CHUNK) -> HeadStats:
    """Exact statistics of one dump under the model (optionally with a replaced / edited W_sd)."""
    with torch.no_grad():
        mix = mix_of_dump(dump, w, W_sd=W_sd, dW=dW)
    return head_stats(mix, w, np.asarray(dump.tokens[1:]), token_ids, topk, chunk)


def score_pair(w: TailWeights, dump, W_sd_new: torch.Tensor, *, token_ids: dict | None = None, topk: int = 5,
               chunk: int = DEFAULT_CHUNK) -> PairedStats:
    """Base vs edited (W_sd replaced by W_sd_new, e.g. the re-quantised bundle's values) for one dump."""
    with torch.no_grad():
        mb = mix_of_dump(dump, w)
        mn = mix_of_dump(dump, w, W_sd=W_sd_new)
    return paired_stats(mb, mn, w, np.asarray(dump.tokens[1:]), token_ids, topk, chunk)


# ----------------------------------------------------------------------------------------------------------
# differentiable path (for the solvers): streamed log-sum-exp and KL with recomputing backward passes


class _StreamedLSE(torch.autograd.Function):
    """lse(mix·W_outᵀ) [T] without keeping [T, V]; backward: ∂lse/∂mix = E_p[W_out row] (recomputed)."""

    @staticmethod
    def forward(ctx, mix, head, scale, chunk):
        acc_m = torch.full((mix.shape[0],), -math.inf, dtype=torch.float64, device=mix.device)
        acc_s = torch.zeros(mix.shape[0], dtype=torch.float64, device=mix.device)
        for lo in range(0, head.shape[0], chunk):
            z = mix @ head[lo:lo + chunk].T
            if scale is not None:
                z = z * (scale if scale.numel() == 1 else scale[lo:lo + chunk])
            m_new = torch.maximum(acc_m, z.max(1).values.double())
            acc_s = acc_s * torch.exp(acc_m - m_new) + torch.exp(z - m_new.to(z.dtype)[:, None]).sum(1, dtype=torch.float64)
            acc_m = m_new
        lse = acc_m + torch.log(acc_s)
        ctx.save_for_backward(mix, head, lse, scale if scale is not None else torch.empty(0))
        ctx.chunk, ctx.has_scale = chunk, scale is not None
        return lse.to(mix.dtype)

    @staticmethod
    def backward(ctx, g):
        mix, head, lse, scale = ctx.saved_tensors
        grad = torch.zeros_like(mix)
        for lo in range(0, head.shape[0], ctx.chunk):
            hcnk = head[lo:lo + ctx.chunk]
            sc = None
            if ctx.has_scale:
                sc = scale if scale.numel() == 1 else scale[lo:lo + ctx.chunk]
            z = mix @ hcnk.T
            if sc is not None:
                z = z * sc
            p = torch.exp(z.double() - lse[:, None]).to(z.dtype)  # [T, C]
            if sc is not None:
                p = p * sc
            grad += p @ hcnk
        return grad * g[:, None], None, None, None


def streamed_lse(mix: torch.Tensor, w: TailWeights, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log-sum-exp over the full vocabulary [T] (f32 out, f64 inside)."""
    return _StreamedLSE.apply(mix, w.head, w.head_scale, chunk)


class _StreamedKL(torch.autograd.Function):
    """KL(p_base ‖ p_new) [T] where p = softmax(mix·W_outᵀ); gradient w.r.t. mix_new only:
    ∂KL/∂z_new = p_new − p_base -> ∂KL/∂mix_new = (p_new − p_base)·W_out (recomputed in chunks)."""

    @staticmethod
    def forward(ctx, mix_new, mix_base, head, chunk):
        both = torch.cat([mix_base, mix_new], 0)
        T = mix_base.shape[0]
        m = torch.full((2 * T,), -math.inf, dtype=torch.float64, device=both.device)
        s = torch.zeros(2 * T, dtype=torch.float64, device=both.device)
        A = torch.zeros(T, dtype=torch.float64, device=both.device)
        for lo in range(0, head.shape[0], chunk):
            z = both @ head[lo:lo + chunk].T
            m_new = torch.maximum(m, z.max(1).values.double())
            alpha = torch.exp(m - m_new)
            e = torch.exp(z - m_new.to(z.dtype)[:, None])
            s = s * alpha + e.sum(1, dtype=torch.float64)
            A = A * alpha[:T] + (e[:T] * (z[:T] - z[T:])).sum(1, dtype=torch.float64)
            m = m_new
        lse = m + torch.log(s)
        ctx.save_for_backward(mix_new, mix_base, head, lse)
        ctx.chunk = chunk
        return (A / s[:T] - lse[:T] + lse[T:]).to(mix_new.dtype)

    @staticmethod
    def backward(ctx, g):
        mix_new, mix_base, head, lse = ctx.saved_tensors
        T = mix_base.shape[0]
        grad = torch.zeros_like(mix_new)
        for lo in range(0, head.shape[0], ctx.chunk):
            hcnk = head[lo:lo + ctx.chunk]
            pn = torch.exp((mix_new @ hcnk.T).double() - lse[T:, None])
            pb = torch.exp((mix_base @ hcnk.T).double() - lse[:T, None])
            grad += (pn - pb).to(hcnk.dtype) @ hcnk
        return grad * g[:, None], None, None, None


def streamed_kl(mix_new: torch.Tensor, mix_base: torch.Tensor, w: TailWeights,
                chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable KL(base ‖ new) per position [T] over the full vocabulary (no output.scale support)."""
    if w.head_scale is not None:
        raise NotImplementedError("streamed_kl with output.scale")
    return _StreamedKL.apply(mix_new, mix_base.detach(), w.head, chunk)


def logp_at(mix: torch.Tensor, w: TailWeights, ids, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log p of chosen ids: ids [T] -> [T]; ids [T, k] -> [T, k]."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=mix.device)
    squeeze = ids.ndim == 1
    z = logits_at(mix, w, ids[:, None] if squeeze else ids)  # [T, k]
    lp = z - streamed_lse(mix, w, chunk)[:, None]
    return lp[:, 0] if squeeze else lp
