"""`l47 dump` on a console: run_dump's callbacks (l47/app/dumping.py `_Report`) rendered with rich — the input
errors, a bar over the documents, one line per document (written with its zero-proxy figures, skipped, refused,
failed) and the summary line."""

from __future__ import annotations

from rich.markup import escape

from l47.app.dumping import STATUS_ERROR, STATUS_REFUSED, STATUS_SKIPPED, DumpJob, DumpSummary, run_dump


def document_line(r: dict) -> str:
    """The console line (rich markup, user text escaped) of one `done` event (a DocResult's fields)."""
    doc = escape(r["doc_id"])
    if r["status"] == STATUS_SKIPPED:
        return f"  {doc}: skipped (already dumped with the same input and model)"
    if r["status"] == STATUS_ERROR:
        return f"  [red]{doc}: error[/]: {escape(r['message'])}"
    if r["status"] == STATUS_REFUSED:
        return f"  [red]{doc}: refused[/]: {escape(r['message'])}"
    return f"  {doc}: T={r['T']}, zero-proxy max |Δ| {r['max_abs']:.2e} mean {r['mean_abs']:.2e} nats"


class DumpProgress:
    """`progress(dict)` and `log(str)` for run_dump on a rich console (None: silent)."""

    def __init__(self, console) -> None:
        self.console, self.bar, self.task = console, None, None

    def __enter__(self) -> "DumpProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def log(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg, markup=False, highlight=False)

    def __call__(self, e: dict) -> None:
        if self.console is None:
            return
        kind = e["event"]
        if kind == "start":
            for err in e["input_errors"]:
                self.console.print(f"[red]input error:[/] {escape(err)}", highlight=False)
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]dump[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=self.console)
            self.bar.start()
            self.task = self.bar.add_task("", total=e["total"])
        elif kind == "document" and self.bar is not None:
            self.bar.update(self.task, description=e["doc_id"][:40])
        elif kind == "done":
            self.console.print(document_line(e), highlight=False)
            if self.bar is not None:
                self.bar.advance(self.task)
        elif kind == "stop":
            self._stop()

    def _stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def dump_and_print(job: DumpJob, console) -> DumpSummary:
    """run_dump with its input errors, bar, per-document lines and summary on `console` (None: silent)."""
    with DumpProgress(console) as p:
        return run_dump(job, log=p.log, progress=p)
