"""WFLD benchmark at real dims with synthetic weights and states: 100 events, 2,000 background positions,
200 protected anchors. Wall time and peak memory (CPU: VmHWM; CUDA: max_memory_allocated)."""

from __future__ import annotations

import time

import torch

from l47.bench import REAL, SMALL, _peak, _reset_peak, _sync, synthetic_weights
from l47.solvers.batch import Batch, EventTerms, batch_mix
from l47.solvers.wfld import WfldConfig, solve_wfld


def synthetic_batch(w, P: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    dev = w.device

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dev)

    return Batch(R=rnd(P, w.hc, w.n, std=2.0), inj=rnd(P, w.hc, std=6.0), hh=rnd(P, w.f), sgv=rnd(P),
                 yr=rnd(P, w.n), target=torch.randint(0, w.V, (P,), generator=g).to(dev), doc=("synthetic",) * P,
                 pos=tuple(range(P)))


def bench_wfld(args, console, events: int = 100, background: int = 2000, anchors: int = 200) -> dict:
    dims = REAL if args.real else SMALL
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
    base = _reset_peak(dev)
    _sync(dev)
    t0 = time.perf_counter()
    res = solve_wfld(w, ev, terms, bg, an, WfldConfig(), log=None)
    _sync(dev)
    dt = time.perf_counter() - t0
    peak = _peak(dev) - base
    out = dict(device=dev if not dev.startswith("cuda") else torch.cuda.get_device_name(), dims=dims,
               events=events, background=background, anchors=anchors, wall_s=dt, peak_extra_bytes=peak,
               gn_steps=len(res.iterations), violation=res.violation, residual=res.residual)
    console.print(f"[bold]WFLD[/] on {out['device']}: {events} events, {background} background, {anchors} anchors, "
                  f"dims {dims}: {dt:.1f} s, peak +{peak / 2**30:.2f} GiB above the weights, "
                  f"{len(res.iterations)} GN steps, max violation {res.violation:.2g} nats", highlight=False)
    return out
