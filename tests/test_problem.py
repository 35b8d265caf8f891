"""The posed problem (solvers/problem.py), the solver registry (solvers/methods.py) and the knobs (solvers/knobs.py).

Numbers: the KL budget against the bars' own thresholds (exact: one product); the protected batch against the rows
it is built from (exact: a concatenation); the knobs' bounds at and beside each end."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from l47.data.experiment import Thresholds
from l47.errors import L47Error
from l47.solvers.knobs import Knob, knob_of, meanings, ranges
from l47.solvers.methods import METHODS, solver_for
from l47.solvers.problem import KL_BUDGET_SAFETY, KlBudget, Problem, resolve_kl_budget
from l47.solvers.solve import SolveConfig, resolve_config
from test_solvers import tiny_rows

ROOT = Path(__file__).resolve().parents[1]


def test_kl_budget_is_resolved_from_the_tightest_kld_bar():
    th = Thresholds()
    assert resolve_kl_budget(0.0, th) == KL_BUDGET_SAFETY * min(th.kld_max, th.chat_kld)
    th2 = dataclasses.replace(th, chat_kld=th.kld_max / 4)
    assert resolve_kl_budget(0.0, th2) == KL_BUDGET_SAFETY * th.kld_max / 4
    assert resolve_kl_budget(0.0123, th) == 0.0123  # a configured budget wins


def test_registry_policies_and_refusal():
    ftpo, wfld = resolve_config({"ftpo": {"kl_rows": 777}}, None, "x"), resolve_config({"max_background": 99}, "wfld", "x")
    assert METHODS == ("wfld", "ftpo") and ftpo.method == "ftpo"
    pf, pw = solver_for("ftpo").policy(ftpo), solver_for("wfld").policy(wfld)
    assert (pf.background_cap, pf.background_with_train, pf.judges_dev) == (777, True, True)
    assert (pw.background_cap, pw.background_with_train, pw.judges_dev) == (99, False, False)
    assert solver_for("ftpo").soft_anchors and not solver_for("wfld").soft_anchors
    g = solver_for("ftpo").grid(ftpo, 0.01)
    assert [c["kl_budget"] for c in g] == [0.005, 0.01, 0.01, 0.015]
    assert [c["target_residual"] for c in g] == [0.2, 0.2, 0.1, 0.1]
    with pytest.raises(L47Error, match="method"):
        solver_for("sgd", "exp.toml")


def test_no_method_branch_outside_the_registry():
    """No `<x>.method == "..."` (or !=, in) in the solvers but solvers/methods.py: a method's choices live there."""
    bad = []
    for p in sorted((ROOT / "solvers").rglob("*.py")):
        if p.name == "methods.py":
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "method" for x in [node.left, *node.comparators]):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_protected_is_the_anchors_then_the_turn_ends():
    w, ids, logits, mk = tiny_rows()
    an, te = mk([3, 7, 11]), mk([20, 21])
    kw = dict(plan=None, solver=solver_for("wfld"), selection=None, kept=None, choice=None, events=mk([0]), terms=None,
              background=mk([1, 2]), kl_budget=KlBudget(0.01))
    p = Problem(anchors=an, kept_anchors=an, turn_ends=te, **kw)
    assert p.protected.pos == (3, 7, 11, 20, 21) and torch.equal(p.protected.hh, torch.cat([an.hh, te.hh]))
    assert p.kept_protected is p.protected
    q = Problem(anchors=an, kept_anchors=mk([7]), turn_ends=None, **kw)
    assert q.protected is an and q.kept_protected.pos == (7,)
    assert Problem(anchors=None, kept_anchors=None, turn_ends=None, **kw).protected is None


def test_knob_bounds_and_homes():
    k = Knob("x", 0.0, 1.0, open_lo=True)
    assert [k.ok(v) for v in (0.0, 1e-12, 1.0, 1.0 + 1e-12, float("nan"))] == [False, True, True, False, False]
    assert knob_of(SolveConfig, "target_residual").ok(0.5) and not knob_of(SolveConfig, "target_residual").ok(1.0)
    from l47.solvers.ftpo import FtpoConfig
    from l47.solvers.wfld import WfldConfig

    for cls in (SolveConfig, WfldConfig, FtpoConfig):  # every field has its meaning in its metadata
        assert all(meanings(cls).values()), cls
    assert ranges(FtpoConfig)["plausible_end_p"] == (0.0, 1.0) and ranges(WfldConfig)["p_cap"] == (0.0, 0.999)
    with pytest.raises(L47Error, match=r"solver.ftpo.kl_rows: expected a value >= 1"):
        resolve_config({"ftpo": {"kl_rows": 0}}, None, "x")
