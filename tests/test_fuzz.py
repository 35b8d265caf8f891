"""A seeded slice of scripts/fuzz_readers.py (issue 35 item 9): 300 mutants of each seed file (a dump, a GGUF, an
experiment TOML, a JSONL document file) read in process; every one must be a clean refusal (L47Error) or a read,
none another exception or a hang (10 s per input). The slice is deterministic (seeded), so a failure names a
reproducible input. The long run's figures are in docs/BENCHMARKS.md.

Not vacuous: each reader both refuses and reads some mutants (the mutations reach past the first check and some
leave a valid file), and the harness counts a reader's stray exception as a crash (a planted ValueError).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

N = 300


def _fuzz_module():
    path = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_readers.py"
    spec = importlib.util.spec_from_file_location("fuzz_readers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fuzz():
    return _fuzz_module()


@pytest.fixture(scope="module")
def figures(fuzz):
    return fuzz.run(list(fuzz.READERS), N, 1, seed=0, limit_s=10.0, save=None)["readers"]


@pytest.mark.parametrize("reader", ["dump", "gguf", "experiment", "jsonl"])
def test_every_mutant_is_refused_or_read(figures, reader):
    f = figures[reader]
    assert f["inputs"] == N
    assert f["refusals"] + f["reads"] + f["crashes"] + f["hangs"] == N
    assert f["refusals"] > 0 and f["reads"] > 0, f  # both outcomes reached: the mutations are not all trivial
    assert f["crashes"] == 0 and f["hangs"] == 0, f["crash_kinds"]


def test_the_harness_counts_a_stray_exception_and_a_hang(fuzz, tmp_path, monkeypatch):
    import random
    import signal
    import time

    seed = b'{"id": "a", "text": "x"}\n'

    def bad(p):
        raise ValueError("planted")

    monkeypatch.setitem(fuzz.READ, "jsonl", bad)
    out = fuzz.fuzz_one_reader("jsonl", seed, 5, random.Random(0), tmp_path, 5.0, tmp_path / "saved")
    assert out["crashes"] == 5 and out["refusals"] == out["reads"] == 0
    assert list(out["crash_kinds"]) == [f"ValueError at {Path(__file__).name}:{bad.__code__.co_firstlineno + 1}"]
    assert len(list((tmp_path / "saved").iterdir())) == 3  # the first 3 inputs of that kind kept

    monkeypatch.setitem(fuzz.READ, "jsonl", lambda p: time.sleep(5))
    old = signal.signal(signal.SIGALRM, fuzz._alarm)
    try:
        out = fuzz.fuzz_one_reader("jsonl", seed, 2, random.Random(0), tmp_path, 0.2, None)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert out["hangs"] == 2 and out["seconds"] < 4
