"""Protected anchors within a budget of the shared-expert width, chosen for what they span.

Every exact anchor (ΔW·hh_a = 0) removes one direction of hh from what ΔW may use; f directions exist in all. When
the protected contexts would use more than `budget` of them, keep the ones that span the most: the contexts that
must be kept (real turn ends of the solver's own chats) first, then greedy pivoted Gram–Schmidt (= column-pivoted
QR) on what is left — at each step the anchor whose key has the largest component outside the span kept so far
(the farthest point from that span), so near-duplicate contexts (the same word in similar sentences) cost one
direction, not many. Not first-N, not evenly spaced.

Notation for shapes: P candidate anchors, f shared-expert width, k kept.
Precision: f64 throughout (Gram–Schmidt on unit-normalised keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BUDGET_FRACTION = 0.5  # of f: the share of the shared-expert width exact anchors may use by default


@dataclass(frozen=True)
class AnchorChoice:
    kept: list[int]  # indices into the candidates, in the order chosen (must-keep first)
    rank: int  # rank of the kept anchors' keys (relative cut `tol`)
    budget: int  # directions allowed
    candidates: int
    must_keep: int
    uncovered: float  # max over dropped anchors of the share of ‖hh‖² outside the kept span (0 = fully covered)
    uncovered_mean: float

    def summary(self) -> dict:
        return {"kept": len(self.kept), "rank": self.rank, "budget": self.budget, "candidates": self.candidates,
                "must_keep": self.must_keep, "dropped_max_share_outside_kept_span": self.uncovered,
                "dropped_mean_share_outside_kept_span": self.uncovered_mean}


def choose_anchors(hh: torch.Tensor, must_keep: list[int], budget: int, tol: float = 1e-6) -> AnchorChoice:
    """Indices of the anchors to protect exactly: every `must_keep` index, then the farthest-from-span ones until
    `budget` directions are used or every candidate lies in the kept span (share outside < tol²)."""
    H = hh.detach().double().cpu()  # [P, f]
    P = H.shape[0]
    nrm = H.norm(dim=1).clamp_min(1e-300)
    U = H / nrm[:, None]  # [P, f] unit keys
    Q = torch.zeros(0, H.shape[1], dtype=torch.float64)  # [k, f] orthonormal basis of the kept span
    kept: list[int] = []
    resid = U.clone()  # [P, f] components outside the kept span

    def take(i: int) -> bool:
        nonlocal Q, resid
        r = resid[i]
        rn = float(r.norm())
        if rn <= tol:
            return False
        q = r / rn
        Q = torch.cat([Q, q[None]], 0)
        resid = resid - (resid @ q)[:, None] * q[None, :]
        return True

    rank = 0
    for i in must_keep:
        kept.append(i)
        rank += take(i)
    chosen = set(kept)
    while rank < budget:
        share = resid.pow(2).sum(1)  # [P]
        if chosen:
            share[list(chosen)] = -1.0
        i = int(torch.argmax(share))
        if share[i] <= tol * tol:
            break
        kept.append(i)
        chosen.add(i)
        rank += take(i)
    dropped = [i for i in range(P) if i not in chosen]
    out = resid[dropped].pow(2).sum(1) if dropped else torch.zeros(1, dtype=torch.float64)
    return AnchorChoice(kept=kept, rank=rank, budget=budget, candidates=P, must_keep=len(must_keep),
                        uncovered=float(out.max()), uncovered_mean=float(out.mean()))


def word_null_cost(hh: torch.Tensor, words: list[str], tol: float = 1e-6) -> dict[str, dict]:
    """Per word: the rank of its anchors' keys alone, and the directions only it uses (rank of all − rank of all
    but its anchors): which words' anchors cost the most of the null space."""
    H = hh.detach().double().cpu()

    def rk(M: torch.Tensor) -> int:
        if M.shape[0] == 0:
            return 0
        S = torch.linalg.svdvals(M)
        return int((S > tol * S[0]).sum()) if S.numel() and S[0] > 0 else 0

    total = rk(H)
    arr = np.asarray(words)
    out = {}
    for word in sorted(set(words)):
        m = torch.as_tensor(arr == word)
        out[word] = {"anchors": int(m.sum()), "rank_alone": rk(H[m]), "unique_directions": total - rk(H[~m])}
    return out


def label_means(x: np.ndarray, labels) -> dict[str, float]:
    """label -> the mean of x [A] over the anchors of that label (`labels` [A]: a collateral word, or the turn-end
    token's name), sorted by label (f64): bars (d)/(f)'s per-word and turn-end means, as the plan's edit and FTPO's
    judge read them."""
    lab, x = np.asarray(labels), np.asarray(x, dtype=np.float64)
    return {k: float(x[lab == k].mean()) for k in sorted(set(lab.tolist()))}
