"""`l47 solve`: experiment -> sets -> WFLD or FTPO -> re-quantised Q8_0 bundle + solve record.

    run_solve = plan_solve        load the experiment, base model, weights, config and sets report; refuse bad input
              → pose              solvers/problem.py: what the solve touches (select_positions, by the solver's
                                  policy), the anchors within budget (fit_anchors), the layer-L batches and
                                  per-event token terms, the KL budget resolved once -> a frozen Problem
              → plan_for          the feasibility plan (solvers/plan.py: check_feasible), stored in the record, or
                                  the one `l47 plan --json` made from the same inputs (--plan: check_plan_handoff)
              → solve_problem     the method's Solver (solvers/methods.py: WFLD or FTPO) -> float ΔW
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
from l47.data.experiment import Experiment, config_from_table, load_experiment
from l47.data.identity import other_model_notes, other_model_stamp
from l47.data.ledger import Ledger
from l47.data.sets import SetsReport, build_sets, canonical_sha256, check_sets_report, load_sets_report
from l47.data.thin import thin_phrases
from l47.dumps import read_dump
from l47.errors import L47Error
from l47.fileio import AtomicGroup, sha256_file
from l47.model import names
from l47.model.gguf_io import GGUFFile, open_gguf
from l47.model.weights import TailWeights, check_finite, load_tail_weights
from l47.solvers.anchors import DEFAULT_BUDGET_FRACTION
from l47.solvers.batch import Batch, batch_mix, gather
from l47.solvers.bundle import write_bundle, write_overlay
from l47.solvers.ftpo import FtpoConfig
from l47.solvers.knobs import KNOB, Knob, knob, knob_of, ranges
from l47.solvers.methods import METHODS, solver_for  # noqa: F401 (METHODS: re-exported for l47 init)
from l47.solvers.plan import BINDING_EVENTS, PlanInputs, feasibility
from l47.solvers.problem import Problem, Shipped, Solution, pose, resolve_kl_budget
from l47.solvers.select import SOLVER_SETS, Selection
from l47.solvers.wfld import WfldConfig
from l47.tail.forward import head_stats, paired_stats

DEFAULT_METHOD = "ftpo"  # solve to the target within the KL budget (docs/SOLVERS.md; measured in docs/BENCHMARKS.md)
COMMON_KEYS = ("method", "seed", "max_background", "max_anchors_per_word", "protect_turn_ends", "n_chosen",
               "anchors_budget", "target_residual", "kl_budget", "wfld", "ftpo")


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
    plan_json: Path | None = None  # the plan `l47 plan --json` wrote for these inputs (check_plan_handoff; with sets_json)


@dataclass(frozen=True)
class SolveConfig:
    method: str = field(metadata={KNOB: Knob(
        'ftpo (solve to target_residual within kl_budget; the default when none is named) | wfld (closed '
        'form); --method overrides')})
    seed: int = knob(0, "the solve's seed")
    max_background: int = knob(
        4000, 'WFLD: background positions of its Fisher (evenly spread); FTPO uses every row (solver.ftpo.kl_rows)', 1)
    max_anchors_per_word: int = knob(
        0, '> 0: protect at most this many collateral contexts per word; each exact anchor uses one direction of'
        ' the shared-expert width f, so keep anchors + events well below f')
    protect_turn_ends: bool = knob(
        True, "real turn ends (<|im_end|> targets) of the solver's chats are exact anchors too")
    n_chosen: int = knob(1, 'natural alternatives per event the freed mass goes to', 1)
    anchors_budget: float = knob(
        DEFAULT_BUDGET_FRACTION, "share of f exact anchors may use; beyond it they are thinned by span (turn ends "
        "kept)", 0.0, 1.0, open_lo=True, expected="a share of the shared-expert width f in (0, 1] (1 = all of f)")
    target_residual: float = knob(
        0.2, "aimed p(rejected) after / before per phrase, in (0, 1) (l47 plan checks it)", 0.0, 1.0, open_lo=True,
        open_hi=True, expected="a residual ratio p_after / p_before in (0, 1)")
    kl_budget: float = knob(
        0.0, "nats of mean background KL (> 0); 0 = half the tightest KLD bar", 0.0,
        expected="a mean background KL budget > 0 nats (0: derived from the KLD bars)")
    wfld: WfldConfig = knob(WfldConfig(), 'table [solver.wfld] (below)')
    ftpo: FtpoConfig = knob(FtpoConfig(), 'table [solver.ftpo] (below)')

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULTS = SolveConfig(method=DEFAULT_METHOD)


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

    return config_from_table(cls, d, where, f"solver.{cls.__name__.removesuffix('Config').lower()}", ranges(cls))[0]


CHECKED_HERE = ("anchors_budget", "target_residual", "kl_budget")  # open bounds: checked by their Knob here


def resolve_config(solver_table: dict, method: str | None, where: str) -> SolveConfig:
    """[solver] table -> SolveConfig, every key type- and range-checked (the ranges: each field's Knob,
    solvers/knobs.py; an unknown key answered with the nearest known one); `method` (--method) wins over the
    table's `method`, default DEFAULT_METHOD."""
    t = dict(solver_table or {})
    method = method or t.pop("method", None) or DEFAULT_METHOD
    t.pop("method", None)
    solver_for(method, where)  # one of METHODS, else the one-line error naming the field

    def num(key: str):
        k, v = knob_of(SolveConfig, key), t.pop(key, getattr(DEFAULTS, key))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not k.ok(float(v)):
            raise L47Error(where, f"solver.{key}", k.expected, repr(v))
        return float(v)

    mine = {key: num(key) for key in CHECKED_HERE}
    top, sub = config_from_table(SolveConfig, t, where, "solver", ranges=ranges(SolveConfig),
                                 nested=("wfld", "ftpo"), fixed={"method": method})
    return dataclasses.replace(top, method=method, wfld=_sub(WfldConfig, sub.get("wfld", {}), where),
                               ftpo=_sub(FtpoConfig, sub.get("ftpo", {}), where), **mine)


# ----------------------------------------------------------------------------------------------------------
# plan


class DumpCache:
    """The report's accepted documents by sha256, read once; batches of (doc, row) pairs."""

    def __init__(self, report: SetsReport, w: TailWeights, allow_other_model: bool = False):
        self.w = w
        self.allow_other_model = allow_other_model
        self.other_model_notes: list[str] = []  # dumps of another model, allowed (l47.data.identity)
        self.paths = {d.sha256: d.path for d in report.docs if not d.refused}
        self._cache: dict[str, object] = {}

    def dump(self, sha: str):
        if sha not in self._cache:
            p = Path(self.paths[sha])
            d = read_dump(p)
            m = str(d.meta.model)
            if self.allow_other_model and len(m) == 64 and m != self.w.model_sha256:
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
    """Every input of a solve, loaded and checked (plan_solve)."""
    args: SolveArgs
    exp: Experiment
    model: Path
    out: Path
    cfg: SolveConfig
    base_g: GGUFFile  # the base model
    w: TailWeights
    report: SetsReport
    sets_built_here: bool  # the sets pass (base scoring of every document) ran inside this solve
    dumps: DumpCache
    ledger: Ledger | None = None  # the base model's (or the one --ledger names)


def plan_solve(args: SolveArgs) -> SolvePlan:
    """Load and check every input before any solving: model, output path, config, target type, sets report."""
    exp = load_experiment(args.experiment)
    if args.plan_json is not None and not args.sets_json:
        raise L47Error("l47 solve", "--plan", "--sets too (the sets report the plan was made from)", "no --sets")
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
    if args.plan_json is not None:  # a plan of other inputs is refused before anything is written
        check_plan_handoff(args.plan_json, handoff_inputs(args, exp, report, w.model_sha256))
    ledger.append([d.sha256 for d in report.docs if d.set in SOLVER_SETS and not d.refused and d.sha256],
                  w.model_sha256, "solve")
    return SolvePlan(args, exp, Path(model), out, cfg, base_g, w, report, built, DumpCache(report, w, args.allow_other_model),
                     ledger)


def refuse_thin(exp, report) -> None:
    """Thin phrases (l47.data.thin) refused before any long work: one line naming each, its counts per split and
    the documents to add."""
    th = exp.thresholds
    thin = thin_phrases([p.phrase for p in report.phrases], report.events, report.docs, th.min_train_per_phrase,
                        th.min_heldout_per_phrase)
    if thin:
        none = all(not t.counts.get("train") for t in thin) and len(thin) == len(report.phrases)
        raise L47Error(exp.path, f"phrases ({len(thin)} thin)",
                       f"≥ {th.min_train_per_phrase} train events and ≥ {th.min_heldout_per_phrase} held-out events "
                       f"per phrase (thresholds min_train_per_phrase, min_heldout_per_phrase)",
                       ("none for any phrase: " if none else "") + "; ".join(t.line() for t in thin))


# ----------------------------------------------------------------------------------------------------------
# problem and solve


def check_feasible(problem: Problem):
    """The feasibility plan (solvers/plan.py) for the problem's kept selection: per phrase events, base p, needed
    and reachable log-odds, share inside the protected span, binding constraint, the plan's edit checked exactly."""
    return feasibility(problem.plan.w, plan_inputs(problem), problem.plan.cfg.wfld,
                       soft_anchors=problem.solver.soft_anchors)


def plan_inputs(problem: Problem) -> PlanInputs:
    """What the plan reads of the problem: the kept selection's events, background and anchors (the span), its dev
    events (their states: the plan's edit is measured on them) and the anchors the solver holds with bars (d)/(f)'s
    tolerances."""
    plan, sel = problem.plan, problem.kept
    r, th = plan.report, plan.exp.thresholds
    phrases = [p.phrase for p in r.phrases]
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
    dev = problem.dev if problem.dev is not None else plan.dumps.batch([(e.doc_sha256, e.pos) for e in sel.dev])
    at = {(e.doc_sha256, e.pos): e for e in sel.dev}  # the batch's rows by provenance (grouped by document)
    dev_ev = [at[k] for k in zip(dev.doc, dev.pos)] if dev is not None else []
    held = problem.protected  # what the solver's soft anchors hold: every collateral anchor, then the turn ends
    label = {(c.doc_sha256, c.pos): c.word for c in problem.selection.anchors}
    n_col = 0 if held is None else held.P - (0 if problem.turn_ends is None else problem.turn_ends.P)
    held_words = [] if held is None else ([label[k] for k in zip(held.doc[:n_col], held.pos[:n_col])]
                                          + [names.IM_END] * (held.P - n_col))
    return PlanInputs(
        phrases, counts, {k: float(np.mean(v)) if v else float("nan") for k, v in pb.items()}, problem.events,
        [e.phrase for e in sel.train], np.asarray([e.p_base for e in sel.train]), problem.terms, problem.background,
        problem.kept_protected, words, len(sel.turn_ends), plan.cfg.target_residual, problem.kl_budget.nats,
        [e.doc_sha256 for e in sel.train],
        [{"doc_sha256": e.doc_sha256, "phrase": e.phrase, "p_base": e.p_base} for e in sel.dev],
        dev_events=dev, dev_final=np.asarray([e.final for e in dev_ev], dtype=np.int64),
        dev_phrase=[e.phrase for e in dev_ev], held=held, held_words=held_words,
        word_tol=abs(th.collateral_word_mean), end_tol=abs(th.im_end_dlogp))


def describe_feasibility(fp) -> list[str]:
    """One line per phrase that cannot reach its target, plus the anchors' use of f."""
    out = [f"plan: anchors rank {fp.anchor_rank} of f = {fp.f} ({fp.turn_ends} turn ends), null space {fp.null_dim}"
           f"{' (soft anchors: the bound is without their span)' if fp.anchors_soft else ''}; "
           f"target residual {fp.target:g}, KL budget {fp.kl_budget:.3g}"]
    for p in fp.short:
        if p.binding == BINDING_EVENTS:
            out.append(f"plan: {p.phrase!r} cannot be trained: no train events ({p.events})")
            continue
        edit = "" if p.edit_residual is None else f"the plan's edit within the budget reaches {p.edit_residual:.3g}; "
        out.append(f"plan: {p.phrase!r} cannot reach its target: {p.binding} ({edit}needs {p.needed_gap:.3g} nats of "
                   f"log-odds, first-order reachable {p.reachable_gap:.3g}; {p.events.get('train', 0)} train events, "
                   f"{p.span_share_mean:.0%} of their keys inside the protected span)")
    for p in fp.unproven:
        out.append(f"plan: {p.phrase!r} not shown reachable: the plan's own edit within the budget reaches "
                   f"{p.edit_residual:.3g} ({p.binding}); first-order reachable {p.reachable_gap:.3g} of "
                   f"{p.needed_gap:.3g} nats needed — the solver may do better")
    return out + [f"plan: {n}" for n in fp.notes]


def solve_problem(problem: Problem, log, progress) -> Solution:
    """The problem's solver (solvers/methods.py) on its config, seeded."""
    torch.manual_seed(problem.plan.cfg.seed)
    return problem.solver.solve(problem, problem.plan.cfg, log, progress)


# ----------------------------------------------------------------------------------------------------------
# re-quantise and measure


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


def measure(problem: Problem, solved: Solution, shipped: Shipped, feas: dict | None = None,
            dev_p: tuple | None = None) -> rec.SolveClaims:
    """Every claimed figure, on the re-quantised weights (exact forward). `feas`: the feasibility plan (JSON);
    `dev_p`: the dev events' `event_p` on these weights, when already measured."""
    plan, sel, prob, choice = problem.plan, problem.selection, problem, problem.choice
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
        anchors=_anchor_claims(plan, prob.protected, solved.dW, W_q),
        convergence=solved.convergence,
        feasibility=feas,
        anchor_choice=None if choice is None else choice.summary(),
        method={**solved.summary, "figures_from": "the float ΔW, before re-quantisation"},
    )


# ----------------------------------------------------------------------------------------------------------
# write: bundle, record, ledger


def touched_terms(prob: Problem) -> list[rec.Touched]:
    """Every (document, row, token, term) the objective acted on."""
    sel, ev = prob.selection, prob.events
    t = [rec.Touched(e.doc_sha256, e.pos, e.final, rec.TERM_SLOP, e.phrase, e.p_base) for e in sel.train]
    t += [rec.Touched(ev.doc[i], ev.pos[i], int(s), rec.TERM_SPECIAL) for i in range(ev.P) for s in sel.special]
    if prob.solver.tethers:
        t += [rec.Touched(ev.doc[i], ev.pos[i], int(c), rec.TERM_TETHER) for i in range(ev.P)
              for c in prob.terms.chosen[i].tolist()]
        t += [rec.Touched(s, r, b, rec.TERM_TETHER) for s, r, b in sel.near]
    t += [rec.Touched(c.doc_sha256, c.pos, c.token_id, rec.TERM_ANCHOR, c.word, c.p_base) for c in sel.anchors]
    t += [rec.Touched(s, r, int(sel.im_end), rec.TERM_ANCHOR, names.IM_END) for s, r in sel.turn_ends]
    t += [rec.Touched(s, p, -1, rec.TERM_BACKGROUND) for s, p in sel.background]
    return t


def _write_bundle(plan: SolvePlan, raw: np.ndarray, path: Path) -> str:
    """Bundle (or overlay) with provenance, written to `path` (the bundle's temp name); returns its sha256."""
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


def write_outputs(prob: Problem, shipped: Shipped, claims: rec.SolveClaims,
                  sweep: rec.SweepRecord | None = None) -> SolveResult:
    plan, sel = prob.plan, prob.selection
    path = rec.record_path_for(plan.out)
    with AtomicGroup(path, plan.out) as unit:  # the bundle and its record: both or neither, whatever interrupts
        record = _write_bundle_and_record(prob, shipped, claims, sweep, unit.temp(plan.out), unit.temp(path))
        unit.on_commit(lambda: plan.ledger.append(_measured_on_bundle(sel), record.bundle_sha256, "solve"))
    return SolveResult(record, plan.out, path, plan.cfg)


def _write_bundle_and_record(prob: Problem, shipped: Shipped, claims: rec.SolveClaims, sweep, bundle_tmp: Path,
                             record_tmp: Path) -> rec.SolveRecord:
    plan = prob.plan
    bundle_sha = _write_bundle(plan, shipped.raw, bundle_tmp)
    r, base_sha = plan.report, plan.base_g.sha256()
    inputs = [rec.InputFile(str(plan.model), base_sha, "model"),
              rec.InputFile(str(plan.exp.path), sha256_file(plan.exp.path), "experiment")]
    inputs += [rec.InputFile(d.path, d.sha256, d.set) for d in sorted(r.docs, key=lambda d: (d.set, d.sha256))]
    warnings = claims.method.get("warnings", [])
    record = rec.SolveRecord(method=plan.cfg.method, toolkit_version=l47.__version__, seed=plan.cfg.seed,
                             base_sha256=base_sha, bundle_sha256=bundle_sha, target=plan.w.target,
                             config=plan.cfg.to_dict(), inputs=inputs, touched=touched_terms(prob),
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
    per FTPO step (with "steps", the total). Returns the record (its claims typed) and the paths. `args.sweep`
    (a small grid of candidates judged on dev, the chosen one written) is solvers/sweep.py's `run_sweep`, which
    calls into this module: the caller picks (l47.app.solve_report.solve_and_print)."""
    log = log or (lambda _msg: None)
    if args.sweep:
        raise L47Error("l47 solve", "--sweep", "l47.solvers.sweep.run_sweep for a sweep", "run_solve")
    plan = plan_solve(args)
    problem = pose(plan, solver_for(plan.cfg.method), log)
    feas, lines = plan_for(problem, args.plan_json)
    for line in lines:
        log(line)
    cand = solve_and_measure(problem, feas, log, progress)
    return write_outputs(problem, cand.shipped, cand.claims)


@dataclass(frozen=True)
class Measured:
    """One solve, as shipped: its Q8_0 bytes and every figure measured on them."""

    shipped: Shipped
    claims: rec.SolveClaims
    dev_rows: list = field(default_factory=list)  # `event_rows` of the dev events on the shipped weights


def solve_and_measure(problem: Problem, feas: dict | None, log, progress) -> Measured:
    """solve_problem -> requantize -> measure: the one path from a problem to its shipped, measured ΔW (a plain
    solve and every sweep candidate). `feas`: the feasibility plan (JSON) the record keeps."""
    plan, sel = problem.plan, problem.selection
    solved = solve_problem(problem, log, progress)
    check_finite(solved.dW, f"l47 solve ({problem.solver.name})", "ΔW (the solver's result)")  # never shipped
    shipped = problem.ship(solved.dW)
    dev_p = event_p(plan, sel.dev, shipped.W_q)
    claims = measure(problem, solved, shipped, feas, dev_p)
    return Measured(shipped, claims, event_rows(sel.dev, *dev_p))


def _stamps(other_model_notes) -> list[str]:

    return [other_model_stamp(len(other_model_notes))] if other_model_notes else []


def run_plan(args: SolveArgs, log: Callable[[str], None] | None = None) -> PlanRun:
    """`l47 plan`: the steps of `run_solve` up to the feasibility plan; nothing is solved or written."""
    log = log or (lambda _msg: None)
    plan = plan_solve(args)
    problem = pose(plan, solver_for(plan.cfg.method), log)
    fp = check_feasible(problem)
    return PlanRun(fp, problem.choice, plan_handoff(problem, fp), problem)


@dataclass(frozen=True)
class PlanRun:
    """What `l47 plan` made: the plan, the anchors it kept, its hand-off to `l47 solve --plan` (plan_handoff) and
    the posed problem (the solve-time estimate reads it)."""
    fp: object  # solvers/plan.py FeasibilityPlan
    choice: object  # AnchorChoice | None
    handoff: dict
    problem: Problem


# ----------------------------------------------------------------------------------------------------------
# the plan's hand-off: `l47 plan --json` -> `l47 solve --plan`, so the README walk computes the plan once

PLAN_HANDOFF = "l47.plan-handoff/1"


def plan_code_sha256() -> str:
    """sha256 of the source of the packages the plan's figures come from (model, tail, data, solvers): a plan made
    by other code is not reused (the version string does not move with every commit). Once per process."""
    global _PLAN_CODE
    if _PLAN_CODE is None:
        import hashlib
        import importlib

        h = hashlib.sha256()
        for pkg in ("l47.model", "l47.tail", "l47.data", "l47.solvers", "l47.solvers.ftpo"):
            for f in sorted(Path(importlib.import_module(pkg).__file__).parent.glob("*.py")):
                h.update(f"{pkg}/{f.name}\0".encode() + f.read_bytes())
        _PLAN_CODE = h.hexdigest()
    return _PLAN_CODE


_PLAN_CODE: str | None = None


def handoff_inputs(args: SolveArgs, exp: Experiment, report: SetsReport, model_sha256: str) -> dict:
    """What the plan is a function of: the sets report (its content, which hashes the experiment's, and its
    events, p_base, refusals and split), the base model (sha256 of its bytes), the solve config with its KL budget
    resolved, the head's device type and precision, and the code (plan_code_sha256)."""
    cfg = resolve_config(exp.solver, args.method, str(exp.path))
    cfg = dataclasses.replace(cfg, kl_budget=resolve_kl_budget(cfg.kl_budget, exp.thresholds))  # as `pose` does
    return {"sets_report_sha256": canonical_sha256(report.to_dict()), "model_sha256": model_sha256,
            "solver": cfg.to_dict(), "head": {"device": torch.device(args.device).type,
                                              "precision": args.precision or "auto"},
            "code_sha256": plan_code_sha256()}


def plan_handoff(problem: Problem, fp) -> dict:
    """The hand-off `l47 plan --json` writes beside its plan (the file's "plan": fp.to_dict()): the plan's inputs and
    their hash, the lines a solve logs of the plan, and the hash of the plan with those lines (a plan edited by
    hand is refused, as a sets report is)."""
    plan = problem.plan
    inputs, lines = handoff_inputs(plan.args, plan.exp, plan.report, plan.w.model_sha256), describe_feasibility(fp)
    return {"schema": PLAN_HANDOFF, "inputs": inputs, "inputs_sha256": canonical_sha256(inputs), "solve_log": lines,
            "body_sha256": canonical_sha256({"plan": fp.to_dict(), "solve_log": lines})}


def plan_json(run: PlanRun, estimate: dict | None = None) -> dict:
    """The JSON `l47 plan --json` writes: the plan, the anchors kept, the solve-time estimate, the hand-off."""
    return {"plan": run.fp.to_dict(), "anchors": None if run.choice is None else run.choice.summary(),
            "estimate": estimate, "handoff": run.handoff}


def load_plan_handoff(path) -> tuple[dict, dict]:
    """(the plan, its hand-off) of a `l47 plan --json` file, checked whole (schema, both hashes); L47Error naming
    the field."""
    import json

    path = Path(path)
    if not path.is_file():
        raise L47Error(path, "--plan", "the JSON `l47 plan --json` wrote for these inputs",
                       "a directory" if path.is_dir() else "no such file")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise L47Error(path, "plan", "a JSON file written by `l47 plan --json`", str(e)) from None
    h = d.get("handoff") if isinstance(d, dict) else None
    if not isinstance(h, dict) or h.get("schema") != PLAN_HANDOFF:
        raise L47Error(path, "handoff.schema", f"{PLAN_HANDOFF} (a plan written by this l47: re-run `l47 plan --json`)",
                       repr(None if not isinstance(h, dict) else h.get("schema")))
    if (not isinstance(h.get("inputs"), dict) or canonical_sha256(h["inputs"]) != h.get("inputs_sha256")
            or canonical_sha256({"plan": d.get("plan"), "solve_log": h.get("solve_log")}) != h.get("body_sha256")):
        raise L47Error(path, "handoff.body_sha256", "a plan hashing to the hashes written with it",
                       "other hashes (edited after it was written)")
    return d["plan"], h


def check_plan_handoff(path, inputs: dict) -> tuple[dict, list[str]]:
    """(the feasibility plan as the record keeps it, the lines a solve logs of it) from `l47 plan --json` at `path`,
    refused (L47Error, one line naming both hashes and what changed) unless made from `inputs` (handoff_inputs)."""
    fp, h = load_plan_handoff(path)
    sha = canonical_sha256(inputs)
    if sha != h["inputs_sha256"]:
        old, new = dict(rec.flat_items(h["inputs"])), dict(rec.flat_items(inputs))
        ch = [f"{'.'.join(k)}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k)]
        raise L47Error(path, "handoff.inputs_sha256", f"{sha[:16]}… (the plan of this solve's inputs)",
                       f"{h['inputs_sha256'][:16]}… (a plan of other inputs: " + "; ".join(ch[:3])
                       + (f" (+{len(ch) - 3} more)" if len(ch) > 3 else "") + "; re-run `l47 plan --json`)")
    return fp, [*h["solve_log"], f"plan: reused from {path} (made from these inputs)"]


def plan_for(problem: Problem, plan_json) -> tuple[dict, list[str]]:
    """The solve's feasibility plan (its record form) and its log lines: the one `l47 plan --json` wrote when
    `plan_json` is given (checked against this problem's inputs), else computed here."""
    if plan_json is not None:
        plan = problem.plan
        return check_plan_handoff(plan_json, handoff_inputs(plan.args, plan.exp, plan.report, plan.w.model_sha256))
    fp = check_feasible(problem)
    return fp.to_dict(), describe_feasibility(fp)
