"""The sampler penalty of seed §6.3: a prefix-conditioned logit bias, simulated exactly on dumps and exported.

Rule (the exported, exact form): at each sampling step, for every banned tuple u whose prefix u[:-1] equals the
last len(u) − 1 tokens of the context, subtract `bias` from the logit of u's final token. Nothing else changes.

The same function (`penalized_at`) decides which tokens are penalised in the simulation, in the JSON spec's
documented semantics and in the transformers `LogitsProcessor`, so what is simulated is what is exported.
Cheaper forms are offered only to measure what they cost (seed §6.3's engine shortcut is not prefix-exact for
multi-token prefixes):
    prefix-exact        the rule above
    last-prefix-token   penalise u's final when the previous token equals u's LAST prefix token
    previous-token      seed's shortcut: when the previous token is ANY prefix token of any tuple, penalise every
                        final token (the "6-token bias")
Their extra hits (positions × tokens penalised that the exact form leaves alone) are counted and scored.

Exact simulation from per-position statistics (no [T, V]): with S_t the penalised set at row t, p the model's
distribution (base, or the edited bundle for "stacked") and b the bias,
    Z'_t          = 1 − (1 − e^{−b}) Σ_{s∈S_t} p(s)
    log p'(x)     = log p(x) − b·[x ∈ S_t] − log Z'_t
    KL(p ‖ p')    = b Σ_{s∈S_t} p(s) + log Z'_t
    KL(p_base ‖ p'_new) = KL(p_base ‖ p_new) + b Σ_{s∈S_t} p_base(s) + log Z'_new,t
    argmax'       = argmax over the top-k of (log p − b·[id ∈ S_t]); exact when k > |S_t|
Only log p of the final tokens (a handful of ids) is needed. Precision: f64 (log1p for log Z').

Notation for array shapes:
    T   positions of a document (row t predicts tokens[t+1], context tokens[:t+1])
    F   distinct final tokens of the banned tuples      k   top-k kept by the head pass
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from l47.data.experiment import load_experiment
from l47.data.ledger import Ledger
from l47.data.sets import build_sets
from l47.dumps import read_dump
from l47.errors import L47Error
from l47.evals.metrics import FINALS as FINALS_KEY  # HeadStats.set_logp key of the penalised final tokens
from l47.evals.metrics import load_vocab
from l47.fileio import read_json, write_text_atomic
from l47.model.weights import check_dump_dims, edited_weight, load_tail_weights
from l47.tail.forward import score_dump, score_pair

PENALTY_SCHEMA = "l47.penalty/1"
FORM_EXACT = "prefix-exact"
FORM_LAST = "last-prefix-token"
FORM_SEED = "previous-token"
FORMS = (FORM_EXACT, FORM_LAST, FORM_SEED)
DEFAULT_BIAS = 5.0  # seed §6.3: "subtract a fixed bias (e.g. 4–6)"
SEMANTICS = ("At each sampling step, for every rule whose `prefix` equals the last len(prefix) tokens of the "
             "context (prompt and generated tokens alike), subtract `bias` from the logit of `token` before any "
             "other sampler stage. Rules never touch any other token or position.")
SEMANTICS_CHEAP = {
    FORM_LAST: "For every rule whose LAST prefix token equals the previous token, subtract `bias` from `token`.",
    FORM_SEED: "When the previous token is any token of any rule's prefix, subtract `bias` from every rule's `token`.",
}


@dataclass(frozen=True)
class PenaltyRule:
    phrase: str
    prefix: tuple[int, ...]
    token: int


@dataclass(frozen=True)
class PenaltySpec:
    bias: float
    rules: tuple[PenaltyRule, ...]
    form: str = FORM_EXACT
    model_sha256: str = ""
    vocab: str = ""

    @property
    def finals(self) -> tuple[int, ...]:
        return tuple(sorted({r.token for r in self.rules}))

    def to_json(self, decode=None) -> str:
        """The engine's input. `decode(ids) -> str` adds the text of each prefix and token (for people)."""
        rules = []
        for r in self.rules:
            d = {"phrase": r.phrase, "prefix": list(r.prefix), "token": r.token}
            if decode is not None:
                d["prefix_text"] = decode(list(r.prefix))
                d["token_text"] = decode([r.token])
            rules.append(d)
        doc = {"schema": PENALTY_SCHEMA, "form": self.form, "bias": self.bias, "model_sha256": self.model_sha256,
               "vocab": self.vocab, "semantics": SEMANTICS if self.form == FORM_EXACT else SEMANTICS_CHEAP[self.form],
               "rules": rules}
        return json.dumps(doc, indent=1, ensure_ascii=False)


def read_spec(path) -> PenaltySpec:
    path = Path(path)
    d = read_json(path, "penalty spec")
    if d.get("schema") != PENALTY_SCHEMA:
        raise L47Error(path, "schema", PENALTY_SCHEMA, repr(d.get("schema")))
    if d.get("form") not in FORMS:
        raise L47Error(path, "form", f"one of {FORMS}", repr(d.get("form")))
    try:
        rules = tuple(PenaltyRule(str(r["phrase"]), tuple(int(i) for i in r["prefix"]), int(r["token"]))
                      for r in d["rules"])
        return PenaltySpec(float(d["bias"]), rules, d["form"], str(d.get("model_sha256", "")), str(d.get("vocab", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise L47Error(path, "rules", "a list of {phrase, prefix: [ids], token: id} and a bias", str(e)) from None


def rules_from_tuples(phrase_tuples) -> tuple[PenaltyRule, ...]:
    """One rule per banned tuple (objects with .phrase and .tuples, e.g. l47.dumps.select.PhraseTuples)."""
    out = []
    for pt in phrase_tuples:
        for tup in pt.tuples:
            if len(tup) < 2:
                continue
            out.append(PenaltyRule(pt.phrase, tuple(int(i) for i in tup[:-1]), int(tup[-1])))
    return tuple(dict.fromkeys(out))


def make_spec(phrase_tuples, bias: float = DEFAULT_BIAS, form: str = FORM_EXACT, model_sha256: str = "",
              vocab: str = "") -> PenaltySpec:
    if form not in FORMS:
        raise L47Error("penalty", "form", f"one of {FORMS}", repr(form))
    if not (bias > 0 and math.isfinite(bias)):
        raise L47Error("penalty", "bias", "a positive finite number of logits", repr(bias))
    return PenaltySpec(float(bias), rules_from_tuples(phrase_tuples), form, model_sha256, vocab)


# ----------------------------------------------------------------------------------------------------------
# the one decision function


def penalized_at(history: Sequence[int], spec: PenaltySpec, form: str | None = None) -> tuple[int, ...]:
    """Token ids whose logit is lowered for the token that follows `history` (sorted, unique)."""
    form = form or spec.form
    if not len(history):
        return ()
    last = int(history[-1])
    if form == FORM_EXACT:
        n = len(history)
        hit = {r.token for r in spec.rules
               if len(r.prefix) <= n and all(int(history[n - len(r.prefix) + i]) == r.prefix[i]
                                             for i in range(len(r.prefix)))}
    elif form == FORM_LAST:
        hit = {r.token for r in spec.rules if r.prefix[-1] == last}
    elif form == FORM_SEED:
        hit = set(spec.finals) if any(last in r.prefix for r in spec.rules) else set()
    else:
        raise L47Error("penalty", "form", f"one of {FORMS}", repr(form))
    return tuple(sorted(hit))


def penalty_mask(tokens, spec: PenaltySpec, form: str | None = None) -> np.ndarray:
    """[T, F] bool: row t, column j = spec.finals[j] is penalised for the target tokens[t+1]. `penalized_at` decides
    every row; it is asked only where tokens[t] can end a rule's prefix (every form needs that: elsewhere its answer
    is empty), with the last (longest prefix) tokens of the history — all it reads (~100x fewer Python steps on
    a 1,000-token document than asking every row with the whole history)."""
    form = form or spec.form
    if form not in FORMS:
        raise L47Error("penalty", "form", f"one of {FORMS}", repr(form))
    tokens = [int(i) for i in np.asarray(tokens).tolist()]  # [T+1]
    finals = spec.finals
    col = {f: j for j, f in enumerate(finals)}
    T = len(tokens) - 1
    m = np.zeros((T, len(finals)), dtype=bool)  # [T, F]
    if not spec.rules:
        return m
    span = max(len(r.prefix) for r in spec.rules)
    ends = (None if any(not r.prefix for r in spec.rules) else  # an empty prefix matches everywhere: ask every row
            {x for r in spec.rules for x in r.prefix} if form == FORM_SEED else {r.prefix[-1] for r in spec.rules})
    for t in range(T):
        if ends is None or tokens[t] in ends:
            for tok in penalized_at(tokens[max(0, t + 1 - span):t + 1], spec, form):
                m[t, col[tok]] = True
    return m


# ----------------------------------------------------------------------------------------------------------
# exact simulation


@dataclass(frozen=True)
class Simulated:
    """A penalised model at every row of one document."""

    logp_target: np.ndarray  # [T] f64
    argmax: np.ndarray  # [T] int64
    kld_vs_base: np.ndarray  # [T] f64  KL(p_base ‖ penalised)
    logZ: np.ndarray  # [T] f64  log Z' (0 where nothing is penalised)
    set_logp: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [T, |S|] penalised log p of listed ids
    argmax_exact: bool = True  # k > |S_t| at every row


def simulate(stats, targets, mask: np.ndarray, finals: Sequence[int], bias: float, base=None, kld_base_stats=None,
             token_sets: dict | None = None) -> Simulated:
    """Apply the penalty exactly to one model's statistics (`penalise_document` is the usual entry).

    stats: HeadStats of the model the sampler sits on (base alone, or the edited model when stacked); it must
    carry set_logp[FINALS_KEY] [T, F] in the order of `finals`. targets [T]; mask [T, F] from `penalty_mask`.
    base / kld_base_stats: for the stacked case, the base HeadStats and KL(base ‖ edited) [T]; KL is then
    measured from the base. token_sets: name -> ids whose penalised log p is wanted (must be in stats.set_logp).
    """
    finals = np.asarray(finals, dtype=np.int64)  # [F]
    lpF = np.asarray(stats.set_logp[FINALS_KEY], dtype=np.float64)  # [T, F]
    m = np.asarray(mask, dtype=bool)  # [T, F]
    T = lpF.shape[0]
    targets = np.asarray(targets, dtype=np.int64)  # [T]
    b = float(bias)
    pS = (np.exp(lpF) * m).sum(1)  # [T] f64 mass of the penalised tokens
    logZ = np.log1p(-(1.0 - math.exp(-b)) * pS)  # [T]
    tgt_pen = (m & (finals[None, :] == targets[:, None])).any(1)  # [T]
    lp = np.asarray(stats.logp_target, dtype=np.float64) - b * tgt_pen - logZ  # [T]
    # argmax over the top-k after the bias
    pen_ids = [set(finals[m[t]].tolist()) for t in range(T)]
    top_ids = np.asarray(stats.top_ids)  # [T, k]
    adj = np.asarray(stats.top_logp, dtype=np.float64).copy()  # [T, k]
    for t in range(T):
        if pen_ids[t]:
            adj[t] -= b * np.isin(top_ids[t], list(pen_ids[t]))
    am = top_ids[np.arange(T), adj.argmax(1)]  # [T]
    exact = bool(all(top_ids.shape[1] > len(s) for s in pen_ids))
    if base is None:
        kl = b * pS + logZ  # [T] KL(p ‖ p')
    else:
        pSb = (np.exp(np.asarray(base.set_logp[FINALS_KEY], dtype=np.float64)) * m).sum(1)  # [T]
        kl = np.asarray(kld_base_stats, dtype=np.float64) + b * pSb + logZ
    sets = {}
    for name, ids in (token_sets or {}).items():
        ids = np.asarray(list(ids), dtype=np.int64)  # [S]
        pen = np.zeros((T, ids.shape[0]), dtype=bool)
        for j, f in enumerate(finals.tolist()):
            pen |= m[:, j:j + 1] & (ids[None, :] == f)
        sets[name] = np.asarray(stats.set_logp[name], dtype=np.float64) - b * pen - logZ[:, None]
    return Simulated(lp, am.astype(np.int64), np.maximum(kl, 0.0), logZ, sets, exact)


@dataclass(frozen=True)
class ExtraHits:
    """What a cheaper form penalises beyond the exact one."""

    form: str
    positions: int  # rows with at least one extra penalised token
    pairs: int  # (row, token) pairs penalised by the cheap form only
    target_hit: int  # rows where the extra-penalised token is the actual target (a legitimate use suppressed)
    examples: tuple[tuple[int, int], ...]  # first (row, token) pairs


def extra_hits(tokens, spec: PenaltySpec, form: str, exact_mask: np.ndarray | None = None,
               max_examples: int = 10) -> tuple[ExtraHits, np.ndarray]:
    """Extra hits of `form` over the exact form in one document, and the cheap form's mask [T, F]."""
    ex = penalty_mask(tokens, spec, FORM_EXACT) if exact_mask is None else exact_mask
    ch = penalty_mask(tokens, spec, form)
    extra = ch & ~ex  # [T, F]
    finals = np.asarray(spec.finals, dtype=np.int64)
    tg = np.asarray(tokens, dtype=np.int64)[1:]
    rows, cols = np.nonzero(extra)
    hit_target = int((extra & (finals[None, :] == tg[:, None])).any(1).sum())
    ex_list = tuple((int(r), int(finals[c])) for r, c in list(zip(rows, cols))[:max_examples])
    return ExtraHits(form, int(extra.any(1).sum()), int(extra.sum()), hit_target, ex_list), ch


@dataclass(frozen=True)
class DocPenalty:
    """The penalty simulated on one document: alone (on the base), stacked (on a bundle), and the cheap forms'
    extra hits."""

    mask: np.ndarray  # [T, F] penalised (row, final token) pairs of the spec's form
    alone: "Simulated"  # base + penalty
    stacked: "Simulated | None"  # bundle + penalty (None without a bundle)
    unchanged: np.ndarray  # [T] bool: rows where nothing is penalised
    extra: dict  # cheap form -> (ExtraHits, its mask [T, F])


def penalise_document(spec: PenaltySpec, tokens, base_stats, paired=None, form: str | None = None) -> DocPenalty:
    """The one simulation driver behind `l47 penalty` and the audit: the penalty of `spec` (in `form`, default
    the spec's) on one document's base statistics, stacked on `paired.new` when a PairedStats is given."""
    form = form or spec.form
    finals = list(spec.finals)
    tg = np.asarray(tokens, dtype=np.int64)[1:]  # [T] targets
    m = penalty_mask(tokens, spec, form)  # [T, F]
    alone = simulate(base_stats, tg, m, finals, spec.bias)
    stacked = (simulate(paired.new, tg, m, finals, spec.bias, base=paired.base, kld_base_stats=paired.kld)
               if paired is not None else None)
    extra = {f: extra_hits(tokens, spec, f, m if form == FORM_EXACT else None) for f in (FORM_LAST, FORM_SEED)}
    return DocPenalty(m, alone, stacked, ~m.any(1), extra)


# ----------------------------------------------------------------------------------------------------------
# transformers LogitsProcessor


_PROCESSOR_CLS = None


def logits_processor(spec: PenaltySpec):
    """A transformers `LogitsProcessor` applying `spec` (same decision function as the simulation)."""
    global _PROCESSOR_CLS
    if _PROCESSOR_CLS is None:
        from transformers import LogitsProcessor

        class PrefixPenaltyLogitsProcessor(LogitsProcessor):
            """Subtract `bias` from each banned tuple's final token when the context ends with its prefix."""

            def __init__(self, spec: PenaltySpec):
                self.spec = spec

            def __call__(self, input_ids, scores):
                scores = scores.clone()
                for b in range(input_ids.shape[0]):
                    ids = penalized_at(input_ids[b].tolist(), self.spec)
                    if ids:
                        scores[b, list(ids)] -= self.spec.bias
                return scores

        _PROCESSOR_CLS = PrefixPenaltyLogitsProcessor
    return _PROCESSOR_CLS(spec)


# ----------------------------------------------------------------------------------------------------------
# the library function behind `l47 penalty`


@dataclass(frozen=True)
class PenaltyArgs:
    experiment: Path
    out: Path  # the JSON spec for the engine
    base: Path | None = None  # base GGUF (default: the experiment's model)
    bundle: Path | None = None  # also simulate stacked on this bundle
    bias: float = DEFAULT_BIAS
    form: str = FORM_EXACT
    sets: tuple[str, ...] = ("heldout",)  # where the residual is measured
    policy: str | None = None
    device: str = "cpu"
    ledger: Path | None = None  # default: the base model's ledger (l47.data.ledger)


@dataclass(frozen=True)
class PenaltyResult:
    spec_path: str
    rules: int
    bias: float
    form: str
    residual: dict  # phrase -> {n, base, penalty, bundle?, stacked?} mean p(rejected) at events of `sets`
    unchanged_rows: int  # rows where nothing is penalised
    unchanged_max_abs_dlogp: float  # max |Δ log p(target)| of the penalty there (0 by construction, measured)
    penalised_rows: int
    extra_hits: dict  # cheap form -> ExtraHits as dict

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _PenaltyTally:
    """Running figures of `run_penalty` over the documents: p(rejected) per phrase at its events (base,
    penalty, bundle, stacked), the rows the penalty leaves alone and its max |Δ log p| there, extra hits."""

    acc: dict = field(default_factory=dict)  # phrase -> {base, penalty, bundle, stacked: [p]}
    unchanged: int = 0
    pen_rows: int = 0
    max_abs: float = 0.0
    extra: dict = field(default_factory=lambda: {FORM_LAST: [], FORM_SEED: []})  # form -> [ExtraHits]

    def add(self, dp: DocPenalty, st, ps, events) -> None:
        """One document: its DocPenalty, base HeadStats, PairedStats (or None) and its events."""
        off = dp.unchanged
        self.unchanged += int(off.sum())
        self.pen_rows += int((~off).sum())
        if off.any():
            self.max_abs = max(self.max_abs, float(np.abs(dp.alone.logp_target[off] - st.logp_target[off]).max()))
        for ev in events:
            a = self.acc.setdefault(ev.phrase, {"base": [], "penalty": [], "bundle": [], "stacked": []})
            a["base"].append(math.exp(st.logp_target[ev.pos]))
            a["penalty"].append(math.exp(dp.alone.logp_target[ev.pos]))
            if ps is not None:
                a["bundle"].append(math.exp(ps.new.logp_target[ev.pos]))
                a["stacked"].append(math.exp(dp.stacked.logp_target[ev.pos]))
        for form in self.extra:
            self.extra[form].append(dp.extra[form][0])

    def residual(self) -> dict:
        return {ph: {"n": len(v["base"]), **{k: (float(np.mean(x)) if x else None) for k, x in v.items()}}
                for ph, v in self.acc.items()}

    def extra_hits(self) -> dict:
        return {f: {"positions": sum(e.positions for e in v), "pairs": sum(e.pairs for e in v),
                    "target_hit": sum(e.target_hit for e in v)} for f, v in self.extra.items()}


def run_penalty(args: PenaltyArgs) -> PenaltyResult:
    """Build the penalty from the experiment's phrases, export it as JSON, and simulate it exactly on the
    events of `args.sets` (alone, and stacked on `args.bundle`), with the cheap forms' extra hits.

    weights + sets + spec (`_penalty_plan`) -> each document scored and penalised -> spec JSON + result."""
    w, vocab, rep, spec, W_new = _penalty_plan(args)
    finals = list(spec.finals)
    topk = max(5, len(finals) + 2)
    tally = _PenaltyTally()
    for dr in rep.docs:
        if dr.set not in args.sets or dr.refused:
            continue
        d = read_dump(dr.path)
        check_dump_dims(w, d.meta, dr.path)
        if W_new is None:
            st, ps = score_dump(w, d, token_ids={FINALS_KEY: finals}, topk=topk), None
        else:
            ps = score_pair(w, d, W_new, token_ids={FINALS_KEY: finals}, topk=topk)
            st = ps.base
        dp = penalise_document(spec, d.tokens, st, ps, args.form)
        tally.add(dp, st, ps, [ev for ev in rep.events if ev.doc_sha256 == dr.sha256])
    write_text_atomic(args.out, spec.to_json(vocab.decode))
    return PenaltyResult(str(args.out), len(spec.rules), spec.bias, spec.form, tally.residual(), tally.unchanged,
                         tally.max_abs, tally.pen_rows, tally.extra_hits())


def _penalty_plan(args: PenaltyArgs):
    """The base weights, vocabulary, sets report (blind documents never touched; every scored document in the
    ledger first), the spec from its phrases and the bundle's weight -> (w, vocab, report, spec, W_new | None)."""
    exp = load_experiment(args.experiment)
    base = args.base or exp.model
    if base is None:
        raise L47Error(args.experiment, "model", "a base GGUF (in the experiment or given)", "none")
    if args.form not in FORMS:
        raise L47Error("penalty", "form", f"one of {FORMS}", repr(args.form))
    w = load_tail_weights(base, policy=args.policy or exp.policy, device=args.device)
    vocab = load_vocab(exp, base, w.V)
    ledger = Ledger.open(args.ledger, w.model_sha256)  # every scored document recorded before it is scored
    # the experiment's own selection (split included); blind documents are never touched here
    rep = build_sets(replace(exp, sets={k: v for k, v in exp.sets.items() if k != "blind"}), w, vocab=vocab,
                     device=args.device, ledger=ledger, command="penalty")
    spec = make_spec(list(rep.phrases), args.bias, args.form, w.model_sha256, vocab.name)
    if not spec.rules:
        raise L47Error(args.experiment, "phrases", "at least one multi-token banned tuple", "none")
    W_new, bsha = edited_weight(w, args.bundle, args.device) if args.bundle is not None else (None, None)
    if bsha is not None:  # scored against the bundle too
        ledger.append([dr.sha256 for dr in rep.docs if dr.set in args.sets and not dr.refused], bsha, "penalty")
    return w, vocab, rep, spec, W_new
