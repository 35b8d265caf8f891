"""transformers' Qwen4Exp QSA indexer with its per-query work shared: the same selection mask, bit for bit.

`Qwen4ExpTextQSAIndexer.forward` (transformers 5.16–5.24) loops in Python over batch rows × query positions and,
for every query, re-pools, re-normalises and re-rotates the key blocks of everything that query sees: at
`83c86d3` that loop was most of the hf engine's generation and capture time on the demo (docs/BENCHMARKS.md "Dump
throughput, round 2"; round 3 has the figures since). With a causal
mask (left padding included) the tokens a query sees are a prefix of what the row's last query sees, so its key
blocks are a prefix of the last query's blocks: they are pooled once per row here, and a query reads the first
n of them. Per query what remains is what decides the selection, called exactly as transformers calls it:

    n      = (visible tokens) // compress_ratio                       complete key blocks of the query
    n <= block_topk:  every visible token is selected (topk of all n blocks = all of them; no score needed)
    n >  block_topk:  scores = relu(q_h · k_j).sum_h / sqrt(d)  [n]    the same matmul on the same [n, d] rows
                      selected = tokens of topk(scores, block_topk) + the incomplete tail block

Exactness: the block keys are row-wise ops (a mean over each block's `compress_ratio` tokens, RMSNorm over d,
rotary embedding at the block's first position) on the same values, so a block's key does not depend on how many
blocks are computed with it; the scores matmul gets the same shapes and strides as in transformers, so the same
floats, the same ties and the same topk. tests/test_qsa.py compares the mask and the model's logits with
transformers' own indexer bit for bit (short and long sequences, left padding, cached decode). Any other mask (a
query that sees tokens the last query does not, e.g. a sliding window) takes transformers' own loop.

Precision: as transformers (f32 scores; the model's dtype elsewhere).
"""

from __future__ import annotations

import math

import torch


def _nested(vis: torch.Tensor) -> bool:
    """Whether, in every batch row of vis [B, S, kv], each query's visible tokens are the first c_q of the row's
    last query's (a causal mask). One batched test for all rows (row-wise ops only)."""
    last = vis[:, -1:]  # [B, 1, kv]
    rank = torch.cumsum(last.to(torch.int64), -1)  # [B, 1, kv] 1-based rank among the last query's tokens
    counts = vis.sum(-1, dtype=torch.int64, keepdim=True)  # [B, S, 1]
    return bool(torch.equal(last & (rank <= counts), vis))


def _block_keys(ix, raw_keys: torch.Tensor, blocks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Pooled, normalised, rotated key of each block [nb, ratio] of token ids -> [nb, d] (transformers' steps)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    groups = raw_keys.index_select(0, blocks.flatten()).view(*blocks.shape, ix.index_head_dim)  # [nb, ratio, d]
    pooled = ix.k_layernorm(groups.float().mean(dim=1).to(raw_keys.dtype))  # [nb, d]
    starts = blocks[:, 0]
    return apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos.index_select(0, starts),
                                sin=sin.index_select(0, starts)).squeeze(1)  # [nb, d]


def _score_rows(ix, out_b: torch.Tensor, q_b: torch.Tensor, vis: torch.Tensor, counts: list[int],
                raw_b: torch.Tensor, cos_b, sin_b) -> None:
    """The rows of one batch row's selection mask out_b [S, kv] (a copy of vis, nested) whose query needs scores
    (more than block_topk complete blocks among its counts[s] visible tokens), in place: the top block_topk
    blocks by score + the incomplete tail block. q_b [S, heads, d], raw_b [kv, d].

    Per query the same float work as transformers: matmul(q [heads, d] f32, K^T [d, n] f32) with K^T a view of
    the f32 block keys transposed (for the first n blocks the same shape and strides, (1, d), as transformers'
    `keys[:n].float().transpose(-1, -2)`), relu, sum over heads, / sqrt(d), topk over the [n] scores."""
    ratio, topk = ix.compress_ratio, ix.block_topk
    need = [s for s, c in enumerate(counts) if c // ratio > topk]
    if not need:
        return
    last = torch.nonzero(vis[-1], as_tuple=False).flatten()  # [c_last] visible token ids, ascending
    nb = max(counts[s] for s in need) // ratio
    blocks = last[: nb * ratio].view(nb, ratio)  # [nb, ratio]
    keys_t = _block_keys(ix, raw_b, blocks, cos_b, sin_b).float().transpose(-1, -2)  # [d, nb] f32, strides (1, d)
    scale = math.sqrt(ix.index_head_dim)
    for s in need:
        n = counts[s] // ratio
        scores = torch.relu(torch.matmul(q_b[s].float(), keys_t[:, :n]).transpose(-1, -2)).sum(dim=-1) / scale  # [n]
        row = out_b[s]
        row[: last[n * ratio - 1] + 1] = False  # the complete blocks' tokens (ascending ids); the tail stays True
        row[blocks[:n].index_select(0, scores.topk(min(topk, n), dim=0).indices).flatten()] = True


def shared_forward(ix, hidden_states, position_embeddings, attention_mask, cache=None, **kw):
    """`Qwen4ExpTextQSAIndexer.forward` with the key blocks pooled once per row (module docstring). Falls back to
    transformers' own forward for a mask whose visible sets are not nested. A query whose complete blocks number
    at most block_topk selects everything it sees (its row of the mask is the visible row), so when no query of
    the batch needs scores the mask is the visible mask itself, with no per-row work."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer, apply_rotary_pos_emb

    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0  # [B, 1, S, kv]
    if kw or not _nested(visible[:, 0]):
        return Qwen4ExpTextQSAIndexer.forward(ix, hidden_states, position_embeddings, attention_mask, cache, **kw)
    B, S, _ = hidden_states.shape
    d = ix.index_head_dim
    full_cos, full_sin = position_embeddings
    qk = ix.index_qk_proj(hidden_states)  # [B, S, (heads + kv_heads)·d]: as transformers computes it
    q, token_k = torch.split(qk, [ix.index_n_heads * d, ix.index_kv_heads * d], dim=-1)
    q, raw_keys = q.reshape(B, S, -1, d), token_k.reshape(B, S, -1, d).squeeze(2)
    q = apply_rotary_pos_emb(ix.q_layernorm(q), cos=full_cos[:, -S:, :], sin=full_sin[:, -S:, :], unsqueeze_dim=2)
    if cache is not None:
        raw_keys = cache.update_indexer(raw_keys, ix.layer_idx)  # [B, kv, d]
    out = visible.clone()  # [B, 1, S, kv] bool: every query that needs no score selects what it sees
    counts = visible[:, 0].sum(-1)  # [B, S] visible tokens per query
    if not bool((counts // ix.compress_ratio > ix.block_topk).any()):
        return out
    for b, cb in enumerate(counts.tolist()):
        _score_rows(ix, out[b, 0], q[b], visible[b, 0], cb, raw_keys[b], full_cos[b], full_sin[b])
    return out


def share_indexer_work(model) -> int:
    """Route every QSA indexer of `model` through `shared_forward` (an instance attribute: the class and other
    models are untouched). Returns how many indexers were routed; a model without them is left as it is."""
    import types

    try:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer
    except ImportError:  # a transformers without Qwen4Exp: nothing to route
        return 0
    need = ("index_qk_proj", "q_layernorm", "k_layernorm", "compress_ratio", "block_topk", "index_head_dim",
            "index_n_heads", "index_kv_heads", "layer_idx")
    n = 0
    for m in model.modules():
        if isinstance(m, Qwen4ExpTextQSAIndexer) and all(hasattr(m, a) for a in need):
            m.forward = types.MethodType(shared_forward, m)
            n += 1
    return n
