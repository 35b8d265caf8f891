"""Bootstrap over documents (l47.data.uncertainty) against independent references: the plain ratio of means,
the analytic standard error of a mean (one event per document), a brute-force resampling loop written here, and
the cluster property (copies of an event inside its document add no information)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from l47.data.uncertainty import bootstrap_over_documents, per_phrase_bootstrap
from l47.errors import L47Error


def test_value_is_the_ratio_of_means():
    rng = np.random.default_rng(0)
    docs = [f"d{i // 3}" for i in range(30)]
    pb, pa = rng.uniform(0.5, 1, 30), rng.uniform(0, 0.5, 30)
    r = bootstrap_over_documents(docs, pa, pb)
    assert r["value"] == pytest.approx(pa.mean() / pb.mean(), rel=1e-12)
    assert r["n_events"] == 30 and r["n_docs"] == 10 and r["lo"] < r["value"] < r["hi"]


def test_se_of_a_mean_matches_the_analytic_one():
    # one event per document: the bootstrap SE of the mean is sd / sqrt(n) (x (n-1)/n); MC error ~ 1.6 % at
    # 4000 replicates, tolerance 8 %
    rng = np.random.default_rng(1)
    x = rng.normal(0.4, 0.2, 200)
    r = bootstrap_over_documents([f"d{i}" for i in range(200)], x, n_boot=4000, seed=3)
    se = x.std(ddof=0) / math.sqrt(200)
    assert r["se"] == pytest.approx(se, rel=0.08)
    # a 90 % percentile interval of a near-normal statistic: ± 1.645 se
    assert r["hi"] - r["lo"] == pytest.approx(2 * 1.645 * se, rel=0.1)


def test_matches_a_brute_force_resampling_loop():
    rng = np.random.default_rng(2)
    n_docs = 25
    docs, pa, pb = [], [], []
    for d in range(n_docs):
        for _ in range(rng.integers(1, 6)):
            docs.append(f"doc{d}")
            pb.append(rng.uniform(0.6, 1.0))
            pa.append(rng.uniform(0.0, 0.6) * (1 + d / n_docs))
    r = bootstrap_over_documents(docs, pa, pb, n_boot=4000, seed=5)
    # reference: resample document names with a different generator, collect their events, ratio of means
    ref_rng = np.random.default_rng(99)
    names_ = sorted(set(docs))
    idx = {n: [i for i, d in enumerate(docs) if d == n] for n in names_}
    pa, pb = np.asarray(pa), np.asarray(pb)
    reps = []
    for _ in range(4000):
        take = [i for n in ref_rng.choice(names_, size=len(names_)) for i in idx[n]]
        reps.append(pa[take].mean() / pb[take].mean())
    lo, hi = np.quantile(reps, [0.05, 0.95])
    width = hi - lo
    assert abs(r["lo"] - lo) < 0.06 * width and abs(r["hi"] - hi) < 0.06 * width
    assert r["se"] == pytest.approx(np.std(reps, ddof=1), rel=0.08)


def test_copies_inside_a_document_add_no_information():
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 1, 40)
    one = bootstrap_over_documents([f"d{i}" for i in range(40)], x, seed=7)
    five = bootstrap_over_documents([f"d{i}" for i in range(40) for _ in range(5)], np.repeat(x, 5), seed=7)
    assert (five["lo"], five["hi"]) == pytest.approx((one["lo"], one["hi"]), rel=1e-12)
    # treating the copies as separate documents would (wrongly) shrink the interval by about sqrt(5)
    naive = bootstrap_over_documents([f"e{i}" for i in range(200)], np.repeat(x, 5), seed=7)
    assert (naive["hi"] - naive["lo"]) < 0.6 * (one["hi"] - one["lo"])


def test_per_phrase_and_edge_cases():
    rows = [{"doc_sha256": f"d{i % 7}", "phrase": "a" if i % 2 else "b", "p_before": 0.9, "p_after": 0.1 + i / 100}
            for i in range(40)]
    out = per_phrase_bootstrap(rows)
    assert set(out) == {"a", "b", "(all)"}
    for p in ("a", "b"):
        rs = [r for r in rows if r["phrase"] == p]
        assert out[p]["value"] == pytest.approx(np.mean([r["p_after"] for r in rs]) / 0.9)
        assert out[p]["n_events"] == 20
    single = bootstrap_over_documents(["d"] * 4, [0.1, 0.2, 0.3, 0.4])
    assert single["value"] == pytest.approx(0.25) and single["lo"] is None and single["n_docs"] == 1
    assert bootstrap_over_documents([], [])["value"] is None
    with pytest.raises(L47Error):
        bootstrap_over_documents(["a"], [1.0, 2.0])
    with pytest.raises(L47Error):
        bootstrap_over_documents(["a"], [1.0], level=1.5)
