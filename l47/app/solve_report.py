"""Rich rendering of what `l47 solve` claims (all figures from the re-quantised weights)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_solve(claims: dict, console: Console) -> None:
    cfg = claims.get("config", {})
    console.print(f"[bold]resolved config[/]: {cfg}", highlight=False)
    t = Table(title="p(rejected) at events, before -> after (exact forward, re-quantised Q8_0 weights)")
    for c in ("set", "phrase", "before", "after", "change"):
        t.add_column(c, justify="left" if c in ("set", "phrase") else "right")
    for name in ("train", "dev"):
        d = claims.get(f"{name}_p_rejected")
        if not d:
            continue
        for ph, b in d["per_phrase_before"].items():
            a = d["per_phrase_after"][ph]
            t.add_row(name, ph, f"{b:.3f}", f"{a:.3f}", f"{(a - b) / b:+.0%}" if b else "—")
        t.add_row(name, "[bold]all[/]", f"{d['before']:.3f}", f"{d['after']:.3f}",
                  f"{(d['after'] - d['before']) / d['before']:+.0%}" if d["before"] else "—")
    console.print(t)
    line = f"background KL (exact) {claims['background_kl_exact']:.5f}"
    if "background_kl_predicted" in claims:
        line += f", K-FAC prediction {claims['background_kl_predicted']:.5f}"
    console.print(line + f"; ||dW||/||W|| = {claims['dW_rel_norm']:.4f} ({claims['blocks_changed']} Q8_0 blocks "
                  "changed)", highlight=False)
    if "anchors" in claims:
        a = claims["anchors"]
        console.print(f"protected anchors ({a['n']}): max |Δlog p| {a['max_abs_dlogp_float']:.2e} before "
                      f"re-quantisation, {a['max_abs_dlogp_shipped']:.2e} shipped (re-quantisation floor "
                      f"{a['requant_floor']:.2e})", highlight=False)
    m = claims.get("method", {})
    if "violation" in m:
        console.print(f"feasibility: max constraint violation {m['violation']:.2e} nats, linear-prediction "
                      f"residual {m['residual']:.2e}, {len(m['infeasible_events'])} infeasible event(s), "
                      f"anchor rank {m['anchor_rank']}, null space {m['null_dim']}", highlight=False)
        for wmsg in m.get("warnings", []):
            console.print(f"[yellow]warning:[/] {wmsg}", highlight=False)
    console.print(f"bundle {claims['bundle']} (sha256 {claims['bundle_sha256'][:16]}…), record {claims['record']}",
                  highlight=False)
