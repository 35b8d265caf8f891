"""engine/qsa.py against transformers' own QSA indexer (the reference): the selection masks and the model's
logits compared bit for bit (torch.equal, no tolerance: the routed indexer must select exactly the same tokens,
and everything downstream is then the same computation). Sequences longer than the indexer budget (64 tokens
here) so that most queries select by score, with exact ties (relu zeros: a block whose every head scores
negative; about a quarter of them with two heads), left padding, a cached decode, and a mask that is not causal
(which must take transformers' own loop)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_hf import tiny_model

from l47.engine import qsa


def _pair(seed: int = 0, **kw):
    ref, fast = tiny_model(seed, **kw), tiny_model(seed, **kw)
    assert qsa.share_indexer_work(fast) >= 1 and qsa.share_indexer_work(torch.nn.Linear(2, 2)) == 0
    return ref, fast


def _masks(model, run):
    got = []
    hooks = [m.register_forward_hook(lambda m, i, o: got.append(o.clone())) for m in model.modules()
             if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    try:
        with torch.no_grad():
            out = run(model)
    finally:
        for h in hooks:
            h.remove()
    return got, out


@pytest.mark.parametrize("T", [40, 150])
def test_forward_same_masks_and_logits(T):
    ref, fast = _pair(0, layers=3, indexer_budget=32, indexer_compress_ratio=4)
    ids = torch.tensor([np.random.default_rng(T).integers(0, 1024, size=T).tolist()])
    (m_ref, o_ref), (m_fast, o_fast) = (_masks(m, lambda m: m(ids).logits) for m in (ref, fast))
    assert len(m_ref) == len(m_fast) >= 1
    for a, b in zip(m_ref, m_fast):
        assert a.dtype == b.dtype == torch.bool and torch.equal(a, b)
    assert torch.equal(o_ref, o_fast)
    if T > 40:  # most queries selected by score, not all of what they see
        assert int(m_ref[0].sum()) < int(torch.tril(torch.ones(T, T)).sum())


def test_scores_have_ties_and_selection_follows_them():
    """The ties the exactness argument is about occur: some blocks score exactly 0 for a query."""
    ref, fast = _pair(1, layers=2, indexer_budget=16, indexer_compress_ratio=4)
    ix = next(m for m in fast.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer")
    seen = {}
    h = ix.index_qk_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("qk", o))
    ids = torch.tensor([np.random.default_rng(5).integers(0, 1024, size=120).tolist()])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, fast(ids).logits)
    h.remove()
    d = ix.index_head_dim
    q = seen["qk"][0, :, : ix.index_n_heads * d].reshape(120, ix.index_n_heads, d)
    k = seen["qk"][0, :, ix.index_n_heads * d:]
    assert ((q @ k.T) < 0).all(1).float().mean() > 0.05  # pre-norm proxy: many all-negative head pairs


def test_padded_batch_and_cached_decode_same_logits():
    ref, fast = _pair(2, layers=3, indexer_budget=32, indexer_compress_ratio=4)
    g = np.random.default_rng(3)
    lens = [70, 9, 45]
    Lp = max(lens)
    x = torch.zeros(3, Lp, dtype=torch.long)
    mask = torch.zeros(3, Lp, dtype=torch.long)
    for j, n in enumerate(lens):
        x[j, Lp - n:] = torch.tensor(g.integers(0, 1024, size=n))
        mask[j, Lp - n:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(m):
        o = m(x, attention_mask=mask, position_ids=pos, use_cache=True)
        outs = [o.logits]
        mk, last = mask, pos[:, -1]
        for step in range(40):  # past the budget for every row
            nxt = torch.tensor([[int(t)] for t in o.logits[:, -1].argmax(-1)])
            mk = torch.cat([mk, torch.ones(3, 1, dtype=torch.long)], 1)
            last = last + 1
            o = m(nxt, attention_mask=mk, position_ids=last[:, None], cache=o.cache, use_cache=True)
            outs.append(o.logits)
        return outs

    (m_ref, o_ref), (m_fast, o_fast) = (_masks(m, run) for m in (ref, fast))
    assert len(m_ref) == len(m_fast)
    assert all(torch.equal(a, b) for a, b in zip(m_ref, m_fast))
    assert all(torch.equal(a, b) for a, b in zip(o_ref, o_fast))


def test_generate_batch_same_ids():
    from l47.engine import hf as eng

    ref, fast = _pair(4, layers=2, indexer_budget=16, indexer_compress_ratio=4)
    g = np.random.default_rng(9)
    prompts = [g.integers(5, 1024, size=n).tolist() for n in (30, 3, 17)]
    settings = [eng.SamplerSettings(30, 7 + i, 0.9, 0.95, 40) for i in range(3)]
    assert eng.generate_batch(ref, prompts, settings) == eng.generate_batch(fast, prompts, settings)


def test_not_causal_mask_takes_transformers_loop(monkeypatch):
    """A mask whose visible sets are not nested (a query sees a token the last one does not) is handed to
    transformers' own forward, with the same result as the reference."""
    _, fast = _pair(6, layers=2, indexer_budget=16, indexer_compress_ratio=4)
    ix = next(m for m in fast.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer")
    S, n = 40, fast.config.hidden_size
    hs = torch.randn(1, S, n, generator=torch.Generator().manual_seed(0))
    rot = fast.model.rotary_emb
    pe = rot(hs, torch.arange(S)[None])
    vis = torch.tril(torch.ones(S, S, dtype=torch.bool))
    vis[-1, 3] = False  # the last query no longer sees token 3; earlier ones do
    assert not qsa._nested(vis)
    calls = []
    orig = type(ix).forward
    monkeypatch.setattr(type(ix), "forward", lambda *a, **k: calls.append(1) or orig(*a, **k))
    with torch.no_grad():
        got = ix(hs, pe, vis[None, None], None)
        want = orig(ix, hs, pe, vis[None, None], None)
    assert calls and torch.equal(got, want)
