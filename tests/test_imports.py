"""Imports go one way (docs/ARCHITECTURE.md): the import graph of the installed package, read with ast from the
folders that pyproject.toml maps to each package, checked edge by edge against one table. No module is exempt:
the drivers live in l47.app, which may import everything. Imports inside functions count."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = {"l47", "l47.errors", "l47.fileio"}
# layer -> layers it may import (itself always allowed). `l47.model.names` is the one constants module and
# imports nothing of l47, so `dumps` may read it too.
ALLOWED = {
    "l47": set(),
    "l47.dumps": {"l47.model.names"},
    "l47.model": {"l47.dumps"},
    "l47.engine": {"l47.model", "l47.dumps"},
    "l47.tail": {"l47.model"},
    "l47.data": {"l47.model", "l47.tail", "l47.dumps"},
    "l47.solvers": {"l47.model", "l47.tail", "l47.data", "l47.dumps"},
    "l47.evals": {"l47.model", "l47.tail", "l47.data", "l47.dumps"},
    "l47.testing": {"l47.model", "l47.tail", "l47.dumps", "l47.data"},
    "l47.app": {"*"},
}


def package_map() -> dict[str, Path]:
    """{package name: folder} from pyproject.toml's setuptools package-dir / packages (what pip installs)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    pdir = cfg["package-dir"]
    out = {}
    for pkg in cfg["packages"]:
        # a package without its own package-dir entry sits under its parent's folder
        parent, _, leaf = pkg.rpartition(".")
        out[pkg] = ROOT / pdir[pkg] if pkg in pdir else out[parent] / leaf
    return out


def modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in package_map().items():
        for f in sorted(folder.glob("*.py")):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return mods


def imports_of(path: Path, modname: str, mods=None) -> set[str]:
    mods = modules() if mods is None else mods
    out = set()
    pkg = modname if path.stem == "__init__" else modname.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from l47.model import names` is an edge to l47.model.names, not the package
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return out


def layer_of(mod: str, layers) -> str | None:
    best = None
    for lay in layers:
        if (mod == lay or mod.startswith(lay + ".")) and (best is None or len(lay) > len(best)):
            best = lay
    return best


def edge_ok(src: str, dst: str, mods: dict) -> bool:
    if dst not in mods and not any(m.startswith(dst + ".") for m in mods):
        return True  # a name imported from a module (`from l47.model.names import ROLES` -> ...names.ROLES)
    if dst in BASE:
        return True
    s, d = layer_of(src, ALLOWED), layer_of(dst, ALLOWED)
    if d is None or s == d:
        return True
    allowed = ALLOWED[s]
    return "*" in allowed or d in allowed or dst in allowed or any(dst.startswith(a + ".") for a in allowed)


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports_of(p, m, mods) if i.split(".")[0] == "l47"} for m, p in mods.items()}


def test_every_edge_of_the_installed_package_is_allowed():
    mods = modules()
    bad = [f"{src} imports {dst}" for src, dsts in graph().items() for dst in sorted(dsts)
           if not edge_ok(src, dst, mods)]
    assert not bad, "\n".join(bad)


def test_no_bare_stage_imports():
    """`evals`, `engine` ... are taken on PyPI: the pipeline folders are only ever imported as l47.<folder>."""
    bad = []
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            bad += [f"{m}: {n}" for n in names if n.split(".")[0] in ("engine", "evals", "solvers", "dumps")]
    assert not bad, bad


def test_no_import_cycles_between_layers():
    mods = modules()
    layer_edges = {}
    for src, dsts in graph().items():
        for dst in dsts:
            s, d = layer_of(src, ALLOWED), layer_of(dst, ALLOWED)
            if d and s != d and dst not in BASE and (dst in mods or any(m.startswith(dst + ".") for m in mods)):
                layer_edges.setdefault(s, set()).add(d)
    # l47.dumps -> l47.model (names only) and l47.model -> l47.dumps would be a cycle: model must not read dumps
    # through the package; check with a DFS
    seen, stack = set(), []

    def dfs(u):
        stack.append(u)
        for v in layer_edges.get(u, ()):
            assert v not in stack, "cycle: " + " -> ".join(stack + [v])
            if v not in seen:
                dfs(v)
        stack.pop()
        seen.add(u)

    for u in list(layer_edges):
        if u not in seen:
            dfs(u)


def test_checker_detects_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from l47.solvers.wfld import solve_wfld\n")
    mods = modules()
    assert not all(edge_ok("l47.evals.audit", d, mods) for d in imports_of(f, "l47.evals.audit")
                   if d.startswith("l47"))
    assert all(edge_ok("l47.app.cli", d, mods) for d in imports_of(f, "l47.app.cli") if d.startswith("l47"))


def test_only_the_app_prints_or_imports_rich():
    bad = []
    for m, p in modules().items():
        if layer_of(m, ALLOWED) == "l47.app":
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{m} imports {n}" for n in names if n.split(".")[0] == "rich"]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                if not _under_main_guard(tree, node):
                    bad.append(f"{m}:{node.lineno} calls print")
    assert not bad, "\n".join(bad)


def _under_main_guard(tree, call) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            if any(call is n for n in ast.walk(node)):
                return True
    return False


