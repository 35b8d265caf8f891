"""The audit's files: report.json (versioned schema), report.md (tables per bar, phrase, word, set; flips with
their context decoded to text), positions.tsv (one row per scored position, like the seed's l47eval*.tsv) and
the PNG plots (l47.evals.plots).

Everything is written into a staging folder inside the output directory and moved into place only when every
file is complete (os.replace per file), so a failure leaves no partial report.

Notation for array shapes: T positions of a document (row t predicts tokens[t+1]).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from l47.evals.metrics import SPECIAL, tok_text
from l47.evals.plots import write_plots
from l47.fileio import deferred_interrupts, staging_dir
from l47.model import names

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
POSITIONS_TSV = "positions.tsv"
PLOTS_DIR = "plots"
TSV_COLUMNS = ("set", "doc", "doc_sha256", "pos", "role", "kind", "target", "target_text", "logp_base", "logp_new",
               "dlogp", "kld", "argmax_base", "argmax_new", "argmax_base_text", "argmax_new_text", "p_special_base",
               "p_special_new", "logp_penalty", "logp_bundle_penalty")


def _md(s) -> str:
    """Text safe inside a Markdown table cell."""
    s = "" if s is None else str(s)
    return s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("`", "'")


def _f(v, spec: str = ".4g") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.2e}"
        return format(v, spec)
    return _md(v)


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else _md(c) for c in r) + " |" for r in rows]
    return out + [""]


# ----------------------------------------------------------------------------------------------------------
# Markdown


# the report's sections, in order: each a pure function of report.json -> markdown lines
def render_markdown(r: dict) -> str:
    """report.json -> report.md: the sections below, in order."""
    L: list[str] = []
    for section in _MD_SECTIONS:
        L += section(r)
    return "\n".join(L) + "\n"


def _md_head(r: dict) -> list[str]:
    """Verdict line and inputs (documents by content hash)."""
    L: list[str] = []
    verdict = ("PASS" if r["passed"] else "FAIL") + "".join(f" — {x}" for x in r.get("stamps") or ())
    L += [f"# l47 audit ({r['mode']}): {verdict}", "",
          f"toolkit {r['toolkit_version']}, schema `{r['schema']}`, exit code {r['exit_code']}", ""]
    inp = r["inputs"]
    rows = [[k, (inp[k] or {}).get("path", "—"), (inp[k] or {}).get("sha256", "—")]
            for k in ("bundle", "base", "experiment", "record", "dev_report") if inp.get(k)]
    rows += [["blind", b["path"], b["sha256"]] for b in inp.get("blind") or ()]  # the blind set, one row each
    L += ["## Inputs", ""] + _table(["input", "path", "sha256"], rows)
    L += [f"policy `{inp['policy']}`, device `{inp['device']}`, vocabulary `{_md(inp['vocab'])}`, ledger "
          f"`{inp['ledger']}`", ""]
    docs = inp.get("documents", [])
    if docs:
        L += _table(["set", "document", "T", "verified", "refused", "sha256"],
                    [[d["set"], d["path"], d["T"], d["verified"], "; ".join(d["reasons"]) if d["refused"] else "no",
                      d["sha256"][:16] + "…"] for d in docs])
    return L


def _md_weakened(r: dict) -> list[str]:
    """What was relaxed from the defaults (l47.evals.bars.weakened) and evidence not gathered (blind: replay)."""
    w = r.get("weakened") or []
    if not w:
        return []
    return ["## Weakened", "", "Each moved from its default in the way that proves less (the bar named reads it):",
            ""] + _table(["key", "default", "value", "proves less when", "bar"],
                         [[x["key"], x["default"], x["value"], x.get("weaker") or "—", x.get("bar", "")] for x in w])


def _md_bars(r: dict) -> list[str]:
    """Every registered bar and the thresholds used."""
    L: list[str] = []
    L += ["## Bars", ""]
    L += _table(["bar", "value", "", "threshold", "status", "aggregation", "definition"],
                [[b["name"], b["value"], b["direction"], b["threshold"],
                  "n/a" if not b["applicable"] else ("PASS" if b["passed"] else "**FAIL**"), b["aggregation"],
                  b["definition"] + (f" — {b['details']['why']}" if "why" in b["details"] else "")]
                 for b in r["bars"]])
    L += ["### Thresholds used", ""]
    L += _table(["threshold", "value"], [[k, v] for k, v in r["thresholds"].items()])
    L += _table(["bar", "threshold", "from"], [[b["name"], b["threshold"], b["threshold_from"] or "fixed"]
                                               for b in r["bars"]])
    return L


def _md_bundle(r: dict) -> list[str]:
    """What changed in the bundle."""
    L: list[str] = []
    b = r.get("bundle") or {}
    if b:
        L += ["## Bundle", "",
              f"form **{b['form']}**, target `{b['target']}`, {b['compared']} tensors compared with the base; "
              f"target changed: {b['target_changed']}; ‖ΔW‖/‖W‖ = {_f(b['dw_rel'])} (‖ΔW‖_F = {_f(b['dw_fro'])}); "
              f"Q8_0 blocks changed: {_f(b['blocks_changed'])}", ""]
        for k, title in (("others_changed", "other tensors that differ"), ("target_type_shape", "target type/shape"),
                         ("metadata_changed", "metadata changed (non-provenance)"),
                         ("scope_mismatches", "scope claims that disagree")):
            if b.get(k):
                L += [f"- {title}: " + "; ".join(_md(x) for x in b[k])]
        if b.get("metadata_omitted"):
            L += [f"- overlay omits {len(b['metadata_omitted'])} base metadata keys"]
        L += [""]
    return L


def _md_proxy(r: dict) -> list[str]:
    """Not a proxy: base CE and zero-proxy per document."""
    L: list[str] = []
    p = r.get("proxy") or {}
    if p:
        L += ["## Not a proxy", "", f"ln V = {_f(p['ln_V'])}; limit {_f(p['limit'])}; unverified dumps: "
              f"{len(p['unverified'])}", ""]
        L += _table(["document", "set", "T", "base CE", "top-1", "zero-proxy max rel"],
                    [[k, v["set"], v["T"], v["ce"], v["top1"], (p["zero_proxy"].get(k) or {}).get("max_rel")]
                     for k, v in p["docs"].items()])
    return L


def _md_record(r: dict) -> list[str]:
    """The solve record's positions and the claims re-derived."""
    L: list[str] = []
    rec = r.get("record") or {}
    if rec:
        L += ["## Solve record", ""]
        if not rec.get("present"):
            L += [f"**{_md(rec.get('why'))}**", ""]
        else:
            L += [f"method `{rec['method']}`, {rec['n_slop']} slop positions; terms {rec['n_terms']}", ""]
            if rec["not_prefix_exact"]:
                L += ["### Not prefix-exact (bar a)", ""]
                L += _table(["doc", "pos", "token", "phrase", "why", "context", "target"],
                            [[x["doc_sha256"][:12], x["pos"], x["token"], x["phrase"], x["why"], x.get("context", ""),
                              x.get("target", "")] for x in rec["not_prefix_exact"][:50]])
            if rec["non_events"]:
                L += ["### Non-events among the record's slop positions (bar a)", ""]
                L += _table(["doc", "pos", "phrase", "base p (audit)", "claimed"],
                            [[x["doc_sha256"][:12], x["pos"], x["phrase"], x["p_base"], x["claimed_p"]]
                             for x in rec["non_events"][:50]])
            if rec["unnatural_docs"]:
                L += ["### Training documents refused (bar b)", ""]
                L += _table(["doc", "why"], [[x.get("path") or x["doc_sha256"], x["why"]]
                                             for x in rec["unnatural_docs"]])
        if rec.get("overlap"):
            L += ["### Overlap with scored sets (bar c)", ""]
            L += _table(["doc", "scored set", "in"], [[x["doc_sha256"][:16], x["scored_set"], x["in"]]
                                                      for x in rec["overlap"]])
    c = r.get("claims") or {}
    if c.get("present"):
        L += ["### Claims re-derived", ""]
        L += _table(["claim", "claimed", "re-derived", "ok", "definition"],
                    [[k, v["claimed"], v["rederived"], v["ok"], v["definition"]] for k, v in c["compared"].items()])
        if c["not_rederived"]:
            L += [f"not re-derived: {', '.join(c['not_rederived'])}", ""]
    return L


def _md_split(r: dict) -> list[str]:
    """Split and slop per set."""
    L: list[str] = []
    sp = r.get("split")
    if sp:
        L += ["## Split", "", f"events {sp['events']}, held-out share {_f(sp['heldout_frac'])}", ""]
        ne: dict[str, int] = {}
        for x in r.get("non_events") or []:
            ne[x["set"]] = ne.get(x["set"], 0) + 1
        L += [f"non-events (prefix-exact, base p < {_f(r['thresholds']['non_event_p'])}) per set: {ne or 'none'}", ""]

    slop = (r.get("slop") or {}).get("heldout") or (r.get("blind") or {}).get("slop")
    if slop:
        L += _slop_md(slop, "Slop at held-out events" if r["mode"] == "dev" else "Slop on the blind set")
    ps = (r.get("slop") or {}).get("per_set")
    if ps:
        L += ["### p(rejected) per set (events)", ""]
        L += _table(["set", "n", "p before", "p after", "reduction", "Σp special before", "after"],
                    [[s, v["n"], v["p_before"], v["p_after"], v["reduction"], v.get("special_p_before"),
                      v.get("special_p_after")] for s, v in ps.items()])
    return L


def _md_collateral(r: dict) -> list[str]:
    """Collateral words (d)."""
    L: list[str] = []
    col = r.get("collateral")
    if col:
        L += ["## Collateral (collateral_eval)", "",
              f"{col['n']} occurrences, mean Δlog p {_f(col['mean_dlogp'])}, {col['n_below']} below "
              f"{_f(r['thresholds']['collateral_below'])} ({_f(col['frac_below'])})", ""]
        L += _table(["word", "n", "mean Δlog p", "frac below", "worst", "worst context", "p before → after"],
                    [[repr(k), v["n"], v["mean_dlogp"], v["frac_below"], v["worst"], v["worst_context"],
                      f"{_f(v['worst_p'][0])} → {_f(v['worst_p'][1])}"] for k, v in col["per_word"].items()])
    return L


def _md_kld(r: dict) -> list[str]:
    """KLD statistics per set (e) and the engine-level checks."""
    L: list[str] = []
    kld = r.get("kld") or {}
    if kld:
        L += ["## KLD statistics per set (exact, f32 logits, f64 sums, full vocabulary)", ""]
        rows = []
        for s, v in kld.items():
            if not v:
                continue
            rows.append([s, v["n"], f"{_f(v['kld_mean'])} ± {_f(v['kld_err'])}", v["kld_pct"]["99.0"], v["kld_max"],
                         v["kld_pct"]["50.0"], f"{_f(v['ppl_base'])} → {_f(v['ppl_new'])}", v["ppl_ratio"],
                         v["ln_ppl_ratio"], v["cor_ln_ppl"], f"{_f(v['dp_mean'])} ± {_f(v['dp_err'])}", v["rms_dp"],
                         v["same_top"]])
        L += _table(["set", "n", "mean KLD", "KLD 99%", "max", "median", "PPL base → new", "PPL ratio",
                     "ln ratio", "cor", "mean Δp", "RMS Δp", "same top"], rows)
        L += ["percentiles (KLD 99.9…0.1, Δp 99.9…0.1) are in report.json under kld.<set>.", ""]
    eng = r.get("engine") or {}
    if eng:
        L += ["## Engine-level checks", ""]
        if eng.get("zero_proxy_edited"):
            L += _table(["edited-engine dump", "document", "max rel |Δ log p|"],
                        [[k, v["doc"], v["max_rel"]] for k, v in eng["zero_proxy_edited"].items()])
        if eng.get("kld"):
            L += _table(["set", "engine KLD", "floor (engine vs exact base)", "tail-forward KLD"],
                        [[k, v["kld"], v["floor"], v["tail_kld"]] for k, v in eng["kld"].items()])
    return L


def _md_chat(r: dict) -> list[str]:
    """Special tokens, turn ends, ordinary tokens (f), (g); blind vs dev."""
    L: list[str] = []
    chat = r.get("chat") or {}
    bl = r.get("blind") or {}
    flips = chat.get("flips") or bl.get("flips")
    if flips:
        L += ["## Special tokens on chat-formatted documents (f)", "",
              f"{flips['docs']} chat documents, {flips['positions']} positions; flips by kind: {flips['by_kind']}", ""]
        if flips["flips"]:
            L += _table(["kind", "doc", "pos", "role", "context", "base → new", "target"],
                        [[f["kind"], Path(f["doc"]).name, f["pos"], f["role"], f["context"],
                          f"{f['base']!r} → {f['new']!r}", repr(f["target"])] for f in flips["flips"][:100]])
    te = chat.get("turn_ends") or bl.get("turn_ends")
    if te:
        L += [f"real turn ends: {te['n']}; <|im_end|> was the argmax at {te['was_argmax']}, kept at {te['kept']}; "
              f"mean Δlog p(<|im_end|>) {_f(te['mean_dlogp'])} (min {_f(te['min_dlogp'])})", ""]
        if te.get("lost_rows"):  # base lead: a tie of thousandths of a nat flips under any edit; a wide lead is damage
            L += _table(["lost turn end: doc", "pos", "Δlog p(<|im_end|>)", "base lead (nats)", "new argmax id",
                         "new argmax leads by"],
                        [[Path(x["doc"]).name, x["pos"], x["dlogp"], x.get("base_lead"), x.get("new_argmax"),
                          x.get("new_deficit")] for x in te["lost_rows"][:100]])
    sm = chat.get("special_mass") or bl.get("special_mass")
    if sm:
        L += _table(["split", "slop events", "Σp special before", "after", "rise"],
                    [[s, v["n"], v["before"], v["after"], v["rise"]] for s, v in sm["per_split"].items()])
    o = chat.get("ordinary") or bl.get("ordinary")
    if o:
        L += ["## Held-out chat (g)" if r["mode"] == "dev" else "## Blind set (g)", "",
              f"{o['docs']} document(s); ordinary tokens n = {o['n_ordinary']}: mean Δlog p {_f(o['mean_dlogp'])} "
              f"(median {_f(o['median_dlogp'])}, {_f(o['frac_below'])} below −0.1); non-slop positions "
              f"n = {o['n_non_slop']}: KLD {_f(o['kld'])}", ""]
    if bl.get("comparisons"):
        L += ["## Blind vs dev", ""]
        L += _table(["figure", "blind", "dev", "blind/dev", "definition"],
                    [[c["figure"], c["blind"], c["dev"], c["blind/dev"], c["definition"]] for c in bl["comparisons"]])
    return L


def _md_penalty(r: dict) -> list[str]:
    """The sampler penalty, warnings and notes."""
    L: list[str] = []
    pen = r.get("penalty")
    if pen:
        L += ["## Sampler penalty (seed §6.3)", "",
              f"form `{pen['form']}`, bias {_f(pen['bias'])} logits, {len(pen['rules'])} rules. Penalised rows: "
              f"{pen['penalised_rows']}; unchanged rows: {pen['unchanged_rows']} with max |Δlog p(target)| "
              f"{_f(pen['unchanged_max_abs_dlogp_alone'])} alone and {_f(pen['unchanged_max_abs_dlogp_stacked'])} "
              "stacked (the penalty touches nothing outside prefix matches).", ""]
        L += _table(["set", "mean KL(base ‖ base+penalty)", "penalised rows"],
                    [[s, v["mean"], v["penalised_rows"]] for s, v in pen["kld_alone_per_set"].items()])
        L += ["Cheaper forms (not exported; their extra hits over the exact form):", ""]
        L += _table(["form", "extra rows", "extra (row, token) pairs", "legit targets hit", "mean Δlog p(target)",
                     "min", "mean KL"],
                    [[k, v["positions"], v["pairs"], v["target_hit"], v["mean_dlogp_target"], v["min_dlogp_target"],
                      v["mean_kld"]] for k, v in pen["cheap_forms"].items()])
        for k, v in pen["cheap_forms"].items():
            for e in v["examples"][:3]:
                L += [f"- `{k}` extra hit: {_md(e['context'])} → {_md(repr(e['target']))} "
                      f"(Δlog p {_f(e['dlogp_target'])})"]
        L += [""]
    if r.get("sets_warnings"):
        L += ["## Sets warnings", ""] + [f"- {_md(x)}" for x in r["sets_warnings"]] + [""]
    if r.get("notes"):
        L += ["## Notes", ""] + [f"- {_md(x)}" for x in r["notes"]] + [""]
    return L


_MD_SECTIONS = (_md_head, _md_weakened, _md_bars, _md_bundle, _md_proxy, _md_record, _md_split, _md_collateral,
                _md_kld, _md_chat, _md_penalty)


def _interval_head(s: dict) -> str:
    """The interval column's heading: its level and resampling unit (report.json `bootstrap`)."""
    b = s.get("bootstrap") or {}
    return f"residual {b['level']:.0%} interval (bootstrap over {b['unit']}s)" if b else "residual interval"


def _level(s: dict) -> str:
    """The intervals' level as the report states it (report.json `bootstrap`), e.g. '90 %'."""
    b = s.get("bootstrap") or {}
    return f"{b['level'] * 100:.0f} %" if b else "the"


def _interval_md(v: dict) -> str:
    """'[lo, hi]' of a residual ratio's bootstrap interval, or why there is none."""
    iv = v.get("residual_interval")
    if iv is not None:
        return f"[{_f(iv[0], '.3g')}, {_f(iv[1], '.3g')}]"
    return "no interval (1 document)" if v.get("n_docs") == 1 else "no interval"


def _slop_md(s: dict, title: str) -> list[str]:
    L = [f"## {title}", "",
         f"{s['n']} events: mean p(rejected) {_f(s['p_before'])} → {_f(s['p_after'])} (reduction {_f(s['reduction'])}, "
         f"residual ratio {_f(s['residual_ratio'])}, {_level(s)} interval over documents {_interval_md(s)}); fresh: {s['fresh']['n']} events "
         f"{_f(s['fresh']['p_before'])} → {_f(s['fresh']['p_after'])}; in-context copies: {s['copies']['n']} events "
         f"{_f(s['copies']['p_before'])} → {_f(s['copies']['p_after'])}", ""]
    L += _table(["phrase", "n", "docs", "copies", "p before", "p after", "reduction", "residual", _interval_head(s),
                 "penalty alone", "bundle + penalty", "argmax special after"],
                [[k, v["n"], v.get("n_docs"), v["copies"], v["p_before"], v["p_after"], v["reduction"],
                  v["residual_ratio"], _interval_md(v), v.get("p_penalty"), v.get("p_stacked"),
                  v.get("argmax_special_after")] for k, v in s["per_phrase"].items()])
    ev = s.get("events") or []
    if ev:
        L += _table(["phrase", "doc", "pos", "copy", "context", "p before", "p after", "new argmax"],
                    [[e["phrase"], Path(e["doc"]).name, e["pos"], e["copy"], e["context"], e["p_before"], e["p_after"],
                      repr(e["argmax_after_text"])] for e in ev[:60]])
    return L


# ----------------------------------------------------------------------------------------------------------
# per-position TSV


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _column(spec: str, a) -> list[str]:
    """format(x, spec) of every element of a numeric column (as the f-string of each numpy element gives)."""
    return [format(x, spec) for x in np.asarray(a).tolist()]


def _texts(cache: dict, vocab, ids: list[int], decode) -> list[str]:
    """The escaped text of each id of `ids` [T], each distinct id decoded once (`cache`: id -> text, per render)."""
    out = []
    for i in ids:
        s = cache.get(i)
        if s is None:
            s = cache[i] = _esc(decode(vocab, i))
        out.append(s)
    return out


# one TSV line: %-formatting of a float is format()'s (the same shortest-repr code, 'f' / 'g' and precision)
_TSV_LINE = "\t".join(["%s"] * 6 + ["%d", "%s", "%.6f", "%.6f", "%.6f", "%.8f", "%d", "%d", "%s", "%s", "%.6g", "%.6g",
                       "%s", "%s"])


def _ints(a, T: int) -> list[int]:
    return np.asarray(a[:T]).astype(np.int64).tolist()


def _floats(a, T: int) -> list[float]:
    return np.asarray(a[:T]).tolist()


def _doc_rows(d, vocab, spec: np.ndarray, sims, caches: tuple[dict, dict]) -> list[str]:
    """The TSV lines of one document, built column by column (each distinct token decoded once, the kinds by one
    np.select) and formatted a line at a time by one template: the same bytes as formatting every cell apart."""
    T = d.T
    if T == 0:
        return []
    b, n = d.ps.base, d.ps.new
    tg = _ints(d.targets, T)
    psb = np.exp(b.set_logp[SPECIAL]).sum(1)  # [T]
    psn = np.exp(n.set_logp[SPECIAL]).sum(1)
    sim = sims.get(d.sha256) or {}
    al, st = sim.get("alone"), sim.get("stacked")
    kind = np.select([np.asarray(d.slop_rows[:T], bool), np.asarray(d.chat.terminal[:T], bool),
                      np.asarray(d.chat.opener[:T], bool), np.isin(np.asarray(d.targets[:T]), spec)],
                     ["slop", "terminal", "opener", "special"], "ordinary").tolist()
    amb, amn = _ints(b.argmax, T), _ints(n.argmax, T)
    blank = [""] * T
    cols = [[str(d.set)] * T, [str(d.path)] * T, [str(d.sha256)] * T, [str(t) for t in range(T)],
            [names.ROLES[r] for r in _ints(d.role, T)], kind, tg,
            _texts(caches[0], vocab, tg, lambda v, i: v.decode([i])),
            _floats(b.logp_target, T), _floats(n.logp_target, T), _floats(d.ps.dlogp, T), _floats(d.ps.kld, T),
            amb, amn, _texts(caches[1], vocab, amb, tok_text), _texts(caches[1], vocab, amn, tok_text),
            _floats(psb, T), _floats(psn, T),
            blank if al is None else _column(".6f", al.logp_target[:T]),
            blank if st is None else _column(".6f", st.logp_target[:T])]
    return [_TSV_LINE % r for r in zip(*cols)]


def render_tsv(docs, vocab, special_ids, sims) -> str:
    """positions.tsv: the header, then one line per scored position of every document (TSV_COLUMNS)."""
    spec = np.array(sorted(set(int(i) for i in special_ids.values())), dtype=np.int64)
    lines = ["\t".join(TSV_COLUMNS)]
    caches: tuple[dict, dict] = ({}, {})  # id -> escaped text: vocab.decode (targets), tok_text (argmaxes)
    for d in docs:
        lines += _doc_rows(d, vocab, spec, sims, caches)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# everything, atomically


def write_reports(out: Path, report: dict, docs, vocab, special_ids, sims, plots: bool = True) -> dict[str, str]:
    """Write report.json, report.md, positions.tsv and the plots into `out` (staged, then moved in)."""
    out = Path(out)

    with staging_dir(out / ".l47-audit") as stage:
        (stage / REPORT_JSON).write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=False))
        (stage / REPORT_MD).write_text(render_markdown(report))
        (stage / POSITIONS_TSV).write_text(render_tsv(docs, vocab, special_ids, sims))
        names = [REPORT_JSON, REPORT_MD, POSITIONS_TSV]
        if plots:
            (stage / PLOTS_DIR).mkdir()
            names += [f"{PLOTS_DIR}/{p}" for p in write_plots(stage / PLOTS_DIR, report, docs)]
        files = {}
        with deferred_interrupts():  # the report's files move in together: an interrupt leaves all or none
            if plots:
                (out / PLOTS_DIR).mkdir(exist_ok=True)
            for nm in names:
                os.replace(stage / nm, out / nm)
                files[nm] = str(out / nm)
        return files
