"""`l47 sets` end to end (l47.data.sets) on dumps made by the hf engine from the tiny transformers model, scored with
the tiny model's own GGUF (conftest: tiny_hf_model(0) exported with the tiny BPE vocabulary).

References:
  - base p at every event / collateral record against a float64 numpy re-derivation of the tail forward
    (DESIGN §1 equations, written out below from the dump arrays and the runtime weights): |Δ log p| ≤ 1e-4
    (f32 forward on O(10) logits vs f64; the same bar as tests/test_forward.py);
  - prefix-exactness and collateral exclusion against the token ids read back from each dump file;
  - the refusals against documents built to trip exactly one rule each.
The random tiny model puts p ≈ 1e-4…1e-2 on most tokens and has CE ≈ ln V, so the main experiment sets
non_event_p = 3e-4 and ce_proxy_frac = 2 (documented overrides); a second experiment with the seed's defaults
shows the non-event filter and the proxy guard firing on the same dumps.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rich.console import Console

from l47.model import names
from l47.dumps import SCHEMA_VERSION, DumpMeta, read_dump, write_dump
from l47.dumps.chat import render_chat, render_plain
from l47.errors import L47Error
from l47.testing.synth import SynthDims, synth_dump_arrays
from l47.app.sets_view import render_sets_table, run_sets
from l47.data.sets import build_sets, load_sets_report, write_sets_json

FILLER = [
    "The quick brown fox jumps over the lazy dog.",
    "A model reads text and predicts the next token.",
    "Far away, the mountains were covered in snow.",
    "She asked what the answer was, and he said that he would think about it.",
    "Numbers like 12, 345 and 6789 appear in tables, lists and reports.",
    "The system prompt says: you are a helpful assistant.",
    "Tools return JSON which the assistant reads.",
    "Mix flour, water, salt and yeast, knead, let it rise, then bake.",
    "The river ran through the valley to the sea.",
    "It is version 2, actually, and more than that, it is the end of the story.",
    "What is the version of the file?",
    "Dates like 2024-05-01 appear in reports too.",
]
SLOP = [
    "Rather than guessing, it measures the real network.",
    "It measures the real network end to end, and it reports the numbers.",
    "It reports the numbers right away.",
    "The model reads text rather than tables.",
    "Answer briefly, end to end, and precisely.",
    "Bake the bread right away, then think about it.",
]
PHRASES = ("rather than", "end to end", "right away")
SHA_OTHER = "0" * 64


def _text(rng, n_fill, n_slop):
    lines = [FILLER[i] for i in rng.choice(len(FILLER), n_fill, replace=False)]
    lines += [SLOP[i] for i in rng.choice(len(SLOP), n_slop, replace=False)]
    rng.shuffle(lines)
    return "\n".join(lines)


def _meta(doc_id, sha, prov, text):
    return DumpMeta(schema_version=SCHEMA_VERSION, doc_id=doc_id, layer=2, n=256, f=64, hc=4, r=32, V=1024,
                    model=sha, engine={"name": "hf", "version": "test", "settings": {"weight_policy": "exact"}},
                    inj_convention="raw", hh_precision="f32", provenance=prov, text=text)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_hf_model, tiny_vocab, tiny_gguf):
    from l47.engine.hf import SamplerSettings, capture, generate, model_id

    root = tmp_path_factory.mktemp("sets")
    model = tiny_hf_model(0)
    sha = model_id(tiny_gguf)
    v = tiny_vocab
    rng = np.random.default_rng(0)

    cache = {}

    def dump(name, ids, role, prov, text, states="model"):
        """states "model": captured from the tiny model (once per id sequence); "synth": l47.testing.synth arrays (for
        documents refused before their numbers matter — keeps this fixture fast on 2 cores)."""
        key = tuple(int(i) for i in ids)
        if states == "synth":
            arr = synth_dump_arrays(SynthDims(n=256, f=64, r=32, hc=4, V=1024), len(ids) - 1, seed=len(ids))
            arr["tokens"] = np.asarray(ids, dtype=np.int32)
        else:
            arr = cache.setdefault(key, capture(model, ids))
        arr = dict(arr)
        arr["role"] = np.asarray(role, dtype=np.uint8)
        return write_dump(root / f"{name}.safetensors", arr, _meta(name, sha, prov, text))

    written = {"assistant": "written"}
    for i in range(6):  # the split pool: natural written documents with slop
        text = _text(rng, 3, 3)
        dump(f"pool{i}", *render_plain(text, v), written, text)
    text = _text(rng, 2, 2)
    dump("mixed", *render_plain(text, v), {"assistant": "mixed"}, text, states="synth")
    salad = '"Rather than place"rather than place' * 6
    dump("salad", *render_plain(salad, v), written, salad, states="synth")
    # the model's own generations: sampled with top_k 20; one claims greedy (inconsistent), one another model
    prompt = v.encode("User: How do I bake bread? Assistant:")
    new = generate(model, prompt, SamplerSettings(16, seed=7, temperature=1.0, top_k=20))  # decode: ~0.25 s a token
    for name, claim_k, gen_model in (("gen_ok", 20, sha), ("gen_lies", 1, sha), ("gen_other", 20, SHA_OTHER)):
        ids = prompt + new
        role = [names.ROLE_ID["user"]] * (len(prompt) - 1) + [names.ROLE_ID["assistant"]] * len(new)
        prov = {"template": "written", "user": "written", "assistant": "generated",
                "generation": {"prompt": "bake", "seed": 7, "model": gen_model,
                               "sampler": {"temperature": 1.0, "top_p": 1.0, "top_k": claim_k}}}
        dump(name, ids, role, prov, v.decode(ids))
    # collateral: ordinary " than" / " end" / " away" plus one banned use of each
    text = "\n".join(FILLER + ["More than that, far away.", "The end of it.", "Send it right away, rather than later."])
    dump("collateral", *render_plain(text, v), written, text)
    # chat documents
    chat = [{"role": "user", "content": "How do I bake bread?"},
            {"role": "assistant", "content": "<think>\nMix flour and water.\n</think>\n\nKnead it, rather than "
                                             "guessing, then bake it right away."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "<think>\nShort.\n</think>\n\nYou are welcome."}]
    ids, role = render_chat(chat, v)
    all_written = {"template": "written", "user": "written", "assistant": "written", "think": "written"}
    dump("chat_ok", ids, role, all_written, "chat")
    ids, role = render_chat([chat[0], {"role": "assistant", "content": "Rather than guessing, bake it."}], v)
    dump("chat_nothink", ids, role, {"template": "written", "user": "written", "assistant": "written"}, "chat")
    ids, role = render_chat([{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "<think>\nok\n</think>\n\nHello there."}], v)
    dump("blind", ids, role, all_written, "blind")
    text = "Tools return JSON like {\"name\": \"search\"} which the assistant reads."
    dump("kld_ops", *render_plain(text, v), written, text)
    (root / "corrupt.safetensors").write_bytes(b"not a dump at all")
    (root / "model.gguf").symlink_to(tiny_gguf)
    return root, sha


def _toml(extra_thresholds="non_event_p = 3e-4\nce_proxy_frac = 2.0\n"):
    return f"""
model = "model.gguf"
policy = "exact"

[sets]
collateral_eval = ["collateral.safetensors"]
chat_heldout = ["chat_ok.safetensors", "chat_nothink.safetensors"]
blind = ["blind.safetensors"]
background = ["corrupt.safetensors"]

[sets.kld]
ops = ["kld_ops.safetensors"]

[split]
pool = ["pool*.safetensors", "mixed.safetensors", "salad.safetensors", "gen_*.safetensors"]
seed = 1

{''.join(f'[[phrases]]{chr(10)}text = "{p}"{chr(10)}{chr(10)}' for p in PHRASES)}
[[phrases]]
text = "the"

[collateral]
words = [" than", " end", " away"]

[thresholds]
{extra_thresholds}
"""


def _np_logp(w, d) -> np.ndarray:
    """log p(target) [T] in float64 numpy straight from DESIGN §1 (independent of l47.tail.forward)."""
    f = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    T, hc, n = d.R.shape
    ys = d.hh.astype(np.float64) @ f(w.W_sd).T  # [T, n]
    bo = d.yr + sig(d.sgv.astype(np.float64))[:, None] * ys  # [T, n]
    Rp = d.R + bo[:, None, :] * 2 * sig(d.inj.astype(np.float64) / hc)[:, :, None]  # [T, hc, n]
    xn = Rp * f(w.onorm)[None] / np.sqrt((Rp ** 2).mean(-1, keepdims=True) + w.eps)  # [T, hc, n]
    a = xn.reshape(T, hc * n) @ f(w.odown).T / hc  # [T, r]
    lo = a * sig(a)
    g = sig(lo @ f(w.oup).T).reshape(T, hc, n)  # [T, hc, n]
    mix = (xn * g).sum(1) / hc  # [T, n]
    z = mix @ f(w.head).T  # [T, V]
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    return z[np.arange(T), d.tokens[1:]] - lse


@pytest.fixture(scope="module")
def report(world):
    root, _ = world
    p = root / "exp.toml"
    p.write_text(_toml())
    return build_sets(p)


def _doc(report, name):
    return next(d for d in report.docs if d.path.endswith(f"/{name}.safetensors"))


def test_base_p_is_the_exact_forward(report, world):
    from l47.model.weights import load_tail_weights

    w = load_tail_weights(world[0] / "model.gguf", policy="exact")
    recs = list(report.events) + list(report.non_events) + list(report.collateral)
    assert len(report.events) >= 10 and len(report.non_events) >= 3 and len(report.collateral) >= 5
    by_doc = {}
    for r in recs:
        by_doc.setdefault(r.doc, []).append(r)
    for doc, rs in by_doc.items():
        ref = _np_logp(w, read_dump(doc))  # [T] f64
        for r in rs:
            assert abs(math.log(r.p_base) - ref[r.pos]) <= 1e-4, (doc, r.pos)


def test_events_prefix_exact_and_non_event_filter(report):
    thr = report.thresholds["non_event_p"]
    assert thr == 3e-4
    for r in report.events + report.non_events:
        tokens = read_dump(r.doc).tokens
        L = len(r.tuple)
        assert tuple(tokens[r.pos + 2 - L:r.pos + 2]) == r.tuple and tokens[r.pos + 1] == r.final
        assert r.final == r.tuple[-1] and r.phrase in PHRASES
        assert r.role == names.ROLES[read_dump(r.doc).role[r.pos]]
        assert r.generated == (r.role == "assistant" and "/gen_" in r.doc)
    assert all(r.p_base >= thr for r in report.events) and all(r.p_base < thr for r in report.non_events)
    for d in report.docs:  # per-document counts agree with the records
        if not d.refused:
            assert d.events == sum(1 for r in report.events if r.doc == d.path)
            assert d.non_events == sum(1 for r in report.non_events if r.doc == d.path)


def test_split_by_document(report):
    assign = report.split["assignment"]
    assert set(assign.values()) <= {"train", "dev", "heldout"} and len(assign) == 7  # 6 pool + gen_ok
    by_set = {}
    for r in report.events:
        by_set.setdefault(r.set, set()).add(r.doc)
    assert not (by_set.get("heldout", set()) & (by_set.get("train", set()) | by_set.get("dev", set())))
    split_ev = [r for r in report.events if r.set in ("train", "dev", "heldout")]
    held = sum(r.set == "heldout" for r in split_ev)
    assert held / len(split_ev) >= 0.30  # the split moves whole documents until the share is reached
    assert not any("of events held out" in w for w in report.warnings)
    # a phrase short of held-out events is named in a warning exactly when its count is below the minimum
    per = {p: sum(1 for r in split_ev if r.set == "heldout" and r.phrase == p) for p in PHRASES}
    warned = {p for p in PHRASES if any(w.startswith(f"phrase {p!r}: ") and "held-out events" in w
                                        for w in report.warnings)}
    assert warned == {p for p, n in per.items() if n < 3}, (per, report.warnings)
    # documents are the unit: every document's events are in one split
    for d in assign:
        assert len({r.set for r in report.events if r.doc == d}) <= 1
    assert all(r.set in ("train", "dev") for r in report.solver_events())
    assert {r.doc for r in report.heldout_events()} <= {d for d, s in assign.items() if s == "heldout"}
    # refused pool documents are not split
    for name in ("mixed", "salad", "gen_lies", "gen_other"):
        assert _doc(report, name).path not in assign


def test_refusals_name_the_rule(report):
    why = lambda n: " ".join(_doc(report, n).reasons)  # noqa: E731
    assert _doc(report, "mixed").refused and "mixed" in why("mixed")
    assert _doc(report, "salad").refused and "word salad" in why("salad")
    assert _doc(report, "gen_lies").refused and "sampler" in why("gen_lies")
    assert _doc(report, "gen_other").refused and "not this model" in why("gen_other")
    assert _doc(report, "chat_nothink").refused and "<think>" in why("chat_nothink")
    assert _doc(report, "corrupt").refused and "unreadable dump" in why("corrupt")
    ok = _doc(report, "gen_ok")
    assert not ok.refused and ok.sampler_checked >= 16 and ok.sampler_violations == 0
    chat = _doc(report, "chat_ok")
    assert not chat.refused and chat.coverage.turns == 4 and chat.coverage.think_blocks == 2
    assert chat.coverage.terminal == 4 and chat.coverage.openers == 2
    # refused documents contribute no records
    refused = {d.path for d in report.docs if d.refused}
    assert not any(r.doc in refused for r in report.events + report.non_events + report.collateral)


def test_collateral_excludes_banned_prefixes(report, tiny_vocab):
    col = [c for c in report.collateral if c.set == "collateral_eval"]
    d = read_dump(col[0].doc)
    tgt = d.tokens[1:]
    ev_rows = {(r.pos, r.final) for r in report.events + report.non_events if r.doc == col[0].doc}
    words = report.collateral_words
    assert words == {w: tiny_vocab.id_of(w) for w in (" than", " end", " away")}
    want = {(t, int(tgt[t])) for t in range(len(tgt)) if tgt[t] in words.values()} - ev_rows
    assert {(c.pos, c.token_id) for c in col} == want
    assert ev_rows, "the collateral document holds banned uses that must be excluded"
    # ... "rather than later" and "right away" are excluded; "More than that" / "far away" are counted
    got_words = {c.word for c in col}
    assert {" than", " away"} <= got_words


def test_warnings_and_phrase_report(report):
    w = " | ".join(report.warnings)
    assert "set 'blind': zero events" in w  # a set with zero events is named; the rest is still reported
    assert "`l47 audit --blind` refuses a blind set without a slop event" in w
    # the blind set's events per phrase, counted by its tokens (never scored here): its chat holds no phrase
    assert report.blind_events["docs"] == 1 and set(report.blind_events["per_phrase"]) == {
        p.phrase for p in report.phrases if p.tuples}
    assert not any(report.blind_events["per_phrase"].values()) and not any(report.blind_events["occurrences"].values())
    assert all(c.get("blind") == 0 for ph, c in report.counts("events").items() if ph in report.blind_events["per_phrase"])
    assert "phrase 'end to end': 0 held-out events (< 3)" in w  # all its candidates are non-events here
    assert "collateral_eval" in w  # fewer than 200 occurrences
    assert any(i["phrase"] == "the" and "single token" in i["reason"] for i in report.phrase_issues)
    cov = report.coverage()
    assert cov["blind"].turns == 2 and cov["kld.ops"].turns == 0 and cov["collateral_eval"].final_word_targets > 0


def test_json_round_trip_and_cli(report, world, tmp_path):
    p = write_sets_json(report, tmp_path / "sets.json")
    back = load_sets_report(p)
    assert back == report
    assert json.loads(p.read_text())["schema"] == "l47.sets/1"
    con = Console(record=True, width=250)
    for r in render_sets_table(report):
        con.print(r)
    out = con.export_text()
    for s in ("events per phrase", "collateral per word", "coverage per set", "refused documents",
              "unreadable dump", "warning: set 'blind': zero events", "non_event_p=0.0003",
              "phrase variants not used", "tokenises to the single token"):
        assert s in out
    root, _ = world
    con = Console(record=True, width=250)
    code = run_sets(root / "exp.toml", tmp_path / "cli.json", con)
    assert code == 1 and load_sets_report(tmp_path / "cli.json").events == report.events


def test_seed_defaults_non_events_and_proxy_guard(world):
    root, _ = world
    p = root / "exp_defaults.toml"
    p.write_text(_toml(extra_thresholds=""))
    rep = build_sets(p)
    # the random tiny model is a proxy (CE ≈ ln V > 0.5 ln V): every training candidate is refused
    pool = [d for d in rep.docs if d.path.split("/")[-1].startswith("pool")]
    assert pool and all(d.refused and any("base CE" in r for r in d.reasons) for d in pool)
    # held-out chat documents are not CE-guarded; with p < 1e-2 its candidates are non-events
    chat = [r for r in rep.non_events if r.set == "chat_heldout"]
    assert chat and not [r for r in rep.events if r.set == "chat_heldout" and r.p_base < 1e-2]


def test_missing_model_and_dump(world, tmp_path):
    root, _ = world
    p = root / "exp_missing.toml"
    p.write_text(_toml().replace('"blind.safetensors"', '"blind.safetensors", "nowhere.safetensors"'))
    with pytest.raises(L47Error, match="nowhere.safetensors"):
        build_sets(p)
    p.write_text(_toml().replace('model = "model.gguf"\n', ""))
    with pytest.raises(L47Error, match="model"):
        build_sets(p)
