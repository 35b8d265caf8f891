"""`l47 inspect DUMP --text` (issue 35 item 7) on the malformed corpus's world: the synthetic qwen4exp GGUF with the
tiny BPE vocabulary, dumps of rendered text (synthetic states), a bundle of a small ΔW.

References (independent of the rendering):
  - the text: the printed pieces joined equal the tokenizer's decode of the dump's ids and the dump's own text;
  - events: the text up to an EVENT token ends with the phrase (case-insensitively), and the number of EVENT marks
    equals the phrase's occurrences in the text;
  - near misses: the token after the phrase's first word where the phrase does not go on (" rather" + " go");
  - turn ends: one TURN-END per chat turn with content, each on an <|im_end|> token;
  - Δlog p: log_softmax of the full [T, V] logits (small V here) of the tail forward with the base's and the bundle's
    target matrix, in f64, target entries subtracted; the 4-decimal print agrees to 5e-5 (rounding + 1e-6 nats
    between the streamed head and this full softmax).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from l47.app.cli import app

sys.path.insert(0, str(Path(__file__).parent))
from test_malformed import DIMS_KW, _meta, make_world  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    return make_world(tmp_path_factory.mktemp("text_world"), tmp_path_factory.mktemp("text_build"), tiny_tokenizer_kv)


def _invoke(*a):
    return CliRunner().invoke(app, [str(x) for x in a])


def _rows(output: str) -> list[tuple[int, str, str, str, str]]:
    """(index, role, token text, marks, Δlog p) of each token line of the plain rendering."""
    out = []
    for ln in output.splitlines()[2:]:
        m = re.match(r"^\s*(\d+)  (\S+)\s+('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\s*(.*?)\s*([+-]\d+\.\d{4})?$", ln)
        assert m, ln
        out.append((int(m[1]), m[2], eval(m[3]), m[4].strip(), m[5] or ""))  # noqa: S307 - a repr we printed
    return out


def _dump_of(world, tmp_path, name, ids, role, text, **meta):
    from l47.dumps import write_dump
    from l47.testing.synth import SynthDims, synth_dump_arrays

    a = synth_dump_arrays(SynthDims(**DIMS_KW), len(ids) - 1, seed=7)
    a["tokens"], a["role"] = np.asarray(ids, dtype=np.int32), np.asarray(role, dtype=np.uint8)
    return write_dump(tmp_path / f"{name}.safetensors", a, _meta(name, world["w"], text, **meta))


def test_text_events_and_plain_marks(world):
    from l47.dumps import read_dump
    from l47.model.vocab import vocab_from_gguf
    from l47.model.gguf_io import open_gguf

    dump = world["dumps"]["pool0"]
    r = _invoke("inspect", dump, "--text", "--experiment", world["root"] / "exp.toml")
    assert r.exit_code == 0, r.output
    rows = _rows(r.output)
    d = read_dump(dump)
    v = vocab_from_gguf(open_gguf(world["base"]))
    assert [i for i, *_ in rows] == list(range(d.T + 1))
    assert "".join(t for _, _, t, _, _ in rows) == v.decode(np.asarray(d.tokens)) == d.meta.text
    assert all(role == "assistant" for _, role, *_ in rows[1:])  # a plain document rendered as assistant text
    text = d.meta.text
    for phrase in ("rather than", "end to end"):
        ev = [i for i, _, _, mk, _ in rows if f"EVENT[{phrase}]" in mk]
        assert len(ev) == len(re.findall(re.escape(phrase), text, flags=re.I)) >= 1, (phrase, ev)
        for i in ev:
            upto = "".join(t for _, _, t, _, _ in rows[: i + 1])
            assert upto.lower().endswith(phrase), (phrase, upto)


def test_near_miss_and_turn_ends(world, tmp_path):
    from l47.dumps.chat import render_chat, render_plain
    from l47.model.gguf_io import open_gguf
    from l47.model.vocab import vocab_from_gguf

    v = vocab_from_gguf(open_gguf(world["base"]))
    text = "I would rather go home than stay, rather than wait."
    ids, role = render_plain(text, v)
    p = _dump_of(world, tmp_path, "near", ids, role, text)
    r = _invoke("inspect", p, "--text", "--model", world["base"], "--phrase", "rather than")
    assert r.exit_code == 0, r.output
    rows = _rows(r.output)
    near = [i for i, _, _, mk, _ in rows if "near-miss[rather than]" in mk]
    pieces = [t for _, _, t, _, _ in rows]
    assert len(near) == 1, rows  # after the phrase's prefix " rather", the text goes on with " go", not " than"
    assert "".join(pieces[: near[0]]).endswith("I would rather") and "".join(pieces[near[0]:]).startswith(" go")
    assert sum("EVENT[rather than]" in mk for *_, mk, _ in rows) == 1

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How long?"},
            {"role": "assistant", "content": "Rather than guess: seven minutes."}]
    ids, role = render_chat(msgs, v)
    text = v.decode(ids)
    prov = {r: "written" for r in ("template", "system", "user", "assistant")}
    p = _dump_of(world, tmp_path, "chat", ids, role, text, provenance=prov)
    r = _invoke("inspect", p, "--text", "--model", world["base"], "--phrase", "rather than")
    assert r.exit_code == 0, r.output
    rows = _rows(r.output)
    ends = [i for i, _, _, mk, _ in rows if "TURN-END" in mk]
    assert len(ends) == 3 and all(ids[i] == v.special_ids["<|im_end|>"] for i in ends)
    assert {role for _, role, *_ in rows[1:]} >= {"system", "user", "assistant", "template"}
    assert sum("EVENT[rather than]" in mk for *_, mk, _ in rows) == 1  # "Rather than" at the turn's start


def test_bundle_dlogp_matches_full_softmax(world):
    from l47.dumps import read_dump
    from l47.model.weights import edited_weight, load_tail_weights
    from l47.tail.forward import full_logits, mix_of_dump

    dump = world["dumps"]["pool1"]
    r = _invoke("inspect", dump, "--text", "--experiment", world["root"] / "exp.toml", "--bundle", world["bundle"])
    assert r.exit_code == 0, r.output
    rows = _rows(r.output)
    got = np.array([float(x) for *_, x in rows[1:]])  # [T]
    d = read_dump(dump)
    w = load_tail_weights(world["base"], policy="strata")
    W_new, _ = edited_weight(w, world["bundle"])
    tgt = torch.tensor(np.asarray(d.tokens[1:], dtype=np.int64))
    with torch.no_grad():
        lp = [torch.log_softmax(full_logits(mix_of_dump(d, w, W_sd=W), w).double(), -1)  # [T, V] f64, V = 1024
              .gather(1, tgt[:, None])[:, 0] for W in (None, W_new)]
    want = (lp[1] - lp[0]).numpy()
    assert np.abs(want).max() > 1e-3  # the bundle moves something: the check is not vacuous
    # the column is printed to 4 decimals (rounding: ≤ 5e-5) of an exact forward with f32 logits (≤ 2e-6 from the
    # f64 reference at these sizes): a bound of 5e-5 alone failed once at 5.05e-5 in a fresh clone
    assert np.abs(got - want).max() <= 5e-5 + 2e-6


def test_text_input_errors(world, tmp_path):
    dump = world["dumps"]["pool0"]
    r = _invoke("inspect", dump, "--text")
    assert r.exit_code == 2 and "--experiment" in r.output and "Traceback" not in r.output
    r = _invoke("inspect", dump, "--phrase", "rather than")
    assert r.exit_code == 2 and "--phrase" in r.output and "only with --text" in " ".join(r.output.split())
    r = _invoke("inspect", world["root"] / "other_model.safetensors", "--text", "--model", world["base"],
                "--bundle", world["bundle"])
    assert r.exit_code == 2 and "meta.model" in r.output, r.output


def test_terminal_rendering_flows_the_text_with_the_events_dlogp(world):
    """On a terminal: the text as written (role labels inserted), colour codes present, and each event's Δlog p
    listed — the same numbers as the plain rows (3 decimals)."""
    from rich.console import Console

    from l47.app.inspect_text import TextArgs, build_text_view, print_text, render_plain

    view = build_text_view(TextArgs(world["dumps"]["pool1"], world["root"] / "exp.toml", (), None, world["bundle"]))
    con = Console(force_terminal=True, color_system="truecolor", width=100, record=True)
    print_text(view, con)
    coloured = con.export_text(styles=True, clear=False)
    shown = con.export_text(styles=False)
    flat = "".join(shown.splitlines())
    assert "".join(m.text for m in view.tokens[1:]).replace("\n", "") in flat.replace("[assistant]", "")
    assert "\x1b[" in coloured
    ev = [m for m in view.tokens if m.event]
    assert ev and all(f"#{m.i} {m.event!r} {m.dlogp:+.3f}" in flat for m in ev)
    plain = {int(ln.split()[0]): ln for ln in render_plain(view)[2:]}
    assert all(f"{m.dlogp:+.4f}" in plain[m.i] for m in ev)
