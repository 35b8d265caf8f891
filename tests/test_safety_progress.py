"""`l47 audit` shows per-set progress (issue 15 item 5): the library reports `progress(set, done, total)` once per
scored document; the CLI renders a bar per set on a terminal and one log line per finished set (plus at most one
line every 15 s meanwhile) when not.

The world is test_malformed's (synthetic states), audited with test_determinism's relaxed experiment: its sets
hold 1 (collateral_eval), 1 (background) and 4 (the split pool) documents.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from l47.app.cli import app
from test_malformed import make_solvable_world

EXPECTED = {"collateral_eval": 1, "background": 1, "pool": 4}  # the experiment below


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    return make_solvable_world(tmp_path_factory, tiny_tokenizer_kv, "pr")


def test_library_reports_every_document_once_per_set(world, tmp_path):
    from l47.evals.audit import AuditArgs, run_audit

    calls = []
    res = run_audit(AuditArgs(world["bundle"], world["base"], world["root"] / "det.toml", tmp_path / "a",
                              ledger=tmp_path / "l.jsonl", plots=False), progress=lambda *c: calls.append(c))
    per_set: dict[str, list] = {}
    for s, done, total in calls:
        per_set.setdefault(s, []).append((done, total))
    assert {s: v[-1] for s, v in per_set.items()} == {s: (n, n) for s, n in EXPECTED.items()}
    for s, v in per_set.items():
        assert [d for d, _ in v] == list(range(1, EXPECTED[s] + 1)), (s, v)  # 1, 2, ..., total: each once
    assert len(calls) == len(res.report["inputs"]["documents"]) == sum(EXPECTED.values())


def test_cli_log_lines_when_not_a_terminal(world, tmp_path):
    r = CliRunner().invoke(app, ["audit", str(world["bundle"]), "--base", str(world["base"]), "--experiment",
                                 str(world["root"] / "det.toml"), "--out", str(tmp_path / "a"), "--no-plots",
                                 "--ledger", str(tmp_path / "l.jsonl")])
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("audit: set ")]
    # the test is fast: no 15-s line, exactly one line per set, when its last document is scored
    assert sorted(lines) == sorted(f"audit: set {s}: {n}/{n} document(s) scored" for s, n in EXPECTED.items())
    r = CliRunner().invoke(app, ["--quiet", "audit", str(world["bundle"]), "--base", str(world["base"]),
                                 "--experiment", str(world["root"] / "det.toml"), "--out", str(tmp_path / "b"),
                                 "--no-plots", "--ledger", str(tmp_path / "l.jsonl")])
    assert "audit: set" not in r.output and r.exit_code in (0, 1)
    r = CliRunner().invoke(app, ["audit", str(world["bundle"]), "--base", str(world["base"]), "--experiment",
                                 str(world["root"] / "det.toml"), "--out", str(tmp_path / "c"), "--no-plots",
                                 "--ledger", str(tmp_path / "l.jsonl"), "--json", "-"])
    assert json.loads(r.stdout)["schema"] == "l47.audit/1"  # stdout is the JSON only: no progress lines in it


def test_periodic_lines_and_terminal_bars():
    from l47.app.audit_view import SetProgress

    t = [0.0]
    buf = io.StringIO()
    p = SetProgress(Console(file=buf, force_terminal=False, width=100), every_s=15.0, clock=lambda: t[0])
    for done in range(1, 11):  # 10 documents, 4 s apart: a line at 16 s, 32 s (>= 15 s since the last) and at the end
        t[0] += 4.0
        p("pool", done, 10)
    assert buf.getvalue().splitlines() == ["audit: set pool: 4/10 document(s) scored",
                                           "audit: set pool: 8/10 document(s) scored",
                                           "audit: set pool: 10/10 document(s) scored"]
    term = SetProgress(Console(file=io.StringIO(), force_terminal=True, width=100))
    with term:
        for s, n in EXPECTED.items():
            for d in range(1, n + 1):
                term(s, d, n)
        tasks = {task.description: (task.completed, task.total) for task in term.bar.tasks}
    assert tasks == {s: (n, n) for s, n in EXPECTED.items()}  # one bar per set, each full


def test_head_precision_is_per_run_not_per_process(world, tmp_path):
    """`--precision` reaches the weights through the command's arguments (no process-wide setting): two audits in
    one process, split-bf16 then the default, each record their own head precision and the first its split's
    max |logit − f64 logit| on the check rows, larger than the f32 path's on the same rows (split-bf16 keeps ~2⁻¹⁷
    of each product, f32 rounds at 2⁻²⁴; tests/test_stream.py bounds both against f64)."""
    got = []
    for k, extra in enumerate((["--precision", "split-bf16"], [])):
        out = tmp_path / f"p{k}"
        r = CliRunner().invoke(app, ["audit", str(world["bundle"]), "--base", str(world["base"]), "--experiment",
                                     str(world["root"] / "det.toml"), "--out", str(out), "--no-plots",
                                     "--ledger", str(tmp_path / "l.jsonl"), *extra])
        assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
        got.append(json.loads((out / "report.json").read_text())["inputs"]["numerics"])
    split, default = got
    assert (split["requested"], split["precision"], split["split"]) == ("split-bf16", "split-bf16", "split-bf16")
    assert split["max_logit_err_split"] > split["max_logit_err_f32"] > 0
    assert (default["requested"], default["precision"], default["max_logit_err_split"]) == ("auto", "f32", None)
    r = CliRunner().invoke(app, ["audit", str(world["bundle"]), "--base", str(world["base"]), "--experiment",
                                 str(world["root"] / "det.toml"), "--out", str(tmp_path / "bad"), "--no-plots",
                                 "--precision", "fp8"])
    assert r.exit_code == 2
    assert "--precision: precision: expected f32, split-fp16 or split-bf16, found 'fp8'" in r.output
