"""Shared fixtures: the tiny random transformers Qwen4Exp, a tiny byte-level BPE vocabulary with Qwen's
pre-tokenizer and special tokens, and the tiny model exported as a whole qwen4exp GGUF (seed file's types).

The model comes from tests/tiny_hf.py (hidden 256, 3 layers, vocab 1024, hc 4, low rank 32, shared expert 64;
row lengths multiples of 32). HF initialises norms to zero and gates tiny, so `tiny_hf.perturb` gives every norm
weight N(0, 0.3) and the router, shared-expert gate and inject weights O(1)-scale values (|inj| ≫ 4): every
convention (the (1 + w) fold, the /hc inside the inject sigmoid, stream-major flattening) changes the numbers.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_hf

from tiny_hf import tiny_model  # noqa: E402

# The scoring ledgers live under $L47_HOME (l47.data.ledger): never the user's own during tests. Module fixtures
# share this session folder; every test function gets a fresh one (`_l47_home`).
os.environ["L47_HOME"] = _SESSION_HOME = tempfile.mkdtemp(prefix="l47-test-home-")


def pytest_sessionfinish(session, exitstatus):
    """The session's ledger folder is the suite's own (made above): removed at the end (was: one left in the
    temp dir per run)."""
    shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _l47_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("L47_HOME", str(tmp_path_factory.mktemp("l47_home")))

TINY_VOCAB = 1024  # the tiny model's vocabulary; the BPE below has at most this many tokens

_CORPUS = """The quick brown fox jumps over the lazy dog. A model reads text and predicts the next token.
Rather than guessing, it measures the real network end to end, and it reports the numbers right away.
What is the version of the file? It is version 2, actually, and more than that, it is the end of the story.
Far away, the mountains were covered in snow; the river ran through the valley to the sea.
She asked what the answer was, and he said that he would think about it before replying.
Numbers like 12, 345 and 6789 appear in tables, lists and reports; dates like 2024-05-01 too.
Python code: def f(x): return x * 2 + 1  # a comment. print("hello, world!")
User: How do I bake bread? Assistant: Mix flour, water, salt and yeast, knead, let it rise, then bake.
The system prompt says: you are a helpful assistant. Answer briefly and precisely.
Tools return JSON like {"name": "search", "results": [1, 2, 3]} which the assistant reads.
"""


def _train_tiny_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from l47.model.names import SPECIAL_TOKENS
    from l47.model.vocab import qwen_pre_tokenizer

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = qwen_pre_tokenizer()
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([_CORPUS] * 4, trainer)
    return tk


@pytest.fixture(scope="session")
def tiny_hf_model():
    """Factory: tiny_hf_model(seed=0) -> a fresh perturbed Qwen4ExpForCausalLM (eval mode, f32, CPU).
    Fresh each call (building takes ~30 ms), so a test may edit its copy."""

    def make(seed: int = 0, **kw):
        return tiny_model(seed=seed, **kw)

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer_kv() -> dict:
    """GGUF tokenizer metadata of a tiny byte-level BPE (Qwen pre-tokenizer, the five chat special tokens)."""
    from l47.model import names
    from l47.model.vocab import TT_UNUSED, vocab_to_gguf_kv

    kv = vocab_to_gguf_kv(_train_tiny_bpe())
    pad = TINY_VOCAB - len(kv[names.K_TOK_TOKENS])  # padded to the head's rows, as real GGUFs are
    kv[names.K_TOK_TOKENS] = kv[names.K_TOK_TOKENS] + [f"[PAD{i}]" for i in range(pad)]
    kv[names.K_TOK_TYPES] = kv[names.K_TOK_TYPES] + [TT_UNUSED] * pad
    return kv


@pytest.fixture(scope="session")
def tiny_vocab(tiny_tokenizer_kv):
    from l47.model.vocab import vocab_from_kv

    return vocab_from_kv(tiny_tokenizer_kv, "tiny bpe")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_hf_model, tiny_tokenizer_kv) -> Path:
    """tiny_hf_model(0) exported as a whole qwen4exp GGUF with the seed file's types and the tiny vocabulary."""
    from l47.engine.gguf_export import export_gguf

    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    return export_gguf(tiny_hf_model(0), path, tokenizer_kv=tiny_tokenizer_kv)
