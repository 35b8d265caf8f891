"""The split-fp16 kernels (l47/tail/fused_kernels.py) on the CPU through Triton's interpreter, against the torch
reference producer (fused.torch_partials of fused.split_fp16_logits) at small sizes — a check before a GPU call:
    pip install --target DIR triton==3.6.0  (the device image's version; not a project dependency)
    TRITON_INTERPRET=1 PYTHONPATH=DIR OMP_NUM_THREADS=1 python scripts/gpu16/interp_check.py
(with numpy 2, Triton 3.6's interpreter needs `int(self.handle.data)` in triton/runtime/interpreter.py read as
`int(self.handle.data.reshape(-1)[0])`). Each config: paired partials folded by fused.combine (lse, top-5 values
and ids, entropy, KL), the logits written by the stacked kernel for every row, and a single pass of an odd row
count; prints the max differences (fp16 products are exact in f32, so what differs is the order of f32 sums:
~1e-5 at these sizes) and exits 1 when one exceeds 1e-4 or a top-5 id differs."""
import sys

import torch

from l47.tail import fused

CFGS = [dict(fused.SPLIT_CFG),  # the default (BK 64; a head of width 96 takes SPLIT_BK_MIN)
        dict(BM=32, BN=64, BK=32, GROUP=2, num_warps=4, num_stages=2, PROMOTE=True, STACK=False),
        dict(BM=32, BN=64, BK=32, GROUP=2, num_warps=4, num_stages=2, PROMOTE=True, STACK=True),
        dict(BM=64, BN=64, BK=64, GROUP=8, num_warps=4, num_stages=3, PROMOTE=True, STACK=True),
        dict(BM=64, BN=64, BK=32, GROUP=8, num_warps=4, num_stages=2, PROMOTE=False, STACK=True)]


def main() -> int:
    fused._build()
    return max(check(n) for n in (128, 96))


def check(n: int) -> int:
    g = torch.Generator().manual_seed(0)
    P, V, k = 40, 520, 5  # P and V not multiples of the tiles: partial row blocks and a partial last tile
    head = torch.randn(V, n, generator=g) * 0.5
    mb = torch.randn(P, n, generator=g)
    both = torch.cat([mb, mb + 0.05 * torch.randn(P, n, generator=g)])
    xp, hp = fused.split_fp16(both), fused.split_fp16(head)
    z = fused.split_fp16_logits(xp, hp, 0, V)  # [2P, V] the torch reference's logits
    bad = 0
    for cfg in CFGS:
        got = fused.combine(fused.split_fp16_partials(xp, hp, P, k, cfg=cfg), k, P, True)
        ref = fused.combine(fused.torch_partials(z, P, cfg["BN"], k), k, P, True)
        d = {name: float((a - b).abs().max()) for name, a, b in zip(("lse", "top_v", "top_i", "ent", "kl"), got, ref)
             if name != "top_i"}
        same = torch.equal(got[2], ref[2])
        zo = torch.full((2 * P - 1, V), float("nan"))  # single pass, odd row count, logits written
        one = fused.combine(fused.split_fp16_partials(fused.split_fp16(both[:-1]), hp, 0, k, z_out=zo, cfg=cfg), k, 0,
                            True)
        ro = fused.combine(fused.torch_partials(z[:-1], 0, cfg["BN"], k), k, 0, True)
        d["single_lse"] = float((one[0] - ro[0]).abs().max())
        d["z_out"] = float((zo - z[:-1]).abs().max()) if cfg["STACK"] else float((zo[:P] - z[:P]).abs().max())
        same = same and torch.equal(one[2], ro[2])
        bad += (not same) or max(d.values()) > 1e-4 or d["z_out"] != d["z_out"]
        print(n, cfg, {k2: f"{v:.2g}" for k2, v in d.items()}, "top-5 ids equal" if same else "TOP-5 IDS DIFFER",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
