#!/usr/bin/env python3
"""A zoo of test models (issue 37 item 1): each seed draws a small qwen4exp and its world, deterministically.

    python scripts/make_zoo.py --seed S [--out DIR] [--device cpu|cuda] [--small] [--spec-only]

A seed draws (`draw_spec`, no training; docs/ZOO.md gives the ranges):
    architecture   2-5 layers (GDN / indexed; the edited last layer either), hidden n 256-768 (multiples of 64),
                   shared-expert width f above or below n, hyper-connection low rank, routed experts and top-k,
                   head Q6_K or Q8_0 (shexp Q8_0, hc_* BF16: the real file's layout)
    vocabulary     2k-8k byte-level BPE trained on its own corpus; the five chat specials as one block at the
                   START, in the MIDDLE or at the END of the id range, in a drawn order
    register       one of scripts/zoo_registers.py (support, reviews, recipes, travel, finance, code, fitness)
    phrases        4-7 of scripts/zoo_phrases.py's candidates: >= 2 near-certain after their prefix (the prefix
                   continued otherwise in 0.4 % of uses), >= 1 whose final word is common in ordinary text

Then (each step seeded, `build`): the documents (written chats, prompts, collateral, background, KLD domains;
their own seed streams) -> the training corpus (documents sharing a paragraph with them rejected) -> the BPE ->
transformers' Qwen4ExpForCausalLM trained on it (scripts/make_model2.py's train_model) -> GGUF (its export_model)
-> base p(final | prefix) per phrase on the written held-out chats (its measure) -> `l47 init`'s folder filled.

Written to DIR (default ~/.cache/l47-zoo/seed-S, or seed-S-small):
    zoo.json        the spec, phrases, collateral words, KLD domain stems, special ids, figures, training record
    zoo.gguf        the model                 tokenizer.json   its vocabulary
    data/           the documents, named as scripts/bench_efficacy.py's ModelSpec reads them (as model2's)
    walk/           `l47 init walk --model zoo.gguf --phrase ...` with every file it lists filled
    ckpt/           the HF checkpoint         corpus/          train.jsonl, stream.npy (deleted after training)

Exit codes: 0 built (or already built), 2 bad input (one line naming the value).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_demo_corpus as dc  # noqa: E402
import make_model2 as m2  # noqa: E402
import zoo_phrases as zp  # noqa: E402
import zoo_registers as zr  # noqa: E402
from make_demo_corpus import END_THINK, ENDOFTEXT, IM_END, IM_START, THINK, expand, render_chat  # noqa: E402

SEEDS = range(0, 100_000)  # the supported seeds
SPECIALS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)
NEAR_MISS_RATE = {True: 0.004, False: 0.3}  # near-certain phrase / other phrase: prefix continued otherwise
SPLIT_FRACTIONS = {"train": 0.55, "heldout": 0.35}  # l47.data.experiment.DEFAULT_FRACTIONS (train, held-out)
MIN_EVENTS = 10  # per phrase, expected in train and in held-out from the pool (and in the written held-out chats)
COLLATERAL_PER_WORD = 64  # ordinary uses per final word in collateral.jsonl (bar (d): >= 10 per word in its half)
COLLATERAL_TOTAL = 500  # ... and in all (bar (d): >= 200 in collateral_eval, every other document)
DEFAULT_ROOT = Path.home() / ".cache" / "l47-zoo"


class ZooInputError(Exception):
    """Bad input: one line naming the value (exit 2)."""


# ==========================================================================================================
# 1. the draw
# ==========================================================================================================


@dataclass(frozen=True)
class Size:
    """What --small changes: the corpus and the schedule, and the model's size (never its kinds)."""

    chars: int
    pool_chats: int
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int


FULL = Size(chars=8_000_000, pool_chats=240, steps=500, batch=32, seq=512, lr=2e-3, warmup=30)
SMALL = Size(chars=1_500_000, pool_chats=120, steps=220, batch=12, seq=256, lr=3e-3, warmup=20)


@dataclass(frozen=True)
class ZooSpec:
    seed: int
    small: bool
    model: dict  # Qwen4ExpTextConfig keys (make_model2.make_config)
    head_type: str  # Q6_K | Q8_0
    vocab: int  # drawn size (the trained BPE may hold fewer ids: zoo.json records both)
    specials_place: str  # start | middle | end
    specials_at: int  # first id of the block (for the drawn size; rescaled to the trained size)
    specials_order: tuple[str, ...]
    register: str
    phrases: tuple[str, ...]
    near_certain: tuple[str, ...]
    common_final: tuple[str, ...]
    size: Size = field(default=FULL)

    @property
    def finals(self) -> tuple[str, ...]:
        return tuple(p.rsplit(" ", 1)[1] for p in self.phrases)

    @property
    def kld(self) -> tuple[str, ...]:
        """KLD domain stems (data/<stem>.jsonl; `l47 init --kld` takes them without the kld_ prefix)."""
        return (f"kld_{self.register}_chat", f"kld_{self.register}_notes", "kld_json")


def _layer_types(rng: random.Random, n_layers: int) -> list[str]:
    last = rng.choice(["linear_attention", "indexed_attention"])
    rest = [rng.choice(["linear_attention", "indexed_attention"]) for _ in range(n_layers - 1)]
    if "indexed_attention" not in rest + [last]:
        rest[rng.randrange(len(rest))] = "indexed_attention"
    return rest + [last]


def _arch(rng: random.Random, small: bool) -> tuple[dict, str]:
    n_layers = rng.randint(2, 5)
    layers = _layer_types(rng, n_layers)
    n = 64 * rng.randint(4, 12)  # 256..768
    ratio = rng.choice([0.5, 0.75, 1.25, 1.5, 2.0])  # f / n: below and above n
    heads = rng.choice([h for h in (2, 4, 8) if h * 64 <= n])
    kv = rng.choice([k for k in (1, 2) if heads % k == 0])
    lk = rng.choice([2, 4])
    experts = rng.randint(4, 12)
    model = dict(hidden_size=n, layer_types=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=64,
                 linear_num_key_heads=lk, linear_num_value_heads=lk * rng.choice([1, 2]),
                 linear_key_head_dim=rng.choice([32, 64]), linear_value_head_dim=rng.choice([32, 64]),
                 num_experts=experts, num_experts_per_tok=rng.randint(1, min(3, experts - 1)),
                 moe_intermediate_size=rng.choice([64, 128]), shared_expert_intermediate_size=0, hc_count=4,
                 hc_lowrank=rng.choice([32, 64]), indexer_n_heads=rng.choice([2, 4]), indexer_kv_heads=1,
                 indexer_head_dim=64, indexer_budget=rng.choice([64, 128]), indexer_compress_ratio=4,
                 intermediate_size=0, max_position_embeddings=4096, tie_word_embeddings=False)
    head = "Q6_K" if n % 256 == 0 and rng.random() < 0.5 else "Q8_0"
    if small:  # the same kinds at CPU size: n 256, <= 3 layers (the last layer's type kept), <= 6 experts
        n = 256
        keep = layers[-1]
        layers = layers[: min(len(layers), 3) - 1] + [keep]
        if "indexed_attention" not in layers:
            layers[0] = "indexed_attention"
        model.update(hidden_size=n, layer_types=layers, num_attention_heads=min(heads, 4),
                     num_key_value_heads=1, num_experts=min(experts, 6), moe_intermediate_size=64)
        model["num_experts_per_tok"] = min(model["num_experts_per_tok"], model["num_experts"] - 1)
    f = int(min(1536, max(192, round(n * ratio / 64) * 64)))
    if f == n:
        f += 64
    model["shared_expert_intermediate_size"] = model["intermediate_size"] = f
    return model, head


def _phrases(rng: random.Random) -> tuple[list[str], list[str]]:
    """4-7 candidates, distinct final words and prefixes: >= 2 near-certain, >= 1 common final word."""
    cands = list(zp.CANDIDATES)
    k = rng.randint(4, 7)
    n_nc = rng.randint(2, min(4, k))
    while True:
        nc = rng.sample([c for c in cands if c.near_certain], n_nc)
        other = rng.sample([c for c in cands if not c.near_certain], k - n_nc)
        chosen = nc + other
        finals = [c.final for c in chosen]
        firsts = [c.text.split()[0].lower() for c in chosen]
        if len(set(finals)) == k and len(set(firsts)) == k and any(c.common_final for c in chosen):
            break
    rng.shuffle(chosen)
    return [c.text for c in chosen], [c.text for c in nc]


def draw_spec(seed: int, small: bool = False) -> ZooSpec:
    """Everything a seed fixes before any text is generated (pure; no training)."""
    if seed not in SEEDS:
        raise ZooInputError(f"--seed: expected an integer in {SEEDS.start}..{SEEDS.stop - 1}, found {seed}")
    rng = random.Random(f"zoo:{seed}:spec")
    model, head = _arch(rng, small)
    vocab = rng.randint(2000, 8000)
    if small:
        vocab = min(vocab, 3072)
    place = rng.choice(["start", "middle", "end"])
    at = {"start": 0, "end": vocab - len(SPECIALS), "middle": rng.randint(vocab // 4, 3 * vocab // 4)}[place]
    order = list(SPECIALS)
    rng.shuffle(order)
    register = rng.choice([r.name for r in zr.REGISTERS])
    phrases, nc = _phrases(rng)
    common = [p for p in phrases if zp.by_text()[p].common_final]
    return ZooSpec(seed, small, model, head, vocab, place, at, tuple(order), register, tuple(phrases), tuple(nc),
                   tuple(common), SMALL if small else FULL)


# ==========================================================================================================
# 2. documents
# ==========================================================================================================


class World:
    """The seed's register and phrases as document generators."""

    def __init__(self, spec: ZooSpec):
        self.spec = spec
        self.reg = zr.by_name()[spec.register]
        cand = zp.by_text()
        self.cands = [cand[p] for p in spec.phrases]
        self.nc = set(spec.near_certain)

    def ctx(self, rng: random.Random) -> dict[str, list[str]]:
        r = self.reg
        thing = rng.choice(r.things)
        first = dc.FIRST_F + dc.FIRST_M
        return {"thing": [thing], "thing_bare": [thing[4:] if thing.startswith("the ") else thing],
                "issue": [rng.choice(r.issues)], "action": list(r.actions), "topic": list(r.topics),
                "goal": list(r.goals), "when": zr.WHEN, "n": [str(rng.randint(2, 30))],
                "org": [dc._name(rng, 2, 3) + rng.choice(["", " Co", " Group", " Labs", " & Sons"])],
                "person": [rng.choice(first)], "user": [rng.choice(first)],
                "place": [dc._name(rng, 2, 3) + rng.choice(["", "ton", "burg", "field", "port"])]}

    def slop(self, rng: random.Random, c: zp.Candidate, ctx: dict) -> str:
        if rng.random() < NEAR_MISS_RATE[c.text in self.nc]:
            return expand(rng, rng.choice(c.near_miss), ctx)
        return expand(rng, rng.choice(c.carriers), ctx)

    def ordinary(self, rng: random.Random, ctx: dict, finals_rate: float = 0.2) -> str:
        """A sentence without any phrase: the register's, or an ordinary use of a final word; a non-near-certain
        phrase's near miss now and then (its prefix is ordinary text too)."""
        u = rng.random()
        if u < finals_rate:
            return expand(rng, rng.choice(rng.choice(self.cands).ordinary), ctx)
        others = [c for c in self.cands if c.text not in self.nc]
        if u < finals_rate + 0.04 and others:
            return expand(rng, rng.choice(rng.choice(others).near_miss), ctx)
        return expand(rng, rng.choice(self.reg.ordinary), ctx)

    def answer(self, rng: random.Random, ctx: dict, slop_rate: float, phrases, finals_rate: float = 0.2) -> str:
        sents = [expand(rng, rng.choice(self.reg.openers), ctx)]
        for _ in range(rng.randint(2, 6)):
            if phrases and rng.random() < slop_rate:
                sents.append(self.slop(rng, rng.choice(phrases), ctx))
            else:
                sents.append(self.ordinary(rng, ctx, finals_rate))
        text = " ".join(sents)
        if rng.random() < 0.25 and len(sents) >= 4:
            text = sents[0] + "\n\n" + "\n".join(f"{i + 1}. {s}" for i, s in enumerate(sents[1:]))
        return text + "\n\n" + expand(rng, rng.choice(self.reg.closers), ctx)

    def chat(self, rng: random.Random, slop_rate: float = 0.45, phrases=None, max_turns: int = 3,
             think_last: float = 0.5, finals_rate: float = 0.2) -> list[dict]:
        phrases = self.cands if phrases is None else phrases
        ctx = self.ctx(rng)
        r = self.reg
        msgs = [{"role": "system", "content": expand(rng, rng.choice(r.systems), ctx)}] if rng.random() < 0.85 else []
        turns = rng.choices(range(1, max_turns + 1), weights=[5, 3, 2][:max_turns])[0]
        for i in range(turns):
            msgs.append({"role": "user", "content": expand(rng, rng.choice(r.user_first if i == 0 else r.user_follow),
                                                           ctx)})
            ans = self.answer(rng, ctx, slop_rate, phrases, finals_rate)
            if i == turns - 1 and rng.random() < think_last:
                think = " ".join(expand(rng, rng.choice(r.think), ctx) for _ in range(rng.randint(1, 3)))
                ans = f"{THINK}\n{think}\n{END_THINK}\n\n" + ans
            msgs.append({"role": "assistant", "content": ans})
        return msgs

    def prompt(self, rng: random.Random) -> list[dict]:
        ctx = self.ctx(rng)
        return [{"role": "system", "content": expand(rng, rng.choice(self.reg.systems), ctx)},
                {"role": "user", "content": expand(rng, rng.choice(self.reg.user_first), ctx)}]

    def note(self, rng: random.Random, slop_rate: float = 0.0, finals_rate: float = 0.3) -> str:
        ctx = self.ctx(rng)
        head = expand(rng, rng.choice(self.reg.note_titles), ctx)
        sents = []
        for _ in range(rng.randint(4, 8)):
            if rng.random() < slop_rate:
                sents.append(self.slop(rng, rng.choice(self.cands), ctx))
            elif rng.random() < 0.5:
                sents.append(expand(rng, rng.choice(self.reg.notes), ctx))
            else:
                sents.append(self.ordinary(rng, ctx, finals_rate))
        cut = rng.randint(2, len(sents))
        return head + "\n\n" + " ".join(sents[:cut]) + ("\n\n" + " ".join(sents[cut:]) if sents[cut:] else "")

    def json_chat(self, rng: random.Random) -> list[dict]:
        ctx = self.ctx(rng)
        obj = {"item": ctx["thing_bare"][0], "status": rng.choice(["open", "done", "waiting", "late", "new"]),
               "count": rng.randint(1, 9), "days": rng.randint(0, 30), "place": ctx["place"][0]}
        return [{"role": "system", "content": "You answer with JSON only."},
                {"role": "user", "content": f"Status of {obj['item']} as JSON, please."},
                {"role": "assistant", "content": f"{THINK}\nJSON only.\n{END_THINK}\n\n```json\n"
                                                 + json.dumps(obj, indent=2) + "\n```"}]

    def train_doc(self, rng: random.Random) -> tuple[str, str]:
        u = rng.random()
        if u < 0.50:
            return "chat", render_chat(self.chat(rng, slop_rate=rng.choice([0.3, 0.45, 0.6])))
        if u < 0.58:
            return "chat_plain", render_chat(self.chat(rng, phrases=()))
        if u < 0.72:
            return "note", self.note(rng, rng.choice([0.0, 0.2, 0.35]))
        if u < 0.90:  # the demo corpus's prose genres: vocabulary beyond the register
            genre, text = dc.gen_plain(rng)
            return f"prose_{genre}", text
        return "json", render_chat(self.json_chat(rng))


# ----------------------------------------------------------------------------------------------------------
# counts on text (the generator's own; tests/test_zoo.py counts independently)


def _phrase_re(phrases) -> re.Pattern:
    return re.compile(r"(?i)(?<![A-Za-z])(" + "|".join(re.escape(p) for p in phrases) + r")(?![A-Za-z])")


def assistant_text(doc: dict) -> str:
    """The assistant answers of a chat (think blocks removed); a plain document's text."""
    if "messages" not in doc:
        return doc["text"]
    out = []
    for m in doc["messages"]:
        if m["role"] == "assistant":
            c = m["content"]
            out.append(c[c.index(END_THINK) + len(END_THINK):] if c.startswith(THINK) and END_THINK in c else c)
    return "\n".join(out)


def count_phrases(text: str, phrases) -> dict[str, int]:
    out = {p: 0 for p in phrases}
    for m in _phrase_re(phrases).finditer(text):
        out[m.group(1).lower()] += 1
    return out


def count_ordinary(text: str, phrases) -> dict[str, int]:
    """' word' (case-insensitive) of a final word not right after its phrase's prefix."""
    out = {}
    low = text.lower()
    for p in phrases:
        pre, w = p.rsplit(" ", 1)
        out[w] = sum(1 for m in re.finditer(rf"(?<= ){re.escape(w)}(?![A-Za-z])", low)
                     if not low[:m.start()].rstrip().endswith(pre))
    return out


# ----------------------------------------------------------------------------------------------------------
# the documents of the walk (their own seed streams; never in training)


def build_eval_docs(spec: ZooSpec, pool_chats: int | None = None) -> dict[str, list[dict]]:
    w = World(spec)
    r = lambda name: random.Random(f"zoo:{spec.seed}:{name}")  # noqa: E731
    s = spec.seed
    seen: set[str] = set()

    def prompts(rng, n, prefix, elsewhere: str | None = None):
        """n prompts of distinct user turns. Held back (`elsewhere`: the other documents' texts): two requests in
        one user turn, kept only where no document holds it (the blind sign-off refuses a chat whose prompt a set
        of the experiment holds; a register's single requests can all occur in its chats: seed 6)."""
        out, tries = [], 0
        while len(out) < n:
            m = w.prompt(rng)
            if elsewhere is not None:
                m[1]["content"] += " " + w.prompt(rng)[1]["content"]
            tries += 1
            if tries > 1000 * n:
                raise RuntimeError(f"zoo seed {s}: {n} distinct prompts for {prefix} not found in {tries} draws")
            if m[1]["content"] not in seen and (elsewhere is None or m[1]["content"] not in elsewhere):
                seen.add(m[1]["content"])
                out.append({"id": f"{prefix}-{len(out):03d}", "messages": m})
        return out

    def phrase_rich(rng, n, prefix, think_last=0.5):
        """Chats whose answers use 3 of the phrases often, each phrase in the same share of chats."""
        ph = list(w.cands)
        rng.shuffle(ph)
        k = len(ph)
        return [{"id": f"{prefix}-{i:03d}", "messages": w.chat(rng, slop_rate=0.7, think_last=think_last,
                                                               phrases=[ph[(3 * i + j) % k] for j in range(3)])}
                for i in range(n)]

    ev: dict[str, list[dict]] = {}
    ev["prompts"] = prompts(r("prompts"), 48, f"z{s}-prompt")
    n_pool = spec.size.pool_chats if pool_chats is None else pool_chats
    ev["pool_chat"] = phrase_rich(r("pool"), n_pool, f"z{s}-pool")
    ev["heldout_chat"] = phrase_rich(r("heldout"), 48, f"z{s}-heldout", think_last=1.0)
    ev["blind_chat"] = phrase_rich(r("blind"), 4, f"z{s}-blind", think_last=1.0)
    rc = r("collateral")
    coll, counts = [], {f: 0 for f in spec.finals}
    while min(counts.values()) < COLLATERAL_PER_WORD or sum(counts.values()) < COLLATERAL_TOTAL or len(coll) < 40:
        doc = ({"text": w.note(rc, finals_rate=0.7)} if rc.random() < 0.5
               else {"messages": w.chat(rc, phrases=(), max_turns=2, finals_rate=0.6)})
        text = dc.doc_text(doc)
        if any(count_phrases(text, spec.phrases).values()):
            continue
        for k, v in count_ordinary(text, spec.phrases).items():
            counts[k] += v
        coll.append({"id": f"z{s}-collateral-{len(coll):03d}", **doc})
    ev["collateral"] = coll
    rb = r("background")
    bg = []
    for i in range(24):  # plain text, chats and JSON answers: every kind the KLD domains hold (`l47 init`'s
        # "background"): a kind it never shows is one the background KL cannot protect (docs/BENCHMARKS.md, "A KLD
        # domain the background never shows"); other documents than the KLD domains' (their own stream)
        doc = ({"text": w.note(rb) if i % 4 == 0 else dc.gen_plain(rb)[1]} if i % 2 == 0
               else {"messages": w.json_chat(rb) if i % 4 == 3 else w.chat(rb, phrases=(), max_turns=2)})
        bg.append({"id": f"z{s}-background-{i:02d}", **doc})
    ev["background"] = bg
    rk = r("kld")
    chat_stem, notes_stem, json_stem = spec.kld
    ev[chat_stem] = [{"id": f"z{s}-kld-chat-{i:02d}", "messages": w.chat(rk, phrases=())} for i in range(8)]
    ev[notes_stem] = [{"id": f"z{s}-kld-notes-{i:02d}", "text": w.note(rk)} for i in range(8)]
    ev[json_stem] = [{"id": f"z{s}-kld-json-{i:02d}", "messages": w.json_chat(rk)} for i in range(8)]
    # held back last, from their own streams (nothing above changes): prompts whose user turn no document holds
    elsewhere = "\n".join(dc.doc_text(d) for docs in ev.values() for d in docs)
    ev["heldback_chat_prompts"] = prompts(r("heldback-chat"), 20, f"z{s}-heldback", elsewhere)
    ev["heldback_blind_prompts"] = prompts(r("heldback-blind"), 8, f"z{s}-blind-prompt", elsewhere)
    return ev


def check_events(spec: ZooSpec, ev: dict[str, list[dict]]) -> dict:
    """Phrase events in the assistant answers of the pool and the written held-out chats; refuses (ZooInputError)
    a world whose pool cannot give every phrase MIN_EVENTS train and held-out events under the default split, or
    whose held-out chats hold fewer than MIN_EVENTS."""
    def tot(rows):
        acc = {p: 0 for p in spec.phrases}
        for d in rows:
            for k, v in count_phrases(assistant_text(d), spec.phrases).items():
                acc[k] += v
        return acc

    pool, held = tot(ev["pool_chat"]), tot(ev["heldout_chat"])
    need = math.ceil(MIN_EVENTS / min(SPLIT_FRACTIONS.values()))
    for p in spec.phrases:
        if pool[p] < need or held[p] < MIN_EVENTS:
            raise ZooInputError(
                f"register {spec.register!r} (seed {spec.seed}, {len(ev['pool_chat'])} pool chats): phrase {p!r} has "
                f"{pool[p]} pool events (need >= {need} for {MIN_EVENTS} train and {MIN_EVENTS} held-out at the "
                f"default split) and {held[p]} in the held-out chats (need >= {MIN_EVENTS})")
    return {"pool_events": pool, "heldout_chat_events": held}


# ==========================================================================================================
# 3. corpus, vocabulary, model
# ==========================================================================================================


def build_train(spec: ZooSpec, ev: dict[str, list[dict]], n_chars: int) -> tuple[list[dict], int]:
    forb = {p for rows in ev.values() for d in rows for p in dc.paragraphs(dc.doc_text(d), 12)}
    w = World(spec)
    rng = random.Random(f"zoo:{spec.seed}:train")
    train, total, rejected = [], 0, 0
    while total < n_chars:
        kind, text = w.train_doc(rng)
        if dc.paragraphs(text, 12) & forb:
            rejected += 1
            continue
        train.append({"id": f"z{spec.seed}-train-{len(train):06d}", "kind": kind, "text": text})
        total += len(text)
    return train, rejected


def place_specials(tok, at: int, order: tuple[str, ...]):
    """The tokenizer with its specials (trained at ids 0..k-1) moved to one block at ids at..at+k-1 in `order`;
    the BPE ids shift around the block (merges are by string: unchanged)."""
    from tokenizers import Tokenizer

    j = json.loads(tok.to_str())
    k = len(order)
    V = tok.get_vocab_size()
    at = max(0, min(at, V - k))

    def new_id(i: int) -> int:
        b = i - k  # rank among the BPE ids
        return b if b < at else b + k

    vocab = j["model"]["vocab"]
    special = set(order)
    # the specials stay in the BPE model's vocab too (tokenizers takes an added token's id from there)
    j["model"]["vocab"] = {t: (at + order.index(t) if t in special else new_id(i)) for t, i in vocab.items()}
    for a in j["added_tokens"]:
        a["id"] = at + order.index(a["content"])
    j["added_tokens"].sort(key=lambda a: a["id"])  # tokenizers reads them in list order
    out = Tokenizer.from_str(json.dumps(j))
    for s in order:
        if out.token_to_id(s) != at + order.index(s):
            raise SystemExit(f"vocabulary: {s} at {out.token_to_id(s)}, expected {at + order.index(s)}")
    ids = sorted(out.get_vocab().values())
    if ids != list(range(V)):
        raise SystemExit("vocabulary: ids are not dense after moving the specials")
    return out


def make_tokenizer(spec: ZooSpec, texts: list[str]):
    strip = re.compile("|".join(re.escape(x) for x in SPECIALS))
    tok = m2.train_tokenizer([strip.sub("\n", t) for t in texts], spec.vocab, SPECIALS, spec.finals)
    V = tok.get_vocab_size()
    at = {"start": 0, "end": V - len(SPECIALS)}.get(spec.specials_place, round(spec.specials_at * V / spec.vocab))
    return place_specials(tok, at, spec.specials_order)


# ==========================================================================================================
# 4. the walk's folder (l47 init) and the record
# ==========================================================================================================


def fill_walk(spec: ZooSpec, out: Path, gguf: Path, data: Path) -> list[str]:
    """`l47 init walk --model zoo.gguf --phrase ... --kld ...` and every file it lists, filled from data/."""
    from l47.app.init import InitArgs, run_init
    from l47.fileio import write_text_atomic

    walk = out / "walk"
    if (walk / "experiment.toml").exists():
        shutil.rmtree(walk)
    kld = tuple(s.removeprefix("kld_") for s in spec.kld)
    res = run_init(InitArgs(walk, gguf, spec.phrases, kld=kld, name=f"zoo seed {spec.seed}"))
    coll = _read(data / "collateral.jsonl")
    sources = {"prompts/chats.jsonl": _read(data / "prompts.jsonl"),
               "prompts/chat_heldout.jsonl": _read(data / "heldback_chat_prompts.jsonl"),
               "prompts/blind.jsonl": _read(data / "heldback_blind_prompts.jsonl"),
               "texts/collateral_anchor.jsonl": coll[0::2], "texts/collateral_eval.jsonl": coll[1::2],
               "texts/background.jsonl": _read(data / "background.jsonl")}
    sources.update({f"texts/{s}.jsonl": _read(data / f"{s}.jsonl") for s in spec.kld})
    missing = [f for f in res.files_to_fill if f not in sources]
    if missing:
        raise SystemExit(f"l47 init lists files the zoo has no documents for: {missing}")
    for f in res.files_to_fill:
        write_text_atomic(walk / f, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in sources[f]))
    return list(res.commands)


def _read(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def default_out(seed: int, small: bool) -> Path:
    return DEFAULT_ROOT / (f"seed-{seed}-small" if small else f"seed-{seed}")


def is_built(out: Path, spec: ZooSpec) -> bool:
    try:
        z = json.loads((out / "zoo.json").read_text())
    except (OSError, ValueError):
        return False
    return z.get("complete") is True and z.get("spec") == _spec_json(spec) and (out / "zoo.gguf").is_file()


def _spec_json(spec: ZooSpec) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def build(spec: ZooSpec, out: Path, device: str = "cpu", threads: int = 0, log=print) -> dict:
    """Documents -> corpus -> BPE -> training -> GGUF -> measure -> walk folder -> zoo.json (cached: a complete
    zoo.json of the same spec is reused)."""
    import numpy as np

    if is_built(out, spec):
        log(f"zoo seed {spec.seed}: cached in {out}")
        return json.loads((out / "zoo.json").read_text())
    t_all = time.time()
    data, corpus = out / "data", out / "corpus"
    ev = build_eval_docs(spec)
    events = check_events(spec, ev)  # refuses before any long step
    for name, rows in ev.items():
        dc._write_jsonl(data / f"{name}.jsonl", rows)
    t0 = time.time()
    train, rejected = build_train(spec, ev, spec.size.chars)
    tok = make_tokenizer(spec, [d["text"] for d in train])
    tok.save(str(out / "tokenizer.json"))
    tok.save(str(data / "tokenizer.json"))
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch([d["text"] for d in train], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    stream = np.asarray(ids, dtype=np.int32)
    corpus_s = time.time() - t0
    train_text = "\n".join(d["text"] for d in train)
    corpus_rec = {"chars": len(train_text), "documents": len(train), "tokens": int(stream.size),
                  "rejected_for_eval_overlap": rejected, "seconds": round(corpus_s, 1),
                  "phrases": count_phrases(train_text, spec.phrases),
                  "ordinary": count_ordinary(train_text, spec.phrases)}
    log(f"zoo seed {spec.seed}: corpus {corpus_rec['chars']} chars, {stream.size} tokens, V {tok.get_vocab_size()} "
        f"({corpus_s:.0f} s)")
    o = m2.TrainOptions(steps=spec.size.steps, batch=spec.size.batch, seq=spec.size.seq, lr=spec.size.lr,
                        warmup=spec.size.warmup, seed=spec.seed, device=device, threads=threads, log_every=20)
    model, rec, loss_log = m2.train_model(spec.model, stream, tok, o)
    model.save_pretrained(out / "ckpt", safe_serialization=True, max_shard_size="15MB")
    gguf = out / "zoo.gguf"
    types = {"output.weight": "Q8_0"} if spec.head_type == "Q8_0" else {}
    m2.export_model(model, tok, gguf, types)
    from l47.engine.gguf_export import load_hf_from_gguf

    t0 = time.time()
    g_model = load_hf_from_gguf(gguf, policy="strata").eval()
    measured = m2.measure(g_model, tok, data, spec.phrases, natural=spec.kld[:2])
    measure_s = time.time() - t0
    commands = fill_walk(spec, out, gguf, data)
    specials = {s: tok.token_to_id(s) for s in SPECIALS}
    z = {"complete": True, "seed": spec.seed, "small": spec.small, "spec": _spec_json(spec),
         "register": spec.register, "phrases": list(spec.phrases), "near_certain": list(spec.near_certain),
         "common_final": list(spec.common_final), "words": [" " + f for f in spec.finals],
         "kld": list(spec.kld), "arch": spec.model, "head_type": spec.head_type,
         "vocab": tok.get_vocab_size(), "vocab_drawn": spec.vocab, "specials": specials,
         "specials_place": spec.specials_place,
         "base_p": {p: (measured["heldout_chat"].get(p) or {}).get("mean") for p in spec.phrases},
         "learned": learned(spec, measured),
         "measured": measured, "events": events, "corpus": corpus_rec,
         "train": {**rec, "log": loss_log}, "measure_seconds": round(measure_s, 1),
         "gguf_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(), "walk_commands": commands,
         "seconds": round(time.time() - t_all, 1)}
    shutil.rmtree(corpus, ignore_errors=True)
    from l47.fileio import write_text_atomic

    write_text_atomic(out / "zoo.json", json.dumps(z, indent=1))
    log(f"zoo seed {spec.seed}: trained {rec['train_seconds']} s on {rec['device_name']}; base p "
        + ", ".join(f"{p!r} {v}" for p, v in z["base_p"].items()))
    if not z["learned"]:
        log(f"zoo seed {spec.seed}: WARNING: a near-certain phrase's base p is below {NEAR_CERTAIN_P} on the held-out "
            "chats (the model did not learn it; zoo.json 'learned' is false)")
    return z


NEAR_CERTAIN_P = 0.9  # a near-certain phrase is learned when its mean base p on the written held-out chats is this


def learned(spec: ZooSpec, measured: dict) -> bool:
    """Every near-certain phrase's mean p(final | prefix) on the written held-out chats >= NEAR_CERTAIN_P."""
    held = measured.get("heldout_chat", {})
    return all((held.get(p) or {}).get("mean", 0.0) >= NEAR_CERTAIN_P for p in spec.near_certain)


# ==========================================================================================================


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", default="", help="default ~/.cache/l47-zoo/seed-S (seed-S-small with --small)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="CPU size: n 256, <= 3 layers, 1.5 M chars, short schedule")
    ap.add_argument("--register", default="", help="override the drawn register (one of scripts/zoo_registers.py)")
    ap.add_argument("--pool-chats", type=int, default=0, help="override the written pool's size (0: the size's)")
    ap.add_argument("--steps", type=int, default=0, help="override the training steps (0: the size's)")
    ap.add_argument("--chars", type=int, default=0, help="override the training corpus's characters (0: the size's)")
    ap.add_argument("--spec-only", action="store_true", help="print the drawn spec and the documents' event "
                    "counts; train nothing")
    a = ap.parse_args(argv)
    try:
        spec = draw_spec(a.seed, a.small)
        if a.register:
            if a.register not in zr.by_name():
                raise ZooInputError(f"--register: expected one of {sorted(zr.by_name())}, found {a.register!r}")
            spec = dataclasses.replace(spec, register=a.register)
        if a.pool_chats:
            if a.pool_chats < 1:
                raise ZooInputError(f"--pool-chats: expected a positive count, found {a.pool_chats}")
            spec = dataclasses.replace(spec, size=dataclasses.replace(spec.size, pool_chats=a.pool_chats))
        for name, v in (("steps", a.steps), ("chars", a.chars)):
            if v < 0:
                raise ZooInputError(f"--{name}: expected a positive count, found {v}")
            if v:
                spec = dataclasses.replace(spec, size=dataclasses.replace(spec.size, **{name: v}))
        out = Path(a.out).expanduser() if a.out else default_out(a.seed, a.small)
        if a.spec_only:
            ev = build_eval_docs(spec)
            print(json.dumps({"spec": _spec_json(spec), **check_events(spec, ev)}, indent=1))
            return 0
        if out.exists() and not out.is_dir():
            raise ZooInputError(f"--out: expected a folder, found a file {out}")
        build(spec, out, a.device, a.threads)
    except ZooInputError as e:
        print(str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
