"""positions.tsv rendering time: evals.report.render_tsv against the per-row renderer it replaced
(tests/test_report_tsv.py's reference), process CPU time, on 40 synthetic documents of 1,000 positions — with a
trivial decoder, then with the Qwen3.6 vocabulary and ids spread over it; asserts the same bytes.
    OMP_NUM_THREADS=1 python scripts/gpu16/tsv_speed.py"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_report_tsv import _doc, _Vocab, render_tsv_per_row  # noqa: E402

from l47.evals import report  # noqa: E402
from l47.model.vocab import vocab_qwen36  # noqa: E402


def timed(name, fn, *a):
    t = time.process_time()
    s = fn(*a)
    print(f"{name}: {time.process_time() - t:.3f} CPU-s, {len(s):,} characters", flush=True)
    return s


def main():
    sp = {"a": 7, "b": 3}
    for label, vocab, spread in (("trivial decoder", _Vocab(), False), ("Qwen3.6 vocabulary", vocab_qwen36(), True)):
        rng, sims = np.random.default_rng(1), {}
        docs = [_doc(rng, i, 1000, i % 4 == 0, sims) for i in range(40)]
        if spread:  # ids as a real document's
            for d in docs:
                d.tokens[:] = rng.integers(0, 248_000, d.tokens.shape)
                d.ps.base.argmax[:] = rng.integers(0, 5000, d.T)
                d.ps.new.argmax[:] = d.ps.base.argmax
        for rep in range(2):
            a = timed(f"{label}, per-row (old), {rep + 1}", render_tsv_per_row, docs, vocab, sp, sims)
            b = timed(f"{label}, column-wise (new), {rep + 1}", report.render_tsv, docs, vocab, sp, sims)
            assert a == b


if __name__ == "__main__":
    main()
