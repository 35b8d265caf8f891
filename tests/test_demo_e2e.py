"""End to end on the shipped demo model, at reduced size: dump (hf engine, the model's own generations) ->
sets -> solve (the defaults: FTPO) -> audit -> blind sign-off on a fresh generation, plus the negative control. Asserts the
verdicts (the demo's exit code follows the dev AND blind verdicts) and every bar's value against a
recomputation from the written files: the hf engine's own log p stored in the dumps (ref_logp, an independent
forward: transformers' Qwen4Exp), the per-event rows of the report and the sets report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from l47.app.demo import DemoArgs, run_demo

LN_V = math.log(3072)  # the demo model's vocabulary


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    log = tmp_path_factory.mktemp("demo_log")  # the demo refuses a folder holding files it did not write
    console = Console(file=open(log / "console.txt", "w"), width=120)
    code = run_demo(DemoArgs(out=out, prompts=32, max_new_tokens=96), console)
    return out, code


def _rep(path: Path) -> dict:
    return json.loads(path.read_text())


def _bars(rep: dict) -> dict:
    return {b["name"]: b for b in rep["bars"]}


def _tsv(path: Path) -> list[dict]:
    """The audit's positions.tsv as rows (csv module, no quoting: the TSV escapes its own tabs)."""
    import csv

    csv.field_size_limit(1 << 30)
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))


def _engine_ce(path: str) -> float:
    """Base CE over content targets from the hf engine's own log p (transformers' forward, not l47's)."""
    from safetensors.numpy import load_file

    a = load_file(path)
    m = a["role"] != 0
    return float(-a["ref_logp"][m].astype(np.float64).mean())


def test_demo_exit_code_follows_the_verdicts(demo):
    out, code = demo
    s = json.loads((out / "demo_summary.json").read_text())
    dev, blind = _rep(out / "audit" / "report.json"), _rep(out / "audit-blind" / "report.json")
    ctl = _rep(out / "control" / "audit" / "report.json")
    assert dev["passed"] == all(b["passed"] for b in dev["bars"]) == s["passed"]
    assert blind["mode"] == "blind" and blind.get("status") != "started"  # a finished sign-off, not the stub
    assert blind["passed"] == all(b["passed"] for b in blind["bars"]) == s["blind_passed"]
    assert s["control_failed"] is True and ctl["passed"] is False
    assert code == (0 if dev["passed"] and blind["passed"] else 1)  # `make demo` fails when the sign-off fails
    assert sorted(s["failed_bars"]) == sorted(b["name"] for b in dev["bars"] if not b["passed"])
    assert sorted(s["blind_failed_bars"]) == sorted(b["name"] for b in blind["bars"] if not b["passed"])


def test_dev_bar_values_recomputed(demo):
    out, _ = demo
    rep = _rep(out / "audit" / "report.json")
    bars, sets = _bars(rep), _rep(out / "sets.json")
    docs = [d for d in rep["inputs"]["documents"] if not d["refused"]]
    # proxy.base_ce: the worst document's CE, each within 1e-3 of the engine's own figure
    ce = {d["path"]: _engine_ce(d["path"]) for d in docs}
    worst = max(ce, key=ce.get)
    b = bars["proxy.base_ce"]
    assert b["details"]["worst_doc"] == worst and b["value"] == pytest.approx(ce[worst], abs=1e-3)
    assert b["threshold"] == pytest.approx(0.5 * LN_V) and b["passed"] == (ce[worst] <= 0.5 * LN_V)
    # the held-out chats are the model's own generations, natural for it
    chats = [d for d in docs if d["set"] == "chat_heldout"]
    assert len(chats) >= 6 and all(ce[d["path"]] < 0.5 * LN_V for d in chats)
    # c.slop: the worst phrase's reduction, from the per-event rows; each p_before is the engine's own p
    rows = rep["slop"]["heldout"]["events"]
    per = {}
    for r in rows:
        per.setdefault(r["phrase"], []).append(r)
    red = {p: 1 - np.mean([r["p_after"] for r in rs]) / np.mean([r["p_before"] for r in rs]) for p, rs in per.items()}
    assert bars["c.slop"]["value"] == pytest.approx(min(red.values()), abs=1e-9)
    assert bars["c.slop"]["details"]["worst_phrase"] == min(red, key=red.get)
    from safetensors.numpy import load_file

    for r in rows[:20]:
        assert r["p_before"] == pytest.approx(math.exp(load_file(r["doc"])["ref_logp"][r["pos"]]), rel=2e-3)
    # minimum counts from the sets report
    ho = {p["phrase"]: 0 for p in sets["phrases"] if p["tuples"]}
    for e in sets["events"]:
        if e["set"] == "heldout":
            ho[e["phrase"]] += 1
    assert bars["c.min_heldout_per_phrase"]["value"] == min(ho.values())
    assert bars["c.min_heldout_per_phrase"]["passed"] == (min(ho.values()) >= rep["thresholds"]["min_heldout_per_phrase"])
    cw = {w: 0 for w in sets["collateral_words"]}
    for c in sets["collateral"]:
        if c["set"] == "collateral_eval":
            cw[c["word"]] += 1
    assert bars["d.min_per_word"]["value"] == min(cw.values()) and bars["d.min_total"]["value"] == sum(cw.values())
    # (f): the turn ends the solver protected are apart from the ones judged
    te = rep["chat"]["turn_ends"]
    rec = _rep(out / "bundle.gguf.solve.json")
    touched = {(t["doc_sha256"], t["pos"]) for t in rec["touched"]}
    assert te["protected"]["n"] > 0 and te["n"] > 0
    sha_of = {d["path"]: d["sha256"] for d in rep["inputs"]["documents"]}
    assert all((sha_of[r["doc"]], r["pos"]) not in touched for r in te["lost_rows"])
    # zero-proxy: every dump is verified (hf engine), so the bar is judged, not waived
    assert bars["proxy.zero_proxy"]["applicable"] and not rep["proxy"]["unverified"]
    assert not any(s.startswith("unverified") for s in rep["stamps"])


def test_blind_is_a_fresh_generation_scored_once(demo):
    from l47.app.demo import fresh_blind_chat
    from l47.data.ledger import Ledger
    from l47.dumps import read_dump
    from l47.dumps.select import phrases_to_tuples
    from l47.app.demo import BLIND_CHATS, MODEL, PHRASES
    from l47.model.vocab import vocab_for_model

    out, _ = demo
    s = json.loads((out / "demo_summary.json").read_text())
    blind = _rep(out / "audit-blind" / "report.json")
    chats = s["blind"]["chats"]
    docs = [read_dump(c["doc"]) for c in chats]
    assert len(docs) == BLIND_CHATS == len({d.sha256 for d in docs})  # the blind set: distinct fresh chats
    assert [b["sha256"] for b in blind["inputs"]["blind"]] == [d.sha256 for d in docs]
    assert blind["blind"]["n_docs"] == BLIND_CHATS and blind["blind"]["doc_sha256"] == [d.sha256 for d in docs]
    for c, d in zip(chats, docs):
        prov = d.meta.provenance
        assert prov["assistant"] == "generated" and prov["generation"]["model"] == d.meta.model
        assert _engine_ce(c["doc"]) < 0.5 * LN_V  # natural for the model
    # pooled over the set: the turn-end figure is the mean over every chat's turn ends (from positions.tsv)
    te = _bars(blind)["blind.f.turn_end_dlogp"]
    rows = [r for r in _tsv(out / "audit-blind" / "positions.tsv") if r["kind"] == "terminal"]
    assert len(rows) >= 3 * BLIND_CHATS and len({r["doc_sha256"] for r in rows}) == BLIND_CHATS
    assert te["value"] == pytest.approx(np.mean([float(r["dlogp"]) for r in rows]), abs=1e-6)
    # per phrase present: the absolute residual bar is the worst phrase's ratio from the blind event rows
    rows = blind["blind"]["slop"]["events"]
    per = {}
    for r in rows:
        per.setdefault(r["phrase"], []).append(r)
    ratio = {p: np.mean([r["p_after"] for r in rs]) / np.mean([r["p_before"] for r in rs]) for p, rs in per.items()}
    b = _bars(blind)["blind.slop_residual_abs"]
    assert rows and b["value"] == pytest.approx(max(ratio.values()), abs=1e-9) and b["threshold"] == 0.5
    # the ledger (the base model's, never deleted): started before the scoring, then the verdict
    led = Ledger.open(s["ledger"], docs[0].meta.model)
    for d in docs:
        assert [e.event for e in led.scored(d.sha256)] == ["blind-started", "blind-verdict"]
    # the next run would sign off on another fresh chat (next seed), never this one
    pts, _ = phrases_to_tuples(PHRASES, vocab_for_model(MODEL))
    nxt, how = fresh_blind_chat(MODEL, out, led, pts, 1000, None)
    assert how["seed"] > max(c["seed"] for c in chats) and read_dump(nxt).sha256 not in {d.sha256 for d in docs}
    assert not led.scored(read_dump(nxt).sha256)


def test_blind_scored_by_l47_score_is_refused_on_the_demo(demo, tmp_path):
    """The planted reuse on the real demo model: a fresh blind generation (never scored), re-saved under another
    name and scored by `l47 score --bundle`, is then refused as the blind document (same tokens, the base model's
    one ledger): exit 2's error, no report written, nothing appended by the refused sign-off."""
    from l47.app.demo import MODEL, PHRASES, fresh_blind_chat
    from l47.app.score import ScoreArgs, run_score
    from l47.data.ledger import Ledger
    from l47.dumps import read_dump
    from l47.dumps.select import phrases_to_tuples
    from l47.errors import L47Error
    from l47.evals.audit import AuditArgs, run_audit
    from l47.model.vocab import vocab_for_model
    from l47.testing.planted import resave

    out, _ = demo
    s = json.loads((out / "demo_summary.json").read_text())
    ledger = Path(s["ledger"])
    led = Ledger.open(ledger, read_dump(s["blind"]["chats"][0]["doc"]).meta.model)
    pts, _ = phrases_to_tuples(PHRASES, vocab_for_model(MODEL))
    fresh, _ = fresh_blind_chat(MODEL, tmp_path / "fresh", led, pts, 2000, None)
    sha = read_dump(fresh).sha256
    assert not led.scored(sha)
    copy = resave(fresh, tmp_path / "renamed.safetensors")
    assert read_dump(copy).sha256 == sha  # another file, the same tokens
    run_score(ScoreArgs(MODEL, (copy,), bundle=out / "bundle.gguf", ledger=ledger))
    assert [e.event for e in Ledger.open(ledger, led.base_sha256).scored(sha)] == ["scored"]
    with pytest.raises(L47Error, match="scored by `score`"):
        run_audit(AuditArgs(bundle=out / "bundle.gguf", base=MODEL, experiment=out / "experiment.toml",
                            out_dir=tmp_path / "blind", blind=fresh, dev_report=out / "audit" / "report.json",
                            ledger=ledger, plots=False))
    assert not (tmp_path / "blind" / "report.json").exists()
    assert [e.event for e in Ledger.open(ledger, led.base_sha256).scored(sha)] == ["scored"]


def test_negative_control_fails_for_the_right_reasons(demo):
    out, _ = demo
    bars = _bars(_rep(out / "control" / "audit" / "report.json"))
    assert not bars["d.word_mean"]["passed"]  # a final word suppressed everywhere
    assert not bars["a.prefix_exact"]["passed"]  # its record touched non-prefix positions


def test_planted_failures_on_the_demo(demo, tmp_path):
    """The model-agnostic planted failures (l47.testing.planted), built from this demo run's own experiment,
    bundle and dev report, each caught for its reason on the real demo model (a bar that already failed for the
    honest bundle must get strictly worse); a written chat claiming to be the model's own generation is refused
    as the blind document by proxy.own_generation, while the demo's real blind generation passes that bar."""
    from planted_check import check_all, dump_written_chat

    from l47.app.demo import MODEL
    from l47.testing.planted import HonestRun, plant_all, unnatural_text

    out, _ = demo
    run = HonestRun(out / "experiment.toml", MODEL, out / "bundle.gguf", out / "audit" / "report.json")
    forged = dump_written_chat(MODEL, tmp_path / "forged", "forged-chat", [
        {"role": "user", "content": "Could you look over the release checklist for tomorrow?"},
        {"role": "assistant", "content": "<think>\nThe list has five items.\n</think>\n\nThe checklist looks "
                                         "complete end to end. I would move the backup step before the migration "
                                         "and add a note about the rollback window."}])
    # (it holds a phrase: a blind set without a slop event is refused before any bar, issue 35 item 8)
    unnatural = dump_written_chat(MODEL, tmp_path / "unnatural", "unnatural-chat", [
        {"role": "user", "content": unnatural_text(MODEL, seed=1)},
        {"role": "assistant", "content": unnatural_text(MODEL, seed=2)}])
    plants = plant_all(run, tmp_path / "plants", forged=forged, unnatural=unnatural)
    assert len(plants) == 12
    check_all(plants, run, tmp_path / "audits")
    blind = _bars(_rep(out / "audit-blind" / "report.json"))["proxy.own_generation"]
    assert blind["passed"] and blind["value"] == 0.0  # the demo's real generation: every token its sampler's


@pytest.mark.parametrize("solver, label", [("", "3. solve (FTPO)"), ('\n[solver]\nmethod = "wfld"\n', "3. solve (WFLD)")])
def test_demo_solve_step_is_labelled_with_the_method_it_runs(tmp_path, monkeypatch, solver, label):
    """The step's title names the method the solve resolves from the demo's experiment (no [solver] table: the
    solver's default, FTPO), not a fixed name; the solve itself is stubbed out."""
    import io

    from l47.app import demo as D
    from l47.app import solve_report

    seen = []
    monkeypatch.setattr(solve_report, "solve_and_print", lambda args, console: seen.append(args.method))
    exp = tmp_path / "experiment.toml"
    exp.write_text('name = "x"\n' + solver)
    buf = io.StringIO()
    run = D._DemoRun(None, Console(file=buf, width=80), tmp_path, tmp_path / "m.gguf", type("L", (), {"path": None}))
    D._solve(run, exp, tmp_path / "sets.json")
    assert label in buf.getvalue() and seen == [None]  # the experiment file decides the method, not the demo


def test_blind_chat_skips_every_seed_already_in_the_ledger(tmp_path):
    """More consecutive seeds than BLIND_TRIES already burned (as a blind set's skipped seeds leave them for the
    next run): they are skipped without counting as misses, and the chat returned is the first fresh one."""
    from l47.app.demo import BLIND_TRIES, MODEL, PHRASES, fresh_blind_chat
    from l47.data.ledger import Ledger
    from l47.dumps import read_dump
    from l47.dumps.select import phrases_to_tuples
    from l47.model.gguf_io import open_gguf
    from l47.model.vocab import vocab_for_model

    pts, _ = phrases_to_tuples(PHRASES, vocab_for_model(MODEL))
    led = Ledger.open(tmp_path / "ledger.jsonl", open_gguf(MODEL).sha256())
    k, used = 0, []
    while len(used) < BLIND_TRIES + 1:  # burn the first BLIND_TRIES + 1 chats that hold an event
        p, how = fresh_blind_chat(MODEL, tmp_path / "gen", led, pts, 5000, None, k0=k)
        used.append((how["k"], read_dump(p).sha256))
        k = how["k"] + 1
    led.append([sha for _, sha in used], "b" * 64, "audit", "blind-started")
    p, how = fresh_blind_chat(MODEL, tmp_path / "gen", led, pts, 5000, None, k0=0)
    assert how["k"] > used[-1][0] and read_dump(p).sha256 not in {sha for _, sha in used}
    assert sum("already in the ledger" in x for x in how["skipped"]) == len(used)

