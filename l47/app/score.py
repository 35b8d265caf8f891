"""`l47 score`: exact per-document and per-position scoring of dumps under a base model and optionally a bundle."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from l47.data.identity import other_model_stamp
from l47.data.ledger import Ledger
from l47.dumps import read_dump
from l47.errors import L47Error
from l47.fileio import write_text_atomic
from l47.model.weights import TailWeights, check_dump_dims, edited_weight, load_tail_weights, runtime_tensor
from l47.tail.forward import HeadStats, PairedStats, score_dump, score_pair


@dataclass(frozen=True)
class ScoreArgs:
    model: Path
    dumps: tuple[Path, ...]
    bundle: Path | None = None
    tsv: Path | None = None
    policy: str = "strata"
    device: str = "cpu"
    ledger: Path | None = None  # default: the base model's ledger (l47.data.ledger.default_ledger_path)
    allow_other_model: bool = False  # score dumps made from another model (refused by default, DESIGN §3.1)
    precision: str | None = None  # head GEMM precision (l47.model.weights.head_precision); None: "auto"


@dataclass(frozen=True)
class DocScore:
    doc: str
    T: int
    ce: float  # mean −log p(target), nats
    top1: float  # fraction of positions whose argmax is the target
    verified: bool
    ce_new: float | None = None
    top1_new: float | None = None
    kld: float | None = None  # mean KL(base ‖ edited)
    dlogp: float | None = None  # mean Δlog p(target)
    same_top: float | None = None


@dataclass(frozen=True)
class ScoreResult:
    docs: tuple[DocScore, ...]
    model_sha256: str
    bundle_sha256: str | None = None
    rows: int = 0
    tsv: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    ledger: str | None = None
    stamps: tuple[str, ...] = ()  # e.g. dumps of another model scored (--allow-other-model)


TSV_BASE = ("doc", "pos", "target", "logp_target", "argmax")
TSV_PAIRED = TSV_BASE + ("logp_target_new", "argmax_new", "kld")


def run_score(args: ScoreArgs, progress=None) -> ScoreResult:
    """Score every dump; with a bundle, paired base-vs-edited statistics from one streamed pass each."""
    w = load_tail_weights(args.model, policy=args.policy, device=args.device, precision=args.precision)
    ledger = Ledger.open(args.ledger, w.model_sha256)  # a corrupt ledger / another model's: refused now
    W_new, bsha = (None, None)
    if args.bundle is not None:
        W_new, bsha = edited_weight(w, args.bundle, args.device)
    docs, notes, others = [], [], 0
    buf = io.StringIO()
    tsv = csv.writer(buf, delimiter="\t", lineterminator="\n")
    tsv.writerow(TSV_PAIRED if W_new is not None else TSV_BASE)
    rows = 0
    dumps = []
    for p in args.dumps:  # every input checked before anything is scored
        d = read_dump(p)
        check_dump_dims(w, d.meta, str(p))
        if d.meta.model not in (w.model_sha256, "") and not str(d.meta.model).startswith("hf:"):
            if not args.allow_other_model:
                raise L47Error(p, "meta.model", f"the scoring model {w.model_sha256[:16]}… (or --allow-other-model)",
                               f"{str(d.meta.model)[:16]}…")
            notes.append(f"{p}: dumped from model {d.meta.model[:12]}…, scored under {w.model_sha256[:12]}…")
            others += 1
        dumps.append((p, d))
    # every document is in the ledger (by content) before its first score is computed
    ledger.append([d.sha256 for _, d in dumps], bsha or w.model_sha256, "score")
    for p, d in dumps:
        if not d.verified:
            notes.append(f"{p}: unverified (no ref_logp: the zero-proxy check was not run)")
        tg = np.asarray(d.tokens[1:])
        if W_new is None:
            s: HeadStats = score_dump(w, d)
            docs.append(DocScore(d.meta.doc_id, s.T, float(-s.logp_target.mean()),
                                 float((s.argmax == tg).mean()), d.verified))
            for t in range(s.T):
                tsv.writerow([d.meta.doc_id, t, int(tg[t]), f"{s.logp_target[t]:.6f}", int(s.argmax[t])])
        else:
            ps: PairedStats = score_pair(w, d, W_new)
            b, n = ps.base, ps.new
            docs.append(DocScore(d.meta.doc_id, b.T, float(-b.logp_target.mean()), float((b.argmax == tg).mean()),
                                 d.verified, float(-n.logp_target.mean()), float((n.argmax == tg).mean()),
                                 float(ps.kld.mean()), float(ps.dlogp.mean()), float(ps.same_top.mean())))
            for t in range(b.T):
                tsv.writerow([d.meta.doc_id, t, int(tg[t]), f"{b.logp_target[t]:.6f}", int(b.argmax[t]),
                              f"{n.logp_target[t]:.6f}", int(n.argmax[t]), f"{ps.kld[t]:.8f}"])
        rows += docs[-1].T
        if progress is not None:
            progress()
    if args.tsv is not None:
        write_text_atomic(args.tsv, buf.getvalue())

    return ScoreResult(tuple(docs), w.model_sha256, bsha, rows, str(args.tsv) if args.tsv else None, tuple(notes),
                       str(ledger.path), (other_model_stamp(others),) if others else ())


def ppl(ce: float) -> float:
    return math.exp(ce)
