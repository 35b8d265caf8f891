"""Feasibility before solving (`l47 plan`, and the first step of every `l47 solve`).

For each phrase: its events per set, base p(rejected), the logit gap its events must lose to reach the target
residual, how much of each event's key `hh` lies inside the protected anchors' span, and the largest reduction
reachable under the hard constraints alone within the KL budget — on the linearised problem, so it is a bound of
first order, not a promise. Then the anchors' rank against f and which words' anchors cost the most of it.

The linearised problem (ΔW = Y Bᵀ, B the anchors' null space; KL ≈ ½ tr(ΔWᵀ G ΔW A), the K-FAC metric of
solvers/fisher.py with its sampled tail, at the base): for event e with rejected r and chosen natural alternative
c, gap_e = ℓ_r − ℓ_c changes by ⟨a_e, ΔW⟩ (a_e = g_e h_eᵀ, g_e = ∂gap/∂ys, h_e its key in the null space).
    needed     d_e = log( p (1 − p′) / (p′ (1 − p)) ),   p′ = target · p      (the log-odds a residual p′/p needs)
    jointly    min ½ΔWᵀMΔW s.t. ⟨a_e, ΔW⟩ ≤ −d_e for every event  (a QP, solved exactly through its dual (NNLS));
               its ΔW is then run through the exact forward: s = exact KL / ½ΔWᵀMΔW corrects the metric's scale
    per phrase max_{½ s ΔWᵀMΔW ≤ budget} mean_{e ∈ phrase} (−⟨a_e, ΔW⟩) = √(2·budget·1ᵀK1 / s) / |phrase|
K = C M⁻¹ Cᵀ is WFLD's dual Gram. A phrase that cannot reach its target is named with the binding constraint:
`no train events`, `anchors' span` (its keys ≥ max_removed inside it), or `KL budget` (needed > reachable).

Notation for shapes: E train events, m = E rows, n hidden, f width, f' null-space dimension.
Precision: f64 for every solve step, f32 forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from l47.model.weights import TailWeights
from l47.solvers.anchors import word_null_cost
from l47.solvers.batch import Batch, EventTerms, batch_mix, ys_grad_mix
from l47.solvers.fisher import fisher_factors
from l47.solvers.wfld import _dual_gram, _nnls_dual, anchor_basis, background_kl

BINDING_NONE = "none"
BINDING_EVENTS = "no train events"
BINDING_SPAN = "anchors' span"
BINDING_KL = "KL budget"


@dataclass(frozen=True)
class PhrasePlan:
    phrase: str
    events: dict  # set name -> count (train, dev, heldout, ...)
    p_base: float  # mean base p(rejected) over its train + dev events
    needed_gap: float  # mean over train events of d_e (nats of log-odds) for the target residual
    needed_gap_max: float
    span_share_mean: float  # mean share of ‖hh‖² of its train events inside the protected span
    span_share_max: float
    blocked_events: int  # train events with share > max_removed (cannot be moved at all)
    reachable_gap: float  # largest mean gap reduction within the KL budget (linearised, this phrase alone)
    reachable_residual: float  # the residual ratio that gap gives at the mean base p
    joint_kl_share: float  # share of the least KL reaching every target (all phrases together) spent on it
    binding: str  # none | no train events | anchors' span | KL budget


@dataclass(frozen=True)
class FeasibilityPlan:
    target: float  # residual ratio aimed at per phrase
    kl_budget: float  # nats, mean background KL
    f: int
    anchors: int
    anchor_rank: int
    turn_ends: int
    null_dim: int
    words: dict  # word -> {anchors, rank_alone, unique_directions}
    phrases: list[PhrasePlan]
    joint_min_kl: float  # least KL (linearised metric) reaching every train event's needed gap; inf if none
    joint_exact_kl: float  # the exact streamed background KL of that least-KL ΔW
    metric_scale: float  # joint_exact_kl / joint_min_kl: the factor the reachable figures are corrected by
    fisher_tail_mass: float
    notes: list[str] = field(default_factory=list)

    @property
    def short(self) -> list[PhrasePlan]:
        return [p for p in self.phrases if p.binding != BINDING_NONE]

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("joint_min_kl", "joint_exact_kl"):
            d[k] = d[k] if math.isfinite(d[k]) else None
        return d


def needed_gap(p: np.ndarray, target: float) -> np.ndarray:
    """d = log(p(1 − p′)/(p′(1 − p))), p′ = target·p: the log-odds drop that takes p to p′ when every other token
    keeps its share of the rest. f64."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    q = target * p
    return np.log(p * (1 - q)) - np.log(q * (1 - p))


def residual_after(p: float, d: float) -> float:
    """p′/p after the log-odds of p drop by d."""
    p = min(max(p, 1e-12), 1 - 1e-12)
    q = p * math.exp(-d) / (1 - p + p * math.exp(-d))
    return q / p


def _gap_grads(ev: Batch, terms: EventTerms, w: TailWeights) -> torch.Tensor:
    """∂(ℓ_r − ℓ_c)/∂ys at the base for every event [E, n] (the lse cancels in a difference of log-probs)."""
    ys, mix = ys_grad_mix(ev, w, w.W_sd)
    u = (w.head[terms.rejected] - w.head[terms.chosen[:, 0]]).to(mix.dtype)  # [E, n] ∂gap/∂mix
    (g,) = torch.autograd.grad(mix, ys, grad_outputs=u)
    return g.double()


def feasibility(w: TailWeights, phrases: list[str], counts: dict[str, dict], p_base: dict[str, float],
                ev: Batch, ev_phrase: list[str], ev_p: np.ndarray, terms: EventTerms, background: Batch,
                anchors: Batch | None, anchor_words: list[str], turn_ends: int, target: float, kl_budget: float,
                max_removed: float = 0.95, anchor_tol: float = 1e-6, fisher_topk: int = 32,
                tail_samples: int = 32, ridge: float = 1e-6) -> FeasibilityPlan:
    """The plan (module docstring). `counts[phrase][set]` events per set; `p_base[phrase]` mean base p;
    `ev`/`ev_phrase`/`ev_p` the train events, their phrases and base p; `anchor_words` one label per anchor row
    (turn ends included, labelled as such)."""
    dev = w.device
    B, rank = anchor_basis(anchors, w.f, anchor_tol, dev)  # [f, f']
    notes: list[str] = []
    words = word_null_cost(anchors.hh, anchor_words, anchor_tol) if anchors is not None and anchors.P else {}
    ev_phrase = list(ev_phrase)
    share = np.zeros(0)
    if ev is not None and ev.P:
        he = ev.hh.double()
        share = (1.0 - (he @ B).pow(2).sum(1) / he.pow(2).sum(1).clamp_min(1e-300)).cpu().numpy()  # [E]
    d_need = needed_gap(ev_p, target) if len(ev_p) else np.zeros(0)
    # the linearised problem in the metric's eigenbases (WFLD's machinery, at the base)
    K = None
    tail = float("nan")
    if ev is not None and ev.P:
        ff = fisher_factors(background, w, w.W_sd, K=fisher_topk, row_basis=B, tail_samples_n=tail_samples)
        tail = ff.tail_mass
        gam, UG = torch.linalg.eigh(ff.G)
        alp, UA = torch.linalg.eigh(ff.A)
        gam, alp = gam.clamp_min(0), alp.clamp_min(0)
        rho = ridge * float(gam.mean() * alp.mean()) or ridge
        D = 1.0 / (rho + gam[:, None] * alp[None, :])  # [n, f'] (M = ρI + A'⊗G; ρ only keeps it invertible)
        Gh = _gap_grads(ev, terms, w) @ UG  # [E, n]
        Hh = (ev.hh.double() @ B) @ UA  # [E, f']
        K = _dual_gram(Gh, Hh, D, np.arange(ev.P))  # [E, E]: ½KL of the min-norm step is ½ μᵀKμ
    joint, mu, joint_exact, calib = float("inf"), None, float("nan"), 1.0
    blocked = share > max_removed
    if K is not None:
        act = np.nonzero(~blocked)[0]
        if len(act):
            Ka = K[np.ix_(act, act)] if len(act) < ev.P else K
            mu = _nnls_dual(torch.as_tensor(Ka), -d_need[act])
            Kmu = Ka.cpu().numpy() @ mu
            joint = 0.5 * float(mu @ Kmu)
            contrib = np.zeros(ev.P)
            contrib[act] = 0.5 * mu * Kmu
            # the least-KL ΔW itself, and its EXACT background KL: the linearised metric's scale along it
            at = torch.as_tensor(act, device=dev)
            mu_t = torch.as_tensor(mu, dtype=torch.float64, device=dev)
            Yhat = -D * (Gh[at].T @ (mu_t[:, None] * Hh[at]))  # [n, f']
            dW = (UG @ Yhat @ UA.T @ B.T).to(torch.float32)  # [n, f]
            with torch.no_grad():
                mix0 = batch_mix(background, w)
            joint_exact = background_kl(background, w, dW, mix0)
            if joint > 0 and joint_exact > 0:
                calib = joint_exact / joint
            bad_fit = float(np.max(d_need[act] - Kmu, initial=-np.inf))  # > 0: a target the dual did not meet
            if bad_fit > 1e-3 * max(1.0, float(d_need.max(initial=0))):
                notes.append(f"the linearised targets are not all reachable even without a budget (short by "
                             f"{bad_fit:.3g} nats): a direction is missing from the null space")
    out = []
    for ph in phrases:
        idx = np.asarray([i for i, q in enumerate(ev_phrase) if q == ph], dtype=np.int64)
        pb = float(p_base.get(ph, float("nan")))
        if not len(idx):
            out.append(PhrasePlan(ph, counts.get(ph, {}), pb, float("nan"), float("nan"), float("nan"),
                                  float("nan"), 0, 0.0, 1.0, 0.0, BINDING_EVENTS))
            continue
        ok = idx[~blocked[idx]]
        if len(ok) and K is not None:
            s = float(K[np.ix_(ok, ok)].sum())
            # blocked events contribute no reduction; the metric scaled to the exact KL at the joint solution
            reach = math.sqrt(max(2.0 * kl_budget * s / calib, 0.0)) / len(idx)
        else:
            reach = 0.0
        need = float(d_need[idx].mean())
        resid = residual_after(float(np.mean(ev_p[idx])), reach)
        jshare = float(contrib[idx].sum() / joint) if mu is not None and joint > 0 else 0.0
        if blocked[idx].all():
            binding = BINDING_SPAN
        elif reach < need:
            binding = BINDING_SPAN if blocked[idx].mean() > 0.5 else BINDING_KL
        else:
            binding = BINDING_NONE
        out.append(PhrasePlan(ph, counts.get(ph, {}), pb, need, float(d_need[idx].max()),
                              float(share[idx].mean()), float(share[idx].max()), int(blocked[idx].sum()), reach,
                              resid, jshare, binding))
    if math.isfinite(joint_exact) and joint_exact > kl_budget:
        notes.append(f"the least-KL edit reaching every phrase's linearised target has an exact background KL of "
                     f"{joint_exact:.3g} nats > the budget {kl_budget:.3g}")
    return FeasibilityPlan(target=target, kl_budget=kl_budget, f=w.f, anchors=0 if anchors is None else anchors.P,
                           anchor_rank=rank, turn_ends=turn_ends, null_dim=B.shape[1], words=words, phrases=out,
                           joint_min_kl=joint, joint_exact_kl=joint_exact, metric_scale=calib,
                           fisher_tail_mass=tail, notes=notes)
