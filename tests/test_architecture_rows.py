"""docs/ARCHITECTURE.md "Commands → code": every command of the CLI has a row, every row names a command of the
CLI, and every `file` `function` pair a row names is a def (or class) in that file, read with ast — so the
rows stay at most two hops from the code (the command's row, then the function)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _table() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    sec = text.split("## Commands → code", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in sec.splitlines() if ln.startswith("| `l47 ")]


def _defs(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_command_has_a_row_and_every_row_a_command():
    from l47.app.cli import app

    cli = {c.name or c.callback.__name__ for c in app.registered_commands}
    rows = {re.match(r"\| `l47 (\w+)`", ln).group(1) for ln in _table()}
    assert rows == cli, (sorted(cli - rows), sorted(rows - cli))
    for cmd in ("export", "init", "plan"):
        assert cmd in rows


def test_every_named_function_is_in_its_file():
    pairs = 0
    for ln in _table():
        for path, names in re.findall(r"`((?:l47|solvers|evals|engine|dumps)/[\w/]+\.py)` ((?:`\w+(?:\(\w+\))?`(?:, | / )?)+)",
                                      ln):
            defs = _defs(ROOT / path)
            for name in re.findall(r"`(\w+)", names):
                assert name in defs, f"{ln.split('|')[1].strip()}: {path} has no def {name}"
                pairs += 1
    assert pairs >= 15
