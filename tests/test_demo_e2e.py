"""End to end on the shipped demo model, at reduced size: dump (hf engine, the model's own generations) ->
sets -> WFLD solve -> audit, plus the negative control. Asserts the verdicts and the key figures, each recomputed
here from the written files where cheap (not read back from the tool's own summary only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from l47.app.demo import MODEL, DemoArgs, run_demo



@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    log = tmp_path_factory.mktemp("demo_log")  # the demo refuses a folder holding files it did not write
    console = Console(file=open(log / "console.txt", "w"), width=120)
    code = run_demo(DemoArgs(out=out, prompts=32, max_new_tokens=96), console)
    return out, code


def test_demo_passes_and_control_fails(demo):
    out, code = demo
    s = json.loads((out / "demo_summary.json").read_text())
    assert code == 0 and s["passed"] is True and s["control_failed"] is True


def _bars(path: Path) -> dict:
    return {b["name"]: b for b in json.loads(path.read_text())["bars"]}


def test_key_figures(demo):
    out, _ = demo
    bars = _bars(out / "audit" / "report.json")
    assert all(b["passed"] for b in bars.values() if b.get("applicable", True))
    assert bars["c.slop"]["value"] >= 0.5  # held-out p(rejected) at least halved
    assert bars["proxy.base_ce"]["value"] < 0.5 * np.log(3072)  # the real network, not a proxy
    assert bars["d.word_mean"]["value"] >= -0.05 and bars["f.flips"]["value"] == 0
    rec = json.loads((out / "bundle.gguf.solve.json").read_text())
    slop = [t for t in rec["touched"] if t["term"] == "slop"]
    assert slop and min(t["base_p"] for t in slop) >= 1e-2  # events only, base p high
    sets = json.loads((out / "sets.json").read_text())
    assert np.mean([e["p_base"] for e in sets["events"]]) > 0.5  # the model really learned the slop


def test_negative_control_fails_for_the_right_reasons(demo):
    out, _ = demo
    bars = _bars(out / "control" / "audit" / "report.json")
    assert not bars["d.word_mean"]["passed"]  # a final word suppressed everywhere
    assert not bars["a.prefix_exact"]["passed"]  # its record touched non-prefix positions
