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
