"""Does the background show the kinds of text the audit scores? (`l47 sets`' coverage warning)

The solver holds the model still only where its background KL looks: an edit of W acts on a position through its
key hh, and a direction of hh the background never uses costs that KL nothing. A scored set whose keys lie
largely outside the background's span can move freely under an edit that passes every solver-side check — the
seed's v3.1 ended chat turns mid-sentence because its background was plain text (seed §6.1), and a zoo model whose
background held no JSON answer flipped eight `kld.json` rows to `<|im_start|>` (docs/BENCHMARKS.md, "A KLD domain
the background never shows"). Measured per set from its second moment C = Σ hh hhᵀ:

    P        the leading eigenvectors of C_background holding ENERGY of its trace          [f, k]
    outside  1 − tr(Pᵀ C P) / tr(C)                 the share of the set's key energy P misses

A scored set is named when its share exceeds RATIO × the share of the solver's own documents (train, dev, the
split pool, collateral_anchor: text the background is meant to cover, measured the same way) and FLOOR.

Precision: each document's Gram in f32 on the model's device, summed in f64; eigh in f64.
"""

from __future__ import annotations

import numpy as np
import torch

ENERGY = 0.99  # the background's span: the directions holding 99 % of its key energy
RATIO = 3.0  # a scored set this many times further outside than the solver's own documents is named
FLOOR = 0.05  # ... and at least this share outside (a few per cent is any two samples of text: a zoo model whose
# background holds a quarter of JSON answers still leaves 4.1 % of its kld.json keys outside, 0.8 % of its own)
REFERENCE = ("train", "dev", "pool", "collateral_anchor")  # the solver's own documents


class KeyGrams:
    """Per set: C = Σ hh hhᵀ [f, f] (f64) and its number of rows."""

    def __init__(self):
        self.C: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}

    def add(self, name: str, hh, device="cpu") -> None:
        h = torch.tensor(np.asarray(hh, dtype=np.float32), device=device)  # [T, f] (a copy: dumps are read-only maps)
        g = (h.T @ h).cpu().double().numpy()  # [f, f] (f64 on the CPU: an MPS device has no float64)
        self.C[name] = self.C[name] + g if name in self.C else g
        self.rows[name] = self.rows.get(name, 0) + h.shape[0]

    def pooled(self, names) -> np.ndarray | None:
        got = [self.C[s] for s in names if s in self.C]
        return sum(got) if got else None


def span_basis(C: np.ndarray, energy: float = ENERGY) -> np.ndarray:
    """P [f, k] (f64): the eigenvectors of C (symmetric PSD) with the largest eigenvalues, as few as hold
    `energy` of its trace."""
    lam, U = np.linalg.eigh(C)  # ascending
    lam, U = lam[::-1].clip(min=0.0), U[:, ::-1]
    k = int(np.searchsorted(np.cumsum(lam) / max(lam.sum(), 1e-300), energy)) + 1
    return U[:, : min(k, U.shape[1])]


def outside_share(C: np.ndarray, P: np.ndarray) -> float:
    """1 − tr(Pᵀ C P) / tr(C): the share of a set's key energy outside span P (0 for an empty set)."""
    tr = float(np.trace(C))
    return 0.0 if tr <= 0 else max(0.0, 1.0 - float(np.einsum("fk,fg,gk->", P, C, P)) / tr)


def coverage_warnings(g: KeyGrams, scored: list[str]) -> list[str]:
    """One line per scored set whose keys the background does not show (module docstring); [] without a
    background or the solver's own documents."""
    ref = g.pooled(REFERENCE)
    if "background" not in g.C or ref is None:
        return []
    P = span_basis(g.C["background"])
    base = outside_share(ref, P)
    out = []
    for s in scored:
        if s not in g.C:
            continue
        share = outside_share(g.C[s], P)
        if share > max(FLOOR, RATIO * base):
            out.append(f"set {s!r}: {share:.1%} of its key energy lies outside the background's span (the "
                       f"solver's own documents: {base:.1%}): the background shows little of this kind of text, and "
                       f"the solver holds an edit only where its background looks — add background documents of "
                       f"this kind (other documents than {s!r}'s)")
    return out
