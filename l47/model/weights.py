"""Runtime tail weights: the tensors the exact layer-L tail forward needs, as the engine sees them.

Notation used for tensor shapes:
    n   hidden size (2560)            f   shared-expert width (640)
    hc  hyper-connection streams (4)  r   HC low rank (320)
    V   vocabulary (248,320)

Runtime weight policies (DESIGN §1 "Runtime weights, not file weights"):
    strata  BF16 `hc_*` / `output_hc_*` tensors go BF16 -> Q8_0 -> f32 (Strata reads Q8_0 copies of them)
            where their rows are whole Q8_0 blocks (a multiple of 32; the real model's are), BF16 -> f32 where
            they are not (no Q8_0 form exists: `has_q8_0_copy`); norms stay F32 as stored; every other tensor
            through its own dequantiser.
    exact   every tensor through its own dequantiser, file values as they are.
All dequantised values are f32; dequantisation itself is exact in f32 for Q8_0/Q6_K/BF16/F16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from l47.errors import L47Error
from l47.model import names, quants
from l47.model.gguf_io import open_gguf

POLICIES = ("strata", "exact")
_BF16 = int(gguf.GGMLQuantizationType.BF16)
_Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)


PRECISIONS = ("f32", "split-fp16", "split-bf16")  # head GEMM precisions (l47.tail.stream.head_logits)
SPLITS = ("split-fp16", "split-bf16")


@dataclass
class Numerics:
    """How the head is evaluated and reduced in this run (the logic is l47.tail.stream). Mutable on purpose: the
    first head pass resolves `precision` ("auto" → split-fp16 on CUDA after a check against f64, else f32) and
    records the measured errors, which reports copy via `record()`."""

    precision: str = "f32"  # requested: "f32", "split-fp16", "split-bf16" or "auto"
    no_f64: bool = False  # no float64 on the compute device (MPS): the vocabulary sums run on the CPU in f64
    used: str | None = None  # the precision in use (set by the check)
    err_f32: float | None = None  # max |logit − f64 logit| on the check rows, f32 path
    err_split: float | None = None  # same for the split precision measured (`split`)
    split: str | None = None  # which split precision the check measured
    note: str = ""
    _parts: dict = field(default_factory=dict, repr=False, compare=False)  # cached bf16 hi/lo of the head

    def record(self) -> dict:
        return {"precision": self.used or self.precision, "requested": self.precision, "no_f64": self.no_f64,
                "max_logit_err_f32": self.err_f32, "split": self.split,
                "max_logit_err_split": self.err_split, "note": self.note}


@dataclass(frozen=True)
class TailWeights:
    """Everything downstream of layer L's shared-expert down projection, in f32 on one device."""

    layer: int
    n: int
    f: int
    hc: int
    r: int
    V: int
    eps: float
    W_sd: torch.Tensor  # [n, f]        runtime value of blk.L.ffn_down_shexp (the edited tensor)
    onorm: torch.Tensor  # [hc, n]      output_hc_norm, folded (1 + w) as stored
    odown: torch.Tensor  # [r, hc*n]    output_hc_down rows 0..r-1
    oup: torch.Tensor  # [hc*n, r]      output_hc_up
    head: torch.Tensor  # [V, n]        output.weight with output.scale (if any) folded in: logits = head · mix
    target: str  # GGUF name of the edited tensor
    target_type: int  # its ggml type id (Q8_0 in the seed's file)
    model_sha256: str
    policy: str
    path: str
    folded_scale: int = 0  # provenance: how many output.scale values were folded into `head` (0: none; 1 or V)
    numerics: Numerics = field(default_factory=Numerics, compare=False)

    @property
    def device(self) -> torch.device:
        return self.head.device


_Q8_0_BLOCK = 32  # elements per Q8_0 block (ggml QK8_0)


def has_q8_0_copy(shape: tuple[int, ...]) -> bool:
    """Whether the engine makes a Q8_0 runtime copy of a BF16 `hc_*` tensor of this LOGICAL shape: only when its
    rows are whole Q8_0 blocks (ggml quantises a row in blocks of 32). A tensor whose rows are not (e.g. a
    `[hc·n, r]` up projection with r = 24) has no Q8_0 form and is used as the file holds it, BF16 -> f32."""
    return len(shape) > 0 and shape[-1] % _Q8_0_BLOCK == 0


def runtime_tensor(g, name: str, policy: str, device=None) -> torch.Tensor:
    """f32 value of tensor `name` as the engine uses it under `policy` (shape = logical GGUF shape)."""
    if policy not in POLICIES:
        raise L47Error("weight policy", "policy", f"one of {POLICIES}", repr(policy))

    info = g.info(name)
    w = g.tensor(name, device=device)  # f32, its own dequant
    is_hc = name.startswith("output_hc_") or ".hc_" in name
    if policy == "strata" and info.ggml_type == _BF16 and is_hc and not names.is_folded_norm(name) \
            and has_q8_0_copy(tuple(w.shape)):
        # BF16 -> Q8_0 -> f32, as Strata's q8off_ copies (seed §3.1)
        w = quants.dequantize(quants.quantize(w.reshape(-1, w.shape[-1]), _Q8_0, name), _Q8_0, tuple(w.shape),
                              name, device=device)
    return w


_FINITE_ROWS = 8192  # rows checked at a time (bounds the bool temporary of a [V, n] head)


def check_finite(t: torch.Tensor, where, name: str) -> torch.Tensor:
    """Refuse a tensor holding NaN or ±Inf: L47Error naming it, the count and the first bad index (row-major).
    Scanned in row chunks so a [V, n] head never needs a full-size bool temporary. Returns t."""
    flat = t.reshape(t.shape[0], -1) if t.ndim > 1 else t.reshape(1, -1)  # [rows, cols]
    count, first = 0, None
    for r0 in range(0, flat.shape[0], _FINITE_ROWS):
        bad = ~torch.isfinite(flat[r0:r0 + _FINITE_ROWS])
        c = int(bad.sum())
        if c and first is None:
            k = int(bad.reshape(-1).nonzero()[0, 0]) + r0 * flat.shape[1]
            first = list(np.unravel_index(k, tuple(t.shape))) if t.ndim else [0]
        count += c
    if count:
        raise L47Error(where, f"tensor {name}", "finite values (no NaN or Inf)",
                       f"{count} non-finite (first at {[int(i) for i in first]})")
    return t


def _hparam(g, suffix: str, default=None):
    arch = g.kv.get(names.KEY_ARCH, names.ARCH)
    k = names.key(suffix, arch)
    if k in g.kv:
        return g.kv[k]
    if default is not None:
        return default
    raise L47Error(g.path, f"metadata key {k}", "present", "missing")


def head_precision(precision: str | None) -> str:
    """The requested head precision, checked: "f32", "split-fp16", "split-bf16", or None / "auto" -> "auto"
    (split-fp16 on CUDA after the per-run check against f64, f32 elsewhere; l47.tail.stream.check_precision). The
    CLI's --precision; a command passes the result down with its arguments to `load_tail_weights`."""
    p = precision or "auto"
    if p not in PRECISIONS + ("auto",):
        raise L47Error("--precision", "precision", "f32, split-fp16 or split-bf16", repr(precision))
    return p


def numerics_for(device, precision: str | None = None) -> Numerics:
    """The run's Numerics on `device` for the requested head `precision` (None: "auto"): the one place a
    Numerics is made for a run. MPS has no float64, so its vocabulary sums run on the CPU in f64."""
    return Numerics(precision=head_precision(precision), no_f64=str(device).startswith("mps"))


def load_tail_weights(model, policy: str = "strata", device="cpu", layer: int | None = None,
                      precision: str | None = None) -> TailWeights:
    """Read the tail tensors of GGUF `model` (path or open GGUFFile) under a runtime weight policy.

    The layer is the model's last (`block_count - 1`); any other is refused: only the last layer's FFN write
    is followed by nothing but the output mixer and the head (seed §3.1), so only there is the forward exact.
    `precision` of the head GEMM (`head_precision`): None = "auto". Each TailWeights carries its own Numerics, so
    weights loaded in one process with different precisions keep theirs.
    """
    g = open_gguf(model) if isinstance(model, (str, Path)) else model
    n_layers = int(_hparam(g, names.K_BLOCK_COUNT))
    last = n_layers - 1
    if layer is not None and layer != last:
        raise L47Error(g.path, "layer", f"the last layer {last} (block_count - 1): the exact tail forward holds "
                       "only there", str(layer))
    L = last
    t_name = names.target_tensor(L)
    t_info = g.info(t_name)
    W_sd = runtime_tensor(g, t_name, policy, device)  # [n, f]
    n, f = W_sd.shape
    hc = int(_hparam(g, names.K_HC_COUNT))
    up = runtime_tensor(g, names.OUTPUT_HC_UP.gguf, policy, device)  # [hc*n, r]
    r = int(_hparam(g, names.K_HC_LOWRANK, up.shape[1]))
    if tuple(up.shape) != (hc * n, r):
        raise L47Error(g.path, f"tensor {names.OUTPUT_HC_UP.gguf}", f"shape ({hc * n}, {r})", str(tuple(up.shape)))
    down = runtime_tensor(g, names.OUTPUT_HC_DOWN.gguf, policy, device)  # [r + extra, hc*n]
    if down.ndim != 2 or down.shape[1] != hc * n or down.shape[0] < r:
        raise L47Error(g.path, f"tensor {names.OUTPUT_HC_DOWN.gguf}", f"shape (>= {r}, {hc * n})",
                       str(tuple(down.shape)))
    down = down[:r].contiguous()  # rows 0..r-1: some files carry more rows than the low rank
    onorm = runtime_tensor(g, names.OUTPUT_HC_NORM.gguf, policy, device)
    if onorm.numel() != hc * n or tuple(onorm.shape) not in {(hc * n,), (hc, n)}:
        raise L47Error(g.path, f"tensor {names.OUTPUT_HC_NORM.gguf}", f"shape ({hc * n},) or ({hc}, {n}), "
                       "stream-major", str(tuple(onorm.shape)))
    onorm = onorm.reshape(hc, n)  # [hc, n] stream-major (c·n + d)
    head = runtime_tensor(g, names.OUTPUT.gguf, policy, device)  # [V, n]
    if head.ndim != 2 or head.shape[1] != n:
        raise L47Error(g.path, f"tensor {names.OUTPUT.gguf}", f"shape (V, {n})", str(tuple(head.shape)))
    head, folded = fold_output_scale(g, head, device)
    eps = float(_hparam(g, names.K_RMS_EPS, 1e-6))
    for nm, t in ((t_name, W_sd), (names.OUTPUT_HC_UP.gguf, up), (names.OUTPUT_HC_DOWN.gguf, down),
                  (names.OUTPUT_HC_NORM.gguf, onorm), (names.OUTPUT.gguf, head)):  # head: output.scale folded in
        if t is not None:
            check_finite(t, g.path, nm)  # a NaN is never printed as a result
    if not math.isfinite(eps) or eps < 0:
        raise L47Error(g.path, f"metadata {names.key(names.K_RMS_EPS)}", "a finite value >= 0", repr(eps))
    return TailWeights(
        layer=L, n=n, f=f, hc=hc, r=r, V=head.shape[0], eps=eps, W_sd=W_sd, onorm=onorm, odown=down, oup=up,
        head=head, target=t_name, target_type=t_info.ggml_type, model_sha256=g.sha256(),
        policy=policy, path=str(g.path), folded_scale=folded, numerics=numerics_for(device, precision),
    )


def fold_output_scale(g, head: torch.Tensor, device) -> tuple[torch.Tensor, int]:
    """head [V, n] with `output.scale` (1 value, or one per vocabulary row; it multiplies the logits) folded in:
    z_v = s_v·(W_out[v]·mix) = (s_v·W_out[v])·mix, so every consumer sees one head. Returns (head, values folded).
    f32 (one rounding per weight: |Δz| ≤ ~1 ulp of the logit)."""
    if names.OUTPUT_SCALE.gguf not in g.tensors:
        return head, 0
    scale = runtime_tensor(g, names.OUTPUT_SCALE.gguf, "exact", device).reshape(-1)  # [V] or [1]
    if scale.numel() not in (1, head.shape[0]):
        raise L47Error(g.path, f"tensor {names.OUTPUT_SCALE.gguf}", f"1 or {head.shape[0]} values",
                       str(scale.numel()))
    return head * scale[:, None], int(scale.numel())  # [V, n]


def weights_to(w: TailWeights, device) -> TailWeights:
    """The same weights on another device (e.g. the CPU for f64 solver algebra when the device has no float64),
    with that device's Numerics and the same requested precision."""
    import dataclasses

    moved = {f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
             if isinstance(getattr(w, f.name), torch.Tensor)}
    return dataclasses.replace(w, **moved, numerics=numerics_for(device, w.numerics.precision))


def check_dump_dims(w: TailWeights, meta, where: str) -> None:
    """Refuse a dump whose dims or layer do not match the model."""
    problems = []
    for k in ("n", "f", "hc", "V", "layer"):
        got = getattr(meta, k, None)
        want = getattr(w, k)
        if got is not None and int(got) != int(want):
            problems.append(f"{k}: expected {want}, found {got}")
    if problems:
        raise L47Error(where, "dump metadata", "dims matching the model " + w.path, "; ".join(problems))


def as_f32(x, device) -> torch.Tensor:
    """A copy of a (possibly read-only, memory-mapped) array as f32 on `device`."""
    return torch.tensor(np.asarray(x), dtype=torch.float32, device=device)


def edited_weight(w: TailWeights, bundle_path: Path, device="cpu"):
    """Runtime value of the edited tensor in a bundle (full GGUF or overlay), same policy as the base."""
    b = open_gguf(bundle_path)
    if w.target not in b.tensors:
        raise L47Error(bundle_path, f"tensor {w.target}", "present in the bundle", "missing")

    claimed = b.kv.get(names.PROVENANCE_PREFIX + "base_sha256") or b.kv.get(names.PROVENANCE_PREFIX + "overlay_of")
    if claimed and claimed != w.model_sha256:
        raise L47Error(bundle_path, names.PROVENANCE_PREFIX + "base_sha256", f"the base {w.model_sha256[:16]}…",
                       f"{str(claimed)[:16]}… (a bundle of another model)")
    if b.info(w.target).ggml_type != w.target_type:
        raise L47Error(bundle_path, f"tensor {w.target}", f"ggml type {w.target_type} (as in the base)",
                       str(b.info(w.target).type_name))
    W = runtime_tensor(b, w.target, w.policy, device)
    if tuple(W.shape) != tuple(w.W_sd.shape):
        raise L47Error(bundle_path, f"tensor {w.target}", f"shape {tuple(w.W_sd.shape)}", str(tuple(W.shape)))
    check_finite(W, bundle_path, w.target)
    return W, b.sha256()
