"""`l47 plan`: each phrase's mean base p(rejected) over its train (and dev) events with its 90 % interval
bootstrapped over documents (issue 12 item 9), on test_audit's world with heldout_b moved to dev (two train and
two dev chats; 'right away' has train events in train_a only, its train_b occurrence being the planted non-event).

Reference, independent of the plan's plumbing: the events and base p of the world's own sets report
(`world["sets"]`, built by the fixture), each bootstrap replicate the explicit concatenation of its drawn
documents' events (draw counts from the documented stream: numpy's multinomial on default_rng(key_seed(phrase)),
documents in sorted order); tolerance 1e-9 relative (the same base p, f64 sums in another order).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.data.uncertainty import LEVEL, N_BOOT, key_seed
from test_audit import _variant, world  # noqa: F401 - the module-scoped world fixture


def _brute(rows: list[tuple[str, float]], seed: int) -> dict:
    """rows (doc, p): the mean, and the percentile interval of the mean over documents drawn with replacement."""
    docs = sorted({d for d, _ in rows})
    out = {"value": float(np.mean([p for _, p in rows])), "n_docs": len(docs), "n_events": len(rows),
           "interval": None}
    if len(docs) < 2:
        return out
    draws = np.random.default_rng(seed).multinomial(len(docs), [1.0 / len(docs)] * len(docs), size=N_BOOT)
    reps = [np.mean([p for d, c in zip(docs, counts) for _ in range(int(c)) for dd, p in rows if dd == d])
            for counts in draws]
    a = (1 - LEVEL) / 2
    out["interval"] = [float(x) for x in np.quantile(reps, [a, 1 - a])]
    return out


@pytest.fixture(scope="module")
def planned(world, tmp_path_factory):
    from l47.solvers.solve import SolveArgs, run_plan

    exp = _variant(world, "plan_twodev", {"dev": [world["paths"]["heldout_b"].name]}, drop=("heldout_b",))
    fp = run_plan(SolveArgs(experiment=exp, method="wfld", out=Path("/nonexistent/plan-only.gguf"),
                            model=world["base"])).fp
    heldout_b = str(world["paths"]["heldout_b"])
    ref = {"train": {}, "dev": {}}
    for e in world["sets"].events:
        s = "dev" if e.set == "dev" or (e.set == "heldout" and e.doc == heldout_b) else e.set
        if s in ref:
            ref[s].setdefault(e.phrase, []).append((e.doc_sha256, e.p_base))
    return dict(exp=exp, fp=fp, ref=ref)


def test_plan_base_p_and_interval_match_a_brute_force_bootstrap(planned):
    fp, ref = planned["fp"], planned["ref"]
    assert [p.phrase for p in fp.phrases] == ["rather than", "end to end", "right away"]
    seen_none = seen_interval = 0
    for p in fp.phrases:
        for s, got in (("train", p.p_base_train), ("dev", p.p_base_dev)):
            rows = ref[s].get(p.phrase, [])
            if not rows:
                assert got is None
                continue
            want = _brute(rows, key_seed(p.phrase))
            assert got["n_events"] == want["n_events"] == p.events.get(s, 0)
            assert got["n_docs"] == want["n_docs"] and got["value"] == pytest.approx(want["value"], rel=1e-9)
            if want["interval"] is None:
                seen_none += 1
                assert got["interval"] is None
            else:
                seen_interval += 1
                assert got["interval"] == pytest.approx(want["interval"], rel=1e-9)
                assert got["interval"][0] <= got["value"] <= got["interval"][1]
    # the world exercises both: 'right away' trains on one document; the rest span two
    assert seen_none >= 1 and seen_interval >= 3
    ra = next(p for p in fp.phrases if p.phrase == "right away")
    assert ra.p_base_train["n_docs"] == 1 and ra.p_base_train["interval"] is None


def test_plan_cli_prints_and_writes_the_intervals(planned, world, tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(app, ["plan", str(planned["exp"]), "--model", str(world["base"]), "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output  # 1: a phrase short of its target (the plan's verdict, not an error)
    assert "train p [90%]" in r.output and "dev p [90%]" in r.output
    d = json.loads(out.read_text())["plan"]["phrases"]
    for p, js in zip(planned["fp"].phrases, d):
        assert (js["p_base_train"], js["p_base_dev"]) == (p.p_base_train, p.p_base_dev)  # JSON floats round-trip
        for b in (p.p_base_train, p.p_base_dev):
            iv = b["interval"]
            shown = f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv is not None else f"({b['n_docs']} doc)"
            assert f"{b['value']:.3f} {shown}" in r.output
    assert f"{planned['fp'].phrases[2].p_base_train['value']:.3f} (1 doc)" in r.output


def test_plan_with_soft_anchors_is_the_bound_without_their_span(planned, world):
    """FTPO's anchors are penalties: its plan (`soft_anchors`) must equal the plan of the same selection with no
    anchors at all (every reachable figure and binding; rel 1e-9: the same f64 algebra on the same rows), while it
    still reports the anchors' rank. WFLD's plan (exact anchors) of the same selection differs where they bind."""
    import dataclasses

    from l47.solvers.methods import solver_for
    from l47.solvers.problem import pose
    from l47.solvers.solve import SolveArgs, check_feasible, plan_solve

    plan = plan_solve(SolveArgs(experiment=planned["exp"], method="ftpo", out=Path("/nonexistent/plan-only.gguf"),
                                model=world["base"]))
    prob = pose(plan, solver_for("ftpo"), lambda _m: None)
    soft = check_feasible(prob)
    wfld = dataclasses.replace(prob.with_config(dataclasses.replace(plan.cfg, method="wfld")), solver=solver_for("wfld"))
    bare = check_feasible(dataclasses.replace(wfld, anchors=None, kept_anchors=None, turn_ends=None))
    exact = check_feasible(wfld)
    assert soft.anchors_soft and not exact.anchors_soft and soft.anchor_rank == exact.anchor_rank > 0
    assert soft.null_dim == exact.null_dim == soft.f - soft.anchor_rank
    for s, b in zip(soft.phrases, bare.phrases):
        assert s.phrase == b.phrase and s.binding == b.binding and s.blocked_events == 0
        assert s.reachable_gap == pytest.approx(b.reachable_gap, rel=1e-9, abs=1e-12)
    assert soft.joint_exact_kl == pytest.approx(bare.joint_exact_kl, rel=1e-9)
    assert [p.reachable_gap for p in exact.phrases] != [p.reachable_gap for p in soft.phrases]


def test_plan_and_solve_refuse_thin_phrases_before_any_long_work(world, tmp_path):
    """The world's phrases have 1–3 train events each: at the default minimum (5 train events) `l47 plan` and
    `l47 solve` exit 2 with one line naming every thin phrase, its counts per split (the world's own sets report,
    counted here independently) and the documents to add; nothing is written, no input changes."""
    import hashlib
    import re

    from l47.data.experiment import load_experiment

    exp = _variant(world, "thin", {})
    text = exp.read_text().replace("min_train_per_phrase = 1\n", "")
    exp.write_text(text)
    assert load_experiment(exp).thresholds.min_train_per_phrase == 5
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in [exp, world["base"]]}
    counts: dict[str, dict[str, int]] = {}
    for e in world["sets"].events:
        counts.setdefault(e.phrase, {}).setdefault(e.set, 0)
        counts[e.phrase][e.set] += 1
    for cmd in (["plan", str(exp), "--model", str(world["base"])],
                ["solve", str(exp), "--model", str(world["base"]), "--out", str(tmp_path / "b.gguf")]):
        r = CliRunner().invoke(app, cmd)
        flat = " ".join(r.output.split())
        assert r.exit_code == 2, r.output[-2000:]
        assert "min_train_per_phrase" in flat and "Traceback" not in r.output
        thin = [ph for ph, c in counts.items() if c.get("train", 0) < 5 or c.get("heldout", 0) < 3]
        assert thin and all(f"'{ph}' has train {counts[ph].get('train', 0)}, dev {counts[ph].get('dev', 0)}, "
                            f"heldout {counts[ph].get('heldout', 0)} events" in flat for ph in thin), flat
        assert re.search(r"add about \d+ more", flat)
    assert not (tmp_path / "b.gguf").exists() and not list(tmp_path.iterdir())
    assert before == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in [exp, world["base"]]}
