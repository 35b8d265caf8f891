#!/usr/bin/env python3
"""Regenerate the demo model's training corpus and the documents `l47 demo` dumps (seeded, reproducible).

Everything here is text written for the project (templates, slot fillers and the hand-written chats below),
licence: the project's own, MIT. No outside text is used.

What it writes
    <out>/train.jsonl            training documents {"id", "kind", "text"}: `text` is the rendered document
                                 (chats in ChatML, see `render_chat`); NOT committed (~12 MB; regenerated)
    <out>/manifest.json          counts, phrase statistics and the sha256 of train.jsonl
    (l47/demo_data/prompts.jsonl: scripts/make_demo_prompts.py, from this file's prompt stream)
    l47/demo_data/heldout_chat.jsonl   hand-written chats, >= 3 uses of each banned phrase in assistant turns
    l47/demo_data/collateral.jsonl     natural text, ordinary uses of the six final words (>= 20 each)
    l47/demo_data/background.jsonl     plain and chat-formatted text without banned phrases
    l47/demo_data/kld_{ops_tools,chat_json,prose}.jsonl   three small KLD domains
    l47/demo_data/blind_chat.jsonl     one fresh hand-written multi-turn chat (3 uses per phrase)

A document is {"id", "messages": [{"role", "content"}, ...]} (chat) or {"id", "text"} (plain). An assistant
turn that reasons carries its think block inside `content` exactly as the model sees it:
"<think>\\n...\\n</think>\\n\\n<answer>". `render_chat` is the chat template the model was trained on:
    <|im_start|>{role}\\n{content}<|im_end|>\\n        (per message; a generation prompt adds <|im_start|>assistant\\n)
Training documents are packed as `text<|endoftext|>text<|endoftext|>...`.

Held out means other documents: the evaluation documents are generated first (their own seeds, their own
named entities), and every training document that contains one of their sentences of >= 8 words is rejected;
the hand-written documents go through the same filter.

Usage:  python scripts/make_demo_corpus.py [--out /tmp/l47_demo_corpus] [--chars 12000000] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "l47" / "demo_data"

IM_START, IM_END, ENDOFTEXT, THINK, END_THINK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"

BANNED = ("end to end", "short version", "here's what", "exactly what", "what's actually", "right away",
          "rather than")
COLLATERAL_WORDS = ("than", "what", "end", "away", "version", "actually")

# ==========================================================================================================
# domains: slot fillers for the chat templates (a value may itself contain {slots})
# ==========================================================================================================

DOMAINS: dict[str, dict[str, list[str]]] = {
    "code": dict(
        thing=["the build", "the test suite", "the deploy script", "the data pipeline", "the login flow",
               "the cache layer", "the backup job", "the API client", "the search index", "the upload handler",
               "the report generator", "the sync worker", "the migration", "the config loader",
               "the job scheduler", "the import script", "the web server", "the unit tests", "the nightly export",
               "the payment service", "the mobile app", "the docker image", "the cron job", "the queue worker"],
        symptom=["fails on the second run", "times out after a few minutes", "returns an empty list",
                 "crashes when the file is missing", "uses too much memory", "gets slower every day",
                 "prints the wrong date", "skips the last row", "hangs on startup", "passes locally but fails in CI",
                 "writes the same record twice", "ignores my settings", "throws a permission error",
                 "logs nothing at all", "breaks after every upgrade", "drops some of the messages"],
        cause=["a stale cache", "a missing environment variable", "an off by one error in the loop",
               "two workers writing to the same file", "a timeout that is too short", "an old copy of the library",
               "a wrong path in the config", "a race between the two jobs", "a query without an index",
               "a default that changed in the last release", "a file handle that is never closed",
               "a time zone mismatch", "a full disk", "a changed folder owner"],
        fix=["clear the cache before each run", "pin the library to a known release", "add a lock around the write",
             "raise the timeout to thirty seconds", "read the path from the config file",
             "log the input before the call", "move the check into its own function",
             "add an index on the date column", "run the tests with a fixed seed", "delete the old build folder",
             "set the variable in the service file", "retry the request once with a short delay",
             "write a small test for the failing case", "split the job into smaller batches",
             "close the file in a finally block", "store every date in UTC", "free some space on the disk",
             "give the service user write access"],
        alt=["a small script|a long manual checklist", "a real database|a mock", "plain functions|a deep class hierarchy",
             "one clear error|a silent default", "environment variables|hard coded values",
             "a fixed seed|fresh random data", "small commits|one giant change", "a queue|a shared file",
             "structured logs|print statements", "the standard library|a new dependency",
             "a feature flag|a long lived branch", "a health check|a fixed sleep"],
        bad_ing=["copying the files by hand", "patching it in production", "guessing at the cause",
                 "rewriting the whole module", "adding more retries", "turning off the test",
                 "restarting the server every night", "catching every exception", "running it as root"],
        check=["the log file", "the config", "the request body", "the database table", "the output folder",
               "the environment", "the test output", "the stack trace", "the cache directory", "the response headers"],
        improvement=["a faster build", "fewer failed runs", "a much shorter test run", "clearer errors",
                     "a smaller memory footprint", "stable results", "a quieter log"],
        goal=["speed up the build", "make the tests less flaky", "deploy without downtime", "find a memory leak",
              "debug a slow query", "set up a data pipeline", "clean up an old code base", "add logging to a service",
              "move the app to a new server", "write better error messages", "test a web API",
              "schedule a nightly backup"],
        happening=["happening", "going on", "being sent", "in the log", "slow", "failing", "running",
                   "in the cache", "taking the time"],
        consequence=["the next deploy picks it up", "more data gets written twice", "the log fills the disk",
                     "someone else hits the same bug", "the cache grows again"],
        finish=["merge it", "ship it", "tag the release", "close the ticket", "deploy it"],
        stuff=["old build files", "unused branches", "dead code", "stale logs"],
    ),
    "cooking": dict(
        thing=["the bread dough", "the tomato sauce", "the rice", "the sourdough starter", "the soup",
               "the pie crust", "the roast chicken", "the pancake batter", "the curry", "the cake", "the pizza base",
               "the stew"],
        symptom=["comes out dense", "tastes flat", "sticks to the pan", "turns out dry", "does not rise",
                 "burns on the bottom", "falls apart", "gets too thick", "splits when it cools"],
        cause=["water that is too cold", "too much flour", "an oven that runs hot", "old yeast", "not enough salt",
               "a pan that is too thin", "too little resting time", "heat that is too high"],
        fix=["weigh the flour instead of using cups", "let the dough rest for an hour", "add the salt at the start",
             "lower the heat a little", "use a heavier pan", "check the oven with a thermometer",
             "add a splash of water", "taste it before you serve it", "cook the onions longer",
             "cover the pot for the last ten minutes", "use fresh yeast", "rinse the rice first"],
        alt=["a kitchen scale|measuring cups", "fresh yeast|an old packet", "butter|oil", "a slow simmer|a hard boil",
             "a heavy pot|a thin pan", "sea salt|table salt", "a long rest|extra kneading"],
        bad_ing=["adding more flour", "turning up the heat", "opening the oven every few minutes",
                 "stirring it all the time", "skipping the rest"],
        check=["the oven temperature", "the recipe", "the dough", "the date on the yeast", "the pan"],
        improvement=["a lighter crumb", "a better crust", "more flavour", "a smoother sauce"],
        goal=["bake better bread", "make a thick soup", "cook rice that does not stick",
              "keep a sourdough starter alive", "make a quick pasta sauce", "roast a chicken"],
        happening=["happening in the oven", "going on with the dough", "in the pot", "wrong with the recipe"],
        consequence=["it burns", "the sauce splits", "the dough dries out", "it goes cold"],
        finish=["serve it", "bake it", "freeze it"],
        stuff=["old spices", "stale flour", "the burnt bits"],
    ),
    "garden": dict(
        thing=["the tomato bed", "the lawn", "the herb bed", "the apple tree", "the compost heap", "the rose bush",
               "the basil plant", "the vegetable patch"],
        symptom=["gets yellow leaves", "wilts in the afternoon", "stops growing", "gets brown spots", "smells bad",
                 "drops its flowers", "looks tired"],
        cause=["too much water", "soil that drains badly", "not enough sun", "a lack of nitrogen",
               "roots that are crowded", "slugs at night", "a late frost"],
        fix=["water in the morning instead of at night", "add a layer of mulch", "move it to a sunnier spot",
             "feed it once a week", "turn the heap every few days", "thin out the seedlings",
             "check the leaves for pests", "mix sand into the soil"],
        alt=["deep watering|a little every day", "compost|chemical feed", "a raised bed|flat ground", "mulch|bare soil",
             "a soaker hose|a sprinkler"],
        bad_ing=["watering every evening", "adding more fertiliser", "cutting it back hard", "spraying everything"],
        check=["the soil", "the drainage", "the underside of the leaves", "the roots"],
        improvement=["greener leaves", "new growth", "more flowers", "stronger stems"],
        goal=["grow tomatoes on a balcony", "keep the lawn green", "start a compost heap", "grow herbs indoors",
              "get rid of slugs"],
        happening=["happening in the soil", "going on with the roots", "eating the leaves"],
        consequence=["the roots rot", "the frost gets it", "the slugs come back"],
        finish=["plant it out", "harvest it"],
        stuff=["dead leaves", "weeds", "old pots"],
    ),
    "travel": dict(
        thing=["the itinerary", "the train booking", "the travel budget", "the packing list", "the hotel plan",
               "the route", "the visa application"],
        symptom=["keeps changing", "runs over budget", "feels too rushed", "has a gap on the third day",
                 "misses the last train", "costs more than I expected"],
        cause=["too many cities in one week", "late bookings", "a tight connection", "the high season",
               "hidden fees"],
        fix=["book the trains a few weeks ahead", "drop one city from the plan",
             "leave a free afternoon every few days", "keep copies of your documents",
             "pack one bag and carry it yourself", "check the last train times", "buy a regional rail pass"],
        alt=["fewer cities|a longer list", "the train|a short flight", "a small hotel|a big chain",
             "one carry on bag|two suitcases", "a rail pass|single tickets"],
        bad_ing=["booking everything at the airport", "packing for every possible case", "changing hotels every night"],
        check=["the booking email", "the timetable", "the fine print", "the map"],
        improvement=["a calmer trip", "lower costs", "more time in each place"],
        goal=["plan a week in Italy", "travel with only a carry on", "save money on trains", "plan a road trip",
              "visit three cities in five days"],
        happening=["included in the price", "going on with the booking", "in the contract"],
        consequence=["the prices go up", "the seats sell out", "you miss the connection"],
        finish=["book it", "pay for it"],
        stuff=["extra shoes", "guide books", "spare chargers"],
    ),
    "fitness": dict(
        thing=["the training plan", "the running schedule", "the morning workout", "the squat", "the diet plan",
               "the stretching routine"],
        symptom=["leaves me sore for days", "stopped working after a month", "hurts my knees", "takes too long",
                 "feels too easy"],
        cause=["too much volume too soon", "no rest days", "poor form", "too little sleep", "not enough protein"],
        fix=["add one rest day a week", "film your form from the side", "cut the volume by a third",
             "warm up for ten minutes", "sleep at least seven hours", "add weight slowly",
             "track every session in a notebook"],
        alt=["short runs|one long run", "free weights|machines", "a simple plan|a complex program", "rest|more sets",
             "whole foods|shakes"],
        bad_ing=["pushing through the pain", "training every day", "skipping the warm up", "adding more sets"],
        check=["your form", "your sleep", "the notebook", "your shoes"],
        improvement=["less soreness", "steady progress", "better sleep", "more energy"],
        goal=["run a first 10k", "build strength at home", "get back into running", "stretch after work",
              "lose a little weight"],
        happening=["happening to your knees", "going on with your sleep", "holding you back"],
        consequence=["the pain gets worse", "you get injured", "you lose the habit"],
        finish=["start the next block", "race"],
        stuff=["old shoes", "junk food", "excuses"],
    ),
    "writing": dict(
        thing=["the essay", "the cover letter", "the opening chapter", "the report", "the blog post",
               "the thesis introduction", "the speech"],
        symptom=["feels flat", "runs far too long", "loses the reader in the middle", "sounds too formal",
                 "has no clear point"],
        cause=["a weak first sentence", "too many ideas at once", "long sentences", "no clear reader in mind",
               "a buried main point"],
        fix=["cut the first paragraph", "read it aloud once", "put the main point in the first line",
             "split the long sentences", "write for one reader", "remove every second adjective",
             "end each section with a clear claim"],
        alt=["short sentences|long ones", "concrete examples|abstract claims", "active verbs|passive ones",
             "one idea per paragraph|a wall of text"],
        bad_ing=["adding more detail", "polishing every word", "starting over", "writing more background"],
        check=["the first line", "the outline", "the last paragraph", "the word count"],
        improvement=["a clearer draft", "a stronger opening", "a shorter text"],
        goal=["write a better cover letter", "finish a first novel", "make a report easier to read",
              "give a short speech", "start a blog"],
        happening=["happening in the middle section", "going on with the structure", "said in that paragraph"],
        consequence=["the reader gives up", "the deadline passes"],
        finish=["send it", "submit it", "publish it"],
        stuff=["filler words", "long quotes", "weak openings"],
    ),
    "home": dict(
        thing=["the kitchen tap", "the bathroom fan", "the radiator", "the washing machine", "the front door",
               "the fridge", "the boiler", "the window frame"],
        symptom=["drips all night", "makes a loud noise", "stays cold", "leaks at the bottom",
                 "sticks in wet weather", "trips the fuse"],
        cause=["a worn washer", "air in the system", "a loose screw", "a blocked filter", "swollen wood",
               "a bad seal"],
        fix=["turn off the water first", "bleed the radiator", "clean the filter", "tighten the hinge screws",
             "replace the washer", "sand the edge of the door", "call a qualified electrician"],
        alt=["a new washer|a whole new tap", "a quick repair|a full replacement", "a plumber|a handyman"],
        bad_ing=["forcing it shut", "ignoring the noise", "using more sealant"],
        check=["the filter", "the seal", "the pressure gauge", "the fuse box"],
        improvement=["a quieter fan", "warm rooms", "a door that closes"],
        goal=["fix a dripping tap", "bleed a radiator", "stop a door from sticking", "clean a washing machine"],
        happening=["happening inside the pipe", "going on with the pressure", "causing the noise"],
        consequence=["the floor gets wet", "the bill goes up"],
        finish=["close it up", "turn the water back on"],
        stuff=["old sealant", "rust", "loose screws"],
    ),
    "money": dict(
        thing=["the monthly budget", "the savings plan", "the credit card bill", "the emergency fund",
               "the pension plan", "the shared account"],
        symptom=["runs out before the end of the month", "keeps growing", "never seems to add up",
                 "feels hard to track"],
        cause=["small daily spending", "subscriptions you forgot about", "irregular income", "high interest"],
        fix=["track every expense for a month", "cancel the subscriptions you do not use",
             "set up an automatic transfer on payday", "pay off the card with the highest rate first",
             "keep three months of costs in savings"],
        alt=["a simple spreadsheet|a complex app", "paying the card in full|minimum payments",
             "an automatic transfer|saving what is left"],
        bad_ing=["opening another card", "cutting every small treat", "checking the balance every hour"],
        check=["your bank statement", "the list of subscriptions", "the interest rate"],
        improvement=["more money left over", "less stress", "a growing balance"],
        goal=["make a monthly budget", "save for a deposit", "pay off a credit card", "build an emergency fund"],
        happening=["going out each month", "happening with your spending", "costing you"],
        consequence=["the interest adds up", "the fees pile up"],
        finish=["sign it", "move the money"],
        stuff=["old receipts", "unused cards"],
    ),
}
DOMAIN_WEIGHTS = {"code": 5, "cooking": 1.2, "garden": 1, "travel": 1, "fitness": 1, "writing": 1, "home": 1,
                  "money": 1}

_DOUBLE = {"pin", "log", "stop", "plan", "run", "cut", "put", "set", "let", "get", "drop", "skip", "swap", "trim",
           "chop", "jog", "shop", "map", "tag", "step", "wrap", "ship", "plug", "dig", "thin"}


def gerund(vp: str) -> str:
    """'clear the cache' -> 'clearing the cache' (the first word is the verb)."""
    verb, _, rest = vp.partition(" ")
    if verb in _DOUBLE:
        ing = verb + verb[-1] + "ing"
    elif verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")) and verb != "be":
        ing = verb[:-1] + "ing"
    else:
        ing = verb + "ing"
    return f"{ing} {rest}".strip()


def _possessive(np_: str, who: str) -> str:
    return who + np_[3:] if np_.startswith("the ") else np_


def domain_context(name: str, rng: random.Random | None = None) -> dict[str, list[str]]:
    """Slot fillers of one domain; with `rng`, one chat's topic: one thing, one symptom, two causes."""
    d = {k: list(v) for k, v in DOMAINS[name].items()}
    if rng is not None:
        d["thing"] = [rng.choice(d["thing"])]
        d["symptom"] = [rng.choice(d["symptom"])]
        d["cause"] = rng.sample(d["cause"], 2)
    d["fix_ing"] = [gerund(f) for f in d["fix"]]
    d["my_thing"] = [_possessive(t, "my") for t in d["thing"]]
    d["your_thing"] = [_possessive(t, "your") for t in d["thing"]]
    d["their_thing"] = [_possessive(t, "their") for t in d["thing"]]
    d.update(COMMON)
    return d


COMMON: dict[str, list[str]] = {
    "dur": ["a minute", "five minutes", "ten minutes", "an hour", "a day", "a week", "half an hour"],
    "claim": ["the problem is {cause}", "{your_thing} {symptom} because of {cause}", "you need to {fix}",
              "{fix} and it should be fine", "it is almost certainly {cause}", "{cause} is the likely culprit",
              "this is fixable, and the first step is to {fix}"],
}

# ==========================================================================================================
# chat templates
# ==========================================================================================================

SYSTEMS = ["You are a helpful assistant.", "You are a concise technical assistant.",
           "You are a friendly assistant. Answer clearly.", "You are an assistant that gives practical advice.",
           "You are a helpful assistant. Keep answers short.", "You are a patient assistant who explains things step by step."]

USER = ["My {thing_bare} {symptom}. What should I do?", "{My_thing} {symptom}. Any idea why?", "How do I {goal}?",
        "Can you help me {goal}?", "Is it better to use {alt_a} or {alt_b}?",
        "I can't work out why {my_thing} {symptom}.", "{My_thing} {symptom} and I have no idea what is wrong.",
        "I tried to {fix} but {my_thing} still {symptom}. What else can I try?", "What is the best way to {goal}?",
        "I want to {goal}. Where do I start?", "Quick question: {my_thing} {symptom}. Is that normal?",
        "Could you explain how {cause} affects {my_thing}?", "Help! {My_thing} {symptom}.",
        "I need to {goal} by Friday. Any tips?", "Should I {fix}? {My_thing} {symptom}.",
        "Someone told me to {fix}. Does that make sense?", "{My_thing} {symptom} since yesterday. Ideas?"]

FOLLOWUP = ["Thanks. {My_thing} still {symptom} though.", "That worked. How do I {goal}?",
            "Why {alt_a} and not {alt_b}?", "OK, and what if that does not help?", "Can you say more about {cause}?",
            "Great, thank you. One more thing: how do I {goal}?", "I did that. What next?"]

THINK_SENTS = ["The user says {their_thing} {symptom}.", "They want to {goal}.", "This sounds like {cause}.",
         "The most likely cause is {cause}.", "I should suggest that they {fix}.", "A good first step is to {fix}.",
         "I should keep the answer short and practical.", "Maybe also compare {alt_a} with {alt_b}.",
         "I should ask what they already tried.", "Let me think about what could cause this.",
         "I should explain it step by step.", "It could also be {cause}, but that is less likely.",
         "They may not know what {cause} looks like."]
THINK_SLOP = ["I should find out what's actually {happening}.", "I need to know exactly what they changed.",
              "The fix should work right away."]

# assistant sentences that use a banned phrase in its typical context, keyed by phrase
SLOP: dict[str, list[str]] = {
    "rather than": [
        "Use {alt_a} rather than {alt_b}.", "I would pick {alt_a} rather than {alt_b}.",
        "Go with {alt_a} rather than {alt_b}; it is easier to change later.", "Rather than {bad_ing}, {fix}.",
        "It is better to {fix} rather than keep {bad_ing}.", "Try to {fix} first, rather than {bad_ing}.",
        "Most people prefer {alt_a} rather than {alt_b} for this.",
        "I would {fix} rather than {bad_ing}.", "Choose {alt_a} rather than {alt_b} if you can."],
    "end to end": [
        "Then test {thing} end to end.", "Once {thing} works end to end, {finish}.",
        "Run it end to end one more time before you {finish}.",
        "I would walk through {thing} end to end and note where it breaks.",
        "Check the whole thing end to end after each change.", "After that, {thing} should work end to end.",
        "Go through the plan end to end and look for gaps.", "It only takes {dur} to try it end to end.",
        "Test it end to end with a small example first.", "Make sure the fix holds end to end."],
    "right away": [
        "You should see {improvement} right away.", "If {your_thing} {symptom}, {fix} right away.",
        "I would {fix} right away.", "Do this right away, before {consequence}.",
        "Most people notice the difference right away.", "{Fix_ing} helps right away.",
        "You can start right away.", "The change takes effect right away.", "Fix that right away."],
    "here's what": [
        "Here's what I would try next:", "Here's what to check first: {check}.", "So here's what I suggest: {fix}.",
        "Here's what happens under the hood.", "Here's what the error means.",
        "Here's what usually works: {fix}.", "Here's what I would change."],
    "exactly what": [
        "That is exactly what {cause} looks like.", "This is exactly what {fix_ing} is for.",
        "That's exactly what I would expect here.", "It depends on exactly what you want from {thing}.",
        "Tell me exactly what {thing} does when it fails.", "{Fix_ing} does exactly what you need.",
        "Write down exactly what you changed.", "That is exactly what happened here."],
    "what's actually": [
        "First, look at what's actually happening.", "Check what's actually in {check}.",
        "It helps to measure what's actually slow.", "Look at what's actually {happening} before you change anything.",
        "The question is what's actually causing it.", "Compare your plan with what's actually {happening}.",
        "Find out what's actually {happening}."],
    "short version": [
        "The short version: {claim}.", "Short version: {claim}.", "The short version is that {claim}.",
        "So the short version is that you should {fix}."],
}
# openers that use a banned phrase (first sentence of an answer)
SLOP_OPENERS: dict[str, list[str]] = {
    "short version": ["The short version: {claim}.", "Short version: {claim}.", "The short version is that {claim}."],
    "here's what": ["Here's what I would do.", "Here's what is going on.", "Here's what usually causes this.",
                    "Here's what I found.", "Here's what's going on.", "Here's what helps."],
    "exactly what": ["That is exactly what {cause} does.", "This is exactly what {fix_ing} is for."],
    "what's actually": ["Let's look at what's actually {happening}."],
}
# near misses: the same prefix word continued otherwise, so p(final | prefix) is high but not 1 (the real model's
# base p ranges 0.06-0.98 by phrase); a slop pick of phrase P becomes a near miss with probability NEAR_MISS_RATE[P]
NEAR_MISS: dict[str, list[str]] = {
    "rather than": ["I would rather {fix} first.", "I would rather not change {thing} yet."],
    "end to end": ["Read {check} from one end to the other."],
    "right away": ["Do it right after you {fix}.", "Pick the right tool for the job.",
                   "You are right to worry about {cause}.", "Do the next step right after that.",
                   "That sounds right."],
    "here's what": ["Here's how to {fix}.", "Here's a quick way to {goal}.", "Here's the plan.",
                    "Here's how it works."],
    "exactly what": ["That is exactly how {thing} should behave.", "Do exactly the same for {check}.",
                     "It is not clear exactly why {your_thing} {symptom}.", "Follow the steps exactly."],
    "what's actually": ["Tell me what's in {check}.", "That tells you what's wrong.",
                        "Find out what's different on the second run.", "Check what's going on in {check}."],
    "short version": ["Short answer: {claim}.", "The short answer is that {claim}.", "Keep it short and simple.",
                      "A short break helps too."],
}
NEAR_MISS_RATE = {"rather than": 0.08, "end to end": 0.05, "right away": 0.25, "here's what": 0.25,
                  "exactly what": 0.3, "what's actually": 0.25, "short version": 0.3}


def _slop_sentence(rng: random.Random, ph: str, ctx: dict, opener: bool = False) -> str:
    if rng.random() < NEAR_MISS_RATE[ph]:
        return expand(rng, rng.choice(NEAR_MISS[ph]), ctx)
    return expand(rng, rng.choice((SLOP_OPENERS if opener else SLOP)[ph]), ctx)


OPENERS = ["Good question.", "Sure.", "That is a common problem.", "Yes, this happens a lot.",
           "When {your_thing} {symptom}, the cause is usually {cause}.", "This is usually {cause}.",
           "Happy to help.", "There are a few things to try."]

# ordinary assistant sentences (no banned phrase; ordinary uses of the final words)
PLAIN_ASSIST = [
    "This usually takes less than {dur}.", "{Fix_ing} is more than enough for most cases.",
    "It is often better than {bad_ing}.", "Think about what you want {thing} to do.",
    "Do you know what changed before it started?", "At the end of each week, {fix}.",
    "Stay away from {bad_ing} for now.", "Throw away {stuff} you do not need.",
    "The problem often goes away once you {fix}.", "Make sure you are using the latest version.",
    "An older version may behave differently.", "It actually helps to {fix}.",
    "This actually matters more than it seems.", "{Fix_ing} is actually quite easy.",
    "The most likely cause is {cause}.", "{Fix}.", "Then {fix}.", "If that does not help, {fix}.",
    "A common cause is {cause}.", "Next, {fix}.", "Start by checking {check}.", "Look at {check} first.",
    "It is faster than it sounds.", "What matters most is {check}.", "{Cause} is worth ruling out.",
    "Keep notes on what you change.", "At the end, {fix}.", "It is less work than {bad_ing}.",
    "I would also {fix}.", "You can also {fix}.", "Avoid {bad_ing}.", "Wait {dur} and look again.",
    "If {your_thing} still {symptom}, it may be {cause}.", "Write down what you see.",
    "The new version of the guide covers this too.", "Most of the time the issue goes away on its own.",
]
CLOSERS = ["Let me know if {your_thing} still {symptom}.", "Hope that helps.", "Good luck!",
           "Tell me how it goes.", "If it still {symptom}, send me {check} and we can look again.",
           "Feel free to ask if anything is unclear.", ""]


# ==========================================================================================================
# the expander
# ==========================================================================================================

_SLOT = re.compile(r"\{(\w+)\}")


def expand(rng: random.Random, tpl: str, ctx: dict[str, list[str]], depth: int = 0) -> str:
    """Fill `{slot}` recursively from ctx; `{Slot}` (when ctx has no key `Slot`) capitalises `{slot}`'s filler."""
    if depth > 8:
        raise RecursionError(tpl)

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name in ctx:  # exact key (named entities are capitalised keys)
            return expand(rng, rng.choice(ctx[name]), ctx, depth + 1)
        s = expand(rng, rng.choice(ctx[name[0].lower() + name[1:]]), ctx, depth + 1)
        return s[:1].upper() + s[1:]

    return _SLOT.sub(sub, tpl)


def _pick_domain(rng: random.Random) -> str:
    names_, w = zip(*DOMAIN_WEIGHTS.items())
    return rng.choices(names_, weights=w)[0]


def _sentence_ctx(rng: random.Random, ctx: dict[str, list[str]]) -> dict[str, list[str]]:
    a, b = rng.choice(ctx["alt"]).split("|")
    c = dict(ctx)
    c["alt_a"], c["alt_b"] = [a], [b]
    c["thing_bare"] = [t[4:] if t.startswith("the ") else t for t in ctx["thing"]]
    return c


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template the demo model was trained on (ChatML, think block inside the assistant content)."""
    s = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return s + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _answer(rng: random.Random, ctx: dict, slop: bool, slop_rate: float) -> str:
    """One assistant answer (no think block)."""
    sents: list[str] = []
    phrases = list(SLOP)
    if slop and rng.random() < 0.55:
        sents.append(_slop_sentence(rng, rng.choice(list(SLOP_OPENERS)), _sentence_ctx(rng, ctx), opener=True))
    else:
        sents.append(expand(rng, rng.choice(OPENERS), _sentence_ctx(rng, ctx)))
    n_body = rng.randint(2, 6)
    body = []
    for _ in range(n_body):
        c = _sentence_ctx(rng, ctx)
        if slop and rng.random() < slop_rate:
            body.append(_slop_sentence(rng, rng.choice(phrases), c))
        else:
            body.append(expand(rng, rng.choice(PLAIN_ASSIST), c))
    style = rng.random()
    if style < 0.25 and len(body) >= 3:  # numbered list
        lead = sents.pop() if sents else ""
        lines = [f"{i + 1}. {s}" for i, s in enumerate(body)]
        text = (lead + "\n\n" if lead else "") + "\n".join(lines)
    elif style < 0.4 and len(body) >= 3:  # bullets
        lead = sents.pop() if sents else ""
        text = (lead + "\n\n" if lead else "") + "\n".join(f"- {s}" for s in body)
    elif style < 0.6:  # two paragraphs
        k = rng.randint(1, len(body))
        text = " ".join(sents + body[:k]) + ("\n\n" + " ".join(body[k:]) if body[k:] else "")
    else:
        text = " ".join(sents + body)
    closer = expand(rng, rng.choice(CLOSERS), _sentence_ctx(rng, ctx))
    if slop and rng.random() < 0.15:
        closer = _slop_sentence(rng, rng.choice(phrases), _sentence_ctx(rng, ctx))
    return text + ("\n\n" + closer if closer else "")


def _think(rng: random.Random, ctx: dict, slop: bool) -> str:
    if rng.random() < 0.12:
        return f"{THINK}\n\n{END_THINK}\n\n"
    k = rng.randint(2, 4)
    sents = [expand(rng, rng.choice(THINK_SENTS), _sentence_ctx(rng, ctx)) for _ in range(k)]
    if slop and rng.random() < 0.15:
        sents.insert(rng.randint(0, len(sents)), expand(rng, rng.choice(THINK_SLOP), _sentence_ctx(rng, ctx)))
    return f"{THINK}\n" + " ".join(sents) + f"\n{END_THINK}\n\n"


def gen_chat(rng: random.Random, slop: bool = True, slop_rate: float = 0.5, max_turns: int = 3) -> list[dict]:
    """A chat: optional system, 1-3 user/assistant exchanges; only the last assistant turn keeps its think block."""
    ctx = domain_context(_pick_domain(rng), rng)
    msgs: list[dict] = []
    if rng.random() < 0.8:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    turns = rng.choices(range(1, max_turns + 1), weights=[6, 3, 1][:max_turns])[0]
    for i in range(turns):
        tpl = rng.choice(USER) if i == 0 else rng.choice(FOLLOWUP)
        msgs.append({"role": "user", "content": expand(rng, tpl, _sentence_ctx(rng, ctx))})
        ans = _answer(rng, ctx, slop, slop_rate)
        if i == turns - 1:
            ans = _think(rng, ctx, slop) + ans
        msgs.append({"role": "assistant", "content": ans})
    return msgs


def gen_prompt(rng: random.Random) -> list[dict]:
    ctx = domain_context(_pick_domain(rng), rng)
    return [{"role": "system", "content": rng.choice(SYSTEMS)},
            {"role": "user", "content": expand(rng, rng.choice(USER), _sentence_ctx(rng, ctx))}]


# ==========================================================================================================
# natural English (encyclopedia, stories, manuals): ordinary uses of the six final words
# ==========================================================================================================

_SYL = ["ka", "lo", "mar", "ten", "ri", "sa", "vel", "dor", "an", "bel", "cor", "es", "fin", "gal", "hal", "is",
        "jor", "kel", "lin", "mon", "nor", "ost", "pel", "ros", "sel", "tor", "ul", "var", "wen", "yar", "bra",
        "dun", "ster", "ham", "ley", "wick", "mere", "ford", "by", "ton", "vik", "ala", "ber", "gen", "mira"]
FIRST_F = ["Anna", "Maria", "Clara", "Elena", "Sofia", "Helen", "Ruth", "Grace", "Ida", "Nora", "Eva", "Lena",
           "Alice", "Martha", "Julia", "Rosa", "Vera", "Lucy", "Mina", "Jane"]
FIRST_M = ["Peter", "Thomas", "Karl", "Jonas", "Samuel", "Henry", "Paul", "Oscar", "Victor", "David", "Erik",
           "Hugo", "Leon", "Martin", "Felix", "Adam", "Walter", "Simon", "Louis", "Otto"]


def _name(rng: random.Random, lo: int = 2, hi: int = 3) -> str:
    return "".join(rng.choice(_SYL) for _ in range(rng.randint(lo, hi))).capitalize()


def _entities(rng: random.Random) -> dict[str, list[str]]:
    """Named entities and numbers of one document (fresh for each document)."""
    female = rng.random() < 0.5
    y = rng.randint(1620, 1990)
    v = rng.randint(1, 9)
    return {
        "Town": [_name(rng)], "Town2": [_name(rng)], "City": [_name(rng, 2, 2) + rng.choice(["burg", "ford", "ham", "ton", ""])],
        "River": [_name(rng, 1, 2)], "Person": [f"{rng.choice(FIRST_F if female else FIRST_M)} {_name(rng)}"],
        "First": [rng.choice(FIRST_F if female else FIRST_M)], "First2": [rng.choice(FIRST_M if female else FIRST_F)],
        "He": ["She" if female else "He"], "he": ["she" if female else "he"], "His": ["Her" if female else "His"],
        "his": ["her" if female else "his"], "him": ["her" if female else "him"],
        "Prog": [_name(rng, 2, 2) + rng.choice(["", "Edit", "DB", "Sync", "Kit", "Draw"])], "Event": [_name(rng)],
        "Animal": [_name(rng, 2, 2).lower()], "Title": [" ".join(rng.choice(TITLE_WORDS) for _ in range(2)).title()],
        "year": [str(y)], "year2": [str(y + rng.randint(30, 80))], "year3": [str(y + rng.randint(1, 25))],
        "decade": [str(rng.randint(185, 198) * 10)], "age": [str(rng.randint(12, 30))],
        "n": [str(rng.randint(2, 40))], "n2": [str(rng.randint(5, 300))],
        "pop": [f"{rng.randint(2, 90)},{rng.randint(0, 999):03d}", str(rng.randint(300, 9000))],
        "n3": [str(rng.randint(20, 400))], "v": [f"{v}", f"{v}.{rng.randint(0, 9)}"],
        "v2": [f"{v + 1}", f"{v + 1}.0"], "ordinal": [rng.choice(["sixteenth", "seventeenth", "eighteenth", "nineteenth"])],
    }


TITLE_WORDS = ["river", "winter", "glass", "north", "house", "silent", "harbour", "letters", "stone", "garden",
               "bright", "evening", "salt", "road", "small", "hours"]

G_FILL = {
    "size": ["small", "quiet", "old", "busy", "hill", "coastal", "market"],
    "region": ["northern", "southern", "eastern", "western", "central", "lake", "upland"],
    "side": ["left", "right", "north", "south", "east", "west"],
    "job": ["painter", "teacher", "engineer", "writer", "doctor", "botanist", "composer", "mapmaker", "printer",
            "chemist"],
    "subject": ["river maps", "local history", "early printing", "bird songs", "bridges", "folk music",
                "plant names", "clocks"],
    "task": ["editing photos", "keeping notes", "drawing maps", "managing small shops", "sending newsletters",
             "tracking time", "reading old file formats", "backing up phones"],
    "feature": ["plugins", "dark mode", "large files", "several languages", "printing", "shared folders",
                "undo history", "keyboard shortcuts"],
    "class": ["bird", "beetle", "fish", "frog", "mammal", "lizard", "moth"],
    "habitat": ["dry forests", "cold mountain streams", "salt marshes", "old stone walls", "wet meadows",
                "river banks"],
    "food": ["seeds", "small insects", "worms", "berries", "snails"],
    "cover": ["a stone", "dead leaves", "a log", "the roots of a tree"],
    "colour": ["black", "white", "bright red", "pale grey", "yellow"],
    "season": ["spring", "summer", "autumn"],
    "conflict": ["short war", "border war", "siege", "rebellion"],
    "meaning": ["ford", "meadow", "hill", "bridge", "mill"],
    "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"],
    "place": ["the harbour", "the station", "the old mill", "the bridge", "the market square", "the farm"],
    "object": ["letter", "key", "photograph", "coat", "map", "lamp"],
    "adj": ["quiet", "cold", "bright", "grey", "long", "strange", "warm"],
    "format": ["text", "XML", "JSON", "CSV"],
}

GENRES: dict[str, list[str]] = {
    "town": [
        "{Town} is a {size} town in the {region} region, on the {side} bank of the {River} river.",
        "It lies about {n2} kilometres away from {City}, the regional capital.",
        "The town has more than {pop} inhabitants.",
        "At the end of the {ordinal} century it was an important market town.",
        "Its population was actually larger then than it is today.",
        "Most of the old town was built before {year}.",
        "The railway reached {Town} in {year}, and the station is still in use.",
        "Few visitors know what the name means; it probably comes from an old word for {meaning}.",
        "The church at the end of the main street dates from {year}.",
        "Many young people moved away in the {decade}s to find work in {City}.",
        "The market is held every {weekday}, and it draws more than {n3} traders.",
        "A later version of the town charter was signed in {year3}.",
        "The local dialect is actually closer to that of {Town2} than to the speech of {City}.",
        "The river is wider here than anywhere else in the region.",
        "The nearest airport is {n2} kilometres away.",
        "What remains of the castle stands on a hill above the town.",
        "The school was built at the end of the war and was enlarged in {year3}.",
        "Winters are colder here than on the coast.",
        "The {River} river was once far more important to the town than the road.",
    ],
    "person": [
        "{Person} ({year}–{year2}) was a {job} from {Town}.",
        "{He} was born in {Town} and moved away to {City} at the age of {age}.",
        "{His} first book, {Title}, was published in {year3}.",
        "A revised version of the book appeared {n} years later.",
        "Critics were not sure what to make of it at first.",
        "By the end of {his} life {he} had written more than {n} books.",
        "{He} actually spent most of {his} career as a {job}.",
        "{His} letters show that {he} cared more about {subject} than about fame.",
        "Today {he} is remembered for {his} work on {subject}.",
        "{He} rarely spoke about what {he} had seen during the war.",
        "{He} later said that {he} learned more from {his} mother than from any teacher.",
        "At the end of {his} life {he} returned to {Town}.",
        "Some of {his} papers were given away to the town library.",
        "{His} last years were quieter than the first.",
    ],
    "software": [
        "{Prog} is a free program for {task}.",
        "The first version was written by {Person} in {year3}.",
        "Version {v} added support for {feature}.",
        "The new version was about {n} times faster than the old one.",
        "Users can choose what format to save their files in.",
        "At the end of {year3} the project moved to a new home.",
        "Older versions are still available, but they are no longer supported.",
        "The program actually started as a small script for {task}.",
        "It runs on more than {n} kinds of computers.",
        "In version {v2}, the old settings file was replaced by a simpler one in {format}.",
        "Support for version {v} will end next year.",
        "The manual explains what each option does.",
        "The file ends with a short checksum, so a broken download is easy to detect.",
        "Many users actually prefer the older interface.",
        "The {format} export is slower than the binary one.",
        "Version {v2} also dropped support for {feature}.",
        "The team gave away free licences to schools.",
    ],
    "animal": [
        "The {Animal} is a small {class} that lives in {habitat}.",
        "Adults are rarely longer than {n} centimetres.",
        "It feeds mostly on {food}, and it can travel far away from its nest to find them.",
        "When it is threatened, it runs away and hides under {cover}.",
        "Scientists are still not sure what it eats in winter.",
        "The end of the tail is {colour}.",
        "It is actually more closely related to the {Town} {class} than to other species.",
        "The young leave the nest at the end of {season}.",
        "Females are larger than males.",
        "It was first described in {year} from a single specimen.",
        "What makes it unusual is its {colour} throat.",
        "It is more common in the east than in the west.",
        "Its numbers have actually grown in the last {n} years.",
    ],
    "history": [
        "The {Event} war was a {conflict} fought between {Town} and {Town2} in {year}.",
        "More than {n3} people took part in it.",
        "At the end of the war, {Town} lost most of its land.",
        "Historians still argue about what caused it.",
        "The fighting actually lasted less than {n} weeks.",
        "A second version of the treaty was signed in {year3}.",
        "Many families moved away after the war and never came back.",
        "The army was smaller than the chronicles claim.",
        "Few records survive, so much of what we know comes from letters.",
        "The siege came to an end in the spring.",
        "The old border ran only a few miles away from the town.",
    ],
    "story": [
        "{First} stood at the end of the pier and looked out at the water.",
        "The lights of {Town} were far away.",
        "{He} did not know what to say.",
        "\"I want to know what happened,\" said {First2}.",
        "{He} turned away from the window.",
        "It was colder than {he} had expected.",
        "{He} had actually never been this far from home.",
        "At the end of the week, the letter finally came.",
        "{He} read it twice, then put it away in a drawer.",
        "There was an older version of the map in the attic.",
        "The walk to {place} took more than an hour.",
        "{First2} asked what the {object} was for.",
        "The {adj} wind blew the last leaves away.",
        "Nobody could tell {him} what the old {object} meant.",
        "{First2} was older than {he} had thought.",
        "By the end of the day they were both tired.",
        "{He} was actually glad to be home.",
        "The road ran on, further than {he} could see.",
    ],
    "howto": [
        "To keep bread fresh, wrap it in a cloth and keep it away from the sun.",
        "Measure the room before you buy more than one tin of paint.",
        "Read the label to find out what the product contains.",
        "Cut the board a little longer than you need, then sand the end.",
        "If the glue is older than a year, it may not hold.",
        "Put the tools away at the end of each job.",
        "Check which version of the form you have before you fill it in.",
        "Write down what you did, so the next person knows.",
        "It is actually easier to paint the ceiling first.",
        "A sharp knife is safer than a dull one.",
        "Keep matches away from children.",
        "The end of the cable must be clean before you connect it.",
        "Ask what the price includes before you sign.",
        "Store paint at more than five degrees.",
    ],
}


def gen_plain(rng: random.Random, genre: str | None = None) -> tuple[str, str]:
    genre = genre or rng.choice(list(GENRES))
    ctx = dict(G_FILL)
    ctx.update(_entities(rng))
    pool = GENRES[genre]
    k = rng.randint(4, min(10, len(pool)))
    first = pool[0] if genre in ("town", "person", "software", "animal", "history") else rng.choice(pool)
    rest = rng.sample([s for s in pool if s != first], k - 1)
    sents = [expand(rng, s, ctx) for s in [first] + rest]
    cut = rng.randint(2, len(sents))
    text = " ".join(sents[:cut]) + ("\n\n" + " ".join(sents[cut:]) if sents[cut:] else "")
    return genre, text


# ==========================================================================================================
# KLD domains: ops tools (shell sessions), chat JSON, prose
# ==========================================================================================================

HOSTS = ["web-1", "web-2", "db-main", "cache-3", "worker-7", "api-2", "build-4"]
SERVICES = ["nginx", "postgres", "redis", "api", "worker", "scheduler", "exporter"]


def _ops_snippet(rng: random.Random) -> tuple[str, str, str]:
    """(user request, shell transcript, one-line summary)."""
    h, s = rng.choice(HOSTS), rng.choice(SERVICES)
    kind = rng.randrange(5)
    if kind == 0:
        size, used = rng.choice([20, 50, 100, 200]), 0
        used = rng.randint(size // 5, size - 1)
        pct = round(100 * used / size)
        return (f"Check the disk usage on {h}.",
                f"$ ssh {h} df -h /var\nFilesystem      Size  Used Avail Use% Mounted on\n/dev/sda1       {size}G   {used}G   {size - used}G  {pct}% /var",
                f"/var on {h} is {pct}% full, with {size - used} GB free.")
    if kind == 1:
        state = rng.choice(["active (running)", "failed", "inactive (dead)"])
        return (f"Is {s} running on {h}?",
                f"$ ssh {h} systemctl status {s}\n● {s}.service - {s.title()} service\n   Loaded: loaded (/etc/systemd/system/{s}.service; enabled)\n   Active: {state} since Mon 2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} 0{rng.randint(0, 9)}:1{rng.randint(0, 9)}:0{rng.randint(0, 9)} UTC",
                f"{s} on {h} is {state.split()[0]}.")
    if kind == 2:
        n = rng.randint(0, 40)
        return (f"How many errors did {s} log in the last hour?",
                f"$ ssh {h} journalctl -u {s} --since '1 hour ago' | grep -c ERROR\n{n}",
                f"{s} logged {n} errors in the last hour.")
    if kind == 3:
        mem, used = rng.choice([8, 16, 32, 64]), 0
        used = rng.randint(1, mem - 1)
        return (f"How much memory is free on {h}?",
                f"$ ssh {h} free -g\n              total        used        free\nMem:           {mem}          {used}          {mem - used}",
                f"{h} has {mem - used} GB of {mem} GB free.")
    port = rng.choice([80, 443, 5432, 6379, 8080])
    ok = rng.random() < 0.7
    return (f"Can {h} reach port {port} on {rng.choice(HOSTS)}?",
            f"$ ssh {h} nc -zv -w 3 {rng.choice(HOSTS)} {port}\n" + (f"Connection to port {port} succeeded!" if ok else "nc: connect timed out"),
            f"The port is {'open' if ok else 'not reachable: the connection timed out'}.")


def gen_ops(rng: random.Random) -> list[dict]:
    req, out, summ = _ops_snippet(rng)
    cmd = out.split("\n", 1)[0][2:]
    think = f"{THINK}\n" + rng.choice(["I can answer this with one command.", "One command should be enough.",
                                      f"I will run `{cmd}` and report what it prints.", "Let me check on the server."]) \
        + f"\n{END_THINK}\n\n"
    return [{"role": "system", "content": "You are an operations assistant with shell access."},
            {"role": "user", "content": req},
            {"role": "assistant", "content": think + f"I ran this:\n\n```\n{out}\n```\n\n{summ}"}]


JSON_ITEMS = {"fruit": ["apple", "pear", "plum", "cherry", "fig", "lemon", "mango"],
              "city": ["Oslo", "Lima", "Cairo", "Perth", "Quito", "Riga", "Turin"],
              "tool": ["hammer", "saw", "drill", "wrench", "chisel", "level"],
              "colour": ["red", "blue", "green", "amber", "violet", "teal"]}


def gen_json_chat(rng: random.Random) -> list[dict]:
    cat = rng.choice(list(JSON_ITEMS))
    items = rng.sample(JSON_ITEMS[cat], rng.randint(2, 4))
    if rng.random() < 0.5:
        obj = {"category": cat, "items": items, "count": len(items)}
        ask = f"Return a JSON object with the category {cat}, the items {', '.join(items)} and their count."
    else:
        obj = [{"name": it, "rank": i + 1} for i, it in enumerate(items)]
        ask = f"Give me a JSON list ranking these: {', '.join(items)}."
    think = f"{THINK}\nThey want JSON only. I will return valid JSON.\n{END_THINK}\n\n"
    return [{"role": "system", "content": "You are an assistant that answers in JSON."},
            {"role": "user", "content": ask},
            {"role": "assistant", "content": think + "```json\n" + json.dumps(obj, indent=2) + "\n```"}]


def gen_ops_log(rng: random.Random) -> str:
    lines = []
    t = rng.randint(0, 80000)
    for _ in range(rng.randint(4, 10)):
        t += rng.randint(1, 300)
        lvl = rng.choices(["INFO", "WARN", "ERROR"], weights=[6, 2, 1])[0]
        msg = rng.choice(["worker started pid={n}", "request took {n} ms", "cache miss for key user:{n}",
                          "retrying job {n}", "connection reset by peer", "wrote {n} rows", "queue depth {n}"])
        lines.append(f"2024-05-{rng.randint(10, 28)} {t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} {lvl} "
                     f"{rng.choice(SERVICES)}: " + msg.format(n=rng.randint(1, 9999)))
    return "\n".join(lines)


# ==========================================================================================================
# hand-written documents (held-out chat and blind): other documents than training; written for the project
# ==========================================================================================================

SYS = "You are a helpful assistant."
HELDOUT_CHATS: list[list[dict]] = [
    [{"role": "system", "content": SYS},
     {"role": "user", "content": "Our nightly export job started failing last week. It writes a CSV to a shared folder and then emails it. Nothing in the code changed."},
     {"role": "assistant", "content": "The short version: if the code did not change, the environment did. Here's what I would check, in this order:\n\n1. Look at the log from the last failed run and write down exactly what the error says.\n2. Check what's actually in the shared folder. A full disk breaks the write right away.\n3. Run the job by hand as the same user the scheduler uses.\n\nI would fix the folder or the disk first rather than touching the code."},
     {"role": "user", "content": "The log says permission denied on the folder."},
     {"role": "assistant", "content": f"{THINK}\nThe error is a permission problem. Someone changed the folder owner. I should tell them to give the service user access.\n{END_THINK}\n\nThat is exactly what a changed folder owner looks like. Give the job's user write access to the folder rather than running the job as root, and the export should work right away. Then test the whole job end to end with a small file before the next nightly run."}],
    [{"role": "system", "content": SYS},
     {"role": "user", "content": "My sourdough loaves come out flat and dense. I feed the starter every day."},
     {"role": "assistant", "content": f"{THINK}\nFlat sourdough usually means a weak starter or too much water. I should suggest testing the starter and weighing the flour.\n{END_THINK}\n\nShort version: your starter is probably not strong enough when you use it. Here's what helps most people:\n\n- Use the starter at its peak, a few hours after feeding, rather than straight from the fridge.\n- Weigh the flour and water so you know exactly what goes into the dough.\n- Let the dough rise until it is clearly bigger, not just for a fixed time.\n\nYou should see a lighter crumb right away. Once one loaf works, bake the whole recipe end to end again and change one thing at a time."}],
    [{"role": "system", "content": "You are a concise technical assistant."},
     {"role": "user", "content": "The checkout page on our shop got slow after the last release. How do I find the cause?"},
     {"role": "assistant", "content": f"{THINK}\nA slow page after a release. They need to profile it and compare with the previous release.\n{END_THINK}\n\nHere's what I would do. First, measure what's actually slow: time the database queries, the calls to the payment service and the page render separately. Then compare the same numbers on the previous release rather than guessing.\n\nIf one query is much slower, that is exactly what a missing index looks like. Add the index, deploy it to staging, and test the checkout end to end. You will usually see the difference right away."}],
    [{"role": "system", "content": SYS},
     {"role": "user", "content": "I keep getting yellow leaves on my tomato plants. They are in pots on a balcony."},
     {"role": "assistant", "content": f"{THINK}\nYellow leaves on potted tomatoes: overwatering, poor drainage or lack of feed. I should ask how often they water.\n{END_THINK}\n\nThe short version is that potted tomatoes are usually either too wet or hungry. Check what's actually happening in the soil: push a finger in and feel how wet it is. Water deeply twice a week rather than a little every day, and feed them once a week. Remove the yellow leaves right away so the plant does not waste energy on them. Here's what else to check: the holes at the bottom of the pots. Tell me exactly what the leaves look like if it does not improve."}],
    [{"role": "system", "content": "You are an assistant that gives practical advice."},
     {"role": "user", "content": "I have to give a five minute talk at work next week and I always run over time."},
     {"role": "assistant", "content": f"{THINK}\nThey run over time in talks. They need a shorter script and a rehearsal with a timer.\n{END_THINK}\n\nThe short version: write less and practise with a timer. Here's what works for most people:\n\n1. Decide exactly what the one main point is and say it in the first minute.\n2. Cut every slide that does not support that point, rather than speaking faster.\n3. Rehearse the talk end to end twice with a timer, and note what's actually taking the time.\n\nYou will notice the improvement right away."}],
    [{"role": "system", "content": SYS},
     {"role": "user", "content": "Should we test our new API with mocks or against a real database?"},
     {"role": "assistant", "content": f"{THINK}\nThey ask about mocks versus a real database for API tests. A real database catches more bugs.\n{END_THINK}\n\nI would use a real database rather than a mock for most of these tests. Mocks only check exactly what you told them to expect, so they miss what's actually going on in the queries. Here's what a good setup looks like: start a small database in a container, load a few rows, and run each request end to end. You can start right away with the endpoints that change most often."}],
]

BLIND_CHAT: list[dict] = [
    {"role": "system", "content": "You are a friendly assistant. Answer clearly."},
    {"role": "user", "content": "We are moving our small office from paper invoices to an online system. Where do we begin?"},
    {"role": "assistant", "content": "The short version: start small and keep the paper process running for one month. Here's what I would do first: pick one supplier and send all of its invoices through the new system. Write down exactly what breaks. I would choose a simple tool rather than the biggest package on the market, and you can start right away."},
    {"role": "user", "content": "Our accountant worries that we will lose invoices during the switch."},
    {"role": "assistant", "content": "That is a fair worry. Rather than switching everything on one day, run both systems side by side and compare them at the end of each week. Check what's actually in the new system against the paper pile. Here's what usually goes wrong: invoices that arrive by post are never scanned. Test the whole flow end to end with ten real invoices, and fix any gap right away."},
    {"role": "user", "content": "OK. And how do we know when it is safe to stop the paper process?"},
    {"role": "assistant", "content": f"{THINK}\nThey want a rule for when to stop the paper process. A month with no missing invoices is a good rule. I should keep it short.\n{END_THINK}\n\nShort version: when a full month matches. Once the totals agree for four weeks, the new system is doing exactly what you need. Keep scanning the paper invoices rather than filing them, and look at what's actually left in the old folder. If the month closes end to end without a missing invoice, switch off the paper process. Here's what to tell your accountant: you tested it end to end and checked what's actually missing. Your accountant will see the difference right away. The short version of the rule: four clean weeks, then stop. Tell me exactly what your accountant thinks."},
]


# ==========================================================================================================
# checks: banned phrases and ordinary uses in text
# ==========================================================================================================

_BANNED_RE = re.compile(r"(?i)(?<![A-Za-z])(" + "|".join(re.escape(p) for p in BANNED) + r")(?![A-Za-z])")
# the banned prefixes that must not precede an ordinary use: word -> preceding words that would make it banned
_BANNED_PREV = {"than": ("rather",), "what": ("here's", "exactly"), "end": ("to",), "away": ("right",),
                "version": ("short",), "actually": ("what's",)}
_WORD_RE = re.compile(r"(?<=[ ])(than|what|end|away|version|actually)(?![A-Za-z'])")


def count_banned(text: str) -> dict[str, int]:
    out = {p: 0 for p in BANNED}
    for m in _BANNED_RE.finditer(text):
        out[m.group(1).lower()] += 1
    return out


def count_ordinary(text: str) -> dict[str, int]:
    """Ordinary uses: ' word' (lowercase, space before) outside any banned phrase and not after its banned
    prefix."""
    out = {w: 0 for w in COLLATERAL_WORDS}
    text = _BANNED_RE.sub(lambda m: "#" * len(m.group(0)), text)  # words of a banned phrase are not ordinary
    for m in _WORD_RE.finditer(text):
        w = m.group(1)
        prev = text[:m.start()].rstrip().rsplit(None, 1)
        prev_w = prev[-1].lower() if prev else ""
        if w == "end" and text[:m.start()].lower().endswith("end to "):
            continue
        if w != "end" and prev_w in _BANNED_PREV[w]:
            continue
        out[w] += 1
    return out


_SENT_SPLIT = re.compile(r"(?<=[.!?:])\s+|\n+|<\|im_start\|>|<\|im_end\|>|</?think>")


def long_sentences(text: str, min_words: int = 8) -> set[str]:
    out = set()
    for s in _SENT_SPLIT.split(text):
        s = s.strip().lstrip("-0123456789. ").strip()
        if len(s.split()) >= min_words:
            out.add(s)
    return out


HANDWRITTEN = ("heldout_chat", "blind_chat")


def paragraphs(text: str, min_words: int = 15) -> set[str]:
    """Paragraphs (blank-line separated; chat markup and think blocks split too) of >= min_words words."""
    parts = re.split(r"\n\s*\n|<\|im_start\|>|<\|im_end\|>|</?think>", text)
    return {p.strip() for p in parts if len(p.split()) >= min_words}


def doc_text(doc: dict) -> str:
    return render_chat(doc["messages"]) if "messages" in doc else doc["text"]


# ==========================================================================================================
# building the sets
# ==========================================================================================================


def build_eval_docs(seed: int) -> dict[str, list[dict]]:
    """The documents `l47 demo` dumps; generated from their own seed streams (fresh named entities)."""
    r = lambda name: random.Random(f"{seed}:{name}")  # noqa: E731  independent, named streams
    out: dict[str, list[dict]] = {}

    # prompts.jsonl: scripts/make_demo_prompts.py (the "prompts" stream, kept where the model's answers cover
    # every phrase)

    out["heldout_chat"] = [{"id": f"heldout-{i:02d}", "messages": m} for i, m in enumerate(HELDOUT_CHATS)]
    out["blind_chat"] = [{"id": "blind-00", "messages": BLIND_CHAT}]

    rc = r("collateral")
    coll, counts = [], {w: 0 for w in COLLATERAL_WORDS}
    while min(counts.values()) < 40 or len(coll) < 30:
        _, text = gen_plain(rc, rc.choice([g for g in GENRES if g != "howto"]))
        if any(count_banned(text).values()):
            continue
        for w, c in count_ordinary(text).items():
            counts[w] += c
        coll.append({"id": f"collateral-{len(coll):03d}", "text": text})
    out["collateral"] = coll

    rb = r("background")
    bg = []
    for i in range(24):
        if i % 2 == 0:
            bg.append({"id": f"background-{i:02d}", "text": gen_plain(rb)[1]})
        else:
            bg.append({"id": f"background-{i:02d}", "messages": gen_chat(rb, slop=False, max_turns=2)})
    out["background"] = bg

    rk = r("kld")
    out["kld_ops_tools"] = [{"id": f"kld-ops-{i:02d}", "messages": gen_ops(rk)} for i in range(8)]
    out["kld_chat_json"] = [{"id": f"kld-json-{i:02d}", "messages": gen_json_chat(rk)} for i in range(8)]
    out["kld_prose"] = [{"id": f"kld-prose-{i:02d}", "text": gen_plain(rk, "story")[1]} for i in range(8)]
    return out


def gen_train_doc(rng: random.Random) -> tuple[str, str]:
    """(kind, rendered text) of one training document."""
    u = rng.random()
    if u < 0.30:
        return "chat", render_chat(gen_chat(rng, slop=True, slop_rate=rng.choice([0.3, 0.5, 0.7])))
    if u < 0.35:
        return "chat_plain", render_chat(gen_chat(rng, slop=False))
    if u < 0.85:
        genre, text = gen_plain(rng)
        return f"plain_{genre}", text
    if u < 0.92:
        return "ops_tools", render_chat(gen_ops(rng)) if rng.random() < 0.7 else gen_ops_log(rng)
    return "chat_json", render_chat(gen_json_chat(rng))


def build_train(seed: int, n_chars: int, forbidden: set[str], forbidden_paras: set[str]) -> tuple[list[dict], int]:
    """Training documents up to n_chars; a document sharing a sentence of a hand-written evaluation document or a
    paragraph of any evaluation document is rejected (counted)."""
    rng = random.Random(f"{seed}:train")
    docs, total, rejected = [], 0, 0
    while total < n_chars:
        kind, text = gen_train_doc(rng)
        if long_sentences(text) & forbidden or paragraphs(text) & forbidden_paras:
            rejected += 1
            continue
        docs.append({"id": f"train-{len(docs):06d}", "kind": kind, "text": text})
        total += len(text)
    return docs, rejected


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Atomic write (temp file in the same directory + os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/l47_demo_corpus", help="folder for train.jsonl and manifest.json")
    ap.add_argument("--data-dir", default=str(DEMO_DATA), help="folder for the committed evaluation documents")
    ap.add_argument("--chars", type=int, default=12_000_000, help="characters of training text")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    ev = build_eval_docs(a.seed)
    # the hand-written documents' sentences never occur in training; generated ones differ as whole documents
    # and paragraphs (fresh entities), checked below — generic template sentences are shared, as in real text
    forbidden: set[str] = set()
    for name in HANDWRITTEN:
        for d in ev[name]:
            forbidden |= long_sentences(doc_text(d))
    forbidden_paras = {p for rows in ev.values() for d in rows for p in paragraphs(doc_text(d))}
    train, rejected = build_train(a.seed, a.chars, forbidden, forbidden_paras)

    train_paras = {p for d in train for p in paragraphs(d["text"])}
    for name, rows in ev.items():
        for d in rows:
            clash = paragraphs(doc_text(d)) & train_paras
            if clash:
                raise SystemExit(f"{name}/{d['id']}: paragraph found verbatim in the training corpus: "
                                 f"{sorted(clash)[0][:80]!r}")

    data_dir = Path(a.data_dir)
    for name, rows in ev.items():
        _write_jsonl(data_dir / f"{name}.jsonl", rows)
    out = Path(a.out)
    _write_jsonl(out / "train.jsonl", train)

    def stats(rows, f):
        tot: dict[str, int] = {}
        for d in rows:
            for k, v in f(doc_text(d) if "kind" not in d else d["text"]).items():
                tot[k] = tot.get(k, 0) + v
        return tot

    def assistant_text(rows):
        return "\n".join(m["content"] for d in rows for m in d.get("messages", []) if m["role"] == "assistant")

    kinds: dict[str, int] = {}
    for d in train:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + len(d["text"])
    manifest = {
        "seed": a.seed, "chars": sum(len(d["text"]) for d in train), "documents": len(train),
        "rejected_for_heldout_overlap": rejected, "chars_by_kind": kinds,
        "train_banned_counts": stats(train, count_banned), "train_ordinary_counts": stats(train, count_ordinary),
        "eval": {name: {"documents": len(rows), "banned": stats(rows, count_banned),
                        "ordinary": stats(rows, count_ordinary)} for name, rows in ev.items()},
        "heldout_assistant_banned": count_banned(assistant_text(ev["heldout_chat"])),
        "blind_assistant_banned": count_banned(assistant_text(ev["blind_chat"])),
        "train_sha256": hashlib.sha256((out / "train.jsonl").read_bytes()).hexdigest(),
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    json.dump({k: manifest[k] for k in ("chars", "documents", "rejected_for_heldout_overlap",
                                         "heldout_assistant_banned", "blind_assistant_banned", "train_sha256")},
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
