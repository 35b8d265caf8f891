"""docs/ARCHITECTURE.md reaches every bar and every command in one hop (issue 11's target): the tables are read
from the page and checked against the registry of bars (evals/bars.py) and the commands typer registers."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def _rows(header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with `header` (cells stripped)."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    out = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        out.append([c.strip() for c in ln.strip("|").split("|")])
    return out


def test_every_registered_bar_has_a_row_naming_its_measure():
    from l47.evals.bars import REGISTRY

    rows = _rows("| bar(s) |")
    for name, bd in REGISTRY.items():
        hit = [r for r in rows if f"`{name}`" in r[0]]
        assert len(hit) == 1, f"bar {name}: {len(hit)} rows of the bars table name it"
        fn = bd.fn.__name__
        assert fn == "<lambda>" or f"`{fn}`" in hit[0][1], f"bar {name}: its measure {fn} is not in its row"
    named = {m for r in rows for m in re.findall(r"`([^`]+)`", r[0]) if "<" not in m}  # e.kld.<domain>: a form
    assert named <= set(REGISTRY), f"rows name bars that are not registered: {sorted(named - set(REGISTRY))}"


def test_every_command_has_a_row():
    import typer.main

    from l47.app.cli import app

    commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    rows = {r[0].strip("`").removeprefix("l47 ") for r in _rows("| command |")}
    assert commands and commands <= rows, sorted(commands - rows)
    assert typer.main.get_command(app).commands.keys() == commands  # what typer builds is what was read


def test_every_function_a_command_row_names_is_in_its_file():
    """Each `file` `function` pair of the commands table is a def (or class) of that file, read with ast: the row
    is one hop from the code, and a renamed function cannot leave it pointing nowhere."""
    import ast

    root = DOC.parents[1]
    pairs = 0
    for r in _rows("| command |"):
        for path, names in re.findall(r"`((?:l47|solvers|evals|engine|dumps)/[\w/]+\.py)` "
                                      r"((?:`\w+(?:\(\w+\))?`(?:, | / )?)+)", r[1]):
            tree = ast.parse((root / path).read_text(encoding="utf-8"))
            defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            for name in re.findall(r"`(\w+)", names):
                assert name in defs, f"{r[0]}: {path} has no def {name}"
                pairs += 1
    assert pairs >= 15
    assert {"l47 export", "l47 init", "l47 plan"} <= {r[0].strip("`") for r in _rows("| command |")}


def _defs(path: str) -> set[str]:
    import ast

    tree = ast.parse((DOC.parents[1] / path).read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_every_concept_names_the_function_that_makes_it():
    """The concepts table and the evidence families table: each `file` `function` pair of the `made in` column is
    a def of that file (read with ast), so a concept's one maker cannot be renamed away from its row."""
    pairs = 0
    for header in ("| concept | type | made in |", "| family (`Evidence` field) |"):
        for r in _rows(header):
            for path, name in re.findall(r"`((?:l47|solvers|evals|engine|dumps)/[\w/]+\.py)` `(\w+)", r[2]):
                assert name in _defs(path), f"{r[0]}: {path} has no def {name}"
                pairs += 1
    assert pairs >= 20


def test_every_evidence_family_has_a_row():
    """Each dataclass of evals/figures.py is a row of the evidence families table, and each row's type is one of
    them; every field of bars.Evidence but the thresholds and the mode is a family's row, and every row but the
    reported-only ones (bars "—") is such a field."""
    import ast
    import dataclasses

    from l47.evals.bars import Evidence

    tree = ast.parse((DOC.parents[1] / "evals/figures.py").read_text(encoding="utf-8"))
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    rows = _rows("| family (`Evidence` field) |")
    typed = {t for r in rows for t in re.findall(r"`(\w+)`", r[1])} & classes
    assert typed == classes - {"KldStats"}, sorted(classes ^ typed)
    fields = {f.name for f in dataclasses.fields(Evidence)} - {"thresholds", "mode"}
    read_by_bars = [r for r in rows if not r[3].startswith("—")]  # a row whose bars are "—" is reported only
    assert fields == {re.findall(r"`(\w+)`", r[0])[0] for r in read_by_bars}
