"""The registry of solve methods: each a `Solver` (solvers/problem.py) — WFLD (closed form, exact anchors) and FTPO
(the trainer, soft anchors). Every method-specific choice of the solve lives here: what the selection takes, the
sweep's grid, how a posed problem becomes the solver's own problem. Nothing else reads a method's name.

Sweep grids (docs/SOLVERS.md "Sweep"), t the configured target residual and B the solve's KL budget:
    FTPO  (target_residual, kl_budget) = (t, B/2), (t, B), (t/2, B), (t/2, 3B/2)
    WFLD  margin = ln(1/t') nats for t' = 2t, t, t/2 (t' capped at 0.9): the log-odds drop that takes an event
          to t' of its base odds
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from l47.data import record as rec
from l47.errors import L47Error
from l47.model import names
from l47.model.weights import weights_to
from l47.solvers.batch import EventTerms, batch_to
from l47.solvers.ftpo import FtpoProblem, train_ftpo
from l47.solvers.problem import Problem, Solution, Solver
from l47.solvers.select import SelectionPolicy
from l47.solvers.wfld import solve_wfld

FTPO_GRID = ((1.0, 0.5), (1.0, 1.0), (0.5, 1.0), (0.5, 1.5))  # (× target residual, × KL budget)
WFLD_GRID = (2.0, 1.0, 0.5)  # × target residual -> margin ln(1 / t')
WFLD_MAX_TARGET = 0.9


@dataclass(frozen=True)
class Wfld:
    """WFLD (solvers/wfld.py): exact anchors, a strided background sample for its Fisher, no dev judging."""

    name: str = "wfld"
    needs_dev: bool = False
    soft_anchors: bool = False
    tethers: bool = False

    def policy(self, cfg) -> SelectionPolicy:
        return SelectionPolicy(background_cap=int(cfg.max_background), background_with_train=False, judges_dev=False)

    def grid(self, cfg, budget: float) -> list[dict]:
        t = cfg.target_residual
        return [{"wfld": {"margin": math.log(1.0 / min(WFLD_MAX_TARGET, t * a))}} for a in WFLD_GRID]

    def solve(self, problem: Problem, cfg, log: Callable[[str], None],
              progress: Callable[[dict], None] | None = None) -> Solution:
        """WFLD within the problem's KL budget (every accepted iterate's exact background KL within it, of the
        float ΔW and re-quantised as shipped; solvers/wfld.py), on the CPU when the device has no float64 (MPS:
        WFLD's algebra is f64)."""
        plan, dev = problem.plan, problem.plan.w.device
        w, t = plan.w, problem.terms
        if w.numerics.no_f64:
            w, t = weights_to(w, "cpu"), EventTerms(t.rejected.cpu(), t.chosen.cpu(), t.special.cpu(), t.scale.cpu())
        on = (lambda b: b) if w is plan.w else (lambda b: batch_to(b, "cpu"))
        budget = dataclasses.replace(problem.kl_budget, shipped=lambda dW: problem.ship(dW.to(dev)).W_q.to(w.device))
        res = solve_wfld(w, on(problem.events), t, on(problem.background), on(problem.protected), cfg.wfld, log=log,
                         budget=budget)
        conv = rec.Convergence(stop_reason=res.stop_reason, max_violation=res.violation,
                               violation_tol=res.tolerance, iterations=len(res.iterations) - 1)
        if res.violation > res.tolerance:
            log(f"warning: WFLD ended with a max constraint violation of {res.violation:.3g} nats > tolerance "
                f"{res.tolerance:g} ({res.stop_reason}; exact background KL {res.exact_bg_kl:.3g}, budget "
                f"{budget.nats:.3g})")
        return Solution(res.dW.to(dev), res.summary(), res.predicted_bg_kl, conv)


@dataclass(frozen=True)
class Ftpo:
    """FTPO (solvers/ftpo/): soft anchors, every background row up to `kl_rows`, candidates judged on dev."""

    name: str = "ftpo"
    needs_dev: bool = True
    soft_anchors: bool = True
    tethers: bool = True

    def policy(self, cfg) -> SelectionPolicy:
        own = ("train", "background") if cfg.ftpo.own_anchors else ()
        return SelectionPolicy(background_cap=int(cfg.ftpo.kl_rows), background_with_train=True, judges_dev=True,
                               anchor_sets=("collateral_anchor",) + own)

    def grid(self, cfg, budget: float) -> list[dict]:
        t = cfg.target_residual
        return [{"target_residual": t * a, "kl_budget": budget * b} for a, b in FTPO_GRID]

    def solve(self, problem: Problem, cfg, log: Callable[[str], None],
              progress: Callable[[dict], None] | None = None) -> Solution:
        step = None if progress is None else (lambda r: progress({**r, "steps": cfg.ftpo.steps}))
        res = train_ftpo(problem.plan.w, ftpo_problem(problem, cfg), cfg.ftpo, progress=step)
        return Solution(res.dW, {**res.summary(), "warnings": res.notes}, None, res.convergence(cfg.target_residual))


def ftpo_problem(problem: Problem, cfg) -> FtpoProblem:
    """The trainer's problem: soft anchors with tolerances from the bars ((d) per word, (f) at turn ends), dev
    events with their phrases, the target and budget, and the re-quantisation map (candidates judged as shipped)."""
    sel, th, w = problem.selection, problem.plan.exp.thresholds, problem.plan.w
    n_te = len(sel.turn_ends)
    groups = [c.word for c in sel.anchors] + [names.IM_END] * n_te
    tols = [abs(th.collateral_word_mean)] * len(sel.anchors) + [abs(th.im_end_dlogp)] * n_te
    dev_final = torch.as_tensor([e.final for e in sel.dev], device=w.device) if problem.dev is not None else None
    return FtpoProblem(events=problem.events, terms=problem.terms, phrase=[e.phrase for e in sel.train],
                       background=problem.background, target_residual=cfg.target_residual,
                       kl_budget=problem.kl_budget.nats, anchors=problem.protected, anchor_group=groups,
                       anchor_tol=tols, turn_ends=n_te, near=problem.near, near_banned=problem.near_banned,
                       dev=problem.dev, dev_final=dev_final, dev_phrase=[e.phrase for e in sel.dev],
                       dev_rows=problem.dev_rows, guard=problem.guard, word_below=th.collateral_below,
                       word_frac_below=th.collateral_frac_below, special_tol=th.special_rise_tol, im_end=sel.im_end,
                       im_end_tol=abs(th.im_end_dlogp), dev_kl_limit=th.chat_kld,
                       shipped=lambda dW: problem.ship(dW).W_q)


SOLVERS: dict[str, Solver] = {s.name: s for s in (Wfld(), Ftpo())}
METHODS = tuple(SOLVERS)  # ("wfld", "ftpo")


def solver_for(method: str, where: str = "solver") -> Solver:
    """The registered Solver of `method`; L47Error naming the field when there is none."""
    if method not in SOLVERS:
        raise L47Error(where, "method ([solver] method or --method)", f"one of {METHODS}", repr(method))
    return SOLVERS[method]
