"""Input documents and the Qwen chat template, with the role of every target token (DESIGN §3.1, §4).

Documents come from JSONL — plain `{"id", "text"}` or chat `{"id", "messages": [{"role", "content"}]}` — or from a
local `datasets` dataset with the same columns. Bad records (malformed line, unknown role, empty document, missing
id, duplicate id) become collected `L47Error`s naming the document and field; the other documents are still read.

Chat rendering (Qwen's ChatML template):
    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n          content may hold <think>…</think> blocks
    <|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n      (consecutive tool
                                                                                   messages share one turn)
Role of a token: the special tokens, the turn headers (`user\\n`), the `\\n` after `<|im_end|>` and the tool
markup are "template"; a message's content has the message's role; text inside `<think>…</think>` (or before a
lone `</think>`) is "think". The dump stores the role of the TARGET token: role[t] = role of tokens[t+1].

Tokenisation: each run of text between two special tokens is encoded as ONE string (exactly what a tokenizer
given the whole rendered text produces); role boundaries inside a run are found by encoding its prefixes, and
a token that straddles a boundary (a BPE merge across it) takes the role of the segment it ends in.

Notation for shapes: T = len(tokens) − 1 target positions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from l47.model import names
from l47.errors import L47Error

MESSAGE_ROLES = ("system", "user", "assistant", "tool")  # roles a message may have (think comes from content)
TEMPLATE = "template"
THINK = "think"
TOOL_OPEN = "<tool_response>\n"
TOOL_CLOSE = "\n</tool_response>"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATASET_FILE_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class VocabLike(Protocol):
    special_ids: dict[str, int]

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Document:
    """One input document: plain (`text`) or chat (`messages`). `source` says where it came from."""

    id: str
    text: str | None = None
    messages: tuple[Message, ...] | None = None
    source: str = ""  # "file.jsonl:12" or "dataset[3]"

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "plain"

    def record(self) -> dict[str, Any]:
        """The canonical JSON-able form (what the input hash covers)."""
        if self.messages is not None:
            return {"id": self.id, "messages": [{"role": m.role, "content": m.content} for m in self.messages]}
        return {"id": self.id, "text": self.text}

    def sha256(self) -> str:
        s = json.dumps(self.record(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(s.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DocumentSet:
    docs: tuple[Document, ...]
    errors: tuple[L47Error, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Rendered:
    """A rendered document: token ids [T+1], role code of every TARGET token [T] uint8, the rendered text."""

    tokens: tuple[int, ...]
    role: np.ndarray  # [T] uint8, codes of l47.model.names.ROLES
    text: str

    @property
    def T(self) -> int:
        return len(self.tokens) - 1


# ----------------------------------------------------------------------------------------------------------
# rendering

# A segment: (text, role, is_special). Specials are single token ids looked up in vocab.special_ids.
Segment = tuple[str, str, bool]


def _think_segments(content: str, vocab: VocabLike) -> list[Segment]:
    """Assistant content → assistant / think / template segments (think tags are template)."""
    out: list[Segment] = []
    special = lambda tag: (tag, TEMPLATE, tag in vocab.special_ids)  # noqa: E731
    rest = content
    # a lone </think> before any <think>: the reasoning started in the prompt (generation prompt "<think>\n")
    lone = rest.find(names.END_THINK)
    if lone >= 0 and (rest.find(names.THINK) < 0 or lone < rest.find(names.THINK)):
        out += [(rest[:lone], THINK, False), special(names.END_THINK)]
        rest = rest[lone + len(names.END_THINK):]
    while True:
        i = rest.find(names.THINK)
        if i < 0:
            out.append((rest, "assistant", False))
            return out
        j = rest.find(names.END_THINK, i)
        out += [(rest[:i], "assistant", False), special(names.THINK)]
        if j < 0:  # unclosed: reasoning runs to the end of the turn (a truncated generation)
            out.append((rest[i + len(names.THINK):], THINK, False))
            return out
        out += [(rest[i + len(names.THINK):j], THINK, False), special(names.END_THINK)]
        rest = rest[j + len(names.END_THINK):]


def chat_segments(messages: Iterable[Message], vocab: VocabLike, add_generation_prompt: bool = False,
                  where: str = "chat") -> list[Segment]:
    """The ChatML template as (text, role, is_special) segments."""
    msgs = list(messages)
    im_start = (names.IM_START, TEMPLATE, True)
    im_end = (names.IM_END, TEMPLATE, True)
    segs: list[Segment] = []
    for i, m in enumerate(msgs):
        if m.role not in MESSAGE_ROLES:
            raise L47Error(where, f"messages[{i}].role", f"one of {list(MESSAGE_ROLES)}", repr(m.role))
        if m.role == "tool":
            if i == 0 or msgs[i - 1].role != "tool":
                segs += [im_start, ("user", TEMPLATE, False)]
            segs += [("\n" + TOOL_OPEN, TEMPLATE, False), (m.content, "tool", False), (TOOL_CLOSE, TEMPLATE, False)]
            if i + 1 == len(msgs) or msgs[i + 1].role != "tool":
                segs += [im_end, ("\n", TEMPLATE, False)]
            continue
        segs += [im_start, (m.role + "\n", TEMPLATE, False)]
        segs += _think_segments(m.content, vocab) if m.role == "assistant" else [(m.content, m.role, False)]
        segs += [im_end, ("\n", TEMPLATE, False)]
    if add_generation_prompt:
        segs += [im_start, ("assistant\n", TEMPLATE, False)]
    return segs


def _common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def tokenize_segments(segs: list[Segment], vocab: VocabLike, where: str = "chat") -> tuple[list[int], list[str]]:
    """Token ids and the role of every token. Each run of text between specials is encoded as one string."""
    ids: list[int] = []
    roles: list[str] = []
    run: list[tuple[str, str]] = []

    def flush() -> None:
        parts = [(t, r) for t, r in run if t]
        run.clear()
        if not parts:
            return
        full = list(vocab.encode("".join(t for t, _ in parts)))
        start, prefix = 0, ""
        for k, (t, r) in enumerate(parts):
            prefix += t
            end = len(full) if k + 1 == len(parts) else max(start, _common_prefix(list(vocab.encode(prefix)), full))
            ids.extend(full[start:end])
            roles.extend([r] * (end - start))
            start = end

    for text, role, special in segs:
        if not special:
            run.append((text, role))
            continue
        flush()
        tid = vocab.special_ids.get(text)
        if tid is None:
            raise L47Error(where, f"special token {text}", "an id in the model's vocabulary", "missing")
        ids.append(int(tid))
        roles.append(role)
    flush()
    return ids, roles


def _target_roles(token_roles: list[str]) -> np.ndarray:
    return np.asarray([names.ROLE_ID[r] for r in token_roles[1:]], dtype=np.uint8)  # [T]


def render_chat(messages, vocab: VocabLike, add_generation_prompt: bool = False,
                where: str = "chat") -> tuple[list[int], np.ndarray]:
    """Chat messages (Message or {"role", "content"} dicts) → (token ids [T+1], role of each target [T] uint8)."""
    msgs = [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in messages]
    ids, roles = tokenize_segments(chat_segments(msgs, vocab, add_generation_prompt, where), vocab, where)
    return ids, _target_roles(roles)


def render_plain(text: str, vocab: VocabLike, role: str = "assistant") -> tuple[list[int], np.ndarray]:
    """Plain text → (token ids [T+1], role [T]). Every target has `role` (default "assistant": the model writes
    plain text itself; nothing in it is chat markup)."""
    if role not in names.ROLE_ID:
        raise L47Error("render_plain", "role", f"one of {list(names.ROLES)}", repr(role))
    ids = list(vocab.encode(text))
    return ids, np.full(max(len(ids) - 1, 0), names.ROLE_ID[role], dtype=np.uint8)


def render_document(doc: Document, vocab: VocabLike, plain_role: str = "assistant") -> Rendered:
    """Render a Document; refuses one that gives fewer than 2 tokens (nothing to predict)."""
    where = f"{doc.source or 'document'} (doc {doc.id!r})"
    if doc.messages is not None:
        ids, role = render_chat(doc.messages, vocab, where=where)
        text = "".join(t for t, _, _ in chat_segments(doc.messages, vocab, where=where))
    else:
        ids, role = render_plain(doc.text or "", vocab, plain_role)
        text = doc.text or ""
    if len(ids) < 2:
        raise L47Error(where, "text" if doc.messages is None else "messages", "at least 2 tokens",
                       f"{len(ids)} token(s)")
    return Rendered(tuple(int(i) for i in ids), role, text)


# ----------------------------------------------------------------------------------------------------------
# reading documents


def document_from_record(rec: Any, where: str, default_id: str | None = None) -> Document:
    """Validate one JSON record into a Document; L47Error names the document and the field."""
    if not isinstance(rec, dict):
        raise L47Error(where, "record", "a JSON object", type(rec).__name__)
    doc_id = rec.get("id", default_id)
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise L47Error(where, "id", "a non-empty string", repr(rec.get("id")))
    w = f"{where} (doc {doc_id!r})"
    has_text, has_msgs = rec.get("text") is not None, rec.get("messages") is not None
    if has_text == has_msgs:
        raise L47Error(w, "text/messages", "exactly one of 'text' (plain) or 'messages' (chat)",
                       "both" if has_text else "neither")
    if has_text:
        if not isinstance(rec["text"], str):
            raise L47Error(w, "text", "a string", type(rec["text"]).__name__)
        if not rec["text"].strip():
            raise L47Error(w, "text", "a non-empty document", "empty text")
        return Document(doc_id, text=rec["text"], source=where)
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise L47Error(w, "messages", "a non-empty list of {role, content}", repr(msgs)[:60])
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise L47Error(w, f"messages[{i}]", "an object {role, content}", type(m).__name__)
        if m.get("role") not in MESSAGE_ROLES:
            raise L47Error(w, f"messages[{i}].role", f"one of {list(MESSAGE_ROLES)}", repr(m.get("role")))
        if not isinstance(m.get("content"), str):
            raise L47Error(w, f"messages[{i}].content", "a string", repr(m.get("content"))[:60])
        out.append(Message(m["role"], m["content"]))
    if not any(m.content.strip() for m in out):
        raise L47Error(w, "messages", "a non-empty document", "every message's content is empty")
    return Document(doc_id, messages=tuple(out), source=where)


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any, L47Error | None]]:
    with open(path, encoding="utf-8", errors="strict") as fh:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = fh.readline()
            except UnicodeDecodeError as e:
                yield f"{path}:{lineno}", None, L47Error(f"{path}:{lineno}", "line", "UTF-8 text", str(e))
                return
            if not line:
                return
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line), None
            except json.JSONDecodeError as e:
                yield where, None, L47Error(where, "line", "one JSON object per line", f"malformed JSON ({e.msg} "
                                            f"at column {e.colno}): {line.strip()[:60]!r}")
            except RecursionError:  # json parses nested arrays / objects recursively
                yield where, None, L47Error(where, "line", "one JSON object per line (a document record)",
                                            "JSON nested deeper than Python's recursion limit")


def _dataset_records(ds, name: str) -> Iterator[tuple[str, Any, L47Error | None]]:
    for i, row in enumerate(ds):
        yield f"{name}[{i}]", row, None


def _open_dataset(path: Path, split: str | None):
    import datasets

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        builder = DATASET_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise L47Error(path, "input", f"JSONL ({', '.join(JSONL_SUFFIXES)}), a datasets directory "
                           f"(save_to_disk) or a data file ({', '.join(DATASET_FILE_BUILDERS)})",
                           f"suffix {path.suffix!r}")
        ds = datasets.load_dataset(builder, data_files=str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in ds:
            raise L47Error(path, "split", f"one of {splits}", repr(split))
        ds = ds[split]
    return ds


def read_documents(path_or_dataset, split: str | None = None) -> DocumentSet:
    """Documents from a JSONL file, a local `datasets` directory/data file, or a `datasets.Dataset` object.
    Bad records become errors (each naming its document and field); every good record is returned."""
    is_jsonl = False  # JSONL records must carry their id; dataset rows default to "row{i}"
    if isinstance(path_or_dataset, (str, Path)):
        path = Path(path_or_dataset)
        if not path.exists():
            raise L47Error(path, "input", "an existing JSONL file or dataset", "nothing at that path")
        is_jsonl = path.is_file() and path.suffix.lower() in JSONL_SUFFIXES
        if is_jsonl:
            records, name = _jsonl_records(path), str(path)
        else:
            records, name = _dataset_records(_open_dataset(path, split), str(path)), str(path)
    else:
        name = getattr(path_or_dataset, "info", None)
        name = getattr(name, "dataset_name", None) or "dataset"
        records = _dataset_records(path_or_dataset, name)
    docs: list[Document] = []
    errors: list[L47Error] = []
    seen: dict[str, str] = {}
    for i, (where, rec, err) in enumerate(records):
        if err is not None:
            errors.append(err)
            continue
        try:
            d = document_from_record(rec, where, default_id=None if is_jsonl else f"row{i}")
        except L47Error as e:
            errors.append(e)
            continue
        if d.id in seen:
            errors.append(L47Error(f"{where} (doc {d.id!r})", "id", "a unique document id",
                                   f"a duplicate of {seen[d.id]}"))
            continue
        seen[d.id] = where
        docs.append(d)
    return DocumentSet(tuple(docs), tuple(errors))
