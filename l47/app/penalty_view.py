"""Rich rendering of `l47 penalty`: residual p(rejected) per phrase, base / penalty / bundle / stacked."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def print_penalty(res, console) -> None:
    """res: l47.evals.penalty.PenaltyResult."""
    t = Table(title=f"sampler penalty ({res.form}, bias {res.bias:g}, {res.rules} rules) → {res.spec_path}")
    for c in ("phrase", "n", "p base", "penalty", "bundle", "bundle+penalty"):
        t.add_column(c, justify="left" if c == "phrase" else "right")
    f = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
    for ph, r in res.residual.items():
        t.add_row(Text(ph), str(r["n"]), f(r["base"]), f(r["penalty"]), f(r.get("bundle")), f(r.get("stacked")))
    console.print(t)
    console.print(f"unchanged rows: {res.unchanged_rows} (max |Δ log p| there {res.unchanged_max_abs_dlogp:.1e}); "
                  f"penalised rows: {res.penalised_rows}")
    for form, e in res.extra_hits.items():
        console.print(f"cheap form {form!r}: {e['positions']} extra rows, {e['pairs']} extra (row, token) pairs, "
                      f"{e['target_hit']} legitimate targets suppressed")
