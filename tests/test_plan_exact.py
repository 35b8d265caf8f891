"""`l47 plan` checks its own edit exactly (issue 37 item 4): the joint least-KL ΔW of the linearised problem,
scaled by c ≤ 1 to the KL budget, run through the exact forward; per phrase its residual Σp1/Σp0 on the train and
dev events; the soft anchors' (d)/(f) figures at it; the binding read from the exact figure.

World: test_audit's tiny world with heldout_b moved to dev (3 phrases; 7 train, 5 dev events). Its own background
rows do not see the events' keys (the exact KL of any plan edit there is ~1e-10, rounding), so the cases that need
a costly edit use the same selection with the train and dev events' own rows added to the background.

Reference, independent of the plan's code: the tail forward written out again here in float64 from the equations
of l47/tail/forward.py's docstring, with the full softmax over the tiny vocabulary (V = 1024, no streaming), on the
states read from the dump files by each event's (document, row) in the world's own sets report. Tolerances: the
plan's forward is f32 (f64 sums): log p agrees to ~1e-5 nats, so a residual ratio to ~1e-5 relative; 1e-3 relative
is asserted (far below the 2× the plan promises), 1e-4 nats absolute on a mean Δlog p, 1e-3 relative on a KL.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_audit import _variant, world  # noqa: F401 - the module-scoped world fixture

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------
# the float64 reference forward


def _ref_logp(w, st: dict, dW: torch.Tensor | None) -> torch.Tensor:
    """log softmax [P, V] f64 of the tail at states `st` (R, inj, hh, sgv, yr as f64 tensors) under W_sd + dW."""
    d = lambda t: t.detach().double().cpu()  # noqa: E731
    W = d(w.W_sd) + (0 if dW is None else d(dW))  # [n, f]
    ys = st["hh"] @ W.T  # [P, n]
    bo = st["yr"] + torch.sigmoid(st["sgv"])[:, None] * ys
    Rp = st["R"] + bo[:, None, :] * (2.0 * torch.sigmoid(st["inj"] / w.hc))[:, :, None]  # [P, hc, n]
    xn = Rp * torch.rsqrt(Rp.pow(2).mean(-1, keepdim=True) + w.eps) * d(w.onorm)
    P = ys.shape[0]
    lo = torch.nn.functional.silu((xn.reshape(P, w.hc * w.n) @ d(w.odown).T) / w.hc)  # [P, r]
    gate = torch.sigmoid(lo @ d(w.oup).T).reshape(P, w.hc, w.n)
    mix = (gate * xn).mean(1)  # [P, n]
    return torch.log_softmax(mix @ d(w.head).T, -1)  # [P, V]


def _states_of_batch(b) -> dict:
    return {k: getattr(b, k).double().cpu() for k in ("R", "inj", "hh", "sgv", "yr")}


def _states_of_events(events) -> dict:
    """The events' states read from their dump files (row e.pos predicts the final token)."""
    from l47.dumps import read_dump

    cache, out = {}, {k: [] for k in ("R", "inj", "hh", "sgv", "yr")}
    for e in events:
        dump = cache.setdefault(e.doc, read_dump(e.doc))
        assert int(dump.tokens[e.pos + 1]) == e.final
        for k in out:
            out[k].append(torch.tensor(np.array(getattr(dump, k)[e.pos], dtype=np.float64)))
    return {k: torch.stack(v) for k, v in out.items()}


def _ref_residuals(w, events, dW) -> dict[str, float]:
    """phrase -> Σ p1 / Σ p0 over `events` (EventRecords) under ΔW, f64."""
    st = _states_of_events(events)
    fin = torch.as_tensor([e.final for e in events])
    p0 = _ref_logp(w, st, None)[torch.arange(len(events)), fin].exp()
    p1 = _ref_logp(w, st, dW)[torch.arange(len(events)), fin].exp()
    out = {}
    for ph in sorted({e.phrase for e in events}):
        m = torch.as_tensor([e.phrase == ph for e in events])
        out[ph] = float(p1[m].sum() / p0[m].sum())
    return out


def _ref_kl(w, bg, dW) -> float:
    """Mean KL(base ‖ edited) over the background batch's rows, f64, full vocabulary."""
    st = _states_of_batch(bg)
    l0, l1 = _ref_logp(w, st, None), _ref_logp(w, st, dW)
    return float((l0.exp() * (l0 - l1)).sum(-1).mean())


# ----------------------------------------------------------------------------------------------------------
# the world's plans


@pytest.fixture(scope="module")
def exact(world):
    from l47.solvers.batch import batch_cat
    from l47.solvers.methods import solver_for
    from l47.solvers.plan import feasibility
    from l47.solvers.problem import pose
    from l47.solvers.solve import SolveArgs, plan_inputs, plan_solve

    exp = _variant(world, "plan_exact", {"dev": [world["paths"]["heldout_b"].name]}, drop=("heldout_b",))
    plan = plan_solve(SolveArgs(experiment=exp, method="ftpo", out=Path("/nonexistent/plan-only.gguf"),
                                model=world["base"]))
    prob = pose(plan, solver_for("ftpo"), lambda _m: None)
    inp = plan_inputs(prob)
    w, cfg = plan.w, plan.cfg.wfld
    costly = dataclasses.replace(inp, background=batch_cat([inp.events, inp.dev_events, inp.background]),
                                 target=0.2)
    scaled = feasibility(w, dataclasses.replace(costly, kl_budget=0.0025), cfg, soft_anchors=True)
    wide = feasibility(w, dataclasses.replace(costly, kl_budget=2 * scaled.joint_exact_kl), cfg, soft_anchors=True)
    default = feasibility(w, inp, cfg, soft_anchors=True)
    heldout_b = str(world["paths"]["heldout_b"])
    train = [e for e in world["sets"].events if e.set == "train"]
    dev = [e for e in world["sets"].events if e.set == "dev" or (e.set == "heldout" and e.doc == heldout_b)]
    return dict(w=w, inp=inp, costly=costly, scaled=scaled, wide=wide, default=default, train=train, dev=dev)


def _print_plan(tag, fp):
    print(f"\n{tag}: c {fp.edit.c:.4g}, edit KL {fp.edit.kl:.4g} (budget {fp.kl_budget:.4g}; unscaled "
          f"{fp.joint_exact_kl:.4g}), words {fp.edit.word_dlogp}, turn ends {fp.edit.turn_end_dlogp:.3g}")
    for p in fp.phrases:
        print(f"  {p.phrase!r}: needed {p.needed_gap:.3g}, first-order reach {p.reachable_gap:.3g} (resid "
              f"{p.reachable_residual:.3g}); edit resid {p.edit_residual:.4g} (train {p.edit_residual_train:.4g}, dev "
              f"{p.edit_residual_dev:.4g}; unscaled {p.edit_residual_full:.4g}); share {p.joint_kl_share:.3f}; "
              f"{p.binding}")


def test_edit_residual_equals_a_float64_rederivation(exact):
    """(a) Each phrase's edit residual on train and dev equals the reference forward's Σp1/Σp0 under W + c·ΔW (the
    plan's returned edit), and edit_residual is the larger of the two (the solver's at-target rule); the soft
    anchors' per-word mean Δlog p and the turn ends' likewise."""
    w = exact["w"]
    for tag in ("default", "scaled", "wide"):
        fp = exact[tag]
        _print_plan(tag, fp)
        assert fp.edit is not None and fp.edit_dW is not None
        tr = _ref_residuals(w, exact["train"], fp.edit_dW)
        dv = _ref_residuals(w, exact["dev"], fp.edit_dW)
        assert set(tr) == set(dv) == {p.phrase for p in fp.phrases}
        for p in fp.phrases:
            assert p.edit_residual_train == pytest.approx(tr[p.phrase], rel=1e-3)
            assert p.edit_residual_dev == pytest.approx(dv[p.phrase], rel=1e-3)
            assert p.edit_residual == max(p.edit_residual_train, p.edit_residual_dev)
        held = exact["costly"].held if tag != "default" else exact["inp"].held
        words = np.asarray(exact["inp"].held_words)
        d = _ref_logp(w, _states_of_batch(held), fp.edit_dW) - _ref_logp(w, _states_of_batch(held), None)
        dl = d[torch.arange(held.P), held.target.cpu()].numpy()  # [A]
        assert set(fp.edit.word_dlogp) == set(words) - {"<|im_end|>"}
        for word, v in fp.edit.word_dlogp.items():
            assert v == pytest.approx(float(dl[words == word].mean()), abs=1e-4)
        assert fp.edit.turn_end_dlogp == pytest.approx(float(dl[words == "<|im_end|>"].mean()), abs=1e-4)
    # the costly world's edit moves the events for real (not a rounding-level edit)
    assert min(p.edit_residual_train for p in exact["wide"].phrases) < 0.5


def test_scaled_edit_is_within_the_budget_and_as_large_as_it_may_be(exact):
    """(b) The scaled edit's exact KL (re-derived in f64) is within the budget, c < 1 where the unscaled edit is
    over it, and c is the largest within the bisection's tolerance: the reference KL at c·(1 + 2·SCALE_REL) is over
    the budget. c = 1 (and the edit's KL the unscaled one) where the unscaled edit is already within the budget."""
    from l47.solvers.plan import SCALE_REL

    w, bg = exact["w"], exact["costly"].background
    seen_scaled = 0
    for tag in ("scaled", "wide"):
        fp = exact[tag]
        e = fp.edit
        ref = _ref_kl(w, bg, fp.edit_dW)
        assert e.kl == pytest.approx(ref, rel=1e-3) and e.kl <= fp.kl_budget and ref <= fp.kl_budget * (1 + 1e-3)
        assert 0 <= e.best_round < e.rounds
        full = fp.edit_dW / e.c
        assert _ref_kl(w, bg, full) == pytest.approx(e.kl_full, rel=1e-3)
        if e.kl_full > fp.kl_budget:
            seen_scaled += 1
            assert 0 < e.c < 1 and _ref_kl(w, bg, full * min(1.0, e.c * (1 + 2 * SCALE_REL))) > fp.kl_budget
        else:
            assert e.c == 1.0 and e.kl == e.kl_full
    assert seen_scaled >= 1 and exact["scaled"].joint_exact_kl > exact["scaled"].kl_budget
    d = exact["default"]  # its background barely moves: the edit is within the budget as it is
    assert d.edit.c == 1.0 and d.edit.kl == d.edit.kl_full <= d.kl_budget


@pytest.mark.parametrize("power", [2.0, 4.0, 1.0])
def test_scale_to_budget_on_a_known_curve(power):
    """The bisection on an analytic KL(c) = K·c^power (power 2: the small-edit law its first guess assumes; 4 and 1:
    a wrong guess): c* = (B/K)^(1/power), found within SCALE_REL below it, its KL within the budget."""
    from l47.solvers.plan import SCALE_ITERS, SCALE_REL, scale_to_budget

    K, B, calls = 0.4, 0.0025, []

    def kl_at(c):
        calls.append(c)
        return K * c ** power

    c, kl = scale_to_budget(kl_at, K, B)
    star = (B / K) ** (1 / power)
    assert star * (1 - SCALE_REL) <= c <= star and kl == pytest.approx(K * c ** power, rel=1e-12) and kl <= B
    assert len(calls) <= SCALE_ITERS
    if power == 2.0:
        assert len(calls) == 2  # the quadratic guess and its neighbour bracket it
    assert scale_to_budget(lambda c: 1 / 0, 0.001, B) == (1.0, 0.001)  # within already: no evaluation


def test_linearisation_binds_where_the_first_order_bound_overstates(exact):
    """(c) In the costly world at target 0.2 and budget 0.0025 the first-order bound calls every phrase reachable
    (reachable log-odds ≥ needed) while the exact edit within the budget stays above the target on the train events
    as well as unscaled (re-derived in f64): the binding reads `linearisation` — but for a phrase whose final word's
    anchors the edit lowers past bar (d)'s tolerance (that binding is tested below)."""
    from l47.solvers.plan import BINDING_ANCHORS, BINDING_ENDS, BINDING_LINEAR

    w, fp = exact["w"], exact["scaled"]
    full = fp.edit_dW / fp.edit.c
    at_c = {s: _ref_residuals(w, exact[s], fp.edit_dW) for s in ("train", "dev")}
    at_1 = {s: _ref_residuals(w, exact[s], full) for s in ("train", "dev")}
    assert BINDING_ENDS not in fp.edit.breaks
    broken = {wd.strip() for wd, v in fp.edit.word_dlogp.items() if v < -fp.edit.word_tol}
    carry = {p.phrase for p in fp.phrases if p.phrase.split()[-1] in broken}  # by text, the plan goes by token id
    lin = 0
    for p in fp.phrases:
        assert p.reachable_gap >= p.needed_gap and p.reachable_residual <= fp.target  # first order: reachable
        assert not p.reachable
        if p.phrase in carry:
            assert p.binding == BINDING_ANCHORS
            continue
        assert at_c["train"][p.phrase] > fp.target  # exact: short on its own train events...
        assert max(at_1["train"][p.phrase], at_1["dev"][p.phrase]) > fp.target  # ... and unscaled
        assert p.binding == BINDING_LINEAR
        lin += 1
    assert lin >= 2 and fp.unproven == fp.phrases and fp.short == []  # reachable at first order: a warning


def test_soft_anchors_bind_the_phrase_that_carries_the_edit(exact):
    """The budget twice the least-KL edit's KL: the plan's edit lowers the ' end' anchors' mean log p past bar (d)'s
    tolerance (re-derived in f64 in test (a)); 'end to end', the phrase ending in ' end' (and whose events carry
    > 90 % of the edit's KL), is bound by the soft anchors (d), named in a note; each other phrase reads what the f64 residuals say: `dev events` where its
    train events reach the target and its dev events do not, else `linearisation` (first order: reachable)."""
    from l47.solvers.plan import BINDING_ANCHORS, BINDING_DEV, BINDING_LINEAR

    w, fp = exact["w"], exact["wide"]
    assert BINDING_ANCHORS in fp.edit.breaks and fp.edit.word_dlogp[" end"] < -fp.edit.word_tol
    by = {p.phrase: p for p in fp.phrases}
    assert by["end to end"].joint_kl_share > 0.9 and by["end to end"].binding == BINDING_ANCHORS
    tr = _ref_residuals(w, exact["train"], fp.edit_dW)
    for ph in ("rather than", "right away"):
        assert by[ph].reachable_gap >= by[ph].needed_gap and by[ph].edit_residual > fp.target
        assert by[ph].binding == (BINDING_DEV if tr[ph] <= fp.target else BINDING_LINEAR)
    assert any("soft anchors (d) bind 'end to end'" in n for n in fp.notes)
    assert any("' end'" in n and "bar (d)" in n for n in fp.notes)


def test_binding_and_carriers_decisions():
    """The decision table of phrase_binding (numbers in, a constraint out) and carriers' rule (the fewest phrases,
    largest share first, holding more than half of the edit)."""
    from l47.solvers.plan import (BINDING_DEV, BINDING_EVENTS, BINDING_KL, BINDING_LINEAR, BINDING_NONE,
                                  BINDING_SPAN, carriers, phrase_binding)

    t = 0.2
    assert phrase_binding(False, False, False, False, None, None, None, t) == BINDING_EVENTS
    assert phrase_binding(True, True, True, False, 0.1, 0.1, 0.1, t) == BINDING_SPAN
    assert phrase_binding(True, False, False, True, None, None, None, t) == BINDING_KL  # no edit: first order
    assert phrase_binding(True, False, False, True, 0.19, 0.1, 0.1, t) == BINDING_NONE  # exact beats first order
    assert phrase_binding(True, False, False, False, 0.35, 0.3, 0.15, t) == BINDING_KL  # unscaled reaches it
    assert phrase_binding(True, False, False, False, 0.35, 0.15, 0.3, t) == BINDING_DEV  # train reached, dev not
    assert phrase_binding(True, False, False, False, 0.35, 0.3, 0.3, t) == BINDING_LINEAR
    assert phrase_binding(True, False, True, True, 0.35, 0.3, 0.3, t) == BINDING_SPAN  # first order short: its name
    assert carriers({"a": 0.6, "b": 0.3, "c": 0.1}) == ["a"]
    assert carriers({"a": 0.4, "b": 0.35, "c": 0.25}) == ["a", "b"]
    assert carriers({"a": 0.0, "b": 0.0}) == []


def test_soft_anchor_bindings_go_to_the_phrases_they_hold():
    """Numbers in, bindings out: a broken word binds the phrases ending in it; a broken word no phrase ends in, and
    broken turn ends, bind the carriers of the edit; a phrase held twice takes the larger multiple of its tolerance;
    no train events / anchors' span keep their name; nothing broken changes nothing."""
    from l47.solvers.plan import (BINDING_ANCHORS, BINDING_ENDS, BINDING_EVENTS, BINDING_LINEAR, BINDING_NONE,
                                  PhrasePlan, PlanEdit, _anchors_bind)

    def pp(ph, share, binding=BINDING_NONE):
        return PhrasePlan(ph, {}, 0.5, 1.0, 1.0, 0.0, 0.0, 0, 2.0, 0.1, share, binding)

    out = [pp("a b", 0.7), pp("c d", 0.2, BINDING_LINEAR), pp("e f", 0.1), pp("g h", 0.0, BINDING_EVENTS)]

    def edit(words, ends):
        e = PlanEdit(c=1.0, kl=1e-3, word_dlogp=words, word_tol=0.05, turn_end_dlogp=ends, turn_end_tol=0.005)
        return dataclasses.replace(e, breaks=[b for b, on in ((BINDING_ANCHORS, min(words.values()) < -0.05),
                                                              (BINDING_ENDS, ends < -0.005)) if on])

    def run(words, ends, owners):
        notes: list[str] = []
        return {p.phrase: p.binding for p in _anchors_bind(out, edit(words, ends), owners, notes)}, notes

    got, notes = run({" d": -0.2, " f": -0.01}, -0.001, {" d": ["c d"], " f": ["e f"]})
    assert got == {"a b": BINDING_NONE, "c d": BINDING_ANCHORS, "e f": BINDING_NONE, "g h": BINDING_EVENTS}
    assert len(notes) == 1 and "' d'" in notes[0] and "0.2 nats" in notes[0] and "'c d'" in notes[0]
    got, _ = run({" x": -0.1}, -0.001, {})  # a word no phrase ends in: the carriers ("a b": 70 % > half)
    assert got == {"a b": BINDING_ANCHORS, "c d": BINDING_LINEAR, "e f": BINDING_NONE, "g h": BINDING_EVENTS}
    got, _ = run({" b": -0.06}, -0.05, {" b": ["a b"]})  # "a b": word ×1.2 vs turn ends ×10 -> turn ends
    assert got["a b"] == BINDING_ENDS and got["c d"] == BINDING_LINEAR
    got, _ = run({" b": -0.5}, -0.006, {" b": ["a b"]})  # word ×10 vs turn ends ×1.2 -> the word
    assert got["a b"] == BINDING_ANCHORS
    got, notes = run({" b": -0.01}, -0.001, {" b": ["a b"]})
    assert got == {p.phrase: p.binding for p in out} and notes == []


# ----------------------------------------------------------------------------------------------------------
# (d) the benchmark's plan-vs-solver listing


def _bench():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_efficacy as be

    return be


def _method(plan: dict, solver: dict, target=0.2) -> dict:
    return {"plan_target": target, "solver_residual": solver,
            "plan": {ph: {"edit_residual": v, "binding": "none" if v <= target else "linearisation"}
                     for ph, v in plan.items()}}


def test_bench_lists_every_disagreement_between_plan_and_solver():
    """Numbers in, rows out: a phrase is listed when the plan reaches the target and the solver does not, or the
    ratio solver / plan, each read as at least the target, is outside [1/2, 2]; agreeing phrases (both at or
    below the target, however far) and phrases without a solver figure are not."""
    be = _bench()
    res = {"models": {
        "zoo5": {"methods": {"ftpo": _method({"a": 0.10, "b": 0.15, "c": 0.50, "d": 0.05, "e": 0.1, "f": 0.3,
                                              "g": 0.19, "h": 0.5},
                                             {"a": 0.15, "b": 0.25, "c": 0.10, "d": 0.45, "f": 0.5, "g": 0.02,
                                              "h": 0.21})}},
        "demo": {"methods": {"wfld": _method({"a": 0.1}, {"a": 0.1}), "ftpo": {"solve_error": "refused"}}},
        "bad": {"failed": {"command": "x", "error": "y"}}}}
    rows = be.plan_vs_solver(res)
    got = {(r["model"], r["method"], r["phrase"]): r for r in rows}
    assert set(got) == {("zoo5", "ftpo", "b"), ("zoo5", "ftpo", "c"), ("zoo5", "ftpo", "d"), ("zoo5", "ftpo", "h")}
    b, c, d, h = (got[("zoo5", "ftpo", x)] for x in "bcdh")
    assert b["why"] == "plan reachable, solver short" and b["ratio"] == pytest.approx(0.25 / 0.15, rel=1e-12)
    outside = "solver/plan (each at least the target) outside [0.5, 2]"
    assert c["why"] == outside and c["ratio"] == pytest.approx(0.2, rel=1e-12)  # 0.2 / 0.5 = 0.4 floored
    assert d["why"] == "plan reachable, solver short; " + outside and d["ratio"] == pytest.approx(9.0)  # 0.45 / 0.2
    assert (d["plan"], d["solver"], d["target"], d["binding"]) == (0.05, 0.45, 0.2, "none")
    assert h["why"] == outside and h["ratio"] == pytest.approx(0.42)  # 0.21 / 0.5
    # f: plan 0.3 (short) and solver 0.5: both above the target, ratio 1.67 — agreeing, not listed;
    # g: plan 0.19, solver 0.02: both at or below the target (raw ratio 0.105) — agreeing, not listed


def test_bench_solver_residual_is_the_at_target_rule():
    """The solver's figure per phrase: the larger of its dev and train residuals (mean p after / before from the
    solve record's claims), train alone where a phrase has no dev event."""
    from l47.data import record as rec

    be = _bench()
    tr = rec.PRejected(before=0.5, after=0.1, n=4, per_phrase_before={"a": 0.8, "b": 0.4},
                       per_phrase_after={"a": 0.08, "b": 0.2})
    dv = rec.PRejected(before=0.5, after=0.1, n=2, per_phrase_before={"a": 0.5}, per_phrase_after={"a": 0.1})
    claims = type("C", (), {"train_p_rejected": tr, "dev_p_rejected": dv})()
    assert be.solver_residuals(claims) == pytest.approx({"a": 0.2, "b": 0.5}, rel=1e-12)


def test_bench_markdown_carries_the_plan_columns_and_section():
    """The per-phrase table gains '<method> plan' and '<method> solver/plan' after the existing columns (kept in
    their order), and a 'plan vs solver' section lists the disagreements."""
    be = _bench()
    m = _method({"a": 0.1, "b": 0.15}, {"a": 0.12, "b": 0.25})
    m.update(dev={"a": {"residual": 0.12, "lo": 0.1, "hi": 0.2}}, heldout={}, passed=True, bars={})
    res = {"commit": "abc", "args": "--zoo 1", "machine": "m", "models": {"zoo5": {
        "model": "/x/zoo.gguf", "events": {"a": {"train": 5, "dev": 2, "heldout": 3},
                                           "b": {"train": 5, "dev": 2, "heldout": 3}},
        "methods": {"ftpo": m}, "dump_s": 1, "sets_s": 1, "sets_warnings": [], "total_s": 2}}}
    md = be.markdown(res)
    head = next(ln for ln in md.splitlines() if ln.startswith("| phrase |"))
    assert head == ("| phrase | events train/dev/held-out | ftpo dev | ftpo held-out | ftpo blind | ftpo plan | "
                    "ftpo solver/plan |")
    row_a = next(ln for ln in md.splitlines() if ln.startswith("| a |"))
    assert row_a == "| a | 5/2/3 | 0.12 [0.1, 0.2] | — | — | 0.10 (none) | 1.20 |"
    sec = md.split("## plan vs solver")[1]
    assert "| zoo5 | ftpo | b | 0.2 | 0.15 | 0.25 | 1.67 | none | plan reachable, solver short |" in sec
    assert "| a |" not in sec


def test_plan_cli_prints_the_edit_beside_the_first_order_bound(world, exact, tmp_path):
    """`l47 plan` on the world (its own background): the first-order columns under their new names, each phrase's
    edit residual as the plan computed it (the fixture's `default` plan of the same selection), the edit's line, and
    the JSON's figures the same floats; the exit code 1 iff a phrase is short."""
    import json

    from typer.testing import CliRunner

    from l47.app.cli import app

    exp = world["root"] / "exp_plan_exact.toml"
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(app, ["plan", str(exp), "--model", str(world["base"]), "--method", "ftpo", "--json",
                                 str(out)], catch_exceptions=False)
    fp = exact["default"]
    assert r.exit_code == (1 if fp.short else 0), r.output
    flat = " ".join(r.output.split())
    assert "1st-order reach" in flat and "1st-order resid." in flat and "edit resid." in flat, r.output
    assert f"plan's edit (the least-KL edit of the linearised problem × c = {fp.edit.c:.3g}" in flat
    d = json.loads(out.read_text())["plan"]
    assert d["edit"]["c"] == fp.edit.c and d["edit"]["kl"] == pytest.approx(fp.edit.kl, abs=1e-12)
    assert "edit_dW" not in d
    for p, js in zip(fp.phrases, d["phrases"]):
        assert js["edit_residual"] == pytest.approx(p.edit_residual, rel=1e-6) and js["binding"] == p.binding
        assert f"{p.edit_residual:.3f}" in r.output
    print(r.output)


def test_bench_plan_summary_is_the_plans_figures(exact):
    """What the bench records of a plan (`plan_summary`, JSON-ready): per phrase the plan's own edit residuals and
    binding, the target and the edit, the same floats."""
    import json

    be = _bench()
    fp = exact["wide"]
    s = json.loads(json.dumps(be.plan_summary(fp)))
    assert s["plan_target"] == fp.target and s["plan_edit"]["c"] == fp.edit.c and s["plan_edit"]["kl"] == fp.edit.kl
    for p in fp.phrases:
        x = s["plan"][p.phrase]
        assert (x["edit_residual"], x["edit_residual_train"], x["edit_residual_dev"], x["binding"]) == \
            (p.edit_residual, p.edit_residual_train, p.edit_residual_dev, p.binding)
        assert x["first_order_residual"] == p.reachable_residual
