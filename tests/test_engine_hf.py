"""The `hf` engine: whole-model GGUF export/import, capture at layer L, seeded generation, and `l47 dump` end to end
with the zero-proxy check, on the tiny random transformers Qwen4Exp (CPU).

References and tolerances:
- GGUF bytes: Q8_0 / BF16 against gguf.quants (ggml's reference rules; bit-exact), dequantised values against
  gguf.quants' decoders (bit-exact), the "strata" policy's BF16 -> Q8_0 -> f32 re-derived with gguf.quants.
- capture: the layer's FFN half re-derived in float64 numpy from the captured R and the layer's parameters
  (hc_norm (1 + w), the mixer, router top-2, experts, shared expert): f32 vs f64 on O(1–10) values, rtol 1e-4.
- zero-proxy: the exact tail forward vs the engine's own log p(next): ≤ 1e-4 nats (the issue's bar for f32).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from l47.model import names
from l47.engine import hf as eng
from l47.engine.gguf_export import export_gguf, load_hf, load_hf_from_gguf
from l47.errors import L47Error
from l47.model.gguf_io import open_gguf
from l47.tail import forward

TOL = 1e-4  # nats: zero-proxy bar for the f32 engine
LAST = 2  # tiny model: 3 layers


def _ids(n: int, seed: int = 1, V: int = 1024) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _param(model, hf_name: str) -> torch.Tensor:
    return model.state_dict()[hf_name]


# ----------------------------------------------------------------------------------------------------------
# export / load


def test_export_types_bytes_and_metadata(tiny_gguf, tiny_hf_model):
    m = tiny_hf_model(0)
    g = open_gguf(tiny_gguf)
    t = {k: v.type_name for k, v in g.tensors.items()}
    for L in range(3):
        assert t[f"blk.{L}.ffn_down_shexp.weight"] == "Q8_0"
        assert t[f"blk.{L}.hc_ffn_inject.weight"] == "BF16" and t[f"blk.{L}.hc_attn_down.weight"] == "BF16"
        assert t[f"blk.{L}.hc_ffn_norm.weight"] == "F32"
    assert t["output.weight"] == "Q6_K"  # n = 256 is a multiple of 256
    assert t["output_hc_up.weight"] == "BF16" and t["output_hc_norm.weight"] == "F32"
    assert t["token_embd.weight"] == "F32" and t["blk.2.ffn_gate_up_exps.weight"] == "F32"
    assert len(g.tensors) == len(m.state_dict())
    # Q8_0 and BF16 bytes are exactly ggml's reference quantisation of the HF weights
    W = _param(m, names.hf_name(names.FFN_DOWN_SHEXP, LAST)).numpy()
    assert np.array_equal(g.raw("blk.2.ffn_down_shexp.weight").reshape(-1), gq.quantize(W, QT.Q8_0).reshape(-1))
    U = _param(m, names.OUTPUT_HC_UP.hf).numpy()
    assert np.array_equal(g.raw("output_hc_up.weight").reshape(-1).view(np.uint8),
                          gq.quantize(U, QT.BF16).reshape(-1).view(np.uint8))
    # norms stored folded: 1 + w in f32
    w = _param(m, names.OUTPUT_HC_NORM.hf).numpy()
    assert np.array_equal(g.tensor("output_hc_norm.weight").numpy(), np.float32(1) + w)
    assert np.abs(w).mean() > 0.1  # perturbed, so folding matters
    # Q6_K head: valid blocks whose values are close to the weights (a 6-bit code: ≤ ~3% of the row max)
    head = _param(m, "lm_head.weight").numpy()
    deq = gq.dequantize(g.raw("output.weight"), QT.Q6_K).reshape(head.shape)
    assert np.abs(deq - head).max() <= 0.03 * np.abs(head).max()
    # metadata
    kv = g.kv
    assert kv[names.KEY_ARCH] == names.ARCH
    for k, v in ((names.K_BLOCK_COUNT, 3), (names.K_EMBED, 256), (names.K_SHEXP_FF, 64), (names.K_HC_COUNT, 4),
                 (names.K_HC_LOWRANK, 32), (names.K_VOCAB, 1024)):
        assert kv[names.key(k)] == v
    assert json.loads(kv[names.K_HF_CONFIG])["hidden_size"] == 256
    assert kv[names.K_TOK_PRE] == "qwen35" and len(kv[names.K_TOK_TOKENS]) == 1024


@pytest.mark.parametrize("policy", ["exact", "strata"])
def test_loaded_parameters_equal_dequantised_gguf(tiny_gguf, policy):
    """Every parameter of the rebuilt model equals the GGUF tensor dequantised by gguf.quants (an independent
    decoder), through BF16 -> Q8_0 -> f32 for hc_* under "strata", minus 1 for the folded norms — bit for bit."""
    g = open_gguf(tiny_gguf)
    m = load_hf_from_gguf(tiny_gguf, policy=policy)
    table = names.hf_to_gguf_map(3)
    sd = m.state_dict()
    n_hc = 0
    for hf_name, p in sd.items():
        gname = table[hf_name]
        ti = g.info(gname)
        ref = gq.dequantize(np.asarray(g.raw(gname)), QT(ti.ggml_type)).astype(np.float32).reshape(p.shape)
        if policy == "strata" and ti.type_name == "BF16":
            ref = gq.dequantize(gq.quantize(ref.reshape(-1, ref.shape[-1]), QT.Q8_0), QT.Q8_0).reshape(p.shape)
            n_hc += 1
        if names.is_folded_norm(gname):
            ref = ref - np.float32(1)
        assert p.dtype == torch.float32
        assert np.array_equal(p.numpy(), ref), hf_name
    assert policy == "exact" or n_hc == 3 * 6 + 2  # 6 hc matrices per layer + output_hc_down/up


def test_f32_export_round_trips_the_model(tmp_path, tiny_hf_model):
    """All-F32 export -> load: identical parameters (norms up to the f32 rounding of (1 + w) − 1) and logits."""
    m = tiny_hf_model(0)
    table = names.hf_to_gguf_map(3)
    names_all = {table[k] for k in m.state_dict()}
    p = export_gguf(m, tmp_path / "f32.gguf", tokenizer_kv=None, types={n: "F32" for n in names_all})
    m2 = load_hf_from_gguf(p, policy="strata")  # nothing is BF16, so the policy changes nothing
    for k, v in m.state_dict().items():
        v2 = m2.state_dict()[k]
        if "hc_norm" in k:  # stored 1 + w; (1 + w) − 1 is exact in f32 where 1 + w ∈ [0.5, 2] (Sterbenz)
            assert torch.equal(1.0 + v2, 1.0 + v) or (v2 - v).abs().max() <= 1e-7, k
        else:
            assert torch.equal(v, v2), k
    ids = torch.tensor([_ids(24)])
    with torch.no_grad():
        a, b = m(ids).logits, m2(ids).logits
    assert (a - b).abs().max() <= 1e-5


def test_load_refuses_foreign_or_incomplete_gguf(tmp_path, tiny_gguf):
    from l47.model.gguf_io import write_gguf

    g = open_gguf(tiny_gguf)
    kv = {k: v for k, v in g.kv.items() if k != names.K_HF_CONFIG}
    kvt = {k: g.kv_types[k] for k in kv}
    tensors = [(n, ti.ggml_type, ti.shape, np.asarray(g.raw(n))) for n, ti in g.tensors.items()]
    write_gguf(tmp_path / "noconf.gguf", kv, kvt, tensors, kv_item_types=g.kv_item_types)
    with pytest.raises(L47Error, match=names.K_HF_CONFIG):
        load_hf_from_gguf(tmp_path / "noconf.gguf")
    kv2 = dict(g.kv)
    write_gguf(tmp_path / "extra.gguf", kv2, dict(g.kv_types),
               tensors + [("blk.0.mystery.weight", 0, (4,), np.zeros(4, np.float32))], kv_item_types=g.kv_item_types)
    with pytest.raises(L47Error, match="mystery"):
        load_hf_from_gguf(tmp_path / "extra.gguf")
    write_gguf(tmp_path / "missing.gguf", kv2, dict(g.kv_types), tensors[1:], kv_item_types=g.kv_item_types)
    with pytest.raises(L47Error, match="missing"):
        load_hf_from_gguf(tmp_path / "missing.gguf")


def test_load_hf_checkpoint_dir(tmp_path, tiny_hf_model):
    m = tiny_hf_model(0)
    m.save_pretrained(tmp_path / "ckpt")
    m2 = load_hf(tmp_path / "ckpt")
    ids = torch.tensor([_ids(16)])
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)
    mid = eng.model_id(tmp_path / "ckpt")
    assert mid.startswith("hf:") and mid == eng.model_id(tmp_path / "ckpt")
    with pytest.raises(L47Error, match="config.json"):
        load_hf(tmp_path)


def test_run_dump_from_checkpoint_dir(tmp_path, tiny_hf_model, tiny_vocab):
    """The engine on a transformers checkpoint: tail weights straight from the model, model id "hf:…"."""
    from l47.app.dumping import DumpJob, run_dump
    from l47.dumps import read_dump

    tiny_hf_model(0).save_pretrained(tmp_path / "ckpt")
    s = run_dump(DumpJob(tmp_path / "ckpt", _docs(tmp_path, "plain"), tmp_path / "out", vocab=tiny_vocab))
    assert [r.status for r in s.results] == ["written"] and s.results[0].max_abs <= TOL
    d = read_dump(s.results[0].path)
    assert d.meta.model == eng.model_id(tmp_path / "ckpt") and d.meta.model.startswith("hf:")
    assert d.meta.engine["settings"]["weights"] == "hf-checkpoint"


# ----------------------------------------------------------------------------------------------------------
# capture


def _ffn_reference_f64(model, L: int, R: np.ndarray) -> dict[str, np.ndarray]:
    """Layer L's FFN half from R [T, hc, n] in float64 numpy, straight from the parameters (DESIGN §1)."""
    c = model.config
    hc, n, eps = c.hc_count, c.hidden_size, c.rms_norm_eps
    P = {k: v.double().numpy() for k, v in model.model.layers[L].state_dict().items()}
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    silu = lambda x: x * sig(x)  # noqa: E731
    T = R.shape[0]
    R = R.astype(np.float64)
    w = 1 + P["mlp_hyper_connection.hc_norm.weight"].reshape(hc, n)
    xn = R / np.sqrt((R ** 2).mean(-1, keepdims=True) + eps) * w  # [T, hc, n]
    flat = xn.reshape(T, hc * n)  # stream-major
    inj = flat @ P["mlp_hyper_connection.block_inject_weight.weight"].T  # [T, hc] raw
    lo = silu(flat @ P["mlp_hyper_connection.input_mix_weight_down.weight"].T / hc)
    gate = sig(lo @ P["mlp_hyper_connection.input_mix_weight_up.weight"].T).reshape(T, hc, n)
    XF = (gate * xn).mean(1)  # [T, n]
    hh = silu(XF @ P["mlp.shared_expert.gate_proj.weight"].T) * (XF @ P["mlp.shared_expert.up_proj.weight"].T)
    sgv = XF @ P["mlp.shared_expert_gate.weight"][0]
    z = XF @ P["mlp.gate.weight"].T  # [T, E] router
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, 1, kind="stable")[:, : c.num_experts_per_tok]
    yr = np.zeros((T, n))
    gu, dn = P["mlp.experts.gate_up_proj"], P["mlp.experts.down_proj"]
    fi = c.moe_intermediate_size
    for t in range(T):
        wts = p[t, top[t]] / p[t, top[t]].sum()
        for e, wt in zip(top[t], wts):
            a = gu[e] @ XF[t]
            yr[t] += wt * (dn[e] @ (silu(a[:fi]) * a[fi:]))
    return {"inj": inj, "hh": hh, "sgv": sgv, "yr": yr}


def test_capture_shapes_dtypes_and_f64_rederivation(tiny_hf_model):
    m = tiny_hf_model(0)
    ids = _ids(33)
    a = eng.capture(m, ids, ref_logits=True)
    T = 32
    want = {"tokens": ((T + 1,), np.int32), "R": ((T, 4, 256), np.float32), "inj": ((T, 4), np.float32),
            "hh": ((T, 64), np.float32), "sgv": ((T,), np.float32), "yr": ((T, 256), np.float32),
            "ref_logp": ((T,), np.float32), "ref_top_ids": ((T, 8), np.int32),
            "ref_top_logits": ((T, 8), np.float32), "ref_logits": ((T, 1024), np.float16)}
    assert set(a) == set(want)
    for k, (shape, dt) in want.items():
        assert a[k].shape == shape and a[k].dtype == dt, k
    assert a["tokens"].tolist() == ids
    ref = _ffn_reference_f64(m, LAST, a["R"])
    for k in ("inj", "hh", "sgv", "yr"):
        scale = np.abs(ref[k]).max()
        assert np.abs(a[k] - ref[k]).max() <= 1e-4 * max(scale, 1.0), k
    assert np.abs(a["inj"]).mean() > 4  # |inj| ≫ 4: the /hc convention is exercised
    # reference statistics against the model's own logits (f64 log-softmax)
    with torch.no_grad():
        z = m(torch.tensor([ids])).logits[0, :T].double()
    lsm = torch.log_softmax(z, -1)
    assert np.abs(a["ref_logp"] - lsm[torch.arange(T), torch.tensor(ids[1:])].numpy()).max() <= 1e-6
    assert np.array_equal(a["ref_top_ids"], torch.topk(z.float(), 8).indices.numpy())
    assert np.array_equal(a["ref_logits"], z.float().half().numpy())


def test_capture_other_layer_and_bad_ids(tiny_hf_model):
    m = tiny_hf_model(0)
    a = eng.capture(m, _ids(9), layer=1)
    assert np.abs(a["R"] - eng.capture(m, _ids(9))["R"]).max() > 1e-3  # really another layer
    with pytest.raises(L47Error, match="layer"):
        eng.capture(m, _ids(9), layer=3)
    with pytest.raises(L47Error, match=r"token ids\[2\]"):
        eng.capture(m, [1, 2, 5000])
    with pytest.raises(L47Error, match="at least 2"):
        eng.capture(m, [7])


def test_zero_proxy_on_captured_arrays(tiny_hf_model, tiny_gguf):
    """The exact tail forward from the captured arrays reproduces the engine's log p(next), for the weights the
    model has (checkpoint path) and for the GGUF-built engine under the runtime policy; a wrong layer's
    states are caught."""
    from types import SimpleNamespace

    from l47.tail.forward import score_dump
    from l47.model.weights import load_tail_weights

    m = tiny_hf_model(0)
    ids = _ids(40, seed=5)
    a = eng.capture(m, ids)
    lp = score_dump(eng.tail_weights_from_model(m, "hf:x"), SimpleNamespace(**a)).logp_target
    assert np.abs(lp - a["ref_logp"]).max() <= TOL
    mg = load_hf_from_gguf(tiny_gguf, policy="strata")
    b = eng.capture(mg, ids)
    w = load_tail_weights(tiny_gguf, policy="strata")
    assert np.abs(score_dump(w, SimpleNamespace(**b)).logp_target - b["ref_logp"]).max() <= TOL
    wrong = eng.capture(mg, ids, layer=1)  # states of the wrong layer: not the network
    assert np.abs(score_dump(w, SimpleNamespace(**wrong)).logp_target - b["ref_logp"]).max() > 1e-2
    # XF (the FFN input, what Strata's .mixed holds) where R belongs: caught
    xf = {}
    h = mg.model.layers[LAST].mlp.register_forward_pre_hook(lambda mod, i: xf.__setitem__("XF", i[0][0].clone()))
    try:
        with torch.no_grad():
            mg(torch.tensor([ids]))
    finally:
        h.remove()
    R_xf = xf["XF"][:-1, None, :].expand(-1, 4, -1).numpy()  # [T, hc, n]
    lp_xf = score_dump(w, SimpleNamespace(**{**b, "R": R_xf})).logp_target
    assert np.abs(lp_xf - b["ref_logp"]).max() > 1e-2


# ----------------------------------------------------------------------------------------------------------
# generation


def test_generate_deterministic_and_greedy(tiny_hf_model):
    m = tiny_hf_model(0)
    prompt = _ids(6, seed=2)
    kw = dict(temperature=0.9, top_p=0.95, top_k=50)
    g1 = eng.generate(m, prompt, eng.SamplerSettings(12, seed=11, **kw))
    assert g1 == eng.generate(m, prompt, eng.SamplerSettings(12, seed=11, **kw)) and len(g1) == 12
    assert g1 != eng.generate(m, prompt, eng.SamplerSettings(12, seed=12, **kw))
    # greedy through the KV cache == argmax of a full forward at every step (no cache: independent path)
    greedy = eng.generate(m, prompt, eng.SamplerSettings(6, seed=0, temperature=0))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    assert greedy == seq[len(prompt):]
    assert eng.generate(m, prompt, eng.SamplerSettings(6, seed=5, temperature=1.0, top_k=1)) == greedy
    # a stop id ends generation and is included
    stop = greedy[3]
    assert eng.generate(m, prompt, eng.SamplerSettings(6, seed=0, temperature=0, stop_ids=(stop,))) == \
        greedy[: greedy.index(stop) + 1]


def test_sampler_filters():
    s = eng.SamplerSettings(1, 0, temperature=1.0, top_p=0.75)
    z = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15], dtype=torch.float64))
    kept = torch.isfinite(eng._filter_logits(z, s)).tolist()
    assert kept == [False, True, True, False]  # 0.5 + 0.3 reaches 0.75
    s = eng.SamplerSettings(1, 0, temperature=1.0, top_k=3)
    assert torch.isfinite(eng._filter_logits(z, s)).tolist() == [False, True, True, True]
    counts = np.bincount([eng.sample_next(z, eng.SamplerSettings(1, 0), torch.Generator().manual_seed(i))
                          for i in range(400)], minlength=4)
    assert counts[1] > counts[2] > counts[3] > 0  # roughly the distribution


# ----------------------------------------------------------------------------------------------------------
# l47 dump, end to end


CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "How do I bake bread?"},
        {"role": "assistant", "content": "<think>\nThe user wants a recipe.\n</think>\n\nMix flour, water, salt "
                                         "and yeast, knead, let it rise, then bake."}]
PLAIN = "The quick brown fox jumps over the lazy dog. Rather than guessing, it measures the real network end to end."


def _docs(d, only: str | None = None):
    """A JSONL with a chat and a plain document (plus a malformed line and an unknown role unless `only`)."""
    lines = [json.dumps({"id": "chat-1", "messages": CHAT}), json.dumps({"id": "plain 1", "text": PLAIN})]
    if only == "chat":
        lines = lines[:1]
    elif only == "plain":
        lines = lines[1:]
    else:
        lines += ["{broken", json.dumps({"id": "bad", "messages": [{"role": "narrator", "content": "x"}]})]
    p = d / f"docs-{only or 'all'}.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def base_dumps(tmp_path_factory, tiny_gguf):
    """One `l47 dump` of the two documents with the GGUF-built engine, shared by the end-to-end tests."""
    from l47.app.dumping import DumpJob, run_dump

    d = tmp_path_factory.mktemp("base_dumps")
    docs = _docs(d)
    return run_dump(DumpJob(tiny_gguf, docs, d / "out")), docs, d / "out"


def test_run_dump_end_to_end(tmp_path, tiny_gguf, tiny_vocab, base_dumps):
    from l47.app.dumping import DumpJob, run_dump
    from l47.dumps import read_dump
    from l47.dumps.chat import render_chat

    s, docs, out = base_dumps
    assert [r.status for r in s.results] == ["written", "written"]
    assert len(s.input_errors) == 2 and "line" in s.input_errors[0] and "narrator" in s.input_errors[1]
    for r in s.results:
        assert r.max_abs <= TOL and r.mean_abs <= r.max_abs  # the zero-proxy check, f32 engine
    d = read_dump(out / "chat-1.safetensors")
    assert d.verified and d.meta.model == open_gguf(tiny_gguf).sha256() and d.meta.layer == LAST
    assert d.meta.engine["name"] == "hf" and d.meta.engine["settings"]["weight_policy"] == "strata"
    assert d.meta.inj_convention == "raw" and d.meta.hh_precision == "f32"
    ids, role = render_chat(CHAT, tiny_vocab)
    assert d.tokens.tolist() == ids and np.array_equal(d.role, role)  # roles match the template
    assert tiny_vocab.decode(d.tokens[1:][d.role == names.ROLE_ID["think"]]) == "\nThe user wants a recipe.\n"
    assert set(d.meta.provenance) == {"template", "system", "user", "assistant", "think"}
    assert set(d.meta.provenance.values()) == {"written"}
    p = read_dump(next(out.glob("plain_1-*.safetensors")))
    assert p.tokens.tolist() == tiny_vocab.encode(PLAIN)
    assert (p.role == names.ROLE_ID["assistant"]).all() and p.meta.provenance == {"assistant": "written"}
    # resumable: same inputs and model -> skipped, files untouched
    mtime = (out / "chat-1.safetensors").stat().st_mtime_ns
    s2 = run_dump(DumpJob(tiny_gguf, docs, out))
    assert [r.status for r in s2.results] == ["skipped", "skipped"]
    assert (out / "chat-1.safetensors").stat().st_mtime_ns == mtime
    # a different model (other bytes) over a copy of the dumps -> dumped again
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_gguf, other)
    with open(other, "ab") as fh:
        fh.write(b"\0" * 32)  # trailing padding: same tensors, another sha256
    out2 = tmp_path / "copy"
    shutil.copytree(out, out2)
    s3 = run_dump(DumpJob(other, _docs(tmp_path, "chat"), out2, ref_logits=True))
    assert [r.status for r in s3.results] == ["written"]
    d3 = read_dump(out2 / "chat-1.safetensors")
    assert d3.ref_logits is not None and d3.meta.model == open_gguf(other).sha256() != d.meta.model
    assert not list(out.glob("*.pending")) and not list(out.glob(".*"))  # nothing half-written


def test_run_dump_reports_through_callbacks(tmp_path, tiny_gguf):
    """run_dump prints nothing: `progress(dict)` gets start (the document count and the input errors), one
    `document` and one `done` (the DocResult's fields) per document in input order, then stop; `log(str)` gets the
    summary line. The console rendering (l47/app/dump_view.py) turns them into the lines `l47 dump` has always
    printed."""
    from dataclasses import asdict

    from l47.app.dump_view import document_line
    from l47.app.dumping import DumpJob, run_dump

    docs, out = _docs(tmp_path), tmp_path / "out"
    for expect in ("written", "skipped"):  # a fresh folder, then the same run again (resumed)
        events, lines = [], []
        s = run_dump(DumpJob(tiny_gguf, docs, out), log=lines.append, progress=events.append)
        assert events[0] == {"event": "start", "total": 2, "input_errors": list(s.input_errors)}
        assert len(s.input_errors) == 2 and events[-1] == {"event": "stop"}
        pairs = events[1:-1]
        assert [e["event"] for e in pairs] == ["document", "done"] * 2
        assert [e["doc_id"] for e in pairs] == ["chat-1", "chat-1", "plain 1", "plain 1"]
        assert [{k: v for k, v in e.items() if k != "event"} for e in pairs[1::2]] == [asdict(r) for r in s.results]
        assert [r.status for r in s.results] == [expect, expect]
        n = {"written": (2, 0), "skipped": (0, 2)}[expect]
        assert lines == [f"dump: {n[0]} written, {n[1]} skipped, 0 refused, 0 failed, 2 input error(s)"]
        r = s.results[0]
        assert document_line(pairs[1]) == (
            f"  chat-1: T={r.T}, zero-proxy max |Δ| {r.max_abs:.2e} mean {r.mean_abs:.2e} nats" if expect == "written"
            else "  chat-1: skipped (already dumped with the same input and model)")
    s = run_dump(DumpJob(tiny_gguf, docs, tmp_path / "silent"))  # no callbacks: silent, same results
    assert [r.status for r in s.results] == ["written", "written"]


def test_run_dump_scores_identically_through_l47_score(base_dumps, tiny_gguf):
    """`l47 score` on the dumps gives the engine's own log p (mean CE over positions) within the bar."""
    from l47.dumps import read_dump
    from l47.app.score import ScoreArgs, run_score

    _, _, out = base_dumps
    files = tuple(sorted(out.glob("*.safetensors")))
    res = run_score(ScoreArgs(model=tiny_gguf, dumps=files))
    assert len(res.docs) == 2
    for f, doc in zip(files, res.docs):
        d = read_dump(f)
        assert doc.verified and abs(doc.ce - float(-np.mean(d.ref_logp, dtype=np.float64))) <= TOL


def test_run_dump_refuses_above_tolerance_and_bad_layer(tmp_path, tiny_gguf):
    from l47.app.dumping import DumpJob, run_dump

    out = tmp_path / "d"
    docs = _docs(tmp_path, "plain")
    s = run_dump(DumpJob(tiny_gguf, docs, out, tolerance=0.0))
    # f32 sums in two orders differ by ~1e-6: at tolerance 0 the document is refused, not left as a dump
    assert [r.status for r in s.results] == ["refused"] and not s.ok and s.results[0].max_abs > 0
    assert not list(out.glob("*.safetensors")) and len(list(out.glob("*.safetensors.refused"))) == 1
    s2 = run_dump(DumpJob(tiny_gguf, docs, out))  # passes now; the stale refusal is removed
    assert [r.status for r in s2.results] == ["written"] and not list(out.glob("*.refused"))
    with pytest.raises(L47Error, match="layer"):
        run_dump(DumpJob(tiny_gguf, docs, out, layer=1))
    with pytest.raises(L47Error, match="strata"):
        run_dump(DumpJob(tiny_gguf, docs, out, engine="strata"))


def test_run_dump_generate_mode(tmp_path, tiny_gguf, tiny_vocab):
    from l47.app.dumping import DumpJob, GenerateOptions, run_dump
    from l47.dumps import read_dump

    gen = GenerateOptions(max_new_tokens=12, seed=3, temperature=0.8, top_p=0.95, top_k=40, think=True)
    docs = _docs(tmp_path, "chat")
    a = run_dump(DumpJob(tiny_gguf, docs, tmp_path / "a", generate=gen))
    b = run_dump(DumpJob(tiny_gguf, docs, tmp_path / "b", generate=gen))
    assert [r.status for r in a.results] == ["written"] and a.results[0].max_abs <= TOL
    da, db = read_dump(tmp_path / "a" / "chat-1.safetensors"), read_dump(tmp_path / "b" / "chat-1.safetensors")
    assert np.array_equal(da.tokens, db.tokens)  # seeded: the same sample twice
    pv = da.meta.provenance
    assert pv["think"] == "generated" and pv["user"] == "written" and pv["system"] == "written"
    g = pv["generation"]
    assert g["model"] == da.meta.model and g["sampler"]["top_k"] == 40 and g["prompt"].endswith("<think>\n")
    # the prompt is the document without its assistant turn; the sampled tail is at most 12 tokens
    prompt_ids = tiny_vocab.encode_chat(g["prompt"])
    assert "Mix flour" not in g["prompt"] and da.tokens[:len(prompt_ids)].tolist() == prompt_ids
    assert 1 <= da.tokens.shape[0] - len(prompt_ids) <= 12


def test_engine_on_transplanted_bundle_matches_tail_prediction(tmp_path, tiny_gguf, base_dumps):
    """Seed §3.1: the transplanted GGUF's own log p(next) = the tail forward's prediction from the BASE dumps
    plus the edit (W_sd + ΔW re-quantised to Q8_0, as it ships)."""
    from l47.app.dumping import DumpJob, run_dump
    from l47.dumps import read_dump
    from l47.tail.forward import score_dump
    from l47.model.gguf_io import copy_with_tensor_replaced
    from l47.model.weights import load_tail_weights, runtime_tensor

    _, docs, base_out = base_dumps
    edit_out = tmp_path / "edit"
    w = load_tail_weights(tiny_gguf, policy="strata")
    dW = torch.randn(w.W_sd.shape, generator=torch.Generator().manual_seed(7)) * 0.05
    raw = gq.quantize((w.W_sd + dW).numpy(), QT.Q8_0)
    bundle = copy_with_tensor_replaced(tiny_gguf, tmp_path / "bundle.gguf", {w.target: raw})
    W_new = runtime_tensor(open_gguf(bundle), w.target, "strata")
    run_dump(DumpJob(bundle, docs, edit_out))
    files = sorted(base_out.glob("*.safetensors"))
    assert len(files) == 2
    for f in files:
        base, edited = read_dump(f), read_dump(edit_out / f.name)
        assert np.array_equal(base.R, edited.R) and np.array_equal(base.hh, edited.hh)  # upstream untouched
        pred = score_dump(w, base, W_sd=W_new).logp_target
        moved = np.abs(edited.ref_logp - base.ref_logp).max()
        assert moved > 1e-2  # the edit really changes the model
        assert np.abs(pred - edited.ref_logp).max() <= TOL


# ----------------------------------------------------------------------------------------------------------
# the engine across devices (accelerate): on this CPU-only machine the split is host RAM + disk offload, which
# runs every offloaded module through accelerate's hooks (weights loaded from the offload folder at its turn)


def _dump_bytes(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("how", ["explicit", "max_memory"])
def test_run_dump_across_devices_byte_identical(tmp_path, tiny_gguf, base_dumps, how):
    """Tolerance 0 (file bytes): the same f32 operations run on the same CPU, only the weights' home differs;
    the capture hooks on layer L fire although its weights live on disk until their turn."""
    from l47.app.dumping import DumpJob, run_dump
    from l47.engine.gguf_export import load_hf_from_gguf

    s0, docs, out0 = base_dumps
    model = load_hf_from_gguf(tiny_gguf)
    top = [n for n, _ in model.named_children()]  # model, lm_head
    inner = [f"model.{n}" for n, _ in model.model.named_children() if n != "layers"]
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    if how == "explicit":  # layer L and the head offloaded to disk, the rest in host RAM
        dm = {k: "cpu" for k in inner + layers[:-1]} | {layers[-1]: "disk", "lm_head": "disk"}
        assert set(top) == {"model", "lm_head"}
        placement = eng.parse_placement(json.dumps(dm), None, tmp_path / "offload")
    else:  # caps: host RAM holds ~40 % of the weights, accelerate puts the rest on disk
        from accelerate.utils import compute_module_sizes

        cap = int(compute_module_sizes(model)[""] * 0.4)
        placement = eng.parse_placement("auto", json.dumps({"cpu": cap, "disk": "1000GiB"}), tmp_path / "offload")
    placed = eng.place_model(load_hf_from_gguf(tiny_gguf), placement)
    assert "disk" in placed.hf_device_map.values() and "cpu" in placed.hf_device_map.values()
    assert eng.input_device(placed).type == "cpu" and eng.compute_device_type(placed) == "cpu"
    s = run_dump(DumpJob(tiny_gguf, docs, tmp_path / "out", placement=placement))
    assert [r.status for r in s.results] == ["written", "written"]
    got, want = _dump_bytes(tmp_path / "out"), _dump_bytes(out0)
    assert list(got) == list(want) and all(got[k] == want[k] for k in want)


def test_checkpoint_dir_across_devices_byte_identical(tmp_path, tiny_hf_model, tiny_vocab):
    """A transformers checkpoint loaded straight onto its devices (from_pretrained with max_memory)."""
    from l47.app.dumping import DumpJob, run_dump

    tiny_hf_model(0).save_pretrained(tmp_path / "ckpt")
    docs = _docs(tmp_path, "plain")
    run_dump(DumpJob(tmp_path / "ckpt", docs, tmp_path / "one", vocab=tiny_vocab))
    placement = eng.parse_placement(None, "cpu=3MiB,disk=1000GiB", tmp_path / "offload")
    assert placement.device_map == "auto" and placement.max_memory == {"cpu": "3MiB", "disk": "1000GiB"}
    s = run_dump(DumpJob(tmp_path / "ckpt", docs, tmp_path / "split", vocab=tiny_vocab, placement=placement))
    assert [r.status for r in s.results] == ["written"]
    assert _dump_bytes(tmp_path / "split") == _dump_bytes(tmp_path / "one")


def test_placement_refuses_bad_input(tmp_path, tiny_gguf):
    from l47.engine.gguf_export import load_hf_from_gguf

    with pytest.raises(L47Error, match="device map"):
        eng.parse_placement("everywhere", None)
    with pytest.raises(L47Error, match="max-memory"):
        eng.parse_placement(None, "lots")
    with pytest.raises(L47Error, match="explicit map"):
        eng.parse_placement('{"model": "cpu", "lm_head": "cpu"}', "cpu=1GiB")
    with pytest.raises(L47Error, match="offload folder"):
        eng.place_model(load_hf_from_gguf(tiny_gguf), eng.parse_placement('{"model": "cpu", "lm_head": "disk"}', None))
    with pytest.raises(L47Error, match="module 'model.layer.0'"):
        eng.place_model(load_hf_from_gguf(tiny_gguf), eng.parse_placement('{"model.layer.0": "cpu"}', None))
    assert eng.parse_placement(None, None) == eng.Placement()


def test_audit_engine_bars_from_the_hf_engine_on_the_transplanted_bundle(tmp_path, tiny_gguf, base_dumps):
    """The audit's engine-level figures fed by an independent forward: transformers' Qwen4Exp (the hf engine)
    run on the transplanted bundle, its log p(next) against the tail forward's prediction for the edited model
    (engine.zero_proxy: ≤ 1e-4 nats, f32 engine vs exact tail, as at dump time) and its KLD against the base run
    equal to the tail's own KLD (both exact forwards of the same two models; f16 ref_logits: ≤ 1e-3). A planted
    0.01-nat disagreement in the engine's log p must fail the bar."""
    from dataclasses import replace as dc_replace

    from l47.app.dumping import DumpJob, run_dump
    from l47.dumps import read_dump, write_dump
    from l47.evals.audit import AuditArgs, run_audit
    from l47.model.gguf_io import copy_with_tensor_replaced
    from l47.model.weights import load_tail_weights

    _, docs, _ = base_dumps
    base_out = tmp_path / "base"
    run_dump(DumpJob(tiny_gguf, docs, base_out, ref_logits=True))  # the engine's base run, full logits kept
    w = load_tail_weights(tiny_gguf, policy="strata")
    dW = torch.randn(w.W_sd.shape, generator=torch.Generator().manual_seed(11)) * 0.05
    bundle = copy_with_tensor_replaced(tiny_gguf, tmp_path / "bundle.gguf",
                                       {w.target: gq.quantize((w.W_sd + dW).numpy(), QT.Q8_0)})
    edit_out = tmp_path / "edit"
    run_dump(DumpJob(bundle, docs, edit_out, ref_logits=True))  # the engine runs the bundle itself: no tail code
    files = sorted(base_out.glob("*.safetensors"))
    exp = tmp_path / "exp.toml"
    exp.write_text("\n".join([
        'name = "engine-check"', f'model = "{tiny_gguf}"', 'vocab = "gguf"', 'policy = "strata"', "",
        "[sets.kld]", f"prose = {json.dumps([str(f) for f in files])}", "", "[[phrases]]", 'text = "the end"',
    ]) + "\n")
    engine = sorted(edit_out.glob("*.safetensors"))

    def audit(out, engine_dumps):
        return run_audit(AuditArgs(bundle=bundle, base=tiny_gguf, experiment=exp, out_dir=out, plots=False,
                                   engine_dumps=tuple(engine_dumps), allow_unverified=True))

    res = audit(tmp_path / "a", engine)
    eng_rep = res.report["engine"]
    zp = eng_rep["zero_proxy_edited"]
    assert set(zp) == {str(p) for p in engine}
    assert max(v["max_rel"] for v in zp.values()) <= TOL
    k = eng_rep["kld"]["kld.prose"]
    assert k["tail_kld"] > 1e-3  # the edit really moves the distribution
    assert k["kld"] == pytest.approx(k["tail_kld"], abs=1e-3) and k["floor"] < 1e-3
    bars = {b["name"]: b for b in res.report["bars"]}
    assert bars["engine.zero_proxy"]["passed"]

    d = read_dump(engine[0])  # planted: the engine disagrees with the tail prediction by 0.01 nats
    arr = {kk: np.array(v) for kk, v in d.arrays().items()}
    arr["ref_logp"] = arr["ref_logp"] + np.float32(0.01)
    bad = write_dump(tmp_path / "planted" / engine[0].name, arr, dc_replace(d.meta, doc_id="planted"))
    res2 = audit(tmp_path / "b", [bad] + engine[1:])
    b2 = {b["name"]: b for b in res2.report["bars"]}["engine.zero_proxy"]
    want = float((0.01 / np.maximum(1.0, np.abs(d.ref_logp.astype(np.float64)))).max())  # the bar's relative form
    assert not b2["passed"] and b2["value"] == pytest.approx(want, rel=0.05)  # the engine's log p ≈ tail's (1e-4)
