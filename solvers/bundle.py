"""Re-quantise W_sd + ΔW to Q8_0 as it will ship, and write bundles (full GGUF or overlay) and transplants.

A bundle differs from its base only in the target tensor's bytes plus `l47.provenance.*` metadata keys.
Writes are atomic (temp file + rename) and never touch the base.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from l47.errors import L47Error
from l47.fileio import atomic_path
from l47.model import names, quants
from l47.model.gguf_io import _same_file, copy_with_tensor_replaced, open_gguf, tensors_equal_bytes, write_gguf

Q8_0 = int(gguf.GGMLQuantizationType.Q8_0)


def requantize_target(base_g, target: str, W_new_float: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Q8_0 bytes of W_new_float (ggml reference rule; blocks whose values did not change keep their original
    bytes) and their dequantised f32 value — the weights every reported number is computed from."""
    info = base_g.info(target)
    if info.ggml_type != Q8_0:
        raise L47Error(base_g.path, f"tensor {target}", "ggml type Q8_0 (the edited tensor ships as Q8_0)",
                       info.type_name)
    if tuple(W_new_float.shape) != tuple(info.shape):
        raise L47Error(base_g.path, f"tensor {target}", f"shape {info.shape}", str(tuple(W_new_float.shape)))
    raw_old = torch.from_numpy(np.array(base_g.raw(target)))  # a writable copy of the mapped bytes
    raw_new = quants.q8_0_requantize(W_new_float.detach().float().cpu(), raw_old)
    W_q = quants.dequantize(raw_new, Q8_0, tuple(info.shape), target)
    return raw_new.numpy(), W_q


def provenance_kv(prov: dict) -> dict:
    """`l47.provenance.<key>` string values (dicts as sorted JSON) — deterministic, no timestamps."""
    out = {}
    for k, v in sorted(prov.items()):
        out[names.PROVENANCE_PREFIX + k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return out


def write_bundle(base_path: Path, out: Path, target: str, raw_new: np.ndarray, prov: dict) -> Path:
    """Full-model bundle: the base with the target tensor's bytes replaced and provenance keys added."""
    return copy_with_tensor_replaced(base_path, out, {target: raw_new}, extra_kv=provenance_kv(prov))


def write_overlay(base_path: Path, out: Path, target: str, raw_new: np.ndarray, prov: dict,
                  include: list[str] | None = None) -> Path:
    """Overlay bundle: a GGUF holding a subset of the base's tensors (default: every layer's
    ffn_down_shexp, the seed's 48 "writers"), the target's bytes replaced, the others as in the base."""


    g = open_gguf(base_path)
    if _same_file(Path(out), Path(g.path)):
        raise L47Error(out, "output path", "a file other than the base GGUF", "the base itself")
    if include is None:
        include = [n for n in g.tensors if n.endswith("ffn_down_shexp.weight")]
    if target not in include:
        include = include + [target]
    keep = {k: v for k, v in g.kv.items() if not k.startswith("tokenizer.")}
    kv = {**keep, **provenance_kv({**prov, "overlay_of": g.sha256()})}
    types = {k: g.kv_types[k] for k in keep}
    tensors = []
    for n in include:
        i = g.info(n)
        tensors.append((n, i.ggml_type, i.shape, raw_new if n == target else np.asarray(g.raw(n))))
    return write_gguf(out, kv, types, tensors, alignment=g.alignment)


def transplant(overlay_path: Path, base_path: Path, out: Path) -> dict:
    """Apply an overlay to a full model; verify after writing that every tensor outside the overlay is
    byte-identical to the base and every overlay tensor to the overlay. Returns a summary."""
    ov, base = open_gguf(overlay_path), open_gguf(base_path)

    for p, what in ((overlay_path, "the overlay itself"), (base_path, "the base itself")):
        if Path(out).exists() and _same_file(Path(out), Path(p)):
            raise L47Error(out, "output path", "a new file, never an input", what)
    repl = {}
    for n, i in ov.tensors.items():
        if n not in base.tensors:
            raise L47Error(overlay_path, f"tensor {n}", "a tensor the base has", "missing in the base")
        b = base.tensors[n]
        if (b.ggml_type, b.shape) != (i.ggml_type, i.shape):
            raise L47Error(overlay_path, f"tensor {n}", f"{b.type_name} {b.shape} (as in the base)",
                           f"{i.type_name} {i.shape}")
        repl[n] = np.asarray(ov.raw(n))
    made_for = ov.kv.get(names.PROVENANCE_PREFIX + "overlay_of")
    if isinstance(made_for, str) and made_for and made_for != base.sha256():
        raise L47Error(overlay_path, names.PROVENANCE_PREFIX + "overlay_of", f"the base given, sha256 "
                       f"{base.sha256()[:16]}… ({base_path})", f"an overlay of model sha256 {made_for[:16]}…")
    prov = {k: v for k, v in ov.kv.items() if k.startswith(names.PROVENANCE_PREFIX)}

    with atomic_path(out) as tmp:  # verified before it takes the name: a failed check leaves no file
        copy_with_tensor_replaced(base, tmp, repl, extra_kv=prov or None)
        res = open_gguf(tmp)
        changed = []
        for n in base.tensors:
            if n in repl:
                if not tensors_equal_bytes(res, ov, n):
                    raise L47Error(out, f"tensor {n}", "the overlay's bytes after writing", "different bytes")
                if not tensors_equal_bytes(res, base, n):
                    changed.append(n)
            elif not tensors_equal_bytes(res, base, n):
                raise L47Error(out, f"tensor {n}", "byte-identical to the base after writing", "different bytes")
        sha = res.sha256()
        del res
    return {"out": str(out), "overlay_tensors": len(repl), "changed": changed, "sha256": sha}
