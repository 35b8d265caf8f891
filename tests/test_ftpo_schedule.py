"""FTPO's schedule as pure functions, checked with numbers worked by hand: the multipliers follow their constraints
both ways (next_multiplier), and each phrase's reason for standing where the solve left it (phrase_stops, with
the residual's trend at a step cap)."""

import math

import numpy as np
import pytest

from l47.solvers.ftpo import (BIND_DEV_KL, BIND_FLIPS, BIND_KL, STOP_TARGET, next_multiplier, phrase_stops,
                              residual_trend)


def test_next_multiplier_doubles_when_violated_halves_with_slack_never_below_its_floor():
    assert next_multiplier(1.0, 1.0, violated=True, slack=False, relax=0.5) == 2.0
    assert next_multiplier(8.0, 1.0, violated=False, slack=True, relax=0.5) == 4.0
    assert next_multiplier(1.5, 1.0, violated=False, slack=True, relax=0.5) == 1.0  # floored at the initial value
    assert next_multiplier(8.0, 1.0, violated=False, slack=False, relax=0.5) == 8.0  # within, no slack: kept
    assert next_multiplier(8.0, 1.0, violated=False, slack=True, relax=0.0) == 8.0  # relax 0: only ever rises
    assert next_multiplier(6e5, 1.0, violated=True, slack=False, relax=0.5) == 1e6  # capped


def _h(step, res, bad=()):
    return {"step": step, "train_residual": {"a": res}, "dev_residual": {}, "inadmissible": list(bad)}


def test_residual_trend_is_the_log_slope_of_the_last_evaluations():
    steps = list(range(0, 400, 10))
    res = [0.9 * math.exp(-0.002 * s) for s in steps]  # log-linear: slope −0.002 per step exactly, no scatter
    slope, se = residual_trend(steps, res)
    assert slope == pytest.approx(-0.002, rel=1e-9) and se == pytest.approx(0.0, abs=1e-12)
    assert residual_trend([0, 10], [1.0, 0.5]) == (0.0, 0.0)  # fewer than 3 evaluations: no trend
    # with scatter: slope and standard error against numpy's least squares (its covariance, unscaled by n − 2)
    noisy = [0.6 * math.exp(-0.0005 * s + 0.05 * math.sin(1.7 * s)) for s in steps]
    x, y = np.asarray(steps[-30:], float), np.log(noisy[-30:])
    coef, cov = np.polyfit(x, y, 1, cov="unscaled")
    r = y - np.polyval(coef, x)
    slope, se = residual_trend(steps, noisy)
    assert slope == pytest.approx(coef[0], rel=1e-9)
    assert se == pytest.approx(math.sqrt(cov[0, 0] * (r @ r) / (len(x) - 2)), rel=1e-9)


def test_phrase_stops_names_the_condition_that_rejected_better_candidates():
    t = 0.2
    hist = [_h(0, 1.0), {"step": 10, "loss": 1.0}, _h(10, 0.6), _h(20, 0.5, [BIND_FLIPS]),
            _h(30, 0.45, [BIND_FLIPS, BIND_KL]), _h(40, 0.7, [BIND_DEV_KL])]  # 40: worse than kept, not counted
    out = phrase_stops(hist, best_step=10, best_res={"a": 0.6}, target=t, stopped="iteration_cap", kl_used=0.3)
    assert out["a"].startswith(BIND_FLIPS + " binds (2 later")
    assert phrase_stops(hist, 10, {"a": 0.19}, t, "iteration_cap", 0.3)["a"] == STOP_TARGET
    # every later candidate admissible, the kept one at 85 % of the budget: the KL budget binds
    ok = [_h(0, 1.0), _h(10, 0.6), _h(20, 0.61)]
    assert phrase_stops(ok, 10, {"a": 0.6}, t, "iteration_cap", 0.85)["a"].startswith(BIND_KL + " binds (kept")


def test_phrase_stops_at_a_cap_reports_the_trend_and_the_steps_it_would_take():
    steps = list(range(0, 1010, 10))
    hist = [_h(s, 0.97 * math.exp(-0.001 * s)) for s in steps]  # still falling, every candidate admissible
    r_end = 0.97 * math.exp(-1.0)
    out = phrase_stops(hist, 1000, {"a": r_end}, 0.2, "iteration_cap", 0.2)["a"]
    more = math.log(0.2 / r_end) / -0.001  # ln(0.2 / 0.357) / −0.001 = 578.9 steps; e^−0.1 − 1 = −9.5 %
    assert f"{more:.0f}" == "579"
    assert out.startswith("iteration_cap: still falling (-9.5% per 100 steps; about 579 more steps")
    flat = [_h(s, 0.8) for s in steps]
    assert phrase_stops(flat, 1000, {"a": 0.8}, 0.2, "iteration_cap", 0.2)["a"] == (
        "iteration_cap: no longer falling; no constraint binds")
    # a plateau that wanders (±6 % between evaluations, a small dip at the end): its fitted slope over the last 30
    # evaluations is negative, but within the scatter — not "still falling"
    wander = [_h(s, 0.6 * math.exp(0.06 * math.sin(2.3 * s) - 0.00005 * s)) for s in steps]
    out = phrase_stops(wander, 1000, {"a": 0.57}, 0.2, "iteration_cap", 0.2)["a"]
    assert out.startswith("iteration_cap: no longer falling (") and "over the last 30 evaluations" in out, out
