"""`l47 solve`: experiment -> sets -> WFLD or FTPO -> re-quantised Q8_0 bundle + solve record.

    run_solve = plan_solve        load the experiment, base model, weights, config and sets report; refuse bad input
              → select_positions  what the solve touches (l47.solvers.select: events, anchors, turn ends, background)
              → fit_anchors       protected contexts within the anchors budget, chosen for span (solvers/anchors.py)
              → build_problem     the layer-L batches and per-event token terms
              → check_feasible    the feasibility plan (solvers/plan.py), stored in the record
              → solve_problem     WFLD or FTPO -> float ΔW
              → requantize        ΔW -> Q8_0 bytes of the target and their runtime values (what ships)
              → measure           every claimed figure on the re-quantised weights (l47.data.record.SolveClaims)
              → write_outputs     bundle (or overlay), solve record, ledger
With --sweep (solvers/sweep.py) the steps solve_problem → measure run once per candidate of a small grid, each
judged on dev; the chosen one is written, the record lists every candidate.

Every figure it reports is computed by the exact tail forward on the re-quantised weights (as shipped). The
same command on the same inputs writes the same bytes (no timestamps; deterministic solvers). The library
prints nothing: messages go to `log(str)`, FTPO steps to `progress(dict)` (l47.app renders them).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import l47
from l47.data import record as rec
from l47.errors import L47Error
from l47.fileio import AtomicGroup, sha256_file
from l47.model import names
from l47.solvers.batch import Batch, EventTerms, batch_mix, gather, pick_chosen
from l47.solvers.ftpo import FtpoConfig
from l47.solvers.anchors import DEFAULT_BUDGET_FRACTION, AnchorChoice, choose_anchors
from l47.solvers.select import SOLVER_SETS, Selection, select_positions
from l47.solvers.wfld import WfldConfig
from l47.tail.forward import head_stats, paired_stats

METHODS = ("wfld", "ftpo")
DEFAULT_METHOD = "ftpo"  # solve to the target within the KL budget (docs/SOLVERS.md; measured in docs/BENCHMARKS.md)
COMMON_KEYS = ("method", "seed", "max_background", "max_anchors_per_word", "protect_turn_ends", "n_chosen",
               "anchors_budget", "target_residual", "kl_budget", "wfld", "ftpo")
KL_BUDGET_SAFETY = 0.5  # default KL budget = this × the tightest KLD bar ((e) kld_max, (g) chat_kld)


@dataclass(frozen=True)
class SolveArgs:
    experiment: Path
    method: str | None  # None: [solver] method, else DEFAULT_METHOD
    out: Path
    model: Path | None = None
    overlay: bool = False
    device: str = "cpu"
    ledger: Path | None = None
    sets_json: Path | None = None  # reuse a `l47 sets --json` report instead of re-mining
    allow_other_model: bool = False  # use dumps of another model (each one noted in the solve record)
    sweep: bool = False  # a small grid of candidates judged on dev, the chosen one written (solvers/sweep.py)
    precision: str | None = None  # head GEMM precision (l47.model.weights.head_precision); None: "auto"


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
    anchors_budget: float = DEFAULT_BUDGET_FRACTION  # exact anchors may use at most this share of f; beyond it they
    # are thinned by span (solvers/anchors.py), the solver's own turn ends always kept
    target_residual: float = 0.2  # per phrase: aimed p(rejected) after / before (the plan checks it is reachable)
    kl_budget: float = 0.0  # nats of mean background KL (> 0 when set); 0: KL_BUDGET_SAFETY × the tightest KLD bar
    wfld: WfldConfig = WfldConfig()
    ftpo: FtpoConfig = FtpoConfig()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SolveResult:
    """What `run_solve` returns: the record it wrote (its `claims` typed) and where."""

    record: rec.SolveRecord
    bundle: Path
    record_path: Path
    config: SolveConfig

    @property
    def claims(self) -> rec.SolveClaims:
        return self.record.claims


def _sub(cls, d: dict, where: str):
    from l47.data.experiment import config_from_table

    ranges = {"p_cap": (0.0, 0.999), "step_sizes": (1e-6, 1.0), "max_removed": (0.0, 1.0), "n_chosen": (1, None),
              "kl_rows": (1, None), "plausible_end_p": (0.0, 1.0), "relax": (0.0, 1.0), "relax_after": (1, None)}
    return config_from_table(cls, d, where, f"solver.{cls.__name__.removesuffix('Config').lower()}", ranges)[0]


def resolve_config(solver_table: dict, method: str | None, where: str) -> SolveConfig:
    """[solver] table -> SolveConfig, every key type- and range-checked (an unknown key answered with the nearest
    known one); `method` (--method) wins over the table's `method`, default DEFAULT_METHOD."""
    from l47.data.experiment import config_from_table

    t = dict(solver_table or {})
    method = method or t.pop("method", None) or DEFAULT_METHOD
    t.pop("method", None)
    if method not in METHODS:
        raise L47Error(where, "method ([solver] method or --method)", f"one of {METHODS}", repr(method))
    def num(key: str, default, ok, expected: str):
        v = t.pop(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(float(v)):
            raise L47Error(where, f"solver.{key}", expected, repr(v))
        return float(v)

    mine = dict(anchors_budget=num("anchors_budget", DEFAULT_BUDGET_FRACTION, lambda x: 0 < x <= 1,
                                   "a share of the shared-expert width f in (0, 1] (1 = all of f)"),
                target_residual=num("target_residual", 0.2, lambda x: 0 < x < 1,
                                    "a residual ratio p_after / p_before in (0, 1)"),
                kl_budget=num("kl_budget", 0.0, lambda x: x >= 0 and np.isfinite(x),
                              "a mean background KL budget > 0 nats (0: derived from the KLD bars)"))
    top, sub = config_from_table(SolveConfig, t, where, "solver",
                                 ranges={"n_chosen": (1, None), "max_background": (1, None)},
                                 nested=("wfld", "ftpo"), fixed={"method": method})
    return dataclasses.replace(top, method=method, wfld=_sub(WfldConfig, sub.get("wfld", {}), where),
                               ftpo=_sub(FtpoConfig, sub.get("ftpo", {}), where), **mine)


# ----------------------------------------------------------------------------------------------------------
# plan


class DumpCache:
    """The report's accepted documents by sha256, read once; batches of (doc, row) pairs."""

    def __init__(self, report, w, allow_other_model: bool = False):
        self.w = w
        self.allow_other_model = allow_other_model
        self.other_model_notes: list[str] = []  # dumps of another model, allowed (l47.data.identity)
        self.paths = {d.sha256: d.path for d in report.docs if not d.refused}
        self._cache: dict[str, object] = {}

    def dump(self, sha: str):
        from l47.dumps import read_dump

        if sha not in self._cache:
            p = Path(self.paths[sha])
            d = read_dump(p)
            m = str(d.meta.model)
            if self.allow_other_model and len(m) == 64 and m != self.w.model_sha256:
                from l47.data.identity import other_model_notes

                self.other_model_notes += other_model_notes([p], self.w.model_sha256, self.w.path, True)
            elif len(m) == 64 and all(c in "0123456789abcdef" for c in m) and m != self.w.model_sha256:
                raise L47Error(p, "meta.model", f"the base model's sha256 {self.w.model_sha256[:16]}…",
                               f"{m[:16]}… (dumped from another model)")
            self._cache[sha] = d
        return self._cache[sha]

    def tokens(self, sha: str):
        return self.dump(sha).tokens

    def batch(self, pairs) -> Batch | None:
        by: dict[str, list[int]] = {}
        for sha, pos in pairs:
            by.setdefault(sha, []).append(pos)
        items = [(self.dump(s), rows) for s, rows in by.items()]
        return gather(items, self.w.device) if items else None


@dataclass
class SolvePlan:
    args: SolveArgs
    exp: object  # l47.data.experiment.Experiment
    model: Path
    out: Path
    cfg: SolveConfig
    base_g: object  # GGUF of the base
    w: object  # TailWeights
    report: object  # SetsReport
    sets_built_here: bool  # the sets pass (base scoring of every document) ran inside this solve
    dumps: DumpCache
    ledger: object = None  # l47.data.ledger.Ledger of the base model (or the one --ledger names)


def plan_solve(args: SolveArgs) -> SolvePlan:
    """Load and check every input before any solving: model, output path, config, target type, sets report."""
    from l47.data.experiment import load_experiment
    from l47.data.ledger import Ledger
    from l47.data.sets import build_sets, check_sets_report, load_sets_report
    from l47.model.gguf_io import open_gguf
    from l47.model.weights import load_tail_weights

    exp = load_experiment(args.experiment)
    given = load_sets_report(args.sets_json) if args.sets_json else None
    if given is not None:  # made from these inputs? (token hashes only: before the model is read)
        check_sets_report(given, exp, args.sets_json)
    model = args.model or exp.model
    if model is None:
        raise L47Error(exp.path, "model", "a base GGUF (experiment `model` or --model)", "none")
    out = Path(args.out)
    if out.exists() and Path(model).exists() and os.path.samefile(out, model):
        raise L47Error(out, "--out", "a new file, never the base model", f"the base {model}")
    cfg = resolve_config(exp.solver, args.method, str(exp.path))
    base_g = open_gguf(model)
    w = load_tail_weights(base_g, policy=exp.policy, device=args.device, precision=args.precision)
    tinfo = base_g.info(w.target)
    if tinfo.type_name != "Q8_0":
        raise L47Error(model, f"tensor {w.target}", "ggml type Q8_0 (it ships re-quantised to Q8_0)", tinfo.type_name)
    # the base model's ledger, validated before any scoring; every document this solve may score is in it first
    ledger = Ledger.open(args.ledger, base_g.sha256())
    built = not args.sets_json
    if given is not None and given.model_sha256 != w.model_sha256:
        raise L47Error(args.sets_json, "model_sha256", f"{w.model_sha256[:16]}… (the base model given, {model})",
                       f"{given.model_sha256[:16]}… (a sets report of another model: {given.model})")
    report = build_sets(exp, w, device=args.device, ledger=ledger, command="solve") if built else given
    refuse_thin(exp, report)
    ledger.append([d.sha256 for d in report.docs if d.set in SOLVER_SETS and not d.refused and d.sha256],
                  w.model_sha256, "solve")
    return SolvePlan(args, exp, Path(model), out, cfg, base_g, w, report, built, DumpCache(report, w, args.allow_other_model),
                     ledger)


def refuse_thin(exp, report) -> None:
    """Thin phrases (l47.data.thin) refused before any long work: one line naming each, its counts per split and
    the documents to add."""
    from l47.data.thin import thin_phrases

    th = exp.thresholds
    thin = thin_phrases([p["phrase"] for p in report.phrases], report.events, report.docs, th.min_train_per_phrase,
                        th.min_heldout_per_phrase)
    if thin:
        none = all(not t.counts.get("train") for t in thin) and len(thin) == len(report.phrases)
        raise L47Error(exp.path, f"phrases ({len(thin)} thin)",
                       f"≥ {th.min_train_per_phrase} train events and ≥ {th.min_heldout_per_phrase} held-out events "
                       f"per phrase (thresholds min_train_per_phrase, min_heldout_per_phrase)",
                       ("none for any phrase: " if none else "") + "; ".join(t.line() for t in thin))


# ----------------------------------------------------------------------------------------------------------
# problem and solve


def kl_budget(plan: "SolvePlan") -> float:
    """The configured KL budget, or KL_BUDGET_SAFETY × the tightest of bars (e) and (g)'s KLD limits."""
    if plan.cfg.kl_budget > 0:
        return plan.cfg.kl_budget
    th = plan.exp.thresholds
    return KL_BUDGET_SAFETY * min(th.kld_max, th.chat_kld)


def fit_anchors(plan: "SolvePlan", sel: Selection, log) -> tuple[Selection, AnchorChoice | None]:
    """Protected contexts within `anchors_budget` of f: when the collateral anchors and turn ends span more, keep
    every turn end and then the collateral anchors that span the most (pivoted QR); the rest are dropped (they
    stay scored by the audit's collateral bars). Returns the thinned selection and what was kept."""
    cfg, w = plan.cfg, plan.w
    cand = plan.dumps.batch([(c.doc_sha256, c.pos) for c in sel.anchors] + sel.turn_ends)
    if cand is None:
        return sel, None
    budget = int(np.floor(cfg.anchors_budget * w.f))
    n_col = len(sel.anchors)
    must = list(range(n_col, cand.P))  # turn ends of the solver's own chats: always kept
    choice = choose_anchors(cand.hh, must, budget, tol=cfg.wfld.anchor_tol)
    kept_col = sorted(i for i in choice.kept if i < n_col)
    if len(must) > budget:  # turn ends are kept whatever the budget; collateral only where it adds span
        log(f"anchors: the {len(must)} turn ends alone exceed the anchors budget {budget} "
            f"(= {cfg.anchors_budget:g} × f = {w.f}); all kept, and {len(kept_col)} of {n_col} collateral anchors "
            f"(those that add span beyond them, rank {choice.rank})")
    elif len(kept_col) < n_col:
        log(f"anchors: {n_col} collateral + {len(must)} turn ends would span more than the budget {budget} "
            f"(= {cfg.anchors_budget:g} × f); kept {len(kept_col)} collateral anchors chosen for span, rank "
            f"{choice.rank}; the dropped ones keep ≤ {choice.uncovered:.0%} of their key outside the kept span")
    return dataclasses.replace(sel, anchors=[sel.anchors[i] for i in kept_col]), choice


@dataclass
class Problem:
    events: Batch  # one row per train event, in selection order
    terms: EventTerms
    anchors: Batch | None  # collateral anchors, then turn ends
    background: Batch
    dev: Batch | None  # dev events (FTPO's best-step choice only)
    near: Batch | None = None  # near misses: prefix rows whose target is not the banned final (FTPO's tether)
    near_banned: torch.Tensor | None = None  # [N] the banned final token at each near miss
    dev_rows: Batch | None = None  # dev documents away from prefix rows (FTPO's judge: KL and flips)


def build_problem(plan: SolvePlan, sel: Selection) -> Problem:
    w, cfg, dumps = plan.w, plan.cfg, plan.dumps
    ev = dumps.batch([(e.doc_sha256, e.pos) for e in sel.train])
    if ev.doc != tuple(e.doc_sha256 for e in sel.train) or ev.pos != tuple(e.pos for e in sel.train):
        raise L47Error("solve", "train events", "one batch row per event, in event order", "a different order")
    rejected = torch.as_tensor([e.final for e in sel.train], device=w.device)
    chosen = pick_chosen(ev, w, rejected, sel.special, k=cfg.n_chosen)
    scale_of = {p["phrase"]: float(p.get("margin_scale", 1.0)) for p in plan.report.phrases}
    terms = EventTerms(rejected=rejected, chosen=chosen, special=torch.as_tensor(sel.special, dtype=torch.long),
                       scale=torch.as_tensor([scale_of.get(e.phrase, 1.0) for e in sel.train], device=w.device))
    an = dumps.batch([(c.doc_sha256, c.pos) for c in sel.anchors] + sel.turn_ends)
    dev = dumps.batch([(e.doc_sha256, e.pos) for e in sel.dev]) if sel.dev and cfg.method == "ftpo" else None
    near = near_banned = None
    if sel.near and cfg.method == "ftpo":
        near = dumps.batch([(s, r) for s, r, _ in sel.near])
        near_banned = torch.as_tensor([b for _, _, b in sel.near], device=w.device)
    dev_rows = dumps.batch(list(sel.dev_rows)) if sel.dev_rows and cfg.method == "ftpo" else None
    return Problem(ev, terms, an, dumps.batch(sel.background), dev, near, near_banned, dev_rows)


def describe(sel: Selection, prob: Problem) -> str:
    return (f"solve: {len(sel.train)} train events, {len(sel.dev)} dev events, {len(sel.near)} near misses, "
            f"{0 if prob.anchors is None else prob.anchors.P} anchors ({len(sel.turn_ends)} of them turn ends of "
            f"the solver's chats), {prob.background.P} background positions "
            f"({'every row' if sel.stride == 1 else f'one row in {sel.stride}'} of {sel.background_total}, prefix rows "
            f"left out) from {sel.background_docs} documents")


def check_feasible(plan: "SolvePlan", sel: Selection, prob: "Problem"):
    """The feasibility plan (solvers/plan.py) for this selection: per phrase events, base p, needed and
    reachable log-odds, share inside the protected span, binding constraint."""
    from l47.solvers.plan import PlanInputs, feasibility

    r = plan.report
    phrases = [p["phrase"] for p in r.phrases]
    counts: dict[str, dict] = {ph: {} for ph in phrases}
    pb: dict[str, list] = {ph: [] for ph in phrases}
    for e in r.events:
        counts.setdefault(e.phrase, {})
        counts[e.phrase][e.set] = counts[e.phrase].get(e.set, 0) + 1
        if e.set in ("train", "dev"):
            pb.setdefault(e.phrase, []).append(e.p_base)
    empty = [ph for ph in phrases if not sum(counts.get(ph, {}).values())]
    if empty:
        raise L47Error(plan.exp.path, f"phrases.text = {empty[0]!r}", "a phrase with at least one event (prefix-exact, "
                       f"base p ≥ {r.thresholds['non_event_p']}) in the experiment's documents", "zero events")
    words = [c.word for c in sel.anchors] + [names.IM_END] * len(sel.turn_ends)
    return feasibility(plan.w, PlanInputs(
        phrases, counts, {k: float(np.mean(v)) if v else float("nan") for k, v in pb.items()}, prob.events,
        [e.phrase for e in sel.train], np.asarray([e.p_base for e in sel.train]), prob.terms, prob.background,
        prob.anchors, words, len(sel.turn_ends), plan.cfg.target_residual, kl_budget(plan),
        [e.doc_sha256 for e in sel.train],
        [{"doc_sha256": e.doc_sha256, "phrase": e.phrase, "p_base": e.p_base} for e in sel.dev]), plan.cfg.wfld,
        soft_anchors=plan.cfg.method == "ftpo")


def describe_feasibility(fp) -> list[str]:
    """One line per phrase that cannot reach its target, plus the anchors' use of f."""
    from l47.solvers.plan import BINDING_EVENTS

    out = [f"plan: anchors rank {fp.anchor_rank} of f = {fp.f} ({fp.turn_ends} turn ends), null space {fp.null_dim}"
           f"{' (soft anchors: the bound is without their span)' if fp.anchors_soft else ''}; "
           f"target residual {fp.target:g}, KL budget {fp.kl_budget:.3g}"]
    for p in fp.short:
        if p.binding == BINDING_EVENTS:
            out.append(f"plan: {p.phrase!r} cannot be trained: no train events ({p.events})")
            continue
        out.append(f"plan: {p.phrase!r} cannot reach its target: {p.binding} (needs {p.needed_gap:.3g} nats of "
                   f"log-odds, reachable {p.reachable_gap:.3g}; {p.events.get('train', 0)} train events, "
                   f"{p.span_share_mean:.0%} of their keys inside the protected span)")
    return out + [f"plan: {n}" for n in fp.notes]


@dataclass
class Solved:
    dW: torch.Tensor  # [n, f] f32, the float solution
    summary: dict  # the solver's diagnostics
    predicted_bg_kl: float | None = None
    convergence: rec.Convergence | None = None


def solve_problem(plan: SolvePlan, sel: Selection, prob: Problem, log, progress) -> Solved:
    from l47.solvers.ftpo import train_ftpo

    cfg, w = plan.cfg, plan.w
    torch.manual_seed(cfg.seed)
    if cfg.method == "wfld":
        return wfld_solve(plan, prob, log)
    step = None if progress is None else (lambda r: progress({**r, "steps": cfg.ftpo.steps}))
    res = train_ftpo(w, ftpo_problem(plan, sel, prob), cfg.ftpo, progress=step)
    conv = res.convergence(cfg.target_residual)
    return Solved(res.dW, {**res.summary(), "warnings": res.notes}, None, conv)


def wfld_solve(plan: SolvePlan, prob: Problem, log) -> Solved:
    """WFLD on the problem within the solve's KL budget (`kl_budget`: every accepted iterate's exact background
    KL within it, of the float ΔW and re-quantised as shipped; solvers/wfld.py), on the CPU when the device has no
    float64 (MPS: WFLD's algebra is f64)."""
    from l47.solvers.batch import batch_to
    from l47.solvers.wfld import KlBudget, solve_wfld

    w, t, dev = plan.w, prob.terms, plan.w.device
    if w.numerics.no_f64:
        from l47.model.weights import weights_to

        w, t = weights_to(w, "cpu"), EventTerms(t.rejected.cpu(), t.chosen.cpu(), t.special.cpu(), t.scale.cpu())
    on = (lambda b: b) if w is plan.w else (lambda b: batch_to(b, "cpu"))
    budget = KlBudget(kl_budget(plan), shipped=lambda dW: requantize(plan, dW.to(dev)).W_q.to(w.device))
    res = solve_wfld(w, on(prob.events), t, on(prob.background), on(prob.anchors), plan.cfg.wfld, log=log,
                     budget=budget)
    conv = rec.Convergence(stop_reason=res.stop_reason, max_violation=res.violation,
                           violation_tol=res.tolerance, iterations=len(res.iterations) - 1)
    if res.violation > res.tolerance:
        log(f"warning: WFLD ended with a max constraint violation of {res.violation:.3g} nats > tolerance "
            f"{res.tolerance:g} ({res.stop_reason}; exact background KL {res.exact_bg_kl:.3g}, budget "
            f"{kl_budget(plan):.3g})")
    return Solved(res.dW.to(dev), res.summary(), res.predicted_bg_kl, conv)


def ftpo_problem(plan: SolvePlan, sel: Selection, prob: Problem):
    """The trainer's problem: soft anchors with tolerances from the bars ((d) per word, (f) at turn ends), dev
    events with their phrases, the target and budget, and the re-quantisation map (candidates judged as shipped)."""
    from l47.solvers.ftpo import FtpoProblem

    th = plan.exp.thresholds
    groups = [c.word for c in sel.anchors] + [names.IM_END] * len(sel.turn_ends)
    tols = [abs(th.collateral_word_mean)] * len(sel.anchors) + [abs(th.im_end_dlogp)] * len(sel.turn_ends)
    dev_final = torch.as_tensor([e.final for e in sel.dev], device=plan.w.device) if prob.dev is not None else None
    return FtpoProblem(events=prob.events, terms=prob.terms, phrase=[e.phrase for e in sel.train],
                       background=prob.background, target_residual=plan.cfg.target_residual,
                       kl_budget=kl_budget(plan), anchors=prob.anchors, anchor_group=groups, anchor_tol=tols,
                       near=prob.near, near_banned=prob.near_banned, dev=prob.dev, dev_final=dev_final,
                       dev_phrase=[e.phrase for e in sel.dev], dev_rows=prob.dev_rows, special_tol=th.special_rise_tol, im_end=sel.im_end,
                       im_end_tol=abs(th.im_end_dlogp),
                       dev_kl_limit=th.chat_kld,
                       shipped=lambda dW: requantize(plan, dW).W_q)


# ----------------------------------------------------------------------------------------------------------
# re-quantise and measure


@dataclass
class Shipped:
    raw: np.ndarray  # Q8_0 bytes of the target
    W_q: torch.Tensor  # their runtime values [n, f] f32 on the weights' device


def requantize(plan: SolvePlan, dW: torch.Tensor) -> Shipped:
    from l47.solvers.bundle import requantize_target

    raw, W_q = requantize_target(plan.base_g, plan.w.target, plan.w.W_sd + dW)
    return Shipped(raw, W_q.to(plan.w.device))


def event_p(plan: SolvePlan, events: list, W_q) -> tuple[np.ndarray, np.ndarray]:
    """(base, shipped) p(rejected) at each of `events` [P], [P] (exact forward; empty arrays for no event)."""
    if not events:
        return np.zeros(0), np.zeros(0)
    b = plan.dumps.batch([(e.doc_sha256, e.pos) for e in events])
    finals = np.array([e.final for e in events])
    with torch.no_grad():
        p0 = np.exp(head_stats(batch_mix(b, plan.w), plan.w, finals).logp_target)  # [P]
        p1 = np.exp(head_stats(batch_mix(b, plan.w, W_sd=W_q), plan.w, finals).logp_target)  # [P]
    return p0, p1


def event_rows(events: list, p0: np.ndarray, p1: np.ndarray) -> list[dict]:
    """One row per event {doc_sha256, phrase, p_before, p_after} (p0, p1 [P] from `event_p`): what
    l47.data.uncertainty bootstraps over documents."""
    return [{"doc_sha256": e.doc_sha256, "phrase": e.phrase, "p_before": float(a), "p_after": float(b)}
            for e, a, b in zip(events, p0, p1)]


def _p_rejected(plan: SolvePlan, events: list, W_q, p: tuple | None = None) -> rec.PRejected | None:
    """Mean base and shipped p(rejected) over `events`, overall and per phrase (`p`: their `event_p`, when
    already measured)."""
    if not events:
        return None
    p0, p1 = event_p(plan, events, W_q) if p is None else p
    phr = [e.phrase for e in events]

    def per_phrase(p):
        out: dict[str, list[float]] = {}
        for ph, v in zip(phr, p):
            out.setdefault(ph, []).append(float(v))
        return {k: float(np.mean(v)) for k, v in sorted(out.items())}

    return rec.PRejected(before=float(p0.mean()), after=float(p1.mean()), n=len(events),
                         per_phrase_before=per_phrase(p0), per_phrase_after=per_phrase(p1))


def _anchor_claims(plan: SolvePlan, an: Batch | None, dW, W_q) -> rec.AnchorClaims | None:
    if an is None:
        return None
    w = plan.w
    with torch.no_grad():
        m0, mf, mq = batch_mix(an, w), batch_mix(an, w, dW=dW), batch_mix(an, w, W_sd=W_q)
    tg = an.target.cpu().numpy()

    def worst(a, b):
        return float(np.abs(paired_stats(a, b, w, tg).dlogp).max())

    return rec.AnchorClaims(n=an.P, max_abs_dlogp_float=worst(m0, mf), max_abs_dlogp_shipped=worst(m0, mq),
                            requant_floor=worst(mf, mq))


def measure(plan: SolvePlan, sel: Selection, prob: Problem, solved: Solved, shipped: Shipped, feas=None,
            choice: AnchorChoice | None = None, dev_p: tuple | None = None) -> rec.SolveClaims:
    """Every claimed figure, on the re-quantised weights (exact forward). `dev_p`: the dev events' `event_p` on
    these weights, when already measured."""
    w, W_q = plan.w, shipped.W_q
    base_raw = np.asarray(plan.base_g.raw(w.target))
    with torch.no_grad():
        bg = paired_stats(batch_mix(prob.background, w), batch_mix(prob.background, w, W_sd=W_q), w,
                          prob.background.target.cpu().numpy())
    return rec.SolveClaims(
        dW_rel_norm=float((W_q - w.W_sd).norm() / w.W_sd.norm()),
        dW_rel_norm_float=float(solved.dW.norm() / w.W_sd.norm()),
        blocks_changed=int((shipped.raw.reshape(-1, 34) != base_raw.reshape(-1, 34)).any(1).sum()),
        train_p_rejected=_p_rejected(plan, sel.train, W_q),
        dev_p_rejected=_p_rejected(plan, sel.dev, W_q, dev_p),
        background_kl_exact=float(bg.kld.mean()),
        background_kl_predicted=solved.predicted_bg_kl,
        anchors=_anchor_claims(plan, prob.anchors, solved.dW, W_q),
        convergence=solved.convergence,
        feasibility=feas,
        anchor_choice=None if choice is None else choice.summary(),
        method={**solved.summary, "figures_from": "the float ΔW, before re-quantisation"},
    )


# ----------------------------------------------------------------------------------------------------------
# write: bundle, record, ledger


def touched_terms(sel: Selection, prob: Problem, method: str) -> list[rec.Touched]:
    """Every (document, row, token, term) the objective acted on."""
    ev = prob.events
    t = [rec.Touched(e.doc_sha256, e.pos, e.final, rec.TERM_SLOP, e.phrase, e.p_base) for e in sel.train]
    t += [rec.Touched(ev.doc[i], ev.pos[i], int(s), rec.TERM_SPECIAL) for i in range(ev.P) for s in sel.special]
    if method == "ftpo":
        t += [rec.Touched(ev.doc[i], ev.pos[i], int(c), rec.TERM_TETHER) for i in range(ev.P)
              for c in prob.terms.chosen[i].tolist()]
        t += [rec.Touched(s, r, b, rec.TERM_TETHER) for s, r, b in sel.near]
    t += [rec.Touched(c.doc_sha256, c.pos, c.token_id, rec.TERM_ANCHOR, c.word, c.p_base) for c in sel.anchors]
    t += [rec.Touched(s, r, int(sel.im_end), rec.TERM_ANCHOR, names.IM_END) for s, r in sel.turn_ends]
    t += [rec.Touched(s, p, -1, rec.TERM_BACKGROUND) for s, p in sel.background]
    return t


def _write_bundle(plan: SolvePlan, raw: np.ndarray, path: Path) -> str:
    """Bundle (or overlay) with provenance, written to `path` (the bundle's temp name); returns its sha256."""
    from l47.model.gguf_io import open_gguf
    from l47.solvers.bundle import write_bundle, write_overlay

    r = plan.report
    prov = {"method": plan.cfg.method, "toolkit_version": l47.__version__, "seed": str(plan.cfg.seed),
            "base_sha256": plan.base_g.sha256(), "target": plan.w.target, "config": plan.cfg.to_dict(),
            "dumps": sorted({d.sha256 for d in r.docs if not d.refused and d.set in SOLVER_SETS})}
    (write_overlay if plan.args.overlay else write_bundle)(plan.model, path, plan.w.target, raw, prov)
    return open_gguf(path).sha256()


def _measured_on_bundle(sel: Selection) -> list[str]:
    """The documents this solve measured on the bundle (events, anchors, turn ends, background), by content. They
    are in the ledger against the base since plan_solve; write_outputs adds the bundle they were scored on (a
    blind document is never scored by a solve)."""
    return sorted({e.doc_sha256 for e in sel.train + sel.dev} | {c.doc_sha256 for c in sel.anchors}
                  | {s for s, _ in sel.turn_ends + sel.background})


def write_outputs(plan: SolvePlan, sel: Selection, prob: Problem, shipped: Shipped,
                  claims: rec.SolveClaims, sweep: rec.SweepRecord | None = None) -> SolveResult:
    path = rec.record_path_for(plan.out)
    with AtomicGroup(path, plan.out) as unit:  # the bundle and its record: both or neither, whatever interrupts
        record = _write_bundle_and_record(plan, sel, prob, shipped, claims, sweep, unit.temp(plan.out),
                                          unit.temp(path))
        unit.on_commit(lambda: plan.ledger.append(_measured_on_bundle(sel), record.bundle_sha256, "solve"))
    return SolveResult(record, plan.out, path, plan.cfg)


def _write_bundle_and_record(plan: SolvePlan, sel: Selection, prob: Problem, shipped: Shipped,
                             claims: rec.SolveClaims, sweep, bundle_tmp: Path, record_tmp: Path) -> rec.SolveRecord:
    bundle_sha = _write_bundle(plan, shipped.raw, bundle_tmp)
    r, base_sha = plan.report, plan.base_g.sha256()
    inputs = [rec.InputFile(str(plan.model), base_sha, "model"),
              rec.InputFile(str(plan.exp.path), sha256_file(plan.exp.path), "experiment")]
    inputs += [rec.InputFile(d.path, d.sha256, d.set) for d in sorted(r.docs, key=lambda d: (d.set, d.sha256))]
    warnings = claims.method.get("warnings", [])
    record = rec.SolveRecord(method=plan.cfg.method, toolkit_version=l47.__version__, seed=plan.cfg.seed,
                             base_sha256=base_sha, bundle_sha256=bundle_sha, target=plan.w.target,
                             config=plan.cfg.to_dict(), inputs=inputs, touched=touched_terms(sel, prob, plan.cfg.method),
                             claims=claims, notes=list(warnings) + plan.dumps.other_model_notes,
                             numerics=plan.w.numerics.record(), stamps=_stamps(plan.dumps.other_model_notes),
                             sweep=sweep, experiment_content=r.content, experiment_content_sha256=r.content_sha256)
    record_tmp.write_text(record.to_json(), encoding="utf-8")
    return record


# ----------------------------------------------------------------------------------------------------------
# the driver


def run_solve(args: SolveArgs, log: Callable[[str], None] | None = None,
              progress: Callable[[dict], None] | None = None) -> SolveResult:
    """Solve and write the bundle, its record and the ledger lines. `log` receives messages, `progress` one dict
    per FTPO step (with "steps", the total). Returns the record (its claims typed) and the paths. With
    `args.sweep`: a small grid of candidates judged on dev, the chosen one written (solvers/sweep.py)."""
    log = log or (lambda _msg: None)
    if args.sweep:
        from l47.solvers.sweep import run_sweep

        return run_sweep(args, log, progress)
    plan, every, sel, choice, prob = _prepare(args, log)
    feas = check_feasible(plan, sel, prob)
    for line in describe_feasibility(feas):
        log(line)
    sel, prob = soft_anchors(plan, every, sel, prob, log)
    cand = solve_and_measure(plan, Posed(sel, prob, feas.to_dict(), choice), log, progress)
    return write_outputs(plan, sel, prob, cand.shipped, cand.claims)


def soft_anchors(plan: SolvePlan, every: Selection, sel: Selection, prob: Problem, log) -> tuple[Selection, Problem]:
    """FTPO's anchors are soft and use no direction of f: it keeps every collateral anchor (its plan, made on the
    thinned selection, bounds it without their span). WFLD: the thinned selection as it is."""
    if plan.cfg.method != "ftpo" or len(every.anchors) <= len(sel.anchors):
        return sel, prob
    log(f"ftpo: every collateral anchor kept as a soft anchor ({len(every.anchors)})")
    return every, dataclasses.replace(prob, anchors=plan.dumps.batch(
        [(c.doc_sha256, c.pos) for c in every.anchors] + every.turn_ends))


@dataclass(frozen=True)
class Posed:
    """What one solve of a prepared problem acts on and records: the selection, its batches, the feasibility
    plan (as JSON) and the anchors' choice."""

    sel: Selection
    prob: Problem
    feas: dict | None = None
    choice: AnchorChoice | None = None


@dataclass(frozen=True)
class Measured:
    """One solve, as shipped: its Q8_0 bytes and every figure measured on them."""

    shipped: Shipped
    claims: rec.SolveClaims
    dev_rows: list = field(default_factory=list)  # `event_rows` of the dev events on the shipped weights


def solve_and_measure(plan: SolvePlan, posed: Posed, log, progress) -> Measured:
    """solve_problem -> requantize -> measure: the one path from a problem to its shipped, measured ΔW (a plain
    solve and every sweep candidate)."""
    from l47.model.weights import check_finite

    solved = solve_problem(plan, posed.sel, posed.prob, log, progress)
    check_finite(solved.dW, f"l47 solve ({plan.cfg.method})", "ΔW (the solver's result)")  # never shipped
    shipped = requantize(plan, solved.dW)
    dev_p = event_p(plan, posed.sel.dev, shipped.W_q)
    claims = measure(plan, posed.sel, posed.prob, solved, shipped, posed.feas, posed.choice, dev_p)
    return Measured(shipped, claims, event_rows(posed.sel.dev, *dev_p))


def _stamps(other_model_notes) -> list[str]:
    from l47.data.identity import other_model_stamp

    return [other_model_stamp(len(other_model_notes))] if other_model_notes else []


def run_plan(args: SolveArgs, log: Callable[[str], None] | None = None):
    """`l47 plan`: the steps of `run_solve` up to the feasibility plan; nothing is solved or written. Returns
    (FeasibilityPlan, AnchorChoice | None)."""
    log = log or (lambda _msg: None)
    plan, _, sel, choice, prob = _prepare(args, log)
    return check_feasible(plan, sel, prob), choice


def _prepare(args: SolveArgs, log: Callable[[str], None]):
    """The steps `l47 solve` and `l47 plan` share: plan -> select every position -> anchors within budget ->
    the problem's batches. Returns (plan, every selected position, the kept selection, anchor choice, problem)."""
    plan = plan_solve(args)
    every = select_positions(plan.report, plan.cfg, plan.exp.path, plan.dumps.tokens)
    sel, choice = fit_anchors(plan, every, log)
    prob = build_problem(plan, sel)
    log(describe(sel, prob))
    return plan, every, sel, choice, prob
