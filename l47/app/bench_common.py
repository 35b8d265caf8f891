"""What the benchmarks share (l47/app/bench.py, bench_fused.py, bench_pipeline.py): the synthetic tail weights at
real or small dims, synthetic layer-L batches and an FTPO problem on them, the device clock and the peak-memory
counters. Imports no other bench module."""

from __future__ import annotations

import time
from pathlib import Path

from dataclasses import dataclass

import torch

from l47.model.weights import TailWeights
from l47.solvers.batch import Batch, EventTerms, batch_mix, pick_chosen
from l47.solvers.ftpo import FtpoProblem
from l47.tail.forward import head_stats

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


def synthetic_batch(w: TailWeights, P: int, seed: int) -> Batch:
    """P rows of random layer-L states at w's dims and realistic scales (targets uniform over V)."""
    g = torch.Generator().manual_seed(seed)
    dev = w.device

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dev)

    return Batch(R=rnd(P, w.hc, w.n, std=2.0), inj=rnd(P, w.hc, std=6.0), hh=rnd(P, w.f), sgv=rnd(P),
                 yr=rnd(P, w.n), target=torch.randint(0, w.V, (P,), generator=g).to(dev), doc=("synthetic",) * P,
                 pos=tuple(range(P)))


@dataclass(frozen=True)
class FtpoCounts:
    """Rows of a synthetic FTPO problem (a realistic experiment's shape: l47/app/bench_pipeline.py FULL)."""

    events: int = 120
    background: int = 2048
    anchors: int = 96  # collateral anchors of two words, then turn ends (a quarter of them)
    near: int = 32
    dev_events: int = 40
    dev_rows: int = 1024


def synthetic_ftpo_problem(w: TailWeights, c: FtpoCounts = FtpoCounts(), seed: int = 0) -> FtpoProblem:
    """An FTPO problem on random states: each event's rejected token is its base argmax (p well above chance), its
    chosen the runner-up, the last 5 ids special, two phrases; budget 0.01 nats, target residual 0.2."""
    ev, bg = synthetic_batch(w, c.events, seed + 1), synthetic_batch(w, c.background, seed + 2)
    special = list(range(w.V - 5, w.V))
    with torch.no_grad():
        top = torch.as_tensor(head_stats(batch_mix(ev, w), w, ev.target.cpu().numpy(), topk=1).top_ids[:, 0])
    rej = top.to(w.device)
    terms = EventTerms(rejected=rej, chosen=pick_chosen(ev, w, rej, special), special=torch.tensor(special,
                                                                                                   device=w.device),
                       scale=torch.ones(c.events, device=w.device))
    n_te = c.anchors // 4
    an = synthetic_batch(w, c.anchors, seed + 3)
    dev = synthetic_batch(w, c.dev_events, seed + 4)
    with torch.no_grad():
        dev_final = torch.as_tensor(head_stats(batch_mix(dev, w), w, dev.target.cpu().numpy(), topk=1).top_ids[:, 0],
                                    device=w.device)
    half = (c.anchors - n_te) // 2
    return FtpoProblem(
        events=ev, terms=terms, phrase=["a" if i % 2 else "b" for i in range(c.events)], background=bg,
        target_residual=0.2, kl_budget=0.01, anchors=an,
        anchor_group=["w1"] * half + ["w2"] * (c.anchors - n_te - half) + ["<|im_end|>"] * n_te,
        anchor_tol=[0.02] * (c.anchors - n_te) + [0.005] * n_te, turn_ends=n_te,
        near=synthetic_batch(w, c.near, seed + 5), near_banned=torch.randint(0, w.V, (c.near,)).to(w.device),
        dev=dev, dev_final=dev_final, dev_phrase=["a" if i % 2 else "b" for i in range(c.dev_events)],
        dev_rows=synthetic_batch(w, c.dev_rows, seed + 6), im_end=w.V - 1, special_tol=1e-3)


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
