"""Feasibility before solving (`l47 plan`, and the first step of every `l47 solve`).

For each phrase: its events per set, base p(rejected), the logit gap its events must lose to reach the target
residual, how much of each event's key `hh` lies inside the protected anchors' span, and the largest reduction
reachable under the hard constraints alone within the KL budget — on the linearised problem, so it is a bound of
first order, not a promise. The mean base p over its train (and dev) events carries a 90 % interval bootstrapped
over documents (l47.data.uncertainty): how well its few documents pin the starting point down. Then the
anchors' rank against f and which words' anchors cost the most of it.

The linearised problem (ΔW = Y Bᵀ, B the anchors' null space; KL ≈ ½ tr(ΔWᵀ G ΔW A), the K-FAC metric of
solvers/fisher.py with its sampled tail, at the base): for event e with rejected r and chosen natural alternative
c, gap_e = ℓ_r − ℓ_c changes by ⟨a_e, ΔW⟩ (a_e = g_e h_eᵀ, g_e = ∂gap/∂ys, h_e its key in the null space).
    needed     d_e = log( p (1 − p′) / (p′ (1 − p)) ),   p′ = target · p      (the log-odds a residual p′/p needs)
    jointly    min ½ΔWᵀMΔW s.t. ⟨a_e, ΔW⟩ ≤ −d_e for every event  (a QP, solved exactly through its dual (NNLS));
               its ΔW is then run through the exact forward: s = exact KL / ½ΔWᵀMΔW corrects the metric's scale
    per phrase max_{½ s ΔWᵀMΔW ≤ budget} mean_{e ∈ phrase} (−⟨a_e, ΔW⟩) = √(2·budget·1ᵀK1 / s) / |phrase|
K = C M⁻¹ Cᵀ is WFLD's dual Gram. A phrase that cannot reach its target is named with the binding constraint:
`no train events`, `anchors' span` (its keys ≥ max_removed inside it), or `KL budget` (needed > reachable).
With soft anchors (FTPO, the default method: its anchors are penalties, they remove no direction of f) the bound
is the same problem with B = I — nothing blocked, only the budget binds; the anchors' rank and the share of each
key inside their span are still reported (what WFLD, whose anchors are exact, would be bound by).

Notation for shapes: E train events, m = E rows, n hidden, f width, f' null-space dimension.
Precision: f64 for every solve step, f32 forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from l47.data.uncertainty import POOLED, phrase_intervals
from l47.model.weights import TailWeights
from l47.solvers.anchors import word_null_cost
from l47.solvers.ftpo import needed_drop
from l47.solvers.batch import Batch, EventTerms, batch_mix, ys_grad_mix
from l47.solvers.wfld import (WfldConfig, _dual_gram, _nnls_dual, anchor_basis, background_kl, eigen_metric,
                               span_share)

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
    # mean base p(rejected) over its train (dev) events with its 90 % interval bootstrapped over documents:
    # {value, interval: [lo, hi] | None (< 2 documents), n_events, n_docs}; None without events of that set
    p_base_train: dict | None = None
    p_base_dev: dict | None = None


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
    anchors_soft: bool = False  # True: the bound is without the anchors' span (FTPO's anchors are soft)

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
    keeps its share of the rest. f64. The solver's own `needed_drop` (one definition, 1 − p floored at the f32
    logits' resolution 1e-6): clipped at 1 − 1e-12 here before, a train event whose p f32 rounds to ≥ 1 asked 27.6
    nats, and model2's "above and beyond" (mean need 14.1 nats, reachable 15.1) read as unreachable at 16.9."""
    return needed_drop(p, target)


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


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads of one selection (built by solvers/solve.py `check_feasible`)."""
    phrases: list[str]
    counts: dict[str, dict]  # phrase -> {set name: events}
    p_base: dict[str, float]  # phrase -> mean base p(rejected) over its train + dev events
    events: Batch | None  # the train events [E]
    event_phrase: list[str]  # [E] the phrase of each train event
    event_p: np.ndarray  # [E] base p(rejected) of each train event
    terms: EventTerms
    background: Batch
    anchors: Batch | None
    anchor_words: list[str]  # one label per anchor row (turn ends included, labelled as such)
    turn_ends: int
    target: float  # residual ratio aimed at per phrase
    kl_budget: float  # nats, mean background KL
    event_doc: list[str] = field(default_factory=list)  # [E] the document (sha256) of each train event
    dev: list[dict] = field(default_factory=list)  # the dev events: {doc_sha256, phrase, p_base}


def base_p_intervals(rows: list[dict]) -> dict[str, dict]:
    """phrase -> {value, interval, n_events, n_docs}: the mean base p(rejected) over the phrase's event rows
    ({doc_sha256, phrase, p_base}) and its interval bootstrapped over documents (l47.data.uncertainty)."""
    out = phrase_intervals(rows, num="p_base", den=None)
    out.pop(POOLED)
    return out


@dataclass
class _Joint:
    """The least-KL ΔW reaching every train event's needed gap on the linearised problem (all phrases at once)."""
    K: torch.Tensor | None = None  # [E, E] the dual Gram: ½KL of the min-norm step is ½ μᵀKμ
    min_kl: float = float("inf")  # ½ μᵀKμ, the metric's KL (inf: no event can move)
    exact_kl: float = float("nan")  # the exact streamed background KL of that ΔW
    scale: float = 1.0  # exact_kl / min_kl: the factor the reachable figures are corrected by
    contrib: np.ndarray | None = None  # [E] each event's share ½ μ_e (Kμ)_e of min_kl
    tail_mass: float = float("nan")


PLAN_RIDGE = 1e-6  # ρ relative to mean(γ)·mean(α): only keeps M invertible


def feasibility(w: TailWeights, inp: PlanInputs, cfg: WfldConfig = WfldConfig(),
                soft_anchors: bool = False) -> FeasibilityPlan:
    """The plan (module docstring) of the selection `inp`, with WFLD's settings for the anchors' span and the
    metric (anchor_tol, max_removed, fisher_topk, fisher_tail_samples). soft_anchors: the solver's anchors are
    penalties (FTPO), so the reachable figures are computed without their span (B = I, no event blocked)."""
    B, rank = anchor_basis(inp.anchors, w.f, cfg.anchor_tol, w.device)  # [f, f']
    an = inp.anchors
    words = word_null_cost(an.hh, inp.anchor_words, cfg.anchor_tol) if an is not None and an.P else {}
    movable = inp.events is not None and inp.events.P
    share = span_share(inp.events.hh, B).cpu().numpy() if movable else np.zeros(0)  # [E]
    d_need = needed_gap(inp.event_p, inp.target) if len(inp.event_p) else np.zeros(0)
    blocked = share > cfg.max_removed
    notes: list[str] = []
    if soft_anchors:
        if blocked.any():
            notes.append(f"{int(blocked.sum())} of {len(blocked)} train events lie ≥ {cfg.max_removed:.0%} inside the "
                         f"anchors' span: exact anchors (WFLD) could not move them; FTPO's soft anchors can")
        B, blocked = torch.eye(w.f, dtype=B.dtype, device=B.device), np.zeros_like(blocked)  # [f, f] nothing blocked
    joint = _joint(w, inp, B, cfg, d_need, blocked, notes) if movable else _Joint()
    out = [_phrase_plan(ph, inp, share, blocked, d_need, joint) for ph in inp.phrases]
    train = base_p_intervals([{"doc_sha256": d, "phrase": ph, "p_base": float(p)}
                              for d, ph, p in zip(inp.event_doc, inp.event_phrase, inp.event_p)])
    dev = base_p_intervals(inp.dev)
    out = [replace(p, p_base_train=train.get(p.phrase), p_base_dev=dev.get(p.phrase)) for p in out]
    if math.isfinite(joint.exact_kl) and joint.exact_kl > inp.kl_budget:
        notes.append(f"the least-KL edit reaching every phrase's linearised target has an exact background KL of "
                     f"{joint.exact_kl:.3g} nats > the budget {inp.kl_budget:.3g}")
    return FeasibilityPlan(target=inp.target, kl_budget=inp.kl_budget, f=w.f, anchors=0 if an is None else an.P,
                           anchor_rank=rank, turn_ends=inp.turn_ends, null_dim=w.f - rank, words=words, phrases=out,
                           joint_min_kl=joint.min_kl, joint_exact_kl=joint.exact_kl, metric_scale=joint.scale,
                           fisher_tail_mass=joint.tail_mass, notes=notes, anchors_soft=soft_anchors)


def _joint(w: TailWeights, inp: PlanInputs, B: torch.Tensor, cfg: WfldConfig, d_need: np.ndarray,
           blocked: np.ndarray, notes: list[str]) -> _Joint:
    """The linearised problem in the metric's eigenbases (WFLD's machinery, at the base), its least-KL solution
    through the dual (NNLS) over the events not blocked by the anchors' span, and that ΔW's exact KL."""
    ev = inp.events
    m = eigen_metric(inp.background, w, w.W_sd, B, ev.hh, cfg, PLAN_RIDGE)
    D = m.inverse_diag()  # [n, f'] (M = ρI + A'⊗G; ρ only keeps it invertible)
    Gh = _gap_grads(ev, inp.terms, w) @ m.UG  # [E, n]
    out = _Joint(K=_dual_gram(Gh, m.Hh, D, np.arange(ev.P)), tail_mass=m.tail_mass)  # K [E, E]
    act = np.nonzero(~blocked)[0]
    if not len(act):
        return out
    Ka = out.K[np.ix_(act, act)] if len(act) < ev.P else out.K
    mu = _nnls_dual(torch.as_tensor(Ka), -d_need[act])
    Kmu = Ka.cpu().numpy() @ mu
    out.min_kl = 0.5 * float(mu @ Kmu)
    out.contrib = np.zeros(ev.P)
    out.contrib[act] = 0.5 * mu * Kmu
    # the least-KL ΔW itself, and its EXACT background KL: the linearised metric's scale along it
    at = torch.as_tensor(act, device=w.device)
    mu_t = torch.as_tensor(mu, dtype=torch.float64, device=w.device)
    Yhat = -D * (Gh[at].T @ (mu_t[:, None] * m.Hh[at]))  # [n, f']
    dW = (m.UG @ Yhat @ m.UA.T @ B.T).to(torch.float32)  # [n, f]
    with torch.no_grad():
        mix0 = batch_mix(inp.background, w)
    out.exact_kl = background_kl(inp.background, w, dW, mix0)
    if out.min_kl > 0 and out.exact_kl > 0:
        out.scale = out.exact_kl / out.min_kl
    bad_fit = float(np.max(d_need[act] - Kmu, initial=-np.inf))  # > 0: a target the dual did not meet
    if bad_fit > 1e-3 * max(1.0, float(d_need.max(initial=0))):
        notes.append(f"the linearised targets are not all reachable even without a budget (short by "
                     f"{bad_fit:.3g} nats): a direction is missing from the null space")
    return out


def _phrase_plan(ph: str, inp: PlanInputs, share: np.ndarray, blocked: np.ndarray, d_need: np.ndarray,
                 joint: _Joint) -> PhrasePlan:
    """One phrase's row: needed vs reachable mean gap (this phrase alone within the KL budget, the metric scaled
    to the exact KL at the joint solution; blocked events contribute no reduction) and the binding constraint."""
    idx = np.asarray([i for i, q in enumerate(inp.event_phrase) if q == ph], dtype=np.int64)
    pb = float(inp.p_base.get(ph, float("nan")))
    if not len(idx):
        return PhrasePlan(ph, inp.counts.get(ph, {}), pb, float("nan"), float("nan"), float("nan"), float("nan"), 0,
                          0.0, 1.0, 0.0, BINDING_EVENTS)
    ok = idx[~blocked[idx]]
    if len(ok) and joint.K is not None:
        s = float(joint.K[np.ix_(ok, ok)].sum())
        reach = math.sqrt(max(2.0 * inp.kl_budget * s / joint.scale, 0.0)) / len(idx)
    else:
        reach = 0.0
    need = float(d_need[idx].mean())
    resid = residual_after(float(np.mean(inp.event_p[idx])), reach)
    jshare = float(joint.contrib[idx].sum() / joint.min_kl) if joint.contrib is not None and joint.min_kl > 0 else 0.0
    if blocked[idx].all():
        binding = BINDING_SPAN
    elif reach < need:
        binding = BINDING_SPAN if blocked[idx].mean() > 0.5 else BINDING_KL
    else:
        binding = BINDING_NONE
    return PhrasePlan(ph, inp.counts.get(ph, {}), pb, need, float(d_need[idx].max()), float(share[idx].mean()),
                      float(share[idx].max()), int(blocked[idx].sum()), reach, resid, jshare, binding)
