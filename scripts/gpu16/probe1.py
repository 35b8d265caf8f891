"""GPU probe 1 (perf, issue 16): head passes at R = 1000 rows with top-k 1/5/64 (what `l47 sets` asks: 64 for
the sampler guard), dump I/O of one real-size dump, and a small full-dims pipeline with every stage profiled."""
import json, math, os, sys, time
from pathlib import Path
import numpy as np
import torch

OUT = Path(os.environ["OUT"])
res = {}
def log(*a):
    print(*a, flush=True)
def save():
    (OUT / ("probe1_" + "_".join(sys.argv[1:]) + ".json")).write_text(json.dumps(res, indent=1, default=str))

torch.backends.cuda.matmul.allow_tf32 = False
from l47.app.bench import synthetic_weights, REAL
from l47.model.weights import Numerics
from l47.tail import stream
sync = torch.cuda.synchronize

def timed(fn, reps=3):
    sync(); t0 = time.perf_counter(); fn(); sync(); first = time.perf_counter() - t0
    best = math.inf
    for _ in range(reps):
        sync(); t0 = time.perf_counter(); fn(); sync(); best = min(best, time.perf_counter() - t0)
    return first, best

if "micro" in sys.argv:
    w = synthetic_weights(REAL, "cuda")
    g = torch.Generator().manual_seed(1)
    R = 1000
    mix = torch.randn(R, 2560, generator=g).cuda()
    mix2 = torch.cat([mix, mix + 0.01 * torch.randn(R, 2560, generator=g).cuda()])
    for fusedflag in (True, False):
        stream.FUSED = fusedflag
        for prec in ("split-fp16", "f32"):
            if prec == "split-fp16" and not fusedflag:
                continue
            num = Numerics(precision=prec)
            for k in (1, 5, 64):
                for x, pairs in ((mix, 0), (mix2, R)):
                    key = f"{'fused' if fusedflag else 'unfused'}_{prec}_k{k}_{'paired' if pairs else 'single'}"
                    first, best = timed(lambda: stream.stream_head(x, w.head, num, chunk=16384, topk=k,
                                                                   entropy=True, pairs=pairs))
                    res[key] = dict(first_s=first, best_s=best, rows=x.shape[0])
                    log(key, f"first {first:.3f} s best {best:.4f} s")
                    save()
    stream.FUSED = True
    # dump I/O of one real-size 1,000-position dump (page cache warm)
    from l47.testing.synth import synth_dump_arrays, SynthDims
    from l47.dumps import DumpMeta, write_dump, read_dump, doc_hash
    from l47.tail.forward import dump_tensors
    from l47.model import names
    d = SynthDims(n=2560, f=640, r=320, hc=4, V=248_320, n_layers=48)
    a = synth_dump_arrays(d, 1000, seed=3)
    meta = DumpMeta(schema_version=1, doc_id="probe", layer=47, n=2560, f=640, hc=4, r=320, V=248_320, model="x" * 64,
                    engine={"name": "synthetic", "version": "probe", "settings": {}}, inj_convention="raw",
                    hh_precision="f32", provenance={names.ROLES[int(c)]: "written" for c in np.unique(a["role"])},
                    text="probe")
    p = write_dump(Path("/tmp/probe_dump.safetensors"), a, meta)
    for name, fn in (("read_validate", lambda: read_dump(p)), ("read_novalidate", lambda: read_dump(p, validate=False)),
                     ("file_sha256", lambda: doc_hash(p)),
                     ("to_cuda", lambda: dump_tensors(read_dump(p, validate=False), "cuda"))):
        first, best = timed(fn)
        res[f"io_{name}"] = dict(first_s=first, best_s=best, bytes=p.stat().st_size)
        log("io", name, f"first {first:.3f} best {best:.4f} s ({p.stat().st_size / 2**20:.1f} MiB)")
    save()
    del w, mix, mix2
    torch.cuda.empty_cache()

if "pipe" in sys.argv:
    import l47.app.bench_pipeline as bp
    from l47.testing.synth import SynthDims
    n_docs = int(os.environ.get("PROBE_POOL", "12"))
    dev = os.environ.get("PROBE_DEV", "cuda")
    if dev == "cuda":
        bp.FULL = bp.PipelineSize("probe", SynthDims(n=2560, f=640, r=320, hc=4, V=248_320, n_layers=4), tokens=1000,
                                  pool=n_docs, collateral=4, background=2, kld=1, chat_heldout=2, events_per_doc=3,
                                  collateral_min_total=20)
    else:  # a local smoke test of this script
        from dataclasses import replace
        bp.FULL = replace(bp.REDUCED, pool=n_docs)
    from prof_pipe import profile_stages  # scripts/gpu16/prof_pipe.py (this script's folder is on sys.path)

    profile_stages(bp, OUT, callers="read_dump|validate_dump|doc_hash")
    t0 = time.perf_counter()
    r = bp.bench_pipeline(True, dev, Path(os.environ.get("PROBE_WORK", "/tmp/pipe-probe")), log=log)
    res["pipe"] = r
    res["pipe_wall"] = time.perf_counter() - t0
    save()
    log(json.dumps({k: r[k] for k in ("stages", "world", "events", "error")}, default=str)[:3000])
