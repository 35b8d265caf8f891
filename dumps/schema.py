"""The dump file: one safetensors file per document, holding the per-token state around layer L's shared-expert
down projection (DESIGN §3.1). This module reads, writes and validates it; nothing else in the toolkit parses the
bytes.

Notation for tensor shapes (as in DESIGN §1):
    T   positions of the document (position t is computed at input tokens[t] and predicts tokens[t+1])
    hc  hyper-connection streams (4)            n   hidden size (2560)
    f   shared-expert width (640)               r   HC low rank (320; metadata only)
    V   vocabulary size (248,320)               k   engine top-k kept for the zero-proxy check

File layout (safetensors, little-endian; see dumps/README.md for a C++ reader):
    [8 bytes: u64 header length N] [N bytes: JSON header, space-padded to a multiple of 8] [array bytes]
    header = {"__metadata__": {"l47": "<DumpMeta JSON>"}, name: {"dtype", "shape", "data_offsets"}, ...}
Arrays are written contiguously, 4-byte dtypes first, then f16, then u8, so every array is aligned to its dtype.

Precision: arrays are stored exactly as given (no conversion on write). The only arithmetic on load is the
inject-convention normalisation, `inj · 4` in f32, which is exact (a power of two) for every finite f32 below
2^126.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from l47.errors import L47Error
from l47.fileio import atomic_open
from l47.model.names import ROLE_ID, ROLES

SCHEMA_VERSION = 1
META_KEY = "l47"  # the one key of safetensors' __metadata__; its value is the DumpMeta JSON string
ST_META = "__metadata__"  # safetensors' own reserved header key

# --- array names (the file's tensor names) --------------------------------------------------------------
TOKENS = "tokens"
R = "R"
INJ = "inj"
HH = "hh"
SGV = "sgv"
YR = "yr"
ROLE = "role"
REF_LOGP = "ref_logp"
REF_TOP_IDS = "ref_top_ids"
REF_TOP_LOGITS = "ref_top_logits"
REF_LOGITS = "ref_logits"

REQUIRED_ARRAYS = (TOKENS, R, INJ, HH, SGV, YR, ROLE)
REF_TRIO = (REF_LOGP, REF_TOP_IDS, REF_TOP_LOGITS)  # all three or none
OPTIONAL_ARRAYS = REF_TRIO + (REF_LOGITS,)
ALL_ARRAYS = REQUIRED_ARRAYS + OPTIONAL_ARRAYS

# name -> (dtype, shape template). Shape symbols: ints are literal, strings are metadata dims, "T+1"/"T"/"k".
ARRAY_SPEC: dict[str, tuple[np.dtype, tuple[str, ...]]] = {
    TOKENS: (np.dtype(np.int32), ("T+1",)),
    R: (np.dtype(np.float32), ("T", "hc", "n")),
    INJ: (np.dtype(np.float32), ("T", "hc")),
    HH: (np.dtype(np.float32), ("T", "f")),
    SGV: (np.dtype(np.float32), ("T",)),
    YR: (np.dtype(np.float32), ("T", "n")),
    ROLE: (np.dtype(np.uint8), ("T",)),
    REF_LOGP: (np.dtype(np.float32), ("T",)),
    REF_TOP_IDS: (np.dtype(np.int32), ("T", "k")),
    REF_TOP_LOGITS: (np.dtype(np.float32), ("T", "k")),
    REF_LOGITS: (np.dtype(np.float16), ("T", "V")),
}
FLOAT_ARRAYS = (R, INJ, HH, SGV, YR, REF_LOGP, REF_TOP_LOGITS, REF_LOGITS)

# --- metadata values ------------------------------------------------------------------------------------
INJ_RAW = "raw"  # inj = inject_w · xn (DESIGN §1)
INJ_XN_DIV4 = "xn_div4"  # inj = inject_w · (xn / 4): the loader multiplies by 4
INJ_CONVENTIONS = {INJ_RAW: 1.0, INJ_XN_DIV4: 4.0}  # convention -> factor that turns it into raw
HH_F32 = "f32"
HH_F16 = "f16"  # the engine rounded hh to fp16 (Strata's prompt path); stored as f32, values fp16-exact
HH_PRECISIONS = (HH_F32, HH_F16)
PROV_GENERATED = "generated"
PROV_WRITTEN = "written"
PROV_MIXED = "mixed"
PROVENANCES = (PROV_GENERATED, PROV_WRITTEN, PROV_MIXED)


def provenance_of(role: np.ndarray, generated: np.ndarray | None = None) -> dict:
    """Per role present among the targets: written / generated / mixed. role [T] uint8, generated [T] bool
    (None: nothing generated)."""
    out = {}
    for code in np.unique(role):
        g = generated[role == code] if generated is not None else np.zeros(1, bool)
        out[ROLES[int(code)]] = PROV_GENERATED if g.all() else (PROV_MIXED if g.any() else PROV_WRITTEN)
    return out
PROV_GENERATION = "generation"  # optional provenance entry: how the generated text was sampled
GENERATION_FIELDS = {"prompt": str, "seed": int, "sampler": dict, "model": str}
SAMPLER_FIELDS = ("temperature", "top_p", "top_k")
ENGINE_FIELDS = {"name": str, "version": str, "settings": dict}

# safetensors dtype tag <-> numpy dtype (tags numpy cannot hold, e.g. BF16, are reported, not read)
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
# What a real dump header can be, checked on the raw bytes BEFORE any JSON parsing (a mutated header must end in a
# one-line refusal, never in the parser's RecursionError or in minutes of parsing):
#   size   <= _HEADER_SLACK + the data section: the header is the array table (< 2 KiB) and the metadata, whose
#          only long fields are the document's text and its prompt — a few bytes per position, while every position
#          holds 4·(hc·n + hc + f + 1 + n) + 5 bytes of arrays (measured on 195 demo / model2 dumps: header / data
#          at most 0.6 %, header at most 58 bytes per position)
#   bytes outside JSON strings <= _MAX_STRUCTURE: ~25 per array entry (measured at most 324 in the header, 164 in
#          the metadata)
#   nesting <= _MAX_HEADER_DEPTH for the header (the object, a tensor's entry, its shape / data_offsets; the
#          metadata table maps strings to strings), <= _MAX_META_DEPTH for the metadata JSON (its deepest field is
#          provenance.generation.sampler, 4 deep; engine.settings may hold an engine's own small tables)
_HEADER_SLACK = 1 << 20
_MAX_STRUCTURE = 64 << 10
_MAX_HEADER_DEPTH = 3
_MAX_META_DEPTH = 8
_CHUNK = 1 << 24  # elements per chunk in value scans (bounds the temporary bool arrays to 16 MB)


class DumpError(L47Error):
    """A dump that is not valid: every problem found, joined with "; " (each names its array or field)."""

    def __init__(self, where: str | os.PathLike, problems: list[str]):
        self.problems = list(problems)
        super().__init__(str(where), "dump", f"a valid l47 dump (schema_version {SCHEMA_VERSION}, dumps/README.md)",
                         f"{len(self.problems)} problem(s): " + "; ".join(self.problems))


# --- metadata -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DumpMeta:
    """Every field of DESIGN §3.1's metadata. JSON-serialisable; `roles` is a list in the JSON."""

    schema_version: int
    doc_id: str
    layer: int
    n: int
    f: int
    hc: int
    r: int
    V: int
    model: str  # sha256 of the GGUF, or the checkpoint id
    engine: dict  # {"name", "version", "settings": {every setting that changes the numbers}}
    inj_convention: str  # INJ_RAW | INJ_XN_DIV4
    hh_precision: str  # HH_F32 | HH_F16
    provenance: dict  # role name -> generated|written|mixed; optional "generation": {prompt, seed, sampler, model}
    text: str
    roles: tuple[str, ...] = ROLES
    source: dict = field(default_factory=dict)  # input file + line/hash, for resumable dumping

    def to_dict(self) -> dict[str, Any]:
        d = {fl.name: getattr(self, fl.name) for fl in fields(self)}
        d["roles"] = list(self.roles)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str | os.PathLike = "<metadata>") -> "DumpMeta":
        problems = meta_problems(d)
        if problems:
            raise DumpError(where, problems)
        kw = dict(d)
        kw["roles"] = tuple(kw.get("roles", ROLES))
        return DumpMeta(**kw)

    @staticmethod
    def from_json(s: str, where: str | os.PathLike = "<metadata>") -> "DumpMeta":
        bad = json_shape_problem(s.encode("utf-8"), "metadata", _MAX_META_DEPTH) if isinstance(s, str) else None
        if bad:
            raise DumpError(where, [bad])
        try:
            d = json.loads(s)
        except (json.JSONDecodeError, TypeError) as e:
            raise DumpError(where, [f"metadata: expected one JSON object, found unparsable JSON ({e})"]) from None
        if not isinstance(d, dict):
            raise DumpError(where, [f"metadata: expected one JSON object, found {type(d).__name__}"])
        return DumpMeta.from_dict(d, where)


_META_TYPES: dict[str, type] = {
    "schema_version": int, "doc_id": str, "layer": int, "n": int, "f": int, "hc": int, "r": int, "V": int,
    "model": str, "engine": dict, "inj_convention": str, "hh_precision": str, "provenance": dict, "text": str,
    "roles": (list, tuple), "source": dict,
}
_META_OPTIONAL = ("roles", "source")
_DIMS = ("n", "f", "hc", "r", "V")


def is_json_type(v: Any, t) -> bool:
    """isinstance for parsed JSON, except that a bool is not a number (JSON true is no int)."""
    if isinstance(v, bool) and t in (int, float, (int, float)):
        return False
    return isinstance(v, t)


def meta_problems(d: Mapping[str, Any]) -> list[str]:
    """Every problem of a metadata dict (fields, types, values). Field names are prefixed `meta.`."""
    out: list[str] = []
    for k, t in _META_TYPES.items():
        if k not in d:
            if k not in _META_OPTIONAL:
                out.append(f"meta.{k}: expected present, found missing")
        elif not is_json_type(d[k], t):
            tn = "list of str" if k == "roles" else t.__name__
            out.append(f"meta.{k}: expected {tn}, found {type(d[k]).__name__} {d[k]!r:.60}")
    for k in sorted(set(d) - set(_META_TYPES)):
        out.append(f"meta.{k}: expected no such field (schema_version {SCHEMA_VERSION}), found it")

    def ok(k: str) -> bool:
        return k in d and is_json_type(d[k], _META_TYPES[k])

    if ok("schema_version") and d["schema_version"] != SCHEMA_VERSION:
        out.append(f"meta.schema_version: expected {SCHEMA_VERSION}, found {d['schema_version']} (unknown version)")
    for k in _DIMS:
        if ok(k) and d[k] <= 0:
            out.append(f"meta.{k}: expected > 0, found {d[k]}")
    if ok("layer") and d["layer"] < 0:
        out.append(f"meta.layer: expected >= 0, found {d['layer']}")
    for k in ("doc_id", "model"):
        if ok(k) and not d[k]:
            out.append(f"meta.{k}: expected a non-empty string, found ''")
    if ok("inj_convention") and d["inj_convention"] not in INJ_CONVENTIONS:
        out.append(f"meta.inj_convention: expected one of {sorted(INJ_CONVENTIONS)}, found {d['inj_convention']!r}")
    if ok("hh_precision") and d["hh_precision"] not in HH_PRECISIONS:
        out.append(f"meta.hh_precision: expected one of {list(HH_PRECISIONS)}, found {d['hh_precision']!r}")
    if ok("engine"):
        for k, t in ENGINE_FIELDS.items():
            if not is_json_type(d["engine"].get(k), t):
                out.append(f"meta.engine.{k}: expected {t.__name__}, found {d['engine'].get(k)!r:.60}")
    roles = tuple(d["roles"]) if ok("roles") else ROLES
    if ok("roles"):
        if not roles or not all(isinstance(x, str) for x in roles) or len(set(roles)) != len(roles):
            out.append(f"meta.roles: expected unique role names, found {list(roles)!r:.80}")
        elif any(x not in ROLE_ID for x in roles):
            unknown = [x for x in roles if x not in ROLE_ID]
            out.append(f"meta.roles: expected names from {list(ROLES)}, found unknown {unknown}")
    if ok("provenance"):
        for k, v in d["provenance"].items():
            if k == PROV_GENERATION:
                out += _generation_problems(v)
            elif k not in roles:
                out.append(f"meta.provenance.{k}: expected a role name from {list(roles)} or "
                           f"'{PROV_GENERATION}', found {k!r}")
            elif v not in PROVENANCES:
                out.append(f"meta.provenance.{k}: expected one of {list(PROVENANCES)}, found {v!r:.60}")
    return out


def _generation_problems(g: Any) -> list[str]:
    w = f"meta.provenance.{PROV_GENERATION}"
    if not isinstance(g, dict):
        return [f"{w}: expected an object {{prompt, seed, sampler, model}}, found {type(g).__name__}"]
    out = [f"{w}.{k}: expected {t.__name__}, found {g.get(k)!r:.60}" for k, t in GENERATION_FIELDS.items()
           if not is_json_type(g.get(k), t)]
    if isinstance(g.get("sampler"), dict):
        out += [f"{w}.sampler.{k}: expected a number, found {g['sampler'].get(k)!r}" for k in SAMPLER_FIELDS
                if not is_json_type(g["sampler"].get(k), (int, float))]
    return out


# --- the record -----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Dump:
    """One document's dump. Arrays are read-only (memory-mapped when read with mmap=True); `inj` is always in
    the raw convention (meta.inj_convention == "raw") once read."""

    path: Path | None
    meta: DumpMeta
    tokens: np.ndarray  # [T+1] int32
    R: np.ndarray  # [T, hc, n] f32
    inj: np.ndarray  # [T, hc] f32
    hh: np.ndarray  # [T, f] f32
    sgv: np.ndarray  # [T] f32
    yr: np.ndarray  # [T, n] f32
    role: np.ndarray  # [T] uint8
    ref_logp: np.ndarray | None = None  # [T] f32
    ref_top_ids: np.ndarray | None = None  # [T, k] int32
    ref_top_logits: np.ndarray | None = None  # [T, k] f32
    ref_logits: np.ndarray | None = None  # [T, V] f16

    @property
    def T(self) -> int:
        return int(self.tokens.shape[0]) - 1

    @property
    def targets(self) -> np.ndarray:
        return self.tokens[1:]  # [T] int32: the token position t predicts

    @property
    def verified(self) -> bool:
        return self.ref_logp is not None

    def arrays(self) -> dict[str, np.ndarray]:
        """The present arrays by file name (optional ones left out when None)."""
        return {k: getattr(self, k) for k in ALL_ARRAYS if getattr(self, k) is not None}

    @cached_property
    def sha256(self) -> str:
        """The document's identity: sha256 of its token ids (`content_hash`), independent of the file name, the
        metadata (doc_id, paths) and the engine that dumped it. Identity, disjointness, the split, the ledger
        and the blind rule use this; the file's own bytes hash (`file_sha256`) is provenance only."""
        return content_hash(self.tokens)

    @cached_property
    def file_sha256(self) -> str:
        """sha256 of the file bytes when read from a file; otherwise of the bytes write_dump would write
        (provenance only: a re-saved copy of a document has another file hash and the same `sha256`)."""
        if self.path is not None:
            return doc_hash(self.path)
        h = hashlib.sha256()
        for chunk in _serialize(self.arrays(), self.meta):
            h.update(chunk)
        return h.hexdigest()


# --- validation -----------------------------------------------------------------------------------------


def _count_where(a: np.ndarray, bad_fn) -> tuple[int, tuple[int, ...] | None]:
    """(count, first index) of the elements where bad_fn is true, scanned in chunks of _CHUNK elements so a
    [T, V] array never needs a full-size bool temporary."""
    flat = a.reshape(-1)
    count, first = 0, None
    for s in range(0, flat.shape[0], _CHUNK):
        bad = bad_fn(flat[s:s + _CHUNK])
        c = int(np.count_nonzero(bad))
        if c and first is None:
            first = tuple(int(i) for i in np.unravel_index(s + int(np.argmax(bad)), a.shape))
        count += c
    return count, first


def _expected_shape(name: str, dims: Mapping[str, int | None]) -> tuple[int | None, ...]:
    """ARRAY_SPEC's shape template with the known dims filled in (None = unknown, not checked)."""
    T = dims["T"]
    return tuple((T + 1 if T is not None else None) if sym == "T+1" else dims.get(sym)
                 for sym in ARRAY_SPEC[name][1])


def _fmt_shape(shape: tuple) -> str:
    return "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"


def validate_dump(arrays: Mapping[str, np.ndarray], meta: DumpMeta | Mapping[str, Any],
                  where: str | os.PathLike = "<dump>") -> list[str]:
    """Every problem of a dump at once (empty list = valid): metadata fields and values, missing/unknown arrays,
    dtypes, shapes against the metadata dims and T = len(tokens) − 1, non-finite values (count and first index),
    role codes, token ids, fp16-exactness of hh when hh_precision is "f16". `where` is only used by callers that
    raise; each problem string starts with the array or `meta.` field it concerns."""
    md = meta.to_dict() if isinstance(meta, DumpMeta) else dict(meta)
    out = meta_problems(md) + _presence_problems(arrays)
    dims = _dims(arrays, md, out)
    for name in ALL_ARRAYS:
        a = arrays.get(name)
        if a is not None:
            out += _array_problems(name, a, dims, md)
    return out + _provenance_problems(arrays, md)


def _roles(md: Mapping[str, Any]) -> tuple[Any, int]:
    """The metadata's role names (as given) and how many codes they allow."""
    roles = md.get("roles", ROLES)
    return roles, len(roles) if isinstance(roles, (list, tuple)) else len(ROLES)


def _presence_problems(arrays: Mapping[str, np.ndarray]) -> list[str]:
    out = [f"{k}: expected present, found missing" for k in REQUIRED_ARRAYS if k not in arrays]
    present_ref = [k for k in REF_TRIO if k in arrays]
    if present_ref and len(present_ref) != len(REF_TRIO):
        missing = [k for k in REF_TRIO if k not in arrays]
        out.append(f"{', '.join(missing)}: expected present with {', '.join(present_ref)} (the ref arrays come "
                   f"together), found missing")
    for k in sorted(set(arrays) - set(ALL_ARRAYS)):
        out.append(f"{k}: expected no such array (known: {', '.join(ALL_ARRAYS)}), found it")
    return out


def _dims(arrays: Mapping[str, np.ndarray], md: Mapping[str, Any], out: list[str]) -> dict[str, int | None]:
    """T (from the tokens), k (from the ref top-k arrays) and the metadata dims; None = unknown, not checked.
    Problems with T or k are appended to `out`."""
    T = None
    tok = arrays.get(TOKENS)
    if tok is not None and tok.ndim == 1:
        T = tok.shape[0] - 1
        if T < 1:
            out.append(f"{TOKENS}: expected at least 2 ids (T >= 1 positions), found {tok.shape[0]}")
            T = None
    k_top = None
    for k in (REF_TOP_IDS, REF_TOP_LOGITS):
        a = arrays.get(k)
        if a is not None and a.ndim == 2:
            k_top = a.shape[1] if k_top is None else k_top
    if k_top is not None and k_top < 1:
        out.append(f"{REF_TOP_IDS}: expected k >= 1, found k = {k_top}")

    def dim(k: str) -> int | None:
        v = md.get(k)
        return v if is_json_type(v, int) and v > 0 else None

    return {"T": T, "k": k_top, **{d: dim(d) for d in _DIMS}}


def _array_problems(name: str, a: Any, dims: Mapping[str, int | None], md: Mapping[str, Any]) -> list[str]:
    """One array's dtype, shape and values."""
    if not isinstance(a, np.ndarray):
        return [f"{name}: expected a numpy array, found {type(a).__name__}"]
    out = []
    want_dt = ARRAY_SPEC[name][0]
    if a.dtype != want_dt:
        out.append(f"{name}: expected dtype {want_dt}, found {a.dtype}")
    want = _expected_shape(name, dims)
    if a.ndim != len(want) or any(w is not None and w != s for w, s in zip(want, a.shape)):
        out.append(f"{name}: expected shape {_fmt_shape(want)}, found {list(a.shape)}")
    if a.size == 0:
        return out
    roles, n_roles = _roles(md)
    if name in FLOAT_ARRAYS and a.dtype.kind == "f":
        c, first = _count_where(a, lambda x: ~np.isfinite(x))
        if c:
            out.append(f"{name}: expected finite values, found {c} non-finite (first at {list(first)})")
    if name == ROLE and a.dtype.kind in "iu":
        c, first = _count_where(a, lambda x: (x < 0) | (x >= n_roles))
        if c:
            out.append(f"{ROLE}: expected codes 0..{n_roles - 1} ({', '.join(map(str, roles))}), found {c} out of "
                       f"range (first at {list(first)}: {int(a[first])})")
    if name in (TOKENS, REF_TOP_IDS) and a.dtype.kind in "iu" and dims["V"] is not None:
        V = dims["V"]
        c, first = _count_where(a, lambda x: (x < 0) | (x >= V))
        if c:
            out.append(f"{name}: expected ids in [0, {V}), found {c} out of range (first at {list(first)}: "
                       f"{int(a[first])})")
    if name == HH and md.get("hh_precision") == HH_F16 and a.dtype == np.float32:
        c, first = _count_where(a, lambda x: x.astype(np.float16).astype(np.float32) != x)
        if c:
            out.append(f"{HH}: expected fp16-exact values (meta.hh_precision is \"f16\"), found {c} values not "
                       f"representable in fp16 (first at {list(first)}: {float(a[first])!r})")
    if name == REF_LOGP and a.dtype.kind == "f":
        c, first = _count_where(a, lambda x: x > 1e-3)
        if c:
            out.append(f"{REF_LOGP}: expected log-probabilities <= 0, found {c} positive (first at {list(first)}: "
                       f"{float(a[first])!r})")
    return out


def _provenance_problems(arrays: Mapping[str, np.ndarray], md: Mapping[str, Any]) -> list[str]:
    """Provenance must cover every role that produced a target."""
    role = arrays.get(ROLE)
    prov = md.get("provenance")
    roles, n_roles = _roles(md)
    if (isinstance(prov, dict) and isinstance(role, np.ndarray) and role.dtype.kind in "iu" and role.size
            and isinstance(roles, (list, tuple)) and all(isinstance(x, str) for x in roles)):
        used = [roles[int(c)] for c in np.unique(role) if 0 <= int(c) < n_roles]
        lacking = [x for x in used if x not in prov]
        if lacking:
            return [f"meta.provenance: expected an entry for every role present in `role`, found none for "
                    f"{lacking}"]
    return []


# --- writing --------------------------------------------------------------------------------------------


def _order(names) -> list[str]:
    """Write order: larger dtypes first (4-byte, then f16, then u8) so every array is aligned; canonical within."""
    return sorted(names, key=lambda k: (-ARRAY_SPEC[k][0].itemsize if k in ARRAY_SPEC else 0, ALL_ARRAYS.index(k)
                                        if k in ALL_ARRAYS else len(ALL_ARRAYS), k))


def _serialize(arrays: Mapping[str, np.ndarray], meta: DumpMeta) -> Iterator[bytes | memoryview]:
    """The file's bytes, in chunks: 8-byte length, space-padded JSON header, array bytes (little-endian)."""
    header: dict[str, Any] = {ST_META: {META_KEY: meta.to_json()}}
    bufs, off = [], 0
    for k in _order(arrays):
        a = np.ascontiguousarray(arrays[k])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        nb = a.size * a.dtype.itemsize
        header[k] = {"dtype": _NP_TO_ST[np.dtype(a.dtype.newbyteorder("="))], "shape": list(a.shape),
                     "data_offsets": [off, off + nb]}
        bufs.append(a)
        off += nb
    hb = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    yield struct.pack("<Q", len(hb))
    yield hb
    for a in bufs:
        if a.size:
            yield memoryview(a.reshape(-1)).cast("B")


def write_dump(path: str | os.PathLike, dump_or_arrays: Dump | Mapping[str, np.ndarray],
               meta: DumpMeta | None = None) -> Path:
    """Validate, then write atomically (temp file in the same directory, fsync, os.replace). An invalid dump
    raises DumpError and writes nothing; a failure while writing leaves no temp file and any old file intact."""
    path = Path(path)
    if isinstance(dump_or_arrays, Dump):
        arrays = dump_or_arrays.arrays()
        meta = dump_or_arrays.meta if meta is None else meta
    else:
        arrays = {k: v for k, v in dump_or_arrays.items() if v is not None}
    if not isinstance(meta, DumpMeta):
        raise DumpError(path, [f"meta: expected a DumpMeta, found {type(meta).__name__}"])
    problems = validate_dump(arrays, meta, path)
    if problems:
        raise DumpError(path, problems)
    with atomic_open(path, "wb", fsync=True) as fh:
        for chunk in _serialize(arrays, meta):
            fh.write(chunk)
    return path


# --- reading --------------------------------------------------------------------------------------------


def _string_spans(b: np.ndarray) -> np.ndarray:
    """[m, 2] (first, last) byte of each JSON string literal of b ([N] uint8), quotes included; an unterminated
    last string runs to the end. A quote is escaped when an odd run of backslashes precedes it."""
    quotes = np.flatnonzero(b == 0x22)  # [q]
    bs = np.flatnonzero(b == 0x5C)  # [s] backslashes
    if bs.size:
        starts = np.flatnonzero(np.diff(bs, prepend=-2) != 1)  # first backslash of each run
        ends = np.append(starts[1:], bs.size) - 1
        run_end, run_len = bs[ends], ends - starts + 1  # [runs]
        k = np.searchsorted(run_end, quotes - 1)  # the run that may end just before each quote
        hit = (k < run_end.size) & (run_end[np.minimum(k, run_end.size - 1)] == quotes - 1)
        escaped = hit & (run_len[np.minimum(k, run_end.size - 1)] % 2 == 1)
        quotes = quotes[~escaped]
    if quotes.size % 2:
        quotes = np.append(quotes, b.size - 1)
    return quotes.reshape(-1, 2)


def json_shape_problem(raw: bytes, what: str, max_depth: int) -> str | None:
    """The problem of JSON text that no l47 dump holds, found without parsing it: more than _MAX_STRUCTURE bytes
    outside its string literals, or {} / [] nested deeper than max_depth (None: neither). Vectorised: a 60 MB
    header in well under a second."""
    b = np.frombuffer(raw, dtype=np.uint8)  # [N]
    spans = _string_spans(b)  # [m, 2]
    outside = b.size - int((spans[:, 1] - spans[:, 0] + 1).sum())
    if outside > _MAX_STRUCTURE:
        return (f"{what}: expected at most {_MAX_STRUCTURE} bytes outside JSON strings (an l47 dump's), found "
                f"{outside}")
    br = np.flatnonzero((b == 0x7B) | (b == 0x5B) | (b == 0x7D) | (b == 0x5D))  # [k] { [ } ]
    br = br[np.searchsorted(spans[:, 0], br, side="right") == np.searchsorted(spans[:, 1], br, side="left")]
    step = np.where((b[br] == 0x7B) | (b[br] == 0x5B), 1, -1)  # outside strings only
    depth = int(np.cumsum(step).max(initial=0))
    if depth > max_depth:
        return f"{what}: expected JSON nested at most {max_depth} deep (an l47 dump's), found {depth} deep"
    return None


def _header_bytes(buf: np.ndarray) -> tuple[bytes | None, str | None]:
    """The header's bytes, or the problem that refuses them before parsing (length, size, structure, depth)."""
    size = buf.shape[0]
    if size < 8:
        return None, f"file: expected a safetensors file (>= 8 bytes), found {size} bytes"
    (hlen,) = struct.unpack("<Q", buf[:8].tobytes())
    if hlen > _MAX_HEADER or 8 + hlen > size:
        return None, (f"header: expected a length <= {min(_MAX_HEADER, size - 8)}, found {hlen} (not a "
                      f"safetensors file, or truncated)")
    cap = _HEADER_SLACK + (size - 8 - hlen)
    if hlen > cap:
        return None, (f"header: expected at most {cap} bytes (1 MiB + the {size - 8 - hlen}-byte data section: an "
                      f"l47 dump's), found {hlen}")
    raw = buf[8:8 + hlen].tobytes()
    return raw, json_shape_problem(raw, "header", _MAX_HEADER_DEPTH)


def _tensor_entry(info, n_data: int):
    """(dtype tag, shape, begin, end) of one header entry, or the problem as text: dtype a string, shape a list of
    integers ≥ 0 whose element count fits the data section, data_offsets two integers (a fuzzed header held lists,
    floats and 10¹⁹-element shapes here: TypeError / OverflowError before this check)."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        return f"expected {{dtype, shape, data_offsets}} in the header, found {info!r:.80}"
    tag, shape, off = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(tag, str):
        return f"expected dtype as a string, found {tag!r:.40}"
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                              for x in shape):
        return f"expected shape as a list of integers ≥ 0, found {shape!r:.60}"
    if math.prod(shape) > n_data:
        return f"expected a shape whose elements fit the {n_data}-byte data section, found {shape!r:.60}"
    if not (isinstance(off, list) and len(off) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in off)):
        return f"expected data_offsets as two integers, found {off!r:.60}"
    return tag, shape, off[0], off[1]


def _parse(buf: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, str], list[str]]:
    """Arrays (views into buf), __metadata__, and structural problems of a safetensors byte buffer."""
    raw, problem = _header_bytes(buf)
    if problem is not None:
        return {}, {}, [problem]
    hlen = len(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, {}, [f"header: expected JSON, found unparsable bytes ({e})"]
    if not isinstance(header, dict):
        return {}, {}, [f"header: expected a JSON object, found {type(header).__name__}"]
    st_meta = header.pop(ST_META, {}) or {}
    data, base, out, arrays = buf[8 + hlen:], 8 + hlen, [], {}
    for name, info in header.items():
        entry = _tensor_entry(info, data.shape[0])
        if isinstance(entry, str):
            out.append(f"{name}: {entry}")
            continue
        tag, shape, b, e = entry
        if tag not in _ST_DTYPES:
            out.append(f"{name}: expected dtype {ARRAY_SPEC[name][0] if name in ARRAY_SPEC else 'numeric'}, found "
                       f"safetensors dtype {tag}")
            continue
        dt = np.dtype(_ST_DTYPES[tag]).newbyteorder("<")
        nb = math.prod(shape) * dt.itemsize
        if not (0 <= b <= e <= data.shape[0]) or e - b != nb:
            out.append(f"{name}: expected {nb} bytes inside the {data.shape[0]}-byte data section, found "
                       f"data_offsets [{b}, {e}] (truncated file?)")
            continue
        arrays[name] = data[b:e].view(dt).reshape(shape) if nb else np.zeros(shape, dt)
    return arrays, st_meta, out


def read_dump(path: str | os.PathLike, mmap: bool = True, validate: bool = True) -> Dump:
    """Read one dump. mmap=True maps the file (arrays are read-only views; pages load on first touch);
    mmap=False reads it into memory. `inj` is normalised to the raw convention (xn_div4: × 4, f32, exact) and
    role codes to l47.model.names.ROLES when the file lists its roles in another order; meta says "raw" afterwards.
    validate=True checks everything (DumpError lists every problem); validate=False checks only what is needed
    to build the record (header structure, metadata fields)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if mmap and size > 0:
            buf = np.memmap(path, dtype=np.uint8, mode="r")
        else:
            buf = np.fromfile(path, dtype=np.uint8)
            buf.flags.writeable = False
    except OSError as e:
        raise DumpError(path, [f"file: expected a readable file, found {e.strerror or e}"]) from None
    arrays, st_meta, problems = _parse(buf)
    raw_meta = st_meta.get(META_KEY) if isinstance(st_meta, dict) else None
    md: dict[str, Any] = {}
    if raw_meta is None:
        problems.append(f"{ST_META}.{META_KEY}: expected the dump metadata JSON, found missing (not an l47 dump)")
    elif not isinstance(raw_meta, str):
        problems.append(f"{ST_META}.{META_KEY}: expected the dump metadata as a JSON string, found "
                        f"{type(raw_meta).__name__}")
    elif (bad := json_shape_problem(raw_meta.encode("utf-8"), f"{ST_META}.{META_KEY}", _MAX_META_DEPTH)):
        problems.append(bad)
    else:
        try:
            md = json.loads(raw_meta)
            if not isinstance(md, dict):
                problems.append(f"{ST_META}.{META_KEY}: expected a JSON object, found {type(md).__name__}")
                md = {}
        except (json.JSONDecodeError, TypeError) as e:
            problems.append(f"{ST_META}.{META_KEY}: expected JSON, found unparsable text ({e})")
    if validate:
        problems += validate_dump(arrays, md, path) if md else []
    else:
        problems += meta_problems(md) if md else []
        problems += [f"{k}: expected present, found missing" for k in REQUIRED_ARRAYS if k not in arrays]
    if problems:
        raise DumpError(path, problems)
    meta = DumpMeta.from_dict(md, path)

    # inj -> raw convention  [T, hc] f32 (× 1 or × 4: exact)
    factor = INJ_CONVENTIONS[meta.inj_convention]
    if factor != 1.0:
        inj = arrays[INJ] * np.float32(factor)
        inj.flags.writeable = False
        arrays[INJ] = inj
    # role codes -> canonical ROLES
    if tuple(meta.roles) != ROLES:
        lut = np.array([ROLE_ID[x] for x in meta.roles], dtype=np.uint8)
        role = lut[arrays[ROLE]]
        role.flags.writeable = False
        arrays[ROLE] = role
    meta = DumpMeta(**{**meta.to_dict(), "inj_convention": INJ_RAW, "roles": ROLES})
    known = {k: arrays[k] for k in ALL_ARRAYS if k in arrays}
    return Dump(path=path, meta=meta, **known)


def content_hash(tokens) -> str:
    """A document's identity: sha256 of its token ids as little-endian int32 ([T+1] ids, in order). Two dumps
    of the same text under the same vocabulary have the same content hash whatever their file names, doc_id,
    metadata or engine; the model (vocabulary) identity is kept beside it (dump meta.model, the ledger's
    base_sha256), never mixed in."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(tokens), dtype="<i4").tobytes()).hexdigest()


def doc_hash(path: str | os.PathLike) -> str:
    """sha256 of the file bytes, streamed in 8 MB blocks (provenance only; a document's identity is
    `content_hash` of its tokens)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            h.update(block)
    return h.hexdigest()


def dump_nbytes(T: int, n: int, f: int, hc: int, V: int = 0, k: int = 0, ref_logits: bool = False) -> int:
    """Bytes of a dump's array section (header excluded): 4·(hc·n + hc + f + 1 + n) + 1 + 4 per position, + 4 for
    the extra token, + (4 + 8k) per position with the ref trio (k > 0), + 2V per position with ref_logits."""
    per = 4 * (hc * n + hc + f + 1 + n) + 1 + 4
    if k:
        per += 4 + 8 * k
    if ref_logits:
        per += 2 * V
    return T * per + 4
