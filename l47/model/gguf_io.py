"""Tolerant GGUF access: our own header / metadata / tensor-table parser, a memory-mapped data section, and a
writer that mirrors it.

Why our own: `gguf` 0.19's `GGUFReader` raises on tensor type ids it does not know, and Strata's real file
stores the routed experts in a custom 2-bit type. Here an unknown type only makes that tensor's `raw()` refuse;
the file still opens, and every tensor the toolkit needs can be read (DESIGN §1, §8).

Notation for tensor shapes:
    ne      GGUF dims as stored in the file, fastest-varying first (ne[0] = row length)
    shape   LOGICAL numpy/torch order = reversed(ne): `[rows, cols]` for a matrix, `[E, rows, cols]` for a stack
    rows    prod(shape[:-1]); cols = shape[-1] = ne[0]
    bs, ts  a ggml type's block size (weights per block) and type size (bytes per block)

This module is the ONE place where `ne` is flipped into `shape` (and back, when writing).

File layout (GGUF v2/v3, little-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv × (str key, u32 vtype, value)
    | n_tensors × (str name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset) | pad to alignment
    | data section: each tensor at data_offset + offset, offsets multiples of the alignment
    str = u64 length + utf-8 bytes; array value = u32 item type + u64 count + items.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from l47.errors import L47Error
from l47.fileio import atomic_open, sha256_file
from l47.model.names import DEFAULT_ALIGNMENT, KEY_ALIGNMENT, KEY_ARCH
from l47.model.quants import dequantize

GGUF_MAGIC = b"GGUF"
GGUF_WRITE_VERSION = 3
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths; nothing in this project produces it
GGML_MAX_DIMS = 4
_CHUNK = 1 << 24  # 16 MiB: streaming copy / hash / compare granularity

# scalar value types: struct format (little-endian) and numpy dtype for array fast paths
_SCALAR_FMT: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_SCALAR_NP: dict[int, np.dtype] = {t: np.dtype(f) for t, f in _SCALAR_FMT.items()}
_STR_ERRORS = "surrogateescape"  # bytes that are not UTF-8 survive a read → write round trip unchanged


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    type_name: str  # "Q8_0", ... or f"unknown({id})"
    shape: tuple[int, ...]  # LOGICAL order = reversed GGUF ne
    offset: int  # absolute byte offset in the file
    nbytes: int | None  # None when the type is unknown (then raw() refuses)


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown({ggml_type})"


def _block(ggml_type: int) -> tuple[int, int] | None:
    """(block size, type size) of a known ggml type, else None."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None


def _expected_nbytes(ggml_type: int, shape: tuple[int, ...], where: str, field: str) -> int | None:
    """Bytes of a tensor of this type and LOGICAL shape; None for unknown types; L47Error on a bad row length."""
    bt = _block(ggml_type)
    if bt is None:
        return None
    bs, ts = bt
    cols = shape[-1] if shape else 1
    if cols % bs:
        raise L47Error(where, field, f"row length a multiple of {bs} for {type_name(ggml_type)}", f"{cols}")
    return math.prod(shape) // bs * ts


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# --- reading --------------------------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; `field` names what is being read, for errors."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path, self.field = buf, 0, path, "header"

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise L47Error(self.path, self.field, f"{n} more bytes at offset {self.pos} (truncated file?)",
                           f"end of file at {len(self.buf)}")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = str(self.buf[self.pos:self.pos + n], "utf-8", _STR_ERRORS)
        self.pos += n
        return s

    def value(self, vtype: int) -> tuple[Any, int | None]:
        """One metadata value → (python object, array item type or None)."""
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype]), None
        if vtype == GGUFValueType.STRING:
            return self.string(), None
        if vtype == GGUFValueType.ARRAY:
            itype = self.unpack("<I")
            count = self.unpack("<Q")
            if itype in _SCALAR_NP:  # fast path: numbers as one numpy view → list
                dt = _SCALAR_NP[itype]
                self.need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist(), itype
            if itype == GGUFValueType.STRING:
                return [self.string() for _ in range(count)], itype
            if itype == GGUFValueType.ARRAY:  # nested arrays: items are (list); their own item types are lost
                return [self.value(itype)[0] for _ in range(count)], itype
            raise L47Error(self.path, self.field, "a GGUF array item type (0..12)", f"{itype}")
        raise L47Error(self.path, self.field, "a GGUF value type (0..12)", f"{vtype}")


class GGUFFile:
    """An opened GGUF file: metadata as python objects, the tensor table, and a read-only memmap of the bytes.

    Open once (`open_gguf`) and keep it: the memmap costs nothing until tensors are touched.
    """

    def __init__(self, path: Path, version: int, alignment: int, data_offset: int, kv: dict[str, object],
                 kv_types: dict[str, int], kv_item_types: dict[str, int], tensors: dict[str, TensorInfo],
                 mm: np.memmap, kv_spans: dict[str, tuple[int, int]], table_span: tuple[int, int],
                 extents: dict[str, int]):
        """Filled by `open_gguf` only. Many parameters because there is one per parsed section of the file."""
        self.path, self.version, self.alignment, self.data_offset = path, version, alignment, data_offset
        self.kv, self.kv_types, self.kv_item_types, self.tensors = kv, kv_types, kv_item_types, tensors
        self._mm = mm
        self._kv_spans = kv_spans  # key → (start, end) of its encoded entry (key string included)
        self._table_span = table_span  # (start, end) of the encoded tensor table
        self._extents = extents  # name → bytes from its offset to the next tensor (or EOF): unknown types' span
        self._sha: tuple[tuple[int, int], str] | None = None

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.kv)} kv, {len(self.tensors)} tensors)"

    @property
    def size(self) -> int:
        return len(self._mm)

    def info(self, name: str) -> TensorInfo:
        ti = self.tensors.get(name)
        if ti is None:
            raise L47Error(self.path, f"tensor {name}", "present", "missing")
        return ti

    def raw(self, name: str) -> np.ndarray:
        """uint8 memmap view of the tensor's bytes: [rows, row_nbytes] (1-D tensors: [nbytes]). Zero-copy."""
        ti = self.info(name)
        if ti.nbytes is None:
            raise L47Error(self.path, f"tensor {name}", "a ggml type this toolkit can read",
                           f"type {ti.type_name} (id {ti.ggml_type})")
        view = self._mm[ti.offset:ti.offset + ti.nbytes]  # [nbytes]
        if len(ti.shape) <= 1:
            return view
        rows = math.prod(ti.shape[:-1])
        return view.reshape(rows, ti.nbytes // rows)  # [rows, row_nbytes]

    def tensor(self, name: str, device=None):
        """The tensor as f32 torch, LOGICAL shape, through the project's dequantizers (l47.model.quants)."""
        ti = self.info(name)
        return dequantize(self.raw(name), ti.ggml_type, ti.shape, name=name, device=device)

    def arch(self) -> str:
        a = self.get(KEY_ARCH)
        if not isinstance(a, str):
            raise L47Error(self.path, f"metadata {KEY_ARCH}", "a string", f"{type(a).__name__} {a!r}")
        return a

    _MISSING = object()

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.kv:
            return self.kv[key]
        if default is GGUFFile._MISSING:
            raise L47Error(self.path, f"metadata {key}", "present", "missing")
        return default

    def sha256(self) -> str:
        """sha256 of the whole file, streamed; cached while the file's size and mtime are unchanged."""
        st = os.stat(self.path)
        stamp = (os.path.realpath(self.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._sha is None or self._sha[0] != stamp:
            if stamp not in _SHA_CACHE:  # one hash per file and process, whoever opens it (a 70 GB model: minutes)
                _SHA_CACHE[stamp] = sha256_file(self.path)
            self._sha = (stamp, _SHA_CACHE[stamp])
        return self._sha[1]

    def _span(self, name: str) -> tuple[int, int]:
        """(absolute start, length) of a tensor's bytes; for unknown types, up to the next tensor (padding too)."""
        ti = self.info(name)
        return ti.offset, (ti.nbytes if ti.nbytes is not None else self._extents[name])


_SHA_CACHE: dict[tuple, str] = {}  # (realpath, dev, inode, size, mtime_ns) -> sha256 of the file


def open_gguf(path) -> GGUFFile:
    """Parse a GGUF's header, metadata and tensor table; memory-map the file. Tolerates unknown tensor types.
    The steps follow the file's layout: header, metadata, tensor table, tensor data placement."""
    path = Path(path)
    if not path.is_file():
        raise L47Error(path, "file", "an existing GGUF file", "missing")
    size = path.stat().st_size
    if size < 4:
        raise L47Error(path, "magic", "b'GGUF' (not a GGUF file?)", f"a {size}-byte file")
    mm = np.memmap(path, dtype=np.uint8, mode="r")  # [size]
    buf = memoryview(mm)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise L47Error(path, "magic", "b'GGUF' (not a GGUF file?)", repr(bytes(buf[:4])))
    cur = _Cursor(buf, path)
    version, n_tensors, n_kv = _read_header(cur)
    kv, kv_types, kv_item_types, kv_spans = _read_metadata(cur, n_kv)
    alignment = kv.get(KEY_ALIGNMENT, DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise L47Error(path, f"metadata {KEY_ALIGNMENT}", "a power of two", repr(alignment))
    table_start = cur.pos
    raw_table = _read_tensor_table(cur, n_tensors)
    table_end = cur.pos
    data_offset = _align(table_end, alignment)
    tensors, extents = _place_tensors(path, raw_table, data_offset, alignment, size)
    return GGUFFile(path, version, alignment, data_offset, kv, kv_types, kv_item_types, tensors, mm, kv_spans,
                    (table_start, table_end), extents)


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    """version, tensor count, metadata count (after the 4-byte magic)."""
    cur.pos = 4
    cur.field = "version"
    version = cur.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise L47Error(cur.path, "version", f"one of {SUPPORTED_VERSIONS}", f"{version}{hint}")
    cur.field = "tensor count"
    n_tensors = cur.unpack("<Q")
    cur.field = "kv count"
    n_kv = cur.unpack("<Q")
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int):
    """key -> value, value type, array item type, and the byte span of each encoded entry."""
    kv: dict[str, object] = {}
    kv_types: dict[str, int] = {}
    kv_item_types: dict[str, int] = {}
    kv_spans: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        start = cur.pos
        cur.field = f"metadata entry {i} key"
        k = cur.string()
        cur.field = f"metadata {k}"
        if k in kv:
            raise L47Error(cur.path, cur.field, "unique metadata keys", "a duplicate")
        vtype = cur.unpack("<I")
        v, itype = cur.value(vtype)
        kv[k], kv_types[k] = v, vtype
        if itype is not None:
            kv_item_types[k] = itype
        kv_spans[k] = (start, cur.pos)
    return kv, kv_types, kv_item_types, kv_spans


def _read_tensor_table(cur: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, ne as stored — fastest dimension first, ggml type, offset relative to the data section)."""
    raw_table: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(n_tensors):
        cur.field = f"tensor table entry {i}"
        name = cur.string()
        cur.field = f"tensor {name} (table entry {i})"
        n_dims = cur.unpack("<I")
        if n_dims > GGML_MAX_DIMS:
            raise L47Error(cur.path, cur.field, f"at most {GGML_MAX_DIMS} dims", f"{n_dims}")
        ne = tuple(cur.unpack("<Q") for _ in range(n_dims))
        if 0 in ne:  # ggml has no empty dimension (every ne >= 1)
            raise L47Error(cur.path, cur.field, "dimensions >= 1", f"ne {ne}")
        gtype = cur.unpack("<I")
        rel = cur.unpack("<Q")
        raw_table.append((name, ne, gtype, rel))
    return raw_table


def _place_tensors(path: Path, raw_table, data_offset: int, alignment: int, size: int):
    """TensorInfo per name (LOGICAL shape, absolute offset, byte size) and each tensor's extent (bytes up to the
    next tensor's start or EOF: the span unknown types are compared by); overlaps and truncation refused."""
    tensors: dict[str, TensorInfo] = {}
    for name, ne, gtype, rel in raw_table:
        field = f"tensor {name}"
        if name in tensors:
            raise L47Error(path, field, "unique tensor names", "a duplicate")
        if rel % alignment:
            raise L47Error(path, f"{field} offset", f"a multiple of the alignment {alignment}", f"{rel}")
        shape = tuple(reversed(ne))  # the flip: GGUF ne (fastest first) → LOGICAL [rows, cols]
        nbytes = _expected_nbytes(gtype, shape, path, field)
        start = data_offset + rel
        end = start + (nbytes or 0)
        if end > size:
            raise L47Error(path, f"{field} data", f"bytes [{start}, {end}) inside the file (truncated?)",
                           f"file ends at {size}")
        tensors[name] = TensorInfo(name, gtype, type_name(gtype), shape, start, nbytes)
    order = sorted(tensors.values(), key=lambda t: t.offset)
    extents = {t.name: (order[i + 1].offset if i + 1 < len(order) else size) - t.offset for i, t in enumerate(order)}
    for t in order:
        if t.nbytes is not None and t.nbytes > extents[t.name]:
            raise L47Error(path, f"tensor {t.name} data", "tensor data ranges that do not overlap",
                           f"{t.nbytes} bytes but the next tensor starts {extents[t.name]} bytes later")
    return tensors, extents


def tensors_equal_bytes(a: GGUFFile, b: GGUFFile, name: str) -> bool:
    """Same type, same shape and the same bytes in both files. Unknown types compare their whole extent
    (data + padding up to the next tensor): conservative, never "equal" when the data differ."""
    ta, tb = a.info(name), b.info(name)
    if ta.ggml_type != tb.ggml_type or ta.shape != tb.shape:
        return False
    (sa, na), (sb, nb) = a._span(name), b._span(name)
    if na != nb:
        return False
    for off in range(0, na, _CHUNK):
        m = min(_CHUNK, na - off)
        if not np.array_equal(a._mm[sa + off:sa + off + m], b._mm[sb + off:sb + off + m]):
            return False
    return True


# --- writing --------------------------------------------------------------------------------------------


def _infer_vtype(v: Any, where: str, field: str) -> tuple[int, int | None]:
    """GGUF value type (and array item type) for a python value, gguf-py's conventions: int → INT32 (INT64 when
    it does not fit, UINT64 above int64), float → FLOAT32, numpy scalars keep their dtype."""
    if isinstance(v, np.generic):
        for t, dt in _SCALAR_NP.items():
            if v.dtype == dt:
                return t, None
        raise L47Error(where, field, "a value GGUF can store", f"numpy {v.dtype}")
    if isinstance(v, (str, bytes, bytearray)):
        return GGUFValueType.STRING, None
    if isinstance(v, bool):
        return GGUFValueType.BOOL, None
    if isinstance(v, int):
        if -(1 << 31) <= v < (1 << 31):
            return GGUFValueType.INT32, None
        return (GGUFValueType.INT64, None) if -(1 << 63) <= v < (1 << 63) else (GGUFValueType.UINT64, None)
    if isinstance(v, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, (list, tuple)):
        if not v:
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        itypes = {_infer_vtype(x, where, field)[0] for x in v}
        if itypes <= {GGUFValueType.INT32, GGUFValueType.INT64, GGUFValueType.UINT64}:
            itypes = {max(itypes)}  # one int type wide enough for every item
        if len(itypes) != 1:
            raise L47Error(where, field, "an array with items of one type", f"types {sorted(itypes)}")
        return GGUFValueType.ARRAY, itypes.pop()
    raise L47Error(where, field, "str, int, float, bool or a list of them", type(v).__name__)


def _encode_str(s: str | bytes) -> bytes:
    b = s if isinstance(s, (bytes, bytearray)) else s.encode("utf-8", _STR_ERRORS)
    return struct.pack("<Q", len(b)) + bytes(b)


def _encode_value(vtype: int, v: Any, itype: int | None, where: str, field: str) -> bytes:
    """The value part of a metadata entry (after the u32 type)."""
    try:
        if vtype in _SCALAR_FMT:
            return struct.pack(_SCALAR_FMT[vtype], v)
        if vtype == GGUFValueType.STRING:
            return _encode_str(v)
        if vtype == GGUFValueType.ARRAY:
            if itype is None:
                itype = _infer_vtype(v, where, field)[1]
            head = struct.pack("<IQ", itype, len(v))
            if itype in _SCALAR_NP:
                return head + np.asarray(v, dtype=_SCALAR_NP[itype]).tobytes()  # numpy checks the range
            if itype == GGUFValueType.STRING:
                return head + b"".join(_encode_str(s) for s in v)
            if itype == GGUFValueType.ARRAY:
                return head + b"".join(_encode_value(GGUFValueType.ARRAY, x, None, where, field) for x in v)
    except (struct.error, OverflowError, TypeError, ValueError) as e:
        raise L47Error(where, field, f"a value storable as GGUF type {vtype}", f"{v!r:.80} ({e})") from None
    raise L47Error(where, field, "a GGUF value type (0..12)", f"{vtype}")


def _encode_kv(key: str, v: Any, vtype: int | None, itype: int | None, where: str) -> bytes:
    field = f"metadata {key}"
    if vtype is None:
        vtype, inferred = _infer_vtype(v, where, field)
        itype = itype if itype is not None else inferred
    return _encode_str(key) + struct.pack("<I", vtype) + _encode_value(vtype, v, itype, where, field)


def _as_bytes(x: Any) -> memoryview:
    """Raw bytes of an ndarray / torch tensor / bytes-like, as a flat uint8 memoryview (no copy when possible)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().contiguous()
        if str(x.dtype) == "torch.bfloat16":
            import torch

            x = x.view(torch.int16)
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    return memoryview(x).cast("B")


def _pad(f, pos: int, alignment: int) -> int:
    n = _align(pos, alignment) - pos
    if n:
        f.write(b"\0" * n)
    return pos + n


TensorData = Any  # np.ndarray | bytes | torch.Tensor | Iterable of those (streamed, known types only)


def write_gguf(path, kv: dict, kv_types: dict | None, tensors: list[tuple[str, int, tuple[int, ...], TensorData]],
               alignment: int = DEFAULT_ALIGNMENT, *, kv_item_types: dict | None = None) -> Path:
    """Write a GGUF v3 file atomically (temp file + os.replace).

    kv:         metadata in order; kv_types / kv_item_types give the GGUF value type (and array item type) of a
                key, else it is inferred (int → INT32, float → FLOAT32, like gguf-py).
    tensors:    (name, ggml type id, LOGICAL shape, raw bytes) in file order. Types gguf does not know (e.g. 200)
                are written as given. For known types the bytes may also be an iterable of chunks (streamed
                one at a time, total size checked) so huge tensors never need to be in memory at once.
    alignment:  data alignment; written as `general.alignment` when not the default.
    """
    path = Path(path)
    where = str(path)
    kv_types, kv_item_types = dict(kv_types or {}), dict(kv_item_types or {})
    if alignment <= 0 or alignment & (alignment - 1):
        raise L47Error(where, "alignment", "a power of two", f"{alignment}")
    kv = dict(kv)
    if KEY_ALIGNMENT in kv:
        if kv[KEY_ALIGNMENT] != alignment:
            raise L47Error(where, f"metadata {KEY_ALIGNMENT}", f"{alignment} (the alignment written)",
                           f"{kv[KEY_ALIGNMENT]!r}")
    elif alignment != DEFAULT_ALIGNMENT:
        kv[KEY_ALIGNMENT] = alignment
        kv_types[KEY_ALIGNMENT] = GGUFValueType.UINT32
    kv_blobs = [_encode_kv(k, v, kv_types.get(k), kv_item_types.get(k), where) for k, v in kv.items()]

    # tensor table: sizes must be known before any data is written
    entries: list[tuple[str, int, tuple[int, ...], int, Any]] = []  # name, type, shape, nbytes, data
    seen: set[str] = set()
    for name, gtype, shape, data in tensors:
        field = f"tensor {name}"
        if name in seen:
            raise L47Error(where, field, "unique tensor names", "a duplicate")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        if len(shape) > GGML_MAX_DIMS:
            raise L47Error(where, field, f"at most {GGML_MAX_DIMS} dims", f"shape {shape}")
        nbytes = _expected_nbytes(gtype, shape, where, field)
        is_chunks = not (isinstance(data, (np.ndarray, bytes, bytearray, memoryview)) or hasattr(data, "detach"))
        if is_chunks:
            if nbytes is None:
                raise L47Error(where, field, "an array (streamed chunks need a known type to size the table)",
                               f"chunks of type {type_name(gtype)}")
        else:
            data = _as_bytes(data)
            if nbytes is None:
                nbytes = data.nbytes
            elif data.nbytes != nbytes:
                raise L47Error(where, field, f"{nbytes} bytes for {type_name(gtype)} {shape}", f"{data.nbytes}")
        entries.append((name, gtype, shape, nbytes, data))

    table, rel = [], 0
    for name, gtype, shape, nbytes, _ in entries:
        ne = tuple(reversed(shape))  # the flip back: LOGICAL shape → GGUF ne
        table.append(_encode_str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, gtype, rel))
        rel = _align(rel + nbytes, alignment)
    header = struct.pack("<4sIQQ", GGUF_MAGIC, GGUF_WRITE_VERSION, len(entries), len(kv_blobs))

    with atomic_open(path, "wb", fsync=True) as f:
        pos = f.write(header + b"".join(kv_blobs) + b"".join(table))
        pos = _pad(f, pos, alignment)
        for name, gtype, shape, nbytes, data in entries:
            if isinstance(data, memoryview):
                pos += f.write(data)
            else:
                written = 0
                for chunk in data:  # streamed: one chunk in memory at a time
                    written += f.write(_as_bytes(chunk))
                if written != nbytes:
                    raise L47Error(where, f"tensor {name}", f"{nbytes} bytes for {type_name(gtype)} {shape}",
                                   f"{written} streamed")
                pos += written
            pos = _pad(f, pos, alignment)
    return path


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def copy_with_tensor_replaced(base, out, replacements: dict[str, Any], extra_kv: dict | None = None, *,
                              extra_kv_types: dict | None = None) -> Path:
    """Bundle writing: `out` = `base` with the named tensors' bytes replaced (same byte size each).

    Without extra_kv the file is copied byte for byte and only those byte ranges are overwritten. With extra_kv
    the metadata is rewritten (keys overwritten in place, new keys appended; untouched entries keep their exact
    bytes) and the tensor table and the whole data section are copied unchanged after it, so every tensor keeps
    its relative offset and alignment. A key already in base keeps base's value type unless extra_kv_types says
    otherwise. Atomic; refuses out == base (same path or same inode).
    """
    g = base if isinstance(base, GGUFFile) else open_gguf(base)
    out = Path(out)
    if _same_file(out, g.path):
        raise L47Error(out, "output path", "a file other than the base GGUF", f"the base itself ({g.path})")
    patches: list[tuple[int, memoryview]] = []  # (offset relative to the data section, bytes)
    for name, data in replacements.items():
        ti = g.info(name)
        if ti.nbytes is None:
            raise L47Error(g.path, f"tensor {name}", "a ggml type with a known size to replace",
                           f"type {ti.type_name}")
        b = _as_bytes(data)
        if b.nbytes != ti.nbytes:
            raise L47Error(out, f"tensor {name}", f"{ti.nbytes} replacement bytes ({ti.type_name} {ti.shape})",
                           f"{b.nbytes}")
        patches.append((ti.offset - g.data_offset, b))

    src = memoryview(g._mm)
    with atomic_open(out, "wb", fsync=True) as f:
        if extra_kv:
            if KEY_ALIGNMENT in extra_kv and extra_kv[KEY_ALIGNMENT] != g.alignment:
                raise L47Error(out, f"metadata {KEY_ALIGNMENT}", f"{g.alignment} (the base's; data is copied as is)",
                               f"{extra_kv[KEY_ALIGNMENT]!r}")
            types = dict(extra_kv_types or {})
            blobs = []
            for k in g.kv:
                if k in extra_kv:
                    blobs.append(_encode_kv(k, extra_kv[k], types.get(k, g.kv_types[k]), g.kv_item_types.get(k),
                                            str(out)))
                else:
                    s, e = g._kv_spans[k]
                    blobs.append(bytes(src[s:e]))
            blobs += [_encode_kv(k, v, types.get(k), None, str(out)) for k, v in extra_kv.items() if k not in g.kv]
            ts, te = g._table_span
            pos = f.write(struct.pack("<4sIQQ", GGUF_MAGIC, g.version, len(g.tensors), len(blobs)))
            pos += f.write(b"".join(blobs))
            pos += f.write(src[ts:te])
            data_offset = _pad(f, pos, g.alignment)
            for off in range(g.data_offset, g.size, _CHUNK):  # the data section, verbatim
                f.write(src[off:min(off + _CHUNK, g.size)])
        else:
            with open(g.path, "rb") as s:
                shutil.copyfileobj(s, f, _CHUNK)
            data_offset = g.data_offset
        for rel, b in patches:
            f.seek(data_offset + rel)
            f.write(b)
    return out
