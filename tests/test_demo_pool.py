"""The demo's written pool chats (l47/demo_data/pool_chat.jsonl, scripts/make_demo_pool.py): regenerated from
their seed stream (the committed file is the stream minus the candidates that overlapped the training corpus,
ids = candidate numbers), and enough events for every phrase — counted here by regex on the assistant turns."""

from __future__ import annotations

import json
import sys
from itertools import islice
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def test_pool_regenerates_and_covers_every_phrase():
    import make_demo_corpus as mc
    import make_demo_pool as mp

    rows = [json.loads(x) for x in (mc.DEMO_DATA / "pool_chat.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == mp.N_CHATS
    last = int(rows[-1]["id"].split("-")[1])
    cand = {d["id"]: d for d in islice(mp.candidates(0), last + 1)}
    for r in rows:
        assert json.loads(json.dumps(cand[r["id"]])) == r, r["id"]  # byte-identical to its candidate
    text = "\n".join(m["content"] for d in rows for m in d["messages"] if m["role"] == "assistant")
    counts = mc.count_banned(text)
    # >= 10 train and >= 10 held-out events per phrase need >= ~29 events at the 0.55 / 0.35 split fractions
    assert min(counts.values()) >= 30, counts
