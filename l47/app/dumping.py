"""`l47 dump`: documents -> engine -> one dump file per document, each checked by the zero-proxy check.

Per document: render (chat template + roles, or plain text; optionally the engine samples the assistant turn)
-> engine capture at layer L -> write the dump (atomic, to a pending name) -> zero-proxy check: the exact tail
forward recomputes log p(next) from the written file and compares it with the engine's own `ref_logp`; the
max and mean |Δ| (nats) are reported, and a document above tolerance is refused (its file is renamed
`*.safetensors.refused`, never left under the dump name). Resumable: a document whose existing dump has the
same input hash and model hash is skipped. Bad documents are collected as errors; the others still run.
Prints nothing: it reports through callbacks, `log(str)` and `progress(dict)` (as run_solve and run_audit do);
l47/app/dump_view.py renders them.

Notation for shapes: T positions of a document (row t predicts tokens[t+1]).
Precision: the engine runs in f32; the check's log p in f64 from f32 logits (l47.tail.forward).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from l47.dumps import DumpMeta, SCHEMA_VERSION, dump_nbytes, read_dump, write_dump
from l47.dumps.chat import DocumentSet, chat_segments, read_documents, render_document, tokenize_segments
from l47.dumps.schema import provenance_of
from l47.engine import strata
from l47.engine.gguf_export import load_hf, load_hf_from_gguf, read_hf_config
from l47.engine.hf import (
    HH_PRECISION, INJ_CONVENTION, SamplerSettings, batchable, capture, engine_meta, generate, generate_batch,
    load_hf_placed, model_id, place_model, tail_weights_from_model,
)
from l47.engine.qsa import share_indexer_work
from l47.errors import L47Error
from l47.model import names
from l47.model.gguf_io import open_gguf
from l47.model.vocab import require_specials, vocab_for_model, vocab_from_checkpoint
from l47.model.weights import _hparam, check_dump_dims, load_tail_weights
from l47.tail.forward import score_dump

ENGINES = ("hf", "strata")
DEFAULT_TOLERANCE = {"hf": 1e-4, "strata": 1e-3}  # nats: f32 reference engine / Strata's fp16 prompt path
DEFAULT_BATCH = 64  # generated turns sampled together (docs/BENCHMARKS.md: 16 -> 64 cut generation CPU by a third)
DUMP_SUFFIX = ".safetensors"
PENDING_SUFFIX = ".pending"
REFUSED_SUFFIX = ".refused"
STRATA_RAW = ".strata-raw"  # the Strata engine's per-document contract folders, inside --out (removed after use)
_SAFE = re.compile(r"[^A-Za-z0-9._-]")

STATUS_WRITTEN, STATUS_SKIPPED, STATUS_REFUSED, STATUS_ERROR = "written", "skipped", "refused", "error"


@dataclass(frozen=True)
class GenerateOptions:
    """Sample the assistant turn (chat: after the last non-assistant message; plain: a continuation)."""

    max_new_tokens: int = 256
    seed: int = 0  # base seed; each document samples with a seed derived from (seed, doc id)
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    think: bool | None = None  # True: prompt ends "<think>\n"; False: empty think block; None: nothing added


@dataclass(frozen=True)
class DocResult:
    doc_id: str
    status: str  # written | skipped | refused | error
    path: str | None = None
    T: int = 0
    max_abs: float | None = None  # zero-proxy |Δ log p(next)|, nats
    mean_abs: float | None = None
    message: str = ""


@dataclass(frozen=True)
class DumpSummary:
    results: tuple[DocResult, ...]
    input_errors: tuple[str, ...]
    model: str
    engine: dict
    tolerance: float
    out_dir: str

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        return not self.input_errors and all(r.status in (STATUS_WRITTEN, STATUS_SKIPPED) for r in self.results)

    @property
    def exit_code(self) -> int:
        """2: a bad input record or document (named in its error); 1: a document refused by the zero-proxy bar;
        0: every document written or already there."""
        if self.input_errors or self.count(STATUS_ERROR):
            return 2
        return 1 if self.count(STATUS_REFUSED) else 0


# ----------------------------------------------------------------------------------------------------------
# helpers


def dump_name(doc_id: str) -> str:
    """File name of a document's dump: the id with unsafe characters replaced (+ a short id hash when changed)."""
    safe = _SAFE.sub("_", doc_id)[:100].lstrip(".")
    if safe != doc_id:
        safe = f"{safe}-{hashlib.sha256(doc_id.encode()).hexdigest()[:8]}"
    return safe + DUMP_SUFFIX


def doc_seed(seed: int, doc_id: str) -> int:
    """Per-document sampling seed (stable across runs and document order)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{doc_id}".encode()).digest()[:4], "little")


def _input_hash(doc, layer: int, gen: GenerateOptions | None, ref_logits: bool, topk: int, plain_role: str,
                engine: dict) -> str:
    """Everything that determines a document's dump besides the model bytes."""
    blob = {"doc": doc.record(), "layer": layer, "generate": asdict(gen) if gen else None,
            "ref_logits": ref_logits, "topk": topk, "plain_role": plain_role, "engine": engine}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _generated_roles(ids: list[int], vocab, start_in_think: bool, content_role: str) -> list[str]:
    """Roles of sampled tokens: think tags and other specials are template; inside <think>…</think> think."""
    sp = vocab.special_ids
    think, end_think = sp.get(names.THINK), sp.get(names.END_THINK)
    specials = set(sp.values())
    in_think, out = start_in_think, []
    for i in ids:
        if i == think:
            in_think = True
            out.append("template")
        elif i == end_think:
            in_think = False
            out.append("template")
        elif i in specials:
            out.append("template")
        else:
            out.append("think" if in_think else content_role)
    return out


def _decode(vocab, ids) -> str:
    """Text of sampled ids for the metadata; ids beyond the tokenizer (padded head rows) read as U+FFFD."""
    if not hasattr(vocab, "decode"):
        return ""
    size = getattr(vocab, "size", None)
    out, run = [], []
    for i in ids:
        if size is not None and not 0 <= i < size:
            out.append(vocab.decode(run) + "\ufffd")
            run = []
        else:
            run.append(i)
    return "".join(out) + vocab.decode(run)


# ----------------------------------------------------------------------------------------------------------
# one document


@dataclass(frozen=True)
class _Rendered:
    tokens: list[int]
    role: np.ndarray  # [T] uint8
    provenance: dict
    text: str


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    roles: list[str]  # role of every prompt token
    text: str
    stop: list[int]
    content_role: str  # role of what the engine writes
    where: str


def _prompt(doc, vocab, gen: GenerateOptions, plain_role: str) -> _Prompt:
    """The generation prompt of a document: a chat up to the assistant's turn, or a plain text to continue."""
    where = f"{doc.source or 'document'} (doc {doc.id!r})"
    sp = vocab.special_ids
    if doc.messages is not None:
        msgs = list(doc.messages)
        while msgs and msgs[-1].role == "assistant":
            msgs.pop()  # the engine writes the assistant turn itself
        if not msgs:
            raise L47Error(where, "messages", "a prompt (a non-assistant message) to generate from",
                           "only assistant messages")
        segs = chat_segments(msgs, vocab, add_generation_prompt=True, where=where)
        # what the template adds to the generation prompt is markup ("template"), not reasoning
        if gen.think is True:
            segs += [(names.THINK, "template", True), ("\n", "template", False)]
        elif gen.think is False:
            segs += [(names.THINK, "template", True), ("\n\n", "template", False),
                     (names.END_THINK, "template", True), ("\n\n", "template", False)]
        prompt, p_roles = tokenize_segments(segs, vocab, where)
        return _Prompt(list(prompt), list(p_roles), "".join(t for t, _, _ in segs),
                       [sp[s] for s in (names.IM_END, names.ENDOFTEXT) if s in sp], "assistant", where)
    prompt = list(vocab.encode(doc.text))
    return _Prompt(prompt, [plain_role] * len(prompt), doc.text,
                   [sp[names.ENDOFTEXT]] if names.ENDOFTEXT in sp else [], plain_role, where)


def _with_generation(doc, vocab, gen: GenerateOptions, p: _Prompt, new: list[int], mid: str,
                     engine: str) -> _Rendered:
    """Rendered document = prompt + the engine's sampled tokens, with roles and provenance `generated`."""
    ids = p.ids + list(new)
    if len(ids) < 2:
        raise L47Error(p.where, "tokens", "at least 2 tokens", str(len(ids)))
    roles = p.roles + _generated_roles(list(new), vocab, gen.think is True, p.content_role)
    role = np.asarray([names.ROLE_ID[r] for r in roles[1:]], dtype=np.uint8)  # [T] role of each target
    generated = np.arange(1, len(ids)) >= len(p.ids)  # [T] target was sampled
    prov = provenance_of(role, generated)
    prov["generation"] = {"prompt": p.text, "seed": doc_seed(gen.seed, doc.id), "model": mid,
                          "sampler": {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
                                      "max_new_tokens": gen.max_new_tokens, "base_seed": gen.seed,
                                      "stop_ids": p.stop, "think": gen.think, "engine": engine}}
    return _Rendered(ids, role, prov, p.text + _decode(vocab, list(new)))


def _render(doc, vocab, gen: GenerateOptions | None, model, mid: str, plain_role: str,
            sampled: list[int] | None = None) -> _Rendered:
    """Render a document; with `gen`, its assistant turn is `sampled` (from a batch) or sampled here."""
    if gen is None:
        r = render_document(doc, vocab, plain_role)
        return _Rendered(list(r.tokens), r.role, provenance_of(r.role, None), r.text)
    p = _prompt(doc, vocab, gen, plain_role)
    new = sampled if sampled is not None else generate(model, p.ids, _sampler(gen, doc, p), p.where)
    return _with_generation(doc, vocab, gen, p, new, mid, "hf")


def _sampler(gen: GenerateOptions, doc, p: _Prompt):
    """The engine's sampler for one document's turn: the run's options, the document's own seed, its stop ids."""
    return SamplerSettings(gen.max_new_tokens, doc_seed(gen.seed, doc.id), gen.temperature, gen.top_p, gen.top_k,
                           tuple(p.stop))


def _sample_batch(model, docs, prompts, gen: GenerateOptions) -> list[list[int]]:
    """The sampled turns of several documents in one padded batch (engine.hf.generate_batch: the same ids as one
    at a time); [] when the batch fails (e.g. an id outside the model: each document then fails on its own,
    with its name)."""
    try:
        return generate_batch(model, [p.ids for p in prompts], [_sampler(gen, d, p) for d, p in zip(docs, prompts)])
    except L47Error:
        return []


def _strata_document(job: "DumpJob", eng: "_LoadedEngine", doc, raw_dir: Path, source: dict):
    """One document through the external Strata binary (engine/CONTRACT.md) -> (arrays, DumpMeta)."""
    gen, vocab, mid = job.generate, eng.vocab, eng.mid
    if gen is None:
        r = render_document(doc, vocab, job.plain_role)
        strata.run_strata(eng.strata, list(r.tokens), raw_dir)
        base = {"doc_id": doc.id, "text": r.text, "role": r.role, "provenance": provenance_of(r.role, None),
                "model": mid, "source": source}
        arrays, fields = strata.convert(raw_dir, base)
        return arrays, DumpMeta(**fields)
    p = _prompt(doc, vocab, gen, job.plain_role)
    strata.run_strata(eng.strata, p.ids, raw_dir, _sampler(gen, doc, p))
    raw = strata.read_raw(raw_dir)
    new = [int(t) for t in np.asarray(raw[strata.K_TOKENS])[len(p.ids):]]
    r = _with_generation(doc, vocab, gen, p, new, mid, "strata")
    base = {"doc_id": doc.id, "text": r.text, "role": r.role, "model": mid, "source": source,
            "prompt_text": p.text}
    arrays, fields = strata.convert(raw, base)
    return arrays, DumpMeta(**fields)


def zero_proxy(tail, dump) -> tuple[float, float]:
    """(max, mean) |log p_tail(next) − ref_logp| in nats over the dump's positions."""
    check_dump_dims(tail, dump.meta, str(dump.path))
    s = score_dump(tail, dump, topk=1)  # log p(next) only: the least top-k the streamed head keeps
    d = np.abs(s.logp_target - np.asarray(dump.ref_logp, dtype=np.float64))  # [T] f64
    return float(d.max()), float(d.mean())


# ----------------------------------------------------------------------------------------------------------
# disk space, estimated before the model is loaded (issue 14 item 1)

_HEADER_BASE = 16 << 10  # a dump's safetensors header: tensor table + metadata JSON without the text (~3 KiB seen)
_HEADER_PER_TEXT_BYTE = 8  # the text (and a generated document's prompt) in the metadata, JSON-escaped
_HEADER_PER_NEW_TOKEN = 64  # a generated token's text in the metadata (the text is unknown before sampling)


def _file_nbytes(T: int, n: int, f: int, hc: int, V: int, topk: int, ref_logits: bool, text_bytes: int = 0) -> int:
    """An upper bound of one dump file's size: the array section (l47.dumps.dump_nbytes, exact) + the header
    (16 KiB + 8 bytes per byte of the text)."""
    return dump_nbytes(T, n, f, hc, V, k=topk, ref_logits=ref_logits) + _HEADER_BASE + _HEADER_PER_TEXT_BYTE * text_bytes


def _model_dims(model_path: Path) -> tuple[int, int, int, int]:
    """(n, f, hc, V) from a GGUF's tensor table and metadata, or a checkpoint's config.json (nothing loaded)."""
    if model_path.is_dir():
        c = read_hf_config(model_path)
        return (int(c.hidden_size), int(c.shared_expert_intermediate_size), int(c.hc_count), int(c.vocab_size))

    g = open_gguf(model_path)
    L = int(_hparam(g, names.K_BLOCK_COUNT)) - 1
    n, f = g.info(names.target_tensor(L)).shape  # [n, f]
    V = g.info(names.OUTPUT.gguf).shape[0]  # [V, n]
    return int(n), int(f), int(_hparam(g, names.K_HC_COUNT)), int(V)


def estimate_dump_bytes(model_path, inputs, out_dir, generate: GenerateOptions | None = None,
                        ref_logits: bool = False, topk: int = 8, plain_role: str = "assistant",
                        vocab=None) -> tuple[int, int] | None:
    """(bytes, documents) a `run_dump` into `out_dir` will add to its disk, from the documents' token counts and
    the model's dims, read without loading the model: each document without a dump there yet (forced: its
    rendered length; generated: its prompt + max_new_tokens, an upper bound), plus the largest document once
    for a dump that is replaced (written beside the old one, then renamed over it). None when the inputs or the
    model cannot be read here (run_dump then reports that with its own error)."""
    model_path, out_dir = Path(model_path), Path(out_dir)
    try:
        n, f, hc, V = _model_dims(model_path)
        if vocab is None:
            if model_path.is_dir():
                vocab = vocab_from_checkpoint(model_path, V)
            else:
                vocab = vocab_for_model(model_path)
        docs = read_documents(inputs).docs
    except (L47Error, OSError, ValueError):
        return None
    total, biggest, count = 0, 0, 0
    for doc in docs:
        try:
            if generate is None:
                r = render_document(doc, vocab, plain_role)
                size = _file_nbytes(len(r.tokens) - 1, n, f, hc, V, topk, ref_logits, len(r.text.encode()))
            else:
                p = _prompt(doc, vocab, generate, plain_role)
                T = len(p.ids) + int(generate.max_new_tokens) - 1
                size = _file_nbytes(T, n, f, hc, V, topk, ref_logits, 2 * len(p.text.encode())) \
                    + _HEADER_PER_NEW_TOKEN * int(generate.max_new_tokens)
        except L47Error:
            continue  # a bad document is reported (and written nowhere) by run_dump
        biggest = max(biggest, size)
        if not (out_dir / dump_name(doc.id)).exists():
            total, count = total + size, count + 1
    return total + (biggest if count < len(docs) else 0), count


# ----------------------------------------------------------------------------------------------------------
# the command


_ENGINE_CACHE: dict[tuple, tuple] = {}


def _load_engine(model_path: Path, policy: str, device: str, layer: int | None, placement=None):
    """(model, tail weights, model id, engine meta, default vocab) for the hf engine; cached per process for the
    same file (path, size, mtime), policy, device, layer and placement — several `run_dump` calls share one load."""
    st = model_path.stat() if model_path.exists() else None
    key = (str(model_path.resolve()), st and st.st_size, st and st.st_mtime_ns, policy, str(device), layer,
           repr(placement))
    if st is not None and model_path.is_file() and key in _ENGINE_CACHE:
        return _ENGINE_CACHE[key]
    out = _load_engine_uncached(model_path, policy, device, layer, placement)
    if model_path.is_file():
        _ENGINE_CACHE.clear()  # one model at a time
        _ENGINE_CACHE[key] = out
    return out


def _load_engine_uncached(model_path: Path, policy: str, device: str, layer: int | None, placement=None):
    placed = placement is not None and placement.device_map is not None

    if not model_path.exists():
        raise L47Error(model_path, "model", "a qwen4exp GGUF or a transformers checkpoint directory", "nothing")
    if model_path.is_file():
        vocab = vocab_for_model(model_path)  # the GGUF's own tokenizer metadata
        mid = model_id(model_path)
        model = load_hf_from_gguf(model_path, policy=policy, device="cpu" if placed else device)
        model = place_model(model, placement)  # placed: built on the host, then dispatched (engine/hf.py)
        tail = load_tail_weights(model_path, policy=policy, device=device, layer=layer)
        meta = engine_meta(model, source="gguf", policy=policy)
    else:
        cfg = read_hf_config(model_path)  # config.json checked before anything is loaded
        has_tok = (model_path / "tokenizer.json").is_file()  # run_dump refuses a missing one unless given a vocab
        vocab = vocab_from_checkpoint(model_path, int(cfg.vocab_size)) if has_tok else None  # its own
        mid = model_id(model_path)
        model = load_hf_placed(model_path, placement) if placed else load_hf(model_path, device=device)
        tail = tail_weights_from_model(model, mid, layer)
        meta = engine_meta(model, source="hf-checkpoint", policy=None)
    share_indexer_work(model)  # the same selection as transformers' QSA indexer, bit for bit, without its re-pooling
    return model, tail, mid, meta, vocab


def _portable_source(inputs, doc, input_hash: str) -> dict:
    """The dump's `source`: the input's file NAME (not its folder) and the line, plus content hashes — so the same
    documents dumped from a copy of the input in another folder give the same dump bytes (issue 14 item 8)."""
    where = doc.source or ""
    name = "documents"
    if isinstance(inputs, (str, Path)):
        name = Path(inputs).name
        folder = str(Path(inputs).parent)
        if folder not in ("", ".") and where.startswith(folder + "/"):
            where = where[len(folder) + 1:]
    return {"input": name, "where": where, "input_sha256": input_hash, "doc_sha256": doc.sha256()}


def _missing_dirs(folder: Path) -> list[Path]:
    """`folder` and its ancestors that do not exist yet, deepest first."""
    out, p = [], Path(os.path.abspath(folder))
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def _rmdir_if_empty(d: Path) -> None:
    try:
        d.rmdir()  # only an empty folder: never a file or folder the user put there
    except OSError:
        pass


def _existing_matches(path: Path, input_hash: str, mid: str) -> bool:
    if not path.is_file():
        return False
    try:
        d = read_dump(path, validate=False)
    except L47Error:
        return False  # unreadable: dump it again
    return d.meta.source.get("input_sha256") == input_hash and d.meta.model == mid


@dataclass(frozen=True)
class DumpJob:
    """Everything one `l47 dump` run is asked to do: the CLI, the demo, export's self-check, the scripts and the
    tests build one and hand it to `run_dump`. Checked when built (an L47Error names the option).

    engine      "hf" (transformers reference engine) or "strata" (the external binary, engine/CONTRACT.md)
    model_path  a qwen4exp GGUF written by l47's exporter (tensors dequantised under `policy`, vocabulary from
                its metadata) or a transformers checkpoint directory (vocabulary: its own tokenizer.json)
    inputs      JSONL path, datasets path/object, or a DocumentSet
    layer       must be the last layer (the exact tail forward holds only there); None = the last
    generate    sample the assistant turn (GenerateOptions); None = the documents as written
    tolerance   zero-proxy bar in nats; None = the engine's default (DEFAULT_TOLERANCE)
    vocab       the vocabulary the documents are rendered with; None = the model's own
    placement   hf engine across devices (l47.engine.hf.Placement: device map, max memory, offload folder);
                None = the whole model on `device`. The tail weights of the zero-proxy check stay on `device`.
    batch       hf engine: documents whose turns are sampled together (padded; the same ids as one at a time)
    """

    model_path: Path
    inputs: object
    out_dir: Path
    engine: str = "hf"
    layer: int | None = None
    generate: GenerateOptions | None = None
    ref_logits: bool = False
    tolerance: float | None = None
    policy: str = "strata"
    device: str = "cpu"
    vocab: object | None = None
    plain_role: str = "assistant"
    topk: int = 8
    split: str | None = None
    engine_bin: object | None = None
    placement: object | None = None
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        if self.model_path is None or self.inputs is None or self.out_dir is None:
            raise L47Error("l47 dump", "arguments", "model_path, inputs and out_dir", "one missing")
        object.__setattr__(self, "model_path", Path(self.model_path))  # frozen: set once, here
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if int(self.batch) < 1:
            raise L47Error("l47 dump", "--batch", "an integer >= 1", str(self.batch))
        if self.engine not in ENGINES:
            raise L47Error("l47 dump", "--engine", f"one of {list(ENGINES)}", repr(self.engine))
        if self.plain_role not in names.ROLE_ID:
            raise L47Error("l47 dump", "plain_role", f"one of {list(names.ROLES)}", repr(self.plain_role))

    @property
    def bar(self) -> float:
        """The zero-proxy tolerance this run applies, nats."""
        return DEFAULT_TOLERANCE[self.engine] if self.tolerance is None else float(self.tolerance)


@dataclass(frozen=True)
class _LoadedEngine:
    """The engine a job runs: the hf model (None for Strata) or how the Strata binary runs, the tail weights of
    the zero-proxy check, the model id, the engine's metadata and the vocabulary the documents are rendered with."""

    strata: object | None  # l47.engine.strata.StrataRun
    model: object | None
    tail: object
    mid: str
    meta: dict
    vocab: object

    @property
    def L(self) -> int:
        return self.tail.layer


class _Report:
    """The run's two callbacks (either may be None): `log(str)`, a line of text; `progress(dict)`, one event
    ({"event": "start", "total", "input_errors"} · {"event": "document", "doc_id"} before a document ·
    {"event": "done", **DocResult fields} after it · {"event": "stop"}). l47.app.dump_view renders them."""

    def __init__(self, log=None, progress=None) -> None:
        self.log, self.progress = log, progress

    def say(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)

    def event(self, event: str, **fields) -> None:
        if self.progress is not None:
            self.progress({"event": event, **fields})


def check_placement(placement) -> None:
    """Every device a --device-map / --max-memory names exists here, before any model is loaded: cpu, disk (with
    --offload-dir), mps where MPS is available, cuda / cuda:N / N below this machine's CUDA device count. A device
    that is not present is one L47Error naming the option and the entry (accelerate would fail mid-load)."""
    if placement is None:
        return
    dm = placement.device_map if isinstance(placement.device_map, dict) else {}
    named = [("--device-map", f"{json.dumps(k)}: {json.dumps(v)}", v) for k, v in dm.items()]
    named += [("--max-memory", json.dumps(k), k) for k in (placement.max_memory or {})]
    for opt, entry, dev in named:
        _check_placed_device(opt, entry, dev, placement.offload_dir)


def _present_devices() -> tuple[int, bool]:
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cuda, bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _check_placed_device(opt: str, entry: str, dev, offload_dir) -> None:
    """One device of a placement (check_placement)."""
    if dev == "cpu":
        return
    if dev == "disk":
        if offload_dir is None:
            raise L47Error("l47 dump", f"{opt} {entry}", "--offload-dir FOLDER for the layers placed on 'disk'",
                           "no --offload-dir")
        return
    n_cuda, mps = _present_devices()
    m = re.fullmatch(r"cuda(?::(\d+))?", dev) if isinstance(dev, str) else None
    idx = dev if isinstance(dev, int) and not isinstance(dev, bool) else int(m.group(1) or 0) if m else None
    if (dev == "mps" and mps) or (idx is not None and 0 <= idx < n_cuda):
        return
    have = ", ".join(["cpu", "disk"] + (["mps"] if mps else []) + [f"cuda:{i}" for i in range(n_cuda)])
    raise L47Error("l47 dump", f"{opt} {entry}", f"a device present on this machine ({have}; {n_cuda} CUDA "
                   "device(s) found)", json.dumps(dev))


def run_dump(job: DumpJob, log: Callable[[str], None] | None = None,
             progress: Callable[[dict], None] | None = None) -> DumpSummary:
    """Dump every document of `job.inputs` into `job.out_dir`: check the placement's devices -> load engine ->
    plan documents -> dump each (resumable, errors collected) -> summary. Prints nothing: `log` receives the
    summary line, `progress` one event per step (`_Report`; l47.app.dump_view.dump_and_print renders both);
    None = silent."""
    check_placement(job.placement)
    eng = _load_job_engine(job)
    docset = _plan_documents(job, eng.vocab)
    report = _Report(log, progress)
    report.event("start", total=len(docset.docs), input_errors=[str(e) for e in docset.errors])
    results = _dump_documents(job, eng, docset.docs, report)
    summary = DumpSummary(tuple(results), tuple(str(e) for e in docset.errors), eng.mid, eng.meta, job.bar,
                          str(job.out_dir))
    report.say(f"dump: {summary.count(STATUS_WRITTEN)} written, {summary.count(STATUS_SKIPPED)} skipped, "
               f"{summary.count(STATUS_REFUSED)} refused, {summary.count(STATUS_ERROR)} failed, "
               f"{len(summary.input_errors)} input error(s)")
    return summary


def _load_job_engine(job: DumpJob) -> _LoadedEngine:
    """The Strata binary + the tail weights, or the hf model (cached per process); the vocabulary resolved."""
    if job.engine == "strata":
        sbin = strata.strata_binary(job.engine_bin)
        if not job.model_path.is_file():
            raise L47Error(job.model_path, "model", "the qwen4exp GGUF the Strata binary runs", "not a file")
        tail = load_tail_weights(job.model_path, policy=job.policy, device=job.device, layer=job.layer)
        mid, default_vocab = model_id(job.model_path), vocab_for_model(job.model_path)
        run = strata.StrataRun(sbin, job.model_path, tail.layer, topk=job.topk, ref_logits=job.ref_logits)
        return _LoadedEngine(run, None, tail, mid, {"name": "strata", "bin": str(sbin)}, job.vocab or default_vocab)
    if job.vocab is None and job.model_path.is_dir():  # the checkpoint's own tokenizer, checked before loading
        vocab_from_checkpoint(job.model_path, int(read_hf_config(job.model_path).vocab_size))
    model, tail, mid, meta, default_vocab = _load_engine(job.model_path, job.policy, job.device, job.layer,
                                                         job.placement)
    return _LoadedEngine(None, model, tail, mid, meta, job.vocab or default_vocab)


def _plan_documents(job: DumpJob, vocab):
    """The documents (bad records collected as input errors); chat documents and generation need the specials."""
    docset = job.inputs if isinstance(job.inputs, DocumentSet) else read_documents(job.inputs, split=job.split)
    if job.generate is not None or any(d.messages is not None for d in docset.docs):
        need = names.SPECIAL_TOKENS if job.generate is not None else (names.IM_START, names.IM_END)
        require_specials(vocab, need, "chat documents and generation")
    return docset


def _dump_documents(job: DumpJob, eng: _LoadedEngine, docs, report: _Report) -> list[DocResult]:
    """Every document (results in input order), the hf engine's turns sampled a batch at a time; the folders this
    run created (and the Strata contract folder) removed again when left empty, whatever happened."""
    made = _missing_dirs(job.out_dir)  # the folders this run creates (removed again if it ends with them empty)
    job.out_dir.mkdir(parents=True, exist_ok=True)
    raw_root = job.out_dir / STRATA_RAW
    raw_made = eng.strata is not None and not raw_root.exists()
    results: dict[int, DocResult] = {}
    try:
        for group, sampled in _batches(job, eng, docs):
            for k in group:
                report.event("document", doc_id=docs[k].id)
                results[k] = _dump_document(job, eng, docs[k], sampled.get(k), raw_root)
                report.event("done", **asdict(results[k]))
    finally:
        report.event("stop")
        if raw_made:
            _rmdir_if_empty(raw_root)
        for d in made:  # deepest first: a folder this run created and left empty (a refusal, an interrupt)
            _rmdir_if_empty(d)
    return [results[k] for k in sorted(results)]


def _doc_hash(job: DumpJob, eng: _LoadedEngine, doc) -> str:
    return _input_hash(doc, eng.L, job.generate, job.ref_logits, job.topk, job.plain_role, eng.meta)


def _batches(job: DumpJob, eng: _LoadedEngine, docs):
    """(document indices, {index: sampled turn}) in the order they are dumped. Without batched generation: one
    document at a time, in input order. With it: first, one at a time, the documents that need no sampling here
    (already dumped, or a prompt that cannot be built: their own render reports it); then the others sorted by
    prompt length (least padding) in batches of `job.batch`, each batch's turns sampled together just before its
    documents are dumped (a sampled turn depends only on its document: engine.hf.generate_batch)."""
    bs = job.batch if (job.generate is not None and eng.strata is None and batchable(eng.model)) else 1
    if bs == 1:
        yield from (([k], {}) for k in range(len(docs)))
        return
    todo: list[tuple[int, int, _Prompt]] = []  # (prompt length, index, prompt)
    for k, doc in enumerate(docs):
        p = None
        if not _existing_matches(job.out_dir / dump_name(doc.id), _doc_hash(job, eng, doc), eng.mid):
            try:
                p = _prompt(doc, eng.vocab, job.generate, job.plain_role)
            except L47Error:
                pass
        if p is None:
            yield [k], {}
        else:
            todo.append((len(p.ids), k, p))
    todo.sort(key=lambda t: (t[0], t[1]))
    for i in range(0, len(todo), bs):
        chunk = todo[i:i + bs]
        idx = [k for _, k, _ in chunk]
        turns = _sample_batch(eng.model, [docs[k] for k in idx], [p for _, _, p in chunk], job.generate) \
            if len(chunk) > 1 else []
        yield idx, dict(zip(idx, turns))


def _dump_document(job: DumpJob, eng: _LoadedEngine, doc, sampled: list[int] | None, raw_root: Path) -> DocResult:
    """One document: skipped (same input and model) | captured -> written to a pending name -> zero-proxy check
    -> renamed to its dump name or refused. An L47Error is the document's error; the pending file and the
    engine's contract files never stay behind."""
    path = job.out_dir / dump_name(doc.id)
    pending = path.with_name(path.name + PENDING_SUFFIX)
    ih = _doc_hash(job, eng, doc)
    try:
        if _existing_matches(path, ih, eng.mid):
            return DocResult(doc.id, STATUS_SKIPPED, str(path), message="same input and model")
        source = _portable_source(job.inputs, doc, ih)
        if eng.strata is not None:  # the external Strata binary (engine/CONTRACT.md)
            arrays, meta = _strata_document(job, eng, doc, raw_root / path.stem, source)
        else:
            arrays, meta = _hf_document(job, eng, doc, sampled, source)
        return _write_checked(job, eng, doc.id, arrays, meta, path)
    except L47Error as e:
        return DocResult(doc.id, STATUS_ERROR, None, message=str(e))
    finally:
        pending.unlink(missing_ok=True)  # never left behind, whatever failed (an interrupt included)
        if eng.strata is not None:
            strata.remove_raw(raw_root / path.stem, eng.L)  # the engine's contract files, nothing else


def _hf_document(job: DumpJob, eng: _LoadedEngine, doc, sampled: list[int] | None, source: dict):
    """One document through the transformers engine -> (arrays, DumpMeta)."""
    cfg = eng.model.config
    r = _render(doc, eng.vocab, job.generate, eng.model, eng.mid, job.plain_role, sampled)
    arrays = capture(eng.model, r.tokens, eng.L, ref_logits=job.ref_logits, topk=job.topk,
                     where=f"{doc.source} (doc {doc.id!r})")
    arrays["role"] = r.role
    meta = DumpMeta(
        schema_version=SCHEMA_VERSION, doc_id=doc.id, layer=eng.L, n=int(cfg.hidden_size),
        f=int(cfg.shared_expert_intermediate_size), hc=int(cfg.hc_count), r=int(cfg.hc_lowrank),
        V=int(cfg.vocab_size), model=eng.mid, engine=eng.meta, inj_convention=INJ_CONVENTION,
        hh_precision=HH_PRECISION, provenance=r.provenance, text=r.text, source=source,
    )
    return arrays, meta


def _write_checked(job: DumpJob, eng: _LoadedEngine, doc_id: str, arrays, meta, path: Path) -> DocResult:
    """Write to the pending name, run the zero-proxy check on what was written, then rename it to the dump name
    (a stale refusal removed) or to `*.refused` above the tolerance."""
    pending = path.with_name(path.name + PENDING_SUFFIX)
    refused = path.with_name(path.name + REFUSED_SUFFIX)
    T = int(len(arrays["tokens"]) - 1)
    write_dump(pending, arrays, meta)
    mx, mean = zero_proxy(eng.tail, read_dump(pending))
    if mx <= job.bar:
        os.replace(pending, path)
        refused.unlink(missing_ok=True)  # a stale refusal from an earlier run
        return DocResult(doc_id, STATUS_WRITTEN, str(path), T, mx, mean)
    os.replace(pending, refused)
    msg = (f"zero-proxy max |Δ log p| {mx:.3e} nats > tolerance {job.bar:.1e} (mean {mean:.3e}); "
           f"kept as {refused.name}")
    return DocResult(doc_id, STATUS_REFUSED, str(refused), T, mx, mean, msg)
