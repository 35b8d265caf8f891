"""A corpus of malformed inputs and misuses across every command (issue 14 item 9), run through the real CLI
(typer's CliRunner, in process). Each case asserts:
  * the exit code (2: usage or input error; the few positive controls 0),
  * one `error:` line naming the file and the field (substrings given per case), printed literally,
  * no traceback (the runner caught no exception other than SystemExit),
  * no partial output (the case's scratch folder holds exactly what it held before),
  * every input byte-identical afterwards (sha256 of every file of the world, before and after).

The world (built once, ~1 s): the synthetic qwen4exp GGUF (l47.testing.synth, n 256, f 64, V 1024) carrying the
conftest's tiny BPE vocabulary; six dumps of rendered plain/chat text with synthetic states (meta.model = the
GGUF's sha256); an experiment naming them; a bundle and an overlay of a small ΔW; bad variants of each (NaN in
a tail tensor, another model, truncated files, bad TOML, ...). All cases fail in validation, before any solve,
so the corpus runs in seconds.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from l47.app.cli import app
from l47.model import names

DIMS_KW = dict(n=256, f=64, r=32, hc=4, V=1024, n_layers=3)

TEXTS = {
    "pool0": "We checked the build end to end rather than guessing, and we sent the numbers right away.",
    "pool1": "Run the suite end to end on a clean machine. Use the measured numbers rather than a guess.",
    "pool2": "The audit traced the head end to end and flagged one file right away.",
    "pool3": "I read both files rather than the summary, and it took more than an hour.",
    "coll": "The river is more than a mile wide. At the end of the valley the road turns far away.",
    "bg": "The quick brown fox jumps over the lazy dog. A model reads text and predicts the next token.",
}


def _meta(name, w, text, model=None, **kw):
    from l47.dumps import DumpMeta

    d = dict(schema_version=1, doc_id=name, layer=w.layer, n=w.n, f=w.f, hc=w.hc, r=w.r, V=w.V,
             model=model or w.model_sha256, engine={"name": "synthetic", "version": "0", "settings": {}},
             inj_convention="raw", hh_precision="f32", provenance={"assistant": "written"}, text=text)
    d.update(kw)
    return DumpMeta(**d)


def _sha_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def _nan_q8(raw: np.ndarray, block: int = 3) -> np.ndarray:
    """Q8_0 bytes with one block's f16 scale set to NaN (the first bad element is that block's first)."""
    raw = np.array(raw, copy=True)
    flat = raw.reshape(-1, 34)
    flat[block, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    return raw


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    return make_world(tmp_path_factory.mktemp("malformed_world"), tmp_path_factory.mktemp("malformed_build"),
                      tiny_tokenizer_kv)


def make_solvable_world(tmp_path_factory, tokenizer_kv, name: str) -> dict:
    """make_world plus det.toml: the world's experiment with bars that a tiny solvable world meets (non-events
    kept, CE guard off, minimum counts 1) and a [split] pool — for tests that run solve and audit end to end."""
    w = make_world(tmp_path_factory.mktemp(f"{name}_world"), tmp_path_factory.mktemp(f"{name}_build"), tokenizer_kv)
    exp = _toml(w["dumps"], thresholds="[thresholds]\nnon_event_p = 0.0\nce_proxy_frac = 100.0\n"
                "min_heldout_per_phrase = 1\nmin_train_per_phrase = 1\ncollateral_min_total = 1\ncollateral_min_per_word = 1\n",
                split='[split]\npool = ["pool*.safetensors"]\nseed = 0\ntrain = 0.5\ndev = 0.25\nheldout = 0.25\n')
    (w["root"] / "det.toml").write_text(exp)
    return w


def make_world(root: Path, scratch: Path, tiny_tokenizer_kv) -> dict:
    """Build the corpus world in `root` (`scratch` is removed afterwards). Also used by test_determinism."""
    from l47.dumps import write_dump
    from l47.dumps.chat import render_plain
    from l47.engine.gguf_export import _TOKENIZER_TYPES
    from l47.model.gguf_io import copy_with_tensor_replaced, open_gguf
    from l47.model.vocab import vocab_from_gguf
    from l47.model.weights import load_tail_weights
    from l47.solvers.bundle import requantize_target, write_bundle, write_overlay
    from l47.testing.synth import SynthDims, synth_dump_arrays, write_synth_gguf

    raw = write_synth_gguf(scratch / "raw.gguf", SynthDims(**DIMS_KW), seed=3, unknown_type_tensor=False)
    base = copy_with_tensor_replaced(raw, root / "base.gguf", {}, extra_kv=tiny_tokenizer_kv,
                                     extra_kv_types=_TOKENIZER_TYPES)
    g = open_gguf(base)
    w = load_tail_weights(g, policy="strata")
    vocab = vocab_from_gguf(g)
    dumps = {}
    for i, (name, text) in enumerate(TEXTS.items()):
        ids, role = render_plain(text, vocab)
        a = synth_dump_arrays(SynthDims(**DIMS_KW), len(ids) - 1, seed=10 + i)
        a["tokens"], a["role"] = np.asarray(ids, dtype=np.int32), np.asarray(role, dtype=np.uint8)
        dumps[name] = write_dump(root / f"{name}.safetensors", a, _meta(name, w, text))
    # a dump of another model (same dims), one with NaN in hh, a truncated one, one of other dims
    a = synth_dump_arrays(SynthDims(**DIMS_KW), 12, seed=99)
    a["tokens"] = np.asarray(a["tokens"] % 256, dtype=np.int32)
    a["role"] = np.full(12, names.ROLE_ID["assistant"], dtype=np.uint8)
    write_dump(root / "other_model.safetensors", a, _meta("other", w, "x", model="ab" * 32))
    good = (root / "pool0.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    b = synth_dump_arrays(SynthDims(**{**DIMS_KW, "n": 128}), 12, seed=5)
    b["tokens"] = np.asarray(b["tokens"] % 256, dtype=np.int32)
    b["role"] = np.full(12, names.ROLE_ID["assistant"], dtype=np.uint8)
    write_dump(root / "other_dims.safetensors", b, _meta("dims", w, "x", n=128))

    # bundles: a small ΔW (full and overlay), one with NaN in the target, a base with NaN in the head
    dW = torch.randn(w.W_sd.shape, generator=torch.Generator().manual_seed(1)) * 0.02
    raw_new, _ = requantize_target(g, w.target, w.W_sd + dW)
    bundle = write_bundle(base, root / "bundle.gguf", w.target, raw_new, {"method": "test"})
    overlay = write_overlay(base, root / "overlay.gguf", w.target, raw_new, {"method": "test"})
    nan_target = _nan_q8(np.asarray(g.raw(w.target)))
    copy_with_tensor_replaced(base, root / "nan_target.gguf", {w.target: nan_target},
                              extra_kv={names.PROVENANCE_PREFIX + "method": "nan"})
    head = names.gguf_name(names.OUTPUT)
    hraw = np.array(g.raw(head), copy=True)
    hinfo = g.info(head)
    if hinfo.type_name == "Q8_0":
        hraw = _nan_q8(hraw, block=0)
    else:  # Q6_K: the block's f16 super-scale d is its last 2 bytes (210-byte blocks)
        flat = hraw.reshape(-1, 210)
        flat[0, 208:210] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    copy_with_tensor_replaced(base, root / "nan_head.gguf", {head: hraw})
    (root / "not_a_gguf.gguf").write_text("this is a text file, not a model\n")
    bb = base.read_bytes()
    (root / "truncated.gguf").write_bytes(bb[: len(bb) // 3])
    (root / "empty.gguf").write_bytes(b"")

    # the experiment and its bad variants
    exp = _toml(dumps)
    (root / "exp.toml").write_text(exp)
    (root / "ledger_bad.jsonl").write_text('{"schema": "l47.ledger/1", "base_sha256": "%s"}\n' % ("0" * 64)
                                            + "not json\n")  # a valid header, then a corrupt line 2
    (root / "notes.txt").write_text("the user's own notes\n")
    (root / "a_folder").mkdir()
    (root / "a_folder" / "keep.txt").write_text("keep me\n")
    (root / "docs.jsonl").write_text(json.dumps({"id": "d0", "text": TEXTS["pool0"]}) + "\n")
    (root / "docs_bad.jsonl").write_text("{not json\n")
    (root / "report_other.json").write_text(json.dumps({"schema": "something else"}))
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    shutil.rmtree(scratch)
    return dict(root=root, base=base, bundle=bundle, overlay=overlay, w=w, dumps=dumps)


def _toml(dumps, **edits) -> str:
    sets = {"collateral_eval": ["coll.safetensors"], "background": ["bg.safetensors"]}
    body = {
        "top": 'name = "corpus"\nmodel = "base.gguf"\nvocab = "gguf"\npolicy = "strata"\n',
        "sets": "[sets]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in sets.items()),
        "split": '[split]\npool = ["pool*.safetensors"]\nseed = 0\n',
        "phrases": '[[phrases]]\ntext = "rather than"\n\n[[phrases]]\ntext = "end to end"\n',
        "collateral": '[collateral]\nwords = [" than", " end"]\n',
        "thresholds": "[thresholds]\nmin_heldout_per_phrase = 1\nmin_train_per_phrase = 1\ncollateral_min_total = 1\n"
                      "collateral_min_per_word = 1\n",
        "solver": "",
    }
    body.update(edits)
    return "\n".join(v for v in body.values() if v) + "\n"


# ---------------------------------------------------------------------------------------------------------
# the corpus: (id, argv template, expected exit, substrings the error line must contain, files to write first)
# {X} in argv is the world file X; {T} the case's scratch folder. `pre` writes bad inputs into the scratch
# folder: {name: text | (world file, transform)}.

BAD_TOML = {
    "toml_syntax": ('name = "x"\n[sets\nbackground = []\n', ["line 2", "column"]),
    "unknown_top_key": (None, ["phrase", "did you mean 'phrases'"]),
    "unknown_threshold": (None, ["kld_mx", "did you mean 'kld_max'"]),
    "negative_kld": (None, ["thresholds.kld_max", ">= 0"]),
    "probability_gt_1": (None, ["thresholds.non_event_p", "[0.0, 1.0]"]),
    "salad_ngram_zero": (None, ["thresholds.salad_ngram", ">= 1"]),
    "wrong_type": (None, ["thresholds.salad_ngram", "integer"]),
    "missing_dump": (None, ["missing.safetensors", "dump files"]),
    "fractions": (None, ["split", "= 1"]),
    "markup_phrase": (None, ["[red]rather[/red]", "phrases[1].text"]),
    "unknown_solver_key": (None, ["solver", "max_anchor_per_word", "did you mean 'max_anchors_per_word'"]),
    "solver_type": (None, ["solver.wfld", "p_cap"]),
    "solver_plausible_end_p": (None, ["solver.ftpo.plausible_end_p", "[0.0, 1.0]", "2.0"]),
    "empty_phrase": (None, ["phrases[0].text"]),
    "margin_negative": (None, ["phrases[0].margin_scale", ">= 0"]),
}


def _bad_toml(kind: str, dumps) -> str:
    if kind == "toml_syntax":
        return BAD_TOML[kind][0]
    th = "[thresholds]\nmin_heldout_per_phrase = 1\nmin_train_per_phrase = 1\ncollateral_min_total = 1\ncollateral_min_per_word = 1\n"
    e = {
        "unknown_top_key": dict(top='name = "c"\nmodel = "base.gguf"\nvocab = "gguf"\nphrase = []\n'),
        "unknown_threshold": dict(thresholds=th + "kld_mx = 0.1\n"),
        "negative_kld": dict(thresholds=th + "kld_max = -1.0\n"),
        "probability_gt_1": dict(thresholds=th + "non_event_p = 2.0\n"),
        "salad_ngram_zero": dict(thresholds=th + "salad_ngram = 0\n"),
        "wrong_type": dict(thresholds=th + 'salad_ngram = "4"\n'),
        "missing_dump": dict(sets='[sets]\nbackground = ["missing.safetensors"]\n'),
        "fractions": dict(split='[split]\npool = ["pool*.safetensors"]\ntrain = 0.9\ndev = 0.5\nheldout = 0.5\n'),
        "markup_phrase": dict(phrases='[[phrases]]\ntext = "[red]rather[/red]"\n\n[[phrases]]\n'
                                      'text = "[red]rather[/red]"\n'),
        "unknown_solver_key": dict(solver="[solver]\nmax_anchor_per_word = 4\n"),
        "solver_type": dict(solver='[solver.wfld]\np_cap = "high"\n'),
        "solver_plausible_end_p": dict(solver="[solver.ftpo]\nplausible_end_p = 2.0\n"),
        "empty_phrase": dict(phrases='[[phrases]]\ntext = "   "\n'),
        "margin_negative": dict(phrases='[[phrases]]\ntext = "rather than"\nmargin_scale = -1.0\n'),
    }[kind]
    return _toml(dumps, **e)


CASES = [
    # --- inspect
    ("inspect_dir", ["inspect", "{a_folder}"], 2, ["a_folder", "config.json"]),
    ("inspect_missing", ["inspect", "{T}/nothing.gguf"], 2, ["nothing.gguf", "expected an existing"]),
    ("inspect_empty", ["inspect", "{empty.gguf}"], 2, ["empty.gguf"]),
    ("inspect_truncated_gguf", ["inspect", "{truncated.gguf}"], 2, ["truncated.gguf"]),
    ("inspect_text_as_gguf", ["inspect", "{not_a_gguf.gguf}"], 2, ["not_a_gguf.gguf"]),
    ("inspect_truncated_dump", ["inspect", "{truncated.safetensors}"], 2, ["truncated.safetensors"]),
    ("inspect_binary", ["inspect", "{binary.bin}"], 2, ["binary.bin"]),
    # --- score
    ("score_tsv_is_model", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--tsv", "{base.gguf}"], 2,
     ["base.gguf", "--tsv", "base model"]),
    ("score_tsv_is_dump", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--tsv",
                           "{pool0.safetensors}"], 2, ["pool0.safetensors", "--tsv"]),
    ("score_tsv_is_dir", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--tsv", "{a_folder}"], 2,
     ["a_folder", "--tsv", "directory"]),
    ("score_tsv_under_file", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--tsv",
                              "{notes.txt}/x.tsv"], 2, ["notes.txt", "--tsv"]),
    ("score_tsv_foreign_file", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--tsv",
                                "{T}/mine.tsv"], 2, ["mine.tsv", "--tsv", "--force"], {"mine.tsv": "my data\n"}),
    ("score_ledger_is_model", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--ledger",
                               "{base.gguf}"], 2, ["base.gguf", "--ledger"]),
    ("score_ledger_corrupt", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--ledger",
                              "{ledger_bad.jsonl}"], 2, ["ledger_bad.jsonl", "line 2"]),
    ("score_ledger_binary", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--ledger",
                             "{binary.bin}"], 2, ["binary.bin", "ledger"]),
    ("score_model_missing", ["score", "{pool0.safetensors}", "--model", "{T}/none.gguf"], 2, ["none.gguf"]),
    ("score_model_is_dump", ["score", "{pool0.safetensors}", "--model", "{bg.safetensors}"], 2,
     ["bg.safetensors"]),
    ("score_model_text", ["score", "{pool0.safetensors}", "--model", "{not_a_gguf.gguf}"], 2, ["not_a_gguf.gguf"]),
    ("score_dump_missing", ["score", "{T}/gone.safetensors", "--model", "{base.gguf}"], 2, ["gone.safetensors"]),
    ("score_dump_truncated", ["score", "{truncated.safetensors}", "--model", "{base.gguf}"], 2,
     ["truncated.safetensors"]),
    ("score_other_model", ["score", "{other_model.safetensors}", "--model", "{base.gguf}"], 2,
     ["other_model.safetensors", "meta.model", "abababababab", "--allow-other-model"]),
    ("score_other_dims", ["score", "{other_dims.safetensors}", "--model", "{base.gguf}"], 2,
     ["other_dims.safetensors", "n"]),
    ("score_nan_target", ["score", "{pool0.safetensors}", "--model", "{nan_target.gguf}"], 2,
     ["nan_target.gguf", "ffn_down_shexp", "finite", "first"]),
    ("score_nan_head", ["score", "{pool0.safetensors}", "--model", "{nan_head.gguf}"], 2,
     ["nan_head.gguf", "output.weight", "finite", "first"]),
    ("score_nan_bundle", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--bundle",
                          "{nan_target.gguf}"], 2, ["nan_target.gguf", "ffn_down_shexp", "finite"]),
    ("score_bundle_text", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--bundle",
                           "{not_a_gguf.gguf}"], 2, ["not_a_gguf.gguf"]),
    ("score_policy", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--policy", "fast"], 2,
     ["policy", "fast"]),
    # --- dump
    ("dump_out_is_file", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{notes.txt}"], 2,
     ["notes.txt", "--out", "existing file"]),
    ("dump_out_under_file", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{notes.txt}/d"], 2,
     ["notes.txt", "--out"]),
    ("dump_inputs_missing", ["dump", "{T}/none.jsonl", "--model", "{base.gguf}", "--out", "{T}/d"], 2,
     ["none.jsonl"]),
    ("dump_model_text", ["dump", "{docs.jsonl}", "--model", "{not_a_gguf.gguf}", "--out", "{T}/d"], 2,
     ["not_a_gguf.gguf"]),
    ("dump_engine", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d", "--engine", "vllm"], 2,
     ["--engine", "vllm"]),
    ("dump_out_is_model", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{base.gguf}"], 2,
     ["base.gguf", "--out"]),
    ("dump_out_holds_foreign_file", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d"], 2,
     ["d0.safetensors", "--out", "another kind", "'d0'"], {"d/d0.safetensors": "a user's file, not a dump\n"}),
    ("dump_out_holds_foreign_refused", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d"], 2,
     ["d0.safetensors.refused", "--out", "another kind"], {"d/d0.safetensors.refused": "mine\n"}),
    # --- sets
    ("sets_json_is_experiment", ["sets", "{exp.toml}", "--json", "{exp.toml}"], 2, ["exp.toml", "--json",
                                                                                   "experiment"]),
    ("sets_json_is_model", ["sets", "{exp.toml}", "--json", "{base.gguf}"], 2, ["base.gguf", "--json"]),
    ("sets_json_is_dump", ["sets", "{exp.toml}", "--json", "{bg.safetensors}"], 2, ["bg.safetensors", "--json"]),
    ("sets_json_foreign", ["sets", "{exp.toml}", "--json", "{T}/mine.json"], 2, ["mine.json", "--force"],
     {"mine.json": '{"mine": 1}'}),
    ("sets_json_dir", ["sets", "{exp.toml}", "--json", "{a_folder}"], 2, ["a_folder", "directory"]),
    ("sets_ledger_corrupt", ["sets", "{exp.toml}", "--ledger", "{ledger_bad.jsonl}"], 2,
     ["ledger_bad.jsonl", "line 2"]),
    ("sets_experiment_dir", ["sets", "{a_folder}"], 2, ["a_folder"]),
    ("sets_experiment_binary", ["sets", "{binary.bin}"], 2, ["binary.bin"]),
    ("sets_other_model_dump", ["sets", "{T}/e.toml"], 2, ["other_model.safetensors", "meta.model",
                                                           "abababababab", "--allow-other-model"],
     {"e.toml": "other_model"}),
    *[(f"sets_{k}", ["sets", "{T}/e.toml"], 2, ["e.toml", *v[1]], {"e.toml": f"bad:{k}"})
      for k, v in BAD_TOML.items() if not k.startswith(("unknown_solver", "solver_"))],
    # --- solve
    ("solve_out_is_model", ["solve", "{exp.toml}", "--out", "{base.gguf}"], 2, ["base.gguf", "--out",
                                                                                "base model"]),
    ("solve_out_is_dump", ["solve", "{exp.toml}", "--out", "{pool1.safetensors}"], 2, ["pool1.safetensors",
                                                                                       "--out"]),
    ("solve_out_is_experiment", ["solve", "{exp.toml}", "--out", "{exp.toml}"], 2, ["exp.toml", "--out"]),
    ("solve_out_dir", ["solve", "{exp.toml}", "--out", "{a_folder}"], 2, ["a_folder", "directory"]),
    ("solve_out_foreign", ["solve", "{exp.toml}", "--out", "{T}/mine.gguf"], 2, ["mine.gguf", "--force"],
     {"mine.gguf": "not a bundle\n"}),
    ("solve_out_under_file", ["solve", "{exp.toml}", "--out", "{notes.txt}/b.gguf"], 2, ["notes.txt", "--out"]),
    ("solve_ledger_corrupt", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--ledger", "{ledger_bad.jsonl}"],
     2, ["ledger_bad.jsonl", "line 2"]),
    ("solve_ledger_is_model", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--ledger", "{base.gguf}"], 2,
     ["base.gguf", "--ledger"]),
    ("solve_method", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--method", "adam"], 2, ["method", "adam"]),
    ("solve_sets_not_json", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--sets", "{notes.txt}"], 2,
     ["notes.txt", "sets report"]),
    ("solve_nan_model", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--model", "{nan_target.gguf}",
                         "--allow-other-model"], 2,
     ["nan_target.gguf", "ffn_down_shexp", "finite"]),
    ("solve_unknown_solver_key", ["solve", "{T}/e.toml", "--out", "{T}/b.gguf"], 2,
     ["e.toml", *BAD_TOML["unknown_solver_key"][1]], {"e.toml": "bad:unknown_solver_key"}),
    ("solve_solver_type", ["solve", "{T}/e.toml", "--out", "{T}/b.gguf"], 2,
     ["e.toml", *BAD_TOML["solver_type"][1]], {"e.toml": "bad:solver_type"}),
    ("solve_plausible_end_p", ["solve", "{T}/e.toml", "--out", "{T}/b.gguf"], 2,
     ["e.toml", *BAD_TOML["solver_plausible_end_p"][1]], {"e.toml": "bad:solver_plausible_end_p"}),
    ("solve_salad_zero", ["solve", "{T}/e.toml", "--out", "{T}/b.gguf"], 2,
     ["e.toml", *BAD_TOML["salad_ngram_zero"][1]], {"e.toml": "bad:salad_ngram_zero"}),
    # --- --json outputs go through the same policy (issue 14 item 1: every file a command writes)
    ("solve_json_is_model", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{base.gguf}"], 2,
     ["base.gguf", "--json", "base model"]),
    ("solve_json_is_experiment", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{exp.toml}"], 2,
     ["exp.toml", "--json", "experiment"]),
    ("solve_json_is_dump", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{pool2.safetensors}"], 2,
     ["pool2.safetensors", "--json", "dump of set"]),
    ("solve_json_foreign", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{T}/r.json"], 2,
     ["r.json", "--json", "--force"], {"r.json": '{"mine": 1}'}),
    ("solve_json_dir", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{a_folder}"], 2,
     ["a_folder", "--json", "directory"]),
    ("solve_json_is_record", ["solve", "{exp.toml}", "--out", "{T}/b.gguf", "--json", "{T}/b.gguf.solve.json"],
     2, ["b.gguf.solve.json", "--json", "solve record"]),
    ("audit_json_is_model", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                             "--out", "{T}/a", "--json", "{base.gguf}"], 2, ["base.gguf", "--json", "base model"]),
    ("audit_json_is_bundle", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                              "--out", "{T}/a", "--json", "{bundle.gguf}"], 2, ["bundle.gguf", "--json", "bundle"]),
    ("audit_json_foreign", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                            "--out", "{T}/a", "--json", "{report_other.json}"], 2,
     ["report_other.json", "--json", "--force"]),
    ("audit_json_dir", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                        "--out", "{T}/a", "--json", "{a_folder}"], 2, ["a_folder", "--json", "directory"]),
    ("audit_json_in_report_dir", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                                  "--out", "{T}/a", "--json", "{T}/a/report.md"], 2,
     ["report.md", "--json", "--out (report.md)"]),
    ("plan_json_is_experiment", ["plan", "{exp.toml}", "--json", "{exp.toml}"], 2, ["exp.toml", "--json",
                                                                                    "experiment"]),
    ("plan_json_is_model", ["plan", "{exp.toml}", "--json", "{base.gguf}"], 2, ["base.gguf", "--json"]),
    ("plan_json_foreign", ["plan", "{exp.toml}", "--json", "{notes.txt}"], 2, ["notes.txt", "--json", "--force"]),
    ("plan_json_under_file", ["plan", "{exp.toml}", "--json", "{notes.txt}/p.json"], 2, ["notes.txt", "--json"]),
    ("plan_sets_not_json", ["plan", "{exp.toml}", "--sets", "{binary.bin}"], 2, ["binary.bin"]),
    ("plan_experiment_bad", ["plan", "{T}/e.toml"], 2, ["e.toml", "kld_mx"], {"e.toml": "bad:unknown_threshold"}),
    # --- audit
    ("audit_out_is_file", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                           "--out", "{notes.txt}"], 2, ["notes.txt", "--out", "existing file"]),
    ("audit_out_foreign_report", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment",
                                  "{exp.toml}", "--out", "{T}/a"], 2, ["report.json", "--out", "--force"],
     {"a/report.json": '{"schema": "mine"}'}),
    ("audit_nan_bundle", ["audit", "{nan_target.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                          "--out", "{T}/a"], 2, ["nan_target.gguf", "ffn_down_shexp", "finite"]),
    ("audit_bundle_text", ["audit", "{not_a_gguf.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                           "--out", "{T}/a"], 2, ["not_a_gguf.gguf"]),
    ("audit_ledger_corrupt", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{exp.toml}",
                              "--out", "{T}/a", "--ledger", "{ledger_bad.jsonl}"], 2, ["ledger_bad.jsonl", "line 2"]),
    ("audit_dev_report_garbage", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment",
                                  "{exp.toml}", "--out", "{T}/a", "--blind", "{bg.safetensors}", "--dev", "{notes.txt}"], 2,
     ["notes.txt"]),
    ("audit_base_is_bundle_dir", ["audit", "{bundle.gguf}", "--base", "{a_folder}", "--experiment",
                                  "{exp.toml}", "--out", "{T}/a"], 2, ["a_folder"]),
    ("audit_experiment_bad", ["audit", "{bundle.gguf}", "--base", "{base.gguf}", "--experiment", "{T}/e.toml",
                              "--out", "{T}/a"], 2, ["e.toml", "kld_mx"], {"e.toml": "bad:unknown_threshold"}),
    # --- penalty
    ("penalty_out_is_model", ["penalty", "{exp.toml}", "--out", "{base.gguf}"], 2, ["base.gguf", "--out"]),
    ("penalty_out_is_experiment", ["penalty", "{exp.toml}", "--out", "{exp.toml}"], 2, ["exp.toml", "--out"]),
    ("penalty_out_dir", ["penalty", "{exp.toml}", "--out", "{a_folder}"], 2, ["a_folder", "directory"]),
    ("penalty_out_foreign", ["penalty", "{exp.toml}", "--out", "{T}/p.json"], 2, ["p.json", "--force"],
     {"p.json": "[1, 2]"}),
    ("penalty_form", ["penalty", "{exp.toml}", "--out", "{T}/p.json", "--form", "fuzzy"], 2, ["form", "fuzzy"]),
    ("penalty_bias_nan", ["penalty", "{exp.toml}", "--out", "{T}/p.json", "--bias", "nan"], 2, ["bias", "nan"]),
    ("penalty_bias_negative", ["penalty", "{exp.toml}", "--out", "{T}/p.json", "--bias", "-3"], 2,
     ["bias", "-3"]),
    # --- transplant
    ("transplant_out_is_base", ["transplant", "{overlay.gguf}", "{base.gguf}", "{base.gguf}"], 2,
     ["base.gguf", "base model"]),
    ("transplant_out_is_overlay", ["transplant", "{overlay.gguf}", "{base.gguf}", "{overlay.gguf}"], 2,
     ["overlay.gguf", "overlay"]),
    ("transplant_out_dir", ["transplant", "{overlay.gguf}", "{base.gguf}", "{a_folder}"], 2,
     ["a_folder", "directory"]),
    ("transplant_out_foreign", ["transplant", "{overlay.gguf}", "{base.gguf}", "{notes.txt}"], 2,
     ["notes.txt", "--force"]),
    ("transplant_overlay_text", ["transplant", "{not_a_gguf.gguf}", "{base.gguf}", "{T}/o.gguf"], 2,
     ["not_a_gguf.gguf"]),
    ("transplant_other_base", ["transplant", "{overlay.gguf}", "{nan_head.gguf}", "{T}/o.gguf"], 2,
     ["overlay.gguf", "overlay_of", "nan_head.gguf"]),
    ("transplant_base_missing", ["transplant", "{overlay.gguf}", "{T}/none.gguf", "{T}/o.gguf"], 2,
     ["none.gguf"]),
    # --- demo
    ("demo_out_is_file", ["demo", "--out", "{notes.txt}"], 2, ["notes.txt", "--out"]),
    ("demo_out_foreign_folder", ["demo", "--out", "{T}/d", "--fresh"], 2, ["--out", "other files"],
     {"d/mine.txt": "my file\n"}),
    ("demo_out_user_file_in_dumps", ["demo", "--out", "{T}/d"], 2, ["bundle.gguf", "--out"],
     {"d/.l47-demo-manifest.json": '{"files": [], "dirs": []}', "d/bundle.gguf": "mine\n"}),
    # --- bench
    ("bench_json_dir", ["bench", "--no-real", "--json", "{a_folder}"], 2, ["a_folder", "directory"]),
    ("bench_T_zero", ["bench", "--no-real", "-T", "0"], 2, ["-T", ">= 1", "0"]),
    # --- shared options (checked before any command runs)
    ("score_device_unknown", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--device", "tpu"], 2,
     ["--device", "'tpu'"]),
    ("score_device_absent", ["score", "{pool0.safetensors}", "--model", "{base.gguf}", "--device", "cuda:9"], 2,
     ["--device", "cuda:9"]),
    ("dump_max_new_tokens_zero", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d",
                                  "--generate", "--max-new-tokens", "0"], 2, ["--max-new-tokens", ">= 1"]),
    ("dump_top_p", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d", "--top-p", "2"], 2,
     ["--top-p", "[0.0, 1.0]"]),
    ("dump_temperature_nan", ["dump", "{docs.jsonl}", "--model", "{base.gguf}", "--out", "{T}/d",
                              "--temperature", "nan"], 2, ["--temperature", "nan"]),
    ("demo_prompts_zero", ["demo", "--out", "{T}/d", "--prompts", "0"], 2, ["--prompts", ">= 1"]),
]


def _argv(argv, world, tmp: Path) -> list[str]:
    root = world["root"]

    def fill(a: str) -> str:
        out = a.replace("{T}", str(tmp))
        while "{" in out:
            i, j = out.index("{"), out.index("}")
            out = out[:i] + str(root / out[i + 1:j]) + out[j + 1:]
        return out

    return [fill(a) for a in argv]


def _pre(world, tmp: Path, pre: dict) -> None:
    for rel, text in pre.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text == "other_model":
            text = _toml(world["dumps"], sets='[sets]\nbackground = ["' + str(world["root"] / "bg.safetensors")
                         + '"]\ncollateral_eval = ["' + str(world["root"] / "other_model.safetensors") + '"]\n',
                         top=f'name = "c"\nmodel = "{world["base"]}"\nvocab = "gguf"\n',
                         split='[split]\npool = ["' + str(world["root"]) + '/pool*.safetensors"]\n')
        elif text.startswith("bad:"):
            text = _bad_toml(text[4:], world["dumps"])
            text = text.replace('"base.gguf"', json.dumps(str(world["base"])))
            for name in list(TEXTS) + ["missing"]:
                text = text.replace(f'"{name}.safetensors"', json.dumps(str(world["root"] / f"{name}.safetensors")))
            text = text.replace('"pool*.safetensors"', json.dumps(str(world["root"] / "pool*.safetensors")))
        p.write_text(text)


def run_case(world, tmp: Path, argv, pre=None):
    tmp.mkdir(parents=True, exist_ok=True)
    _pre(world, tmp, pre or {})
    before_world, before_tmp = _sha_tree(world["root"]), _sha_tree(tmp)
    r = CliRunner().invoke(app, _argv(argv, world, tmp), catch_exceptions=True)
    return r, before_world, before_tmp


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed(world, tmp_path, case):
    name, argv, code, must = case[:4]
    pre = case[4] if len(case) > 4 else None
    tmp = tmp_path / "case"
    r, before_world, before_tmp = run_case(world, tmp, argv, pre)
    out = r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}\n{out}"
    assert "Traceback" not in out, out
    assert r.exit_code == code, out
    errs = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1, out
    for m in must:
        assert m in errs[0], f"{m!r} not in {errs[0]!r}"
    assert _sha_tree(world["root"]) == before_world, "an input changed"
    assert _sha_tree(tmp) == before_tmp, "partial output left behind"


def test_corpus_size():
    assert len(CASES) >= 60
    cmds = {c[1][0] for c in CASES}
    assert cmds >= {"inspect", "score", "dump", "sets", "solve", "audit", "penalty", "transplant", "demo", "plan"}


# ---------------------------------------------------------------------------------------------------------
# the positive side of the policy: what is allowed still works


def test_own_output_rerun_and_force(world, tmp_path):
    """A rerun may replace its own earlier output; --force replaces a foreign file; inputs stay untouched."""
    root = world["root"]
    before = _sha_tree(root)
    tsv = tmp_path / "pos.tsv"
    args = ["score", str(root / "pool0.safetensors"), "--model", str(world["base"]), "--tsv", str(tsv)]
    for _ in range(2):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
    assert tsv.read_text().startswith("doc\tpos\ttarget")
    mine = tmp_path / "mine.tsv"
    mine.write_text("my data\n")
    r = CliRunner().invoke(app, args[:-1] + [str(mine), "--force"])
    assert r.exit_code == 0 and mine.read_text().startswith("doc\tpos"), r.output
    assert _sha_tree(root) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine.tsv", "pos.tsv"]


def test_allow_other_model_is_recorded(world, tmp_path):
    exp = tmp_path / "e.toml"
    _pre(world, tmp_path, {"e.toml": "other_model"})
    out = tmp_path / "sets.json"
    r = CliRunner().invoke(app, ["sets", str(exp), "--json", str(out), "--allow-other-model"])
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
    warnings = json.loads(out.read_text())["warnings"]
    assert any("other_model.safetensors" in w and "--allow-other-model" in w for w in warnings), warnings


def test_demo_folder_removes_only_its_own_files(tmp_path):
    """The demo's manifest: --fresh / a rerun remove only files the demo wrote, never a user's file or folder."""
    from l47.app.demo import MANIFEST, STALE, DemoFolder

    out = tmp_path / "demo"
    own = DemoFolder(out)  # a new folder
    (out / "dumps" / "generated").mkdir(parents=True)
    (out / "dumps" / "generated" / "p0.safetensors").write_text("dump")
    (out / "bundle.gguf").write_text("bundle")
    (out / "audit").mkdir()
    (out / "audit" / "report.json").write_text("{}")
    own.record()
    (out / "my_notes.txt").write_text("mine")  # the user's, added later
    (out / "my_folder").mkdir()
    again = DemoFolder(out)
    again.remove(STALE)  # a rerun: bundle and audit go, dumps stay (resumed)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        MANIFEST, "dumps", "dumps/generated", "dumps/generated/p0.safetensors", "my_folder", "my_notes.txt"]
    again.remove(None)  # --fresh: every file it wrote, and its emptied folders; the user's stay
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [MANIFEST, "my_folder", "my_notes.txt"]
