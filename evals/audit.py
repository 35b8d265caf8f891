"""`l47 audit BUNDLE.gguf --base BASE.gguf --experiment EXP.toml`: the bars of DESIGN §6 on the real network.

Orchestration only; the figures are pure functions (l47.evals.metrics), the bars are data (l47.evals.bars), the
files are written by l47.evals.report / l47.evals.plots. Order of work, so that bad input never leaves a report
and a blind document is never scored by a run that will be refused:
    1. refuse an unwritable output directory, a corrupt ledger, missing dumps (load_experiment), a bundle or a
       solve record for another model — before anything is scored;
    2. blind sign-off only: refuse a bundle whose sha256 is not the dev report's, a blind document already in a
       ledger / the dev report / the solve record, a blind document that is not a chat — before scoring it;
    3. score every document once (base and bundle in one exact pass each), compute the figures, run the bars;
    4. append every scored document to the ledger(s) (the blind document is burned from here on);
    5. write report.json / report.md / positions.tsv / plots into a staging folder, then move them in.
Exit code: 0 only when every applicable bar passes.

Notation for array shapes: T positions of a document (row t predicts tokens[t+1]); F final tokens of the banned
tuples; V vocabulary. Precision: f32 forward, f64 reductions (l47.tail.forward); ‖ΔW‖ in f64.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import l47
from l47.data.experiment import SCORED_SETS, SOLVER_SETS, Experiment, Thresholds, load_experiment
from l47.data.identity import other_model_notes, other_model_stamp
from l47.data.ledger import EV_BLIND_STARTED, EV_BLIND_VERDICT, Ledger, default_ledger_path, dump_content_hashes
from l47.data.record import (STOP_ITERATION_CAP, TERM_ANCHOR, TERM_BACKGROUND, TERM_SLOP, AnchorClaims, PRejected,
                             SolveClaims, SolveRecord, claim_name, read_record, record_path_for)
from l47.data.sets import (HANDOFF_SOLVE, EventRecord, SetsReport, blind_event_counts, build_sets, check_handoff,
                           content_sha256, experiment_content, is_scored_set, sampler_wider)
from l47.dumps import doc_hash, read_dump
from l47.dumps.select import (PhraseTuples, WindowIndex, chat_structure, content_ids, find_events, occurrences,
                              phrases_to_tuples, prefix_rows, provenance_reasons)
from l47.errors import L47Error
from l47.evals import bars as B
from l47.evals.figures import (BlindFigures, BundleFigures, CheapFormFigures, ClaimsFigures, CountFigures,
                               EngineFigures, FlipFigures, OrdinaryFigures, PenaltyFigures, ProxyFigures, RecordFigures,
                               SetKld, SlopFigures, SplitFigures, TurnEndFigures, figures_dict, is_figures)
from l47.evals.kld_stats import kld_stats_of_pairs
from l47.evals.metrics import (DocResult, Scoring, collateral_figures, flip_figures, load_vocab, ordinary_figures,
                               proxy_figures, score_document, slop_figures, special_mass_figures, top_k_of,
                               turn_end_figures)
from l47.evals.penalty import (DEFAULT_BIAS, FORM_LAST, FORM_SEED, DocPenalty, PenaltySpec, make_spec,
                               penalise_document, simulate)
from l47.evals.report import write_reports
from l47.fileio import read_json, write_text_atomic
from l47.model import names
from l47.model.gguf_io import GGUFFile, open_gguf, tensors_equal_bytes
from l47.model.vocab import Vocab
from l47.model.weights import TailWeights, check_dump_dims, edited_weight, load_tail_weights
from l47.tail.forward import head_chunk, mix_of_dump

AUDIT_SCHEMA = "l47.audit/1"
CLAIM_TOL_ABS, CLAIM_TOL_REL = 1e-4, 1e-3
# the record's claims (l47.data.record.SolveClaims field paths) the audit re-derives -> definition; a path of three
# parts (per phrase) takes the definition of its first two. Claims not listed here are shown as not re-derived.
CLAIM_DEFINITIONS = {
    ("dW_rel_norm",): "‖ΔW‖/‖W‖ of the runtime weights after re-quantisation",
    ("blocks_changed",): "Q8_0 blocks of the target whose bytes differ from the base",
    ("train_p_rejected", "before"): "mean base p(rejected) at the record's slop positions",
    ("train_p_rejected", "after"): "mean bundle p(rejected) at the record's slop positions",
    ("train_p_rejected", "n"): "number of slop positions in the record",
    ("train_p_rejected", "per_phrase_before"): "per phrase, at the record's slop positions",
    ("train_p_rejected", "per_phrase_after"): "per phrase, at the record's slop positions",
    ("dev_p_rejected", "before"): "mean base p(rejected) at dev events",
    ("dev_p_rejected", "after"): "mean bundle p(rejected) at dev events",
    ("dev_p_rejected", "n"): "number of dev events",
    ("dev_p_rejected", "per_phrase_before"): "per phrase, at dev events",
    ("dev_p_rejected", "per_phrase_after"): "per phrase, at dev events",
    ("background_kl_exact",): "mean KL(base ‖ bundle) at the record's background positions",
    ("anchors", "n"): "number of anchor positions in the record",
    ("anchors", "max_abs_dlogp_shipped"): "max |Δlog p(target)| at the record's anchor positions",
}


@dataclass(frozen=True)
class AuditArgs:
    bundle: Path
    base: Path
    experiment: Path
    out_dir: Path
    blind: tuple[Path, ...] = ()  # the blind set (dumps) for the sign-off: one document or several, each fresh
    dev_report: Path | None = None  # report.json of the dev audit of the same bundle
    ledger: Path | None = None  # default: the base model's ledger (l47.data.ledger.default_ledger_path)
    policy: str = "strata"
    device: str = "cpu"
    record: Path | None = None  # default: <bundle>.solve.json
    engine_dumps: tuple[Path, ...] = ()  # dumps made by the engine running the transplanted bundle
    penalty_bias: float = DEFAULT_BIAS
    plots: bool = True
    allow_unverified: bool = False  # dumps without engine logits: n/a for the zero-proxy bar, report "unverified"
    allow_other_model: bool = False  # dumps of another model (refused before by the CLI): listed and stamped
    precision: str | None = None  # head GEMM precision (l47.model.weights.head_precision); None: "auto"

    def __post_init__(self):  # one path (or None) is a blind set of one (or none)
        b = self.blind
        object.__setattr__(self, "blind", () if b is None else (Path(b),) if isinstance(b, (str, Path))
                           else tuple(Path(x) for x in b))


@dataclass(frozen=True)
class AuditReport:
    passed: bool
    exit_code: int
    mode: str
    bars: tuple
    out_dir: str
    files: dict
    bundle_sha256: str
    report: dict = field(repr=False, default_factory=dict)


# ----------------------------------------------------------------------------------------------------------
# small helpers


def toolkit_version() -> str:
    if getattr(l47, "__version__", None):
        return str(l47.__version__)
    try:
        return version("l47")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0+unknown"


def _file_sha(path: Path) -> str:
    return doc_hash(path)


def _content_hashes(paths) -> dict[str, str]:
    """path -> the document's identity (sha256 of its token ids), for dumps."""
    return dump_content_hashes(paths)


def _check_out_dir(out: Path) -> None:
    """Refuse an output directory that cannot be created or written, before any work. Creates nothing: a refused
    or failed audit leaves no folder behind (the report writer makes it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise L47Error(out, "output directory", "a folder (or a new path)", "an existing file")
    anc = Path(os.path.abspath(out))
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
        raise L47Error(out, "output directory", "a directory this user can create and write",
                       f"{anc} is {'not writable' if anc.is_dir() else 'a file'}")


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(type(o).__name__)


def clean(o):
    """JSON-safe copy: NaN/inf -> None, numpy -> python, tuples -> lists, a family of figures (l47.evals.figures)
    -> its dict (the JSON boundary: figures_dict)."""
    if is_figures(o):
        return clean(figures_dict(o))
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if isinstance(o, (np.floating, float)):
        f = float(o)
        return f if math.isfinite(f) else None
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return clean(o.tolist())
    if isinstance(o, Path):
        return str(o)
    return o


# ----------------------------------------------------------------------------------------------------------
# the bundle


def _scope_claims(kv: dict) -> dict[str, set[str]]:
    """Provenance keys that name tensors (target / scope / tensors / edited / changed) -> set of names."""
    out = {}
    for k, v in kv.items():
        if not k.startswith(names.PROVENANCE_PREFIX):
            continue
        short = k[len(names.PROVENANCE_PREFIX):]
        if short not in ("target", "scope", "tensors", "edited", "changed"):
            continue
        vals = v
        if isinstance(v, str):
            try:
                vals = json.loads(v)
            except ValueError:
                vals = [v]
        if isinstance(vals, str):
            vals = [vals]
        out[short] = {str(x) for x in vals} if isinstance(vals, list) else {str(vals)}
    return out


def refuse_other_model(base_g: GGUFFile, bundle_g: GGUFFile, target: str, record: SolveRecord | None) -> None:
    """L47Error for a bundle (or solve record) made for another model: provenance base hash, record base hash,
    a tensor whose shape differs from the base's, no target tensor."""
    basesha = base_g.sha256()
    for key in (names.PROVENANCE_PREFIX + "overlay_of", names.PROVENANCE_PREFIX + "base_sha256"):
        v = bundle_g.kv.get(key)
        if isinstance(v, str) and v and v != basesha:
            raise L47Error(bundle_g.path, f"metadata {key}", f"the base's sha256 {basesha[:16]}… (a bundle for this "
                           "model)", f"{v[:16]}… (a bundle for another model)")
    if record is not None and record.base_sha256 and record.base_sha256 != basesha:
        raise L47Error(bundle_g.path, "solve record base_sha256", f"{basesha[:16]}… (the base given)",
                       f"{record.base_sha256[:16]}… (solved against another model)")
    if target not in bundle_g.tensors:
        raise L47Error(bundle_g.path, f"tensor {target}", "present (the edited tensor of this model's last layer)",
                       "missing (a bundle for another model?)")
    for name, ti in bundle_g.tensors.items():
        bi = base_g.tensors.get(name)
        if bi is not None and tuple(bi.shape) != tuple(ti.shape):
            raise L47Error(bundle_g.path, f"tensor {name}", f"shape {bi.shape} as in the base (a bundle for this "
                           "model)", f"{ti.shape} (a bundle for another model)")


def bundle_figures(base_g: GGUFFile, bundle_g: GGUFFile, w: TailWeights, W_new: torch.Tensor,
                   record: SolveRecord | None) -> BundleFigures:
    """Compare every tensor and metadata key of the bundle with the base; ‖ΔW‖/‖W‖; scope claims.
    Call `refuse_other_model` first."""
    target = w.target
    bsha = bundle_g.sha256()
    basesha = base_g.sha256()
    others, tgt_ts, compared, target_changed = [], [], 0, False
    for name, ti in bundle_g.tensors.items():
        if name not in base_g.tensors:
            others.append(f"{name}: not a tensor of the base")
            continue
        bi = base_g.tensors[name]
        compared += 1
        if bi.ggml_type != ti.ggml_type:
            (tgt_ts if name == target else others).append(f"{name}: type {bi.type_name} → {ti.type_name}")
            target_changed |= name == target
        elif not tensors_equal_bytes(base_g, bundle_g, name):
            if name == target:
                target_changed = True
            else:
                others.append(f"{name}: bytes differ")
    form = "full" if set(base_g.tensors) <= set(bundle_g.tensors) else "overlay"
    changed_kv, omitted = [], []
    for k, v in bundle_g.kv.items():
        if k.startswith(names.PROVENANCE_PREFIX):
            continue
        if k not in base_g.kv:
            changed_kv.append(f"{k}: added")
        elif v != base_g.kv[k]:
            changed_kv.append(f"{k}: {str(base_g.kv[k])[:40]!r} → {str(v)[:40]!r}")
    for k in base_g.kv:
        if k not in bundle_g.kv:
            (omitted if form == "overlay" else changed_kv).append(f"{k}: removed" if form == "full" else k)
    # ΔW of the runtime weights (what the forward uses), f64
    W0 = w.W_sd.cpu().double()  # on the CPU: MPS has no float64
    dW = W_new.cpu().double() - W0
    dw_fro = float(dW.norm())
    dw_rel = dw_fro / float(W0.norm())
    blocks = None
    if target in bundle_g.tensors and base_g.info(target).ggml_type == bundle_g.info(target).ggml_type:
        ra, rb = np.asarray(base_g.raw(target)), np.asarray(bundle_g.raw(target))

        try:
            ts = GGML_QUANT_SIZES[GGMLQuantizationType(base_g.info(target).ggml_type)][1]
            blocks = int((ra.reshape(-1, ts) != rb.reshape(-1, ts)).any(1).sum())
        except (ValueError, KeyError):
            blocks = None
    changed_set = ({target} if target_changed else set()) | {o.split(":")[0] for o in others}
    claims = _scope_claims(bundle_g.kv)
    mism = [f"provenance {k} = {sorted(v)} but the tensors changed are {sorted(changed_set)}"
            for k, v in claims.items() if v != changed_set]
    if record is not None:
        if record.target != target:
            mism.append(f"solve record target {record.target!r} is not the audited target {target!r}")
        if record.target not in changed_set:
            mism.append(f"solve record target {record.target!r} did not change")
        if record.bundle_sha256 and record.bundle_sha256 != bsha:
            mism.append(f"solve record bundle_sha256 {record.bundle_sha256[:16]}… is not this bundle's {bsha[:16]}… "
                        "(modified after the solve, or another solve's record)")
    return BundleFigures(form=form, target=target, compared=compared, others_changed=others,
                         target_type_shape=tgt_ts, target_changed=target_changed,
                         dw_rel=dw_rel if target_changed else 0.0, dw_fro=dw_fro, blocks_changed=blocks,
                         metadata_changed=changed_kv, metadata_omitted=omitted,
                         scope_claims={k: sorted(v) for k, v in claims.items()}, scope_mismatches=mism,
                         sha256=bsha, base_sha256=basesha)


# ----------------------------------------------------------------------------------------------------------
# the solve record: (a), (b), overlap, claims


def _experiment_overlaps(overlaps) -> list[dict]:
    """The experiment's own copies and near-duplicates (by content; l47.data.sets): a training document and a
    scored one that are one document."""
    out = []
    for o in overlaps:
        sides = {o.set, o.with_set}
        if any(is_scored_set(x) for x in sides) and sides - {x for x in sides if is_scored_set(x)}:
            out.append({"doc_sha256": o.doc_sha256, "scored_set": o.set if is_scored_set(o.set) else o.with_set,
                        "in": f"experiment set {o.with_set if is_scored_set(o.set) else o.set} ({o.kind}"
                              + (f", {o.window} content tokens shared" if o.kind == "window" else "") + ")",
                        "path": o.path, "with_path": o.with_path})
    return out


def record_figures(ctx: AuditContext, scored_shas: dict[str, str], solver_shas: dict[str, str]) -> RecordFigures:
    """Bars (a), (b) and (c)'s disjointness against the solve record: every slop position prefix-exact and an
    event, the training documents natural, no record document among the scored ones."""
    record, record_path, by_sha, pts, vocab = ctx.record, ctx.record_path, ctx.by_sha, ctx.pts, ctx.vocab
    thr, overlaps = ctx.th.non_event_p, ctx.sets_rep.overlaps
    doc_sets = {dr.sha256: {"set": dr.set, "path": dr.path, "refused": dr.refused, "reasons": dr.reasons}
                for dr in ctx.sets_rep.docs}
    overlap = _experiment_overlaps(overlaps)
    if record is None:
        return RecordFigures(present=False, why=f"no solve record at {record_path}", overlap=overlap or None)
    slop = [t for t in record.touched if t.term == TERM_SLOP]
    bad, non_ev, docs = [], [], {}
    by_final: dict[int, list[tuple[int, ...]]] = {}
    for pt in pts:
        for tup in pt.tuples:
            by_final.setdefault(int(tup[-1]), []).append(tuple(int(i) for i in tup))
    for t in slop:
        d = by_sha.get(t.doc_sha256)
        item = {"doc_sha256": t.doc_sha256, "pos": t.pos, "token": t.token, "phrase": t.phrase}
        if d is None:
            bad.append({**item, "why": "document not among the experiment's documents (cannot be verified)"})
            continue
        docs.setdefault(t.doc_sha256, d)
        if not 0 <= t.pos < d.T:
            bad.append({**item, "why": f"position outside the document (T = {d.T})"})
            continue
        tok = d.tokens
        ok = int(tok[t.pos + 1]) == int(t.token) and any(
            t.pos + 1 - (len(u) - 1) >= 0 and tuple(int(x) for x in tok[t.pos + 1 - (len(u) - 1):t.pos + 1]) == u[:-1]
            for u in by_final.get(int(t.token), []))
        if not ok:
            why = ("the target is not the rejected token" if int(tok[t.pos + 1]) != int(t.token) else
                   "the preceding tokens are not a banned prefix ending in this token")
            bad.append({**item, "why": why, "context": vocab.decode(tok[max(0, t.pos - 11):t.pos + 1].tolist()),
                        "target": vocab.decode([int(tok[t.pos + 1])])})
        cols = list(d.ps.base.set_logp.get("finals", np.zeros((d.T, 0))).shape)
        if int(tok[t.pos + 1]) == int(t.token):
            p = math.exp(d.ps.base.logp_target[t.pos])
        else:
            p = math.nan
            fin = sorted(by_final)
            if int(t.token) in fin and cols[1] == len(fin):
                p = math.exp(d.ps.base.set_logp["finals"][t.pos, fin.index(int(t.token))])
        if not (p >= thr):
            non_ev.append({**item, "p_base": p, "claimed_p": t.base_p})
    unnatural, training = [], []
    for sha in docs:
        info = doc_sets.get(sha, {})
        training.append({"doc_sha256": sha, "set": info.get("set"), "path": info.get("path")})
        if info.get("set") != "train":
            unnatural.append({"doc_sha256": sha, "path": info.get("path"),
                              "why": f"in set {info.get('set')!r}, not an accepted train document"})
        elif info.get("refused"):
            unnatural.append({"doc_sha256": sha, "path": info.get("path"), "why": "; ".join(info.get("reasons", ()))})
    rec_docs = {i.sha256: f"record input ({i.set})" for i in record.inputs
                if not (i.set in SCORED_SETS or i.set.startswith("kld."))}
    for t in record.touched:
        rec_docs.setdefault(t.doc_sha256, f"record touched ({t.term})")
    for sha, how in rec_docs.items():
        if sha in scored_shas:
            n_pos = sum(1 for t in record.touched if t.doc_sha256 == sha)
            overlap.append({"doc_sha256": sha, "scored_set": scored_shas[sha], "in": how, "touched_positions": n_pos})
    bg = [t for t in record.touched if t.term == TERM_BACKGROUND]
    return RecordFigures(present=True, path=str(record_path), method=record.method, n_slop=len(slop),
                         n_terms={k: sum(1 for t in record.touched if t.term == k) for k in
                                  sorted({t.term for t in record.touched})},
                         not_prefix_exact=bad, non_events=non_ev, unnatural_docs=unnatural, training_docs=training,
                         overlap=overlap, slop_positions=[(t.doc_sha256, t.pos) for t in slop],
                         background_positions=[(t.doc_sha256, t.pos) for t in bg])


def rederive_claims(record: SolveRecord, rec: RecordFigures, by_sha: dict[str, DocResult], dev_events,
                    bundle: BundleFigures) -> SolveClaims:
    """The SolveClaims the audit's own forward gives at the record's positions (None where it cannot)."""
    def p_rejected(triples) -> PRejected | None:
        got = [(ph, by_sha[s].ps, pos) for s, pos, ph in triples if s in by_sha and 0 <= pos < by_sha[s].T]
        if not got:
            return None
        b = [(ph, math.exp(ps.base.logp_target[pos])) for ph, ps, pos in got]
        a = [(ph, math.exp(ps.new.logp_target[pos])) for ph, ps, pos in got]

        def per(xs):
            return {ph: float(np.mean([x for p, x in xs if p == ph])) for ph in sorted({p for p, _ in xs})}

        return PRejected(before=float(np.mean([x for _, x in b])), after=float(np.mean([x for _, x in a])),
                         n=len(triples), per_phrase_before=per(b), per_phrase_after=per(a))

    bg = [by_sha[s].ps.kld[p] for s, p in rec.background_positions or [] if s in by_sha and 0 <= p < by_sha[s].T]
    an = [(t.doc_sha256, t.pos) for t in record.touched if t.term == TERM_ANCHOR]
    dl = [abs(by_sha[s].ps.dlogp[p]) for s, p in an if s in by_sha and 0 <= p < by_sha[s].T]
    return SolveClaims(
        dW_rel_norm=bundle.dw_rel, blocks_changed=bundle.blocks_changed,
        train_p_rejected=p_rejected([(t.doc_sha256, t.pos, t.phrase) for t in record.touched if t.term == TERM_SLOP]),
        dev_p_rejected=p_rejected([(e.doc_sha256, e.pos, e.phrase) for e in dev_events]),
        background_kl_exact=float(np.mean(bg)) if bg else None,
        anchors=AnchorClaims(n=len(an), max_abs_dlogp_shipped=float(max(dl)) if dl else None) if an else None)


def claims_figures(record: SolveRecord | None, rec: RecordFigures, by_sha: dict[str, DocResult], dev_events,
                   bundle: BundleFigures) -> ClaimsFigures:
    """Re-derive the record's claimed figures with the audit's own forward (rederive_claims) and compare, field
    by field (CLAIM_DEFINITIONS)."""
    if record is None:
        return ClaimsFigures(present=False, why=rec.why)
    mine = dict(rederive_claims(record, rec, by_sha, dev_events, bundle).flat())
    compared, mism, not_re = {}, [], []
    for path, v in sorted(record.claims.flat(), key=lambda kv: claim_name(kv[0])):
        name, a = claim_name(path), mine.get(path)
        if a is None or isinstance(v, bool) or not isinstance(v, (int, float, str)):
            not_re.append(name)
            continue
        if isinstance(a, str) or isinstance(v, str):
            ok = str(a) == str(v)
        else:
            ok = abs(float(v) - float(a)) <= CLAIM_TOL_ABS + CLAIM_TOL_REL * abs(float(a))
        definition = CLAIM_DEFINITIONS.get(path) or CLAIM_DEFINITIONS.get(path[:2], "")
        compared[name] = {"claimed": v, "rederived": a, "ok": ok, "definition": definition}
        if not ok:
            mism.append(name)
    mism += _base_p_mismatches(record, by_sha)
    conv = convergence_problems(record)
    mism += conv["unexplained"]
    rederived = {**{claim_name(p): v for p, v in mine.items()}, "bundle_sha256": bundle.sha256}
    return ClaimsFigures(present=True, compared=compared, mismatched=mism, not_rederived=not_re, rederived=rederived,
                         convergence=conv)


EXPLAIN_PREFIX = "convergence:"  # a record note starting with this explains a capped / infeasible solve


def convergence_problems(record) -> dict:
    """A solve that stopped at its iteration cap, or whose max constraint violation exceeds the tolerance it
    was held to, claims a solution it did not reach: listed as unexplained (failing the claims bar) unless the
    record explains it. An explanation is a note starting "convergence:" with its reason; a stop at the
    iteration cap needs the figures beside it — the iterations run and the dev residual per phrase at the stop
    (claims.dev_p_rejected, re-derived by this audit) — never a bare note. Reported with those figures."""
    c = getattr(record.claims, "convergence", None)
    issues = []
    if c is not None:
        if c.stop_reason == STOP_ITERATION_CAP:
            issues.append(f"convergence.stop_reason = {STOP_ITERATION_CAP} after {c.iterations} iterations")
        if c.max_violation is not None and c.violation_tol is not None and c.max_violation > c.violation_tol:
            issues.append(f"convergence.max_violation {c.max_violation:.3g} > violation_tol {c.violation_tol:.3g}")
    notes = [n for n in record.notes if str(n).strip().lower().startswith(EXPLAIN_PREFIX)]
    reason = next((n.strip()[len(EXPLAIN_PREFIX):].strip() for n in notes if n.strip()[len(EXPLAIN_PREFIX):].strip()),
                  "")
    figures = {"iterations": None if c is None else c.iterations,
               "dev_residual_per_phrase": dev_residual_per_phrase(record.claims.dev_p_rejected), "reason": reason}
    missing = [] if reason else ["the reason (a note \"convergence: <why>\")"]
    if c is not None and c.stop_reason == STOP_ITERATION_CAP:
        missing += [k for k, v in (("the iterations run (claims.convergence.iterations)", figures["iterations"]),
                                   ("the dev residual per phrase at the stop (claims.dev_p_rejected per phrase)",
                                    figures["dev_residual_per_phrase"])) if not v]
    explained = bool(notes) and not missing
    return {"stop_reason": None if c is None else c.stop_reason, "issues": issues, "explanations": notes,
            "figures": figures, "missing": missing if issues else [],
            "unexplained": [] if explained or not issues else
            [f"{x} (explanation lacks {', '.join(missing)})" if notes else x for x in issues]}


def dev_residual_per_phrase(dev) -> dict[str, float]:
    """phrase -> mean p after / mean p before at its dev events (a PRejected's per-phrase figures); {} when the
    record claims none."""
    if dev is None:
        return {}
    b, a = dev.per_phrase_before or {}, dev.per_phrase_after or {}
    return {ph: a[ph] / b[ph] for ph in sorted(b) if ph in a and b[ph]}


def _base_p_mismatches(record, by_sha: dict[str, DocResult]) -> list[str]:
    """The base p each record term claims at its position, against the audit's base pass."""
    bad_p = 0
    for t in record.touched:
        if t.base_p is None or t.doc_sha256 not in by_sha:
            continue
        d = by_sha[t.doc_sha256]
        if 0 <= t.pos < d.T and int(d.tokens[t.pos + 1]) == int(t.token):
            p = math.exp(d.ps.base.logp_target[t.pos])
            if abs(p - t.base_p) > CLAIM_TOL_ABS + CLAIM_TOL_REL * p:
                bad_p += 1
    return [f"touched.base_p ({bad_p} positions)"] if bad_p else []


# ----------------------------------------------------------------------------------------------------------
# engine-level checks


def _engine_figures(args: AuditArgs, w: TailWeights, by_sha: dict[str, DocResult],
                    doc_paths: dict[str, str]) -> EngineFigures:
    """Edited-engine dumps (made by the engine running the transplanted bundle) matched to experiment documents
    by token sequence: their log p vs the tail forward's edited prediction, and engine-level KLD where both
    dumps hold ref_logits, beside the floor KL(engine base ‖ exact forward base)."""
    if not args.engine_dumps:
        return EngineFigures()
    by_tokens = {d.tokens.tobytes(): d for d in by_sha.values()}
    zp, kld_sets = {}, {}
    acc: dict[str, dict[str, list]] = {}
    for p in args.engine_dumps:
        e = read_dump(p)
        check_dump_dims(w, e.meta, str(p))
        d = by_tokens.get(np.asarray(e.tokens, dtype=np.int64).tobytes())
        if d is None:
            raise L47Error(p, "tokens", "the token sequence of one of the experiment's documents (an engine run on "
                           "the transplanted bundle over the same text)", "no match")
        if e.ref_logp is not None:
            ln = d.ps.new.logp_target
            rel = np.abs(np.asarray(e.ref_logp, np.float64) - ln) / np.maximum(1.0, np.abs(ln))
            zp[str(p)] = {"doc": d.path, "max_rel": float(rel.max()), "mean_abs": float(np.abs(e.ref_logp - ln).mean())}
        if e.ref_logits is not None:
            b = read_dump(doc_paths[d.sha256])
            if b.ref_logits is None:
                continue
            kl_e = _kl_rows(np.asarray(b.ref_logits), np.asarray(e.ref_logits))  # [T]

            with torch.no_grad():
                mix = mix_of_dump(b, w)  # [T, n]
                floor = []
                for r0 in range(0, b.T, 64):
                    z = head_chunk(mix[r0:r0 + 64], w, 0, w.V).cpu().double().numpy()  # [t, V]
                    floor.append(_kl_rows(np.asarray(b.ref_logits[r0:r0 + 64]), z))
            a = acc.setdefault(d.set, {"kld": [], "floor": [], "tail": []})
            a["kld"].append(kl_e)
            a["floor"].append(np.concatenate(floor))
            a["tail"].append(d.ps.kld)
    for s, a in acc.items():
        kld_sets[s] = {"kld": float(np.concatenate(a["kld"]).mean()), "floor": float(np.concatenate(a["floor"]).mean()),
                       "tail_kld": float(np.concatenate(a["tail"]).mean())}
    return EngineFigures(zero_proxy_edited=zp, kld=kld_sets)


def _kl_rows(za: np.ndarray, zb: np.ndarray) -> np.ndarray:
    """KL(softmax(za) ‖ softmax(zb)) per row, f64 ([t, V] each, any float dtype)."""
    za = np.asarray(za, dtype=np.float64)
    zb = np.asarray(zb, dtype=np.float64)
    la = za - za.max(1, keepdims=True)
    la -= np.log(np.exp(la).sum(1, keepdims=True))
    lb = zb - zb.max(1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(1, keepdims=True))
    return np.maximum((np.exp(la) * (la - lb)).sum(1), 0.0)


# ----------------------------------------------------------------------------------------------------------
# penalty simulation over the scored documents


@dataclass
class _CheapTally:
    """One cheaper penalty form's extra hits over the exact form, summed over the documents -> CheapFormFigures."""

    positions: int = 0
    pairs: int = 0
    target_hit: int = 0
    dlogp: list = field(default_factory=list)  # per document: [extra rows] f64 Δ log p(target)
    kld: list = field(default_factory=list)  # per document: [extra rows] f64 KL(base ‖ base + cheap penalty)
    examples: list = field(default_factory=list)  # the first 5 extra rows

    def add(self, d: DocResult, dp: DocPenalty, form: str, spec: PenaltySpec, vocab: Vocab) -> None:
        h, cm = dp.extra[form]  # ExtraHits, the cheap form's mask [T, F]
        self.positions += h.positions
        self.pairs += h.pairs
        self.target_hit += h.target_hit
        rows = (cm & ~dp.mask).any(1)  # [T]
        if not rows.any():
            return
        cs = simulate(d.ps.base, d.targets, cm, list(spec.finals), spec.bias)
        self.dlogp.append(cs.logp_target[rows] - d.ps.base.logp_target[rows])
        self.kld.append(cs.kld_vs_base[rows])
        for t in np.flatnonzero(rows)[:max(0, 5 - len(self.examples))].tolist():
            self.examples.append({"doc": d.path, "pos": t,
                                  "context": vocab.decode(d.tokens[max(0, t - 8):t + 1].tolist()),
                                  "target": vocab.decode([int(d.targets[t])]),
                                  "dlogp_target": float(cs.logp_target[t] - d.ps.base.logp_target[t])})

    def figures(self) -> CheapFormFigures:
        x = np.concatenate(self.dlogp) if self.dlogp else np.zeros(0)
        k = np.concatenate(self.kld) if self.kld else np.zeros(0)
        return CheapFormFigures(positions=self.positions, pairs=self.pairs, target_hit=self.target_hit,
                                examples=self.examples, mean_dlogp_target=float(x.mean()) if x.size else None,
                                min_dlogp_target=float(x.min()) if x.size else None,
                                mean_kld=float(k.mean()) if k.size else None)


def _penalty_figures(spec: PenaltySpec, docs: list[DocResult], vocab: Vocab) -> tuple[PenaltyFigures, dict]:
    """The penalty of `spec` on every scored document -> (its figures, {doc sha256: {"alone", "stacked"}
    simulations} for the slop table and positions.tsv)."""
    sims, per_set = {}, {}
    unchanged, pen_rows, max_abs_alone, max_abs_stacked = 0, 0, 0.0, 0.0
    cheap = {FORM_LAST: _CheapTally(), FORM_SEED: _CheapTally()}
    for d in docs:
        dp = penalise_document(spec, d.tokens, d.ps.base, d.ps)
        alone, stacked, off = dp.alone, dp.stacked, dp.unchanged
        sims[d.sha256] = {"alone": alone, "stacked": stacked}
        unchanged += int(off.sum())
        pen_rows += int((~off).sum())
        if off.any():
            max_abs_alone = max(max_abs_alone, float(np.abs(alone.logp_target[off] - d.ps.base.logp_target[off]).max()))
            max_abs_stacked = max(max_abs_stacked,
                                  float(np.abs(stacked.logp_target[off] - d.ps.new.logp_target[off]).max()))
        ps = per_set.setdefault(d.set, {"kl": [], "rows": 0})
        ps["kl"].append(alone.kld_vs_base)
        ps["rows"] += int((~off).sum())
        for form, tally in cheap.items():
            tally.add(d, dp, form, spec, vocab)
    rules = [{"phrase": r.phrase, "prefix": list(r.prefix), "token": r.token,
              "text": vocab.decode(list(r.prefix) + [r.token])} for r in spec.rules]
    fig = PenaltyFigures(
        bias=spec.bias, form=spec.form, rules=rules, penalised_rows=pen_rows, unchanged_rows=unchanged,
        unchanged_max_abs_dlogp_alone=max_abs_alone, unchanged_max_abs_dlogp_stacked=max_abs_stacked,
        kld_alone_per_set={s: {"mean": float(np.concatenate(v["kl"]).mean()), "penalised_rows": v["rows"]}
                           for s, v in per_set.items()},
        cheap_forms={form: tally.figures() for form, tally in cheap.items()})
    return fig, sims


# ----------------------------------------------------------------------------------------------------------
# blind pre-checks


def _read_dev_report(path: Path) -> dict:
    rep = read_json(path, "dev report", "the report.json of the dev audit")
    if rep.get("schema") != AUDIT_SCHEMA or rep.get("mode") != B.MODE_DEV:
        raise L47Error(path, "schema / mode", f"{AUDIT_SCHEMA} of a dev audit", f"{rep.get('schema')!r} / "
                       f"{rep.get('mode')!r}")
    try:
        rep["inputs"]["bundle"]["sha256"]
    except (KeyError, TypeError):
        raise L47Error(path, "inputs.bundle.sha256", "the audited bundle's hash", "missing") from None
    if (rep.get("slop") or {}).get("heldout", {}).get("residual_ratio") is None:
        raise L47Error(path, "slop.heldout.residual_ratio", "the dev held-out residual ratio", "missing")
    return rep


def _blind_prechecks(args, bsha: str, record, exp, ledgers, special_ids, model_sha256: str,
                     window: int) -> tuple[dict, tuple[str, ...]]:
    """Everything that must hold before the blind set is scored. Returns (dev report, each blind doc's sha).
    Per document, by content (the sha256 of its tokens): in no ledger (any command, any event), no document of the
    dev report, no input or touched document of the solve record, no document of the experiment, no other document
    of the blind set, and no `window` content tokens shared with any of the experiment's documents. The model's own
    generation (assistant turns `generated` by this model, sampler recorded) from a prompt held back from every
    set; a chat with turns, a <think> block and real turn ends."""
    if args.dev_report is None:
        raise L47Error("audit", "--dev", "the dev report (report.json) of the same bundle with --blind", "none")
    dev = _read_dev_report(args.dev_report)
    dsha = dev["inputs"]["bundle"]["sha256"]
    if dsha != bsha:
        raise L47Error(args.bundle, "sha256", f"{dsha} (the bundle the dev report audited, untouched since)",
                       f"{bsha} (another bundle, or this one changed since: the blind sign-off needs the dev "
                       f"report of this very bundle, --dev-report {args.dev_report})")
    for p in args.blind:
        if not Path(p).is_file():
            raise L47Error(p, "blind document", "an existing dump file", "missing")
    refs = _BlindRefs(dev, record, ledgers, WindowIndex(window), special_ids, model_sha256, window)
    for s, p in exp.documents():
        if s == "blind":
            continue
        try:  # an experiment document the check cannot read could hide a copy: refuse, do not skip
            o = read_dump(p, validate=False)
        except L47Error as e:
            raise L47Error(p, f"experiment document (set {s!r})", "a readable dump: the blind sign-off compares "
                           "the blind document with every document of the experiment by content",
                           f"unreadable ({e.field}: {e.found})") from None
        refs.sha_of.setdefault(o.sha256, (s, p))
        refs.set_of[str(p)] = s
        refs.index.add(str(p), content_ids(o.tokens, o.role))
        refs.tokens.append((s, p, np.asarray(o.tokens)))
    for p in args.blind:
        d = read_dump(p)
        _blind_doc_checks(p, d, refs)
        refs.blind.append(d.sha256)
    return dev, tuple(refs.blind)


@dataclass
class _BlindRefs:
    """What each blind document is checked against: the dev report, the solve record, the ledgers, the
    experiment's documents (by sha256, by content window, their tokens) and the blind set's earlier documents."""

    dev: dict
    record: SolveRecord | None
    ledgers: list[Ledger]
    index: WindowIndex  # over the experiment's documents
    special_ids: dict
    model_sha256: str
    window: int
    sha_of: dict = field(default_factory=dict)  # experiment doc sha256 -> (set, path)
    set_of: dict = field(default_factory=dict)  # experiment doc path -> set
    tokens: list = field(default_factory=list)  # (set, path, token ids) per experiment document
    blind: list = field(default_factory=list)  # the blind set's documents checked so far (sha256)


def _blind_doc_checks(p, d, refs: _BlindRefs) -> None:
    """One blind document's checks (_blind_prechecks)."""
    dev, record, window = refs.dev, refs.record, refs.window
    doc = d.sha256  # the document's identity: its tokens
    seen = []
    for lp in refs.ledgers:
        for e in lp.scored(doc):
            seen.append(f"ledger {lp.path}: {e.event} by `{e.command}` against {e.bundle_sha256[:12]}…")
    for x in dev.get("inputs", {}).get("documents", []):
        if x.get("sha256") == doc:
            seen.append(f"dev report: scored in set {x.get('set')!r}")
    if record is not None:
        used = {i.sha256 for i in record.inputs if i.set != "blind"} | {t.doc_sha256 for t in record.touched}
        if doc in used:
            seen.append("solve record: an input of the solver")
    if doc in refs.sha_of:
        s, q = refs.sha_of[doc]
        seen.append(f"experiment: the same tokens as {q} (set {s!r})")
    if doc in refs.blind:
        seen.append("the blind set: the same tokens as another of its documents")
    hit = refs.index.first_hit(content_ids(d.tokens, d.role)) if window > 0 else None
    if hit is not None:
        seen.append(f"experiment: shares {window} consecutive content tokens with {hit.key} (set "
                    f"{refs.set_of[hit.key]!r}): a near-copy")
    if seen:
        raise L47Error(p, "blind document", "a document never scored before (blind: scored once, by "
                       "content)", "; ".join(seen[:3]) + (f" (+{len(seen) - 3} more)" if len(seen) > 3 else ""))
    cs = chat_structure(d.tokens, d.role, refs.special_ids)
    lacks = [n for n, v in (("turns", cs.n_turns), ("a <think> block", cs.n_think),
                            ("terminal positions", cs.n_terminal)) if not v]
    if lacks:
        raise L47Error(p, "blind document", "a chat with turns, a <think> block and real turn ends",
                       "no " + ", no ".join(lacks))
    prov = dict(d.meta.provenance or {})
    gen_bad = [r for r in ("assistant", "think") if r in prov and prov[r] != "generated"]
    if "assistant" not in prov or gen_bad:
        raise L47Error(p, "provenance", "assistant (and think) turns generated by this model from a "
                       "held-back prompt", f"{ {r: prov.get(r) for r in ('assistant', 'think')} }")
    why = provenance_reasons(prov, [r for r, v in prov.items() if v == "generated"], refs.model_sha256,
                             d.meta.model)
    wider = sampler_wider(prov)
    if wider:
        raise L47Error(p, "provenance generation.sampler", "a sampler the own-generation check can bound (the "
                       "toolkit's own: a top-k or top-p cut)", wider)
    if why:
        raise L47Error(p, "provenance", "the model's own generation (this model, sampler recorded)",
                       "; ".join(why))
    # the prompt is held back: no user turn of the blind chat (≥ 8 tokens) occurs in any experiment document
    user = np.asarray(d.role) == names.ROLE_ID["user"]
    m = np.concatenate([[False], user, [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    spans = [tuple(int(i) for i in np.asarray(d.tokens)[1:][a:b]) for a, b in zip(edges[0::2], edges[1::2])
             if b - a >= 8]
    for s, q, toks in refs.tokens:
        for sp in spans:
            if occurrences(toks, sp).size:
                raise L47Error(p, "prompt", "a prompt held back from every set",
                               f"its user turn occurs in {q} (set {s!r})")


# ----------------------------------------------------------------------------------------------------------
# evidence for the bars: the dev audit and the blind sign-off


def protected_positions(record) -> frozenset:
    """(doc sha256, row) of every position the solve record's objective touched: in-sample for the solver, so
    bar (f) reports the turn ends among them apart from the ones it judges."""
    if record is None:
        return frozenset()
    return frozenset((t.doc_sha256, int(t.pos)) for t in record.touched)


def kld_figures(docs: list[DocResult], pts: list[PhraseTuples]) -> dict[str, SetKld | None]:
    """Per set: KL(base ‖ bundle) statistics over the positions that are NOT prefix rows (the judged figure of
    bar (e)), with the prefix rows (l47.dumps.select.prefix_rows: moving mass off the banned word there is the
    intended effect) and all rows reported beside it."""
    out = {}
    for s in dict.fromkeys(d.set for d in docs):
        ds = [d for d in docs if d.set == s]
        pre = {d.sha256: prefix_rows(d.tokens, pts) for d in ds}  # [T] bool each
        judged = kld_stats_of_pairs([(d.ps, ~pre[d.sha256]) for d in ds if (~pre[d.sha256]).any()])
        at_pre = kld_stats_of_pairs([(d.ps, pre[d.sha256]) for d in ds if pre[d.sha256].any()])
        allr = kld_stats_of_pairs([d.ps for d in ds])
        out[s] = None if judged is None else SetKld(stats=judged, prefix_rows=at_pre, all_rows=allr)
    return out


def _write_blind_stub(out: Path, args, bsha: str, blind_shas: tuple[str, ...], ledgers) -> None:
    """report.json / report.md saying the blind sign-off started and its documents are burned; the finished
    report replaces both. A run killed in between leaves this stub: the documents may not be used again."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    note = (f"blind sign-off STARTED {when} and did not finish: the blind document(s) {', '.join(blind_shas)} are in "
            f"the ledger ({', '.join(str(p) for p in ledgers)}) and may never be scored again; no verdict exists. "
            "Sign off on fresh documents.")
    stub = {"schema": AUDIT_SCHEMA, "mode": B.MODE_BLIND, "status": "started", "passed": False, "exit_code": 1,
            "stamps": ["blind document burned, no verdict"],
            "inputs": {"bundle": {"path": str(args.bundle), "sha256": bsha},
                       "blind": _blind_inputs(args.blind, blind_shas),
                       "ledger": [str(p) for p in ledgers]}, "notes": [note]}
    write_text_atomic(out / "report.json", json.dumps(stub, indent=1))
    write_text_atomic(out / "report.md", f"# l47 audit (blind): NOT FINISHED\n\n{note}\n")


def _blind_inputs(paths, shas) -> list[dict]:
    """report.json inputs.blind: one {path, sha256} per document of the blind set."""
    return [{"path": str(p), "sha256": s} for p, s in zip(paths, shas)]


def count_figures(sets_rep: SetsReport) -> CountFigures:
    """The minimum-count bars' figures: held-out events per phrase (every phrase with a multi-token variant,
    zero included), collateral_eval occurrences per collateral word (zero included) and in all."""
    ho = {p.phrase: 0 for p in sets_rep.phrases if p.tuples}
    for e in sets_rep.events:
        if e.set == "heldout":
            ho[e.phrase] = ho.get(e.phrase, 0) + 1
    cw = {w: 0 for w in sets_rep.collateral_words}
    for c in sets_rep.collateral:
        if c.set == "collateral_eval":
            cw[c.word] = cw.get(c.word, 0) + 1
    return CountFigures(heldout_per_phrase=ho, collateral_per_word=cw, collateral_total=sum(cw.values()))


@dataclass
class SharedFigures:
    """Figures both modes report, from the scored documents."""

    kld: dict[str, SetKld | None]  # set -> KLD statistics
    proxy: ProxyFigures
    flips: FlipFigures
    turn_ends: TurnEndFigures
    penalty: PenaltyFigures  # reported, no bar
    sims: dict  # doc sha256 -> {"alone", "stacked"} penalty simulations


def shared_figures(ctx: AuditContext) -> SharedFigures:
    accepted, th = ctx.accepted, ctx.th
    pen_fig, sims = _penalty_figures(ctx.spec, accepted, ctx.vocab)
    proxy = proxy_figures(accepted, ctx.w.V, th.ce_proxy_frac, th.zero_proxy_tol, ctx.args.allow_unverified)
    return SharedFigures(kld=kld_figures(accepted, ctx.pts), proxy=proxy,
                         flips=flip_figures(accepted, ctx.vocab, ctx.special_ids),
                         turn_ends=turn_end_figures(accepted, ctx.special_ids, protected_positions(ctx.record)),
                         penalty=pen_fig, sims=sims)


def _disjointness_shas(ctx: AuditContext) -> tuple[dict[str, str], dict[str, str]]:
    """(scored doc sha -> set, solver doc sha -> set) of the experiment's documents."""
    scored, solver = {}, {}
    for dr in ctx.sets_rep.docs:
        if dr.set in SCORED_SETS or dr.set.startswith("kld."):
            scored.setdefault(dr.sha256, dr.set)
        elif dr.set in SOLVER_SETS:
            solver.setdefault(dr.sha256, dr.set)
    for sha in _content_hashes(ctx.exp.sets.get("blind", ())).values():
        scored.setdefault(sha, "blind")
    return scored, solver


def dev_evidence(ctx: AuditContext, sh: SharedFigures) -> tuple[B.Evidence, dict]:
    """The dev audit's evidence for the bars, and the report's figures."""
    sets_rep, by_sha, vocab, special_ids, th = ctx.sets_rep, ctx.by_sha, ctx.vocab, ctx.special_ids, ctx.th
    scored_shas, solver_shas = _disjointness_shas(ctx)
    rec = record_figures(ctx, scored_shas, solver_shas)
    n_ev = {s: sum(1 for e in sets_rep.events if e.set == s) for s in ("train", "dev", "heldout")}
    tot = sum(n_ev.values())
    split = SplitFigures(events=n_ev, heldout_frac=(n_ev["heldout"] / tot) if tot else None, split=sets_rep.split)
    slop = slop_figures(list(sets_rep.heldout_events()), by_sha, vocab, special_ids, sh.sims)
    coll = collateral_figures([c for c in sets_rep.collateral if c.set == "collateral_eval"], by_sha, vocab,
                              th.collateral_below)
    claims = claims_figures(ctx.record, rec, by_sha, [e for e in sets_rep.events if e.set == "dev"], ctx.bundle)
    engine = _engine_figures(ctx.args, ctx.w, by_sha, ctx.doc_paths)
    special = special_mass_figures(sets_rep.events, by_sha)
    ordinary = ordinary_figures([d for d in ctx.accepted if d.set == "chat_heldout"], special_ids)
    counts = count_figures(sets_rep)
    ev = B.Evidence(thresholds=th, bundle=ctx.bundle, proxy=sh.proxy, mode=B.MODE_DEV, record=rec, split=split,
                    slop=slop, claims=claims, collateral=coll, kld=sh.kld, engine=engine, flips=sh.flips,
                    turn_ends=sh.turn_ends, special_mass=special, ordinary=ordinary, counts=counts)
    figures = {"bundle": ctx.bundle, "proxy": sh.proxy, "record": rec, "split": split, "claims": claims,
               "counts": counts, "overlaps": [dict(o.__dict__) for o in sets_rep.overlaps],
               "slop": {"heldout": slop, "per_set": _slop_per_set(sets_rep.events, by_sha, vocab, special_ids,
                                                                  sh.sims)},
               "non_events": [{"set": e.set, "doc": e.doc, "pos": e.pos, "phrase": e.phrase, "p_base": e.p_base}
                              for e in sets_rep.non_events],
               "collateral": coll, "kld": sh.kld, "engine": engine,
               "chat": {"flips": sh.flips, "turn_ends": sh.turn_ends, "special_mass": special, "ordinary": ordinary},
               "penalty": sh.penalty, "sets_warnings": list(sets_rep.warnings)}
    return ev, figures


def blind_evidence(ctx: AuditContext, sh: SharedFigures) -> tuple[B.Evidence, dict]:
    """The blind sign-off's evidence: the blind document's events (base p from this audit's one pass), its
    figures beside the dev report's."""
    th, dev_rep = ctx.th, ctx.dev_rep
    evs = []
    for d0 in ctx.docs:  # the blind set: its figures pooled over its documents
        for e in find_events(d0.tokens, ctx.pts, d0.role):
            p = math.exp(d0.ps.base.logp_target[e.pos])
            if p >= th.non_event_p:
                evs.append(EventRecord("blind", d0.path, d0.sha256, e.pos, e.phrase, tuple(e.tuple), e.final, p,
                                       names.ROLES[e.role], e.in_context_copy))
    slop = slop_figures(evs, ctx.by_sha, ctx.vocab, ctx.special_ids, sh.sims)
    ordinary = ordinary_figures(ctx.docs, ctx.special_ids)
    dev_ho = dev_rep["slop"]["heldout"]
    dev_after = dev_ho.get("p_after")
    blind = BlindFigures(
        bundle_sha256=ctx.bsha, dev_bundle_sha256=dev_rep["inputs"]["bundle"]["sha256"],
        doc_sha256=list(ctx.blind_shas), n_docs=len(ctx.blind_shas), never_scored=True,
        ledgers=[str(lp.path) for lp in ctx.ledgers], slop=slop, flips=sh.flips, turn_ends=sh.turn_ends,
        special_mass=special_mass_figures(evs, ctx.by_sha), ordinary=ordinary,
        dev_residual_ratio=dev_ho["residual_ratio"], events_before_scoring=ctx.blind_events,
        own_generation_replay="not replayed: the blind chat was not re-generated by the engine from its recorded "
                              "prompt, seed and sampler (the sign-off is stamped weakened)",
        absolute_residual_vs_dev=(slop.p_after / dev_after) if slop.p_after and dev_after else None,
        comparisons=_blind_comparisons(slop, ordinary, sh.flips, sh.turn_ends, dev_rep, th))
    ev = B.Evidence(thresholds=th, bundle=ctx.bundle, proxy=sh.proxy, mode=B.MODE_BLIND, blind=blind)
    return ev, {"bundle": ctx.bundle, "blind": blind, "kld": sh.kld, "proxy": sh.proxy, "penalty": sh.penalty}


# ----------------------------------------------------------------------------------------------------------
# the context: every input checked, every document scored once


@dataclass
class AuditContext:
    """What the evidence functions read, computed once: inputs (checked), runtime and bundle weights, the
    record, the vocabulary and phrases, and every document's base and bundle head results (one paired pass per
    document, shared with the sets report)."""

    args: AuditArgs
    mode: str
    exp: Experiment
    ledgers: list[Ledger]  # the base model's (or --ledger) first; with --blind also the dev report's when it
    # named another file
    w: TailWeights  # base
    W_new: torch.Tensor  # [n, f] f32: the bundle's W_sd
    bsha: str  # bundle sha256
    record: SolveRecord | None
    record_path: Path
    bundle: BundleFigures
    vocab: Vocab
    pts: list[PhraseTuples]
    spec: PenaltySpec
    notes: list[str] = field(default_factory=list)
    other_model: list[dict] = field(default_factory=list)  # {path, model} of dumps of another model (allowed)
    dev_rep: dict | None = None  # blind: the dev audit's report
    blind_shas: tuple[str, ...] = ()  # the blind set's documents (sha256 of their tokens)
    sets_rep: SetsReport | None = None  # dev: the sets report (blind documents excluded)
    docs: list[DocResult] = field(default_factory=list)
    doc_paths: dict[str, str] = field(default_factory=dict)
    content: dict = field(default_factory=dict)  # the experiment's content (l47.data.sets.experiment_content)
    blind_events: dict = field(default_factory=dict)  # blind: events per phrase before scoring (blind_slop_events)

    @property
    def th(self) -> Thresholds:
        return self.exp.thresholds

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self.vocab.special_ids)

    @property
    def finals(self) -> list[int]:
        return sorted({int(t[-1]) for pt in self.pts for t in pt.tuples})

    @property
    def by_sha(self) -> dict[str, DocResult]:
        out: dict[str, DocResult] = {}
        for d in self.docs:
            out.setdefault(d.sha256, d)
        return out

    @property
    def accepted(self) -> list[DocResult]:
        return [d for d in self.docs if not d.refused]


def _ledgers(args: AuditArgs, base_sha256: str) -> list[Ledger]:
    """The base model's ledger (or the one --ledger names); with --blind also the dev report's (when it exists)
    and always the base model's default one, so a blind document scored once is refused everywhere after,
    whichever --ledger a later run names. Each validated now, so a corrupt ledger or another model's is refused
    before any scoring."""
    ledger = Ledger.open(args.ledger, base_sha256)
    ledgers = [ledger]
    if not args.blind:
        return ledgers
    extra = [default_ledger_path(base_sha256)]
    if args.dev_report is not None and Path(args.dev_report).is_file():
        try:
            dl = json.loads(Path(args.dev_report).read_text()).get("inputs", {}).get("ledger")
        except ValueError:
            dl = None
        if isinstance(dl, str):
            extra.insert(0, Path(dl))
    for i, p in enumerate(extra):  # the base model's default ledger always: a blind burn is recorded there too
        if (i == len(extra) - 1 or p.exists()) and all(p.resolve() != lp.path.resolve() for lp in ledgers):
            ledgers.append(Ledger.open(p, base_sha256))
    return ledgers


def load_context(args: AuditArgs) -> AuditContext:
    """Check every input — output folder, ledgers, base / bundle / record of one model, blind rules — before
    anything is scored."""
    _check_out_dir(Path(args.out_dir))
    exp = load_experiment(args.experiment)
    base_g, bundle_g = open_gguf(args.base), open_gguf(args.bundle)
    ledgers = _ledgers(args, base_g.sha256())
    rpath = Path(args.record) if args.record is not None else record_path_for(args.bundle)
    record = read_record(rpath) if rpath.is_file() else None
    w = load_tail_weights(base_g, policy=args.policy, device=args.device, precision=args.precision)
    refuse_other_model(base_g, bundle_g, w.target, record)
    content = check_handoffs(args, exp, record, rpath)
    W_new, bsha = edited_weight(w, args.bundle, args.device)
    vocab = load_vocab(exp, base_g, w.V)
    pts, _ = phrases_to_tuples(exp.phrases, vocab)
    ctx = AuditContext(args=args, mode=B.MODE_BLIND if args.blind else B.MODE_DEV, exp=exp,
                       ledgers=ledgers, w=w, W_new=W_new, bsha=bsha, record=record, record_path=rpath,
                       bundle=bundle_figures(base_g, bundle_g, w, W_new, record), vocab=vocab, pts=pts,
                       spec=make_spec(pts, args.penalty_bias, model_sha256=w.model_sha256, vocab=vocab.name),
                       content=content)
    if exp.policy != args.policy:
        ctx.notes.append(f"runtime weight policy {args.policy!r} (the experiment names {exp.policy!r})")

    docs = [p for s, p in exp.documents() if ctx.mode == B.MODE_DEV and s != "blind"]
    other_model_notes(docs + list(args.blind), w.model_sha256, args.base,
                      args.allow_other_model)  # dumps of another model refused here unless allowed
    if ctx.mode == B.MODE_BLIND:
        ctx.dev_rep, ctx.blind_shas = _blind_prechecks(args, bsha, record, exp, ledgers, vocab.special_ids,
                                                      w.model_sha256, exp.thresholds.overlap_window)
        check_dev_handoff(args, ctx.dev_rep, content)
        ctx.blind_events = blind_slop_events(args.blind, pts, exp.thresholds.non_event_p)
    return ctx


def check_handoffs(args: AuditArgs, exp: Experiment, record: SolveRecord | None, record_path: Path) -> dict:
    """The experiment's content at hand (l47.data.sets.experiment_content: token hashes, never a score), and
    the refusal of a solve record made from other inputs (check_handoff: one line naming both hashes and what
    changed), held to what a solve reads: its scored sets may gain or lose documents since (the dev report of a
    blind sign-off is held to all of it: check_dev_handoff)."""
    content = experiment_content(exp)
    if record is not None:
        check_handoff(record_path, "solve record", record.experiment_content, record.experiment_content_sha256,
                      content, exp.path, view=HANDOFF_SOLVE)
    return content


def check_dev_handoff(args: AuditArgs, dev: dict, content: dict) -> None:
    """The blind sign-off: refuse a dev report made from other inputs than the experiment at hand (all of its
    content but the blind set; check_handoff)."""
    e = (dev.get("inputs") or {}).get("experiment") or {}
    check_handoff(args.dev_report, "dev report", e.get("content"), str(e.get("content_sha256") or ""), content,
                  args.experiment)


def blind_slop_events(paths, pts, non_event_p: float) -> dict:
    """The blind set's slop events per phrase before it is scored (l47.data.sets.blind_event_counts: its tokens
    and the engine's recorded base log p); refused (L47Error) when it holds none — a blind set without a slop
    event cannot sign off slop, and scoring it would burn it for nothing."""
    per: dict[str, int] = {}
    occ: dict[str, int] = {}
    for p in paths:
        d = read_dump(p, validate=False)
        e, o = blind_event_counts(d.tokens, d.role, pts, d.ref_logp, non_event_p)
        for ph in e:
            per[ph], occ[ph] = per.get(ph, 0) + e[ph], occ.get(ph, 0) + o[ph]
    if not sum(per.values()):
        where = paths[0] if len(paths) == 1 else f"--blind ({len(paths)} documents)"
        raise L47Error(where, "slop events", f"at least one prefix-exact event of a banned phrase (base p >= "
                       f"non_event_p {non_event_p:g}) in the blind set: without one it cannot sign off slop",
                       f"none ({sum(occ.values())} prefix-exact occurrence(s), each below non_event_p by the "
                       "engine's recorded log p)" if sum(occ.values()) else "none (no banned phrase occurs)")
    return {"per_phrase": per, "occurrences": occ}


class SetTicker:
    """Per-set progress of the scoring: `progress(set, done, total)` once per document when its paired pass is
    done (each document counted once). Sets are the experiment's (the split pool as "pool"; the blind sign-off's
    document as "blind")."""

    def __init__(self, progress, documents):
        self.progress = progress
        self.set_of = {os.path.abspath(p): s for s, p in documents}  # path -> set
        self.total: dict[str, int] = {}
        for s in self.set_of.values():
            self.total[s] = self.total.get(s, 0) + 1
        self.done: dict[str, int] = {s: 0 for s in self.total}
        self.seen: set[str] = set()

    def __call__(self, path) -> None:
        key = os.path.abspath(str(path))
        if self.progress is None or key in self.seen:
            return
        self.seen.add(key)
        s = self.set_of.get(key, "other")
        self.done[s] = self.done.get(s, 0) + 1
        self.progress(s, self.done[s], max(self.total.get(s, 0), self.done[s]))


def score_documents(ctx: AuditContext, progress=None) -> None:
    """One paired (base, bundle) head pass per document. Dev mode: the sets report (events, collateral,
    guards, split; blind documents untouched) takes its base statistics from the same passes.
    progress(set, done, total): called as each document's pass is done (SetTicker)."""
    sc = Scoring(ctx.w, ctx.W_new, ctx.pts, ctx.special_ids, ctx.finals, sampler_tol=ctx.th.sampler_tol)
    # the ledger first: every document about to be scored (by content), against this bundle. The blind
    # document is burned from here on, and a report stub says so until the verdict replaces it
    exp_nb = replace(ctx.exp, sets={k: v for k, v in ctx.exp.sets.items() if k != "blind"})
    if ctx.mode == B.MODE_BLIND:
        _write_blind_stub(Path(ctx.args.out_dir), ctx.args, ctx.bsha, ctx.blind_shas, [lp.path for lp in ctx.ledgers])
        for lp in ctx.ledgers:
            lp.append(ctx.blind_shas, ctx.bsha, "audit", EV_BLIND_STARTED, note=str(ctx.args.out_dir))
    else:
        ctx.ledgers[0].append(_content_hashes(p for _, p in exp_nb.documents()).values(), ctx.bsha, "audit")
    if ctx.mode == B.MODE_BLIND:
        tick = SetTicker(progress, [("blind", p) for p in ctx.args.blind])
        for p in ctx.args.blind:
            d = read_dump(p)
            check_dump_dims(ctx.w, d.meta, str(p))
            if d.meta.model != ctx.w.model_sha256 and not str(d.meta.model).startswith("hf:"):
                ctx.other_model.append({"path": str(p), "model": str(d.meta.model)})
            ctx.docs.append(score_document(sc, d, "blind"))
            ctx.doc_paths[d.sha256] = str(p)
            tick(p)
        return
    tick = SetTicker(progress, exp_nb.documents())
    passes: dict[str, tuple] = {}  # path -> (dump, PairedStats of max(sets' k, sc.topk) top-k columns)

    def base_stats(dump, k: int):
        ps = sc.pair(dump, max(k, sc.topk))
        passes[str(dump.path)] = (dump, ps)
        tick(dump.path)
        return top_k_of(ps.base, k)

    ctx.sets_rep = build_sets(exp_nb, ctx.w, vocab=ctx.vocab, device=ctx.args.device, base_stats=base_stats)
    w = ctx.w
    for dr in ctx.sets_rep.docs:
        d, ps = passes.pop(dr.path, (None, None))
        d = d if d is not None else read_dump(dr.path)
        check_dump_dims(w, d.meta, dr.path)
        ctx.docs.append(score_document(sc, d, dr.set, dr.refused, dr.reasons, ps=ps))
        ctx.doc_paths[d.sha256] = dr.path
        tick(dr.path)
        if d.meta.model not in (w.model_sha256,) and not str(d.meta.model).startswith("hf:"):
            ctx.notes.append(f"{dr.path}: dumped from model {str(d.meta.model)[:12]}…, audited under "
                             f"{w.model_sha256[:12]}…")
            ctx.other_model.append({"path": dr.path, "model": str(d.meta.model)})
    for d in ctx.docs:
        if not d.verified:
            ctx.notes.append(f"{d.path}: unverified (no ref_logp in the dump: the zero-proxy check was not run)")


# ----------------------------------------------------------------------------------------------------------
# the report and the driver


def _identity_stamps(ctx: AuditContext) -> list[str]:
    """Dumps of another model in this audit, and those the bundle's solve record says it was solved with."""
    out = [other_model_stamp(len(ctx.other_model))] if ctx.other_model else []
    return out + [f"solve record: {s}" for s in (ctx.record.stamps if ctx.record is not None else [])]


def write_report(ctx: AuditContext, sh: SharedFigures, figures: dict, bar_list: list) -> AuditReport:
    """Append every scored document to the ledger(s) (the blind one is burned from here on), then write
    report.json / report.md / positions.tsv / plots (staged, then moved in)."""
    args, passed = ctx.args, all(b.passed for b in bar_list)
    blind = ctx.mode == B.MODE_BLIND
    # every threshold moved the way that proves less, and (blind) the own generation not replayed by the engine
    weak = B.weakened(ctx.th) + ([B.NOT_REPLAYED] if blind else [])
    inputs = {
        "bundle": {"path": str(args.bundle), "sha256": ctx.bsha},
        "base": {"path": str(args.base), "sha256": ctx.w.model_sha256},
        "experiment": {"path": str(args.experiment), "sha256": _file_sha(args.experiment),
                       "content_sha256": content_sha256(ctx.content), "content": ctx.content},
        "record": {"path": str(ctx.record_path), "sha256": _file_sha(ctx.record_path)} if ctx.record else None,
        "dev_report": {"path": str(args.dev_report), "sha256": _file_sha(args.dev_report)} if ctx.dev_rep else None,
        "blind": _blind_inputs(args.blind, ctx.blind_shas) if blind else None,
        "engine_dumps": [{"path": str(p), "sha256": _file_sha(p)} for p in args.engine_dumps],
        "documents": [{"path": d.path, "sha256": d.sha256, "set": d.set, "doc_id": d.doc_id, "T": d.T,
                       "verified": d.verified, "refused": d.refused, "reasons": list(d.reasons)} for d in ctx.docs],
        "ledger": str(ctx.ledgers[0].path), "policy": args.policy, "device": args.device, "vocab": ctx.vocab.name,
        "numerics": ctx.w.numerics.record(),  # head precision used and its measured logit error (l47.tail.stream)
        "allow_other_model": args.allow_other_model, "other_model_dumps": ctx.other_model,
    }
    report = clean({
        "schema": AUDIT_SCHEMA, "toolkit_version": toolkit_version(), "mode": ctx.mode, "passed": passed,
        "exit_code": 0 if passed else 1, "stamps": B.stamps(ctx.th, sh.proxy, weak) + _identity_stamps(ctx),
        "weakened": weak, "inputs": inputs,
        "thresholds": {**ctx.th.to_dict(), "penalty_bias": args.penalty_bias},
        "bars": [b.to_dict() for b in bar_list], **figures, "notes": ctx.notes,
    })
    out = Path(args.out_dir)
    files = write_reports(out, report, ctx.docs, ctx.vocab, ctx.special_ids, sh.sims, plots=args.plots)
    if blind:  # the verdict beside the "started" entry
        for lp in ctx.ledgers:
            lp.append(ctx.blind_shas, ctx.bsha, "audit", EV_BLIND_VERDICT,
                      note=f"{'PASS' if passed else 'FAIL'} {files.get('report.json', out / 'report.json')}")
    return AuditReport(passed, 0 if passed else 1, ctx.mode, tuple(bar_list), str(out), files, ctx.bsha, report)


def run_audit(args: AuditArgs, progress=None) -> AuditReport:
    """Audit a bundle against its base on the experiment's documents (or sign off on a blind document).
    Returns the report; `exit_code` is 0 only when every applicable bar passes. Bad input raises L47Error
    before any report file is written. Prints nothing (l47.app.audit_view renders the summary and, through
    `progress(set, done, total)`, the per-set progress of the scoring)."""
    ctx = load_context(args)
    score_documents(ctx, progress)
    sh = shared_figures(ctx)
    ev, figures = (blind_evidence if ctx.mode == B.MODE_BLIND else dev_evidence)(ctx, sh)
    return write_report(ctx, sh, figures, B.evaluate(ev, ctx.mode))


def _slop_per_set(events, by_sha, vocab, special_ids, sims) -> dict[str, SlopFigures]:
    """Slop figures per set of the sets report (the report's table; the event rows left out)."""
    return {s: replace(slop_figures([e for e in events if e.set == s], by_sha, vocab, special_ids, sims), events=None)
            for s in dict.fromkeys(e.set for e in events)}


def _blind_comparisons(slop: SlopFigures, ordinary: OrdinaryFigures, flips: FlipFigures, turn_ends: TurnEndFigures,
                       dev: dict, th: Thresholds) -> list[dict]:
    """Each blind figure beside the dev report's, with its definition (seed §6.3's table)."""
    dchat = dev.get("chat", {})
    dslop = dev.get("slop", {}).get("heldout", {})

    def row(name, b, d, definition):
        ratio = (b / d) if (isinstance(b, (int, float)) and isinstance(d, (int, float)) and d) else None
        return {"figure": name, "blind": b, "dev": d, "blind/dev": ratio, "definition": definition}

    return [
        row("slop residual ratio", slop.residual_ratio, dslop.get("residual_ratio"),
            f"mean p(rejected) after / before at slop events; bar: blind ≤ {th.blind_residual_factor:g} × dev"),
        row("slop p before", slop.p_before, dslop.get("p_before"), "mean base p(rejected) at slop events"),
        row("slop p after", slop.p_after, dslop.get("p_after"), "mean bundle p(rejected) at slop events"),
        row("(g) non-slop KLD", ordinary.kld, dchat.get("ordinary", {}).get("kld"),
            f"mean KL(base ‖ bundle) away from slop; bar ≤ {th.chat_kld:g}"),
        row("(g) ordinary Δlog p", ordinary.mean_dlogp, dchat.get("ordinary", {}).get("mean_dlogp"),
            f"mean Δlog p(target), non-slop non-special targets; bar ≥ {th.chat_ordinary_dlogp:g}"),
        row("(f) flips to a special token", flips.damage, dchat.get("flips", {}).get("damage"),
            "argmax flips to a special token at non-terminal assistant/think/user positions; bar = 0"),
        row("(f) Δlog p(<|im_end|>) at turn ends", turn_ends.mean_dlogp,
            dchat.get("turn_ends", {}).get("mean_dlogp"), f"bar ≥ {th.im_end_dlogp:g}"),
    ]
