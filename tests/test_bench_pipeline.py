"""The pipeline benchmark's synthetic experiment (l47/app/bench_pipeline.py): the planted banned phrases are real
prefix-exact events of the Qwen3.6 vocabulary's token sequences, chats have the structure the audit requires, and
every set of the experiment is populated. (Timings live in docs/BENCHMARKS.md, not here.)"""

from __future__ import annotations

import numpy as np
import pytest

from l47.app import bench_pipeline as bp


@pytest.mark.parametrize("which", ["qwen36", "demo"])
def test_document_specs_hold_prefix_exact_events_and_chat_structure(which):
    """Both vocabularies the benchmark uses: the real one (full size) and the demo BPE (reduced size)."""
    from tokenizers import Tokenizer

    from l47.dumps.select import chat_structure, find_collateral, find_events, phrases_to_tuples
    from l47.model.vocab import vocab_qwen36, vocab_from_kv, vocab_to_gguf_kv

    vocab = vocab_qwen36() if which == "qwen36" else vocab_from_kv(
        vocab_to_gguf_kv(Tokenizer.from_file(str(bp.DEMO_DATA / "tokenizer.json"))), "demo")
    size = bp.REDUCED
    specs = bp.document_specs(size, vocab, seed=3)
    n_kld = len(bp.KLD_DOMAINS) * size.kld
    assert len(specs) == size.pool + size.collateral + size.background + n_kld + size.chat_heldout
    assert len({doc_id for _, doc_id, _ in specs}) == len(specs)
    pts, _ = phrases_to_tuples(bp.PHRASES, vocab)
    words = {w: vocab.id_of(w) for w in bp.WORDS}
    per_set: dict[str, list[int]] = {}
    for s, _, spec in specs:
        tokens, role = bp._render(vocab, spec)
        assert tokens.shape[0] >= size.tokens  # at least the asked length, whole sentences
        ev = find_events(tokens.astype(np.int64), pts, role)
        for e in ev:  # prefix-exact: the phrase's token tuple sits right there
            L = len(e.tuple)
            assert tuple(tokens[e.pos + 2 - L:e.pos + 2]) == tuple(e.tuple)
        per_set.setdefault(s, []).append(len(ev))
        if s == "pool":
            assert len(ev) >= size.events_per_doc  # the planted ones (natural ones come on top)
        if s in ("pool", "chat_heldout"):
            ch = chat_structure(tokens.astype(np.int64), role, vocab.special_ids)
            assert ch.n_turns >= 1 and ch.n_think >= 1 and ch.n_terminal >= 1
        if s.startswith("collateral"):
            assert len(find_collateral(tokens.astype(np.int64), words, pts, role)) >= 3
    assert sorted(per_set) == sorted(["pool", "collateral_anchor", "collateral_eval", "background",
                                      "chat_heldout"] + [f"kld.{d}" for d in bp.KLD_DOMAINS])
    # same seed -> same documents
    assert bp.document_specs(size, vocab, seed=3) == specs


def test_token_text_of_head_rows_beyond_the_vocabulary():
    """The full-size benchmark's model has V = 248,320 head rows and the Qwen3.6 vocabulary 248,077 ids: the audit's
    per-position table must show a predicted id past the vocabulary instead of failing (the first H200 run did)."""
    from l47.evals.metrics import tok_text
    from l47.model.vocab import vocab_qwen36

    v = vocab_qwen36()
    assert tok_text(v, v.encode(" than")[0]) == " than"
    assert tok_text(v, v.size + 234) == f"<id {v.size + 234}>"
