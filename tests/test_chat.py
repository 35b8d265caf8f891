"""Chat-template rendering with target roles, plain documents, and reading documents (JSONL / datasets).

References: a character-level stub vocabulary (one id per character) makes the expected role of every token
readable straight off a hand-written template string; the tiny byte-level BPE checks that rendering run by run
gives exactly the ids the tokenizer gives for the whole rendered text (`Vocab.encode_chat`, independent code).
No floating point here: every comparison is exact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from l47.model import names
from l47.dumps.chat import (Document, Message, read_documents, render_chat, render_document, render_plain)
from l47.errors import L47Error

SPECIAL = {s: i for i, s in enumerate(names.SPECIAL_TOKENS)}


class CharVocab:
    """One id per character (code point + 16); the five chat special tokens are ids 0..4."""

    special_ids = SPECIAL

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 16 for c in text]


def expected(parts: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, role code of every TOKEN) from (piece, role) pieces; a piece that is a special string is one id."""
    ids, roles = [], []
    for piece, role in parts:
        if piece in SPECIAL:
            ids.append(SPECIAL[piece])
            roles.append(names.ROLE_ID[role])
        else:
            ids += [ord(c) + 16 for c in piece]
            roles += [names.ROLE_ID[role]] * len(piece)
    return ids, roles


S, E, TH, ETH = names.IM_START, names.IM_END, names.THINK, names.END_THINK
TPL = "template"


def test_roles_match_template_char_level():
    msgs = [Message("system", "Be brief."), Message("user", "Hi?"),
            Message("assistant", f"{TH}\nplan\n{ETH}\n\nHello."), Message("tool", '{"a": 1}'),
            Message("tool", "ok"), Message("assistant", "Done")]
    ids, role = render_chat(msgs, CharVocab())
    want_ids, want_tok_roles = expected([
        (S, TPL), ("system\n", TPL), ("Be brief.", "system"), (E, TPL), ("\n", TPL),
        (S, TPL), ("user\n", TPL), ("Hi?", "user"), (E, TPL), ("\n", TPL),
        (S, TPL), ("assistant\n", TPL), (TH, TPL), ("\nplan\n", "think"), (ETH, TPL), ("\n\nHello.", "assistant"),
        (E, TPL), ("\n", TPL),
        (S, TPL), ("user", TPL), ("\n<tool_response>\n", TPL), ('{"a": 1}', "tool"), ("\n</tool_response>", TPL),
        ("\n<tool_response>\n", TPL), ("ok", "tool"), ("\n</tool_response>", TPL), (E, TPL), ("\n", TPL),
        (S, TPL), ("assistant\n", TPL), ("Done", "assistant"), (E, TPL), ("\n", TPL),
    ])
    assert ids == want_ids
    assert role.dtype == np.uint8 and role.shape == (len(ids) - 1,)
    assert role.tolist() == want_tok_roles[1:]  # role of the TARGET: row t predicts ids[t + 1]


def test_lone_end_think_and_unclosed_think():
    _, role = render_chat([Message("assistant", f"reasoning{ETH}answer")], CharVocab())
    _, tok = expected([(S, TPL), ("assistant\n", TPL), ("reasoning", "think"), (ETH, TPL), ("answer", "assistant"),
                       (E, TPL), ("\n", TPL)])
    assert role.tolist() == tok[1:]
    _, role = render_chat([Message("assistant", f"a{TH}cut off")], CharVocab())
    _, tok = expected([(S, TPL), ("assistant\n", TPL), ("a", "assistant"), (TH, TPL), ("cut off", "think"),
                       (E, TPL), ("\n", TPL)])
    assert role.tolist() == tok[1:]


def test_generation_prompt_and_unknown_role():
    ids, _ = render_chat([Message("user", "x")], CharVocab(), add_generation_prompt=True)
    assert ids[-len("assistant\n") - 1:] == expected([(S, TPL), ("assistant\n", TPL)])[0]
    with pytest.raises(L47Error, match=r"messages\[1\]\.role"):
        render_chat([Message("user", "x"), Message("robot", "y")], CharVocab())


def test_bpe_rendering_equals_whole_text_tokenization(tiny_vocab):
    """Rendering run by run must give the ids a tokenizer gives for the whole rendered text (encode_chat)."""
    msgs = [Message("system", "You are a helpful assistant."), Message("user", "What is the version?"),
            Message("assistant", f"{TH}\nThe user asks.\n{ETH}\n\nIt is version 2, actually.")]
    ids, role = render_chat(msgs, tiny_vocab)
    text = "".join(f"{S}{m.role}\n{m.content}{E}\n" for m in msgs)
    assert ids == tiny_vocab.encode_chat(text)
    # roles: the content of each message decodes back to its text
    tok_roles = [None] + role.tolist()
    for r, content in (("system", "You are a helpful assistant."), ("user", "What is the version?"),
                       ("think", "\nThe user asks.\n"), ("assistant", "\n\nIt is version 2, actually.")):
        got = [i for i, rr in zip(ids, tok_roles) if rr == names.ROLE_ID[r]]
        assert tiny_vocab.decode(got) == content


def test_boundary_merge_goes_to_later_segment():
    """A BPE merge across a role boundary: the straddling token takes the role of the segment it ends in."""

    class MergeVocab(CharVocab):
        def encode(self, text):  # merges "\nX" into one token 999, otherwise characters
            out, i = [], 0
            while i < len(text):
                if text[i:i + 2] == "\nX":
                    out.append(999)
                    i += 2
                else:
                    out.append(ord(text[i]) + 16)
                    i += 1
            return out

    ids, role = render_chat([Message("user", "Xy")], MergeVocab())
    k = ids.index(999)
    assert role[k - 1] == names.ROLE_ID["user"]  # target ids[k] = the merged "\nX" token
    assert role[k] == names.ROLE_ID["user"]


def test_render_plain(tiny_vocab):
    ids, role = render_plain("Rather than guessing, it measures.", tiny_vocab)
    assert ids == tiny_vocab.encode("Rather than guessing, it measures.")
    assert role.shape == (len(ids) - 1,) and (role == names.ROLE_ID["assistant"]).all()
    _, role = render_plain("a b c", tiny_vocab, role="user")
    assert (role == names.ROLE_ID["user"]).all()
    with pytest.raises(L47Error, match="role"):
        render_plain("x", tiny_vocab, role="narrator")
    with pytest.raises(L47Error, match="at least 2 tokens"):
        render_document(Document("d", text="a"), CharVocab())


# ----------------------------------------------------------------------------------------------------------
# reading documents


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_jsonl_collects_every_error_and_keeps_good_docs(tmp_path):
    good_chat = {"id": "c1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    lines = [
        json.dumps({"id": "p1", "text": "plain text"}),
        "{not json",
        json.dumps({"id": "r1", "messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}),
        json.dumps({"id": "e1", "text": "  \n"}),
        json.dumps({"id": "e2", "messages": [{"role": "user", "content": ""}]}),
        "",
        json.dumps(good_chat),
        json.dumps({"text": "no id"}),
        json.dumps({"id": "p1", "text": "duplicate"}),
        json.dumps({"id": "b1", "text": "x", "messages": []}),
        json.dumps({"id": "m1", "messages": [{"role": "user"}]}),
    ]
    ds = read_documents(_write_jsonl(tmp_path / "docs.jsonl", lines))
    assert [d.id for d in ds.docs] == ["p1", "c1"]
    assert ds.docs[1].messages == (Message("user", "Hi"), Message("assistant", "Yo"))
    errs = [str(e) for e in ds.errors]
    assert len(errs) == 8
    expect = [("docs.jsonl:2", "line"), ("docs.jsonl:3 (doc 'r1')", "messages[1].role"),
              ("docs.jsonl:4 (doc 'e1')", "text: expected a non-empty document"),
              ("docs.jsonl:5 (doc 'e2')", "messages: expected a non-empty document"),
              ("docs.jsonl:8", "id"), ("docs.jsonl:9 (doc 'p1')", "id: expected a unique document id"),
              ("docs.jsonl:10 (doc 'b1')", "text/messages"), ("docs.jsonl:11 (doc 'm1')", "messages[0].content")]
    for msg, (where, field) in zip(errs, expect):
        assert where in msg and field in msg, (msg, where, field)
    assert "robot" in errs[1]


def test_read_documents_from_datasets(tmp_path):
    import datasets  # a dependency (pyproject): a missing install must fail, not skip

    rows = {"id": ["a", "b", "c"], "text": ["first doc", "", "third doc"]}
    ds = datasets.Dataset.from_dict(rows)
    got = read_documents(ds)
    assert [d.id for d in got.docs] == ["a", "c"] and len(got.errors) == 1 and "'b'" in str(got.errors[0])
    ds.save_to_disk(str(tmp_path / "saved"))
    got2 = read_documents(tmp_path / "saved")
    assert [d.text for d in got2.docs] == ["first doc", "third doc"]
    # a JSON data file through datasets' own loader; rows without an id get row{i}
    (tmp_path / "chat.json").write_text(json.dumps(
        [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]))
    got3 = read_documents(tmp_path / "chat.json")
    assert got3.docs[0].id == "row0" and got3.docs[0].kind == "chat"


def test_missing_input_and_unknown_suffix(tmp_path):
    with pytest.raises(L47Error, match="nothing at that path"):
        read_documents(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(L47Error, match="suffix"):
        read_documents(tmp_path / "x.txt")


def test_document_hash_is_content_only():
    a = Document("d", text="hello", source="f:1")
    b = Document("d", text="hello", source="g:9")
    assert a.sha256() == b.sha256() != Document("d", text="hello!").sha256()
