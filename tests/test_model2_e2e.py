"""model2 end to end at reduced size, as the efficacy benchmark runs it (scripts/bench_efficacy.py): dump (hf
engine) -> an experiment file with NO [solver] table -> sets -> WFLD solve -> audit. Figures re-derived here from
the written files: the stratified split's per-phrase events from sets.json, the model's base p at its
near-certain phrases, the per-phrase held-out residual from the audit's event rows, the bundle's bytes."""

from __future__ import annotations

import json
import math
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

TINY = {"prompts": 0, "pool_chat": 30, "heldout_chat": 3, "collateral": 8, "background": 4, "kld": 2, "blind": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import bench_efficacy as be

    out = tmp_path_factory.mktemp("model2")
    spec = be.specs()["model2"]
    res = be.run_model(spec, out, ("wfld",), be.BenchOptions(TINY, 32), lambda s: None)
    return out, res


def test_experiment_has_no_per_model_knob(run):
    out, _ = run
    exp = tomllib.loads((out / "experiment.toml").read_text())
    assert "solver" not in exp and "collateral" not in exp  # defaults only; collateral words from the phrases
    assert len(exp["phrases"]) == 5


def test_split_covers_every_phrase(run):
    out, res = run
    sets = json.loads((out / "sets.json").read_text())
    mine: dict[str, dict[str, int]] = {}
    for e in sets["events"]:
        mine.setdefault(e["phrase"], {}).setdefault(e["set"], 0)
        mine[e["phrase"]][e["set"]] += 1
    for ph, c in res["events"].items():
        assert {k: v for k, v in c.items() if v} == mine[ph], ph
        assert c["train"] >= 1 and c["heldout"] >= 1, (ph, c)  # stratified: nothing left without train/held-out
    # the model learned its near-certain phrases (an untrained model: ~1/V)
    for ph in ("above and beyond", "delve into", "second to none"):
        p = [e["p_base"] for e in sets["events"] if e["phrase"] == ph]
        assert len(p) >= 5 and np.mean(p) >= 0.98, (ph, np.mean(p))


def test_solve_and_audit_figures(run):
    out, res = run
    m = res["methods"]["wfld"]
    assert "solve_error" not in m and "audit_error" not in m, m
    assert math.isfinite(m["background_kl_exact"]) and m["background_kl_exact"] >= 0
    rep = json.loads((out / "wfld" / "audit" / "report.json").read_text())
    bars = {b["name"]: b for b in rep["bars"]}
    assert bars["bundle.only_target"]["passed"] and {k: v["value"] for k, v in m["bars"].items()} == \
        {k: b.get("value") for k, b in bars.items()}
    rows = rep["slop"]["heldout"]["events"]  # the audit's own held-out event rows (not the bench's join)
    for ph, x in m["heldout"].items():
        rs = [r for r in rows if ph == "(all)" or r["phrase"] == ph]
        assert x["n"] == len(rs) > 0
        assert x["residual"] == pytest.approx(sum(r["p_after"] for r in rs) / sum(r["p_before"] for r in rs),
                                              rel=1e-5)  # positions.tsv keeps 6 decimals of log p
        if x["lo"] is not None:
            assert x["lo"] <= x["residual"] <= x["hi"]
    for ph, x in m["dev"].items():
        assert x["n"] == sum(1 for e in json.loads((out / "sets.json").read_text())["events"]
                             if e["set"] == "dev" and (ph == "(all)" or e["phrase"] == ph))
    # the pooled held-out residual is reported beside the bar
    assert bars["c.slop"]["details"]["pooled"] == pytest.approx(1 - m["heldout"]["(all)"]["residual"], abs=1e-5)
    # ... and the bar's value is the worst phrase's reduction
    assert bars["c.slop"]["value"] == pytest.approx(
        min(1 - x["residual"] for ph, x in m["heldout"].items() if ph != "(all)"), abs=1e-5)


def test_blind_signoff_figures(run):
    """The bench's blind column: two fresh chats of model2's own from its held-back prompts (user turns found in no
    other file of model2's), signed off; each phrase's residual is re-derived from the blind report's own event rows (Σ p_after / Σ p_before)."""
    out, res = run
    b = res["methods"]["wfld"]["blind"]
    assert "error" not in b, b
    assert b["how"].startswith("2 fresh chats of the model's own from heldback_blind_prompts.jsonl")
    rep = json.loads((out / "wfld" / "audit-blind" / "report.json").read_text())
    assert rep["mode"] == "blind" and b["passed"] == rep["passed"]
    rows = rep["blind"]["slop"]["events"]
    assert rows, "a blind set without an event is refused before scoring"
    for ph, x in b["per_phrase"].items():
        rs = [r for r in rows if ph == "(all)" or r["phrase"] == ph]
        assert x["n"] == len(rs) > 0, ph
        assert x["residual"] == pytest.approx(sum(r["p_after"] for r in rs) / sum(r["p_before"] for r in rs),
                                              rel=1e-9)  # the report's own floats: only the sum's order differs


def test_planted_failures_on_model2(run, tmp_path):
    """The same model-agnostic planted failures on model2 (specials at ids 0–4, another register and size): each
    caught for its reason against this run's honest WFLD bundle and dev report."""
    import bench_efficacy as be
    from planted_check import check_all, dump_written_chat

    from l47.testing.planted import HonestRun, plant_all, unnatural_text

    out, _ = run
    model = be.specs()["model2"].model
    honest = HonestRun(out / "experiment.toml", model, out / "wfld" / "bundle.gguf",
                       out / "wfld" / "audit" / "report.json")
    forged = dump_written_chat(model, tmp_path / "forged", "forged-chat", [
        {"role": "user", "content": "My order arrived with a cracked lid. What can I do?"},
        {"role": "assistant", "content": "<think>\nOffer a replacement.\n</think>\n\nSorry about the lid. Rest assured, "
                                         "I can send a new one today, or refund the item if you prefer."}])
    # (it holds a phrase: a blind set without a slop event is refused before any bar, issue 35 item 8)
    unnatural = dump_written_chat(model, tmp_path / "unnatural", "unnatural-chat", [
        {"role": "user", "content": unnatural_text(model, seed=1)},
        {"role": "assistant", "content": unnatural_text(model, seed=2)}])
    plants = plant_all(honest, tmp_path / "plants", forged=forged, unnatural=unnatural)
    assert len(plants) == 12
    check_all(plants, honest, tmp_path / "audits")
