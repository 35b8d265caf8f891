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


@pytest.fixture(scope="module")
def setup():
    m = tiny_model(seed=0)
    w = weights_from_hf(m)
    ids = torch.randint(0, 1024, (400,), generator=torch.Generator().manual_seed(1))
    s, logits = capture(m, ids)

    def mk(rows):
        r = torch.as_tensor(rows)
        return Batch(R=s["R"][r], inj=s["inj"][r], hh=s["hh"][r], sgv=s["sgv"][r], yr=s["yr"][r],
                     target=ids[r + 1], doc=("d",) * len(rows), pos=tuple(rows))

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


def test_wfld_is_deterministic(setup):
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    a = solve_wfld(w, ev, terms, bg, an, WfldConfig())
    b = solve_wfld(w, ev, terms, bg, an, WfldConfig())
    assert torch.equal(a.dW, b.dW)


def test_ftpo_reduces_rejected_within_kl_budget(setup):
    w, ev, terms, bg, an = setup["w"], setup["ev"], setup["terms"], setup["bg"], setup["an"]
    cfg = FtpoConfig(steps=60, lr=5e-3, kl_budget=0.05, eval_every=10)
    res = train_ftpo(w, terms, ev, bg, an, [int(t) for t in an.target], None, cfg)
    assert res.best_step > 0
    before, after = _p_rej(ev, w, terms.rejected), _p_rej(ev, w, terms.rejected, dW=res.dW)
    assert after.mean() < 0.7 * before.mean()
    ps = paired_stats(_mix(bg, w), _mix(bg, w, dW=res.dW), w, bg.target.numpy())
    assert ps.kld.mean() <= 0.05 + 1e-6
