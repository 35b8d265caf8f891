"""K-FAC factors of the background-preservation metric for a ΔW on the shared-expert down projection.

For a position t the change of the logits is Δz_t = J_t ΔW hh_t (J_t = ∂z/∂ys [V, n]); the expected KL to
second order is ½ Δz_tᵀ F_t Δz_t, F_t = diag(p_t) − p_t p_tᵀ. K-FAC factorises its mean over background
positions as ½ tr(ΔWᵀ G ΔW A):
    A = mean_t w_t hh_t hh_tᵀ                       [f, f]
    G = mean_t J_tᵀ F_t J_t                         [n, n]

The exact J_tᵀ F_t J_t costs V·n² per position. **Estimator used: top-K exact + sampled tail.** With
μ_t = E_{p_t}[W_out] (exact, over the full vocabulary: the streaming accumulator l47.tail.stream) and s_{t,v} = J_mix,tᵀ (W_out[v] − μ_t) (one
vector-Jacobian product through the output mixer per v),
    J_tᵀ F_t J_t = Σ_{v ∈ topK(p_t)} p_v s_{t,v} s_{t,v}ᵀ  +  τ_t · E_{v ~ p_t | tail}[s_{t,v} s_{t,v}ᵀ]
where τ_t is the mass outside the top-K. The tail expectation is estimated with S stratified inverse-CDF samples
per position (one streamed pass; seeded, so a solve reproduces its bytes): unbiased, exact as K -> V. Dropping
the tail term (the earlier top-K-only metric) under-states G by a factor that grows with the entropy of the
background: measured 1.3x on the demo model (tail mass 0.017) and ~4x on a flat synthetic head (tail mass 0.74,
docs/SOLVERS.md); it is what `tail_mass` reports.

Precision: forward and VJPs in f32; the factors accumulate in f64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l47.model.weights import TailWeights
from l47.tail.forward import DEFAULT_CHUNK, head_chunk, mixer_parts, mixer_vjp
from l47.tail.stream import stream_head
from l47.solvers.batch import Batch


@dataclass(frozen=True)
class FisherFactors:
    A: torch.Tensor  # [f, f] f64
    G: torch.Tensor  # [n, n] f64
    topk: int
    tail_mass: float  # mean probability mass outside the top-K (estimated by `tail_samples` samples, not dropped)
    P: int
    tail_samples: int = 0


def mu_lse(mix: torch.Tensor, w: TailWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """μ = E_p[W_out] [P, n] f64 and log-sum-exp [P] f64 of the full head, one streamed pass (no grad)."""
    st = stream_head(mix, w.head, w.numerics, mu=True)
    return st.mu.to(mix.device), st.lse.to(mix.device)


@torch.no_grad()
def tail_samples(mix: torch.Tensor, w: TailWeights, lse: torch.Tensor, top_ids: torch.Tensor, S: int,
                 seed: int = 0) -> torch.Tensor:
    """S token ids per position [P, S] drawn from p_t restricted to the tokens outside `top_ids` [P, K], by
    stratified inverse CDF (thresholds (s + u)/S of the tail mass, u ~ U[0,1) seeded): one streamed head pass.
    Precision: probabilities exp(z − lse) in f64, cumulative sums in f64."""
    P = mix.shape[0]
    dev = mix.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.rand(P, S, generator=gen, dtype=torch.float64).to(dev)  # [P, S]
    lse = lse.to(dev).double()
    ids = torch.full((P, S), -1, dtype=torch.long, device=dev)
    last = torch.zeros(P, dtype=torch.long, device=dev)  # last tail token seen (rounding fallback)
    tail = None
    cum = torch.zeros(P, dtype=torch.float64, device=dev)
    passes = []
    for phase in (0, 1):  # 0: the tail mass τ_t exactly; 1: the samples
        if phase == 1:
            thr = (torch.arange(S, device=dev, dtype=torch.float64)[None, :] + u) / S * tail[:, None]  # [P, S]
            cum.zero_()
        for lo in range(0, w.V, DEFAULT_CHUNK):
            hi = min(w.V, lo + DEFAULT_CHUNK)
            p = torch.exp(head_chunk(mix, w, lo, hi).double() - lse[:, None])  # [P, C]
            inside = (top_ids >= lo) & (top_ids < hi)
            rows = torch.nonzero(inside)[:, 0]
            p[rows, top_ids[inside] - lo] = 0.0
            if phase == 0:
                passes.append(p.sum(1))
                continue
            cs = cum[:, None] + torch.cumsum(p, 1)  # [P, C]
            j = torch.searchsorted(cs, thr)  # [P, S] first index with cs ≥ thr
            hit = (j < hi - lo) & (ids < 0)
            ids[hit] = (j + lo)[hit]
            nz = (p > 0).any(1)
            last[nz] = lo + (p.shape[1] - 1 - torch.argmax((p > 0).flip(1).to(torch.int8), 1))[nz]
            cum = cs[:, -1]
        if phase == 0:
            tail = torch.stack(passes, 0).sum(0)  # [P]
    miss = ids < 0
    ids[miss] = last[:, None].expand(-1, S)[miss]
    return ids


def fisher_factors(bg: Batch, w: TailWeights, W: torch.Tensor, K: int = 32, weights: torch.Tensor | None = None,
                   row_basis: torch.Tensor | None = None, tail_samples_n: int = 32, seed: int = 0) -> FisherFactors:
    """A and G over the background batch at weights W (= W_sd + current ΔW). `row_basis` [f, f'] expresses A in
    reduced coordinates (the anchors' null space). `tail_samples_n` samples per position estimate the Fisher of the
    mass outside the top-K (0: top-K only, which under-states G; module docstring)."""
    P = bg.P
    wt = torch.ones(P, dtype=torch.float64, device=bg.hh.device) if weights is None else weights.double()
    wt = wt / wt.sum()
    h = bg.hh.double()
    if row_basis is not None:
        h = h @ row_basis  # [P, f']
    A = (h * wt[:, None]).T @ h  # [f', f']
    with torch.no_grad():
        parts = mixer_parts(bg.hh @ W.T, bg.R, bg.inj, bg.sgv, bg.yr, w)  # the tail from ys = W·hh [P, n]
        mix = parts.mix  # [P, n]
    vjp = mixer_vjp(parts, bg.sgv, w)  # u [P, n] -> uᵀ ∂mix/∂ys (by hand: 3× autograd's speed)
    st = stream_head(mix, w.head, w.numerics, topk=K, mu=True)  # one pass: μ and the top-K
    mu, ids = st.mu.to(mix.device), st.top_i  # [P, n] f64, [P, K]
    p = torch.exp(st.top_v.to(st.lse.device).double() - st.lse[:, None]).to(mix.device)  # [P, K] f64
    G = torch.zeros(w.n, w.n, dtype=torch.float64, device=bg.hh.device)
    for j in range(K):
        u = (w.head[ids[:, j]].double() - mu) * torch.sqrt(p[:, j] * wt)[:, None]  # [P, n] mix-space score
        s = vjp(u.to(mix.dtype)).double()  # [P, n]
        G += s.T @ s
    tail_t = (1.0 - p.sum(1)).clamp_min(0)  # [P] mass outside the top-K
    S = tail_samples_n if K < w.V else 0
    if S > 0:
        _, lse = mu_lse(mix, w)
        sid = tail_samples(mix, w, lse, ids, S, seed=seed)  # [P, S]
        for j in range(S):
            u = (w.head[sid[:, j]].double() - mu) * torch.sqrt(tail_t * wt / S)[:, None]  # [P, n]
            s = vjp(u.to(mix.dtype)).double()  # [P, n]
            G += s.T @ s
    return FisherFactors(A=A, G=G, topk=K, tail_mass=float(tail_t.mean()), P=P, tail_samples=S)
