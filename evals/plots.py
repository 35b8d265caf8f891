"""The audit's PNG plots, drawn with matplotlib's Agg canvas (no pyplot, no global backend state):
    slop_per_phrase.png    p(rejected) per phrase: base, bundle, penalty alone, bundle + penalty
    collateral_dlogp.png   per-word Δlog p distributions at collateral_eval occurrences, with the bars' lines
    kld_per_set.png        per-position KLD distribution (ECDF, log x) per set, with the KLD bar
    special_mass.png       Σ p(special) at slop events, before vs after (points above the diagonal = a rise)
A plot without data is skipped (its name is not returned).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from l47.fileio import write_bytes_atomic


def _fig(w: float = 8.0, h: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path.name


def plot_slop(path: Path, slop: dict) -> str | None:
    pp = slop.get("per_phrase") or {}
    if not pp:
        return None
    fig = _fig(max(6.0, 1.4 * len(pp) + 2), 4.5)
    ax = fig.add_subplot(1, 1, 1)
    phrases = list(pp)
    cols = [("p_before", "base"), ("p_after", "bundle"), ("p_penalty", "penalty"), ("p_stacked", "bundle + penalty")]
    cols = [(k, lab) for k, lab in cols if all(pp[p].get(k) is not None for p in phrases)]
    x = np.arange(len(phrases))
    wd = 0.8 / max(1, len(cols))
    for i, (k, lab) in enumerate(cols):
        ax.bar(x + (i - (len(cols) - 1) / 2) * wd, [pp[p][k] for p in phrases], wd, label=lab)
    ax.set_xticks(x, [f"{p}\n(n={pp[p]['n']})" for p in phrases], fontsize=8)
    ax.set_ylabel("mean p(rejected)")
    ax.set_ylim(0, 1)
    ax.set_title("p(rejected) at slop events, per phrase")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_collateral(path: Path, coll: dict, mean_bar: float, below: float) -> str | None:
    rows = coll.get("rows") or []
    if not rows:
        return None
    words = list(dict.fromkeys(r["word"] for r in rows))
    data = [np.array([r["dlogp"] for r in rows if r["word"] == wd]) for wd in words]
    fig = _fig(max(6.0, 1.1 * len(words) + 2), 4.5)
    ax = fig.add_subplot(1, 1, 1)
    ax.boxplot(data, showfliers=False)
    rng = np.random.default_rng(0)
    for i, x in enumerate(data, 1):
        ax.scatter(i + rng.uniform(-0.15, 0.15, x.size), x, s=6, alpha=0.5)
        ax.scatter([i], [x.mean()], marker="D", color="black", s=20, zorder=3)
    ax.axhline(mean_bar, color="red", ls="--", lw=1, label=f"per-word mean bar {mean_bar:g}")
    ax.axhline(below, color="orange", ls=":", lw=1, label=f"'below' line {below:g}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(range(1, len(words) + 1), [repr(wd) for wd in words], fontsize=8)
    ax.set_ylabel("Δ log p(target), nats")
    ax.set_title("collateral_eval: Δ log p per word (diamond = mean)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_kld(path: Path, docs, kld_bar: float) -> str | None:
    sets = list(dict.fromkeys(d.set for d in docs))
    if not sets:
        return None
    fig = _fig()
    ax = fig.add_subplot(1, 1, 1)
    for s in sets:
        k = np.sort(np.concatenate([d.ps.kld for d in docs if d.set == s]))
        k = np.maximum(k, 1e-12)
        ax.step(k, np.arange(1, k.size + 1) / k.size, where="post", label=f"{s} (mean {k.mean():.2e})")
    ax.axvline(kld_bar, color="red", ls="--", lw=1, label=f"KLD bar {kld_bar:g} (on the mean)")
    ax.set_xscale("log")
    ax.set_xlabel("KL(base ‖ bundle) per position, nats")
    ax.set_ylabel("fraction of positions ≤ x")
    ax.set_title("KLD distribution per set")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_special(path: Path, events: list[dict]) -> str | None:
    if not events:
        return None
    b = np.array([e["special_p_before"] for e in events])
    a = np.array([e["special_p_after"] for e in events])
    fig = _fig(5.5, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    lo = max(1e-9, float(min(b.min(), a.min())) * 0.5)
    hi = min(1.0, float(max(b.max(), a.max())) * 2)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.scatter(np.maximum(b, lo), np.maximum(a, lo), s=14)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Σ p(special) before")
    ax.set_ylabel("Σ p(special) after")
    ax.set_title(f"special-token mass at slop events (mean {b.mean():.2e} → {a.mean():.2e})")
    return _save(fig, path)


def write_plots(folder: Path, report: dict, docs) -> list[str]:
    folder = Path(folder)
    th = report["thresholds"]
    slop = (report.get("slop") or {}).get("heldout") or (report.get("blind") or {}).get("slop") or {}
    out = [
        plot_slop(folder / "slop_per_phrase.png", slop),
        plot_collateral(folder / "collateral_dlogp.png", report.get("collateral") or {}, th["collateral_word_mean"],
                        th["collateral_below"]),
        plot_kld(folder / "kld_per_set.png", [d for d in docs if not d.refused], th["kld_max"]),
        plot_special(folder / "special_mass.png", slop.get("events") or []),
    ]
    return [p for p in out if p]


SWEEP_PLOT_TITLE = "l47 solve --sweep"  # the PNG's Title metadata: how an existing plot is recognised as ours


def _yerr(y: list[float], ivs: list) -> np.ndarray:
    """[2, C] error-bar lengths below / above each value from its [lo, hi] interval (0 where there is none)."""
    out = np.zeros((2, len(y)))
    for j, (v, iv) in enumerate(zip(y, ivs)):
        if iv is not None and np.isfinite(v):
            out[:, j] = max(v - iv[0], 0.0), max(iv[1] - v, 0.0)
    return out


def plot_sweep(path: Path, sweep) -> str:
    """`l47 solve --sweep`'s plot, written atomically: per candidate (l47.data.record.SweepRecord) its dev residual
    per phrase (small markers), worst phrase (line) and pooled (squares) vs its exact background KL, the markers
    with their 90 % intervals over dev documents as error bars; the KL budget as a vertical line, the chosen
    candidate ringed."""


    cs = sorted(sweep.candidates, key=lambda c: c.background_kl_exact)
    kl = np.array([c.background_kl_exact for c in cs])
    fig = _fig(8.0, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    for ph in sorted({p for c in cs for p in c.dev_residual_per_phrase}):
        y = [c.dev_residual_per_phrase.get(ph, np.nan) for c in cs]
        ax.errorbar(kl, y, yerr=_yerr(y, [c.dev_residual_interval_per_phrase.get(ph) for c in cs]), fmt="o", ms=4,
                    alpha=0.6, capsize=2, lw=0.8, label=ph)
    ax.plot(kl, [c.dev_residual_worst for c in cs], "-", color="k", lw=1, label="worst phrase")
    y = [c.dev_residual for c in cs]
    ax.errorbar(kl, y, yerr=_yerr(y, [c.dev_residual_interval for c in cs]), fmt="s", color="k", ms=5, capsize=3,
                lw=1, label="pooled")
    for c in cs:
        ax.annotate(c.name, (c.background_kl_exact, c.dev_residual_worst), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ch = next(c for c in cs if c.chosen)
    ax.plot([ch.background_kl_exact], [ch.dev_residual_worst], "o", ms=14, mfc="none", mec="red", mew=2,
            label=f"chosen ({ch.name})")
    ax.axvline(sweep.budget, color="red", ls="--", lw=1, label=f"KL budget {sweep.budget:.3g}")
    if kl.min() > 0 and kl.max() > 10 * kl.min():
        ax.set_xscale("log")  # candidates' KL spans decades
    ax.set_xlabel("exact background KL (nats, re-quantised)")
    ax.set_ylabel("dev residual p(rejected) after / before")
    ax.set_ylim(0, max(1.05, float(np.nanmax([c.dev_residual_worst for c in cs])) * 1.05))
    ax.set_title("sweep candidates on dev: residual per phrase vs exact KL")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Title": SWEEP_PLOT_TITLE})
    write_bytes_atomic(path, buf.getvalue())
    return Path(path).name
