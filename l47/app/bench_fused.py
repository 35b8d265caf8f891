"""`l47 bench --device cuda`: the head precisions and the fused reductions (l47.tail.fused), all in one run.

Figures (T positions, paired = base + edited rows [2T, n] against the head [V, n]):
    paired_f32_unfused   the streaming accumulator (f32 GEMM per chunk + torch reductions), positions/s
    paired_f32           f32 GEMM per chunk (cuBLAS) + one Triton reduction kernel per chunk
    single_f32           head_stats the same way
    paired_<split>       split-fp16 (GEMM + reductions in one Triton kernel, logits never stored) and split-bf16
                         (three cuBLAS bf16 GEMMs + the reduction kernel)
    bare_split_fp16      three cuBLAS fp16 GEMMs of [2T, n] × [n, V] (f32 output), the split's GEMM alone
    errors               max |logit − f64| of each precision on the per-run check's rows (the same kernel the run
                         uses); lse / KL / entropy / top-5 of 64 pairs against dense f64 logits; split vs f32 over
                         all T pairs (max |ΔKL|, max |Δ log p(target)|, same top-5 ids)
TF32 off. Ratios are against the bare f32 GEMM of the same run. The kernel sweep (`sweep_split`, `sweep_errors`
over SWEEP) then that whole forward bench in one process: `python -m l47.app.bench --sweep` (l47/app/bench.py
`main`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from l47.app.bench_common import timed
from l47.model.weights import Numerics
from l47.tail import fused, stream
from l47.tail.forward import head_stats, paired_stats


def _timed(fn, reps):
    return timed(fn, "cuda", reps, warmup=True)  # warm-up: compiles the kernels, runs the precision check


def _dense_f64(both: torch.Tensor, head: torch.Tensor, P: int, k: int = 5) -> dict:
    """lse, entropy, KL, top-k of rows [base P; edited P] from dense f64 logits [2P, V] (P small)."""
    z = both.double() @ head.double().T
    ls = torch.log_softmax(z, -1)
    return dict(lse=torch.logsumexp(z, -1), ent=-(ls.exp() * ls).sum(-1),
                kl=(ls[:P].exp() * (ls[:P] - ls[P:])).sum(-1),
                top=torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k])


def _vs_dense(st, ref, P) -> dict:
    return dict(lse=float((st.lse - ref["lse"]).abs().max()), entropy=float((st.entropy - ref["ent"]).abs().max()),
                kl=float((st.kl - ref["kl"]).abs().max()), kl_mean=float(ref["kl"].mean()),
                top5_equal=bool(torch.equal(st.top_i, ref["top"])))


def bench_head_cuda(w, mix_b, mix_n, tgt, chunk: int, reps: int, t_mm2: float) -> dict:
    T = mix_b.shape[0]
    out = {}
    both = torch.cat([mix_b, mix_n])

    def paired(prec):
        ws = dataclasses.replace(w, numerics=Numerics(precision=prec))
        return ws, (lambda: paired_stats(mix_b, mix_n, ws, tgt, topk=5, chunk=chunk))

    stream.FUSED = False
    _, fn = paired("f32")
    out["paired_f32_unfused_s"] = _timed(fn, reps)
    stream.FUSED = True
    res = {}
    for prec in ("f32", "split-fp16", "split-bf16"):
        ws, fn = paired(prec)
        out[f"paired_{prec}_s"] = t = _timed(fn, reps)
        out[f"paired_{prec}_pos_s"] = T / t
        out[f"paired_{prec}_ratio_vs_f32_mm"] = t_mm2 / t
        out[f"max_logit_err_{prec}"] = ws.numerics.err_split if prec != "f32" else None
        out["max_logit_err_f32_check"] = ws.numerics.err_f32 or out.get("max_logit_err_f32_check")
        res[prec] = fn()
    ws = dataclasses.replace(w, numerics=Numerics(precision="f32"))
    out["single_f32_s"] = t = _timed(lambda: head_stats(mix_b, ws, tgt, topk=5, chunk=chunk), reps)
    out["single_f32_pos_s"] = T / t
    # accuracy: 64 pairs against dense f64; split vs f32 over all pairs
    P = 64
    sub = torch.cat([mix_b[:P], mix_n[:P]])
    ref = _dense_f64(sub, w.head, P)
    for prec in ("f32", "split-fp16", "split-bf16"):
        num = Numerics(precision=prec)
        st = stream.stream_head(sub, w.head, num, chunk=chunk, topk=5, entropy=True, pairs=P)
        out[f"vs_f64_{prec}"] = _vs_dense(st, ref, P)
    a, b = res["f32"], res["split-fp16"]
    out["split_fp16_vs_f32"] = dict(
        max_dkl=float(np.abs(a.kld - b.kld).max()), mean_kl=float(a.kld.mean()),
        max_dlogp=float(np.abs(a.base.logp_target - b.base.logp_target).max()),
        same_top5=float((a.base.top_ids == b.base.top_ids).all(1).mean()))
    # the split's GEMM alone (three cuBLAS fp16 GEMMs, f32 out)
    xh, xl, one_x = fused.split_fp16(both)
    hh, hl, one_h = fused.split_fp16(w.head)

    def bare():
        z = fused.split_fp16_logits((xh, xl, one_x), (hh, hl, one_h), 0, hh.shape[0])  # incl. the rescale
        del z

    out["bare_split_fp16_s"] = t = _timed(bare, reps)
    out["bare_split_fp16_pos_s"] = T / t
    out["split_cfg"] = dict(fused.SPLIT_CFG)
    out["reduce_tile"] = [fused.REDUCE_BM, fused.REDUCE_BN]
    return out


def sweep_split(w, mix_b, mix_n, configs: list[dict], reps: int = 3) -> list[dict]:
    """Time the split-fp16 kernel (paired partials over all of V) for each config; errors are recorded per row."""
    both = torch.cat([mix_b, mix_n])
    P = mix_b.shape[0]
    xp, hp = fused.split_fp16(both), fused.split_fp16(w.head)
    fused.available(both)
    rows = []
    for cfg in configs:
        try:
            t = _timed(lambda: fused.split_fp16_partials(xp, hp, P, 5, cfg=cfg), reps)
            rows.append(dict(cfg, s=t, pos_s=P / t))
        except Exception as e:  # noqa: BLE001 - a config that does not compile (registers, shared memory)
            rows.append(dict(cfg, error=repr(e)[:200]))
    return rows


_S = dict(BM=128, BN=128, GROUP=8, num_warps=8, PROMOTE=True, STACK=True)  # 64 pairs a program, one accumulator
SWEEP = [dict(_S, BK=64, num_stages=3, GROUP=4),  # the default (SPLIT_CFG)
         dict(_S, BK=64, num_stages=3, GROUP=8), dict(_S, BK=64, num_stages=3, GROUP=16),
         dict(_S, BK=64, num_stages=3, GROUP=32), dict(_S, BK=64, num_stages=3, GROUP=16, PROMOTE=False),
         dict(BM=128, BN=128, BK=32, GROUP=8, num_warps=8, num_stages=3, PROMOTE=True, STACK=False)]
# split_kernel's configs measured in the 2026-12-04 01:45 UTC run (docs/BENCHMARKS.md): BK 32 at 3 / 4 stages,
# BK 64 at 2, GROUP 4 / 8 / 16, chained; the stacked kernel at BK 32 (3-5 stages) and BK 64 at 2 stages
# STACK (l47/tail/fused_kernels.py split_kernel_stacked): the pairs' base and edited rows share one accumulator, so
# BK 64 fits 3 stages (2 × (2 A tiles of 128 × 64 + 2 B tiles of 64 × 128) fp16 = 192 KiB at 3 stages) and the
# registers hold one [128, 128] f32 accumulator and its block partial instead of two and one
# the first device run's wider sweep (docs/BENCHMARKS.md): BM 32–128, BN 64–256, BK 32/64, 4/8 warps, 3–4 stages;
# BN 256 and BM 128 × BK 64 × 3 stages do not fit the shared memory or run 3–4× slower. BK 64 at 2 stages promotes
# the tensor cores' partial every 64 terms (half the CUDA-core adds of BK 32) and fits the shared memory
# (2 × (4 A tiles of 128 × 64 + 2 B tiles of 64 × 128) fp16 = 192 KiB)


def sweep_errors(w, mix, configs, rows: int = 64) -> list[float]:
    """Max |logit − f64| of the split kernel per config on `rows` rows (the check's measure)."""
    x = mix[:rows]
    ref = x.double() @ w.head.double().T  # [rows, V] f64
    xp, hp = fused.split_fp16(x), fused.split_fp16(w.head)
    errs = []
    for cfg in configs:
        z = torch.empty(rows, w.head.shape[0], device=x.device)
        try:  # STACK: the stacked kernel, as every split pass of a run whose config it is (the check's too)
            fused.split_fp16_partials(xp, hp, 0, 5, z_out=z, cfg=cfg)
            errs.append(float((z.double() - ref).abs().max()))
        except Exception:  # noqa: BLE001
            errs.append(float("nan"))
    e32 = 0.0  # the f32 GEMM's, last: per vocabulary chunk as the per-run check computes it
    for lo in range(0, w.head.shape[0], 16384):
        e32 = max(e32, float(((x @ w.head[lo:lo + 16384].T).double() - ref[:, lo:lo + 16384]).abs().max()))
    errs.append(e32)
    return errs
