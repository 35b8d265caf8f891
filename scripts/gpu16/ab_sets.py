"""build_sets before (main 83c86d3's sets.py and accumulator row sums) and after (this branch), alternated in one
process on the mid world (real n/f/r/hc, V 4,096, 19 documents, 22,081 positions, 1.1 GiB of dumps).
    git show 83c86d3:l47/data/sets.py > /tmp/sets_old.py
    python scripts/gpu16/prof_sets.py /tmp/mid          # builds the mid world (and profiles build_sets once)
    SETS_OLD=/tmp/sets_old.py python scripts/gpu16/ab_sets.py /tmp/mid 2"""
import cProfile, importlib.util, json, os, pstats, sys, time
from pathlib import Path
import torch
from l47.data import sets as new
from l47.tail.stream import VocabAccumulator
spec = importlib.util.spec_from_file_location("l47.data.sets_old", os.environ["SETS_OLD"])
old = importlib.util.module_from_spec(spec); sys.modules["l47.data.sets_old"] = old; spec.loader.exec_module(old)
new_sum = VocabAccumulator._sum
def old_sum(self, x):
    if self.no_f64:
        return x.sum(1).to(self.rdev, torch.float64)
    return x.sum(1, dtype=torch.float64)
exp = Path(json.loads((Path(sys.argv[1]) / "world.json").read_text())["experiment"])
print("threads", torch.get_num_threads(), "load", os.getloadavg(), flush=True)
reports = {}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for name, mod, sm in (("before", old, old_sum), ("after", new, new_sum)):
        VocabAccumulator._sum = sm
        from l47.app.bench_common import peak as _peak, reset_peak as _reset_peak, rss as _rss
        h0 = _reset_peak("cpu")
        t0, c0 = time.perf_counter(), time.process_time()
        r = mod.build_sets(exp)
        hp = (_peak("cpu") - h0) / 2**30
        anon = _rss("RssAnon") / 2**30
        print(f"{rep} {name}: wall {time.perf_counter() - t0:.2f} s, CPU {time.process_time() - c0:.2f} s, load "
              f"{os.getloadavg()[0]:.1f}, host peak +{hp:.2f} GiB (RssAnon now {anon:.2f} GiB)", flush=True)
        reports[name] = r.to_json()
print("reports identical:", reports["before"] == reports["after"])
VocabAccumulator._sum = new_sum
pr = cProfile.Profile(); pr.enable(); new.build_sets(exp); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
