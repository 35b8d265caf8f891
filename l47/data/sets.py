"""`l47 sets`: events, splits, collateral, chat coverage and refusals for an experiment file (DESIGN §3.2, §4).

For every listed dump (each scored once with the exact tail forward): prefix-exact events of the banned phrases with the base p(final token) from the exact
tail forward (`score_dump`), non-events (p < thresholds.non_event_p) apart, in-context copies flagged;
collateral occurrences of each final word (never after a banned prefix); chat structure; and — for training
candidates (train, dev, the split pool) — the provenance and naturalness guards. Pool documents are then split
by document (seeded). The report is what `l47 solve` (train/dev events, collateral_anchor) and `l47 audit`
(held-out events, collateral_eval, chat sets) consume, as JSON.

Notation for array shapes: T positions of a document (row t predicts tokens[t+1]); k top-k of the head pass.
Precision: log p and CE come from the tail forward in f32 with f64 vocabulary reductions (l47.tail.forward); the
report stores p = exp(log p) as f64.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from l47.data.coverage import KeyGrams, coverage_warnings
from l47.data.experiment import KLD, SCORED_SETS, SETS, SOLVER_SETS, SPLIT_SETS, Experiment, load_experiment
from l47.data.ledger import dump_content_hashes
from l47.dumps import doc_hash, read_dump
from l47.dumps.schema import PROV_GENERATED
from l47.dumps.select import (
    GuardLimits, PhraseTuples, WindowIndex, chat_structure, claims_generation, content_ids, find_collateral,
    find_events, guard_document, phrases_to_tuples, provenance_reasons, split_documents, system_spans,
)
from l47.errors import L47Error
from l47.fileio import write_text_atomic
from l47.model import names
from l47.model.vocab import resolve_vocab
from l47.model.weights import TailWeights, check_dump_dims, load_tail_weights
from l47.tail.forward import score_dump

SCHEMA = "l47.sets/1"
POOL = "pool"
EVENT_SETS = SPLIT_SETS + ("chat_heldout", "blind")  # sets where a zero event count is worth a warning
GUARDED = SPLIT_SETS[:2] + (POOL,)  # training candidates: provenance and naturalness guards
CHAT_REQUIRED = ("chat_heldout", "blind")  # need turns, a <think> block and terminal positions
SAMPLER_TOPK = 64  # top-k of the base pass used by the sampler-consistency guard




def sampler_wider(provenance) -> str | None:
    """Why a document's declared sampler is wider than the toolkit's own generation settings, or None. The
    toolkit samples (`l47 dump --generate`, l47.engine.hf) with a top-k and a top-p cut, and the own-generation
    check (l47.dumps.select.sampler_violations, SAMPLER_TOPK columns) bounds a support only through such a cut: a
    top-k ≤ SAMPLER_TOPK, a top-p < 1 at temperature ≤ 1, or greedy decoding. A min-p alone (1e-30 admits every
    token) or no cut at all proves nothing about where the text came from. None also when no sampler is declared
    (the provenance check names that)."""
    from collections.abc import Mapping

    g = dict(provenance or {}).get("generation")
    smp = g.get("sampler") if isinstance(g, Mapping) else None
    if not isinstance(smp, Mapping):
        return None
    try:
        temp = float(smp.get("temperature", 1.0))
        top_k = int(smp.get("top_k") or 0)
        top_p = float(1.0 if smp.get("top_p") is None else smp.get("top_p"))
    except (TypeError, ValueError):
        return f"declared sampler {dict(smp)!r:.120} is not numbers"
    if temp <= 0 or 1 <= top_k <= SAMPLER_TOPK or (0 < top_p < 1 and temp <= 1):
        return None
    shown = {k: smp.get(k) for k in ("temperature", "top_k", "top_p", "min_p") if k in smp}
    return (f"declared sampler {shown} has no top-k <= {SAMPLER_TOPK} and no top-p < 1 at temperature <= 1: wider "
            "than the toolkit's own generation settings (a top-k / top-p cut), so its support cannot be bounded")


# ----------------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class EventRecord:
    set: str
    doc: str
    doc_sha256: str
    pos: int  # row t: target tokens[t+1] is the final token
    phrase: str
    tuple: tuple[int, ...]
    final: int
    p_base: float  # base p(final token) at row t (exact tail forward)
    role: str  # role of the target
    in_context_copy: bool  # the phrase already occurred earlier in the same document
    generated: bool = False  # the target's role is `generated` in the document's provenance


@dataclass(frozen=True)
class CollateralRecord:
    set: str
    doc: str
    doc_sha256: str
    pos: int
    word: str
    token_id: int
    p_base: float
    role: str


@dataclass(frozen=True)
class Coverage:
    docs: int = 0
    positions: int = 0
    final_word_targets: int = 0  # targets equal to a banned tuple's final token or a collateral word
    collateral: int = 0  # of which ordinary (not after a banned prefix)
    special_targets: int = 0
    turns: int = 0
    think_blocks: int = 0
    terminal: int = 0  # real turn ends (target <|im_end|>)
    openers: int = 0  # user-turn openers

    def __add__(self, o: "Coverage") -> "Coverage":
        return Coverage(**{f.name: getattr(self, f.name) + getattr(o, f.name) for f in fields(self)})


@dataclass(frozen=True)
class DocReport:
    set: str
    path: str
    sha256: str
    doc_id: str
    T: int
    verified: bool  # the dump carries the engine's own log p (zero-proxy check possible)
    ce: float | None  # base CE over content targets, nats (None: refused before scoring)
    events: int
    non_events: int
    copies: int  # events flagged in-context copy
    coverage: Coverage
    ngram_repeat: float | None = None
    dup_lines: float | None = None
    sampler_checked: int | None = None
    sampler_violations: int | None = None
    refused: bool = False
    reasons: tuple[str, ...] = ()
    content_key: str = ""  # = sha256 (kept for readers of older reports)
    file_sha256: str = ""  # sha256 of the file bytes: provenance only (a re-saved copy has another)


@dataclass(frozen=True)
class Overlap:
    """Two documents of the experiment that are one document by content: the same token ids (`exact`), or a
    scored document sharing `window` consecutive content tokens with a training document (`window`)."""

    doc_sha256: str
    set: str
    path: str
    with_sha256: str
    with_set: str
    with_path: str
    kind: str  # "exact" | "window"
    window: int = 0  # content tokens shared (kind "window")
    at: int = -1  # index of the shared window in the document's content tokens
    with_at: int = -1  # ... in the other document's




@dataclass(frozen=True)
class SetsReport:
    schema: str
    experiment: str
    name: str
    model: str
    model_sha256: str
    vocab: str
    thresholds: dict
    phrases: tuple[PhraseTuples, ...]  # the phrases' id tuples (JSON: {phrase, margin_scale, tuples, variants})
    phrase_issues: tuple[dict, ...]  # {phrase, variant, ids, reason}
    collateral_words: dict[str, int]
    special_ids: dict[str, int]
    docs: tuple[DocReport, ...]
    events: tuple[EventRecord, ...]  # base p ≥ non_event_p, accepted documents, every set
    non_events: tuple[EventRecord, ...]
    collateral: tuple[CollateralRecord, ...]
    split: dict | None  # {seed, fractions, assignment: {path: split}, heldout_frac}
    warnings: tuple[str, ...]
    overlaps: tuple[Overlap, ...] = ()  # documents that are one document by content (see Overlap)
    stamps: tuple[str, ...] = ()  # facts the reader must see first (l47.data.identity.other_model_stamp)
    # what it was made from (experiment_content): phrases, words, thresholds, set membership by token sha256;
    # `l47 plan` / `l47 solve --sets` refuse a report whose content is not the experiment's at hand
    content: dict | None = None
    content_sha256: str = ""
    blind_events: dict | None = None  # blind set, by tokens only (never scored here): blind_event_counts

    # --- views
    def set_names(self) -> list[str]:
        present = {d.set for d in self.docs}
        order = list(SETS) + sorted(s for s in present if s.startswith(KLD + ".")) + [POOL]
        return [s for s in order if s in present]

    def counts(self, what: str = "events") -> dict[str, dict[str, int]]:
        """phrase → set → count of `events` / `non_events` / `copies` (in-context copies among events)."""
        out = {p.phrase: {} for p in self.phrases}
        src = self.non_events if what == "non_events" else self.events
        for e in src:
            if what == "copies" and not e.in_context_copy:
                continue
            c = out.setdefault(e.phrase, {})
            c[e.set] = c.get(e.set, 0) + 1
        if what == "events" and self.blind_events:  # the blind set's, by its tokens (blind_event_counts)
            for ph, n in self.blind_events["per_phrase"].items():
                out.setdefault(ph, {})["blind"] = n
        return out

    def collateral_counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {w: {} for w in self.collateral_words}
        for c in self.collateral:
            d = out.setdefault(c.word, {})
            d[c.set] = d.get(c.set, 0) + 1
        return out

    def coverage(self) -> dict[str, Coverage]:
        out: dict[str, Coverage] = {}
        for d in self.docs:
            if not d.refused:
                out[d.set] = out.get(d.set, Coverage()) + d.coverage
        return out

    def solver_events(self) -> tuple[EventRecord, ...]:
        """Events the solver may train on / tune with: train and dev only."""
        return tuple(e for e in self.events if e.set in SPLIT_SETS[:2])

    def heldout_events(self) -> tuple[EventRecord, ...]:
        return tuple(e for e in self.events if e.set == "heldout")

    # --- serialisation
    def to_dict(self) -> dict:
        return {**asdict(self), "phrases": [phrase_to_json(p) for p in self.phrases]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1, allow_nan=False)

    @staticmethod
    def from_dict(d: dict) -> "SetsReport":
        if d.get("schema") != SCHEMA:
            raise L47Error("sets report", "schema", SCHEMA, repr(d.get("schema")))
        ev = lambda x: EventRecord(**{**x, "tuple": tuple(x["tuple"])})  # noqa: E731
        docs = tuple(DocReport(**{**x, "coverage": Coverage(**x["coverage"]), "reasons": tuple(x["reasons"])})
                     for x in d["docs"])
        return SetsReport(**{
            **d, "phrases": tuple(phrase_from_json(p) for p in d["phrases"]), "phrase_issues": tuple(d["phrase_issues"]), "docs": docs,
            "events": tuple(ev(x) for x in d["events"]), "non_events": tuple(ev(x) for x in d["non_events"]),
            "collateral": tuple(CollateralRecord(**x) for x in d["collateral"]), "warnings": tuple(d["warnings"]),
            "overlaps": tuple(Overlap(**x) for x in d.get("overlaps", ())), "stamps": tuple(d.get("stamps", ())),
        })


# ----------------------------------------------------------------------------------------------------------
# the experiment's content: what every hand-off (sets report, solve record, dev report) was made from

CONTENT_SCHEMA = "l47.experiment-content/1"
HANDOFF_SETS = "sets"  # views of the content a hand-off must match: every part (a sets report, a dev report) ...
HANDOFF_SOLVE = "solve"  # ... or what a solve reads (its record): scored sets may grow or shrink after a solve
_SOLVE_KEYS = ("phrases", "collateral_words", "vocab", "policy", "split")


def document_identities(paths) -> dict[str, str]:
    """path -> the document's identity: the sha256 of its token ids (the header and tokens only are read, never
    scored); a file that cannot be read as a dump is named by its bytes instead ("unreadable <sha256>")."""
    out = {}
    for p in paths:
        try:
            out[str(p)] = read_dump(p, validate=False).sha256
        except (L47Error, ValueError, KeyError, TypeError):
            try:
                out[str(p)] = f"unreadable {doc_hash(p)}"
            except OSError:
                out[str(p)] = "missing"
        except OSError:
            out[str(p)] = "missing"
    return out


def experiment_content(exp: Experiment, ids: dict[str, str] | None = None) -> dict:
    """The experiment's parsed content, canonical: phrases (text, margin scale), collateral words, every
    threshold, vocabulary source and weight policy, and each set's documents as the sorted sha256 of their token
    ids (a split's pool likewise, with its seed and fractions). Not in it: file names and bytes, the name, the
    solver table, and the blind set (blind documents are never an input of a solve or a dev audit; they are
    added when the sign-off comes). `ids`: path -> identity (document_identities of the listed paths)."""
    listed = [p for s, p in exp.documents() if s != "blind"]
    ids = ids if ids is not None else document_identities(listed)
    sets = {s: sorted(ids[str(p)] for p in ps) for s, ps in sorted(exp.sets.items()) if s != "blind"}
    split = None if exp.split is None else {
        "seed": exp.split.seed, "fractions": dict(sorted(exp.split.fractions.items())),
        "pool": sorted(ids[str(p)] for p in exp.split.pool)}
    return {"schema": CONTENT_SCHEMA, "phrases": sorted([p.text, p.margin_scale] for p in exp.phrases),
            "collateral_words": sorted(exp.collateral_words), "thresholds": exp.thresholds.to_dict(),
            "vocab": exp.vocab, "policy": exp.policy, "sets": sets, "split": split}


def content_view(content: dict, view: str = HANDOFF_SETS) -> dict:
    """The part of `content` a hand-off of kind `view` must match: everything (HANDOFF_SETS), or what a solve
    reads (HANDOFF_SOLVE: phrases, words, vocabulary, policy, the solver's sets and the split). The thresholds
    are not in the solve's view: an audit judges with its own, and one moved the way that proves less is stamped
    "weakened" (l47.evals.bars.weakened)."""
    if view == HANDOFF_SETS:
        return content
    return {**{k: content.get(k) for k in _SOLVE_KEYS},
            "sets": {s: v for s, v in (content.get("sets") or {}).items() if s in SOLVER_SETS}}


def canonical_sha256(obj) -> str:
    """sha256 of obj's canonical JSON (sorted keys, no spaces, UTF-8): the one hash of every hand-off's content."""
    import hashlib

    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_sha256(content: dict, view: str = HANDOFF_SETS) -> str:
    """sha256 of the canonical JSON of the view (canonical_sha256)."""
    return canonical_sha256(content_view(content, view))


def content_changes(old: dict, new: dict, view: str = HANDOFF_SETS) -> list[str]:
    """What changed from `old` to `new` (both experiment_content), in words: "phrase removed: 'x'", "document
    added to set heldout (sha256 ab12…)", "threshold non_event_p: 0.01 -> 0.001", ..."""
    a, b = content_view(old, view), content_view(new, view)
    out: list[str] = []
    pa, pb = dict(map(tuple, a.get("phrases") or [])), dict(map(tuple, b.get("phrases") or []))
    out += [f"phrase removed: {t!r}" for t in pa if t not in pb] + [f"phrase added: {t!r}" for t in pb if t not in pa]
    out += [f"phrase {t!r}: margin_scale {pa[t]:g} -> {pb[t]:g}" for t in pa if t in pb and pa[t] != pb[t]]
    wa, wb = a.get("collateral_words") or [], b.get("collateral_words") or []
    out += [f"collateral word removed: {x!r}" for x in wa if x not in wb]
    out += [f"collateral word added: {x!r}" for x in wb if x not in wa]
    ta, tb = a.get("thresholds") or {}, b.get("thresholds") or {}
    out += [f"threshold {k}: {ta.get(k)} -> {tb.get(k)}" for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)]
    out += [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in ("vocab", "policy") if a.get(k) != b.get(k)]
    sa, sb = a.get("sets") or {}, b.get("sets") or {}
    for s in sorted(set(sa) | set(sb)):
        da, db = sa.get(s, []), sb.get(s, [])
        out += [f"document removed from set {s} ({_doc_id_text(x)})" for x in da if x not in db]
        out += [f"document added to set {s} ({_doc_id_text(x)})" for x in db if x not in da]
    xa, xb = a.get("split") or {}, b.get("split") or {}
    for k in ("seed", "fractions"):
        if xa.get(k) != xb.get(k):
            out.append(f"split {k}: {xa.get(k)} -> {xb.get(k)}")
    pa_, pb_ = xa.get("pool") or [], xb.get("pool") or []
    out += [f"document removed from the split pool ({_doc_id_text(x)})" for x in pa_ if x not in pb_]
    out += [f"document added to the split pool ({_doc_id_text(x)})" for x in pb_ if x not in pa_]
    return out or ["the content differs (schema)"]


def _doc_id_text(x: str) -> str:
    """A document identity (document_identities) shortened for a message."""
    kind, _, h = x.rpartition(" ")
    return f"{kind + ' file, bytes ' if kind else ''}sha256 {h[:12]}…" if h else x


def check_handoff(path, what: str, stored: dict | None, stored_sha: str, at_hand: dict, exp_path,
                  view: str = HANDOFF_SETS) -> None:
    """Refuse a hand-off (`what`: "sets report", "solve record", "dev report" at `path`) whose experiment content
    is not the one at hand (view `view`), in one line naming both hashes and what changed. A hand-off that names
    no content, or whose content does not hash to the hash it names (edited by hand), is refused too."""
    fixed = {HANDOFF_SETS: "l47 sets --json", HANDOFF_SOLVE: "l47 solve"}.get(view, "")
    if not isinstance(stored, dict) or not stored_sha:
        raise L47Error(path, f"{what} experiment content", "the content hash of the experiment it was made from "
                       f"(written by this l47: re-run {'the dev audit' if what == 'dev report' else fixed})",
                       "none (written before hand-offs were stamped)")
    if content_sha256(stored, HANDOFF_SETS) != stored_sha:
        raise L47Error(path, f"{what} experiment content", f"content hashing to its content_sha256 "
                       f"{stored_sha[:16]}…", f"{content_sha256(stored)[:16]}… (edited after it was written)")
    mine, theirs = content_sha256(at_hand, view), content_sha256(stored, view)
    if mine != theirs:
        ch = content_changes(stored, at_hand, view)
        more = f" (+{len(ch) - 3} more)" if len(ch) > 3 else ""
        raise L47Error(path, f"{what} experiment content", f"{mine[:16]}… (the experiment at hand, {exp_path})",
                       f"{theirs[:16]}… (made from other inputs: " + "; ".join(ch[:3]) + more + ")")


def check_sets_report(report: SetsReport, exp: Experiment, path) -> None:
    """`l47 plan` / `l47 solve --sets`: refuse (check_handoff) a sets report not made from this experiment's
    content — another experiment's, or this one's before a phrase, a threshold or a document changed."""
    check_handoff(path, "sets report", report.content, report.content_sha256, experiment_content(exp), exp.path)


def phrase_to_json(p: PhraseTuples) -> dict:
    """A phrase's id tuples at the JSON boundary: {phrase, margin_scale, tuples, variants}."""
    return {"phrase": p.phrase, "margin_scale": p.margin_scale, "tuples": [list(t) for t in p.tuples],
            "variants": list(p.variants)}


def phrase_from_json(d: dict) -> PhraseTuples:
    """The one PhraseTuples builder from a sets report's JSON phrase (phrase_to_json's inverse)."""
    return PhraseTuples(d["phrase"], tuple(tuple(int(i) for i in t) for t in d["tuples"]), tuple(d["variants"]),
                        float(d.get("margin_scale", 1.0)))


def load_sets_report(path) -> SetsReport:
    path = Path(path)
    try:
        return SetsReport.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise L47Error(path, "sets report", f"a JSON file written by `l47 sets` ({SCHEMA})", str(e)) from None


def write_sets_json(report: SetsReport, path) -> Path:
    """Atomic write (l47.fileio)."""
    return write_text_atomic(path, report.to_json())


# ----------------------------------------------------------------------------------------------------------
# one document


@dataclass
class _Doc:
    set: str
    path: Path
    sha: str = ""
    report: DocReport | None = None
    events: list = field(default_factory=list)  # (Event, p)
    collateral: list = field(default_factory=list)  # (Collateral, p)
    generated_roles: frozenset = frozenset()  # role codes whose provenance is "generated"
    file_sha: str = ""  # sha256 of the file bytes (provenance only)
    content_key: str = ""  # sha256 of the token ids = sha (the document's identity)
    content: np.ndarray | None = None  # [C] content token ids for the near-duplicate windows
    systems: tuple = ()  # system-role spans (id tuples)
    ids_roles: tuple | None = None  # (tokens [T+1], role [T]) kept for content_of
    blind_counts: tuple | None = None  # blind set: (events, occurrences) per phrase (blind_event_counts)

    def content_of(self, exclude) -> np.ndarray:
        return content_ids(*self.ids_roles, exclude=exclude)


def _refuse(d: _Doc, reason: str) -> None:
    """Refuse an already processed document (its events and collateral no longer count)."""
    d.report = replace(d.report, refused=True, reasons=d.report.reasons + (reason,))


def is_scored_set(name: str) -> bool:
    """Sets the audit scores as evidence (never shown to the solver)."""
    return name in SCORED_SETS or name.startswith(KLD + ".")


def _refused(d: _Doc, reason: str, doc_id: str = "", T: int = 0) -> _Doc:
    d.report = DocReport(d.set, str(d.path), d.sha, doc_id, T, False, None, 0, 0, 0, Coverage(), refused=True,
                         reasons=(reason,), content_key=d.sha, file_sha256=d.file_sha)
    return d


@dataclass(frozen=True)
class _Ctx:
    """What every document's processing reads: the model, its vocabulary, the thresholds, the phrases' id tuples,
    the collateral words (word -> id), the final-word ids and the base head pass (base_stats(dump, k))."""

    weights: object
    vocab: object
    thresholds: object
    phrases: list
    words: dict
    final_ids: np.ndarray  # [F] int64
    base_stats: Callable
    grams: KeyGrams = field(default_factory=KeyGrams)  # per set Σ hh hhᵀ: the background's coverage (coverage.py)


def _read(path: Path):
    """One document's file, read once: the dump fully validated (read_dump) and both its hashes (token ids:
    identity; file bytes: provenance) computed. -> Dump, or the L47Error that refuses it."""
    try:
        dump = read_dump(path)
    except L47Error as e:
        return e
    _ = dump.sha256, dump.file_sha256  # cached on the record: hashed here, on the reading thread
    return dump


def _read_ahead(paths: list, depth: int = 2):
    """`_read` of every path, in order, by one worker thread that stays up to `depth` documents ahead of the
    caller (hashing and validation release the GIL: the reads overlap the head passes and the guards)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="l47-read") as ex:
        pending = deque(ex.submit(_read, p) for p in paths[:depth])
        for i in range(len(paths)):
            got = pending.popleft().result()
            if i + depth < len(paths):
                pending.append(ex.submit(_read, paths[i + depth]))
            yield got


def _process(d: _Doc, dump, ctx: _Ctx) -> _Doc:
    """One document (`dump`: `_read`'s result): identity (its token ids), check it fits the model, score it once
    with the base head (never a blind one), find its events and collateral, guard it (provenance, salad, CE,
    sampler, chat structure) and report it."""
    w, vocab = ctx.weights, ctx.vocab
    if isinstance(dump, L47Error):
        return _refused(d, f"unreadable dump: {dump}")
    _identify(d, dump)
    try:
        check_dump_dims(w, dump.meta, str(d.path))
    except L47Error as e:
        return _refused(d, str(e), dump.meta.doc_id, dump.T)
    tokens = np.asarray(dump.tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(dump.role)  # [T]
    bad = tokens[(tokens < 0) | (tokens >= vocab.size)]
    if bad.size:
        return _refused(d, f"token id {int(bad[0])} outside the vocabulary ({vocab.size} ids)", dump.meta.doc_id,
                        dump.T)
    events = find_events(tokens, ctx.phrases, role)
    collat = find_collateral(tokens, ctx.words, ctx.phrases, role)
    # every readable document is scored once: base p at events / collateral, and CE (the not-a-proxy figure) —
    # except a blind document, which only `l47 audit --blind` may score, once (its structure is still checked)
    if d.set == "blind":
        stats, logp = None, np.full(dump.T, np.nan)  # [T]
        d.events, d.collateral = [], []
        d.blind_counts = blind_event_counts(tokens, role, ctx.phrases, dump.ref_logp, ctx.thresholds.non_event_p)
    else:
        own = d.set in GUARDED or claims_generation(dump.meta.provenance)  # the sampler check needs a top-k
        stats = ctx.base_stats(dump, min(SAMPLER_TOPK, w.V) if own else 1)
        logp = stats.logp_target  # [T] f64
        d.events = [(e, float(math.exp(logp[e.pos]))) for e in events]
        d.collateral = [(c, float(math.exp(logp[c.pos]))) for c in collat]
    reasons, guard, chat = _guard(d, dump, tokens, role, stats, ctx)
    d.report = _doc_report(d, dump, logp if stats is not None else None, chat, guard, reasons, len(collat), ctx)
    if d.set != "blind" and not d.report.refused:  # its keys: what the background shows against what is scored
        ctx.grams.add(d.set, dump.hh, w.device)
    return d


def _identify(d: _Doc, dump) -> None:
    """The document's identity (the sha256 of its token ids), its content targets and generated roles."""
    d.sha = dump.sha256  # content hash of the token ids (l47.dumps.content_hash): the document's identity
    d.content_key = d.sha
    d.file_sha = dump.file_sha256
    # copies (int64 ids, uint8 roles): a view would keep the whole file mapped — and every page validation
    # touched resident — for as long as the report is built (+12 GiB at 200 real-size documents)
    d.ids_roles = (np.array(dump.tokens, dtype=np.int64), np.array(dump.role))
    d.systems = tuple(system_spans(*d.ids_roles))
    d.content = d.content_of(())  # [C] the targets that are not chat markup
    d.generated_roles = frozenset(names.ROLE_ID[r] for r, v in (dump.meta.provenance or {}).items()
                                  if r in names.ROLE_ID and v == PROV_GENERATED)


def _guard(d: _Doc, dump, tokens, role, stats, ctx: _Ctx):
    """Reasons to refuse the document: provenance and the natural-text guards (sets the solver or the audit's
    natural-text bars read), and the chat structure a chat set needs. -> (reasons, guard result, chat)."""
    w, vocab, th = ctx.weights, ctx.vocab, ctx.thresholds
    meta = dump.meta
    chat = chat_structure(tokens, role, vocab.special_ids)
    reasons: list[str] = []
    guard = None
    if d.set in GUARDED:
        present = sorted({names.ROLES[int(r)] for r in np.unique(role)})
        reasons += provenance_reasons(meta.provenance, present, w.model_sha256, meta.model)
        content = tokens[1:][role != names.ROLE_ID["template"]]  # [T'] the document's words, no chat markup
        limits = GuardLimits(ngram_n=th.salad_ngram, max_ngram_repeat=th.salad_max_ngram_repeat,
                             max_dup_lines=th.salad_max_dup_lines, ce_proxy_frac=th.ce_proxy_frac,
                             max_sampler_violation_frac=th.sampler_max_violation_frac, sampler_tol=th.sampler_tol)
        guard = guard_document(vocab.decode(content.tolist()), logp_target=stats.logp_target,
                               top_logp=stats.top_logp, role=role, provenance=meta.provenance, vocab_size=w.V,
                               limits=limits)
        reasons += list(guard.reasons)
    if d.set in CHAT_REQUIRED:
        lacks = [n for n, v in (("turns", chat.n_turns), ("<think> block", chat.n_think),
                                ("terminal positions", chat.n_terminal)) if not v]
        if lacks:
            reasons.append(f"a {d.set} document must be a chat with turns, a <think> block and terminal "
                           f"positions; it has no {', no '.join(lacks)}")
    return reasons, guard, chat


def _doc_report(d: _Doc, dump, logp, chat, guard, reasons, n_collateral: int, ctx: _Ctx) -> DocReport:
    """The document's line of the sets report: CE over content targets (f64 mean), events and non-events,
    in-context copies, coverage, guard figures."""
    tokens = np.asarray(dump.tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(dump.role)  # [T]
    thr = ctx.thresholds.non_event_p
    T = dump.T
    n_ev = sum(1 for _, q in d.events if q >= thr)
    content_mask = role != names.ROLE_ID["template"]
    ce = None
    if T and logp is not None:
        m = content_mask if content_mask.any() else np.ones(T, dtype=bool)
        ce = float(-logp[m].mean())  # f64 mean over content targets
    cov = Coverage(
        docs=1, positions=T, final_word_targets=int(np.isin(tokens[1:], ctx.final_ids).sum()),
        collateral=n_collateral, special_targets=int(chat.special_target.sum()), turns=chat.n_turns,
        think_blocks=chat.n_think, terminal=chat.n_terminal, openers=int(chat.opener.sum()),
    )
    sampler = None if guard is None else guard.sampler
    return DocReport(
        set=d.set, path=str(d.path), sha256=d.sha, doc_id=dump.meta.doc_id, T=T, verified=dump.verified, ce=ce,
        events=n_ev, non_events=len(d.events) - n_ev,
        copies=sum(1 for e, q in d.events if q >= thr and e.in_context_copy), coverage=cov,
        ngram_repeat=None if guard is None else guard.ngram_repeat,
        dup_lines=None if guard is None else guard.dup_lines,
        sampler_checked=None if sampler is None else sampler.checked,
        sampler_violations=None if sampler is None else len(sampler.violations),
        refused=bool(reasons), reasons=tuple(reasons), content_key=d.content_key, file_sha256=d.file_sha,
    )


# ----------------------------------------------------------------------------------------------------------
# the whole experiment


def _copies(docs: list) -> list:
    """A document (its token ids) belongs to one set only: copies are refused, the training-side one kept (an
    overlap the audit fails on, bar c.disjoint). Returns (refused copy, kept document, "exact", None) pairs."""
    pairs = []
    groups: dict[str, list[_Doc]] = {}
    for d in docs:
        if d.sha:
            groups.setdefault(d.sha, []).append(d)
    for g in groups.values():
        if len(g) < 2:
            continue
        keep = min(g, key=lambda d: (d.set not in SOLVER_SETS + (POOL,), d.report.refused))
        for o in g:
            if o is not keep:
                _refuse(o, f"the same document (tokens sha256 {o.sha[:12]}) as {keep.path} in set {keep.set}: a "
                        "document belongs to one set only")
                pairs.append((o, keep, "exact", None))
    return pairs


def _pool_groups(docs: list, nwin: int) -> dict[str, str]:
    """Accepted pool documents sharing an `nwin`-token content window, grouped (union-find): content hash ->
    its group's key, so near-duplicates land in one split. Common system prompts are already stripped."""
    pool = [d for d in docs if d.set == POOL and not d.report.refused]
    group = {d.sha: d.sha for d in pool}
    if not pool or nwin <= 0:
        return group

    def find(k):
        while group[k] != k:
            group[k] = group[group[k]]
            k = group[k]
        return k

    ix = WindowIndex(nwin)
    for d in pool:
        ix.add(d.sha, d.content)
    for d in pool:
        for k in ix.keys_sharing(d.content, skip=d.sha):
            a, b = find(d.sha), find(k)
            if a != b:
                group[max(a, b)] = min(a, b)
    return {k: find(k) for k in group}


def _window_overlaps(docs: list, nwin: int) -> list:
    """Scored documents sharing `nwin` consecutive content tokens with a training document (after the split):
    refused, returned as (document, training document, "window", WindowHit) pairs."""
    pairs = []
    if nwin <= 0:
        return pairs
    tix = WindowIndex(nwin)
    train = {d.sha: d for d in docs if d.set in SOLVER_SETS and not d.report.refused and d.content is not None}
    for d in train.values():
        tix.add(d.sha, d.content)
    for d in docs:
        if not is_scored_set(d.set) or d.report.refused or d.content is None:
            continue
        hit = tix.first_hit(d.content, skip=d.sha)
        if hit is not None:
            keep = train[hit.key]
            _refuse(d, f"shares {nwin} consecutive content tokens with training document {keep.path} (set "
                    f"{keep.set}): a near-duplicate, not held-out evidence")
            pairs.append((d, keep, "window", hit))
    return pairs


def _split_pool(docs: list, exp: Experiment, th, group: dict[str, str]) -> dict | None:
    """Seeded split of the pool's accepted documents into train / dev / heldout, in place (d.set); None without
    a [split] table. `group`: content hash -> group key (near-duplicates split together)."""
    # by document; key: hash of the token ids (of the group's first member when near-duplicates were grouped),
    # so file names and metadata such as the input path do not matter
    split_info = None
    thr = th.non_event_p
    if exp.split is not None:
        pool = [d for d in docs if d.set == POOL and not d.report.refused]
        counts: dict[str, dict[str, int]] = {}
        for d in pool:
            c = counts.setdefault(group.get(d.sha, d.sha), {})
            for e, q in d.events:
                if q >= thr:
                    c[e.phrase] = c.get(e.phrase, 0) + 1
        res = split_documents(counts, exp.split.seed, exp.split.fractions, th.heldout_frac,
                              th.min_heldout_per_phrase)
        for d in pool:
            d.set = res.assignment[group.get(d.sha, d.sha)]
            d.report = replace(d.report, set=d.set)
        split_info = {"seed": exp.split.seed, "fractions": dict(exp.split.fractions),
                      "assignment": {str(d.path): d.set for d in pool}, "heldout_frac": res.heldout_frac,
                      "groups": len(set(group.values()))}
    return split_info


def _records(docs: list, thr: float) -> tuple[list, list, list]:
    """(events, non-events, collateral) records of the accepted documents; an event has base p >= thr."""
    ev, nev, col = [], [], []
    for d in docs:
        if d.report.refused:
            continue
        for e, q in d.events:
            rec = EventRecord(d.set, str(d.path), d.sha, e.pos, e.phrase, tuple(e.tuple), e.final, q,
                              names.ROLES[e.role], e.in_context_copy, e.role in d.generated_roles)
            (ev if q >= thr else nev).append(rec)
        for c, q in d.collateral:
            col.append(CollateralRecord(d.set, str(d.path), d.sha, c.pos, c.word, c.token_id, q, names.ROLES[c.role]))
    return ev, nev, col


def blind_event_counts(tokens, role, phrases, ref_logp, non_event_p: float) -> tuple[dict, dict]:
    """A blind document's slop events per phrase WITHOUT scoring it (only `l47 audit --blind` may, once):
    prefix-exact occurrences of a banned tuple (tokens [T+1], role [T]), and of those the events — base p of
    the final token ≥ non_event_p by the engine's own log p recorded in the dump (ref_logp [T], the base model
    that generated it); without ref_logp every occurrence counts. -> ({phrase: events}, {phrase: occurrences})."""
    ev: dict[str, int] = {pt.phrase: 0 for pt in phrases if pt.tuples}
    occ = dict(ev)
    for e in find_events(np.asarray(tokens, dtype=np.int64), phrases, role):
        occ[e.phrase] = occ.get(e.phrase, 0) + 1
        if ref_logp is None or math.exp(float(ref_logp[e.pos])) >= non_event_p:
            ev[e.phrase] = ev.get(e.phrase, 0) + 1
    return ev, occ


def _blind_events(docs: list, exp: Experiment, thr: float) -> dict | None:
    """The blind set's events per phrase (blind_event_counts, summed over its readable documents); None when
    the experiment lists no blind set."""
    if "blind" not in exp.sets:
        return None
    got = [d.blind_counts for d in docs if d.set == "blind" and d.blind_counts is not None]
    per: dict[str, int] = {}
    occ: dict[str, int] = {}
    for e, o in got:
        for ph, n in e.items():
            per[ph] = per.get(ph, 0) + n
        for ph, n in o.items():
            occ[ph] = occ.get(ph, 0) + n
    return {"docs": len(got), "per_phrase": per, "occurrences": occ, "non_event_p": thr,
            "measured": "prefix-exact occurrences whose base p by the engine's recorded log p (ref_logp) is >= "
                        "non_event_p; never scored here"}


def _warnings(exp, th, issues, docs, ev, col, phrases, words, blind=None) -> list[str]:
    """What a user should know about the sets: unusable phrases, refused documents, empty sets, too few held-out
    events or collateral occurrences, a blind set with no slop event. Many parameters because every one is a
    different part of the report being built."""
    warnings: list[str] = []
    for i in issues:
        if i.reason.startswith("no multi-token variant"):
            warnings.append(f"phrase {i.phrase!r}: no multi-token variant, so it can have no events")
    refused = [d for d in docs if d.report.refused]
    if refused:
        warnings.append(f"{len(refused)} document(s) refused (see the refused table)")
    accepted: dict[str, int] = {}
    for d in docs:
        if not d.report.refused:
            accepted[d.set] = accepted.get(d.set, 0) + 1
    n_ev = {}
    for r in ev:
        n_ev[r.set] = n_ev.get(r.set, 0) + 1
    if blind is not None:  # never scored here: its events by tokens and the engine's recorded log p
        n_ev["blind"] = sum(blind["per_phrase"].values())
    for s in EVENT_SETS:
        listed = s in exp.sets or (exp.split is not None and s in SPLIT_SETS)
        if listed and s == "blind" and accepted.get(s, 0) and not n_ev.get(s):
            warnings.append(f"set 'blind': zero events in {accepted[s]} document(s) (by its tokens and the "
                            "engine's recorded log p): `l47 audit --blind` refuses a blind set without a slop event")
        elif listed and accepted.get(s, 0) == 0:
            warnings.append(f"set {s!r}: no accepted documents")
        elif listed and n_ev.get(s, 0) == 0:
            warnings.append(f"set {s!r}: zero events in {accepted[s]} document(s)")
    split_total = sum(n_ev.get(s, 0) for s in SPLIT_SETS)
    if split_total:
        frac = n_ev.get("heldout", 0) / split_total
        if frac < th.heldout_frac:
            warnings.append(f"only {frac:.1%} of events held out (< {th.heldout_frac:.0%}, by document)")
        per = {pt.phrase: 0 for pt in phrases if pt.tuples}
        for r in ev:
            if r.set == "heldout":
                per[r.phrase] = per.get(r.phrase, 0) + 1
        for ph, n in per.items():
            if n < th.min_heldout_per_phrase:
                warnings.append(f"phrase {ph!r}: {n} held-out events (< {th.min_heldout_per_phrase})")
    ceval = [c for c in col if c.set == "collateral_eval"]
    if len(ceval) < th.collateral_min_total:
        warnings.append(f"collateral_eval: {len(ceval)} collateral occurrences (< {th.collateral_min_total})")
    for wd in words:
        n = sum(1 for c in ceval if c.word == wd)
        if n < th.collateral_min_per_word:
            warnings.append(f"collateral_eval: word {wd!r} occurs {n} times (< {th.collateral_min_per_word})")
    return warnings


def _inputs(experiment, weights_or_model_path, vocab, device):
    """The experiment, the base model's tail weights and its vocabulary; refuses an experiment without a model or
    without phrases. -> (Experiment, TailWeights, Vocab)."""
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    src = weights_or_model_path if weights_or_model_path is not None else exp.model
    if src is None:
        raise L47Error(exp.path, "model", "a base GGUF (the experiment's `model` key or --model)", "none given")
    w = src if isinstance(src, TailWeights) else load_tail_weights(src, policy=exp.policy, device=device)
    vocab = vocab if vocab is not None else resolve_vocab(exp.vocab, w.path, w.V)
    if not exp.phrases:
        raise L47Error(exp.path, "phrases", "at least one [[phrases]] entry", "none")
    return exp, w, vocab


def _collateral_words(exp: Experiment, vocab, phrases) -> dict[str, int]:
    """word -> token id: the experiment's collateral words (each one token of the vocabulary), else the phrases'
    final tokens."""
    if not exp.collateral_words:
        return {vocab.decode([i]): i for i in sorted({t[-1] for pt in phrases for t in pt.tuples})}
    words = {}
    for wd in exp.collateral_words:
        try:
            words[wd] = vocab.id_of(wd)
        except L47Error as e:
            raise L47Error(exp.path, f"collateral.words {wd!r}", "a string that is one token of the model's "
                           "vocabulary (mind the leading space)", e.found) from None
    return words


def _score_documents(exp: Experiment, ctx: _Ctx, progress) -> list[_Doc]:
    """Every listed document processed (`_process`), in the experiment's order; the files are read ahead."""
    listed = list(exp.documents())
    docs = []
    for (s, path), dump in zip(listed, _read_ahead([p for _, p in listed])):
        if progress:
            progress(f"{s}: {path}")
        docs.append(_process(_Doc(s, path), dump, ctx))
    return docs


def _by_content(docs: list, exp: Experiment, th) -> tuple[dict | None, tuple]:
    """Identity by content: copies refused; near-duplicates (content windows, chat markup and system prompts
    common to several documents excluded) split together, and refused as evidence when they share a window
    with a training document. -> (split info, overlaps)."""
    pairs = _copies(docs)
    span_docs: dict[tuple, int] = {}
    for d in docs:
        for sp in set(d.systems):
            span_docs[sp] = span_docs.get(sp, 0) + 1
    common = {sp for sp, n in span_docs.items() if n >= 2}
    for d in docs:
        if d.ids_roles is not None and common:
            d.content = d.content_of(common)
    split_info = _split_pool(docs, exp, th, _pool_groups(docs, th.overlap_window))
    pairs += _window_overlaps(docs, th.overlap_window)
    overlaps = tuple(Overlap(o.sha, o.set, str(o.path), k.sha, k.set, str(k.path), kind,
                             hit.n if hit is not None else 0, hit.start if hit is not None else -1,
                             hit.start_indexed if hit is not None else -1) for o, k, kind, hit in pairs)
    return split_info, overlaps


def build_sets(experiment: Experiment | str | Path, weights_or_model_path=None, *, vocab=None, device="cpu",
               progress: Callable[[str], None] | None = None, base_stats=None, ledger=None,
               command: str = "sets") -> SetsReport:
    """Mine, score, guard and split every document of an experiment. See the module docstring.
    base_stats(dump, k) -> HeadStats (>= k top-k columns): the base head pass of a document; default one exact
    pass here (l47.tail.forward.score_dump). The audit passes its own, so each document is scored once.
    `ledger` (l47.data.ledger.Ledger): every document this scores (all but blind ones) is appended to it, by
    content, against the base model, before the first score is computed."""
    exp, w, vocab = _inputs(experiment, weights_or_model_path, vocab, device)
    th = exp.thresholds
    phrases, issues = phrases_to_tuples(exp.phrases, vocab)
    words = _collateral_words(exp, vocab, phrases)
    finals = {t[-1] for pt in phrases for t in pt.tuples}
    ctx = _Ctx(weights=w, vocab=vocab, thresholds=th, phrases=phrases, words=words,
               final_ids=np.array(sorted(finals | set(words.values())), dtype=np.int64),
               base_stats=base_stats or (lambda dump, k: score_dump(w, dump, topk=k)))
    if ledger is not None:
        ledger.append(dump_content_hashes(p for s, p in exp.documents() if s != "blind").values(), w.model_sha256,
                      command)
    docs = _score_documents(exp, ctx, progress)
    content = experiment_content(exp)
    blind = _blind_events(docs, exp, th.non_event_p)
    split_info, overlaps = _by_content(docs, exp, th)
    ev, nev, col = _records(docs, th.non_event_p)
    return SetsReport(
        schema=SCHEMA, experiment=str(exp.path), name=exp.name, model=w.path, model_sha256=w.model_sha256,
        vocab=vocab.name, thresholds=th.to_dict(),
        phrases=tuple(phrases),
        phrase_issues=tuple({"phrase": i.phrase, "variant": i.variant, "ids": list(i.ids), "reason": i.reason}
                            for i in issues),
        collateral_words=dict(words), special_ids=dict(vocab.special_ids), docs=tuple(d.report for d in docs),
        events=tuple(ev), non_events=tuple(nev), collateral=tuple(col), split=split_info,
        warnings=tuple(_warnings(exp, th, issues, docs, ev, col, phrases, words, blind)
                       + coverage_warnings(ctx.grams, [s for s in ctx.grams.C if is_scored_set(s)])),
        overlaps=overlaps,
        content=content, content_sha256=content_sha256(content), blind_events=blind,
    )
