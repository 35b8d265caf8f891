"""The zoo of test models (scripts/make_zoo.py): the seed's draw, its documents, and its refusals.

Counts here are independent of make_zoo's own counters: phrase uses are found by a regex written here over the
assistant answers (think blocks cut by string search), near misses by "prefix + another word", ordinary uses by
"final word not after its prefix". No training (CPU, a few seconds).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import make_zoo as mz  # noqa: E402
import zoo_phrases as zp  # noqa: E402
import zoo_registers as zr  # noqa: E402

SEEDS = range(50)


@pytest.fixture(scope="module")
def specs():
    return [mz.draw_spec(s) for s in SEEDS]


def test_pools_are_large_enough():
    assert len(zr.REGISTERS) >= 6
    assert len(zp.CANDIDATES) >= 20
    for c in zp.CANDIDATES:
        assert 2 <= len(c.text.split()) <= 5, c.text
        assert c.carriers and c.near_miss and c.ordinary, c.text
        for t in c.near_miss:  # the prefix, then another word
            assert re.search(rf"(?i)\b{re.escape(c.prefix)} (?!{c.final}\b)\w", t), (c.text, t)
        for t in c.ordinary:  # the final word, never after the prefix, never the phrase
            assert re.search(rf"(?i)\b{c.final}\b", t) and c.text not in t.lower(), (c.text, t)
    assert sum(c.near_certain for c in zp.CANDIDATES) >= 6 and sum(c.common_final for c in zp.CANDIDATES) >= 4


def test_draw_is_deterministic(specs):
    assert [mz.draw_spec(s) for s in (0, 7, 49)] == [specs[0], specs[7], specs[49]]
    assert len({json.dumps(mz._spec_json(s), sort_keys=True) for s in specs}) == len(specs)


def test_draw_covers_the_ranges(specs):
    seen = Counter()
    for s in specs:
        m = s.model
        n, f = m["hidden_size"], m["shared_expert_intermediate_size"]
        L = m["layer_types"]
        assert 2 <= len(L) <= 5 and "indexed_attention" in L
        assert 256 <= n <= 768 and n % 64 == 0 and f % 64 == 0 and f != n
        assert 2000 <= s.vocab <= 8000
        assert 4 <= len(s.phrases) <= 7 and len(s.near_certain) >= 2 and s.common_final
        assert len({p.rsplit(" ", 1)[1] for p in s.phrases}) == len(s.phrases)  # distinct final words
        assert s.head_type in ("Q6_K", "Q8_0") and (s.head_type == "Q8_0" or n % 256 == 0)
        assert sorted(s.specials_order) == sorted(mz.SPECIALS)
        lo, hi = s.specials_at, s.specials_at + 5
        assert 0 <= lo and hi <= s.vocab
        seen["f>n" if f > n else "f<n"] += 1
        seen[s.specials_place] += 1
        seen[L[-1]] += 1
        seen[s.head_type] += 1
        seen[s.register] += 1
        seen[f"L{len(L)}"] += 1
        seen[f"n{n}"] += 1
    for k in ("f>n", "f<n", "start", "middle", "end", "linear_attention", "indexed_attention", "Q6_K", "Q8_0",
              "L2", "L3", "L4", "L5"):
        assert seen[k] >= 2, (k, seen)
    assert sum(seen[r.name] > 0 for r in zr.REGISTERS) >= 6
    assert len([k for k in seen if k.startswith("n")]) >= 5  # hidden sizes spread over the range


def test_bad_seed_and_register_refused():
    for args, word in ((["--seed", "-1"], "--seed"), (["--seed", "100000"], "--seed"),
                       (["--seed", "1", "--register", "poetry"], "--register"),
                       (["--seed", "1", "--small", "--pool-chats", "12", "--spec-only"], "pool chats")):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_zoo.py"), *args], capture_output=True,
                           text=True, timeout=60)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0], (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr
    assert "100000" in subprocess.run([sys.executable, str(REPO / "scripts" / "make_zoo.py"), "--seed", "100000"],
                                      capture_output=True, text=True, timeout=60).stderr


# ----------------------------------------------------------------------------------------------------------
# one seed's documents at --small, counted here


def _answers(doc: dict) -> str:
    out = []
    for m in doc.get("messages", []):
        if m["role"] == "assistant":
            c = m["content"]
            k = c.find("</think>")
            out.append(c[k + len("</think>"):] if c.startswith("<think>") and k >= 0 else c)
    return "\n".join(out) if "messages" in doc else doc["text"]


def _count(text: str, phrase: str) -> int:
    return len(re.findall(rf"(?i)(?<![a-z]){re.escape(phrase)}(?![a-z])", text))


@pytest.fixture(scope="module")
def world():
    spec = mz.draw_spec(11, small=True)
    return spec, mz.build_eval_docs(spec)


def test_every_phrase_has_its_events(world):
    spec, ev = world
    pool = "\n".join(_answers(d) for d in ev["pool_chat"])
    held = "\n".join(_answers(d) for d in ev["heldout_chat"])
    for p in spec.phrases:
        # the split is by document, default shares train 0.55 / held-out 0.35: 10 / 0.35 -> 29 events in the pool
        assert _count(pool, p) >= 29, (p, _count(pool, p))
        assert _count(held, p) >= 10, (p, _count(held, p))
    assert mz.check_events(spec, ev)["pool_events"] == {p: _count(pool, p) for p in spec.phrases}


def test_documents_are_disjoint_and_clean(world):
    spec, ev = world
    texts = {name: [mz.dc.doc_text(d) for d in rows] for name, rows in ev.items()}
    for name in ("collateral", "background", *spec.kld):
        for t in texts[name]:
            assert not any(_count(t, p) for p in spec.phrases), (name, t[:80])
    prompts = [d["messages"][-1]["content"] for k in ("prompts", "heldback_chat_prompts", "heldback_blind_prompts")
               for d in ev[k]]
    assert len(prompts) == len(set(prompts)) == 48 + 20 + 8
    assert all(d["messages"][-1]["role"] == "user" for k in ("prompts",) for d in ev[k])
    assert all(d["messages"][-1]["content"].startswith("<think>") for d in ev["heldout_chat"])
    # a held-back prompt's user turn is in no document of any set (the blind sign-off refuses one that is; the
    # audit compares token spans, this the texts: a turn absent as text is absent as tokens)
    docs = [t for name, rows in texts.items() if not name.startswith("heldback") for t in rows]
    for k in ("heldback_chat_prompts", "heldback_blind_prompts"):
        for d in ev[k]:
            u = d["messages"][-1]["content"]
            assert not any(u in t for t in docs), (k, u)
    ids = [d["id"] for rows in ev.values() for d in rows]
    assert len(ids) == len(set(ids))


def test_ordinary_uses_and_near_misses_present(world):
    spec, ev = world
    coll = "\n".join(mz.dc.doc_text(d) for d in ev["collateral"]).lower()
    for p in spec.phrases:
        pre, w = p.rsplit(" ", 1)
        ordinary = [m for m in re.finditer(rf"(?<= ){re.escape(w)}(?![a-z])", coll)
                    if not coll[:m.start()].rstrip().endswith(pre)]
        assert len(ordinary) >= 20, (w, len(ordinary))  # bar (d): >= 10 per word in collateral_eval (half)
    # near misses in a training-sized sample of the corpus: every phrase's prefix continued otherwise, and the
    # near-certain phrases' share of them under 1 %
    w = mz.World(spec)
    rng = mz.random.Random("test-zoo")
    text = "\n".join(w.train_doc(rng)[1] for _ in range(6000))
    for p in spec.phrases:
        pre, fin = p.rsplit(" ", 1)
        uses = _count(text, p)
        near = len(re.findall(rf"(?i)(?<![a-z]){re.escape(pre)} (?!{re.escape(fin)}(?![a-z]))[a-z]", text))
        assert uses >= 100 and near >= 1, (p, uses, near)
        if p in spec.near_certain:
            assert near / (near + uses) < 0.01, (p, near, uses)
        else:
            assert near / (near + uses) > 0.05, (p, near, uses)


def test_specials_move_anywhere():
    """place_specials: the block at start / middle / end, ids dense, text tokenised the same."""
    from tokenizers import Tokenizer

    import make_model2 as m2

    spec = mz.draw_spec(11, small=True)
    w = mz.World(spec)
    rng = mz.random.Random("tok")
    texts = [re.sub(r"<\|im_start\|>|<\|im_end\|>|</?think>", "\n", w.train_doc(rng)[1]) for _ in range(400)]
    tok = m2.train_tokenizer(texts, 800, mz.SPECIALS, ())
    V = tok.get_vocab_size()
    sample = mz.render_chat(w.chat(rng))
    ref = [tok.id_to_token(i) for i in tok.encode(sample, add_special_tokens=False).ids]
    for at in (0, V // 2, V - 5):
        t = mz.place_specials(tok, at, spec.specials_order)
        assert isinstance(t, Tokenizer) and t.get_vocab_size() == V
        assert [t.token_to_id(s) for s in spec.specials_order] == list(range(at, at + 5))
        assert sorted(t.get_vocab().values()) == list(range(V))
        got = [t.id_to_token(i) for i in t.encode(sample, add_special_tokens=False).ids]
        assert got == ref
        assert t.decode(t.encode(sample, add_special_tokens=False).ids, skip_special_tokens=False) == sample


def test_bench_marks_a_failed_model_and_goes_on(tmp_path):
    """bench_efficacy --zoo-seeds: a model whose build fails (its cache folder cannot be made: the root is a file)
    is marked FAILED with the failing command and its first error line; the run still writes its table, exit 0."""
    root = tmp_path / "root"
    root.write_text("not a folder")
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_efficacy.py"), "--models", "", "--methods", "",
                        "--zoo-seeds", "5,6", "--zoo-root", str(root), "--zoo-jobs", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "zoo seeds: 5,6" in r.stdout
    res = json.loads((out / "results.json").read_text())
    assert set(res["models"]) == {"zoo5", "zoo6"}
    for s in (5, 6):
        f = res["models"][f"zoo{s}"]["failed"]
        assert f["command"].startswith(f"python scripts/make_zoo.py --seed {s} ") and str(root) in f["command"]
        assert f["error"].split(":")[0] in ("NotADirectoryError", "FileExistsError", "FileNotFoundError"), f
    md = (out / "results.md").read_text()
    assert md.count("FAILED") == 2 and "make_zoo.py --seed 5" in md and "make_zoo.py --seed 6" in md
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_efficacy.py"), "--models", "", "--zoo-seeds",
                          "5,x", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--zoo-seeds" in bad.stderr
