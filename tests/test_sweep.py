"""`l47 solve --sweep` (issue 12 item 5) on test_audit's small synthetic world (synthetic tail states with planted
slop events at base p 0.6 in train, dev and held-out chats), with a tiny FTPO step budget.

References: each candidate solved ALONE by a plain `l47 solve` whose [solver] table holds the candidate's
overrides. The solvers are deterministic on the CPU, so the sweep's figures for a candidate must equal the plain
solve's claims exactly (tolerance 0: the same code path on the same inputs), and the chosen candidate's bundle
must be the same bytes. The frontier is re-derived here from the record's figures by brute force.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from l47.app.cli import app
from l47.data.record import read_record, record_path_for
from l47.solvers.sweep import FTPO_GRID, read_table, sweep_paths_for
from test_audit import world  # noqa: F401 - the module-scoped world fixture

FTPO = "[solver.ftpo]\nsteps = 120\neval_every = 20\n"


def _exp(world, name: str, top: str = "", sub: str = FTPO):  # noqa: F811
    p = world["root"] / f"{name}.toml"
    p.write_text(world["exp"].read_text() + f'\n[solver]\nmethod = "ftpo"\n{top}\n{sub}')
    return p


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _toml_value(v) -> str:
    return repr(float(v))  # repr round-trips through TOML's float


def _overrides_toml(ov: dict) -> tuple[str, str]:
    top = "".join(f"{k} = {_toml_value(v)}\n" for k, v in ov.items() if not isinstance(v, dict))
    sub = FTPO + "".join(f"{k} = {_toml_value(v)}\n" for k, v in ov.get("ftpo", {}).items())
    return top, sub


def _dominates(a, b) -> bool:
    ka = (a.background_kl_exact, a.dev_residual_worst, a.dev_removal)
    kb = (b.background_kl_exact, b.dev_residual_worst, b.dev_removal)
    return all(x <= y for x, y in zip(ka, kb)) and ka != kb


@pytest.fixture(scope="module")
def swept(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep_out")
    exp = _exp(world, "sweep")
    r = _cli("solve", exp, "--sweep", "--out", out / "b.gguf", "--model", world["base"], "--ledger",
             out / "ledger.jsonl")
    assert r.exit_code == 0, r.output
    return dict(out=out, record=read_record(record_path_for(out / "b.gguf")), output=r.output)


def test_sweep_candidates_match_separate_solves(world, swept, tmp_path):
    sw = swept["record"].sweep
    assert len(sw.candidates) == len(FTPO_GRID) and sum(c.chosen for c in sw.candidates) == 1
    for c in sw.candidates:
        top, sub = _overrides_toml(c.overrides)
        d = tmp_path / c.name
        d.mkdir()
        r = _cli("solve", _exp(world, f"alone_{c.name}", top, sub), "--out", d / "b.gguf", "--model",
                 world["base"], "--ledger", d / "ledger.jsonl")
        assert r.exit_code == 0, r.output
        cl = read_record(record_path_for(d / "b.gguf")).claims
        assert c.background_kl_exact == cl.background_kl_exact
        dv = cl.dev_p_rejected
        assert c.dev_residual == dv.after / dv.before
        per = [math.log(max(v, 0.2)) for v in c.dev_residual_per_phrase.values()]  # against the configured t
        assert c.dev_removal == pytest.approx(sum(per) / len(per), abs=1e-12)
        assert c.dev_residual_per_phrase == {ph: dv.per_phrase_after[ph] / b for ph, b in dv.per_phrase_before.items()}
        if c.chosen:
            assert (d / "b.gguf").read_bytes() == (swept["out"] / "b.gguf").read_bytes()
            assert cl == swept["record"].claims


def test_sweep_choice_is_on_the_measured_frontier(swept):
    sw = swept["record"].sweep
    ch = next(c for c in sw.candidates if c.chosen)
    assert sw.chosen == ch.name and ch.name in sw.reason
    for c in sw.candidates:
        assert c.within_budget == (c.background_kl_exact <= sw.budget)
        assert c.on_frontier == (not any(_dominates(o, c) for o in sw.candidates if o is not c))
    inside = [c for c in sw.candidates if c.within_budget]
    if inside:  # the most removal within the budget, and nothing tried beats it on every figure
        assert ch.within_budget and ch.dev_removal == min(c.dev_removal for c in inside)
        assert not any(_dominates(o, ch) for o in sw.candidates)
    else:
        assert ch.background_kl_exact == min(c.background_kl_exact for c in sw.candidates)
    # the grid is relative to the configured target and budget (kl_budget 0: 0.5 × the tightest KLD bar)
    assert [c.overrides["kl_budget"] for c in sw.candidates] == [sw.budget * b for _, b in FTPO_GRID]
    assert [c.overrides["target_residual"] for c in sw.candidates] == [0.2 * a for a, _ in FTPO_GRID]


def test_sweep_plot_and_table_match_the_record(swept):
    png, tsv = sweep_paths_for(swept["out"] / "b.gguf")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    rows = read_table(tsv)
    sw = swept["record"].sweep
    assert [r["candidate"] for r in rows] == [c.name for c in sw.candidates]
    for r, c in zip(rows, sw.candidates):
        assert json.loads(r["overrides"]) == c.overrides
        for k in ("background_kl_exact", "dev_removal", "dev_residual", "dev_residual_worst"):
            assert float(r[k]) == getattr(c, k)
        for ph, v in c.dev_residual_per_phrase.items():
            assert float(r[f"dev_residual[{ph}]"]) == v
        assert r["chosen"] == str(c.chosen) and r["on_frontier"] == str(c.on_frontier)
    assert "chosen: " in swept["output"]


def test_record_without_sweep_still_reads(swept, tmp_path):
    d = json.loads(record_path_for(swept["out"] / "b.gguf").read_text())
    assert d["schema"] == 3 and d["sweep"]["chosen"] == swept["record"].sweep.chosen
    d.pop("sweep")
    d["schema"] = 2
    p = tmp_path / "old.solve.json"
    p.write_text(json.dumps(d))
    old = read_record(p)
    assert old.sweep is None and old.claims == swept["record"].claims


def test_sweep_refuses_an_output_that_is_an_input(world, tmp_path):
    exp = _exp(world, "in")
    out = world["root"] / "clash.gguf"
    clash = sweep_paths_for(out)[1]
    clash.symlink_to(exp)  # the table path is the experiment itself
    try:
        r = _cli("solve", exp, "--sweep", "--out", out, "--model", world["base"], "--ledger",
                 tmp_path / "ledger.jsonl")
    finally:
        clash.unlink()
    assert r.exit_code == 2, r.output
    assert "sweep table" in r.output and "experiment" in r.output
    assert not out.exists() and not record_path_for(out).exists() and not (tmp_path / "ledger.jsonl").exists()


def test_wfld_sweep_chosen_is_the_plain_solve_of_its_margin(world, tmp_path):
    """WFLD's grid: margin = ln(1/t') for t' = 2t, t, t/2; the chosen candidate's bundle is the bytes a plain
    WFLD solve with that margin in [solver.wfld] writes."""
    exp = world["root"] / "sweep_wfld.toml"
    exp.write_text(world["exp"].read_text() + '\n[solver]\nmethod = "wfld"\n')
    r = _cli("solve", exp, "--sweep", "--out", tmp_path / "s.gguf", "--model", world["base"], "--ledger",
             tmp_path / "s.jsonl")
    assert r.exit_code == 0, r.output
    sw = read_record(record_path_for(tmp_path / "s.gguf")).sweep
    assert [c.overrides["wfld"]["margin"] for c in sw.candidates] == [math.log(1 / t) for t in (0.4, 0.2, 0.1)]
    ch = next(c for c in sw.candidates if c.chosen)
    assert not any(_dominates(o, ch) for o in sw.candidates) and ch.within_budget == (ch.background_kl_exact
                                                                                       <= sw.budget)
    alone = world["root"] / "alone_wfld.toml"
    alone.write_text(exp.read_text() + f"\n[solver.wfld]\nmargin = {ch.overrides['wfld']['margin']!r}\n")
    r = _cli("solve", alone, "--out", tmp_path / "a.gguf", "--model", world["base"], "--ledger", tmp_path / "a.jsonl")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "s.gguf").read_bytes()
    cl = read_record(record_path_for(tmp_path / "a.gguf")).claims
    assert cl.background_kl_exact == ch.background_kl_exact
    assert cl.dev_p_rejected.after / cl.dev_p_rejected.before == ch.dev_residual


def test_choose_marks_budget_frontier_and_the_most_removal():
    """The rule on hand-made figures (no solve): budget 1.0; b is dominated by a; c removes most within budget;
    d removes more but is over budget; with a budget of 0.1 none is within it and the least-KL one is taken."""
    from l47.data.record import SweepCandidate
    from l47.solvers.sweep import choose

    def mk(name, kl, worst, score):
        return SweepCandidate(name, {}, kl, score, worst, worst, {"p": worst}, False, False, False)

    cs = [mk("a", 0.2, 0.5, -0.4), mk("b", 0.3, 0.5, -0.4), mk("c", 0.9, 0.2, -1.2), mk("d", 1.5, 0.1, -1.6)]
    out, why = choose(cs, 1.0)
    assert [(c.within_budget, c.on_frontier, c.chosen) for c in out] == [
        (True, True, False), (True, False, False), (True, True, True), (False, True, False)]
    assert why.startswith("c:")
    out, why = choose(cs, 0.1)
    assert [c.chosen for c in out] == [True, False, False, False] and "no candidate is within" in why


# ----------------------------------------------------------------------------------------------------------
# dev residuals with their intervals over documents (issue 12 item 9)


def test_one_dev_document_gives_no_interval(swept):
    """The world has one dev chat: no spread over documents to estimate, so every interval is None in the record
    and nan in the table (and the point figures stay as they were)."""
    sw = swept["record"].sweep
    rows = read_table(sweep_paths_for(swept["out"] / "b.gguf")[1])
    for r, c in zip(rows, sw.candidates):
        assert c.dev_residual_interval is None
        assert c.dev_residual_interval_per_phrase == {ph: None for ph in c.dev_residual_per_phrase}
        assert r["dev_residual_lo"] == r["dev_residual_hi"] == "nan"
        assert all(r[f"dev_residual_{k}[{ph}]"] == "nan" for ph in c.dev_residual_per_phrase for k in ("lo", "hi"))


def test_sweep_intervals_equal_the_audit_s_on_two_dev_documents(world, tmp_path):
    """heldout_b moved to dev (two dev chats; 'rather than' is in one of them only). Reference: the audit of the
    chosen bundle computes the same intervals from ITS per-document scoring (slop.per_set.dev, another forward
    path, events in another order) with the same bootstrap streams; tolerance 1e-5 relative (f32 forwards of the
    same weights). Every interval holds its point; the table carries the record's numbers exactly. 80 FTPO steps
    per candidate: the figures need not be good, only measured — but the kept candidate must have moved (at 20
    steps "rather than" had risen to 1.4 on train, so no candidate beat ΔW = 0 and every interval was [1, 1])."""
    from test_audit import _audit_exp, _variant

    base = _variant(world, "twodev", {"dev": [world["paths"]["heldout_b"].name]}, drop=("heldout_b",))
    exp = world["root"] / "sweep_twodev.toml"
    exp.write_text(base.read_text() + '\n[solver]\nmethod = "ftpo"\n\n[solver.ftpo]\nsteps = 80\neval_every = 20\n')
    r = _cli("solve", exp, "--sweep", "--out", tmp_path / "b.gguf", "--model", world["base"], "--ledger",
             tmp_path / "ledger.jsonl")
    assert r.exit_code == 0, r.output
    sw = read_record(record_path_for(tmp_path / "b.gguf")).sweep
    rows = read_table(sweep_paths_for(tmp_path / "b.gguf")[1])
    for row, c in zip(rows, sw.candidates):
        ivs = c.dev_residual_interval_per_phrase
        assert ivs["rather than"] is None  # its dev events are all in heldout_b
        for ph in ("end to end", "right away"):
            lo, hi = ivs[ph]
            assert lo <= c.dev_residual_per_phrase[ph] <= hi
            assert [float(row[f"dev_residual_lo[{ph}]"]), float(row[f"dev_residual_hi[{ph}]"])] == [lo, hi]
        lo, hi = c.dev_residual_interval
        assert lo <= c.dev_residual <= hi and lo < hi
        assert [float(row["dev_residual_lo"]), float(row["dev_residual_hi"])] == [lo, hi]
    ch = next(c for c in sw.candidates if c.chosen)
    rep = _audit_exp(world, tmp_path / "b.gguf", tmp_path / "audit", exp).report
    dev = rep["slop"]["per_set"]["dev"]
    assert dev["residual_interval"] == pytest.approx(ch.dev_residual_interval, rel=1e-5)
    assert dev["residual_ratio"] == pytest.approx(ch.dev_residual, rel=1e-5)
    for ph, v in dev["per_phrase"].items():
        assert v["residual_ratio"] == pytest.approx(ch.dev_residual_per_phrase[ph], rel=1e-5)
        if ch.dev_residual_interval_per_phrase[ph] is None:
            assert v["residual_interval"] is None and v["n_docs"] == 1
        else:
            assert v["residual_interval"] == pytest.approx(ch.dev_residual_interval_per_phrase[ph], rel=1e-5)
