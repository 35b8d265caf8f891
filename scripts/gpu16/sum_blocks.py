import time, torch, sys
from l47.tail import stream
from l47.tail.stream import VocabAccumulator
torch.set_num_threads(int(sys.argv[1]))
z = torch.randn(2048, 8192)
acc = VocabAccumulator(2048, "cpu")
def old(x): return x.sum(1, dtype=torch.float64)
ref = old(z)
for rep in range(3):
    for name, blk in (("old", None), ("blk32767", 32767), ("blk131072", 1 << 17)):
        if blk: stream.SUM_BLOCK = blk
        f = old if blk is None else acc._sum
        assert torch.equal(f(z), ref)
        b = 1e9; tot = 0
        for _ in range(5):
            t0 = time.perf_counter(); f(z); d = time.perf_counter() - t0; b = min(b, d); tot += d
        print(sys.argv[1], "threads", name, f"best {b*1e3:.1f} ms mean {tot/5*1e3:.1f} ms")
