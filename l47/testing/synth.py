"""Synthetic fixtures: a qwen4exp-layout GGUF holding the last layer's tail tensors, and per-token dump arrays.

The GGUF carries what the exact tail forward reads (DESIGN §1) with the seed file's tensor types — `W_sd` Q8_0,
`output_hc_*` BF16, `output_hc_norm` F32, head Q6_K — plus enough neighbours that it looks like a real file, and
optionally one tensor of an unknown type id (Strata's custom 2-bit experts) that readers must tolerate.

Notation for tensor shapes:
    n   hidden size (embedding_length)           f   shared-expert width (expert_shared_feed_forward_length)
    r   hyper-connection low rank                hc  hyper-connection streams
    V   vocabulary                               L   the last layer = n_layers - 1
    T   positions of a synthetic document
Shapes are LOGICAL ([rows, cols], as l47.model.gguf_io returns them).

Scales (chosen so the tail forward's logits are O(1–10): neither saturated nor ~0):
    W_sd ~ N(0, 1/f)                ys = W_sd·hh has the scale of hh (~1)
    odown, oup, hc_* ~ N(0, 1/fan_in)   pre-activations ~N(0, 1)
    norms 1 + 0.1·N(0, 1)           (GGUF stores the folded 1 + w)
    head ~ N(0, HEAD_GAIN²/n)       mix has RMS ~0.45 (correlated streams) → logits std ~3.5, |max| ~15

Weights are generated in f32 (numpy, one independent stream per tensor name and seed) and quantized with the
ggml reference codecs (gguf.quants for BF16/Q8_0; l47.model.quants for Q6_K, which gguf.quants cannot quantize).
The head is generated, quantized and written in row chunks, so REAL_DIMS never holds it whole in memory; the
chunks' Gaussians are drawn on a few threads at a time (numpy releases the GIL while it fills an array; each chunk has
its own stream, so the bytes do not depend on the thread count).
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gq

from l47.errors import L47Error
from l47.model import names
from l47.model.gguf_io import write_gguf
from l47.model.quants import quantize  # Q6_K and friends: gguf.quants only dequantizes K-quants


@dataclass(frozen=True)
class SynthDims:
    n: int = 256
    f: int = 64
    r: int = 32
    hc: int = 4
    V: int = 1024
    n_layers: int = 3
    extra_down_rows: int = 0  # output_hc_down rows beyond r (some files have them; the forward uses rows 0..r-1)


REAL_DIMS = SynthDims(n=2560, f=640, r=320, hc=4, V=248_320, n_layers=48)

RMS_EPS = 1e-6
HEAD_GAIN = 8.0  # head std = HEAD_GAIN / sqrt(n); see the scale table in the module docstring
UNKNOWN_TYPE_ID = 200  # stands in for Strata's custom 2-bit expert type
SYNTH_NAME = "l47-synth"
_HEAD_CHUNK_ROWS = 8192  # head rows generated + quantized at a time (REAL_DIMS: 84 MB of f32)

Q8_0 = GGMLQuantizationType.Q8_0
Q6_K = GGMLQuantizationType.Q6_K
BF16 = GGMLQuantizationType.BF16
F32 = GGMLQuantizationType.F32


def _rng(seed: int, name: str, chunk: int = 0) -> np.random.Generator:
    """An independent stream per (seed, tensor name, chunk): tensors do not depend on write order."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode()), chunk]))


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float, chunk: int = 0) -> np.ndarray:
    x = _rng(seed, name, chunk).standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)  # in place: the same f32 products as `x * std`
    return x  # f32


def _quantize(w: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    """f32 [rows, cols] → raw uint8 bytes of the given ggml type."""
    if qtype == F32:
        return np.ascontiguousarray(w, dtype=np.float32).view(np.uint8)
    if qtype in (BF16, Q8_0):  # ggml reference rules (gguf.quants; Q8_0 bit-exact with ggml)
        return gq.quantize(w, qtype).view(np.uint8)
    import torch

    return quantize(torch.from_numpy(np.ascontiguousarray(w)), int(qtype), name=name).numpy()


def _check_dims(d: SynthDims) -> None:
    where = "SynthDims"
    for field, v in (("n", d.n), ("f", d.f)):
        if v <= 0 or v % 32:
            raise L47Error(where, field, "a positive multiple of 32 (Q8_0 rows)", f"{v}")
    for field, v in (("r", d.r), ("hc", d.hc), ("V", d.V), ("n_layers", d.n_layers)):
        if v <= 0:
            raise L47Error(where, field, "positive", f"{v}")
    if d.extra_down_rows < 0:
        raise L47Error(where, "extra_down_rows", ">= 0", f"{d.extra_down_rows}")


def _head_chunks(dims: SynthDims, seed: int, qtype: GGMLQuantizationType, name: str) -> Iterator[np.ndarray]:
    std = HEAD_GAIN / math.sqrt(dims.n)
    starts = list(enumerate(range(0, dims.V, _HEAD_CHUNK_ROWS)))
    workers = max(1, min(8, os.cpu_count() or 1))

    def gen(ir: tuple[int, int]) -> np.ndarray:
        i, r0 = ir
        return _normal(seed, name, (min(_HEAD_CHUNK_ROWS, dims.V - r0), dims.n), std, chunk=i)  # [rows, n] f32

    with ThreadPoolExecutor(workers) as pool:
        for b in range(0, len(starts), workers):  # `workers` chunks drawn at once, then quantized in order
            for w in pool.map(gen, starts[b:b + workers]):
                yield _quantize(w, qtype, name)  # [rows, row_nbytes] uint8


def write_synth_gguf(path, dims: SynthDims = SynthDims(), seed: int = 0, unknown_type_tensor: bool = True,
                     head_type: str = "Q6_K") -> Path:
    """Write a qwen4exp-layout GGUF with the last layer's tail tensors (seed file's types) and its metadata."""
    _check_dims(dims)
    n, f, r, hc, V = dims.n, dims.f, dims.r, dims.hc, dims.V
    L = dims.n_layers - 1
    hcn = hc * n
    try:
        head_q = GGMLQuantizationType[head_type]
    except KeyError:
        raise L47Error("write_synth_gguf", "head_type", "a ggml type name (Q6_K, Q8_0, ...)", head_type) from None
    bs = GGML_QUANT_SIZES[head_q][0]
    if n % bs:
        if head_q != Q6_K:
            raise L47Error("write_synth_gguf", "head_type", f"a type whose block size divides n={n}",
                           f"{head_type} (block {bs})")
        warnings.warn(f"synth head: n={n} is not a multiple of 256, so output.weight is written as Q8_0 "
                      f"instead of Q6_K", stacklevel=2)
        head_q = Q8_0

    u32 = GGUFValueType.UINT32
    kv = {
        names.KEY_ARCH: names.ARCH,
        names.KEY_NAME: SYNTH_NAME,
        names.key(names.K_BLOCK_COUNT): dims.n_layers,
        names.key(names.K_EMBED): n,
        names.key(names.K_SHEXP_FF): f,
        names.key(names.K_HC_COUNT): hc,
        names.key(names.K_HC_LOWRANK): r,
        names.key(names.K_RMS_EPS): RMS_EPS,
        names.key(names.K_VOCAB): V,
    }
    kv_types = {k: u32 for k, v in kv.items() if isinstance(v, int)}
    kv_types[names.key(names.K_RMS_EPS)] = GGUFValueType.FLOAT32

    def g(t: names.TensorName, layer: int | None = None) -> str:
        return names.gguf_name(t, layer)

    def norm(name: str, size: int) -> np.ndarray:  # folded 1 + w, F32
        return 1.0 + _normal(seed, name, (size,), 0.1)

    def q(name: str, shape: tuple[int, ...], std: float, qtype: GGMLQuantizationType) -> tuple:
        return (name, int(qtype), shape, _quantize(_normal(seed, name, shape, std), qtype, name))

    tensors: list[tuple] = []
    # one small tensor per earlier layer, so the file has the usual block structure
    for layer in range(L):
        nm = g(names.FFN_HC_NORM, layer)
        tensors.append((nm, int(F32), (hcn,), norm(nm, hcn)))
    if unknown_type_tensor:  # custom 2-bit expert stack: [E, n, f] at 2 bits a weight, opaque bytes
        nm = g(names.FFN_DOWN_EXPS, 0)
        shape = (4, n, f)
        tensors.append((nm, UNKNOWN_TYPE_ID, shape,
                        _rng(seed, nm).integers(0, 256, math.prod(shape) // 4, dtype=np.uint8)))

    # the last layer: its hc_ffn (what makes inj) and the shared expert
    nm = g(names.FFN_HC_NORM, L)
    tensors.append((nm, int(F32), (hcn,), norm(nm, hcn)))
    tensors.append(q(g(names.FFN_HC_DOWN, L), (r, hcn), 1 / math.sqrt(hcn), BF16))
    tensors.append(q(g(names.FFN_HC_UP, L), (hcn, r), 1 / math.sqrt(r), BF16))
    tensors.append(q(g(names.FFN_HC_INJECT, L), (hc, hcn), 1 / math.sqrt(hcn), BF16))
    nm = g(names.FFN_GATE_INP_SHEXP, L)
    tensors.append((nm, int(F32), (n,), _normal(seed, nm, (n,), 1 / math.sqrt(n))))
    tensors.append(q(g(names.FFN_GATE_SHEXP, L), (f, n), 1 / math.sqrt(n), Q8_0))
    tensors.append(q(g(names.FFN_UP_SHEXP, L), (f, n), 1 / math.sqrt(n), Q8_0))
    tensors.append(q(g(names.FFN_DOWN_SHEXP, L), (n, f), 1 / math.sqrt(f), Q8_0))  # W_sd ~ N(0, 1/f)

    # the output mixer and the head
    nm = g(names.OUTPUT_HC_NORM)
    tensors.append((nm, int(F32), (hcn,), norm(nm, hcn)))
    tensors.append(q(g(names.OUTPUT_HC_DOWN), (r + dims.extra_down_rows, hcn), 1 / math.sqrt(hcn), BF16))
    tensors.append(q(g(names.OUTPUT_HC_UP), (hcn, r), 1 / math.sqrt(r), BF16))
    nm = g(names.OUTPUT)
    tensors.append((nm, int(head_q), (V, n), _head_chunks(dims, seed, head_q, nm)))  # streamed

    return write_gguf(path, kv, kv_types, tensors)


def synth_dump_arrays(dims: SynthDims, T: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Plain per-position arrays with the dump schema's names, shapes and dtypes (DESIGN §3.1), realistic scales.

    tokens [T+1] int32; R [T, hc, n] f32 (RMS ~1.8: a component shared by the streams + per-stream noise);
    inj [T, hc] f32 ~ N(0, 6) (|inj| ≫ 4: the stream gates 2σ(inj/4) saturate, as in the real model);
    hh [T, f] f32 = silu(a)·b; sgv [T] f32 ~ N(0, 2); yr [T, n] f32 ~ N(0, 0.5); role [T] uint8 in 0..5.
    """
    n, f, hc = dims.n, dims.f, dims.hc
    rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(b"dump"), T]))
    f32 = np.float32
    shared = rng.standard_normal((T, 1, n), dtype=f32) * f32(1.5)  # [T, 1, n]
    R = shared + rng.standard_normal((T, hc, n), dtype=f32)  # [T, hc, n]
    a = rng.standard_normal((T, f), dtype=f32) * f32(1.5)  # [T, f]
    b = rng.standard_normal((T, f), dtype=f32)  # [T, f]
    hh = a / (1 + np.exp(-a)) * b  # [T, f] silu(a)·b
    return {
        "tokens": rng.integers(0, dims.V, T + 1, dtype=np.int32),  # [T+1]
        "R": R.astype(f32),
        "inj": (rng.standard_normal((T, hc), dtype=f32) * f32(6)),  # [T, hc]
        "hh": hh.astype(f32),
        "sgv": (rng.standard_normal(T, dtype=f32) * f32(2)),  # [T]
        "yr": (rng.standard_normal((T, n), dtype=f32) * f32(0.5)),  # [T, n]
        "role": rng.integers(0, len(names.ROLES), T, dtype=np.uint8),  # [T]
    }
