"""The top-k tie rule, one implementation: among equal logits the LOWER token id ranks first (argmax, top-k, the
fused kernels' tile lists, Fisher top-K). l47.tail.stream and l47.tail.fused both read it from here.

Notation for shapes: R rows, C columns (vocabulary ids or candidates in id order), k kept.
"""

from __future__ import annotations

import torch


def topk_lowest_id(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of z [R, C], descending, ties broken by the lower index (torch.topk does not promise
    which of equal values it returns). [R, k] values and indices."""
    k = min(k, z.shape[1])
    v, i = torch.topk(z, min(k + 1, z.shape[1]), dim=1)  # one extra: a tie across the cut shows as v[k-1] == v[k]
    if v.shape[1] > k:
        cut = (v[:, k - 1] == v[:, k]).nonzero().flatten()
        v, i = v[:, :k].clone(), i[:, :k].clone()
        for r in cut.tolist():  # rare: exact ties at the cut; take the candidates in id order
            cand = (z[r] >= v[r, k - 1]).nonzero().flatten()  # ascending ids
            o = torch.sort(z[r, cand], descending=True, stable=True).indices[:k]
            v[r], i[r] = z[r, cand[o]], cand[o]
    # within the k: order by (value desc, id asc)
    o = torch.sort(i, dim=1).indices
    v, i = torch.gather(v, 1, o), torch.gather(i, 1, o)
    o = torch.sort(v, dim=1, descending=True, stable=True).indices
    return torch.gather(v, 1, o), torch.gather(i, 1, o)
