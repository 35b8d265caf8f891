"""The audit's bars as data: a registry of small named checks, each with a declared direction, threshold,
aggregation and definition (lm-evaluation-harness style), evaluated on the audit's `Evidence`.

A bar function reads figures that `l47.evals.audit` computed (exact tail forward, see l47.evals.metrics) and
returns a `Measure` (value + details); the registry turns it into a `Bar(name, value, threshold, direction,
passed, details)`. A bar with no data FAILS ("no evidence is not a pass"), except the few declared
`optional` (e.g. engine-level checks where no engine run on the bundle exists), which are marked n/a.

Thresholds come from the experiment file (`l47.data.experiment.Thresholds`, the seed's defaults) or are derived
from other figures (named in the bar's `threshold_from`); the report prints every threshold used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the evidence is made by l47.evals.audit / l47.evals.metrics
    from l47.data.experiment import Thresholds
    from l47.evals.figures import (BlindFigures, BundleFigures, ClaimsFigures, CollateralFigures, CountFigures,
                                   EngineFigures, FlipFigures, OrdinaryFigures, ProxyFigures, RecordFigures,
                                   SetKld, SlopFigures, SpecialMassFigures, SplitFigures, TurnEndFigures)

GE, LE = ">=", "<="
DIRECTIONS = (GE, LE)
MODE_DEV = "dev"
MODE_BLIND = "blind"
MODE_BOTH = "both"


@dataclass(frozen=True)
class Bar:
    name: str
    value: float | None
    threshold: float | None
    direction: str
    passed: bool
    details: dict = field(default_factory=dict)
    family: str = ""
    definition: str = ""
    aggregation: str = ""
    threshold_from: str = ""
    applicable: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def status(self) -> str:
        return "n/a" if not self.applicable else ("PASS" if self.passed else "FAIL")


@dataclass(frozen=True)
class Measure:
    value: float | None
    details: dict = field(default_factory=dict)
    applicable: bool = True
    threshold: float | None = None  # overrides the declared threshold (derived ones)


@dataclass(frozen=True)
class Evidence:
    """Every figure the bars read, one typed family each (l47.evals.figures). Both modes carry the bundle and
    proxy figures; the dev audit's families are None in a blind sign-off and `blind` is None in a dev audit
    (the registry runs only the bars of the mode)."""

    thresholds: Thresholds
    bundle: BundleFigures
    proxy: ProxyFigures
    mode: str = MODE_DEV
    record: RecordFigures | None = None
    split: SplitFigures | None = None
    slop: SlopFigures | None = None  # held-out events
    claims: ClaimsFigures | None = None
    collateral: CollateralFigures | None = None
    kld: dict[str, SetKld | None] = field(default_factory=dict)  # set name -> its KLD figures
    engine: EngineFigures | None = None
    flips: FlipFigures | None = None
    turn_ends: TurnEndFigures | None = None
    special_mass: SpecialMassFigures | None = None
    ordinary: OrdinaryFigures | None = None
    blind: BlindFigures | None = None
    counts: CountFigures | None = None  # held-out events per phrase, collateral_eval per word / in all


@dataclass(frozen=True)
class BarDef:
    name: str
    family: str
    direction: str
    threshold: str | None  # a Thresholds field, or None when the Measure carries a derived threshold
    aggregation: str
    definition: str
    fn: Callable[[Evidence], Measure | dict[str, Measure]]
    mode: str = MODE_DEV
    optional: bool = False  # no data -> n/a instead of FAIL
    threshold_from: str = ""
    reads: tuple[tuple[str, str], ...] = ()  # other thresholds the measure depends on: (name, the way it proves less)


REGISTRY: dict[str, BarDef] = {}


HIGHER, LOWER = "higher", "lower"  # the way a threshold moves to prove less (weakened_thresholds)


def register(name: str, *, family: str, direction: str, threshold: str | None, aggregation: str, definition: str,
             mode: str = MODE_DEV, optional: bool = False, threshold_from: str = "",
             reads: tuple[tuple[str, str], ...] = ()):
    """Decorator: add a bar function to the registry (names are unique). `reads`: the other thresholds the
    bar's measure depends on (a guard or a selection rule that decides what it measures), each with the way it
    moves to prove less (HIGHER / LOWER); the bar's own `threshold` has the way its direction implies.
    Many parameters because the keyword parameters ARE the bar's metadata (registered as data, shown in every
    report)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"bar {name}: direction {direction!r}")
    if any(way not in (HIGHER, LOWER) for _, way in reads):
        raise ValueError(f"bar {name}: reads {reads!r}")

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"bar {name} registered twice")
        REGISTRY[name] = BarDef(name, family, direction, threshold, aggregation, definition, fn, mode, optional,
                                threshold_from or (f"thresholds.{threshold}" if threshold else ""), tuple(reads))
        return fn

    return deco


def threshold_directions() -> dict[str, tuple[str, str]]:
    """threshold name -> (the way it moves to prove less, the bar that says so), from the registry alone: a
    bar's own threshold proves less raised when the bar is `<=` and lowered when it is `>=`; a threshold a bar
    `reads` carries its declared way. Two bars that disagree on a threshold's way are a registry error."""
    out: dict[str, tuple[str, str]] = {}
    for bd in REGISTRY.values():
        own = [(bd.threshold, HIGHER if bd.direction == LE else LOWER)] if bd.threshold else []
        for th, way in own + list(bd.reads):
            if th in out and out[th][0] != way:
                raise ValueError(f"threshold {th}: bar {bd.name} says {way}, bar {out[th][1]} says {out[th][0]}")
            out.setdefault(th, (way, bd.name))
    return out


def compare(value: float | None, threshold: float | None, direction: str) -> bool:
    if value is None or threshold is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return value >= threshold if direction == GE else value <= threshold


def evaluate(ev: Evidence, mode: str | None = None) -> list[Bar]:
    """Run every registered bar for this mode (dev audit or blind sign-off), in registration order."""
    mode = mode or ev.mode
    out: list[Bar] = []
    for bd in REGISTRY.values():
        if bd.mode not in (mode, MODE_BOTH):
            continue
        res = bd.fn(ev)
        items = res.items() if isinstance(res, dict) else [("", res)]
        for suffix, m in items:
            thr = m.threshold if m.threshold is not None else (
                getattr(ev.thresholds, bd.threshold) if bd.threshold else None)
            applicable = m.applicable and not (bd.optional and m.value is None)
            passed = compare(m.value, thr, bd.direction) if applicable else True
            det = dict(m.details)
            if applicable and m.value is None:
                det.setdefault("why", "no data: the evidence this bar needs is missing")
            out.append(Bar(bd.name + (f".{suffix}" if suffix else ""), m.value, thr, bd.direction, passed, det,
                           bd.family, bd.definition, bd.aggregation, bd.threshold_from, applicable))
    return out


def thresholds_used(bars: list[Bar]) -> dict[str, float | None]:
    return {b.name: b.threshold for b in bars}


def _why_no_record(f: RecordFigures | ClaimsFigures) -> str:
    """Why a family of the solve record has no figures (no record, or the reason the audit gives)."""
    return f.why if f.why is not None else "no solve record"


# ----------------------------------------------------------------------------------------------------------
# bundle (seed §5, §6: 47/48 tensors byte-identical, only blk.47.ffn_down_shexp differs)


@register("bundle.only_target", family="bundle", direction=LE, threshold=None, mode=MODE_BOTH,
          aggregation="count over every tensor of the bundle",
          definition="tensors other than layer L's ffn_down_shexp that differ from the base (bytes, type or "
                     "shape), plus a target whose type or shape changed; must be 0")
def _bundle_only_target(ev: Evidence) -> Measure:
    b = ev.bundle
    bad = list(b.others_changed) + list(b.target_type_shape)
    det = {"changed": bad, "target": b.target, "compared": b.compared, "form": b.form}
    return Measure(float(len(bad)), det, threshold=0.0)


@register("bundle.target_edited", family="bundle", direction=GE, threshold=None, mode=MODE_BOTH,
          aggregation="one tensor", definition="the target tensor differs from the base (a no-op bundle edits "
          "nothing); value = ‖ΔW‖/‖W‖ of the runtime (dequantised) weights, must be > 0")
def _bundle_target_edited(ev: Evidence) -> Measure:
    b = ev.bundle
    return Measure(b.dw_rel, {"target": b.target, "blocks_changed": b.blocks_changed, "dw_fro": b.dw_fro},
                   threshold=1e-12)


@register("bundle.metadata", family="bundle", direction=LE, threshold=None, mode=MODE_BOTH,
          aggregation="count over metadata keys",
          definition="metadata keys changed or added, other than provenance keys (l47.provenance.*); overlays may "
                     "leave base keys out")
def _bundle_metadata(ev: Evidence) -> Measure:
    b = ev.bundle
    return Measure(float(len(b.metadata_changed)), {"changed": b.metadata_changed, "omitted": b.metadata_omitted},
                   threshold=0.0)


@register("bundle.scope", family="bundle", direction=LE, threshold=None, mode=MODE_BOTH,
          aggregation="count of claims",
          definition="scope claims (provenance target/scope/tensors keys, the solve record's target, base and "
                     "bundle sha256) that disagree with the tensors actually changed and the files audited")
def _bundle_scope(ev: Evidence) -> Measure:
    b = ev.bundle
    return Measure(float(len(b.scope_mismatches)), {"mismatches": b.scope_mismatches, "claims": b.scope_claims},
                   threshold=0.0)


# ----------------------------------------------------------------------------------------------------------
# not a proxy (seed §3: the proxy sat at 12.08 nats ≈ ln V)


@register("proxy.base_ce", family="not a proxy", direction=LE, threshold=None, mode=MODE_BOTH,
          aggregation="max over every scored document of its base CE over content targets (the worst document is "
                      "named; the token-pooled mean is reported beside it)",
          threshold_from="thresholds.ce_proxy_frac · ln V", reads=(("ce_proxy_frac", HIGHER),),
          definition="base CE of the exact tail forward on EACH scored document: text the model finds unnatural "
                     "(near ln V) is no evidence for bars (f), (g) or the slop bar, and a proxy sits near ln V")
def _proxy_ce(ev: Evidence) -> Measure:
    p = ev.proxy
    per = {k: v["ce"] for k, v in p.docs.items()}
    worst = max(per, key=per.get) if per else None
    lim = p.limit
    over = sorted((k for k, v in per.items() if lim is not None and v > lim), key=lambda k: -per[k])
    return Measure(per[worst] if worst else None,
                   {"worst_doc": worst, "ce_pooled": p.ce_pooled, "ln_V": p.ln_V,
                    "tokens": p.tokens, "over_limit": over, "per_doc": per}, threshold=lim)


@register("proxy.zero_proxy", family="not a proxy", direction=LE, threshold="zero_proxy_tol", mode=MODE_BOTH,
          aggregation="max over positions of every scored dump",
          definition="|log p(target) of the engine that made the dump − tail forward's| / max(1, |log p|): the "
                     "forward is the real network. Required for every scored dump: a dump without the engine's own "
                     "log p (ref_logp) fails this bar unless --allow-unverified, which stamps the report "
                     "\"unverified\"")
def _proxy_zero(ev: Evidence) -> Measure:
    p = ev.proxy
    unv = list(p.unverified or [])
    det = {"unverified": unv, "allow_unverified": bool(p.allow_unverified), "per_doc": p.zero_proxy}
    if unv and not p.allow_unverified:
        det["why"] = (f"{len(unv)} scored dump(s) carry no engine log p, so the zero-proxy check cannot run "
                      f"(first: {unv[0]}); re-dump with the engine, or pass --allow-unverified")
        return Measure(None, det)
    if p.zero_proxy_max is None:  # allowed and nothing verified at all: stamped, not judged
        return Measure(None, {**det, "why": "no scored dump is verified (--allow-unverified)"}, applicable=False)
    return Measure(p.zero_proxy_max, det)


@register("proxy.own_generation", family="not a proxy", direction=LE, threshold="sampler_max_violation_frac",
          mode=MODE_BOTH, reads=(("sampler_tol", HIGHER),),
          aggregation="max over the scored documents that claim generated text of (tokens outside the recorded "
                      "sampler's support) / (tokens checked); the worst document is named",
          definition="a document whose provenance says `generated` must be what its recorded sampler (temperature, "
                     "top-k, top-p, min-p) could draw from the base model's exact logits: greedy -> the argmax, "
                     "top-k -> among the k most probable, top-p -> inside the nucleus (l47.dumps.select."
                     "sampler_violations, thresholds.sampler_tol nats of slack). The blind document must claim it "
                     "and be checkable (a sampler that admits every token proves nothing; one wider than the "
                     "toolkit's own top-k / top-p cuts, e.g. min-p 1e-30 alone, is refused before scoring, and in "
                     "a dev audit fails this bar); the blind chat is not replayed by the engine, so the sign-off "
                     "is stamped weakened (own_generation.replay); in a dev audit, documents that claim no "
                     "generation are not judged")
def _proxy_own(ev: Evidence) -> Measure:
    own = ev.proxy.own_generation or {}
    frac = {k: v["outside"] / v["checked"] for k, v in own.items() if v["checked"]}
    undecided = sorted(k for k, v in own.items() if not v["checked"])
    wider = sorted(k for k, v in own.items() if v.get("wider"))
    det = {"per_doc": own, "undecided": undecided, "wider": wider}
    if wider:  # a claim of generation under a sampler no check can bound is no evidence (l47.data.sets.sampler_wider)
        return Measure(None, {**det, "why": f"{len(wider)} document(s) claim generation under a sampler wider than "
                                            f"the toolkit's own (first: {wider[0]}: {own[wider[0]]['wider']})"})
    if ev.mode == MODE_BLIND and (not own or undecided):
        det["why"] = ("the blind document claims no generated text (provenance)" if not own else
                      "the blind document's recorded sampler admits tokens this check cannot bound (no top-k <= "
                      "64, no top-p reached inside the top 64, no min-p): it cannot be shown to be the model's "
                      "own generation; sample it with a top-k or top-p cut")
        return Measure(None, det)
    if not frac:
        return Measure(None, {**det, "why": "no scored document claims generated text"}, applicable=False)
    worst = max(frac, key=frac.get)
    return Measure(frac[worst], {**det, "worst_doc": worst})


# ----------------------------------------------------------------------------------------------------------
# (a)–(c) against the solve record (seed §5.3: the failure was positions the solver added)


@register("a.prefix_exact", family="(a)", direction=LE, threshold=None,
          aggregation="count over the record's slop terms",
          definition="positions the solve record says the slop objective touched whose preceding tokens are not a "
                     "banned tuple's prefix, whose target is not the tuple's final token, or that cannot be found")
def _a_prefix(ev: Evidence) -> Measure:
    r = ev.record
    if not r.present:
        return Measure(None, {"why": _why_no_record(r)}, threshold=0.0)
    return Measure(float(len(r.not_prefix_exact)), {"n_slop": r.n_slop, "bad": r.not_prefix_exact[:50]},
                   threshold=0.0)


@register("a.events", family="(a)", direction=LE, threshold=None, aggregation="count over the record's slop terms",
          threshold_from="thresholds.non_event_p", reads=(("non_event_p", LOWER),),
          definition="positions the record's slop objective touched whose base p(rejected) < non_event_p "
                     "(non-events: suppressing almost-never to almost-never, seed §3 (2)); the audit's own forward")
def _a_events(ev: Evidence) -> Measure:
    r = ev.record
    if not r.present:
        return Measure(None, {"why": _why_no_record(r)}, threshold=0.0)
    return Measure(float(len(r.non_events)), {"n_slop": r.n_slop, "non_events": r.non_events[:50]}, threshold=0.0)


@register("b.natural", family="(b)", direction=LE, threshold=None, aggregation="count over documents",
          reads=(("salad_ngram", HIGHER), ("salad_max_ngram_repeat", HIGHER), ("salad_max_dup_lines", HIGHER),
                 ("ce_proxy_frac", HIGHER), ("sampler_max_violation_frac", HIGHER), ("sampler_tol", HIGHER)),
          definition="documents holding the record's slop positions that are not accepted training documents "
                     "(not in train, or refused by the provenance / word-salad / CE / sampler guards)")
def _b_natural(ev: Evidence) -> Measure:
    r = ev.record
    if not r.present:
        return Measure(None, {"why": _why_no_record(r)}, threshold=0.0)
    return Measure(float(len(r.unnatural_docs)), {"docs": r.unnatural_docs, "training_docs": r.training_docs},
                   threshold=0.0)


@register("c.heldout_fraction", family="(c)", direction=GE, threshold="heldout_frac",
          aggregation="held-out events / (train + dev + held-out events), by document",
          definition="share of slop events held out in documents the solver never saw")
def _c_frac(ev: Evidence) -> Measure:
    s = ev.split
    return Measure(s.heldout_frac, {"events": s.events})


@register("c.disjoint", family="(c)", direction=LE, threshold=None, aggregation="count of documents",
          reads=(("overlap_window", HIGHER),),
          definition="documents of the solve record (inputs and touched positions) or of the solver's sets that "
                     "are also in a scored set (heldout, collateral_eval, chat_heldout, kld.*, blind), by sha256")
def _c_disjoint(ev: Evidence) -> Measure:
    r = ev.record
    ov = r.overlap
    if ov is None:
        return Measure(None, {"why": _why_no_record(r)}, threshold=0.0)
    return Measure(float(len(ov)), {"overlap": ov}, threshold=0.0)


@register("c.slop", family="(c)", direction=GE, threshold="slop_reduction",
          aggregation="min over phrases of 1 − mean p_after / mean p_before at the phrase's held-out events (the "
                      "worst phrase is named; the pooled reduction over every event is reported beside it)",
          definition="held-out slop: EACH phrase's mean p(rejected) at prefix-exact events of held-out documents is "
                     "reduced by at least the bar (in-context copies included; fresh and copies reported apart)")
def _c_slop(ev: Evidence) -> Measure:
    s = ev.slop
    per = {k: {kk: v.get(kk) for kk in ("n", "p_before", "p_after", "reduction")} for k, v in s.per_phrase.items()}
    vals = {k: v["reduction"] for k, v in per.items()}
    det = {"pooled": s.reduction, "n": s.n, "p_before": s.p_before, "p_after": s.p_after, "fresh": s.fresh,
           "copies": s.copies, "per_phrase": per}
    if not vals:
        return Measure(None, {**det, "why": "no held-out slop event"})
    if any(v is None for v in vals.values()):
        bad = [k for k, v in vals.items() if v is None]
        return Measure(None, {**det, "why": f"no reduction defined for {bad} (base p 0)"})
    worst = min(vals, key=vals.get)
    return Measure(vals[worst], {**det, "worst_phrase": worst,
                                 "failing": sorted(k for k, v in vals.items()
                                                   if v < ev.thresholds.slop_reduction)})


@register("c.min_heldout_per_phrase", family="(c)", direction=GE, threshold="min_heldout_per_phrase",
          reads=(("min_train_per_phrase", LOWER),),  # plan / solve refuse a phrase thinner than it (l47.data.thin)
          aggregation="min over the experiment's phrases (a phrase with no held-out event counts 0)",
          definition="held-out events per phrase: too few and the per-phrase slop figure is noise (seed §6.3)")
def _c_min(ev: Evidence) -> Measure:
    c = ev.counts.heldout_per_phrase
    if not c:
        return Measure(None, {"why": "no phrase with a multi-token variant"})
    worst = min(c, key=c.get)
    return Measure(float(c[worst]), {"per_phrase": c, "worst_phrase": worst})


@register("claims", family="record", direction=LE, threshold=None, aggregation="count of claims",
          definition="figures the solve record claims that the audit re-derives and finds different "
                     "(tolerance: 1e-4 absolute + 1e-3 relative), plus an unexplained convergence failure: stop "
                     "reason iteration_cap, or max constraint violation above its tolerance (explained by a record "
                     "note starting \"convergence:\" with its reason; at the iteration cap only with the figures "
                     "beside it: the iterations run and the dev residual per phrase at the stop, re-derived)")
def _claims(ev: Evidence) -> Measure:
    c = ev.claims
    if not c.present:
        return Measure(None, {"why": _why_no_record(c)}, threshold=0.0)
    return Measure(float(len(c.mismatched)), {"compared": c.compared, "mismatched": c.mismatched,
                                               "not_rederived": c.not_rederived, "convergence": c.convergence},
                   threshold=0.0)


# ----------------------------------------------------------------------------------------------------------
# (d) collateral_eval, per word (seed §6: a raised " what" must not offset a suppressed " actually")


@register("d.word_mean", family="(d)", direction=GE, threshold="collateral_word_mean",
          aggregation="min over words of the mean Δlog p(target) at the word's ordinary uses in collateral_eval",
          definition="per-word collateral: every final-token word keeps its ordinary uses")
def _d_word(ev: Evidence) -> Measure:
    c = ev.collateral
    return Measure(c.min_word_mean, {"n": c.n, "per_word": {
        k: {kk: v[kk] for kk in ("n", "mean_dlogp", "frac_below", "worst")} for k, v in c.per_word.items()}})


@register("d.frac_below", family="(d)", direction=LE, threshold="collateral_frac_below",
          aggregation="pooled over every collateral_eval occurrence", threshold_from="thresholds.collateral_frac_below "
          "(below thresholds.collateral_below nats)", reads=(("collateral_below", LOWER),),
          definition="share of collateral occurrences losing more than |collateral_below| nats")
def _d_frac(ev: Evidence) -> Measure:
    c = ev.collateral
    return Measure(c.frac_below, {"n_below": c.n_below, "n": c.n, "per_word_frac": {
        k: v["frac_below"] for k, v in c.per_word.items()}})


@register("d.min_per_word", family="(d)", direction=GE, threshold="collateral_min_per_word",
          aggregation="min over the collateral words (a word with no occurrence counts 0)",
          definition="ordinary uses of each collateral word in collateral_eval: a word that is not measured is not "
                     "protected (it would silently drop out of d.word_mean)")
def _d_min_word(ev: Evidence) -> Measure:
    c = ev.counts.collateral_per_word
    if not c:
        return Measure(None, {"why": "no collateral word"})
    worst = min(c, key=c.get)
    return Measure(float(c[worst]), {"per_word": c, "worst_word": worst})


@register("d.min_total", family="(d)", direction=GE, threshold="collateral_min_total",
          aggregation="count over collateral_eval", definition="ordinary uses of the collateral words in all")
def _d_min_total(ev: Evidence) -> Measure:
    n = ev.counts.collateral_total
    return Measure(None if n is None else float(n), {})


# ----------------------------------------------------------------------------------------------------------
# (e) KLD domains


@register("e.kld", family="(e)", direction=LE, threshold="kld_max",
          aggregation="mean over the domain's positions that are not prefix-exact (prefix-exact positions — where "
                      "moving mass off the banned word is the intended effect, l47.dumps.select.prefix_rows — are "
                      "reported apart)",
          definition="KL(base ‖ bundle) from the exact tail forward, per kld.<domain> (float-order floor ~0 for a "
                     "layer-L-only edit)")
def _e_kld(ev: Evidence) -> dict[str, Measure] | Measure:
    doms = {k: v for k, v in ev.kld.items() if k.startswith("kld.")}
    if not doms:
        return Measure(None, {"why": "no kld.<domain> set in the experiment"})
    out = {}
    for k, v in doms.items():
        st, pre, allr = (v.stats, v.prefix_rows, v.all_rows) if v else (None, None, None)
        out[k[4:]] = Measure(st.kld_mean if st else None, {
            "n": st.n if st else 0, "kld_99": st.kld_pct["99.0"] if st else None,
            "same_top": st.same_top if st else None, "prefix_rows_n": pre.n if pre else 0,
            "prefix_rows_kld_mean": pre.kld_mean if pre else None,
            "all_rows_kld_mean": allr.kld_mean if allr else None})
    return out


@register("e.engine_kld", family="(e)", direction=LE, threshold="kld_max", optional=True,
          aggregation="mean over the kld.<domain>'s positions",
          definition="engine-level KL(engine base ‖ engine on the transplanted bundle) from the dumps' ref_logits, "
                     "per kld.<domain>, beside the engine's floor KL(engine base ‖ exact forward base); other sets "
                     "are reported in engine.kld")
def _e_engine(ev: Evidence) -> dict[str, Measure] | Measure:
    e = {k: v for k, v in (ev.engine.kld or {}).items() if k.startswith("kld.")}
    if not e:
        return Measure(None, {"why": "no engine logits for both base and bundle on a kld.<domain> document"})
    return {k: Measure(v["kld"], {"floor": v.get("floor"), "tail_kld": v.get("tail_kld")}) for k, v in e.items()}


@register("engine.zero_proxy", family="(e)", direction=LE, threshold="zero_proxy_tol", optional=True,
          aggregation="max over positions",
          definition="where the engine ran the transplanted bundle: |its log p(target) − the tail forward's "
                     "prediction for the edited model| / max(1, |log p|)")
def _engine_zp(ev: Evidence) -> Measure:
    e = ev.engine.zero_proxy_edited
    return Measure(None if not e else max(v["max_rel"] for v in e.values()), {"per_doc": e})


# ----------------------------------------------------------------------------------------------------------
# (f) special tokens on every chat-formatted document (seed §6.1–6.3)


@register("f.flips", family="(f)", direction=LE, threshold=None, aggregation="count over chat-formatted documents",
          definition="argmax flips TO <|im_end|>/<|im_start|>/<think>/</think>/<|endoftext|> at non-terminal "
                     "assistant, think and user positions other than user-turn openers (others listed, not failed)")
def _f_flips(ev: Evidence) -> Measure:
    f = ev.flips
    if not f.docs:
        return Measure(None, {"why": "no chat-formatted document was scored"}, threshold=0.0)
    return Measure(float(f.damage), {"docs": f.docs, "by_kind": f.by_kind}, threshold=0.0)


@register("f.special_mass", family="(f)", direction=LE, threshold="special_rise_tol",
          aggregation="max over splits of (mean after − mean before) of Σ p(special) at slop events",
          definition="no rise of the special tokens' mean probability at slop positions")
def _f_mass(ev: Evidence) -> Measure:
    s = ev.special_mass
    return Measure(s.max_rise, {"per_split": s.per_split})


@register("f.turn_end_argmax", family="(f)", direction=LE, threshold=None,
          aggregation="count over real turn ends the solver did not protect (protected ones — the record's anchor "
                      "terms — are in-sample and reported apart)",
          definition="real turn ends where <|im_end|> was the base argmax and no longer is")
def _f_te_arg(ev: Evidence) -> Measure:
    t = ev.turn_ends
    if not t.n:
        return Measure(None, {"why": "no unprotected real turn end (<|im_end|> target) in the chat documents",
                              "protected": t.protected}, threshold=0.0)
    return Measure(float(t.lost), {"n": t.n, "was_argmax": t.was_argmax, "lost": t.lost_rows,
                                   "protected": t.protected}, threshold=0.0)


@register("f.turn_end_dlogp", family="(f)", direction=GE, threshold="im_end_dlogp",
          aggregation="mean over real turn ends the solver did not protect (protected ones reported apart)",
          definition="Δlog p(<|im_end|>) where it is the true next token")
def _f_te_dl(ev: Evidence) -> Measure:
    t = ev.turn_ends
    return Measure(t.mean_dlogp, {"n": t.n, "min": t.min_dlogp, "protected": t.protected})


# ----------------------------------------------------------------------------------------------------------
# (g) the held-out chat document


@register("g.ordinary_dlogp", family="(g)", direction=GE, threshold="chat_ordinary_dlogp",
          aggregation="mean over chat_heldout positions that are not slop and whose target is not special",
          definition="ordinary tokens of held-out chat keep their probability")
def _g_dl(ev: Evidence) -> Measure:
    o = ev.ordinary
    return Measure(o.mean_dlogp, {"docs": o.docs, "n_ordinary": o.n_ordinary, "median_dlogp": o.median_dlogp,
                                  "frac_below": o.frac_below})


G_ROWS = ("mean over the positions that are not prefix-exact (l47.dumps.select.prefix_rows: the events and the "
          "near misses, where moving mass off the banned word is the intended effect, as in bar (e) — reported "
          "apart, not judged)")


@register("g.kld", family="(g)", direction=LE, threshold="chat_kld", aggregation=G_ROWS,
          definition="KL(base ‖ bundle) on held-out chat away from slop positions")
def _g_kld(ev: Evidence) -> Measure:
    o = ev.ordinary
    return Measure(o.kld, {"n_non_slop": o.n_non_slop, "prefix_rows": o.prefix_rows})


# ----------------------------------------------------------------------------------------------------------
# blind sign-off (seed §6.2–6.3): a fresh blind set (one document or several, figures pooled over them), scored
# once, against the untouched bundle


@register("blind.bundle_untouched", family="blind", direction=GE, threshold=None, mode=MODE_BLIND,
          aggregation="sha256", definition="the bundle's sha256 equals the dev report's (untouched since); a "
          "mismatch is refused before the blind set is scored")
def _blind_sha(ev: Evidence) -> Measure:
    b = ev.blind
    return Measure(1.0 if b.bundle_sha256 and b.bundle_sha256 == b.dev_bundle_sha256 else 0.0,
                   {"bundle": b.bundle_sha256, "dev_report": b.dev_bundle_sha256}, threshold=1.0)


@register("blind.never_scored", family="blind", direction=GE, threshold=None, mode=MODE_BLIND,
          aggregation="ledger lookup", definition="each blind document's sha256 is in no ledger and in no input of the "
          "dev report or the solve record (refused before scoring otherwise); it is scored once, now")
def _blind_once(ev: Evidence) -> Measure:
    b = ev.blind
    return Measure(1.0 if b.never_scored else 0.0, {"doc": b.doc_sha256, "ledgers": b.ledgers}, threshold=1.0)


def _blind_part(key: str, fn: Callable) -> Callable[[Evidence], Measure]:
    """A dev bar's measure on the blind set: `fn` of the blind figures' family `key` (flips, turn_ends, ...)."""
    return lambda ev: fn(getattr(ev.blind, key))


register("blind.f.flips", family="blind", direction=LE, threshold=None, mode=MODE_BLIND,
         aggregation="count", definition="(f) flips to a special token on the blind set")(
    _blind_part("flips", lambda f: Measure(float(f.damage) if f.docs else None, {"by_kind": f.by_kind},
                                           threshold=0.0)))
register("blind.f.special_mass", family="blind", direction=LE, threshold="special_rise_tol", mode=MODE_BLIND,
         aggregation="mean after − mean before at the blind set's slop events",
         definition="(f) no rise of special-token mass at slop positions")(
    _blind_part("special_mass", lambda s: Measure(s.max_rise, {"per_split": s.per_split})))
register("blind.f.turn_end_argmax", family="blind", direction=LE, threshold=None, mode=MODE_BLIND,
         aggregation="count", definition="(f) real turn ends losing the <|im_end|> argmax")(
    _blind_part("turn_ends", lambda t: Measure(float(t.lost) if t.n else None, {"n": t.n}, threshold=0.0)))
register("blind.f.turn_end_dlogp", family="blind", direction=GE, threshold="im_end_dlogp", mode=MODE_BLIND,
         aggregation="mean", definition="(f) mean Δlog p(<|im_end|>) at real turn ends")(
    _blind_part("turn_ends", lambda t: Measure(t.mean_dlogp, {"n": t.n})))
register("blind.g.ordinary_dlogp", family="blind", direction=GE, threshold="chat_ordinary_dlogp", mode=MODE_BLIND,
         aggregation="mean over ordinary tokens", definition="(g) ordinary-token mean Δlog p on the blind set")(
    _blind_part("ordinary", lambda o: Measure(o.mean_dlogp, {"n": o.n_ordinary})))
register("blind.g.kld", family="blind", direction=LE, threshold="chat_kld", mode=MODE_BLIND,
         aggregation=G_ROWS, definition="(g) KLD on the blind set away from slop")(
    _blind_part("ordinary", lambda o: Measure(o.kld, {"n": o.n_non_slop, "prefix_rows": o.prefix_rows})))


@register("blind.slop_residual", family="blind", direction=LE, threshold=None, mode=MODE_BLIND,
          aggregation="mean p_after / mean p_before over the blind set's slop events",
          threshold_from="thresholds.blind_residual_factor × the dev report's held-out residual ratio",
          reads=(("blind_residual_factor", HIGHER),),
          definition="slop residual ratio (mean p after / mean p before) on the blind set vs the dev report's "
                     "held-out residual ratio")
def _blind_resid(ev: Evidence) -> Measure:
    b = ev.blind
    s = b.slop
    dev = b.dev_residual_ratio
    thr = None if dev is None else ev.thresholds.blind_residual_factor * dev
    det = {"n": s.n, "p_before": s.p_before, "p_after": s.p_after, "dev_residual_ratio": dev,
           "factor": ev.thresholds.blind_residual_factor, "absolute_residual_vs_dev": b.absolute_residual_vs_dev}
    return Measure(s.residual_ratio, det, threshold=thr)


@register("blind.slop_residual_abs", family="blind", direction=LE, threshold="blind_residual_abs", mode=MODE_BLIND,
          aggregation="max over the phrases present in the blind set of mean p_after / mean p_before at "
                      "the phrase's events (the worst phrase is named)",
          definition="slop residual ratio of EACH phrase present on the blind set, an absolute bar (the "
                     "seed's blind level): a bundle that removes almost nothing fails it whatever the dev report says")
def _blind_resid_abs(ev: Evidence) -> Measure:
    per = {k: v.get("residual_ratio") for k, v in ev.blind.slop.per_phrase.items()}
    if not per:
        return Measure(None, {"why": "no slop event in the blind set: nothing to sign off on"})
    if any(v is None for v in per.values()):
        return Measure(None, {"per_phrase": per, "why": "a phrase with base p 0 at its events"})
    worst = max(per, key=per.get)
    return Measure(per[worst], {"per_phrase": per, "worst_phrase": worst})


# ----------------------------------------------------------------------------------------------------------
# stamps on the report's summary line

def weakened(thresholds: Thresholds) -> list[dict]:
    """Every threshold moved from its default in the way that proves less (threshold_directions: one rule, read
    from the registry), as {key, default, value, weaker, bar}; a report with any is stamped "weakened". Moving a
    threshold the other way (a stricter audit) is not a weakening."""
    ways = threshold_directions()
    out = []
    for f in fields(thresholds):
        if f.name not in ways:
            continue
        way, bar = ways[f.name]
        v, d = getattr(thresholds, f.name), f.default
        if (way == LOWER and v < d) or (way == HIGHER and v > d):
            out.append({"key": f.name, "default": d, "value": v, "weaker": way, "bar": bar})
    return out


NOT_REPLAYED = {"key": "own_generation.replay", "default": "replayed", "value": "not replayed", "weaker": "",
                "bar": "proxy.own_generation"}  # the blind chat was not re-generated by the engine (DESIGN §6)


def weakened_text(item: dict) -> str:
    """One weakening as the summary line shows it: "key value (default d)"."""
    v, d = item["value"], item["default"]
    if isinstance(v, (int, float)) and isinstance(d, (int, float)):
        return f"{item['key']} {v:g} (default {d:g})"
    return f"{item['key']} {v} (default {d})"


def stamps(thresholds: Thresholds, proxy: ProxyFigures | None, weakenings: list[dict] | None = None) -> list[str]:
    """The report's stamps: "weakened: …" when a bar was made easier (`weakenings`: weakened(thresholds) and
    any evidence the run could not gather, e.g. NOT_REPLAYED), "unverified: …" when dumps without the engine's
    own log p were accepted (--allow-unverified)."""
    out = []
    w = weakened(thresholds) if weakenings is None else weakenings
    if w:
        out.append("weakened: " + ", ".join(weakened_text(x) for x in w))
    if proxy is not None and proxy.unverified and proxy.allow_unverified:
        out.append(f"unverified: {len(proxy.unverified)} dump(s) without engine log p")
    return out
