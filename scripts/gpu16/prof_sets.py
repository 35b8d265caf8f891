"""Profile build_sets on a mid-size world: real tail dims n/f/r/hc (dump bytes per position as at full size),
V 4,096 (demo vocab) so the head is cheap on CPU."""
import cProfile, pstats, sys, time
from pathlib import Path
import torch
from l47.app.bench_pipeline import PipelineSize, build_world
from l47.testing.synth import SynthDims
MID = PipelineSize("mid", SynthDims(n=2560, f=640, r=320, hc=4, V=4096, n_layers=4), tokens=1000, pool=8,
                   collateral=4, background=2, kld=1, chat_heldout=2, events_per_doc=2, collateral_min_total=20,
                   vocab="demo")
root = Path(sys.argv[1])
t0 = time.perf_counter()
world = build_world(root, MID, "cpu", log=print)
print("world", time.perf_counter() - t0, world["docs"], world["positions"], world["dump_bytes"] / 2**30, "GiB")
from l47.data.sets import build_sets
mode = sys.argv[2] if len(sys.argv) > 2 else "prof"
if mode == "prof":
    pr = cProfile.Profile()
    t0, c0 = time.perf_counter(), time.process_time()
    pr.enable()
    rep = build_sets(Path(world["experiment"]))
    pr.disable()
    print("sets wall", time.perf_counter() - t0, "cpu", time.process_time() - c0)
    pr.dump_stats(str(root / "sets.prof"))
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
else:
    for i in range(int(mode)):
        t0, c0 = time.perf_counter(), time.process_time()
        rep = build_sets(Path(world["experiment"]))
        print("sets wall %.2f cpu %.2f" % (time.perf_counter() - t0, time.process_time() - c0))
