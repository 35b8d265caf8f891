"""One output policy for every command, checked before any work (issue 14 item 1).

An output path is refused (L47Error -> exit 2) when it
  - resolves to an input of the command (same path after resolving links, or the same inode) or to the base
    model — never overridable;
  - is a directory where a file is expected, or a file (or a path under a file) where a folder is expected;
  - is an existing file that is not an l47 output of the same kind (a GGUF without l47 provenance, a TSV with
    another header, a JSON of another schema, ...) — unless --force;
  - lies in a folder this user cannot create or write, or on a disk whose free space is below the expected size;
  - is named twice (two outputs of one command on the same file).
Nothing is created here: a refused command leaves the disk as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from l47.errors import L47Error

# --- kinds of output: what an existing file must look like to be overwritten without --force -----------------

GGUF = "gguf"  # a bundle / overlay / transplant written by l47 (GGUF with l47.provenance.* keys)
SCORE_TSV = "score-tsv"
SETS_JSON = "sets-json"
PENALTY_JSON = "penalty-json"
BENCH_JSON = "bench-json"
SOLVE_RECORD = "solve-record"
AUDIT_JSON = "audit-json"  # `audit --json`: the report.json content written elsewhere
PLAN_JSON = "plan-json"
SWEEP_TSV = "sweep-tsv"  # `l47 solve --sweep`'s table
SWEEP_PNG = "sweep-png"  # `l47 solve --sweep`'s plot (a PNG whose metadata names it)
LEDGER = "ledger"  # appended to: must already be a valid ledger (or absent)
AUDIT_DIR = "audit-dir"
DUMP_DIR = "dump-dir"
DEMO_DIR = "demo-dir"
DIR_KINDS = (AUDIT_DIR, DUMP_DIR, DEMO_DIR)

_JSON_SNIFF_MAX = 512 << 20  # an output JSON larger than this is not one of ours


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def _is_l47_gguf(path: Path) -> bool:
    from l47.model.gguf_io import open_gguf
    from l47.model.names import PROVENANCE_PREFIX

    if _head(path, 4) != b"GGUF":
        return False
    try:
        g = open_gguf(path)
    except Exception:  # noqa: BLE001 - any unreadable GGUF is "not ours"
        return False
    return any(k.startswith(PROVENANCE_PREFIX) for k in g.kv)


def _json_schema(path: Path):
    if path.stat().st_size > _JSON_SNIFF_MAX:
        return None
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _is_score_tsv(path: Path) -> bool:
    from l47.app.score import TSV_BASE, TSV_PAIRED

    first = _head(path, 4096).split(b"\n", 1)[0].decode("utf-8", "replace")
    return first in ("\t".join(TSV_BASE), "\t".join(TSV_PAIRED))


def _is_sets_json(path: Path) -> bool:
    from l47.data.sets import SCHEMA

    d = _json_schema(path)
    return d is not None and d.get("schema") == SCHEMA


def _is_penalty_json(path: Path) -> bool:
    from l47.evals.penalty import PENALTY_SCHEMA

    d = _json_schema(path)
    return d is not None and d.get("schema") == PENALTY_SCHEMA


def _is_bench_json(path: Path) -> bool:
    d = _json_schema(path)
    return d is not None and set(d) <= {"forward", "wfld"}


def _is_solve_record(path: Path) -> bool:
    d = _json_schema(path)
    return d is not None and {"method", "base_sha256", "bundle_sha256", "touched"} <= set(d)


def _is_plan_json(path: Path) -> bool:
    d = _json_schema(path)
    return d is not None and isinstance(d.get("plan"), dict) and set(d) <= {"plan", "anchors", "estimate", "handoff"}


def _is_sweep_tsv(path: Path) -> bool:
    from l47.solvers.sweep import TABLE_COLUMNS

    return _head(path, 4096).split(b"\n", 1)[0].decode("utf-8", "replace").startswith("\t".join(TABLE_COLUMNS))


def _is_sweep_png(path: Path) -> bool:
    from l47.evals.plots import SWEEP_PLOT_TITLE

    h = _head(path, 4096)
    return h.startswith(b"\x89PNG") and SWEEP_PLOT_TITLE.encode() in h


def _is_ledger(path: Path) -> bool:
    return True  # validated by check_ledger_file in check_outputs (a bad ledger is an error, not overwritten)


def _is_audit_report(path: Path) -> bool:
    from l47.evals.audit import AUDIT_SCHEMA

    d = _json_schema(path)
    return d is not None and d.get("schema") == AUDIT_SCHEMA


_SNIFF: dict[str, tuple[str, Callable[[Path], bool]]] = {
    GGUF: ("a GGUF written by l47 (with l47.provenance metadata)", _is_l47_gguf),
    SCORE_TSV: ("a per-position TSV written by `l47 score`", _is_score_tsv),
    SETS_JSON: ("a JSON report written by `l47 sets`", _is_sets_json),
    PENALTY_JSON: ("a penalty spec written by `l47 penalty`", _is_penalty_json),
    BENCH_JSON: ("a JSON written by `l47 bench`", _is_bench_json),
    SOLVE_RECORD: ("a solve record written by `l47 solve`", _is_solve_record),
    AUDIT_JSON: ("an audit report written by `l47 audit`", _is_audit_report),
    PLAN_JSON: ("a plan written by `l47 plan --json`", _is_plan_json),
    LEDGER: ("a scoring ledger", _is_ledger),
    SWEEP_TSV: ("a sweep table written by `l47 solve --sweep`", _is_sweep_tsv),
    SWEEP_PNG: ("a sweep plot written by `l47 solve --sweep`", _is_sweep_png),
}


@dataclass(frozen=True)
class Output:
    """One output of a command. `option` names it in messages (e.g. "--out"); `nbytes` is the expected size for
    the free-disk check; for a folder output, `files` are the names the command writes inside it (each must not
    be an input either)."""

    path: Path
    kind: str
    option: str
    nbytes: int = 0
    files: tuple[str, ...] = ()
    nbytes_what: str = ""  # what the expected size is made of, for the refusal (e.g. "48 dumps, estimated")


def _same(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
    except OSError:
        pass
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _existing_ancestor(p: Path) -> Path:
    p = Path(os.path.abspath(p))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _check_writable(o: Output, folder_wanted: bool) -> None:
    """The path's nearest existing ancestor must be a folder this user can write, with room for o.nbytes."""
    target = Path(o.path)
    anc = _existing_ancestor(target if not target.exists() or not folder_wanted else target / "x")
    if anc == Path(os.path.abspath(target)) and not folder_wanted:
        anc = anc.parent  # an existing file: its folder is written (temp file + rename)
    if not anc.is_dir():
        raise L47Error(target, o.option, "a path inside a folder", f"{anc} is a file, not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise L47Error(target, o.option, "a folder this user can write", f"{anc} is not writable")
    if o.nbytes > 0:
        free = shutil.disk_usage(anc).free
        if free < o.nbytes:
            what = f" for {o.nbytes_what}" if o.nbytes_what else ""
            raise L47Error(target, o.option, f"at least {_fmt_bytes(o.nbytes)} free on its disk{what}",
                           f"{_fmt_bytes(free)} free in {anc}")


def _refuse_inputs(p: Path, option: str, inputs: Iterable[tuple[Path, str]]) -> None:
    if not p.exists():
        return
    for ip, role in inputs:
        if ip is not None and Path(ip).exists() and _same(p, Path(ip)):
            raise L47Error(p, option, "a new file, never one of the command's inputs",
                           f"the {role} ({ip})")


def check_outputs(outputs: Iterable[Output], inputs: Iterable[tuple[Path | None, str]] = (), *,
                  force: bool = False) -> None:
    """Apply the output policy (module docstring) to every output; raise L47Error on the first refusal.

    inputs: (path, role) pairs, e.g. (model, "base model"), (dump, "dump of set train"); None entries skipped."""
    outs = [o for o in outputs if o.path is not None]
    ins = [(Path(p), r) for p, r in inputs if p is not None]
    seen: list[tuple[Path, str]] = []  # (path, option) of every output so far, files inside folders included
    for o in outs:
        p = Path(o.path)
        for sp, sopt in seen:
            if _same(sp, p) or Path(os.path.abspath(sp)) == Path(os.path.abspath(p)):
                raise L47Error(p, o.option, f"a path other than {sopt}'s", "the same file")
        seen.append((p, o.option))
        seen += [(p / name, f"{o.option} ({name})") for name in o.files]
        if o.kind in DIR_KINDS:
            if p.exists() and not p.is_dir():
                raise L47Error(p, o.option, "a folder (or a new path)", "an existing file")
            _check_writable(o, folder_wanted=True)
            for name in o.files:
                _refuse_inputs(p / name, o.option, ins)
            if o.kind == AUDIT_DIR and (p / "report.json").is_file() and not force:
                if not _is_audit_report(p / "report.json"):
                    raise L47Error(p / "report.json", o.option, "an audit report written by `l47 audit` to "
                                   "replace (or --force)", "another file")
            continue
        if p.is_dir():
            raise L47Error(p, o.option, "a file path", "a directory")
        _refuse_inputs(p, o.option, ins)
        if p.exists() and o.kind == LEDGER:
            from l47.data.ledger import check_ledger_file

            check_ledger_file(p)  # a corrupt ledger fails now, not after the work
        elif p.exists() and not force:
            want, sniff = _SNIFF[o.kind]
            try:
                ours = p.is_file() and sniff(p)
            except OSError:
                ours = False
            if not ours:
                raise L47Error(p, o.option, f"a new path or {want} (or --force to replace it)",
                               "an existing file of another kind")
        _check_writable(o, folder_wanted=False)


def file_size(p: Path | None) -> int:
    try:
        return Path(p).stat().st_size if p is not None else 0
    except OSError:
        return 0


def experiment_inputs(exp) -> list[tuple[Path, str]]:
    """(path, role) of every file an experiment names: its own file, the model, every dump."""
    out: list[tuple[Path, str]] = [(Path(exp.path), "experiment")]
    if exp.model is not None:
        out.append((Path(exp.model), "base model"))
    out += [(Path(p), f"dump of set {s}") for s, p in exp.documents()]
    return out


# --- per command: the inputs and outputs each one names (called by l47.app.cli before any work) -------------


def _exp(path):
    from l47.data.experiment import load_experiment

    return load_experiment(path)  # validated now: a bad experiment fails before any model is loaded


def _overlay_nbytes(model: Path) -> int:
    from l47.model.gguf_io import open_gguf

    g = open_gguf(model)
    return sum(int(i.nbytes or 0) for n, i in g.tensors.items() if n.endswith("ffn_down_shexp.weight"))


def _models(exp, model, allow: bool, extra=()) -> list[str]:
    """Refuse dumps of another model (l47.data.identity) before any work; notes when allowed."""
    from l47.data.identity import other_model_notes
    from l47.model.gguf_io import open_gguf

    model = model or exp.model
    if model is None or not Path(model).is_file():
        return []  # the command itself reports the missing model
    try:
        sha = open_gguf(model).sha256()
    except L47Error:
        return []  # not a GGUF: the command reports it
    return other_model_notes([p for _, p in exp.documents()] + [p for p in extra if p is not None], sha, model, allow)


# expected bytes of a per-position TSV row beyond its path / id column (numbers, token texts, separators): the
# audit's positions.tsv rows are ~270 bytes with a 58-byte path on the demo; score's ~40 beyond the doc id
TSV_ROW_AUDIT = 320
TSV_ROW_SCORE = 96
REPORT_PER_POSITION = 64  # report.json / report.md per scored position (31 bytes on the demo)
REPORT_BASE = 4 << 20  # plots and the reports' fixed part


def _positions(paths) -> tuple[int, int]:
    """(positions, longest path) of the readable dumps among `paths` (headers only; unreadable ones are the
    command's to report)."""
    from l47.dumps import read_dump

    T, longest = 0, 0
    for p in paths:
        try:
            T += len(read_dump(p, validate=False).tokens) - 1
        except (L47Error, OSError, ValueError):
            continue
        longest = max(longest, len(str(p)))
    return T, longest


def check_score(model, dumps, bundle, tsv, ledger, force=False) -> None:
    ins = [(model, "base model"), (bundle, "bundle")] + [(d, "dump") for d in dumps]
    T, _ = _positions(dumps) if tsv is not None else (0, 0)
    check_outputs([Output(tsv, SCORE_TSV, "--tsv", nbytes=T * (TSV_ROW_SCORE + 100),
                          nbytes_what=f"{T} rows, estimated"),
                   Output(ledger, LEDGER, "--ledger")], ins, force=force)


def check_sets(experiment, json_out, model, ledger, force=False, allow_other_model=False) -> list[str]:
    exp = _exp(experiment)
    ins = experiment_inputs(exp) + [(model, "base model")]
    json_out = None if json_out is not None and str(json_out) == "-" else json_out  # "-": stdout
    check_outputs([Output(json_out, SETS_JSON, "--json"),
                   Output(ledger, LEDGER, "--ledger")], ins, force=force)
    return _models(exp, model, allow_other_model)


def _file_out(json_out):
    """None for no output or "-" (stdout)."""
    return None if json_out is None or str(json_out) == "-" else Path(json_out)


def check_solve(args, force=False, json_out=None) -> list[str]:
    """`l47 solve`'s paths, config and sets report before the model is read (args: l47.solvers.solve.SolveArgs)."""
    from l47.data.record import record_path_for
    from l47.solvers.solve import resolve_config

    exp = _exp(args.experiment)
    resolve_config(exp.solver, args.method, str(exp.path))  # every knob checked before the model is read
    if args.sets_json is not None:
        from l47.data.sets import check_sets_report, load_sets_report

        # a bad or stale sets report fails now, not after the model is loaded
        check_sets_report(load_sets_report(args.sets_json), exp, args.sets_json)
    model = args.model or exp.model
    if args.plan_json is not None:
        _check_plan_handoff(args, exp, model)
    ins = experiment_inputs(exp) + [(model, "base model"), (args.sets_json, "sets report"), (args.plan_json, "plan")]
    out = Path(args.out)
    size = (_overlay_nbytes(model) if args.overlay else file_size(model)) \
        if model is not None and Path(model).is_file() else 0
    outs = [Output(out, GGUF, "--out", nbytes=size),
            Output(record_path_for(out), SOLVE_RECORD, "--out (its solve record)"),
            Output(_file_out(json_out), SOLVE_RECORD, "--json"),
            Output(args.ledger, LEDGER, "--ledger")]
    if args.sweep:
        from l47.solvers.sweep import sweep_paths_for

        png, tsv = sweep_paths_for(out)
        outs += [Output(png, SWEEP_PNG, "--out (its sweep plot)"), Output(tsv, SWEEP_TSV, "--out (its sweep table)")]
    check_outputs(outs, ins, force=force)
    return _models(exp, model, args.allow_other_model)


def _check_plan_handoff(args, exp, model) -> None:
    """`l47 solve --plan P` before the model is read: no --sweep, --sets given, and P made from these inputs (a
    missing P is reported after the thin-phrase check: `l47 plan` refuses a thin phrase and writes no plan)."""
    from l47.data.sets import load_sets_report
    from l47.model.gguf_io import open_gguf
    from l47.solvers.solve import check_plan_handoff, handoff_inputs

    if args.sweep:
        raise L47Error("l47 solve", "--plan", "no --sweep (each sweep candidate is planned under its own config)",
                       "--plan with --sweep")
    if args.sets_json is None:
        raise L47Error("l47 solve", "--plan", "--sets too (the sets report the plan was made from)", "no --sets")
    if Path(args.plan_json).exists() and model is not None and Path(model).is_file():
        check_plan_handoff(args.plan_json, handoff_inputs(args, exp, load_sets_report(args.sets_json),
                                                       open_gguf(model).sha256()))


def check_plan(experiment, json_out, model, sets_json, force=False) -> None:
    exp = _exp(experiment)
    if sets_json is not None:
        from l47.data.sets import check_sets_report, load_sets_report

        check_sets_report(load_sets_report(sets_json), exp, sets_json)  # made from this experiment's content?
    ins = experiment_inputs(exp) + [(model or exp.model, "base model"), (sets_json, "sets report")]
    check_outputs([Output(_file_out(json_out), PLAN_JSON, "--json")], ins, force=force)


def check_transplant(overlay, base, out, force=False) -> None:
    check_outputs([Output(out, GGUF, "OUT", nbytes=file_size(base))], [(overlay, "overlay"), (base, "base model")],
                  force=force)


def expand_dump_paths(paths, option: str) -> tuple[Path, ...]:
    """The dumps a list option names: each path as given, a folder standing for the dump files directly in it
    (*.safetensors, sorted by name; `l47 dump --out` writes them there). A folder holding none is refused (a
    misspelt or unfilled folder would otherwise be an empty blind set)."""
    from l47.app.dumping import DUMP_SUFFIX

    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append(p)
            continue
        found = sorted(q for q in p.iterdir() if q.name.endswith(DUMP_SUFFIX) and q.is_file())
        if not found:
            raise L47Error(p, option, f"dump files ({DUMP_SUFFIX}) in the folder, or dump files", "a folder without any")
        out += found
    return tuple(out)


def check_audit(args, force=False, json_out=None) -> list[str]:
    """`l47 audit`'s inputs and outputs, with room for the report (args: l47.evals.audit.AuditArgs)."""
    from l47.evals.report import POSITIONS_TSV, REPORT_JSON, REPORT_MD

    exp = _exp(args.experiment)
    ins = experiment_inputs(exp) + [(args.bundle, "bundle"), (args.base, "base model"),
                                    (args.dev_report, "dev report"), (args.record, "solve record")]
    ins += [(d, "blind dump") for d in args.blind]
    ins += [(d, "engine dump") for d in args.engine_dumps]
    out = Path(args.out_dir)
    docs = list(args.blind) if args.blind else [p for s, p in exp.documents() if s != "blind"]
    T, longest = _positions(docs)
    need = T * (TSV_ROW_AUDIT + longest + REPORT_PER_POSITION) + REPORT_BASE
    check_outputs([Output(out, AUDIT_DIR, "--out", files=(REPORT_JSON, REPORT_MD, POSITIONS_TSV), nbytes=need,
                          nbytes_what=f"the report of {T} positions, estimated"),
                   Output(_file_out(json_out), AUDIT_JSON, "--json"),
                   Output(args.ledger, LEDGER, "--ledger")], ins, force=force)
    return _models(exp, args.base, args.allow_other_model, extra=args.blind)  # engine dumps: the bundle's


def check_penalty(args, force=False, allow_other_model=False) -> list[str]:
    """`l47 penalty`'s bias, form, inputs and outputs (args: l47.evals.penalty.PenaltyArgs)."""
    import math

    from l47.evals.penalty import FORMS

    exp = _exp(args.experiment)
    bias, form = args.bias, args.form
    if not (isinstance(bias, (int, float)) and math.isfinite(bias) and bias > 0):
        raise L47Error("l47 penalty", "--bias", "a finite logit bias > 0 (subtracted from the final token)",
                       repr(bias))
    if form not in FORMS:
        raise L47Error("l47 penalty", "--form", f"one of {list(FORMS)}", repr(form))
    ins = experiment_inputs(exp) + [(args.base, "base model"), (args.bundle, "bundle")]
    check_outputs([Output(args.out, PENALTY_JSON, "--out"), Output(args.ledger, LEDGER, "--ledger")], ins,
                  force=force)
    return _models(exp, args.base, allow_other_model)


def check_dump(inputs, model, out, generate=None, ref_logits: bool = False) -> None:
    """Inputs exist; --out is a folder (or new path) that is not an input, writable, with room on its disk for
    the dumps (l47.app.dumping.estimate_dump_bytes: the documents' token counts x the model's dims, read without
    loading the model)."""
    from l47.app.dumping import estimate_dump_bytes

    if not Path(inputs).exists():
        raise L47Error(inputs, "input", "an existing JSONL file or dataset", "nothing at that path")
    if not Path(model).exists():
        raise L47Error(model, "--model", "a qwen4exp GGUF or a transformers checkpoint folder", "nothing there")
    ins = [(inputs, "input documents"), (model, "model")]
    check_outputs([Output(out, DUMP_DIR, "--out")], ins)  # the path itself first: a file or an input is refused
    _check_dump_files(inputs, out, ins)
    est = estimate_dump_bytes(model, inputs, out, generate, ref_logits)
    if est is not None and est[0] > 0:
        nb, k = est
        check_outputs([Output(out, DUMP_DIR, "--out", nbytes=nb, nbytes_what=f"{k} dump(s), estimated")], ins)


def _check_dump_files(inputs, out, ins) -> None:
    """Each document's dump file in --out (l47.app.dumping.dump_name) is new, or a dump l47 wrote (a rerun resumes
    or replaces it), never another file — e.g. a checkpoint's model.safetensors when --out is its folder — and
    never an input."""
    from l47.app.dumping import REFUSED_SUFFIX, dump_name
    from l47.dumps import read_dump
    from l47.dumps.chat import read_documents

    out = Path(out)
    if not out.is_dir():
        return
    try:
        docs = read_documents(inputs).docs
    except (L47Error, OSError, ValueError):
        return  # the command reports its input
    for doc in docs:
        for p in (out / dump_name(doc.id), out / (dump_name(doc.id) + REFUSED_SUFFIX)):
            if not p.exists() and not p.is_symlink():
                continue
            _refuse_inputs(p, "--out", ins)
            try:
                ours = p.is_file() and not p.is_symlink() and read_dump(p, validate=False) is not None
            except (L47Error, OSError, ValueError):
                ours = False
            if not ours:
                raise L47Error(p, "--out", f"a new path or a dump written by `l47 dump` for document {doc.id!r} "
                               "(a rerun resumes or replaces it)", "an existing file of another kind")


def check_bench(json_out, force=False) -> None:
    check_outputs([Output(json_out, BENCH_JSON, "--json")], force=force)


# --- command-line options shared by several commands: checked by the CLI's wrapper before the command runs ---

# option name -> (lo, hi, integer?) ; None = open
OPTION_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "max_new_tokens": (1, None, True), "temperature": (0.0, None, False), "top_p": (0.0, 1.0, False),
    "top_k": (0, None, True), "tolerance": (0.0, None, False), "seed": (0, None, True), "reps": (1, None, True),
    "T": (1, None, True), "prompts": (1, None, True), "layer": (0, None, True),
}


def check_device(device: str, where: str = "--device") -> None:
    """cpu, cuda[:N] (present on this machine) or mps; anything else is an input error before any work."""
    import re

    d = str(device)
    if d == "cpu" or d == "mps":
        return
    m = re.fullmatch(r"cuda(?::(\d+))?", d)
    if not m:
        raise L47Error("l47", where, "cpu, cuda, cuda:N or mps", repr(d))
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    idx = int(m.group(1) or 0)
    if idx >= n:
        raise L47Error("l47", where, f"a CUDA device present on this machine ({n} found)", repr(d))


def check_options(command: str, values: dict) -> None:
    """Range-check the numeric options every command shares (OPTION_RANGES) and --device."""
    import math

    for name, v in values.items():
        if name == "device" and isinstance(v, str):
            check_device(v)
        elif name in OPTION_RANGES and v is not None and not isinstance(v, bool) and isinstance(v, (int, float)):
            lo, hi, _ = OPTION_RANGES[name]
            opt = "-T" if name == "T" else "--" + name.replace("_", "-")
            if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
                rng = (f"a value in [{lo}, {hi}]" if hi is not None else f"a value >= {lo}")
                raise L47Error(f"l47 {command}", opt, rng, repr(v))
