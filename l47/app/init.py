"""`l47 init DIR --model M.gguf --phrase "..."`: a new experiment folder — a commented experiment.toml with every
key, its default and its meaning, the folders a user fills in, and the commands to run next.

One schema (`SCHEMA`) describes every key the experiment file and `l47 solve` accept: the defaults are read from
the parsers' own dataclasses (Thresholds, SolveConfig, WfldConfig, FtpoConfig); the solver settings' meanings from
their fields' metadata (solvers/knobs.py), the others' are written here.
tests/test_init.py checks that the schema covers exactly the keys the parsers accept, that the file written
here parses, and that docs/EXPERIMENT.md's tables and TOML examples agree with it.

Layout written (DIR/):
    experiment.toml         the experiment (relative paths resolve against DIR)
    prompts/chats.jsonl     prompts for the model's own generations -> dumps/generated/ (the train/dev/heldout pool)
    prompts/chat_heldout.jsonl, prompts/blind.jsonl
                            prompts held back from every other set: the held-out chats and the blind chat are
                            the model's own generations (with a <think> block) from them (docs/AUDIT.md)
    texts/<set>.jsonl       documents of every other set -> dumps/<set>/
    dumps/                  written by `l47 dump`
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from l47.data import experiment as E
from l47.data.experiment import load_experiment
from l47.errors import L47Error
from l47.fileio import staging_dir
from l47.model.gguf_io import open_gguf
from l47.model.names import ARCH, KEY_ARCH
from l47.model.vocab import resolve_vocab
from l47.solvers.ftpo import FtpoConfig
from l47.solvers.knobs import meanings
from l47.solvers.solve import COMMON_KEYS, DEFAULT_METHOD, METHODS, SolveConfig, resolve_config
from l47.solvers.wfld import WfldConfig


@dataclass(frozen=True)
class Key:
    table: str  # "" (top level), "sets", "split", "phrases", "collateral", "thresholds", "solver", "solver.wfld", ...
    name: str
    type: str
    default: object  # None: no default (required or optional without one)
    meaning: str


# the sets a user fills (set name -> what belongs there)
SET_MEANINGS = {
    "train": "natural documents with slop events, read by the solver (with [split], from the pool)",
    "dev": "same kind as train, other documents: the solver's tuning and early stopping",
    "heldout": "slop events the solver never sees, in other documents: audit bar (c)",
    "collateral_anchor": "natural text with ordinary uses of the final words: protected by the solver",
    "collateral_eval": "same kind, other documents: audit bar (d)",
    "background": "plain and chat-formatted text of every kind the KLD domains hold (JSON answers, tool output, "
                  "other languages; other documents): the solver's background KL protects only what it shows",
    "chat_heldout": "the model's own chats (<think> block, turn ends) from held-back prompts: bars (f), (g)",
    "blind": "one chat the model generates from a held-back prompt, never scored: `l47 audit --blind`",
}

THRESHOLD_MEANINGS = {
    "non_event_p": "base p(final token) below this: a non-event, reported apart",
    "heldout_frac": "share of events held out, by document",
    "min_heldout_per_phrase": "(c) held-out events per phrase: a bar (lowering it marks the report weakened)",
    "min_train_per_phrase": "train events per phrase below which plan and solve refuse (a thin phrase is named)",
    "collateral_min_total": "collateral occurrences needed in collateral_eval",
    "collateral_min_per_word": "... and per word",
    "slop_reduction": "(c) held-out mean p(rejected) reduced by at least this",
    "collateral_word_mean": "(d) per-word mean Δlog p (nats) at least this",
    "collateral_frac_below": "(d) at most this share of occurrences ...",
    "collateral_below": "... below this Δlog p (nats)",
    "kld_max": "(e) KLD per domain",
    "chat_ordinary_dlogp": "(g) ordinary-token mean Δlog p on the held-out chat",
    "chat_kld": "(g) its KLD",
    "im_end_dlogp": "(f) mean Δlog p(<|im_end|>) at real turn ends",
    "special_rise_tol": "(f) largest allowed rise of Σ p(special) at slop positions",
    "blind_residual_factor": "blind slop residual ≤ this × the dev report's",
    "blind_residual_abs": "blind slop residual ≤ this per phrase present (absolute)",
    "overlap_window": "content tokens shared with a training document that make a copy",
    "zero_proxy_tol": "engine vs tail forward agreement, relative",
    "ce_proxy_frac": "natural text: base CE ≤ this · ln V",
    "salad_ngram": "n of the word n-gram repetition guard",
    "salad_max_ngram_repeat": "share of word n-grams repeating an earlier one",
    "salad_max_dup_lines": "share of near-duplicate lines",
    "sampler_max_violation_frac": "share of generated tokens outside the recorded sampler's support",
    "sampler_tol": "nats of slack in that check",
}

# The solver's settings ([solver], [solver.wfld], [solver.ftpo]) carry their meaning, default and range in their
# config dataclass fields (solvers/knobs.py `knob`): schema() reads them from there.


def _fields(cls) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def _typename(v) -> str:
    return {bool: "bool", int: "integer", float: "number", str: "string", tuple: "array"}.get(type(v), "table")


def schema() -> list[Key]:
    """Every key of the experiment file, defaults from the parsers' dataclasses."""
    keys = [
        Key("", "name", "string", None, "shown in reports (default: the file's stem)"),
        Key("", "model", "path", None, "base GGUF (or --model on the command line)"),
        Key("", "vocab", "string", "auto", "auto: the GGUF's tokenizer | gguf | qwen36"),
        Key("", "policy", "string", "strata", "runtime weight policy of the tail forward: strata | exact"),
    ]
    keys += [Key("sets", s, "paths", None, SET_MEANINGS[s]) for s in E.SETS]
    keys.append(Key("sets", E.KLD, "table", None, "[sets.kld] domain = [paths]: one KLD set per domain, bar (e)"))
    keys += [Key("split", "pool", "paths", None, "dumps split by document into train / dev / heldout"),
             Key("split", "seed", "integer", 0, "the split's seed (keyed by document content)")]
    keys += [Key("split", s, "number", E.DEFAULT_FRACTIONS[s], f"target share of events in {s}")
             for s in E.SPLIT_SETS]
    keys += [Key("phrases", "text", "string", None, "a banned phrase (plain text; variants are generated)"),
             Key("phrases", "margin_scale", "number", _fields(E.Phrase)["margin_scale"],
                 "scales the solver's margin for this phrase (< 1 where the final word is often legitimate)")]
    keys.append(Key("collateral", "words", "strings", None,
                    "one-token words whose ordinary uses must not move (default: the phrases' final tokens)"))
    th = _fields(E.Thresholds)
    keys += [Key("thresholds", k, _typename(v), v, THRESHOLD_MEANINGS.get(k, "")) for k, v in th.items()]
    sc = _fields(SolveConfig)
    sc["method"] = DEFAULT_METHOD  # the solver's own default (l47.solvers.solve), written active by init
    solver_meaning = meanings(SolveConfig)
    for k in E_SOLVER_KEYS():
        if k in ("wfld", "ftpo"):
            keys.append(Key("solver", k, "table", None, solver_meaning[k]))
        else:
            keys.append(Key("solver", k, _typename(sc.get(k)), sc.get(k), solver_meaning[k]))
    for table, cls in (("solver.wfld", WfldConfig), ("solver.ftpo", FtpoConfig)):
        mean = meanings(cls)
        keys += [Key(table, k, _typename(v), v, mean[k]) for k, v in _fields(cls).items()]
    return keys


def E_SOLVER_KEYS() -> tuple[str, ...]:  # noqa: N802 - the solver's accepted [solver] keys

    return tuple(COMMON_KEYS)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


# ----------------------------------------------------------------------------------------------------------
# the folder

PROMPTS = "prompts/chats.jsonl"
TEXT_SETS = ("collateral_anchor", "collateral_eval", "background")
# sets that are the model's own chats (with a <think> block) from held-back prompts: the audit's held-out chats
# must be natural for the model (proxy.base_ce) and the blind chat its own generation, never scored before
CHAT_SETS = ("chat_heldout", "blind")


@dataclass(frozen=True)
class InitArgs:
    folder: Path
    model: Path
    phrases: tuple[str, ...]
    words: tuple[str, ...] = ()
    kld: tuple[str, ...] = ("prose",)
    name: str | None = None
    method: str = "ftpo"  # l47.solvers.solve.DEFAULT_METHOD (tests/test_init.py checks they agree)
    settings: tuple[str, ...] = ()  # "table.key=value" (TOML value), e.g. "solver.wfld.p_cap=0.35"


@dataclass(frozen=True)
class InitResult:
    folder: str
    experiment: str
    files_to_fill: tuple[str, ...]
    commands: tuple[str, ...]


def next_commands(model: str, kld: tuple[str, ...]) -> list[str]:
    """What to run in the folder after filling it (docs: README's walk)."""
    cmds = [f"l47 dump {PROMPTS} --model {model} --out dumps/generated --generate"]
    cmds += [f"l47 dump prompts/chat_heldout.jsonl --model {model} --out dumps/chat_heldout --generate --think",
             f"l47 dump prompts/blind.jsonl --model {model} --out dumps/blind --generate --think --seed 1"]
    cmds += [f"l47 dump texts/{s}.jsonl --model {model} --out dumps/{s}" for s in TEXT_SETS]
    cmds += [f"l47 dump texts/kld_{d}.jsonl --model {model} --out dumps/kld_{d}" for d in kld]
    cmds += ["l47 sets experiment.toml --json sets.json",
             "l47 plan experiment.toml --sets sets.json --json plan.json",
             "l47 solve experiment.toml --sets sets.json --plan plan.json --out bundle.gguf",
             f"l47 audit bundle.gguf --base {model} --experiment experiment.toml --out audit",
             f"l47 audit bundle.gguf --base {model} --experiment experiment.toml --out audit-blind "
             "--blind dumps/blind/*.safetensors --dev-report audit/report.json"]
    return cmds


def parse_settings(settings) -> dict[tuple[str, str], object]:
    """--set "table.key=value" -> {(table, key): value}; the key must be a schema key with a default (a scalar
    setting), the value TOML (a bare word is read as a string)."""
    import tomllib

    known = {(k.table, k.name): k for k in schema() if k.default is not None}
    out = {}
    for item in settings:
        path, sep, raw = item.partition("=")
        table, _, name = path.strip().rpartition(".")
        if not sep or (table, name) not in known:
            raise L47Error("l47 init", f"--set {item}", "table.key=value for a key with a default "
                           "(docs/EXPERIMENT.md), e.g. solver.wfld.p_cap=0.35", repr(path.strip()))
        try:
            v = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            v = raw.strip()
        out[(table, name)] = v
    return out


def _comment(meaning: str) -> str:
    return f"  # {meaning}" if meaning else ""


def render_experiment(args: InitArgs, model_str: str) -> str:
    """The commented experiment.toml: given values active, every other key commented out at its default."""
    keys = schema()
    by = lambda t: [k for k in keys if k.table == t]  # noqa: E731
    given = parse_settings(args.settings)

    def line(k: Key) -> str:  # a default (commented) or a --set value (active)
        if (k.table, k.name) in given:
            return f"{k.name} = {toml_value(given[(k.table, k.name)])}{_comment(k.meaning)}"
        return f"# {k.name} = {toml_value(k.default)}{_comment(k.meaning)}"
    L = ["# l47 experiment file (docs/EXPERIMENT.md). Every key is listed: active lines are set, commented lines",
         "# show the default. Paths are relative to this file's folder; glob patterns are expanded.",
         "#",
         "# Fill in prompts/ and texts/ (JSONL: {\"id\": ..., \"text\": ...} or {\"id\": ..., \"messages\": [...]}),",
         "# then run, in this folder:"]
    L += [f"#   {c}" for c in next_commands(model_str, args.kld)]
    L += ["", f"name = {toml_value(args.name or args.folder.name)}", f"model = {toml_value(model_str)}"]
    for k in by(""):
        if k.name not in ("name", "model"):
            L.append(line(k))
    L += ["", "[sets]  # set name = dump paths; every document in one set only"]
    for k in by("sets"):
        if k.name in TEXT_SETS + CHAT_SETS:
            L.append(f"{k.name} = [\"dumps/{k.name}/*.safetensors\"]{_comment(k.meaning)}")
        elif k.name != "kld":
            L.append(f"# {k.name} = []{_comment(k.meaning)}  (or from [split])")
    L += ["", "[sets.kld]  # one KLD set per domain, bar (e)"]
    L += [f"{d} = [\"dumps/kld_{d}/*.safetensors\"]" for d in args.kld]
    L += ["", "[split]  # the model's own generations, split by document"]
    for k in by("split"):
        if k.name == "pool":
            L.append(f"pool = [\"dumps/generated/*.safetensors\"]{_comment(k.meaning)}")
        else:
            L.append(line(k))
    for p in args.phrases:
        L += ["", "[[phrases]]", f"text = {toml_value(p)}",
              f"# margin_scale = 1.0{_comment(by('phrases')[1].meaning)}"]
    L += ["", "[collateral]"]
    if args.words:
        L.append(f"words = {toml_value(list(args.words))}{_comment(by('collateral')[0].meaning)}")
    else:
        L.append(f"# words = []{_comment(by('collateral')[0].meaning)}")
    L += ["", "[thresholds]  # the bars; defaults are the seed's numbers"]
    L += [line(k) for k in by("thresholds")]
    L += ["", "[solver]", f"method = {toml_value(args.method)}{_comment(by('solver')[0].meaning)}"]
    L += [line(k) for k in by("solver") if k.name not in ("method", "wfld", "ftpo")]
    for sub in ("solver.wfld", "solver.ftpo"):
        L += ["", f"[{sub}]"]
        L += [line(k) for k in by(sub)]
    return "\n".join(L) + "\n"


def _model_str(folder: Path, model: Path) -> str:
    m = Path(model).resolve()
    try:
        return str(m.relative_to(folder.resolve()))
    except ValueError:
        import os

        rel = os.path.relpath(m, folder.resolve())
        return rel if not rel.startswith(("../../../", "..\\..\\..\\")) else str(m)


def _check_parses(text: str) -> None:
    """The file as `l47 sets` and `l47 solve` read it (a bad --set value is refused here, nothing written)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="l47-init-") as tmp:
        p = Path(tmp) / "experiment.toml"
        p.write_text(text, encoding="utf-8")
        try:
            exp = load_experiment(p, check_files=False)
            resolve_config(exp.solver, None, "experiment.toml")
        except L47Error as e:
            raise L47Error("l47 init", f"--set ({e.field})", e.expected, e.found) from None
        except (TypeError, ValueError) as e:
            raise L47Error("l47 init", "--set", "values of the keys' types", str(e)) from None


def check_folder(folder: Path) -> None:
    """A new path or an empty folder: init never writes beside a user's files."""
    if folder.exists() and not folder.is_dir():
        raise L47Error(folder, "folder", "a new or empty folder", "a file")
    if folder.is_dir():
        held = sorted(p.name for p in folder.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise L47Error(folder, "folder", "a new or empty folder (init never writes beside other files)",
                           f"a folder holding {len(held)} entr{'y' if len(held) == 1 else 'ies'} ({shown})")


def check_model(model: Path):
    """--model: a qwen4exp GGUF (magic, header, general.architecture). Returns the opened GGUF."""
    model = Path(model)
    if not model.is_file():
        raise L47Error(model, "--model", "the base GGUF file (l47 export writes one)",
                       "a folder" if model.is_dir() else "no such file")
    try:
        g = open_gguf(model)
    except L47Error as e:
        raise L47Error(model, f"--model ({e.field})", e.expected, e.found) from None
    arch = g.kv.get(KEY_ARCH)
    if arch != ARCH:
        raise L47Error(model, f"--model (metadata {KEY_ARCH})", repr(ARCH), "missing" if arch is None else repr(arch))
    return g


def _invisible(text: str) -> str | None:
    """The first character of `text` no reader sees (control, format / zero-width, unassigned, private use,
    surrogate, line / paragraph separator) as 'U+XXXX NAME', or a note when no character is visible; else None."""
    import unicodedata

    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cn", "Co", "Cs", "Zl", "Zp"):
            return f"U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed')}"
    if not any(unicodedata.category(ch)[0] in "LMNPS" for ch in text):
        return "no visible character"
    return None


def _visible(opt: str, text: str) -> None:
    bad = _invisible(text)
    if bad:
        raise L47Error("l47 init", f"{opt} {text!r}", "visible characters (letters, digits, punctuation, spaces; "
                       "no control or zero-width character)", bad)


def check_tokens(args: InitArgs, vocab) -> None:
    """Each --phrase tokenises into >= 2 tokens of the model's vocabulary (one token has no prefix, so no
    prefix-exact event can exist), each --word is exactly one token (as `l47 sets` reads it); both visible."""
    for p in args.phrases:
        ids = vocab.encode(p.strip())
        if len(ids) < 2:
            raise L47Error("l47 init", f"--phrase {p!r}", f"at least 2 tokens of the model's vocabulary "
                           f"({vocab.name})", f"{len(ids)} token(s) {ids}")
    for w in args.words:
        try:
            vocab.id_of(w)
        except L47Error:
            ids = vocab.encode(w)
            raise L47Error("l47 init", f"--word {w!r}", f"exactly one token of the model's vocabulary ({vocab.name};"
                           " mind the leading space, e.g. ' than')", f"{len(ids)} tokens {ids}") from None


def _check_arguments(args: InitArgs) -> None:
    """What needs no file: phrases, KLD names, method, --set keys (each once, known to the schema)."""
    if not args.phrases:
        raise L47Error("l47 init", "--phrase", "at least one phrase", "none")
    for p in args.phrases:
        _visible("--phrase", p)
    for w in args.words:
        _visible("--word", w)
    for d in args.kld:
        if not d.replace("_", "").isalnum():
            raise L47Error("l47 init", "--kld", "a domain name of letters, digits and _", repr(d))

    if args.method not in METHODS:
        raise L47Error("l47 init", "--method", f"one of {METHODS}", repr(args.method))
    keys = [s.partition("=")[0].strip() for s in args.settings]
    for k in keys:
        if keys.count(k) > 1:
            raise L47Error("l47 init", f"--set {k}", "each key once", f"{keys.count(k)} times")
    parse_settings(args.settings)


def _model_vocab(args: InitArgs, g):
    """The vocabulary the experiment will use: its `vocab` key (--set vocab=..., default auto: the GGUF's own)."""
    source = parse_settings(args.settings).get(("", "vocab"), "auto")
    try:
        return resolve_vocab(source, g)
    except L47Error as e:
        raise L47Error(args.model, f"--model ({e.field})", e.expected, e.found) from None


def _write_folder(folder: Path, text: str) -> None:
    """The folder, complete or not at all: built inside a staging folder beside it, then renamed into place (an
    empty existing folder is replaced by the rename; an interrupt removes the staging folder)."""
    with staging_dir(folder) as stage:
        tree = stage / "experiment"
        for sub in ("prompts", "texts", "dumps"):
            (tree / sub).mkdir(parents=True)
        (tree / "experiment.toml").write_text(text, encoding="utf-8")
        os.replace(tree, folder)


def run_init(args: InitArgs) -> InitResult:
    """Validate everything (arguments, folder, model, phrases and words against its vocabulary, the file as the
    parsers read it), then write the folder in one step; a refusal writes nothing."""
    folder = Path(args.folder)
    _check_arguments(args)
    check_folder(folder)
    g = check_model(args.model)
    check_tokens(args, _model_vocab(args, g))
    model_str = _model_str(folder, args.model)
    text = render_experiment(args, model_str)
    _check_parses(text)
    fill = [PROMPTS] + [f"prompts/{s}.jsonl" for s in CHAT_SETS] + [f"texts/{s}.jsonl" for s in TEXT_SETS]
    fill += [f"texts/kld_{d}.jsonl" for d in args.kld]
    _write_folder(folder, text)
    exp = folder / "experiment.toml"
    return InitResult(str(folder), str(exp), tuple(fill), tuple(next_commands(model_str, args.kld)))


def schema_markdown(tables=("solver", "solver.wfld", "solver.ftpo")) -> str:
    """Markdown tables (key | default | meaning) of schema tables; docs/EXPERIMENT.md embeds this text verbatim
    (tests/test_init.py compares it)."""
    out = []
    keys = schema()
    for t in tables:
        out += [f"`[{t}]`", "", "| key | default | meaning |", "|---|---|---|"]
        for k in keys:
            if k.table == t:
                d = "—" if k.default is None else f"`{toml_value(k.default)}`"
                out.append(f"| `{k.name}` | {d} | {k.meaning.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out)
