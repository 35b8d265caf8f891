"""CPU paired scoring vs the bare matmul of the same work (issue 16 target: paired >= 0.8x bare mm), alternated in
one process at real dims (synthetic head, l47/app/bench.py): `python scripts/gpu16/cpu_ratio.py T THREADS REPS`.
Each rep times torch.mm([2T, n] x [n, V]) and paired_stats(T pairs, top-5, entropy, KL) back to back, on the
process CPU clock (robust to other processes sharing the cores) and the wall clock; prints one line per rep, the
load average, and the median ratios."""
import os, sys, time, statistics
import torch
from l47.app.bench import synthetic_weights, REAL
from l47.tail.forward import paired_stats

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
w = synthetic_weights(REAL, "cpu")
g = torch.Generator().manual_seed(1)
mb = torch.randn(T, REAL["n"], generator=g)
mn = mb + 0.01 * torch.randn(T, REAL["n"], generator=g)
tgt = torch.randint(0, REAL["V"], (T,), generator=g)
both = torch.cat([mb, mn])
print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, T {T}, load {os.getloadavg()}", flush=True)
cpu_r, wall_r = [], []
for rep in range(reps):
    c0, t0 = time.process_time(), time.perf_counter()
    torch.mm(both, w.head.T)
    cmm, wmm = time.process_time() - c0, time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    paired_stats(mb, mn, w, tgt, topk=5)
    cp, wp = time.process_time() - c0, time.perf_counter() - t0
    cpu_r.append(cmm / cp)
    wall_r.append(wmm / wp)
    print(f"rep {rep}: bare mm {cmm:.2f} CPU-s / {wmm:.2f} s wall ({2 * 2 * T * REAL['n'] * REAL['V'] / wmm / 1e9:.1f} "
          f"GFLOP/s); paired {cp:.2f} CPU-s / {wp:.2f} s wall; ratio CPU {cmm / cp:.3f}, wall {wmm / wp:.3f}; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
print(f"median ratio (bare mm / paired): CPU time {statistics.median(cpu_r):.3f}, wall {statistics.median(wall_r):.3f}")
