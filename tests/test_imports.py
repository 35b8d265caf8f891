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


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks: read by type checkers, never run."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for b in node.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def imports_of(path: Path, modname: str, mods=None, runtime_only: bool = False) -> set[str]:
    mods = modules() if mods is None else mods
    out = set()
    pkg = modname if path.stem == "__init__" else modname.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports_of(p, m, mods, runtime_only) if i.split(".")[0] == "l47"} for m, p in mods.items()}


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




# Module cycles being removed elsewhere. An entry that is no longer a cycle fails the test: delete it then.
PENDING_CYCLES: set[tuple[str, ...]] = set()


def module_cycles(g: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The import cycles of graph `g` (module -> modules it imports): every strongly connected component of more
    than one module (or a module importing itself), each sorted; Tarjan's algorithm, iterative."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in g.get(v, ()):
                    out.append(tuple(sorted(comp)))
    return sorted(out)


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the installed package it imports (module level or inside a function: both run;
    not under `if TYPE_CHECKING:`, which never runs)."""
    mods = modules()
    return {m: {d for d in dsts if d in mods and d != m} for m, dsts in graph(runtime_only=True).items()}


def test_no_import_cycles_between_modules():
    """No two modules of the installed package import each other, directly or through others (issue 36 item 5:
    the bench helpers live in l47/app/bench_common.py, the top-k tie rule in l47/tail/topk.py)."""
    found = set(module_cycles(module_graph()))
    new = sorted(found - PENDING_CYCLES)
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = sorted(PENDING_CYCLES - found)
    assert not gone, f"no longer a cycle, remove from PENDING_CYCLES: {gone}"
    if found:
        print("pending import cycles:", sorted(found))


def test_cycle_finder_on_known_graphs(tmp_path):
    """module_cycles on graphs whose cycles are known by construction, and the real reader on files that form one
    through a function-level import."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}, "h": {"a"}}
    assert module_cycles(g) == [("a", "b", "c"), ("d", "e"), ("f",)]
    assert module_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    (tmp_path / "x.py").write_text("from l47.tail import stream\n")
    (tmp_path / "y.py").write_text("def f():\n    from l47.tail.fused import combine\n")
    mods = modules()
    gx = {"l47.tail.fused": imports_of(tmp_path / "x.py", "l47.tail.fused", mods) & set(mods),
          "l47.tail.stream": imports_of(tmp_path / "y.py", "l47.tail.stream", mods) & set(mods)}
    assert module_cycles(gx) == [("l47.tail.fused", "l47.tail.stream")]


def test_the_dump_driver_prints_nothing():
    """l47/app/dumping.py reports through callbacks (log, progress) like run_solve and run_audit; the rendering is
    l47/app/dump_view.py."""
    tree = ast.parse(modules()["l47.app.dumping"].read_text())
    bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "print")
        or (isinstance(n.func, ast.Attribute) and n.func.attr == "print"))]
    bad += [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and any(
        (a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0] == "rich" for a in n.names)]
    assert not bad, f"l47/app/dumping.py prints or imports rich at lines {bad}"


# ----------------------------------------------------------------------------------------------------------
# where imports sit (issue 36 item 4): the library imports its own modules at module level; only the CLI defers

HEAVY = ("torch", "transformers", "numpy", "gguf", "safetensors", "tokenizers", "matplotlib", "scipy")
# The one module that defers on purpose: each typer command imports its driver when it runs, so `l47 --help` loads
# none of HEAVY (test_cli_start_up_imports_nothing_heavy).
CLI_DEFERS = {"l47.app.cli": "each command imports its driver when it runs: `l47 --help` loads nothing heavy"}
# Other modules that keep an import of l47 inside a function, each for a reason that is still true: a module-level
# import would form a real import cycle or load an optional heavy dependency. An entry whose module no longer
# imports l47 inside a function fails the test: delete it.
DEFERRED: dict[str, str] = {
    "l47.tail.fused": "l47.tail.fused_kernels imports triton (optional, CUDA only): loaded when a kernel is built",
    "l47.app.paths": "the path and option checks run before every command: a bad path is refused before torch and "
                     "the solvers load (test_a_bad_path_is_refused_before_anything_heavy_loads)",
}
# modules still importing l47 inside a function, left to their owners (moved when next edited). An entry that no
# longer does (and exists) fails the test: delete it.
PENDING_DEFERRED: set[str] = set()


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of l47 inside a function or class body (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top or id(node) in skip:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        out += [(node.lineno, n) for n in names if n.split(".")[0] == "l47" or getattr(node, "level", 0)]
    return sorted(out)


def test_library_imports_its_own_modules_at_module_level():
    """Every module of the installed package imports l47 at module level (none of them forms a runtime cycle:
    test_no_import_cycles_between_modules), save the CLI, which defers its drivers for start-up time, and the few
    modules of DEFERRED, each with its reason."""
    mods = modules()
    found = {m: v for m, p in mods.items() if (v := function_level_imports(p))}
    exempt = CLI_DEFERS.keys() | DEFERRED.keys() | PENDING_DEFERRED
    new = {m: v for m, v in found.items() if m not in exempt}
    assert not new, "imports inside functions:\n" + "\n".join(f"{m}: {v}" for m, v in sorted(new.items()))
    gone = sorted(m for m in exempt - set(found) if m in mods)
    assert not gone, f"no function-level import left, remove from CLI_DEFERS / DEFERRED / PENDING_DEFERRED: {gone}"
    assert all(m in mods for m in CLI_DEFERS.keys() | DEFERRED.keys()), "an exempt module that does not exist"


def test_function_level_import_reader(tmp_path):
    """The reader on a file whose imports are known: module level and TYPE_CHECKING ones are not counted."""
    (tmp_path / "m.py").write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nfrom l47 import fileio\n"
        "if TYPE_CHECKING:\n    from l47.model import weights\n"
        "def f():\n    import json\n    from l47.tail import forward\n"
        "class C:\n    def g(self):\n        from . import sibling\n")
    assert function_level_imports(tmp_path / "m.py") == [(8, "l47.tail"), (11, "")]


def test_cli_start_up_imports_nothing_heavy():
    """`import l47.app.cli` and `l47 --help` load none of the heavy libraries (torch, transformers, ...): each
    command imports its driver when it runs. Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys\nfrom l47.app.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_a_bad_path_is_refused_before_anything_heavy_loads(tmp_path):
    """`l47 plan` of an experiment file that is not TOML exits 2 with one line naming it, and by then none of the
    heavy libraries has been imported: the checks every command runs first (l47.app.paths) are cheap. Fresh
    interpreter."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "experiment.toml"
    missing.write_text("this is = not [valid toml\n")
    code = ("import sys\nfrom l47.app.cli import app\ntry:\n    app(['plan', %r])\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))") % str(missing)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "COLUMNS": "400"})
    lines = out.stdout.strip().splitlines()
    assert "exit 2" in lines, out.stdout[-2000:] + out.stderr[-2000:]
    assert str(missing.name) in out.stdout + out.stderr
    assert lines[-1] == "[]", out.stdout[-2000:]
