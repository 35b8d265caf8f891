"""The `hf` engine: transformers' Qwen4Exp as the reference engine that produces dumps (DESIGN §3.1).

`capture` runs one document through the model (prompt path: one full-sequence forward) and records, with
forward hooks on layer L (default: the last), exactly the states the exact tail forward consumes (DESIGN §1):

    R    `hyper_input` returned by layer L's `mlp_hyper_connection`: the streams after the attention write,
         [T, hc·n] reshaped stream-major to [T, hc, n]
    inj  output of `mlp_hyper_connection.block_inject_weight` on hc_norm(R): the RAW inject logits (no /hc, no
         sigmoid) — convention "raw"
    hh   input of `mlp.shared_expert.down_proj`: silu(W_sg·XF) ⊙ (W_su·XF)
    sgv  output of `mlp.shared_expert_gate` (pre-sigmoid)
    yr   output of `mlp.experts`: the routed experts' weighted sum, before the shared expert is added
plus the model's own next-token statistics (`ref_*`) for the zero-proxy check. `generate` samples a
continuation with a seeded torch.Generator (manual loop over the KV cache, deterministic for a seed).

Notation for tensor shapes:
    T   positions (row t is computed at tokens[t] and predicts tokens[t+1]; the last input row is dropped)
    n   hidden size     f   shared-expert width     hc  hyper-connection streams     V   vocabulary
    k   top-k of the reference statistics

Precision: the model runs in f32 (on CPU or CUDA); log-softmax of the reference logits in f64; arrays are
stored f32 (`ref_logits` f16, as the dump schema says). Capture and generation run under torch.inference_mode
(no autograd bookkeeping: the same kernels, the same bytes; ~5 % less CPU on the demo's dumps).
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from l47.engine.gguf_export import check_checkpoint_weights, read_hf_config, require_strict_load
from l47.errors import L47Error
from l47.fileio import sha256_file
from l47.model import names
from l47.model.gguf_io import open_gguf
from l47.model.weights import TailWeights

ENGINE_NAME = "hf"
INJ_CONVENTION = "raw"  # inj = inject_w · hc_norm(R); the forward applies 2σ(inj / hc)
HH_PRECISION = "f32"
REF_TOPK = 8
_CHUNK_FILES = 1 << 24


@dataclass(frozen=True)
class SamplerSettings:
    """Everything that determines a sampled continuation (recorded in the dump's provenance)."""

    max_new_tokens: int
    seed: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    stop_ids: tuple[int, ...] = ()


# ----------------------------------------------------------------------------------------------------------
# identity and settings


def model_id(path) -> str:
    """The `model` field of a dump: sha256 of a GGUF file; "hf:" + sha256 over a checkpoint directory's
    config.json and weight files (name + content hash, sorted) for a transformers checkpoint."""
    path = Path(path)
    if path.is_file():
        return open_gguf(path).sha256()
    files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    if not files:
        raise L47Error(path, "model path", "a GGUF file or a transformers checkpoint directory", "neither")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return "hf:" + h.hexdigest()


def engine_meta(model, *, source: str, policy: str | None) -> dict:
    """The dump's `engine` field: name, version and every setting that changes the numbers."""
    import transformers

    cfg = model.config
    p = next(model.parameters())
    return {
        "name": ENGINE_NAME,
        "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "settings": {
            "dtype": str(p.dtype).removeprefix("torch."),
            "device": compute_device_type(model),  # not the placement: it does not change the numbers
            "path": "prompt",  # one full-sequence forward per document
            "weights": source,  # "gguf" (dequantised under weight_policy) or "hf-checkpoint"
            "weight_policy": policy,
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
            "machine": platform.machine(),
        },
    }


# ----------------------------------------------------------------------------------------------------------
# placement across devices (accelerate, the transformers convention)

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's named strategies


@dataclass(frozen=True)
class Placement:
    """Where the model's layers live. device_map: None (one device: the `device` argument), a strategy name from
    DEVICE_MAPS, or an explicit {module name: device} map (values: GPU index, "cuda:i", "cpu", "disk");
    max_memory: {device: bytes or "70GiB"} caps per device ("cpu" = host RAM, "disk" = unlimited offload);
    offload_dir: the folder for layers placed on "disk"."""

    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_dir: str | None = None


def _device_key(k: str):
    return int(k) if str(k).isdigit() else str(k)


def parse_placement(device_map: str | None, max_memory: str | None, offload_dir=None,
                    where: str = "--device-map") -> Placement:
    """CLI strings -> Placement. device_map: a name from DEVICE_MAPS or a JSON object {module: device};
    max_memory: JSON ({"0": "70GiB", "cpu": "200GiB"}) or "0=70GiB,1=70GiB,cpu=200GiB"."""
    dm = None
    if device_map:
        if device_map in DEVICE_MAPS:
            dm = device_map
        else:
            try:
                dm = json.loads(device_map)
            except json.JSONDecodeError:
                dm = None
            if not isinstance(dm, dict) or not dm:
                raise L47Error(where, "device map", f"one of {list(DEVICE_MAPS)} or a JSON object "
                               '{"module.name": device}', repr(device_map))
            dm = {str(k): _device_key(v) if isinstance(v, str) else v for k, v in dm.items()}
    mm = None
    if max_memory:
        try:
            mm = json.loads(max_memory)
        except json.JSONDecodeError:
            mm = dict(kv.split("=", 1) for kv in max_memory.split(",") if "=" in kv) or None
        if not isinstance(mm, dict) or not mm:
            raise L47Error("--max-memory", "per-device caps", 'JSON {"0": "70GiB", "cpu": "200GiB"} or '
                           "0=70GiB,cpu=200GiB", repr(max_memory))
        mm = {_device_key(k): v for k, v in mm.items()}
        if dm is None:
            dm = "auto"  # transformers: max_memory alone means an automatic map under those caps
    if isinstance(dm, dict) and mm is not None:
        raise L47Error("--max-memory", "combination", "caps with a strategy name (auto, balanced, ...), not with "
                       "an explicit map", "both")
    return Placement(dm, mm, str(offload_dir) if offload_dir else None)


def _no_split(model) -> list[str]:
    return sorted(getattr(model, "_no_split_modules", None) or [])  # a decoder layer is never cut in two


def resolve_device_map(model, placement: Placement) -> dict:
    """The explicit {module: device} map for `placement` (accelerate's infer_auto_device_map for a strategy)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    dm = placement.device_map
    if isinstance(dm, dict):
        return dict(dm)
    mm = placement.max_memory
    if dm in ("balanced", "balanced_low_0"):
        mm = get_balanced_memory(model, max_memory=mm, no_split_module_classes=_no_split(model),
                                 low_zero=dm == "balanced_low_0")
    return dict(infer_auto_device_map(model, max_memory=mm, no_split_module_classes=_no_split(model)))


def place_model(model, placement: Placement | None):
    """Dispatch an f32 model (built on the CPU) over the devices of `placement` with accelerate's hooks: each
    module runs on its device (weights placed on "cpu"/"disk" are moved to the next GPU, or run on the CPU,
    when their turn comes), inputs move along, and the model's outputs come back to the input's device. The
    layer-L capture hooks (forward hooks on submodules) see the activations wherever the layer runs.
    None / no device_map: the model unchanged."""
    if placement is None or placement.device_map is None:
        return model
    from accelerate import dispatch_model

    dm = resolve_device_map(model, placement)
    if "disk" in dm.values() and not placement.offload_dir:
        raise L47Error("--device-map", "offload folder", "--offload-dir for modules placed on 'disk'",
                       f"{sum(v == 'disk' for v in dm.values())} module(s) on disk, no folder")
    unknown = sorted(set(dm) - {n for n, _ in model.named_modules()})
    if unknown:
        raise L47Error("--device-map", f"module {unknown[0]!r}", "a module name of the model (e.g. "
                       "model.layers.3, lm_head)", f"{len(unknown)} unknown name(s)")
    model = dispatch_model(model, device_map=dm, offload_dir=placement.offload_dir)
    model.hf_device_map = dm
    return model


def load_hf_placed(path, placement: Placement):
    """A local transformers checkpoint directory loaded straight onto its devices (from_pretrained with
    device_map / max_memory / offload_folder: weights go to their device shard by shard, never the whole model
    on the host), f32, eval mode."""
    from transformers import Qwen4ExpForCausalLM

    path = Path(path)
    check_checkpoint_weights(path, read_hf_config(path))  # strict: every parameter from the checkpoint's tensors
    try:
        model, info = Qwen4ExpForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                          device_map=placement.device_map,
                                                          max_memory=placement.max_memory,
                                                          offload_folder=placement.offload_dir,
                                                          output_loading_info=True)
    except (OSError, ValueError) as e:
        raise L47Error(path, "checkpoint", "a loadable Qwen4Exp checkpoint", f"{type(e).__name__}: {e}") from None
    require_strict_load(path, info)
    return model.eval()


def param_values(model, name: str) -> torch.Tensor:
    """A parameter's values wherever the device map put it: an offloaded one (left on the meta device) is read
    back from the weights map of the accelerate hook that loads it (on the nearest enclosing module)."""
    t = model.get_parameter(name)
    if t.device.type != "meta":
        return t
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:i])), "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            wm = getattr(h, "weights_map", None)
            key = ".".join(parts[i:])
            if wm is not None and key in wm:
                return wm[key]
    raise L47Error("device map", f"parameter {name}", "its values (on a device or in an offload map)",
                   "only a meta placeholder")


def _as_device(v) -> torch.device:
    if isinstance(v, int):
        return torch.device("cuda", v)
    return torch.device("cpu") if str(v) in ("disk", "meta") else torch.device(str(v))


def input_device(model) -> torch.device:
    """Where a forward's input ids go: the embedding's device under a device map (its execution device; "cpu"
    when it is offloaded), else the device of the model's parameters."""
    dm = getattr(model, "hf_device_map", None)
    if dm:
        emb = next((n for n, mod in model.named_modules() if mod is model.get_input_embeddings()), "")
        keys = [k for k in dm if k == "" or emb == k or emb.startswith(k + ".")]
        return _as_device(dm[max(keys, key=len)] if keys else next(iter(dm.values())))
    return next(model.parameters()).device


def compute_device_type(model) -> str:
    """"cuda" when any module runs on a GPU (offloaded modules run on the GPU too), else the parameters' type."""
    dm = getattr(model, "hf_device_map", None)
    if dm:
        return "cuda" if any(_as_device(v).type == "cuda" for v in dm.values()) else "cpu"
    return next(model.parameters()).device.type


# ----------------------------------------------------------------------------------------------------------
# capture


def _check_ids(model, ids, where: str, min_len: int) -> torch.Tensor:
    V = int(model.config.vocab_size)
    t = torch.as_tensor(list(ids), dtype=torch.long)
    if t.ndim != 1 or t.numel() < min_len:
        raise L47Error(where, "token ids", f"at least {min_len} tokens", f"{t.numel()}")
    bad = ((t < 0) | (t >= V)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise L47Error(where, f"token ids[{i}]", f"an id in [0, {V})", f"{int(t[i])}")
    return t


@torch.inference_mode()
def capture(model, input_ids, layer: int | None = None, *, ref_logits: bool = False, topk: int = REF_TOPK,
            where: str = "capture") -> dict[str, np.ndarray]:
    """Dump arrays of one document: tokens [T+1] int32, R [T, hc, n], inj [T, hc], hh [T, f], sgv [T], yr [T, n],
    ref_logp [T], ref_top_ids [T, k] int32, ref_top_logits [T, k] (all f32), optionally ref_logits [T, V] f16."""
    cfg = model.config
    n_layers, hc, n = int(cfg.num_hidden_layers), int(cfg.hc_count), int(cfg.hidden_size)
    L = n_layers - 1 if layer is None else int(layer)
    if not 0 <= L < n_layers:
        raise L47Error(where, "layer", f"0..{n_layers - 1}", str(layer))
    ids = _check_ids(model, input_ids, where, 2)
    dev = input_device(model)
    blk = model.model.layers[L]
    got: dict[str, torch.Tensor] = {}
    T1 = ids.numel()

    def put(name: str, x: torch.Tensor) -> None:  # batch of one: [1, T+1, ...] or [T+1, ...] -> [T+1, -1]
        got[name] = x.detach().float().reshape(T1, -1).clone()

    hooks = [
        # returns (mixed_input, hyper_input, injection_weights); hyper_input = the streams entering the FFN
        blk.mlp_hyper_connection.register_forward_hook(lambda m, i, o: put("R", o[1])),  # [T+1, hc*n]
        blk.mlp_hyper_connection.block_inject_weight.register_forward_hook(  # raw inject logits [T+1, hc]
            lambda m, i, o: put("inj", o)),
        blk.mlp.shared_expert.down_proj.register_forward_pre_hook(lambda m, i: put("hh", i[0])),  # [T+1, f]
        blk.mlp.shared_expert_gate.register_forward_hook(lambda m, i, o: put("sgv", o)),  # [T+1, 1]
        blk.mlp.experts.register_forward_hook(lambda m, i, o: put("yr", o)),  # [T+1, n]
    ]
    try:
        logits = model(ids[None].to(dev)).logits[0].float()  # [T+1, V] f32
    finally:
        for h in hooks:
            h.remove()
    missing = {"R", "inj", "hh", "sgv", "yr"} - set(got)
    if missing:
        raise L47Error(where, f"layer {L} hooks", "every capture hook to fire", f"{sorted(missing)} never fired")
    T = ids.numel() - 1
    tgt = ids[1:].to(dev)  # [T]
    z = logits[:T]  # [T, V] f32: the last row predicts nothing in the document
    lse = torch.cat([torch.logsumexp(z[i:i + 256].double(), -1) for i in range(0, T, 256)])  # [T] f64, by rows
    top_v, top_i = torch.topk(z, min(topk, z.shape[1]), dim=-1)  # [T, k]
    out = {
        "tokens": ids.numpy().astype(np.int32),  # [T+1]
        "R": got["R"][:T].reshape(T, hc, n),  # [T, hc, n] stream-major (c·n + d)
        "inj": got["inj"][:T],  # [T, hc] raw
        "hh": got["hh"][:T],  # [T, f]
        "sgv": got["sgv"][:T, 0],  # [T] pre-sigmoid
        "yr": got["yr"][:T],  # [T, n]
        "ref_logp": (z[torch.arange(T, device=dev), tgt].double() - lse).float(),  # [T] log p(next)
        "ref_top_ids": top_i.to(torch.int32),  # [T, k]
        "ref_top_logits": top_v,  # [T, k]
    }
    if ref_logits:
        out["ref_logits"] = z.half()  # [T, V] f16
    return {k: (v if isinstance(v, np.ndarray) else v.cpu().numpy()) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# generation


def _filter_logits(z: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """Temperature, top-k and top-p (nucleus) on rows of logits [..., V] (f64), each row on its own; removed
    entries → −inf. Row-wise ops only (division, top-k values, a stable order, softmax and cumsum along V, a
    scatter), so a row's result does not depend on the other rows of the batch.

    Top-p reads the row in descending order, ties by lower id (a stable sort). After a top-k cut only the m
    finite entries need ordering (m ≥ top_k: ties at the k-th value stay): they are taken with topk, put in id
    order, then stably sorted by value — the same first m entries as a stable sort of the whole row, whose
    other entries are −inf either way, so the sorted row handed to softmax is the same, bit for bit, without
    sorting all V (V = 248,320 at real size)."""
    z = z / s.temperature  # [B, V]
    V = z.shape[-1]
    m = V  # entries that can still be kept
    cand = None  # [B, m] ids of the kept entries, when every row keeps exactly top_k (no tie at the cut)
    if 0 < s.top_k < V:
        top = torch.topk(z, s.top_k, dim=-1)  # values [B, k] descending, indices [B, k]
        kth = top.values[..., -1:]  # [B, 1]
        kept = ((z >= kth) & (z > -torch.inf) & (z < torch.inf)).sum(-1)  # [B] finite entries the cut keeps
        m = int(kept.max())  # >= top_k
        if int(kept.min()) == m == s.top_k:  # every row keeps exactly its topk entries: z's other entries
            cand = top.indices  # are not read below (top-p gathers the candidates' values only)
        else:
            z = torch.where(z < kth, torch.full_like(z, -torch.inf), z)
    if s.top_p < 1.0:
        if m < V:
            if cand is None:  # ties at the k-th value: m > k entries kept in some row (z cut above)
                cand = torch.topk(z, m, dim=-1).indices
            ids = torch.sort(cand, dim=-1).values  # [B, m] candidates, by id
            head = torch.gather(ids, -1, torch.argsort(torch.gather(z, -1, ids), dim=-1, descending=True,
                                                       stable=True))  # [B, m] by value, ties by lower id
        else:
            head = torch.argsort(z, dim=-1, descending=True, stable=True)  # [B, V]
        zh = torch.gather(z, -1, head)  # [B, m] the sorted row's first m entries
        zs = torch.cat([zh, torch.full_like(z[..., :V - head.shape[-1]], -torch.inf)], -1)  # [B, V] sorted row
        p = torch.softmax(zs, -1)  # [B, V] f64
        keep = ((torch.cumsum(p, -1) - p) < s.top_p)[..., :head.shape[-1]]  # [B, m] smallest prefix ≥ top_p
        z = torch.full_like(z, -torch.inf).scatter_(-1, head, torch.where(keep, zh, torch.full_like(zh, -torch.inf)))
    elif cand is not None:  # top-k alone: the cut row
        z = torch.where(z < kth, torch.full_like(z, -torch.inf), z)
    return z


def sample_rows(z: torch.Tensor, settings, gens) -> list[int]:
    """One token per row of logits [B, V] under each row's sampler (f64 on the CPU, so a seed gives the same ids
    everywhere): rows that share a sampler are filtered together (row-wise ops), each row then draws with its
    own torch.Generator. A row's id depends only on its logits, its settings and its generator."""
    z = z.detach().double().cpu()  # [B, V] f64
    out = [0] * z.shape[0]
    groups: dict[tuple, list[int]] = {}
    for b, s in enumerate(settings):
        groups.setdefault((s.temperature, s.top_p, s.top_k), []).append(b)
    for rows in groups.values():
        s = settings[rows[0]]
        zr = z[rows]  # [b, V]
        if s.temperature <= 0:
            for b, t in zip(rows, torch.argmax(zr, -1).tolist()):
                out[b] = int(t)
            continue
        p = torch.softmax(_filter_logits(zr, s), -1)  # [b, V] f64
        for j, b in enumerate(rows):
            out[b] = draw(p[j], gens[b])
    return out


_DRAW_LOOP_MAX = 512  # candidates beyond which `draw` leaves the row to torch.multinomial itself


def draw_from_uniform(p: torch.Tensor, u: torch.Tensor, cand: torch.Tensor | None = None) -> int:
    """argmax_i p_i / q_i with q_i = −log1p(−u_i): torch.multinomial's draw (n_samples = 1, CPU) from its uniform
    variates u [V] f64 (the exponential variates it makes are q). Only entries with p_i > 0 can win (p_i / q_i >
    0; the others give 0), so q is computed there only (`cand`: their ids, ascending; None = found here), each
    with the C library's scalar log1p as torch's CPU exponential kernel computes it, and divided in f64; ties go
    to the lowest id (torch.argmax's first maximum). A u_i of exactly 0 (probability 2^-53 per entry) makes q_i = 0
    and p_i / q_i NaN or inf: then every q is computed and torch.argmax decides, as in torch."""
    import math

    c = torch.nonzero(p, as_tuple=False).flatten() if cand is None else cand  # [m] int64
    if not c.numel() or float(u.min()) == 0.0:
        q = torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64)  # [V]
        return int(torch.argmax(p / q))
    best, arg = -1.0, 0
    for i, pi, ui in zip(c.tolist(), p.index_select(0, c).tolist(), u.index_select(0, c).tolist()):
        r = pi / (-math.log1p(-ui))  # f64, as at::div of the two f64 tensors
        if r > best:  # strict: the first maximum wins
            best, arg = r, i
    return arg


def draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """`int(torch.multinomial(p, 1, generator=gen))` for one row of probabilities p [V] f64 on the CPU: the same
    id and the same generator state after (tests/test_generate_batch.py compares both over many rows and seeds).
    torch draws V exponential variates for it (−log1p(−u) of V uniforms, one 64-bit number each from `gen`);
    here the V uniforms are drawn (the same numbers, ~4× cheaper than the exponentials) and the exponential is
    taken only where p > 0 — after top-k / top-p, a few dozen entries of V (`draw_from_uniform`). Rows with more
    candidates than _DRAW_LOOP_MAX, and rows torch.multinomial refuses (its error), go to torch.multinomial."""
    import math

    if p.dtype != torch.float64 or p.ndim != 1 or p.device.type != "cpu":
        return int(torch.multinomial(p, 1, generator=gen))
    c = torch.nonzero(p, as_tuple=False).flatten()  # [m] ids with p != 0, ascending
    total = float(p.sum())  # NaN / inf entries make it non-finite
    if c.numel() > _DRAW_LOOP_MAX or not (math.isfinite(total) and total > 0) or float(p.min()) < 0:
        return int(torch.multinomial(p, 1, generator=gen))
    u = torch.empty_like(p).uniform_(generator=gen)  # [V] f64: the variates torch's exponential_ transforms
    return draw_from_uniform(p, u, c)


def sample_next(z: torch.Tensor, s: SamplerSettings, gen: torch.Generator) -> int:
    """One token from logits [V] under the sampler (`sample_rows` on one row)."""
    return sample_rows(z.reshape(1, -1), [s], [gen])[0]


def _check_settings(s: SamplerSettings, where: str) -> None:
    if s.max_new_tokens < 0:
        raise L47Error(where, "max_new_tokens", ">= 0", str(s.max_new_tokens))
    if not 0 < s.top_p <= 1:
        raise L47Error(where, "top_p", "in (0, 1]", str(s.top_p))


@torch.inference_mode()
def generate(model, prompt_ids, settings: SamplerSettings, where: str = "generate") -> list[int]:
    """Sample up to `settings.max_new_tokens` ids after `prompt_ids` (the stop id, when hit, is included and ends
    it). Deterministic for a seed: one torch.Generator, sampling in f64 on the CPU, the KV cache on the decode
    path. The reference `generate_batch` is tested against."""
    s = settings
    _check_settings(s, where)
    ids = _check_ids(model, prompt_ids, where, 1)
    dev = input_device(model)
    gen = torch.Generator().manual_seed(s.seed)
    out: list[int] = []
    if s.max_new_tokens == 0:
        return out
    o = model(ids[None].to(dev), use_cache=True)
    for _ in range(s.max_new_tokens):
        nxt = sample_next(o.logits[0, -1], s, gen)
        out.append(nxt)
        if nxt in s.stop_ids or len(out) == s.max_new_tokens:
            break
        o = model(torch.tensor([[nxt]], device=dev), cache=o.cache, use_cache=True)
    return out


def batchable(model) -> bool:
    """Whether left-padded batched generation gives each prompt exactly its own computation: not for models with
    per-layer n-gram embeddings (PLE), whose n-gram context would see the padding as tokens."""
    return not getattr(model.config, "ple_layer_ids", None)


@torch.inference_mode()
def generate_batch(model, prompts, settings, where: str = "generate") -> list[list[int]]:
    """`generate` for several prompts at once: the prompts left-padded to one length (attention mask 0 on the
    padding, positions counted from each prompt's first token), one forward per step for the rows still
    sampling, each row sampled with its own seeded torch.Generator in f64 on the CPU (`sample_rows`). Same ids
    as `generate` one at a time for the same seeds (rows never interact: attention, the recurrent layers and
    routing are per row; padded states are zeroed). The prefill computes the head on its last position only
    (logits_to_keep=1: no [B, Lp, V]); those logits can differ from a full forward's last row in the last bits
    (≤ 5e-6 seen on the demo and model2: another matmul shape), and a draw (argmax of p / q) changes only where
    two candidates lie within that margin — none did on the demo's 181 prompts (docs/BENCHMARKS.md). A row that
    stops (stop id or its max_new_tokens) leaves the batch: its rows of the cache are dropped
    (Cache.reorder_cache), so the next steps cost only the live rows.

    prompts   list of token id lists [B]
    settings  one SamplerSettings per prompt (max_new_tokens, seed, temperature, top_p, top_k, stop_ids)
    """
    if len(prompts) != len(settings):
        raise L47Error(where, "settings", f"one per prompt ({len(prompts)})", str(len(settings)))
    for s in settings:
        _check_settings(s, where)
    ids = [_check_ids(model, p, where, 1) for p in prompts]
    out: list[list[int]] = [[] for _ in ids]
    rows = [b for b, s in enumerate(settings) if s.max_new_tokens > 0]  # the batch's rows -> prompt index
    if not rows:
        return out
    dev = next(model.parameters()).device
    Lp = max(int(ids[b].numel()) for b in rows)
    x = torch.zeros(len(rows), Lp, dtype=torch.long)  # [B, Lp] left-padded (id 0 under mask 0)
    mask = torch.zeros(len(rows), Lp, dtype=torch.long)  # [B, Lp] 1 on real tokens
    for j, b in enumerate(rows):
        x[j, Lp - ids[b].numel():] = ids[b]
        mask[j, Lp - ids[b].numel():] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, Lp] each prompt's own positions 0..len-1
    gens = [torch.Generator().manual_seed(s.seed) for s in settings]
    o = model(x.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=True,
              logits_to_keep=1)  # [B, 1, V]: the head on the last position only (no [B, Lp, V] at real V)
    last = pos[:, -1]  # [B] position of each row's last token
    while True:
        nxt = sample_rows(o.logits[:, -1], [settings[b] for b in rows], [gens[b] for b in rows])  # [B] ids
        keep = []
        for j, (b, t) in enumerate(zip(rows, nxt)):
            out[b].append(t)
            if t not in settings[b].stop_ids and len(out[b]) < settings[b].max_new_tokens:
                keep.append(j)
        if not keep:
            return out
        if len(keep) < len(rows):  # drop the rows that stopped: their cache rows, mask and positions
            sel = torch.tensor(keep, dtype=torch.long)
            o.cache.reorder_cache(sel.to(dev))
            mask, last = mask[sel], last[sel]
            rows, nxt = [rows[j] for j in keep], [nxt[j] for j in keep]
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)  # [B', past + 1]
        last = last + 1
        o = model(torch.tensor(nxt, dtype=torch.long)[:, None].to(dev), attention_mask=mask.to(dev),
                  position_ids=last[:, None].to(dev), cache=o.cache, use_cache=True)


# ----------------------------------------------------------------------------------------------------------
# the tail weights the engine itself used (zero-proxy check for a transformers checkpoint without a GGUF)


def tail_weights_from_model(model, model_sha: str, layer: int | None = None):
    """`l47.model.weights.TailWeights` straight from the model's parameters (output_hc_norm folded 1 + w, as GGUF
    stores it): what the exact tail forward needs to re-score this engine's dumps."""
    c = model.config
    last = int(c.num_hidden_layers) - 1
    if layer is not None and int(layer) != last:
        raise L47Error("tail weights", "layer", f"the last layer {last}", str(layer))
    mixer = "model.hyper_connection_mixer"
    f32 = lambda name: param_values(model, name).detach().float().cpu().clone()  # noqa: E731
    return TailWeights(
        layer=last, n=int(c.hidden_size), f=int(c.shared_expert_intermediate_size), hc=int(c.hc_count),
        r=int(c.hc_lowrank), V=int(c.vocab_size), eps=float(c.rms_norm_eps),
        W_sd=f32(f"model.layers.{last}.mlp.shared_expert.down_proj.weight"),
        onorm=(1.0 + f32(f"{mixer}.hc_norm.weight")).reshape(int(c.hc_count), int(c.hidden_size)),
        odown=f32(f"{mixer}.input_mix_weight_down.weight"), oup=f32(f"{mixer}.input_mix_weight_up.weight"),
        head=f32("lm_head.weight"), target=names.target_tensor(last),
        target_type=0, model_sha256=model_sha, policy="exact", path=model_sha,
    )
