"""The solve-time estimate (solvers/estimate.py `Estimate`) as text: one headline line and the per-step parts."""

from __future__ import annotations

import math

from l47.solvers.estimate import estimate_solve
from l47.solvers.solve import run_plan


def human(seconds: float) -> str:
    """'8.0 s', '42 s', '3.5 min', '2.1 h', '3.2 days'."""
    if not math.isfinite(seconds):
        return "∞"
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def estimate_lines(est) -> list[str]:
    """The headline (total, machine, precision, why it is an upper bound) and the per-step parts."""
    u = est.units
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in est.per_step.items())
    bound = "; the step cap: an upper bound on the steps" if est.upper_bound else ""
    return [f"estimated solve time on this machine ({u.device}, {u.threads} threads, head {u.precision}): "
            f"≈ {human(est.total_s)} ({est.method}: {human(est.setup_s)} setup + up to {est.steps} steps × "
            f"{est.step_s:.3g} s{bound})",
            f"  per step: {parts}; {est.note}; measured on {u.probe_rows} rows × {u.probe_vocab:,} head rows, "
            f"linear in V"]


def plan_and_estimate(args, log):
    """`l47 plan`'s work: solvers/solve.py `run_plan` (plan_solve → pose → check_feasible → its hand-off), then the
    solve-time estimate of the posed problem on this machine. Returns (PlanRun, Estimate)."""
    run = run_plan(args, log)
    return run, estimate_solve(run.problem)


def estimate_dict(est) -> dict:
    """The estimate as JSON-ready numbers (the plan's --json)."""
    from dataclasses import asdict

    return {"method": est.method, "total_s": est.total_s, "setup_s": est.setup_s, "steps": est.steps,
            "step_s": est.step_s, "per_step": dict(est.per_step), "upper_bound": est.upper_bound, "note": est.note,
            "units": asdict(est.units)}
