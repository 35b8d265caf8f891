"""The `l47` command line: each command parses its options into a dataclass and calls one library function.

Bad input (an `L47Error`) prints one red line naming file, field, expected and found, and exits 2 — no traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from l47.errors import L47Error

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact, audited edits of the last layer's shared-expert down projection of qwen4exp models.")
console = Console()
err_console = Console(stderr=True)


def guarded(fn):
    """Turn L47Error (and missing files) into one clear line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except L47Error as e:
            err_console.print(f"[bold red]error:[/] {e}", soft_wrap=True, highlight=False, markup=True)
            raise typer.Exit(2)
        except FileNotFoundError as e:
            err_console.print(f"[bold red]error:[/] {e.filename}: file: expected an existing file, found nothing",
                              highlight=False)
            raise typer.Exit(2)

    return wrapper


def _fmt(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


@app.command()
@guarded
def inspect(file: Path = typer.Argument(..., help="a GGUF model/bundle or a dump (.safetensors)")):
    """Describe a GGUF's tail tensors and hyperparameters, or a dump file."""
    from l47.inspect import inspect_file

    inspect_file(file, console)


@app.command()
@guarded
def score(
    dumps: list[Path] = typer.Argument(..., help="dump files"),
    model: Path = typer.Option(..., "--model", help="base GGUF"),
    bundle: Optional[Path] = typer.Option(None, "--bundle", help="edited GGUF (full or overlay)"),
    tsv: Optional[Path] = typer.Option(None, "--tsv", help="per-position TSV output"),
    policy: str = typer.Option("strata", help="runtime weight policy: strata | exact"),
    device: str = typer.Option("cpu"),
    ledger: Optional[Path] = typer.Option(None, help="append scored document hashes to this ledger"),
):
    """Exact per-document CE / top-1 (and with --bundle: KLD, Δlog p, same-top) from the tail forward."""
    from rich.progress import Progress

    from l47.score import ScoreArgs, run_score

    args = ScoreArgs(model, tuple(dumps), bundle, tsv, policy, device, ledger)
    with Progress(console=err_console, transient=True) as prog:
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
        console.print(f"[yellow]note:[/] {n}", highlight=False)
    if res.tsv:
        console.print(f"per-position TSV: {res.tsv} ({res.rows} rows)")


@app.command()
@guarded
def bench(
    real: bool = typer.Option(True, help="real dims (2560/640/320/4/248,320); --no-real for a small smoke run"),
    T: int = typer.Option(1024, "-T", help="positions per pass"),
    device: str = typer.Option("cpu"),
    reps: int = typer.Option(2),
    what: str = typer.Option("forward", help="forward | wfld | all"),
    json_out: Optional[Path] = typer.Option(None, "--json"),
):
    """Throughput and memory of the tail forward (and solvers) at real dims with synthetic weights."""
    from l47.bench import BenchArgs, run_bench

    run_bench(BenchArgs(real=real, T=T, device=device, reps=reps, what=what, json_out=json_out), console)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
