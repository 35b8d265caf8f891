"""WFLD and FTPO on the tiny transformers Qwen4Exp; re-quantisation; bundle byte identity; transplant.

Tolerances: anchors are protected exactly (ΔW·hh_a = 0 by construction), so their log-probs move only by f32
rounding of the forward (~1e-7): we assert ≤ 1e-5 nats before re-quantisation, and after re-quantisation no more
than the re-quantisation floor (what re-quantising W itself moves there) plus that rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from l47.tail.forward import paired_stats, tail_mix
from l47.solvers.batch import Batch, EventTerms, pick_chosen
from l47.solvers.ftpo import FtpoConfig, train_ftpo
from l47.solvers.wfld import WfldConfig, solve_wfld
from test_forward import weights_from_hf
from tiny_hf import capture, tiny_model


def tiny_rows():
    """The tiny transformers model's tail weights, 400 random ids, their logits, and mk(rows) -> the Batch of
    those positions (the states transformers captured). Shared with test_kl_model."""
    m = tiny_model(seed=0)
    w = weights_from_hf(m)
    ids = torch.randint(0, 1024, (400,), generator=torch.Generator().manual_seed(1))
    s, logits = capture(m, ids)

    def mk(rows):
        r = torch.as_tensor(rows)
        return Batch(R=s["R"][r], inj=s["inj"][r], hh=s["hh"][r], sgv=s["sgv"][r], yr=s["yr"][r],
                     target=ids[r + 1], doc=("d",) * len(rows), pos=tuple(rows))

    return w, ids, logits, mk


@pytest.fixture(scope="module")
def setup():
    w, ids, logits, mk = tiny_rows()
    lp = torch.log_softmax(logits, -1)
    ev_rows = list(range(0, 60, 3))
    rej = lp[torch.as_tensor(ev_rows)].argmax(-1)  # plant: the base argmax is the "banned" final token
    ev = mk(ev_rows)
    spec = [1, 2, 3, 4, 5]
    terms = EventTerms(rejected=rej, chosen=pick_chosen(ev, w, rej, spec), special=torch.tensor(spec),
                       scale=torch.ones(len(ev_rows)))
    return dict(w=w, ev=ev, terms=terms, bg=mk(list(range(150, 399))), an=mk(list(range(100, 130))), mk=mk)


def _mix(b, w, **kw):
    return tail_mix(b.R, b.inj, b.hh, b.sgv, b.yr, w, **kw)


def _p_rej(b, w, rej, **kw):
    z = _mix(b, w, **kw) @ w.head.T
    return torch.softmax(z.double(), -1)[torch.arange(b.P), rej]


def test_wfld_meets_constraints_and_protects_anchors(setup):
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(margin=2.0))
    assert res.violation < 2e-3 and res.residual < 2e-3  # Gauss–Newton converged: exact == linear prediction
    before, after = _p_rej(ev, w, terms.rejected), _p_rej(ev, w, terms.rejected, dW=res.dW)
    assert after.mean() < 0.5 * before.mean()
    ps = paired_stats(_mix(an, w), _mix(an, w, dW=res.dW), w, an.target.numpy())
    assert np.abs(ps.dlogp).max() <= 1e-5
    assert res.anchor_rank == an.P and res.null_dim == w.f - an.P


def test_wfld_margin_holds_per_event(setup):
    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    cfg = WfldConfig(margin=1.5, delta_cho=0.1)
    res = solve_wfld(w, ev, terms, bg, None, cfg)
    lp0 = torch.log_softmax(_mix(ev, w) @ w.head.T, -1)
    lp1 = torch.log_softmax(_mix(ev, w, dW=res.dW) @ w.head.T, -1)
    ar = torch.arange(ev.P)
    c = terms.chosen[:, 0]
    d_gap = (lp1[ar, terms.rejected] - lp1[ar, c]) - (lp0[ar, terms.rejected] - lp0[ar, c])
    assert (d_gap <= -1.5 + 2e-3).all()
    assert ((lp1[ar, c] - lp0[ar, c]) >= 0.1 - 2e-3).all()
    sp = terms.special
    mass0, mass1 = torch.logsumexp(lp0[:, sp], 1), torch.logsumexp(lp1[:, sp], 1)
    assert ((mass1 - mass0) <= 2e-3).all()  # the special tokens' total mass does not rise


def test_wfld_reports_infeasible_event_in_protected_span(setup):
    w, ev, terms, bg, mk = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["mk"]
    an = mk([0, 3] + list(range(100, 110)))  # the first two events are themselves anchors
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig())
    assert res.infeasible_events[:2] == [0, 1] and res.removed[0] > 0.999
    assert any("protected" in x for x in res.warnings)


# the trust region's failed search (line_search_failed), its radius rule and the step's QP: tests/test_wfld_trust.py


def test_wfld_is_deterministic(setup):
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    a = solve_wfld(w, ev, terms, bg, an, WfldConfig())
    b = solve_wfld(w, ev, terms, bg, an, WfldConfig())
    assert torch.equal(a.dW, b.dW)


def test_ftpo_reaches_the_target_within_the_kl_budget(setup):
    """The target objective on the tiny model: every event's p(rejected) ≤ target × its base p, checked by an
    independent full-softmax forward in f64; the background KL (full softmax, f64) within the budget."""
    from l47.solvers.ftpo import FtpoProblem

    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    target, budget = 0.5, 0.3  # the tiny random model's head is flat: every event's key is the background's too
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a" if i % 2 else "b" for i in range(ev.P)], background=bg,
                     target_residual=target, kl_budget=budget, anchors=an, anchor_group=["w"] * an.P,
                     anchor_tol=[0.05] * an.P)
    res = train_ftpo(w, pb, FtpoConfig(steps=200, lr=0.3, key_rank=10, eval_every=10))  # 10 events per phrase
    assert res.stopped == "converged" and res.best_step > 0
    before, after = _p_rej(ev, w, terms.rejected), _p_rej(ev, w, terms.rejected, dW=res.dW)
    for ph in ("a", "b"):
        m = torch.as_tensor([p == ph for p in pb.phrase])
        assert float(after[m].sum() / before[m].sum()) <= target + 1e-6  # per phrase, as the trainer judged it
    lp0 = torch.log_softmax((_mix(bg, w) @ w.head.T).double(), -1)
    lp1 = torch.log_softmax((_mix(bg, w, dW=res.dW) @ w.head.T).double(), -1)
    kl = float((lp0.exp() * (lp0 - lp1)).sum(-1).mean())
    assert kl <= budget and kl == pytest.approx(res.kl_exact, rel=1e-3, abs=1e-7)
    assert res.convergence(target).max_violation == 0.0 and res.convergence(target).stop_reason == "converged"


def test_ftpo_at_target_needs_dev_and_train():
    """A phrase is at its target only when its dev AND train residuals are (the demo's "rather than": 3 dev events
    at 0.087, train 0.354, held out 0.364): the rule behind the stop, the per-phrase switch and the record's
    max violation (log(residual / target), nats)."""
    import math

    from l47.solvers.ftpo import FtpoResult, at_target_residuals

    tr, dv = {"a": 0.354, "b": 0.05, "c": 0.3}, {"a": 0.087, "b": 0.15}
    assert at_target_residuals(tr, dv) == {"a": 0.354, "b": 0.15, "c": 0.3}  # c: no dev events, train alone
    res = FtpoResult(torch.zeros(1, 1), 0, stopped="iteration_cap", dev_residual=dv, train_residual=tr)
    conv = res.convergence(0.2)
    assert conv.max_violation == pytest.approx(math.log(0.354 / 0.2), rel=1e-12)  # a, by its train residual
    at = FtpoResult(torch.zeros(1, 1), 0, stopped="converged", dev_residual={"a": 0.2}, train_residual={"a": 0.19})
    assert at.convergence(0.2).max_violation == 0.0


def test_ftpo_keeps_candidates_by_the_residual_that_stops_it():
    """The judge's key reads each phrase as the stop rule does (the larger of dev and train). The case it mends
    (the demo with lambda_shape 0, three seeds): a dev-only key kept an earlier, lower-KL candidate at target on
    dev but not on train, the solve stopped "converged" with a record violation of 0.035–0.131 nats, and the
    audit's claims bar failed. Illustrative residuals; the scores re-derived by hand (mean of log max(r, t))."""
    import math

    from l47.solvers.ftpo import candidate_key

    t = 0.2
    early = candidate_key({"a": 0.23, "b": 0.1}, {"a": 0.15, "b": 0.1}, t, kl=1e-4)
    late = candidate_key({"a": 0.2, "b": 0.1}, {"a": 0.2, "b": 0.1}, t, kl=2e-4)
    assert early[0] == pytest.approx((math.log(0.23) + math.log(0.2)) / 2, rel=1e-12)
    assert late[0] == pytest.approx(math.log(0.2), rel=1e-12) and late < early  # more removal beats less KL
    # a phrase without dev events is read on train; both at target: the least KL wins
    assert candidate_key({"c": 0.1}, {}, t, 1e-4) < candidate_key({"c": 0.19}, {}, t, 2e-4)
    # the earlier rule (dev where a phrase has dev events) would have kept `early`
    from l47.solvers.ftpo import removal_score

    assert removal_score({"a": 0.15, "b": 0.1}, t) == removal_score({"a": 0.2, "b": 0.1}, t)  # tie -> less KL


def test_ftpo_events_pull_until_their_own_residual_is_at_target():
    """`pulling`: a phrase short of its target pulls with every event; a phrase at its target (its mean residual
    ≤ t) still pulls with each event whose own p/p⁰ is above t. The case it mends (model2): "above and beyond" read
    0.138 on train with 9 of its 123 events ("The seller went above and") at p/p⁰ = 1.000; the phrase stopped as
    a whole and the held-out set, 28 % of it that context, read 0.33–0.37. Illustrative ratios, the expected mask
    written out by hand from the rule."""
    import numpy as np

    from l47.solvers.ftpo import pulling

    t = 0.2
    ratio = np.array([0.05, 1.0, 0.19, 0.21, 0.5, 0.01])
    phrase = ["a", "a", "a", "a", "b", "b"]
    at = {"a": 0.12, "b": 0.255}  # a at its target (its mean), b short of it
    assert pulling(ratio, phrase, at, t).tolist() == [False, True, False, True, True, True]
    # at the target exactly is reached (the stop rule's ≤): neither the phrase nor an event at t pulls
    assert pulling(np.array([0.2, 0.2]), ["a", "a"], {"a": 0.2}, t).tolist() == [False, False]


def test_ftpo_restart_returns_to_the_kept_value_with_half_the_first_step():
    """`_Adam.restart`: back to the given value, moments cleared, the step halved. Reference: Adam's first step
    in closed form — m̂ = g, v̂ = g², so u = sign(g) (floor 0), RMS(u) = 1 — of size lr·RMS(W)·(1/warmup)."""
    from l47.solvers.ftpo import _Adam

    cfg = FtpoConfig(lr=0.2, warmup=4, floor=0.0)
    target = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, -1.5]])
    loss_of = lambda rows, p=None: ((opt.param - target).pow(2).sum(), {})  # noqa: E731
    opt = _Adam(torch.zeros(2, 3, requires_grad=True), cfg, W_rms=0.5, n_bg=8)
    opt.run(7, loss_of)  # somewhere else, with moments built up
    kept = torch.tensor([[0.2, 0.1, -0.3], [0.0, 0.4, 0.9]])
    opt.restart(kept)
    assert torch.equal(opt.param.detach(), kept)
    opt.run(1, loss_of)
    step = 0.5 * 0.2 * 0.5 * (1 / 4)  # scale · lr · RMS(W) · warm-up
    expected = kept - step * torch.sign(2 * (kept - target))
    np.testing.assert_allclose(opt.param.detach().numpy(), expected.numpy(), rtol=0, atol=1e-7)
    opt.restart(kept)  # halved again
    opt.run(1, loss_of)
    np.testing.assert_allclose((kept - opt.param.detach()).abs().numpy(), np.full((2, 3), step / 2), atol=1e-7)


def test_ftpo_restarts_every_recover_after_evaluations_over_the_budget(setup):
    """With a KL budget no edit meets (1e-12 nats), every evaluation after step 0 is over it: the trainer goes back
    to the kept candidate (step 0, ΔW = 0: the only one within the budget) after every third, halving the step
    each time, records each restart, and returns ΔW = 0. With recover_after = 0 (λ alone) it never restarts."""
    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, train_ftpo

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5,
                     kl_budget=1e-12)
    res = train_ftpo(w, pb, FtpoConfig(steps=100, eval_every=10, lr=0.3))
    kls = [h["kl_exact"] for h in res.history if "kl_exact" in h]
    assert kls[0] == 0.0 and min(kls[1:]) > 1e-12  # the premise: over the budget at every evaluation but step 0
    restarts = [(h["step"], h["restart_from"], h["lr_scale"]) for h in res.history if "restart_from" in h]
    assert restarts == [(30, 0, 0.5), (60, 0, 0.25), (90, 0, 0.125)]
    assert res.best_step == 0 and float(res.dW.abs().max()) == 0.0
    assert sum("restarted from the kept candidate" in i for i in res.info) == 3
    off = train_ftpo(w, pb, FtpoConfig(steps=100, eval_every=10, lr=0.3, recover_after=0))
    assert not [h for h in off.history if "restart_from" in h]


def test_key_basis_spans_the_phrase_keys_relative_to_the_background(setup):
    """Q is orthonormal; with k = the phrase's event count, span(Q) = span(B⁻¹ h_e) (the generalized
    eigenvectors of (C, B) with non-zero eigenvalue), re-derived by projecting B⁻¹ hᵀ; with k = 1 the kept
    direction maximises vᵀCv / vᵀBv (scipy's generalized symmetric eigensolver)."""
    import scipy.linalg

    from l47.solvers.ftpo import key_basis

    ev, bg = setup["ev"], setup["bg"]
    g = torch.zeros(ev.P, dtype=torch.long)
    Q = key_basis(ev.hh, g, bg.hh, ev.P)
    np.testing.assert_allclose((Q.T @ Q).numpy(), np.eye(Q.shape[1]), atol=1e-10)
    H = ev.hh.double()
    B = (bg.hh.double().T @ bg.hh.double() / bg.P).numpy()
    B += 1e-3 * np.trace(B) / B.shape[0] * np.eye(B.shape[0])
    X = torch.as_tensor(np.linalg.solve(B, H.numpy().T))  # [f, E] B⁻¹ hᵀ
    assert float((X - Q @ (Q.T @ X)).norm() / X.norm()) < 1e-8
    C = (H.T @ H / ev.P).numpy()
    vals, vecs = scipy.linalg.eigh(C, B)
    q1 = key_basis(ev.hh, g, bg.hh, 1)[:, 0].numpy()
    v = vecs[:, -1] / np.linalg.norm(vecs[:, -1])
    assert abs(float(q1 @ v)) == pytest.approx(1.0, abs=1e-6)


def test_needed_drop_is_the_log_odds_of_the_aim():
    """d = logit(p0) − logit(r·p0), re-derived in f64 with scipy; a drop of d in the log-odds gives r·p0."""
    from scipy.special import expit, logit

    from l47.solvers.ftpo import needed_drop

    p0 = np.array([0.02, 0.5, 0.93, 0.999, 0.99999])
    d = needed_drop(p0, 0.1)
    np.testing.assert_allclose(d, logit(p0) - logit(0.1 * p0), rtol=1e-12)
    np.testing.assert_allclose(expit(logit(p0) - d), 0.1 * p0, rtol=1e-10)


def test_conditional_kl_and_log_odds_against_references():
    """conditional_kl against a numpy f64 re-derivation (restrict, renormalise, KL); the gradient of the target
    hinge of the log-odds against central finite differences (f64 gradcheck)."""
    from l47.solvers.ftpo import conditional_kl, log_odds, target_hinge

    g = torch.Generator().manual_seed(0)
    z0, z1 = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.randn(4, 7, generator=g, dtype=torch.float64)
    keep = torch.rand(4, 7, generator=g) > 0.3
    keep[:, 0] = True
    got = conditional_kl(z0, z1, keep).numpy()
    for i in range(4):
        k = keep[i].numpy()
        a, b = np.exp(z0[i].numpy()[k]), np.exp(z1[i].numpy()[k])
        a, b = a / a.sum(), b / b.sum()
        assert got[i] == pytest.approx(float((a * np.log(a / b)).sum()), rel=1e-10, abs=1e-14)
    zr = torch.randn(4, generator=g, dtype=torch.float64)

    def f(zr_, zs_):
        return target_hinge(log_odds(zr_, zs_, keep) - 0.3, torch.full((4,), 1.5, dtype=torch.float64), 0.25).sum()

    assert torch.autograd.gradcheck(f, (zr.requires_grad_(), z1.clone().requires_grad_()))


def _full_kl(b, w, dW):
    """KL(p⁰ ‖ p) per row over the whole vocabulary in f64 (full softmax: the tiny model's V is small)."""
    l0 = torch.log_softmax((_mix(b, w) @ w.head.T).double(), -1)
    l1 = torch.log_softmax((_mix(b, w, dW=dW) @ w.head.T).double(), -1)
    return (l0.exp() * (l0 - l1)).sum(-1)


def test_ftpo_step_kl_value_and_gradient_against_full_softmax(setup):
    """The trainer's one-pass KL (lse − lse⁰ − μ⁰·(mix − mix⁰), `kl_from` on the judge's KlReference) against the
    f64 full-softmax KL: value within 2e-6 nats (the two f32 lse's rounding and the step's lse cast to f32, ~ε₃₂·lse
    with lse ≈ 8: measured max 4e-7; the former Σp⁰log p⁰ − μ⁰·mix + lse erred by 2.5e-6, its entropy's rounding),
    gradient w.r.t. ΔW within 1e-3 relative (f32 forward / backward through the tail)."""
    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Objective

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5, kl_budget=0.1)
    obj = _Objective(w, pb, FtpoConfig(), torch.zeros(ev.P, dtype=torch.long))
    dW = (0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(3))).requires_grad_(True)
    rows = torch.arange(bg.P)
    mix = _mix(bg, w, dW=dW)
    from l47.tail.forward import streamed_lse

    got = obj.step_kl(mix, rows, streamed_lse(mix, w))
    ref = _full_kl(bg, w, dW)
    assert float(ref.detach().mean()) > 1e-3  # a real change, not a zero-vs-zero comparison
    np.testing.assert_allclose(got.detach().numpy(), ref.detach().numpy(), atol=2e-6)
    g_got, = torch.autograd.grad(got.mean(), dW)
    g_ref, = torch.autograd.grad(_full_kl(bg, w, dW).mean(), dW)
    assert float((g_got.double() - g_ref).norm() / g_ref.norm()) < 1e-3


def test_ftpo_near_ties_select_and_cost_against_full_softmax(setup):
    """_NearTies keeps exactly the rows whose full-softmax top two are one special and one ordinary token within
    the margin (re-derived with torch.topk on f64 logits); its cost is 0 at ΔW = 0 and, for a planted ΔW, equals
    Σ (max(−Δgap, 0) / max(gap⁰, 0.05))² recomputed from the f64 logits (tolerance 1e-4 relative: f32 logits)."""
    from l47.solvers.ftpo import _NearTies

    w, bg, terms = setup["w"], setup["bg"], setup["terms"]
    special = torch.as_tensor(sorted(set(int(t) for t in torch.topk(_mix(bg, w) @ w.head.T, 2).indices[:40, 1])))
    z0 = (_mix(bg, w) @ w.head.T).double()
    top = torch.topk(z0, 2)
    sp = torch.isin(top.indices, special)
    gap0 = top.values[:, 0] - top.values[:, 1]
    want = torch.nonzero((sp[:, 0] != sp[:, 1]) & (gap0 < 1.0))[:, 0]
    assert 0 < len(want) < bg.P  # the planted special set makes some rows near ties, not all
    nt = _NearTies([bg], w, special, margin=1.0)
    assert nt.n == len(want)
    np.testing.assert_array_equal(nt.ids.numpy(), top.indices[want].numpy())
    assert float(nt.cost(w, torch.zeros(w.n, w.f))) == pytest.approx(0.0, abs=1e-9)
    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(4))
    z1 = (_mix(bg, w, dW=dW) @ w.head.T).double()
    ids = top.indices[want]
    d0 = z0[want].gather(1, ids)
    d1 = z1[want].gather(1, ids)
    shrink = torch.clamp((d0[:, 0] - d0[:, 1]) - (d1[:, 0] - d1[:, 1]), min=0)
    ref = float(((shrink / gap0[want].clamp_min(0.05)) ** 2).sum())
    assert ref > 0 and float(nt.cost(w, dW)) == pytest.approx(ref, rel=1e-4)


def test_ftpo_background_scales_equalise_the_background_energy(setup):
    """With Q scaled by background_scales, every column carries the same background rms (‖h‖ rms / √f), re-derived
    in f64 — except a column the background hardly uses, whose scale stops at SCALE_CAP: the property the
    trainer's step size relies on."""
    from l47.solvers.ftpo import SCALE_CAP, background_scales, key_basis

    w, ev, bg = setup["w"], setup["ev"], setup["bg"]
    Q = key_basis(ev.hh, torch.as_tensor([i % 2 for i in range(ev.P)]), bg.hh, 4).float()
    Qs = Q * background_scales(bg.hh, Q)
    H = bg.hh.double()
    e = (H @ Qs.double()).pow(2).mean(0).sqrt()
    e_raw = (H @ Q.double()).pow(2).mean(0).sqrt()
    ref = float(H.pow(2).sum(1).mean().sqrt() / np.sqrt(H.shape[1]))
    np.testing.assert_allclose(e.numpy(), np.minimum(ref, SCALE_CAP * e_raw.numpy()), rtol=1e-5)
    assert (e_raw.numpy() < ref).any()  # some column is scaled up: the test is not of an identity


def test_ftpo_judge_dev_rows_kl_and_flips_against_full_softmax(setup):
    """The judge's dev-row figures (one paired streamed pass) against the f64 full softmax: mean KL within 1e-6
    (f64 accumulation of f32 logits) and the count of argmax flips to a special token exactly."""
    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Judge, _Objective

    import dataclasses

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    dW = 0.5 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(5))
    a0 = (_mix(bg, w) @ w.head.T).double().argmax(-1)
    a1 = (_mix(bg, w, dW=dW) @ w.head.T).double().argmax(-1)
    sp = torch.as_tensor(sorted(set(a1[a1 != a0].tolist()) - set(a0.tolist())))[:3]  # planted: new argmaxes
    assert sp.numel() > 0
    terms = dataclasses.replace(terms, special=sp)
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5, kl_budget=0.1,
                     dev_rows=bg)
    judge = _Judge(w, pb, _Objective(w, pb, FtpoConfig(), torch.zeros(ev.P, dtype=torch.long)))
    kl, flips, _, _, _ = judge._dev_rows(w.W_sd + dW)
    ref = _full_kl(bg, w, dW)
    assert float(ref.mean()) > 1e-3 and kl == pytest.approx(float(ref.mean()), abs=1e-6)
    want = int((torch.isin(a1, sp) & ~torch.isin(a0, sp)).sum())
    assert want > 0 and flips == want


def test_ftpo_background_is_every_row_and_the_judge_kl_covers_them(setup):
    """FTPO's background is EVERY row of its documents (up to `kl_rows`), WFLD's a strided sample of at most
    `max_background`; the judge's exact KL at a candidate equals the f64 full-softmax KL averaged over all the
    background rows (within 1e-6: f64 accumulation of f32 logits), while each step sees `background_batch` of
    them."""
    from types import SimpleNamespace

    from l47.solvers.ftpo import FtpoProblem, _Judge, _Objective
    from l47.solvers.methods import solver_for
    from l47.solvers.select import background_positions
    from l47.solvers.solve import resolve_config

    def background_cap(cfg):
        return solver_for(cfg.method).policy(cfg).background_cap

    docs = [SimpleNamespace(sha256=f"d{i}", T=t) for i, t in enumerate((2500, 1700, 3301))]  # 7,501 rows
    ftpo, wfld = resolve_config({}, None, "x"), resolve_config({}, "wfld", "x")
    assert ftpo.method == "ftpo" and background_cap(ftpo) == 65536 and background_cap(wfld) == 4000
    pairs, stride, total = background_positions(docs, background_cap(ftpo))
    assert stride == 1 and total == 7501 and pairs == [(d.sha256, t) for d in docs for t in range(d.T)]
    pairs_w, stride_w, _ = background_positions(docs, background_cap(wfld))
    assert stride_w == 2 and len(pairs_w) == 1250 + 850 + 1651 <= 4000
    capped = resolve_config({"ftpo": {"kl_rows": 3000}}, None, "x")
    assert background_positions(docs, background_cap(capped))[1] == 3  # ceil(7501 / 3000)

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5, kl_budget=0.1)
    cfg = FtpoConfig(background_batch=16)
    judge = _Judge(w, pb, _Objective(w, pb, cfg, torch.zeros(ev.P, dtype=torch.long)))
    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(7))
    info = judge(10, dW, 1.0)
    ref = _full_kl(bg, w, dW)
    assert bg.P == 249 and float(ref.mean()) > 1e-3
    assert info["kl_exact"] == pytest.approx(float(ref.mean()), abs=1e-6)
    assert abs(info["kl_exact"] - float(ref[:16].mean())) > 1e-4  # not one step's batch


def test_ftpo_judge_turn_ends_lost_against_full_softmax(setup):
    """_TurnEnds counts, under a candidate, the turn ends (target <|im_end|>) where <|im_end|> was the base argmax
    and no longer is — at the dev rows and at the turn-end anchors — equal to the f64 full-softmax count; and such
    a candidate is not admissible."""
    import dataclasses

    from l47.model import names
    from l47.solvers.ftpo import FtpoProblem, _Judge, _Objective

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    dW = 0.5 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(5))
    a0 = (_mix(bg, w) @ w.head.T).double().argmax(-1)
    a1 = (_mix(bg, w, dW=dW) @ w.head.T).double().argmax(-1)
    both = [int(t) for t in torch.unique(a0) if ((a0 == t) & (a1 != t)).any() and ((a0 == t) & (a1 == t)).any()]
    assert both  # planted: a base argmax that the candidate loses at some rows and keeps at others
    im = max(both, key=lambda t: int(((a0 == t) & (a1 != t)).sum()))
    rows = dataclasses.replace(bg, target=torch.full_like(bg.target, im))  # every row a turn end
    want = int(((a0 == im) & (a1 != im)).sum())
    assert want > 0 and int((a0 == im).sum()) > want
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5, kl_budget=10.0,
                     dev_rows=rows, anchors=rows, anchor_group=[names.IM_END] * rows.P, turn_ends=rows.P,
                     anchor_tol=[0.05] * rows.P, im_end=im)
    judge = _Judge(w, pb, _Objective(w, pb, FtpoConfig(), torch.zeros(ev.P, dtype=torch.long)))
    info = judge(10, dW, 1.0)
    assert info["turn_ends_lost"] == {"dev": want, "anchors": want}
    assert judge.best is None  # a candidate that loses a turn end is never kept
    assert judge(20, torch.zeros_like(dW), 1.0)["turn_ends_lost"] == {"dev": 0, "anchors": 0}
    assert judge.best is not None and judge.best[1] == 20


def test_ftpo_judge_held_anchors_and_special_mass_against_full_softmax(setup):
    """The judge reads bars (d) and (f) on what the solver holds: per anchor group the mean Δlog p of its targets
    (a collateral word; <|im_end|> at the real turn ends), the share of the words' anchors below −0.1 nats, and the
    larger mean rise of Σ p(special) at the train events and at the background documents' slop events —
    each equal to the f64 full softmax of the same rows (1e-5: f32 logits against f64, a mean of ~30 rows; the
    special mass is a probability ~1e-3, compared to 1e-9 absolute) — and a candidate past a group's tolerance or
    the special-mass tolerance is never kept, the condition named."""
    from l47.model import names
    from l47.solvers.ftpo import (BIND_END_DLOGP, BIND_SPECIAL, BIND_WORDS, BIND_WORDS_BELOW, FtpoProblem, _Judge,
                                  _Objective)

    w, ev, terms, an = setup["w"], setup["ev"], setup["terms"], setup["an"]
    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(7))
    lp0 = torch.log_softmax((_mix(an, w) @ w.head.T).double(), -1)[torch.arange(an.P), an.target]
    lp1 = torch.log_softmax((_mix(an, w, dW=dW) @ w.head.T).double(), -1)[torch.arange(an.P), an.target]
    order = torch.argsort(lp1 - lp0).tolist()  # the groups planted by the candidate's change: of the 12 anchors it
    rank = {a: i for i, a in enumerate(order)}  # lowers most, the even ranks are turn ends, the odd ones word x;
    groups = [("x" if rank[a] % 2 else names.IM_END) if rank[a] < 12 else "y" for a in range(an.P)]  # the rest y
    want = {g: float((lp1 - lp0)[torch.as_tensor([i for i, h in enumerate(groups) if h == g])].mean())
            for g in set(groups)}
    sp, guard = terms.special, setup["mk"](list(range(60, 100, 2)))  # guard: the background's own slop events

    def mass_rise(b):
        ps0 = torch.softmax((_mix(b, w) @ w.head.T).double(), -1)[:, sp].sum(1)
        return float((torch.softmax((_mix(b, w, dW=dW) @ w.head.T).double(), -1)[:, sp].sum(1) - ps0).mean())

    rise_ev, rise_g = mass_rise(ev), mass_rise(guard)
    rise = max(rise_ev, rise_g)  # bar (f): the max over splits of the mean rise

    words = torch.as_tensor([g != names.IM_END for g in groups])
    below = float(((lp1 - lp0)[words] < -0.1).double().mean())  # bar (d)'s share, pooled over the words' anchors

    def judged(tol_word, tol_end, special_tol, frac_below=1.0):
        tols = [tol_end if g == names.IM_END else tol_word for g in groups]
        pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=setup["bg"], target_residual=0.5,
                         kl_budget=10.0, anchors=an, anchor_group=groups, anchor_tol=tols, special_tol=special_tol,
                         word_below=-0.1, word_frac_below=frac_below, guard=guard)
        judge = _Judge(w, pb, _Objective(w, pb, FtpoConfig(), torch.zeros(ev.P, dtype=torch.long)))
        return judge(10, dW, 1.0), judge

    info, judge = judged(10.0, 10.0, 1.0)
    for g, v in want.items():
        assert info["held_dlogp"][g] == pytest.approx(v, abs=1e-5)
    assert info["held_below"] == pytest.approx(below) and 0 < below < 1  # anchors on both sides of −0.1 nats
    assert info["special_rise"] == pytest.approx(rise, abs=1e-9)
    assert abs(rise_ev - rise_g) > 1e-8  # the two splits differ: the max is read over both
    assert info["inadmissible"] == [] and judge.best is not None  # every tolerance wide: kept
    worst_word = min(want["x"], want["y"])
    assert worst_word < 0 and want[names.IM_END] < 0 and abs(rise) > 1e-7  # the planted groups are lowered
    info, judge = judged(-worst_word / 2, 10.0, 1.0)
    assert info["inadmissible"] == [BIND_WORDS] and judge.best is None
    info, judge = judged(10.0, -want[names.IM_END] / 2, 1.0)
    assert info["inadmissible"] == [BIND_END_DLOGP] and judge.best is None
    info, judge = judged(10.0, 10.0, abs(rise) / 2)
    assert (BIND_SPECIAL in info["inadmissible"]) == (rise > abs(rise) / 2)
    info, judge = judged(10.0, 10.0, 1.0, frac_below=below / 2)
    assert info["inadmissible"] == [BIND_WORDS_BELOW] and judge.best is None


def test_dev_rows_drop_the_prefix_rows_and_near_misses_are_listed():
    """bar (g)'s rows (the judge's dev rows) are every row but a phrase's prefix rows — the occurrence AND the
    near miss (prefix, another next token), as (g) and (e) judge; the near miss is listed for the tether.
    Hand-made: phrase (1, 2, 3) in 5 1 2 3 9 1 2 7 4."""
    from types import SimpleNamespace

    from l47.dumps.select import PhraseTuples
    from l47.solvers.select import near_miss_rows, without_prefix_rows

    tok = [5, 1, 2, 3, 9, 1, 2, 7, 4]
    doc = SimpleNamespace(sha256="d", T=len(tok) - 1)
    pt = PhraseTuples("a b c", ((1, 2, 3),), ("a b c",))
    pairs = [("d", t) for t in range(doc.T)]
    assert without_prefix_rows(pairs, [doc], [pt], lambda s: tok) == [p for p in pairs if p[1] not in (2, 6)]
    assert near_miss_rows([doc], [pt], lambda s: tok) == [("d", 6, 3)]


def test_ratio_upper_is_the_cluster_ratio_bound():
    """ratio_upper against a hand computation: rows 1, 3 (doc a), 2 (doc b), 10, 0, 2 (doc c): R = 18/6 = 3,
    S − R·n = (4 − 6, 2 − 3, 12 − 9) = (−2, −1, 3), SE = √(3/2 · 14)/6, bound = 3 + 1.645·SE; one document: R."""
    import math

    from l47.solvers.ftpo import ratio_upper

    x = np.array([1.0, 3.0, 2.0, 10.0, 0.0, 2.0])
    doc = np.array(["a", "a", "b", "c", "c", "c"])
    assert ratio_upper(x, doc) == pytest.approx(3 + 1.645 * math.sqrt(1.5 * 14) / 6, rel=1e-12)
    assert ratio_upper(x, np.array(["a"] * 6)) == pytest.approx(3.0)


def test_ftpo_gap_directions_keep_the_special_word_gaps_to_first_order(setup):
    """gap_basis / project_out: V is orthonormal, a projected U has no part in it, and ΔW = ε·P(U)·Mᵀ moves the
    special-vs-word gap (z_t1 − z_t2) at every selected row by ≤ 2 % of what ΔW = ε·U·Mᵀ moves it (second order
    and f32 rounding), both measured by an independent full-softmax forward in f64 logits; the rows selected are
    the f64 topk's (one special, one word, gap < the margin); the implicit projector is idempotent and symmetric."""
    from l47.solvers.ftpo import background_scales, gap_basis, gap_jacobians, key_basis, project_out, special_word_pairs

    w, ev, bg = setup["w"], setup["ev"], setup["bg"]
    z0 = (_mix(bg, w) @ w.head.T).double()
    special = torch.as_tensor(sorted(set(int(t) for t in torch.topk(z0, 2).indices[:40, 1])))
    top = torch.topk(z0, 2)
    sp = torch.isin(top.indices, special)
    want = torch.nonzero((sp[:, 0] != sp[:, 1]) & (top.values[:, 0] - top.values[:, 1] < 4.0))[:, 0]
    b, ids, gap = special_word_pairs([bg], w, special, 4.0)
    assert 0 < len(want) < bg.P and b.P == len(want)
    np.testing.assert_array_equal(ids.numpy(), top.indices[want].numpy())
    Q = key_basis(ev.hh, torch.as_tensor([i % 2 for i in range(ev.P)]), bg.hh, 8).float()
    M = Q * background_scales(bg.hh, Q)  # [f, K]
    V = gap_basis(gap_jacobians(b, w, ids), b.hh @ M, 1.0 / gap.clamp_min(0.05), max_rank=w.n * M.shape[1] // 2,
                  rel_tol=1e-6)  # every direction: the default 1e-3 drops the weakest, the test needs them all
    assert V.rank == len(want)  # one direction per row: the rows' G_b are independent here
    U = torch.randn(w.n, M.shape[1], generator=torch.Generator().manual_seed(5))
    U2 = torch.randn(w.n, M.shape[1], generator=torch.Generator().manual_seed(6))
    Up = project_out(U, V)
    PU = V.project(U)
    assert float(V.project(PU).sub(PU).norm()) <= 1e-3 * float(PU.norm())  # a projector: P² = P ...
    assert float((V.project(U2) * U).sum()) == pytest.approx(float((PU * U2).sum()), rel=1e-3)  # ... symmetric
    assert float(V.coords(Up).abs().max()) <= 1e-4 * float(V.coords(U).abs().max())  # every row's G_b ⟂ Up
    def gap_change(Umat):
        z1 = (_mix(bg, w, dW=Umat @ M.T) @ w.head.T).double()[want].gather(1, ids)
        d0 = z0[want].gather(1, ids)
        return (z1[:, 0] - z1[:, 1]) - (d0[:, 0] - d0[:, 1])

    eps = 0.02 * float(w.W_sd.std()) / float((U @ M.T).std())
    free, kept = gap_change(eps * U), gap_change(eps * Up)
    assert float(free.abs().max()) > 1e-2  # the planted step does move the gaps
    assert float(kept.abs().max()) <= 0.02 * float(free.abs().max())


def test_ftpo_turn_end_directions_hold_log_p_of_the_turn_end_to_first_order(setup):
    """turn_end_basis / off_span: B is orthonormal and holds ≥ `energy` of the energy of the gradients
    ∂ log p(target)/∂ys — the reference gradients from a DENSE f64 log-softmax over the full vocabulary (the basis
    uses the streamed log-sum-exp); ΔW = ε·off_span(U)·Mᵀ moves log p(target) at those rows by ≤ 5 % of what
    ε·U·Mᵀ moves it (measured by the same dense forward: second order, f32 rounding and the 0.1 % energy left),
    and on the joint parameterisation the gap rows stay unmoved too (both projections hold)."""
    from l47.solvers.batch import ys_grad_mix
    from l47.solvers.ftpo import (background_scales, gap_basis, gap_jacobians, key_basis, off_span, project_out,
                                  special_word_pairs, turn_end_basis)

    w, ev, bg, an = setup["w"], setup["ev"], setup["bg"], setup["an"]
    with torch.enable_grad():
        ys, mix = ys_grad_mix(an, w, w.W_sd)
        lp = torch.log_softmax((mix @ w.head.T).double(), -1)[torch.arange(an.P), an.target]
        lp.sum().backward()
    G = ys.grad.double()  # [A, n] reference gradients
    B = turn_end_basis(an, w, 0.999, w.n)
    k = B.shape[1]
    assert 1 <= k < w.n
    assert torch.allclose(B.T.double() @ B.double(), torch.eye(k, dtype=torch.float64), atol=1e-5)
    kept = float((G @ B.double()).pow(2).sum() / G.pow(2).sum())
    assert kept >= 0.999 - 1e-4, kept
    S = torch.linalg.svdvals(G)  # the fewest: one direction less holds less than the share
    assert float(S[:k - 1].pow(2).sum() / S.pow(2).sum()) < 0.999

    Q = key_basis(ev.hh, torch.as_tensor([i % 2 for i in range(ev.P)]), bg.hh, 8).float()
    M = Q * background_scales(bg.hh, Q)  # [f, K]
    U = torch.randn(w.n, M.shape[1], generator=torch.Generator().manual_seed(5))
    Up = off_span(U, B)
    assert float((B.T @ Up).abs().max()) <= 1e-5 * float(U.abs().max())
    lp0 = torch.log_softmax((_mix(an, w) @ w.head.T).double(), -1)[torch.arange(an.P), an.target]

    def change(Umat):
        z = (_mix(an, w, dW=Umat @ M.T) @ w.head.T).double()
        return torch.log_softmax(z, -1)[torch.arange(an.P), an.target] - lp0

    eps = 0.02 * float(w.W_sd.std()) / float((U @ M.T).std())
    free, held = change(eps * U), change(eps * Up)
    assert float(free.abs().max()) > 1e-3  # the planted step does move log p there
    assert float(held.abs().max()) <= 0.05 * float(free.abs().max()), (float(held.abs().max()), float(free.abs().max()))

    # both projections at once: off span B, then off the gap directions of (I − B Bᵀ)J
    z0 = (_mix(bg, w) @ w.head.T).double()
    special = torch.as_tensor(sorted(set(int(t) for t in torch.topk(z0, 2).indices[:40, 1])))
    b, ids, gap = special_word_pairs([bg], w, special, 4.0)
    J = off_span(gap_jacobians(b, w, ids).T, B).T
    V = gap_basis(J, b.hh @ M, 1.0 / gap.clamp_min(0.05), max_rank=w.n * M.shape[1] // 2, rel_tol=1e-6)
    Y = project_out(off_span(U, B), V)
    assert float((B.T @ Y).abs().max()) <= 1e-4 * float(U.abs().max())  # still off span B
    Jfull = gap_jacobians(b, w, ids).double()
    moved = ((Jfull @ Y.double()) * (b.hh @ M).double()).sum(1)  # first-order gap change per row
    base = ((Jfull @ U.double()) * (b.hh @ M).double()).sum(1)
    assert float(moved.abs().max()) <= 1e-3 * float(base.abs().max())


def test_ftpo_plausible_turn_ends_select_and_cost_against_full_softmax(setup):
    """The plausible turn ends are the background rows whose f64 full-softmax p(turn-end token) is ≥
    plausible_end_p and whose target is not that token, the most likely first (capped); with only them as soft
    anchors the objective's anchor term is mean((Δlog p / tol)²) over the rotated subset, recomputed here from the
    f64 log-softmax (rel 1e-4: f32 logits); 0 at ΔW = 0."""
    import dataclasses

    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Objective

    w, ev, terms, bg = setup["w"], setup["ev"], setup["terms"], setup["bg"]
    lp0 = torch.log_softmax((_mix(bg, w) @ w.head.T).double(), -1)  # [B, V]
    im = int(torch.median(lp0.argmax(-1)))  # a token that is likely at some rows, not at all
    p_min = float(torch.quantile(lp0[:, im].exp(), 0.6))
    bg = dataclasses.replace(bg, target=torch.where(torch.arange(bg.P) % 7 == 0, torch.tensor(im), bg.target))
    ok = (lp0[:, im].exp() >= p_min) & (bg.target != im)
    want = torch.nonzero(ok)[:, 0]
    assert 5 < want.numel() < bg.P  # planted: some rows plausible, some real turn ends among them left out
    cfg = FtpoConfig(plausible_end_p=p_min, anchor_batch=0, gap_margin=0.0, lambda_flip=0.0, end_odds_tol=0.0)
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=bg, target_residual=0.5,
                     kl_budget=0.1, im_end=im, im_end_tol=0.02)
    obj = _Objective(w, pb, cfg, torch.zeros(ev.P, dtype=torch.long))
    assert sorted(obj.pe_rows.tolist()) == want.tolist()
    assert (lp0[obj.pe_rows, im].diff() <= 1e-6).all()  # the most likely first
    capped = _Objective(w, pb, dataclasses.replace(cfg, plausible_end_rows=3), torch.zeros(ev.P, dtype=torch.long))
    assert capped.pe_rows.tolist() == want[torch.argsort(lp0[want, im], descending=True)[:3]].tolist()
    rows = torch.arange(bg.P)
    assert obj(torch.zeros(w.n, w.f), rows, 1.0)[1]["coll"] == pytest.approx(0.0, abs=1e-9)
    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(6))
    lp1 = torch.log_softmax((_mix(bg, w, dW=dW) @ w.head.T).double(), -1)
    ref = float((((lp1[want, im] - lp0[want, im]) / 0.02) ** 2).mean())
    assert ref > 1e-3 and obj(dW, rows, 1.0)[1]["coll"] == pytest.approx(ref, rel=1e-4)
    off = _Objective(w, pb, dataclasses.replace(cfg, plausible_end_p=0.0), torch.zeros(ev.P, dtype=torch.long))
    assert off.pe_rows is None and off(dW, rows, 1.0)[1]["coll"] == 0.0


def test_ftpo_turn_end_log_odds_cost_against_full_softmax(setup):
    """At turn-end anchors the anchor cost is (Δlog p / tol)² + (Δo / end_odds_tol)², o = z_end − log Σ exp z over
    the row's base top-(K+1) without the turn-end token, recomputed here from f64 full-vocabulary logits (rel 1e-4:
    f32 logits); 0 at ΔW = 0; with end_odds_tol = 0 the log p term alone."""
    import dataclasses

    from l47.model import names
    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Objective

    w, ev, terms, an = setup["w"], setup["ev"], setup["terms"], setup["an"]
    z0 = (_mix(an, w) @ w.head.T).double()  # [A, V]
    im = int(torch.mode(z0.argmax(-1)).values)
    an = dataclasses.replace(an, target=torch.full_like(an.target, im))  # every anchor a real turn end
    K, tol, tol_o = 4, 0.02, 0.05
    cfg = FtpoConfig(anchor_batch=0, gap_margin=0.0, lambda_flip=0.0, plausible_end_p=0.0, tether_topk=K,
                     end_odds_tol=tol_o)
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=setup["bg"], target_residual=0.5,
                     kl_budget=0.1, anchors=an, anchor_group=[names.IM_END] * an.P, anchor_tol=[tol] * an.P, im_end=im,
                     turn_ends=an.P)
    obj = _Objective(w, pb, cfg, torch.zeros(ev.P, dtype=torch.long))
    rows = torch.arange(pb.background.P)
    assert obj(torch.zeros(w.n, w.f), rows, 1.0)[1]["coll"] == pytest.approx(0.0, abs=1e-9)

    def ref(dW):
        z1 = (_mix(an, w, dW=dW) @ w.head.T).double()
        top = torch.topk(z0, K + 1, dim=-1).indices  # [A, K+1] the base top-(K+1)
        keep = top != im

        def odds(z):
            return z[:, im] - torch.logsumexp(z.gather(1, top).masked_fill(~keep, -torch.inf), -1)

        dlp = torch.log_softmax(z1, -1)[:, im] - torch.log_softmax(z0, -1)[:, im]
        return float(((dlp / tol) ** 2 + ((odds(z1) - odds(z0)) / tol_o) ** 2).mean()), dlp, odds(z1) - odds(z0)

    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(7))
    want, _, _ = ref(dW)
    assert want > 1e-3 and obj(dW, rows, 1.0)[1]["coll"] == pytest.approx(want, rel=1e-4)
    _, dlp, _ = ref(dW)
    off = _Objective(w, pb, dataclasses.replace(cfg, end_odds_tol=0.0), torch.zeros(ev.P, dtype=torch.long))
    assert off(dW, rows, 1.0)[1]["coll"] == pytest.approx(float(((dlp / tol) ** 2).mean()), rel=1e-4)


def test_ftpo_turn_end_runner_up_drift_against_full_logits(setup):
    """With end_lead_tol on, the turn ends add one anchor group: Σ_g n_g (min(mean_g Δd, 0) / tol)² / Σ n_g, d = z_end −
    z_r with r the row's strongest other token in the base, g the rows sharing r — recomputed here from f64
    full-vocabulary logits (rel 1e-4: f32 logits). 0 at ΔW = 0; one-sided (the ΔW below raises some groups' leads
    and lowers others': only the lowered ones cost)."""
    import dataclasses

    from l47.model import names
    from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Objective

    w, ev, terms, an = setup["w"], setup["ev"], setup["terms"], setup["an"]
    z0 = (_mix(an, w) @ w.head.T).double()  # [A, V]
    im = int(torch.mode(z0.argmax(-1)).values)
    an = dataclasses.replace(an, target=torch.full_like(an.target, im))  # every anchor a real turn end
    tol, tol_d = 0.02, 0.03
    cfg = FtpoConfig(anchor_batch=0, gap_margin=0.0, lambda_flip=0.0, plausible_end_p=0.0, end_lead_tol=tol_d)
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a"] * ev.P, background=setup["bg"], target_residual=0.5,
                     kl_budget=0.1, anchors=an, anchor_group=[names.IM_END] * an.P, anchor_tol=[tol] * an.P, im_end=im,
                     turn_ends=an.P)
    obj = _Objective(w, pb, cfg, torch.zeros(ev.P, dtype=torch.long))
    rows = torch.arange(pb.background.P)
    assert obj(torch.zeros(w.n, w.f), rows, 1.0)[1]["coll"] == pytest.approx(0.0, abs=1e-9)
    others = z0.clone()
    others[:, im] = -torch.inf
    r = others.argmax(-1)  # [A] the base runner-up
    assert torch.unique(r).numel() > 1  # several groups, so the group means are what is tested

    def ref(dW):
        z1 = (_mix(an, w, dW=dW) @ w.head.T).double()
        dlp = torch.log_softmax(z1, -1)[:, im] - torch.log_softmax(z0, -1)[:, im]
        dd = (z1[:, im] - z1.gather(1, r[:, None])[:, 0]) - (z0[:, im] - z0.gather(1, r[:, None])[:, 0])
        drift = [(float(m.sum()), float(dd[m].mean())) for m in (r[None] == torch.unique(r)[:, None])]
        lead = sum(n * (min(d, 0.0) / tol_d) ** 2 for n, d in drift) / len(r)
        return (float(((dlp / tol) ** 2).mean()) + lead) / 2, [d for _, d in drift]  # two groups: anchors, leads

    dW = 0.3 * w.W_sd.std() * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(7))
    want, drift = ref(dW)
    assert min(drift) < -1e-3 and max(drift) > 1e-3  # both signs present: the hinge is exercised
    assert obj(dW, rows, 1.0)[1]["coll"] == pytest.approx(want, rel=1e-4)


def test_ftpo_names_the_soft_term_that_holds_a_phrase_at_the_cap(setup):
    """A ridge on ‖ΔW‖² too stiff for the target (λ_ridge 300; at 30 the same solve converges): the trainer stops
    at its step cap with both phrases short (≈ 0.65 against 0.5) and no constraint binding, and the record says
    what holds them — the ridge, whose gradient cancels more than half of each phrase's pull at the kept candidate
    (pull_balance; its shares are checked against finite differences in tests/test_ftpo_terms.py). The special-mass
    bar and the soft anchors are set loose (special_tol 1, anchor tolerance 1 nat): the judge holds the anchors'
    mean within their tolerance and doubles λ_coll while it is broken, so at 0.05 nats on these random anchors the
    soft anchors, not the ridge, hold both phrases (a constraint binding, as the record then says)."""
    from l47.solvers.ftpo import FtpoProblem

    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a" if i % 2 else "b" for i in range(ev.P)], background=bg,
                     target_residual=0.5, kl_budget=0.3, anchors=an, anchor_group=["w"] * an.P,
                     anchor_tol=[1.0] * an.P, special_tol=1.0)
    res = train_ftpo(w, pb, FtpoConfig(steps=300, lr=0.3, key_rank=10, eval_every=10, lambda_ridge=300.0))
    assert res.stopped == "iteration_cap"
    assert set(res.pull_balance) == {"a", "b"}
    for ph in ("a", "b"):
        shares = res.pull_balance[ph]
        assert max(shares, key=shares.get) == "ridge" and shares["ridge"] > 0.5, shares
        assert "no constraint binds; held by the ridge (cancels" in res.phrase_stops[ph], res.phrase_stops[ph]
    assert res.summary()["pull_balance"] == res.pull_balance
