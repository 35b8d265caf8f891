"""`l47 demo`: the whole workflow on the shipped demo model (a small qwen4exp that learned the slop phrases).

    dump (hf engine: the model's own generations + held-out chat, collateral, background, KLD, blind documents)
      -> sets -> solve (the solver's default, FTPO: the demo's experiment names no method) -> audit (must PASS)
      -> a negative control through the same audit (must FAIL): a bundle that suppresses a final word everywhere,
         with a solve record that touched non-prefix positions (the seed's v3 "mined" failure, seed §5)

Every number printed comes from the exact tail forward on the re-quantised weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

import l47
from l47.app import solve_report  # called through the module: a test replaces solve_and_print
from l47.app.audit_view import audit_and_print
from l47.app.dump_view import dump_and_print
from l47.app.dumping import DumpJob, GenerateOptions
from l47.app.sets_view import render_sets_table
from l47.data import record as rec
from l47.data.ledger import EV_BLIND_STARTED, Ledger
from l47.data.sets import build_sets, write_sets_json
from l47.dumps import read_dump
from l47.dumps.select import find_events, phrases_to_tuples
from l47.errors import L47Error
from l47.evals.audit import AuditArgs
from l47.fileio import write_json_atomic, write_text_atomic
from l47.model.gguf_io import open_gguf
from l47.model.vocab import vocab_for_model
from l47.model.weights import load_tail_weights
from l47.solvers.bundle import requantize_target, write_bundle
from l47.solvers.solve import SolveArgs, resolve_config

DATA = Path(__file__).resolve().parents[1] / "demo_data"
MODEL = DATA / "demo-model.gguf"
PHRASES = ("end to end", "short version", "here's what", "exactly what", "what's actually", "right away",
           "rather than")
WORDS = (" than", " what", " end", " away", " version", " actually")


@dataclass(frozen=True)
class DemoArgs:
    out: Path = Path("out/demo")
    model: Path = MODEL
    prompts: int | None = None  # use only the first N prompts (tests)
    max_new_tokens: int = 96
    seed: int = 0
    fresh: bool = False  # remove previous outputs first (dumps are otherwise resumed; the ledger is kept)
    control: bool = True
    pool_chat: bool = False  # add the written pool chats (demo_data/pool_chat.jsonl) to the split pool: every
    # phrase then has >= 15 train and >= 15 held-out events; off by default until the solver chooses its own
    # budget (with today's demo [solver] settings the ~7x larger train set over-edits: bars (f), (g) fail)
    ledger: Path | None = None  # default: the demo model's ledger under $L47_HOME (l47.data.ledger)


def _subset_jsonl(src: Path, dst: Path, n: int | None) -> Path:
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]

    return write_text_atomic(dst, "\n".join(lines[: n or len(lines)]) + "\n")


def _toml_list(paths) -> str:
    return "[" + ", ".join(json.dumps(str(p)) for p in paths) + "]"


# The demo runs the toolkit's defaults: no [solver] table (FTPO, its target and KL budget from the bars). It once
# hand-set WFLD's p_cap and max_anchors_per_word for this model; a default that needs that is a defect (issue 12).
SOLVER = ""
# a run on the first N prompts only (tests): its phrases may be thin; they are solved and audited, not refused,
# and every report says "weakened" (min_train_per_phrase, min_heldout_per_phrase below their defaults)
REDUCED = "[thresholds]\nmin_train_per_phrase = 1\nmin_heldout_per_phrase = 1\n"


def write_experiment(out: Path, model: Path, d: dict[str, list[Path]], solver: str = SOLVER, *,
                     phrases=PHRASES, words=WORDS, name: str = "l47 demo") -> Path:
    """The demo's experiment file: generated turns (and written chats, `pool_chat`) split by document into
    train/dev/heldout; human-written chat as chat_heldout; collateral documents alternately protected (anchor)
    and scored (eval). Other models (scripts/bench_efficacy.py): their phrases; `words` empty = the phrases'
    final tokens; `solver` empty = the toolkit's defaults."""
    coll = sorted(d["collateral"])
    anchor, evalc = coll[0::2], coll[1::2]
    kld = "\n".join(f"{k.removeprefix('kld_')} = {_toml_list(v)}" for k, v in sorted(d.items())
                    if k.startswith("kld_"))
    phrase_toml = "\n".join(f'[[phrases]]\ntext = "{p}"\n' for p in phrases)
    pool = sorted(d.get("generated", [])) + sorted(d.get("pool_chat", []))
    collateral = f"[collateral]\nwords = {json.dumps(list(words))}\n" if words else ""
    blind = f"blind = {_toml_list(sorted(d['blind']))}\n" if d.get("blind") else ""
    text = f'''name = {json.dumps(name)}
model = {json.dumps(str(model))}
policy = "strata"

[sets]
collateral_anchor = {_toml_list(anchor)}
collateral_eval = {_toml_list(evalc)}
background = {_toml_list(sorted(d["background"]))}
chat_heldout = {_toml_list(sorted(d["heldout_chat"]))}
{blind}
[sets.kld]
{kld}

[split]
pool = {_toml_list(pool)}
seed = 0

{phrase_toml}
{collateral}{solver}
'''
    return write_text_atomic(out / "experiment.toml", text)


INPUTS = ("pool_chat", "collateral", "background", "kld_ops_tools", "kld_chat_json", "kld_prose")
# pool_chat: written chats that join the generated turns in the split pool, so that every phrase has >= 10 train
# and >= 10 held-out events (scripts/make_demo_pool.py; the model's ~96-token generations hold ~1 event each)
FILES = {"pool_chat": "pool_chat.jsonl", "collateral": "collateral.jsonl", "background": "background.jsonl",
         "kld_ops_tools": "kld_ops_tools.jsonl", "kld_chat_json": "kld_chat_json.jsonl",
         "kld_prose": "kld_prose.jsonl"}
# Prompts held back from every set: the held-out chats (bars (f), (g)) and the blind chat are the model's own
# generations from them (DESIGN §4: natural for the model, per-document base CE inside the bar), with a
# <think> block so that every chat structure (f) judges is present.
HELDOUT_PROMPTS = "heldback_chat_prompts.jsonl"
BLIND_PROMPTS = "heldback_blind_prompts.jsonl"
CHAT_TOKENS = 160  # new tokens per held-out / blind chat
BLIND_TRIES = 6  # fresh seeds tried for a blind chat that holds a slop event and was never scored
BLIND_CHATS = 8  # fresh blind chats per sign-off (the blind set; k runs on over the held-back prompts): a chat
# holds three turn ends and one or two slop events, so one chat's (f) mean and residual are a draw — measured over
# 20 fresh chats of the demo (docs/BENCHMARKS.md "blind set"): one chat passes 60 % of its sign-offs, eight pooled 99 %;
# 24 more (2026-12-06, "Blind chats, one at a time"): 17 of 24 single sign-offs pass, and one chat in 24 flips a
# 0.008–0.014-nat tie (" It" vs <|im_end|>) with either FTPO rule: ~29 % of eight-chat sets fail on (f) by the draw


@dataclass(frozen=True)
class BlindSource:
    """Where fresh blind chats come from: the held-back prompts, the device that generates them, and how many
    seeds in a row may give a chat without a slop event before the blind set is given up."""

    prompts: Path = DATA / BLIND_PROMPTS
    device: str = "cpu"
    tries: int = BLIND_TRIES


def fresh_blind_chat(model: Path, out: Path, ledger, pts, seed: int, console=None,
                     k0: int | None = None, source: BlindSource = BlindSource()) -> tuple[Path, dict]:
    """A blind chat nobody has scored: the model's own generation from a held-back prompt, with a seed it has
    not used — the k-th blind document of this base model (k = "blind-started" entries in its ledger, or `k0`)
    uses prompt k mod N and seed `seed` + k. Seeds are skipped (k + 1, ...) while the generation is already in the
    ledger (by content) or holds no prefix-exact event of the phrases (a blind residual needs one; `source.tries`
    such misses in a row at most); only the tokens are looked at, nothing is scored. Returns (dump path, how it was
    chosen)."""
    prompts = [ln for ln in source.prompts.read_text().splitlines() if ln.strip()]
    k0 = ledger.count(EV_BLIND_STARTED) if k0 is None else k0
    skipped, k, misses = [], k0, 0
    while misses < source.tries:  # misses in a row: a seed whose chat is in the ledger (an earlier run used it;
        # the ledger's count lags the seeds a blind set skipped, so a rerun walks those again) resets the count
        rec = json.loads(prompts[k % len(prompts)])
        rec["id"] = f"{rec['id']}-seed{seed + k}"
        src = write_text_atomic(out / "inputs" / f"blind-{k}.jsonl", json.dumps(rec) + "\n")
        gen = GenerateOptions(max_new_tokens=CHAT_TOKENS, seed=seed + k, temperature=0.7, top_p=0.9, top_k=40,
                              think=True)
        s = dump_and_print(DumpJob(model, src, out / "dumps" / "blind" / str(k), generate=gen, device=source.device),
                           console)
        path = next(Path(r.path) for r in s.results if r.path)
        d = read_dump(path)
        if ledger.scored(d.sha256):
            skipped.append(f"{rec['id']}: already in the ledger")
            misses = 0
        elif not find_events(d.tokens, pts, d.role):
            skipped.append(f"{rec['id']}: no slop event")
            misses += 1
        else:
            return path, {"prompt": rec["id"], "seed": seed + k, "k": k, "skipped": skipped}
        k += 1
    raise L47Error(out / "dumps" / "blind", "blind chat", f"a generation with a slop event in {source.tries} fresh "
                   "seeds in a row", "; ".join(skipped))


def fresh_blind_chats(model: Path, out: Path, ledger, pts, seed: int, n: int = BLIND_CHATS,
                      console=None, source: BlindSource = BlindSource()) -> tuple[list[Path], dict]:
    """The blind set: `n` fresh blind chats (fresh_blind_chat), k running on from the ledger's "blind-started"
    count so every chat has its own prompt (k mod N) and seed. Returns (dump paths, {"chats": [how each was
    chosen], "skipped": [...]})."""
    k = ledger.count(EV_BLIND_STARTED)
    paths, chats, skipped = [], [], []
    for _ in range(n):
        path, how = fresh_blind_chat(model, out, ledger, pts, seed, console, k0=k, source=source)
        paths.append(path)
        chats.append({"prompt": how["prompt"], "seed": how["seed"], "k": how["k"], "doc": str(path)})
        skipped += how["skipped"]
        k = how["k"] + 1
    return paths, {"chats": chats, "skipped": skipped}


def suppress_word_bundle(base: Path, out: Path, word_id: int, contexts, rel_norm: float = 0.5) -> Path:
    """Negative control: ΔW that pushes one final word down in EVERY context (no prefix condition), as the
    seed's v3 "mined" loss did (seed §5.3). Rank one: along minus the word's head row, keyed on the mean hh of
    `contexts` ((dump, row) pairs where the word is the target), scaled to ‖ΔW‖/‖W‖ = rel_norm."""
    g = open_gguf(base)
    w = load_tail_weights(g, policy="strata")
    u = -w.head[word_id] / w.head[word_id].norm()  # [n] down the word's logit direction
    h = torch.stack([torch.tensor(np.asarray(d.hh[t]), dtype=torch.float32) for d, t in contexts]).mean(0)
    v = h / h.norm()  # [f]
    dW = rel_norm * w.W_sd.norm() * torch.outer(u, v)
    raw, _ = requantize_target(g, w.target, w.W_sd + dW)
    return write_bundle(base, out, w.target, raw, {"method": "negative-control: suppress a word everywhere"})


def control_record(bundle: Path, base: Path, sets_report, word_id: int) -> Path:
    """A solve record for the control that says what such a loss touches: every position whose target is the
    word — ordinary uses included, no prefix check (what bar (a) must catch)."""
    touched = [rec.Touched(c.doc_sha256, c.pos, c.token_id, rec.TERM_SLOP, c.word, c.p_base)
               for c in sets_report.collateral if c.token_id == word_id and c.set in ("collateral_anchor",)]
    touched += [rec.Touched(e.doc_sha256, e.pos, e.final, rec.TERM_SLOP, e.phrase, e.p_base)
                for e in sets_report.events if e.set == "train"]
    r = rec.SolveRecord(method="negative-control", toolkit_version=l47.__version__, seed=0,
                        base_sha256=open_gguf(base).sha256(), bundle_sha256=open_gguf(bundle).sha256(),
                        target="", config={"word_id": word_id}, inputs=[], touched=touched,
                        claims=rec.SolveClaims(), experiment_content=sets_report.content,
                        experiment_content_sha256=sets_report.content_sha256)
    p = rec.record_path_for(bundle)
    write_text_atomic(p, r.to_json())
    return p


MANIFEST = ".l47-demo-manifest.json"
STALE = ("ledger.jsonl", "audit", "audit-blind", "control", "bundle.gguf", "bundle.gguf.solve.json")
WRITES = STALE + ("inputs", "dumps", "experiment.toml", "sets.json", "demo_summary.json")  # top-level names


class DemoFolder:
    """The demo's output folder and its manifest (MANIFEST: every file and folder the demo wrote, relative).

    Opening refuses (exit 2, nothing changed) a path that is a file, or an existing folder that holds files and no
    manifest (not a demo folder). `remove(prefixes)` deletes only manifest-listed files (under `prefixes`, or all
    with None) and then the manifest-listed folders left empty; `record()` adds what this run wrote (files that
    appeared since opening) to the manifest."""

    def __init__(self, out: Path):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise L47Error(self.out, "--out", "a folder for the demo's outputs", "an existing file")
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        m = self.out / MANIFEST
        if m.is_file():
            try:
                d = json.loads(m.read_text(encoding="utf-8"))
                self.files, self.dirs = set(d["files"]), set(d["dirs"])
            except (ValueError, KeyError, TypeError) as e:
                raise L47Error(m, "manifest", "the demo's JSON manifest {files, dirs}",
                               f"unreadable ({type(e).__name__})") from None
        elif self.out.is_dir() and any(self.out.iterdir()):
            raise L47Error(self.out, "--out", "a new or empty folder, or one the demo wrote (with its manifest)",
                           "a folder holding other files (move them, or pick another --out)")
        self.before = self._scan()
        theirs = sorted(f for f in self.before[0] - self.files if f.split("/")[0] in WRITES)
        if theirs:
            raise L47Error(self.out / theirs[0], "--out", "only files the demo wrote where the demo writes "
                           f"(its manifest {MANIFEST})", f"{len(theirs)} other file(s) there")

    def _scan(self) -> tuple[set[str], set[str]]:
        files, dirs = set(), set()
        if self.out.is_dir():
            for p in self.out.rglob("*"):
                rel = p.relative_to(self.out).as_posix()
                (dirs if p.is_dir() and not p.is_symlink() else files).add(rel)
        files.discard(MANIFEST)
        return files, dirs

    def remove(self, prefixes) -> None:
        def hit(rel: str) -> bool:
            return prefixes is None or any(rel == q or rel.startswith(q + "/") for q in prefixes)

        for rel in sorted(f for f in self.files if hit(f)):
            (self.out / rel).unlink(missing_ok=True)
            self.files.discard(rel)
        for rel in sorted((d for d in self.dirs if hit(d)), key=lambda r: -r.count("/")):
            p = self.out / rel
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
                self.dirs.discard(rel)
        self.before = self._scan()
        self._write()

    def record(self) -> None:
        files, dirs = self._scan()
        self.files = (self.files & files) | (files - self.before[0])
        self.dirs = (self.dirs & dirs) | (dirs - self.before[1])
        self._write()

    def _write(self) -> None:
        if self.out.is_dir():
            write_json_atomic(self.out / MANIFEST, {"files": sorted(self.files), "dirs": sorted(self.dirs)})


def run_demo(args: DemoArgs, console) -> int:
    """dump -> sets -> solve -> audit (dev) -> blind sign-off; then the negative control. Exit code 0 when the
    solved bundle passes every bar, the blind sign-off passes and the negative control fails; 1 otherwise."""
    out = Path(args.out).resolve()  # the experiment file lists absolute dump paths
    if not Path(args.model).is_file():
        raise L47Error(args.model, "demo model", "the shipped GGUF (scripts/train_demo_model.py rebuilds it)",
                       "missing")
    own = DemoFolder(out)  # refuses a folder holding files the demo did not write, before any change
    # a demo run's bundle and reports start afresh; dumps are resumed. The ledger is the base model's own
    # (l47.data.ledger, never deleted): each run signs off on a fresh blind set, so a rerun is never refused.
    # Only files listed in the demo's own manifest are ever removed (never a folder or file it did not write).
    own.remove(None if args.fresh else STALE)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run_demo(args, console, out)
    finally:
        own.record()


@dataclass(frozen=True)
class _DemoRun:
    """What every step of one demo run shares: its arguments, console, output folder, model and ledger."""

    args: DemoArgs
    console: object
    out: Path
    model: Path  # resolved: the experiment file lists absolute paths
    ledger: object  # l47.data.ledger.Ledger of the demo model


def _run_demo(args: DemoArgs, console, out: Path) -> int:
    """1. dump -> 2. sets -> 3. solve -> 4./5. audit and blind sign-off -> 6. negative control -> result."""
    model = Path(args.model).resolve()
    run = _DemoRun(args, console, out, model, Ledger.open(args.ledger, open_gguf(model).sha256()))
    dirs, blind_how = _dump_inputs(run)
    exp = write_experiment(out, model, dirs, solver=REDUCED if args.prompts is not None else SOLVER)
    report, sets_json = _sets(run, exp)
    bundle = _solve(run, exp, sets_json)
    dev, bl = _audits(run, exp, bundle, dirs)
    control_ok = _negative_control(run, exp, report) if args.control else None
    return _result(run, bundle, dev, bl, control_ok, blind_how)


def _dump_inputs(run: _DemoRun) -> tuple[dict[str, list[Path]], dict]:
    """Step 1: the model's generations, the shipped documents, the held-out chats and a fresh blind set ->
    ({set kind: dump paths}, how the blind chats were chosen)."""
    args, console, out, model = run.args, run.console, run.out, run.model

    def dumped(s) -> list[Path]:
        return [Path(r.path) for r in s.results if r.path and r.status in ("written", "skipped")]

    console.rule("[bold]1. dump (hf engine)")
    dirs: dict[str, list[Path]] = {}
    prompts = _subset_jsonl(DATA / "prompts.jsonl", out / "inputs" / "prompts.jsonl", args.prompts)
    gen = GenerateOptions(max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=0.7, top_p=0.9, top_k=40)
    dirs["generated"] = dumped(dump_and_print(DumpJob(model, prompts, out / "dumps" / "generated", generate=gen),
                                              console))
    for k in INPUTS:
        if k == "pool_chat" and not (args.pool_chat and (DATA / FILES[k]).is_file()):
            continue
        dirs[k] = dumped(dump_and_print(DumpJob(model, DATA / FILES[k], out / "dumps" / k), console))
    chat_gen = replace(gen, max_new_tokens=CHAT_TOKENS, think=True)
    dirs["heldout_chat"] = dumped(dump_and_print(DumpJob(model, DATA / HELDOUT_PROMPTS, out / "dumps" / "heldout_chat",
                                                        generate=chat_gen), console))
    pts, _ = phrases_to_tuples(PHRASES, vocab_for_model(model))
    dirs["blind"], blind_how = fresh_blind_chats(model, out, run.ledger, pts, args.seed + 1000, console=console)
    console.print(f"blind set: {len(dirs['blind'])} chats, prompts "
                  f"{', '.join(c['prompt'] for c in blind_how['chats'])} (never scored; "
                  f"{len(blind_how['skipped'])} seed(s) skipped)", highlight=False)
    return dirs, blind_how


def _sets(run: _DemoRun, exp: Path):
    """Step 2: the sets report (printed, written to sets.json) -> (report, its path)."""
    run.console.rule("[bold]2. sets")
    report = build_sets(exp, ledger=run.ledger)
    for r in render_sets_table(report):
        run.console.print(r)
    return report, write_sets_json(report, run.out / "sets.json")


def _solve(run: _DemoRun, exp: Path, sets_json: Path) -> Path:
    """Step 3: the experiment's solver (the default, FTPO, unless its [solver] table names one) -> bundle.gguf and
    its solve record. The step's label is the method the solve resolves, never a fixed name."""
    import tomllib

    method = resolve_config(tomllib.loads(exp.read_text(encoding="utf-8")).get("solver", {}), None, str(exp)).method
    run.console.rule(f"[bold]3. solve ({method.upper()})")
    bundle = run.out / "bundle.gguf"
    solve_report.solve_and_print(SolveArgs(exp, None, bundle, ledger=run.ledger.path, sets_json=sets_json), run.console)
    return bundle


def _audits(run: _DemoRun, exp: Path, bundle: Path, dirs: dict[str, list[Path]]):
    """Steps 4 and 5: the dev audit, then the blind sign-off on the fresh blind set -> (dev, blind or None)."""
    run.console.rule("[bold]4. audit")
    dev = audit_and_print(AuditArgs(bundle, run.model, exp, run.out / "audit", ledger=run.ledger.path), run.console)
    bl = None
    if dirs["blind"]:
        run.console.rule("[bold]5. blind sign-off")
        bl = audit_and_print(AuditArgs(bundle, run.model, exp, run.out / "audit-blind", blind=tuple(dirs["blind"]),
                                       dev_report=Path(dev.out_dir) / "report.json", ledger=run.ledger.path),
                             run.console)
    return dev, bl


def _negative_control(run: _DemoRun, exp: Path, report) -> bool:
    """Step 6: a bundle that suppresses ' than' everywhere, through the same audit -> True when it fails."""
    console, model = run.console, run.model
    console.rule("[bold]6. negative control: a bundle that suppresses ' than' everywhere")
    word = vocab_for_model(model).encode(" than")[0]
    by_path = {d.sha256: d.path for d in report.docs}
    ctx = [(read_dump(by_path[c.doc_sha256]), c.pos) for c in report.collateral
           if c.token_id == word and c.set == "collateral_anchor"]
    cb = suppress_word_bundle(model, run.out / "control" / "bundle.gguf", word, ctx)
    control_record(cb, model, report, word)
    ctl = audit_and_print(AuditArgs(cb, model, exp, run.out / "control" / "audit", ledger=run.ledger.path), console)
    control_ok = not ctl.passed
    failed = [b.name for b in ctl.bars if not b.passed]
    console.print(f"negative control verdict: {'FAIL (as it must)' if control_ok else 'PASS — the audit missed it!'}"
                  f"; failed bars: {', '.join(failed)}", highlight=False)
    return control_ok


def _result(run: _DemoRun, bundle: Path, dev, bl, control_ok: bool | None, blind: dict) -> int:
    """demo_summary.json and the verdict lines -> exit code (0: dev and blind pass, the control fails)."""
    console = run.console
    blind_ok = None if bl is None else bl.passed
    summary = {"bundle": str(bundle), "report": str(Path(dev.out_dir) / "report.md"), "passed": dev.passed,
               "blind_passed": blind_ok, "control_failed": control_ok, "blind": blind,
               "ledger": str(run.ledger.path),
               "failed_bars": [b.name for b in dev.bars if not b.passed],
               "blind_failed_bars": [] if bl is None else [b.name for b in bl.bars if not b.passed]}
    write_text_atomic(run.out / "demo_summary.json", json.dumps(summary, indent=1))
    console.rule("[bold]result")
    console.print(f"audit: {'PASS' if dev.passed else 'FAIL'}; blind sign-off: "
                  f"{'—' if blind_ok is None else ('PASS' if blind_ok else 'FAIL')}; negative control: "
                  f"{'—' if control_ok is None else ('failed, as it must' if control_ok else 'passed (audit missed it)')}"
                  f"\nreport: {summary['report']}", highlight=False)
    for what, bars in (("audit", summary["failed_bars"]), ("blind sign-off", summary["blind_failed_bars"])):
        if bars:
            console.print(f"{what}: failed bars {', '.join(bars)}", highlight=False)
    return 0 if dev.passed and blind_ok is True and control_ok is not False else 1
