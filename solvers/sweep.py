"""`l47 solve --sweep`: a small grid of candidates, each solved, re-quantised as shipped and judged on DEV only.

    run_sweep = pose                the plain solve's steps up to the problem (solvers/problem.py), once
              → grid                the candidates: a few solver settings relative to the configured target and
                                    KL budget (never tuned to a model; the solver's `grid`, solvers/methods.py)
              → per candidate       check_feasible → solve_and_measure (the plain solve's one path: solve,
                                    Q8_0 re-quantise, exact measure) → its dev figures
              → choose              the most removal inside the KL budget, on the measured frontier
              → write_outputs       the chosen candidate's bundle and record (+ every candidate), the table

The grid (docs/SOLVERS.md "Sweep"; each solver's `grid` in solvers/methods.py), with t the configured target
residual and B the problem's KL budget (`Problem.kl_budget`, resolved once):
    FTPO  (target_residual, kl_budget) = (t, B/2), (t, B), (t/2, B), (t/2, 3B/2)
    WFLD  margin = ln(1/t') nats for t' = 2t, t, t/2 (t' capped at 0.9): the log-odds drop that takes an event
          to t' of its base odds
Held-out is never read here: it is scored only by `l47 audit`. The chosen candidate's bundle is the one a plain
`l47 solve` with its overrides in [solver] writes (same bytes).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from l47.data import record as rec
from l47.data.uncertainty import POOLED, residual_intervals
from l47.errors import L47Error
from l47.fileio import write_text_atomic
from l47.solvers.ftpo import removal_score
from l47.solvers.methods import FTPO_GRID, WFLD_GRID, WFLD_MAX_TARGET, solver_for  # noqa: F401 (the grids: re-exported)
from l47.solvers.problem import pose
from l47.solvers.solve import check_feasible, describe_feasibility, plan_solve, solve_and_measure, write_outputs

RULE = ("among the candidates whose exact background KL is within the budget: the most dev removal (mean over "
        "phrases of log max(dev residual, target residual), FTPO's kept-step score), then the lowest worst-phrase "
        "dev residual, then the lowest KL (a lexicographic minimum, so no candidate tried is at least as good on "
        "all three and better on one); none within: the least KL")
TABLE_COLUMNS = ("candidate", "overrides", "background_kl_exact", "dev_removal", "dev_residual", "dev_residual_lo",
                 "dev_residual_hi", "dev_residual_worst", "within_budget", "on_frontier", "chosen", "stop_reason")


def sweep_paths_for(bundle: Path) -> tuple[Path, Path]:
    """(plot, table) beside the bundle: <bundle>.sweep.png, <bundle>.sweep.tsv."""
    bundle = Path(bundle)
    return bundle.with_name(bundle.name + ".sweep.png"), bundle.with_name(bundle.name + ".sweep.tsv")


def grid(cfg, budget: float) -> list[dict]:
    """The candidates' overrides of the resolved SolveConfig `cfg` (module docstring); `budget` is B."""
    return solver_for(cfg.method).grid(cfg, budget)


def apply_overrides(cfg, ov: dict):
    """cfg with a candidate's overrides (top-level keys; "wfld" / "ftpo" sub-tables)."""
    top = {k: v for k, v in ov.items() if k not in ("wfld", "ftpo")}
    sub = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in ov.items() if k in ("wfld", "ftpo")}
    return dataclasses.replace(cfg, **top, **sub)


# ----------------------------------------------------------------------------------------------------------
# the choice (pure functions of the measured figures)


def dev_figures(claims: rec.SolveClaims, target: float) -> tuple[float, float, float, dict[str, float]]:
    """(removal score, pooled, worst phrase, per phrase) of a candidate's claims: dev residual p_after / p_before
    per phrase; the score is FTPO's (l47.solvers.ftpo.removal_score: mean over phrases of log max(residual,
    target); lower = more removal, a phrase below the target counts as at it)."""
    d = claims.dev_p_rejected
    per = {ph: d.per_phrase_after[ph] / b for ph, b in d.per_phrase_before.items() if b > 0}
    return removal_score(per, target), d.after / d.before, max(per.values()), per


def _key(c: rec.SweepCandidate) -> tuple[float, float, float]:
    return (c.dev_removal, c.dev_residual_worst, c.background_kl_exact)


def dominated(c: rec.SweepCandidate, others: list[rec.SweepCandidate]) -> bool:
    """Some other candidate has ≤ removal score, ≤ worst-phrase residual and ≤ KL, and < in one of them."""
    k = _key(c)
    return any(all(a <= b for a, b in zip(_key(o), k)) and _key(o) != k for o in others if o is not c)


def choose(cands: list[rec.SweepCandidate], budget: float) -> tuple[list[rec.SweepCandidate], str]:
    """Mark within_budget, on_frontier and chosen (RULE); returns the marked candidates and the reason."""
    cands = [dataclasses.replace(c, within_budget=c.background_kl_exact <= budget) for c in cands]
    cands = [dataclasses.replace(c, on_frontier=not dominated(c, cands)) for c in cands]
    inside = [c for c in cands if c.within_budget]
    if inside:
        best = min(inside, key=_key)
        worst_ph = max(best.dev_residual_per_phrase, key=best.dev_residual_per_phrase.get)
        why = (f"{best.name}: the most dev removal (score {best.dev_removal:.4g}; worst phrase "
               f"{best.dev_residual_worst:.4g} {worst_ph!r}, pooled {best.dev_residual:.4g}) of the {len(inside)} of "
               f"{len(cands)} candidates within the KL budget {budget:.4g} (its exact background KL "
               f"{best.background_kl_exact:.4g})")
    else:
        best = min(cands, key=lambda c: (c.background_kl_exact,) + _key(c))
        why = (f"{best.name}: no candidate is within the KL budget {budget:.4g}; the least-KL one "
               f"({best.background_kl_exact:.4g}, worst-phrase dev residual {best.dev_residual_worst:.4g})")
    return [dataclasses.replace(c, chosen=c is best) for c in cands], why


# ----------------------------------------------------------------------------------------------------------
# the table


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _lo_hi(iv) -> list[float]:
    """An interval's two ends; nan, nan when there is none (fewer than 2 dev documents)."""
    return [float("nan")] * 2 if iv is None else list(iv)


def table_text(sw: rec.SweepRecord) -> str:
    """The sweep as TSV: one row per candidate, every number as the record holds it (repr of the float), then
    three columns per phrase (dev residual of that phrase and its interval's ends over dev documents)."""
    phrases = sorted({ph for c in sw.candidates for ph in c.dev_residual_per_phrase})
    lines = ["\t".join(TABLE_COLUMNS + tuple(f"dev_residual{k}[{ph}]" for ph in phrases for k in ("", "_lo", "_hi")))]
    for c in sw.candidates:
        row = [c.name, json.dumps(c.overrides, sort_keys=True), c.background_kl_exact, c.dev_removal, c.dev_residual,
               *_lo_hi(c.dev_residual_interval), c.dev_residual_worst, c.within_budget, c.on_frontier, c.chosen,
               c.stop_reason or ""]
        for ph in phrases:
            row += [c.dev_residual_per_phrase.get(ph, float("nan")),
                    *_lo_hi(c.dev_residual_interval_per_phrase.get(ph))]
        lines.append("\t".join(_num(x) for x in row))
    return "\n".join(lines) + "\n"


def read_table(path: Path) -> list[dict[str, str]]:
    """The TSV back as one dict per row (header -> cell)."""
    head, *rows = Path(path).read_text(encoding="utf-8").splitlines()
    cols = head.split("\t")
    return [dict(zip(cols, r.split("\t"))) for r in rows]


# ----------------------------------------------------------------------------------------------------------
# the driver


def _candidate(name: str, ov: dict, m, target: float) -> rec.SweepCandidate:
    """A candidate's dev figures from its Measured (claims, and the dev event rows for the intervals over
    documents: l47.data.uncertainty.residual_intervals)."""
    score, pooled, worst, per = dev_figures(m.claims, target)
    iv = residual_intervals(m.dev_rows)
    cv = m.claims.convergence
    return rec.SweepCandidate(name=name, overrides=ov, background_kl_exact=m.claims.background_kl_exact,
                              dev_removal=score, dev_residual=pooled, dev_residual_worst=worst, dev_residual_per_phrase=per,
                              within_budget=False, on_frontier=False, chosen=False,
                              stop_reason=None if cv is None else cv.stop_reason,
                              dev_residual_interval=iv[POOLED]["residual_interval"],
                              dev_residual_interval_per_phrase={ph: iv[ph]["residual_interval"] for ph in per})


def _step_progress(progress, name: str, i: int, n: int):
    if progress is None:
        return None
    return lambda r: progress({**r, "candidate": name, "candidate_index": i, "candidates": n})


def run_sweep(args, log: Callable[[str], None], progress: Callable[[dict], None] | None):
    """Every candidate of the grid solved and judged on dev; the chosen one's bundle and record written (with
    every candidate in `record.sweep`) and the table beside the bundle. Returns the SolveResult."""
    plan = plan_solve(args)
    prob = pose(plan, solver_for(plan.cfg.method), log)
    if not prob.kept.dev:
        raise L47Error(plan.exp.path, "documents.dev", "dev documents with events (the sweep judges on dev)",
                       "no dev event")
    budget, cfg = prob.kl_budget.nats, prob.plan.cfg  # its kl_budget resolved
    ovs = grid(cfg, budget)
    cands, runs = [], []
    for i, ov in enumerate(ovs):
        name = f"c{i + 1}"
        pc = prob.with_config(apply_overrides(cfg, ov))
        feas = check_feasible(pc)
        if i == 0:
            for line in describe_feasibility(feas):
                log(line)
        log(f"sweep {name} ({i + 1}/{len(ovs)}): {ov}")
        m = solve_and_measure(pc, feas.to_dict(), log, _step_progress(progress, name, i, len(ovs)))
        cands.append(_candidate(name, ov, m, cfg.target_residual))
        runs.append((pc, m))
        c = cands[-1]
        log(f"sweep {name}: exact background KL {c.background_kl_exact:.4g}, dev removal score "
            f"{c.dev_removal:.4g}, dev residual pooled {c.dev_residual:.4g}, worst phrase {c.dev_residual_worst:.4g}")
    marked, why = choose(cands, budget)
    k = next(i for i, c in enumerate(marked) if c.chosen)
    log(f"sweep: chose {why}" if any(c.within_budget for c in marked) else f"warning: sweep: {why}")
    sw = rec.SweepRecord(budget=budget, rule=RULE, chosen=marked[k].name, reason=why, candidates=marked)
    pc, m = runs[k]
    res = write_outputs(pc, m.shipped, m.claims, sweep=sw)
    write_text_atomic(sweep_paths_for(plan.out)[1], table_text(sw))
    return res
