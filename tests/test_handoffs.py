"""Hand-offs carry the content hash of what they were made from (issue 35 items 2 and 10), through the real CLI.

The world is test_malformed's solvable one (synthetic qwen4exp GGUF with the tiny BPE vocabulary, six dumps of
rendered text, det.toml with a [split] pool); its sets report is made once by `l47 sets --json`. Each stale
hand-off is built from it (a phrase removed, a threshold moved, a document added, another split, a report edited
by hand or written before hand-offs were stamped) and handed to `l47 plan` / `l47 solve --sets`: exit 2, ONE
`error:` line naming both hashes (each recomputed here from the experiment file) and what changed, nothing
written, every input byte-identical afterwards (sha256 of every file of the world). Controls: the same content
under other file names and bytes has the same hash (a document is its tokens), and the matching report plans.

The weakened rule (item 10) is tested threshold by threshold against a table written here from each threshold's
meaning (independent of the registry it is read from), each direction, and the floor of overlap_window.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from test_malformed import _sha_tree, make_solvable_world


def _token_sha(path) -> str:
    """Independent of l47: sha256 of the dump's token ids as little-endian int32 (safetensors reader)."""
    from safetensors.numpy import load_file

    return hashlib.sha256(load_file(str(path))["tokens"].astype("<i4").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def hw(tmp_path_factory, tiny_tokenizer_kv):
    w = make_solvable_world(tmp_path_factory, tiny_tokenizer_kv, "handoff")
    root = w["root"]
    det = (root / "det.toml").read_text()
    r = CliRunner().invoke(app, ["sets", str(root / "det.toml"), "--json", str(root / "sets.json")])
    assert r.exit_code in (0, 1) and (root / "sets.json").is_file(), r.output
    variants = {
        "phrase_removed": (det.replace('[[phrases]]\ntext = "end to end"\n', ""), "phrase removed: 'end to end'"),
        "threshold": (det.replace("non_event_p = 0.0", "non_event_p = 0.001"), "threshold non_event_p: 0.0 -> 0.001"),
        "document_added": (det.replace('background = ["bg.safetensors"]',
                                       'background = ["bg.safetensors"]\nchat_heldout = ["extra.safetensors"]'),
                           "document added to set chat_heldout (sha256 {extra}"),
        "other_split": (det.replace("seed = 0", "seed = 1"), "split seed: 0 -> 1"),
    }
    from l47.dumps import read_dump, write_dump
    from dataclasses import replace

    d = read_dump(root / "coll.safetensors")  # another document: coll's arrays, its tokens reversed
    arr = {k: np.array(v) for k, v in d.arrays().items()}
    arr["tokens"] = arr["tokens"][::-1].copy()
    write_dump(root / "extra.safetensors", arr, replace(d.meta, doc_id="extra"))
    for name, (text, _) in variants.items():
        assert text != det, name
        (root / f"v_{name}.toml").write_text(text)
    rep = json.loads((root / "sets.json").read_text())
    edited = {**rep, "content": {**rep["content"], "phrases": rep["content"]["phrases"][:1]}}
    (root / "sets_edited.json").write_text(json.dumps(edited))
    (root / "sets_old.json").write_text(json.dumps({k: v for k, v in rep.items()
                                                    if k not in ("content", "content_sha256")}))
    return dict(w, variants={k: v[1].format(extra=_token_sha(root / "extra.safetensors")[:12])
                             for k, v in variants.items()})


def _content_sha(exp_path) -> str:
    from l47.data.experiment import load_experiment
    from l47.data.sets import content_sha256, experiment_content

    return content_sha256(experiment_content(load_experiment(exp_path)))


def _refused(hw, tmp_path, argv) -> str:
    """Run the CLI; assert exit 2, one error line, no traceback, nothing written, the world byte-identical.
    Returns the error line."""
    root = hw["root"]
    before = _sha_tree(root)
    tmp_path.mkdir(exist_ok=True)
    r = CliRunner().invoke(app, argv, catch_exceptions=True)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1, r.output
    assert _sha_tree(root) == before and not any(tmp_path.iterdir())
    return errs[0]


@pytest.mark.parametrize("variant", ["phrase_removed", "threshold", "document_added", "other_split"])
@pytest.mark.parametrize("command", ["plan", "solve"])
def test_stale_sets_report_is_refused(hw, tmp_path, variant, command):
    root = hw["root"]
    exp = root / f"v_{variant}.toml"
    argv = [command, str(exp), "--sets", str(root / "sets.json")]
    argv += ["--out", str(tmp_path / "b.gguf")] if command == "solve" else []
    line = _refused(hw, tmp_path, argv)
    stored = json.loads((root / "sets.json").read_text())["content_sha256"]
    mine = _content_sha(exp)
    assert stored != mine
    assert str(root / "sets.json") in line and "sets report experiment content" in line
    assert mine[:16] in line and stored[:16] in line and str(exp) in line
    assert hw["variants"][variant] in line, line


@pytest.mark.parametrize("report,why", [("sets_edited.json", "edited after it was written"),
                                        ("sets_old.json", "written before hand-offs were stamped")])
def test_edited_or_unstamped_sets_report_is_refused(hw, tmp_path, report, why):
    root = hw["root"]
    line = _refused(hw, tmp_path, ["plan", str(root / "det.toml"), "--sets", str(root / report)])
    assert str(root / report) in line and why in line, line


def test_matching_sets_report_plans_and_identity_is_the_tokens(hw, tmp_path):
    """Control: the report of this very content is accepted by `l47 plan`; the content hash of the experiment
    with every dump re-saved under another name (other file bytes, other doc_id, same token ids) and listed from
    another folder is the report's."""
    from dataclasses import replace

    from l47.dumps import read_dump, write_dump

    root = hw["root"]
    rep = json.loads((root / "sets.json").read_text())
    assert rep["content_sha256"] == _content_sha(root / "det.toml")
    r = CliRunner().invoke(app, ["plan", str(root / "det.toml"), "--sets", str(root / "sets.json")])
    assert r.exit_code == 0, r.output
    other = tmp_path / "elsewhere"
    other.mkdir()
    text = (root / "det.toml").read_text()
    for p in sorted(root.glob("pool*.safetensors")) + [root / "coll.safetensors", root / "bg.safetensors"]:
        d = read_dump(p)
        new = other / f"renamed_{p.name}"
        write_dump(new, {k: np.array(v) for k, v in d.arrays().items()}, replace(d.meta, doc_id=f"x-{p.stem}"))
        assert new.read_bytes() != p.read_bytes() and _token_sha(new) == _token_sha(p)
    text = text.replace('"pool*.safetensors"', json.dumps(str(other / "renamed_pool*.safetensors")))
    text = re.sub(r'"(coll|bg)\.safetensors"', lambda m: json.dumps(str(other / f"renamed_{m.group(1)}.safetensors")),
                  text).replace('model = "base.gguf"', f"model = {json.dumps(str(root / 'base.gguf'))}")
    (other / "moved.toml").write_text(text)
    assert _content_sha(other / "moved.toml") == rep["content_sha256"]


def test_content_changes_name_what_changed(hw, tmp_path):
    """Explicit train/dev/heldout lists: one document added to heldout is named as such with its token sha256;
    the blind set is not part of the content (fresh blind documents are added for the sign-off)."""
    from l47.data.experiment import load_experiment
    from l47.data.sets import content_changes, content_sha256, experiment_content

    root = hw["root"]
    base = ('name = "x"\nmodel = "base.gguf"\nvocab = "gguf"\n[sets]\ntrain = ["pool0.safetensors"]\n'
            'dev = ["pool1.safetensors"]\nheldout = ["pool2.safetensors"{more}]\n{blind}'
            '[[phrases]]\ntext = "rather than"\n')
    a, b, c = (root / "ca.toml", root / "cb.toml", root / "cc.toml")
    try:
        a.write_text(base.format(more="", blind=""))
        b.write_text(base.format(more=', "pool3.safetensors"', blind=""))
        c.write_text(base.format(more="", blind='blind = ["bg.safetensors"]\n'))
        ca, cb, cc = (experiment_content(load_experiment(p)) for p in (a, b, c))
        assert content_changes(ca, cb) == [
            f"document added to set heldout (sha256 {_token_sha(root / 'pool3.safetensors')[:12]}…)"]
        assert content_changes(cb, ca) == [
            f"document removed from set heldout (sha256 {_token_sha(root / 'pool3.safetensors')[:12]}…)"]
        assert content_sha256(cc) == content_sha256(ca)
    finally:
        for p in (a, b, c):
            p.unlink()


# ----------------------------------------------------------------------------------------------------------
# item 10: the weakened rule, threshold by threshold

# the way each threshold moves to prove less, from what it means (not read from the registry):
EXPECTED_WEAKER = {
    "non_event_p": "lower",  # lower: near-zero p positions count as events (a.events accepts them)
    "heldout_frac": "lower", "min_heldout_per_phrase": "lower", "collateral_min_total": "lower",
    "min_train_per_phrase": "lower",  # plan / solve accept a thinner phrase
    "collateral_min_per_word": "lower", "slop_reduction": "lower",  # minimums
    "collateral_word_mean": "lower", "chat_ordinary_dlogp": "lower", "im_end_dlogp": "lower",  # Δlog p floors
    "collateral_below": "lower",  # a more negative cut counts fewer occurrences as damaged
    "collateral_frac_below": "higher", "kld_max": "higher", "chat_kld": "higher", "special_rise_tol": "higher",
    "blind_residual_factor": "higher", "blind_residual_abs": "higher", "zero_proxy_tol": "higher",  # maxima
    "ce_proxy_frac": "higher", "salad_max_ngram_repeat": "higher", "salad_max_dup_lines": "higher",  # guards
    "salad_ngram": "higher",  # longer n-grams repeat less: word salad passes
    "sampler_max_violation_frac": "higher", "sampler_tol": "higher",  # own-generation slack
    "overlap_window": "higher",  # a longer shared window is needed to call a document a copy
}


# (a value that proves less, a stricter value) per threshold: real settings a user might write
MOVED = {
    "non_event_p": (1e-3, 0.05), "heldout_frac": (0.2, 0.4), "min_heldout_per_phrase": (1, 5),
    "min_train_per_phrase": (2, 8),
    "collateral_min_total": (50, 300), "collateral_min_per_word": (1, 16), "slop_reduction": (0.3, 0.6),
    "collateral_word_mean": (-0.2, -0.02), "collateral_frac_below": (0.3, 0.05), "collateral_below": (-0.5, -0.05),
    "kld_max": (0.05, 0.005), "chat_ordinary_dlogp": (-0.1, -0.005), "chat_kld": (0.02, 0.002),
    "im_end_dlogp": (-0.05, -0.001), "special_rise_tol": (1e-3, 1e-8), "blind_residual_factor": (3.0, 1.2),
    "blind_residual_abs": (0.9, 0.3), "overlap_window": (200, 32), "zero_proxy_tol": (1e-2, 1e-4),
    "ce_proxy_frac": (2.0, 0.4), "salad_ngram": (8, 3), "salad_max_ngram_repeat": (0.9, 0.2),
    "salad_max_dup_lines": (0.9, 0.2), "sampler_max_violation_frac": (0.2, 0.0), "sampler_tol": (1.0, 1e-3),
}


def test_every_threshold_has_a_direction_from_the_registry():
    from dataclasses import fields

    from l47.data.experiment import Thresholds
    from l47.evals import bars as B

    ways = B.threshold_directions()
    assert {k: v[0] for k, v in ways.items()} == EXPECTED_WEAKER
    assert set(EXPECTED_WEAKER) == {f.name for f in fields(Thresholds)}


@pytest.mark.parametrize("name", sorted(EXPECTED_WEAKER))
def test_weakened_each_threshold_each_direction(name):
    """Moved the way that proves less: weakened, listing key, default and value; the other way, or at its
    default: not weakened. Values pass the experiment's own range checks (parse_thresholds)."""
    from l47.data.experiment import Thresholds, parse_thresholds
    from l47.evals import bars as B

    default = getattr(Thresholds(), name)
    w, s = MOVED[name]
    assert (w > default) == (EXPECTED_WEAKER[name] == "higher") and (s > default) == (w < default)  # the table
    assert B.weakened(parse_thresholds({})) == []
    assert B.weakened(parse_thresholds({name: default})) == []
    got = B.weakened(parse_thresholds({name: w}))
    assert [(x["key"], x["default"], x["value"]) for x in got] == [(name, default, w)]
    assert B.stamps(parse_thresholds({name: w}), None) == [f"weakened: {name} {w:g} (default {default:g})"]
    assert B.weakened(parse_thresholds({name: s})) == [] and B.stamps(parse_thresholds({name: s}), None) == []


def test_conflicting_directions_are_a_registry_error(monkeypatch):
    from l47.evals import bars as B

    reg = dict(B.REGISTRY)
    monkeypatch.setattr(B, "REGISTRY", reg)
    B.register("test.conflict", family="t", direction=B.GE, threshold="kld_max", aggregation="-", definition="-")(
        lambda ev: B.Measure(None))
    with pytest.raises(ValueError, match="kld_max"):
        B.threshold_directions()


@pytest.mark.parametrize("value,ok", [(0, False), (15, False), (16, True), (64, True)])
def test_overlap_window_floor(hw, tmp_path, value, ok):
    from l47.data.experiment import parse_thresholds

    if ok:
        assert parse_thresholds({"overlap_window": value}).overlap_window == value
        return
    root = hw["root"]
    exp = root / f"ow{value}.toml"
    exp.write_text((root / "det.toml").read_text().replace("[thresholds]\n", f"[thresholds]\noverlap_window = {value}\n"))
    try:
        line = _refused(hw, tmp_path, ["sets", str(exp), "--json", str(tmp_path / "s.json")])
    finally:
        exp.unlink()
    assert "thresholds.overlap_window" in line and "at least 16" in line and f"found {value}" in line, line


@pytest.mark.parametrize("sampler,wider", [
    ({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 1e-30}, True),  # min-p alone admits every token
    ({"temperature": 1.0, "top_k": 0, "top_p": 1.0}, True),  # no cut at all
    ({"temperature": 1.0, "top_k": 100, "top_p": 1.0}, True),  # a top-k beyond what the check keeps (64)
    ({"temperature": 1.5, "top_k": 0, "top_p": 0.9}, True),  # top-p above temperature 1 is not bounded
    ({"temperature": 0.7, "top_k": 20, "top_p": 0.8}, False),  # the toolkit's own defaults (l47 dump --generate)
    ({"temperature": 1.0, "top_k": 64, "top_p": 1.0}, False),
    ({"temperature": 0.7, "top_k": 0, "top_p": 0.95}, False),
    ({"temperature": 0.0, "top_k": 0, "top_p": 1.0}, False),  # greedy
])
def test_sampler_wider_than_the_toolkit(sampler, wider):
    from l47.app.dumping import GenerateOptions
    from l47.data.sets import sampler_wider

    g = GenerateOptions()
    assert sampler_wider({"generation": {"sampler": {"temperature": g.temperature, "top_k": g.top_k,
                                                     "top_p": g.top_p}}}) is None
    why = sampler_wider({"assistant": "generated", "generation": {"sampler": sampler}})
    assert (why is not None) == wider
    if wider:
        assert "wider than the toolkit's own generation settings" in why


# ------------------------------------------------------------------------------------------------------------
# the plan's hand-off: `l47 plan --json plan.json` -> `l47 solve --plan plan.json` computes the plan once


def _canonical_sha(obj) -> str:
    """Independent of l47: sha256 of the UTF-8 JSON with sorted keys and no spaces."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def planned(hw, tmp_path_factory):
    """The plan of det.toml as JSON, a solve that reuses it (with the plan's own computation made to fail: it must
    not run) and one that plans for itself (both defaults)."""
    import l47.solvers.solve as solve_mod

    root, out = hw["root"], tmp_path_factory.mktemp("planned")
    base = ["--sets", str(root / "sets.json")]
    r = CliRunner().invoke(app, ["plan", str(root / "det.toml"), *base, "--json", str(out / "plan.json")])
    assert r.exit_code in (0, 1) and (out / "plan.json").is_file(), r.output
    runs = {}
    for name, extra in (("reused", ["--plan", str(out / "plan.json")]), ("fresh", [])):
        with pytest.MonkeyPatch.context() as mp:
            if extra:
                mp.setattr(solve_mod, "check_feasible", lambda *_a, **_k: pytest.fail("the plan was recomputed"))
            r = CliRunner().invoke(app, ["solve", str(root / "det.toml"), *base, *extra,
                                         "--out", str(out / f"{name}.gguf"), "--ledger", str(out / f"{name}.jsonl")])
        assert r.exit_code == 0, r.output
        runs[name] = r.output
    return {"dir": out, "plan": json.loads((out / "plan.json").read_text()), "runs": runs,
            "sets": json.loads((root / "sets.json").read_text())}


def test_solve_reuses_the_plan_and_writes_the_same_bytes(planned):
    """The reused plan changes nothing the solve writes: the bundle's and the record's bytes are those of a solve
    that planned for itself (the record keeps the feasibility plan; equal bytes = equal figures), and the solve
    says where its plan came from. The hand-off's hashes recomputed here (canonical JSON, hashlib)."""
    d, plan = planned["dir"], planned["plan"]
    assert (d / "reused.gguf").read_bytes() == (d / "fresh.gguf").read_bytes()
    rec_a, rec_b = (d / "reused.gguf.solve.json").read_text(), (d / "fresh.gguf.solve.json").read_text()
    assert rec_a == rec_b
    assert json.loads(rec_a)["claims"]["feasibility"] == plan["plan"]
    h = plan["handoff"]
    assert h["inputs_sha256"] == _canonical_sha(h["inputs"])
    assert h["body_sha256"] == _canonical_sha({"plan": plan["plan"], "solve_log": h["solve_log"]})
    assert h["inputs"]["sets_report_sha256"] == _canonical_sha(planned["sets"])  # the report as `l47 sets` wrote it
    assert h["inputs"]["solver"]["method"] == "ftpo" and h["inputs"]["head"] == {"device": "cpu", "precision": "auto"}
    assert "reused from" in planned["runs"]["reused"] and "reused from" not in planned["runs"]["fresh"]
    for line in h["solve_log"]:  # the lines a fresh solve logs of its own plan, word for word
        assert " ".join(line.split()) in " ".join(planned["runs"]["fresh"].split())


def test_plan_of_other_inputs_or_edited_is_refused(hw, planned, tmp_path):
    """A plan reused under another solver config or method, one edited by hand, a missing one, --plan without
    --sets or with --sweep: exit 2, one line naming the plan file, nothing written (the ledger included)."""
    root, d = hw["root"], planned["dir"]
    exp = root / "v_solver_target.toml"  # beside det.toml (its paths are relative): the same content, another solver
    exp.write_text((root / "det.toml").read_text() + "\n[solver]\ntarget_residual = 0.3\n")
    sets = ["--sets", str(root / "sets.json")]
    argv = ["--out", str(tmp_path / "b.gguf"), "--ledger", str(tmp_path / "ledger.jsonl")]
    theirs = planned["plan"]["handoff"]["inputs_sha256"]
    line = _refused(hw, tmp_path, ["solve", str(exp), *sets, "--plan", str(d / "plan.json"), *argv])
    assert str(d / "plan.json") in line and theirs[:16] in line and "solver.target_residual: 0.2 -> 0.3" in line, line
    det = str(root / "det.toml")
    line = _refused(hw, tmp_path, ["solve", det, *sets, "--method", "wfld", "--plan", str(d / "plan.json"), *argv])
    assert theirs[:16] in line and "solver.method: ftpo -> wfld" in line, line
    edited = dict(planned["plan"], plan={**planned["plan"]["plan"], "target": 0.5})
    (d / "edited.json").write_text(json.dumps(edited))
    line = _refused(hw, tmp_path, ["solve", det, *sets, "--plan", str(d / "edited.json"), *argv])
    assert str(d / "edited.json") in line and "edited after it was written" in line, line
    line = _refused(hw, tmp_path, ["solve", det, *sets, "--plan", str(d / "none.json"), *argv])
    assert str(d / "none.json") in line and "no such file" in line, line
    line = _refused(hw, tmp_path, ["solve", det, "--plan", str(d / "plan.json"), *argv])
    assert "--plan" in line and "--sets" in line, line
    line = _refused(hw, tmp_path, ["solve", det, *sets, "--plan", str(d / "plan.json"), "--sweep", *argv])
    assert "--plan" in line and "--sweep" in line, line
