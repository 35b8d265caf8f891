"""`l47 export HF_DIR OUT.gguf`: a transformers qwen4exp checkpoint -> the whole-model GGUF `sets`, `solve`,
`audit` and `dump` read, with the checkpoint's own tokenizer, checked before it is kept.

Steps (every input is validated before the model is loaded; nothing is left at OUT unless the check passes):
    1. inputs      config.json (model_type qwen4_exp_text, the hyper-parameters the GGUF carries present), the
                   safetensors weights (complete files; exactly the model's parameters at their shapes: missing,
                   unexpected and mismatched tensors named; transformers then loads them strictly), tokenizer.json (byte-level BPE, a Qwen
                   pre-tokenizer detected from its Split regex or named with --pre), the five chat special
                   tokens, OUT not existing, the tensor types
    2. tokenizer   tokenizer.json -> GGUF tokenizer metadata (padded to config vocab_size with unused rows)
    3. export      every tensor under its GGUF name, the seed file's types unless overridden (engine/gguf_export)
    4. check       forced documents (a plain text and a chat with a think block, rendered with the exported
                   vocabulary): their ids equal the checkpoint's own tokenizer.json run by `tokenizers`; `l47 dump`
                   on the exported file (hf engine, policy "exact", zero-proxy check of the exact tail forward)
                   agrees with transformers on the checkpoint at the exported types (its parameters encoded and
                   decoded by the same codecs, without reading the file) within the hf zero-proxy tolerance
    5. keep        the checked file is renamed to OUT; a failed check removes it (exit 1)

Precision: the model runs in f32; log p(next) in f64 from f32 logits. The f32 checkpoint's own log p differs
from the exported file's by the quantisation of the chosen types; that drift is reported, not a bar.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from l47.app import dumping
from l47.app.paths import GGUF, Output, check_outputs
from l47.dumps import read_dump
from l47.dumps.chat import document_from_record, render_document
from l47.engine import gguf_export as GE  # called through the module: tests replace its functions
from l47.errors import L47Error
from l47.fileio import sha256_file, temp_dir
from l47.model import names
from l47.model.vocab import checkpoint_tokenizer_kv, require_specials, vocab_from_kv

TYPE_GROUPS = ("target", "head", "hc")  # --target-type (every blk.*.ffn_down_shexp), --head-type, --hc-type

CHECK_DOCS = (
    {"id": "export-check-plain",
     "text": "The river town kept its old bridge. Rather than rebuild it, the council repaired each stone, "
             "and by 1904 the road ran end to end again: 12 arches, 3 towers, one toll gate. "
             "Its sign reads किताब घर, café, naïve."},
    {"id": "export-check-chat",
     "messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "How long should I boil an egg?"},
                  {"role": "assistant", "content": "<think>\nA soft egg or a hard one?\n</think>\n\n"
                                                   "About 7 minutes for a firm yolk, then cool it right away."}]},
)


@dataclass(frozen=True)
class ExportArgs:
    hf_dir: Path
    out: Path
    pre: str | None = None  # pre-tokenizer name when tokenizer.json's cannot be detected
    target_type: str | None = None  # ggml type names; None = the seed file's layout (DESIGN §1)
    head_type: str | None = None
    hc_type: str | None = None
    device: str = "cpu"


@dataclass(frozen=True)
class CheckDoc:
    doc_id: str
    T: int
    max_abs: float  # |log p(next)| exported file (dump + tail forward) vs transformers at the exported types, nats
    zero_proxy: float  # the dump's own zero-proxy max |Δ| (tail forward vs engine), nats
    drift_f32: float  # |Δ log p| vs the f32 checkpoint (the cost of the tensor types; reported, not a bar)


@dataclass(frozen=True)
class ExportResult:
    out: str
    sha256: str
    n_tensors: int
    vocab_size: int
    tokenizer_size: int
    pre: str
    special_ids: dict[str, int]
    types: dict[str, int]  # ggml type id -> number of tensors
    tolerance: float
    docs: tuple[CheckDoc, ...] = field(default_factory=tuple)
    failure: str = ""

    @property
    def ok(self) -> bool:
        return not self.failure


def _type_overrides(model_types: dict[str, int], args: ExportArgs) -> dict[str, str]:
    """GGUF name -> type name for the groups the user named."""
    pick = {"target": lambda g: g.endswith(".ffn_down_shexp.weight") and names.layer_of(g) is not None,
            "head": lambda g: g == names.OUTPUT.gguf, "hc": GE._is_hc_matrix}
    out: dict[str, str] = {}
    for grp in TYPE_GROUPS:
        t = getattr(args, f"{grp}_type")
        if t is not None:
            out.update({g: t for g in model_types if pick[grp](g)})
    return out


def _check_type_names(args: ExportArgs) -> None:
    import gguf

    for grp in TYPE_GROUPS:
        t = getattr(args, f"{grp}_type")
        if t is not None and t not in gguf.GGMLQuantizationType.__members__:
            raise L47Error("l47 export", f"--{grp}-type", "a ggml type name (F32, F16, BF16, Q8_0, Q6_K, ...)",
                           repr(t))


def validate_inputs(args: ExportArgs):
    """(config, tokenizer metadata, vocab) — every input checked, nothing loaded or written yet."""
    out = Path(args.out)
    if out.exists():
        raise L47Error(out, "output", "a path that does not exist yet (export never overwrites)", "an existing file"
                       if out.is_file() else "an existing folder")
    if not out.parent.is_dir():
        raise L47Error(out, "output folder", "an existing folder", f"no folder {out.parent}")
    _check_type_names(args)
    cfg = GE.read_hf_config(args.hf_dir)
    GE.check_checkpoint_weights(args.hf_dir, cfg)  # headers: every parameter covered, nothing extra, shapes, complete
    kv = checkpoint_tokenizer_kv(args.hf_dir, int(cfg.vocab_size), args.pre)
    vocab = vocab_from_kv(kv, str(Path(args.hf_dir) / "tokenizer.json"))
    require_specials(vocab, why="the chat template and the audit's turn ends")
    return cfg, kv, vocab


def export_nbytes(args: ExportArgs, cfg) -> int | None:
    """Bytes of the GGUF `run_export` writes, from the checkpoint's safetensors headers (names and shapes; no
    tensor read): each tensor at the type it is exported as (the seed layout, F32 for every tensor the name table
    does not map one to one, e.g. per-expert weights fused on load), plus the metadata (at most tokenizer.json's
    and config.json's sizes + 1 MiB). None when the weights are not safetensors files."""
    import math

    import gguf
    from safetensors import safe_open

    hf = Path(args.hf_dir)
    files = sorted(hf.glob("*.safetensors"))
    if not files:
        return None
    table = names.hf_to_gguf_map(int(cfg.num_hidden_layers))
    shapes: dict[str, tuple[int, ...]] = {}
    unmapped = 0  # elements of tensors written in another form (fused), at F32
    for f in files:
        with safe_open(f, "np") as st:  # the header only
            for k in st.keys():
                shp = tuple(st.get_slice(k).get_shape())
                g = table.get(k)
                if g is None:
                    unmapped += math.prod(shp)
                else:
                    shapes.setdefault(g, shp)
    over = _type_overrides({g: 0 for g in shapes}, args)
    total = 4 * unmapped
    for g, shp in shapes.items():
        t = GE._type_id(over[g], "l47 export", g) if g in over else GE.seed_type(g, shp)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
        total += -(-math.prod(shp) // block) * size + 32  # + alignment
    meta = sum(p.stat().st_size for p in (hf / "tokenizer.json", hf / "config.json") if p.is_file())
    return total + meta + (1 << 20)


def _logp_next(model, ids: list[int]) -> np.ndarray:
    """log p(tokens[t+1] | tokens[:t+1]) [T] f64 from the model's f32 logits."""
    import torch

    with torch.no_grad():
        t = torch.tensor([ids])
        z = model(t).logits[0, :-1].double()  # [T, V] f64 (small check documents only)
        return (z.gather(1, t[0, 1:, None])[:, 0] - torch.logsumexp(z, -1)).numpy()


def _rendered(vocab) -> list:
    """The check documents as `l47 dump` renders them with the exported vocabulary."""
    return [render_document(document_from_record(d, f"export check [{i}]"), vocab) for i, d in enumerate(CHECK_DOCS)]


def _check_tokenizer(hf_dir: Path, rendered) -> None:
    """Each rendered check document's ids equal the checkpoint's tokenizer.json run by `tokenizers` itself."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(Path(hf_dir) / "tokenizer.json"))
    for r, d in zip(rendered, CHECK_DOCS):
        want = tk.encode(r.text, add_special_tokens=False).ids
        if list(r.tokens) != list(want):
            k = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(want), len(r.tokens)))
            raise L47Error(Path(hf_dir) / "tokenizer.json", f"tokenisation of check document {d['id']!r}",
                           f"the exported vocabulary's ids (first difference at token {k})",
                           f"{len(want)} ids from tokenizers vs {len(r.tokens)} (wrong --pre or normalizer?)")


def run_export(args: ExportArgs, log: Callable[[str], None] | None = None) -> ExportResult:
    """Export, check, keep (or remove and report the failure). Raises L47Error on bad input (nothing written)."""
    import gguf
    import torch

    say = log or (lambda m: None)
    out = Path(args.out)
    cfg, kv, vocab = validate_inputs(args)
    rendered = _rendered(vocab)
    _check_tokenizer(args.hf_dir, rendered)
    say(f"tokenizer: {vocab.size:,} ids (tokenizer.json: {sum(t != 5 for t in kv[names.K_TOK_TYPES]):,}), "
        f"pre-tokenizer {kv[names.K_TOK_PRE]}, specials "
        + ", ".join(f"{s} {i}" for s, i in vocab.special_ids.items()))

    nbytes = export_nbytes(args, cfg)
    if nbytes is not None:  # room for the file on its disk, before the checkpoint is loaded
        check_outputs([Output(out, GGUF, "OUT", nbytes=nbytes, nbytes_what="the exported GGUF (checkpoint "
                              "tensors at the export types + metadata)")], [(args.hf_dir, "checkpoint")])
    model = GE.load_hf(args.hf_dir, device=args.device)
    types = GE.export_types(model, _type_overrides(GE.export_types(model), args))
    partial = out.with_name(f".{out.name}.partial")
    tol = dumping.DEFAULT_TOLERANCE["hf"]
    try:
        f32 = [_logp_next(model, list(r.tokens)) for r in rendered]  # [T] f64 each
        say(f"writing {len(types)} tensors ({cfg.num_hidden_layers} layers, n {cfg.hidden_size}, "
            f"V {cfg.vocab_size}) -> {out}")
        GE.export_gguf(model, partial, tokenizer_kv=kv, types={g: t for g, t in types.items()})
        GE.round_trip_in_place(model, types)
        ref = [_logp_next(model, list(r.tokens)) for r in rendered]  # transformers at the exported types
        del model
        say("checking: l47 dump (hf engine, exact policy) on the exported file vs transformers on the checkpoint")
        with temp_dir("l47-export-check-") as tmp:
            src = Path(tmp) / "check.jsonl"
            src.write_text("".join(json.dumps(d) + "\n" for d in CHECK_DOCS), encoding="utf-8")
            job = dumping.DumpJob(partial, src, Path(tmp) / "dumps", policy="exact", device=args.device,
                                  tolerance=tol)
            summary = dumping.run_dump(job)
            dumping._ENGINE_CACHE.clear()
            docs, failure = [], ""
            for r, res, want, base in zip(rendered, summary.results, ref, f32):
                if res.status != dumping.STATUS_WRITTEN:
                    failure = failure or f"{res.doc_id}: {res.status}: {res.message}"
                    continue
                d = read_dump(res.path)
                got = np.asarray(d.ref_logp, dtype=np.float64)  # [T]
                if list(np.asarray(d.tokens)) != list(r.tokens):
                    failure = failure or f"{res.doc_id}: the dump's tokens differ from the rendered check document"
                    continue
                mx = float(np.abs(got - want).max())
                docs.append(CheckDoc(res.doc_id, res.T, mx, float(res.max_abs), float(np.abs(got - base).max())))
                if mx > tol:
                    failure = failure or (f"{res.doc_id}: max |Δ log p| {mx:.3e} nats between the exported file and "
                                          f"transformers on the checkpoint > tolerance {tol:.0e}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    counts: dict[str, int] = {}
    for t in types.values():
        k = gguf.GGMLQuantizationType(t).name
        counts[k] = counts.get(k, 0) + 1
    tok_size = sum(t != 5 for t in kv[names.K_TOK_TYPES])
    base = dict(out=str(out), n_tensors=len(types), vocab_size=int(cfg.vocab_size), tokenizer_size=tok_size,
                pre=kv[names.K_TOK_PRE], special_ids=dict(vocab.special_ids), types=counts, tolerance=tol,
                docs=tuple(docs))
    if failure:
        partial.unlink(missing_ok=True)
        return ExportResult(sha256="", failure=failure, **base)
    if out.exists():  # appeared while we worked: never overwrite
        partial.unlink(missing_ok=True)
        raise L47Error(out, "output", "a path that does not exist yet (export never overwrites)", "created meanwhile")
    os.replace(partial, out)
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return ExportResult(sha256=sha256_file(out), **base)


def print_export(res: ExportResult, console) -> None:
    """The check's table (fits 80 columns) and the verdict line."""
    from rich.table import Table

    t = Table(title=f"export check (tolerance {res.tolerance:.0e} nats)")
    for c in ("document", "T", "max |Δ| vs hf", "zero-proxy", "f32 drift"):
        t.add_column(c, justify="left" if c == "document" else "right")
    for d in res.docs:
        t.add_row(d.doc_id, str(d.T), f"{d.max_abs:.1e}", f"{d.zero_proxy:.1e}", f"{d.drift_f32:.1e}")
    console.print(t)
    console.print("f32 drift: |Δ log p| between the f32 checkpoint and the file's tensor types (not a bar)",
                  highlight=False)
    if res.ok:
        types = ", ".join(f"{k} {v}" for k, v in sorted(res.types.items()))
        console.print(f"[green]ok[/]: wrote {res.out} ({res.n_tensors} tensors: {types}; V {res.vocab_size:,}, "
                      f"tokenizer {res.tokenizer_size:,} ids, pre {res.pre}); sha256 {res.sha256}", highlight=False)
    else:
        console.print(f"[red]export check FAILED[/]: {res.failure}; nothing written to {res.out}", highlight=False)
