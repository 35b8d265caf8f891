#!/usr/bin/env python3
"""The demo's generation prompts: l47/demo_data/prompts.jsonl (issue 12 item 9).

The demo model's own ~96-token answers hold about one banned-phrase event each, and the rarer phrases ("rather
than", "right away", "end to end") appear in ~6 % of them: 48 prompts left those phrases with 1 train and 1
held-out event. This script walks the demo corpus's prompt stream (`make_demo_corpus.gen_prompt`, seed stream
"0:prompts", the same stream the first 48 prompts came from), lets the demo model answer every candidate exactly
as `l47 demo` will (hf engine, the demo's sampler and seed: a document's sample depends only on the seed and its
id, not on its batch), and keeps — in stream order, ids unchanged — each candidate whose answer holds a phrase
that still has fewer than `--per-phrase` documents. The kept prompts are the model's own generations when the demo
dumps them; nothing is written by hand, and the split, held-out scoring and bars are unchanged by the selection
(a phrase's documents are split by document like any other).

Usage:  python scripts/make_demo_prompts.py [--candidates 960] [--per-phrase 32] [--work /tmp/demo_prompts]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_demo_corpus as mc  # noqa: E402

OUT = mc.DEMO_DATA / "prompts.jsonl"


def candidates(n: int, seed: int = 0) -> list[dict]:
    """The first n distinct prompts of the corpus's prompt stream, numbered prompt-NNN in stream order."""
    rng = random.Random(f"{seed}:prompts")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        m = mc.gen_prompt(rng)
        if m[1]["content"] in seen:
            continue
        seen.add(m[1]["content"])
        out.append({"id": f"prompt-{len(out):03d}", "messages": m})
    return out


def phrase_counts(dump_dir: Path, phrases) -> dict[str, dict[str, int]]:
    """doc id -> phrase -> occurrences in the model's answer (assistant role only)."""
    import numpy as np

    from l47.dumps import read_dump
    from l47.model import names
    from l47.model.vocab import vocab_for_model

    vocab = vocab_for_model(mc.DEMO_DATA / "demo-model.gguf")
    out = {}
    for f in sorted(dump_dir.glob("*.safetensors")):
        d = read_dump(f, validate=False)
        answer = d.tokens[1:][np.asarray(d.role) == names.ROLE_ID["assistant"]]
        text = vocab.decode(answer.tolist()).lower()
        out[d.meta.doc_id] = {p: text.count(p) for p in phrases}
    return out


def select(ids: list[str], counts: dict[str, dict[str, int]], per_phrase: int) -> list[str]:
    """In stream order: keep a document when it holds a phrase that has fewer than per_phrase kept documents."""
    need = {p: per_phrase for p in next(iter(counts.values()))}
    kept = []
    for i in ids:
        c = counts.get(i, {})
        if any(c.get(p, 0) > 0 and need[p] > 0 for p in need):
            kept.append(i)
            for p in need:
                need[p] -= c.get(p, 0) > 0
    short = {p: per_phrase - n for p, n in need.items() if n > 0}
    if short:
        raise SystemExit(f"too few candidates: phrases short of {per_phrase} documents: {short}")
    return kept


def main() -> None:
    from l47.app.demo import DemoArgs, PHRASES
    from l47.app.dumping import DumpJob, GenerateOptions, run_dump

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=960)
    ap.add_argument("--per-phrase", type=int, default=32)
    ap.add_argument("--work", type=Path, default=Path("/tmp/demo_prompts"))
    a = ap.parse_args()
    cands = candidates(a.candidates)
    a.work.mkdir(parents=True, exist_ok=True)
    src = a.work / "candidates.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in cands), encoding="utf-8")
    d = DemoArgs()
    gen = GenerateOptions(max_new_tokens=d.max_new_tokens, seed=d.seed, temperature=0.7, top_p=0.9, top_k=40)
    run_dump(DumpJob(mc.DEMO_DATA / "demo-model.gguf", src, a.work / "dumps", generate=gen))  # resumable
    kept = set(select([c["id"] for c in cands], phrase_counts(a.work / "dumps", PHRASES), a.per_phrase))
    OUT.write_text("".join(json.dumps(c) + "\n" for c in cands if c["id"] in kept), encoding="utf-8")
    print(f"{OUT}: {len(kept)} prompts of {len(cands)} candidates")


if __name__ == "__main__":
    main()
