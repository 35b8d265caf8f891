"""Issue 16 on one H200 in one call (perf helper): `python3 scripts/gpu16/run16.py pipe|audit|head`, each part in
its own process. Staged with scripts/gpu16/stage.sh; the call (carry [".perf"]):
    cd .perf && . scripts/gpu16/setup.sh && S=$SECONDS && { timeout 300 python3 scripts/gpu16/run16.py pipe;
    timeout 90 python3 scripts/gpu16/run16.py audit;
    timeout $((560 - SECONDS + S)) python3 scripts/gpu16/run16.py head; } 2>&1 | tee $OUT/log

pipe  the full-size pipeline benchmark (`l47 bench --what pipeline --device cuda`): world set-up timed apart, then
      sets -> solve (WFLD) -> audit with wall / CPU / peak per stage and the solve's and audit's sub-step times in
      the log (bench_pipeline's stage clocks).
audit (only when `pipe` did not reach its audit) the audit alone on the cached world (audit_only)
head  one process, T = 4096, TF32 off: the split-fp16 kernel sweep (time and max logit error of each config against
      f64, beside the f32 GEMM's error), the fastest config whose error is <= 2x the f32 path's made the kernel's
      config, then `l47 bench --device cuda --what forward` (bare f32 GEMMs, exact paired scoring in f32 / split-fp16
      / split-bf16 with the per-run check's errors, single scoring, dense-f64 comparisons) in the same process.

Every part writes $OUT/run16_<part>.json as soon as it has a figure (a later failure or the time limit keeps what
came before); a failing step is recorded with its traceback and the next step still runs."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out16"))
DEV = os.environ.get("RUN16_DEV", "cuda")  # a CPU rehearsal: RUN16_DEV=cpu RUN16_SIZE=reduced
REAL = os.environ.get("RUN16_SIZE", "full") == "full"
T0 = time.time()
res: dict = {}


def log(msg) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


def save(part: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"run16_{part}.json").write_text(json.dumps(res, indent=1, default=str))


def step(part: str, name: str, fn):
    log(f"--- {name}")
    t = time.time()
    try:
        res[name] = fn()
        return res[name]
    except Exception:  # noqa: BLE001 - recorded; the next step still runs
        res[name + "_error"] = traceback.format_exc()
        log(f"{name} FAILED:\n{res[name + '_error']}")
        return None
    finally:
        res.setdefault("step_s", {})[name] = time.time() - t
        save(part)


def env() -> dict:
    import subprocess

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
           "cpus": os.cpu_count(), "load": os.getloadavg(), "python": sys.version.split()[0]}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used,utilization.gpu"
    if DEV == "cuda":
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True)
        out["nvidia_smi"] = r.stdout.strip()
    return out


def pipe() -> None:
    from l47.app.bench_pipeline import bench_pipeline

    step("pipe", "env", env)
    work = Path(os.environ.get("PIPE_WORK", "/tmp/pipe"))
    step("pipe", "pipeline", lambda: bench_pipeline(REAL, DEV, work, log=log))
    step("pipe", "env_after", env)


def audit_only() -> None:
    """Only when `pipe` ended before its audit: time the audit alone on the cached world, with the solve's bundle
    if it was written, else a stand-in bundle (W_sd + 1e-3-relative Gaussian ΔW, re-quantised to Q8_0; its
    figures mean nothing, the scoring work is the audit's)."""
    import torch

    from l47.app.bench_pipeline import FULL, REDUCED, _clock, _set_done, _stage, build_world
    from l47.evals.audit import AuditArgs, run_audit
    from l47.model.gguf_io import open_gguf
    from l47.model.weights import load_tail_weights
    from l47.solvers.bundle import requantize_target, write_bundle

    prev = OUT / "run16_pipe.json"
    p = (json.loads(prev.read_text()).get("pipeline") or {}) if prev.is_file() else {}
    if "audit" in p.get("stages", {}) or str(p.get("error")).startswith("audit"):
        log("audit-only: not needed (the pipeline reached its audit)")
        return
    step("audit", "env", env)
    root = Path(os.environ.get("PIPE_WORK", "/tmp/pipe"))
    world = build_world(root, FULL if REAL else REDUCED, DEV, log=log)  # cached by `pipe`
    model, exp, runs = Path(world["model"]), Path(world["experiment"]), root / "run2"
    runs.mkdir(exist_ok=True)
    bundle = root / "run" / "bundle.gguf"
    if not bundle.is_file():
        bundle = runs / "bundle.gguf"
        g = open_gguf(model)
        w = load_tail_weights(g, policy="strata", device=DEV)
        dW = 1e-3 * w.W_sd.std() * torch.randn(w.W_sd.shape, generator=torch.Generator().manual_seed(0)).to(DEV)
        raw, _ = requantize_target(g, w.target, w.W_sd + dW)
        write_bundle(model, bundle, w.target, raw, {"method": "stand-in", "note": "run16 audit-only"})
        del w
    res["bundle"] = str(bundle)
    stages: dict = {}
    res["stages"] = stages
    clock = _clock(log)
    args = AuditArgs(bundle, model, exp, runs / "audit", ledger=runs / "ledger.jsonl", device=DEV, plots=False)
    step("audit", "audit", lambda: bool(_stage("audit", lambda: run_audit(args, progress=_set_done(clock("audit"))),
                                              DEV, stages, log).passed))


def stacked_vs_split(rows: int = 64) -> dict:
    """The stacked kernel's logits against split_kernel's (same BK 32, promotion every 32 terms) and f64 on `rows`
    rows of the bench's synthetic head: max |Δ| (0 when the tensor cores' sums per logit are the same)."""
    import torch

    from l47.app.bench import REAL, synthetic_weights
    from l47.tail import fused

    w = synthetic_weights(REAL, "cuda")
    x = torch.randn(rows, REAL["n"], generator=torch.Generator().manual_seed(3)).cuda()
    xp, hp = fused.split_fp16(x), fused.split_fp16(w.head)
    fused.available(x)
    out = {}
    for name, st in (("split", False), ("stacked", True)):
        z = torch.empty(rows, w.head.shape[0], device="cuda")
        fused.split_fp16_partials(xp, hp, 0, 5, z_out=z, cfg=dict(BK=32, num_stages=3, STACK=st))
        out[name] = z
    ref = x.double() @ w.head.double().T
    return dict(max_abs_stacked_minus_split=float((out["stacked"] - out["split"]).abs().max()),
                err_split=float((out["split"].double() - ref).abs().max()),
                err_stacked=float((out["stacked"].double() - ref).abs().max()))


def head() -> None:
    from l47.app import bench as bench_fused  # its sweep-then-forward driver moved to l47.app.bench.main

    step("head", "env", env)
    step("head", "stacked_vs_split", stacked_vs_split)
    got = step("head", "bench_fused", lambda: bench_fused.main(["-T", "4096", "--sweep", "--reps", "5",
                                                                "--json", str(OUT / "run16_head_bench.json")]))
    if got is not None:
        res["bench_fused"] = "see run16_head_bench.json"
    step("head", "env_after", env)


if __name__ == "__main__":
    {"pipe": pipe, "audit": audit_only, "head": head}[sys.argv[1]]()
    log("done")
