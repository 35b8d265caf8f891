"""A transformers Qwen4Exp <-> a whole-model qwen4exp GGUF with the seed file's tensor types.

`export_gguf` writes every tensor of a `Qwen4ExpForCausalLM` under its GGUF name (l47/model/names.py), with the types
of the seed's file (DESIGN §1): every `blk.*.ffn_down_shexp` Q8_0, `output.weight` Q6_K (Q8_0 when n is not a
multiple of 256), every `hc_*` / `output_hc_*` matrix BF16, the hyper-connection norms F32 folded (GGUF stores
1 + w, HF stores w), everything else F32. The transformers config travels as JSON (`l47.hf_config`) so
`load_hf_from_gguf` can rebuild the model; it loads every tensor through the runtime weight policy
(`l47.model.weights.runtime_tensor`), so the `hf` engine built from a GGUF and the exact tail forward see the same
f32 weights.

Notation for tensor shapes (LOGICAL order, as l47.model.gguf_io returns them = the torch parameter's shape):
    n   hidden size        f   shared-expert width       hc  hyper-connection streams
    r   HC low rank        V   vocabulary                E   routed experts

Precision: quantisation (BF16 / Q8_0 / Q6_K) goes through l47.model.quants (ggml reference rules); dequantised values
are f32; un-folding a norm (stored − 1) is one f32 subtraction, exact when the stored value is in [0.5, 2]
(Sterbenz), otherwise rounded to the nearest f32.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from l47.errors import L47Error
from l47.model import names
from l47.model.gguf_io import open_gguf, write_gguf
from l47.model.quants import dequantize, quantize  # ggml reference codecs (BF16, Q8_0, Q6_K, ...)
from l47.model.weights import runtime_tensor

F32 = int(gguf.GGMLQuantizationType.F32)
F16 = int(gguf.GGMLQuantizationType.F16)
BF16 = int(gguf.GGMLQuantizationType.BF16)
Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
Q6_K = int(gguf.GGMLQuantizationType.Q6_K)
_QK_K = 256  # K-quant super-block

HF_MODEL_TYPE = "qwen4_exp_text"
EXPORTER_NAME = "l47-export"


def _is_hc_matrix(gguf_name: str) -> bool:
    """`hc_*` / `output_hc_*` tensors other than the norms (BF16 in the seed's file)."""
    return (gguf_name.startswith("output_hc_") or ".hc_" in gguf_name) and not names.is_folded_norm(gguf_name)


def seed_type(gguf_name: str, shape: tuple[int, ...]) -> int:
    """ggml type of a tensor in the seed's file layout (DESIGN §1)."""
    if names.layer_of(gguf_name) is not None and gguf_name == names.target_tensor(names.layer_of(gguf_name)):
        return Q8_0
    if gguf_name == names.OUTPUT.gguf:
        return Q6_K if shape[-1] % _QK_K == 0 else Q8_0
    if _is_hc_matrix(gguf_name):
        return BF16
    return F32


def _type_id(t, where: str, field: str) -> int:
    if isinstance(t, str):
        try:
            return int(gguf.GGMLQuantizationType[t])
        except KeyError:
            raise L47Error(where, field, "a ggml type name (F32, F16, BF16, Q8_0, Q6_K, ...)", repr(t)) from None
    return int(t)


def _encode(w: torch.Tensor, gtype: int, name: str) -> np.ndarray:
    """f32 tensor (LOGICAL shape) -> raw bytes of `gtype`: uint8 [rows, row_nbytes] (1-D: [nbytes])."""
    w = w.detach().to(torch.float32).contiguous().cpu()  # f32
    if gtype == F32:
        return w.numpy().reshape(-1).view(np.uint8)
    if gtype == F16:
        return w.to(torch.float16).numpy().reshape(-1).view(np.uint8)

    rows = w.reshape(-1, w.shape[-1]) if w.ndim else w.reshape(1, 1)  # [rows, cols]
    return np.asarray(quantize(rows, gtype, name).cpu().numpy(), dtype=np.uint8)


# config.json key -> the GGUF hyper-parameter written from it (`_hparams_kv`). These must come from the checkpoint's
# own config.json: transformers would fill a missing one with its default, and the GGUF would carry a value the
# checkpoint never had (a missing dimension shows up as a tensor shape mismatch, but e.g. the experts used per
# token or the norm epsilon would not).
HPARAM_KEYS: dict[str, tuple[str, type]] = {
    "num_hidden_layers": (names.K_BLOCK_COUNT, int),
    "hidden_size": (names.K_EMBED, int),
    "shared_expert_intermediate_size": (names.K_SHEXP_FF, int),
    "moe_intermediate_size": (names.K_EXPERT_FF, int),
    "num_experts": (names.K_EXPERT_COUNT, int),
    "num_experts_per_tok": (names.K_EXPERT_USED, int),
    "hc_count": (names.K_HC_COUNT, int),
    "hc_lowrank": (names.K_HC_LOWRANK, int),
    "rms_norm_eps": (names.K_RMS_EPS, float),
    "vocab_size": (names.K_VOCAB, int),
}


def _hparams_kv(cfg) -> tuple[dict, dict]:
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    kv = {names.KEY_ARCH: names.ARCH, names.KEY_NAME: EXPORTER_NAME}
    types = {}
    for attr, (k, typ) in HPARAM_KEYS.items():
        kv[names.key(k)] = typ(getattr(cfg, attr))
        types[names.key(k)] = u32 if typ is int else f32
    kv[names.K_HF_CONFIG] = cfg.to_json_string(use_diff=False)
    return kv, types


_TOKENIZER_TYPES = {
    names.K_TOK_EOS: gguf.GGUFValueType.UINT32,
    names.K_TOK_BOS: gguf.GGUFValueType.UINT32,
    names.K_TOK_PAD: gguf.GGUFValueType.UINT32,
}


@torch.no_grad()
def export_gguf(model, path, *, tokenizer_kv: dict | None = None, types: dict | None = None) -> Path:
    """Write the whole model as a qwen4exp GGUF (atomic). `types` overrides the ggml type of tensors by GGUF name
    (type id or name, e.g. {"output.weight": "Q8_0"}); `tokenizer_kv` adds the `tokenizer.*` metadata as is."""
    path = Path(path)
    cfg = model.config
    if getattr(cfg, "model_type", None) != HF_MODEL_TYPE:
        raise L47Error("export_gguf", "model.config.model_type", repr(HF_MODEL_TYPE),
                       repr(getattr(cfg, "model_type", None)))
    overrides = {k: _type_id(v, str(path), f"types[{k!r}]") for k, v in (types or {}).items()}
    table = names.hf_to_gguf_map(int(cfg.num_hidden_layers))
    tensors, seen = [], set()
    for hf, p in model.state_dict().items():
        gname = table.get(hf)
        if gname is None:
            raise L47Error("export_gguf", f"parameter {hf}", "a tensor in l47/model/names.py's table", "no GGUF name")
        if gname in seen:  # tied weights appear once per name
            continue
        seen.add(gname)
        shape = tuple(p.shape)  # LOGICAL = torch shape
        w = p.detach().float()
        if names.is_folded_norm(gname):
            w = 1.0 + w  # [hc*n] GGUF stores the folded 1 + w (F32)
        gtype = overrides.pop(gname, None)
        if gtype is None:
            gtype = seed_type(gname, shape)
        tensors.append((gname, gtype, shape, _encode(w, gtype, gname)))
    if overrides:
        raise L47Error(str(path), "types", "names of tensors of this model", ", ".join(sorted(overrides)))
    kv, kv_types = _hparams_kv(cfg)
    for k, v in (tokenizer_kv or {}).items():
        kv[k] = v
        if k in _TOKENIZER_TYPES:
            kv_types[k] = _TOKENIZER_TYPES[k]
    return write_gguf(path, kv, kv_types, tensors)


# ----------------------------------------------------------------------------------------------------------
# loading


def hf_config_from_gguf(g):
    """The transformers config stored by `export_gguf` (metadata `l47.hf_config`)."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    raw = g.kv.get(names.K_HF_CONFIG)
    if raw is None:
        raise L47Error(g.path, f"metadata {names.K_HF_CONFIG}", "the transformers config JSON (written by "
                       "l47's exporter; the hf engine cannot rebuild a model without it)", "missing")
    try:
        d = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise L47Error(g.path, f"metadata {names.K_HF_CONFIG}", "a JSON object", f"unparsable ({e})") from None
    if not isinstance(d, dict) or d.get("model_type") != HF_MODEL_TYPE:
        raise L47Error(g.path, f"metadata {names.K_HF_CONFIG}.model_type", repr(HF_MODEL_TYPE),
                       repr(d.get("model_type") if isinstance(d, dict) else d))
    return Qwen4ExpTextConfig.from_dict(d)


def _gguf_state_dict(g, cfg, policy: str, device) -> dict[str, torch.Tensor]:
    """HF state dict (f32) from the GGUF's tensors under `policy`; refuses missing or unexpected tensors."""
    L_count = int(cfg.num_hidden_layers)
    table = names.hf_to_gguf_map(L_count)
    r, hc = int(cfg.hc_lowrank), int(cfg.hc_count)
    used: set[str] = set()
    sd: dict[str, torch.Tensor] = {}

    def take(gname: str) -> torch.Tensor:
        used.add(gname)
        w = runtime_tensor(g, gname, policy, device)  # f32, runtime value
        return w - 1.0 if names.is_folded_norm(gname) else w  # HF stores w, GGUF 1 + w

    for hf, gname in table.items():
        if gname in g.tensors:
            sd[hf] = take(gname)
    # merged layout: rows 0..r-1 of hc_ffn_down_inject are the down projection, rows r..r+hc-1 the inject rows
    for L in range(L_count):
        merged = names.gguf_name(names.FFN_HC_DOWN_INJECT, L)
        if merged in g.tensors:
            w = take(merged)  # [r + hc, hc*n]
            sd.setdefault(names.hf_name(names.FFN_HC_DOWN, L), w[:r])
            sd.setdefault(names.hf_name(names.FFN_HC_INJECT, L), w[r:r + hc])
    down = names.OUTPUT_HC_DOWN.hf
    if down in sd:
        sd[down] = sd[down][:r]  # some files carry more rows than the low rank; rows 0..r-1 are used
    extra = sorted(set(g.tensors) - used)
    if extra:
        raise L47Error(g.path, f"tensor {extra[0]}", "only tensors the transformers Qwen4Exp has (the hf engine "
                       "would silently ignore it)", f"{len(extra)} such tensor(s): {', '.join(extra[:4])}")
    return sd


@torch.no_grad()
def load_hf_from_gguf(path, policy: str = "strata", device="cpu"):
    """Rebuild the transformers model from a GGUF written by `export_gguf`, every tensor dequantised under the
    runtime weight `policy` ("strata": BF16 hc_* -> Q8_0 -> f32; "exact": file values), norms un-folded."""
    from transformers import Qwen4ExpForCausalLM

    g = open_gguf(path)
    if g.arch() != names.ARCH:
        raise L47Error(g.path, f"metadata {names.KEY_ARCH}", repr(names.ARCH), repr(g.arch()))
    cfg = hf_config_from_gguf(g)
    sd = _gguf_state_dict(g, cfg, policy, device)
    model = Qwen4ExpForCausalLM(cfg).to(device=device, dtype=torch.float32).eval()
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    if missing:
        raise L47Error(g.path, f"tensor for {missing[0]}", "present", f"missing ({len(missing)} parameters)")
    for k, v in sd.items():
        if v.numel() != want[k].numel():
            raise L47Error(g.path, f"tensor for {k}", f"{tuple(want[k].shape)}", f"{tuple(v.shape)}")
        sd[k] = v.reshape(want[k].shape).contiguous()
    model.load_state_dict(sd, strict=True)
    return model


CONFIG_FILE = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def read_hf_config(path):
    """The Qwen4Exp text config of a transformers checkpoint folder, validated before anything is loaded:
    the folder, its config.json (JSON, model_type qwen4_exp_text) and at least one weight file."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    path = Path(path)
    if not path.is_dir():
        raise L47Error(path, "checkpoint", "a transformers checkpoint folder (config.json, weights, tokenizer.json)",
                       "not a folder" if path.exists() else "nothing at that path")
    cj = path / CONFIG_FILE
    if not cj.is_file():
        raise L47Error(path, CONFIG_FILE, "a transformers checkpoint folder", f"no {CONFIG_FILE}")
    try:
        d = json.loads(cj.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise L47Error(cj, "JSON", "a JSON object", f"unparsable ({e})") from None
    if not isinstance(d, dict) or d.get("model_type") != HF_MODEL_TYPE:
        found = d.get("model_type") if isinstance(d, dict) else type(d).__name__
        raise L47Error(cj, "model_type", f"{HF_MODEL_TYPE!r} (a Qwen4ExpForCausalLM text checkpoint)", repr(found))
    if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
        raise L47Error(path, "weights", f"*{' or *'.join(WEIGHT_SUFFIXES)} weight files", "none")
    for k, (_, typ) in HPARAM_KEYS.items():
        v = d.get(k)
        if v is None:
            raise L47Error(cj, k, f"{'an integer' if typ is int else 'a number'} (a hyper-parameter the GGUF "
                           "carries; never transformers' default)", "missing")
        ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) if typ is int else \
            (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1)
        if not ok:
            raise L47Error(cj, k, "a positive integer" if typ is int else "a number in (0, 1)", repr(v))
    try:
        return Qwen4ExpTextConfig.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise L47Error(cj, "config", "a valid Qwen4Exp text config", f"{type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# the checkpoint's weights, checked before anything is loaded

_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_ST_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own header cap
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def safetensors_shapes(path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in one safetensors file, from its header only (no tensor read). Refuses
    (L47Error naming the file and the field) a file that is not a complete safetensors file: a header length past
    the end, a header that is not a JSON object of {dtype, shape, data_offsets}, offsets that do not match the
    shape, overlap, or leave bytes missing (a truncated file) or unaccounted for."""
    import math
    import struct

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise L47Error(path, "header", "a safetensors file (8-byte header length)", f"{size} bytes")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(_ST_MAX_HEADER, size - 8):
                raise L47Error(path, "header length", f"<= {min(_ST_MAX_HEADER, size - 8)} bytes (the file's size)",
                               f"{hlen} (truncated, or not a safetensors file)")
            raw = f.read(hlen)
    except OSError as e:
        raise L47Error(path, "weights file", "a readable safetensors file", f"{type(e).__name__}: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise L47Error(path, "header", "a JSON object", f"unparsable ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise L47Error(path, "header", "a JSON object", type(header).__name__)
    header.pop("__metadata__", None)
    data = size - 8 - hlen
    shapes: dict[str, tuple[int, ...]] = {}
    spans = []
    for name, info in header.items():
        try:
            tag, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            ok = tag in _ST_ITEMSIZE and isinstance(shape, list) and all(
                type(x) is int and x >= 0 for x in [*shape, b, e])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise L47Error(path, f"header entry {name}", "{dtype, shape, data_offsets} of a safetensors dtype",
                           f"{info!r:.80}")
        nb = math.prod(shape) * _ST_ITEMSIZE[tag]
        if e - b != nb or b > e:
            raise L47Error(path, f"tensor {name}", f"{nb} bytes ({tag} {tuple(shape)})", f"data_offsets [{b}, {e}]")
        if e > data:
            raise L47Error(path, f"tensor {name}", f"bytes [{b}, {e}) inside the {data}-byte data section",
                           "past the end of the file (truncated)")
        shapes[name] = tuple(shape)
        spans.append((b, e))
    spans.sort()
    end = 0
    for b, e in spans:
        if b < end:
            raise L47Error(path, "data_offsets", "disjoint tensors", f"overlap at byte {b}")
        end = e
    if end != data:
        raise L47Error(path, "data section", f"{end} bytes (the tensors the header lists)",
                       f"{data} bytes (truncated, or a file not written as safetensors)")
    return shapes


def checkpoint_weight_files(path) -> list[Path]:
    """The safetensors files transformers loads for this folder (the index's shards, else model.safetensors);
    refuses a checkpoint whose weights are only pickle files (l47 reads no pickle) or whose index names a missing
    shard."""
    path = Path(path)
    idx = path / SAFETENSORS_INDEX
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({str(v) for v in wm.values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise L47Error(idx, "weight_map", "a JSON object {tensor: shard file}", f"unreadable ({e!r:.80})") \
                from None
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise L47Error(idx, "weight_map", "shard files present in the folder", f"missing {', '.join(missing)}")
        return [path / f for f in files]
    if (path / SAFETENSORS_SINGLE).is_file():
        return [path / SAFETENSORS_SINGLE]
    raise L47Error(path, "weights", f"{SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} (l47 reads no pickle weights)",
                   ", ".join(sorted(p.name for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)) or "none")


def expected_checkpoint_tensors(cfg) -> dict[str, tuple[tuple[int, ...], dict[str, tuple[int, ...]]]]:
    """model parameter -> (its shape, the tensors a checkpoint may hold it as: transformers' own reverse
    conversion, e.g. the fused experts as one tensor per expert and projection), for the model `cfg` builds
    (on the meta device: nothing allocated). Tied parameters (stored once) are left out."""
    from transformers import Qwen4ExpForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    out = {}
    for k, t in model.state_dict().items():
        if k in tied:
            continue
        alt = {a: tuple(v.shape) for a, v in revert_weight_conversion(model, {k: t}).items()}
        out[k] = (tuple(t.shape), alt)
    return out


def check_checkpoint_weights(path, cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model `cfg` builds is in the checkpoint's safetensors files with its shape (as
    itself, or as the pieces transformers' conversion joins), and every tensor of the files is one of them: else
    one L47Error naming the missing, unexpected and shape-mismatched tensors (first few of each and their counts).
    Headers only; returns name -> shape of the files' tensors."""
    path = Path(path)
    have: dict[str, tuple[int, ...]] = {}
    for f in checkpoint_weight_files(path):
        for k, shp in safetensors_shapes(f).items():
            if k in have:
                raise L47Error(f, f"tensor {k}", "each tensor in one file", "also in another shard")
            have[k] = shp
    missing, bad, used = [], [], set()
    for k, (shp, alt) in expected_checkpoint_tensors(cfg).items():
        if k in have:
            used.add(k)
            if have[k] != shp:
                bad.append(f"{k} {have[k]} (model {shp})")
            continue
        if alt.keys() != {k} and any(a in have for a in alt):  # held as pieces: each piece is checked
            used.update(a for a in alt if a in have)
            missing += [a for a in alt if a not in have]
            bad += [f"{a} {have[a]} (model {s})" for a, s in alt.items() if a in have and have[a] != s]
            continue
        missing.append(k)
    extra = sorted(set(have) - used)
    if missing or extra or bad:
        def part(what, xs):
            return f"{what} {len(xs)}: {', '.join(xs[:3])}{', ...' if len(xs) > 3 else ''}" if xs else ""
        found = "; ".join(p for p in (part("missing", missing), part("unexpected", extra),
                                      part("shape mismatch", bad)) if p)
        raise L47Error(path, "weights", "exactly the tensors of the model config.json describes, at their shapes",
                       found)
    return have


def load_hf(path, device="cpu"):
    """A local transformers checkpoint directory (no network), f32, eval mode."""
    from transformers import Qwen4ExpForCausalLM

    path = Path(path)
    cfg = read_hf_config(path)
    check_checkpoint_weights(path, cfg)  # every parameter from the checkpoint's own tensors, before loading
    try:
        model, info = Qwen4ExpForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                          output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise L47Error(path, "checkpoint", "a loadable Qwen4Exp checkpoint", f"{type(e).__name__}: {e}") from None
    require_strict_load(path, info)
    return model.to(device).eval()


def require_strict_load(path, info: dict) -> None:
    """transformers' own loading report must be empty: no parameter initialised at random, none ignored."""
    left = {k: sorted(v) for k, v in info.items() if v}
    if left:
        k, v = next(iter(left.items()))
        raise L47Error(path, f"weights ({k})", "none (every parameter from the checkpoint's own tensors)",
                       f"{len(v)}: {', '.join(map(str, v[:3]))}")


def export_types(model, types: dict | None = None) -> dict[str, int]:
    """GGUF name -> ggml type of every tensor `export_gguf` writes for this model (seed layout + overrides)."""
    overrides = {k: _type_id(v, "export", f"types[{k!r}]") for k, v in (types or {}).items()}
    table = names.hf_to_gguf_map(int(model.config.num_hidden_layers))
    out: dict[str, int] = {}
    for hf, p in model.state_dict().items():
        g = table.get(hf)
        if g is not None and g not in out:
            out[g] = overrides.get(g, seed_type(g, tuple(p.shape)))
    bad = sorted(set(overrides) - set(out))
    if bad:
        raise L47Error("export", "types", "names of tensors of this model", ", ".join(bad))
    return out


@torch.no_grad()
def round_trip_in_place(model, types: dict[str, int]) -> None:
    """Replace every parameter by its value after the export's encoding and decoding (ggml codecs of
    l47.model.quants; norms folded 1 + w and un-folded in f32, as the file stores them): the checkpoint as the
    exported file holds it, computed without reading the file (the export's independent reference)."""
    table = names.hf_to_gguf_map(int(model.config.num_hidden_layers))
    for hf, p in model.state_dict().items():
        g = table[hf]
        w = p.detach().float()
        folded = names.is_folded_norm(g)
        if folded:
            w = 1.0 + w  # [hc*n] f32, as stored
        raw = _encode(w, types[g], g)
        v = dequantize(torch.from_numpy(np.ascontiguousarray(raw)), types[g], tuple(p.shape), g, "cpu")
        v = v.reshape(p.shape).float()
        p.copy_(v - 1.0 if folded else v)
