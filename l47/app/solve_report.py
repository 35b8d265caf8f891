"""Rich rendering of `l47 solve`: the FTPO progress bar and what the solve claims (all figures from the
re-quantised weights)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from l47.evals.plots import plot_sweep
from l47.solvers.solve import run_solve
from l47.solvers.sweep import run_sweep, sweep_paths_for


class FtpoProgress:
    """`progress` callback for run_solve: a transient bar over the FTPO steps (created at the first step)."""

    def __init__(self, console: Console):
        self.console = console
        self.bar: Progress | None = None
        self.task = None

    def __enter__(self) -> "FtpoProgress":
        return self

    def __call__(self, r: dict) -> None:
        """r: one evaluation of the trainer (l47.solvers.ftpo: step, loss, exact KL, dev/train residual per
        phrase, elapsed seconds) plus "steps", the cap."""
        res = r.get("dev_residual") or r.get("train_residual") or {}
        cand = (f"{r['candidate']} ({r['candidate_index'] + 1}/{r['candidates']}) " if r.get("candidate") else "")
        worst = max(res.items(), key=lambda kv: kv[1]) if res else None
        desc = (f"KL {r['kl_exact']:.2e}" + (f" loss {r['loss']:.4f}" if r.get("loss") is not None else "")
                + (f" worst {worst[0]!r} {worst[1]:.3f}" if worst else ""))
        if not self.console.is_terminal:  # a log, not a bar: one line per evaluation with every phrase
            per = ", ".join(f"{k} {v:.3f}" for k, v in res.items())
            self.console.print(f"{cand}FTPO step {r['step']}/{r.get('steps')} ({r.get('elapsed_s', 0):.0f} s): {desc}; "
                               f"{'dev' if r.get('dev_residual') else 'train'} residual per phrase: {per}",
                               highlight=False)
            return
        if self.bar is None:
            self.bar = Progress(TextColumn("[bold]FTPO[/]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.description}"), transient=True, console=self.console)
            self.bar.start()
            self.task = self.bar.add_task("", total=r.get("steps"))
        self.bar.update(self.task, completed=r["step"], description=escape(cand + desc))

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_solve(res, console: Console) -> None:
    """res: l47.solvers.solve.SolveResult."""
    c = res.claims
    console.print(f"[bold]resolved config[/]: {res.config.to_dict()}", highlight=False)
    t = Table(title="p(rejected) at events, before -> after (exact forward, re-quantised Q8_0 weights)")
    for col in ("set", "phrase", "before", "after", "change"):
        t.add_column(col, justify="left" if col in ("set", "phrase") else "right")
    for name, d in (("train", c.train_p_rejected), ("dev", c.dev_p_rejected)):
        if not d:
            continue
        for ph, b in d.per_phrase_before.items():
            a = d.per_phrase_after[ph]
            t.add_row(name, Text(ph), f"{b:.3f}", f"{a:.3f}", f"{(a - b) / b:+.0%}" if b else "—")
        t.add_row(name, "[bold]all[/]", f"{d.before:.3f}", f"{d.after:.3f}",
                  f"{(d.after - d.before) / d.before:+.0%}" if d.before else "—")
    console.print(t)
    line = f"background KL (exact) {c.background_kl_exact:.5f}"
    if c.background_kl_predicted is not None:
        line += f", solver prediction {c.background_kl_predicted:.5f}"
    console.print(line + f"; ||dW||/||W|| = {c.dW_rel_norm:.4f} ({c.blocks_changed} Q8_0 blocks changed)",
                  highlight=False)
    if c.anchors is not None:
        a = c.anchors
        console.print(f"protected anchors ({a.n}): max |Δlog p| {a.max_abs_dlogp_float:.2e} before "
                      f"re-quantisation, {a.max_abs_dlogp_shipped:.2e} shipped (re-quantisation floor "
                      f"{a.requant_floor:.2e})", highlight=False)
    m = c.method
    if c.convergence is not None:
        cv = c.convergence
        console.print(f"stop: {cv.stop_reason} after {cv.iterations} iterations; max violation "
                      f"{cv.max_violation if cv.max_violation is not None else float('nan'):.3g} "
                      f"(tolerance {cv.violation_tol})", highlight=False)
    console.print(phrase_stop_table(res))
    for note in res.record.notes:
        console.print(f"note: {escape(str(note))}", highlight=False)
    if "violation" in m:
        console.print(f"feasibility: max constraint violation {m['violation']:.2e} nats, linear-prediction "
                      f"residual {m['residual']:.2e}, {len(m['infeasible_events'])} infeasible event(s), "
                      f"anchor rank {m['anchor_rank']}, null space {m['null_dim']}", highlight=False)
        for wmsg in m.get("warnings", []):
            console.print(f"[yellow]warning:[/] {escape(str(wmsg))}", highlight=False)
    console.print(f"bundle {res.bundle} (sha256 {res.record.bundle_sha256[:16]}…), record {res.record_path}",
                  highlight=False)
    for s in res.record.stamps:  # e.g. dumps of another model let in by --allow-other-model
        console.print(f"[bold yellow]stamp:[/] {escape(str(s))}", highlight=False)


def phrase_stop_table(res) -> Table:
    """Per phrase: its dev (and train) residual as shipped beside the target, and why it stopped there (the solver's
    `phrase_stops`: target met / the constraint that binds / the stop with the residual's trend)."""
    c, t = res.claims, res.config.target_residual
    stops = c.method.get("phrase_stops") or {}
    stop = c.convergence.stop_reason if c.convergence is not None else "—"
    tab = Table(title=f"per phrase at the stop: residual p_after / p_before (target {t:g})")
    for col in ("phrase", "dev", "train", "why it stopped there"):
        tab.add_column(col, justify="right" if col in ("dev", "train") else "left")

    def ratio(d, ph):
        b = None if d is None else d.per_phrase_before.get(ph)
        return d.per_phrase_after[ph] / b if b else None

    phrases = list((c.train_p_rejected.per_phrase_before if c.train_p_rejected else {}).keys())
    for ph in phrases:
        rd, rt = ratio(c.dev_p_rejected, ph), ratio(c.train_p_rejected, ph)
        worst = max(x for x in (rd, rt) if x is not None)
        why = stops.get(ph) or ("target met" if worst <= t else stop)
        tab.add_row(Text(ph), "—" if rd is None else f"{rd:.3f}", f"{rt:.3f}", Text(why))
    return tab


def _overrides(ov: dict, pre: str = "") -> str:
    """{"wfld": {"margin": 2.302585}} -> "wfld.margin=2.303"."""
    return " ".join(_overrides(v, f"{pre}{k}.") if isinstance(v, dict) else f"{pre}{k}={v:.4g}"
                    for k, v in ov.items())


def _interval_text(iv) -> str:
    """' [lo, hi]' of a bootstrap interval over documents; '' when there is none (fewer than 2 documents)."""
    return "" if iv is None else f" [{iv[0]:.3g}, {iv[1]:.3g}]"


def print_sweep(res, console: Console) -> None:
    """The sweep's candidates (dev figures, exact KL) and the choice; draws the plot beside the bundle."""

    sw = res.record.sweep
    png, tsv = sweep_paths_for(res.bundle)
    plot_sweep(png, sw)
    t = Table(title=f"sweep on dev (KL budget {sw.budget:.4g}; re-quantised, exact forward)")
    for col in ("", "overrides", "exact KL", "removal", "dev pooled [90% over docs]", "dev worst", "≤ budget",
                "frontier", "chosen"):
        t.add_column(col, justify="left" if col in ("", "overrides") else "right")
    for c in sw.candidates:
        t.add_row(c.name, Text(_overrides(c.overrides)), f"{c.background_kl_exact:.3g}", f"{c.dev_removal:.3f}",
                  f"{c.dev_residual:.4g}" + _interval_text(c.dev_residual_interval),
                  f"{c.dev_residual_worst:.4g}", "yes" if c.within_budget else "no",
                  "yes" if c.on_frontier else "no", "[bold]yes[/]" if c.chosen else "")
    console.print(t)
    console.print(f"chosen: {escape(sw.reason)}", highlight=False)
    console.print(f"sweep plot {png}, table {tsv}", highlight=False)


def solve_and_print(args, console: Console):
    """run_solve with messages and the FTPO bar on `console`, then the claims (and the sweep's candidates)."""

    with FtpoProgress(console) as bar:
        res = (run_sweep if args.sweep else run_solve)(args, log=lambda m: console.print(m, highlight=False),
                                                       progress=bar)
    print_solve(res, console)
    if res.record.sweep is not None:
        print_sweep(res, console)
    return res
