"""--allow-other-model is a stamped, visible fact (issue 14 item 6: "... unless --allow-other-model, which the
report records").

The world is test_malformed's (synthetic tail states; a dump whose meta.model is another GGUF's sha256), with
an experiment whose background set holds that dump. Without the flag `sets`, `solve` and `audit` refuse it (exit
2, one line naming the dump, meta.model and both identities) and the audit library refuses it too when called
directly. With the flag: the sets JSON, the solve record and the audit report each carry the stamp
(l47.data.identity.other_model_stamp) in a `stamps` field, the audit's report.json lists the dump with its model
and its headline (report.md's first line, the printed summary) shows the stamp, and the audit carries the solve
record's stamp forward.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.data.identity import other_model_stamp
from test_malformed import _toml, make_world

OTHER = "ab" * 32  # test_malformed's other model


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer_kv):
    w = make_world(tmp_path_factory.mktemp("id_world"), tmp_path_factory.mktemp("id_build"), tiny_tokenizer_kv)
    exp = _toml(w["dumps"], thresholds="[thresholds]\nnon_event_p = 0.0\nce_proxy_frac = 100.0\n"
                "min_heldout_per_phrase = 1\nmin_train_per_phrase = 1\ncollateral_min_total = 1\ncollateral_min_per_word = 1\n",
                sets='[sets]\ncollateral_eval = ["coll.safetensors"]\n'
                     'background = ["bg.safetensors", "other_model.safetensors"]\n',
                split='[split]\npool = ["pool*.safetensors"]\nseed = 0\ntrain = 0.5\ndev = 0.25\nheldout = 0.25\n')
    (w["root"] / "other.toml").write_text(exp)
    return w


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output, r.output
    return r


def _refused(r):
    errs = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errs) == 1, r.output
    for must in ("other_model.safetensors", "meta.model", OTHER[:16], "--allow-other-model"):
        assert must in errs[0], (must, errs[0])


def test_refused_without_the_flag(world, tmp_path):
    root = world["root"]
    exp = root / "other.toml"
    _refused(_cli("sets", exp, "--json", tmp_path / "s.json"))
    _refused(_cli("solve", exp, "--out", tmp_path / "b.gguf", "--ledger", tmp_path / "l.jsonl"))
    _refused(_cli("audit", world["bundle"], "--base", world["base"], "--experiment", exp, "--out", tmp_path / "a",
                  "--no-plots", "--ledger", tmp_path / "l.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_audit_library_refuses_without_the_flag(world, tmp_path):
    from l47.errors import L47Error
    from l47.evals.audit import AuditArgs, run_audit

    with pytest.raises(L47Error) as e:
        run_audit(AuditArgs(world["bundle"], world["base"], world["root"] / "other.toml", tmp_path / "a",
                            ledger=tmp_path / "l.jsonl", plots=False))
    assert "other_model.safetensors" in str(e.value) and "meta.model" in str(e.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "l.jsonl").exists()


def test_stamped_in_sets_solve_and_audit(world, tmp_path):
    root = world["root"]
    exp, stamp = root / "other.toml", other_model_stamp(1)
    led = tmp_path / "ledger.jsonl"

    r = _cli("sets", exp, "--json", tmp_path / "sets.json", "--allow-other-model", "--ledger", led)
    assert r.exit_code in (0, 1), r.output
    s = json.loads((tmp_path / "sets.json").read_text())
    assert s["stamps"] == [stamp]
    assert any("other_model.safetensors" in w for w in s["warnings"])
    assert f"stamp: {stamp}" in " ".join(r.output.split())

    r = _cli("solve", exp, "--out", tmp_path / "bundle.gguf", "--allow-other-model", "--ledger", led)
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "bundle.gguf.solve.json").read_text())
    assert rec["stamps"] == [stamp]
    assert any("other_model.safetensors" in n and OTHER[:16] in n for n in rec["notes"])
    assert f"stamp: {stamp}" in " ".join(r.output.split())

    r = _cli("audit", tmp_path / "bundle.gguf", "--base", world["base"], "--experiment", exp, "--out",
             tmp_path / "audit", "--no-plots", "--allow-other-model", "--ledger", led)
    assert r.exit_code in (0, 1), r.output
    rep = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert stamp in rep["stamps"] and f"solve record: {stamp}" in rep["stamps"]
    assert rep["inputs"]["allow_other_model"] is True
    assert [(d["path"].endswith("other_model.safetensors"), d["model"]) for d in rep["inputs"]["other_model_dumps"]] \
        == [(True, OTHER)]
    first = (tmp_path / "audit" / "report.md").read_text().splitlines()[0]
    assert first.startswith("# l47 audit (dev): ") and stamp in first, first
    assert "other model" in " ".join(r.output.split())  # the printed summary's title


def test_score_and_penalty_print_the_stamp(world, tmp_path):
    root = world["root"]
    led = tmp_path / "ledger.jsonl"
    r = _cli("score", root / "other_model.safetensors", "--model", world["base"], "--ledger", led)
    assert r.exit_code == 2 and "--allow-other-model" in r.output  # refused without the flag
    r = _cli("score", root / "other_model.safetensors", root / "bg.safetensors", "--model", world["base"],
             "--ledger", led, "--allow-other-model")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert f"stamp: {other_model_stamp(1)}" in flat and "other_model.safetensors" in flat
    r = _cli("penalty", root / "other.toml", "--out", tmp_path / "p.json", "--ledger", led, "--allow-other-model")
    assert r.exit_code == 0, r.output
    assert f"stamp: {other_model_stamp(1)}" in " ".join(r.output.split())
