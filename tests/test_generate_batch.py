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
    first = [eng.generate(m, p, 1, seed=10 + i, temperature=temperature, top_p=top_p, top_k=top_k)[0]
             for i, p in enumerate(prompts)]
    stop = (first[1],)
    settings = [eng.SamplerSettings(12 + 3 * (i % 2), 10 + i, temperature, top_p, top_k, stop)
                for i in range(len(prompts))]
    want = [eng.generate(m, p, s.max_new_tokens, s.seed, s.temperature, s.top_p, s.top_k, s.stop_ids)
            for p, s in zip(prompts, settings)]
    got = eng.generate_batch(m, prompts, settings)
    assert got == want
    assert len(got[1]) == 1 and any(len(g) == s.max_new_tokens for g, s in zip(got, settings))


def test_run_dump_batched_same_files(tmp_path, tiny_gguf):
    from l47.app.dumping import GenerateOptions, run_dump
    from l47.dumps import read_dump

    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": "Numbers like " + "12 " * i + "appear."}]}
             for i in range(5)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in chats))
    gen = GenerateOptions(max_new_tokens=10, seed=5, temperature=0.8, top_p=0.9, top_k=30)
    a = run_dump("hf", tiny_gguf, src, tmp_path / "a", generate=gen, batch=1)
    b = run_dump("hf", tiny_gguf, src, tmp_path / "b", generate=gen, batch=3)  # batches of 3 and 2
    assert [r.status for r in a.results] == ["written"] * 5 == [r.status for r in b.results]
    for ra, rb in zip(a.results, b.results):
        da, db = read_dump(ra.path), read_dump(rb.path)
        for k in ("tokens", "role", "R", "inj", "hh", "sgv", "yr", "ref_logp"):
            assert np.array_equal(np.asarray(getattr(da, k)), np.asarray(getattr(db, k))), (ra.doc_id, k)
        assert da.meta.provenance == db.meta.provenance
