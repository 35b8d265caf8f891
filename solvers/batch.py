"""Positions gathered from many dumps into one batch of layer-L states, and the constraint builders shared by
WFLD and the FTPO trainer.

Notation used for tensor shapes:
    P   positions in a batch   n hidden   f shared-expert width   hc streams   k chosen / special tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from l47.errors import L47Error
from l47.model.weights import TailWeights, as_f32
from l47.tail.forward import head_stats, logits_at, mix_from_ys, streamed_lse, tail_mix


@dataclass(frozen=True)
class Batch:
    """Layer-L states of P positions (f32 on the weights' device) and where they came from."""

    R: torch.Tensor  # [P, hc, n]
    inj: torch.Tensor  # [P, hc]
    hh: torch.Tensor  # [P, f]
    sgv: torch.Tensor  # [P]
    yr: torch.Tensor  # [P, n]
    target: torch.Tensor  # [P] long — the actual next token
    doc: tuple[str, ...]  # doc sha256 per position
    pos: tuple[int, ...]  # row in its dump
    role: torch.Tensor | None = None  # [P] long: the dump's role code of each target (None: not gathered)

    @property
    def P(self) -> int:
        return int(self.hh.shape[0])


def gather(items: list[tuple[object, list[int]]], device) -> Batch:
    """items: (Dump, rows) pairs -> one Batch (rows in the given order)."""
    parts = {k: [] for k in ("R", "inj", "hh", "sgv", "yr", "target", "role")}
    docs, poss = [], []
    for d, rows in items:
        if not len(rows):
            continue
        idx = np.asarray(rows, dtype=np.int64)
        for k in ("R", "inj", "hh", "sgv", "yr"):
            parts[k].append(as_f32(np.asarray(getattr(d, k))[idx], device))
        parts["target"].append(torch.as_tensor(np.asarray(d.tokens)[idx + 1].astype(np.int64), device=device))
        parts["role"].append(torch.as_tensor(np.asarray(d.role)[idx].astype(np.int64), device=device))
        docs += [d.sha256] * len(idx)
        poss += [int(i) for i in idx]
    if not docs:
        raise L47Error("solve", "positions", "at least one position in this batch", "none")
    cat = {k: torch.cat(v, 0) for k, v in parts.items()}
    return Batch(doc=tuple(docs), pos=tuple(poss), **cat)


def batch_to(b: Batch | None, device) -> Batch | None:
    """The same positions on another device."""
    if b is None:
        return None
    return Batch(R=b.R.to(device), inj=b.inj.to(device), hh=b.hh.to(device), sgv=b.sgv.to(device),
                 yr=b.yr.to(device), target=b.target.to(device), doc=b.doc, pos=b.pos,
                 role=None if b.role is None else b.role.to(device))


def batch_rows(b: Batch, rows: torch.Tensor) -> Batch:
    """The positions `rows` of a batch (their provenance dropped)."""
    return Batch(R=b.R[rows], inj=b.inj[rows], hh=b.hh[rows], sgv=b.sgv[rows], yr=b.yr[rows],
                 target=b.target[rows], doc=(), pos=(), role=None if b.role is None else b.role[rows])


def batch_cat(bs: list[Batch]) -> Batch:
    """Batches one after the other (their provenance dropped)."""
    role = torch.cat([b.role for b in bs]) if all(b.role is not None for b in bs) else None
    return Batch(**{k: torch.cat([getattr(b, k) for b in bs]) for k in ("R", "inj", "hh", "sgv", "yr", "target")},
                 doc=(), pos=(), role=role)


def batch_mix(b: Batch, w: TailWeights, W_sd=None, dW=None) -> torch.Tensor:
    return tail_mix(b.R, b.inj, b.hh, b.sgv, b.yr, w, W_sd=W_sd, dW=dW)  # [P, n]


def ys_grad_mix(b: Batch, w: TailWeights, W: torch.Tensor):
    """(ys leaf [P, n], mix [P, n]) with ys = W·hh as a leaf, so functionals of mix back-propagate to ys."""
    ys = (b.hh @ W.T).detach().requires_grad_(True)  # [P, n]
    return ys, mix_from_ys(ys, b.R, b.inj, b.sgv, b.yr, w)


@dataclass(frozen=True)
class EventTerms:
    """Per-event token ids for the FTPO-style terms (P events)."""

    rejected: torch.Tensor  # [P] the banned final token
    chosen: torch.Tensor  # [P, kc] natural alternatives: top non-rejected, non-special base tokens
    special: torch.Tensor  # [ks] special-token ids (same for every event)
    scale: torch.Tensor  # [P] per-phrase margin scale


def pick_chosen(b: Batch, w: TailWeights, rejected: torch.Tensor, special_ids: list[int], k: int = 1,
                pool: int = 16) -> torch.Tensor:
    """Each event's top-k base tokens that are neither the rejected token nor a special token. [P, k]"""
    with torch.no_grad():
        st = head_stats(batch_mix(b, w), w, b.target.cpu().numpy(), topk=pool)
    bad = set(int(s) for s in special_ids)
    out = []
    for i in range(b.P):
        cand = [int(t) for t in st.top_ids[i] if int(t) != int(rejected[i]) and int(t) not in bad][:k]
        if len(cand) < k:
            raise L47Error("solve", f"event {i} (doc {b.doc[i][:12]}…, row {b.pos[i]})",
                           f"{k} natural alternative(s) (not rejected, not special) in the base top {pool}",
                           f"{len(cand)}")
        out.append(cand)
    return torch.as_tensor(out, dtype=torch.long, device=b.hh.device)


def event_logps(mix: torch.Tensor, w: TailWeights, t: EventTerms) -> dict[str, torch.Tensor]:
    """log p of rejected [P], chosen [P, kc], special [P, ks] — differentiable through mix."""
    lse = streamed_lse(mix, w)[:, None]  # [P, 1]
    P = mix.shape[0]
    return {
        "rejected": (logits_at(mix, w, t.rejected[:, None]) - lse)[:, 0],
        "chosen": logits_at(mix, w, t.chosen) - lse,
        "special": (logits_at(mix, w, t.special) - lse) if t.special.numel() else mix.new_zeros(P, 0),
    }
