"""The llama-perplexity KLD statistics against an independent float64 numpy computation on random logits.

The chain under test is the one the audit runs: random f32 `mix` rows and head → `l47.tail.forward.paired_stats`
(streamed over vocabulary chunks, f64 sums) → `l47.evals.kld_stats.kld_stats_of_pairs`. The reference builds
the full [T, V] logits from the same f32 values in float64, takes log-softmax, the KL divergence, and every
summary figure with numpy / scipy primitives (np.percentile, np.corrcoef, np.std), not with the sums the module
uses. Tolerances: f32 logits vs f64 logits differ by ~1e-6 relative, so per-position KL agrees to ~1e-6 absolute
and every mean/percentile to 1e-5 (relative 1e-5 for PPL-sized figures).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import log_softmax

from l47.evals.kld_stats import DP_PERCENTILES, KLD_PERCENTILES, format_llama, kld_stats, kld_stats_of_pairs
from l47.tail.forward import paired_stats
from l47.model.weights import TailWeights


def _weights(head: torch.Tensor) -> TailWeights:
    V, n = head.shape
    z = torch.zeros(1)
    return TailWeights(layer=0, n=n, f=1, hc=1, r=1, V=V, eps=1e-6, W_sd=z, onorm=z, odown=z, oup=z, head=head,
                       target="t", target_type=0, model_sha256="", policy="exact", path="")


def _reference(zb: np.ndarray, zn: np.ndarray, tg: np.ndarray) -> dict:
    """Every figure from full float64 log-softmaxes with numpy primitives."""
    lb, ln = log_softmax(zb, axis=1), log_softmax(zn, axis=1)  # [T, V] f64
    pb = np.exp(lb)
    kl = (pb * (lb - ln)).sum(1)  # [T]
    T = zb.shape[0]
    lpb, lpn = lb[np.arange(T), tg], ln[np.arange(T), tg]
    dp = np.exp(lpn) - np.exp(lpb)
    same = zb.argmax(1) == zn.argmax(1)
    nq, nb = -lpn, -lpb
    sem = lambda x: np.std(x) / math.sqrt(len(x) - 1)  # noqa: E731  standard error with population variance
    cov = np.cov(nq, nb, bias=True)[0, 1] / (T - 1)
    return dict(
        kl=kl, ppl_new=math.exp(nq.mean()), ppl_base=math.exp(nb.mean()), cor=np.corrcoef(nq, nb)[0, 1],
        ln_ratio=nq.mean() - nb.mean(), ln_ratio_err=math.sqrt(sem(nq) ** 2 + sem(nb) ** 2 - 2 * cov),
        ppl_ratio=math.exp(nq.mean() - nb.mean()), kld_mean=kl.mean(), kld_err=sem(kl), kld_max=kl.max(),
        kld_min=kl.min(), kld_pct={p: np.percentile(kl, p) for p in KLD_PERCENTILES},
        dp_mean=dp.mean(), dp_err=sem(dp), dp_pct={p: np.percentile(dp, p) for p in DP_PERCENTILES},
        dp_max=dp.max(), dp_min=dp.min(), rms=math.sqrt((dp ** 2).mean()), same=same.mean(),
        same_err=math.sqrt(same.mean() * (1 - same.mean()) / (T - 1)), ppl_new_err=math.exp(nq.mean()) * sem(nq),
        ppl_diff=math.exp(nq.mean()) - math.exp(nb.mean()),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_kld_statistics_match_numpy_on_random_logits(seed):
    rng = np.random.default_rng(seed)
    T, V, n = 400, 3000, 48
    head = torch.from_numpy(rng.standard_normal((V, n), dtype=np.float32) * np.float32(0.6))  # logits std ~4
    mb = torch.from_numpy(rng.standard_normal((T, n), dtype=np.float32))
    mn = mb + torch.from_numpy(rng.standard_normal((T, n), dtype=np.float32) * np.float32(0.05))
    w = _weights(head)
    zb = mb.double().numpy() @ head.double().numpy().T  # [T, V] f64 from the same f32 inputs
    zn = mn.double().numpy() @ head.double().numpy().T
    pb = np.exp(log_softmax(zb, axis=1))
    tg = np.array([rng.choice(V, p=row) for row in pb])  # targets sampled from the base: CE ~ entropy, not ln V
    # two documents (the set is their concatenation), chunks smaller than V so the online rescaling runs
    ps1 = paired_stats(mb[:150], mn[:150], w, tg[:150], chunk=700)
    ps2 = paired_stats(mb[150:], mn[150:], w, tg[150:], chunk=1024)
    s = kld_stats_of_pairs([ps1, ps2])
    ref = _reference(zb, zn, tg)

    np.testing.assert_allclose(np.concatenate([ps1.kld, ps2.kld]), ref["kl"], atol=2e-6)
    assert s.n == T
    for k, v in (("ppl_new", "ppl_new"), ("ppl_base", "ppl_base"), ("ppl_ratio", "ppl_ratio"),
                 ("ppl_diff", "ppl_diff"), ("ppl_new_err", "ppl_new_err")):
        assert getattr(s, k) == pytest.approx(ref[v], rel=1e-5), k
    assert s.cor_ln_ppl == pytest.approx(ref["cor"], abs=1e-6)
    assert s.ln_ppl_ratio == pytest.approx(ref["ln_ratio"], abs=1e-5)
    assert s.ln_ppl_ratio_err == pytest.approx(ref["ln_ratio_err"], rel=1e-3)
    for k in ("kld_mean", "kld_err", "kld_max", "kld_min", "dp_mean", "dp_err", "dp_max", "dp_min"):
        assert getattr(s, k) == pytest.approx(ref[k], abs=1e-5), k
    for p in KLD_PERCENTILES:
        assert s.kld_pct[f"{p:.1f}"] == pytest.approx(ref["kld_pct"][p], abs=1e-5), p
    for p in DP_PERCENTILES:
        assert s.dp_pct[f"{p:.1f}"] == pytest.approx(ref["dp_pct"][p], abs=1e-5), p
    assert s.rms_dp == pytest.approx(ref["rms"], abs=1e-6)
    assert s.same_top == pytest.approx(ref["same"], abs=0)  # argmax of f32 vs f64 logits: no ties at this scale
    assert s.same_top_err == pytest.approx(ref["same_err"], rel=1e-9)
    assert 0.0 < s.kld_mean < 0.5 and 0.5 < s.same_top < 1.0  # the test is not degenerate
    text = format_llama(s)
    assert "Mean    KLD" in text and "Same top p" in text and "Median   KLD" in text


def test_identical_models_give_zero_divergence_and_unit_ratio():
    lp = np.log(np.random.default_rng(3).uniform(0.01, 1, 50))
    s = kld_stats(lp, lp, np.zeros(50), np.ones(50, bool))
    assert s.kld_mean == 0 and s.ln_ppl_ratio == 0 and s.ppl_ratio == 1 and s.same_top == 1
    assert s.rms_dp == 0 and s.cor_ln_ppl == pytest.approx(1.0)
    assert kld_stats([], [], [], []) is None


def test_percentile_interpolation_small_case():
    # 5 values: the 90th percentile sits at 0.9·4 = 3.6 -> 0.4·v[3] + 0.6·v[4]
    kl = np.array([0.5, 0.1, 0.4, 0.2, 0.3])
    s = kld_stats(np.zeros(5) - 1, np.zeros(5) - 1, kl, np.ones(5, bool))
    assert s.kld_pct["90.0"] == pytest.approx(0.4 * 0.4 + 0.6 * 0.5)
    assert s.kld_pct["50.0"] == pytest.approx(0.3)
