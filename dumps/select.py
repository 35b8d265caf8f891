"""Position selection on token ids (pure numpy, no model): banned phrases → token tuples, prefix-exact events,
collateral occurrences, chat structure, the seeded split by document, and the naturalness guards.

Every rule here is one of the seed's hard lessons (DESIGN §4, seed §5–§6):
    - a slop event is a position whose preceding tokens equal a banned tuple's prefix and whose target is the
      tuple's final token — nothing else (seed §5.3: the "mined" loss without this check suppressed the final
      words everywhere);
    - held-out means other documents, ≥ 30 % of events, ≥ 3 per phrase (seed §5.1, §6.3);
    - collateral = ordinary uses of the final words, never after a banned prefix (seed §5 (d), §6);
    - training contexts must be natural: word salad made of repeated fragments is refused (seed §5.2).

Notation for array shapes:
    T   positions of a document; row t is computed at input tokens[t] and predicts the TARGET tokens[t+1]
    L   length of a banned tuple (≥ 2: prefix tuple[:-1] + final token tuple[-1])
    k   top-k entries of a head pass
Token ids are int64 after `np.asarray`; probabilities are f64.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from l47.model import names
from l47.dumps.schema import PROV_GENERATED, PROV_GENERATION, PROV_MIXED, PROV_WRITTEN

SPLITS = ("train", "dev", "heldout")
TEMPLATE = names.ROLE_ID["template"]
USER = names.ROLE_ID["user"]
ASSISTANT = names.ROLE_ID["assistant"]
THINK = names.ROLE_ID["think"]

# ----------------------------------------------------------------------------------------------------------
# phrases → token tuples


@dataclass(frozen=True)
class PhraseIssue:
    """A surface variant that cannot be a prefix-exact tuple (reported, never dropped silently)."""

    phrase: str
    variant: str
    ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class PhraseTuples:
    phrase: str
    tuples: tuple[tuple[int, ...], ...]  # multi-token variants, deduplicated, in variant order
    variants: tuple[str, ...]  # the surface text of each tuple (first variant that produced it)
    margin_scale: float = 1.0

    @property
    def finals(self) -> tuple[int, ...]:
        return tuple(sorted({t[-1] for t in self.tuples}))


def surface_variants(phrase: str) -> list[tuple[str, str]]:
    """(context, variant) pairs: as-is, leading space, Capitalised, capitalised with space, lower-first, and
    each casing at a sentence start after a newline. The context's own tokens are stripped from the tuple."""
    p = phrase.strip()
    if not p:
        return []
    cases = [p, p[0].upper() + p[1:], p[0].lower() + p[1:]]
    out: list[tuple[str, str]] = []
    for c in dict.fromkeys(cases):
        out += [("", c), ("", " " + c), ("\n", c)]
    return list(dict.fromkeys(out))


def phrase_tuples(phrase: str, vocab, margin_scale: float = 1.0) -> tuple[PhraseTuples, list[PhraseIssue]]:
    """Token tuples of every surface variant of `phrase` under `vocab` (anything with `.encode(text)`)."""
    tuples: dict[tuple[int, ...], str] = {}
    issues: list[PhraseIssue] = []
    variants = surface_variants(phrase)
    if not variants:
        issues.append(PhraseIssue(phrase, phrase, (), "no tokens: the phrase is empty or whitespace"))
    for ctx, v in variants:
        ids = tuple(int(i) for i in vocab.encode(ctx + v))
        cids = tuple(int(i) for i in vocab.encode(ctx)) if ctx else ()
        shown = (ctx + v)
        if ids[:len(cids)] != cids:
            issues.append(PhraseIssue(phrase, shown, ids, f"the context {ctx!r} merges with the phrase's first "
                                      "token; variant skipped"))
            continue
        t = ids[len(cids):]
        if len(t) == 0:
            issues.append(PhraseIssue(phrase, shown, t, "no tokens"))
        elif len(t) == 1:
            issues.append(PhraseIssue(phrase, shown, t, f"tokenises to the single token {t[0]}: no prefix, so no "
                                      "prefix-exact event can exist; not used"))
        else:
            tuples.setdefault(t, shown)
    return PhraseTuples(phrase, tuple(tuples), tuple(tuples.values()), float(margin_scale)), issues


def phrases_to_tuples(phrases: Iterable, vocab) -> tuple[list[PhraseTuples], list[PhraseIssue]]:
    """Many phrases: each item a str, a (text, margin_scale) pair, or an object with .text / .margin_scale."""
    out, issues = [], []
    for p in phrases:
        if isinstance(p, str):
            text, scale = p, 1.0
        elif isinstance(p, tuple):
            text, scale = p
        else:
            text, scale = p.text, p.margin_scale
        pt, iss = phrase_tuples(text, vocab, scale)
        out.append(pt)
        issues += iss
        if not pt.tuples and text.strip():
            issues.append(PhraseIssue(text, text, (), "no multi-token variant: the phrase can have no events"))
    return out, issues


# ----------------------------------------------------------------------------------------------------------
# events


@dataclass(frozen=True)
class Event:
    """A prefix-exact slop position: tokens[t+1-len(prefix) : t+1] == prefix and tokens[t+1] == final."""

    pos: int  # row t (predicts tokens[t+1])
    phrase: str
    tuple: tuple[int, ...]
    start: int  # index in tokens of the tuple's first token
    in_context_copy: bool  # the same phrase fully occurred earlier in this document
    role: int | None  # role code of the target (names.ROLES), None when no role array was given

    @property
    def final(self) -> int:
        return self.tuple[-1]


def occurrences(tokens: np.ndarray, tup: Sequence[int]) -> np.ndarray:
    """Indices j of tokens where a full occurrence of `tup` ENDS (tokens[j-L+1 : j+1] == tup). [n] int64."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    L = len(tup)
    if L == 0 or tokens.shape[0] < L:
        return np.zeros(0, dtype=np.int64)
    win = sliding_window_view(tokens, L)  # [T+2-L, L]
    hit = (win == np.asarray(tup, dtype=np.int64)).all(axis=1)  # [T+2-L]
    return np.flatnonzero(hit).astype(np.int64) + (L - 1)


def find_events(tokens, phrases: Sequence[PhraseTuples], role=None) -> list[Event]:
    """Every prefix-exact event of `phrases` in one document, sorted by position.

    tokens [T+1]; role [T] (role of each target) or None. Row t is an event of tuple u iff
    tokens[t+1-(L-1) : t+1] == u[:-1] and tokens[t+1] == u[-1]. Per (position, phrase) the longest matching
    tuple is kept. `in_context_copy`: some tuple of the same phrase fully occurred ending at an index < t+1.
    """
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    role = None if role is None else np.asarray(role)
    out: list[Event] = []
    for pt in phrases:
        hits: dict[int, tuple[int, ...]] = {}  # final index j → longest tuple
        for tup in pt.tuples:
            for j in occurrences(tokens, tup).tolist():
                if j not in hits or len(tup) > len(hits[j]):
                    hits[j] = tup
        ends = sorted(hits)
        for k, j in enumerate(ends):
            t = j - 1  # the row whose target is the final token
            tup = hits[j]
            out.append(Event(pos=t, phrase=pt.phrase, tuple=tup, start=j - len(tup) + 1, in_context_copy=k > 0,
                             role=None if role is None else int(role[t])))
    out.sort(key=lambda e: (e.pos, e.phrase))
    return out


def prefix_rows(tokens, phrases: Sequence[PhraseTuples]) -> np.ndarray:
    """Rows whose preceding tokens equal a banned tuple's prefix, WHATEVER the target: row t is marked iff
    tokens[t+1-(L-1) : t+1] == u[:-1] for some tuple u of length L. [T] bool.

    These are the positions where moving probability off the banned final token is the intended effect of an
    edit, so a distribution change there is not collateral: bar (e) reports them apart (their KLD is listed,
    not judged) and the solver treats them as the edit's own rows, never as protected background. The events of
    `find_events` are the subset whose target IS the final token. One definition, used by l47.evals and
    l47.solvers alike."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    T = max(tokens.shape[0] - 1, 0)
    rows = np.zeros(T, dtype=bool)  # [T]
    for pt in phrases:
        for tup in pt.tuples:
            ends = occurrences(tokens[:-1], tup[:-1])  # prefix ends at index t ≤ T−1 → row t predicts next
            rows[ends] = True
    return rows


# ----------------------------------------------------------------------------------------------------------
# document identity by content: near-duplicate windows

DEFAULT_WINDOW = 64  # content tokens a scored document may share with a training document (DESIGN §4)
_P = np.uint64(1099511628211)  # FNV-style odd multiplier for the rolling window hash (collisions re-checked)


def content_ids(tokens, role, exclude: Iterable[tuple[int, ...]] = ()) -> np.ndarray:
    """The document's content token ids for near-duplicate checks: the targets tokens[1:] whose role is not
    `template` (chat markup and special tokens are the same in every chat), with any system-role span listed in
    `exclude` (a system prompt common to several documents) left out. [C] int64."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(role)  # [T]
    targets = tokens[1:]  # [T]
    keep = role != TEMPLATE  # [T]
    excl = set(tuple(int(i) for i in e) for e in exclude)
    if excl:
        for a, b in _runs(role == names.ROLE_ID["system"]):
            if tuple(int(i) for i in targets[a:b]) in excl:
                keep[a:b] = False
    return targets[keep]


def system_spans(tokens, role) -> list[tuple[int, ...]]:
    """The system-role spans of a document (runs of targets whose role is `system`), as id tuples."""
    tokens = np.asarray(tokens, dtype=np.int64)
    role = np.asarray(role)
    return [tuple(int(i) for i in tokens[1:][a:b]) for a, b in _runs(role == names.ROLE_ID["system"])]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every run of True in a [T] bool mask."""
    m = np.concatenate([[False], np.asarray(mask, dtype=bool), [False]])
    d = np.flatnonzero(m[1:] != m[:-1])
    return list(zip(d[0::2].tolist(), d[1::2].tolist()))


def window_hashes(ids, n: int) -> np.ndarray:
    """Polynomial hash (mod 2^64) of every window of n consecutive ids. [C−n+1] uint64 (empty when C < n)."""
    ids = np.asarray(ids, dtype=np.int64).astype(np.uint64)  # [C]
    if n <= 0 or ids.shape[0] < n:
        return np.zeros(0, dtype=np.uint64)
    pw = np.ones(n, dtype=np.uint64)  # [n] P^(n-1-j)
    with np.errstate(over="ignore"):
        for j in range(n - 2, -1, -1):
            pw[j] = pw[j + 1] * _P
        win = sliding_window_view(ids, n)  # [C-n+1, n]
        return (win * pw).sum(axis=1, dtype=np.uint64)


@dataclass(frozen=True)
class WindowHit:
    key: str  # the indexed (training) document
    start: int  # index in the queried document's content ids
    start_indexed: int  # index in the indexed document's content ids
    n: int


class WindowIndex:
    """Every n-token content window of a set of documents (the training side), queried with another
    document: the first window both share, verified token by token (hash collisions never count)."""

    def __init__(self, n: int = DEFAULT_WINDOW):
        self.n = int(n)
        self._by_hash: dict[int, list[tuple[str, int]]] = {}
        self._ids: dict[str, np.ndarray] = {}

    def add(self, key: str, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        self._ids[key] = ids
        for i, h in enumerate(window_hashes(ids, self.n).tolist()):
            self._by_hash.setdefault(h, []).append((key, i))

    def keys_sharing(self, ids, skip: str | None = None) -> set[str]:
        """Every indexed document (other than `skip`) that shares at least one n-window with `ids`."""
        ids = np.asarray(ids, dtype=np.int64)
        out: set[str] = set()
        for i, h in enumerate(window_hashes(ids, self.n).tolist()):
            for key, j in self._by_hash.get(h, ()):
                if key != skip and key not in out and np.array_equal(ids[i:i + self.n],
                                                                     self._ids[key][j:j + self.n]):
                    out.add(key)
        return out

    def first_hit(self, ids, skip: str | None = None) -> WindowHit | None:
        """The first window of `ids` that an indexed document (other than `skip`) also holds, or None."""
        ids = np.asarray(ids, dtype=np.int64)
        for i, h in enumerate(window_hashes(ids, self.n).tolist()):
            for key, j in self._by_hash.get(h, ()):
                if key != skip and np.array_equal(ids[i:i + self.n], self._ids[key][j:j + self.n]):
                    return WindowHit(key, i, j, self.n)
        return None


# ----------------------------------------------------------------------------------------------------------
# collateral


@dataclass(frozen=True)
class Collateral:
    """An ordinary use of a collateral word: target == the word's id, NOT after a banned prefix ending in it."""

    pos: int
    word: str
    token_id: int
    role: int | None


def find_collateral(tokens, words: Mapping[str, int], phrases: Sequence[PhraseTuples], role=None) -> list[Collateral]:
    """Positions t with tokens[t+1] == a collateral word id, excluding every t where a banned tuple whose final
    token is that id has its prefix at tokens[t+1-len(prefix) : t+1]."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    targets = tokens[1:]  # [T]
    banned: dict[int, set[int]] = {}  # final id → rows that follow one of its prefixes
    for pt in phrases:
        for tup in pt.tuples:
            pre = tup[:-1]
            rows = occurrences(tokens[:-1], pre)  # prefix ends at index t (≤ T-1) → row t
            banned.setdefault(tup[-1], set()).update(rows.tolist())
    out = []
    for w, wid in words.items():
        for t in np.flatnonzero(targets == int(wid)).tolist():
            if t in banned.get(int(wid), ()):
                continue
            out.append(Collateral(pos=t, word=w, token_id=int(wid), role=None if role is None else int(role[t])))
    out.sort(key=lambda c: (c.pos, c.word))
    return out


# ----------------------------------------------------------------------------------------------------------
# chat structure


@dataclass(frozen=True)
class ChatStructure:
    """Chat positions of one document (all masks [T] bool, over rows t / targets tokens[t+1])."""

    terminal: np.ndarray  # target is <|im_end|> closing a real turn (opened by <|im_start|>, with content)
    opener: np.ndarray  # target is the first content token of a user turn (after <|im_start|>user\n)
    assistant: np.ndarray  # role of the target is assistant
    think: np.ndarray  # ... think
    user: np.ndarray  # ... user
    special_target: np.ndarray  # target is one of the special tokens
    n_turns: int  # complete turns <|im_start|> … <|im_end|>
    n_think: int  # closed <think> … </think> blocks

    @property
    def n_terminal(self) -> int:
        return int(self.terminal.sum())


def chat_structure(tokens, role, special_ids: Mapping[str, int]) -> ChatStructure:
    """Turn ends, user-turn openers and role masks from the ids (specials read from the model's vocabulary)
    and the dump's role array (roles come from the chat template: header tokens are role `template`)."""
    tokens = np.asarray(tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(role)  # [T]
    T = tokens.shape[0] - 1
    targets = tokens[1:]  # [T]
    sid = {k: int(v) for k, v in special_ids.items()}
    start, end = sid.get(names.IM_START), sid.get(names.IM_END)
    th, eth = sid.get(names.THINK), sid.get(names.END_THINK)
    special_target = np.isin(targets, np.array(sorted(sid.values()), dtype=np.int64))  # [T]
    terminal = np.zeros(T, dtype=bool)
    opener = np.zeros(T, dtype=bool)
    n_turns = n_think = 0
    open_at: int | None = None  # index of the open turn's <|im_start|>
    content = False  # the open turn has a non-template target
    first_seen = False  # the open turn's first content token was met
    think_open = False
    specials = set(sid.values())
    for j in range(tokens.shape[0]):
        tok = int(tokens[j])
        t = j - 1  # row whose target is tokens[j]
        if t >= 0 and open_at is not None and role[t] != TEMPLATE and tok not in specials:
            if not first_seen:
                first_seen = True
                opener[t] = role[t] == USER
            content = True
        if tok == start:
            open_at, content, first_seen = j, False, False
        elif tok == end and end is not None:
            if open_at is not None and t >= 0:
                n_turns += 1
                terminal[t] = content
            open_at = None
        elif tok == th and th is not None:
            think_open = True
        elif tok == eth and eth is not None and think_open:
            n_think += 1
            think_open = False
    return ChatStructure(
        terminal=terminal, opener=opener, assistant=role == ASSISTANT, think=role == THINK, user=role == USER,
        special_target=special_target, n_turns=n_turns, n_think=n_think,
    )


# ----------------------------------------------------------------------------------------------------------
# seeded split by document, stratified per phrase


@dataclass(frozen=True)
class SplitResult:
    assignment: dict[str, str]  # document key → "train" | "dev" | "heldout"
    counts: dict[str, dict[str, int]]  # phrase → split → events
    totals: dict[str, int]  # split → events
    heldout_frac: float  # held-out events / all events (0 when there are none)
    warnings: tuple[str, ...]


def phrase_split_counts(doc_counts: Mapping[str, Mapping[str, int]], assignment: Mapping[str, str],
                        phrases: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
    """phrase → split → events, from per-document event counts and a document → split assignment (documents
    without an assignment are not counted). `phrases` adds phrases with no events (all zeros)."""
    out: dict[str, dict[str, int]] = {p: {s: 0 for s in SPLITS} for p in (phrases or ())}
    for k, c in doc_counts.items():
        s = assignment.get(k)
        for p, n in c.items():
            row = out.setdefault(p, {x: 0 for x in SPLITS})
            if s in row and n:
                row[s] += int(n)
    return out


def split_documents(doc_counts: Mapping[str, Mapping[str, int]], seed: int,
                    fractions: Mapping[str, float] | None = None, min_heldout_frac: float = 0.30,
                    min_heldout_per_phrase: int = 3) -> SplitResult:
    """Assign whole documents to train/dev/heldout, deterministically from `seed`, stratified per phrase.

    doc_counts: document key (use a content hash: the split then does not depend on file names) → phrase →
    events. Iterative stratification (Sechidis et al. 2011) over phrases: the phrase with the fewest events
    still unassigned is taken first, and its documents (seeded permutation of the sorted keys) go one by one
    to the split that (1) has none of this phrase's events yet — so a phrase found in ≥ 3 documents gets train,
    held-out and dev events, in that order — else (2) is furthest below its target share of this phrase's
    events, then of all events. A document's events count for every phrase it holds, so documents with several
    phrases are placed by their rarest phrase. Documents without events: by document count.
    Then train documents move to heldout (permutation order) until ≥ min_heldout_frac of events are held out,
    and for each phrase with < min_heldout_per_phrase held-out events; a move never leaves a phrase with no
    train event.
    """
    fr = dict(fractions or {"train": 0.55, "dev": 0.10, "heldout": 0.35})
    keys = sorted(doc_counts)
    order = [keys[i] for i in np.random.default_rng(seed).permutation(len(keys))]
    rank = {k: i for i, k in enumerate(order)}
    cnt = {k: {p: int(n) for p, n in doc_counts[k].items() if int(n) > 0} for k in keys}
    ev = {k: sum(cnt[k].values()) for k in keys}
    total = sum(ev.values())
    phrases = sorted({p for c in doc_counts.values() for p in c})
    p_total = {p: sum(cnt[k].get(p, 0) for k in keys) for p in phrases}
    assign: dict[str, str] = {}
    got = {s: 0 for s in SPLITS}  # events per split
    got_p = {p: {s: 0 for s in SPLITS} for p in phrases}  # phrase → split → events
    left = {p: p_total[p] for p in phrases}  # events of unassigned documents

    def place(k: str, s: str) -> None:
        assign[k] = s
        got[s] += ev[k]
        for p, n in cnt[k].items():
            got_p[p][s] += n
            left[p] -= n

    while True:
        todo = [p for p in phrases if left[p] > 0]
        if not todo:
            break
        p = min(todo, key=lambda q: (left[q], q))
        for k in sorted((k for k in keys if k not in assign and cnt[k].get(p, 0)), key=rank.__getitem__):
            empty = [s for s in SPLITS if got_p[p][s] == 0 and fr.get(s, 0) > 0]
            cand = empty or [s for s in SPLITS if fr.get(s, 0) > 0] or list(SPLITS)
            s = max(cand, key=lambda s: (fr.get(s, 0) * p_total[p] - got_p[p][s], fr.get(s, 0) * total - got[s],
                                         -SPLITS.index(s)))
            place(k, s)
    ndoc = {s: 0 for s in SPLITS}  # event-free documents per split
    n_free = sum(1 for k in keys if ev[k] == 0)
    for k in order:
        if ev[k] == 0:
            s = max(SPLITS, key=lambda s: (fr.get(s, 0) * n_free - ndoc[s], -SPLITS.index(s)))
            ndoc[s] += 1
            assign[k] = s

    def movable(k: str) -> bool:
        """train → heldout leaves every phrase of k with ≥ 1 train event."""
        return assign[k] == "train" and ev[k] > 0 and all(got_p[p]["train"] - n >= 1 for p, n in cnt[k].items())

    def move(k: str) -> None:
        got["train"] -= ev[k]
        got["heldout"] += ev[k]
        for p, n in cnt[k].items():
            got_p[p]["train"] -= n
            got_p[p]["heldout"] += n
        assign[k] = "heldout"

    # ≥ min_heldout_frac of all events held out
    for k in order:
        if total == 0 or got["heldout"] >= min_heldout_frac * total:
            break
        if movable(k):
            move(k)
    for p in phrases:
        for k in order:
            if got_p[p]["heldout"] >= min_heldout_per_phrase:
                break
            if cnt[k].get(p, 0) and movable(k):
                move(k)
    counts = phrase_split_counts(cnt, assign, phrases)
    frac = got["heldout"] / total if total else 0.0
    warns = []
    if total and frac < min_heldout_frac:
        warns.append(f"only {frac:.1%} of events held out (< {min_heldout_frac:.0%}): too few documents to split")
    for p in phrases:
        if counts[p]["heldout"] < min_heldout_per_phrase:
            warns.append(f"phrase {p!r}: {counts[p]['heldout']} held-out events (< {min_heldout_per_phrase})")
        missing = [s for s in ("train", "dev") if counts[p][s] == 0 and fr.get(s, 0) > 0]
        if missing and p_total[p]:
            warns.append(f"phrase {p!r}: no {' and no '.join(missing)} events ({p_total[p]} events in "
                         f"{sum(1 for k in keys if cnt[k].get(p))} document(s): add documents that use it)")
    return SplitResult(assign, counts, dict(got), frac, tuple(warns))


# ----------------------------------------------------------------------------------------------------------
# naturalness guards (seed §5.2: the training trace was word salad, which copying makes LOW-CE)

_WORD = re.compile(r"\w+|[^\w\s]")
_NONWORD = re.compile(r"[\W_]+")


def ngram_repeat_rate(text: str, n: int = 4) -> float:
    """Fraction of the word n-grams (lower-cased words and punctuation marks) that already occurred earlier in
    the text. Natural prose: a few %; fragments repeated over and over: most of them."""
    w = _WORD.findall(text.lower())
    if len(w) < n + 1:
        return 0.0
    grams = list(zip(*(w[i:] for i in range(n))))
    seen: set = set()
    rep = 0
    for g in grams:
        rep += g in seen
        seen.add(g)
    return rep / len(grams)


def _trigrams(s: str) -> set[str]:
    return {s[i:i + 3] for i in range(max(1, len(s) - 2))}


def dup_line_rate(text: str, jaccard: float = 0.8, min_chars: int = 8) -> float:
    """Fraction of the non-trivial lines (≥ min_chars after normalising case, punctuation and spacing) that
    are near-duplicates of an earlier line: character-trigram Jaccard similarity ≥ `jaccard`."""
    lines = [_NONWORD.sub(" ", ln.lower()).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if len(ln) >= min_chars]
    if len(lines) < 2:
        return 0.0
    grams = [_trigrams(ln) for ln in lines]
    dup = 0
    for i in range(1, len(lines)):
        gi = grams[i]
        for j in range(max(0, i - 256), i):
            gj = grams[j]
            if lines[i] == lines[j] or len(gi & gj) >= jaccard * len(gi | gj):
                dup += 1
                break
    return dup / len(lines)


@dataclass(frozen=True)
class SamplerCheck:
    checked: int  # generated positions whose sampler support could be decided
    undecided: int  # generated positions where the top-k kept was too short to decide
    violations: tuple[int, ...]  # rows whose target lies outside the recorded sampler's support


def sampler_violations(logp_target, top_logp, generated, sampler: Mapping, tol: float = 0.01) -> SamplerCheck:
    """Rows of generated targets that the recorded sampler could not have produced.

    logp_target [T] f64 log p(target) and top_logp [T, k] f64 (descending) at temperature 1, from the base
    forward; generated [T] bool. Necessary conditions (tolerance `tol` nats for engine-vs-forward rounding):
        greedy (temperature ≤ 0 or top_k == 1)   target is the argmax
        top_k = K ≤ k                            log p(target) ≥ K-th largest log p
        top_p = P < 1, temperature ≤ 1           target among the m most probable, m = smallest with Σ p ≥ P.
            Valid whether temperature is applied before (HF) or after (llama.cpp) the nucleus: for τ ≤ 1 the
            tempered top-m mass is ≥ the untempered one, so the tempered nucleus is inside the untempered one.
        min_p = M (when recorded)                p(target) ≥ M · max p
    """
    lp = np.asarray(logp_target, dtype=np.float64)  # [T]
    top = np.asarray(top_logp, dtype=np.float64)  # [T, k]
    gen = np.asarray(generated, dtype=bool)  # [T]
    k = top.shape[1]
    temp = float(sampler.get("temperature", 1.0))
    top_k = int(sampler.get("top_k", 0) or 0)
    top_p = float(sampler.get("top_p", 1.0) or 1.0)
    min_p = float(sampler.get("min_p", 0.0) or 0.0)
    if temp <= 0:
        top_k = 1
    bound = np.full(lp.shape, -np.inf)  # [T] the lowest log p the sampler can emit (lower bound)
    if 1 <= top_k <= k:  # a larger top_k is not decidable from k entries; top-p / min-p may still decide
        bound = np.maximum(bound, top[:, top_k - 1])
    if top_p < 1.0 and temp <= 1.0:
        cum = np.cumsum(np.exp(top), axis=1)  # [T, k] f64
        reached = cum[:, -1] >= top_p  # [T]
        m = np.argmax(cum >= top_p, axis=1)  # [T] index of the last nucleus member
        b = top[np.arange(top.shape[0]), m]
        bound = np.where(reached, np.maximum(bound, b), bound)
    if min_p > 0:
        bound = np.maximum(bound, top[:, 0] + math.log(min_p))
    undecided = ~np.isfinite(bound)  # [T]
    bad = gen & ~undecided & (lp < bound - tol)
    return SamplerCheck(int((gen & ~undecided).sum()), int((gen & undecided).sum()),
                        tuple(np.flatnonzero(bad).tolist()))


def claims_generation(provenance: Mapping | None) -> bool:
    """Does the provenance say some role's text was generated by a model (so its sampler can be checked)?"""
    return any(v == PROV_GENERATED for r, v in dict(provenance or {}).items() if r in names.ROLE_ID)


def generation_check(logp_target, top_logp, role, provenance: Mapping | None,
                     tol: float = 0.01) -> SamplerCheck | None:
    """`sampler_violations` at the rows whose role the provenance calls `generated`, under the sampler it
    records; None when the document claims no generation (or records no sampler, or no top-k was kept).
    logp_target [T], top_logp [T, k] (descending, temperature 1), role [T]: the base forward and the dump."""
    prov = dict(provenance or {})
    gen_roles = [names.ROLE_ID[r] for r, v in prov.items() if v == PROV_GENERATED and r in names.ROLE_ID]
    gen_info = prov.get(PROV_GENERATION)
    samp = gen_info.get("sampler") if isinstance(gen_info, Mapping) else None
    if not gen_roles or role is None or top_logp is None or not isinstance(samp, Mapping):
        return None
    gen = np.isin(np.asarray(role), gen_roles)  # [T] rows whose target was sampled
    return sampler_violations(logp_target, top_logp, gen, samp, tol)


@dataclass(frozen=True)
class GuardResult:
    ngram_repeat: float
    dup_lines: float
    ce: float | None  # base CE over content targets (nats), None when not scored
    sampler: SamplerCheck | None
    reasons: tuple[str, ...]  # empty = passes

    @property
    def ok(self) -> bool:
        return not self.reasons


def provenance_reasons(provenance: Mapping | None, roles_present: Iterable[str], model_sha256: str,
                       meta_model: str | None = None) -> list[str]:
    """Why a document's provenance does not allow it as a training context (empty list = allowed).

    Allowed: every content role present is `generated` (by this model, sampler recorded) or `written`.
    Refused: `mixed` (concatenated fragments), unknown values, a role without provenance, generated text from
    another model or without its generation settings.
    """
    prov = dict(provenance or {})
    out = []
    present = [r for r in roles_present if r != names.ROLES[TEMPLATE]]
    if not prov:
        return ["no provenance recorded"]
    generated = []
    for r in present:
        v = prov.get(r)
        if v is None:
            out.append(f"no provenance for role {r!r}")
        elif v == PROV_MIXED:
            out.append(f"role {r!r} is '{PROV_MIXED}' (concatenated fragments are not natural contexts)")
        elif v == PROV_GENERATED:
            generated.append(r)
        elif v != PROV_WRITTEN:
            out.append(f"role {r!r} has unknown provenance {v!r}")
    if generated:
        g = prov.get(PROV_GENERATION)
        if not isinstance(g, Mapping):
            out.append(f"roles {generated} are generated but no generation settings are recorded")
        else:
            s = g.get("sampler")
            if not isinstance(s, Mapping) or any(k not in s for k in ("temperature", "top_p", "top_k")):
                out.append("generation.sampler lacks temperature / top_p / top_k")
            gm = g.get("model") or meta_model
            if not gm or not model_sha256 or gm != model_sha256:
                out.append(f"generated by model {str(gm)[:16]!r}, not this model {model_sha256[:16]!r}")
    return out


@dataclass(frozen=True)
class GuardLimits:
    """The natural-text guards' limits (an experiment's thresholds: salad_*, ce_proxy_frac, sampler_*)."""

    ngram_n: int = 4  # word n-grams of the repeat rate
    max_ngram_repeat: float = 0.4
    max_dup_lines: float = 0.4
    ce_proxy_frac: float = 0.5  # refuse base CE > ce_proxy_frac · ln V
    max_sampler_violation_frac: float = 0.01
    sampler_tol: float = 0.01


def guard_document(text: str, *, logp_target=None, top_logp=None, role=None, provenance: Mapping | None = None,
                   vocab_size: int, limits: GuardLimits = GuardLimits()) -> GuardResult:
    """The salad / proxy / sampler guards for one document (provenance itself: `provenance_reasons`).

    text: the document's content (no chat markup). logp_target [T], top_logp [T, k]: base forward at
    temperature 1. role [T]. Refuses when the word n-gram repeat rate or the near-duplicate-line rate exceed
    their maxima, when base CE over content targets > ce_proxy_frac · ln V (a proxy sits near ln V, seed §3),
    or when more than max_sampler_violation_frac of the generated targets are outside the recorded sampler's
    support (all in `limits`).
    """
    ngram_n, max_ngram_repeat, max_dup_lines = limits.ngram_n, limits.max_ngram_repeat, limits.max_dup_lines
    ce_proxy_frac, max_sampler_violation_frac = limits.ce_proxy_frac, limits.max_sampler_violation_frac
    sampler_tol = limits.sampler_tol
    reasons = []
    ng = ngram_repeat_rate(text, ngram_n)
    dl = dup_line_rate(text)
    if ng > max_ngram_repeat:
        reasons.append(f"word salad: {ng:.0%} of word {ngram_n}-grams repeat earlier ones (> {max_ngram_repeat:.0%})")
    if dl > max_dup_lines:
        reasons.append(f"word salad: {dl:.0%} of lines are near-duplicates (> {max_dup_lines:.0%})")
    ce = None
    check = None
    if logp_target is not None:
        lp = np.asarray(logp_target, dtype=np.float64)  # [T]
        content = np.ones(lp.shape, dtype=bool) if role is None else np.asarray(role) != TEMPLATE
        if not content.any():
            content = np.ones(lp.shape, dtype=bool)
        ce = float(-lp[content].mean()) if lp.size else 0.0
        lim = ce_proxy_frac * math.log(vocab_size)
        if ce > lim:
            reasons.append(f"base CE {ce:.3f} > {ce_proxy_frac:g}·ln V = {lim:.3f} (unnatural text or a proxy)")
        check = generation_check(lp, top_logp, role, provenance, sampler_tol)
        if check is not None and check.checked and len(check.violations) > max_sampler_violation_frac * check.checked:
            reasons.append(f"{len(check.violations)} of {check.checked} generated tokens are outside the "
                           f"recorded sampler's support (first rows {list(check.violations[:5])})")
    return GuardResult(ng, dl, ce, check, tuple(reasons))


__all__ = [
    "SPLITS", "PhraseIssue", "PhraseTuples", "surface_variants", "phrase_tuples", "phrases_to_tuples", "Event",
    "occurrences", "find_events", "prefix_rows", "DEFAULT_WINDOW", "content_ids", "system_spans",
    "window_hashes", "WindowHit", "WindowIndex", "Collateral", "find_collateral", "ChatStructure", "chat_structure",
    "SplitResult", "phrase_split_counts", "split_documents", "ngram_repeat_rate", "dup_line_rate", "SamplerCheck",
    "sampler_violations", "claims_generation", "generation_check",
    "GuardResult", "GuardLimits", "provenance_reasons", "guard_document",
]
