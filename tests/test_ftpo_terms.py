"""FTPO's loss term by term (solvers/ftpo/objective.py `Term`): each term's cost at one step, on the tiny transformers
Qwen4Exp at a random ΔW, against a float64 re-derivation from the full-vocabulary log-softmax (the tail forward is
shared: what is tested is the term's algebra, its rows and tokens, not the forward). Then the loss: the weighted sum
of the terms.

Tolerances: the objective's forward is f32 and its vocabulary reductions f64; each reference below is f64 over
the same f32 hidden states, so the terms agree to f32 logit rounding: 1e-4 relative (plus an absolute floor stated
per term for a term near zero).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from l47.model import names
from l47.solvers.batch import EventTerms, pick_chosen
from l47.solvers.ftpo import FtpoConfig, FtpoProblem, _Objective
from l47.solvers.ftpo.objective import Step
from l47.tail.forward import tail_mix
from test_solvers import tiny_rows


def _z(b, w, dW=None) -> torch.Tensor:
    """f64 logits [P, V] of a batch (the f32 hidden state, the head in f64)."""
    return tail_mix(b.R, b.inj, b.hh, b.sgv, b.yr, w, dW=dW).double() @ w.head.double().T


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    w, ids, logits, mk = tiny_rows()
    ev = mk(list(range(0, 60, 3)))
    bg = mk(list(range(150, 300)))
    z0_bg = _z(bg, w)
    spec = sorted({int(t) for t in z0_bg.argmax(-1)[:12].tolist()})  # special tokens that lead some background rows
    rej = _z(ev, w).argmax(-1)
    terms = EventTerms(rejected=rej, chosen=pick_chosen(ev, w, rej, spec), special=torch.tensor(spec),
                       scale=torch.ones(ev.P))
    an = mk(list(range(100, 125)))  # 10 + 10 collateral anchors of two words, then 5 turn ends
    near = mk(list(range(61, 91, 3)))
    pb = FtpoProblem(events=ev, terms=terms, phrase=["a" if i % 3 else "b" for i in range(ev.P)], background=bg,
                     target_residual=0.5, kl_budget=0.1, anchors=an,
                     anchor_group=["w1"] * 10 + ["w2"] * 10 + [names.IM_END] * 5,
                     anchor_tol=[0.02] * 10 + [0.05] * 10 + [0.005] * 5, turn_ends=5, near=near,
                     near_banned=(ids[torch.arange(61, 91, 3) + 1] + 1) % 1024, special_tol=1.0,
                     guard=mk(list(range(126, 150, 2))))  # slop events of the background documents
    cfg = FtpoConfig(key_rank=0, anchor_batch=0, lambda_shape=0.5, lambda_cond=2.0, flip_margin=50.0,
                     lambda_ridge=0.3, anchor_knee=0.75)  # knee: 9 of the 20 word anchors past it at dW
    group = torch.as_tensor([0 if p == "a" else 1 for p in pb.phrase])
    obj = _Objective(w, pb, cfg, group)
    dW = 0.05 * float(w.W_sd.pow(2).mean().sqrt()) * torch.randn(w.n, w.f, generator=torch.Generator().manual_seed(3))
    rows = torch.arange(0, bg.P, 2)
    return dict(w=w, pb=pb, cfg=cfg, obj=obj, dW=dW, rows=rows, st=Step(obj, dW, rows), spec=torch.tensor(spec))


def _cost(world, name: str) -> float:
    return float(world["obj"].terms[name].cost(world["st"]))


def _topk_keep(z0: torch.Tensor, banned: torch.Tensor, spec: torch.Tensor, K: int):
    """Base top-K ids per row [P, K] and which of them the tether keeps (not banned, not special)."""
    ids = z0.argsort(-1, descending=True)[:, :K]
    return ids, (ids != banned[:, None]) & ~torch.isin(ids, spec)


def test_target_hinge_term(world):
    """pref = mean over phrases of mean over events of τ·softplus((Δo + d)/τ): o the log-odds of the rejected token
    against the rest of its base top-K (neither it nor a special token), d = logit p⁰ − logit(aim·t·p⁰)."""
    w, pb, cfg, dW = world["w"], world["pb"], world["cfg"], world["dW"]
    z0, z1 = _z(pb.events, w), _z(pb.events, w, dW)
    r = pb.terms.rejected
    ids, keep = _topk_keep(z0, r, world["spec"], cfg.tether_topk)
    ar = torch.arange(pb.events.P)

    def odds(z):
        return z[ar, r] - torch.logsumexp(z.gather(1, ids).masked_fill(~keep, -math.inf), 1)

    p0 = torch.softmax(z0, -1)[ar, r]
    q = cfg.aim * pb.target_residual * p0
    d = torch.log(p0) - torch.log((1 - p0).clamp_min(1e-6)) - torch.log(q) + torch.log1p(-q)
    h = cfg.taper * torch.nn.functional.softplus((odds(z1) - odds(z0) + d) / cfg.taper)
    ph = torch.as_tensor([p == "a" for p in pb.phrase])
    ref = 0.5 * (h[ph].mean() + h[~ph].mean())
    assert _cost(world, "pref") == pytest.approx(float(ref), rel=1e-4)


def test_background_kl_term(world):
    """kl_step = mean over the step's background rows of KL(p⁰ ‖ p) over the whole vocabulary (nats)."""
    w, pb, rows, dW = world["w"], world["pb"], world["rows"], world["dW"]
    b = pb.background
    l0 = torch.log_softmax(_z(b, w), -1)[rows]
    l1 = torch.log_softmax(_z(b, w, dW), -1)[rows]
    ref = float((l0.exp() * (l0 - l1)).sum(-1).mean())
    assert ref > 1e-4
    assert _cost(world, "kl_step") == pytest.approx(ref, rel=1e-3, abs=1e-6)  # a difference of O(lse) terms


def test_special_mass_term(world):
    """special = mean over events of max(Δ log Σ_s p_s, 0) + mean over the step's background rows of
    max(Δ log Σ_s p_s, 0) + the same mean over the background documents' slop events (f64 full softmax; rel 1e-4:
    f32 logits)."""
    w, pb, rows, dW, spec = world["w"], world["pb"], world["rows"], world["dW"], world["spec"]

    def mass(b, dW=None):
        return torch.softmax(_z(b, w, dW), -1)[:, spec].sum(1)

    ev = (mass(pb.events, dW).log() - mass(pb.events).log()).clamp_min(0).mean()
    bg = (mass(pb.background, dW).log() - mass(pb.background).log())[rows].clamp_min(0).mean()
    gd = (mass(pb.guard, dW).log() - mass(pb.guard).log()).clamp_min(0).mean()
    assert float(ev + bg) > 0 and float(gd) > 0.05 * float(ev + bg)  # the guard events' part counts
    assert _cost(world, "special") == pytest.approx(float(ev + bg + gd), rel=1e-4, abs=1e-7)


def test_conditional_tether_term(world):
    """cond_kl = λ_shape · mean over events + λ_cond · mean over near misses of KL(q⁰ ‖ q), q the distribution over
    the row's base top-K without the banned and special tokens, renormalised."""
    w, pb, cfg, dW, spec = world["w"], world["pb"], world["cfg"], world["dW"], world["spec"]

    def tether(b, banned):
        z0, z1 = _z(b, w), _z(b, w, dW)
        ids, keep = _topk_keep(z0, banned, spec, cfg.tether_topk)
        q0 = torch.log_softmax(z0.gather(1, ids).masked_fill(~keep, -math.inf), -1)
        q1 = torch.log_softmax(z1.gather(1, ids).masked_fill(~keep, -math.inf), -1)
        return torch.where(keep, q0.exp() * (q0 - q1), torch.zeros_like(q0)).sum(-1).mean()

    ref = cfg.lambda_shape * tether(pb.events, pb.terms.rejected) + cfg.lambda_cond * tether(pb.near, pb.near_banned)
    assert _cost(world, "cond_kl") == pytest.approx(float(ref), rel=1e-4)


def test_soft_anchor_term(world):
    """coll = mean over anchor groups (each word, the turn ends) of the mean cost per anchor, x = Δlog p(target) /
    tol: the turn ends x², the collateral words x² up to the knee (anchor_knee tolerances) and linear past it with
    the same slope, 2·knee·|x| − knee² (every anchor in this step: anchor_batch 0; no plausible turn ends: no
    turn-end token named). Reference: the f64 full softmax, the Huber written out per anchor."""
    w, pb, dW, k = world["w"], world["pb"], world["dW"], world["cfg"].anchor_knee
    a = pb.anchors
    ar = torch.arange(a.P)
    dl = torch.log_softmax(_z(a, w, dW), -1)[ar, a.target] - torch.log_softmax(_z(a, w), -1)[ar, a.target]
    x = (dl / torch.as_tensor(pb.anchor_tol, dtype=torch.float64)).tolist()
    c = [v * v if i >= 20 or abs(v) <= k else 2 * k * abs(v) - k * k for i, v in enumerate(x)]
    assert sum(abs(v) > k for v in x[:20]) >= 3 and sum(abs(v) <= k for v in x[:20]) >= 3  # both pieces met
    assert max(abs(v) for v in x[20:]) > k  # a turn end past the knee still costs its square
    ref = (np.mean(c[:10]) + np.mean(c[10:20]) + np.mean(c[20:])) / 3
    assert _cost(world, "coll") == pytest.approx(float(ref), rel=1e-3)  # (Δℓ / 0.005)²: f32 Δℓ magnified


def test_soft_anchor_huber_is_continuous_with_its_slope():
    """soft_anchor's Huber: the square within the knee, linear past it, value and slope continuous at ±knee
    (central differences in f64, 1e-6: the pieces are polynomials), the plain square with knee = inf."""
    from l47.solvers.ftpo import soft_anchor

    tol, k = torch.tensor(0.05, dtype=torch.float64), 2.0
    for x in (-3.0, -2.0, -1.0, 0.5, 2.0, 7.0):
        d = torch.tensor(x * 0.05, dtype=torch.float64, requires_grad=True)
        c = soft_anchor(d, tol, k)
        want = x * x if abs(x) <= k else 2 * k * abs(x) - k * k
        assert float(c.detach()) == pytest.approx(want, rel=1e-12)
        (g,) = torch.autograd.grad(c, d)
        h = 1e-7
        fd = (float(soft_anchor(d.detach() + h, tol, k)) - float(soft_anchor(d.detach() - h, tol, k))) / (2 * h)
        assert float(g) == pytest.approx(fd, rel=1e-6)
    assert float(soft_anchor(torch.tensor(-0.5, dtype=torch.float64), tol)) == pytest.approx(100.0)


def test_near_tie_term(world):
    """flip = Σ over the background rows and turn ends whose base top two are one special token and one not,
    within flip_margin, of (max(d⁰ − d, 0) / max(gap⁰, 0.05))², d = z_t1 − z_t2 and gap⁰ the base log-prob gap.
    At 5× the fixture's ΔW: a shrink is a difference of f32 logits (~1e-5 absolute at |z| ~ 10), so it must be
    large against that for a 1e-3 relative agreement."""
    w, pb, cfg, spec = world["w"], world["pb"], world["cfg"], world["spec"]
    dW = 5 * world["dW"]
    total, n = 0.0, 0
    for b in (pb.background, pb.anchors):
        sel = slice(None) if b is pb.background else slice(20, None)  # the anchors' turn ends
        z0, z1 = _z(b, w)[sel], _z(b, w, dW)[sel]
        top = z0.argsort(-1, descending=True)[:, :2]
        sp = torch.isin(top, spec)
        lp0 = torch.log_softmax(z0, -1).gather(1, top)
        gap0 = lp0[:, 0] - lp0[:, 1]
        m = (sp[:, 0] != sp[:, 1]) & (gap0 < cfg.flip_margin)
        d0, d1 = (z[m].gather(1, top[m]) for z in (z0, z1))
        shrink = ((d0[:, 0] - d0[:, 1]) - (d1[:, 0] - d1[:, 1])).clamp_min(0)
        total += float(((shrink / gap0[m].clamp_min(0.05)) ** 2).sum())
        n += int(m.sum())
    assert n >= 5 and total > 0
    got = float(world["obj"].terms["flip"].cost(Step(world["obj"], dW, world["rows"])))
    assert got == pytest.approx(total, rel=1e-3)


def test_ridge_term(world):
    assert _cost(world, "ridge") == pytest.approx(float(world["dW"].double().pow(2).sum()), rel=1e-5)


def test_loss_is_the_weighted_sum_of_the_terms(world):
    """loss = Σ weight · cost / norm over the terms (λ = 1.7 on the KL), every part reported as its cost."""
    obj, dW, rows, cfg, pb = world["obj"], world["dW"], world["rows"], world["cfg"], world["pb"]
    loss, parts = obj(dW, rows, 1.7)
    ridge = float(dW.double().pow(2).sum()) / obj.W_sq
    ref = (parts["pref"] + 1.7 * parts["kl_step"] / pb.kl_budget + parts["cond_kl"] / pb.kl_budget
           + cfg.lambda_flip * parts["flip"] + cfg.lambda_coll * parts["coll"] + cfg.lambda_special * parts["special"]
           + cfg.lambda_ridge * ridge)
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    for k in ("pref", "kl_step", "cond_kl", "coll", "special", "flip"):
        assert parts[k] == pytest.approx(_cost(world, k), rel=1e-5, abs=1e-9)


def test_pull_balance_matches_finite_differences(world):
    """pull_balance: each term's share of phrase "a"'s pull, −⟨∇ term, ∇ pull⟩ / ‖∇ pull‖², against the term's
    central finite difference along the pull's gradient g: share ≈ −(c(ΔW + εg) − c(ΔW − εg)) / (2ε‖g‖²). ε moves
    ΔW by 1e-3 of its size: the f32 forward resolves the difference to ~1e-3 of it (tolerance 3 % of the share
    plus 2e-3 absolute, for the kinks of the relu terms and f32 rounding)."""
    from l47.solvers.ftpo.objective import pull_balance

    obj, dW, rows, pb = world["obj"], world["dW"], world["rows"], world["pb"]
    mask = torch.as_tensor([float(p == "a") for p in pb.phrase])
    shares = pull_balance(obj, lambda p: p, dW, rows, mask)
    assert set(shares) >= {"kl_step", "cond_kl", "coll", "ridge"}, shares

    def weighted(name: str, d: torch.Tensor, events_on: torch.Tensor | None = None) -> float:
        on = obj.event_on
        if events_on is not None:
            obj.event_on = events_on
        try:
            return float(obj.terms[name].weighted(obj.terms[name].cost(Step(obj, d, rows))).double())
        finally:
            obj.event_on = on

    p = dW.clone().requires_grad_(True)
    with torch.enable_grad():
        on = obj.event_on
        obj.event_on = mask
        pull = obj.terms["pref"].weighted(obj.terms["pref"].cost(Step(obj, p, rows)))
        obj.event_on = on
        g = torch.autograd.grad(pull, p)[0]
    gg = float(g.double().pow(2).sum())
    eps = 1e-3 * float(dW.norm()) / math.sqrt(gg)
    # the pull along its own gradient: its directional derivative is ‖g‖² (share −1)
    d_pull = (weighted("pref", dW + eps * g, mask) - weighted("pref", dW - eps * g, mask)) / (2 * eps)
    assert d_pull == pytest.approx(gg, rel=0.03)
    for name, share in shares.items():
        fd = -(weighted(name, dW + eps * g) - weighted(name, dW - eps * g)) / (2 * eps * gg)
        assert share == pytest.approx(fd, rel=0.03, abs=2e-3), (name, share, fd)
    # and the shares are not all zero: the terms do pull against the phrase at a random ΔW
    assert max(abs(v) for v in shares.values()) > 1e-2, shares


def test_vocab_log_odds_against_the_full_softmax_and_finite_differences(world):
    """o = z_r − log Σ_{v ∉ {r} ∪ special} exp z_v (odds = "vocabulary"): its value against the f64 full-vocabulary
    re-derivation (f32 hidden state: 1e-4 relative), and its gradient along a random direction of mix against a
    central difference of the f64 reference (step 1e-3 of mix's RMS; the reference is smooth, so the difference's
    error is O(h²) ≈ 1e-6 relative; the f32 forward adds ~1e-4: tolerance 1e-3 relative)."""
    from l47.solvers.batch import batch_mix
    from l47.solvers.ftpo.objective import vocab_log_odds

    w, pb, spec = world["w"], world["pb"], world["spec"]
    r = pb.terms.rejected
    mix = batch_mix(pb.events, w, dW=world["dW"]).detach()  # [E, n]

    def ref(m: torch.Tensor) -> torch.Tensor:
        z = m.double() @ w.head.double().T  # [E, V]
        keep = torch.ones_like(z, dtype=torch.bool)
        keep[torch.arange(z.shape[0]), r] = False
        keep[:, spec] = False
        return z.gather(1, r[:, None])[:, 0] - torch.logsumexp(z.masked_fill(~keep, -math.inf), 1)

    m = mix.clone().requires_grad_(True)
    o = vocab_log_odds(m, w, r, spec)
    assert torch.allclose(o, ref(mix), rtol=1e-4, atol=1e-4)
    direction = torch.randn(mix.shape, generator=torch.Generator().manual_seed(5))
    (g,) = torch.autograd.grad((o * torch.arange(1, o.numel() + 1)).sum(), m)
    h = 1e-3 * float(mix.pow(2).mean().sqrt())
    wts = torch.arange(1, o.numel() + 1).double()
    fd = float(((ref(mix.double() + h * direction) - ref(mix.double() - h * direction)) * wts).sum()) / (2 * h)
    an = float((g.double() * direction).sum())
    assert abs(an - fd) <= 1e-3 * abs(fd), (an, fd)
