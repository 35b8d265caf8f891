"""What a solve touches: the selection policy of `l47 solve` (DESIGN §5), as pure functions of the sets report.

    train / dev events      every accepted event of the train / dev sets (the sets report's events)
    anchors                 collateral_anchor occurrences (FTPO with `own_anchors`: and the words' ordinary uses
                            in its train and background documents), thinned to at most `max_anchors_per_word` per word
                            (evenly spread), plus — with `protect_turn_ends` — the real turn ends (<|im_end|>
                            targets) of the solver's chats (background, train, dev; FTPO: background and train —
                            the dev documents' turn ends judge its candidates), protected exactly
    background              every `stride`-th position of the accepted background documents (FTPO: and of the train
                            documents), the stride chosen so that at most `max_background` positions are used
                            (WFLD: its Fisher) — FTPO: EVERY row, up to its `kl_rows` cap (a strided sample is what
                            the edit fits: on the demo the KL at the rows it never saw was 3.8× the KL at the ones
                            it did, and the held-out chats' KLD, bar (g), bound the edit) — prefix rows left out
                            (where moving mass off the banned word is the intended effect:
                            l47.dumps.select.prefix_rows, the definition bar (e) reports apart)
    guard events            slop events that the background documents hold after all (bar (f)'s special mass reads
                            them as a split of their own: FTPO guards and judges Σ p(special) there, never trains
                            them to drop)
    dev rows                positions of the dev documents (every row up to FTPO's `kl_rows`) but the phrases'
                            prefix rows — bar (g)'s rows (FTPO: exact KL, flips and
                            turn ends of each candidate, judged, never trained on)
    near misses             prefix rows of the solver's documents (background, train, dev) whose target is not the
                            phrase's final token: only the banned token's mass may move there (FTPO's tether)

Every list is ordered by document CONTENT (the sha256 of its token ids, `DocReport.content_key`) then position,
not by file hash: the same documents dumped into another folder (other metadata, other file hashes) give the
same float order and the same bundle bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from l47.data.experiment import SOLVER_SETS
from l47.dumps.select import prefix_rows
from l47.errors import L47Error
from l47.model import names

__all__ = ["SOLVER_SETS", "Selection", "SelectionPolicy", "ContentOrder", "select_positions"]


@dataclass(frozen=True)
class Selection:
    """The positions a solve uses, each list in content order."""

    train: list  # [EventRecord] the events the solver acts on (slop terms)
    dev: list  # [EventRecord] measured, never trained on
    anchors: list  # [CollateralRecord] protected collateral contexts (after thinning)
    turn_ends: list[tuple[str, int]]  # (doc sha256, row) of real turn ends, protected exactly
    background: list[tuple[str, int]]  # (doc sha256, row) background KL / Fisher positions
    background_docs: int
    background_total: int  # positions of the background documents before striding
    stride: int
    special: list[int]  # special-token ids (sorted)
    im_end: int | None  # the turn-end token id (None: the vocabulary has none)
    near: list[tuple[str, int, int]] = ()  # (doc sha256, row, banned final) of near misses, content order
    dev_rows: list[tuple[str, int]] = ()  # (doc sha256, row) of the dev documents away from prefix rows, strided
    # like the background: FTPO judges its candidates' KL and flips there (bars (g), (f) on the solver's own chats)
    guard: list = ()  # [EventRecord] slop events found in the background documents: never trained to drop, but
    # bar (f)'s special mass reads them as one more split (FTPO guards and judges it there too)


class ContentOrder:
    """Sort key (content key, position) for a report's documents."""

    def __init__(self, report):
        self._key = {d.sha256: (d.content_key or d.sha256) for d in report.docs}

    def __call__(self, sha: str, pos: int) -> tuple[str, int]:
        return (self._key.get(sha, sha), pos)


def thin_anchors(anchors: list, per_word: int, order: ContentOrder) -> list:
    """At most `per_word` occurrences per word, evenly spread over its occurrences (per_word <= 0: all)."""
    if per_word <= 0:
        return anchors
    keep = []
    for word in sorted({c.word for c in anchors}):
        occ = [c for c in anchors if c.word == word]
        idx = np.unique(np.linspace(0, len(occ) - 1, min(len(occ), per_word)).round().astype(int))
        keep += [occ[i] for i in idx]
    return sorted(keep, key=lambda c: order(c.doc_sha256, c.pos))


def background_positions(bg_docs: list, max_background: int) -> tuple[list[tuple[str, int]], int, int]:
    """Every stride-th row of each document, stride = ceil(total / max_background) (1: every row when the
    documents hold at most max_background). -> (pairs, stride, total)"""
    total = sum(d.T for d in bg_docs)
    stride = max(1, int(np.ceil(total / max_background)))
    return [(d.sha256, t) for d in bg_docs for t in range(0, d.T, stride)], stride, total


@dataclass(frozen=True)
class SelectionPolicy:
    """What a solver's selection takes (its Solver's `policy`, solvers/methods.py): no method name is read here."""

    background_cap: int  # background (and dev) rows at most: FTPO's `kl_rows` (every row of the documents, so the
    # step's rotating subsets and the judge's exact KL cover the rows the held-out chats resemble), WFLD's
    # `max_background` (its Fisher's sample)
    background_with_train: bool  # the train documents' own rows are background too (FTPO)
    judges_dev: bool  # the dev documents are judged inside the solve: their turn ends are left unprotected (FTPO)
    anchor_sets: tuple[str, ...] = ("collateral_anchor",)  # the sets whose collateral occurrences are anchors


def near_miss_rows(docs: list, pts: list, tokens_of) -> list[tuple[str, int, int]]:
    """(doc, row, banned final) of every prefix row (l47.dumps.select.prefix_rows) whose target is not one of
    its phrase's final tokens."""
    out = []
    for d in docs:
        tok = np.asarray(tokens_of(d.sha256))
        for pt in pts:
            rows = np.nonzero(prefix_rows(tok, [pt]) & ~np.isin(tok[1:], pt.finals))[0]
            out += [(d.sha256, int(t), int(pt.finals[0])) for t in rows]
    return sorted(set(out))


def without_prefix_rows(pairs: list[tuple[str, int]], docs: list, pts: list, tokens_of) -> list[tuple[str, int]]:
    """The (doc, row) pairs that are not prefix rows of any phrase."""
    pre = {d.sha256: prefix_rows(np.asarray(tokens_of(d.sha256)), pts) for d in docs}
    return [(s, t) for s, t in pairs if not pre[s][t]]


def turn_end_rows(docs: list, im_end: int, tokens_of) -> list[tuple[str, int]]:
    """(doc, row) of every row whose target is `im_end`, for each document (tokens_of(sha) -> token ids)."""
    out = []
    for d in docs:
        tg = np.asarray(tokens_of(d.sha256)[1:])  # [T] targets
        out += [(d.sha256, int(t)) for t in np.nonzero(tg == im_end)[0]]
    return out


def select_positions(report, cfg, policy: SelectionPolicy, where: str | Path, tokens_of) -> Selection:
    """Apply `policy` and the selection settings of `cfg` (a SolveConfig) to a SetsReport. L47Error when there is nothing to
    train on or no background; tokens_of(sha) gives a document's token ids (for the turn ends)."""
    order = ContentOrder(report)

    def by_order(xs, sha=lambda x: x.doc_sha256, pos=lambda x: x.pos):
        return sorted(xs, key=lambda x: order(sha(x), pos(x)))

    train = by_order([e for e in report.events if e.set == "train"])
    dev = by_order([e for e in report.events if e.set == "dev"])
    if not train:
        raise L47Error(where, "train events", "at least one prefix-exact event with base p ≥ "
                       f"{report.thresholds['non_event_p']} in accepted train documents", "none")
    anchors = by_order([c for c in report.collateral if c.set in policy.anchor_sets])
    anchors = thin_anchors(anchors, cfg.max_anchors_per_word, order)
    accepted = [d for d in report.docs if not d.refused]
    bg_docs = by_order([d for d in accepted if d.set == "background"], lambda d: d.sha256, lambda d: 0)
    if not bg_docs:
        raise L47Error(where, "sets.background", "at least one accepted background document (plain and chat)",
                       "none")
    # FTPO: the train documents' own positions are background too (chats in the phrases' register: the edit's key
    # directions are used there away from the events, and the background documents, written without the
    # phrases, do not show it; measured on the demo: held-out chat KLD 16× the background KL without them)
    kl_docs = bg_docs + (by_order([d for d in accepted if d.set == "train"], lambda d: d.sha256, lambda d: 0)
                         if policy.background_with_train else [])
    cap = policy.background_cap
    bg, stride, total = background_positions(kl_docs, cap)
    pts = list(report.phrases)
    bg = without_prefix_rows(bg, kl_docs, pts, tokens_of)
    im_end = report.special_ids.get(names.IM_END)
    turn_ends = []
    if cfg.protect_turn_ends and im_end is not None:
        # FTPO: the dev documents' turn ends are judged (their argmax, per candidate), never trained on
        own_sets = ("train",) if policy.judges_dev else ("train", "dev")
        own = by_order([d for d in accepted if d.set in own_sets], lambda d: d.sha256, lambda d: 0)
        turn_ends = turn_end_rows(bg_docs + own, int(im_end), tokens_of)
    special = sorted(set(int(v) for v in report.special_ids.values()))
    solver_docs = bg_docs + by_order([d for d in accepted if d.set in ("train", "dev")], lambda d: d.sha256,
                                     lambda d: 0)
    near = sorted(near_miss_rows(solver_docs, pts, tokens_of), key=lambda x: order(x[0], x[1]))
    dev_docs = by_order([d for d in accepted if d.set == "dev"], lambda d: d.sha256, lambda d: 0)
    # bar (g)'s rows: every row but the prefix rows (events and near misses, as bar (g) and (e) judge; the near
    # misses' own change is held by the conditional tether)
    dev_rows = without_prefix_rows(background_positions(dev_docs, cap)[0], dev_docs, pts, tokens_of)
    guard = by_order([e for e in report.events if e.set == "background"])
    return Selection(train, dev, anchors, turn_ends, bg, len(kl_docs), total, stride, special,
                     None if im_end is None else int(im_end), near, dev_rows, guard)
