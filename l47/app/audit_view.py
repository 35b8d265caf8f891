"""Rich rendering of `l47 audit`: one screen with PASS/FAIL per bar and the figure behind it."""

from __future__ import annotations

import time

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from l47.evals import bars as B
from l47.evals.audit import AuditArgs, AuditReport, run_audit


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def print_summary(res: AuditReport, console) -> None:
    """The bars (PASS / FAIL / n/a with value and threshold), the slop line, the reasons of failed bars, notes."""
    r = res.report
    t = Table(title=f"l47 audit ({res.mode}) — bundle {res.bundle_sha256[:12]}… — "
                    + ("[bold green]PASS[/]" if res.passed else "[bold red]FAIL[/]")
                    + "".join(f" — [yellow]{x}[/]" for x in (res.report.get("stamps") or ())), show_lines=False)
    for c in ("bar", "value", "", "threshold", "status"):
        t.add_column(c, justify="left" if c in ("bar", "status") else "right")
    for b in res.bars:
        st = {"PASS": "[green]PASS[/]", "FAIL": "[bold red]FAIL[/]", "n/a": "[dim]n/a[/]"}[b.status]
        t.add_row(b.name, _fmt(b.value), b.direction, _fmt(b.threshold), st)
    console.print(t)
    ho = (r.get("slop") or {}).get("heldout") if res.mode == B.MODE_DEV else (r.get("blind") or {}).get("slop")
    if ho and ho.get("n"):
        console.print(f"slop p(rejected) {ho['p_before']:.4f} → {ho['p_after']:.4f} over {ho['n']} events "
                      f"({100 * (ho.get('reduction') or 0):.1f} % reduction)", highlight=False)
    for b in res.bars:
        if not b.passed and "why" in b.details:
            console.print(f"[red]{b.name}[/]: {escape(str(b.details['why']))}", highlight=False)
    for n in (r.get("notes") or [])[:5]:
        console.print(f"[yellow]note:[/] {escape(str(n))}", highlight=False)  # user text, literally
    console.print(f"report: {res.files.get('report.md')}  (json, tsv, plots in {res.out_dir})", highlight=False)


class SetProgress:
    """`progress(set, done, total)` for run_audit: on a terminal a transient bar per set; otherwise one log line
    per set when its last document is scored, and meanwhile at most one line every `every_s` seconds."""

    def __init__(self, console, every_s: float = 15.0, clock=None):
        self.console = getattr(console, "_c", console)  # a FittedConsole's own Console (rich's Live needs it)
        self.every_s, self.clock = every_s, clock or time.monotonic
        self.bar, self.tasks, self.last = None, {}, self.clock()

    def __enter__(self) -> "SetProgress":
        return self

    def __call__(self, name: str, done: int, total: int) -> None:
        if self.console.quiet:
            return
        if not self.console.is_terminal:
            now = self.clock()
            if done >= total or now - self.last >= self.every_s:
                self.last = now
                self.console.print(f"audit: set {escape(name)}: {done}/{total} document(s) scored", highlight=False)
            return
        if self.bar is None:
            self.bar = Progress(TextColumn("[bold]audit[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), transient=True, console=self.console)
            self.bar.start()
        if name not in self.tasks:
            self.tasks[name] = self.bar.add_task(escape(name), total=total)
        self.bar.update(self.tasks[name], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def audit_and_print(args: AuditArgs, console) -> AuditReport:
    """run_audit with per-set progress, then its summary once."""
    with SetProgress(console) as progress:
        res = run_audit(args, progress=progress)
    print_summary(res, console)
    return res
