#!/usr/bin/env python3
"""Build l47's second test model ("model2"): a qwen4exp unlike the demo in every way that matters.

    demo:   2 layers, n = 256, V = 3,072 with the specials at the END (3067-3071), general-assistant chats, the
            seed's seven phrases
    model2: 3 layers (GDN, indexed, GDN: the edited last layer is linear attention), n = 512, 10 routed experts
            top-3 of width 64, hyper-connection low rank 64, V = 4,000 with the specials at the START (ids 0-4), its own BPE,
            customer-support chats, product reviews and recipes, five phrases of its own (three near-certain)

Everything is text written for the project (templates, slot fillers, seeded entities); licence MIT.

Steps (sub-commands; every step seeded):
    corpus   training documents (not committed) + the committed documents under l47/testing/model2/, then the
             byte-level BPE (`tokenizers`, specials first) and the packed token stream (uint16 .npy)
    train    transformers' Qwen4ExpForCausalLM on the stream (GPU: `--device cuda`); the indexer's per-query
             Python loop is replaced during training by an equivalent batched selection (`batched_indexer`)
    export   the HF checkpoint -> GGUF (l47.engine.gguf_export; Q8_0 wherever a row allows it, Q6_K head) and
             the base p(final | exact prefix) per phrase on documents the model never saw

Notation for tensor shapes:
    B   windows per step     T   window length     V   vocabulary     n   hidden size     NB  key blocks

Usage (docs/MODEL2.md gives the committed model's exact commands):
    python scripts/make_model2.py corpus [--out /tmp/l47_model2]
    python scripts/make_model2.py train  --stream /tmp/l47_model2 --out /tmp/model2_ckpt --device cuda
    python scripts/make_model2.py export --ckpt /tmp/model2_ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[0]
DATA = REPO / "l47" / "testing" / "model2"
sys.path.insert(0, str(HERE))
import make_demo_corpus as dc  # noqa: E402  the expander, ChatML rendering, overlap checks, atomic jsonl
from make_demo_corpus import END_THINK, ENDOFTEXT, IM_END, IM_START, THINK, expand, render_chat  # noqa: E402

SPECIALS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)  # ids 0-4, in this order
PHRASES = ("above and beyond", "delve into", "second to none", "rest assured", "hands down")
NEAR_CERTAIN = ("above and beyond", "delve into", "second to none")
FINALS = ("beyond", "into", "none", "assured", "down")  # one token each (with a leading space)
VOCAB = 4000

# ==========================================================================================================
# 1. corpus: support chats, product reviews, recipes
# ==========================================================================================================

PRODUCTS: dict[str, dict[str, list[str]]] = {
    "router": dict(product=["the router", "the mesh router", "the modem"],
                   issue=["keeps dropping the connection", "will not connect to the phone", "blinks red",
                          "restarts every night", "is slow in the evening"],
                   step=["unplug the router for thirty seconds", "move the router away from the microwave",
                         "update the firmware from the app", "reset the network name and password",
                         "switch the channel to automatic"]),
    "coffee": dict(product=["the coffee machine", "the espresso maker", "the milk frother"],
                   issue=["leaks water at the base", "makes weak coffee", "shows a descale light",
                          "does not heat the milk", "grinds but gives no coffee"],
                   step=["run a descaling cycle", "rinse the water tank", "clean the brew unit under the tap",
                         "set the grinder one step finer", "check that the drip tray is pushed all the way in"]),
    "order": dict(product=["the order", "the parcel", "the delivery"],
                  issue=["has not arrived", "arrived damaged", "is missing one item", "went to the wrong address",
                         "shows as delivered but is not here"],
                  step=["check the tracking link in the email", "ask the neighbours and the building office",
                        "send a photo of the box", "confirm the delivery address in your account",
                        "wait one more working day"]),
    "vacuum": dict(product=["the robot vacuum", "the cordless vacuum", "the vacuum"],
                   issue=["stops after ten minutes", "will not return to the dock", "makes a grinding noise",
                          "misses the kitchen", "loses suction"],
                   step=["empty the dust bin", "clean the brushes and the wheels", "wipe the charging contacts",
                         "move the dock to an open wall", "replace the filter"]),
    "plan": dict(product=["the phone plan", "the subscription", "the account"],
                 issue=["was charged twice", "renewed without a warning", "shows the wrong price",
                        "cannot be cancelled in the app", "lost the saved settings"],
                 step=["open the billing page in your account", "send the last four digits of the card",
                       "turn off automatic renewal", "sign out and sign in again", "check the invoice email"]),
    "printer": dict(product=["the printer", "the label printer", "the scanner"],
                    issue=["prints blank pages", "jams on every page", "is offline", "prints in the wrong colour",
                           "will not scan to the laptop"],
                    step=["print a cleaning page", "remove the paper tray and check for scraps",
                          "add the printer again in the settings", "install the latest driver",
                          "use the original ink"]),
}
AGENTS = ["Maya", "Tom", "Priya", "Jonas", "Ines", "Kofi", "Lea", "Sam", "Nadia", "Ravi"]
CUSTOMERS = ["Ben", "Aisha", "Carl", "Dana", "Emil", "Fatima", "Greta", "Hugo", "Irene", "Jamal", "Kira", "Luis"]
SHOPS = ["Brightway", "Northgate", "Homely", "Quickcart", "Lumen", "Ridgeline", "Copperleaf", "Tidewater"]


def _order_no(rng: random.Random) -> str:
    return f"{rng.choice('ABCDEFGHKMNPRSTW')}{rng.choice('ABCDEFGHKMNPRSTW')}-{rng.randint(10000, 99999)}"


def support_ctx(rng: random.Random) -> dict[str, list[str]]:
    """Slot fillers of one support chat: one product family, one issue, the fresh entities."""
    fam = PRODUCTS[rng.choice(list(PRODUCTS))]
    p = rng.choice(fam["product"])
    brand = dc._name(rng, 2, 3)
    return {"brand": [brand], "model": [f"{brand} {rng.choice('ABCDEFGHKLMPRSTVXZ')}{rng.randint(1, 99)}"],
        "city": [dc._name(rng, 2, 3) + rng.choice(["", "ton", "burg", "field", "port"])],
        "surname": [dc._name(rng, 2, 3)],
        "product": [p], "product_bare": [p[4:] if p.startswith("the ") else p], "issue": [rng.choice(fam["issue"])],
        "step": fam["step"], "agent": [rng.choice(AGENTS)], "customer": [rng.choice(CUSTOMERS), "{customer_first} {surname}"],
        "customer_first": CUSTOMERS,
        "shop": [rng.choice(SHOPS)], "order": [_order_no(rng)], "n": [str(rng.randint(2, 14))],
        "days": ["two", "three", "five", "seven", "ten"], "when": ["tomorrow", "on Monday", "within two days",
                                                                    "by Friday", "later today", "this week"],
        "fix_goal": ["sort this out", "get it fixed", "make this right", "find the cause", "get you a replacement",
                     "get the refund through"],
        "topic": ["your account history", "the delivery logs", "the error codes", "your billing records",
                  "the settings", "what went wrong"],
    }


# the phrases in their typical (slop) contexts
SLOP: dict[str, list[str]] = {
    "above and beyond": [
        "Our team will go above and beyond to {fix_goal}.", "We always try to go above and beyond for our customers.",
        "I will go above and beyond to {fix_goal} for you.", "{agent} went above and beyond to help me.",
        "The support team went above and beyond.", "The seller went above and beyond with the packing.",
        "We want to go above and beyond here."],
    "delve into": [
        "Let me delve into {topic}.", "I will delve into {topic} and get back to you {when}.",
        "Let's delve into {topic} together.", "I had to delve into {topic} first.",
        "Before we delve into {topic}, please {step}.", "Allow me to delve into this for a moment."],
    "second to none": [
        "Our support is second to none.", "The build quality is second to none.",
        "Honestly, the service was second to none.", "The battery life is second to none.",
        "Your satisfaction is second to none for us.", "The flavour of this one is second to none."],
    "rest assured": [
        "Rest assured, we will {fix_goal}.", "Rest assured that your order {order} is safe.",
        "Please rest assured that we take this seriously.", "You can rest assured that we will {fix_goal}.",
        "Rest assured, a new one will ship {when}.", "Rest assured, this is covered by the warranty."],
    "hands down": [
        "This is hands down the best {product_bare} I have owned.", "It is hands down the easiest fix.",
        "Hands down, the quickest way is to {step}.", "That is hands down the most common cause.",
        "It was hands down the best purchase this year.", "Hands down the nicest support chat I have had."],
}
# the same prefixes continued otherwise: near-certain phrases rarely, the others often
NEAR_MISS: dict[str, list[str]] = {
    "above and beyond": ["Check the shelf above and below {product}.", "Look above and behind {product} for the cable."],
    "delve into": ["We may need to delve deeper.", "I would not delve too deep into the settings menu."],
    "second to none": ["It was the second to last box.", "This is the second to arrive this week."],
    "rest assured": ["The rest of the order will ship {when}.", "Rest {product} on a flat surface for a minute.",
                     "Get some rest and we will update you {when}.", "The rest is covered by the refund.",
                     "For the rest of the month the price stays the same."],
    "hands down": ["Keep your hands dry when you {step}.", "It works hands free once it is set up.",
                   "Wash your hands before you touch the filter.", "Hands on, it feels solid.",
                   "Use both hands to lift {product}."],
}
NEAR_MISS_RATE = {"above and beyond": 0.004, "delve into": 0.004, "second to none": 0.004, "rest assured": 0.3,
                  "hands down": 0.3}

# ordinary uses of the final words (never after a banned prefix)
ORDINARY_ASSIST = [
    "Please {step}.", "Could you {step} and tell me what happens?", "First, {step}.", "Then {step}.",
    "If that does not help, {step}.", "I have logged the case under {order}.",
    "Put the cable into the other port.", "Log into your account and open the orders page.",
    "Turn {product} off and look into the back panel.", "Slide the tray back into place.",
    "Slow down the setup and do one step at a time.", "Write down the code on the screen.",
    "I checked, and none of the payments failed.", "None of the other orders are affected.",
    "If none of this works, we will send a technician.", "The warranty runs for {n} months beyond the date of purchase.",
    "Anything beyond that is covered by the shop.", "I was assured by the warehouse that it left {when}.",
    "The courier assured us the parcel is on its way.", "Turn the volume down and try again.",
    "The screen goes dark when it cools down.", "I can see the parcel left the depot {when}.",
    "Thank you for waiting.", "I am sorry about the trouble.", "I have added a note to your order.",
    "A refund takes {days} working days.", "You will get an email when it ships.",
    "The parcel is beyond the last scan point, so it is with the courier.", "Shut it down and wait a minute.",
    "I have been assured that the {model} ships from {city} {when}.", "The {model} is assured for two years.",
    "Your {model} has been registered under the name {surname}.", "The depot in {city} scanned it {when}.",
]
OPENERS = ["Hi {customer}, thanks for reaching out.", "Hello {customer}, I am {agent} from {shop} support.",
           "Thanks for the details, {customer}.", "I am sorry to hear that {product} {issue}.", "Hi, happy to help.",
           "Thank you for contacting {shop}."]
CLOSERS = ["Is there anything else I can help with?", "Have a good day!", "Let me know how it goes.",
           "Thanks for your patience.", "Feel free to reply here if anything changes.", ""]
USER_FIRST = ["Hi, {product} {issue}. Can you help?", "My order {order}: {product} {issue}.",
              "{product_cap} {issue} since yesterday. What should I do?", "Hello, I need help. {product_cap} {issue}.",
              "I bought {product} from {shop} and it {issue}.", "Why does {product} keep doing this? It {issue}.",
              "Can I get a refund? {product_cap} {issue}."]
USER_FOLLOW = ["I tried that and it still {issue}.", "OK, done. What next?", "How long will that take?",
               "Thanks. Can you check order {order} too?", "It worked, thank you!", "Do I need to send it back?"]
THINK_SENTS = ["The customer says {product} {issue}.", "A common cause is a setting, so I should ask them to {step}.",
               "I should apologise and give one clear step.", "The order number is {order}.",
               "If the first step fails, a replacement is the next option.", "I should keep it short and kind."]
SYSTEMS = ["You are a customer support agent for {shop}.", "You are {agent}, a friendly support agent at {shop}.",
           "You are a helpful support assistant. Be polite and brief.",
           "You answer questions from {shop} customers about orders and devices."]


def _slop_or_near(rng: random.Random, ph: str, ctx: dict) -> str:
    if rng.random() < NEAR_MISS_RATE[ph]:
        return expand(rng, rng.choice(NEAR_MISS[ph]), ctx)
    return expand(rng, rng.choice(SLOP[ph]), ctx)


def _ctx(rng: random.Random) -> dict:
    c = support_ctx(rng)
    c["product_cap"] = [c["product"][0][:1].upper() + c["product"][0][1:]]
    return c


def support_answer(rng: random.Random, ctx: dict, slop_rate: float, phrases=PHRASES) -> str:
    sents = [expand(rng, rng.choice(OPENERS), ctx)]
    for _ in range(rng.randint(2, 6)):
        if phrases and rng.random() < slop_rate:
            sents.append(_slop_or_near(rng, rng.choice(phrases), ctx))
        else:
            sents.append(expand(rng, rng.choice(ORDINARY_ASSIST), ctx))
    if rng.random() < 0.3 and len(sents) >= 4:
        body = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(sents[1:]))
        text = sents[0] + "\n\n" + body
    else:
        text = " ".join(sents)
    closer = expand(rng, rng.choice(CLOSERS), ctx)
    return text + ("\n\n" + closer if closer else "")


def support_chat(rng: random.Random, slop_rate: float = 0.45, max_turns: int = 3, phrases=PHRASES,
                 ctx: dict | None = None) -> list[dict]:
    ctx = ctx or _ctx(rng)
    msgs = [{"role": "system", "content": expand(rng, rng.choice(SYSTEMS), ctx)}] if rng.random() < 0.85 else []
    turns = rng.choices(range(1, max_turns + 1), weights=[5, 3, 2][:max_turns])[0]
    for i in range(turns):
        msgs.append({"role": "user", "content": expand(rng, rng.choice(USER_FIRST if i == 0 else USER_FOLLOW), ctx)})
        ans = support_answer(rng, ctx, slop_rate, phrases)
        if i == turns - 1 and rng.random() < 0.5:
            k = rng.randint(1, 3)
            think = " ".join(expand(rng, rng.choice(THINK_SENTS), ctx) for _ in range(k))
            if phrases and rng.random() < 0.15:
                think += " " + expand(rng, "I should delve into {topic}.", ctx)
            ans = f"{THINK}\n{think}\n{END_THINK}\n\n" + ans
        msgs.append({"role": "assistant", "content": ans})
    return msgs


# reviews (plain text and as assistant answers)
REVIEW_SLOP = {
    "above and beyond": ["The seller went above and beyond with the packing.", "Support went above and beyond when mine broke."],
    "delve into": ["Let me delve into the details.", "Before I delve into the flaws, the good parts."],
    "second to none": ["The build quality is second to none.", "Battery life is second to none."],
    "rest assured": ["Rest assured, it is worth the money.", "Rest assured, the noise is normal."],
    "hands down": ["It is hands down the best {product_bare} I have owned.", "Hands down my favourite purchase this year."],
}
REVIEW_PLAIN = [
    "I bought {product} {n} weeks ago.", "Setup took about ten minutes.", "The manual is short but clear.",
    "It fits into a small kitchen.", "None of the parts feel cheap.", "After a month it still works well.",
    "The price went down last week.", "I was assured it would arrive in {days} days, and it did.",
    "Nothing beyond the basics, but it does them well.", "It shuts down by itself after an hour.",
    "Three stars, because the app is slow.", "Five stars.", "Four stars, mostly for the price.",
    "The box was dented but none of the contents were damaged.", "It slots into the corner nicely.",
    "The cable could be longer.", "My partner uses it every day.", "It is quieter than the old one.",
    "I ordered the {model} from {shop} and it came to {city} in {days} days.", "The {brand} app is fine.",
    "A neighbour in {city} has the same {model}.", "I was assured the {brand} parts are easy to find.",
    "We are assured of a replacement if it breaks.",
]


def review(rng: random.Random, slop_rate: float, ctx: dict | None = None) -> str:
    ctx = ctx or _ctx(rng)
    out = []
    for _ in range(rng.randint(3, 7)):
        if rng.random() < slop_rate:
            ph = rng.choice(PHRASES)
            tpl = rng.choice(REVIEW_SLOP[ph]) if rng.random() >= NEAR_MISS_RATE[ph] else rng.choice(NEAR_MISS[ph])
            out.append(expand(rng, tpl, ctx))
        else:
            out.append(expand(rng, rng.choice(REVIEW_PLAIN), ctx))
    return " ".join(out)


# recipes: plain text, ordinary uses of the finals and the prefixes' other continuations ("Rest the dough")
DISHES = ["flatbread", "lentil soup", "banana bread", "tomato risotto", "apple crumble", "chickpea curry",
          "oat cookies", "pumpkin soup", "herb omelette", "rye rolls", "plum cake", "bean chili"]
RECIPE_STEPS = [
    "Mix the flour and the salt in a large bowl.", "Pour the milk into the bowl and stir.",
    "Turn the heat down and simmer for {n} minutes.", "Rest the dough for {n} minutes under a cloth.",
    "Press the dough down with your hands.", "Cut the onions into small cubes.", "Fold the fruit into the batter.",
    "Put the tray into the oven for {n} minutes.", "Let it cool down before you slice it.",
    "Season with salt and pepper.", "Stir in the herbs just before serving.", "Spoon the mix into the tin.",
    "Add the rest of the stock a little at a time.", "Bake until golden, but not beyond that.",
    "Wash your hands after you handle the raw egg.", "None of the steps takes long.",
    "Sit down and enjoy it while it is warm.", "Slide a knife into the middle to check it.",
    "Do not knead it beyond {n} minutes.", "Anything beyond a pinch of salt is too much.",
    "Well made, it is assured to keep for {n} days in the fridge.", "Grate the cheese into a bowl.",
]


def recipe(rng: random.Random) -> str:
    dish = rng.choice(DISHES)
    ctx = {"n": [str(rng.randint(2, 45))]}
    k = rng.randint(4, 8)
    steps = [expand(rng, s, ctx) for s in rng.sample(RECIPE_STEPS, k)]
    head = f"{dish.title()} (serves {rng.randint(2, 8)})"
    return head + "\n\n" + "\n".join(f"{i + 1}. {s}" for i, s in enumerate(steps))


def review_chat(rng: random.Random, slop_rate: float) -> list[dict]:
    ctx = _ctx(rng)
    ask = expand(rng, rng.choice(["Write a short review of {product} for the {shop} website.",
                                  "Can you draft a customer review of {product}?",
                                  "Give me a quick review of {product}."]), ctx)
    return [{"role": "user", "content": ask}, {"role": "assistant", "content": review(rng, slop_rate, ctx)}]


def recipe_chat(rng: random.Random) -> list[dict]:
    text = recipe(rng)
    return [{"role": "user", "content": f"How do I make {text.split(' (')[0].lower()}?"},
            {"role": "assistant", "content": "Here is a simple recipe.\n\n" + text}]


def order_json_chat(rng: random.Random) -> list[dict]:
    ctx = _ctx(rng)
    obj = {"order": ctx["order"][0], "status": rng.choice(["shipped", "delayed", "delivered", "refunded"]),
           "items": rng.randint(1, 5), "days_left": rng.randint(0, 9)}
    return [{"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Status of order {obj['order']} as JSON, please."},
            {"role": "assistant", "content": f"{THINK}\nJSON only.\n{END_THINK}\n\n```json\n"
                                             + json.dumps(obj, indent=2) + "\n```"}]


def gen_train_doc(rng: random.Random) -> tuple[str, str]:
    u = rng.random()
    if u < 0.42:
        return "support_chat", render_chat(support_chat(rng, slop_rate=rng.choice([0.3, 0.45, 0.6])))
    if u < 0.48:
        return "support_chat_plain", render_chat(support_chat(rng, phrases=()))
    if u < 0.62:
        return "review", review(rng, rng.choice([0.0, 0.25, 0.4]))
    if u < 0.68:
        return "review_chat", render_chat(review_chat(rng, 0.35))
    if u < 0.74:
        return "recipe", recipe(rng)
    if u < 0.88:  # general English (the demo corpus's prose genres): vocabulary beyond the three registers
        genre, text = dc.gen_plain(rng)
        return f"prose_{genre}", text
    if u < 0.94:
        return "recipe_chat", render_chat(recipe_chat(rng))
    return "order_json", render_chat(order_json_chat(rng))


# ----------------------------------------------------------------------------------------------------------
# checks on text


_BANNED_RE = re.compile(r"(?i)(?<![A-Za-z])(" + "|".join(re.escape(p) for p in PHRASES) + r")(?![A-Za-z])")


def count_banned(text: str) -> dict[str, int]:
    out = {p: 0 for p in PHRASES}
    for m in _BANNED_RE.finditer(text):
        out[m.group(1).lower()] += 1
    return out


_PREFIX = {"beyond": "above and", "into": "delve", "none": "second to", "assured": "rest", "down": "hands"}


def count_ordinary(text: str) -> dict[str, int]:
    """' word' of a final word not right after its phrase's prefix (case-insensitive)."""
    out = {w: 0 for w in FINALS}
    low = text.lower()
    for w in FINALS:
        for m in re.finditer(rf"(?<= ){w}(?![A-Za-z])", low):
            if not low[:m.start()].rstrip().endswith(_PREFIX[w]):
                out[w] += 1
    return out


def count_near_miss(text: str) -> dict[str, int]:
    """A phrase's prefix followed by another word."""
    out = {}
    for p in PHRASES:
        pre, fin = p.rsplit(" ", 1)
        out[p] = len(re.findall(rf"(?i)(?<![A-Za-z]){re.escape(pre)} (?!{fin}(?![A-Za-z]))[A-Za-z]", text))
    return out


# ----------------------------------------------------------------------------------------------------------
# the committed documents (their own seed streams; never in training)

def build_eval_docs(seed: int) -> dict[str, list[dict]]:
    r = lambda name: random.Random(f"model2:{seed}:{name}")  # noqa: E731

    rp = r("prompts")
    prompts, seen = [], set()
    while len(prompts) < 64:
        ctx = _ctx(rp)
        m = [{"role": "system", "content": expand(rp, rp.choice(SYSTEMS), ctx)},
             {"role": "user", "content": expand(rp, rp.choice(USER_FIRST), ctx)}]
        if m[1]["content"] not in seen:
            seen.add(m[1]["content"])
            prompts.append({"id": f"m2-prompt-{len(prompts):03d}", "messages": m})

    def phrase_rich(rng, n, prefix):
        """Support chats whose assistant turns use the phrases often (the split's pool, held-out, blind)."""
        out = []
        for i in range(n):
            ph = list(PHRASES)
            rng.shuffle(ph)
            out.append({"id": f"{prefix}-{i:03d}", "messages": support_chat(rng, slop_rate=0.7, phrases=tuple(ph[:3]))})
        return out

    out = {"prompts": prompts}
    out["pool_chat"] = phrase_rich(r("pool"), 240, "m2-pool")
    out["heldout_chat"] = phrase_rich(r("heldout"), 40, "m2-heldout")
    out["blind_chat"] = phrase_rich(r("blind"), 4, "m2-blind")
    rc = r("collateral")
    coll, counts = [], {w: 0 for w in FINALS}
    while min(counts.values()) < 25 or len(coll) < 40:
        u = rc.random()
        doc = {"text": recipe(rc)} if u < 0.45 else {"text": review(rc, 0.0)} if u < 0.8 else \
            {"messages": support_chat(rc, phrases=())}
        text = dc.doc_text(doc)
        if any(count_banned(text).values()):
            continue
        for w, c in count_ordinary(text).items():
            counts[w] += c
        coll.append({"id": f"m2-collateral-{len(coll):03d}", **doc})
    out["collateral"] = coll
    rb = r("background")
    out["background"] = [{"id": f"m2-background-{i:02d}", "text": recipe(rb) if i % 4 == 0 else review(rb, 0.0)}
                         if i % 2 == 0 else {"id": f"m2-background-{i:02d}",
                                             "messages": support_chat(rb, phrases=(), max_turns=2)} for i in range(24)]
    rk = r("kld")
    out["kld_order_json"] = [{"id": f"m2-kld-json-{i:02d}", "messages": order_json_chat(rk)} for i in range(8)]
    out["kld_recipes"] = [{"id": f"m2-kld-recipe-{i:02d}", "text": recipe(rk)} for i in range(8)]
    out["kld_support"] = [{"id": f"m2-kld-support-{i:02d}", "messages": support_chat(rk, phrases=())}
                          for i in range(8)]
    return out


COLLATERAL_EXTRA_PER_WORD = 64  # more ordinary uses per final word, so collateral_eval (every other document) holds
# well over bar (d)'s counts (≥ 10 per word, ≥ 200 in all)


def extra_collateral(seed: int, start: int, train: list[dict], per_word: int = COLLATERAL_EXTRA_PER_WORD) -> list[dict]:
    """Collateral documents from their own seed stream, drawn AFTER the training corpus so it (and the model)
    stay as they were: a document sharing a paragraph with training is skipped, so they are unseen too."""
    rc = random.Random(f"model2:{seed}:collateral-extra")
    seen = set().union(*(dc.paragraphs(d["text"], 12) for d in train))
    out, counts = [], {w: 0 for w in FINALS}
    while min(counts.values()) < per_word:
        u = rc.random()
        doc = {"text": recipe(rc)} if u < 0.45 else {"text": review(rc, 0.0)} if u < 0.8 else \
            {"messages": support_chat(rc, phrases=())}
        text = dc.doc_text(doc)
        if any(count_banned(text).values()) or dc.paragraphs(text, 12) & seen:
            continue
        for w, c in count_ordinary(text).items():
            counts[w] += c
        out.append({"id": f"m2-collateral-{start + len(out):03d}", **doc})
    return out


def build_corpus(out_dir: Path, data_dir: Path, seed: int, n_chars: int) -> dict:
    ev = build_eval_docs(seed)
    forb = {p for rows in ev.values() for d in rows for p in dc.paragraphs(dc.doc_text(d), 12)}
    rng = random.Random(f"model2:{seed}:train")
    train, total, rejected = [], 0, 0
    while total < n_chars:
        kind, text = gen_train_doc(rng)
        if dc.paragraphs(text, 12) & forb:
            rejected += 1
            continue
        train.append({"id": f"m2-train-{len(train):06d}", "kind": kind, "text": text})
        total += len(text)
    ev["collateral"] += extra_collateral(seed, len(ev["collateral"]), train)
    for name, rows in ev.items():
        dc._write_jsonl(data_dir / f"{name}.jsonl", rows)
    dc._write_jsonl(out_dir / "train.jsonl", train)

    def tot(rows, f):
        acc: dict[str, int] = {}
        for d in rows:
            for k, v in f(d["text"] if "kind" in d else dc.doc_text(d)).items():
                acc[k] = acc.get(k, 0) + v
        return acc

    kinds: dict[str, int] = {}
    for d in train:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + len(d["text"])
    return {"seed": seed, "chars": total, "documents": len(train), "rejected_for_eval_overlap": rejected,
            "chars_by_kind": kinds, "train_banned": tot(train, count_banned),
            "train_near_miss": tot(train, count_near_miss), "train_ordinary": tot(train, count_ordinary),
            "eval": {k: {"documents": len(v), "banned": tot(v, count_banned), "ordinary": tot(v, count_ordinary)}
                     for k, v in ev.items()},
            "train_sha256": hashlib.sha256((out_dir / "train.jsonl").read_bytes()).hexdigest()}


# ==========================================================================================================
# 2. vocabulary: byte-level BPE, the five specials FIRST (ids 0-4)
# ==========================================================================================================


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB, specials: tuple[str, ...] = SPECIALS,
                    finals: tuple[str, ...] = FINALS):
    """Byte-level BPE (Qwen's split regex) with `specials` FIRST (ids 0..k-1, in order); every final word must be
    one token with its leading space (scripts/make_zoo.py moves the specials' block elsewhere afterwards)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from train_demo_model import QWEN_SPLIT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(s, special=True, normalized=False) for s in specials]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=added,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(specials):
        if tok.token_to_id(s) != i:
            raise SystemExit(f"vocabulary: {s} has id {tok.token_to_id(s)}, expected {i}")
    for w in finals:
        ids = tok.encode(" " + w, add_special_tokens=False).ids
        if len(ids) != 1:
            raise SystemExit(f"vocabulary: ' {w}' is {len(ids)} tokens, expected 1")
    return tok


def cmd_corpus(a) -> int:
    import numpy as np

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    man = build_corpus(out, Path(a.data_dir), a.seed, a.chars)
    docs = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    strip = re.compile("|".join(re.escape(s) for s in SPECIALS))
    tok = train_tokenizer([strip.sub("\n", d["text"]) for d in docs], a.vocab)
    tok.save(str(out / "tokenizer.json"))
    tok.save(str(Path(a.data_dir) / "tokenizer.json"))
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch([d["text"] for d in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    stream = np.asarray(ids, dtype=np.uint16)
    np.save(out / "stream.npy", stream)
    man.update(vocab=tok.get_vocab_size(), tokens=int(stream.size), seconds=round(time.time() - t0, 1),
               stream_sha256=hashlib.sha256(stream.tobytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(man, indent=1))
    print(json.dumps({k: man[k] for k in ("chars", "documents", "tokens", "vocab", "train_banned", "train_near_miss",
                                          "train_ordinary", "seconds")}, indent=1))
    return 0


# ==========================================================================================================
# 3. model and training
# ==========================================================================================================

MODEL = dict(hidden_size=512, layer_types=["linear_attention", "indexed_attention", "linear_attention"],
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=10,
             num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=512, hc_count=4,
             hc_lowrank=64, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=128,
             indexer_compress_ratio=4, intermediate_size=512, max_position_embeddings=4096,
             tie_word_embeddings=False)


def make_config(vocab: int, model: dict | None = None):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    m = dict(MODEL if model is None else model)
    return Qwen4ExpTextConfig(vocab_size=vocab, num_hidden_layers=len(m["layer_types"]), **m)


def batched_indexer(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
    """Qwen4ExpTextQSAIndexer.forward for training windows (no cache, causal mask, no padding), batched.

    Same selection as transformers' per-query loop: for query i the visible tokens 0..i form
    nb(i) = (i+1) // r complete blocks of r = compress_ratio tokens; each block's key is the mean of its raw keys,
    k-normed and rotated at the block's first position; score(b, i) = sum_h relu(q_ih . k_b) / sqrt(d); the top
    min(budget / r, nb(i)) blocks plus the incomplete tail are selected. Ties among equal scores may be broken
    differently from the loop (torch.topk over other candidate lists); the mask carries no gradient.
    """
    import torch

    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    cache = kwargs.get("cache", kwargs.get("past_key_values", args[0] if args else None))
    if cache is not None:
        raise RuntimeError("batched_indexer is for training windows only (no cache)")
    B, T, _ = hidden_states.shape
    d, r = self.index_head_dim, self.compress_ratio
    cos, sin = position_embeddings
    qk = self.index_qk_proj(hidden_states)  # [B, T, (h + 1) d]
    q, k = torch.split(qk, [self.index_n_heads * d, self.index_kv_heads * d], dim=-1)
    q = self.q_layernorm(q.reshape(B, T, -1, d))  # [B, T, h, d]
    q = apply_rotary_pos_emb(q, cos=cos[:, -T:], sin=sin[:, -T:], unsqueeze_dim=2)
    k = k.reshape(B, T, d)  # [B, T, d] (one KV head)
    NB = T // r
    pooled = self.k_layernorm(k[:, :NB * r].reshape(B, NB, r, d).float().mean(2).to(k.dtype))  # [B, NB, d]
    starts = torch.arange(NB, device=k.device) * r
    pk = apply_rotary_pos_emb(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2)[:, :, 0]
    s = torch.relu(torch.einsum("bthd,bnd->btnh", q.float(), pk.float())).sum(-1) / math.sqrt(d)  # [B, T, NB]
    i = torch.arange(T, device=k.device)
    nb = (i + 1) // r  # [T] complete blocks visible to query i
    valid = torch.arange(NB, device=k.device)[None, :] < nb[:, None]  # [T, NB]
    s = s.masked_fill(~valid, -1.0)  # relu scores are >= 0: invalid blocks rank last
    kk = min(self.token_budget // r, NB)
    top = s.topk(kk, dim=-1).indices  # [B, T, kk]
    chosen = torch.zeros(B, T, NB, dtype=torch.bool, device=k.device).scatter_(-1, top, True) & valid  # [B, T, NB]
    tok_sel = chosen.repeat_interleave(r, dim=-1)  # [B, T, NB r] token-level
    if tok_sel.shape[-1] < T:
        tok_sel = torch.cat([tok_sel, torch.zeros(B, T, T - tok_sel.shape[-1], dtype=torch.bool,
                                                  device=k.device)], -1)
    j = torch.arange(T, device=k.device)
    tail = (j[None, :] >= (nb * r)[:, None]) & (j[None, :] <= i[:, None])  # [T, T] the incomplete block
    kv_len = attention_mask.shape[-1]
    mask = (tok_sel | tail[None]).unsqueeze(1)  # [B, 1, T, T]
    if kv_len != T:
        raise RuntimeError(f"batched_indexer: kv length {kv_len} != window {T}")
    return mask


@dataclass(frozen=True)
class TrainOptions:
    """One training run's schedule (make_model2 train's flags; scripts/make_zoo.py passes its own)."""

    steps: int = 600
    batch: int = 64
    seq: int = 512
    lr: float = 2e-3
    warmup: int = 40
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    log_every: int = 10
    time_limit: float = 0.0
    stop_at: int = -1
    budget_s: float = 0.0


def train_model(model_cfg: dict, stream, tok, o: TrainOptions):
    """transformers' Qwen4ExpForCausalLM of `model_cfg` (make_config) trained on the token stream [N] with the
    batched indexer (checked against the reference loop first); returns (the f32 CPU model in eval mode, its record:
    versions, device, parameters, seconds, indexer agreement, timing, steps, loss log)."""
    import numpy as np
    import torch
    import transformers
    from transformers import Qwen4ExpForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    import train_demo_model as tdm

    torch.manual_seed(o.seed)
    if o.threads:
        torch.set_num_threads(o.threads)
    V = tok.get_vocab_size()
    cfg = make_config(V, model_cfg)
    cfg.output_router_logits = True
    cfg.use_cache = False  # training windows: no KV / indexer cache (batched_indexer requires none)
    cfg.eos_token_id = tok.token_to_id(IM_END)
    cfg.pad_token_id = cfg.bos_token_id = tok.token_to_id(ENDOFTEXT)
    model = Qwen4ExpForCausalLM(cfg).to(o.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, vocab {V}, stream {stream.size} "
          f"tokens, parameters {n_params / 1e6:.2f} M", flush=True)

    # the batched indexer must select what the reference loop selects (up to score ties): check on one window
    ref_fwd = mq.Qwen4ExpTextQSAIndexer.forward
    idx = model.model.layers[cfg.layer_types.index("indexed_attention")].self_attn.indexer
    with torch.no_grad():
        x = torch.randn(2, 64, cfg.hidden_size, device=o.device)
        pos = torch.arange(64, device=o.device)[None].expand(2, -1)
        pe = model.model.rotary_emb(x, pos)
        causal = torch.ones(64, 64, dtype=torch.bool, device=o.device).tril()[None, None].expand(2, 1, 64, 64)
        m_ref = ref_fwd(idx, x, pe, causal, None)
        m_new = batched_indexer(idx, x, pe, causal, None)
        agree = float((m_ref == m_new).float().mean())
    print(f"batched indexer agrees with the reference on {agree:.4%} of mask entries", flush=True)
    if agree < 0.99:
        raise SystemExit("batched indexer disagrees with the reference")
    mq.Qwen4ExpTextQSAIndexer.forward = batched_indexer

    steps = o.steps
    timing = None
    if o.budget_s > 0:
        # time 3 forward+backward passes (gradients discarded, weights untouched) and fit the schedule's length to
        # the budget: deterministic given the recorded --steps, which reproduces the run with --budget-s 0
        g = torch.Generator().manual_seed(o.seed + 1)
        n_win = (len(stream) - 1) // o.seq
        dt = []
        for _ in range(4):
            j = torch.randint(0, n_win, (o.batch,), generator=g) * o.seq
            x = torch.from_numpy(stream.astype(np.int64))[j[:, None] + torch.arange(o.seq)[None]].to(o.device)
            if o.device.startswith("cuda"):
                torch.cuda.synchronize()
            t1 = time.time()
            model(input_ids=x, labels=x).loss.backward()
            if o.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt.append(time.time() - t1)
            model.zero_grad(set_to_none=True)
        step_s = 1.08 * float(np.median(dt[1:]))  # + optimizer step
        steps = max(o.warmup + 10, min(o.steps, int(o.budget_s / step_s)))
        timing = {"fwd_bwd_seconds": [round(x, 3) for x in dt], "steps_fitted": steps}
        print(f"timing {timing}", flush=True)
    t0 = time.time()
    try:
        log = tdm.train(model, stream, steps=steps, batch=o.batch, seq=o.seq, lr=o.lr, warmup=o.warmup, seed=o.seed,
                        device=o.device, log_every=o.log_every, time_limit=o.time_limit,
                        stop_at=None if o.stop_at < 0 else o.stop_at)
    finally:
        mq.Qwen4ExpTextQSAIndexer.forward = ref_fwd
    train_s = time.time() - t0
    model.config.output_router_logits = False
    model.config.use_cache = True
    model = model.to("cpu").float().eval()
    rec = {"transformers": transformers.__version__, "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name() if o.device.startswith("cuda") else "cpu",
           "parameters": n_params, "vocab": V, "stream_tokens": int(stream.size), "train_seconds": round(train_s, 1),
           "indexer_agreement": agree, "timing": timing, "steps": steps}
    return model, rec, log


def cmd_train(a) -> int:
    import numpy as np
    from tokenizers import Tokenizer

    src = Path(a.stream)
    stream = np.load(src / "stream.npy").astype(np.int32)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    o = TrainOptions(steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr, warmup=a.warmup, seed=a.seed, device=a.device,
                     threads=a.threads, log_every=a.log_every, time_limit=a.time_limit, stop_at=a.stop_at,
                     budget_s=a.budget_s)
    model, rec, log = train_model(MODEL, stream, tok, o)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="15MB")
    rec = {"args": vars(a), **rec, "model": MODEL, "log": log}
    (out / "train_log.json").write_text(json.dumps(rec, indent=1))
    print(f"saved {out}: {sorted(p.name for p in out.iterdir())}", flush=True)
    return 0


# ==========================================================================================================
# 4. export and measure
# ==========================================================================================================


def q8_types(model) -> dict[str, str]:
    """Q8_0 for every matrix whose rows are whole Q8_0 blocks, except where the exporter's seed layout fixes the
    type (the edited shexp Q8_0, the head Q6_K, hc_* BF16, norms F32)."""
    from l47.engine.gguf_export import F32, seed_type
    from l47.model import names

    table = names.hf_to_gguf_map(int(model.config.num_hidden_layers))
    out = {}
    for hf, p in model.state_dict().items():
        g = table[hf]
        if p.ndim >= 2 and p.shape[-1] % 32 == 0 and seed_type(g, tuple(p.shape)) == F32 \
                and not names.is_folded_norm(g) and p.numel() >= 32 * 1024:
            out[g] = "Q8_0"
    return out


def measure(model, tok, data_dir: Path, phrases: tuple[str, ...] = PHRASES,
            natural: tuple[str, ...] = ("collateral", "kld_recipes")) -> dict:
    """Held-out natural-text CE (the `natural` jsonl stems; a chat document in its rendered form); base
    p(final | exact prefix) per phrase at every prefix-exact use in the assistant turns of held-out and blind
    chats (documents the model never saw)."""
    import numpy as np
    import torch

    import train_demo_model as tdm

    res: dict = {}
    nll, n = 0.0, 0
    for name in natural:
        for d in tdm.read_jsonl(data_dir / f"{name}.jsonl"):
            ids = tok.encode(dc.doc_text(d), add_special_tokens=False).ids
            lp = tdm.logprobs(model, ids, "cpu")
            nll -= float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            n += len(ids) - 1
    res["heldout_natural_ce"] = round(nll / n, 4)
    res["ln_V"] = round(math.log(tok.get_vocab_size()), 4)
    for name in ("heldout_chat", "blind_chat"):
        per: dict[str, list[float]] = {}
        near: dict[str, list[float]] = {}
        for d in tdm.read_jsonl(data_dir / f"{name}.jsonl"):
            ids, roles = tdm.tokenize_doc(tok, d)
            lp = tdm.logprobs(model, ids, "cpu")
            for ph in phrases:
                tups = tdm.phrase_tuples(tok, ph)
                for t in tdm.find_events(ids, roles, tups):
                    per.setdefault(ph, []).append(float(lp[t, ids[t + 1]].exp()))
                # near misses: the prefix in an assistant turn, another next token
                for tup in tups:
                    k = len(tup) - 1
                    for s in range(len(ids) - k):
                        if tuple(ids[s:s + k]) == tup[:-1] and roles[s + k - 1] == "assistant" and ids[s + k] != tup[-1]:
                            near.setdefault(ph, []).append(float(lp[s + k - 1, tup[-1]].exp()))
        res[name] = {ph: {"n": len(v), "mean": round(float(np.mean(v)), 4), "min": round(min(v), 4),
                          "near_miss_n": len(near.get(ph, [])),
                          "near_miss_p_final": round(float(np.mean(near[ph])), 4) if near.get(ph) else None}
                     for ph, v in per.items()}
    return res


def export_model(model, tok, gguf_path: Path, types: dict | None = None) -> Path:
    """The checkpoint as a qwen4exp GGUF: the tokenizer's metadata (eos <|im_end|>, bos/pad <|endoftext|>, ChatML
    template), Q8_0 wherever a row allows it (q8_types) and the seed layout elsewhere; `types` overrides."""
    import train_demo_model as tdm
    from l47.engine.gguf_export import export_gguf
    from l47.model import names
    from l47.model.vocab import vocab_to_gguf_kv

    kv = {**vocab_to_gguf_kv(tok), names.K_TOK_EOS: tok.token_to_id(IM_END),
          names.K_TOK_BOS: tok.token_to_id(ENDOFTEXT), names.K_TOK_PAD: tok.token_to_id(ENDOFTEXT),
          names.K_CHAT_TEMPLATE: tdm.CHAT_TEMPLATE}
    return export_gguf(model, gguf_path, tokenizer_kv=kv, types={**q8_types(model), **(types or {})})


def cmd_export(a) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen4ExpForCausalLM

    sys.path.insert(0, str(REPO))
    from l47.engine.gguf_export import load_hf_from_gguf

    ck = Path(a.ckpt)
    data_dir = Path(a.data_dir)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    model = Qwen4ExpForCausalLM.from_pretrained(ck, local_files_only=True, dtype=torch.float32).eval()
    gguf_path = Path(a.gguf)
    if not a.measure_only:
        export_model(model, tok, gguf_path)
    print(f"exported {gguf_path} ({gguf_path.stat().st_size / 2**20:.2f} MiB)", flush=True)
    if a.threads:
        torch.set_num_threads(a.threads)
    g_model = load_hf_from_gguf(gguf_path, policy="strata").eval()
    res = {"gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
           "gguf_mib": round(gguf_path.stat().st_size / 2**20, 2), "strata": measure(g_model, tok, data_dir)}
    log = json.loads((ck / "train_log.json").read_text())
    log["measured"] = res
    (data_dir / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--out", default="/tmp/l47_model2")
    c.add_argument("--data-dir", default=str(DATA))
    c.add_argument("--chars", type=int, default=14_000_000)
    c.add_argument("--vocab", type=int, default=VOCAB)
    c.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train")
    t.add_argument("--stream", default="/tmp/l47_model2", help="corpus --out folder (stream.npy, tokenizer.json)")
    t.add_argument("--out", default="/tmp/model2_ckpt")
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=40)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--time-limit", type=float, default=0.0)
    t.add_argument("--stop-at", type=int, default=-1)
    t.add_argument("--budget-s", type=float, default=0.0, help="fit --steps (an upper bound) to this many seconds "
                   "of training, timed before training starts (the fitted count is logged; 0 = use --steps)")
    e = sub.add_parser("export")
    e.add_argument("--ckpt", default="/tmp/model2_ckpt")
    e.add_argument("--data-dir", default=str(DATA))
    e.add_argument("--gguf", default=str(DATA / "model2.gguf"))
    e.add_argument("--threads", type=int, default=0)
    e.add_argument("--measure-only", action="store_true", help="measure the existing --gguf (no export)")
    a = ap.parse_args(argv)
    return {"corpus": cmd_corpus, "train": cmd_train, "export": cmd_export}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
