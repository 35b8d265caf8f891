"""The WFLD background-KL model is honest: Fisher with its sampled tail vs the exact f64 Fisher, the exact KL's
gradient vs finite differences, and predicted vs exact background KL at every Gauss–Newton step.

References and tolerances:
- exact G = mean_t J_tᵀ (diag p_t − p_t p_tᵀ) W_out… built in f64 from the full Jacobian of the mixer (torch.func)
  and the full softmax of the tiny model (V = 1024): an independent route. fisher_factors with K = V must match it
  to 1e-5 relative (f32 VJPs); top-K + S tail samples is a Monte-Carlo estimate (40 positions × 64 samples): its
  trace within 10 % and its quadratic form along the 8 leading directions of G within 15 % (relative standard
  error of such a mean over 2,560 samples ~2–5 %), closer to G than top-K alone, whose trace misses > half.
- the solver's KL model: every accepted step's prediction within [½, 2] of the exact streamed KL (the issue's
  target), and the calibration rule re-solves a step when it is not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l47.solvers.batch import Batch, EventTerms, batch_mix, pick_chosen
from l47.solvers.fisher import fisher_factors
from l47.solvers.wfld import WfldConfig, solve_wfld
from l47.tail.forward import mix_from_ys, paired_stats
from test_solvers import tiny_rows


@pytest.fixture(scope="module")
def tiny():
    w, _, _, mk = tiny_rows()
    return w, mk


def _exact_G(b: Batch, w) -> torch.Tensor:
    """mean_t J_tᵀ W_outᵀ (diag p − p pᵀ) W_out J_t in f64, J_t = ∂mix_t/∂ys_t from torch.func (per position)."""
    ys = (b.hh @ w.W_sd.T)

    def one(y, R, inj, sgv, yr):
        return mix_from_ys(y[None], R[None], inj[None], sgv[None], yr[None], w)[0]

    J = torch.func.vmap(torch.func.jacrev(one))(ys, b.R, b.inj, b.sgv, b.yr).double()  # [P, n, n]
    with torch.no_grad():
        z = (batch_mix(b, w) @ w.head.T).double()
    p = torch.softmax(z, 1)  # [P, V]
    H = w.head.double()
    mu = p @ H  # [P, n]
    Cov = torch.einsum("pv,vi,vj->pij", p, H, H) - mu[:, :, None] * mu[:, None, :]  # [P, n, n]
    return torch.einsum("pai,pab,pbj->ij", J, Cov, J) / b.P


def test_fisher_tail_estimator_matches_exact_fisher(tiny):
    w, mk = tiny
    b = mk(list(range(150, 190)))
    G = _exact_G(b, w)
    full = fisher_factors(b, w, w.W_sd, K=w.V, tail_samples_n=0).G
    assert float((full - G).norm() / G.norm()) < 1e-5
    top = fisher_factors(b, w, w.W_sd, K=4, tail_samples_n=0)
    est = fisher_factors(b, w, w.W_sd, K=4, tail_samples_n=64).G
    assert top.tail_mass > 0.3  # the tiny model's head is flat: most of the mass is outside the top 4
    tr = float(torch.trace(G))
    r_top, r_est = float(torch.trace(top.G)) / tr, float(torch.trace(est)) / tr
    assert r_top < 0.5 and abs(r_est - 1) < 0.1, (r_top, r_est)  # the tail is most of the Fisher; sampled back
    # the quadratic forms the solver uses, along the dominant directions of the exact G
    _, U = torch.linalg.eigh(G)
    V = U[:, -8:]
    q, q_est = torch.diag(V.T @ G @ V), torch.diag(V.T @ est @ V)
    assert float(((q_est - q).abs() / q).max()) < 0.15
    assert float((est - G).norm()) < float((top.G - G).norm())


def test_wfld_predicted_background_kl_within_2x_at_every_step(tiny):
    w, mk = tiny
    ev_rows = list(range(0, 60, 3))
    ev = mk(ev_rows)
    with torch.no_grad():
        rej = (batch_mix(ev, w) @ w.head.T).argmax(-1)
    spec = [1, 2, 3, 4, 5]
    terms = EventTerms(rejected=rej, chosen=pick_chosen(ev, w, rej, spec), special=torch.tensor(spec),
                       scale=torch.ones(len(ev_rows)))
    bg = mk(list(range(150, 399)))
    res = solve_wfld(w, ev, terms, bg, mk(list(range(100, 130))), WfldConfig(margin=3.0, fisher_topk=8))
    steps = [it for it in res.iterations if it["iter"] > 0]
    assert steps
    for it in steps:
        ex, pr = it["kl_exact"], it["kl_predicted"]
        assert max(ex, pr) < 1e-6 or 0.5 <= ex / pr <= 2.0, it
    with torch.no_grad():
        ex = paired_stats(batch_mix(bg, w), batch_mix(bg, w, dW=res.dW), w, bg.target.numpy()).kld.mean()
    assert abs(res.exact_bg_kl - ex) <= 1e-5 * ex
    assert 0.5 <= res.exact_bg_kl / res.predicted_bg_kl <= 2.0
    assert res.stop_reason in ("converged", "iteration_cap")


# ----------------------------------------------------------------------------------------------------------
# anchors within budget, and the plan's closed forms

def test_choose_anchors_follows_pivoted_qr_and_keeps_must():
    """Greedy farthest-from-span = column-pivoted QR (scipy's LAPACK geqp3 is the independent reference)."""
    import scipy.linalg

    from l47.solvers.anchors import choose_anchors

    g = np.random.default_rng(0)
    basis = g.standard_normal((12, 40))  # anchors span 12 directions of f = 40
    H = g.standard_normal((90, 12)) @ basis * np.exp(g.standard_normal((90, 1)))
    Hn = H / np.linalg.norm(H, axis=1, keepdims=True)
    _, _, piv = scipy.linalg.qr(Hn.T, pivoting=True, mode="economic")
    ch = choose_anchors(torch.as_tensor(H), [], budget=8)
    assert ch.kept == [int(i) for i in piv[:8]] and ch.rank == 8
    full = choose_anchors(torch.as_tensor(H), [5, 7], budget=40)
    assert full.rank == 12 and full.kept[:2] == [5, 7] and full.uncovered < 1e-12  # everything is in the span
    assert len(full.kept) == 12


def test_needed_gap_reaches_the_target_residual():
    """Lower one logit of a softmax by d = needed_gap(p, τ): its probability becomes τ·p (exact algebra)."""
    from l47.solvers.plan import needed_gap, residual_after

    z = torch.tensor([4.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    p = float(torch.softmax(z, 0)[0])
    for tau in (0.5, 0.2, 0.01):
        d = float(needed_gap(np.array([p]), tau)[0])
        z2 = z.clone()
        z2[0] -= d
        assert abs(float(torch.softmax(z2, 0)[0]) - tau * p) < 1e-12
        assert abs(residual_after(p, d) - tau) < 1e-12
    import math

    # p at or above 1 (an f32 rounding of a near-certain token) asks what 1 − 1e-6 asks, the logits' resolution:
    # log(0.8 / (0.2 · 1e-6)) for τ = 0.2, to the f64 rounding of p itself
    ref = math.log(0.8 / (0.2 * 1e-6))
    for p in (1 - 1e-6, 1.0, 1 + 4.8e-6):
        assert float(needed_gap(np.array([p]), 0.2)[0]) == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("key,value", [("target_residual", 0.0), ("target_residual", 1.5),
                                       ("kl_budget", -1.0), ("anchors_budget", 1.5), ("anchors_budget", 0)])
def test_solver_settings_out_of_range_name_key_and_value(key, value):
    from l47.errors import L47Error
    from l47.solvers.solve import resolve_config

    with pytest.raises(L47Error) as e:
        resolve_config({key: value}, "wfld", "exp.toml")
    assert f"solver.{key}" in str(e.value) and repr(value) in str(e.value)
    ok = resolve_config({}, "wfld", "exp.toml")
    assert ok.target_residual == 0.2 and ok.kl_budget == 0.0 and ok.anchors_budget == 0.5
