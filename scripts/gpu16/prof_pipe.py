"""Profile the pipeline stages (sets, solve, audit) with cProfile: `python scripts/gpu16/prof_pipe.py WORK SIZE`
SIZE: wide (n 256, f 640, V 4,096 with the full size's document counts: per-document / per-position host costs
show), mid (real n/f/r/hc, V 4,096, few documents: real dump bytes), reduced. Profiles to WORK/prof_<stage>.txt.
`profile_stages(bp, out_dir)` is the wrapper (scripts/gpu16/probe1.py uses it too)."""
import cProfile
import io
import json
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path


def profile_stages(bp, out_dir: Path, callers: str | None = None) -> None:
    """Wrap bench_pipeline's stage timer so each stage also writes its cProfile to out_dir/prof_<stage>.txt."""
    orig = bp._stage

    def prof_stage(name, fn, device, out, logf):
        pr = cProfile.Profile()

        def run():
            pr.enable()
            try:
                return fn()
            finally:
                pr.disable()
        r = orig(name, run, device, out, logf)
        s = io.StringIO()
        ps = pstats.Stats(pr, stream=s)
        ps.sort_stats("cumulative").print_stats(60)
        ps.sort_stats("tottime").print_stats(40)
        if callers:
            ps.print_callers(callers)
        (out_dir / f"prof_{name}.txt").write_text(s.getvalue())
        return r
    bp._stage = prof_stage


if __name__ == "__main__":
    import l47.app.bench_pipeline as bp
    from l47.testing.synth import SynthDims

    work, size = Path(sys.argv[1]), sys.argv[2]
    if size == "wide":  # n small (cheap mixer and head), f real (the anchors' span as at full size)
        bp.REDUCED = replace(bp.FULL, name="wide", dims=SynthDims(n=256, f=640, r=32, hc=4, V=4096, n_layers=4),
                             vocab="demo")
    elif size == "mid":
        bp.REDUCED = replace(bp.REDUCED, name="mid", dims=SynthDims(n=2560, f=640, r=320, hc=4, V=4096, n_layers=4),
                             tokens=1000, pool=12)
    profile_stages(bp, work)
    t0 = time.perf_counter()
    r = bp.bench_pipeline(False, "cpu", work, log=lambda m: print(m, flush=True))
    print(json.dumps({k: r[k] for k in ("stages", "world", "events", "error")}, default=str, indent=1))
    print("wall", time.perf_counter() - t0)
