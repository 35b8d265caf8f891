"""What the benchmarks share (l47/app/bench.py, bench_fused.py, bench_pipeline.py): the synthetic tail weights at
real or small dims, the device clock and the peak-memory counters. Imports no other bench module."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from l47.model.weights import TailWeights

REAL = dict(n=2560, f=640, r=320, hc=4, V=248_320)
SMALL = dict(n=256, f=64, r=32, hc=4, V=8192)


def synthetic_weights(dims: dict, device: str, seed: int = 0) -> TailWeights:
    """Random tail weights of `dims` (n, f, r, hc, V) on `device` (drawn on the CPU: the same values everywhere)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, f, r, hc, V = dims["n"], dims["f"], dims["r"], dims["hc"], dims["V"]

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(device)

    return TailWeights(layer=47, n=n, f=f, hc=hc, r=r, V=V, eps=1e-6, W_sd=rnd(n, f, std=f ** -0.5),
                       onorm=1 + rnd(hc, n, std=0.1), odown=rnd(r, hc * n, std=(hc * n) ** -0.5),
                       oup=rnd(hc * n, r, std=r ** -0.5), head=rnd(V, n, std=n ** -0.5 * 4),
                       target="blk.47.ffn_down_shexp.weight", target_type=8, model_sha256="synthetic",
                       policy="exact", path="synthetic")


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> int:
    """Reset the peak counter and return the current level (CUDA: allocated bytes; CPU: RSS, VmHWM reset)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    return rss()


def rss(key: str = "VmRSS") -> int:
    """This process's /proc/self/status `key` in bytes (0 where there is none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak(device: str) -> int:
    """The peak since the last `reset_peak` (CUDA: max_memory_allocated; CPU: VmHWM), bytes."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return rss("VmHWM")


def timed(fn, device: str, reps: int, warmup: bool = False) -> float:
    """The best wall time of `reps` calls of fn (device synchronised around each); `warmup`: one call first
    (compiles kernels, runs the per-run precision check)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best
