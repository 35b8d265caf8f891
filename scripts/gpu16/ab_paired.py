"""CPU paired scoring vs the bare mm of the same work, accumulator row sums before (x.sum(1, dtype=f64)) and after
(cast into a cached f64 block), alternated in one process at real dims (synthetic head, l47/app/bench.py)."""
import os, sys, time, torch
from l47.app.bench import synthetic_weights, REAL
from l47.tail.forward import paired_stats
from l47.tail.stream import VocabAccumulator
new_sum = VocabAccumulator._sum
def old_sum(self, x):
    if self.no_f64:
        return x.sum(1).to(self.rdev, torch.float64)
    return x.sum(1, dtype=torch.float64)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
w = synthetic_weights(REAL, "cpu")
g = torch.Generator().manual_seed(1)
mb = torch.randn(T, 2560, generator=g); mn = mb + 0.01 * torch.randn(T, 2560, generator=g)
tgt = torch.randint(0, REAL["V"], (T,), generator=g)
both = torch.cat([mb, mn])
print("threads", torch.get_num_threads(), "T", T, "load", os.getloadavg(), flush=True)
res = {}
for rep in range(2):
    for name, f in (("before", old_sum), ("after", new_sum)):
        VocabAccumulator._sum = f
        t0 = time.process_time(); torch.mm(both, w.head.T); tmm = time.process_time() - t0
        t0 = time.process_time(); ps = paired_stats(mb, mn, w, tgt, topk=5); tp = time.process_time() - t0
        res.setdefault(name, []).append(ps)
        print(f"{rep} {name}: bare mm [2T,n]x[n,V] {tmm:.2f} CPU-s, paired {tp:.2f} CPU-s, ratio {tmm / tp:.3f}, load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
a, b = res["before"][0], res["after"][0]
import numpy as np
same = all(np.array_equal(getattr(a.base, k), getattr(b.base, k)) and np.array_equal(getattr(a.new, k), getattr(b.new, k))
           for k in ("lse", "logp_target", "top_ids", "top_logp", "entropy")) and np.array_equal(a.kld, b.kld)
print("paired stats bit-identical:", same)
