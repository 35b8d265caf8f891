"""Batched generation (engine.hf.generate_batch, `l47 dump --generate --batch N`) against the reference: `generate`
one prompt at a time with the same seeds. Token ids compare exactly (sampling is discrete: a batch that changed
one logit enough to move one draw would show as a different id), and the dumps of a batched run are the same
files' content as an unbatched run's (tokens, roles and every array bit for bit: capture runs per document)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from l47.engine import hf as eng


def _prompts(V: int = 1024):
    g = np.random.default_rng(7)
    return [g.integers(5, V, size=n).tolist() for n in (3, 17, 9, 30, 1)]  # ragged: 1 to 30 tokens


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.9, 0.95, 40), (0.0, 1.0, 0)])
def test_generate_batch_equals_one_at_a_time(tiny_hf_model, temperature, top_p, top_k):
    m = tiny_hf_model(0)
    prompts = _prompts()
    # stop ids chosen among the first sampled ids, so some rows stop early and ride along (padding-aware)
    first = [eng.generate(m, p, eng.SamplerSettings(1, 10 + i, temperature, top_p, top_k))[0]
             for i, p in enumerate(prompts)]
    stop = (first[1],)
    settings = [eng.SamplerSettings(12 + 3 * (i % 2), 10 + i, temperature, top_p, top_k, stop)
                for i in range(len(prompts))]
    want = [eng.generate(m, p, s) for p, s in zip(prompts, settings)]
    got = eng.generate_batch(m, prompts, settings)
    assert got == want
    assert len(got[1]) == 1 and any(len(g) == s.max_new_tokens for g, s in zip(got, settings))


def test_run_dump_batched_same_files(tmp_path, tiny_gguf):
    from l47.app.dumping import DumpJob, GenerateOptions, run_dump
    from l47.dumps import read_dump

    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": "Numbers like " + "12 " * i + "appear."}]}
             for i in range(5)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in chats))
    gen = GenerateOptions(max_new_tokens=10, seed=5, temperature=0.8, top_p=0.9, top_k=30)
    a = run_dump(DumpJob(tiny_gguf, src, tmp_path / "a", generate=gen, batch=1))
    b = run_dump(DumpJob(tiny_gguf, src, tmp_path / "b", generate=gen, batch=3))  # batches of 3 and 2
    assert [r.status for r in a.results] == ["written"] * 5 == [r.status for r in b.results]
    for ra, rb in zip(a.results, b.results):
        da, db = read_dump(ra.path), read_dump(rb.path)
        for k in ("tokens", "role", "R", "inj", "hh", "sgv", "yr", "ref_logp"):
            assert np.array_equal(np.asarray(getattr(da, k)), np.asarray(getattr(db, k))), (ra.doc_id, k)
        assert da.meta.provenance == db.meta.provenance


def test_cli_batch_default_is_the_library_default():
    import inspect

    from l47.app import cli, dumping

    assert inspect.signature(cli.dump).parameters["batch"].default.default == dumping.DEFAULT_BATCH


def _filter_one(z, s):
    """The sampler's filter on ONE row [V], written independently (element selection, no batch dimension): the
    reference a batched filter must reproduce bit for bit."""
    import torch

    z = z / s.temperature
    if 0 < s.top_k < z.numel():
        kth = torch.sort(z, descending=True).values[s.top_k - 1]
        z = torch.where(z < kth, torch.full_like(z, -torch.inf), z)
    if s.top_p < 1.0:
        order = torch.argsort(z, descending=True, stable=True)
        p = torch.softmax(z[order], -1)
        keep = (torch.cumsum(p, -1) - p) < s.top_p
        z = z.clone()
        z[order[~keep]] = -torch.inf
    return z


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 0.9, 40), (1.0, 0.5, 0), (0.8, 1.0, 5), (0.0, 1, 0)])
def test_sample_rows_row_independent(temperature, top_p, top_k):
    """A row's filtered logits and its draw do not depend on the other rows of the batch: bit-equal to the
    one-row reference, and the same ids as each row sampled alone with its own generator."""
    import torch

    g = torch.Generator().manual_seed(3)
    z = torch.randn(9, 3000, generator=g, dtype=torch.float64) * 3  # [B, V] f64
    z[2, :50] = z[2, 0]  # ties at the top (the stable order breaks them by id)
    z[3, 100:110] = torch.sort(z[3], descending=True).values[37]  # ties across the top-k cut: more than k kept
    z[4, 7:] = -torch.inf  # fewer finite entries than top_k
    s = eng.SamplerSettings(1, 0, temperature, top_p, top_k)
    if temperature > 0:
        got = eng._filter_logits(z, s)  # [B, V]
        for b in range(z.shape[0]):
            assert torch.equal(got[b], _filter_one(z[b], s)), b
    many = eng.sample_rows(z.float(), [s] * 9, [torch.Generator().manual_seed(100 + b) for b in range(9)])
    alone = [eng.sample_rows(z[b:b + 1].float(), [s], [torch.Generator().manual_seed(100 + b)])[0] for b in range(9)]
    assert many == alone
    if temperature <= 0:
        assert many == torch.argmax(z.float().double(), -1).tolist()


def test_sample_rows_mixed_samplers():
    """Rows with different samplers in one batch: each row drawn under its own (grouped filtering)."""
    import torch

    z = torch.randn(6, 500, generator=torch.Generator().manual_seed(4))  # [B, V] f32
    ss = [eng.SamplerSettings(1, 0, 0.7, 0.9, 40), eng.SamplerSettings(1, 0, 0.0), eng.SamplerSettings(1, 0, 1.2, 0.3)]
    rows = [ss[b % 3] for b in range(6)]
    many = eng.sample_rows(z, rows, [torch.Generator().manual_seed(b) for b in range(6)])
    alone = [eng.sample_next(z[b], rows[b], torch.Generator().manual_seed(b)) for b in range(6)]
    assert many == alone and many[1] == int(torch.argmax(z[1]))


def test_draw_is_torch_multinomial():
    """`eng.draw` against torch.multinomial(p, 1) itself (the reference): the same id and the same generator state
    after, over 600 rows and seeds — top-k / top-p cut rows of V 50 to 248,320 (the real vocabulary), full rows
    (every entry a candidate: torch.multinomial's own path), ties between candidates, a one-candidate row."""
    import torch

    from l47.engine.hf import SamplerSettings, _filter_logits

    g = torch.Generator().manual_seed(11)
    cases = 0
    for i in range(600):
        V = (50, 1500, 3072, 4000, 248_320)[i % 5] if i % 40 else 248_320
        z = torch.randn(1, V, generator=g, dtype=torch.float64) * (1 + i % 6)
        if i % 7 == 3:
            z[0, 5:9] = z.max()  # tied candidates: the first maximum of p / q must win, as in torch
        if i % 11 == 0:
            z[0, 1:] = -torch.inf  # one candidate
        s = SamplerSettings(1, 0, 0.7, (0.9, 1.0, 0.5)[i % 3], (40, 0, 20, 1)[i % 4])
        p = torch.softmax(_filter_logits(z, s), -1)[0]  # [V] f64
        a, b = torch.Generator().manual_seed(1000 + i), torch.Generator().manual_seed(1000 + i)
        for _ in range(2):  # two draws in a row: the states after the first must agree too
            assert eng.draw(p, a) == int(torch.multinomial(p, 1, generator=b)), (i, V, s)
        assert torch.equal(a.get_state(), b.get_state()), i
        cases += 1
    assert cases == 600


def test_draw_from_uniform_zero_variate_as_torch():
    """A uniform variate of exactly 0 gives q = 0: at an entry with p = 0 torch's p / q is NaN and torch.argmax
    returns it (NaN is its maximum); at a candidate p / 0 = inf wins. draw_from_uniform then computes every q."""
    import torch

    p = torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64)
    u = torch.tensor([0.3, 0.2, 0.0, 0.9], dtype=torch.float64)
    assert eng.draw_from_uniform(p, u) == 2  # the NaN entry, as torch.argmax(p / q)
    u = torch.tensor([0.3, 0.0, 0.5, 0.9], dtype=torch.float64)
    assert eng.draw_from_uniform(p, u) == 1  # 0.5 / 0 = inf
    u = torch.tensor([0.3, 0.2, 0.5, 0.9], dtype=torch.float64)  # q = -log1p(-u): 0.223, 2.303 -> id 1
    assert eng.draw_from_uniform(p, u) == 1
