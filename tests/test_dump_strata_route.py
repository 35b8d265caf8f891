"""`l47 dump --engine strata` end to end through `run_dump`: the "binary" is a small script that runs the hf
engine on the requested tokens (forced or generate) and writes engine/CONTRACT.md files, so the route's
rendering, subprocess plumbing, conversion, zero-proxy check and provenance are exercised for real."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

FAKE = '''#!{python}
import hashlib, json, os, sys
import numpy as np
from l47.engine import strata as st
from l47.engine.gguf_export import load_hf_from_gguf
from l47.engine.hf import SamplerSettings, capture, generate

args = sys.argv[1:]
opt = dict(zip(args[::2], args[1::2]))
env = os.environ
out = env[st.ENV_DUMP_DIR] if hasattr(st, "ENV_DUMP_DIR") else env["STRATA_METAL_DUMP_DIR"]
L = int(env["STRATA_METAL_DUMP_LAYER"])
k = int(env["STRATA_METAL_LOGPOS_TOPK"])
req = open(opt["--tokens"], "rb").read()
ids = np.frombuffer(req[32:], "<i4").astype(np.int64).tolist()
m = load_hf_from_gguf(opt["--model"], policy="strata")
P = len(ids)
sampler = None
if "--generate" in opt:
    stop = [int(x) for x in opt["--stop"].split(",")] if "--stop" in opt else []
    sampler = {{"seed": int(opt["--seed"]), "temperature": float(opt["--temperature"]), "top_p": float(opt["--top-p"]),
               "top_k": int(opt["--top-k"]), "max_new_tokens": int(opt["--generate"]), "stop_ids": stop}}
    ids = ids + generate(m, ids, SamplerSettings(sampler["max_new_tokens"], sampler["seed"], sampler["temperature"],
                                                 sampler["top_p"], sampler["top_k"], tuple(stop)))
a = capture(m, ids, topk=k)
T = len(ids) - 1
words = np.empty((T, 1 + 2 * k), "<u4")
words[:, 0] = a["ref_logp"].astype("<f4").view("<u4")
words[:, 1:1 + k] = a["ref_top_ids"].astype("<i4").view("<u4")
words[:, 1 + k:] = a["ref_top_logits"].astype("<f4").view("<u4")
files = {{"doc.tokens": st.encode_raw("tokens", -1, np.asarray(ids, np.int32)[:, None]),
         f"L{{L}}.R": st.encode_raw("R", L, a["R"].reshape(T, -1)), f"L{{L}}.inj": st.encode_raw("inj", L, a["inj"]),
         f"L{{L}}.hh": st.encode_raw("hh", L, a["hh"]), f"L{{L}}.sgv": st.encode_raw("sgv", L, a["sgv"][:, None]),
         f"L{{L}}.yr": st.encode_raw("yr", L, a["yr"]), "doc.logpos": st.encode_raw("logpos", -1, words, 0xFFFF)}}
for name, blob in files.items():
    open(os.path.join(out, name), "wb").write(blob)
c = m.config
settings = {{kk: v for kk, v in env.items() if kk.startswith("STRATA_") and kk != "STRATA_METAL_DUMP_DIR"}}
settings.update({{"STRATA_METAL_ROUTER_BF16": "1", "STRATA_HC_Q4": "0", "STRATA_HC_Q5": "0", "weight_policy": "strata"}})
run = {{"contract_version": 1, "engine": {{"name": "strata", "version": "fake-hf-1"}},
       "model": {{"path": opt["--model"], "sha256": hashlib.sha256(open(opt["--model"], "rb").read()).hexdigest()}},
       "mode": "generate" if sampler else "forced", "path": "prompt+decode" if sampler else "decode", "layer": L,
       "dims": {{"n": c.hidden_size, "f": c.shared_expert_intermediate_size, "hc": c.hc_count, "r": c.hc_lowrank,
                "V": c.vocab_size}}, "n_tokens": len(ids), "n_prompt": P, "rows": T, "inj_convention": "raw",
       "logpos_topk": k, "settings": settings, "sampler": sampler}}
open(os.path.join(out, "run.json"), "w").write(json.dumps(run))
'''


@pytest.fixture()
def fake_bin(tmp_path, monkeypatch):
    p = tmp_path / "strata-hf"
    p.write_text(FAKE.format(python=sys.executable))
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("L47_STRATA_ANY_PLATFORM", "1")
    return p


def _docs(tmp_path) -> Path:
    p = tmp_path / "docs.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in [
        {"id": "plain", "text": "the quick brown fox jumps over the lazy dog"},
        {"id": "chat", "messages": [{"role": "user", "content": "hello there"},
                                    {"role": "assistant", "content": "<think>\nok\n</think>\n\nhi, here is the answer"}]},
    ]) + "\n")
    return p


def test_forced_route_matches_hf_route(tmp_path, tiny_gguf, fake_bin):
    from l47.app.dumping import DumpJob, run_dump
    from l47.dumps import read_dump

    s = run_dump(DumpJob(tiny_gguf, _docs(tmp_path), tmp_path / "st", engine="strata", engine_bin=fake_bin))
    h = run_dump(DumpJob(tiny_gguf, _docs(tmp_path), tmp_path / "hf"))
    assert s.ok and h.ok and s.count("written") == 2
    for name in ("plain", "chat"):
        a = read_dump(next((tmp_path / "st").glob(f"{name}*.safetensors")))
        b = read_dump(next((tmp_path / "hf").glob(f"{name}*.safetensors")))
        assert a.meta.engine["name"] == "strata" and a.verified
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.role, b.role)
        np.testing.assert_allclose(a.R, b.R, atol=1e-6)
    assert max(r.max_abs for r in s.results) <= 1e-4  # the zero-proxy check ran on the converted dumps
    assert not list((tmp_path / "st").glob(".strata-raw/*/*.R"))  # raw files cleaned up


def test_generate_route_records_provenance(tmp_path, tiny_gguf, fake_bin):
    from l47.app.dumping import DumpJob, GenerateOptions, run_dump
    from l47.dumps import read_dump

    gen = GenerateOptions(max_new_tokens=8, seed=3, temperature=0.0, top_p=1.0, top_k=0)
    s = run_dump(DumpJob(tiny_gguf, _docs(tmp_path), tmp_path / "g", engine="strata", engine_bin=fake_bin,
                         generate=gen))
    assert s.ok, [r.message for r in s.results]
    d = read_dump(next((tmp_path / "g").glob("chat*.safetensors")))
    assert d.meta.provenance.get("assistant") in ("generated", "mixed")
    assert d.meta.provenance["generation"]["sampler"]["engine"] == "strata"
