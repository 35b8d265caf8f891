"""80 columns: every table `l47 sets` prints fits an 80-column terminal with no header cut, and no value lost.

Reference: the report's own numbers (SetsReport.counts) and the tables' headers as built; the rendered text of
a rich Console(width=80) must contain every header whole and every count, and no line may exceed 80 columns."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from test_sets import report, world  # noqa: F401  (module fixtures: the sets world and its report)

from l47.app.cli import app
from l47.app.tables import FittedConsole, fit, needed_width
from l47.app.sets_view import render_sets_table


def test_sets_tables_fit_80_columns(report):  # noqa: F811
    tables = [t for t in render_sets_table(report) if isinstance(t, Table)]
    assert any(needed_width(t) > 80 for t in tables)  # the case this is about: too wide as built
    con = Console(record=True, width=80)
    FittedConsole(con).print(*tables)
    out = con.export_text()
    assert max(len(ln) for ln in out.splitlines()) <= 80
    for t in tables:
        for c in t.columns:
            assert str(c.header) in out, c.header  # whole, not cut to 1–2 letters
    ev = report.counts("events")
    for ph, by_set in ev.items():
        for s, n in by_set.items():
            assert ph in out and str(n) in out


def test_fit_keeps_narrow_tables_and_every_value():
    t = Table(title="narrow")
    t.add_column("a")
    t.add_column("b")
    t.add_row("x", "1")
    assert fit(t, 80) is t
    wide = Table(title="wide")
    heads = ["phrase"] + [f"column number {i}" for i in range(9)]
    for h in heads:
        wide.add_column(h)
    wide.add_row("rather than", *[str(10 * i + 7) for i in range(9)])
    v = fit(wide, 80)
    con = Console(record=True, width=80)
    con.print(v)
    out = con.export_text()
    assert all(h in out for h in heads) and all(str(10 * i + 7) in out for i in range(9))


def test_sets_cli_exit_codes_strict_and_json_stdout(world, tmp_path):  # noqa: F811
    """The world's experiment has warnings (a blind set without events, too little collateral): exit 0, with
    --strict exit 1; --json - prints the report as JSON and nothing else."""
    root, _ = world
    r = CliRunner().invoke(app, ["sets", str(root / "exp.toml")])
    assert r.exit_code == 0 and "warning:" in r.output, r.output[-2000:]
    r = CliRunner().invoke(app, ["sets", str(root / "exp.toml"), "--strict"])
    assert r.exit_code == 1
    r = CliRunner().invoke(app, ["sets", str(root / "exp.toml"), "--json", "-"])
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["schema"] == "l47.sets/1" and d["warnings"]
