"""The experiment file (TOML, docs/EXPERIMENT.md): named sets of dump files, the banned phrases, the collateral
words, every threshold with the seed's default, and the solver's settings — parsed into frozen dataclasses.

Rules enforced on load (DESIGN §3.2, §4): unknown keys are rejected with the list of valid ones; paths are
relative to the TOML file's folder (glob patterns allowed); every listed dump must exist (one error lists all
missing files); a document belongs to one set only; train/dev/heldout come either from explicit lists or from a
`[split]` table (a seeded split by document of a pool), not both; a phrase has non-blank text.
"""

from __future__ import annotations

import glob
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from l47.errors import L47Error

SPLIT_SETS = ("train", "dev", "heldout")
SETS = SPLIT_SETS + ("collateral_anchor", "collateral_eval", "background", "chat_heldout", "blind")
SOLVER_SETS = ("train", "dev", "collateral_anchor", "background")  # the only sets a solve reads
SCORED_SETS = ("heldout", "collateral_eval", "chat_heldout", "blind")  # scored by the audit, + every kld.<domain>
KLD = "kld"  # [sets.kld] domain = [paths]  →  set name "kld.<domain>"
VOCAB_SOURCES = ("auto", "gguf", "qwen36")
POLICIES = ("strata", "exact")
TOP_KEYS = ("name", "model", "vocab", "policy", "sets", "split", "phrases", "collateral", "thresholds", "solver")
SPLIT_KEYS = ("pool", "seed", "train", "dev", "heldout")
PHRASE_KEYS = ("text", "margin_scale")
COLLATERAL_KEYS = ("words",)
DEFAULT_FRACTIONS = {"train": 0.55, "dev": 0.10, "heldout": 0.35}


@dataclass(frozen=True)
class Thresholds:
    """Every bar and selection threshold; defaults are the seed's numbers (DESIGN §4, §6)."""

    non_event_p: float = 1e-2  # base p(final token) below this: a non-event (seed §3 (2))
    heldout_frac: float = 0.30  # ≥ this share of events held out, by document (seed §5 (c))
    min_heldout_per_phrase: int = 3  # held-out events per phrase: a bar of the audit (seed §6.3)
    min_train_per_phrase: int = 5  # train events per phrase below which plan and solve refuse (l47.data.thin)
    collateral_min_total: int = 200  # collateral occurrences in collateral_eval: a bar (seed §5 (d))
    collateral_min_per_word: int = 10  # ... per word: a bar (seed §6: 16–32 per word were scored)
    slop_reduction: float = 0.50  # held-out mean p(rejected) reduced by ≥ this (seed §6.3: −54 % blind)
    collateral_word_mean: float = -0.05  # per-word mean Δlog p ≥ this, nats (seed §6 rec. 1)
    collateral_frac_below: float = 0.10  # ≤ this share of collateral occurrences ...
    collateral_below: float = -0.1  # ... below this Δlog p, nats
    kld_max: float = 0.01  # KLD vs base per domain (seed §3.1, §5 (e))
    chat_ordinary_dlogp: float = -0.01  # (g) ordinary-token mean Δlog p on the held-out chat document
    chat_kld: float = 0.005  # (g) its KLD
    im_end_dlogp: float = -0.005  # (f) mean Δlog p(<|im_end|>) at real turn ends
    special_rise_tol: float = 1e-6  # (f) Σ p(special) at slop positions may not rise by more (float scale;
    # seed §6.1's failure was 7/21 argmax flips to <|im_end|>, i.e. a rise of ~0.3)
    blind_residual_factor: float = 1.5  # blind slop residual ratio ≤ this × the dev report's (seed §6.2)
    blind_residual_abs: float = 0.5  # blind slop residual ratio ≤ this per phrase present (the seed's blind level)
    overlap_window: int = 64  # a scored document sharing this many consecutive content tokens with a training
    # document overlaps it (chat markup and a system prompt common to several documents excluded; DESIGN §4)
    zero_proxy_tol: float = 1e-3  # |Δ log p| engine vs tail forward, relative (seed §3.1 precision)
    ce_proxy_frac: float = 0.5  # natural text: base CE ≤ this · ln V (a proxy sits near ln V, seed §3 (1))
    salad_ngram: int = 4  # word n-gram length of the repetition guard
    salad_max_ngram_repeat: float = 0.4  # ≤ this share of word n-grams repeating earlier ones (seed §5.2 salad: ~0.9)
    salad_max_dup_lines: float = 0.4  # ≤ this share of near-duplicate lines
    sampler_max_violation_frac: float = 0.01  # generated tokens outside the recorded sampler's support
    sampler_tol: float = 0.01  # nats of slack for engine-vs-forward rounding in that check

    def to_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Phrase:
    text: str
    margin_scale: float = 1.0


@dataclass(frozen=True)
class SplitSpec:
    pool: tuple[Path, ...]
    seed: int
    fractions: dict[str, float]  # train / dev / heldout, summing to 1


@dataclass(frozen=True)
class Experiment:
    path: Path
    name: str
    model: Path | None  # base GGUF (may also be given on the command line)
    vocab: str  # auto (GGUF metadata, else Qwen3.6 tiktoken) | gguf | qwen36
    policy: str  # runtime weight policy of the tail forward
    sets: dict[str, tuple[Path, ...]]  # set name ("train", ..., "kld.<domain>") → dump paths
    split: SplitSpec | None
    phrases: tuple[Phrase, ...]
    collateral_words: tuple[str, ...]  # empty: the phrases' final tokens
    thresholds: Thresholds
    solver: dict = field(default_factory=dict)  # free table, validated by the solver

    def documents(self) -> list[tuple[str, Path]]:
        """(set name, path) of every listed document; the split pool's as set "pool"."""
        out = [(s, p) for s, ps in self.sets.items() for p in ps]
        if self.split is not None:
            out += [("pool", p) for p in self.split.pool]
        return out


# ----------------------------------------------------------------------------------------------------------


def nearest_key(name: str, valid) -> str:
    """' (did you mean 'x'?)' for the closest valid key (difflib), or '' when none is close."""
    import difflib

    hit = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean {hit[0]!r}?)" if hit else ""


def _unknown(where: Path, table: str, d: dict, valid) -> None:
    bad = sorted(set(d) - set(valid))
    if bad:
        raise L47Error(where, f"{table} key {bad[0]!r}" if table else f"key {bad[0]!r}",
                       f"one of {list(valid)}", f"unknown key(s) {bad}{nearest_key(bad[0], valid)}")


# value ranges of the thresholds (lo, hi; None = open): probabilities and shares in [0, 1], KLDs and tolerances
# >= 0, Δlog p bars <= 0, counts and n-gram sizes >= 1. A threshold not listed must be a finite number.
THRESHOLD_RANGES: dict[str, tuple[float | None, float | None]] = {
    "non_event_p": (0.0, 1.0), "heldout_frac": (0.0, 1.0), "min_heldout_per_phrase": (1, None), "min_train_per_phrase": (1, None),
    "collateral_min_total": (1, None), "collateral_min_per_word": (1, None), "slop_reduction": (0.0, 1.0),
    "collateral_word_mean": (None, 0.0), "collateral_frac_below": (0.0, 1.0), "collateral_below": (None, 0.0),
    "kld_max": (0.0, None), "chat_ordinary_dlogp": (None, 0.0), "chat_kld": (0.0, None),
    "im_end_dlogp": (None, 0.0), "special_rise_tol": (0.0, None), "blind_residual_factor": (0.0, None),
    "zero_proxy_tol": (0.0, None), "ce_proxy_frac": (0.0, None), "salad_ngram": (1, None),
    "salad_max_ngram_repeat": (0.0, 1.0), "salad_max_dup_lines": (0.0, 1.0),
    "sampler_max_violation_frac": (0.0, 1.0), "sampler_tol": (0.0, None),
    "overlap_window": (16, None),  # OVERLAP_WINDOW_FLOOR: see below
}
# the shortest content window that counts as a copy: below it (0 switched the check off) near-duplicates of
# training documents would pass as held-out evidence, and a raise above the default is stamped "weakened"
OVERLAP_WINDOW_FLOOR = THRESHOLD_RANGES["overlap_window"][0]


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"a value in [{lo}, {hi}]"
    return f"a value >= {lo}" if lo is not None else f"a value <= {hi}"


def config_from_table(cls, d: Any, where, table: str, ranges: dict | None = None, default_lo: float | None = 0.0,
                      nested: tuple[str, ...] = (), fixed: dict | None = None):
    """Build dataclass `cls` from a TOML table, checking every key: unknown keys (with the nearest known one),
    the type of each value against its default's (bool, int, float — an int is accepted —, str, tuple of
    numbers), finite numbers, and ranges (`ranges[name] = (lo, hi)`, else >= default_lo). Keys in `nested` are
    returned untouched for the caller; `fixed` are constructor arguments given by the caller. Returns
    (instance, {nested key: value})."""
    if not isinstance(d, dict):
        raise L47Error(where, table, "a table", f"{type(d).__name__} {d!r:.60}")
    valid = [f.name for f in fields(cls) if f.name not in (fixed or {})]
    _unknown(Path(str(where)), f"[{table}]", d, valid)
    kw, rest = {}, {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v, name = d[f.name], f"{table}.{f.name}"
        if f.name in nested:
            rest[f.name] = v
            continue
        default = f.default
        lo, hi = (ranges or {}).get(f.name, (default_lo, None))
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise L47Error(where, name, "true or false", repr(v))
            kw[f.name] = v
        elif isinstance(default, (int, float)):
            kw[f.name] = _num(Path(str(where)), name, v, int if isinstance(default, int) else float, lo, hi)
        elif isinstance(default, str):
            if not isinstance(v, str):
                raise L47Error(where, name, "a string", repr(v))
            kw[f.name] = v
        elif isinstance(default, tuple):
            if not isinstance(v, list) or not v:
                raise L47Error(where, name, "a non-empty list of numbers", repr(v))
            kw[f.name] = [_num(Path(str(where)), f"{name}[{i}]", x, float, lo, hi) for i, x in enumerate(v)]
        else:
            kw[f.name] = v
    return cls(**{**kw, **(fixed or {})}), rest


def _num(where: Path, name: str, v: Any, kind: type, lo: float | None = None, hi: float | None = None):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok or (kind is float and not math.isfinite(v)):
        found = f"{type(v).__name__} {v!r}" if isinstance(v, str) else f"{v!r}"
        raise L47Error(where, name, "an integer" if kind is int else "a finite number", found)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise L47Error(where, name, _range_text(lo, hi), f"{v!r}")
    return kind(v)


def _is_file(p: Path, where: Path, name: str) -> bool:
    """p.is_file(), a path the file system cannot take (too long, a NUL byte) refused in one line."""
    try:
        return p.is_file()
    except (OSError, ValueError) as e:
        raise L47Error(where, name, "a path the file system accepts", f"{str(p)[:60]!r}…: "
                       f"{getattr(e, 'strerror', None) or e}") from None


def _expand(s: str, where: Path, name: str) -> Path:
    """Path(s) with a leading ~ or ~user expanded; a ~user naming no user is one refusal (Path.expanduser raises
    RuntimeError there)."""
    try:
        return Path(s).expanduser()
    except RuntimeError:
        raise L47Error(where, name, "a path (a leading ~user must name a user of this machine)", repr(s)) from None


def _paths(where: Path, name: str, v: Any, base: Path, missing: list[str]) -> tuple[Path, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise L47Error(where, name, "a list of dump paths (strings)", f"{v!r:.80}")
    out: list[Path] = []
    for s in v:
        p = _expand(s, where, name)
        p = p if p.is_absolute() else base / p
        if glob.has_magic(str(p)):
            hits = sorted(Path(h) for h in glob.glob(str(p)))
            if not hits:
                missing.append(f"{name}: {s} (pattern matches no file)")
            out += hits
        elif not _is_file(p, where, name):
            missing.append(f"{name}: {p}")
            out.append(p)
        else:
            out.append(p)
    return tuple(out)


def parse_thresholds(d: dict, where: Path | str = "thresholds") -> Thresholds:
    where = Path(where)
    if not isinstance(d, dict):
        raise L47Error(where, "thresholds", "a table [thresholds]", f"{type(d).__name__} {d!r:.60}")
    valid = [f.name for f in fields(Thresholds)]
    _unknown(where, "[thresholds]", d, valid)
    kw = {}
    for f in fields(Thresholds):
        if f.name in d:
            kind = int if isinstance(f.default, int) else float
            lo, hi = THRESHOLD_RANGES.get(f.name, (None, None))
            if f.name == "overlap_window" and _is_number(d[f.name]) and d[f.name] < OVERLAP_WINDOW_FLOOR:
                raise L47Error(where, "thresholds.overlap_window", f"a window of at least {OVERLAP_WINDOW_FLOOR} "
                               "content tokens (shorter, near-duplicates of training documents pass as held-out)",
                               repr(d[f.name]))
            kw[f.name] = _num(where, f"thresholds.{f.name}", d[f.name], kind, lo, hi)
    return Thresholds(**kw)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_experiment(path, check_files: bool = True) -> Experiment:
    """Parse and validate an experiment TOML (docs/EXPERIMENT.md): the steps below, each raising L47Error that
    names the key; missing dump files are gathered and reported together."""
    path = Path(path)
    d = _read_toml(path)
    _unknown(path, "", d, TOP_KEYS)
    base = path.resolve().parent
    missing: list[str] = []
    name, model, vocab, policy = _parse_top(path, d, base, missing, check_files)
    sets = _parse_sets(path, d.get("sets", {}), base, missing)
    split = _parse_split(path, d["split"], sets, base, missing) if "split" in d else None
    phrases = _parse_phrases(path, d.get("phrases", []))
    words = _parse_collateral(path, d.get("collateral", {}))
    thresholds = parse_thresholds(d.get("thresholds", {}), path)
    solver = d.get("solver", {})
    if not isinstance(solver, dict):
        raise L47Error(path, "solver", "a table", repr(solver)[:80])
    if check_files and missing:
        shown = "; ".join(missing[:8]) + (f"; … and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise L47Error(path, "dump files", f"existing files (paths are relative to {base})",
                       f"{len(missing)} missing: {shown}")
    _check_one_set_per_document(path, sets, split)
    return Experiment(path=path, name=name, model=model, vocab=vocab, policy=policy, sets=sets, split=split,
                      phrases=phrases, collateral_words=words, thresholds=thresholds, solver=dict(solver))


def _read_toml(path: Path) -> dict:
    if not path.is_file():
        raise L47Error(path, "file", "an experiment TOML file", "a directory" if path.is_dir() else "missing")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise L47Error(path, "TOML", "valid TOML", str(e)) from None
    except UnicodeDecodeError as e:
        raise L47Error(path, "encoding", "UTF-8 text", str(e)) from None
    except RecursionError:  # tomllib parses nested arrays / tables recursively
        raise L47Error(path, "TOML", "valid TOML nested as an experiment is", "nesting deeper than Python's "
                       "recursion limit") from None


def _parse_top(path: Path, d: dict, base: Path, missing: list[str], check_files: bool):
    """name, model (resolved against the file's folder), vocab source, weight policy."""
    name = d.get("name", path.stem)
    if not isinstance(name, str):
        raise L47Error(path, "name", "a string", repr(name))
    model = d.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise L47Error(path, "model", "a path to the base GGUF", repr(model))
        model = _expand(model, path, "model")
        model = model if model.is_absolute() else base / model
        if check_files and not _is_file(model, path, "model"):
            missing.append(f"model: {model}")
    vocab = d.get("vocab", "auto")
    if vocab not in VOCAB_SOURCES:
        raise L47Error(path, "vocab", f"one of {list(VOCAB_SOURCES)}", repr(vocab))
    policy = d.get("policy", "strata")
    if policy not in POLICIES:
        raise L47Error(path, "policy", f"one of {list(POLICIES)}", repr(policy))
    return name, model, vocab, policy


def _parse_sets(path: Path, sets_d, base: Path, missing: list[str]) -> dict[str, tuple[Path, ...]]:
    """[sets] and [sets.kld]: set name -> dump paths (globs expanded)."""
    if not isinstance(sets_d, dict):
        raise L47Error(path, "sets", "a table of set name = [paths]", repr(sets_d)[:80])
    _unknown(path, "[sets]", sets_d, SETS + (KLD,))
    sets: dict[str, tuple[Path, ...]] = {}
    for s in SETS:
        if s in sets_d:
            sets[s] = _paths(path, f"sets.{s}", sets_d[s], base, missing)
    kld = sets_d.get(KLD, {})
    if not isinstance(kld, dict):
        raise L47Error(path, f"sets.{KLD}", "a table of domain = [paths] (e.g. kld.ops_tools = [...])", repr(kld)[:80])
    for dom, v in kld.items():
        sets[f"{KLD}.{dom}"] = _paths(path, f"sets.{KLD}.{dom}", v, base, missing)
    return sets


def _parse_split(path: Path, sd, sets: dict, base: Path, missing: list[str]) -> SplitSpec:
    """[split]: a pool split by document (never beside explicit train/dev/heldout lists)."""
    if not isinstance(sd, dict):
        raise L47Error(path, "split", "a table {pool, seed, train, dev, heldout}", repr(sd)[:80])
    _unknown(path, "[split]", sd, SPLIT_KEYS)
    given = [s for s in SPLIT_SETS if s in sets]
    if given:
        raise L47Error(path, "split", "either a [split] pool or explicit train/dev/heldout lists, not both",
                       f"[split] and sets.{given[0]}")
    if "pool" not in sd:
        raise L47Error(path, "split.pool", "a list of dump paths to split by document", "missing")
    pool = _paths(path, "split.pool", sd["pool"], base, missing)
    seed = _num(path, "split.seed", sd.get("seed", 0), int, 0)
    fr = {s: _num(path, f"split.{s}", sd.get(s, DEFAULT_FRACTIONS[s]), float, 0.0, 1.0) for s in SPLIT_SETS}
    if abs(sum(fr.values()) - 1.0) > 1e-6:
        raise L47Error(path, "split fractions", "train + dev + heldout = 1", f"{sum(fr.values()):g}")
    return SplitSpec(pool, seed, fr)


def _parse_phrases(path: Path, ph) -> tuple[Phrase, ...]:
    """[[phrases]]: non-blank, each once (case-insensitive)."""
    if not isinstance(ph, list):
        raise L47Error(path, "phrases", "an array of tables [[phrases]] text = \"...\"", repr(ph)[:80])
    phrases: list[Phrase] = []
    for i, p in enumerate(ph):
        if isinstance(p, str):
            p = {"text": p}
        if not isinstance(p, dict):
            raise L47Error(path, f"phrases[{i}]", "a table with text (and margin_scale)", repr(p)[:80])
        _unknown(path, f"[[phrases]] #{i + 1}", p, PHRASE_KEYS)
        text = p.get("text")
        if not isinstance(text, str) or not text.strip():
            raise L47Error(path, f"phrases[{i}].text", "a phrase with at least one token (non-blank text)",
                           repr(text))
        scale = _num(path, f"phrases[{i}].margin_scale", p.get("margin_scale", 1.0), float, 0.0)
        phrases.append(Phrase(text, scale))
    seen: dict[str, int] = {}
    for i, p in enumerate(phrases):
        k = p.text.strip().lower()
        if k in seen:
            raise L47Error(path, f"phrases[{i}].text", "each phrase once (variants are generated)",
                           f"{p.text!r} again (phrases[{seen[k]}])")
        seen[k] = i
    return tuple(phrases)


def _parse_collateral(path: Path, col) -> tuple[str, ...]:
    if not isinstance(col, dict):
        raise L47Error(path, "collateral", "a table with words = [...]", repr(col)[:80])
    _unknown(path, "[collateral]", col, COLLATERAL_KEYS)
    words = col.get("words", [])
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise L47Error(path, "collateral.words", "a list of non-empty token strings, e.g. [\" than\", \" what\"]",
                       repr(words)[:80])
    return tuple(words)


def _check_one_set_per_document(path: Path, sets: dict, split: SplitSpec | None) -> None:
    """Each dump path in one set only (by path here; by content in l47.data.sets)."""
    where_is: dict[Path, str] = {}
    pool_paths = split.pool if split else ()
    for s, ps in list(sets.items()) + [("split.pool", pool_paths)]:
        for p in ps:
            k = p.resolve()
            if k in where_is:
                raise L47Error(path, f"sets.{s}" if s != "split.pool" else s,
                               "each document in one set only", f"{p} also in {where_is[k]}")
            where_is[k] = f"sets.{s}" if s != "split.pool" else s
