"""WFLD's trust region (solvers/wfld.py, module docstring) on the tiny transformers model.

Independent references: the step's QP against the same QP's dual solved by scipy's L-BFGS-B (bounds μ ≥ 0), the
linearised row changes against central finite differences of the exact constraint values (the exact forward),
and the radius rule against Nocedal & Wright Alg. 4.1's thresholds written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch

import l47.solvers.wfld as wf
from l47.solvers.batch import EventTerms, pick_chosen
from l47.solvers.wfld import WfldConfig, solve_wfld
from test_solvers import tiny_rows


@pytest.fixture(scope="module")
def setup():
    w, ids, logits, mk = tiny_rows()
    lp = torch.log_softmax(logits, -1)
    ev_rows = list(range(0, 60, 3))
    rej = lp[torch.as_tensor(ev_rows)].argmax(-1)
    ev = mk(ev_rows)
    spec = [1, 2, 3, 4, 5]
    terms = EventTerms(rejected=rej, chosen=pick_chosen(ev, w, rej, spec), special=torch.tensor(spec),
                       scale=torch.ones(len(ev_rows)))
    return dict(w=w, ev=ev, terms=terms, bg=mk(list(range(150, 399))), an=mk(list(range(100, 130))))


def _step(setup, radius: float, cfg=WfldConfig(), Yk=None):
    """A trust-region QP step linearised at ΔW = 0, from the iterate Ŷ_k (Yk [n, f'], None = 0): (problem,
    constraints at 0, Ĝ, Ĥ rows, D, Ŷ, new_lin, limited, metric, cur)."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    pb = wf._problem(w, ev, terms, bg, an, cfg)
    m = wf.eigen_metric(bg, w, w.W_sd, pb.B, ev.hh, cfg, cfg.ridge)
    c = pb.constraints(torch.zeros(w.n, w.f))
    vals, grads, bounds, evr, _, _ = c
    Gh = grads @ m.UG
    Hrow = m.Hh[torch.as_tensor(evr)]
    D = m.inverse_diag(cfg.bg_weight)
    cur = np.zeros(len(vals)) if Yk is None else (Gh * (Yk @ Hrow.T).T).sum(1).numpy()
    Yhat, new_lin, limited = wf.tr_qp_step(wf.Linearised(Gh, Hrow, evr, vals, bounds, cur, Yk), m.Hh, D, radius,
                                           cfg.max_step)
    return pb, c, Gh, Hrow, D, Yhat, new_lin, limited, m, cur


@pytest.mark.parametrize("radius,from_iterate", [(0.05, False), (0.3, False), (1.0, False), (0.3, True)])
def test_step_rows_within_radius_and_qp_matches_scipy(setup, radius, from_iterate):
    Yk = None
    if from_iterate:  # an iterate: the radius-1 step from 0, then the step from it at `radius` (θ = radius)
        Yk = _step(setup, 1.0)[5]
    pb, c, Gh, Hrow, D, Yhat, new_lin, limited, _, cur = _step(setup, radius, Yk=Yk)
    vals, _, bounds, evr, _, _ = c
    move = min(WfldConfig().max_step, 0.5 * radius)
    up = np.minimum(np.maximum(bounds, vals - move) - vals, radius)
    assert np.abs(new_lin - cur).max() <= radius * (1 + 1e-6)  # the trust region, both directions
    assert (new_lin - cur <= up + 1e-6 * radius).all()  # the step's targets
    assert limited  # the margin rows' targets (2 nats away) are clipped by every radius here
    # independent reference: the dual of min ½ ‖Ŷ − c‖²_M (M = diag(1/D), c = (1 − θ) Ŷ_k) s.t.
    # [C; −C] vec(Ŷ) ≤ [up + cur; r − cur], solved by L-BFGS-B on μ ≥ 0 from the explicit rows (C_i = Ĝ_i ⊗ Ĥ_i),
    # primal Ŷ = c − D ⊙ Cᵀμ
    C = torch.einsum("ia,ib->iab", Gh, Hrow).reshape(len(vals), -1).numpy()  # [m, n f']
    C2 = np.concatenate([C, -C])
    b2 = np.concatenate([up + cur, radius - cur])
    d = D.reshape(-1).numpy()
    centre = np.zeros(C.shape[1]) if Yk is None else (1 - min(1.0, radius / wf.TR_RADIUS0)) * Yk.reshape(-1).numpy()
    K2 = (C2 * d) @ C2.T
    b_eff = b2 - C2 @ centre

    def dual(mu):
        g = K2 @ mu + b_eff
        return 0.5 * mu @ (K2 @ mu) + mu @ b_eff, g

    r = scipy.optimize.minimize(dual, np.zeros(len(b2)), jac=True, method="L-BFGS-B",
                                bounds=[(0, None)] * len(b2), options=dict(maxiter=20000, ftol=1e-15, gtol=1e-12))
    Y_ref = centre - d * (C2.T @ r.x)
    Y = Yhat.reshape(-1).numpy()
    assert np.linalg.norm(Y - Y_ref) <= 1e-3 * np.linalg.norm(Y_ref)
    obj = lambda y: 0.5 * (y - centre) @ ((y - centre) / d)  # noqa: E731
    assert obj(Y) <= obj(Y_ref) * (1 + 1e-4)  # no worse objective than scipy's


def test_linearised_changes_match_finite_differences(setup):
    """new_lin is the first-order change of every row along the step: central differences of the exact
    constraint values at ±ε times the step (ΔW = Y Bᵀ), ε = 1e-2 (f32 forward: rounding ~1e-5 / ε)."""
    pb, c, _, _, _, Yhat, new_lin, _, m, _ = _step(setup, 0.3)
    dW = ((m.UG @ Yhat @ m.UA.T) @ pb.B.T).float()
    eps = 1e-2
    fd = (pb.constraints(eps * dW)[0] - pb.constraints(-eps * dW)[0]) / (2 * eps)
    assert np.abs(fd - new_lin).max() <= 2e-2 * np.abs(new_lin).max() + 2e-3


def test_radius_rule():
    r = 1.0
    assert wf.tr_update(r, -3.0, True) == pytest.approx(0.25)  # rejected: ¼
    assert wf.tr_update(r, 0.2, True) == pytest.approx(0.25)  # accepted but poor: ¼
    assert wf.tr_update(r, 0.5, True) == r  # fair: unchanged
    assert wf.tr_update(r, 0.9, True) == pytest.approx(2.0)  # good and the radius bound: 2×
    assert wf.tr_update(r, 0.9, False) == r  # good but inside the region: unchanged
    assert wf.tr_update(6.0, 0.9, True) == pytest.approx(8.0)  # capped at TR_MAX
    assert wf.tr_ratio(2.0, 1.5, 1.75, 1e-3, 0.3, 1.0) == pytest.approx(0.5)  # half the predicted decrease
    assert wf.tr_ratio(2.0, 1.5, 2.5, 1e-3, 0.3, 1.0) == pytest.approx(-1.0)
    # at a feasible iterate: the linear model's agreement, 1 − err / r
    assert wf.tr_ratio(0.0, 0.0, 5e-4, 1e-3, 0.05, 0.5) == pytest.approx(0.9)
    assert wf.tr_ratio(0.0, 0.0, 0.1, 1e-3, 0.75, 0.5) == pytest.approx(-0.5)


def test_accepted_steps_stay_within_the_radius_and_converge(setup):
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0))
    assert res.stop_reason == "converged" and res.violation < 2e-3
    trials = [t for it in res.iterations for t in it.get("trust_region", [])]
    assert trials and all(t["max_linear_change"] <= t["radius"] * (1 + 1e-6) for t in trials)
    assert all(t["accepted"] == (t["ratio"] > wf.TR_ACCEPT) for t in trials)


def test_rejected_steps_shrink_the_radius_to_a_failed_search(setup, monkeypatch):
    """Every trial judged worse than standing still (ratio forced to −1): the radius shrinks by ¼ per rejection
    (guard tokens added first while a token outside the rows rose beyond it) until below TR_MIN, then
    line_search_failed with the iterate kept: ΔW = 0, violation the base's margin (2 nats, log-softmax)."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    monkeypatch.setattr(wf, "tr_ratio", lambda *a: -1.0)
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0))
    assert res.stop_reason == "line_search_failed" and len(res.iterations) == 1
    assert torch.count_nonzero(res.dW) == 0 and res.violation == pytest.approx(2.0, abs=1e-9)
    radii = [t["radius"] for t in res.iterations[0]["trust_region"]]
    assert not any(t["accepted"] for t in res.iterations[0]["trust_region"])
    shrinks = [b / a for a, b in zip(radii, radii[1:]) if b != a]
    assert shrinks and all(s == pytest.approx(0.25) for s in shrinks)
    assert radii[-1] * 0.25 < wf.TR_MIN <= radii[-1]


# the KL budget (module docstring "KL budget"): every accepted iterate within it, the stop says so


def _full_kl(b, w, dW, W_sd=None) -> float:
    """Mean KL(p⁰ ‖ p) over the rows of `b` at W_sd + ΔW (or at `W_sd` itself when given), full softmax over the
    tiny model's whole vocabulary in f64 (the solver's figure is the streamed forward's, block by block: an
    independent summation)."""
    from l47.tail.forward import tail_mix

    def lp(**kw):
        return torch.log_softmax((tail_mix(b.R, b.inj, b.hh, b.sgv, b.yr, w, **kw) @ w.head.T).double(), -1)

    l0, l1 = lp(), (lp(dW=dW) if W_sd is None else lp(W_sd=W_sd))
    return float((l0.exp() * (l0 - l1)).sum(-1).mean())


def test_kl_budget_bounds_every_accepted_iterate_and_names_the_stop(setup):
    """Without a budget this world converges at an exact KL of 0.0163 nats; with a budget of 0.005 the solve
    stops `budget` short of the constraints, the returned ΔW's KL recomputed by the f64 full softmax is within
    the budget (to the two summations' agreement, 1e-7 nats) and binds (> 0.9 × the budget), every iteration's
    exact KL is within it, the trials over it were rejected with the radius shrunk by ¼, and the record note
    explaining the stop starts "convergence:" (the audit's claims bar reads it)."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    free = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0))
    budget = 0.005
    assert free.stop_reason == "converged" and _full_kl(bg, w, free.dW) > 3 * budget  # the budget binds
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0), budget=wf.KlBudget(budget))
    kl = _full_kl(bg, w, res.dW)
    assert res.stop_reason == "budget" and res.kl_budget == budget
    assert kl <= budget + 1e-7 and kl > 0.9 * budget and kl == pytest.approx(res.exact_bg_kl, abs=1e-7)
    assert 2e-3 < res.violation < 2.0  # it edited (base: 2 nats), short of the constraints
    assert all(it["kl_exact"] <= budget for it in res.iterations)
    over = [(it, t) for it in res.iterations for t in it.get("trust_region", []) if t.get("within_budget") is False]
    assert over and all(t["kl_exact"] > budget and not t["accepted"] and t["ratio"] > wf.TR_ACCEPT for _, t in over)
    for it, t in over:  # the next trial of the same step is re-solved at ¼ of the radius
        trials = it["trust_region"]
        k = trials.index(t)
        if k + 1 < len(trials):
            assert trials[k + 1]["radius"] == pytest.approx(wf.TR_SHRINK * t["radius"])
    notes = [n for n in res.warnings if n.startswith("convergence:")]
    assert len(notes) == 1 and "budget 0.005" in notes[0]


def test_kl_budget_below_any_step_keeps_the_base(setup):
    """A budget no step can meet (1e-12 nats): every trial is over it, the radius shrinks to TR_MIN, and the
    solve returns ΔW = 0 (exact KL 0) with stop reason `budget`, not line_search_failed."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0), budget=wf.KlBudget(1e-12))
    assert res.stop_reason == "budget" and len(res.iterations) == 1
    assert torch.count_nonzero(res.dW) == 0 and res.exact_bg_kl == 0.0 and _full_kl(bg, w, res.dW) == 0.0
    trials = res.iterations[0]["trust_region"]
    assert trials and not any(t["accepted"] for t in trials) and trials[-1]["radius"] * wf.TR_SHRINK < wf.TR_MIN


def test_large_kl_budget_changes_nothing(setup):
    """A budget above every iterate's KL (1 nat; the unbudgeted solve ends at 0.0163) gives the same ΔW bit for
    bit, the same iterations and stop reason as no budget."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    a = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0))
    b = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0), budget=wf.KlBudget(1.0))
    assert torch.equal(a.dW, b.dW) and a.stop_reason == b.stop_reason == "converged"
    assert [it["kl_exact"] for it in a.iterations] == [it["kl_exact"] for it in b.iterations]
    assert a.kl_budget is None and b.kl_budget == 1.0


def test_kl_budget_is_judged_on_the_weights_as_shipped(setup):
    """With a `shipped` map the budget holds for the shipped weights: a planted map that ships W + 1.5 ΔW (a
    "re-quantisation" that adds KL) — the returned ΔW's shipped KL (f64 full softmax at W + 1.5 ΔW) is within
    the budget and binds, its float KL well below it, the record's figures equal to the references (1e-7)."""
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    budget = 0.005
    ship = lambda dW: w.W_sd + 1.5 * dW  # noqa: E731
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0), budget=wf.KlBudget(budget, shipped=ship))
    kl_ship, kl = _full_kl(bg, w, None, W_sd=ship(res.dW)), _full_kl(bg, w, res.dW)
    assert res.stop_reason == "budget" and kl_ship <= budget + 1e-7 and kl_ship > 0.9 * budget
    assert kl < 0.6 * budget  # the float ΔW alone would have been allowed further (KL ≈ (1.5)⁻² of the shipped)
    assert res.shipped_bg_kl == pytest.approx(kl_ship, abs=1e-7) and res.exact_bg_kl == pytest.approx(kl, abs=1e-7)
    assert all(it["kl_shipped"] is None or it["kl_shipped"] <= budget for it in res.iterations)


def test_linear_least_kl_matches_a_dense_qp(setup):
    """linear_least_kl (the budget note's figure) against the same QP written out densely and solved by scipy's
    SLSQP in the primal (f64): min ½ yᵀ diag(1/D) y s.t. C y ≤ bound − vals (C_i = Ĝ_i ⊗ Ĥ_i, linearised at 0),
    then c·½ Σ γα y². Tolerance 1e-3 relative (SLSQP's ftol 1e-14 on a convex QP of n·f' unknowns); every row
    met at the reference's point."""
    pb, c, Gh, Hrow, D, _, _, _, m, cur = _step(setup, 1.0)
    vals, _, bounds, evr, _, _ = c
    curv = 1.7
    got = wf.linear_least_kl(wf.Linearised(Gh, Hrow, evr, vals, bounds, cur), m.Hh, D, m.gam, m.alp, curv)
    C = torch.einsum("ia,ib->iab", Gh, Hrow).reshape(len(vals), -1).numpy()  # [m, n f']
    d = D.reshape(-1).numpy()
    r = scipy.optimize.minimize(lambda y: (0.5 * y @ (y / d), y / d), np.zeros(C.shape[1]), jac=True,
                                method="SLSQP", constraints=[dict(type="ineq", fun=lambda y: (bounds - vals) - C @ y,
                                                                  jac=lambda y: -C)],
                                options=dict(maxiter=500, ftol=1e-14))
    y = r.x
    assert (C @ y <= bounds - vals + 1e-6).all()
    ga = (m.gam[:, None] * m.alp[None, :]).reshape(-1).numpy()
    ref = curv * 0.5 * float((ga * y * y).sum())
    assert ref > 0 and got == pytest.approx(ref, rel=1e-3)
