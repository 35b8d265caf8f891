"""The audit's evidence families (evals/figures.py) at the JSON boundary: report.json keeps the keys, their order
and the values it had when the families were dicts. References: the key lists and values written out here by
hand from the former dict literals of evals/metrics.py and evals/audit.py; numbers against numpy."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from l47.evals.audit import clean
from l47.evals.figures import (CheapFormFigures, EngineFigures, PenaltyFigures, RecordFigures, SetKld, SlopFigures,
                               figures_dict)
from l47.evals.kld_stats import KldStats, kld_stats
from l47.evals.metrics import slop_figures

EMPTY_AGG = {"n": 0, "p_before": None, "p_after": None, "reduction": None, "residual_ratio": None}


def test_slop_without_events_keeps_the_short_shape():
    """No event: the pooled figures are the five of an empty aggregate (no argmax / special / penalty keys), then
    the bootstrap keys, fresh, copies, per_phrase, bootstrap and events, in that order."""
    s = clean(slop_figures([], {}, None, {"<|im_end|>": 5}))
    assert list(s) == ["n", "p_before", "p_after", "reduction", "residual_ratio", "residual_interval", "n_docs",
                       "fresh", "copies", "per_phrase", "bootstrap", "events"]
    assert {k: s[k] for k in EMPTY_AGG} == EMPTY_AGG and s["fresh"] == s["copies"] == EMPTY_AGG
    assert s["per_phrase"] == {} and s["events"] == []


def test_slop_with_events_keeps_every_key_and_the_per_set_table_drops_events():
    f = SlopFigures(n=2, p_before=0.5, p_after=0.25, reduction=0.5, residual_ratio=0.5, argmax_rejected_before=1,
                    argmax_rejected_after=0, argmax_special_after=0, special_p_before=0.01, special_p_after=0.02,
                    p_penalty=0.1, residual_interval=[0.4, 0.6], n_docs=2, events=[{"pos": 3}])
    d = figures_dict(f)
    assert list(d) == ["n", "p_before", "p_after", "reduction", "residual_ratio", "argmax_rejected_before",
                       "argmax_rejected_after", "argmax_special_after", "special_p_before", "special_p_after",
                       "p_penalty", "residual_interval", "n_docs", "fresh", "copies", "per_phrase", "bootstrap",
                       "events"]  # p_stacked: absent (no stacked simulation), as before
    assert "events" not in figures_dict(replace(f, events=None))


def test_record_without_a_solve_record_has_three_keys():
    """The absent record: present, why, overlap (null when the experiment has no copy), nothing else."""
    assert clean(RecordFigures(present=False, why="no solve record at x", overlap=None)) == {
        "present": False, "why": "no solve record at x", "overlap": None}
    full = clean(RecordFigures(present=True, path="r.json", method="wfld", n_slop=0, n_terms={}, not_prefix_exact=[],
                               non_events=[], unnatural_docs=[], training_docs=[], overlap=[],
                               slop_positions=[("a" * 64, 3)], background_positions=[]))
    assert list(full) == ["present", "path", "method", "n_slop", "n_terms", "not_prefix_exact", "non_events",
                          "unnatural_docs", "training_docs", "overlap", "slop_positions", "background_positions"]
    assert full["slop_positions"] == [["a" * 64, 3]]  # tuples -> lists, as json writes them


def test_engine_without_engine_dumps_is_an_empty_object():
    assert clean(EngineFigures()) == {}
    assert clean(EngineFigures(zero_proxy_edited={}, kld={})) == {"zero_proxy_edited": {}, "kld": {}}


def test_set_kld_is_the_judged_statistics_with_the_prefix_and_all_rows_beside():
    """SetKld's JSON: every KldStats key of the judged rows, then prefix_rows ({"n": 0} when none) and all_rows;
    the mean KLD against numpy."""
    rng = np.random.default_rng(0)
    lb, ln = np.log(rng.uniform(0.1, 0.9, 50)), np.log(rng.uniform(0.1, 0.9, 50))
    kl = rng.uniform(0, 0.01, 50)
    st = kld_stats(lb, ln, kl, np.ones(50, bool))
    d = clean(SetKld(stats=st, prefix_rows=None, all_rows=st))
    assert list(d) == [*KldStats.__dataclass_fields__, "prefix_rows", "all_rows"]
    assert d["prefix_rows"] == {"n": 0} and d["all_rows"] == clean(st.to_dict())
    assert d["kld_mean"] == pytest.approx(float(kl.mean()), rel=1e-12)  # f64 sums: exact to rounding
    assert d["all_rows"]["kld_mean"] == d["kld_mean"] and not math.isnan(d["ppl_base"])


def test_penalty_keeps_the_report_keys_in_their_order():
    """The sampler penalty's JSON: its keys and each cheap form's in the order of the former dict literal of
    audit._penalty_figures; a nested CheapFormFigures becomes a dict at the boundary (NaN -> null)."""
    cheap = CheapFormFigures(positions=2, pairs=3, target_hit=1, examples=[{"pos": 4}], mean_dlogp_target=-0.5,
                             min_dlogp_target=-1.0, mean_kld=float("nan"))
    d = clean(PenaltyFigures(bias=5.0, form="prefix-exact", rules=[{"phrase": "a b", "prefix": (1,), "token": 2}],
                             penalised_rows=3, unchanged_rows=7, unchanged_max_abs_dlogp_alone=0.0,
                             unchanged_max_abs_dlogp_stacked=0.0,
                             kld_alone_per_set={"heldout": {"mean": 0.1, "penalised_rows": 3}},
                             cheap_forms={"last-prefix-token": cheap}))
    assert list(d) == ["bias", "form", "rules", "penalised_rows", "unchanged_rows", "unchanged_max_abs_dlogp_alone",
                       "unchanged_max_abs_dlogp_stacked", "kld_alone_per_set", "cheap_forms"]
    assert d["cheap_forms"] == {"last-prefix-token": {"positions": 2, "pairs": 3, "target_hit": 1,
                                                      "examples": [{"pos": 4}], "mean_dlogp_target": -0.5,
                                                      "min_dlogp_target": -1.0, "mean_kld": None}}
    assert d["rules"] == [{"phrase": "a b", "prefix": [1], "token": 2}]
