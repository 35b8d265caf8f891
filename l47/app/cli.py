"""The `l47` command line: each command parses its options into a dataclass and calls one library function.

A command function has one parameter per command-line option (typer reads them from the signature), so some have
more than eight; each only builds its Args dataclass and calls the library.
Exit codes: 0 ok · 1 a bar or verdict failed · 2 usage or input error (an `L47Error`, a refused output path, an
unreadable file: one red line naming file, field, expected and found — no traceback) · 130 / 143 interrupted
(SIGINT / SIGTERM; temp and staging files removed). User text (paths, phrases) is printed literally.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from l47.app.tables import FittedConsole, fit, json_to_stdout
from l47.errors import L47Error
from l47.fileio import Interrupted, begin_command, install_signal_cleanup, interrupt_cleanup, write_text_atomic

PRECISION_HELP = ("head GEMM: f32 | split-fp16 | split-bf16 (default: split-fp16 on CUDA after a per-run check "
                  "against f64, "
                  "falling back to f32 if its error exceeds 2x the f32 path's; f32 elsewhere)")


def _head_precision(precision):
    """--precision checked before anything is loaded; the command passes it down with its arguments."""
    from l47.model.weights import head_precision

    return head_precision(precision)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact, audited edits of the last layer's shared-expert down projection of qwen4exp models.")
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _options(quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing but errors (exit code only)")):
    """Options for every command: l47 --quiet COMMAND ..."""
    console.quiet = quiet


def _error_line(msg: str) -> None:
    """One red line; the message is printed literally (rich markup in user text escaped, newlines shown as \\n)."""
    from rich.markup import escape

    one = escape(msg.replace("\n", "\\n"))
    err_console.print(f"[bold red]error:[/] {one}", soft_wrap=True, highlight=False)


def _os_error_line(e: OSError) -> str:
    where = e.filename if e.filename is not None else "l47"
    if isinstance(e, FileNotFoundError):
        return f"{where}: file: expected an existing file, found nothing"
    if isinstance(e, IsADirectoryError):
        return f"{where}: file: expected a file, found a directory"
    if isinstance(e, NotADirectoryError):
        return f"{where}: path: expected a path inside a folder, found a file where a folder should be"
    return f"{where}: file: expected a readable/writable file with room on its disk, found {e.strerror or e}"


def guarded(fn):
    """Turn user errors (L47Error, unreadable or unwritable files) into one clear line and exit code 2; an
    interrupt into exit 130 / 143 after the temp files are removed (l47.fileio)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        install_signal_cleanup()
        begin_command()
        try:
            from l47.app.paths import check_options

            check_options(fn.__name__, kw)  # --device and shared numeric options, before any work
            return fn(*a, **kw)
        except L47Error as e:
            _error_line(str(e))
            raise typer.Exit(2)
        except OSError as e:
            _error_line(_os_error_line(e))
            raise typer.Exit(2)
        except (KeyboardInterrupt, Interrupted) as e:
            what = interrupt_cleanup()  # a second signal meanwhile is ignored: this cleanup always finishes
            code = e.code if isinstance(e, Interrupted) else 130
            _error_line(f"interrupted: stopped before finishing; {what} (exit {code})")
            raise typer.Exit(code)

    return wrapper


def _force_opt():
    return typer.Option(False, "--force", help="replace an existing file that is not an l47 output of this kind")


def _fmt(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


@app.command()
@guarded
def inspect(
    file: Path = typer.Argument(..., help="a GGUF model/bundle, a dump (.safetensors) or a checkpoint folder"),
    text: bool = typer.Option(False, "--text", help="a dump's document token by token: roles, events, near "
                              "misses, turn ends (colours on a terminal, plain marks otherwise)"),
    experiment: Optional[Path] = typer.Option(None, help="--text: the phrases (and the model) of this experiment"),
    phrase: Optional[list[str]] = typer.Option(None, "--phrase", help="--text: a phrase to mark (repeatable)"),
    model: Optional[Path] = typer.Option(None, help="--text: the base GGUF (its vocabulary; the base of Δlog p)"),
    bundle: Optional[Path] = typer.Option(None, help="--text: show each token's Δlog p under this bundle"),
    device: str = typer.Option("cpu", help="--text --bundle: device of the tail forward"),
):
    """Describe a GGUF's tail tensors and hyperparameters, a dump file, or a checkpoint folder; with --text, the
    dump's document token by token."""
    if not text:
        from l47.app.inspect import inspect_file

        given = [o for o, v in (("--experiment", experiment), ("--phrase", phrase), ("--model", model),
                                ("--bundle", bundle)) if v]
        if given:
            raise L47Error("l47 inspect", given[0], "only with --text", "given without it")
        inspect_file(file, console)
        return
    from l47.app.inspect_text import TextArgs, build_text_view, print_text

    print_text(build_text_view(TextArgs(file, experiment, tuple(phrase or ()), model, bundle, device)), console)


@app.command()
@guarded
def export(
    hf_dir: Path = typer.Argument(..., help="transformers qwen4exp checkpoint folder (config.json, weights, "
                                  "tokenizer.json)"),
    out: Path = typer.Argument(..., help="GGUF to write (must not exist)"),
    pre: Optional[str] = typer.Option(None, "--pre", help="pre-tokenizer (qwen2 | qwen35) when tokenizer.json's "
                                      "cannot be detected"),
    target_type: Optional[str] = typer.Option(None, help="type of every blk.*.ffn_down_shexp (default Q8_0)"),
    head_type: Optional[str] = typer.Option(None, help="type of output.weight (default Q6_K, Q8_0 if n % 256)"),
    hc_type: Optional[str] = typer.Option(None, help="type of the hc_* / output_hc_* matrices (default BF16)"),
    device: str = typer.Option("cpu"),
):
    """Checkpoint -> whole-model GGUF with its own tokenizer; kept only if `l47 dump` on it agrees with
    transformers on the checkpoint (exit 1 and no file otherwise)."""
    from l47.app.export import ExportArgs, print_export, run_export

    res = run_export(ExportArgs(hf_dir, out, pre, target_type, head_type, hc_type, device),
                     log=lambda m: console.print(m, highlight=False))
    print_export(res, console)
    raise typer.Exit(0 if res.ok else 1)


@app.command()
@guarded
def init(
    folder: Path = typer.Argument(..., help="experiment folder to create (or an empty one)"),
    model: Path = typer.Option(..., "--model", help="the base GGUF (l47 export writes one)"),
    phrase: list[str] = typer.Option(..., "--phrase", help="a banned phrase (repeat for more)"),
    word: list[str] = typer.Option([], "--word", help="a collateral word, one token, e.g. ' than' (repeat)"),
    kld: list[str] = typer.Option(["prose"], "--kld", help="a KLD domain name (repeat)"),
    name: Optional[str] = typer.Option(None, help="experiment name (default: the folder's name)"),
    method: str = typer.Option("ftpo", help="ftpo (the solver's default) | wfld"),
    setting: list[str] = typer.Option([], "--set", help="table.key=value, e.g. solver.wfld.p_cap=0.35 (repeat)"),
):
    """A new experiment folder: commented experiment.toml (every key, default, meaning), prompts/, texts/,
    dumps/, and the commands to run next."""
    from l47.app.init import InitArgs, run_init

    r = run_init(InitArgs(folder, model, tuple(phrase), tuple(word), tuple(kld), name, method, tuple(setting)))
    console.print(f"wrote {r.experiment}; fill in (JSONL, one document per line):", highlight=False)
    for f in r.files_to_fill:
        console.print(f"  {folder / f}", highlight=False)
    console.print(f"then, in {folder}:", highlight=False)
    for c in r.commands:
        console.print(f"  {c}", highlight=False, soft_wrap=True)


@app.command()
@guarded
def score(
    dumps: list[Path] = typer.Argument(..., help="dump files"),
    model: Path = typer.Option(..., "--model", help="base GGUF"),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="edited GGUF (full or overlay)"),
    tsv: Optional[Path] = typer.Option(None, "--tsv", help="per-position TSV output"),
    policy: str = typer.Option("strata", help="runtime weight policy: strata | exact"),
    device: str = typer.Option("cpu"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the base model's, "
                                          "$L47_HOME/ledgers/<base sha256>.jsonl)"),
    allow_other_model: bool = typer.Option(False, help="score dumps made from another model"),
    force: bool = _force_opt(),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
):
    """Exact per-document CE / top-1 (and with --bundle: KLD, Δlog p, same-top) from the tail forward.\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    precision = _head_precision(precision)
    from rich.progress import Progress

    from l47.app.paths import check_score
    from l47.app.score import ScoreArgs, run_score

    check_score(model, dumps, bundle, tsv, ledger, force)

    args = ScoreArgs(model, tuple(dumps), bundle, tsv, policy, device, ledger, allow_other_model, precision)
    with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as prog:
        task = prog.add_task("scoring", total=len(dumps))
        res = run_score(args, progress=lambda: prog.advance(task))
    t = Table(title=f"l47 score — model {res.model_sha256[:12]}"
              + (f", bundle {res.bundle_sha256[:12]}" if res.bundle_sha256 else ""))
    cols = ["doc", "T", "CE", "PPL", "top-1"]
    if res.bundle_sha256:
        cols += ["CE new", "top-1 new", "mean KLD", "mean Δlog p", "same-top"]
    for c in cols:
        t.add_column(c, justify="right" if c != "doc" else "left")
    import math

    for d in res.docs:
        row = [d.doc, str(d.T), _fmt(d.ce), _fmt(math.exp(d.ce), ".3f"), _fmt(d.top1, ".3f")]
        if res.bundle_sha256:
            row += [_fmt(d.ce_new), _fmt(d.top1_new, ".3f"), _fmt(d.kld, ".6f"), _fmt(d.dlogp, "+.5f"),
                    _fmt(d.same_top, ".3f")]
        t.add_row(*row)
    console.print(t)
    for n in res.notes:
        from rich.markup import escape

        console.print(f"[yellow]note:[/] {escape(n)}", highlight=False)
    for s in res.stamps:
        from rich.markup import escape

        console.print(f"[bold yellow]stamp:[/] {escape(s)}", highlight=False)
    if res.tsv:
        console.print(f"per-position TSV: {res.tsv} ({res.rows} rows)")


@app.command()
@guarded
def bench(
    real: bool = typer.Option(True, help="real dims (2560/640/320/4/248,320); --no-real for a small smoke run"),
    T: int = typer.Option(1024, "-T", help="positions per pass"),
    device: str = typer.Option("cpu"),
    reps: int = typer.Option(2),
    what: str = typer.Option("forward", help="forward | wfld | all | ftpo (reps + 1 steps, by part) | pipeline "
                             "(sets -> plan -> solve -> audit)"),
    json_out: Optional[Path] = typer.Option(None, "--json"),
    work: Optional[Path] = typer.Option(None, help="pipeline: folder for the synthetic model and dumps (reused)"),
    method: Optional[str] = typer.Option(None, help="pipeline: ftpo | wfld (default: the toolkit's default)"),
    dims: Optional[str] = typer.Option(None, help="full | reduced | tiny (pipeline's world) or n,f,r,hc,V "
                                       "(forward, wfld, ftpo); default: from --real"),
    force: bool = _force_opt(),
):
    """Throughput and memory of the tail forward (and solvers) at real dims with synthetic weights.

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    from l47.app.bench import BenchArgs, run_bench
    from l47.app.paths import check_bench

    check_bench(json_out, force)

    run_bench(BenchArgs(real=real, T=T, device=device, reps=reps, what=what, json_out=json_out, work=work,
                        method=method, dims=dims), console)


@app.command()
@guarded
def dump(
    inputs: Path = typer.Argument(..., help="JSONL documents ({id, text} or {id, messages}) or a datasets dir"),
    model: Path = typer.Option(..., "--model", help="qwen4exp GGUF or a local transformers checkpoint dir"),
    out: Path = typer.Option(..., "--out", help="output directory (one .safetensors dump per document)"),
    engine: str = typer.Option("hf", help="hf | strata"),
    engine_bin: Optional[Path] = typer.Option(None, "--engine-bin", help="Strata binary (or set STRATA_BIN)"),
    layer: Optional[int] = typer.Option(None, help="the last layer (default); any other is refused"),
    generate: bool = typer.Option(False, help="sample the assistant turn with the model (provenance generated)"),
    think: bool = typer.Option(False, help="with --generate: the turn opens with a <think> block (held-out and "
                               "blind chats)"),
    max_new_tokens: int = typer.Option(256),
    seed: int = typer.Option(0),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.8),
    top_k: int = typer.Option(20),
    ref_logits: bool = typer.Option(False, help="also store the engine's full logits (f16)"),
    tolerance: Optional[float] = typer.Option(None, help="zero-proxy bar, nats (hf default 1e-4)"),
    policy: str = typer.Option("strata"),
    device: str = typer.Option("cpu"),
    device_map: Optional[str] = typer.Option(None, help="hf engine across devices: auto | balanced | "
                                             "sequential | JSON {module: device} (accelerate)"),
    max_memory: Optional[str] = typer.Option(None, help="per-device caps, e.g. 0=70GiB,1=70GiB,cpu=200GiB"),
    offload_dir: Optional[Path] = typer.Option(None, help="folder for layers the device map puts on 'disk'"),
    batch: int = typer.Option(64, help="hf engine: turns sampled together (same ids as one at a time; "
                               "l47.app.dumping.DEFAULT_BATCH)"),
):
    """Run an engine over documents -> dump files, with the zero-proxy check per document.\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    from l47.app.dump_view import dump_and_print
    from l47.app.dumping import DumpJob, GenerateOptions
    from l47.engine.hf import parse_placement

    placement = parse_placement(device_map, max_memory, offload_dir)

    from l47.app.paths import check_dump

    if think and not generate:
        raise L47Error("l47 dump", "--think", "--think with --generate (it shapes the sampled turn)", "--think alone")
    gen = GenerateOptions(max_new_tokens, seed, temperature, top_p, top_k, think=True if think else None) \
        if generate else None
    check_dump(inputs, model, out, gen, ref_logits)  # paths and disk space, before the model is loaded
    job = DumpJob(model, inputs, out, engine=engine, layer=layer, generate=gen, ref_logits=ref_logits,
                  tolerance=tolerance, policy=policy, device=device, engine_bin=engine_bin, placement=placement,
                  batch=batch)
    raise typer.Exit(dump_and_print(job, console).exit_code)


@app.command()
@guarded
def sets(
    experiment: Path = typer.Argument(..., help="experiment TOML"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the report as JSON (- : to stdout)"),
    model: Optional[Path] = typer.Option(None, "--model"),
    device: str = typer.Option("cpu"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the base model's, "
                                          "$L47_HOME/ledgers/<base sha256>.jsonl)"),
    strict: bool = typer.Option(False, help="warnings are failures (exit 1)"),
    force: bool = _force_opt(),
    allow_other_model: bool = typer.Option(False, help="use dumps made from another model (recorded in the report)"),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
):
    """Events per phrase x split, non-events, in-context copies, collateral, coverage and refusals
    (--json - : the report as JSON on stdout, nothing else).\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    precision = _head_precision(precision)
    from l47.app.paths import check_sets
    from l47.app.sets_view import run_sets

    notes = check_sets(experiment, json_out, model, ledger, force, allow_other_model)
    with json_to_stdout(json_out, console) as target:
        warned = run_sets(experiment, target, FittedConsole(console), model=model, device=device,
                          ledger=ledger, notes=notes, precision=precision)  # 1: warnings
    raise typer.Exit(1 if (warned and strict) else 0)


@app.command()
@guarded
def solve(
    experiment: Path = typer.Argument(..., help="experiment TOML"),
    method: Optional[str] = typer.Option(None, help="wfld | ftpo (default: [solver] method, else ftpo)"),
    out: Path = typer.Option(..., "--out", help="bundle GGUF to write (never the base)"),
    model: Optional[Path] = typer.Option(None, "--model"),
    overlay: bool = typer.Option(False, help="write an overlay (the shared-expert writers) instead of a full GGUF"),
    sets_json: Optional[Path] = typer.Option(None, "--sets", help="reuse a `l47 sets --json` report"),
    plan_json: Optional[Path] = typer.Option(None, "--plan", help="reuse the plan `l47 plan --json` wrote for these "
                                             "inputs (refused when made from others)"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the base model's, "
                                          "$L47_HOME/ledgers/<base sha256>.jsonl)"),
    device: str = typer.Option("cpu"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the solve record as JSON (- : to stdout)"),
    strict: bool = typer.Option(False, help="the solver's warnings (with --sweep: no candidate within the KL budget) are failures (exit 1)"),
    force: bool = _force_opt(),
    allow_other_model: bool = typer.Option(False, help="use dumps made from another model (recorded in the report)"),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
    sweep: bool = typer.Option(False, "--sweep", help="solve a small grid of candidates judged on dev only; write "
                               "the chosen one, BUNDLE.sweep.png and BUNDLE.sweep.tsv (docs/SOLVERS.md)"),
):
    """WFLD or FTPO -> re-quantised Q8_0 bundle + solve record; every figure from the shipped weights.\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    precision = _head_precision(precision)
    from l47.app.paths import check_solve
    from l47.app.solve_report import solve_and_print
    from l47.solvers.solve import SolveArgs

    args = SolveArgs(experiment, method, out, model, overlay, device, ledger, sets_json,
                     allow_other_model=allow_other_model, sweep=sweep, precision=precision, plan_json=plan_json)
    check_solve(args, force, json_out)
    with json_to_stdout(json_out, console) as target:
        res = solve_and_print(args, console)
        if target is not None:
            write_text_atomic(target, res.record.to_json())
    over = res.record.sweep is not None and not any(c.within_budget for c in res.record.sweep.candidates)
    raise typer.Exit(1 if (strict and (res.claims.method.get("warnings") or over)) else 0)


@app.command()
@guarded
def plan(
    experiment: Path = typer.Argument(..., help="experiment TOML"),
    model: Optional[Path] = typer.Option(None, "--model"),
    sets_json: Optional[Path] = typer.Option(None, "--sets", help="reuse a `l47 sets --json` report"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the plan as JSON here (- : to stdout)"),
    method: Optional[str] = typer.Option(None, help="wfld | ftpo: the bound of this solver, ftpo's anchors soft, "
                                         "wfld's exact (default: [solver] method, else ftpo)"),
    device: str = typer.Option("cpu"),
    force: bool = _force_opt(),
):
    """Feasibility before solving: per phrase events, base p, needed vs reachable log-odds within the KL budget,
    share inside the protected span, binding constraint; anchors' rank vs f. The bound is the solver's: FTPO's
    anchors are soft (no span removed), WFLD's exact. Exit 1 if a phrase cannot reach its target."""
    from l47.app.paths import check_plan

    check_plan(experiment, json_out, model, sets_json, force)
    with json_to_stdout(json_out, console) as target:
        short = _plan(experiment, model, sets_json, target, device, method)
    raise typer.Exit(1 if short else 0)


def _p_interval(b: dict | None) -> str:
    """'mean [lo, hi]' of a plan's base p over one set's events (interval bootstrapped over documents); the
    number of documents instead of an interval when there are fewer than 2; '—' without events."""
    if b is None:
        return "—"
    iv = b["interval"]
    return f"{b['value']:.3f} " + (f"[{iv[0]:.3f}, {iv[1]:.3f}]" if iv is not None else f"({b['n_docs']} doc)")


def _plan(experiment, model, sets_json, json_out, device, method=None) -> bool:
    import json

    from l47.app.estimate_view import estimate_dict, estimate_lines, plan_and_estimate
    from l47.solvers.solve import SolveArgs, plan_json

    run, est = plan_and_estimate(SolveArgs(experiment, method, Path("/nonexistent/plan-only.gguf"), model,
                                           False, device, None, sets_json),
                                 log=lambda m: console.print(m, highlight=False))
    fp, choice = run.fp, run.choice
    bound = "soft anchors (ftpo)" if fp.anchors_soft else "exact anchors (wfld)"  # the experiment's method
    t = Table(title=f"plan: target residual {fp.target:g}, KL budget {fp.kl_budget:.3g} nats; {bound}")
    # the first-order bound (needed vs reachable log-odds, its residual) beside the plan's edit checked exactly (its
    # residual: the larger of dev and train, the solver's at-target rule); "binding" reads the exact figure
    for c in ("phrase", "train", "dev", "heldout", "base p", "train p [90%]", "dev p [90%]", "needed",
              "1st-order reach", "1st-order resid.", "edit resid.", "in span", "binding"):
        t.add_column(c, justify="left" if c in ("phrase", "binding") else "right")
    for p in fp.phrases:
        t.add_row(p.phrase, str(p.events.get("train", 0)), str(p.events.get("dev", 0)),
                  str(p.events.get("heldout", 0)), _fmt(p.p_base, ".3f"), _p_interval(p.p_base_train),
                  _p_interval(p.p_base_dev), _fmt(p.needed_gap, ".2f"),
                  _fmt(p.reachable_gap, ".2f"), _fmt(p.reachable_residual, ".3f"), _fmt(p.edit_residual, ".3f"),
                  _fmt(p.span_share_mean, ".0%"), p.binding)

    console.print(fit(t, console.width))  # 80 columns: the vertical form when the columns do not fit
    e = fp.edit
    if e is not None:
        console.print(f"plan's edit (the least-KL edit of the linearised problem × c = {e.c:.3g}, measured exactly): "
                      f"background KL {e.kl:.3g} of {fp.kl_budget:.3g}; soft anchors' worst word mean Δlog p "
                      f"{_fmt(min(e.word_dlogp.values(), default=None), '.3g')} (tol {e.word_tol:g}), turn ends' "
                      f"Δlog p(<|im_end|>) {_fmt(e.turn_end_dlogp, '.3g')} (tol {e.turn_end_tol:g})", highlight=False)
    console.print(f"anchors: {fp.anchors} rows ({fp.turn_ends} turn ends), rank {fp.anchor_rank} of f = {fp.f}"
                  + ("" if choice is None else f", budget {choice.budget}"), highlight=False)
    for word, c in sorted(fp.words.items(), key=lambda kv: -kv[1]["unique_directions"])[:6]:
        console.print(f"  {word!r}: {c['anchors']} anchors, rank {c['rank_alone']}, "
                      f"{c['unique_directions']} directions only it uses", highlight=False)
    for n in fp.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False)
    for p in fp.unproven:
        console.print(f"[yellow]warning:[/] {p.phrase!r} not shown reachable: the plan's own edit within the budget "
                      f"reaches {p.edit_residual:.3g} ({p.binding}); reachable at first order — the solver may do "
                      "better", highlight=False)
    for line in estimate_lines(est):
        console.print(line, highlight=False)
    if json_out:
        write_text_atomic(json_out, json.dumps(plan_json(run, estimate_dict(est)), indent=1, sort_keys=True))
    return bool(fp.short)


@app.command()
@guarded
def transplant(
    overlay: Path = typer.Argument(..., help="overlay GGUF (a subset of the base's tensors)"),
    base: Path = typer.Argument(..., help="full base GGUF"),
    out: Path = typer.Argument(..., help="output GGUF (never the base)"),
    force: bool = _force_opt(),
):
    """Apply an overlay to a full model, verifying byte identity of every other tensor after writing."""
    from l47.app.paths import check_transplant

    check_transplant(overlay, base, out, force)
    from l47.solvers.bundle import transplant as do

    r = do(overlay, base, out)
    console.print(f"wrote {r['out']}: {r['overlay_tensors']} overlay tensor(s), changed vs base: "
                  f"{r['changed'] or 'none'}; every other tensor byte-identical; sha256 {r['sha256']}",
                  highlight=False)


@app.command()
@guarded
def demo(
    out: Path = typer.Option(Path("out/demo"), help="output directory"),
    prompts: Optional[int] = typer.Option(None, help="use only the first N prompts"),
    max_new_tokens: int = typer.Option(96),
    fresh: bool = typer.Option(False, help="remove previous outputs first"),
    control: bool = typer.Option(True, help="also audit a negative-control bundle (must FAIL)"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the demo model's, under $L47_HOME)"),
):
    """The whole workflow on the shipped demo model: dump -> sets -> solve -> audit -> blind -> negative control."""
    from l47.app.demo import DemoArgs, run_demo

    raise typer.Exit(run_demo(DemoArgs(out=out, prompts=prompts, max_new_tokens=max_new_tokens, fresh=fresh,
                                       control=control, ledger=ledger), console))


class _ManyValuesCommand(typer.core.TyperCommand):
    """A command whose list options in MANY take every value after the flag up to the next option: `--blind a b c`
    reads as `--blind a --blind b --blind c`, so the shell's expansion of `--blind dumps/blind/*.safetensors`
    works for any number of files; `--blind a --blind b` still does, and so does a positional argument written
    after the run (`--blind a BUNDLE`: the run gives its last values back when the command's required arguments
    would otherwise be missing)."""

    MANY = ("--blind",)

    def parse_args(self, ctx, args):
        takes_value = {name: not (p.is_flag or p.count) for p in self.params if p.param_type_name == "option"
                       for name in (*p.opts, *p.secondary_opts)}
        needed = sum(1 for p in self.params if p.param_type_name == "argument" and p.required)
        return super().parse_args(ctx, spread_many(list(args), self.MANY, takes_value, needed))


def spread_many(args: list[str], flags, takes_value: dict[str, bool], needed: int) -> list[str]:
    """`--flag a b c` -> `--flag a --flag b --flag c` for each flag in `flags`. A run of values ends at the next
    option (a word starting with '-', other than '-' itself) or at `--`. When fewer than `needed` positional
    words are left, the last run's last values are positional again (the flag inserted before each is dropped)."""
    out: list[str] = []
    inserted: list[int] = []  # where a flag was inserted into `out`
    positional, flag, taken, skip = 0, None, 0, False
    for i, a in enumerate(args):
        if a == "--":
            positional += len(args) - i - 1
            out += args[i:]
            break
        if a.startswith("-") and a != "-":
            name, eq, _ = a.partition("=")
            flag, taken = (name, 1 if eq else 0) if name in flags else (None, 0)
            skip = not eq and name not in flags and takes_value.get(name, False)  # its value is the next word
            out.append(a)
            continue
        if flag is not None:
            if taken:
                inserted.append(len(out))
                out.append(flag)
            taken += 1
        elif skip:
            skip = False
        else:
            positional += 1
        out.append(a)
    for j in reversed(inserted[-max(needed - positional, 0):] if needed > positional else []):
        del out[j]
    return out


@app.command(cls=_ManyValuesCommand)
@guarded
def audit(
    bundle: Path = typer.Argument(..., help="bundle GGUF (full model or overlay)"),
    base: Path = typer.Option(..., "--base", help="the base GGUF"),
    experiment: Path = typer.Option(..., "--experiment", help="experiment TOML"),
    out: Path = typer.Option(Path("audit"), "--out", help="report directory"),
    blind: list[Path] = typer.Option([], "--blind", metavar="DUMP...", help="the blind set for the sign-off: "
                                     "every dump (or folder of dumps) after --blind up to the next option, e.g. "
                                     "--blind dumps/blind/*.safetensors; figures pooled over its documents"),
    dev_report: Optional[Path] = typer.Option(None, "--dev", "--dev-report", help="the dev audit's report.json"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the base model's, "
                                          "$L47_HOME/ledgers/<base sha256>.jsonl)"),
    allow_unverified: bool = typer.Option(False, help="accept dumps without engine log p (zero-proxy bar n/a; "
                                          "the report is stamped \"unverified\")"),
    record: Optional[Path] = typer.Option(None, help="solve record (default: BUNDLE.solve.json)"),
    engine_dumps: list[Path] = typer.Option([], "--engine-dump", help="dumps of the engine running the bundle"),
    policy: str = typer.Option("strata"),
    device: str = typer.Option("cpu"),
    plots: bool = typer.Option(True),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the report as JSON (- : to stdout)"),
    force: bool = _force_opt(),
    allow_other_model: bool = typer.Option(False, help="use dumps made from another model (recorded in the report)"),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
):
    """Bars (a)–(g), KLD domains and the blind sign-off -> report.json / report.md / plots / TSV; exit 0 only
    if every bar passes.\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    precision = _head_precision(precision)
    from l47.app.audit_view import audit_and_print
    from l47.app.paths import check_audit, expand_dump_paths
    from l47.evals.audit import AuditArgs

    args = AuditArgs(bundle, base, experiment, out, expand_dump_paths(blind, "--blind"), dev_report, ledger, policy,
                     device, record, tuple(engine_dumps), plots=plots, allow_unverified=allow_unverified,
                     allow_other_model=allow_other_model, precision=precision)
    check_audit(args, force, json_out)
    with json_to_stdout(json_out, console) as target:
        res = audit_and_print(args, FittedConsole(console))
        if target is not None:
            import json as _json

            write_text_atomic(target, _json.dumps(res.report, indent=1, default=str) + "\n")
    raise typer.Exit(res.exit_code)


@app.command()
@guarded
def penalty(
    experiment: Path = typer.Argument(..., help="experiment TOML"),
    out: Path = typer.Option(..., "--out", help="penalty spec JSON for the engine"),
    base: Optional[Path] = typer.Option(None, "--base"),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="also simulate stacked on this bundle"),
    bias: float = typer.Option(5.0, help="logit bias subtracted from the final token after its exact prefix"),
    form: str = typer.Option("prefix-exact", help="prefix-exact | last-prefix-token | previous-token (cheaper forms: extra hits measured)"),
    device: str = typer.Option("cpu"),
    ledger: Optional[Path] = typer.Option(None, help="scoring ledger (default: the base model's, "
                                          "$L47_HOME/ledgers/<base sha256>.jsonl)"),
    force: bool = _force_opt(),
    allow_other_model: bool = typer.Option(False, help="use dumps made from another model (recorded in the report)"),
):
    """Prefix-conditioned sampler penalty: exact simulation on the dumps, alone and stacked; JSON export.\f

    Many parameters because each one is a command-line option (typer reads a command's options from them)."""
    from l47.app.paths import check_penalty
    from l47.app.penalty_view import print_penalty
    from l47.evals.penalty import PenaltyArgs, run_penalty

    args = PenaltyArgs(experiment, out, base, bundle, bias, form, device=device, ledger=ledger)
    notes = check_penalty(args, force, allow_other_model)
    print_penalty(run_penalty(args), console)
    _print_stamps(notes)


def _print_stamps(other_model_notes) -> None:
    """Dumps of another model let in by --allow-other-model: each named, then the stamp, last on the screen."""
    from rich.markup import escape

    from l47.data.identity import other_model_stamp

    for n in other_model_notes:
        console.print(f"[yellow]note:[/] {escape(n)}", highlight=False)
    if other_model_notes:
        console.print(f"[bold yellow]stamp:[/] {escape(other_model_stamp(len(other_model_notes)))}", highlight=False)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
