"""`l47 export` and the checkpoint's own tokenizer, on checkpoints the project has not seen: config vocabulary
4,000 (tokenizer 516 ids, padded), the five chat special tokens at ids 0–4, other layer counts and dims.

References:
  - transformers' Qwen4Exp on the checkpoint folder (f32): with every tensor exported as F32 the rebuilt model's
    logits equal the checkpoint's to 1e-5 (the only rounding is the norm fold (1 + w) − 1 in f32, ~1e-7 relative;
    1e-5 on logits of size ~10 leaves a 100x margin);
  - `tokenizers` running the checkpoint's tokenizer.json itself: token ids compared exactly (no tolerance);
  - the export's own check (hf zero-proxy tolerance 1e-4 nats) must pass on the default types and must fail,
    removing its output, when the reference differs (a perturbed parameter).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from tiny_ckpt import SPECIALS, save_checkpoint, train_tokenizer

from l47.app.cli import app
from l47.errors import L47Error
from l47.model import names

TEXTS = ["Rather than rebuild it, the council repaired each stone in 1904.",
         "<|im_start|>user\nHow long?<|im_end|>\n<|im_start|>assistant\n<think>\nsoft\n</think>\n\nSeven.<|im_end|>\n"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen4exp", layers=2)


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _leftovers(folder, name):
    return [p.name for p in folder.iterdir() if name in p.name]


def test_export_default_types_specials_at_0_to_4(ckpt, tmp_path):
    out = tmp_path / "m.gguf"
    r = _invoke("export", ckpt, out)
    assert r.exit_code == 0, r.output
    assert "ok" in r.output and out.is_file()
    from l47.model.gguf_io import open_gguf
    from l47.model.vocab import vocab_from_gguf

    g = open_gguf(out)
    v = vocab_from_gguf(g)
    assert v.size == 4000  # config vocab_size: tokenizer's 516 ids + unused padding rows
    assert v.special_ids == {s: i for i, s in enumerate(SPECIALS)}  # ids 0..4, read from the file
    tk = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    for t in TEXTS:
        assert v.encode_chat(t) == tk.encode(t, add_special_tokens=False).ids
    assert g.tensors["output.weight"].type_name == "Q6_K"
    assert g.tensors[names.target_tensor(1)].type_name == "Q8_0"
    assert g.kv[names.K_TOK_EOS] == 2 and g.kv[names.K_TOK_BOS] == 0
    assert names.K_CHAT_TEMPLATE in g.kv


def test_export_f32_equals_checkpoint(tmp_path):
    """Other dims (3 layers, n 128 so the head is not Q6_K-able, 4 experts, low rank 16), every type F32: the
    GGUF rebuilt by the hf engine gives the checkpoint's logits (transformers on the folder) to 1e-5."""
    from l47.engine.gguf_export import load_hf, load_hf_from_gguf

    ck = save_checkpoint(tmp_path / "ck", vocab=3000, layers=3, hidden=128, shared=96, lowrank=16, num_experts=4,
                         seed=3)
    out = tmp_path / "f32.gguf"
    r = _invoke("export", ck, out, "--target-type", "F32", "--head-type", "F32", "--hc-type", "F32")
    assert r.exit_code == 0, r.output
    ids = torch.tensor([[0, 1, 7, 200, 3, 42, 4, 515, 2, 9, 2999]])
    with torch.no_grad():
        want = load_hf(ck)(ids).logits
        got = load_hf_from_gguf(out, policy="exact")(ids).logits
    assert float((got - want).abs().max()) < 1e-5


def test_export_check_failure_removes_output(ckpt, tmp_path, monkeypatch):
    import l47.engine.gguf_export as ge

    real = ge.round_trip_in_place

    def off(model, types):  # the reference moves one head row: the file no longer matches it
        real(model, types)
        with torch.no_grad():
            model.lm_head.weight[5] += 0.5

    monkeypatch.setattr(ge, "round_trip_in_place", off)
    out = tmp_path / "bad.gguf"
    r = _invoke("export", ckpt, out)
    assert r.exit_code == 1, r.output
    assert "FAILED" in r.output and not out.exists() and not _leftovers(tmp_path, "bad.gguf")


def _no_config(p):
    (p / "config.json").unlink()


def _llama(p):
    c = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**c, "model_type": "llama"}))


def _no_tokenizer(p):
    (p / "tokenizer.json").unlink()


def _gpt2_pre(p):
    train_tokenizer(byte_level_regex=True).save(str(p / "tokenizer.json"))


def _no_think(p):
    train_tokenizer(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")).save(
        str(p / "tokenizer.json"))


@pytest.mark.parametrize("breaks, names_", [
    (_no_config, ["config.json"]), (_llama, ["config.json", "model_type", "llama"]),
    (_no_tokenizer, ["tokenizer.json", "missing"]), (_gpt2_pre, ["tokenizer.json", "pre_tokenizer", "--pre"]),
    (_no_think, ["special token <think>", "missing"]),
])
def test_export_bad_checkpoint_exit_2_nothing_written(ckpt, tmp_path, breaks, names_):
    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    breaks(bad)
    out = tmp_path / "o.gguf"
    r = _invoke("export", bad, out)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 3  # one error (wrapped)
    flat = " ".join(r.output.split())
    for s in names_:
        assert s in flat, (s, flat)
    assert not _leftovers(tmp_path, "o.gguf")


def test_export_existing_output_and_wrong_pre(ckpt, tmp_path):
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"keep me")
    r = _invoke("export", ckpt, out)
    assert r.exit_code == 2 and "exists.gguf" in r.output and "output" in r.output
    assert out.read_bytes() == b"keep me"
    r = _invoke("export", ckpt, tmp_path / "p.gguf", "--pre", "qwen35")  # the file says qwen2
    assert r.exit_code == 2 and "pre_tokenizer" in r.output and not (tmp_path / "p.gguf").exists()
    r = _invoke("export", ckpt, tmp_path / "t.gguf", "--head-type", "Q9_9")
    assert r.exit_code == 2 and "--head-type" in r.output


def test_dump_hf_dir_uses_its_own_tokenizer(ckpt, tmp_path):
    """`l47 dump --model HF_DIR`: ids from the checkpoint's tokenizer.json (specials 0–4), not a built-in one."""
    from l47.dumps import read_dump

    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "c", "messages": [{"role": "user", "content": "How long?"},
                                                       {"role": "assistant", "content": "Seven minutes."}]}) + "\n")
    r = _invoke("dump", src, "--model", ckpt, "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output
    d = read_dump(tmp_path / "d" / "c.safetensors")
    tk = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert list(np.asarray(d.tokens)) == tk.encode(d.meta.text, add_special_tokens=False).ids
    assert list(np.asarray(d.tokens))[:1] == [1]  # <|im_start|> is id 1 in this tokenizer


def test_dump_missing_special_is_named(ckpt, tmp_path):
    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    _no_think(bad)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    r = _invoke("dump", src, "--model", bad, "--out", tmp_path / "d", "--generate", "--max-new-tokens", "2")
    assert r.exit_code == 2 and "<think>" in r.output, r.output


def test_inspect_checkpoint_folder(ckpt, tmp_path):
    r = _invoke("inspect", ckpt)
    assert r.exit_code == 0 and "qwen4_exp_text" in r.output and "<|im_end|> 2" in r.output, r.output
    r = _invoke("inspect", tmp_path)
    assert r.exit_code == 2 and "config.json" in r.output and "Traceback" not in r.output


def test_vocab_checkpoint_kv_padding_and_errors(ckpt):
    from l47.model.vocab import TT_UNUSED, checkpoint_tokenizer_kv

    kv = checkpoint_tokenizer_kv(ckpt, 4000)
    assert len(kv[names.K_TOK_TOKENS]) == 4000 and kv[names.K_TOK_TYPES][3999] == TT_UNUSED
    with pytest.raises(L47Error, match="vocab_size"):
        checkpoint_tokenizer_kv(ckpt, 100)  # the tokenizer has ids beyond the model's rows


def test_export_hc_rank_not_q8_0_blocks_strata_policy(tmp_path):
    """Low rank r = 24 (not a multiple of Q8_0's 32): the `[hc·n, r]` hc_* tensors have no Q8_0 form, so the
    default export keeps them BF16 and the strata runtime policy uses them as the file holds them (BF16 -> f32),
    while the hc_* tensors whose rows are whole blocks still get their Q8_0 runtime copy. Reference: transformers
    on the checkpoint folder with every parameter replaced by what that rule gives, computed with gguf-py's own
    codecs (`gguf.quants`, independent of l47's): the GGUF rebuilt under the strata policy gives the same logits
    to 1e-5, and `l47 dump` on the GGUF (default policy strata) writes log p(next) equal to transformers' to the
    hf zero-proxy tolerance 1e-4 nats, its own zero-proxy check passing (exit 0)."""
    import gguf
    from gguf import quants as gq

    from l47.engine.gguf_export import _is_hc_matrix, load_hf, load_hf_from_gguf
    from l47.model.gguf_io import open_gguf

    ck = save_checkpoint(tmp_path / "ck", vocab=1200, layers=4, hidden=160, shared=96, lowrank=24, num_experts=6,
                         seed=7)
    out = tmp_path / "r24.gguf"
    r = _invoke("export", ck, out)
    assert r.exit_code == 0, r.output
    g = open_gguf(out)
    hc = {k: t for k, t in g.tensors.items() if _is_hc_matrix(k)}
    assert hc and all(t.type_name == "BF16" for t in hc.values())
    short = [k for k in hc if tuple(hc[k].shape)[-1] == 24]
    assert names.OUTPUT_HC_UP.gguf in short and len(short) >= 4 + 1  # every layer's hc up + the mixer's

    ref = load_hf(ck)
    table = names.hf_to_gguf_map(4)
    Q8, BF = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16
    with torch.no_grad():
        for hf, p in ref.state_dict().items():
            gname, w = table[hf], p.detach().float().numpy()
            if names.is_folded_norm(gname):
                w = (np.float32(1) + w) - np.float32(1)  # stored 1 + w, F32
            elif _is_hc_matrix(gname):
                w = gq.dequantize(gq.quantize(w, BF), BF)  # the file's BF16
                if w.shape[-1] % 32 == 0:
                    w = gq.dequantize(gq.quantize(w, Q8), Q8)  # Strata's Q8_0 copy
            elif g.tensors[gname].type_name == "Q8_0":  # the shexp targets, the head (n 160: not Q6_K-able)
                w = gq.dequantize(gq.quantize(w, Q8), Q8)
            else:
                assert g.tensors[gname].type_name == "F32", gname
            p.copy_(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(p.shape))
    ids = torch.tensor([[0, 5, 77, 300, 2, 9, 1100, 42, 4, 8, 1199, 3]])
    with torch.no_grad():
        want = ref(ids).logits[0]  # [T, V]
        got = load_hf_from_gguf(out, policy="strata")(ids).logits[0]
    assert float((got - want).abs().max()) < 1e-5

    doc = tmp_path / "doc.jsonl"
    doc.write_text(json.dumps({"id": "d", "text": TEXTS[0]}) + "\n")
    r = _invoke("dump", doc, "--model", out, "--out", tmp_path / "dumps")
    assert r.exit_code == 0, r.output
    from l47.dumps import read_dump

    d = read_dump(next((tmp_path / "dumps").glob("*.safetensors")))
    t = torch.tensor(np.asarray(d.tokens, dtype=np.int64))[None]
    with torch.no_grad():
        z = ref(t).logits[0, :-1].double()  # [T, V]
    lp = (z.gather(1, t[0, 1:, None])[:, 0] - torch.logsumexp(z, -1)).numpy()  # [T] f64
    assert float(np.abs(np.asarray(d.ref_logp, dtype=np.float64) - lp).max()) < 1e-4


# --- a checkpoint whose weights or config do not describe the model completely (issue 35 item 3) --------------

TARGET_HF = "model.layers.1.mlp.shared_expert.down_proj.weight"  # the matrix l47 edits (layer 1 of 2)


def _rewrite_weights(p, edit):
    from safetensors.torch import load_file, save_file

    sd = load_file(p / "model.safetensors")
    edit(sd)
    save_file(sd, p / "model.safetensors", metadata={"format": "pt"})


def _drop_target(p):
    _rewrite_weights(p, lambda sd: sd.pop(TARGET_HF))


def _drop_expert_piece(p):
    _rewrite_weights(p, lambda sd: sd.pop("model.layers.0.mlp.experts.3.up_proj.weight"))


def _extra_tensor(p):
    _rewrite_weights(p, lambda sd: sd.__setitem__("model.layers.1.mlp.spare.weight", torch.zeros(4, 4)))


def _wrong_shape(p):
    _rewrite_weights(p, lambda sd: sd.__setitem__(TARGET_HF, sd[TARGET_HF][:, :32].contiguous()))


def _truncated(p):
    f = p / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _garbage(p):
    (p / "model.safetensors").write_bytes(b"\xff" * 4096)


def _pickle_only(p):
    (p / "model.safetensors").rename(p / "pytorch_model.bin")


def _config_without(key):
    def edit(p):
        c = json.loads((p / "config.json").read_text())
        del c[key]
        (p / "config.json").write_text(json.dumps(c))
    return edit


@pytest.mark.parametrize("breaks, names_", [
    (_drop_target, ["weights", "missing 1", TARGET_HF]),
    (_drop_expert_piece, ["missing 1", "model.layers.0.mlp.experts.3.up_proj.weight"]),
    (_extra_tensor, ["unexpected 1", "model.layers.1.mlp.spare.weight"]),
    (_wrong_shape, ["shape mismatch 1", TARGET_HF, "(256, 32)", "(256, 64)"]),
    (_truncated, ["model.safetensors", "truncated"]),
    (_garbage, ["model.safetensors", "header length"]),
    (_pickle_only, ["weights", "pytorch_model.bin", "no pickle"]),
    (_config_without("hidden_size"), ["config.json", "hidden_size", "missing"]),
    (_config_without("num_experts_per_tok"), ["config.json", "num_experts_per_tok", "missing"]),
    (_config_without("rms_norm_eps"), ["config.json", "rms_norm_eps", "missing"]),
])
def test_export_incomplete_checkpoint_exit_2_named_nothing_written(ckpt, tmp_path, breaks, names_):
    """Each break: one line naming the file and the tensor / key, exit 2, nothing written, the checkpoint's bytes
    unchanged. Before: a missing tensor (even the edited matrix) was initialised at random by transformers and the
    round-trip check compared that random model with itself (exit 0); truncation and a missing key: tracebacks."""
    import hashlib

    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    breaks(bad)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in bad.iterdir()}
    out = tmp_path / "o.gguf"
    r = _invoke("export", bad, out)
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) <= 3  # one error (wrapped)
    flat = " ".join(r.output.split())
    for s in names_:
        assert s in flat, (s, flat)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing written beside the output either
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in bad.iterdir()} == before


def test_load_hf_is_strict_and_exact(ckpt, tmp_path):
    """The round-trip reference: every parameter of load_hf's model equals the checkpoint's own tensor (read here
    with safetensors; the experts, stored per expert, compared through the fused layout: gate rows then up rows),
    bit for bit; a checkpoint without one tensor is refused by load_hf itself (no random initialisation)."""
    from safetensors.torch import load_file

    from l47.engine.gguf_export import load_hf

    sd = load_file(ckpt / "model.safetensors")
    model = load_hf(ckpt)
    n_checked = 0
    for k, p in model.state_dict().items():
        if k in sd:
            want = sd[k]
        else:  # model.layers.L.mlp.experts.{gate_up_proj [E, 2f, n], down_proj [E, n, f]}
            pre, kind = k.rsplit(".", 1)
            E = p.shape[0]
            if kind == "gate_up_proj":
                want = torch.stack([torch.cat([sd[f"{pre}.{e}.gate_proj.weight"], sd[f"{pre}.{e}.up_proj.weight"]])
                                    for e in range(E)])
            else:
                want = torch.stack([sd[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
        assert torch.equal(p, want.to(p.dtype)), k
        n_checked += 1
    assert n_checked == len(model.state_dict())
    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    _drop_target(bad)
    with pytest.raises(L47Error, match="missing 1"):
        load_hf(bad)
