"""The solve's problem, posed once (`pose`): what a solver acts on, typed and frozen, and the `Solver` protocol.

    pose = select_positions   what the solve touches (solvers/select.py), by the solver's SelectionPolicy
         → fit_anchors        protected contexts within the anchors budget, chosen for span (solvers/anchors.py)
         → the batches        layer-L rows: train events and their token terms, collateral anchors, turn ends,
                              background; dev events, dev rows and near misses where the solver judges on dev
         → the KL budget      resolved ONCE (`KlBudget`): [solver] kl_budget, or KL_BUDGET_SAFETY × the tightest
                              KLD bar; the problem's config holds the resolved value (the bundle's provenance and
                              the solve record write it)

A solver with soft anchors (FTPO) acts on every collateral anchor; the feasibility plan is made on the ones kept
within the anchors budget (`Problem.kept`), what exact anchors (WFLD) would be bound by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from l47.data import record as rec
from l47.errors import L47Error
from l47.solvers.anchors import AnchorChoice, choose_anchors
from l47.solvers.batch import Batch, EventTerms, batch_cat, pick_chosen
from l47.solvers.bundle import requantize_target
from l47.solvers.select import Selection, SelectionPolicy, select_positions

if TYPE_CHECKING:
    from l47.solvers.solve import SolvePlan

KL_BUDGET_SAFETY = 0.5  # default KL budget = this × the tightest KLD bar ((e) kld_max, (g) chat_kld)


@dataclass(frozen=True)
class KlBudget:
    """The solve's background-KL budget, resolved once: no accepted candidate's mean exact background KL exceeds
    `nats`, judged on the float ΔW and, with `shipped` (ΔW [n, f] f32 → the target's runtime weights as shipped,
    re-quantised, [n, f] f32 on the weights' device), on the shipped weights too."""

    nats: float
    shipped: Callable[[torch.Tensor], torch.Tensor] | None = None


def resolve_kl_budget(configured: float, thresholds) -> float:
    """The configured KL budget (> 0), or KL_BUDGET_SAFETY × the tightest of bars (e) and (g)'s KLD limits (0)."""
    if configured > 0:
        return configured
    return KL_BUDGET_SAFETY * min(thresholds.kld_max, thresholds.chat_kld)


@dataclass(frozen=True)
class Shipped:
    raw: np.ndarray  # Q8_0 bytes of the target
    W_q: torch.Tensor  # their runtime values [n, f] f32 on the weights' device


def requantize(plan: SolvePlan, dW: torch.Tensor) -> Shipped:
    """W_sd + ΔW → the target's Q8_0 bytes and their runtime values (what ships)."""
    raw, W_q = requantize_target(plan.base_g, plan.w.target, plan.w.W_sd + dW)
    return Shipped(raw, W_q.to(plan.w.device))


@dataclass(frozen=True)
class Solution:
    """What a solver returns: the float ΔW and its diagnostics."""

    dW: torch.Tensor  # [n, f] f32, the float solution
    summary: dict  # the solver's diagnostics (the record's claims.method)
    predicted_bg_kl: float | None = None
    convergence: rec.Convergence | None = None


@dataclass(frozen=True)
class Problem:
    """Everything a solver acts on, built once from the plan (batches on the weights' device)."""

    plan: SolvePlan  # the inputs: experiment, weights, sets report, dumps, config
    solver: Solver  # the method's registered solver (solvers/methods.py)
    selection: Selection  # the positions the solver acts on (and the record lists as touched)
    kept: Selection  # ... with the collateral anchors kept within the anchors budget (the feasibility plan's)
    choice: AnchorChoice | None  # what fit_anchors kept
    events: Batch  # one row per train event, in selection order
    terms: EventTerms
    anchors: Batch | None  # the selection's collateral anchors
    kept_anchors: Batch | None  # the kept selection's collateral anchors (anchors itself without soft anchors)
    turn_ends: Batch | None  # real turn ends (target <|im_end|>) of the solver's chats, protected
    background: Batch
    kl_budget: KlBudget  # resolved once (nats; its `shipped` judges candidates as they ship)
    dev: Batch | None = None  # dev events (a solver that judges on dev)
    near: Batch | None = None  # near misses: prefix rows whose target is not the banned final (FTPO's tether)
    near_banned: torch.Tensor | None = None  # [N] the banned final token at each near miss
    dev_rows: Batch | None = None  # dev documents away from prefix rows (FTPO's judge: KL and flips)
    guard: Batch | None = None  # slop events of the background documents (FTPO: Σ p(special) guarded and judged)

    @cached_property
    def protected(self) -> Batch | None:
        """The collateral anchors, then the turn ends, as one batch (exact anchors: WFLD; the claims)."""
        return _cat(self.anchors, self.turn_ends)

    @cached_property
    def kept_protected(self) -> Batch | None:
        """The kept collateral anchors, then the turn ends (the feasibility plan's anchors)."""
        return self.protected if self.kept_anchors is self.anchors else _cat(self.kept_anchors, self.turn_ends)

    def ship(self, dW: torch.Tensor) -> Shipped:
        return requantize(self.plan, dW)

    def with_config(self, cfg) -> Problem:
        """The same problem under another SolveConfig (a sweep candidate's overrides): its KL budget resolved."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, cfg=cfg),
                                   kl_budget=KlBudget(resolve_kl_budget(cfg.kl_budget, self.plan.exp.thresholds)))


def _cat(a: Batch | None, b: Batch | None) -> Batch | None:
    """a's rows then b's, with their provenance (None when neither)."""
    parts = [x for x in (a, b) if x is not None]
    if len(parts) < 2:
        return parts[0] if parts else None
    return dataclasses.replace(batch_cat(parts), doc=a.doc + b.doc, pos=a.pos + b.pos)


class Solver(Protocol):
    """A solve method (solvers/methods.py registers them). `policy`: what its selection takes; `grid`: its sweep
    candidates' overrides (solvers/sweep.py); `solve`: the float ΔW of a posed problem."""

    name: str
    needs_dev: bool  # dev events and rows are judged inside the solve (their batches are built)
    soft_anchors: bool  # anchors are penalties: every collateral anchor kept; the plan's bound is without their span
    tethers: bool  # chosen alternatives and near misses are tethered (touched terms of the record)

    def policy(self, cfg) -> SelectionPolicy: ...

    def grid(self, cfg, budget: float) -> list[dict]: ...

    def solve(self, problem: Problem, cfg, log: Callable[[str], None],
              progress: Callable[[dict], None] | None = None) -> Solution: ...


# ----------------------------------------------------------------------------------------------------------
# pose


def fit_anchors(plan: SolvePlan, sel: Selection, log) -> tuple[Selection, AnchorChoice | None]:
    """Protected contexts within `anchors_budget` of f: when the collateral anchors and turn ends span more, keep
    every turn end and then the collateral anchors that span the most (pivoted QR); the rest are dropped (they
    stay scored by the audit's collateral bars). Returns the thinned selection and what was kept."""
    cfg, w = plan.cfg, plan.w
    cand = plan.dumps.batch([(c.doc_sha256, c.pos) for c in sel.anchors] + sel.turn_ends)
    if cand is None:
        return sel, None
    budget = int(np.floor(cfg.anchors_budget * w.f))
    n_col = len(sel.anchors)
    must = list(range(n_col, cand.P))  # turn ends of the solver's own chats: always kept
    choice = choose_anchors(cand.hh, must, budget, tol=cfg.wfld.anchor_tol)
    kept_col = sorted(i for i in choice.kept if i < n_col)
    if len(must) > budget:  # turn ends are kept whatever the budget; collateral only where it adds span
        log(f"anchors: the {len(must)} turn ends alone exceed the anchors budget {budget} "
            f"(= {cfg.anchors_budget:g} × f = {w.f}); all kept, and {len(kept_col)} of {n_col} collateral anchors "
            f"(those that add span beyond them, rank {choice.rank})")
    elif len(kept_col) < n_col:
        log(f"anchors: {n_col} collateral + {len(must)} turn ends would span more than the budget {budget} "
            f"(= {cfg.anchors_budget:g} × f); kept {len(kept_col)} collateral anchors chosen for span, rank "
            f"{choice.rank}; the dropped ones keep ≤ {choice.uncovered:.0%} of their key outside the kept span")
    return dataclasses.replace(sel, anchors=[sel.anchors[i] for i in kept_col]), choice


def event_terms(plan: SolvePlan, sel: Selection, ev: Batch) -> EventTerms:
    """The train events' token terms: rejected final, chosen natural alternatives, special tokens, margin scale."""
    w = plan.w
    rejected = torch.as_tensor([e.final for e in sel.train], device=w.device)
    chosen = pick_chosen(ev, w, rejected, sel.special, k=plan.cfg.n_chosen)
    scale_of = {p.phrase: float(p.margin_scale) for p in plan.report.phrases}
    return EventTerms(rejected=rejected, chosen=chosen, special=torch.as_tensor(sel.special, dtype=torch.long),
                      scale=torch.as_tensor([scale_of.get(e.phrase, 1.0) for e in sel.train], device=w.device))


def pose(plan: SolvePlan, solver: Solver, log: Callable[[str], None]) -> Problem:
    """The steps `l47 solve`, `l47 solve --sweep` and `l47 plan` share: select every position (the solver's
    policy) -> anchors within budget -> the problem's batches, the KL budget resolved once."""
    every = select_positions(plan.report, plan.cfg, solver.policy(plan.cfg), plan.exp.path, plan.dumps.tokens)
    kept, choice = fit_anchors(plan, every, log)
    dumps, w = plan.dumps, plan.w
    ev = dumps.batch([(e.doc_sha256, e.pos) for e in kept.train])
    if ev.doc != tuple(e.doc_sha256 for e in kept.train) or ev.pos != tuple(e.pos for e in kept.train):
        raise L47Error("solve", "train events", "one batch row per event, in event order", "a different order")
    terms = event_terms(plan, kept, ev)

    def rows(pairs):
        return dumps.batch(list(pairs)) if pairs else None

    kept_an = rows((c.doc_sha256, c.pos) for c in kept.anchors)
    sel, an = kept, kept_an
    if solver.soft_anchors and len(every.anchors) > len(kept.anchors):
        log(f"{solver.name}: every collateral anchor kept as a soft anchor ({len(every.anchors)})")
        sel, an = every, rows((c.doc_sha256, c.pos) for c in every.anchors)
    dev = near = near_banned = dev_rows = guard = None
    if solver.needs_dev:
        dev = rows((e.doc_sha256, e.pos) for e in kept.dev)
        dev_rows = rows(kept.dev_rows)
        guard = rows((e.doc_sha256, e.pos) for e in kept.guard)
    if solver.tethers and kept.near:
        near = rows((s, r) for s, r, _ in kept.near)
        near_banned = torch.as_tensor([b for _, _, b in kept.near], device=w.device)
    budget = KlBudget(resolve_kl_budget(plan.cfg.kl_budget, plan.exp.thresholds))
    plan = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, kl_budget=budget.nats))  # written resolved
    prob = Problem(plan, solver, sel, kept, choice, ev, terms, an, kept_an, rows(kept.turn_ends), dumps.batch(kept.background),
                   budget, dev, near, near_banned, dev_rows, guard)
    log(describe(prob))
    return prob


def describe(prob: Problem) -> str:
    sel = prob.kept
    n_an = sum(0 if b is None else b.P for b in (prob.kept_anchors, prob.turn_ends))
    return (f"solve: {len(sel.train)} train events, {len(sel.dev)} dev events, {len(sel.near)} near misses, "
            f"{n_an} anchors ({len(sel.turn_ends)} of them turn ends of "
            f"the solver's chats), {prob.background.P} background positions "
            f"({'every row' if sel.stride == 1 else f'one row in {sel.stride}'} of {sel.background_total}, prefix rows "
            f"left out) from {sel.background_docs} documents")
