"""`l47 solve`: experiment -> sets -> WFLD or FTPO -> re-quantised Q8_0 bundle + solve record.

Every figure it reports is computed by the exact tail forward on the re-quantised weights (as shipped). The
same command on the same inputs writes the same bytes (no timestamps; deterministic solvers).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import l47
from l47.model import names
from l47.data import record as rec
from l47.errors import L47Error
from l47.fileio import sha256_file, write_text_atomic
from l47.tail.forward import paired_stats
from l47.model.weights import load_tail_weights
from l47.solvers.batch import EventTerms, Batch, batch_mix, gather, pick_chosen
from l47.solvers.bundle import requantize_target, write_bundle, write_overlay
from l47.solvers.ftpo import FtpoConfig, train_ftpo
from l47.solvers.wfld import WfldConfig, solve_wfld

METHODS = ("wfld", "ftpo")
COMMON_KEYS = ("seed", "max_background", "max_anchors_per_word", "protect_turn_ends", "n_chosen", "wfld", "ftpo")
SOLVER_SETS = ("train", "dev", "collateral_anchor", "background")  # the only sets a solve reads


@dataclass(frozen=True)
class SolveArgs:
    experiment: Path
    method: str
    out: Path
    model: Path | None = None
    overlay: bool = False
    device: str = "cpu"
    ledger: Path | None = None
    sets_json: Path | None = None  # reuse a `l47 sets --json` report instead of re-mining


@dataclass(frozen=True)
class SolveConfig:
    method: str
    seed: int = 0
    max_background: int = 4000
    max_anchors_per_word: int = 0  # > 0: protect at most this many collateral contexts per word (evenly spread);
    # every exact anchor removes a direction of hh from what ΔW may use (f is the budget, DESIGN §5)
    protect_turn_ends: bool = True  # real turn ends (<|im_end|> targets) of background/train/dev chats: exact anchors
    # too (seed §6.1: chat-formatted anchors, so freed mass cannot end turns early)
    n_chosen: int = 1
    wfld: WfldConfig = WfldConfig()
    ftpo: FtpoConfig = FtpoConfig()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sub(cls, d: dict, where: str):
    valid = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(d) - valid)
    if bad:
        raise L47Error(where, f"key(s) {bad}", f"one of {sorted(valid)}", str(bad))
    return cls(**d)


def resolve_config(solver_table: dict, method: str, where: str) -> SolveConfig:
    if method not in METHODS:
        raise L47Error(where, "method", f"one of {METHODS}", repr(method))
    t = dict(solver_table or {})
    bad = sorted(set(t) - set(COMMON_KEYS))
    if bad:
        raise L47Error(where, f"[solver] key(s) {bad}", f"one of {list(COMMON_KEYS)}", str(bad))
    return SolveConfig(method=method, seed=int(t.get("seed", 0)), max_background=int(t.get("max_background", 4000)),
                       max_anchors_per_word=int(t.get("max_anchors_per_word", 0)),
                       protect_turn_ends=bool(t.get("protect_turn_ends", True)),
                       n_chosen=int(t.get("n_chosen", 1)), wfld=_sub(WfldConfig, t.get("wfld", {}), where + " [solver.wfld]"),
                       ftpo=_sub(FtpoConfig, t.get("ftpo", {}), where + " [solver.ftpo]"))


def _check_model_hash(d, w, path):
    m = str(d.meta.model)
    if len(m) == 64 and all(c in "0123456789abcdef" for c in m) and m != w.model_sha256:
        raise L47Error(path, "meta.model", f"the base model's sha256 {w.model_sha256[:16]}…",
                       f"{m[:16]}… (dumped from another model)")


def _p_by_phrase(phrases, p):
    out = {}
    for ph, v in zip(phrases, p):
        out.setdefault(ph, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in sorted(out.items())}


def run_solve(args: SolveArgs, log=print) -> dict:
    """Solve and write the bundle and its record. Returns the claims (also stored in the record)."""
    from l47.dumps import read_dump
    from l47.data.experiment import load_experiment
    from l47.model.gguf_io import open_gguf
    from l47.data.ledger import append_ledger
    from l47.data.sets import build_sets, load_sets_report

    exp = load_experiment(args.experiment)
    model = args.model or exp.model
    if model is None:
        raise L47Error(exp.path, "model", "a base GGUF (experiment `model` or --model)", "none")
    out = Path(args.out)
    if out.exists() and Path(model).exists() and os.path.samefile(out, model):
        raise L47Error(out, "--out", "a new file, never the base model", f"the base {model}")
    cfg = resolve_config(exp.solver, args.method, str(exp.path))
    base_g = open_gguf(model)
    w = load_tail_weights(base_g, policy=exp.policy, device=args.device)
    if w.head_scale is not None:
        raise L47Error(model, "tensor output.scale", "no output.scale for the solvers (the audit and scoring "
                       "handle it; the solvers' linearisation does not yet)", "present")
    tinfo = base_g.info(w.target)
    if tinfo.type_name != "Q8_0":
        raise L47Error(model, f"tensor {w.target}", "ggml type Q8_0 (it ships re-quantised to Q8_0)", tinfo.type_name)
    report = load_sets_report(args.sets_json) if args.sets_json else build_sets(exp, w, device=args.device)
    train = [e for e in report.events if e.set == "train"]
    devs = [e for e in report.events if e.set == "dev"]
    if not train:
        raise L47Error(exp.path, "train events", "at least one prefix-exact event with base p ≥ "
                       f"{exp.thresholds.non_event_p} in accepted train documents", "none")
    docs = {d.sha256: d for d in report.docs if not d.refused}
    # every batch is ordered by document CONTENT (token ids), not by file hash: the same documents dumped into
    # another folder (other metadata, other file hashes) give the same float order and the same bundle bytes
    ckey = {d.sha256: (d.content_key or d.sha256) for d in report.docs}

    def order(sha: str, pos: int):
        return (ckey.get(sha, sha), pos)

    cache: dict[str, object] = {}

    def dump(sha):
        if sha not in cache:
            p = Path(docs[sha].path)
            d = read_dump(p)
            _check_model_hash(d, w, p)
            cache[sha] = d
        return cache[sha]

    def batch_of(pairs) -> Batch | None:
        by: dict[str, list[int]] = {}
        for sha, pos in pairs:
            by.setdefault(sha, []).append(pos)
        items = [(dump(s), rows) for s, rows in by.items()]
        return gather(items, w.device) if items else None

    special = sorted(set(int(v) for v in report.special_ids.values()))
    scale_of = {p["phrase"]: float(p.get("margin_scale", 1.0)) for p in report.phrases}
    # events in a fixed order: (doc, pos)
    train = sorted(train, key=lambda e: order(e.doc_sha256, e.pos))
    devs = sorted(devs, key=lambda e: order(e.doc_sha256, e.pos))
    ev = batch_of([(e.doc_sha256, e.pos) for e in train])
    if ev.doc != tuple(e.doc_sha256 for e in train) or ev.pos != tuple(e.pos for e in train):
        raise L47Error("solve", "train events", "one batch row per event, in event order", "a different order")
    rejected = torch.as_tensor([e.final for e in train], device=w.device)
    chosen = pick_chosen(ev, w, rejected, special, k=cfg.n_chosen)
    terms = EventTerms(rejected=rejected, chosen=chosen, special=torch.as_tensor(special, dtype=torch.long),
                       scale=torch.as_tensor([scale_of.get(e.phrase, 1.0) for e in train], device=w.device))
    anchors_rec = sorted([c for c in report.collateral if c.set == "collateral_anchor"],
                         key=lambda c: order(c.doc_sha256, c.pos))
    if cfg.max_anchors_per_word > 0:
        keep = []
        for word in sorted({c.word for c in anchors_rec}):
            occ = [c for c in anchors_rec if c.word == word]
            idx = np.unique(np.linspace(0, len(occ) - 1, min(len(occ), cfg.max_anchors_per_word)).round().astype(int))
            keep += [occ[i] for i in idx]
        anchors_rec = sorted(keep, key=lambda c: order(c.doc_sha256, c.pos))
    bg_docs = sorted([d for d in report.docs if d.set == "background" and not d.refused],
                     key=lambda d: order(d.sha256, 0))
    if not bg_docs:
        raise L47Error(exp.path, "sets.background", "at least one accepted background document (plain and chat)",
                       "none")
    total = sum(d.T for d in bg_docs)
    stride = max(1, int(np.ceil(total / cfg.max_background)))
    bg_pairs = [(d.sha256, t) for d in bg_docs for t in range(0, d.T, stride)]
    im_end = report.special_ids.get(names.IM_END)
    turn_ends = []  # (doc, row) of real turn ends in the solver's chats (background, train, dev): protected exactly
    if cfg.protect_turn_ends and im_end is not None:
        own = sorted([d for d in report.docs if d.set in ("train", "dev") and not d.refused],
                     key=lambda d: order(d.sha256, 0))
        for d in bg_docs + own:
            tg = np.asarray(dump(d.sha256).tokens[1:])
            turn_ends += [(d.sha256, int(t)) for t in np.nonzero(tg == im_end)[0]]
    an = batch_of([(c.doc_sha256, c.pos) for c in anchors_rec] + turn_ends)
    bg = batch_of(bg_pairs)
    log(f"solve: {len(train)} train events, {len(devs)} dev events, {0 if an is None else an.P} anchors "
        f"({len(turn_ends)} of them turn ends of the solver's chats), "
        f"{bg.P} background positions (every {stride}th of {total}) from {len(bg_docs)} documents")

    torch.manual_seed(cfg.seed)
    if cfg.method == "wfld":
        res = solve_wfld(w, ev, terms, bg, an, cfg.wfld, log=log)
        dW, method_summary = res.dW, res.summary()
    else:
        dev_batch = None
        if devs:
            db = batch_of([(e.doc_sha256, e.pos) for e in devs])
            dev_batch = (db, torch.as_tensor([e.final for e in devs]))
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("[bold]FTPO[/]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      TextColumn("{task.description}"), transient=True, disable=log is None) as bar:
            task = bar.add_task("", total=cfg.ftpo.steps)

            def live(r: dict) -> None:
                bar.update(task, advance=1, description=f"loss {r['loss']:.4f} pref {r['pref']:.4f} "
                           f"KL {r['kl']:.2e} coll {r['coll']:.2e}"
                           + (f" dev p_rej {r['dev_p_rej']:.3f}" if "dev_p_rej" in r else ""))

            words = [c.token_id for c in anchors_rec] + [int(im_end)] * len(turn_ends)
            res = train_ftpo(w, terms, ev, bg, an, words if an is not None else None,
                             dev_batch, cfg.ftpo, progress=live)
        dW, method_summary = res.dW, res.summary()

    # ---- re-quantise and score as shipped
    raw_new, W_q = requantize_target(base_g, w.target, w.W_sd + dW)
    W_q = W_q.to(w.device)
    dW_q = W_q - w.W_sd
    claims: dict = {"dW_rel_norm": float(dW_q.norm() / w.W_sd.norm()),
                    "dW_rel_norm_float": float(dW.norm() / w.W_sd.norm()),
                    "blocks_changed": int((raw_new.reshape(-1, 34) != np.asarray(base_g.raw(w.target)).reshape(-1, 34))
                                          .any(1).sum()),
                    "method": {**method_summary, "figures_from": "the float ΔW, before re-quantisation"}}

    def p_rej(events, W=None):
        if not events:
            return np.zeros(0)
        b = batch_of([(e.doc_sha256, e.pos) for e in events])
        with torch.no_grad():
            z = batch_mix(b, w, W_sd=W)
        from l47.tail.forward import head_stats
        st = head_stats(z, w, np.array([e.final for e in events]))
        return np.exp(st.logp_target)

    for name, evs in (("train", train), ("dev", devs)):
        if evs:
            b0, b1 = p_rej(evs), p_rej(evs, W_q)
            phr = [e.phrase for e in evs]
            claims[f"{name}_p_rejected"] = {"before": float(b0.mean()), "after": float(b1.mean()),
                                            "per_phrase_before": _p_by_phrase(phr, b0),
                                            "per_phrase_after": _p_by_phrase(phr, b1), "n": len(evs)}
    with torch.no_grad():
        ps = paired_stats(batch_mix(bg, w), batch_mix(bg, w, W_sd=W_q), w, bg.target.cpu().numpy())
    claims["background_kl_exact"] = float(ps.kld.mean())
    if cfg.method == "wfld":
        claims["background_kl_predicted"] = res.predicted_bg_kl
    if an is not None:
        with torch.no_grad():
            m0, mf, mq = batch_mix(an, w), batch_mix(an, w, dW=dW), batch_mix(an, w, W_sd=W_q)
        tg = an.target.cpu().numpy()
        float_move = np.abs(paired_stats(m0, mf, w, tg).dlogp).max()
        shipped = np.abs(paired_stats(m0, mq, w, tg).dlogp).max()
        floor = np.abs(paired_stats(mf, mq, w, tg).dlogp).max()
        claims["anchors"] = {"n": an.P, "max_abs_dlogp_float": float(float_move),
                             "max_abs_dlogp_shipped": float(shipped), "requant_floor": float(floor)}

    # ---- bundle, record, ledger
    inputs = [rec.InputFile(str(Path(model)), base_g.sha256(), "model"),
              rec.InputFile(str(exp.path), sha256_file(exp.path), "experiment")]
    inputs += [rec.InputFile(d.path, d.sha256, d.set) for d in sorted(report.docs, key=lambda d: (d.set, d.sha256))]
    prov = {"method": cfg.method, "toolkit_version": l47.__version__, "seed": str(cfg.seed),
            "base_sha256": base_g.sha256(), "target": w.target, "config": cfg.to_dict(),
            "dumps": sorted({d.sha256 for d in report.docs if not d.refused and d.set in SOLVER_SETS})}
    if args.overlay:
        write_overlay(model, out, w.target, raw_new, prov)
    else:
        write_bundle(model, out, w.target, raw_new, prov)
    bundle_sha = open_gguf(out).sha256()
    touched = [rec.Touched(e.doc_sha256, e.pos, e.final, rec.TERM_SLOP, e.phrase, e.p_base) for e in train]
    touched += [rec.Touched(ev.doc[i], ev.pos[i], int(s), rec.TERM_SPECIAL) for i in range(ev.P) for s in special]
    if cfg.method == "ftpo":
        touched += [rec.Touched(ev.doc[i], ev.pos[i], int(c), rec.TERM_TETHER) for i in range(ev.P)
                    for c in chosen[i].tolist()]
    touched += [rec.Touched(c.doc_sha256, c.pos, c.token_id, rec.TERM_ANCHOR, c.word, c.p_base) for c in anchors_rec]
    touched += [rec.Touched(s, t, int(im_end), rec.TERM_ANCHOR, names.IM_END) for s, t in turn_ends]
    touched += [rec.Touched(s, p, -1, rec.TERM_BACKGROUND) for s, p in bg_pairs]
    record = rec.SolveRecord(method=cfg.method, toolkit_version=l47.__version__, seed=cfg.seed,
                             base_sha256=base_g.sha256(), bundle_sha256=bundle_sha, target=w.target,
                             config=cfg.to_dict(), inputs=inputs, touched=touched, claims=claims,
                             notes=list(method_summary.get("warnings", [])) if isinstance(method_summary, dict) else [])
    write_text_atomic(rec.record_path_for(out), record.to_json())
    ledger = args.ledger or out.parent / "ledger.jsonl"
    scored = sorted({d.sha256 for d in report.docs if d.set != "blind"})  # sets never scores a blind document
    append_ledger(ledger, [(s, bundle_sha) for s in scored], "solve")
    claims["bundle"] = str(out)
    claims["bundle_sha256"] = bundle_sha
    claims["record"] = str(rec.record_path_for(out))
    claims["config"] = cfg.to_dict()
    return claims
