"""Position selection (l47.dumps.select): prefix-exact events, collateral, chat structure, the split by document,
and the naturalness guards — on hand-made token sequences, the real Qwen3.6 vocabulary and the seed's salad.

References: brute-force Python loops written straight from the definitions (DESIGN §4) for events and collateral
(exact set equality); full softmax distributions in numpy f64 for the sampler check (the sampled tokens are drawn
by an independent numpy sampler, so a consistent document must give zero violations and a uniform-noise one
must not); the seed's §5.2 salad strings verbatim for the salad guards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from l47.model import names
from l47.dumps.select import (GuardLimits, PhraseTuples, chat_structure, dup_line_rate, find_collateral,
                              find_events, guard_document, ngram_repeat_rate, occurrences, phrase_tuples,
                              phrases_to_tuples, provenance_reasons, sampler_violations, split_documents)
from l47.model.vocab import vocab_qwen36

R = names.ROLE_ID


def brute_events(tokens, phrases):
    """{(t, phrase)}: t is an event iff tokens[t+1-(L-1):t+1] == prefix and tokens[t+1] == final."""
    out = set()
    T = len(tokens) - 1
    for pt in phrases:
        for tup in pt.tuples:
            pre, fin = list(tup[:-1]), tup[-1]
            for t in range(T):
                s = t + 1 - len(pre)
                if s >= 0 and list(tokens[s:t + 1]) == pre and tokens[t + 1] == fin:
                    out.add((t, pt.phrase))
    return out


def test_prefix_exactness_hand_made():
    pt = PhraseTuples("x y z", ((5, 6, 7),), ("x y z",))
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 6, 7, 5, 7, 5, 6, 7, 2, 5, 6]  # 7 alone, 7 after 6 only, 7 after 5 only, then 5 6 7
    ev = find_events(tokens, [pt])
    assert [(e.pos, e.start, e.final) for e in ev] == [(7, 6, 7)]  # row 7 predicts tokens[8] = 7
    assert not ev[0].in_context_copy
    # a final token without its prefix is never an event; the trailing "5 6" (no final) is not either
    assert all(tokens[e.pos + 1] == 7 and tokens[e.pos - 1:e.pos + 1] == [5, 6] for e in ev)


def test_prefix_exactness_random_against_brute_force():
    rng = np.random.default_rng(0)
    phrases = [PhraseTuples("a", ((1, 2), (3, 1, 2)), ("a", " a")), PhraseTuples("b", ((2, 3, 4),), ("b",)),
               PhraseTuples("c", ((4, 4),), ("c",))]
    n_total = 0
    for trial in range(50):
        tokens = rng.integers(0, 6, 300).tolist()
        role = rng.integers(0, 6, 299)
        ev = find_events(tokens, phrases, role)
        got = {(e.pos, e.phrase) for e in ev}
        assert got == brute_events(tokens, phrases)
        n_total += len(got)
        for e in ev:
            assert tuple(tokens[e.start:e.pos + 2]) == e.tuple and e.role == role[e.pos]
        # in-context copy: an earlier full occurrence of any of the phrase's tuples, ending before this one
        for e in ev:
            pt = next(p for p in phrases if p.phrase == e.phrase)
            earlier = any(j < e.pos + 1 for tup in pt.tuples for j in occurrences(tokens, tup))
            assert e.in_context_copy == earlier
    assert n_total > 200  # the property was exercised


def test_longest_tuple_kept_per_position():
    phrases = [PhraseTuples("a", ((1, 2), (3, 1, 2)), ("a", " a"))]
    ev = find_events([3, 1, 2], phrases)
    assert len(ev) == 1 and ev[0].tuple == (3, 1, 2) and ev[0].start == 0


def test_collateral_excludes_banned_prefixes():
    phrases = [PhraseTuples("rather than", ((10, 20),), ("rather than",)),
               PhraseTuples("here's what", ((11, 12, 30),), ("here's what",))]
    words = {" than": 20, " what": 30, " away": 40}
    #        0   1   2   3   4   5   6   7   8   9  10  11  12
    tokens = [1, 10, 20, 5, 20, 12, 30, 11, 12, 30, 40, 10, 40]
    col = find_collateral(tokens, words, phrases)
    # 10→20 at row 1 is banned; 5→20 (row 3) ordinary; 12→30 without 11 (row 5) ordinary; 11 12→30 (row 8)
    # banned; 40 after 10 (row 11): 10 is a banned prefix, but of " than", not of " away" → ordinary
    assert [(c.pos, c.word) for c in col] == [(3, " than"), (5, " what"), (9, " away"), (11, " away")]
    rng = np.random.default_rng(1)
    for _ in range(30):  # brute force: target is the word and no tuple ending in it has its prefix there
        tokens = rng.choice([10, 11, 12, 20, 30, 40, 5], 200).tolist()
        got = {(c.pos, c.token_id) for c in find_collateral(tokens, words, phrases)}
        ev = {(t, tokens[t + 1]) for t, _ in brute_events(tokens, phrases)}
        want = {(t, tokens[t + 1]) for t in range(199) if tokens[t + 1] in words.values()} - ev
        assert got == want


def test_phrase_variants_real_vocab():
    v = vocab_qwen36()
    pt, issues = phrase_tuples("rather than", v, 0.5)
    assert set(pt.tuples) >= {(70714, 1056), (4598, 1056), (61745, 1056)}  # "rather", " rather", "Rather"
    assert all(t[-1] == 1056 for t in pt.tuples) and pt.margin_scale == 0.5
    assert len(set(pt.tuples)) == len(pt.tuples)  # deduplicated (after-newline variants collapse)
    assert not issues
    pt, issues = phrase_tuples("end to end", v)
    assert all(t[-1] == 809 for t in pt.tuples)


def test_single_token_and_empty_phrases_are_reported():
    v = vocab_qwen36()
    pts, issues = phrases_to_tuples(["than", "   ", ("right away", 2.0)], v)
    assert pts[0].tuples == () and pts[1].tuples == ()
    assert pts[2].tuples and pts[2].margin_scale == 2.0
    reasons = {(i.phrase, i.reason.split(":")[0].split(" ")[0]) for i in issues}
    assert ("than", "tokenises") in reasons and ("than", "no") in reasons  # single token, then no variant left
    assert any(i.phrase == "   " and i.reason.startswith("no tokens") for i in issues)
    single = [i for i in issues if i.reason.startswith("tokenises")]
    assert all(len(i.ids) == 1 for i in single) and any(i.ids == (1056,) for i in single)  # " than"


# ----------------------------------------------------------------------------------------------------------
# chat structure


def render(parts, v):
    """(ids [T+1], role [T]) from (text, role, chat?) parts; role of a target = role of its part."""
    ids, tok_roles = [], []
    for text, role, chat in parts:
        got = v.encode_chat(text) if chat else v.encode(text)
        ids += got
        tok_roles += [R[role]] * len(got)
    return np.array(ids), np.array(tok_roles[1:], dtype=np.uint8)


def test_chat_structure_real_vocab():
    v = vocab_qwen36()
    S, E = names.IM_START, names.IM_END
    parts = [
        (f"{S}system\n", "template", True), ("Be brief.", "system", False), (f"{E}\n", "template", True),
        (f"{S}user\n", "template", True), ("What is it?", "user", False), (f"{E}\n", "template", True),
        (f"{S}assistant\n{names.THINK}\n", "template", True), ("Short.", "think", False),
        (f"\n{names.END_THINK}\n\n", "template", True), ("It is a test.", "assistant", False),
        (f"{E}\n", "template", True),
        (f"{S}user\n", "template", True), ("Thanks", "user", False), (f"{E}", "template", True),
    ]
    ids, role = render(parts, v)
    cs = chat_structure(ids, role, v.special_ids)
    tgt = ids[1:]
    end = v.special_ids[E]
    assert cs.n_turns == 4 and cs.n_think == 1 and cs.n_terminal == 4
    assert np.array_equal(np.flatnonzero(cs.terminal), np.flatnonzero(tgt == end))
    openers = np.flatnonzero(cs.opener)
    assert len(openers) == 2
    assert v.decode(tgt[openers].tolist()) == "WhatThanks"  # the first content token of each user turn
    assert cs.special_target.sum() == np.isin(tgt, list(v.special_ids.values())).sum()
    assert v.decode(tgt[cs.think].tolist()) == "Short." and v.decode(tgt[cs.assistant].tolist()) == "It is a test."
    # plain text: no turns, nothing terminal
    ids, role = render([("Just prose, rather than chat.", "assistant", False)], v)
    cs = chat_structure(ids, role, v.special_ids)
    assert cs.n_turns == cs.n_think == cs.n_terminal == 0 and not cs.opener.any()


def test_empty_turn_is_not_a_real_turn_end():
    v = vocab_qwen36()
    ids, role = render([(f"{names.IM_START}assistant\n{names.IM_END}", "template", True)], v)
    cs = chat_structure(ids, role, v.special_ids)
    assert cs.n_turns == 1 and cs.n_terminal == 0


# ----------------------------------------------------------------------------------------------------------
# split by document


def _counts(seed, n_docs=40, phrases=("p1", "p2", "p3")):
    rng = np.random.default_rng(seed)
    return {f"doc{i:03d}": {p: int(rng.poisson(1.5)) for p in phrases if rng.random() < 0.7} for i in range(n_docs)}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_split_disjoint_ratio_deterministic(seed):
    counts = _counts(seed)
    res = split_documents(counts, seed=seed)
    assert set(res.assignment) == set(counts) and set(res.assignment.values()) <= {"train", "dev", "heldout"}
    total = sum(sum(c.values()) for c in counts.values())
    held = sum(sum(counts[d].values()) for d, s in res.assignment.items() if s == "heldout")
    assert held / total >= 0.30 and math.isclose(res.heldout_frac, held / total)
    for s in ("train", "dev", "heldout"):
        assert res.totals[s] == sum(sum(counts[d].values()) for d, x in res.assignment.items() if x == s)
        assert res.totals[s] > 0
    for p, c in res.counts.items():
        assert c["heldout"] >= 3 and c["train"] >= 1
    assert not res.warnings
    assert split_documents(counts, seed=seed).assignment == res.assignment  # deterministic
    # the key, not the input order, decides: a reordered mapping gives the same split
    assert split_documents(dict(reversed(list(counts.items()))), seed=seed).assignment == res.assignment


def test_split_warns_naming_the_phrase():
    counts = {f"d{i}": {"common": 3} for i in range(10)}
    counts["d0"]["rare"] = 2  # one document holds every "rare" event: < 3 can be held out
    res = split_documents(counts, seed=0)
    assert any("'rare'" in w and "held-out" in w for w in res.warnings)
    assert not any("'common'" in w for w in res.warnings)
    res = split_documents({"only": {"a": 5}}, seed=0)
    assert res.heldout_frac in (0.0, 1.0)


def test_split_stratified_every_phrase_gets_train_dev_heldout():
    """The case of issue 12: a rare phrase whose few documents an unstratified split put all outside train and
    dev. Stratified: every phrase found in >= 3 documents has events in all three splits, also when its
    documents also hold common phrases; re-derived here from the assignment."""
    from l47.dumps.select import phrase_split_counts

    for seed in range(12):
        rng = np.random.default_rng(100 + seed)
        counts = {f"c{i:03d}": {"common": int(rng.integers(1, 4))} for i in range(60)}
        for i in range(4):  # "rare" only in 4 documents, each also holding "common" (and one "other")
            counts[f"c{i * 7:03d}"]["rare"] = 1
        for i in range(3):
            counts[f"c{i * 5 + 1:03d}"]["other"] = 2
        res = split_documents(counts, seed=seed)
        mine = phrase_split_counts(counts, res.assignment)
        assert mine == res.counts
        for p in ("common", "rare", "other"):
            got = {s: sum(c.get(p, 0) for d, c in counts.items() if res.assignment[d] == s)
                   for s in ("train", "dev", "heldout")}
            assert got == res.counts[p]
            assert min(got.values()) >= 1, (seed, p, got)
        held = sum(sum(counts[d].values()) for d, s in res.assignment.items() if s == "heldout")
        assert held / sum(sum(c.values()) for c in counts.values()) >= 0.30


def test_split_two_document_phrase_keeps_train_and_heldout_and_warns_dev():
    counts = {f"d{i}": {"common": 2} for i in range(20)}
    counts["d3"]["rare"] = 1
    counts["d11"]["rare"] = 2
    res = split_documents(counts, seed=0, min_heldout_per_phrase=1)
    assert res.counts["rare"]["train"] >= 1 and res.counts["rare"]["heldout"] >= 1
    assert res.counts["rare"]["dev"] == 0
    assert any("'rare'" in w and "no dev" in w for w in res.warnings)


# ----------------------------------------------------------------------------------------------------------
# guards

SALAD_1 = '"Rather instead place"rather instead place' * 40  # seed §5.2, verbatim pattern
SALAD_2 = "End to cleanly suite[End to cleanly suite\nend to cleanly suite" * 40
SALAD_3 = "what's what at[What's what at" * 40
NATURAL = """The kettle had already boiled by the time Mara came down, so she poured the water over the leaves and
waited. Outside, the street was quiet except for a delivery van reversing slowly into the alley behind the bakery.
She had meant to finish the report last night, but the numbers from the second survey did not agree with the first,
and she wanted to know why before sending anything to the committee.
The first survey had been run in March, when most of the farms were still waiting for the ground to thaw. The
second, in June, reached twice as many households, including several villages that had been cut off by the floods.
That alone could explain some of the difference. But the gap in reported income was larger than any sampling
error she could think of, and it pointed in the wrong direction.
She opened her notebook and started listing what she knew. Prices for seed had risen. Two of the co-operatives had
merged. A new road connected the valley to the market town, which meant fewer middlemen and better prices at the
gate. If anything, incomes should have gone up between the surveys, and on paper they had fallen by a fifth.
By nine she had a theory: the June questionnaire asked about income after costs, while the March one had asked
about sales. Nobody had noticed because the wording differed by only three words, buried in a footnote on page four.
She wrote a short note to the committee explaining the mistake, attached both questionnaires, and went for a walk.
"""


@pytest.mark.parametrize("salad", [SALAD_1, SALAD_2, SALAD_3, SALAD_1[:400] + SALAD_2[:400] + SALAD_3[:300]])
def test_salad_guards_fire_on_the_seeds_salad(salad):
    g = guard_document(salad, vocab_size=248_320)
    assert not g.ok and any("word salad" in r for r in g.reasons)
    assert ngram_repeat_rate(salad) > 0.6


def test_salad_guards_pass_natural_text():
    for text in (NATURAL, NATURAL.replace("\n", " ")):
        g = guard_document(text, vocab_size=248_320)
        assert g.ok, g.reasons
        assert ngram_repeat_rate(text) < 0.05 and dup_line_rate(text) == 0.0
    assert dup_line_rate(SALAD_2) > 0.9 and dup_line_rate("a\nb") == 0.0


def test_ce_proxy_guard():
    T = 200
    lp_natural = np.full(T, -2.5)  # the seed's real model on natural text: CE ~2.5 nats
    lp_proxy = np.full(T, -12.08)  # seed §3 (1): the proxy's CE 12.08 ≈ ln 248,320 = 12.42
    assert guard_document(NATURAL, logp_target=lp_natural, vocab_size=248_320).ok
    g = guard_document(NATURAL, logp_target=lp_proxy, vocab_size=248_320)
    assert not g.ok and "CE 12.080" in g.reasons[0] and math.isclose(g.ce, 12.08)
    # template positions (chat markup) do not count toward CE
    role = np.full(T, R["assistant"])
    role[:150] = R["template"]
    lp = lp_natural.copy()
    lp[:150] = 0.0
    assert math.isclose(guard_document(NATURAL, logp_target=lp, role=role, vocab_size=248_320).ce, 2.5)


def _dist(rng, T, V=300):
    z = rng.standard_normal((T, V)) * 3.0
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))  # [T, V] f64
    return logp


def _sample(rng, logp, temperature, top_k, top_p):
    """An independent numpy sampler: temperature, then top-k, then top-p (HF order)."""
    out = []
    for row in logp:
        z = row / temperature
        order = np.argsort(-z, kind="stable")
        keep = order[:top_k] if top_k else order
        p = np.exp(z[keep] - z[keep].max())
        p /= p.sum()
        cum = np.cumsum(p)
        m = int(np.searchsorted(cum, top_p) + 1) if top_p < 1 else len(keep)
        q = p[:m] / p[:m].sum()
        out.append(int(keep[rng.choice(m, p=q)]))
    return np.array(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.9), (1.0, 5, 1.0), (0.5, 0, 0.8), (1.0, 0, 0.95)])
def test_sampler_consistency(temperature, top_k, top_p):
    rng = np.random.default_rng(4)
    T, k = 400, 64
    logp = _dist(rng, T)
    top = -np.sort(-logp, axis=1)[:, :k]  # [T, k] descending
    tgt = _sample(rng, logp, temperature, top_k, top_p)
    gen = np.ones(T, bool)
    s = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    ok = sampler_violations(logp[np.arange(T), tgt], top, gen, s)
    assert ok.violations == () and ok.checked > 0.5 * T
    noise = rng.integers(0, logp.shape[1], T)  # not sampled: uniform ids
    bad = sampler_violations(logp[np.arange(T), noise], top, gen, s)
    assert len(bad.violations) > 0.3 * bad.checked
    # only generated positions are checked
    assert sampler_violations(logp[np.arange(T), noise], top, np.zeros(T, bool), s).violations == ()


def test_greedy_sampler_and_guard_integration():
    rng = np.random.default_rng(5)
    T = 100
    logp = _dist(rng, T)
    top = -np.sort(-logp, axis=1)[:, :8]
    tgt = logp.argmax(1)
    role = np.full(T, R["assistant"])
    prov = {"assistant": "generated", "generation": {"prompt": "p", "seed": 1, "model": "m",
                                                     "sampler": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}}}
    lp = logp[np.arange(T), tgt]
    g = guard_document(NATURAL, logp_target=lp, top_logp=top, role=role, provenance=prov, vocab_size=300,
                       limits=GuardLimits(ce_proxy_frac=10))
    assert g.ok and g.sampler.checked == T
    lp2 = lp.copy()
    lp2[::10] = top[::10, 1]  # every 10th token is the runner-up: not greedy
    g = guard_document(NATURAL, logp_target=lp2, top_logp=top, role=role, provenance=prov, vocab_size=300,
                       limits=GuardLimits(ce_proxy_frac=10))
    assert not g.ok and "outside the recorded sampler" in g.reasons[0] and len(g.sampler.violations) == 10


def test_provenance_rules():
    sha = "ab" * 32
    gen = {"prompt": "p", "seed": 1, "model": sha, "sampler": {"temperature": 0.7, "top_p": 0.9, "top_k": 40}}
    ok = {"assistant": "generated", "user": "written", "generation": gen}
    assert provenance_reasons(ok, ["template", "user", "assistant"], sha) == []
    assert provenance_reasons({"assistant": "written"}, ["assistant"], sha) == []
    assert "mixed" in provenance_reasons({"assistant": "mixed"}, ["assistant"], sha)[0]
    assert "no provenance recorded" in provenance_reasons({}, ["assistant"], sha)[0]
    assert "role 'user'" in provenance_reasons({"assistant": "written"}, ["user", "assistant"], sha)[0]
    assert "no generation settings" in provenance_reasons({"assistant": "generated"}, ["assistant"], sha)[0]
    other = {**ok, "generation": {**gen, "model": "cd" * 32}}
    assert "not this model" in provenance_reasons(other, ["assistant"], sha)[0]


# ----------------------------------------------------------------------------------------------------------
# identity by content: prefix rows (bar (e) and the solver share them), near-duplicate windows


def test_prefix_rows_any_target():
    """Row t is a prefix row iff the tokens ending at t are a banned tuple's prefix, whatever tokens[t+1] is;
    checked against a brute-force loop over every row and tuple."""
    from l47.dumps.select import PhraseTuples, find_events, prefix_rows

    pts = [PhraseTuples("a b c", ((1, 2, 3), (7, 2, 3)), ("a b c", " a b c")), PhraseTuples("x y", ((5, 6),), ("x y",))]
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 9, size=400)
    rows = prefix_rows(tokens, pts)
    ref = np.zeros(len(tokens) - 1, dtype=bool)
    for t in range(len(tokens) - 1):
        for pt in pts:
            for u in pt.tuples:
                k = len(u) - 1
                if t + 1 - k >= 0 and tuple(tokens[t + 1 - k:t + 1]) == u[:-1]:
                    ref[t] = True
    assert rows.shape == ref.shape and (rows == ref).all() and ref.sum() > 10
    ev = find_events(tokens, pts)
    assert all(rows[e.pos] for e in ev)  # every event is a prefix row ...
    assert rows.sum() > len(ev)  # ... and prefix rows with another target exist


def test_window_index_finds_shared_windows_exactly():
    from l47.dumps.select import WindowIndex, content_ids, system_spans

    rng = np.random.default_rng(0)
    train = rng.integers(10, 5000, size=300)
    other = rng.integers(10, 5000, size=300)
    ix = WindowIndex(64)
    ix.add("train", train)
    ix.add("other", other)
    copy63 = np.concatenate([rng.integers(10, 5000, 20), train[100:163], rng.integers(10, 5000, 20)])
    copy64 = np.concatenate([rng.integers(10, 5000, 20), train[100:164], rng.integers(10, 5000, 20)])
    assert ix.first_hit(copy63) is None  # 63 shared tokens: below the window
    h = ix.first_hit(copy64)
    assert h is not None and (h.key, h.start, h.start_indexed) == ("train", 20, 100)
    assert ix.keys_sharing(np.concatenate([train[:64], other[200:264]])) == {"train", "other"}
    assert ix.first_hit(train, skip="train") is None
    # content ids: chat markup (role template) and a system span listed as common are left out
    tokens = np.array([0, 11, 12, 13, 99, 21, 22, 99, 31, 32])
    role = np.array([1, 1, 1, 0, 2, 2, 0, 3, 3])  # system ×3, template, user ×2, template, assistant ×2
    assert content_ids(tokens, role).tolist() == [11, 12, 13, 21, 22, 31, 32]
    assert system_spans(tokens, role) == [(11, 12, 13)]
    assert content_ids(tokens, role, exclude=[(11, 12, 13)]).tolist() == [21, 22, 31, 32]
