"""Per-document exact scoring for the audit and the figures behind every bar (pure functions over arrays).

Each document is scored once, base and edited together (`l47.tail.forward.score_pair`: one streamed pass over the
whole vocabulary), with the log p of the special tokens and of the banned tuples' final tokens kept per
position. Every figure below is then a reduction of those per-position arrays; nothing of size [T, V] exists.

Notation for array shapes:
    T   positions of a document (row t is computed at input tokens[t] and predicts the target tokens[t+1])
    S   special tokens of the model (<|endoftext|>, <|im_start|>, <|im_end|>, <think>, </think>)
    F   distinct final tokens of the banned tuples           k   top-k kept per position
Precision: log p from f32 logits with f64 vocabulary reductions; every mean / fraction here in f64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from l47.data.experiment import Experiment
from l47.data.sets import SAMPLER_TOPK, sampler_wider
from l47.data.uncertainty import POOLED, residual_intervals, settings
from l47.dumps import DumpMeta
from l47.dumps.select import (ChatStructure, SamplerCheck, chat_structure, claims_generation, find_events,
                              generation_check, prefix_rows)
from l47.errors import L47Error
from l47.evals.figures import (CollateralFigures, FlipFigures, OrdinaryFigures, ProxyFigures, SlopFigures,
                               SpecialMassFigures, TurnEndFigures)
from l47.model import names
from l47.model.gguf_io import GGUFFile
from l47.model.vocab import Vocab, resolve_vocab
from l47.model.weights import TailWeights
from l47.tail.forward import PairedStats, score_pair

SPECIAL = "special"  # token_sets key: the model's special tokens
FINALS = "finals"  # token_sets key: the banned tuples' final tokens
CONTEXT_TOKENS = 16  # tokens of context decoded for flips and examples
CHAT_ROLES = (names.ROLE_ID["assistant"], names.ROLE_ID["think"], names.ROLE_ID["user"])


def load_vocab(exp: Experiment, base: GGUFFile | Path | str, V: int) -> Vocab:
    """The model's vocabulary as the experiment names it; refused when its ids do not fit the head."""
    v = resolve_vocab(getattr(exp, "vocab", "auto"), base, V)
    missing = [s for s in (names.IM_END, names.IM_START) if s not in v.special_ids]
    if missing:
        raise L47Error(v.name, "special tokens", f"{names.IM_START} and {names.IM_END} in the vocabulary",
                       f"missing {missing}")
    return v


def context_text(vocab, tokens: np.ndarray, t: int, n: int = CONTEXT_TOKENS) -> str:
    """The text of the input tokens[t-n+1 .. t] (what the model saw before predicting row t's target)."""
    return vocab.decode(np.asarray(tokens[max(0, t - n + 1):t + 1]).tolist())


def tok_text(vocab, i: int) -> str:
    """One token id's text. The head may have more rows than the vocabulary has tokens (Qwen3.6's tiktoken file:
    248,077 ids for V = 248,320), and a model can still predict such an id: shown as <id N>."""
    i = int(i)
    return vocab.decode([i]) if 0 <= i < vocab.size else f"<id {i}>"


# ----------------------------------------------------------------------------------------------------------
# one scored document


@dataclass(frozen=True)
class DocResult:
    set: str
    path: str
    sha256: str
    doc_id: str
    tokens: np.ndarray  # [T+1] int64
    role: np.ndarray  # [T] uint8
    ps: PairedStats  # base / new HeadStats with set_logp[SPECIAL] [T, S], [FINALS] [T, F]
    chat: ChatStructure
    slop_rows: np.ndarray  # [T] bool: prefix-exact positions of any banned tuple (events and non-events)
    verified: bool
    ref_logp: np.ndarray | None  # [T] the engine's own log p(target), when dumped
    refused: bool
    reasons: tuple[str, ...]
    meta: DumpMeta
    sampler: SamplerCheck | None = None  # of the rows it claims generated (None: claims none)

    @property
    def T(self) -> int:
        return int(self.tokens.shape[0]) - 1

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[1:]

    @property
    def is_chat(self) -> bool:
        return self.chat.n_turns > 0


@dataclass(frozen=True)
class Scoring:
    """What every document of an audit is scored with: the runtime weights, the edited W_sd (the bundle's
    values), the banned tuples and the token sets whose log p is kept per position."""

    w: TailWeights
    W_new: torch.Tensor  # [n, f] f32: the bundle's W_sd
    phrase_tuples: Sequence  # [PhraseTuples]
    special_ids: Mapping[str, int]
    finals: Sequence[int]
    sampler_tol: float = 0.01  # nats of slack in the generated-tokens check (thresholds.sampler_tol)

    @property
    def topk(self) -> int:
        return max(5, len(self.finals) + 2)  # the penalty simulation's argmax is exact when k > |penalised set|

    def pair(self, dump, topk: int | None = None):
        """One paired (base, bundle) streamed head pass over the dump -> PairedStats with `topk` columns."""
        spec = sorted(set(int(i) for i in self.special_ids.values()))
        return score_pair(self.w, dump, self.W_new, token_ids={SPECIAL: spec, FINALS: list(self.finals)},
                          topk=topk or self.topk)


def top_k_of(h, k: int):
    """The first k top-k columns of a HeadStats (the top-k of a wider pass, same order)."""
    return h if h.top_ids.shape[1] <= k else replace(h, top_ids=h.top_ids[:, :k], top_logp=h.top_logp[:, :k])


def score_document(sc: Scoring, dump, set_name: str, refused: bool = False, reasons: tuple[str, ...] = (),
                   ps=None) -> DocResult:
    """Paired exact scoring of one dump (base = the model's W_sd, new = sc.W_new); `ps`: the PairedStats of a
    pass already made (any top-k width >= sc.topk), else one pass here."""
    if ps is None:  # a document that claims to be generated keeps the top-k its sampler check reads
        ps = sc.pair(dump, max(sc.topk, SAMPLER_TOPK) if claims_generation(dump.meta.provenance) else None)
    tokens = np.asarray(dump.tokens, dtype=np.int64)  # [T+1]
    role = np.asarray(dump.role).astype(np.uint8)  # [T]
    own = generation_check(ps.base.logp_target, ps.base.top_logp, role, dump.meta.provenance, sc.sampler_tol)
    ps = replace(ps, base=top_k_of(ps.base, sc.topk), new=top_k_of(ps.new, sc.topk))
    rows = prefix_rows(tokens, sc.phrase_tuples)  # [T]: the events and the near misses (one definition)
    for e in find_events(tokens, sc.phrase_tuples, role):
        rows[e.pos] = True
    chat = chat_structure(tokens, role, sc.special_ids)
    ref = None if dump.ref_logp is None else np.asarray(dump.ref_logp, dtype=np.float64)
    return DocResult(set_name, str(dump.path), dump.sha256, dump.meta.doc_id, tokens, role, ps, chat, rows,
                     dump.verified, ref, refused, tuple(reasons), dump.meta, own)


def special_cols(special_ids: Mapping[str, int]) -> dict[str, int]:
    """special token name -> column in set_logp[SPECIAL] (ids sorted ascending)."""
    spec = sorted(set(int(i) for i in special_ids.values()))
    return {name: spec.index(int(i)) for name, i in special_ids.items()}


def _located(records, by_sha: Mapping[str, DocResult]):
    """(record, the scored DocResult of its document) for every record whose document was scored."""
    for r in records:
        d = by_sha.get(r.doc_sha256)
        if d is not None:
            yield r, d


def _mean(x) -> float | None:
    x = np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=np.float64)
    return float(x.mean()) if x.size else None


# ----------------------------------------------------------------------------------------------------------
# not a proxy


def proxy_figures(docs: Iterable[DocResult], V: int, ce_frac: float, tol: float,
                  allow_unverified: bool = False) -> ProxyFigures:
    """Base CE over content targets per document (a proxy sits near ln V), the zero-proxy agreement of the
    tail forward with the engine's own log p (relative |Δ| = |Δ log p| / max(1, |log p|)), and, for every
    document that claims generated text, how many of those tokens its recorded sampler could not have drawn
    (`wider`: a declared sampler the check cannot bound, l47.data.sets.sampler_wider, which proves nothing)."""
    per, zp, own = {}, {}, {}
    tmpl = names.ROLE_ID["template"]
    nll_sum, n_tok = 0.0, 0  # pooled over every content target of every scored document (f64)
    for d in docs:
        lp = d.ps.base.logp_target  # [T]
        m = d.role != tmpl
        m = m if m.any() else np.ones_like(m)
        nll_sum += float(-lp[m].sum())
        n_tok += int(m.sum())
        per[d.path] = {"set": d.set, "ce": float(-lp[m].mean()), "top1": float((d.ps.base.argmax == d.targets).mean()),
                       "T": d.T}
        if d.verified and d.ref_logp is not None:
            rel = np.abs(d.ref_logp - lp) / np.maximum(1.0, np.abs(lp))  # [T]
            zp[d.path] = {"max_rel": float(rel.max()), "mean_abs": float(np.abs(d.ref_logp - lp).mean())}
        if d.sampler is not None:  # the document claims generated text: is it in its sampler's support?
            own[d.path] = {"set": d.set, "checked": d.sampler.checked, "undecided": d.sampler.undecided,
                           "outside": len(d.sampler.violations), "first_rows": list(d.sampler.violations[:5])}
            wider = sampler_wider(d.meta.provenance)
            if wider:
                own[d.path]["wider"] = wider
    ce_max = max((v["ce"] for v in per.values()), default=None)
    ce_pooled = nll_sum / n_tok if n_tok else None
    return ProxyFigures(ln_V=math.log(V), limit=ce_frac * math.log(V), ce_max=ce_max, ce_pooled=ce_pooled,
                        tokens=n_tok, docs=per, zero_proxy=zp,
                        zero_proxy_max=max((v["max_rel"] for v in zp.values()), default=None),
                        unverified=sorted(d.path for d in docs if not d.verified), tol=tol, own_generation=own,
                        allow_unverified=allow_unverified)


# ----------------------------------------------------------------------------------------------------------
# slop at events (held-out only for the bar)


def slop_figures(events, by_sha: Mapping[str, DocResult], vocab, special_ids: Mapping[str, int],
                 penalty: Mapping[str, Mapping] | None = None) -> SlopFigures:
    """Mean p(rejected) before/after at the given events (EventRecord list), per phrase, with in-context copies
    apart; the new argmax and the special-token mass at each event. `penalty`: doc sha → {"alone": Simulated,
    "stacked": Simulated} for the sampler-penalty columns."""
    sc = special_cols(special_ids)
    rows = []
    for e, d in _located(events, by_sha):
        t = e.pos
        b, n = d.ps.base, d.ps.new
        spb = float(np.exp(b.set_logp[SPECIAL][t]).sum())
        spn = float(np.exp(n.set_logp[SPECIAL][t]).sum())
        r = {"doc": d.path, "doc_sha256": d.sha256, "set": e.set, "pos": t, "phrase": e.phrase,
             "copy": bool(e.in_context_copy), "p_before": math.exp(b.logp_target[t]),
             "p_after": math.exp(n.logp_target[t]),
             "argmax_before": int(b.argmax[t]), "argmax_after": int(n.argmax[t]),
             "argmax_after_text": tok_text(vocab, n.argmax[t]),
             "argmax_after_special": int(n.argmax[t]) in set(int(i) for i in special_ids.values()),
             "special_p_before": spb, "special_p_after": spn, "context": context_text(vocab, d.tokens, t),
             "target_text": tok_text(vocab, d.targets[t])}
        if penalty is not None and d.sha256 in penalty:
            pen = penalty[d.sha256]
            r["p_penalty"] = math.exp(pen["alone"].logp_target[t])
            if pen.get("stacked") is not None:
                r["p_stacked"] = math.exp(pen["stacked"].logp_target[t])
        rows.append(r)

    def agg(rs) -> dict:
        if not rs:
            return {"n": 0, "p_before": None, "p_after": None, "reduction": None, "residual_ratio": None}
        pb = _mean(r["p_before"] for r in rs)
        pa = _mean(r["p_after"] for r in rs)
        out = {"n": len(rs), "p_before": pb, "p_after": pa,
               "reduction": (1.0 - pa / pb) if pb else None, "residual_ratio": (pa / pb) if pb else None,
               "argmax_rejected_before": sum(r["argmax_before"] == by_sha[r["doc_sha256"]].targets[r["pos"]]
                                             for r in rs),
               "argmax_rejected_after": sum(r["argmax_after"] == by_sha[r["doc_sha256"]].targets[r["pos"]]
                                            for r in rs),
               "argmax_special_after": sum(r["argmax_after_special"] for r in rs),
               "special_p_before": _mean(r["special_p_before"] for r in rs),
               "special_p_after": _mean(r["special_p_after"] for r in rs)}
        if all("p_penalty" in r for r in rs):
            out["p_penalty"] = _mean(r["p_penalty"] for r in rs)
        if all("p_stacked" in r for r in rs):
            out["p_stacked"] = _mean(r["p_stacked"] for r in rs)
        return out

    phrases = list(dict.fromkeys(r["phrase"] for r in rows))
    boot = residual_intervals(rows)  # phrase / "(all)" -> residual_interval, n_docs (bootstrap over documents)
    return SlopFigures(
        **agg(rows), **boot[POOLED],
        fresh=agg([r for r in rows if not r["copy"]]),
        copies=agg([r for r in rows if r["copy"]]),
        per_phrase={p: {**agg([r for r in rows if r["phrase"] == p]), **boot[p],
                        "copies": sum(r["copy"] for r in rows if r["phrase"] == p)} for p in phrases},
        bootstrap=settings(),
        events=rows,
    )


# ----------------------------------------------------------------------------------------------------------
# collateral


def collateral_figures(collateral, by_sha: Mapping[str, DocResult], vocab, below: float) -> CollateralFigures:
    """Per word mean Δlog p(target) at ordinary uses (CollateralRecord list), the fraction below `below`, the
    worst occurrence with its context; pooled fraction."""
    rows = []
    for c, d in _located(collateral, by_sha):
        t = c.pos
        rows.append({"doc": d.path, "pos": t, "word": c.word, "dlogp": float(d.ps.dlogp[t]),
                     "p_before": math.exp(d.ps.base.logp_target[t]), "p_after": math.exp(d.ps.new.logp_target[t]),
                     "context": context_text(vocab, d.tokens, t)})
    per = {}
    for wd in dict.fromkeys(r["word"] for r in rows):
        rs = [r for r in rows if r["word"] == wd]
        x = np.array([r["dlogp"] for r in rs])
        worst = rs[int(x.argmin())]
        per[wd] = {"n": len(rs), "mean_dlogp": float(x.mean()), "n_below": int((x < below).sum()),
                   "frac_below": float((x < below).mean()), "worst": worst["dlogp"],
                   "worst_context": worst["context"], "worst_p": (worst["p_before"], worst["p_after"])}
    x = np.array([r["dlogp"] for r in rows])
    return CollateralFigures(n=len(rows), mean_dlogp=_mean(x), n_below=int((x < below).sum()) if x.size else 0,
                             frac_below=float((x < below).mean()) if x.size else None,
                             min_word_mean=min((v["mean_dlogp"] for v in per.values()), default=None),
                             per_word=per, rows=rows)


# ----------------------------------------------------------------------------------------------------------
# chat structure: (f) flips and turn ends, (g) ordinary tokens


FLIP_DAMAGE = "to-special"  # the failing kind
FLIP_OPENER = "to-special at a user-turn opener"
FLIP_FIX = "to-special = the true next token"
FLIP_TERMINAL = "to-special at a special target"
FLIP_OTHER_ROLE = "to-special at a system/tool/template position"
FLIP_AWAY = "away from special"


def flip_figures(docs: Iterable[DocResult], vocab, special_ids: Mapping[str, int]) -> FlipFigures:
    """Argmax flips involving a special token on every chat-formatted document, classified (seed §6.1–6.3):
    a flip TO a special token at a non-terminal assistant / think / user position that is not a user-turn
    opener is damage; opener flips, fixes (the special is the true next token), flips at other roles and flips
    AWAY from a special token are listed, not failed."""
    spec = set(int(i) for i in special_ids.values())
    flips, n_docs, n_pos = [], 0, 0
    for d in docs:
        if not d.is_chat:
            continue
        n_docs += 1
        n_pos += d.T
        b, n = d.ps.base.argmax, d.ps.new.argmax
        tg = d.targets
        for t in np.flatnonzero(b != n).tolist():
            to_s, from_s = int(n[t]) in spec, int(b[t]) in spec
            if not (to_s or from_s):
                continue
            if to_s:
                if int(d.role[t]) not in CHAT_ROLES:
                    kind = FLIP_OTHER_ROLE
                elif d.chat.opener[t]:
                    kind = FLIP_OPENER
                elif int(tg[t]) == int(n[t]):
                    kind = FLIP_FIX
                elif int(tg[t]) in spec:
                    kind = FLIP_TERMINAL
                else:
                    kind = FLIP_DAMAGE
            else:
                kind = FLIP_AWAY
            flips.append({"doc": d.path, "set": d.set, "pos": t, "kind": kind, "role": names.ROLES[int(d.role[t])],
                          "base": tok_text(vocab, b[t]), "new": tok_text(vocab, n[t]), "target": tok_text(vocab, tg[t]),
                          "context": context_text(vocab, d.tokens, t)})
    kinds = {}
    for f in flips:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    return FlipFigures(docs=n_docs, positions=n_pos, damage=kinds.get(FLIP_DAMAGE, 0), by_kind=kinds, flips=flips)


def _lost_margins(ps, t: int) -> dict:
    """Where <|im_end|> lost the argmax at row t: its base lead over the runner-up and how far the new argmax
    now leads it (nats, f64 log p; a tie of a few thousandths is lost by any edit, a wide lead is damage)."""
    base_lead = float(ps.base.top_logp[t, 0] - ps.base.top_logp[t, 1]) if ps.base.top_logp.shape[1] > 1 else None
    return {"base_lead": base_lead, "new_argmax": int(ps.new.argmax[t]),
            "new_deficit": float(ps.new.top_logp[t, 0] - ps.new.logp_target[t])}


def turn_end_figures(docs: Iterable[DocResult], special_ids: Mapping[str, int],
                     protected: frozenset | set = frozenset()) -> TurnEndFigures:
    """At real turn ends (target <|im_end|>): does <|im_end|> stay the argmax where it was; mean Δlog p of it.
    Turn ends in `protected` ((doc sha256, row) pairs the solver held fixed: in-sample) are left out of the
    figures and summarised apart under "protected"."""
    im_end = int(special_ids[names.IM_END])
    n, kept, was, dl, lost = 0, 0, 0, [], []
    pdl, plost = [], 0
    for d in docs:
        if not d.is_chat:
            continue
        for t in np.flatnonzero(d.chat.terminal).tolist():
            if (d.sha256, t) in protected:
                pdl.append(float(d.ps.dlogp[t]))
                plost += int(int(d.ps.base.argmax[t]) == im_end and int(d.ps.new.argmax[t]) != im_end)
                continue
            n += 1
            dl.append(float(d.ps.dlogp[t]))  # the target is <|im_end|>
            if int(d.ps.base.argmax[t]) == im_end:
                was += 1
                if int(d.ps.new.argmax[t]) == im_end:
                    kept += 1
                else:
                    lost.append({"doc": d.path, "pos": t, "dlogp": float(d.ps.dlogp[t]), **_lost_margins(d.ps, t)})
    return TurnEndFigures(n=n, was_argmax=was, kept=kept, lost=len(lost), lost_rows=lost, mean_dlogp=_mean(dl),
                          min_dlogp=min(dl, default=None),
                          protected={"n": len(pdl), "lost": plost, "mean_dlogp": _mean(pdl)})


def ordinary_figures(docs: Iterable[DocResult], special_ids: Mapping[str, int],
                     below: float = -0.1) -> OrdinaryFigures:
    """(g): on the given (held-out chat) documents, ordinary-token mean Δlog p (not a slop position, target
    not special) and the mean KLD over non-slop positions. Slop positions are the prefix-exact rows
    (l47.dumps.select.prefix_rows: the events and the near misses, where moving mass off the banned word is
    the intended effect) — the rows bar (e) reports apart and the solver never counts as background; they are
    reported apart here too (`prefix_rows`: their KLD and their targets' Δlog p), not judged."""
    spec = np.array(sorted(set(int(i) for i in special_ids.values())), dtype=np.int64)
    dl, kl, pk, pdl, n_doc = [], [], [], [], 0
    for d in docs:
        n_doc += 1
        non_slop = ~d.slop_rows  # [T]
        ordinary = non_slop & ~np.isin(d.targets, spec)  # [T]
        dl.append(d.ps.dlogp[ordinary])
        kl.append(d.ps.kld[non_slop])
        pk.append(d.ps.kld[d.slop_rows])
        pdl.append(d.ps.dlogp[d.slop_rows])
    x = np.concatenate(dl) if dl else np.zeros(0)
    k = np.concatenate(kl) if kl else np.zeros(0)
    pre_k = np.concatenate(pk) if pk else np.zeros(0)
    return OrdinaryFigures(docs=n_doc, n_ordinary=int(x.size), mean_dlogp=_mean(x),
                           median_dlogp=float(np.median(x)) if x.size else None,
                           frac_below=float((x < below).mean()) if x.size else None, n_non_slop=int(k.size),
                           kld=_mean(k),
                           prefix_rows={"n": int(pre_k.size), "kld_mean": _mean(pre_k),
                                        "target_dlogp_mean": _mean(np.concatenate(pdl) if pdl else np.zeros(0))})


def special_mass_figures(events, by_sha: Mapping[str, DocResult]) -> SpecialMassFigures:
    """Mean total probability of the special tokens at slop event positions, before and after, per split."""
    acc: dict[str, tuple[list, list]] = {}
    for e in events:
        d = by_sha.get(e.doc_sha256)
        if d is None:
            continue
        a = acc.setdefault(e.set, ([], []))
        a[0].append(float(np.exp(d.ps.base.set_logp[SPECIAL][e.pos]).sum()))
        a[1].append(float(np.exp(d.ps.new.set_logp[SPECIAL][e.pos]).sum()))
    out = {s: {"n": len(b), "before": _mean(b), "after": _mean(a), "rise": _mean(a) - _mean(b)}
           for s, (b, a) in acc.items()}
    return SpecialMassFigures(per_split=out, max_rise=max((v["rise"] for v in out.values()), default=None))
