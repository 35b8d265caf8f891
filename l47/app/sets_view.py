"""Rich rendering of `l47 sets` and the command's driver: build the sets report, print its tables, write the
JSON and the ledger lines."""

from __future__ import annotations

from dataclasses import fields

from rich.table import Table
from rich.text import Text

from l47.data.experiment import load_experiment
from l47.data.identity import other_model_stamp
from l47.data.ledger import Ledger
from l47.data.sets import Coverage, POOL, SetsReport, build_sets, write_sets_json
from l47.errors import L47Error
from l47.model.weights import load_tail_weights



def render_sets_table(report: SetsReport) -> list:
    """rich renderables: events per phrase × set, collateral per word × set, coverage per set, refusals,
    phrase issues, warnings and the thresholds."""
    out: list = []
    sets = [s for s in report.set_names() if s != POOL]
    ev, nev, cp = report.counts("events"), report.counts("non_events"), report.counts("copies")
    t = Table(title=f"events per phrase × set (base p ≥ {report.thresholds['non_event_p']:g}; "
                    f"solver sees train/dev only)")
    t.add_column("phrase")
    t.add_column("tuples", justify="right")
    for s in sets:
        t.add_column(s, justify="right")
    t.add_column("non-events", justify="right")
    t.add_column("held-out copies", justify="right")
    ntup = {p.phrase: len(p.tuples) for p in report.phrases}
    for ph in ev:
        t.add_row(Text(ph), str(ntup.get(ph, 0)), *[str(ev[ph].get(s, 0)) for s in sets],
                  str(sum(nev.get(ph, {}).values())), str(cp.get(ph, {}).get("heldout", 0)))
    out.append(t)

    cc = report.collateral_counts()
    t = Table(title="collateral per word × set (ordinary uses, never after a banned prefix)")
    t.add_column("word")
    t.add_column("id", justify="right")
    for s in sets:
        t.add_column(s, justify="right")
    for wd, c in cc.items():
        t.add_row(Text(repr(wd)), str(report.collateral_words.get(wd, "")), *[str(c.get(s, 0)) for s in sets])
    out.append(t)

    cov = report.coverage()
    t = Table(title="coverage per set")
    cols = [f.name for f in fields(Coverage)]
    t.add_column("set")
    for c in cols:
        t.add_column(c.replace("_", " "), justify="right")
    t.add_column("refused", justify="right")
    for s in report.set_names():
        c = cov.get(s, Coverage())
        nref = sum(1 for d in report.docs if d.set == s and d.refused)
        t.add_row(s, *[str(getattr(c, k)) for k in cols], str(nref))
    out.append(t)

    refused = [d for d in report.docs if d.refused]
    if refused:
        t = Table(title="refused documents")
        t.add_column("set")
        t.add_column("document")
        t.add_column("why")
        for d in refused:
            t.add_row(d.set, Text(d.path), Text("; ".join(d.reasons)))
        out.append(t)
    if report.phrase_issues:
        t = Table(title="phrase variants not used")
        t.add_column("phrase")
        t.add_column("variant")
        t.add_column("ids")
        t.add_column("reason")
        for i in report.phrase_issues:
            t.add_row(Text(i["phrase"]), Text(repr(i["variant"])), str(i["ids"]), Text(i["reason"]))
        out.append(t)
    th = ", ".join(f"{k}={v:g}" for k, v in report.thresholds.items())
    out.append(Text(f"thresholds: {th}", style="dim"))
    for wmsg in report.warnings:
        out.append(Text(f"warning: {wmsg}", style="yellow"))
    for s in report.stamps:  # last, where the eye lands: e.g. dumps of another model let in
        out.append(Text(f"stamp: {s}", style="bold yellow"))
    return out


def run_sets(experiment_path, json_out=None, console=None, *, model=None, device="cpu", ledger=None,
             notes=(), precision=None) -> int:
    """`l47 sets EXPERIMENT.toml [--json out.json]`: build, print, write. Exit code 0 when there are no
    warnings (no refused documents, enough held-out events and collateral), 1 otherwise; bad input raises
    L47Error (the CLI prints it and exits 2)."""
    from rich.console import Console

    console = console or Console()
    exp = load_experiment(experiment_path)
    src = model if model is not None else exp.model
    if src is None:
        raise L47Error(exp.path, "model", "a base GGUF (the experiment's `model` key or --model)", "none given")
    w = load_tail_weights(src, policy=exp.policy, device=device, precision=precision)
    # the base model's ledger (or the one named), validated now; every document scored is in it first
    report = build_sets(exp, w, device=device, ledger=Ledger.open(ledger, w.model_sha256), command="sets")
    if notes:  # dumps of another model, allowed by --allow-other-model: the report says so
        from dataclasses import replace

        report = replace(report, warnings=tuple(report.warnings) + tuple(notes),
                         stamps=tuple(report.stamps) + (other_model_stamp(len(notes)),))
    for r in render_sets_table(report):
        console.print(r)
    if json_out is not None:
        p = write_sets_json(report, json_out)
        console.print(f"sets JSON: {p}")
    return 1 if report.warnings else 0
