"""Tables that fit the terminal (80 columns and up): a rich Table whose columns cannot all be shown whole is
printed as a vertical (long) table instead — one row per (row, column) cell: the row's first cell, the column
header, the value — so no header is ever cut to one or two letters."""

from __future__ import annotations

import contextlib

from rich.table import Table
from rich.text import Text

_PAD = 3  # rich's default cell padding + border per column


def _plain(x) -> str:
    if isinstance(x, Text):
        return x.plain
    return str(x)


def _cells(t: Table) -> list[list[str]]:
    return [[_plain(c) for c in col._cells] for col in t.columns]  # column-major


def needed_width(t: Table) -> int:
    """Width at which every header and every cell's longest word is shown whole."""
    w = 1
    for col, cells in zip(t.columns, _cells(t)):
        words = [len(s) for c in cells for s in c.split()] + [len(x) for x in _plain(col.header).split()]
        head = len(_plain(col.header))
        w += max([head] + words) + _PAD
    return w


def fit(t, width: int):
    """`t` itself when it fits `width`; otherwise its vertical form (same title, every value kept)."""
    if not isinstance(t, Table) or needed_width(t) <= width or len(t.columns) < 3:
        return t
    cols = _cells(t)
    heads = [_plain(c.header) for c in t.columns]
    v = Table(title=t.title, caption=t.caption)
    v.add_column(heads[0])
    v.add_column("column")
    v.add_column("value", justify="right")
    for i in range(len(cols[0])):
        for j in range(1, len(cols)):
            v.add_row(cols[0][i] if j == 1 else "", heads[j], cols[j][i], end_section=j == len(cols) - 1)
    return v


def print_fitted(console, renderables) -> None:
    """Print renderables, each table fitted to the console's width."""
    for r in renderables:
        console.print(fit(r, console.width))


class FittedConsole:
    """A console whose print fits every table to its width (what library code that prints tables is given)."""

    def __init__(self, console):
        self._c = console

    def print(self, *objects, **kw) -> None:
        self._c.print(*(fit(o, self._c.width) for o in objects), **kw)

    def __getattr__(self, name):
        return getattr(self._c, name)


@contextlib.contextmanager
def json_to_stdout(json_out, console):
    """`--json -`: yields a temporary path for the command's JSON, keeps the console quiet meanwhile, then writes
    the JSON to stdout; any other value is yielded as is."""
    if json_out is None or str(json_out) != "-":
        yield json_out
        return
    import sys
    import tempfile
    from pathlib import Path

    quiet = console.quiet
    console.quiet = True
    with tempfile.TemporaryDirectory(prefix="l47-json-") as tmp:
        p = Path(tmp) / "out.json"
        try:
            yield p
        finally:
            console.quiet = quiet
        sys.stdout.write(p.read_text(encoding="utf-8"))
        sys.stdout.flush()
