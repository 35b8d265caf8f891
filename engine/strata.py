"""The `strata` engine: run an external Strata binary, read what it wrote, convert it into an l47 dump.

Strata's own dump layout is not public; `engine/CONTRACT.md` defines the one this adapter speaks (environment,
argv, file names, 32-byte little-endian headers, which engine buffer each field is, `run.json`). Every name of
that contract lives in the constants block below and nowhere else.

    strata_binary(cli_value)                       -> Path    the binary (--engine-bin / STRATA_BIN), platform
    run_strata(StrataRun(bin, model, layer, ...),   -> Path    one document, forced or generate, in its own dir
               tokens, out_dir, generate=None)
    read_raw(dir)                                   -> dict    parse + check every contract file, all problems
    convert(raw_or_dir, meta_base)                  -> (arrays, DumpMeta fields) of one dump

Notation for tensor shapes:
    N   tokens of the document (prompt + sampled)      rows  positions the engine dumped (N or N − 1)
    T   positions of the dump = N − 1 (row t is computed at tokens[t] and predicts tokens[t+1])
    hc  hyper-connection streams (4)    n  hidden (2560)    f  shared-expert width (640)    r  HC low rank (320)
    V   vocabulary (248,320)            k  top-k of the engine's logit-position output

Precision: nothing is computed here. Arrays are copied as stored: f32 stays f32; an fp16 `hh` (Strata's prompt
path) is widened to f32, which is exact, and the dump says `hh_precision: "f16"`; full logits are stored f16 as
the dump schema requires (f32 -> f16 rounds to nearest).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from l47.dumps.schema import (
    HH_F16, HH_F32, INJ_CONVENTIONS, INJ_RAW, PROV_GENERATION,
    SCHEMA_VERSION, is_json_type, provenance_of, validate_dump,
)
from l47.errors import L47Error
from l47.fileio import write_bytes_atomic

if TYPE_CHECKING:
    from l47.engine.hf import SamplerSettings

# ==========================================================================================================
# The contract (engine/CONTRACT.md). Every name the adapter and the engine share.

ENGINE_NAME = "strata"
CONTRACT_VERSION = 1
CONTRACT_DOC = "engine/CONTRACT.md"

# --- environment ------------------------------------------------------------------------------------------
ENV_BIN = "STRATA_BIN"  # the binary, when --engine-bin is not given
ENV_ANY_PLATFORM = "L47_STRATA_ANY_PLATFORM"  # "1": skip the macOS / CUDA check (a build that runs elsewhere)
ENV_DUMP_DIR = "STRATA_METAL_DUMP_DIR"  # where the engine writes every file of one document
ENV_DUMP_LAYER = "STRATA_METAL_DUMP_LAYER"  # the dumped layer L
ENV_DUMP_MOE = "STRATA_METAL_DUMP_MOE"  # "1": .hh .yr .sgv .mixed (today) + .R .inj (added by the contract)
ENV_MOCE_BONUS = "STRATA_METAL_MOCE_BONUS"  # "0": deterministic routing
ENV_LOGPOS = "STRATA_METAL_LOGPOS"  # "1": logit-position output (doc.logpos)
ENV_LOGPOS_TOPK = "STRATA_METAL_LOGPOS_TOPK"  # k
ENV_DUMP_LOGITS = "STRATA_METAL_DUMP_LOGITS"  # "1": full logits (doc.logits)
# settings run.json must state (besides every other STRATA_* the engine read)
SET_MOCE_BONUS = ENV_MOCE_BONUS
SET_ROUTER_BF16 = "STRATA_METAL_ROUTER_BF16"
SET_HC_Q4 = "STRATA_HC_Q4"
SET_HC_Q5 = "STRATA_HC_Q5"
SET_WEIGHT_POLICY = "weight_policy"  # l47.model.weights.POLICIES
REQUIRED_SETTINGS = (SET_MOCE_BONUS, SET_ROUTER_BF16, SET_HC_Q4, SET_HC_Q5, SET_WEIGHT_POLICY)
WEIGHT_POLICIES = ("strata", "exact")  # = l47.model.weights.POLICIES (not imported: it pulls in torch)
MOCE_DETERMINISTIC = "0"
NVIDIA_PROC, NVIDIA_SMI = "/proc/driver/nvidia/version", "nvidia-smi"  # a CUDA machine has one of them
DEFAULT_TOPK = 8

# --- argv -------------------------------------------------------------------------------------------------
ARG_MODEL = "--model"
ARG_TOKENS = "--tokens"
ARG_GENERATE = "--generate"  # MAX_NEW
ARG_SEED = "--seed"
ARG_TEMPERATURE = "--temperature"
ARG_TOP_P = "--top-p"
ARG_TOP_K = "--top-k"
ARG_STOP = "--stop"  # comma-separated ids

# --- files ------------------------------------------------------------------------------------------------
RUN_JSON = "run.json"
REQUEST_TOKENS = "request.tokens"
DOC_TOKENS = "doc.tokens"
DOC_LOGPOS = "doc.logpos"
DOC_LOGITS = "doc.logits"
TAG_TOKENS, TAG_LOGPOS, TAG_LOGITS = "tokens", "logpos", "logits"
TAG_R, TAG_INJ, TAG_HH, TAG_SGV, TAG_YR, TAG_MIXED = "R", "inj", "hh", "sgv", "yr", "mixed"
LAYER_TAGS = (TAG_R, TAG_INJ, TAG_HH, TAG_SGV, TAG_YR, TAG_MIXED)
REQUIRED_LAYER_TAGS = (TAG_R, TAG_INJ, TAG_HH, TAG_SGV, TAG_YR)


def layer_file(layer: int, tag: str) -> str:
    """`L{layer}.{tag}`: a per-layer file's name."""
    return f"L{layer}.{tag}"


# --- binary layout ----------------------------------------------------------------------------------------
MAGIC = b"L47S"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH8siIQ")  # magic, version, dtype, tag, layer, width, rows: 32 bytes
NO_LAYER = -1
DT_F32, DT_F16, DT_I32, DT_RECORD = 0, 1, 26, 0xFFFF  # ggml type ids; RECORD = the .logpos row record
DTYPE_NP = {DT_F32: np.dtype("<f4"), DT_F16: np.dtype("<f2"), DT_I32: np.dtype("<i4"), DT_RECORD: np.dtype("<u4")}
DTYPE_NAME = {DT_F32: "f32", DT_F16: "f16", DT_I32: "i32", DT_RECORD: "logpos record"}

# --- run.json values --------------------------------------------------------------------------------------
MODE_FORCED, MODE_GENERATE = "forced", "generate"
PATH_PROMPT, PATH_DECODE, PATH_PROMPT_DECODE = "prompt", "decode", "prompt+decode"
MODES = (MODE_FORCED, MODE_GENERATE)
PATHS = (PATH_PROMPT, PATH_DECODE, PATH_PROMPT_DECODE)
DIMS = ("n", "f", "hc", "r", "V")
SAMPLER_KEYS = {"seed": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
                "max_new_tokens": int, "stop_ids": list}

# The raw-dir dict's keys (read_raw's result)
K_RUN, K_DIR, K_LAYER, K_TOKENS, K_REQUEST, K_ROWS = "run", "dir", "layer", "tokens", "request", "rows"
K_LOGP, K_TOP_IDS, K_TOP_LOGITS, K_LOGITS, K_HH_DTYPE = "ref_logp", "ref_top_ids", "ref_top_logits", "logits", \
    "hh_dtype"

_STDERR_TAIL = 2000  # characters of the engine's stderr shown when it fails


class StrataRawError(L47Error):
    """A raw Strata output that breaks the contract: every problem found, joined with "; " (each starts with
    the file name and the field)."""

    def __init__(self, where, problems: list[str]):
        self.problems = list(problems)
        super().__init__(str(where), "strata raw dump",
                         f"files following {CONTRACT_DOC} (contract version {CONTRACT_VERSION})",
                         f"{len(self.problems)} problem(s): " + "; ".join(self.problems))


# ==========================================================================================================
# the binary


def platform_problem() -> str | None:
    """None when Strata can run here (macOS: Metal; a machine with an NVIDIA driver: CUDA; or the override),
    else what is wrong."""
    if os.environ.get(ENV_ANY_PLATFORM) == "1":
        return None
    system = platform.system()
    if system == "Darwin":
        return None
    if Path(NVIDIA_PROC).exists() or shutil.which(NVIDIA_SMI):
        return None
    return (f"this machine is {system} {platform.machine()} without CUDA; the strata engine runs on macOS (Metal) "
            f"or a CUDA machine: use --engine hf here, or set {ENV_ANY_PLATFORM}=1 if your Strata build runs on "
            "this machine")


def strata_binary(cli_value: str | os.PathLike | None = None, *, check_platform: bool = True) -> Path:
    """The Strata binary: `--engine-bin` when given, else $STRATA_BIN (a bare name is looked up on PATH).
    Raises one L47Error saying exactly what to set when there is none, it is not an executable file, or this
    machine is neither macOS nor CUDA."""
    where = "l47 dump --engine strata"
    field = f"--engine-bin / {ENV_BIN}"
    plat = platform_problem() if check_platform else None
    also = f"; also: {plat}" if plat else ""
    value = str(cli_value) if cli_value not in (None, "") else os.environ.get(ENV_BIN, "")
    if not value:
        raise L47Error(where, field, f"the path of a Strata binary that follows {CONTRACT_DOC}: pass --engine-bin "
                       f"/path/to/strata or set {ENV_BIN}=/path/to/strata{also}", "neither is set")
    p = Path(value).expanduser()
    if os.sep not in value and not p.exists():
        found = shutil.which(value)
        p = Path(found) if found else p
    if not p.is_file():
        raise L47Error(where, field, f"an existing executable file (set {ENV_BIN} or --engine-bin to it){also}",
                       f"{value!r}: no such file")
    if not os.access(p, os.X_OK):
        raise L47Error(where, field, f"an executable file (chmod +x {p}){also}", f"{value!r}: not executable")
    if plat:
        raise L47Error(where, "platform", "macOS (Metal) or a CUDA machine", plat)
    return p.resolve()


# ==========================================================================================================
# writing a contract file (the adapter writes request.tokens; a test engine may write the rest)


def encode_raw(tag: str, layer: int, data: np.ndarray, dtype_code: int | None = None) -> bytes:
    """Header + data of one contract file. `data` is [rows, width] (or [rows] = width 1) of f32/f16/i32; for the
    logpos record pass the [rows, 1 + 2k] u32 words and DT_RECORD."""
    a = np.asarray(data)
    a = a.reshape(a.shape[0], -1) if a.ndim != 2 else a
    if dtype_code is None:
        inv = {np.dtype("float32"): DT_F32, np.dtype("float16"): DT_F16, np.dtype("int32"): DT_I32}
        if a.dtype not in inv:
            raise L47Error("encode_raw", f"{tag} dtype", "f32, f16 or i32", str(a.dtype))
        dtype_code = inv[a.dtype]
    tagb = tag.encode("ascii")
    if len(tagb) > 8:
        raise L47Error("encode_raw", "tag", "at most 8 ASCII bytes", repr(tag))
    body = np.ascontiguousarray(a, dtype=DTYPE_NP[dtype_code]).tobytes()  # little-endian, row-major
    return HEADER.pack(MAGIC, FORMAT_VERSION, dtype_code, tagb, int(layer), a.shape[1], a.shape[0]) + body


def contract_files(layer: int) -> tuple[str, ...]:
    """Every file name of one document's directory for layer L (request, outputs, run.json)."""
    return (REQUEST_TOKENS, DOC_TOKENS, DOC_LOGPOS, DOC_LOGITS, RUN_JSON) + tuple(layer_file(layer, t)
                                                                                  for t in LAYER_TAGS)


def remove_raw(raw_dir: str | os.PathLike, layer: int) -> None:
    """Delete the contract files of a document directory (nothing else), then the directory if it is empty."""
    d = Path(raw_dir)
    for name in contract_files(layer):
        (d / name).unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass


# ==========================================================================================================
# running the engine


def _check_ids(tokens: Sequence[int], min_len: int, where: str) -> np.ndarray:
    try:
        ids = np.asarray([int(t) for t in tokens], dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise L47Error(where, "tokens", "a sequence of integer token ids", str(e)) from None
    if ids.ndim != 1 or ids.size < min_len:
        raise L47Error(where, "tokens", f"at least {min_len} token id(s)", str(ids.size))
    if (ids < 0).any() or (ids > np.iinfo(np.int32).max).any():
        i = int(np.flatnonzero((ids < 0) | (ids > np.iinfo(np.int32).max))[0])
        raise L47Error(where, f"tokens[{i}]", "an id in [0, 2^31)", str(int(ids[i])))
    return ids.astype(np.int32)


def strata_env(out_dir: Path, layer: int, topk: int, ref_logits: bool, extra_env: Mapping[str, str] | None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: the caller's (STRATA_* flags pass through), `extra_env`, then the contract's
    deterministic-routing default, then the dump settings (always the adapter's)."""
    env = dict(os.environ if base is None else base)
    env[ENV_MOCE_BONUS] = MOCE_DETERMINISTIC  # deterministic routing unless extra_env says otherwise
    env.pop(ENV_DUMP_LOGITS, None)
    env.update({str(k): str(v) for k, v in (extra_env or {}).items()})
    env.update({ENV_DUMP_DIR: str(out_dir), ENV_DUMP_LAYER: str(int(layer)), ENV_DUMP_MOE: "1", ENV_LOGPOS: "1",
                ENV_LOGPOS_TOPK: str(int(topk))})
    if ref_logits:
        env[ENV_DUMP_LOGITS] = "1"
    return env


def strata_argv(bin_path: Path, model: Path, request: Path, generate: "SamplerSettings | None") -> list[str]:
    argv = [str(bin_path), ARG_MODEL, str(model), ARG_TOKENS, str(request)]
    if generate is not None:
        argv += [ARG_GENERATE, str(int(generate.max_new_tokens)), ARG_SEED, str(int(generate.seed)),
                 ARG_TEMPERATURE, repr(float(generate.temperature)), ARG_TOP_P, repr(float(generate.top_p)),
                 ARG_TOP_K, str(int(generate.top_k))]
        stop = [int(i) for i in getattr(generate, "stop_ids", ()) or ()]
        if stop:
            argv += [ARG_STOP, ",".join(str(i) for i in stop)]
    return argv


@dataclass(frozen=True)
class StrataRun:
    """How the binary runs every document of one dump (engine/CONTRACT.md §2): the binary, the GGUF it runs, the
    dumped layer L and the dump settings. `extra_env` is added to the engine's environment before the dump
    settings (which are always the adapter's); `timeout` in seconds per document (None: none)."""

    bin_path: Path
    model: Path
    layer: int
    topk: int = DEFAULT_TOPK
    ref_logits: bool = False
    extra_env: Mapping[str, str] | None = None
    timeout: float | None = None


def run_strata(run: StrataRun, tokens: Sequence[int], out_dir: str | os.PathLike,
               generate: "SamplerSettings | None" = None) -> Path:
    """Run the binary on one document and return the directory it wrote (engine/CONTRACT.md §2).

    tokens    forced mode: the document's ids (≥ 2); generate mode: the prompt's ids (≥ 1)
    generate  None = forced; else an object with max_new_tokens, seed, temperature, top_p, top_k, stop_ids
              (l47.engine.hf.SamplerSettings): the engine samples the continuation itself
    The directory is emptied of contract files first, so nothing from an earlier run can be read as this one's.
    A failed start, a non-zero exit or a timeout raises L47Error with the engine's stderr tail."""
    bin_path, model, out_dir, layer, timeout = Path(run.bin_path), Path(run.model), Path(out_dir), run.layer, \
        run.timeout
    where = f"strata ({bin_path.name})"
    if generate is not None and int(generate.max_new_tokens) < 1:
        raise L47Error(where, "max_new_tokens", ">= 1", str(generate.max_new_tokens))
    ids = _check_ids(tokens, 1 if generate is not None else 2, where)
    if not model.is_file():
        raise L47Error(model, "model", "a GGUF file for the Strata engine", "no such file")
    if int(run.topk) < 1:
        raise L47Error(where, "topk", ">= 1", str(run.topk))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in contract_files(layer):
        (out_dir / name).unlink(missing_ok=True)
    request = out_dir / REQUEST_TOKENS
    write_bytes_atomic(request, encode_raw(TAG_TOKENS, NO_LAYER, ids[:, None]))
    argv = strata_argv(bin_path, model.resolve(), request.resolve(), generate)
    env = strata_env(out_dir.resolve(), layer, run.topk, run.ref_logits, run.extra_env)
    try:
        proc = subprocess.run(argv, env=env, cwd=out_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout, check=False)
    except FileNotFoundError:
        raise L47Error(where, f"--engine-bin / {ENV_BIN}", "an executable file", f"{bin_path}: no such file") \
            from None
    except PermissionError:
        raise L47Error(where, f"--engine-bin / {ENV_BIN}", "an executable file", f"{bin_path}: permission denied") \
            from None
    except OSError as e:
        raise L47Error(where, "start", "the engine to start", f"{e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise L47Error(where, "run time", f"at most {timeout} s", "timed out (killed)") from None
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace")[-_STDERR_TAIL:].strip()
        raise L47Error(where, "exit status", "0", f"{proc.returncode}; stderr: {tail or '(empty)'}")
    return out_dir


# ==========================================================================================================
# reading the engine's output


def _run_problems(run: Any) -> list[str]:
    """Every problem of run.json's content (field names prefixed `run.json: `)."""
    w = RUN_JSON
    if not isinstance(run, dict):
        return [f"{w}: expected one JSON object, found {type(run).__name__}"]
    out = []
    req = {"contract_version": int, "engine": dict, "model": dict, "mode": str, "path": str, "layer": int,
           "dims": dict, "n_tokens": int, "n_prompt": int, "rows": int, "inj_convention": str, "logpos_topk": int,
           "settings": dict}
    for k, t in req.items():
        if k not in run:
            out.append(f"{w}: {k}: expected present, found missing")
        elif not is_json_type(run[k], t):
            out.append(f"{w}: {k}: expected {t.__name__}, found {run[k]!r:.60}")

    def ok(k):
        return k in run and is_json_type(run[k], req[k])

    if ok("contract_version") and run["contract_version"] != CONTRACT_VERSION:
        out.append(f"{w}: contract_version: expected {CONTRACT_VERSION}, found {run['contract_version']}")
    if ok("engine"):
        for k in ("name", "version"):
            if not (is_json_type(run["engine"].get(k), str) and run["engine"][k]):
                out.append(f"{w}: engine.{k}: expected a non-empty string, found {run['engine'].get(k)!r:.60}")
    if ok("model") and "sha256" in run["model"]:
        s = run["model"]["sha256"]
        if not (is_json_type(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)):
            out.append(f"{w}: model.sha256: expected 64 lowercase hex digits, found {s!r:.70}")
    if ok("mode") and run["mode"] not in MODES:
        out.append(f"{w}: mode: expected one of {list(MODES)}, found {run['mode']!r}")
    if ok("path") and run["path"] not in PATHS:
        out.append(f"{w}: path: expected one of {list(PATHS)}, found {run['path']!r}")
    if ok("mode") and ok("path") and run["mode"] == MODE_FORCED and run["path"] == PATH_PROMPT_DECODE:
        out.append(f"{w}: path: expected {PATH_PROMPT!r} or {PATH_DECODE!r} in forced mode, found {run['path']!r}")
    if ok("layer") and run["layer"] < 0:
        out.append(f"{w}: layer: expected >= 0, found {run['layer']}")
    if ok("dims"):
        for k in DIMS:
            v = run["dims"].get(k)
            if not (is_json_type(v, int) and v > 0):
                out.append(f"{w}: dims.{k}: expected an integer > 0, found {v!r}")
    for k in ("n_tokens", "rows", "logpos_topk"):
        if ok(k) and run[k] < 1:
            out.append(f"{w}: {k}: expected >= 1, found {run[k]}")
    if ok("n_prompt") and ok("n_tokens") and not 1 <= run["n_prompt"] <= run["n_tokens"]:
        out.append(f"{w}: n_prompt: expected in [1, n_tokens = {run['n_tokens']}], found {run['n_prompt']}")
    if ok("mode") and ok("n_prompt") and ok("n_tokens") and run["mode"] == MODE_FORCED \
            and run["n_prompt"] != run["n_tokens"]:
        out.append(f"{w}: n_prompt: expected n_tokens ({run['n_tokens']}) in forced mode, found {run['n_prompt']}")
    if ok("inj_convention") and run["inj_convention"] not in INJ_CONVENTIONS:
        out.append(f"{w}: inj_convention: expected one of {sorted(INJ_CONVENTIONS)}, found {run['inj_convention']!r}")
    if ok("settings"):
        s = run["settings"]
        for k in REQUIRED_SETTINGS:
            if k not in s:
                out.append(f"{w}: settings.{k}: expected present (every setting that changes the numbers), "
                           "found missing")
        for k, v in s.items():
            if not is_json_type(v, str):
                out.append(f"{w}: settings.{k}: expected a string value, found {v!r:.40}")
        if is_json_type(s.get(SET_WEIGHT_POLICY), str) and s[SET_WEIGHT_POLICY] not in WEIGHT_POLICIES:
            out.append(f"{w}: settings.{SET_WEIGHT_POLICY}: expected one of {list(WEIGHT_POLICIES)}, "
                       f"found {s[SET_WEIGHT_POLICY]!r}")
    sampler = run.get("sampler")
    if ok("mode") and run["mode"] == MODE_GENERATE:
        if not isinstance(sampler, dict):
            out.append(f"{w}: sampler: expected {{{', '.join(SAMPLER_KEYS)}}} in generate mode, found {sampler!r:.60}")
        else:
            for k, t in SAMPLER_KEYS.items():
                if not is_json_type(sampler.get(k), t):
                    out.append(f"{w}: sampler.{k}: expected {getattr(t, '__name__', 'a number')}, "
                               f"found {sampler.get(k)!r:.40}")
            if isinstance(sampler.get("stop_ids"), list) and not all(is_json_type(i, int) for i in sampler["stop_ids"]):
                out.append(f"{w}: sampler.stop_ids: expected integers, found {sampler['stop_ids']!r:.60}")
    elif ok("mode") and sampler is not None:
        out.append(f"{w}: sampler: expected null in forced mode, found {sampler!r:.60}")
    return out


def _read_file(d: Path, name: str, tag: str, layer: int, dtypes: tuple[int, ...], width: int | None,
               problems: list[str]) -> tuple[np.ndarray | None, int | None]:
    """(data [rows, width] as its stored dtype, rows) of one contract file, or (None, rows|None) with the
    problems appended. Every header field is checked; width None = not known (not checked)."""
    p = d / name
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(HEADER.size)
    except OSError as e:
        problems.append(f"{name}: file: expected a readable file, found {e.strerror or e}")
        return None, None
    if len(head) < HEADER.size:
        problems.append(f"{name}: header: expected {HEADER.size} bytes, found a {size}-byte file (truncated)")
        return None, None
    magic, version, dt, tagb, lay, w, rows = HEADER.unpack(head)
    bad = len(problems)
    if magic != MAGIC:
        problems.append(f"{name}: magic: expected {MAGIC!r}, found {magic!r} (not a {CONTRACT_DOC} file)")
        return None, None
    if version != FORMAT_VERSION:
        problems.append(f"{name}: version: expected {FORMAT_VERSION}, found {version}")
    got_tag = tagb.rstrip(b"\0").decode("ascii", "replace")
    if got_tag != tag:
        problems.append(f"{name}: tag: expected {tag!r}, found {got_tag!r}")
    if lay != layer:
        problems.append(f"{name}: layer: expected {layer}, found {lay}")
    if dt not in dtypes:
        allowed = " or ".join(DTYPE_NAME[x] for x in dtypes)
        problems.append(f"{name}: dtype: expected {allowed}, found code {dt} ({DTYPE_NAME.get(dt, 'unknown')})")
    if width is not None and w != width:
        problems.append(f"{name}: width: expected {width}, found {w}")
    if len(problems) > bad:
        return None, rows
    want = HEADER.size + rows * w * DTYPE_NP[dt].itemsize
    if size != want:
        what = "truncated" if size < want else "trailing bytes"
        problems.append(f"{name}: size: expected {want} bytes (32 + {rows} rows × {w} × "
                        f"{DTYPE_NP[dt].itemsize}), found {size} ({what})")
        return None, rows
    if rows * w == 0:
        return np.zeros((rows, w), DTYPE_NP[dt]), rows
    return np.memmap(p, dtype=DTYPE_NP[dt], mode="r", offset=HEADER.size, shape=(rows, w)), rows


def _find_layer(d: Path) -> int | None:
    """The one layer L of the `L{L}.*` files in a directory (when run.json cannot say), else None."""
    found = set()
    for p in d.glob("L*.*"):
        stem = p.name.split(".", 1)[0][1:]
        if stem.isdigit() and p.name.split(".", 1)[1] in LAYER_TAGS:
            found.add(int(stem))
    return found.pop() if len(found) == 1 else None


@dataclass
class _RawFiles:
    """What read_raw found in one document's directory, before the cross-file checks."""

    d: Path
    run: dict  # run.json ({} when unreadable)
    dim: dict  # DIMS -> int > 0 | None
    layer: int | None
    k: int | None  # logpos top-k
    tok: np.ndarray | None = None  # [N, 1] i32
    n_tok: int | None = None
    req: np.ndarray | None = None  # [*, 1] i32
    lp: np.ndarray | None = None  # [rows, 1 + 2k] u32 records
    lg: np.ndarray | None = None  # [rows, V]
    arr: dict = field(default_factory=lambda: {t: None for t in LAYER_TAGS})  # per-layer files

    def rv(self, key: str, t=int):
        v = self.run.get(key)
        return v if is_json_type(v, t) else None

    @property
    def tokens(self) -> np.ndarray | None:
        return self.tok[:, 0] if self.tok is not None else None


def read_raw(raw_dir: str | os.PathLike) -> dict:
    """Parse one document's directory (engine/CONTRACT.md §3–5) and check everything at once.

    Returns {"dir", "run" (run.json), "layer", "rows", "tokens" [N] i32, "request" [*] i32 | None,
    "R" [rows, hc·n] f32, "inj" [rows, hc] f32, "hh" [rows, f] f16|f32, "hh_dtype" "f16"|"f32",
    "sgv" [rows, 1] f32, "yr" [rows, n] f32, "mixed" [rows, n] | None, "ref_logp" [rows] f32 |
    None, "ref_top_ids" [rows, k] i32 | None, "ref_top_logits" [rows, k] f32 | None, "logits" [rows, V] | None}
    (arrays memory-mapped, read-only). Raises StrataRawError listing every problem.

    run.json -> per-document files -> per-layer files -> rows -> ids -> layer data -> the dict."""
    d = Path(raw_dir)
    problems: list[str] = []
    if not d.is_dir():
        raise StrataRawError(d, [f"{d}: directory: expected the engine's dump directory, found none"])
    f = _read_run(d, problems)
    _read_document_files(f, problems)
    _read_layer_files(f, problems)
    rows = _row_problems(f, problems)
    _id_problems(f, problems)
    _layer_data_problems(f, problems)
    if problems:
        raise StrataRawError(d, problems)
    return _raw_dict(f, rows)


def _read_run(d: Path, problems: list[str]) -> _RawFiles:
    """run.json (its problems appended) and what the other files are checked against: dims, layer, top-k."""
    run: dict = {}
    try:
        run = json.loads((d / RUN_JSON).read_text(encoding="utf-8"))
        problems += _run_problems(run)
    except FileNotFoundError:
        problems.append(f"{RUN_JSON}: file: expected present (the engine writes it last; an incomplete run?), "
                        "found missing")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"{RUN_JSON}: file: expected JSON, found unparsable content ({e})")
    if not isinstance(run, dict):
        run = {}
    f = _RawFiles(d, run, {}, None, None)
    dims = run.get("dims") if isinstance(run.get("dims"), dict) else {}
    f.dim = {k: (dims.get(k) if is_json_type(dims.get(k), int) and dims.get(k) > 0 else None) for k in DIMS}
    layer = f.rv("layer")
    f.layer = layer if layer is not None and layer >= 0 else _find_layer(d)
    f.k = f.rv("logpos_topk")
    return f


def _read_document_files(f: _RawFiles, problems: list[str]) -> None:
    """doc.tokens (required), request.tokens, doc.logpos, doc.logits."""
    d, k = f.d, f.k
    if (d / DOC_TOKENS).exists():
        f.tok, f.n_tok = _read_file(d, DOC_TOKENS, TAG_TOKENS, NO_LAYER, (DT_I32,), 1, problems)
    else:
        problems.append(f"{DOC_TOKENS}: file: expected present (all ids of the document), found missing")
    if (d / REQUEST_TOKENS).exists():
        f.req, _ = _read_file(d, REQUEST_TOKENS, TAG_TOKENS, NO_LAYER, (DT_I32,), 1, problems)
    if (d / DOC_LOGPOS).exists():
        f.lp, _ = _read_file(d, DOC_LOGPOS, TAG_LOGPOS, NO_LAYER, (DT_RECORD,), 1 + 2 * k if k else None, problems)
    if (d / DOC_LOGITS).exists():
        f.lg, _ = _read_file(d, DOC_LOGITS, TAG_LOGITS, NO_LAYER, (DT_F16, DT_F32), f.dim["V"], problems)


def _read_layer_files(f: _RawFiles, problems: list[str]) -> None:
    """The layer's L{L}.* files: R, inj, hh, sgv, yr required; mixed optional."""
    dim, layer = f.dim, f.layer
    hc_n = dim["hc"] * dim["n"] if dim["hc"] and dim["n"] else None
    spec = {TAG_R: ((DT_F32,), hc_n), TAG_INJ: ((DT_F32,), dim["hc"]), TAG_HH: ((DT_F16, DT_F32), dim["f"]),
            TAG_SGV: ((DT_F32,), 1), TAG_YR: ((DT_F32,), dim["n"]), TAG_MIXED: ((DT_F32, DT_F16), dim["n"])}
    what = {TAG_R: f"the streams after layer {layer}'s attention write (.mixed is XF, not R: R must be added "
                   "to the engine)",
            TAG_INJ: f"layer {layer}'s hc_ffn inject logits inj_[cur_inj_] (must be added to the engine)",
            TAG_HH: "the input of ffn_down_shexp", TAG_SGV: "the shared-expert gate logit",
            TAG_YR: "the routed experts' weighted sum"}
    if layer is None:
        problems.append(f"L?.*: layer: expected run.json's layer or one layer's L{{L}}.* files, found neither")
        return
    for t in LAYER_TAGS:
        name = layer_file(layer, t)
        if not (f.d / name).exists():
            if t in REQUIRED_LAYER_TAGS:
                problems.append(f"{name}: file: expected present ({what[t]}), found missing")
            continue
        f.arr[t], _ = _read_file(f.d, name, t, layer, spec[t][0], spec[t][1], problems)


def _row_problems(f: _RawFiles, problems: list[str]) -> int | None:
    """The positions: the same number in every per-position file, N − 1 or N; run.json's counts agree."""
    N, layer = f.n_tok, f.layer
    per_pos = {layer_file(layer, t) if layer is not None else t: a for t, a in f.arr.items() if a is not None}
    if f.lp is not None:
        per_pos[DOC_LOGPOS] = f.lp
    if f.lg is not None:
        per_pos[DOC_LOGITS] = f.lg
    row_counts = {name: a.shape[0] for name, a in per_pos.items()}
    rows = None
    if row_counts:
        distinct = sorted(set(row_counts.values()))
        if len(distinct) > 1:
            problems.append("rows: expected the same number of positions in every per-position file, found "
                            + ", ".join(f"{n}: {c}" for n, c in row_counts.items()))
        else:
            rows = distinct[0]
            if N is not None and rows not in (N - 1, N):
                problems.append(f"rows: expected N − 1 = {N - 1} or N = {N} positions ({DOC_TOKENS} has N = {N} "
                                f"ids), found {rows} in every per-position file")
    if N is not None and N < 2:
        problems.append(f"{DOC_TOKENS}: rows: expected at least 2 ids (one position), found {N}")
    for key, got in (("n_tokens", N), ("rows", rows)):
        if f.rv(key) is not None and got is not None and f.rv(key) != got:
            problems.append(f"{RUN_JSON}: {key}: expected {got} (the files), found {f.rv(key)}")
    return rows


def _id_problems(f: _RawFiles, problems: list[str]) -> None:
    """Token ids inside the vocabulary; the request's ids where the mode puts them; logpos top ids in range."""
    tokens, req, run, dim, k = f.tokens, f.req, f.run, f.dim, f.k
    if tokens is not None and dim["V"]:
        badi = np.flatnonzero((tokens < 0) | (tokens >= dim["V"]))
        if badi.size:
            problems.append(f"{DOC_TOKENS}: ids: expected ids in [0, {dim['V']}), found {badi.size} outside "
                            f"(first: [{int(badi[0])}] = {int(tokens[badi[0]])})")
    if tokens is not None and req is not None and run.get("mode") in MODES:
        r = req[:, 0]
        if run["mode"] == MODE_FORCED:
            same = r.shape == tokens.shape and np.array_equal(r, tokens)
            exp = f"the {r.shape[0]} ids of {REQUEST_TOKENS}"
        else:
            same = r.shape[0] < tokens.shape[0] and np.array_equal(tokens[:r.shape[0]], r)
            exp = f"the prompt ({r.shape[0]} ids of {REQUEST_TOKENS}) followed by sampled ids"
            if same and f.rv("n_prompt") is not None and f.rv("n_prompt") != r.shape[0]:
                problems.append(f"{RUN_JSON}: n_prompt: expected {r.shape[0]} (the request), found "
                                f"{f.rv('n_prompt')}")
        if not same:
            n = min(r.shape[0], tokens.shape[0])
            diff = np.flatnonzero(r[:n] != tokens[:n])
            at = f"first difference at [{int(diff[0])}]" if diff.size else f"{tokens.shape[0]} ids"
            problems.append(f"{DOC_TOKENS}: ids: expected {exp}, found {at}")
    lp = f.lp
    if lp is not None and k and lp.shape[1] == 1 + 2 * k:
        top_ids = lp[:, 1:1 + k].view(np.int32)
        if dim["V"]:
            nb = int(((top_ids < 0) | (top_ids >= dim["V"])).sum())
            if nb:
                problems.append(f"{DOC_LOGPOS}: top ids: expected ids in [0, {dim['V']}), found {nb} outside")


def _layer_data_problems(f: _RawFiles, problems: list[str]) -> None:
    """hh in the path's precision (fp16 on the prompt path, f32 otherwise); R is not a copy of .mixed (XF)."""
    layer, dim, arr = f.layer, f.dim, f.arr
    hh = arr[TAG_HH]
    path_ = f.run.get("path")
    if hh is not None and path_ in PATHS:
        want = DT_F16 if path_ == PATH_PROMPT else DT_F32
        if hh.dtype != DTYPE_NP[want]:
            problems.append(f"{layer_file(layer, TAG_HH)}: dtype: expected {DTYPE_NAME[want]} on path {path_!r} "
                            f"(fp16 on the prompt path, f32 otherwise), found {hh.dtype}")
    R, mixed = arr[TAG_R], arr[TAG_MIXED]
    if R is not None and mixed is not None and dim["hc"] and R.shape[0] == mixed.shape[0] and \
            R.shape[1] == mixed.shape[1] * dim["hc"]:
        m = np.asarray(mixed, dtype=np.float32)[:, None, :]  # [rows, 1, n]
        Rs = np.asarray(R).reshape(R.shape[0], dim["hc"], -1)  # [rows, hc, n]
        copies = [c for c in range(dim["hc"]) if np.allclose(Rs[:, c], m[:, 0], rtol=1e-3, atol=1e-6)]
        if copies:
            problems.append(f"{layer_file(layer, TAG_R)}: data: expected R, the streams after the attention write, "
                            f"found stream(s) {copies} equal to {layer_file(layer, TAG_MIXED)} (XF, the FFN's input)")


def _raw_dict(f: _RawFiles, rows: int) -> dict:
    """read_raw's result from checked files (logpos records split into log p, top ids, top logits)."""
    hh, lp, k = f.arr[TAG_HH], f.lp, f.k
    out = {K_DIR: f.d, K_RUN: f.run, K_LAYER: f.layer, K_ROWS: rows, K_TOKENS: f.tokens,
           K_REQUEST: f.req[:, 0] if f.req is not None else None,
           K_HH_DTYPE: "f16" if hh.dtype == np.float16 else "f32",
           K_LOGITS: f.lg, K_LOGP: None, K_TOP_IDS: None, K_TOP_LOGITS: None}
    out.update({t: f.arr[t] for t in LAYER_TAGS})
    if lp is not None:  # record rows: [logp f32 | k ids i32 | k logits f32], as u32 words
        out[K_LOGP] = lp[:, 0].view(np.float32)
        out[K_TOP_IDS] = lp[:, 1:1 + k].view(np.int32)
        out[K_TOP_LOGITS] = lp[:, 1 + k:].view(np.float32)
    return out


# ==========================================================================================================
# converting to a dump


def _sampler_problems(raw: dict, T: int) -> list[str]:
    """Sampled ids consistent with the recorded sampler (DESIGN §4): greedy -> top-1 of the previous row;
    top_k <= k -> among the top top_k ids."""
    run, s = raw[K_RUN], raw[K_RUN]["sampler"]
    top = raw[K_TOP_IDS]
    if top is None:
        return []
    P = run["n_prompt"]
    t = np.arange(P - 1, T)  # rows whose target was sampled
    if t.size == 0:
        return []
    tgt = raw[K_TOKENS][t + 1]  # [G]
    if s["temperature"] == 0:
        bad = np.flatnonzero(top[t, 0] != tgt)
        if bad.size:
            i = int(t[bad[0]])
            return [f"{DOC_TOKENS}: sampled ids: expected the top-1 id of {DOC_LOGPOS} at every sampled position "
                    f"(sampler.temperature = 0), found {bad.size} other (first: position {i}, id "
                    f"{int(tgt[bad[0]])} vs top-1 {int(top[i, 0])})"]
    elif 0 < s["top_k"] <= top.shape[1]:
        inside = (top[t, : s["top_k"]] == tgt[:, None]).any(1)
        bad = np.flatnonzero(~inside)
        if bad.size:
            i = int(t[bad[0]])
            return [f"{DOC_TOKENS}: sampled ids: expected ids among the top {s['top_k']} of {DOC_LOGPOS} "
                    f"(sampler.top_k), found {bad.size} outside (first: position {i}, id {int(tgt[bad[0]])})"]
    return []


def convert(raw: dict | str | os.PathLike, meta_base: Mapping[str, Any], *,
            allow_moce_bonus: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One document's raw Strata output -> (dump arrays, DumpMeta fields): `write_dump(path, arrays,
    DumpMeta(**fields))` writes it.

    raw        read_raw's dict, or the directory (read here)
    meta_base  what the engine does not know:
               doc_id (str), text (str), role ([T] uint8: role code of every target tokens[t+1], computed by the
               caller from the engine's tokens — read_raw(dir)["tokens"] in generate mode);
               optional: model (the id the caller computed, e.g. the GGUF's sha256; checked against run.json's
               model.sha256), provenance (forced mode; default "written" for every role present),
               prompt_text (generate mode: the rendered prompt), source (dict), n f hc r V (checked)
    The engine's settings come from run.json; in generate mode the targets the engine sampled are "generated"
    and provenance.generation records its sampler. Raises StrataRawError listing every problem, including every
    dump-schema problem of the result (finiteness, fp16-exactness of hh, ...).

    meta_base and run checks -> arrays -> metadata -> the dump schema's own checks."""
    if not isinstance(raw, dict):
        raw = read_raw(raw)
    d = raw[K_DIR]
    problems: list[str] = []
    role, model = _convert_problems(raw, meta_base, allow_moce_bonus, problems)
    arrays = _dump_arrays(raw, role)
    fields = _dump_fields(raw, meta_base, role, model)
    # the dump schema's own checks on the result (finiteness, shapes, fp16-exact hh, provenance per role);
    # role / doc_id / text problems are already reported above
    seen = ("role:", "meta.doc_id", "meta.text", "meta.provenance") if role is None else ("meta.doc_id", "meta.text")
    problems += [f"converted dump: {p}" for p in validate_dump(arrays, fields, d)
                 if not (problems and p.startswith(seen))]
    if problems:
        raise StrataRawError(d, problems)
    return arrays, fields


def _convert_problems(raw: dict, meta_base: Mapping[str, Any], allow_moce_bonus: bool,
                      problems: list[str]) -> tuple[np.ndarray | None, str | None]:
    """meta_base against run.json (doc_id, text, dims, role per target, model), deterministic routing, the
    engine's log p present, sampled ids consistent with the sampler -> (role [T] uint8 | None, model id)."""
    run = raw[K_RUN]
    T = int(raw[K_TOKENS].shape[0]) - 1
    dims = {k: int(run["dims"][k]) for k in DIMS}
    for k, t in (("doc_id", str), ("text", str)):
        if not is_json_type(meta_base.get(k), t):
            problems.append(f"meta_base.{k}: expected {t.__name__}, found {meta_base.get(k)!r:.60}")
    for k in DIMS:
        if k in meta_base and meta_base[k] != dims[k]:
            problems.append(f"{RUN_JSON}: dims.{k}: expected {meta_base[k]} (the model), found {dims[k]}")
    role = meta_base.get("role")
    role = None if role is None else np.asarray(role)
    if role is None or role.shape != (T,) or not np.issubdtype(role.dtype, np.integer):
        problems.append(f"meta_base.role: expected [{T}] integer role codes (one per target), found "
                        f"{None if role is None else f'{role.dtype} {list(role.shape)}'}")
        role = None
    else:
        role = role.astype(np.uint8)
    run_sha = run["model"].get("sha256")
    model = meta_base.get("model") or run_sha
    if not model:
        problems.append(f"{RUN_JSON}: model.sha256: expected the model's sha256 (or meta_base.model), found "
                        "neither")
    elif run_sha and model != run_sha and model.removeprefix("sha256:") != run_sha:
        problems.append(f"{RUN_JSON}: model.sha256: expected {model} (the model the adapter asked for), found "
                        f"{run_sha}")
    s = run["settings"]
    if s.get(SET_MOCE_BONUS) != MOCE_DETERMINISTIC and not allow_moce_bonus:
        problems.append(f"{RUN_JSON}: settings.{SET_MOCE_BONUS}: expected {MOCE_DETERMINISTIC!r} (deterministic "
                        f"routing; set {ENV_MOCE_BONUS}=0), found {s.get(SET_MOCE_BONUS)!r}")
    if raw[K_LOGP] is None:
        problems.append(f"{DOC_LOGPOS}: file: expected present (the engine's own log p for the zero-proxy check; "
                        f"{ENV_LOGPOS}=1), found missing")
    if run["mode"] == MODE_GENERATE:
        problems += _sampler_problems(raw, T)
    return role, model


def _dump_arrays(raw: dict, role: np.ndarray | None) -> dict[str, np.ndarray]:
    """The dump's arrays: rows 0..T-1 (an N-row engine's last row predicts nothing in the document)."""
    tokens, run = raw[K_TOKENS], raw[K_RUN]
    T = int(tokens.shape[0]) - 1
    hc, n = int(run["dims"]["hc"]), int(run["dims"]["n"])
    rs = slice(0, T)
    arrays: dict[str, np.ndarray] = {
        "tokens": np.ascontiguousarray(tokens, dtype=np.int32),  # [T+1]
        "R": np.ascontiguousarray(raw[TAG_R][rs], dtype=np.float32).reshape(T, hc, n),  # [T, hc, n] stream-major
        "inj": np.ascontiguousarray(raw[TAG_INJ][rs], dtype=np.float32),  # [T, hc]
        "hh": np.ascontiguousarray(raw[TAG_HH][rs]).astype(np.float32),  # [T, f]; f16 -> f32 exact
        "sgv": np.ascontiguousarray(raw[TAG_SGV][rs, 0], dtype=np.float32),  # [T] pre-sigmoid
        "yr": np.ascontiguousarray(raw[TAG_YR][rs], dtype=np.float32),  # [T, n]
    }
    if role is not None:
        arrays["role"] = role  # [T]
    if raw[K_LOGP] is not None:
        arrays["ref_logp"] = np.ascontiguousarray(raw[K_LOGP][rs], dtype=np.float32)  # [T]
        arrays["ref_top_ids"] = np.ascontiguousarray(raw[K_TOP_IDS][rs], dtype=np.int32)  # [T, k]
        arrays["ref_top_logits"] = np.ascontiguousarray(raw[K_TOP_LOGITS][rs], dtype=np.float32)  # [T, k]
    if raw[K_LOGITS] is not None:
        arrays["ref_logits"] = np.asarray(raw[K_LOGITS][rs]).astype(np.float16)  # [T, V] (f32 -> f16 rounds)
    return arrays


def _dump_fields(raw: dict, meta_base: Mapping[str, Any], role: np.ndarray | None, model: str | None) -> dict:
    """The DumpMeta fields: the engine and its settings from run.json, provenance (generate mode: the sampled
    targets are "generated" and provenance.generation records the sampler)."""
    run = raw[K_RUN]
    N = int(raw[K_TOKENS].shape[0])
    T = N - 1
    settings = dict(run["settings"])
    settings.update({"path": run["path"], "mode": run["mode"], "hh_dtype": raw[K_HH_DTYPE],
                     "logpos_topk": str(run["logpos_topk"])})
    engine = {"name": ENGINE_NAME, "version": run["engine"]["version"], "settings": settings}
    if run["engine"]["name"] != ENGINE_NAME:
        engine["settings"]["engine_name"] = run["engine"]["name"]
    generate = run["mode"] == MODE_GENERATE
    generated = np.arange(1, N) >= run["n_prompt"] if generate else np.zeros(T, bool)  # [T] target was sampled
    if role is None:
        provenance: dict = {}
    elif generate:
        provenance = provenance_of(role, generated)
        smp = run["sampler"]
        provenance[PROV_GENERATION] = {
            "prompt": str(meta_base.get("prompt_text", "")), "seed": int(smp["seed"]), "model": model or "",
            "sampler": {"temperature": smp["temperature"], "top_p": smp["top_p"], "top_k": smp["top_k"],
                        "max_new_tokens": smp["max_new_tokens"], "stop_ids": list(smp["stop_ids"]),
                        "engine": ENGINE_NAME},
        }
    else:
        provenance = dict(meta_base.get("provenance") or provenance_of(role, generated))
    fields = {
        "schema_version": SCHEMA_VERSION, "doc_id": meta_base.get("doc_id"), "layer": int(run["layer"]),
        **{k: int(run["dims"][k]) for k in DIMS}, "model": model or "", "engine": engine,
        "inj_convention": run["inj_convention"],
        "hh_precision": HH_F16 if raw[K_HH_DTYPE] == "f16" else HH_F32, "provenance": provenance,
        "text": meta_base.get("text"), "source": dict(meta_base.get("source") or {}),
    }
    if fields["inj_convention"] not in INJ_CONVENTIONS:  # already refused by read_raw; keeps the schema happy
        fields["inj_convention"] = INJ_RAW
    return fields
