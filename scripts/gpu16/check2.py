"""GPU check (perf, issue 16): the fused kernels' top-k with the rolled loop (k = 64) and the unrolled one (k = 5)
against references, and their first-call (compile) times. f32: the unfused accumulator over the same cuBLAS logits
(top ids and values must be equal). split-fp16: the kernel's own logits (z_out) of 64 rows, top-k by torch."""
import json, math, os, time
from pathlib import Path
import torch
from l47.app.bench import synthetic_weights, REAL
from l47.model.weights import Numerics
from l47.tail import stream, fused

OUT = Path(os.environ["OUT"])
torch.backends.cuda.matmul.allow_tf32 = False
sync = torch.cuda.synchronize
w = synthetic_weights(REAL, "cuda")
g = torch.Generator().manual_seed(1)
R = 1000
mix = torch.randn(R, 2560, generator=g).cuda()
mix2 = torch.cat([mix, mix + 0.01 * torch.randn(R, 2560, generator=g).cuda()])
res = {}
for prec in ("f32", "split-fp16"):
    for k in (64, 5):
        for x, pairs in ((mix, 0), (mix2, R)):
            key = f"{prec}_k{k}_{'paired' if pairs else 'single'}"
            num = Numerics(precision=prec)
            sync(); t0 = time.perf_counter()
            st = stream.stream_head(x, w.head, num, chunk=16384, topk=k, entropy=True, pairs=pairs)
            sync(); first = time.perf_counter() - t0
            t0 = time.perf_counter()
            st = stream.stream_head(x, w.head, num, chunk=16384, topk=k, entropy=True, pairs=pairs)
            sync(); again = time.perf_counter() - t0
            r = dict(first_s=first, again_s=again)
            if prec == "f32":
                stream.FUSED = False
                ref = stream.stream_head(x, w.head, num, chunk=16384, topk=k, entropy=True, pairs=pairs)
                stream.FUSED = True
                r["top_i_equal"] = bool(torch.equal(st.top_i, ref.top_i))
                r["top_v_equal"] = bool(torch.equal(st.top_v, ref.top_v))
                r["max_dlse"] = float((st.lse - ref.lse).abs().max())
            res[key] = r
            print(key, r, flush=True)
# split kernel: top-k of its own logits (64 rows, all V)
xs = mix[:64]
num = Numerics(precision="split-fp16", used="split-fp16")
hp = stream._head_parts(w.head, num, "split-fp16")
for k in (64, 5):
    z = torch.empty(64, w.V, device="cuda")
    parts = fused.split_fp16_partials(fused.split_fp16(xs), hp, 0, k, z_out=z)
    lse, tv, ti, ent, kl = fused.combine(parts, k, 0, True)
    rv, ri = stream._topk_lowest_id(z, k)
    res[f"split_kernel_vs_own_logits_k{k}"] = r = dict(top_i_equal=bool(torch.equal(ti, ri)),
                                                       top_v_equal=bool(torch.equal(tv, rv)),
                                                       max_dlse=float((lse - torch.logsumexp(z.double(), 1)).abs().max()))
    print("split kernel k", k, r, flush=True)
(OUT / "check2.json").write_text(json.dumps(res, indent=1))
