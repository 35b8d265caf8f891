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
    logits = W_out · mix                                      [T, V]      W_out with output.scale folded in

Precision: every matmul and elementwise step in f32; every reduction over the vocabulary (log-sum-exp,
entropy, KL, expectations) is the one streaming accumulator of l47.tail.stream (f64 across chunks; the head
GEMM in the run's precision, `w.numerics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from l47.model.weights import TailWeights, as_f32
from l47.tail import stream
from l47.tail.stream import DEFAULT_CHUNK, Streamed, head_logits, stream_head


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
    return mixer_parts(ys, R, inj, sgv, yr, w).mix


@dataclass(frozen=True)
class MixerParts:
    """The output mixer's intermediate values at T positions (the equations in the module docstring). f32."""

    c: torch.Tensor  # [T, hc]       2σ(inj_c / hc)
    irms: torch.Tensor  # [T, hc, 1]  rsqrt(mean_d R'_c² + eps)
    xhat: torch.Tensor  # [T, hc, n]  R'_c · irms_c
    xn: torch.Tensor  # [T, hc, n]    x̂_c ⊙ w_onorm_c
    a: torch.Tensor  # [T, r]         W_odown · flat(xn) / hc   (lo = silu(a))
    gate: torch.Tensor  # [T, hc, n]  σ(W_oup · lo)

    @property
    def mix(self) -> torch.Tensor:
        return (self.gate * self.xn).mean(1)  # [T, n]


def mixer_parts(ys, R, inj, sgv, yr, w: TailWeights) -> MixerParts:
    """The output mixer from ys [T, n], step by step (`mix_from_ys` is their `mix`; `mixer_vjp` reads them)."""
    T = ys.shape[0]
    bo = yr + torch.sigmoid(sgv)[:, None] * ys  # [T, n]
    c = 2.0 * torch.sigmoid(inj / w.hc)  # [T, hc]
    Rp = R + bo[:, None, :] * c[:, :, None]  # [T, hc, n]
    irms = torch.rsqrt(Rp.pow(2).mean(-1, keepdim=True) + w.eps)  # [T, hc, 1]
    xhat = Rp * irms  # [T, hc, n]
    xn = xhat * w.onorm  # [T, hc, n]
    a = (xn.reshape(T, w.hc * w.n) @ w.odown.T) / w.hc  # [T, r]
    gate = torch.sigmoid(F.silu(a) @ w.oup.T).reshape(T, w.hc, w.n)  # [T, hc, n]
    return MixerParts(c=c, irms=irms, xhat=xhat, xn=xn, a=a, gate=gate)


@dataclass(frozen=True)
class MixerVjp:
    """The transposed Jacobian of `mix_from_ys` at fixed positions, as a linear map on cotangents:
    u [T, n] -> uᵀ ∂mix/∂ys [T, n]. The equations' backward by hand, with every factor that does not depend on u
    computed once (`mixer_vjp`, from `mixer_parts`): an application is ~10 passes over [T, hc, n] where autograd's backward of the
    same graph is ~30 (2.9× faster on the demo's background, docs/BENCHMARKS.md), and the Fisher's 64 cotangents
    per position share one set of factors (solvers/fisher.py). With k_c = σ(sgv)·2σ(inj_c/hc)/rms_c:
        g_z_c  = u ⊙ xn_c ⊙ σ'(z_c) / hc                          z = W_oup · lo                 [T, hc, n]
        q      = ((flat(g_z) · W_oup) ⊙ silu'(a) / hc) · W_odown                                   [T, hc·n]
        v_c    = w_onorm_c ⊙ (σ(z_c) ⊙ u / hc + q_c)               (= w_onorm_c ⊙ ∂/∂xn_c)        [T, hc, n]
        ∂/∂ys  = Σ_c k_c (v_c − x̂_c · mean_d(x̂_c ⊙ v_c))                                          [T, n]
    Checked against central differences of the f64 forward (tests/test_forward.py). f32 like the forward."""

    xhat: torch.Tensor  # [T, hc, n]  x̂_c
    cz: torch.Tensor  # [T, hc, n]    xn_c ⊙ σ'(z_c) / hc
    gd: torch.Tensor  # [T, hc, n]    w_onorm_c ⊙ σ(z_c) / hc
    k: torch.Tensor  # [T, hc]        k_c
    sa: torch.Tensor  # [T, r]        silu'(a) / hc
    odown_on: torch.Tensor  # [r, hc·n]  W_odown ⊙ flat(w_onorm)
    oup: torch.Tensor  # [hc·n, r]

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        T, hc, n = self.xhat.shape
        ue = u.unsqueeze(-2)  # [T, 1, n]
        glo = (ue * self.cz).reshape(T, hc * n) @ self.oup  # [T, r]
        v = torch.addcmul(((glo * self.sa) @ self.odown_on).reshape(T, hc, n), ue, self.gd)  # [T, hc, n]
        m = torch.einsum("tcn,tcn->tc", self.xhat, v) / n  # [T, hc]
        return torch.einsum("tc,tcn->tn", self.k, v) - torch.einsum("tc,tcn->tn", self.k * m, self.xhat)  # [T, n]


def mixer_vjp(p: MixerParts, sgv, w: TailWeights) -> MixerVjp:
    """The factors of `MixerVjp` from the mixer's parts at ys (`mixer_parts`, computed without autograd) and sgv [T]."""
    with torch.no_grad():
        sa = torch.sigmoid(p.a)  # [T, r]
        return MixerVjp(xhat=p.xhat, cz=p.xn * p.gate * (1.0 - p.gate) / w.hc, gd=w.onorm * p.gate / w.hc,
                        k=torch.sigmoid(sgv)[:, None] * p.c * p.irms[..., 0],
                        sa=sa * (1.0 + p.a * (1.0 - sa)) / w.hc,  # silu'(a) = σ(a)(1 + a(1 − σ(a)))
                        odown_on=w.odown * w.onorm.reshape(1, -1), oup=w.oup)


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
    """Logits for vocabulary rows lo..hi-1: [T, C] f32 (in the run's head precision, l47.tail.stream)."""
    return head_logits(mix, w.head, lo, hi, w.numerics)


def logits_at(mix: torch.Tensor, w: TailWeights, ids: torch.Tensor) -> torch.Tensor:
    """Logits of chosen token ids. ids [k] -> [T, k]; ids [T, k] -> [T, k] (per-position ids). f32, differentiable."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=mix.device)
    if ids.ndim == 1:
        return mix @ w.head[ids].T  # [T, k]
    return torch.einsum("tn,tkn->tk", mix, w.head[ids])  # [T, k]


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


def _finish(st: Streamed, z_target: torch.Tensor, sets: dict[str, torch.Tensor]) -> HeadStats:
    """HeadStats (numpy) of one pass; log p = logit − lse in f64 on the CPU."""
    lse = st.lse.cpu()
    return HeadStats(
        lse=lse.numpy(),
        logp_target=(z_target.cpu().double() - lse).numpy(),
        argmax=st.top_i[:, 0].cpu().numpy(),
        top_ids=st.top_i.cpu().numpy(),
        top_logp=(st.top_v.cpu().double() - lse[:, None]).numpy(),
        entropy=st.entropy.cpu().numpy(),
        set_logp={k: (v.cpu().double() - lse[:, None]).numpy() for k, v in sets.items()},
    )


def _set_logits(mix, w, token_sets: dict | None) -> dict[str, torch.Tensor]:
    return {k: logits_at(mix, w, torch.as_tensor(list(v), dtype=torch.long)) for k, v in (token_sets or {}).items()}


def _target_logit(mix, w, targets):
    return logits_at(mix, w, targets[:, None])[:, 0]  # [T]


@torch.no_grad()
def head_stats(mix: torch.Tensor, w: TailWeights, targets, token_sets: dict | None = None, topk: int = 5,
               chunk: int = DEFAULT_CHUNK) -> HeadStats:
    """One streamed pass over the head: lse, log p(target), argmax, top-k, entropy, log p of token sets."""
    targets = torch.tensor(np.asarray(targets), dtype=torch.long, device=mix.device)
    st = stream_head(mix, w.head, w.numerics, chunk=chunk, topk=max(topk, 1), entropy=True)
    return _finish(st, _target_logit(mix, w, targets), _set_logits(mix, w, token_sets))


@torch.no_grad()
def paired_stats(mix_base: torch.Tensor, mix_new: torch.Tensor, w: TailWeights, targets,
                 token_sets: dict | None = None, topk: int = 5, chunk: int = DEFAULT_CHUNK) -> PairedStats:
    """Base and edited statistics and KL(base ‖ edited) in one streamed pass (one [2T, n] × [n, C] matmul
    per chunk)."""
    T = mix_base.shape[0]
    targets = torch.tensor(np.asarray(targets), dtype=torch.long, device=mix_base.device)
    both = torch.cat([mix_base, mix_new], 0)  # [2T, n]
    st = stream_head(both, w.head, w.numerics, chunk=chunk, topk=max(topk, 1), entropy=True, pairs=T)
    allst = _finish(st, _target_logit(both, w, torch.cat([targets, targets])), _set_logits(both, w, token_sets))
    kld = st.kl.clamp_min(0.0)  # KL ≥ 0; clamp only rounding below zero
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
# differentiable path (for the solvers): streamed log-sum-exp and KL (l47.tail.stream) on the model's head


def streamed_lse(mix: torch.Tensor, w: TailWeights, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log-sum-exp over the full vocabulary [T] (mix's dtype out, f64 inside)."""
    return stream.streamed_lse(mix, w.head, w.numerics, chunk)


def streamed_lse_without(mix: torch.Tensor, w: TailWeights, drop: torch.Tensor,
                         chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log-sum-exp [T] (f64) of each row's vocabulary without its ids drop [T, k]."""
    return stream.streamed_lse_without(mix, w.head, drop, w.numerics, chunk)


def streamed_kl(mix_new: torch.Tensor, mix_base: torch.Tensor, w: TailWeights,
                chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable KL(base ‖ new) per position [T] over the full vocabulary (gradient to mix_new only)."""
    return stream.streamed_kl(mix_new, mix_base, w.head, w.numerics, chunk)


def logp_at(mix: torch.Tensor, w: TailWeights, ids, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Differentiable log p of chosen ids: ids [T] -> [T]; ids [T, k] -> [T, k]."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=mix.device)
    squeeze = ids.ndim == 1
    z = logits_at(mix, w, ids[:, None] if squeeze else ids)  # [T, k]
    lp = z - streamed_lse(mix, w, chunk)[:, None]
    return lp[:, 0] if squeeze else lp


# ----------------------------------------------------------------------------------------------------------
# the KL against fixed base rows in one pass over the new rows


@dataclass(frozen=True)
class KlReference:
    """What KL(p⁰ ‖ p) at fixed base rows needs of them, computed once (`kl_reference`): the logits are linear in
    the mixer output, z = W_out · x, so with μ⁰ = E_p⁰[W_out]
        KL(p⁰ ‖ p) = Σ_v p⁰_v (z⁰_v − z_v) + lse(z) − lse(z⁰) = lse(x) − lse⁰ − μ⁰·(x − x⁰)
    and a later KL is one lse pass over the new rows (`kl_against`), not a pass over base + new rows."""

    mix0: torch.Tensor  # [R, n] f32  x⁰
    lse0: torch.Tensor  # [R] f64     lse(W_out x⁰) by the plain pass (`stream_head` without μ: the fused kernel on CUDA)
    mu0: torch.Tensor  # [R, n] f64   E_p⁰[W_out]


def kl_from(lse: torch.Tensor, mix: torch.Tensor, lse0: torch.Tensor, mix0: torch.Tensor,
            mu0: torch.Tensor) -> torch.Tensor:
    """lse − lse⁰ − μ⁰·(x − x⁰) per row [R] (f64; the difference x − x⁰ first, in f64, so nothing of O(|z|)
    is subtracted but the two lse's). Differentiable in lse and mix (∂/∂mix = −μ⁰ + ∂lse/∂mix = μ − μ⁰).
    lse, lse0 [R]; mix, mix0 [R, n]; mu0 [R, n]."""
    dx = mix.double() - mix0.double()  # [R, n] f64
    return lse.double() - lse0 - (mu0 * dx).sum(1)  # [R]


@torch.no_grad()
def kl_reference(mix0: torch.Tensor, w: TailWeights, *, mu0: torch.Tensor | None = None,
                 topk: int = 0) -> tuple[KlReference, Streamed]:
    """(KlReference of the base rows mix0 [R, n], the plain pass's Streamed with top-`topk`). μ⁰: one μ pass
    (or the caller's `mu0` [R, n] f64 of the same rows); lse⁰: the plain pass, the code path the new rows' lse
    takes in `kl_against`, so that the two lse's round alike (on CUDA the μ pass is not the fused kernel)."""
    if mu0 is None:
        mu0 = stream_head(mix0, w.head, w.numerics, mu=True).mu  # [R, n] f64
    st = stream_head(mix0, w.head, w.numerics, topk=topk)  # [R] lse⁰ f64
    return KlReference(mix0=mix0, lse0=st.lse.to(mu0.device), mu0=mu0), st


@torch.no_grad()
def kl_against(ref: KlReference, mix: torch.Tensor, w: TailWeights, topk: int = 0) -> tuple[torch.Tensor, Streamed]:
    """(KL(p⁰ ‖ p) per row [R] f64, not clamped; the Streamed of the new rows with top-`topk`) for new rows mix
    [R, n] against `ref`'s base rows, by `kl_from` (KlReference's identity): one streamed lse pass over R rows,
    half the head GEMM of the pair pass (`streamed_kl`) over 2R.

    Precision (tests/test_kl_reference.py, against the f64 full softmax): the pair pass's logit rounding δ cancels
    to Σ(p − p⁰)δ (both rows' logits enter its A and its lse), here it does not: the error is the two f32 lse's
    own, Σ_v p_v δ_v − Σ_v p⁰_v δ⁰_v, ~ε₃₂·|z| per row. On the demo solve's background (14,078 rows, lse ≈ 14,
    six of its evaluations, KL 8e-6..3e-4): per row max 1.0e-5, mean |error| 1.55e-6 nats (the pair pass's max
    1.4e-6); their mean, what the judge compares with the budget, −8.2e-8..+1.4e-8 (the pair pass's ≤ 2.3e-10):
    ~3e-5 of a 2.5e-3 budget, 0.5 % of a KL of 8e-6."""
    st = stream_head(mix, w.head, w.numerics, topk=topk)  # [R] lse f64
    dev = ref.mu0.device  # where the f64 sums live (the CPU when the device has no float64)
    lse = st.lse.to(dev)
    kl = torch.cat([kl_from(lse[i:j], mix[i:j].to(dev), ref.lse0[i:j], ref.mix0[i:j].to(dev), ref.mu0[i:j])
                    for i, j in _blocks(mix.shape[0], KL_ROW_BLOCK)])  # [R] f64; [block, n] f64 temporaries
    return kl, st


KL_ROW_BLOCK = 8192  # rows per f64 [block, n] temporary of kl_against (the judge's background: 52k rows at real size)


def _blocks(R: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(R, i + step)) for i in range(0, max(R, 1), step)]
