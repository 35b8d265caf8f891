"""Fuzz the readers users hand files to: a dump (safetensors), a GGUF, an experiment TOML and a JSONL document file.

Each input is a valid seed file mutated (byte flips, truncations, inserted / deleted / duplicated spans, absurd
length fields, header structure edits, deeply nested JSON / TOML) and read IN PROCESS by the reader the CLI uses:

    dump        l47.dumps.read_dump (full validation), then every array touched
    gguf        l47.model.gguf_io.open_gguf, then every tensor's bytes touched (their size checked)
    experiment  l47.data.experiment.load_experiment (files checked: the seed dump and GGUF lie beside it)
    jsonl       l47.dumps.chat.read_documents (bad records are collected as errors: a clean refusal)

Every input must give a clean refusal (L47Error, or a JSONL document set whose bad records are L47Errors) or a read;
anything else (another exception, a read that exceeds the per-input time limit) is a crash, counted by exception
type, the first inputs of each kind saved with --save. The seed files are built here (l47.testing.synth), so a run
depends only on --seed.

    python scripts/fuzz_readers.py --inputs 250000 --workers 16 --seed 0 --json figures.json --save crashes/

--inputs is per reader; the workers split it (worker w uses the seed (seed, w)); figures: inputs, refusals, reads,
crashes and hangs per reader, inputs/s, the command and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

READERS = ("dump", "gguf", "experiment", "jsonl")
ABSURD = (0, 1, 7, 255, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


class Hang(BaseException):
    """The per-input time limit passed (raised by SIGALRM; a BaseException so no reader's handler swallows it)."""


def _alarm(signum, frame):  # noqa: ARG001
    raise Hang()


# --- the seed files -----------------------------------------------------------------------------------------


def build_seeds(folder: Path) -> dict[str, Path]:
    """A small synthetic GGUF (with a tiny byte-level vocabulary), a dump of it, an experiment naming both and a
    JSONL file of a plain and a chat document."""
    import numpy as np

    from l47.dumps import DumpMeta, write_dump
    from l47.model import names
    from l47.testing.synth import SynthDims, synth_dump_arrays, write_synth_gguf

    import warnings

    dims = SynthDims(n=64, f=32, r=32, hc=2, V=64, n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the head is Q8_0: n = 64 is not a multiple of Q6_K's 256
        gguf = write_synth_gguf(folder / "base.gguf", dims, seed=1, unknown_type_tensor=False)
    from l47.model.gguf_io import open_gguf

    sha = open_gguf(gguf).sha256()
    T = 6
    a = synth_dump_arrays(dims, T, seed=2)
    a["tokens"] = np.asarray(a["tokens"] % dims.V, dtype=np.int32)
    a["role"] = np.full(T, names.ROLE_ID["assistant"], dtype=np.uint8)
    L = dims.n_layers - 1
    meta = DumpMeta(schema_version=1, doc_id="seed", layer=L, n=dims.n, f=dims.f, hc=dims.hc, r=dims.r, V=dims.V,
                    model=sha, engine={"name": "synthetic", "version": "0", "settings": {}}, inj_convention="raw",
                    hh_precision="f32", provenance={"assistant": "written"}, text="the seed document")
    dump = write_dump(folder / "seed.safetensors", a, meta)
    exp = folder / "seed.toml"
    exp.write_text('name = "fuzz"\nmodel = "base.gguf"\nvocab = "gguf"\npolicy = "strata"\n\n'
                   '[sets]\ncollateral_eval = ["seed.safetensors"]\nbackground = ["seed.safetensors"]\n\n'
                   '[split]\npool = ["seed*.safetensors"]\nseed = 0\n\n'
                   '[[phrases]]\ntext = "rather than"\n\n[[phrases]]\ntext = "end to end"\n\n'
                   '[collateral]\nwords = [" than", " end"]\n\n'
                   '[thresholds]\nmin_heldout_per_phrase = 1\ncollateral_min_total = 1\n', encoding="utf-8")
    jsonl = folder / "seed.jsonl"
    jsonl.write_text(json.dumps({"id": "p", "text": "Rather than guess, we measured it end to end."}) + "\n"
                     + json.dumps({"id": "c", "messages": [{"role": "user", "content": "How long?"},
                                                           {"role": "assistant", "content": "<think>\nx\n</think>\n\n"
                                                            "Seven minutes."}]}) + "\n", encoding="utf-8")
    return {"dump": dump, "gguf": gguf, "experiment": exp, "jsonl": jsonl}


# --- mutators (each: rng, bytes -> bytes) -------------------------------------------------------------------


def _flip(rng: random.Random, b: bytes) -> bytes:
    x = bytearray(b)
    for _ in range(rng.choice((1, 1, 2, 4, 8, 32))):
        if x:
            i = rng.randrange(len(x))
            x[i] ^= rng.randrange(1, 256)
    return bytes(x)


def _flip_head(rng: random.Random, b: bytes) -> bytes:
    """Flips in the first KiB (where the headers are)."""
    x = bytearray(b)
    for _ in range(rng.choice((1, 2, 4))):
        i = rng.randrange(min(len(x), 1024)) if x else 0
        if x:
            x[i] ^= rng.randrange(1, 256)
    return bytes(x)


def _truncate(rng: random.Random, b: bytes) -> bytes:
    return b[: rng.randrange(len(b))] if b else b


def _splice(rng: random.Random, b: bytes) -> bytes:
    """Insert random bytes, delete a span or duplicate one."""
    if not b:
        return bytes(rng.randrange(256) for _ in range(8))
    i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
    op = rng.randrange(3)
    if op == 0:
        return b[:i] + bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 64)))) + b[i:]
    if op == 1:
        return b[:i] + b[j:]
    return b[:j] + b[i:j] + b[j:]


def _length_field(rng: random.Random, b: bytes, limit: int | None = None) -> bytes:
    """An absurd value written over a u64 / u32 that holds a small number (a string length, an array count, a
    dimension, a type id, a header length) in the first `limit` bytes."""
    import numpy as np

    x = bytearray(b)
    end = min(len(x), limit or len(x))
    if end < 8:
        return _flip(rng, b)
    u = np.frombuffer(bytes(x[:end]), dtype=np.uint8)
    win = np.lib.stride_tricks.sliding_window_view(u, 8).copy().view("<u8")[:, 0]  # [end-7] u64 at every offset
    cands = np.flatnonzero((win > 0) & (win < 1 << 20))
    if not len(cands):
        return _flip(rng, b)
    o = int(cands[rng.randrange(len(cands))])
    if rng.random() < 0.7:
        struct.pack_into("<Q", x, o, rng.choice(ABSURD))
    else:
        struct.pack_into("<I", x, o, rng.choice(ABSURD) & 0xFFFFFFFF)
    return bytes(x)


def _deep(rng: random.Random, kind: str) -> str:
    n = rng.choice((100, 1000, 5000, 50_000, 200_000))
    if kind == "list":
        return "[" * n + "]" * n
    if kind == "obj":
        return '{"a":' * n + "1" + "}" * n
    return "[" * n  # unclosed


def _json_value(rng: random.Random):
    return rng.choice((None, True, -1, 0, 2**64, 1e308, -0.0, "", "x" * rng.choice((1, 10_000)), [], {}, [1, "a"],
                       {"a": {"b": []}}, "\u0000", "\ud800" if False else "\u200b", 3.5))


def _edit_json(rng: random.Random, obj):
    """One structural edit at a random place of a JSON value: delete / add a key, change a value's type, an
    absurd number, swap list items."""
    path = []
    cur = obj
    while isinstance(cur, (dict, list)) and cur and rng.random() < 0.7:
        k = rng.choice(list(cur)) if isinstance(cur, dict) else rng.randrange(len(cur))
        path.append((cur, k))
        cur = cur[k]
    if not path:
        return _json_value(rng)
    parent, k = path[-1]
    op = rng.randrange(5)
    if op == 0 and isinstance(parent, dict):
        del parent[k]
    elif op == 1 and isinstance(parent, dict):
        parent[rng.choice(("extra", "dtype", "shape", "data_offsets", "__metadata__", k + "_"))] = _json_value(rng)
    elif op == 2 and isinstance(cur, (int, float)) and not isinstance(cur, bool):
        parent[k] = rng.choice((-cur, cur + 1, cur * 1000, 2**63, -(2**63), 0.5, float(cur)))
    elif op == 3 and isinstance(parent, list) and len(parent) > 1:
        i = rng.randrange(len(parent))
        parent[k], parent[i] = parent[i], parent[k]
    else:
        parent[k] = _json_value(rng)
    return obj


def _safetensors_header_edit(rng: random.Random, b: bytes) -> bytes:
    """Parse the header; edit its structure (a tensor entry, __metadata__, the l47 metadata JSON inside it, or a
    deep nest), write it back with (mostly) a consistent length field."""
    try:
        (n,) = struct.unpack_from("<Q", b, 0)
        head = json.loads(b[8:8 + n])
        rest = b[8 + n:]
    except Exception:  # noqa: BLE001 - not a parsable seed: fall back to flips
        return _flip(rng, b)
    if not isinstance(head, dict):
        return _flip(rng, b)
    r = rng.random()
    if r < 0.15:
        hb = ('{"__metadata__":' + _deep(rng, rng.choice(("list", "obj", "open"))) + "}").encode()
    elif r < 0.45 and isinstance(head.get("__metadata__"), dict):
        meta = head["__metadata__"]
        k = rng.choice(list(meta)) if meta else "l47"
        try:
            inner = json.loads(meta.get(k, "{}"))
            meta[k] = json.dumps(_edit_json(rng, inner)) if rng.random() < 0.9 else _deep(rng, "obj")
        except Exception:  # noqa: BLE001
            meta[k] = _json_value(rng)
        hb = json.dumps(head).encode()
    else:
        hb = json.dumps(_edit_json(rng, head)).encode()
    hb += b" " * (-len(hb) % 8)
    n2 = len(hb) if rng.random() < 0.9 else rng.choice(ABSURD)
    return struct.pack("<Q", n2) + hb + rest


def _text_edit(rng: random.Random, b: bytes) -> bytes:
    """TOML / JSONL line edits: delete, duplicate or swap a line; a value replaced by another type, a huge or
    deeply nested one; invalid UTF-8; a NUL; a BOM."""
    lines = b.split(b"\n")
    i = rng.randrange(len(lines))
    op = rng.randrange(8)
    if op == 0:
        del lines[i]
    elif op == 1:
        lines.insert(i, lines[i])
    elif op == 2:
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 3 and b"=" in lines[i]:
        key = lines[i].split(b"=", 1)[0]
        val = rng.choice(('"x"', "1e400", "-1", "nan", "inf", "0", "true", "[]", "{}", "[1, \"a\"]", '"' + "y" * 5000
                          + '"', "2024-01-01", "9" * 40, _deep(rng, "list")[:400_000]))
        lines[i] = key + b"= " + val.encode()
    elif op == 4:
        lines.insert(i, _deep(rng, rng.choice(("list", "obj", "open"))).encode())
    elif op == 5:
        lines[i] = lines[i] + rng.choice((b"\xff\xfe", b"\xc3", b"\x00", b"\xed\xa0\x80"))
    elif op == 6:
        return b"\xef\xbb\xbf" + b
    else:
        lines[i] = lines[i].replace(b'"', b"", 1)
    return b"\n".join(lines)


def _jsonl_edit(rng: random.Random, b: bytes) -> bytes:
    """A record's structure edited (types of id / text / messages / role / content), or a text edit."""
    lines = [ln for ln in b.split(b"\n") if ln.strip()]
    if not lines:  # an earlier mutation of the same input left no record
        return _text_edit(rng, b)
    i = rng.randrange(len(lines))
    try:
        rec = json.loads(lines[i])
    except Exception:  # noqa: BLE001
        return _text_edit(rng, b)
    lines[i] = json.dumps(_edit_json(rng, rec)).encode()
    return b"\n".join(lines) + b"\n"


MUTATORS = {
    "dump": (_flip, _flip_head, _truncate, _splice, lambda r, b: _length_field(r, b, 4096),
             _safetensors_header_edit, _safetensors_header_edit),
    "gguf": (_flip, _flip_head, _truncate, _splice, lambda r, b: _length_field(r, b, 8192),
             lambda r, b: _length_field(r, b, 8192)),
    "experiment": (_flip, _truncate, _splice, _text_edit, _text_edit, _text_edit),
    "jsonl": (_flip, _truncate, _splice, _text_edit, _jsonl_edit, _jsonl_edit),
}


# --- the readers ----------------------------------------------------------------------------------------------


def _read_dump(p: Path) -> None:
    import numpy as np

    from l47.dumps import read_dump

    d = read_dump(p)
    for k in ("tokens", "role", "ref_logp"):
        v = getattr(d, k, None)
        if v is not None:
            np.asarray(v).sum()


def _read_gguf(p: Path) -> None:
    import numpy as np

    from l47.model.gguf_io import open_gguf

    g = open_gguf(p)
    for name, t in g.tensors.items():
        raw = np.asarray(g.raw(name))
        if raw.nbytes != t.nbytes:
            raise AssertionError(f"tensor {name}: {raw.nbytes} bytes read, {t.nbytes} declared")
        int(raw.view(np.uint8)[-1:].sum()) if raw.nbytes else 0


def _read_experiment(p: Path) -> None:
    from l47.data.experiment import load_experiment

    load_experiment(p)


def _read_jsonl(p: Path) -> None:
    from l47.dumps.chat import read_documents
    from l47.errors import L47Error

    ds = read_documents(p)
    for e in ds.errors:
        if not isinstance(e, L47Error):
            raise AssertionError(f"an error that is not an L47Error: {e!r}")
    for d in ds.docs:
        if not isinstance(d.id, str):
            raise AssertionError(f"document id {d.id!r}")
    if ds.errors:  # the CLI refuses the file with these (one line each): a clean refusal
        raise ds.errors[0]


READ = {"dump": _read_dump, "gguf": _read_gguf, "experiment": _read_experiment, "jsonl": _read_jsonl}
SUFFIX = {"dump": ".safetensors", "gguf": ".gguf", "experiment": ".toml", "jsonl": ".jsonl"}


def _mutate(rng: random.Random, muts, data: bytes) -> bytes:
    try:
        return rng.choice(muts)(rng, data)
    except RecursionError:  # a mutator's own json.dumps of a deep edit: flips instead
        return _flip(rng, data)


def fuzz_one_reader(reader: str, seed_bytes: bytes, n: int, rng: random.Random, work: Path, limit_s: float,
                    save: Path | None, max_saved: int = 3) -> dict:
    """n mutants of `seed_bytes` read by `reader`; returns its counts."""
    from l47.errors import L47Error

    out = {"inputs": 0, "refusals": 0, "reads": 0, "crashes": 0, "hangs": 0, "crash_kinds": {}, "seconds": 0.0}
    muts = MUTATORS[reader]
    t0 = time.perf_counter()
    for i in range(n):
        data = _mutate(rng, muts, seed_bytes)
        if rng.random() < 0.1:  # a second mutation on top
            data = _mutate(rng, muts, data)
        p = work / f"in{i}{SUFFIX[reader]}"  # a fresh file each time: an earlier read's mmap never sees it change
        p.write_bytes(data)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        kind = None
        try:
            READ[reader](p)
            out["reads"] += 1
        except L47Error:
            out["refusals"] += 1
        except Hang:
            kind = "Hang"
            out["hangs"] += 1
        except BaseException as e:  # noqa: BLE001 - that is what the fuzz counts
            if isinstance(e, KeyboardInterrupt):
                raise
            kind = type(e).__name__
            out["crashes"] += 1
            last = traceback.extract_tb(e.__traceback__)[-1]
            kind = f"{kind} at {Path(last.filename).name}:{last.lineno}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out["inputs"] += 1
        if kind is not None:
            ck = out["crash_kinds"]
            ck[kind] = ck.get(kind, 0) + 1
            if save is not None and ck[kind] <= max_saved:
                save.mkdir(parents=True, exist_ok=True)
                tag = "".join(c if c.isalnum() else "_" for c in kind)[:60]
                (save / f"{reader}-{tag}-{ck[kind]}{SUFFIX[reader]}").write_bytes(data)
        p.unlink(missing_ok=True)
    out["seconds"] = time.perf_counter() - t0
    return out


def _worker(job: tuple) -> dict:
    readers, n, seed, w, limit_s, save = job
    signal.signal(signal.SIGALRM, _alarm)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    with tempfile.TemporaryDirectory(prefix="l47-fuzz-") as tmp:
        tmp = Path(tmp)
        seeds = build_seeds(tmp)
        out = {}
        for reader in readers:
            work = tmp / f"work-{reader}"
            work.mkdir()
            if reader == "experiment":  # the TOML names the seed dump and GGUF: they lie beside it
                for k in ("dump", "gguf"):
                    os.link(seeds[k], work / seeds[k].name)
            rng = random.Random(f"{seed}/{w}/{reader}")
            out[reader] = fuzz_one_reader(reader, seeds[reader].read_bytes(), n, rng, work, limit_s,
                                          Path(save) / f"w{w}" if save else None)
        return out


def run(readers, inputs: int, workers: int, seed: int, limit_s: float, save: str | None, commit: str = "") -> dict:
    """Split `inputs` per reader over `workers` processes; merge their counts."""
    per = [inputs // workers + (1 if w < inputs % workers else 0) for w in range(workers)]
    jobs = [(tuple(readers), per[w], seed, w, limit_s, save) for w in range(workers) if per[w]]
    t0 = time.perf_counter()
    if workers == 1:
        parts = [_worker(j) for j in jobs]
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(len(jobs)) as pool:
            parts = pool.map(_worker, jobs)
    wall = time.perf_counter() - t0
    total = {}
    for r in readers:
        t = {"inputs": 0, "refusals": 0, "reads": 0, "crashes": 0, "hangs": 0, "crash_kinds": {}, "cpu_seconds": 0.0}
        for part in parts:
            c = part[r]
            for k in ("inputs", "refusals", "reads", "crashes", "hangs"):
                t[k] += c[k]
            t["cpu_seconds"] += c["seconds"]
            for k, v in c["crash_kinds"].items():
                t["crash_kinds"][k] = t["crash_kinds"].get(k, 0) + v
        t["inputs_per_s_per_core"] = t["inputs"] / t["cpu_seconds"] if t["cpu_seconds"] else None
        total[r] = t
    n_all = sum(t["inputs"] for t in total.values())
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip()
        except OSError:
            commit = ""
    return {"readers": total, "inputs": n_all, "wall_s": wall, "inputs_per_s": n_all / wall if wall else None,
            "workers": workers, "seed": seed, "limit_s": limit_s, "commit": commit,
            "command": " ".join(["python", "scripts/fuzz_readers.py", *sys.argv[1:]])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1000, help="mutated inputs per reader (all workers together)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--readers", default=",".join(READERS), help="comma-separated: " + ", ".join(READERS))
    ap.add_argument("--limit", type=float, default=10.0, help="seconds per input before it counts as a hang")
    ap.add_argument("--save", default=None, help="folder for the first crashing inputs of each kind")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--commit", default="", help="the commit the figures name (default: git rev-parse HEAD)")
    a = ap.parse_args(argv)
    readers = [r for r in a.readers.split(",") if r]
    bad = [r for r in readers if r not in READERS]
    if bad:
        ap.error(f"--readers: unknown {bad}; expected some of {list(READERS)}")
    res = run(readers, a.inputs, a.workers, a.seed, a.limit, a.save, a.commit)
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return 1 if any(t["crashes"] or t["hangs"] for t in res["readers"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
