"""Thin phrases: too few train or held-out events to learn or to judge, named before any long work.

A phrase with fewer than `min_train_per_phrase` train events gives the solver a handful of contexts to generalise
from; one with fewer than `min_heldout_per_phrase` held-out events cannot pass bar (c) whatever the solver does.
`l47 plan` and `l47 solve` refuse such an experiment (exit 2) with the phrase, its counts per split and how many more
documents of the kind that held its events would bring it to both minima, from its rate per pool document:

    rate      r = events of the phrase in the split pool / pool documents            (events per document)
    share     s_k = documents in split k / pool documents                           (k = train, heldout)
    more      ceil( max_k (min_k − n_k)⁺ / s_k  /  r )                                documents to add to the pool

(the split is by document, so a new document lands in split k with probability s_k; the figure is an expectation,
not a promise). Without a split pool the events of each set are counted as they are listed.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

SPLITS = ("train", "dev", "heldout")


@dataclass(frozen=True)
class ThinPhrase:
    phrase: str
    counts: dict[str, int]  # split -> events
    short: dict[str, tuple[int, int]]  # split -> (events, minimum) where below
    kind: str  # "generated chats" | "written documents": where most of its events came from
    rate: float  # events per pool document (0: no pool document holds one)
    more_docs: int | None  # pool documents of that kind to add (None: the rate is 0, no estimate)

    def line(self) -> str:
        have = ", ".join(f"{k} {self.counts.get(k, 0)}" for k in SPLITS)
        need = ", ".join(f"≥ {m} {k}" for k, (_, m) in self.short.items())
        more = (f"about {self.more_docs} more {self.kind} like those that held it ({self.rate:.2g} events per "
                f"document)" if self.more_docs is not None else f"documents that use it: no pool document holds one")
        return f"{self.phrase!r} has {have} events (needs {need}): add {more}"


def thin_phrases(phrases: list[str], events, docs, min_train: int, min_heldout: int) -> list[ThinPhrase]:
    """The phrases below either minimum, in the experiment's order. events: records with .phrase, .set, .generated
    (the sets report's accepted events); docs: records with .set and .refused (the sets report's documents)."""
    pool_docs = Counter(d.set for d in docs if d.set in SPLITS and not d.refused)  # split -> documents
    n_pool = sum(pool_docs.values())
    out = []
    for ph in phrases:
        mine = [e for e in events if e.phrase == ph]
        counts = Counter(e.set for e in mine)
        mins = {"train": min_train, "heldout": min_heldout}
        short = {k: (counts.get(k, 0), m) for k, m in mins.items() if counts.get(k, 0) < m}
        if not short:
            continue
        in_pool = sum(counts.get(k, 0) for k in SPLITS)
        rate = in_pool / n_pool if n_pool else 0.0
        more = None
        if rate > 0:
            per_split = [(m - counts.get(k, 0)) / (pool_docs.get(k, 0) / n_pool)
                         for k, (_, m) in short.items() if pool_docs.get(k, 0)]
            more = math.ceil(max(per_split) / rate) if per_split else None
        generated = sum(bool(getattr(e, "generated", False)) for e in mine)
        kind = "generated chats" if generated * 2 >= max(len(mine), 1) and mine else "written documents"
        out.append(ThinPhrase(ph, dict(counts), short, kind, rate, more))
    return out
