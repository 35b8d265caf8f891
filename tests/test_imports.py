"""Imports go one way (DESIGN §2): engine/ -> dumps/ -> l47 core -> solvers/, evals/.

Checked statically (ast) on every module, including imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# orchestration modules of the l47 package may reach every stage: they are the pipeline's drivers
DRIVERS = {"cli.py", "dumping.py", "bench.py", "demo.py"}
STAGES = ("engine", "dumps", "solvers", "evals")
ALLOWED = {
    "dumps": {"l47.names", "l47.errors", "l47.dumps"},
    "core": {"l47", "l47.dumps"},
    "engine": {"l47", "l47.dumps", "l47.engine"},
    "solvers": {"l47", "l47.dumps", "l47.solvers"},
    "evals": {"l47", "l47.dumps", "l47.evals"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "l47":  # `from l47 import names` -> l47.names
                out |= {f"l47.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return {m for m in out if m == "l47" or m.startswith("l47.") or m.split(".")[0] in STAGES}


def _stage_of(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] in STAGES:
        return "bare:" + parts[0]  # a bare top-level import would clash with PyPI names (`evals`)
    if len(parts) > 1 and parts[1] in STAGES:
        return "l47." + parts[1]
    return "l47"


def _ok(stage: str, mod: str) -> bool:
    s = _stage_of(mod)
    if s.startswith("bare:"):
        return False
    allowed = ALLOWED[stage]
    if stage == "dumps":
        return mod in allowed or s == "l47.dumps"
    return s in allowed


def test_imports_go_one_way():
    bad = []
    for stage, folder in (("dumps", "dumps"), ("engine", "engine"), ("solvers", "solvers"), ("evals", "evals"),
                          ("core", "l47")):
        for f in sorted((ROOT / folder).glob("*.py")):
            if stage == "core" and f.name in DRIVERS:
                continue
            for mod in _imports(f):
                if not _ok(stage, mod):
                    bad.append(f"{folder}/{f.name} imports {mod}")
    assert not bad, "\n".join(bad)


def test_checker_detects_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from l47.solvers.wfld import solve_wfld\n")
    assert not all(_ok("evals", m) for m in _imports(f))
