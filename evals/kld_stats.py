"""Every figure `llama-perplexity --kl-divergence` prints, computed exactly from per-position arrays.

The per-position inputs come from one streamed pass over the WHOLE vocabulary (`l47.tail.forward.paired_stats`):
f32 logits, f64 reductions, no truncation of the tail (llama.cpp stores the base as uint16 log-probs and drops
tokens below −16; nothing here is quantised or dropped). Nothing of size [T, V] is needed.

Notation for array shapes:
    T   positions of a set (all its documents concatenated); row t predicts the target tokens[t+1]

Inputs per position t:
    logp_base[t], logp_new[t]   log p(target) under the base and the edited model        [T] f64
    kld[t]                      KL(p_base ‖ p_new) over the full vocabulary              [T] f64
    same_top[t]                 argmax_base == argmax_new                                [T] bool
    dp[t] = p_new(target) − p_base(target)                                              [T] f64

Formulas (perplexity.cpp `kl_divergence`, the "====== ... statistics ======" block):
    mean ± err          mean = Σx/n,  err = sqrt((Σx²/n − mean²)/(n − 1))     (NaN when n < 2)
    PPL(Q), PPL(base)   exp(mean NLL) ± PPL · err(NLL)
    Cor(ln PPL(Q), ln PPL(base))   cov(NLL_Q, NLL_base) / (err_Q · err_base), cov = (Σxy/n − x̄ȳ)/(n − 1)
                                    (= the Pearson correlation of the per-token NLLs)
    ln(PPL(Q)/PPL(base))  mean NLL_Q − mean NLL_base ± sqrt(err_Q² + err_base² − 2 cov)
    PPL(Q)/PPL(base)      exp(ln ratio) ± ratio · err(ln ratio)
    PPL(Q) − PPL(base)    ± sqrt(err_PPL_Q² + err_PPL_base² − 2 PPL_Q PPL_base cov)
    percentiles           sorted values, linear interpolation at fraction·(n − 1)  (the median included)
    RMS Δp                sqrt(mean Δp²) ± 0.5/RMS · err(Δp²)
    Same top p            n_same/n ± sqrt(p(1 − p)/(n − 1))
Precision: every sum in f64.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


@dataclass(frozen=True)
class KldStats:
    """The three blocks of llama-perplexity's KL-divergence summary. Probabilities as fractions (not %)."""

    n: int
    # ====== Perplexity statistics ======
    ppl_new: float
    ppl_new_err: float
    ppl_base: float
    ppl_base_err: float
    cor_ln_ppl: float  # Pearson correlation of the per-token NLLs (a fraction; llama.cpp prints %)
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float
    ppl_ratio: float
    ppl_ratio_err: float
    ppl_diff: float
    ppl_diff_err: float
    # ====== KL divergence statistics ======
    kld_mean: float
    kld_err: float
    kld_max: float
    kld_pct: dict[str, float]  # "99.9" … "0.1" (the median is "50.0")
    kld_min: float
    # ====== Token probability statistics ======
    dp_mean: float
    dp_err: float
    dp_max: float
    dp_pct: dict[str, float]
    dp_min: float
    rms_dp: float
    rms_dp_err: float
    same_top: float
    same_top_err: float

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_err(s: float, s2: float, n: int) -> tuple[float, float]:
    """perplexity.cpp's mean_and_uncertainty: mean and the standard error of the mean (f64)."""
    if n < 1:
        return math.nan, math.nan
    m = s / n
    if n < 2:
        return m, math.nan
    var = s2 / n - m * m
    return m, math.sqrt(var / (n - 1)) if var > 0 else 0.0


def _percentile(sorted_x: np.ndarray, pct: float) -> float:
    """Linear interpolation at fraction·(n − 1) of ascending values (perplexity.cpp's `percentile`)."""
    n = sorted_x.shape[0]
    p = pct / 100.0 * (n - 1)
    i = int(math.floor(p))
    f = p - i
    j = min(i + 1, n - 1)
    return float((1.0 - f) * sorted_x[i] + f * sorted_x[j])


def kld_stats(logp_base, logp_new, kld, same_top, dp=None) -> KldStats | None:
    """The full summary for one set of positions (None when there are none). Inputs [T]; all sums in f64."""
    lb = np.asarray(logp_base, dtype=np.float64).reshape(-1)  # [T]
    ln = np.asarray(logp_new, dtype=np.float64).reshape(-1)  # [T]
    kl = np.asarray(kld, dtype=np.float64).reshape(-1)  # [T]
    st = np.asarray(same_top, dtype=bool).reshape(-1)  # [T]
    d = (np.exp(ln) - np.exp(lb)) if dp is None else np.asarray(dp, dtype=np.float64).reshape(-1)  # [T]
    n = int(lb.shape[0])
    if n == 0:
        return None
    nll_q, nll_b = -ln, -lb  # [T]
    mq, eq = _mean_err(float(nll_q.sum()), float((nll_q * nll_q).sum()), n)
    mb, eb = _mean_err(float(nll_b.sum()), float((nll_b * nll_b).sum()), n)
    cov = (float((nll_q * nll_b).sum()) / n - mq * mb) / (n - 1) if n > 1 else math.nan
    ppl_q, ppl_b = math.exp(mq), math.exp(mb)
    ln_ratio = mq - mb
    ln_ratio_err = math.sqrt(max(eq * eq + eb * eb - 2.0 * cov, 0.0)) if n > 1 else math.nan
    cor = cov / (eq * eb) if n > 1 and eq > 0 and eb > 0 else math.nan
    ppl_cov = ppl_q * ppl_b * cov
    ppl_diff_err = (math.sqrt(max((ppl_q * eq) ** 2 + (ppl_b * eb) ** 2 - 2.0 * ppl_cov, 0.0))
                    if n > 1 else math.nan)

    km, ke = _mean_err(float(kl.sum()), float((kl * kl).sum()), n)
    ks = np.sort(kl)  # [T]
    dm, de = _mean_err(float(d.sum()), float((d * d).sum()), n)
    ds = np.sort(d)  # [T]
    d2 = d * d
    m2, e2 = _mean_err(float(d2.sum()), float((d2 * d2).sum()), n)
    rms = math.sqrt(m2)
    rms_err = 0.5 / rms * e2 if rms > 0 else 0.0
    p_top = float(st.sum()) / n
    p_top_err = math.sqrt(p_top * (1.0 - p_top) / (n - 1)) if n > 1 else math.nan
    return KldStats(
        n=n,
        ppl_new=ppl_q, ppl_new_err=ppl_q * eq, ppl_base=ppl_b, ppl_base_err=ppl_b * eb, cor_ln_ppl=cor,
        ln_ppl_ratio=ln_ratio, ln_ppl_ratio_err=ln_ratio_err,
        ppl_ratio=math.exp(ln_ratio), ppl_ratio_err=math.exp(ln_ratio) * ln_ratio_err,
        ppl_diff=ppl_q - ppl_b, ppl_diff_err=ppl_diff_err,
        kld_mean=km, kld_err=ke, kld_max=float(ks[-1]),
        kld_pct={f"{p:.1f}": _percentile(ks, p) for p in KLD_PERCENTILES}, kld_min=float(ks[0]),
        dp_mean=dm, dp_err=de, dp_max=float(ds[-1]),
        dp_pct={f"{p:.1f}": _percentile(ds, p) for p in DP_PERCENTILES}, dp_min=float(ds[0]),
        rms_dp=rms, rms_dp_err=rms_err, same_top=p_top, same_top_err=p_top_err,
    )


def kld_stats_of_pairs(pairs) -> KldStats | None:
    """Summary over several documents' `PairedStats` (positions concatenated), optionally masked:
    `pairs` is an iterable of PairedStats or of (PairedStats, mask [T] bool)."""
    lb, ln, kl, st, dp = [], [], [], [], []
    for item in pairs:
        ps, m = item if isinstance(item, tuple) else (item, None)
        sel = slice(None) if m is None else np.asarray(m, dtype=bool)
        lb.append(ps.base.logp_target[sel])
        ln.append(ps.new.logp_target[sel])
        kl.append(ps.kld[sel])
        st.append(ps.same_top[sel])
        dp.append(ps.dp[sel])
    if not lb:
        return None
    return kld_stats(np.concatenate(lb), np.concatenate(ln), np.concatenate(kl), np.concatenate(st),
                     np.concatenate(dp))


def format_llama(s: KldStats) -> str:
    """The summary as llama-perplexity prints it (Δp and same-top in %)."""
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s.ppl_new:10.6f} ± {s.ppl_new_err:10.6f}",
        f"Mean PPL(base)                : {s.ppl_base:10.6f} ± {s.ppl_base_err:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s.cor_ln_ppl:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s.ln_ppl_ratio:10.6f} ± {s.ln_ppl_ratio_err:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s.ppl_ratio:10.6f} ± {s.ppl_ratio_err:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s.ppl_diff:10.6f} ± {s.ppl_diff_err:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_err:10.6f}",
        f"Maximum KLD: {s.kld_max:10.6f}",
    ]
    for k, v in s.kld_pct.items():
        label = "Median " if k == "50.0" else f"{k:>5s}%"
        lines.append(f"{label}  KLD: {v:10.6f}")
    lines += [f"Minimum KLD: {s.kld_min:10.6f}", "", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s.dp_mean:6.3f} ± {100 * s.dp_err:5.3f} %",
              f"Maximum Δp: {100 * s.dp_max:6.3f}%"]
    for k, v in s.dp_pct.items():
        label = "Median " if k == "50.0" else f"{k:>5s}%"
        lines.append(f"{label}  Δp: {100 * v:6.3f}%")
    lines += [f"Minimum Δp: {100 * s.dp_min:6.3f}%",
              f"RMS Δp    : {100 * s.rms_dp:6.3f} ± {100 * s.rms_dp_err:5.3f} %",
              f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_err:5.3f} %"]
    return "\n".join(lines)
