"""`l47 bench`: throughput and peak memory of the exact tail forward at real dims, with synthetic weights.

Figures (all measured in the same run, so ratios are meaningful):
    bare_mm      one torch.mm of the same shapes as the scoring's head work ([2T, n] × [n, V] for paired), f32
    single       head_stats over T positions (lse, log p(target), argmax, top-k, entropy), positions/s
    paired       paired_stats (base + edited, KL, Δlog p, same-top) over T positions, positions/s
    ratio        paired throughput / bare-mm throughput (same FLOPs: target ≥ 0.6)
    peak memory  above the resident dequantised head (CPU: VmHWM; CUDA: max_memory_allocated)
    CUDA         the head precisions and the fused reductions, all in the same run (l47/app/bench_fused.py)
Shared helpers (synthetic weights, clock, peak memory): l47/app/bench_common.py. `python -m l47.app.bench --sweep`:
the split-fp16 kernel sweep, then the forward figures in the same process (`main`).
TF32 is disabled on CUDA: every f32 figure is exact f32.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict as dataclasses_asdict
from dataclasses import dataclass
from pathlib import Path

import torch

from l47.app.bench_common import (REAL, SMALL, FtpoCounts, peak, reset_peak, sync, synthetic_batch,
                                  synthetic_ftpo_problem, synthetic_weights, timed)
from l47.app.bench_fused import SWEEP, bench_head_cuda, sweep_errors, sweep_split
from l47.app.bench_pipeline import SIZES, bench_pipeline, print_pipeline
from l47.errors import L47Error
from l47.fileio import write_text_atomic
from l47.model.weights import Numerics
from l47.solvers.batch import EventTerms, batch_mix
from l47.solvers.estimate import SolveShape, estimate_ftpo, measure_units
from l47.solvers.ftpo import FtpoConfig, step_parts, train_ftpo
from l47.solvers.wfld import WfldConfig, solve_wfld
from l47.tail import fused, stream
from l47.tail.forward import DEFAULT_CHUNK, head_stats, paired_stats


@dataclass(frozen=True)
class BenchArgs:
    real: bool = True
    T: int = 1024
    device: str = "cpu"
    reps: int = 2
    what: str = "forward"
    json_out: Path | None = None
    chunk: int | None = None
    work: Path | None = None  # --what pipeline: folder for the synthetic model and dumps (kept, reused)
    method: str | None = None  # --what pipeline: the solve method (None: the toolkit's default)
    dims: str | None = None  # full | reduced | tiny (pipeline: bench_pipeline.SIZES; else REAL / SMALL) | n,f,r,hc,V
    # (forward, wfld, ftpo); None: from `real`


def _dims(args: BenchArgs) -> dict:
    """The tail dims of a forward / WFLD / FTPO bench: --dims full | reduced | tiny | n,f,r,hc,V, else --real."""
    if args.dims is None:
        return REAL if args.real else SMALL
    if args.dims in SIZES:
        return REAL if args.dims == "full" else SMALL
    try:
        n, f, r, hc, V = (int(x) for x in args.dims.split(","))
    except ValueError:
        raise L47Error("l47 bench", "--dims", "full, reduced, tiny or n,f,r,hc,V (five integers)", repr(args.dims))
    return dict(n=n, f=f, r=r, hc=hc, V=V)



def bench_forward(args: BenchArgs) -> dict:
    dims = _dims(args)
    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    chunk = args.chunk or (16384 if dev.startswith("cuda") else DEFAULT_CHUNK)
    w = synthetic_weights(dims, dev)
    T, n, V = args.T, dims["n"], dims["V"]
    g = torch.Generator(device="cpu").manual_seed(1)
    mix_b = (torch.randn(T, n, generator=g)).to(dev)
    mix_n = mix_b + 0.01 * torch.randn(T, n, generator=g).to(dev)
    tgt = torch.randint(0, V, (T,), generator=g)
    head_bytes = w.head.numel() * 4
    base_mem = reset_peak(dev)
    t_paired = timed(lambda: paired_stats(mix_b, mix_n, w, tgt, topk=5, chunk=chunk), dev, args.reps)
    peak_paired = peak(dev) - base_mem
    base_mem = reset_peak(dev)
    t_single = timed(lambda: head_stats(mix_b, w, tgt, topk=5, chunk=chunk), dev, args.reps)
    peak_single = peak(dev) - base_mem
    both = torch.cat([mix_b, mix_n], 0)
    t_mm1 = timed(lambda: torch.mm(mix_b, w.head.T), dev, args.reps)
    t_mm2 = timed(lambda: torch.mm(both, w.head.T), dev, args.reps)
    flops1 = 2.0 * T * n * V
    split = {}
    if dev.startswith("cuda"):
        split = bench_head_cuda(w, mix_b, mix_n, tgt, chunk, args.reps, t_mm2)
    return split | dict(
        device=dev if not dev.startswith("cuda") else torch.cuda.get_device_name(),
        torch=torch.__version__, threads=torch.get_num_threads(), dims=dims, T=T, chunk=chunk,
        bare_mm_s=t_mm1, bare_mm_gflops=flops1 / t_mm1 / 1e9, bare_mm_pos_s=T / t_mm1,
        bare_mm_2T_s=t_mm2, bare_mm_2T_pos_s=T / t_mm2,
        single_s=t_single, single_pos_s=T / t_single, single_ratio_vs_mm=t_mm1 / t_single,
        paired_s=t_paired, paired_pos_s=T / t_paired, paired_ratio_vs_mm=t_mm2 / t_paired,
        head_bytes=head_bytes, peak_extra_bytes_paired=peak_paired, peak_extra_bytes_single=peak_single,
    )


def run_bench(args: BenchArgs, console) -> dict:
    out = {}
    if args.what in ("forward", "all"):
        out["forward"] = r = bench_forward(args)
        console.print(
            f"[bold]tail forward[/] on {r['device']} ({r['threads']} threads), dims {r['dims']}, T = {r['T']}, "
            f"chunk {r['chunk']}\n"
            f"  bare mm \\[T,n]x\\[n,V]   {r['bare_mm_s']:.3f} s  {r['bare_mm_gflops']:.1f} GFLOP/s  "
            f"{r['bare_mm_pos_s']:.1f} pos/s\n"
            f"  single scoring        {r['single_s']:.3f} s  {r['single_pos_s']:.1f} pos/s  "
            f"({r['single_ratio_vs_mm']:.2f}x bare mm)\n"
            f"  paired scoring        {r['paired_s']:.3f} s  {r['paired_pos_s']:.1f} pos/s  "
            f"({r['paired_ratio_vs_mm']:.2f}x bare mm of \\[2T,n]x\\[n,V])\n"
            f"  peak memory above the resident head ({r['head_bytes'] / 2**30:.2f} GiB): paired "
            f"{r['peak_extra_bytes_paired'] / 2**30:.3f} GiB, single {r['peak_extra_bytes_single'] / 2**30:.3f} GiB",
            highlight=False)
        if "paired_split-fp16_s" in r:
            e32 = r["max_logit_err_f32_check"]
            for p in ("f32", "split-fp16", "split-bf16"):
                err = e32 if p == "f32" else r[f"max_logit_err_{p}"]
                console.print(
                    f"  fused paired {p:<10} {r[f'paired_{p}_s']:.4f} s  {r[f'paired_{p}_pos_s']:.1f} pos/s  "
                    f"({r[f'paired_{p}_ratio_vs_f32_mm']:.2f}x bare f32 mm)  max |logit error| vs f64 {err:.3g}  "
                    f"vs dense f64 on 64 pairs {r[f'vs_f64_{p}']}", highlight=False)
            console.print(f"  paired f32 unfused {r['paired_f32_unfused_s']:.4f} s; single f32 fused "
                          f"{r['single_f32_pos_s']:.1f} pos/s; bare split-fp16 GEMM {r['bare_split_fp16_pos_s']:.1f} "
                          f"pos/s; split-fp16 vs f32 {r['split_fp16_vs_f32']}", highlight=False)
    if args.what in ("wfld", "all"):
        out["wfld"] = bench_wfld(args, console)
    if args.what == "pipeline":
        size = args.dims or ("full" if args.real else "reduced")
        if size not in SIZES:
            raise L47Error("l47 bench --what pipeline", "--dims", f"one of {tuple(SIZES)}", repr(size))
        out["pipeline"] = r = bench_pipeline(SIZES[size], args.device,
                                             args.work, log=lambda m: console.print(m, highlight=False),
                                             method=args.method)
        print_pipeline(r, console)
    if args.what == "ftpo":
        out["ftpo"] = r = bench_ftpo(_dims(args), args.device, steps=args.reps + 1)
        print_ftpo(r, console)
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(out, indent=2))
    if (out.get("pipeline") or {}).get("error"):
        raise L47Error("l47 bench --what pipeline", "stage", "every stage to finish", out["pipeline"]["error"])
    return out


# WFLD at real dims with synthetic weights and states: 100 events, 2,000 background positions, 200 protected
# anchors. Wall time and peak memory (CPU: VmHWM; CUDA: max_memory_allocated).


def bench_wfld(args, console, events: int = 100, background: int = 2000, anchors: int = 200) -> dict:
    dims = _dims(args)
    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    w = synthetic_weights(dims, dev)
    anchors = min(anchors, w.f // 4)
    events = min(events, w.f // 4)
    ev, bg, an = synthetic_batch(w, events, 1), synthetic_batch(w, background, 2), synthetic_batch(w, anchors, 3)
    with torch.no_grad():
        top = torch.topk(batch_mix(ev, w) @ w.head.T, 2, -1).indices  # at real dims: [100, V] is small
    special = torch.arange(w.V - 5, w.V, device=dev)
    terms = EventTerms(rejected=top[:, 0], chosen=top[:, 1:2], special=special,
                       scale=torch.ones(events, device=dev))
    base = reset_peak(dev)
    sync(dev)
    t0 = time.perf_counter()
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(), log=None)
    sync(dev)
    dt = time.perf_counter() - t0
    held = peak(dev) - base
    out = dict(device=dev if not dev.startswith("cuda") else torch.cuda.get_device_name(), dims=dims,
               events=events, background=background, anchors=anchors, wall_s=dt, peak_extra_bytes=held,
               gn_steps=len(res.iterations), violation=res.violation, residual=res.residual)
    console.print(f"[bold]WFLD[/] on {out['device']}: {events} events, {background} background, {anchors} anchors, "
                  f"dims {dims}: {dt:.1f} s, peak +{held / 2**30:.2f} GiB above the weights, "
                  f"{len(res.iterations)} GN steps, max violation {res.violation:.2g} nats", highlight=False)
    return out


# FTPO: a handful of steps of the trainer's own objective and judge on a synthetic problem, each part timed, beside
# the solve-time estimator's figures for the same problem on the same machine (solvers/estimate.py).


def _now(dev: str) -> float:
    sync(dev)
    return time.perf_counter()


def ftpo_trainer_step(w, pb, cfg, steps: int) -> dict:
    """The real trainer (train_ftpo) for `steps` steps: seconds per step from its progress reports (the wall time
    between its first and last exact evaluations ÷ the steps between them: every part, the judge amortised)."""
    import dataclasses

    seen: list[dict] = []
    res = train_ftpo(w, pb, dataclasses.replace(cfg, steps=steps), progress=seen.append)
    a, b = seen[0], seen[-1]
    return {"per_step_s": (b["elapsed_s"] - a["elapsed_s"]) / max(b["step"] - a["step"], 1),
            "evaluations": len(seen), "steps": b["step"], "stopped": res.stopped, "setup_s": a["elapsed_s"]}


def bench_ftpo(dims: dict, device: str, counts=None, steps: int = 3, trainer_steps: int = 0) -> dict:
    """FTPO's step at `dims` on synthetic weights (bench_common.synthetic_ftpo_problem): the parts measured
    (solvers.ftpo.step_parts), the estimator's parts for the same problem and machine, and with trainer_steps > 0 the
    real trainer's per-step time."""
    import dataclasses

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    w = dataclasses.replace(synthetic_weights(dims, device), numerics=Numerics(precision="auto"))  # as `l47 solve`
    c = counts or FtpoCounts()
    pb = synthetic_ftpo_problem(w, c)
    cfg = FtpoConfig()
    base = reset_peak(device)
    parts = step_parts(w, pb, cfg, steps, clock=lambda: _now(str(w.device)))
    held = peak(device) - base
    units = measure_units(w)
    shape = SolveShape(V=w.V, events=c.events, background=c.background, anchors=c.anchors, turn_ends=c.anchors // 4,
                       near=c.near, dev_events=c.dev_events, dev_rows=c.dev_rows)
    est = estimate_ftpo(shape, cfg, units)
    out = {"device": units.device, "threads": units.threads, "precision": units.precision, "dims": dims,
           "counts": dataclasses_asdict(c), "measured": parts, "estimate": {"per_step": est.per_step,
                                                                             "setup_s": est.setup_s},
           "units": dataclasses_asdict(units), "peak_extra_bytes": held, "head_bytes": w.head.numel() * 4}
    if trainer_steps:
        out["trainer"] = ftpo_trainer_step(w, pb, cfg, trainer_steps)
    return out


def print_ftpo(r: dict, console) -> None:
    m, e = r["measured"]["per_step"], r["estimate"]["per_step"]
    console.print(f"[bold]FTPO step[/] on {r['device']} ({r['threads']} threads, head {r['precision']}), dims "
                  f"{r['dims']}, rows {r['counts']}: setup {r['measured']['setup_s']:.1f} s, peak "
                  f"+{r['peak_extra_bytes'] / 2**30:.2f} GiB above the head ({r['head_bytes'] / 2**30:.2f} GiB)",
                  highlight=False)
    for k in ("forward", "kl", "backward", "judge"):
        console.print(f"  {k:<9} measured {m[k]:8.3f} s/step   estimator {e[k]:8.3f} s/step", highlight=False)
    console.print(f"  total     measured {sum(m.values()):8.3f} s/step   estimator {sum(e.values()):8.3f} s/step "
                  f"(judge: one exact evaluation {r['measured']['judge_eval_s']:.2f} s, every eval_every steps)",
                  highlight=False)
    if "trainer" in r:
        t = r["trainer"]
        console.print(f"  train_ftpo: {t['per_step_s']:.3f} s/step over {t['steps']} steps ({t['evaluations']} "
                      f"evaluations)", highlight=False)


def main(argv=None) -> dict:
    """python -m l47.app.bench [-T 4096] [--json FILE] [--sweep]: the kernel sweep (split-fp16 configs, time and
    error; l47/app/bench_fused.py), the best config kept, then `l47 bench --device cuda --what forward` in the
    same process."""
    import argparse

    from rich.console import Console

    ap = argparse.ArgumentParser()
    ap.add_argument("-T", type=int, default=4096)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    if a.sweep:
        w = synthetic_weights(REAL, "cuda")
        g = torch.Generator(device="cpu").manual_seed(1)
        mix_b = torch.randn(a.T, REAL["n"], generator=g).cuda()
        mix_n = mix_b + 0.01 * torch.randn(a.T, REAL["n"], generator=g).cuda()
        rows = sweep_split(w, mix_b, mix_n, SWEEP)
        errs = sweep_errors(w, mix_b, SWEEP)
        for r, e in zip(rows, errs):
            r["max_logit_err"] = e
        out["sweep"] = dict(rows=rows, err_f32=errs[-1])
        for r in rows:
            print(r, flush=True)
        ok = [r for r in rows if "s" in r and r["max_logit_err"] <= stream.SPLIT_MAX_RATIO * errs[-1]]
        if ok:  # the fastest within the per-run check's error rule; none: the default config stays
            best = min(ok, key=lambda r: r["s"])
            fused.SPLIT_CFG.update(dict(STACK=False) | {k: best[k] for k in best if k in fused.SPLIT_CFG})
        print("best", fused.SPLIT_CFG, "f32 err", errs[-1], flush=True)
        out["sweep"]["chosen"] = dict(fused.SPLIT_CFG)
        save()
        del w, mix_b, mix_n
        torch.cuda.empty_cache()
    out.update(run_bench(BenchArgs(T=a.T, device="cuda", reps=a.reps, what="forward"), Console(width=200)))
    save()
    return out


if __name__ == "__main__":
    main()
