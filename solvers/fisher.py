"""K-FAC factors of the background-preservation metric for a ΔW on the shared-expert down projection.

For a position t the change of the logits is Δz_t = J_t ΔW hh_t (J_t = ∂z/∂ys [V, n]); the expected KL to
second order is ½ Δz_tᵀ F_t Δz_t, F_t = diag(p_t) − p_t p_tᵀ. K-FAC factorises its mean over background
positions as ½ tr(ΔWᵀ G ΔW A):
    A = mean_t w_t hh_t hh_tᵀ                       [f, f]
    G = mean_t J_tᵀ F_t J_t                         [n, n]

The exact J_tᵀ F_t J_t costs V·n² per position. **Approximation used: top-K Fisher.** With μ_t = E_{p_t}[W_out]
(exact, over the full vocabulary: the streaming accumulator l47.tail.stream, which also gives the
top-K ids, ties by lower id) and s_{t,v} = J_mix,tᵀ (W_out[v] − μ_t) (one vector-Jacobian
product through the output mixer per v),
    J_tᵀ F_t J_t = Σ_v p_v s_{t,v} s_{t,v}ᵀ  ≈  Σ_{v ∈ topK(p_t)} p_v s_{t,v} s_{t,v}ᵀ
and the probability mass outside the top-K is reported (`tail_mass`). It is deterministic (a solve reproduces
its bytes) and exact as K -> V.

Precision: forward and VJPs in f32; the factors accumulate in f64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l47.model.weights import TailWeights
from l47.tail.stream import stream_head
from l47.solvers.batch import Batch, ys_grad_mix


@dataclass(frozen=True)
class FisherFactors:
    A: torch.Tensor  # [f, f] f64
    G: torch.Tensor  # [n, n] f64
    topk: int
    tail_mass: float  # mean probability mass outside the top-K (what the approximation drops)
    P: int


def mu_lse(mix: torch.Tensor, w: TailWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """μ = E_p[W_out] [P, n] f64 and log-sum-exp [P] f64 of the full head, one streamed pass (no grad)."""
    st = stream_head(mix, w.head, w.numerics, mu=True)
    return st.mu.to(mix.device), st.lse.to(mix.device)


def fisher_factors(bg: Batch, w: TailWeights, W: torch.Tensor, K: int = 32, weights: torch.Tensor | None = None,
                   row_basis: torch.Tensor | None = None) -> FisherFactors:
    """A and G over the background batch at weights W (= W_sd + current ΔW). `row_basis` [f, f'] expresses A in
    reduced coordinates (the anchors' null space)."""
    P = bg.P
    wt = torch.ones(P, dtype=torch.float64, device=bg.hh.device) if weights is None else weights.double()
    wt = wt / wt.sum()
    h = bg.hh.double()
    if row_basis is not None:
        h = h @ row_basis  # [P, f']
    A = (h * wt[:, None]).T @ h  # [f', f']
    ys, mix = ys_grad_mix(bg, w, W)
    st = stream_head(mix.detach(), w.head, w.numerics, topk=K, mu=True)  # one pass: μ and the top-K
    mu, ids = st.mu.to(mix.device), st.top_i  # [P, n] f64, [P, K]
    p = torch.exp(st.top_v.to(st.lse.device).double() - st.lse[:, None]).to(mix.device)  # [P, K] f64
    G = torch.zeros(w.n, w.n, dtype=torch.float64, device=bg.hh.device)
    for j in range(K):
        u = (w.head[ids[:, j]].double() - mu) * torch.sqrt(p[:, j] * wt)[:, None]  # [P, n] mix-space score
        (s,) = torch.autograd.grad(mix, ys, grad_outputs=u.to(mix.dtype), retain_graph=j < K - 1)  # [P, n]
        s = s.double()
        G += s.T @ s
    tail = float((1.0 - p.sum(1)).clamp_min(0).mean())
    return FisherFactors(A=A, G=G, topk=K, tail_mass=tail, P=P)
