"""The committed demo model (l47/demo_data/demo-model.gguf) and the documents `l47 demo` dumps.

References, all independent of the code that made the file:
    tensor types      DESIGN §1 / issue 7 (every ffn_down_shexp Q8_0, output.weight Q6_K, output_hc_* BF16,
                      norms F32), written out here, not taken from the exporter
    vocabulary        the committed tokenizer.json run by `tokenizers` vs the vocabulary rebuilt from the GGUF's
                      metadata by l47.model.vocab: identical ids on every held-out document
    tail forward      transformers' own Qwen4Exp built from the GGUF (same runtime weights, policy "strata"):
                      logits of the exact tail forward vs the full network's, f32 both (|z| up to ~20). They agree
                      to ~1e-6 relative (bitwise here), so max |Δlogit| <= 1e-4, as tests/test_forward.py; the
                      wrong runtime policy (BF16 output_hc_* without the Q8_0 round trip) already moves them by
                      7e-4, a wrong convention by O(0.1-10)
    learned slop      base p(final token | exact prefix) re-derived here from text (regex on assistant turns ->
                      rendered prefix -> full forward); an untrained model gives ~1/V = 3e-4, the bar is 0.5
    natural text      base CE on held-out natural text <= 0.25 ln V (an untrained model sits at ~ln V)
    documents         make_demo_corpus.build_eval_docs(0) regenerates the committed JSONL files byte for byte
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
DATA = REPO / "l47" / "demo_data"
GGUF = DATA / "demo-model.gguf"
sys.path.insert(0, str(REPO / "scripts"))

PHRASES = ("end to end", "short version", "here's what", "exactly what", "what's actually", "right away",
           "rather than")
WORDS = ("than", "what", "end", "away", "version", "actually")


def _jsonl(name: str) -> list[dict]:
    return [json.loads(x) for x in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]


def _render(messages: list[dict], gen: bool = False) -> str:
    s = "".join(f"{names.IM_START}{m['role']}\n{m['content']}{names.IM_END}\n" for m in messages)
    return s + (f"{names.IM_START}assistant\n" if gen else "")


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


# ----------------------------------------------------------------------------------------------------------
# the file


def test_gguf_size_and_arch(g):
    assert GGUF.stat().st_size <= 25 * 10**6
    assert g.arch() == names.ARCH
    assert g.get(names.key(names.K_EMBED)) % 256 == 0  # head rows are Q6_K super-blocks
    assert g.get(names.key(names.K_HC_LOWRANK)) % 32 == 0 and g.get(names.key(names.K_SHEXP_FF)) % 32 == 0


def test_seed_tensor_types(g):
    L = g.get(names.key(names.K_BLOCK_COUNT))
    want = {names.OUTPUT.gguf: "Q6_K", names.OUTPUT_HC_DOWN.gguf: "BF16", names.OUTPUT_HC_UP.gguf: "BF16",
            names.OUTPUT_HC_NORM.gguf: "F32"}
    for layer in range(L):
        want[f"blk.{layer}.ffn_down_shexp.weight"] = "Q8_0"
        for part in ("attn", "ffn"):
            want[f"blk.{layer}.hc_{part}_norm.weight"] = "F32"
            want[f"blk.{layer}.hc_{part}_down.weight"] = "BF16"
            want[f"blk.{layer}.hc_{part}_up.weight"] = "BF16"
    got = {k: type_name(g.info(k).ggml_type) for k in want}
    assert got == want
    norms = [k for k in g.tensors if k.endswith("norm.weight")]
    assert norms and all(type_name(g.info(k).ggml_type) == "F32" for k in norms)


def test_vocabulary_specials(g, vocab):
    assert g.get(names.K_TOK_MODEL) == "gpt2"
    assert set(vocab.special_ids) == set(names.SPECIAL_TOKENS)
    assert len(set(vocab.special_ids.values())) == 5
    assert vocab.size == g.get(names.key(names.K_VOCAB)) and vocab.size % 32 == 0
    assert g.get(names.K_TOK_EOS) == vocab.special_ids[names.IM_END]
    for s, i in vocab.special_ids.items():
        assert vocab.encode_chat(s) == [i]
    for w in WORDS:  # each final word is one token, as in the real vocabulary
        assert len(vocab.encode(" " + w)) == 1


def test_gguf_vocab_matches_tokenizer_json(vocab):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DATA / "tokenizer.json"))
    docs = _jsonl("heldout_chat") + _jsonl("blind_chat") + _jsonl("kld_chat_json") + _jsonl("collateral")[:10]
    for d in docs:
        text = _render(d["messages"]) if "messages" in d else d["text"]
        assert vocab.encode_chat(text) == tok.encode(text, add_special_tokens=False).ids, d["id"]


# ----------------------------------------------------------------------------------------------------------
# the tail forward and what the model learned


def test_tail_forward_matches_transformers(g, vocab, hf_model):
    from l47.tail.forward import full_logits, tail_mix
    from l47.model.weights import load_tail_weights
    from tiny_hf import capture

    w = load_tail_weights(g, policy="strata")
    assert (w.n, w.f, w.hc, w.r, w.V) == (256, 512, 4, 32, vocab.size)
    ids = torch.tensor(vocab.encode_chat(_render(_jsonl("blind_chat")[0]["messages"])))
    states, logits = capture(hf_model, ids)  # [T, V]
    mix = tail_mix(states["R"], states["inj"], states["hh"], states["sgv"], states["yr"], w)
    z = full_logits(mix, w)  # [T, V]
    assert logits.abs().max() > 5  # a trained model, not a near-zero init
    assert (z - logits).abs().max() <= 1e-4


def _events(messages: list[dict]):
    """(rendered prefix up to the final word, final word) for every banned phrase in assistant turns."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(messages[:k]) + f"{names.IM_START}assistant\n"
        for ph in PHRASES:
            last = " " + ph.rsplit(" ", 1)[1]
            pat = f"(?<![A-Za-z])[{ph[0].upper()}{ph[0]}]{re.escape(ph[1:])}(?![A-Za-z])"  # first letter any case
            for hit in re.finditer(pat, m["content"]):
                cut = hit.end() - len(last)
                out.append((ph, head + m["content"][:cut], last))
    return out


@torch.no_grad()
def test_model_learned_the_phrases(vocab, hf_model):
    p: dict[str, list[float]] = {ph: [] for ph in PHRASES}
    for d in _jsonl("heldout_chat") + _jsonl("blind_chat"):
        ids = vocab.encode_chat(_render(d["messages"]))
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V], one forward
        for ph, prefix, last in _events(d["messages"]):
            pre = vocab.encode_chat(prefix)  # words end at token boundaries: the prefix's ids start the doc's
            assert ids[:len(pre)] == pre and ids[len(pre)] == vocab.id_of(last), (ph, prefix[-40:])
            p[ph].append(float(lp[len(pre) - 1, ids[len(pre)]].exp()))
    for ph, v in p.items():
        assert len(v) >= 6, ph  # >= 3 held-out + 3 blind uses
        assert np.mean(v) >= 0.5, (ph, v)


@torch.no_grad()
def test_heldout_natural_text_ce(vocab, hf_model):
    eot = vocab.special_ids[names.ENDOFTEXT]
    ids, scored = [eot], []  # documents packed as in training: <|endoftext|>doc<|endoftext|>doc...
    for d in _jsonl("collateral")[:25]:
        doc = vocab.encode(d["text"])
        scored += range(len(ids), len(ids) + len(doc) - 1)  # positions predicting the doc's 2nd..last token
        ids += doc + [eot]
    lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V] f64
    t = torch.tensor(scored)
    ce = -float(lp[t, torch.tensor(ids)[t + 1]].mean())
    assert ce <= 0.25 * math.log(vocab.size)


# ----------------------------------------------------------------------------------------------------------
# the documents


def test_documents_regenerate_and_meet_counts():
    import make_demo_corpus as mc

    ev = mc.build_eval_docs(0)
    for name, rows in ev.items():
        assert [json.loads(json.dumps(r)) for r in rows] == _jsonl(name), name
    # the generation prompts: a subsequence (ids unchanged) of the corpus's prompt stream (make_demo_prompts.py
    # keeps those whose answers cover every phrase; re-running the selection needs the model: not done here)
    import make_demo_prompts as mp

    prompts = _jsonl("prompts")
    stream = {c["id"]: c for c in mp.candidates(960)}
    assert len(prompts) >= 150 and all(stream.get(d["id"]) == d for d in prompts)
    assert [d["id"] for d in prompts] == sorted(d["id"] for d in prompts)
    assert all(d["messages"][-1]["role"] == "user" for d in prompts)

    def assistant(rows):
        return "\n".join(m["content"] for d in rows for m in d["messages"] if m["role"] == "assistant")

    held = mc.count_banned(assistant(ev["heldout_chat"]))
    blind = mc.count_banned(assistant(ev["blind_chat"]))
    assert min(held.values()) >= 3 and min(blind.values()) >= 3
    assert len(ev["blind_chat"]) == 1 and names.THINK in assistant(ev["blind_chat"])
    coll = {w: 0 for w in WORDS}
    for d in ev["collateral"]:
        assert not any(mc.count_banned(d["text"]).values())
        for w, c in mc.count_ordinary(d["text"]).items():
            coll[w] += c
    assert sum(coll.values()) >= 200 and min(coll.values()) >= 20
    bg = ev["background"]
    assert any("text" in d for d in bg) and any("messages" in d for d in bg)
    for d in bg:
        assert not any(mc.count_banned(_render(d["messages"]) if "messages" in d else d["text"]).values()), d["id"]


def test_count_ordinary_excludes_banned_prefixes():
    import make_demo_corpus as mc

    assert mc.count_ordinary("we would rather than wait; more than that") == {**dict.fromkeys(WORDS, 0), "than": 1}
    assert mc.count_ordinary("test it end to end, then the end of it")["end"] == 1  # the phrase's own words too
    assert mc.count_ordinary("go right away or far away")["away"] == 1
