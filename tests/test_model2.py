"""The second test model (l47/testing/model2/model2.gguf, scripts/make_model2.py, docs/MODEL2.md): unlike the demo
in every dimension the toolkit must not assume, and a real network that learned its five phrases.

References, independent of the code that made the file:
    dimensions / ids  the brief of issue 12 item 10, written out here: >= 3 layers, n >= 512, V ~ 4,000 with the
                      five specials at ids 0-4, the last layer linear attention (the demo's is indexed)
    tensor types      the exporter's seed rules (ffn_down_shexp Q8_0, output.weight Q6_K, hc_* BF16, norms F32)
                      plus Q8_0 for the other large matrices (the file must stay small), written out here
    vocabulary        the committed tokenizer.json run by `tokenizers` vs l47.model.vocab's GGUF vocabulary
    tail forward      transformers' Qwen4Exp built from the GGUF vs the exact tail forward: <= 1e-4 (f32 both,
                      |z| ~ 20; a wrong runtime policy moves them by ~1e-3, a wrong convention by O(0.1-10))
    learned slop      base p(final | exact prefix) re-derived from text with a full forward: the near-certain
                      phrases >= 0.99 on documents the model never saw (an untrained model: ~1/V = 2.5e-4)
    documents         make_model2.build_eval_docs(0) regenerates the committed JSONL files byte for byte
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from l47.model import names
from l47.model.gguf_io import open_gguf, type_name

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "l47" / "testing" / "model2"
GGUF = DATA / "model2.gguf"
sys.path.insert(0, str(REPO / "scripts"))

PHRASES = ("above and beyond", "delve into", "second to none", "rest assured", "hands down")
NEAR_CERTAIN = ("above and beyond", "delve into", "second to none")
SPECIAL_ORDER = (names.ENDOFTEXT, names.IM_START, names.IM_END, names.THINK, names.END_THINK)


def _jsonl(name: str) -> list[dict]:
    return [json.loads(x) for x in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]


def _render(messages: list[dict]) -> str:
    return "".join(f"{names.IM_START}{m['role']}\n{m['content']}{names.IM_END}\n" for m in messages)


@pytest.fixture(scope="module")
def g():
    return open_gguf(GGUF)


@pytest.fixture(scope="module")
def vocab(g):
    from l47.model.vocab import vocab_from_gguf

    return vocab_from_gguf(g)


@pytest.fixture(scope="module")
def hf_model():
    from l47.engine.gguf_export import load_hf_from_gguf

    return load_hf_from_gguf(GGUF, policy="strata")


def test_dimensions_unlike_the_demo(g, vocab, hf_model):
    assert GGUF.stat().st_size <= 20 * 2**20
    cfg = hf_model.config
    assert g.get(names.key(names.K_BLOCK_COUNT)) == cfg.num_hidden_layers >= 3
    assert g.get(names.key(names.K_EMBED)) == cfg.hidden_size >= 512
    assert cfg.layer_types[-1] == "linear_attention" and "indexed_attention" in cfg.layer_types
    assert g.get(names.key(names.K_HC_LOWRANK)) == 64 and g.get(names.key(names.K_SHEXP_FF)) == 512
    assert 3900 <= vocab.size == g.get(names.key(names.K_VOCAB)) <= 4100
    assert [vocab.special_ids[s] for s in SPECIAL_ORDER] == [0, 1, 2, 3, 4]
    assert g.get(names.K_TOK_EOS) == 2 and g.get(names.K_TOK_BOS) == 0
    for s, i in vocab.special_ids.items():
        assert vocab.encode_chat(s) == [i]
    for ph in PHRASES:  # each final word is one token
        assert len(vocab.encode(" " + ph.rsplit(" ", 1)[1])) == 1


def test_tensor_types(g):
    L = g.get(names.key(names.K_BLOCK_COUNT))
    want = {names.OUTPUT.gguf: "Q6_K", names.OUTPUT_HC_DOWN.gguf: "BF16", names.OUTPUT_HC_UP.gguf: "BF16",
            names.OUTPUT_HC_NORM.gguf: "F32", "token_embd.weight": "Q8_0"}
    for layer in range(L):
        want[f"blk.{layer}.ffn_down_shexp.weight"] = "Q8_0"
        want[f"blk.{layer}.ffn_up_shexp.weight"] = "Q8_0"
        for part in ("attn", "ffn"):
            want[f"blk.{layer}.hc_{part}_norm.weight"] = "F32"
            want[f"blk.{layer}.hc_{part}_down.weight"] = "BF16"
    got = {k: type_name(g.info(k).ggml_type) for k in want}
    assert got == want
    assert all(type_name(g.info(k).ggml_type) == "F32" for k in g.tensors if k.endswith("norm.weight"))


def test_gguf_vocab_matches_tokenizer_json(vocab):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer.json"))
    docs = _jsonl("heldout_chat")[:10] + _jsonl("blind_chat") + _jsonl("kld_order_json") + _jsonl("collateral")[:10]
    for d in docs:
        text = _render(d["messages"]) if "messages" in d else d["text"]
        assert vocab.encode_chat(text) == tok.encode(text, add_special_tokens=False).ids, d["id"]


def test_tail_forward_matches_transformers(g, vocab, hf_model):
    from l47.model.weights import load_tail_weights
    from l47.tail.forward import full_logits, tail_mix
    from tiny_hf import capture

    w = load_tail_weights(g, policy="strata")
    assert (w.n, w.f, w.hc, w.r, w.V) == (512, 512, 4, 64, vocab.size)
    ids = torch.tensor(vocab.encode_chat(_render(_jsonl("blind_chat")[0]["messages"])))
    states, logits = capture(hf_model, ids)  # [T, V]
    z = full_logits(tail_mix(states["R"], states["inj"], states["hh"], states["sgv"], states["yr"], w), w)
    assert logits.abs().max() > 5
    assert (z - logits).abs().max() <= 1e-4


def _events(messages: list[dict]):
    """(phrase, rendered prefix up to the final word, ' final') for every phrase use in assistant answers (after
    any think block)."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(messages[:k]) + f"{names.IM_START}assistant\n"
        c = m["content"]
        start = c.index(names.END_THINK) + len(names.END_THINK) if names.END_THINK in c else 0
        for ph in PHRASES:
            last = " " + ph.rsplit(" ", 1)[1]
            pat = f"(?<![A-Za-z])[{ph[0].upper()}{ph[0]}]{re.escape(ph[1:])}(?![A-Za-z])"
            for hit in re.finditer(pat, c[start:]):
                out.append((ph, head + c[:start + hit.end() - len(last)], last))
    return out


@torch.no_grad()
def test_model_learned_the_phrases(vocab, hf_model):
    p: dict[str, list[float]] = {ph: [] for ph in PHRASES}
    for d in _jsonl("heldout_chat")[:16] + _jsonl("blind_chat"):
        ids = vocab.encode_chat(_render(d["messages"]))
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
        for ph, prefix, last in _events(d["messages"]):
            pre = vocab.encode_chat(prefix)
            assert ids[:len(pre)] == pre and ids[len(pre)] == vocab.id_of(last), (ph, prefix[-40:])
            p[ph].append(float(lp[len(pre) - 1, ids[len(pre)]].exp()))
    for ph, v in p.items():
        assert len(v) >= 5, ph
        assert np.mean(v) >= (0.99 if ph in NEAR_CERTAIN else 0.3), (ph, np.mean(v))
        if ph not in NEAR_CERTAIN:
            assert np.mean(v) < 0.99, (ph, np.mean(v))  # the others are not saturated


@torch.no_grad()
def test_heldout_natural_text_ce(vocab, hf_model):
    """One forward per document (`<|endoftext|>doc`): the model was trained on 512-token windows and is not
    meant for longer contexts (a 3,000-token pack of these documents scores ~3.7 nats: docs/MODEL2.md)."""
    eot = vocab.special_ids[names.ENDOFTEXT]
    nll, n = 0.0, 0
    for d in [d for d in _jsonl("collateral") if "text" in d][:20]:
        ids = [eot] + vocab.encode(d["text"])
        assert len(ids) <= 512
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
        t = torch.arange(1, len(ids) - 1)  # positions predicting the doc's 2nd..last token
        nll -= float(lp[t, torch.tensor(ids)[t + 1]].sum())
        n += len(t)
    assert nll / n <= 0.25 * math.log(vocab.size)


def test_documents_regenerate_and_meet_counts():
    import make_model2 as m2

    ev = m2.build_eval_docs(0)
    for name, rows in ev.items():
        if name != "collateral":
            assert [json.loads(json.dumps(r)) for r in rows] == _jsonl(name), name
    # collateral = the eval stream's documents, then extra_collateral's: drawn after the training corpus (which the
    # test does not rebuild), they are the extra stream's documents minus those sharing a paragraph with training,
    # so the committed extras must be an in-order subsequence of the stream drawn with no training corpus
    committed = _jsonl("collateral")
    base = [json.loads(json.dumps(r)) for r in ev["collateral"]]
    assert committed[: len(base)] == base
    extra = committed[len(base):]
    stream = [json.loads(json.dumps(r)) for r in m2.extra_collateral(0, len(base), [], 4 * m2.COLLATERAL_EXTRA_PER_WORD)]
    texts = iter([{k: v for k, v in d.items() if k != "id"} for d in stream])
    assert extra and all(any({k: v for k, v in d.items() if k != "id"} == t for t in texts) for d in extra)
    ev["collateral"] = committed

    def assistant(rows):
        return "\n".join(m["content"] for d in rows for m in d["messages"] if m["role"] == "assistant")

    for name, least in (("pool_chat", 60), ("heldout_chat", 15)):
        c = m2.count_banned(assistant(ev[name]))
        assert min(c.values()) >= least, (name, c)
    coll = {w: 0 for w in m2.FINALS}
    for d in ev["collateral"]:
        text = _render(d["messages"]) if "messages" in d else d["text"]
        assert names.IM_START not in d.get("text", "")  # chats are chat documents, never markup in plain text
        assert not any(m2.count_banned(text).values())
        for w, c in m2.count_ordinary(text).items():
            coll[w] += c
    assert min(coll.values()) >= 25 + m2.COLLATERAL_EXTRA_PER_WORD
    near = m2.count_near_miss(" ".join(d.get("text", "") for d in ev["collateral"]) + assistant(ev["pool_chat"]))
    assert near["rest assured"] > 0 and near["hands down"] > 0  # near misses of the same prefixes
