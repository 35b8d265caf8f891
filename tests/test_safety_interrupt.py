"""Interrupted commands leave nothing behind (issue 14 item 3), tested with a real `l47` process and real signals.

`l47 dump --engine strata` runs a stand-in Strata binary that writes some contract files into its raw folder
(`OUT/.strata-raw/<doc>/`), records its pid and then sleeps. The test sends SIGTERM or SIGINT to the `l47`
process while the engine runs and asserts: exit 143 / 130 with one `error: interrupted` line and no traceback; the
engine process is gone (killed, not orphaned); the raw folder's contract files and every folder the run created
are removed; a file of the user's in the output folder, or in a `.strata-raw` folder the user made, is untouched;
a rerun completes and gives the same dump bytes as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

SLOW = '''#!{python}
import os, sys, time
out = os.environ["STRATA_METAL_DUMP_DIR"]
L = int(os.environ["STRATA_METAL_DUMP_LAYER"])
for name in ("doc.tokens", f"L{{L}}.R", f"L{{L}}.hh", "run.json"):
    with open(os.path.join(out, name), "wb") as fh:
        fh.write(b"partial engine output")
with open(os.environ["FAKE_PIDFILE"], "w") as fh:
    fh.write(str(os.getpid()))
time.sleep(300)
'''


def _as_in_a_terminal():  # the child gets SIGINT as a user's shell delivers it: a background job of a
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # non-interactive shell (a CI runner, `make test &`) ignores it,
    # and Python keeps an inherited "ignore" — the test would then time out instead of testing the cleanup


def _slow_bin(tmp_path: Path) -> Path:
    p = tmp_path / "strata-slow"
    p.write_text(SLOW.format(python=sys.executable))
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def _docs(tmp_path: Path) -> Path:
    p = tmp_path / "docs.jsonl"
    p.write_text(json.dumps({"id": "plain", "text": "the quick brown fox jumps over the lazy dog"}) + "\n")
    return p


def _tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))} if root.exists() else {}


def _interrupt_dump(tmp_path, tiny_gguf, out: Path, sig: int) -> tuple[subprocess.CompletedProcess, int]:
    """Start `l47 dump --engine strata` with the slow engine, wait until the engine has written its partial
    files, send `sig` to l47, and return (the finished l47 process, the engine's pid)."""
    pidfile = tmp_path / "engine.pid"
    pidfile.unlink(missing_ok=True)
    env = {**os.environ, "L47_STRATA_ANY_PLATFORM": "1", "FAKE_PIDFILE": str(pidfile), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "l47.app.cli", "dump", str(_docs(tmp_path)), "--engine", "strata",
            "--engine-bin", str(_slow_bin(tmp_path)), "--model", str(tiny_gguf), "--out", str(out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_in_a_terminal)
    deadline = time.monotonic() + 120
    while not pidfile.exists() or not pidfile.read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the engine never started"
        time.sleep(0.1)
    engine_pid = int(pidfile.read_text())
    assert any((out / ".strata-raw").glob("*/L*.R"))  # the engine's partial files are there before the signal
    proc.send_signal(sig)
    so, se = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, so, se), engine_pid


def _engine_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").exists() and "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_interrupted_strata_dump_leaves_nothing(tmp_path, tiny_gguf, sig, code):
    out = tmp_path / "new" / "dumps"  # neither folder exists: the run creates both
    r, engine_pid = _interrupt_dump(tmp_path, tiny_gguf, out, sig)
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1 and "interrupted" in errs[0], r.stderr
    assert _engine_gone(engine_pid), "the engine process outlived l47"
    assert not (tmp_path / "new").exists(), _tree(tmp_path / "new")  # every folder it created, removed


def test_interrupt_keeps_the_users_files(tmp_path, tiny_gguf, fake_bin_factory):
    """A folder the user made (with a file of theirs, and their own .strata-raw note) keeps exactly that; a rerun
    then completes and gives the bytes of an uninterrupted run."""
    from l47.app.dumping import DumpJob, run_dump

    out = tmp_path / "dumps"
    (out / ".strata-raw").mkdir(parents=True)
    (out / "mine.txt").write_text("the user's notes\n")
    (out / ".strata-raw" / "README").write_text("the user's own file\n")
    before = _tree(out)
    r, engine_pid = _interrupt_dump(tmp_path, tiny_gguf, out, signal.SIGTERM)
    assert r.returncode == 143, r.stderr
    assert _engine_gone(engine_pid)
    assert _tree(out) == before  # no .pending, no raw folder, the user's files as they were

    fake = fake_bin_factory(tmp_path)
    s = run_dump(DumpJob(tiny_gguf, _docs(tmp_path), out, engine="strata", engine_bin=fake))
    ref = run_dump(DumpJob(tiny_gguf, _docs(tmp_path), tmp_path / "ref", engine="strata", engine_bin=fake))
    assert s.ok and ref.ok and s.count("written") == 1
    assert (out / "plain.safetensors").read_bytes() == (tmp_path / "ref" / "plain.safetensors").read_bytes()
    assert _tree(out).keys() == before.keys() | {"plain.safetensors"}  # the raw folder emptied again
    assert not (tmp_path / "ref" / ".strata-raw").exists()  # created by the run, removed when empty


@pytest.fixture()
def fake_bin_factory(monkeypatch):
    """The stand-in Strata binary of tests/test_dump_strata_route.py (runs the hf engine, writes the contract)."""
    monkeypatch.setenv("L47_STRATA_ANY_PLATFORM", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_dump_strata_route import FAKE
    finally:
        sys.path.pop(0)

    def make(tmp_path: Path) -> Path:
        p = tmp_path / "strata-hf"
        p.write_text(FAKE.format(python=sys.executable))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
        return p

    return make


# ---------------------------------------------------------------------------------------------------------
# `l47 solve` and `l47 audit`, interrupted by SIGTERM mid-run and rerun: the bytes of an uninterrupted run


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_malformed import make_solvable_world
    finally:
        sys.path.pop(0)
    return make_solvable_world(tmp_path_factory, tiny_tokenizer_kv, "int")


def _cli_subprocess(args, tmp_path: Path, wait_for: str, sig=signal.SIGTERM):
    """Run `l47 ARGS`; when a stdout line contains `wait_for`, stop the process (SIGSTOP, so it cannot finish
    meanwhile), queue `sig`, resume it. Returns (returncode, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "L47_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    p = subprocess.Popen([sys.executable, "-m", "l47.app.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if wait_for in line:
            p.send_signal(signal.SIGSTOP)
            p.send_signal(sig)
            p.send_signal(signal.SIGCONT)
            break
    else:
        raise AssertionError(f"{wait_for!r} never printed: {''.join(seen)}{p.stderr.read()}")
    _, err = p.communicate(timeout=300)
    return p.returncode, err


def _debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".staging", ".pending"))
                  or ".l47-audit" in p.name)


def test_interrupted_solve_and_audit_rerun_same_bytes(world, tmp_path):
    from typer.testing import CliRunner

    from l47.app.cli import app

    root, exp = world["root"], world["root"] / "det.toml"

    def solve(out: Path):
        return ["solve", exp, "--out", out / "bundle.gguf", "--ledger", out / "ledger.jsonl"]

    def audit(out: Path):
        return ["audit", out / "bundle.gguf", "--base", world["base"], "--experiment", exp, "--out", out / "audit",
                "--no-plots", "--ledger", out / "ledger.jsonl"]

    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    assert CliRunner().invoke(app, [str(a) for a in solve(ref)]).exit_code == 0
    r = CliRunner().invoke(app, [str(a) for a in audit(ref)])
    assert r.exit_code in (0, 1), r.output

    code, err = _cli_subprocess(solve(run), tmp_path, "solve:")  # the solve's first line: the work has begun
    assert code == 143 and "interrupted" in err and "Traceback" not in err, err
    assert not (run / "bundle.gguf").exists() and not (run / "bundle.gguf.solve.json").exists()
    assert _debris(run) == [] and sorted(p.name for p in run.iterdir()) in ([], ["ledger.jsonl"])
    r = CliRunner().invoke(app, [str(a) for a in solve(run)])
    assert r.exit_code == 0, r.output
    assert (run / "bundle.gguf").read_bytes() == (ref / "bundle.gguf").read_bytes()

    code, err = _cli_subprocess(audit(run), tmp_path, "audit: set")  # the first set scored: mid-audit
    assert code == 143 and "interrupted" in err and "Traceback" not in err, err
    assert _debris(run) == [] and not (run / "audit" / "report.json").exists()
    r = CliRunner().invoke(app, [str(a) for a in audit(run)])
    assert r.exit_code in (0, 1), r.output
    ja, jb = ((x / "audit" / "report.json").read_text().replace(str(x), "<OUT>") for x in (ref, run))
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_determinism import _no_time
    finally:
        sys.path.pop(0)
    assert _no_time(json.loads(ja)) == _no_time(json.loads(jb))
    assert (ref / "audit" / "positions.tsv").read_bytes() == (run / "audit" / "positions.tsv").read_bytes()


def test_interrupted_export_leaves_no_partial_and_no_temp_folder(tmp_path, monkeypatch):
    """`l47 export` stopped while it checks the written file (a dump into its own temp folder): exit 143, no
    OUT, no `.OUT.partial`, and its temp folder (under $TMPDIR) removed; a rerun then writes OUT."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from tiny_ckpt import save_checkpoint
    finally:
        sys.path.pop(0)
    ck = save_checkpoint(tmp_path / "ckpt")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # the child's temp folders go here
    code, err = _cli_subprocess(["export", ck, out], tmp_path, "checking:")
    assert code == 143 and "interrupted" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.parent.iterdir()) == []  # neither OUT nor its .partial
    assert sorted(p.name for p in tmpdir.iterdir()) == []  # the check's temp folder removed
    from typer.testing import CliRunner

    from l47.app.cli import app

    r = CliRunner().invoke(app, ["export", str(ck), str(out)])
    assert r.exit_code == 0 and out.is_file(), r.output


# ---------------------------------------------------------------------------------------------------------
# interrupts at the moments that used to leave half an output (issue 35 item 5): a real `l47` process whose one
# step is slowed (a driver patches it to print a marker and sleep), signalled at that marker

DRIVER = '''
import sys, time
import {module} as M
_real = M.{fn}
def _slow(*a, **k):
    {before}
    r = _real(*a, **k)
    {after}
    return r
M.{fn} = _slow
from l47.app.cli import app
sys.argv = ["l47", *sys.argv[1:]]
app()
'''
_MARK = 'print("MARK", flush=True); time.sleep({s})'


def _driven(tmp_path: Path, args, module: str, fn: str, *, before: str = "pass", after: str = "pass",
            signals=((signal.SIGTERM, "MARK"),)):
    """Run `l47 ARGS` with `module.fn` wrapped (`before` / `after` its call); for each (signal, marker) in order,
    wait for a stdout line holding the marker and send the signal. Returns (returncode, stdout, stderr)."""
    drv = tmp_path / f"driver_{fn}.py"
    drv.write_text(DRIVER.format(module=module, fn=fn, before=before, after=after))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "L47_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    p = subprocess.Popen([sys.executable, str(drv), *map(str, args)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal)
    seen, todo = [], list(signals)
    for line in p.stdout:
        seen.append(line)
        if todo and todo[0][1] in line:
            p.send_signal(todo.pop(0)[0])
            if not todo:
                break
    if todo:
        p.kill()
        raise AssertionError(f"{todo[0][1]!r} never printed: {''.join(seen)}{p.stderr.read()}")
    out, err = p.communicate(timeout=300)
    return p.returncode, "".join(seen) + out, err


@pytest.fixture(scope="module")
def solved(world, tmp_path_factory):
    """An uninterrupted solve of the world (the reference bytes)."""
    from typer.testing import CliRunner

    from l47.app.cli import app

    ref = tmp_path_factory.mktemp("ref_solve")
    r = CliRunner().invoke(app, [str(a) for a in _solve_args(world, ref / "out")])
    assert r.exit_code == 0, r.output
    return ref / "out"


def _solve_args(world, out: Path):
    """The closed-form solve (seconds here; what is tested is the write-out, the same for every method)."""
    return ["solve", world["root"] / "det.toml", "--method", "wfld", "--out", out / "bundle.gguf",
            "--ledger", out.parent / "ledger.jsonl"]


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_sigterm_between_bundle_and_record_leaves_neither(world, solved, tmp_path):
    """The bundle is complete (under its temp name) and the record not yet written: SIGTERM then leaves neither,
    nor the folder the run created for them; the message's claim is true; a rerun gives the reference bytes."""
    out = tmp_path / "new" / "out"  # created by the run (the ledger lives beside it, in new/)
    code, _, err = _driven(tmp_path, _solve_args(world, out), "l47.solvers.solve", "_write_bundle",
                           after=_MARK.format(s=60))
    assert code == 143 and "Traceback" not in err, err
    errs = _error_lines(err)
    assert len(errs) == 1 and "interrupted" in errs[0] and "no partial output left" in errs[0], err
    assert not out.exists(), _tree(tmp_path / "new")  # no bundle, no record, no temp, no empty folder
    from typer.testing import CliRunner

    from l47.app.cli import app

    r = CliRunner().invoke(app, [str(a) for a in _solve_args(world, out)])
    assert r.exit_code == 0, r.output
    for f in ("bundle.gguf", "bundle.gguf.solve.json"):
        assert (out / f).read_bytes() == (solved / f).read_bytes(), f


def test_sigterm_during_the_renames_leaves_both(world, tmp_path):
    """SIGTERM after the record took its name but before the bundle did: the signal is held until the bundle is in
    place too, so both are there (the record naming the bundle's sha256) and the message says they were kept."""
    from l47.data.record import read_record
    from l47.fileio import sha256_file

    out = tmp_path / "out"
    code, _, err = _driven(tmp_path, _solve_args(world, out), "l47.fileio", "commit",
                           after='if str(a[1]).endswith(".solve.json"): ' + _MARK.format(s=2))
    assert code == 143 and "Traceback" not in err, err
    errs = _error_lines(err)
    assert len(errs) == 1 and "complete output file(s)" in errs[0] and "bundle.gguf" in errs[0], err
    # the pair belongs together (the reference bytes come from another thread count: not compared here)
    assert read_record(out / "bundle.gguf.solve.json").bundle_sha256 == sha256_file(out / "bundle.gguf")
    assert sorted(p.name for p in out.iterdir()) == ["bundle.gguf", "bundle.gguf.solve.json"]


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_second_signal_during_cleanup_still_cleans_up(world, tmp_path, second):
    """SIGINT while the bundle is being written, then `second` while the cleanup removes its temp file (slowed):
    the cleanup finishes (no temp, no folder the run made), one error line, exit 130, no traceback."""
    out = tmp_path / "new" / "out"
    args = _solve_args(world, out)
    drv_mark = _MARK.format(s=60)
    # two patches: the bundle write sleeps (first signal there), the temp removal announces itself and sleeps
    code, _, err = _driven(tmp_path, args, "l47.solvers.solve", "_write_bundle",
                           before="import l47.fileio as F\n    _r = F._remove\n"
                                  "    def _slow_remove(p):\n        print('CLEANING', flush=True); time.sleep(1.5); _r(p)\n"
                                  "    F._remove = _slow_remove\n    " + drv_mark,
                           signals=((signal.SIGINT, "MARK"), (second, "CLEANING")))
    assert code == 130 and "Traceback" not in err, err
    errs = _error_lines(err)
    assert len(errs) == 1 and "interrupted" in errs[0], err
    assert not out.exists(), _tree(tmp_path / "new")


def test_interrupted_audit_removes_the_folder_it_created(world, solved, tmp_path):
    """SIGTERM while the audit writes its plots (its report staged inside the new folder): the folder the run
    created is removed with the staging folder; a folder of the user's that existed before keeps its files."""
    exp = world["root"] / "det.toml"
    for folder, pre in ((tmp_path / "new" / "audit", None), (tmp_path / "mine", "notes.txt")):
        if pre:
            folder.mkdir()
            (folder / pre).write_text("the user's\n")
        before = _tree(folder)
        ledger = tmp_path / f"{folder.name}.ledger.jsonl"
        ledger.write_bytes((solved.parent / "ledger.jsonl").read_bytes())
        args = ["audit", solved / "bundle.gguf", "--base", world["base"], "--experiment", exp, "--out", folder,
                "--ledger", ledger]
        code, _, err = _driven(tmp_path, args, "l47.evals.plots", "write_plots", before=_MARK.format(s=60))
        assert code == 143 and "Traceback" not in err, err
        assert "no partial output left" in _error_lines(err)[0], err
        if pre:
            assert _tree(folder) == before
        else:
            assert not (tmp_path / "new").exists(), _tree(tmp_path / "new")


def test_atomic_group_all_or_none(tmp_path, monkeypatch):
    """AtomicGroup: a failure while writing leaves no file and no temp; a failure of the second rename removes the
    first target too (none of the group); a clean exit renames both and runs the on_commit action once; the folder
    the group created is removed by the cleanup when it ends empty, a folder that existed is kept."""
    import l47.fileio as F

    a, b = tmp_path / "new" / "rec.json", tmp_path / "new" / "bundle.gguf"
    with pytest.raises(RuntimeError):
        with F.AtomicGroup(a, b) as g:
            g.temp(a).write_text("r")
            raise RuntimeError("during the write")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == []
    F.cleanup_live()
    assert not (tmp_path / "new").exists()  # created for the group, left empty: removed

    real = F.commit

    def second_fails(t, p):
        if p == b:
            raise OSError(28, "No space left on device")
        return real(t, p)

    monkeypatch.setattr(F, "commit", second_fails)
    with pytest.raises(OSError):
        with F.AtomicGroup(a, b) as g:
            g.temp(a).write_text("r")
            g.temp(b).write_bytes(b"B")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == []
    monkeypatch.setattr(F, "commit", real)
    calls = []
    with F.AtomicGroup(a, b) as g:
        g.temp(a).write_text("r")
        g.temp(b).write_bytes(b"B")
        g.on_commit(lambda: calls.append(a.read_text() + b.read_bytes().decode()))
    assert calls == ["rB"] and sorted(p.name for p in (tmp_path / "new").iterdir()) == ["bundle.gguf", "rec.json"]
