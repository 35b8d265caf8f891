"""Per-phrase residual intervals in the audit report (issue 12 item 9): a bootstrap over DOCUMENTS of the
residual ratio Σ p_after / Σ p_before at held-out events.

References, independent of l47's aggregation:
  * the report's intervals re-computed here from the audit's own positions.tsv (logp_base / logp_new of the
    held-out slop rows, %.6f), each replicate built by brute force as the explicit list of the drawn documents'
    events (the draw counts taken from the same generator stream, so the numbers can be compared); tolerance
    2e-5 relative (the TSV's 6 decimals of log p give p to ≤ 5e-7 relative);
  * properties: documents whose events have the same ratio in every document give an interval that collapses to
    that ratio even when the events inside a document differ (an event-level bootstrap would spread); all events
    in one document: no interval; the interval holds the point estimate; the same inputs write the same bytes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from l47.data.uncertainty import LEVEL, N_BOOT, POOLED, key_seed, residual_intervals
from test_audit import _audit, world  # noqa: F401 - the module-scoped world fixture


def _brute_interval(rows: list[dict], seed: int) -> list[float] | None:
    """Percentile interval of Σ p_after / Σ p_before over documents drawn with replacement; each replicate is
    the explicit concatenation of its drawn documents' events (D draws per replicate, documents in sorted key
    order, draws from numpy's multinomial on default_rng(seed): the stream per_phrase_bootstrap documents)."""
    docs = sorted({r["doc_sha256"] for r in rows})
    if len(docs) < 2:
        return None
    ev = {d: [r for r in rows if r["doc_sha256"] == d] for d in docs}
    draws = np.random.default_rng(seed).multinomial(len(docs), [1.0 / len(docs)] * len(docs), size=N_BOOT)
    reps = []
    for counts in draws:
        take = [r for d, c in zip(docs, counts) for _ in range(int(c)) for r in ev[d]]
        reps.append(sum(r["p_after"] for r in take) / sum(r["p_before"] for r in take))
    a = (1 - LEVEL) / 2
    return [float(x) for x in np.quantile(reps, [a, 1 - a])]


def _tsv_rows(out) -> dict[tuple[str, int], dict]:
    head, *lines = (out / "positions.tsv").read_text().splitlines()
    cols = head.split("\t")
    rows = [dict(zip(cols, ln.split("\t"))) for ln in lines]
    return {(r["doc_sha256"], int(r["pos"])): r for r in rows if r["set"] == "heldout" and r["kind"] == "slop"}


def test_report_intervals_match_a_brute_force_bootstrap_of_the_positions_tsv(world, tmp_path):
    _audit(world, world["bundles"]["good"], tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    ho = rep["slop"]["heldout"]
    assert {k: ho["bootstrap"][k] for k in ("unit", "n_boot", "level", "seed")} == {
        "unit": "document", "n_boot": N_BOOT, "level": LEVEL, "seed": 0}
    tsv = _tsv_rows(tmp_path / "out")
    # the events (phrase, document, row) from the report; p before / after from the TSV's log p
    rows = []
    for e in ho["events"]:
        t = tsv[(e["doc_sha256"], e["pos"])]
        rows.append({"phrase": e["phrase"], "doc_sha256": e["doc_sha256"], "p_before": math.exp(float(t["logp_base"])),
                     "p_after": math.exp(float(t["logp_new"]))})
    phrases = list(dict.fromkeys(r["phrase"] for r in rows))
    assert phrases == list(ho["per_phrase"]) and len(phrases) == 3
    for ph in phrases:  # per_phrase_bootstrap's stream of each phrase: key_seed(phrase, 0)
        v, rs = ho["per_phrase"][ph], [r for r in rows if r["phrase"] == ph]
        ref = _brute_interval(rs, seed=key_seed(ph))
        assert v["n_docs"] == len({r["doc_sha256"] for r in rs}) == 2
        assert v["residual_interval"] == pytest.approx(ref, rel=2e-5), ph
        lo, hi = v["residual_interval"]
        assert lo <= v["residual_ratio"] <= hi and lo < hi  # two documents with different ratios: a spread
    assert ho["residual_interval"] == pytest.approx(_brute_interval(rows, seed=key_seed(POOLED)), rel=2e-5)
    assert ho["residual_interval"][0] <= ho["residual_ratio"] <= ho["residual_interval"][1]
    # the per-set figures carry theirs too (train / dev events of the solver's documents)
    assert all("residual_interval" in f for f in rep["slop"]["per_set"].values())
    # report.md: the per-phrase table has the interval column, one row per phrase with its [lo, hi]
    md = (tmp_path / "out" / "report.md").read_text().splitlines()
    head = next(ln for ln in md if ln.startswith("| phrase | n | docs |"))
    assert "residual 90% interval (bootstrap over documents)" in head
    for ph in phrases:
        lo, hi = ho["per_phrase"][ph]["residual_interval"]
        cells = next(ln for ln in md if ln.startswith(f"| {ph} | ")).split(" | ")
        cell = next(c for c in cells if c.startswith("["))  # '[lo, hi]' to 3 significant figures
        assert [float(x) for x in cell.strip("[]").split(",")] == pytest.approx([lo, hi], rel=5e-3)


def test_same_inputs_write_the_same_intervals(world, tmp_path):
    a = _audit(world, world["bundles"]["good"], tmp_path / "a").report["slop"]
    b = _audit(world, world["bundles"]["good"], tmp_path / "b").report["slop"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    md = [(tmp_path / d / "report.md").read_text().splitlines() for d in ("a", "b")]
    table = [[ln for ln in m if "interval" in ln or ln.startswith("| rather than |")] for m in md]
    assert table[0] == table[1] and len(table[0]) >= 2


def test_blind_report_has_no_interval_for_its_one_document(world, tmp_path):
    good = world["bundles"]["good"]
    _audit(world, good, tmp_path / "dev")
    res = _audit(world, good, tmp_path / "blind", blind=world["paths"]["blind_a"],
                 dev_report=tmp_path / "dev" / "report.json")
    s = res.report["blind"]["slop"]
    assert s["per_phrase"] and all(v["residual_interval"] is None and v["n_docs"] == 1
                                   for v in s["per_phrase"].values())
    assert s["residual_interval"] is None and s["n_docs"] == 1
    md = (tmp_path / "blind" / "report.md").read_text()
    assert md.count("no interval (1 document)") == len(s["per_phrase"]) + 1  # each phrase and the summary line


def test_interval_is_over_documents_not_events():
    # every document has Σ p_after / Σ p_before = 0.75 while its events differ (0.125, 2 | 0.75): resampling
    # documents can only give 0.75 (the interval collapses to the point); resampling events would spread
    rows = [{"phrase": "x", "doc_sha256": "d1", "p_before": 0.8, "p_after": 0.1},
            {"phrase": "x", "doc_sha256": "d1", "p_before": 0.4, "p_after": 0.8},
            {"phrase": "x", "doc_sha256": "d2", "p_before": 0.6, "p_after": 0.45},
            {"phrase": "y", "doc_sha256": "d3", "p_before": 0.9, "p_after": 0.3},
            {"phrase": "y", "doc_sha256": "d3", "p_before": 0.7, "p_after": 0.2}]
    out = residual_intervals(rows)
    assert out["x"]["residual_interval"] == pytest.approx([0.75, 0.75], abs=1e-12) and out["x"]["n_docs"] == 2
    assert out["y"] == {"residual_interval": None, "n_docs": 1}  # all its events in one document
    # the order of the rows moves nothing (each phrase's stream is keyed by its text, documents sorted)
    assert residual_intervals(rows[::-1]) == out
    lo, hi = out["(all)"]["residual_interval"]
    pooled = sum(r["p_after"] for r in rows) / sum(r["p_before"] for r in rows)
    assert lo < pooled < hi and out["(all)"]["n_docs"] == 3
    assert [lo, hi] == pytest.approx(_brute_interval(rows, seed=key_seed(POOLED)), rel=1e-12)
