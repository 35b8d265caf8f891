#!/usr/bin/env python3
"""Efficacy benchmark (issue 12 item 11): the whole workflow on each shipped model, with the toolkit's defaults.

Per model (the demo, model2) and per method (wfld, ftpo):
    dump (hf engine) -> experiment.toml with NO [solver] table (no per-model knob) -> sets -> solve -> audit
and it records: events per phrase per split, per-phrase dev and held-out residual (mean p(rejected) after /
before, with a bootstrap-over-documents 90 % interval), exact vs predicted background KL, every bar's value
and verdict, wall time per step; before each solve, the plan `l47 plan` prints (its edit's exact residual per
phrase, issue 37 item 4) beside the solver's residual, and a section "plan vs solver" listing every phrase where
they disagree (the plan reachable and the solver short, or not within 2×). A method that fails (an L47Error such as an infeasible solve) is recorded
with its message; the benchmark goes on.

Usage:
    python scripts/bench_efficacy.py --out /tmp/bench_efficacy                 # both models, both methods
    python scripts/bench_efficacy.py --models model2 --methods wfld --small   # reduced size (the e2e test)
    python scripts/bench_efficacy.py --out DIR --markdown docs/BENCHMARKS.md  # append the table
    python scripts/bench_efficacy.py --out DIR --methods ''                   # dumps and sets only
    python scripts/bench_efficacy.py --out DIR --methods ftpo --reuse          # solve + audit on DIR's dumps/sets
    python scripts/bench_efficacy.py --zoo 4 --models '' --methods ftpo --device cuda   # 4 fresh zoo seeds
    python scripts/bench_efficacy.py --zoo-seeds 101,103 --models '' --methods ftpo     # these zoo seeds

Zoo models (issue 37, scripts/make_zoo.py, docs/ZOO.md): `--zoo N` draws N fresh seeds (printed), builds each one
not yet in the cache (~/.cache/l47-zoo/seed-S, or --zoo-root) on --device, and runs the same walk on it: its written
pool chats and its own generations in the split pool, its own generated held-out chats, no [solver] table. A model
whose build or walk fails is marked in the table with the failing command and its first error line; the others go on.

Outputs: DIR/<model>/ (dumps, experiment.toml, sets.json, <method>/bundle.gguf, <method>/audit/), DIR/results.json
(everything above) and DIR/results.md (the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSpec:
    """One shipped model and its documents. `pool_generate`: prompts whose sampled turns join the split pool;
    `pool_written`: written chats that join it. Sizes are caps on the documents used (None = all)."""

    name: str
    model: Path
    data: Path
    phrases: tuple[str, ...]
    kld: tuple[str, ...]  # jsonl stems, each a KLD domain
    pool_generate: str | None = "prompts.jsonl"
    pool_written: str | None = None
    caps: dict = field(default_factory=dict)
    blind_prompts: str = "heldback_blind_prompts.jsonl"  # prompts in no document of any set: the blind chats'


def specs() -> dict[str, ModelSpec]:
    from l47.app import demo

    sys.path.insert(0, str(REPO / "scripts"))
    import make_model2 as m2

    d2 = REPO / "l47" / "testing" / "model2"
    return {  # the demo: its own generations only, as `l47 demo` runs it (its prompts cover every phrase; the
        # written pool chats are unnatural for the demo model: proxy.base_ce 7.8 > ½ ln V)
        "demo": ModelSpec("demo", demo.MODEL, demo.DATA, tuple(demo.PHRASES),
                          ("kld_ops_tools", "kld_chat_json", "kld_prose"), "prompts.jsonl", None),
        "model2": ModelSpec("model2", d2 / "model2.gguf", d2, tuple(m2.PHRASES),
                            ("kld_order_json", "kld_recipes", "kld_support"), None, "pool_chat.jsonl"),
    }


def zoo_spec(seed: int, root: Path, small: bool = False) -> ModelSpec:
    """A built zoo model (scripts/make_zoo.py's folder) as a ModelSpec: its phrases and KLD stems from zoo.json."""
    z = json.loads((root / "zoo.json").read_text())
    return ModelSpec(f"zoo{seed}" + ("s" if small else ""), root / "zoo.gguf", root / "data", tuple(z["phrases"]),
                     tuple(z["kld"]), "prompts.jsonl", "pool_chat.jsonl")


SMALL = {"prompts": 8, "pool_chat": 48, "heldout_chat": 6, "collateral": 16, "background": 6, "kld": 3, "blind": 2}


def _subset(src: Path, dst: Path, n: int | None) -> Path:
    from l47.fileio import write_text_atomic

    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    return write_text_atomic(dst, "\n".join(lines[: n or len(lines)]) + "\n")


def _paths(summary) -> list[Path]:
    return [Path(r.path) for r in summary.results if r.path and r.status in ("written", "skipped")]


def dump_all(spec: ModelSpec, out: Path, caps: dict, max_new_tokens: int, log, device: str = "cpu") -> dict[str, list[Path]]:
    """Every document set of the model through the hf engine (sampled turns for the prompts), on `device`."""
    from l47.app.dumping import DumpJob, GenerateOptions, run_dump

    inputs = out / "inputs"
    dirs: dict[str, list[Path]] = {}
    if spec.pool_generate and caps.get("prompts", 1) != 0:
        p = _subset(spec.data / spec.pool_generate, inputs / "prompts.jsonl", caps.get("prompts"))
        gen = GenerateOptions(max_new_tokens=max_new_tokens, seed=0, temperature=0.7, top_p=0.9, top_k=40)
        dirs["generated"] = _paths(run_dump(DumpJob(spec.model, p, out / "dumps" / "generated", generate=gen, device=device)))
        log(f"{spec.name}: generated {len(dirs['generated'])}")
    from l47.app.demo import CHAT_TOKENS, HELDOUT_PROMPTS

    sets = {"heldout_chat": "heldout_chat", "collateral": "collateral", "background": "background",
            **{k: k for k in spec.kld}}
    if (spec.data / HELDOUT_PROMPTS).is_file() and caps.get("heldout_chat", 1) != 0:
        # the model's own chats from held-back prompts, as `l47 demo` makes them (bars (f), (g) and proxy.base_ce
        # judge text natural for the model); else the model's written held-out chats
        del sets["heldout_chat"]
        src = _subset(spec.data / HELDOUT_PROMPTS, inputs / HELDOUT_PROMPTS, caps.get("heldout_chat"))
        gen = GenerateOptions(max_new_tokens=CHAT_TOKENS, seed=0, temperature=0.7, top_p=0.9, top_k=40, think=True)
        dirs["heldout_chat"] = _paths(run_dump(DumpJob(spec.model, src, out / "dumps" / "heldout_chat", generate=gen,
                                                               device=device)))
        log(f"{spec.name}: heldout_chat (generated) {len(dirs['heldout_chat'])}")
    if spec.pool_written:
        sets["pool_chat"] = spec.pool_written.removesuffix(".jsonl")
    for key, stem in sets.items():
        cap = caps.get("kld") if key.startswith("kld_") else caps.get(key)
        src = _subset(spec.data / f"{stem}.jsonl", inputs / f"{stem}.jsonl", cap)
        dirs[key] = _paths(run_dump(DumpJob(spec.model, src, out / "dumps" / key, device=device)))
        log(f"{spec.name}: {key} {len(dirs[key])}")
    dirs.setdefault("blind", [])
    return dirs


def event_rows(sets_json: Path, positions_tsv: Path) -> dict[str, list[dict]]:
    """split -> event rows {doc_sha256, phrase, p_before, p_after}: the events of sets.json joined with the
    audit's per-position table (its `slop` rows: log p of the target under base and bundle)."""
    import math

    logp: dict[tuple[str, int], tuple[float, float]] = {}
    lines = positions_tsv.read_text(encoding="utf-8").split("\n")
    head = lines[0].split("\t")
    col = {k: head.index(k) for k in ("kind", "doc_sha256", "pos", "logp_base", "logp_new")}
    for ln in lines[1:]:
        r = ln.split("\t")
        if len(r) == len(head) and r[col["kind"]] == "slop":
            logp[(r[col["doc_sha256"]], int(r[col["pos"]]))] = (float(r[col["logp_base"]]), float(r[col["logp_new"]]))
    out: dict[str, list[dict]] = {}
    for e in json.loads(sets_json.read_text())["events"]:
        lp = logp.get((e["doc_sha256"], int(e["pos"])))
        if lp is not None:
            out.setdefault(e["set"], []).append({"doc_sha256": e["doc_sha256"], "phrase": e["phrase"],
                                                 "p_before": math.exp(lp[0]), "p_after": math.exp(lp[1])})
    return out


def _per_phrase(rows: list[dict] | None) -> dict:
    """phrase (and "(all)") -> {n, docs, p_before, residual, lo, hi}: residual = Σ p_after / Σ p_before over
    the phrase's events, its 90 % interval a bootstrap over documents (l47.data.uncertainty)."""
    from l47.data.uncertainty import per_phrase_bootstrap

    if not rows:
        return {}
    out = {}
    for ph, b in per_phrase_bootstrap(rows).items():
        rs = [r for r in rows if ph == "(all)" or r["phrase"] == ph]
        out[ph] = {"n": b["n_events"], "docs": b["n_docs"], "p_before": sum(r["p_before"] for r in rs) / len(rs),
                   "residual": b["value"], "lo": b["lo"], "hi": b["hi"]}
    return out


@dataclass(frozen=True)
class BenchOptions:
    """How every model is run: document caps (SMALL or none), sampled-turn length, reuse of an earlier --out's
    dumps and sets, the torch device, and `solver`: TOML appended to every experiment (a variant such as
    `[solver.ftpo]` / `seed = 1`; empty = the toolkit's defaults, the benchmark's figures)."""

    caps: dict = field(default_factory=dict)
    max_new_tokens: int = 96
    reuse: bool = False
    device: str = "cpu"
    solver: str = ""


def run_model(spec: ModelSpec, out: Path, methods: tuple[str, ...], opts: BenchOptions, log,
              res: dict | None = None) -> dict:
    """The walk on one model; `res` (filled as it goes) names in res["command"] the step being run, so a caller
    that catches a failure can say where it happened."""
    from l47.app.demo import write_experiment
    from l47.data.sets import build_sets, write_sets_json
    from l47.dumps.select import SPLITS
    from l47.errors import L47Error
    from l47.evals.audit import AuditArgs, run_audit
    from l47.solvers.solve import SolveArgs, plan_json, run_plan, run_solve

    from l47.data.sets import load_sets_report
    from l47.fileio import write_text_atomic

    res = {} if res is None else res
    res.update({"model": str(spec.model), "methods": {}})
    t0 = time.time()
    manifest, sets_json = out / "dumps.json", out / "sets.json"
    if opts.reuse and manifest.is_file() and sets_json.is_file():  # the dumps and sets of an earlier run of this --out
        dirs = {k: [Path(x) for x in v] for k, v in json.loads(manifest.read_text())["dirs"].items()}
        log(f"{spec.name}: reusing {sum(map(len, dirs.values()))} dumps and {sets_json}")
    else:
        res["command"] = f"l47 dump (every set of {spec.data}) --model {spec.model}"
        dirs = dump_all(spec, out, opts.caps, opts.max_new_tokens, log, opts.device)
        write_text_atomic(manifest, json.dumps({"dirs": {k: [str(x) for x in v] for k, v in dirs.items()}}))
    res["dump_s"] = round(time.time() - t0, 1)
    exp = write_experiment(out, spec.model.resolve(), dirs, solver=opts.solver, phrases=spec.phrases, words=(),
                           name=f"bench {spec.name}")
    t0 = time.time()
    if opts.reuse and sets_json.is_file() and manifest.is_file():
        report = load_sets_report(sets_json)
    else:
        res["command"] = f"l47 sets {exp} --json {sets_json}"
        report = build_sets(exp, device=opts.device)
        write_sets_json(report, sets_json)
    res["sets_s"] = round(time.time() - t0, 1)
    counts = report.counts("events")
    res["events"] = {ph: {s: c.get(s, 0) for s in (*SPLITS, "chat_heldout")} for ph, c in counts.items()}
    res["sets_warnings"] = list(report.warnings)
    for method in methods:
        m: dict = {}
        res["methods"][method] = m
        mdir = out / method
        mdir.mkdir(parents=True, exist_ok=True)
        bundle = mdir / "bundle.gguf"
        t0 = time.time()
        plan_path = mdir / "plan.json"
        res["command"] = m["command"] = f"l47 plan {exp} --sets {sets_json} --method {method} --json {plan_path}"
        plan_arg = None
        try:  # the plan `l47 plan` prints (solvers/solve.py run_plan), before the solve: what it predicts
            run = run_plan(SolveArgs(exp, method, bundle, ledger=mdir / "ledger.jsonl", sets_json=sets_json,
                                     device=opts.device))
            write_text_atomic(plan_path, json.dumps(plan_json(run), sort_keys=True))  # the walk's hand-off
            plan_arg = plan_path
            m.update(plan_summary(run.fp), plan_s=round(time.time() - t0, 1))
            log(f"{spec.name}/{method}: plan " + ", ".join(f"{ph} {_f(x['edit_residual'])} ({x['binding']})"
                                                          for ph, x in m["plan"].items()))
        except L47Error as e:
            m.update(plan_error=str(e), plan_s=round(time.time() - t0, 1))
            log(f"{spec.name}/{method}: plan refused: {e}")
        t0 = time.time()
        res["command"] = m["command"] = (f"l47 solve {exp} --sets {sets_json} --method {method} --out {bundle}"
                                         + (f" --plan {plan_arg}" if plan_arg else ""))
        try:
            solved = run_solve(SolveArgs(exp, method, bundle, ledger=mdir / "ledger.jsonl", sets_json=sets_json,
                                         device=opts.device, plan_json=plan_arg),
                               log=lambda s: log(f"{spec.name}/{method}: {s}"),
                               progress=lambda r: log(f"{spec.name}/{method}: {_progress_line(r)}"))
        except L47Error as e:
            m.update(solve_error=str(e), solve_s=round(time.time() - t0, 1))
            log(f"{spec.name}/{method}: solve refused: {e}")
            continue
        m["solve_s"] = round(time.time() - t0, 1)
        c = solved.claims
        m["background_kl_exact"] = c.background_kl_exact
        m["background_kl_predicted"] = c.background_kl_predicted
        m["dW_rel_norm"] = c.dW_rel_norm
        m["convergence"] = dataclasses.asdict(c.convergence) if c.convergence is not None else None
        m["anchors"] = dataclasses.asdict(c.anchors) if c.anchors is not None else None
        m["solver_residual"] = solver_residuals(c)
        t0 = time.time()
        res["command"] = m["command"] = f"l47 audit {bundle} --base {spec.model} --experiment {exp} --out {mdir / 'audit'}"
        try:
            a = run_audit(AuditArgs(bundle, spec.model, exp, mdir / "audit", ledger=mdir / "ledger.jsonl",
                                    plots=False, device=opts.device))
        except L47Error as e:
            m.update(audit_error=str(e), audit_s=round(time.time() - t0, 1))
            continue
        m["audit_s"] = round(time.time() - t0, 1)
        rep = a.report
        m["passed"] = a.passed
        m["bars"] = {b["name"]: {"value": b.get("value"), "passed": b.get("passed"), "threshold": b.get("threshold"),
                                 "slack": _slack(b), "applicable": b.get("applicable", True)} for b in rep["bars"]}
        rows = event_rows(sets_json, Path(a.out_dir) / "positions.tsv")
        for split in ("dev", "heldout", "chat_heldout"):
            m[split] = _per_phrase(rows.get(split))
        log(f"{spec.name}/{method}: audit {'PASS' if a.passed else 'FAIL'}; held-out residual "
            f"{(m['heldout'].get('(all)') or {}).get('residual')}")
        if opts.caps.get("blind", BLIND_CHATS) != 0:
            res["command"] = f"l47 audit {bundle} --blind (a fresh blind set) --dev {Path(a.out_dir) / 'report.json'}"
            m["blind"] = blind_signoff(spec, out, mdir, BlindRun(bundle, exp, Path(a.out_dir) / "report.json"), opts,
                                       log)
    res.pop("command", None)
    return res


def plan_summary(fp) -> dict:
    """The plan's figures the bench compares with the solver: its target, its edit (c, exact KL, the soft anchors'
    figures) and per phrase the exact edit residual (train, dev, the larger: the solver's at-target rule), the
    first-order bound's residual and the binding constraint."""
    return {"plan_target": fp.target,
            "plan_edit": None if fp.edit is None else dataclasses.asdict(fp.edit),
            "plan": {p.phrase: {"edit_residual": p.edit_residual, "edit_residual_train": p.edit_residual_train,
                                "edit_residual_dev": p.edit_residual_dev, "edit_residual_full": p.edit_residual_full,
                                "first_order_residual": p.reachable_residual, "binding": p.binding}
                     for p in fp.phrases}}


def solver_residuals(claims) -> dict[str, float]:
    """phrase -> the solver's residual as its at-target rule reads it: the larger of its dev and train residuals
    (Σ p after / Σ p before over the phrase's events on the shipped weights: the solve record's mean p per phrase,
    the same events before and after)."""
    from l47.solvers.ftpo import at_target_residuals

    def ratio(pr) -> dict[str, float]:
        if pr is None:
            return {}
        return {ph: pr.per_phrase_after[ph] / b for ph, b in pr.per_phrase_before.items() if b > 0}

    return at_target_residuals(ratio(claims.train_p_rejected), ratio(claims.dev_p_rejected))


PLAN_AGREES = (0.5, 2.0)  # issue 37 item 4: the solver's residual within 2× of the plan's, either way


def plan_vs_solver(results: dict) -> list[dict]:
    """Every (model, method, phrase) where the plan and the solver disagree: the plan says reachable (its edit's
    residual ≤ the target) and the solver falls short (its at-target residual > the target), or the ratio of the
    two, each read as max(residual, target), is outside PLAN_AGREES. Why the floor at the target: the plan's edit
    aims each event at the target and stops there, the solver's steps overshoot it (zoo seed 44868: plan 0.198 and
    0.189 at the target, solver 0.041 and 0.039), so below the target the two figures measure how far past it each
    went, not whether the plan predicted the phrase; a plan short of the target is still compared with the solver
    (plan 0.5, solver 0.1: 0.2 / 0.5, listed). Rows {model, method, phrase, target, plan, solver, ratio (solver /
    plan, unfloored; None when the plan's edit removed every bit of p), binding, why}."""
    out = []
    lo, hi = PLAN_AGREES
    for name, r in results.get("models", {}).items():
        for mn, m in (r.get("methods") or {}).items():
            plan, solver, t = m.get("plan") or {}, m.get("solver_residual") or {}, m.get("plan_target")
            for ph, x in plan.items():
                pr, sr = x.get("edit_residual"), solver.get(ph)
                if pr is None or sr is None or t is None:
                    continue
                ratio = sr / pr if pr > 0 else None
                why = []
                if pr <= t < sr:
                    why.append("plan reachable, solver short")
                if not lo <= max(sr, t) / max(pr, t) <= hi:
                    why.append(f"solver/plan (each at least the target) outside [{lo:g}, {hi:g}]")
                if why:
                    out.append({"model": name, "method": mn, "phrase": ph, "target": t, "plan": pr, "solver": sr,
                                "ratio": ratio, "binding": x.get("binding"), "why": "; ".join(why)})
    return out


def _ratio_cell(m: dict, ph: str) -> str:
    """solver / plan for one phrase of one method ('—' when either is missing)."""
    pr, sr = ((m.get("plan") or {}).get(ph) or {}).get("edit_residual"), (m.get("solver_residual") or {}).get(ph)
    return "—" if pr is None or sr is None or pr <= 0 else f"{sr / pr:.2f}"


BLIND_CHATS = 8  # fresh chats per blind set, as `l47 demo` signs off (l47.app.demo.BLIND_CHATS)
BLIND_TRIES = 24  # fresh seeds in a row without a slop event before a blind set is given up: a zoo model's own
# chats hold ~1 event each on average but some prompts rarely lead to one (zoo 2689: six misses in a row)


@dataclass(frozen=True)
class BlindRun:
    """What a blind sign-off signs: the bundle, its experiment and the dev audit's report."""

    bundle: Path
    exp: Path
    dev_report: Path


def blind_set(spec: ModelSpec, out: Path, ledger, opts: BenchOptions) -> tuple[list[Path], str]:
    """The blind set of a model: `BLIND_CHATS` fresh chats of its own from prompts of no set (`spec.blind_prompts`),
    as `l47 demo` makes them (each new by content to the ledger, each holding a slop event; the audit refuses a
    written blind chat). Returns (dump paths, how they were made)."""
    from l47.app.demo import BlindSource, fresh_blind_chats
    from l47.dumps.select import phrases_to_tuples
    from l47.model.vocab import vocab_for_model

    n = opts.caps.get("blind", BLIND_CHATS)
    pts, _ = phrases_to_tuples(list(spec.phrases), vocab_for_model(spec.model))
    paths, how = fresh_blind_chats(spec.model, out, ledger, pts, 1000, n=n,
                                   source=BlindSource(spec.data / spec.blind_prompts, opts.device, BLIND_TRIES))
    return paths, (f"{len(paths)} fresh chats of the model's own from {spec.blind_prompts} "
                   f"({len(how['skipped'])} seeds skipped)")


def blind_signoff(spec: ModelSpec, out: Path, mdir: Path, run: BlindRun, opts: BenchOptions, log) -> dict:
    """`l47 audit BUNDLE --blind SET --dev REPORT` on a fresh blind set (blind_set) -> {passed, how, per phrase
    residual with its 90 % interval over documents, the audit's error if it refused}."""
    from l47.data.ledger import Ledger
    from l47.errors import L47Error
    from l47.evals.audit import AuditArgs, run_audit
    from l47.model.gguf_io import open_gguf

    ledger_path = mdir / "ledger.jsonl"
    t0 = time.time()
    try:
        paths, how = blind_set(spec, out, Ledger.open(ledger_path, open_gguf(spec.model).sha256()), opts)
        a = run_audit(AuditArgs(run.bundle, spec.model, run.exp, mdir / "audit-blind", blind=tuple(paths),
                                dev_report=run.dev_report, ledger=ledger_path, plots=False, device=opts.device))
    except L47Error as e:
        log(f"{spec.name}: blind sign-off refused: {e}")
        return {"error": str(e), "s": round(time.time() - t0, 1)}
    rep = a.report
    slop = (rep.get("blind") or {}).get("slop") or {}
    per = {ph: _interval_row(x) for ph, x in (slop.get("per_phrase") or {}).items()}
    per["(all)"] = _interval_row(slop)
    failed = [b["name"] for b in rep["bars"] if b.get("applicable", True) and b.get("passed") is False]
    log(f"{spec.name}: blind sign-off {'PASS' if a.passed else 'FAIL'} ({how}); residual "
        f"{_f(per['(all)']['residual'])}{'; failed ' + ', '.join(failed) if failed else ''}")
    return {"passed": a.passed, "how": how, "per_phrase": per, "failed": failed, "s": round(time.time() - t0, 1)}


def _interval_row(x: dict) -> dict:
    """An audit's slop figures (one phrase or pooled) as the bench's row {n, docs, residual, lo, hi}."""
    iv = x.get("residual_interval") or [None, None]
    return {"n": x.get("n"), "docs": x.get("n_docs"), "residual": x.get("residual_ratio"), "lo": iv[0], "hi": iv[1]}


def zoo_seed_list(n: int, given: str) -> list[int]:
    """--zoo-seeds (as given) + n fresh random seeds of make_zoo's range, none repeated."""
    import random

    sys.path.insert(0, str(REPO / "scripts"))
    import make_zoo as mz

    seeds = []
    for x in (t.strip() for t in given.split(",") if t.strip()):
        if not x.isdigit() or int(x) not in mz.SEEDS:
            raise ValueError(f"--zoo-seeds: expected integers in {mz.SEEDS.start}..{mz.SEEDS.stop - 1}, found {x!r}")
        seeds.append(int(x))
    if n < 0:
        raise ValueError(f"--zoo: expected a count >= 0, found {n}")
    rng, target = random.SystemRandom(), len(seeds) + n
    while len(seeds) < target:
        s = rng.randrange(mz.SEEDS.start, mz.SEEDS.stop)
        if s not in seeds:
            seeds.append(s)
    return seeds


def _zoo_folder(seed: int, root: Path | None, small: bool) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    import make_zoo as mz

    return (root / (f"seed-{seed}-small" if small else f"seed-{seed}")) if root else mz.default_out(seed, small)


def prebuild_zoo(seeds: list[int], root: Path | None, small: bool, device: str, jobs: int) -> None:
    """Build the zoo models `jobs` at a time (one make_zoo process each, its log beside its folder); a failed
    build is left to build_zoo, which retries it in-process and records its error."""
    import os

    threads = max(1, (os.cpu_count() or 2) // jobs)
    running: list[subprocess.Popen] = []
    for s in seeds:
        folder = _zoo_folder(s, root, small)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # build_zoo records the error
        cmd = [sys.executable, str(REPO / "scripts" / "make_zoo.py"), "--seed", str(s), "--out", str(folder),
               "--device", device, "--threads", str(threads)] + (["--small"] if small else [])
        print(f"zoo seed {s}: {' '.join(cmd[1:])} > {folder}.log", flush=True)
        with open(f"{folder}.log", "w") as log:
            running.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        while len([p for p in running if p.poll() is None]) >= jobs:
            time.sleep(2)
    for p in running:
        p.wait()


def build_zoo(seed: int, root: Path | None, small: bool, device: str, res: dict) -> ModelSpec:
    """The zoo model of `seed` (built unless cached) as a ModelSpec; its record in res["zoo"]."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_zoo as mz

    spec = mz.draw_spec(seed, small)
    folder = _zoo_folder(seed, root, small)
    res["command"] = f"python scripts/make_zoo.py --seed {seed} --out {folder} --device {device}" + \
        (" --small" if small else "")
    log = Path(f"{folder}.log")
    if log.is_file() and not mz.is_built(folder, spec):  # prebuild_zoo's process failed: its last line says why
        last = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        raise RuntimeError(last[-1] if last else "make_zoo wrote nothing")
    z = mz.build(spec, folder, device, log=lambda s: print(s, flush=True))
    res["zoo"] = {"seed": seed, "register": z["register"], "arch": _arch_line(z), "specials": z["specials"],
                  "base_p": z["base_p"], "near_certain": z["near_certain"], "train_s": z["train"]["train_seconds"],
                  "train_device": z["train"]["device_name"], "learned": z.get("learned")}
    return zoo_spec(seed, folder, small)


def _arch_line(z: dict) -> str:
    m = z["arch"]
    kinds = "".join("I" if t == "indexed_attention" else "G" for t in m["layer_types"])
    return (f"{len(m['layer_types'])} layers {kinds}, n {m['hidden_size']}, f {m['shared_expert_intermediate_size']}, "
            f"{m['num_experts']} experts top-{m['num_experts_per_tok']}, hc rank {m['hc_lowrank']}, V {z['vocab']}, "
            f"head {z['head_type']}")


def _blind_cell(b: dict | None) -> str:
    """The blind sign-off's verdict (and the bars it failed, or why it was refused) for the method table."""
    if not b:
        return "—"
    if "error" in b:
        return f"refused: {b['error'][:80]}"
    return ("PASS" if b["passed"] else "FAIL " + ", ".join(b["failed"])) + f" ({b['how'].split(' (')[0]})"


def _slack(b: dict) -> float | None:
    """How far a bar's value is inside its threshold (negative: outside), in the bar's own units."""
    v, t = b.get("value"), b.get("threshold")
    if not isinstance(v, (int, float)) or not isinstance(t, (int, float)):
        return None
    return float(v - t) if b.get("direction") == ">=" else float(t - v)


def _progress_line(r: dict) -> str:
    """One FTPO evaluation as a log line: step, exact KL (background / dev rows), turn ends lost, residuals."""
    res = {**r.get("train_residual", {}), **r.get("dev_residual", {})}
    return (f"step {r.get('step')}/{r.get('steps')} kl {_f(r.get('kl_exact'))} dev {_f(r.get('kl_dev'))} "
            f"flips {r.get('dev_flips')} ends lost {r.get('turn_ends_lost')} λ {_f(r.get('lambda'))} "
            f"{r.get('elapsed_s')} s | " + " ".join(f"{k} {v:.2f}" for k, v in sorted(res.items())))


def _f(x, nd=3) -> str:
    return "—" if x is None else f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: one table of per-phrase residuals and one of KL, bars and times."""
    lines = [f"## Efficacy (issues 12, 37): defaults, no per-model knob — commit `{results['commit']}`", "",
             f"`python scripts/bench_efficacy.py {results['args']}` on {results['machine']}; residual = mean "
             "p(rejected) after / before at a split's events (90 % bootstrap interval over documents).", ""]
    for name, r in results["models"].items():
        if r.get("failed"):
            lines += [f"### {name}: FAILED", "", f"`{r['failed']['command']}`: {r['failed']['error']}", ""]
            continue
        if r.get("zoo"):
            z = r["zoo"]
            lines += [f"### {name} (`{Path(r['model']).name}`): {z['arch']}", "",
                      f"{z['register']} register; specials {z['specials']}; trained {z['train_s']} s on "
                      f"{z['train_device']}; base p(final | prefix) on written held-out chats (near-certain: "
                      f"{', '.join(z['near_certain'])}; learned: {z['learned']}): "
                      + ", ".join(f"{p} {_f(v)}" for p, v in z["base_p"].items()), ""]
        else:
            lines += [f"### {name} (`{Path(r['model']).name}`)", ""]
        lines += [
                  "| phrase | events train/dev/held-out | " +
                  " | ".join(f"{m} dev | {m} held-out | {m} blind" for m in r["methods"]) + " | " +
                  " | ".join(f"{m} plan | {m} solver/plan" for m in r["methods"]) + " |",
                  "|---|---|" + "---|---|---|" * len(r["methods"]) + "---|---|" * len(r["methods"])]
        for ph, ev in list(r["events"].items()) + [("(all)", None)]:
            cells = [ph, "" if ev is None else f"{ev['train']}/{ev['dev']}/{ev['heldout']}"]
            for m in r["methods"].values():
                for x in ((m.get("dev") or {}).get(ph), (m.get("heldout") or {}).get(ph),
                          ((m.get("blind") or {}).get("per_phrase") or {}).get(ph)):
                    cells.append("—" if not x or x["residual"] is None else
                                 f"{x['residual']:.2f} [{_f(x['lo'], 2)}, {_f(x['hi'], 2)}]")
            for m in r["methods"].values():  # the plan's edit residual (its binding) and the solver's over it
                x = (m.get("plan") or {}).get(ph)
                cells += ["—" if not x or x["edit_residual"] is None else
                          f"{x['edit_residual']:.2f} ({x['binding']})", _ratio_cell(m, ph)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| method | verdict | blind | bg KL exact | bg KL predicted | ‖ΔW‖/‖W‖ | stop | steps | failed bars | "
                  "solve s | audit s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for mn, m in r["methods"].items():
            if "solve_error" in m:
                lines.append(f"| {mn} | solve refused: {m['solve_error'][:120]} | | | | | | | | {m['solve_s']} | |")
                continue
            if "audit_error" in m:
                lines.append(f"| {mn} | audit refused: {m['audit_error'][:120]} | | | | | | | | {m['solve_s']} | |")
                continue
            failed = [k for k, b in (m.get("bars") or {}).items() if b["applicable"] and b["passed"] is False]
            conv = m.get("convergence") or {}
            lines.append(f"| {mn} | {'PASS' if m.get('passed') else 'FAIL'} | {_blind_cell(m.get('blind'))} | "
                         f"{_f(m.get('background_kl_exact'))} | "
                         f"{_f(m.get('background_kl_predicted'))} | {_f(m.get('dW_rel_norm'))} | "
                         f"{conv.get('stop_reason') or '—'} | {_f(conv.get('iterations'))} | {', '.join(failed) or 'none'} | "
                         f"{m.get('solve_s')} | {m.get('audit_s', '—')} |")
        bars = sorted({k for m in r["methods"].values() for k in (m.get("bars") or {})})
        if bars:
            lines += ["", "| bar (value, slack) | " + " | ".join(r["methods"]) + " |",
                      "|---|" + "---|" * len(r["methods"])]
            for b in bars:
                row = []
                for m in r["methods"].values():
                    x = (m.get("bars") or {}).get(b)
                    row.append("—" if not x else f"{_f(x['value'])} ({_f(x.get('slack'), 2)}) "
                               f"{'✓' if x['passed'] else '✗' if x['passed'] is False else ''}")
                lines.append(f"| {b} | " + " | ".join(row) + " |")
        lines += ["", f"dump {r['dump_s']} s, sets {r['sets_s']} s, model total {r.get('total_s')} s; sets warnings: "
                  f"{'; '.join(r['sets_warnings']) or 'none'}", ""]
    rows = plan_vs_solver(results)
    lines += ["## plan vs solver", "", "Every phrase where `l47 plan`'s edit reaches the target and the solver falls "
              "short, or the solver's residual (the larger of dev and train) is not within 2× of the plan's edit "
              "residual, each read as at least the target: a bug in one of them (issue 37 item 4).", ""]
    if rows:
        lines += ["| model | method | phrase | target | plan | solver | solver/plan | plan binding | why |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['model']} | {x['method']} | {x['phrase']} | {x['target']:g} | {x['plan']:.3g} | "
                  f"{x['solver']:.3g} | {_f(x['ratio'], 3)} | {x['binding']} | {x['why']} |" for x in rows]
    else:
        lines.append("none")
    lines.append("")
    return "\n".join(lines)


def write_results(out: Path, results: dict) -> str:
    from l47.fileio import write_text_atomic

    write_text_atomic(out / "results.json", json.dumps({**results, "plan_vs_solver": plan_vs_solver(results)},
                                                       indent=1))
    md = markdown(results)
    write_text_atomic(out / "results.md", md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/l47_bench_efficacy")
    ap.add_argument("--models", default="demo,model2")
    ap.add_argument("--methods", default="wfld,ftpo")
    ap.add_argument("--small", action="store_true", help="reduced document counts (the end-to-end test)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--markdown", default="", help="append the section to this file (docs/BENCHMARKS.md)")
    ap.add_argument("--device", default="cpu", help="torch device of the dumps, sets, solve and audit (cpu, cuda, mps)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the dumps and sets.json an earlier run wrote under the same --out (solve + audit only)")
    ap.add_argument("--solver", default="", metavar="TOML",
                    help="a file of TOML appended to every experiment (a solver variant, e.g. [solver.ftpo] seed = 1)")
    ap.add_argument("--zoo", type=int, default=0, help="N zoo models from fresh random seeds (printed)")
    ap.add_argument("--zoo-seeds", default="", help="zoo models of these seeds (comma-separated), beside --zoo N")
    ap.add_argument("--zoo-root", default="", help="zoo cache (default ~/.cache/l47-zoo; seed-S folders)")
    ap.add_argument("--zoo-small", action="store_true", help="zoo models at make_zoo's --small size (CPU)")
    ap.add_argument("--zoo-jobs", type=int, default=1, help="zoo models built at once (make_zoo processes; the walks "
                    "run one model at a time after them)")
    a = ap.parse_args(argv)
    import platform

    import torch

    out = Path(a.out).resolve()
    sp = specs()
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in sp]
    if bad:
        print(f"--models: unknown {bad}; expected some of {sorted(sp)}", file=sys.stderr)
        return 2
    methods = tuple(x for x in a.methods.split(",") if x)
    try:
        zoo_seeds = zoo_seed_list(a.zoo, a.zoo_seeds)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    if zoo_seeds:
        print(f"zoo seeds: {','.join(map(str, zoo_seeds))}", flush=True)
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    results = {"commit": commit, "args": " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"
                          + (f", device {a.device} ({torch.cuda.get_device_name()})" if a.device.startswith("cuda")
                             else f", device {a.device}"),
               "solver": Path(a.solver).read_text(encoding="utf-8") if a.solver else "", "models": {}}
    opts = BenchOptions(SMALL if a.small else {}, a.max_new_tokens, a.reuse, a.device, results["solver"])
    root = Path(a.zoo_root).expanduser() if a.zoo_root else None
    if zoo_seeds and a.zoo_jobs > 1:
        prebuild_zoo(zoo_seeds, root, a.zoo_small, a.device, a.zoo_jobs)
    jobs = [(name, lambda res, name=name: sp[name]) for name in models]
    jobs += [(f"zoo{s}" + ("s" if a.zoo_small else ""),
              lambda res, s=s: build_zoo(s, root, a.zoo_small, a.device, res)) for s in zoo_seeds]
    for name, get_spec in jobs:
        t0 = time.time()
        res: dict = {}
        try:
            spec = get_spec(res)
            run_model(spec, out / name, methods, opts, lambda s: print(s, flush=True), res)
        except Exception as e:  # noqa: BLE001  a model's failure is recorded; the other models go on
            first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
            res["failed"] = {"command": res.get("command", "?"), "error": f"{type(e).__name__}: {first}"}
            print(f"{name}: FAILED at `{res['failed']['command']}`: {res['failed']['error']}", flush=True)
        res.setdefault("model", "")
        res["total_s"] = round(time.time() - t0, 1)
        results["models"][name] = res
        md = write_results(out, results)  # after every model: a run cut short keeps the models it finished
    md = write_results(out, results)
    if a.markdown:
        from l47.fileio import write_text_atomic

        p = Path(a.markdown)
        write_text_atomic(p, p.read_text() + "\n" + md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
