"""Uncertainty of per-phrase figures: a bootstrap over documents (pure numpy).

Events of one document are not independent (the same chat repeats its phrasing, its topic and the solver's
edit acts on them together), so the resampling unit is the DOCUMENT: each replicate draws the documents with
replacement and keeps all events of every drawn document (cluster bootstrap). The interval is the percentile
interval of the replicates; with one document there is no spread to estimate and the interval is None.

Notation for array shapes:
    N   events        D   documents        B   bootstrap replicates
Precision: f64 sums; replicate weights are integer draw counts.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from l47.errors import L47Error

N_BOOT = 2000
LEVEL = 0.90
POOLED = "(all)"  # per_phrase_bootstrap's key of the pooled figure (every phrase's events together)


def bootstrap_over_documents(docs: Sequence, num: Sequence[float], den: Sequence[float] | None = None, *,
                             n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> dict:
    """Statistic Σ num / Σ den over the events (den = 1 per event when None: the mean of num) and its bootstrap
    over documents.

    docs [N]: the document key of each event (a content hash); num [N], den [N]: per-event values. For the
    residual ratio (mean p after / mean p before at the same events) pass num = p_after, den = p_before.
    Returns {value, lo, hi, se, n_events, n_docs, n_boot, level}; lo / hi / se are None with < 2 documents or
    n_boot = 0; a replicate whose Σ den is 0 is dropped.
    """
    if not 0.0 < level < 1.0:
        raise L47Error("bootstrap", "level", "a number in (0, 1)", repr(level))
    if n_boot < 0:
        raise L47Error("bootstrap", "n_boot", "an integer >= 0", repr(n_boot))
    num = np.asarray(num, dtype=np.float64)  # [N]
    den = np.ones_like(num) if den is None else np.asarray(den, dtype=np.float64)  # [N]
    if num.shape != den.shape or num.ndim != 1 or len(docs) != num.shape[0]:
        raise L47Error("bootstrap", "docs / num / den", "three sequences of the same length",
                       f"{len(docs)}, {num.shape}, {den.shape}")
    out = {"value": None, "lo": None, "hi": None, "se": None, "n_events": int(num.shape[0]), "n_docs": 0,
           "n_boot": int(n_boot), "level": float(level)}
    if num.shape[0] == 0:
        return out
    keys, inv = np.unique(np.asarray([str(d) for d in docs]), return_inverse=True)
    D = keys.shape[0]
    s_num = np.bincount(inv, weights=num, minlength=D)  # [D] per-document sums
    s_den = np.bincount(inv, weights=den, minlength=D)  # [D]
    out["n_docs"] = int(D)
    out["value"] = float(s_num.sum() / s_den.sum()) if s_den.sum() else None
    if D < 2 or n_boot == 0:
        return out
    rng = np.random.default_rng(seed)
    w = rng.multinomial(D, np.full(D, 1.0 / D), size=n_boot).astype(np.float64)  # [B, D] draw counts
    bn, bd = w @ s_num, w @ s_den  # [B]
    ok = bd > 0
    if not ok.any():
        return out
    rep = bn[ok] / bd[ok]  # [B'] replicate statistics
    a = (1.0 - level) / 2.0
    out["lo"], out["hi"] = (float(x) for x in np.quantile(rep, [a, 1.0 - a]))
    out["se"] = float(rep.std(ddof=1)) if rep.shape[0] > 1 else None
    return out


def per_phrase_bootstrap(events: Iterable[Mapping], *, num: str = "p_after", den: str | None = "p_before",
                         doc: str = "doc_sha256", phrase: str = "phrase", n_boot: int = N_BOOT,
                         level: float = LEVEL, seed: int = 0) -> dict[str, dict]:
    """phrase → `bootstrap_over_documents` of Σ num / Σ den over that phrase's events, plus POOLED ("(all)").

    events: mappings with the named keys (the audit's slop rows: doc_sha256, phrase, p_before, p_after; an
    EventRecord converted with dataclasses.asdict works with num="p_base", den=None). Each phrase gets its own
    stream, seeded by `key_seed(phrase, seed)` ("(all)" by its own key): neither the order of the rows nor the
    other phrases move a phrase's interval, so two readers of the same events (the solver's dev rows, the audit's)
    get the same interval.
    """
    rows = list(events)
    by: dict[str, list[Mapping]] = {}
    for r in rows:
        by.setdefault(str(r[phrase]), []).append(r)

    def one(rs: list[Mapping], s: int) -> dict:
        return bootstrap_over_documents([r[doc] for r in rs], [float(r[num]) for r in rs],
                                        None if den is None else [float(r[den]) for r in rs],
                                        n_boot=n_boot, level=level, seed=s)

    out = {p: one(rs, key_seed(p, seed)) for p, rs in by.items()}
    out[POOLED] = one(rows, key_seed(POOLED, seed))
    return out


def key_seed(key: str, seed: int = 0) -> int:
    """The generator seed of one phrase's (or POOLED's) bootstrap: 64 bits of sha256("<seed>:<key>")."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()[:8], "little")


def interval(b: Mapping) -> list[float] | None:
    """[lo, hi] of a `bootstrap_over_documents` result; None when it has none (fewer than 2 documents)."""
    return None if b.get("lo") is None else [b["lo"], b["hi"]]


def phrase_intervals(rows: Iterable[Mapping], num: str = "p_after", den: str | None = "p_before") -> dict[str, dict]:
    """phrase (and POOLED "(all)") -> {value, interval: [lo, hi] | None, n_events, n_docs}: Σ num / Σ den over the
    phrase's rows (den None: the mean of num) and its interval bootstrapped over DOCUMENTS (rows carry
    doc_sha256 and phrase) by `per_phrase_bootstrap` with its fixed default seed: the same rows, in any order, give
    the same interval. None with fewer than 2 documents."""
    return {k: {"value": b["value"], "interval": interval(b), "n_events": b["n_events"], "n_docs": b["n_docs"]}
            for k, b in per_phrase_bootstrap(rows, num=num, den=den).items()}


def residual_intervals(rows: Iterable[Mapping]) -> dict[str, dict]:
    """phrase (and POOLED) -> {residual_interval: [lo, hi] | None, n_docs}: `phrase_intervals` of the residual
    ratio Σ p_after / Σ p_before over the event rows (doc_sha256, phrase, p_before, p_after). The audit's slop
    figures and the sweep's dev figures."""
    return {k: {"residual_interval": v["interval"], "n_docs": v["n_docs"]} for k, v in phrase_intervals(rows).items()}


def settings(seed: int = 0) -> dict:
    """What a report states about its intervals: the resampling unit, replicates, level and seed."""
    return {"unit": "document", "n_boot": N_BOOT, "level": LEVEL, "seed": seed, "interval": "percentile",
            "stream": "per phrase: key_seed(phrase, seed)"}


__all__ = ["N_BOOT", "LEVEL", "POOLED", "bootstrap_over_documents", "per_phrase_bootstrap", "key_seed", "interval",
           "phrase_intervals", "residual_intervals", "settings"]


def ratio_upper(x: np.ndarray, doc: np.ndarray, z: float = 1.645) -> float:
    """One-sided upper bound of the row mean of x [P] over documents drawn at random (cluster ratio estimator,
    f64): R + z·SE, R = Σx / P, SE² = D/(D−1) · Σ_d (S_d − R·n_d)² / P² (S_d, n_d: a document's sum and rows).
    With one document, R itself."""
    x = np.asarray(x, dtype=np.float64)
    _, inv = np.unique(np.asarray(doc), return_inverse=True)
    S, n = np.bincount(inv, weights=x), np.bincount(inv).astype(np.float64)  # [D]
    R, D = float(x.mean()), len(S)
    if D < 2:
        return R
    se = math.sqrt(D / (D - 1) * float(((S - R * n) ** 2).sum())) / len(x)
    return R + z * se


