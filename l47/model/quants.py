"""ggml quant codecs in vectorised torch (CPU / CUDA / MPS), bit-exact with gguf-py's `gguf.quants` (0.19).

Decoders: F32, F16, BF16, Q8_0, Q6_K, Q4_0, Q5_0.  Encoders: F32, F16, BF16, Q8_0 (ggml reference rule, byte-
identical with gguf.quants / ggml), Q6_K (a fixture builder: valid blocks, not claimed byte-identical with ggml).

Notation for tensor shapes:
    N       number of weights of a tensor = rows * cols
    rows    prod(shape[:-1]); cols = shape[-1] (the LOGICAL numpy order, = reversed GGUF ne)
    bs, ts  a ggml type's block size (weights per block) and type size (bytes per block), from GGML_QUANT_SIZES
    B       blocks in one chunk (a chunk holds about _CHUNK weights)
    S       16-weight sub-blocks of a Q6_K super-block (16 of them)

Block layouts (little-endian, as in ggml-common.h):
    Q8_0  [34]  = fp16 d | int8 q[32]                                      x = d * q
    Q4_0  [18]  = fp16 d | u8 qs[16] (lo nibbles: x[0..15], hi: x[16..31])  x = d * (nib - 8)
    Q5_0  [22]  = fp16 d | u32 qh (bit j = 5th bit of x[j]) | u8 qs[16]    x = d * ((nib | hb << 4) - 16)
    Q6_K  [210] = u8 ql[128] | u8 qh[64] | int8 scales[16] | fp16 d        x = (d * scales[j // 16]) * (q - 32)
          in each 128-weight half h (ql += 64 h, qh += 32 h), l = 0..31:
          x[l]    = ql[l] lo  | qh[l] bits 0-1      x[l+32] = ql[l+32] lo | qh[l] bits 2-3
          x[l+64] = ql[l] hi  | qh[l] bits 4-5      x[l+96] = ql[l+32] hi | qh[l] bits 6-7

Precision: every decoder computes exactly what gguf.quants computes, in f32 and in the same order (the Q6_K
product is `(d * scale) * q`: `d * scale` is exact in f32, the second product rounds once, as in gguf/ggml).
Large tensors are processed in chunks (~_CHUNK weights on the CPU, 64x that on an accelerator) written into a
preallocated f32 output, so temporaries stay a few times one chunk: a 248,320 x 2560 Q6_K head from a numpy
memmap needs its 2.37 GiB output plus 0.006 GiB (CPU peak RSS) / 0.04 GiB (CUDA peak allocation) beyond it.
Throughput (`python -m l47.model.quants`, H200 host): Q6_K head dequantize ~150 Mw/s on 16 CPU cores, ~1,300 Mw/s to CUDA
(pageable host-to-device copies included). Encoding runs in chunks of _QCHUNK weights, on the CPU spread over
torch.get_num_threads() Python threads (see _run_chunks).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from l47.errors import L47Error

QT = GGMLQuantizationType
_CHUNK = 1 << 16  # weights per decode chunk on the CPU (256 KiB of f32 output: stays in cache)
_QCHUNK = 1 << 15  # weights per encode chunk on the CPU (the Q6_K search holds 2 x 19 f32 copies of one)
QK8_0 = GGML_QUANT_SIZES[QT.Q8_0][0]  # 32
QK_K = gguf.QK_K  # 256
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: below this a group's values count as zero
_Q6K_SEARCH = (0,) + tuple(i for i in range(-9, 10) if i != 0)  # make_qx_quants: nmax + 0.1*is, is = 0 first


# ---------------------------------------------------------------------------------------------------------------
# types, sizes, input normalisation
# ---------------------------------------------------------------------------------------------------------------

def _type_label(ggml_type: int) -> str:
    try:
        return f"{QT(int(ggml_type)).name} (id {int(ggml_type)})"
    except ValueError:
        return f"unknown type id {int(ggml_type)}"


def _qtype(ggml_type: int, name: str, allowed, what: str) -> GGMLQuantizationType:
    """The GGMLQuantizationType for `ggml_type`, or L47Error naming the tensor when it is not in `allowed`."""
    try:
        qt = QT(int(ggml_type))
    except (ValueError, TypeError):
        qt = None
    if qt is None or qt not in allowed:
        expected = f"a ggml type this toolkit can {what}: " + ", ".join(t.name for t in allowed)
        raise L47Error(name, "ggml type", expected, _type_label(ggml_type))
    return qt


def row_nbytes(ggml_type: int, cols: int, name: str = "?") -> int:
    """Bytes per row of `cols` weights. Any type with a known block size is accepted (a size needs no codec);
    unknown ids and cols not a multiple of the block size raise L47Error."""
    qt = _qtype(ggml_type, name, GGML_QUANT_SIZES, "size")
    bs, ts = GGML_QUANT_SIZES[qt]
    cols = int(cols)
    if cols <= 0 or cols % bs:
        raise L47Error(name, "row length", f"a positive multiple of {qt.name}'s block size {bs}", f"{cols}")
    return cols // bs * ts


def _flat_u8(raw, name: str):
    """raw (numpy array / memmap or torch tensor, any dtype) -> 1-D uint8 view of its bytes (no copy if contiguous)."""
    if isinstance(raw, torch.Tensor):
        t = raw.contiguous().reshape(-1)
        t = t if t.dtype == torch.uint8 else t.view(torch.uint8)
        return t if t.storage_offset() % 4 == 0 else t.clone()  # dtype views of fields need aligned offsets
    if isinstance(raw, (np.ndarray, np.memmap, bytes, bytearray, memoryview)):
        a = np.asarray(raw) if not isinstance(raw, (bytes, bytearray, memoryview)) else np.frombuffer(raw, np.uint8)
        a = np.ascontiguousarray(a).reshape(-1)
        return a if a.dtype == np.uint8 else a.view(np.uint8)
    raise L47Error(name, "raw bytes", "a numpy uint8 array/memmap or a torch uint8 tensor", type(raw).__name__)


def _chunk_to_torch(chunk, device: torch.device) -> torch.Tensor:
    """One chunk of raw bytes as a torch uint8 tensor on `device` (copies read-only memmap slices: chunk-sized)."""
    if isinstance(chunk, torch.Tensor):
        return chunk.to(device)
    if not chunk.flags.writeable:
        chunk = chunk.copy()
    return torch.from_numpy(chunk).to(device)


def _f16_at(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 at byte offset `off` of each block b [B, ts] -> f32 [B, 1] (exact widening)."""
    return b[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# decoders: raw blocks b [B, ts] uint8 -> out [B, bs] f32 (written in place: no extra pass over the output)
# ---------------------------------------------------------------------------------------------------------------

def _dec_f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.contiguous().view(torch.float32))  # [B, 1]


def _dec_f16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.contiguous().view(torch.float16))  # [B, 1] exact widening


def _dec_bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.contiguous().view(torch.bfloat16))  # [B, 1] exact widening: bits << 16 (NaN payloads kept)


def _dec_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # d [B, 1] f32 x int8 codes [B, 32]: torch casts int8 -> f32 exactly, then one f32 product, as gguf/ggml
    torch.mul(_f16_at(b, 0), b[:, 2:].view(torch.int8), out=out)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """u8 qs [B, 16] -> [B, 32]: low nibbles then high nibbles (Q4_0 / Q5_0 order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _dec_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8  # [B, 32] int8 codes
    torch.mul(_f16_at(b, 0), q, out=out)


def _dec_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    B = b.shape[0]
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)  # [8]
    hb = ((b[:, 2:6, None] >> shifts) & 1).reshape(B, 32)  # [B, 4, 8] -> [B, 32]: bit j of the LE u32
    q = (_nibbles(b[:, 6:22]) | (hb << 4)).to(torch.int8) - 16  # [B, 32] int8 codes
    torch.mul(_f16_at(b, 0), q, out=out)


def _q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [B, 210] -> signed codes int8 [B, 256] (-32..31), in value order.

    Works on int32 words (4 codes at a time); every mask keeps each byte's bits inside that byte."""
    B = b.shape[0]
    w = torch.empty((B, 192), dtype=torch.uint8, device=b.device).copy_(b[:, :192]).view(torch.int32)  # [B, 48]
    # words: ql (32) | qh (16); a fresh copy, so 4-byte aligned whatever the chunk's offset
    dev = b.device
    ql = w[:, :32].reshape(B, 2, 1, 16)  # [B, half, 1, 16 words] = 64 ql bytes per half
    qh = w[:, 32:].reshape(B, 2, 1, 8)  # [B, half, 1, 8 words] = 32 qh bytes per half
    lo = (ql >> torch.tensor([0, 4], device=dev, dtype=torch.int32).reshape(1, 1, 2, 1)) & 0x0F0F0F0F
    hi = (qh >> torch.tensor([0, 2, 4, 6], device=dev, dtype=torch.int32).reshape(1, 1, 4, 1)) & 0x03030303
    # lo [B, 2, 2, 16] bytes at (nibble, i) = position nibble*64 + i; hi [B, 2, 4, 8] bytes at (k, l) = k*32 + l
    c = lo.reshape(B, 64) | (hi.reshape(B, 64) << 4)  # [B, 64 words] unsigned 6-bit codes 0..63 per byte
    y = c ^ 0x20202020  # per byte: (c - 32) mod 64 as 6-bit two's complement
    m = y & 0x20202020  # its sign bit
    return (y | (m << 1) | (m << 2)).view(torch.int8)  # [B, 256] sign-extended to int8: c - 32


def _dec_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    B = b.shape[0]
    sc = b[:, 192:208].view(torch.int8).to(torch.float32)  # [B, S]
    dl = (_f16_at(b, 208) * sc).unsqueeze(-1)  # [B, S, 1] exact (11-bit x 8-bit mantissas)
    torch.mul(dl, _q6_k_codes(b).reshape(B, 16, 16), out=out.view(B, 16, 16))  # one f32 rounding, as gguf


_DECODERS = {
    QT.F32: _dec_f32, QT.F16: _dec_f16, QT.BF16: _dec_bf16, QT.Q8_0: _dec_q8_0, QT.Q6_K: _dec_q6_k,
    QT.Q4_0: _dec_q4_0, QT.Q5_0: _dec_q5_0,
}


def _chunk_weights(device: torch.device) -> int:
    """Weights per decode chunk: cache-sized on the CPU, larger on an accelerator (fewer kernel launches)."""
    return _CHUNK if device.type == "cpu" else _CHUNK * 64


def _decode_flat(flat, qt: GGMLQuantizationType, n_weights: int, device: torch.device) -> torch.Tensor:
    """1-D raw bytes of `n_weights` weights -> f32 [n_weights] on `device`, chunk by chunk."""
    bs, ts = GGML_QUANT_SIZES[qt]
    nb = n_weights // bs
    blocks = flat.reshape(nb, ts)  # [nb, ts] view
    out = torch.empty((nb, bs), dtype=torch.float32, device=device)  # [nb, bs]
    step = max(1, _chunk_weights(device) // bs)
    dec = _DECODERS[qt]
    for i in range(0, nb, step):
        dec(_chunk_to_torch(blocks[i:i + step], device), out[i:i + step])  # [B, ts] -> [B, bs]
    return out.reshape(-1)


def _default_device(raw, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return raw.device if isinstance(raw, torch.Tensor) else torch.device("cpu")


def dequantize(raw, ggml_type: int, shape: tuple[int, ...], name: str = "?", device=None) -> torch.Tensor:
    """Raw tensor bytes -> f32 torch tensor of LOGICAL `shape` (rows..., cols), on `device` (default: raw's device
    for a torch tensor, else CPU). Bit-exact with gguf.quants.dequantize."""
    qt = _qtype(ggml_type, name, _DECODERS, "dequantize")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise L47Error(name, "shape", "a non-empty logical shape (rows..., cols)", f"{shape}")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if rows * cols == 0:
        return torch.empty(shape, dtype=torch.float32, device=_default_device(raw, device))
    rnb = row_nbytes(qt, cols, name)
    flat = _flat_u8(raw, name)
    n = flat.numel() if isinstance(flat, torch.Tensor) else flat.size
    if n != rows * rnb:
        raise L47Error(name, "raw byte count", f"{rows} rows x {rnb} bytes = {rows * rnb} for {qt.name} {shape}",
                       f"{n}")
    return _decode_flat(flat, qt, rows * cols, _default_device(raw, device)).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------
# encoders: f32 blocks [B, bs] -> uint8 [B, ts]
# ---------------------------------------------------------------------------------------------------------------

def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """roundf(): ties away from zero (torch.round is ties-to-even). Exact: v - trunc(v) is exact in f32."""
    t = torch.trunc(v)
    return t + torch.sign(v) * ((v - t).abs() >= 0.5).to(v.dtype)


def _refuse_overflow(bad: torch.Tensor, name: str, what: str) -> None:
    if bool(bad.any()):
        raise L47Error(name, "values", f"finite after encoding ({what})",
                       f"{int(bad.sum())} blocks/values overflow fp16/bf16 (|w| too large)")


def _enc_q8_0(x: torch.Tensor, name: str) -> torch.Tensor:
    """ggml quantize_row_q8_0_ref: codes from the f32 d, stored scale fp16(d), ties away from zero."""
    amax = x.abs().amax(dim=-1, keepdim=True)  # [B, 1] f32
    d = amax / 127.0  # [B, 1] f32 (IEEE division, as C)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)  # [B, 1] f32
    v = x * inv  # [B, 32] f32
    # f32-subnormal amax (< ~3.7e-37): 1/d overflows to inf and ggml's (int8_t)roundf(inf) is undefined; we store
    # code 0 there (what x86 ggml and numpy produce). fp16(d) is 0 in that range, so every decoded value is 0 anyway.
    q = torch.where(torch.isfinite(v), _round_half_away(v), torch.zeros_like(v)).to(torch.int8)  # [B, 32]
    d16 = d.to(torch.float16)  # [B, 1] RNE f32 -> fp16
    _refuse_overflow(torch.isinf(d16), name, "Q8_0 scale amax/127 must fit fp16: |w| <= ~8.3e6")
    return torch.cat((d16.view(torch.uint8), q.view(torch.uint8)), dim=-1)  # [B, 34]


_SEARCH = torch.tensor(_Q6K_SEARCH, dtype=torch.float32)  # [19]


def _make_qx_scales(xs: torch.Tensor, nmax: int = 32) -> torch.Tensor:
    """ggml make_qx_quants(n=16, nmax, rmse_type=1, qw=NULL), vectorised: per 16-group scale [B, S] (f32).

    x^2-weighted least-squares scale for codes round(iscale*x) clamped to [-nmax, nmax-1], over the trial inverse
    scales iscale = -(nmax + 0.1*is)/max, is = 0, -9..9 (all 19 at once); keeps the first one with the largest
    sumlx^2/suml2 (ggml keeps the first strictly better one, comparing sumlx^2 > best*suml2).

    Layout: the G = B*S groups along the LAST axis ([19 trials, 16 weights, G]), so every step is one long
    vectorised op and each 16-term sum is vector adds of whole rows, in a FIXED order: torch's CPU order for an
    inner reduction of 16 f32 (8 partial sums p_j + p_{j+8}, then added left to right; tests/test_quants.py checks
    it against `.sum(-1)`). The values are therefore bit-identical with the previous implementation (all trials
    as [B, S, 19, 16] and `.sum(-1)`, kept in the tests as the reference), on any device."""
    B, S, n = xs.shape
    G = B * S
    T = len(_Q6K_SEARCH)
    x = xs.reshape(G, n)  # [G, 16]
    ax = x.abs()  # [G, 16]
    imax = ax.argmax(dim=-1, keepdim=True)  # [G, 1] first max |x|, as ggml's strict >
    live = ax.gather(-1, imax) >= GROUP_MAX_EPS  # [G, 1]; dead groups get scale 0
    mx = torch.where(live, x.gather(-1, imax), torch.ones_like(imax, dtype=x.dtype))  # [G, 1] signed max (1: dead)
    iscale = (-(nmax + 0.1 * _SEARCH.to(xs.device)) / mx).T  # [T, G] trial inverse scales (f32, as ggml's iscale)
    xt = x.T.contiguous()  # [16, G]
    w = xt * xt  # [16, G] weights x^2
    wx = w * xt  # [16, G] x^3
    lv = torch.mul(xt, iscale.unsqueeze(1))  # [T, 16, G] f32 products, one rounding each
    lv.round_().clamp_(-nmax, nmax - 1)  # codes: round half to even (as nearest_int), clamped
    h = n // 2
    acc = torch.mul(lv, wx)  # [T, 16, G] lv*x^3
    sumlx = _sum16_rows(acc, h)  # [T, G]
    acc = lv.mul_(lv).mul_(w)  # [T, 16, G] (lv*lv)*x^2
    suml2 = _sum16_rows(acc, h)  # [T, G]
    score = torch.where(suml2 > 0, sumlx * sumlx / suml2.clamp_min(1e-38), torch.full_like(sumlx, -1.0))  # [T, G]
    k = score.T.argmax(dim=-1, keepdim=True).T  # [1, G] first best trial
    l2 = suml2.gather(0, k)  # [1, G]
    scale = torch.where(l2 > 0, sumlx.gather(0, k) / l2.clamp_min(1e-38), torch.zeros_like(l2))  # [1, G]
    return torch.where(live.T, scale, torch.zeros_like(scale)).reshape(B, S)  # [B, S]


def _sum16_rows(p: torch.Tensor, h: int) -> torch.Tensor:
    """p [T, 16, G] -> [T, G]: the sum over axis 1 in torch's CPU order for an inner reduction of 16 f32: partial
    sums a_j = p_j + p_{j+8} (j < 8), then a_0 + a_1 + ... + a_7 left to right; every add one f32 rounding.
    Overwrites p's first half."""
    a = torch.add(p[:, :h], p[:, h:], out=p[:, :h])  # [T, 8, G]
    s = a[:, 0] + a[:, 1]  # [T, G]
    for j in range(2, h):
        s.add_(a[:, j])
    return s


def _enc_q6_k(x: torch.Tensor, name: str) -> torch.Tensor:
    """quantize_row_q6_K_ref's structure: make_qx_quants scale per 16-group, super-scale d = max_scale/-128 stored
    in fp16, int8 sub-scales, codes round(x / (d16*sc)) in [-32, 31]. Two deliberate departures from ggml, both
    for small-magnitude blocks (|d| near or below fp16's subnormal range, i.e. max|x| < ~0.25): d16 is rounded
    AWAY from zero (so |scale/d16| <= 128 and nothing clips), and sub-scales are round(scale / d16) from the STORED
    d16 (ggml uses the unrounded d). ggml's rule decodes a block of 4e-5's to all zeros; this one keeps it."""
    B = x.shape[0]
    xs = x.reshape(B, 16, 16)  # [B, S, 16]
    scales = _make_qx_scales(xs)  # [B, S] f32
    imax = scales.abs().argmax(dim=-1, keepdim=True)  # [B, 1]
    max_scale = scales.gather(-1, imax)  # [B, 1]
    dead = max_scale.abs() < GROUP_MAX_EPS  # [B, 1] all-zero super-block: ggml memsets it to 0
    d = torch.where(dead, torch.ones_like(max_scale), max_scale) / -128.0  # [B, 1] f32 super-scale
    d16 = d.to(torch.float16)  # [B, 1] RNE ...
    short = d16.to(torch.float32).abs() < d.abs()  # ... then one fp16 ulp away from zero where RNE shrank |d|
    d16 = torch.where(short, (d16.view(torch.int16) + 1).view(torch.float16), d16)  # (0 -> +-2^-24, no underflow)
    _refuse_overflow(torch.isinf(d16) & ~dead, name, "Q6_K super-scale must fit fp16")
    sc = torch.round(scales / d16.to(torch.float32)).clamp_(-128, 127)  # [B, S] int8 sub-scales, |.| <= 128
    dl = d16.to(torch.float32) * sc  # [B, S] effective step per group (exact)
    safe = torch.where(dl == 0, torch.ones_like(dl), dl).unsqueeze(-1)  # [B, S, 1]
    lv = torch.div(xs, safe).round_().clamp_(-32, 31)  # [B, S, 16]
    lv.masked_fill_(dl.unsqueeze(-1) == 0, 0.0)
    L = lv.add_(32).to(torch.uint8).reshape(B, 2, 4, 32)  # [B, half, k, l] codes 0..63
    lo, hi = L & 0x0F, L >> 4  # [B, 2, 4, 32]
    ql = torch.cat((lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)), dim=-1)  # [B, 2, 64]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [B, 2, 32]
    out = torch.cat((ql.reshape(B, 128), qh.reshape(B, 64), sc.to(torch.int8).view(torch.uint8),
                     d16.view(torch.uint8)), dim=-1)  # [B, 210]
    return out.masked_fill_(dead, 0)  # [B, 210]


def _enc_f32(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)  # [B, 4]


def _enc_f16(x: torch.Tensor, name: str) -> torch.Tensor:
    h = x.to(torch.float16)  # RNE, as numpy astype(float16)
    _refuse_overflow(torch.isinf(h), name, "F16 range |w| <= 65504")
    return h.view(torch.uint8)  # [B, 2]


def _enc_bf16(x: torch.Tensor, name: str) -> torch.Tensor:
    bits = f32_to_bf16(x)  # [B, 1] uint16
    _refuse_overflow((bits.view(torch.int16).to(torch.int32) & 0x7FFF) == 0x7F80, name, "BF16 range")
    return bits.view(torch.uint8)  # [B, 2]


_ENCODERS = {QT.F32: _enc_f32, QT.F16: _enc_f16, QT.BF16: _enc_bf16, QT.Q8_0: _enc_q8_0, QT.Q6_K: _enc_q6_k}


def _encode(w: torch.Tensor, qt: GGMLQuantizationType, name: str) -> torch.Tensor:
    """f32-convertible w [..., cols] -> uint8 [..., row_nbytes]; refuses NaN/Inf and bad row lengths."""
    if not isinstance(w, torch.Tensor):
        w = torch.as_tensor(np.asarray(w))
    if w.ndim == 0:
        raise L47Error(name, "shape", "at least 1 dimension (rows..., cols)", "a scalar")
    if not (w.is_floating_point() or w.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise L47Error(name, "dtype", "a real floating tensor", f"{w.dtype}")
    cols = w.shape[-1]
    rnb = row_nbytes(qt, cols, name)
    if w.is_floating_point() and w.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(w))).all()):
        bad = ~torch.isfinite(w)  # one aminmax pass finds any NaN (it propagates) or +-Inf; name the first here
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise L47Error(name, "values", "finite (no NaN/Inf) to quantize",
                       f"{int(bad.sum())} non-finite values, first at index {first}")
    bs, ts = GGML_QUANT_SIZES[qt]
    lead = tuple(w.shape[:-1])
    x = w.detach().to(torch.float32).contiguous().reshape(-1, bs)  # [nb, bs] f32 (no copy if already f32)
    out = torch.empty((x.shape[0], ts), dtype=torch.uint8, device=x.device)  # [nb, ts]
    step = max(1, (_QCHUNK if x.device.type == "cpu" else _QCHUNK * 64) // bs)  # bigger chunks: fewer launches
    enc = _ENCODERS[qt]

    def one(i: int) -> None:
        out[i:i + step] = enc(x[i:i + step], name)  # [B, ts]

    _run_chunks(one, range(0, x.shape[0], step), x.device)
    return out.reshape(*lead, rnb)


def _run_chunks(one, starts: range, device: torch.device) -> None:
    """one(i) for every chunk start. On the CPU with several torch threads, the chunks run on that many Python
    threads (torch releases the GIL inside ops) with torch's intra-op threads set to 1 meanwhile (restored after):
    chunk-sized ops split over OpenMP threads stall at every barrier when the cores are shared with other
    processes (measured: ~250x slower per op with 2 threads on 2 busy cores), while independent chunks do not."""
    workers = min(torch.get_num_threads(), len(starts)) if device.type == "cpu" else 1
    if workers <= 1:
        for i in starts:
            one(i)
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(one, starts):  # re-raises the first chunk's error (an L47Error from an encoder)
                pass
    finally:
        torch.set_num_threads(prev)


def quantize(w: torch.Tensor, ggml_type: int, name: str = "?") -> torch.Tensor:
    """w [..., cols] (float) -> uint8 bytes [rows, row_nbytes], rows = prod(w.shape[:-1]), on w's device.
    F32/F16/BF16/Q8_0 byte-identical with gguf.quants.quantize; Q6_K per `q6_k_quantize`. NaN/Inf -> L47Error."""
    qt = _qtype(ggml_type, name, _ENCODERS, "quantize")
    if isinstance(w, torch.Tensor) and w.ndim >= 1:
        w = w.reshape(-1, w.shape[-1])  # [rows, cols]
    out = _encode(w, qt, name)
    return out.reshape(-1, out.shape[-1])  # [rows, row_nbytes]


# ---------------------------------------------------------------------------------------------------------------
# per-type helpers
# ---------------------------------------------------------------------------------------------------------------

def _dequant_rows(raw, qt: GGMLQuantizationType, cols: int, name: str) -> torch.Tensor:
    """raw [..., row_nbytes] (or 1-D, a whole number of rows) -> f32 [..., cols]."""
    rnb = row_nbytes(qt, cols, name)
    shp = tuple(raw.shape)
    is_u8 = raw.dtype == (torch.uint8 if isinstance(raw, torch.Tensor) else np.uint8)
    if len(shp) >= 2 and shp[-1] == rnb and is_u8:
        shape = (*shp[:-1], cols)
    else:
        flat = _flat_u8(raw, name)
        n = flat.numel() if isinstance(flat, torch.Tensor) else flat.size
        if n % rnb:
            raise L47Error(name, "raw byte count", f"a multiple of {rnb} ({qt.name} row of {cols})", f"{n}")
        shape = (n // rnb, cols)
    return dequantize(raw, qt, shape, name)


def q8_0_quantize(w, name: str = "?") -> torch.Tensor:
    """w [..., cols] -> Q8_0 bytes uint8 [..., cols//32*34] (ggml reference rule, byte-identical with ggml)."""
    return _encode(w, QT.Q8_0, name)


def q8_0_dequantize(raw, cols: int, name: str = "?") -> torch.Tensor:
    """Q8_0 bytes [..., cols//32*34] -> f32 [..., cols]."""
    return _dequant_rows(raw, QT.Q8_0, cols, name)


def q8_0_requantize(w_new: torch.Tensor, raw_old, name: str = "?") -> torch.Tensor:
    """Q8_0 bytes of w_new [..., cols], except that every 32-block whose values equal dequant(raw_old) exactly
    (== in f32, so -0.0 == 0.0) keeps raw_old's bytes: unchanged blocks stay byte-identical even where
    raw_old is not what the reference rule would produce for its own values."""
    if not isinstance(w_new, torch.Tensor):
        w_new = torch.as_tensor(np.asarray(w_new))
    cols = w_new.shape[-1]
    new = q8_0_quantize(w_new, name)  # [..., rnb]
    old = _flat_u8(raw_old, name)
    old = old.to(new.device) if isinstance(old, torch.Tensor) else torch.from_numpy(old.copy()).to(new.device)
    if old.numel() != new.numel():
        raise L47Error(name, "raw_old byte count", f"{new.numel()} (Q8_0 of shape {tuple(w_new.shape)})",
                       f"{old.numel()}")
    old_blocks = old.reshape(-1, 34)  # [nb, 34]
    old_vals = torch.empty((old_blocks.shape[0], 32), dtype=torch.float32, device=new.device)
    _dec_q8_0(old_blocks, old_vals)  # [nb, 32] f32
    same = (w_new.detach().to(torch.float32).reshape(-1, 32) == old_vals).all(dim=-1, keepdim=True)  # [nb, 1]
    out = torch.where(same, old_blocks, new.reshape(-1, 34))  # [nb, 34]
    return out.reshape(new.shape)


def q6_k_dequantize(raw, cols: int, name: str = "?") -> torch.Tensor:
    """Q6_K bytes [..., cols//256*210] -> f32 [..., cols]; bit-exact with gguf.quants."""
    return _dequant_rows(raw, QT.Q6_K, cols, name)


def q6_k_quantize(w, name: str = "?") -> torch.Tensor:
    """w [..., cols] -> Q6_K bytes uint8 [..., cols//256*210]. A fixture builder (gguf-py has no Q6_K quantizer).

    Method: ggml's quantize_row_q6_K_ref structure — per 16-weight group, make_qx_quants(nmax=32, rmse_type=1):
    the x^2-weighted least-squares scale over the 19 trial inverse scales -(32 + 0.1*is)/max, is = 0, -9..9; then
    d = max_scale / -128 in fp16 (rounded away from zero), int8 sub-scales round(scale / d16), codes
    round(x / (d16*sc)) clamped to [-32, 31] (see _enc_q6_k for the two departures from ggml). Valid blocks that
    gguf.quants decodes. Relative RMSE on iid Gaussian data ~1.8e-2: Q6_K's inherent level (64 levels spanning
    +-max of 16 samples, ~+-2 sigma; the float64 absmax baseline gives ~1.87e-2). Computed in f32 with every sum
    in a fixed order (torch's CPU order, see _make_qx_scales), so not byte-identical with ggml's C, but the same
    bytes on every machine. Speed (docs/BENCHMARKS.md): a 248,320 x 2,560 head in ~47 s of CPU time."""
    return _encode(w, QT.Q6_K, name)


def bf16_to_f32(raw) -> torch.Tensor:
    """BF16 bits -> f32 (exact: bits << 16; NaN payloads kept). raw: uint16/int16 bits [...] (torch or numpy), or
    uint8 bytes [..., 2k] -> [..., k]."""
    if not isinstance(raw, torch.Tensor):
        a = np.ascontiguousarray(np.asarray(raw))
        raw = torch.from_numpy(a.view(np.int16) if a.dtype in (np.uint16, np.int16) else a.view(np.uint8))
    raw = raw.contiguous()
    if raw.dtype == torch.uint8:
        if raw.ndim == 0 or raw.shape[-1] % 2:
            raise L47Error("bf16_to_f32", "raw bytes", "an even number of bytes per row", f"{tuple(raw.shape)}")
        raw = raw.view(torch.int16)
    elif raw.dtype in (torch.uint16, torch.int16):
        raw = raw.view(torch.int16)
    else:
        raise L47Error("bf16_to_f32", "dtype", "uint16/int16 bits or uint8 bytes", f"{raw.dtype}")
    return raw.view(torch.bfloat16).to(torch.float32)  # [...] f32, exact: bits << 16


def f32_to_bf16(w) -> torch.Tensor:
    """f32 -> BF16 bits (torch.uint16, same shape), as gguf.quants / ggml_compute_fp32_to_bf16: NaN forced quiet
    (sign and top payload bits kept, bit 6 of the bf16 set), otherwise round to nearest, ties to even (overflow
    rounds to +-inf). Computed in int64 on the f32 bit pattern."""
    if not isinstance(w, torch.Tensor):
        w = torch.as_tensor(np.asarray(w, dtype=np.float32))
    n = w.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [...] u32 bits
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16  # [...] in 0..0xFFFF (no carry out: see NaN branch)
    return (n - ((n >= 0x8000).to(torch.int64) << 16)).to(torch.int16).view(torch.uint16)  # wrap to int16 bits


# ---------------------------------------------------------------------------------------------------------------

if __name__ == "__main__":  # python -m l47.model.quants [V] [n] [device]: throughput and memory at head size
    import os
    import resource
    import sys
    import time

    V = int(sys.argv[1]) if len(sys.argv) > 1 else 248_320
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2560
    dev = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    def rss_gib(field: str) -> float:  # VmRSS / VmHWM (peak) of this process, Linux only
        try:
            with open("/proc/self/status") as fh:
                return next(int(ln.split()[1]) for ln in fh if ln.startswith(field)) / 2**20
        except (OSError, StopIteration):
            return float("nan")

    # 1. Q6_K head dequantize from random valid bytes (a finite fp16 d in every block), numpy input like a memmap
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (V * n // QK_K, 210), dtype=np.uint8)  # [nb, 210]
    raw[:, 208:] = (rng.standard_normal(raw.shape[0]) * 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    try:  # reset the peak-RSS mark, so VmHWM below is the dequantize's own peak
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    base = rss_gib("VmRSS:")
    t0 = time.perf_counter()
    y = dequantize(raw, QT.Q6_K, (V, n), device=dev)  # [V, n] f32
    sync()
    t1 = time.perf_counter()
    f32_gib = V * n * 4 / 2**30
    extra = (torch.cuda.max_memory_allocated() / 2**30 - f32_gib) if dev.type == "cuda" else (
        rss_gib("VmHWM:") - base - f32_gib)
    print(f"Q6_K dequantize {V}x{n} on {dev}: {V * n / (t1 - t0) / 1e6:7.1f} Mw/s ({t1 - t0:.2f} s); "
          f"output {f32_gib:.2f} GiB f32, peak beyond it {extra:.3f} GiB")
    del y, raw

    # 2. round trips on Gaussian rows (quantize on `dev`, dequantize from numpy bytes)
    rows = min(V, 16384)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(0)).to(dev)  # [rows, n]
    for qt in (QT.Q8_0, QT.Q6_K, QT.BF16):
        quantize(x[:64], qt)  # warm-up
        sync()
        t0 = time.perf_counter()
        r = quantize(x, qt)
        sync()
        t1 = time.perf_counter()
        r = r.cpu().numpy()
        t2 = time.perf_counter()
        y = dequantize(r, qt, (rows, n), device=dev)
        sync()
        t3 = time.perf_counter()
        rel = float((y - x).norm() / x.norm())
        print(f"{qt.name:5s} {rows}x{n} on {dev}: quantize {x.numel() / (t1 - t0) / 1e6:8.1f} Mw/s, "
              f"dequantize {x.numel() / (t3 - t2) / 1e6:8.1f} Mw/s, rel RMSE {rel:.2e}")

    # 3. Q6_K quantize of the whole [V, n] head (Gaussian rows), wall and CPU time, with the machine's load
    x = torch.randn(V, n, generator=torch.Generator().manual_seed(1)).to(dev)  # [V, n]
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    r = quantize(x, QT.Q6_K)
    sync()
    t1, c1 = time.perf_counter(), time.process_time()
    print(f"Q6_K quantize {V}x{n} on {dev} ({torch.get_num_threads()} torch threads): {t1 - t0:.1f} s wall, "
          f"{c1 - c0:.1f} s CPU, {x.numel() / (t1 - t0) / 1e6:.1f} Mw/s; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
