"""l47.model.gguf_io against the independent reference: gguf-py's GGUFWriter / GGUFReader (0.19) and gguf.quants.

Byte comparisons are exact (a reader either finds the same bytes or it is wrong); dequantized values are
compared with gguf.quants at tolerance 0 for F32/F16/BF16/Q8_0 (the same f32 arithmetic: scale × int8 code).
"""

from __future__ import annotations

import hashlib
import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

from l47.errors import L47Error
from l47.model.gguf_io import (
    GGUF_MAGIC,
    TensorInfo,
    copy_with_tensor_replaced,
    open_gguf,
    tensors_equal_bytes,
    write_gguf,
)

RNG = np.random.default_rng(1234)
X = RNG.standard_normal((8, 64)).astype(np.float32)  # [rows, cols]
X3 = RNG.standard_normal((2, 4, 32)).astype(np.float32)  # [E, rows, cols]
V1 = RNG.standard_normal(96).astype(np.float32)  # [cols]

KV_ADDERS = [  # (key, GGUFWriter method, value, value type, item type)
    ("t.u8", "add_uint8", 200, VT.UINT8, None),
    ("t.i8", "add_int8", -100, VT.INT8, None),
    ("t.u16", "add_uint16", 60000, VT.UINT16, None),
    ("t.i16", "add_int16", -30000, VT.INT16, None),
    ("t.u32", "add_uint32", 4_000_000_000, VT.UINT32, None),
    ("t.i32", "add_int32", -2_000_000_000, VT.INT32, None),
    ("t.u64", "add_uint64", 2**60, VT.UINT64, None),
    ("t.i64", "add_int64", -(2**60), VT.INT64, None),
    ("t.f32", "add_float32", 1e-6, VT.FLOAT32, None),
    ("t.f64", "add_float64", 1e-300, VT.FLOAT64, None),
    ("t.bool", "add_bool", True, VT.BOOL, None),
    ("t.str", "add_string", "héllo ✓", VT.STRING, None),
    ("t.arr_i", "add_array", [1, -2, 3], VT.ARRAY, VT.INT32),
    ("t.arr_f", "add_array", [0.5, -1.25], VT.ARRAY, VT.FLOAT32),
    ("t.arr_s", "add_array", ["a", "", "ĠThe"], VT.ARRAY, VT.STRING),
]


def _gguf_writer_file(path, alignment=None, tensors=None):
    """A file written by gguf-py itself: the independent producer."""
    w = gguf.GGUFWriter(str(path), "qwen4exp")
    if alignment:
        w.add_custom_alignment(alignment)
    for key, method, value, _, _ in KV_ADDERS:
        getattr(w, method)(key, value)
    tensors = tensors if tensors is not None else [
        ("a.f32", X, None),
        ("b.f16", X.astype(np.float16), None),
        ("c.q8_0", gguf.quants.quantize(X, Q.Q8_0), Q.Q8_0),
        ("d.bf16", gguf.quants.quantize(X, Q.BF16), Q.BF16),
        ("e.vec", V1, None),
        ("f.stack", X3, None),
    ]
    for name, arr, raw_dtype in tensors:
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reader_kv(r: gguf.GGUFReader):
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


@pytest.fixture
def ref_file(tmp_path):
    return _gguf_writer_file(tmp_path / "ref.gguf")


@pytest.mark.parametrize("alignment", [None, 64])
def test_reads_gguf_writer_file_like_gguf_reader(tmp_path, alignment):
    path = _gguf_writer_file(tmp_path / "ref.gguf", alignment)
    g, r = open_gguf(path), gguf.GGUFReader(path)
    assert g.version == 3 and g.alignment == (alignment or 32) and g.data_offset == r.data_offset
    # every metadata value and type
    assert g.kv == _reader_kv(r)  # exact: both decode the same f32/f64 bits
    assert list(g.kv) == list(_reader_kv(r))  # order kept
    for k, f in r.fields.items():
        if not k.startswith("GGUF."):
            assert g.kv_types[k] == f.types[0], k
            if f.types[0] == VT.ARRAY:
                assert g.kv_item_types[k] == f.types[-1], k
    for key, _, value, vtype, _ in KV_ADDERS:
        assert g.kv_types[key] == vtype
        if vtype not in (VT.FLOAT32, VT.ARRAY):
            assert g.kv[key] == value and type(g.kv[key]) is type(value)
    # every tensor: order, type, logical shape (= reversed ne), offset, bytes
    assert list(g.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        ti = g.info(t.name)
        assert ti.ggml_type == int(t.tensor_type) and ti.type_name == t.tensor_type.name
        assert ti.shape == tuple(reversed(t.shape.tolist()))
        assert ti.offset == t.data_offset and ti.nbytes == t.n_bytes
        raw = g.raw(t.name)
        assert raw.dtype == np.uint8 and isinstance(raw, np.memmap)
        assert np.array_equal(np.asarray(raw).reshape(-1), t.data.view(np.uint8).reshape(-1))
    assert g.raw("c.q8_0").shape == (8, 68)  # [rows, row_nbytes]: 2 blocks of 34 bytes
    assert g.raw("f.stack").shape == (8, 128)  # [E·rows, cols·4]
    assert g.raw("e.vec").shape == (96 * 4,)  # 1-D: [nbytes]
    assert g.info("f.stack").shape == (2, 4, 32)
    assert g.arch() == "qwen4exp"


def test_unknown_type_tolerated_and_refused_only_on_raw(tmp_path):
    path = tmp_path / "unk.gguf"
    blob = np.arange(300, dtype=np.uint8)
    write_gguf(path, {"general.architecture": "qwen4exp"}, None, [
        ("a.q8", int(Q.Q8_0), (8, 64), gguf.quants.quantize(X, Q.Q8_0)),
        ("blk.0.ffn_down_exps.weight", 200, (4, 16, 32), blob),
        ("z.f32", int(Q.F32), (8, 64), X),
    ])
    with pytest.raises(ValueError):  # why this module exists: gguf 0.19 refuses the whole file
        gguf.GGUFReader(path)
    g = open_gguf(path)
    ti = g.info("blk.0.ffn_down_exps.weight")
    assert ti.type_name == "unknown(200)" and ti.nbytes is None and ti.shape == (4, 16, 32)
    with pytest.raises(L47Error) as e:
        g.raw("blk.0.ffn_down_exps.weight")
    assert "blk.0.ffn_down_exps.weight" in str(e.value) and "unknown(200)" in str(e.value)
    assert str(path) in str(e.value)
    # neighbours read fine, and the unknown tensor's bytes are where the writer put them
    assert np.array_equal(np.asarray(g.raw("z.f32")).view(np.float32).reshape(8, 64), X)
    assert bytes(g._mm[ti.offset:ti.offset + 300]) == blob.tobytes()


def test_not_a_gguf_truncated_missing(tmp_path, ref_file):
    txt = tmp_path / "notes.txt"
    txt.write_text("hello world, not a model\n")
    for p in (txt, tmp_path / "empty.gguf"):
        p.touch()
        with pytest.raises(L47Error) as e:
            open_gguf(p)
        assert e.value.field == "magic" and str(p) in str(e.value)
    with pytest.raises(L47Error, match="missing"):
        open_gguf(tmp_path / "nope.gguf")

    data = ref_file.read_bytes()
    g = open_gguf(ref_file)
    cases = {  # cut point → expected field substring
        10: "tensor count",  # inside the counts
        60: "metadata",  # inside the kv section
        g._table_span[0] + 5: "tensor table",
        len(data) - 1: "tensor f.stack data",  # the last tensor's bytes run past EOF
    }
    for cut, field in cases.items():
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(L47Error) as e:
            open_gguf(p)
        assert field in e.value.field and str(p) in str(e.value), (cut, e.value)

    for version in (1, 4, 3 << 24):  # v1, a future version, a byte-swapped v3
        p = tmp_path / f"v{version}.gguf"
        p.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        with pytest.raises(L47Error) as e:
            open_gguf(p)
        assert e.value.field == "version" and str(version) in str(e.value)

    with pytest.raises(L47Error) as e:
        g.info("output.weight")
    assert (e.value.field, e.value.expected, e.value.found) == ("tensor output.weight", "present", "missing")
    with pytest.raises(L47Error):
        g.raw("output.weight")
    with pytest.raises(L47Error) as e:
        g.get("qwen4exp.block_count")
    assert "qwen4exp.block_count" in str(e.value) and str(ref_file) in str(e.value)
    assert g.get("qwen4exp.block_count", None) is None and g.get("t.u8") == 200


def test_write_read_round_trip_and_gguf_reader_agrees(tmp_path):
    kv = {"general.architecture": "qwen4exp", "x.count": 48, "x.big": 2**40, "x.eps": 1e-6, "x.flag": False,
          "x.name": "synth ✓", "x.ids": [1, 2, 3], "x.names": ["<|im_end|>", "Ġthan"], "x.u8": 7,
          "x.empty": []}
    kv_types = {"x.count": VT.UINT32, "x.u8": VT.UINT8}
    tensors = [
        ("t.f32", int(Q.F32), (8, 64), X),
        ("t.f16", int(Q.F16), (8, 64), X.astype(np.float16)),
        ("t.q8", int(Q.Q8_0), (8, 64), gguf.quants.quantize(X, Q.Q8_0)),
        ("t.bf16", int(Q.BF16), (8, 64), gguf.quants.quantize(X, Q.BF16)),
        ("t.vec", int(Q.F32), (96,), V1),
        ("t.stack", int(Q.F32), (2, 4, 32), X3),
    ]
    path = write_gguf(tmp_path / "rt.gguf", kv, kv_types, tensors, alignment=64)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode == plain.stat().st_mode  # not mkstemp's 0600
    g = open_gguf(path)
    assert g.alignment == 64 and g.kv["general.alignment"] == 64
    assert g.kv_types["x.count"] == VT.UINT32 and g.kv_types["x.u8"] == VT.UINT8
    assert g.kv_types["x.big"] == VT.INT64 and g.kv_types["x.eps"] == VT.FLOAT32
    assert g.kv_item_types["x.names"] == VT.STRING
    assert g.kv["x.eps"] == pytest.approx(1e-6, rel=1e-7)  # stored as FLOAT32
    assert {k: v for k, v in g.kv.items() if k not in ("x.eps", "general.alignment")} == \
        {k: v for k, v in kv.items() if k != "x.eps"}
    assert list(g.tensors) == [t[0] for t in tensors]
    for name, gtype, shape, arr in tensors:
        ti = g.info(name)
        assert (ti.ggml_type, ti.shape) == (gtype, shape)
        assert np.asarray(g.raw(name)).tobytes() == np.ascontiguousarray(arr).tobytes()
    # the independent reader agrees on the same file
    r = gguf.GGUFReader(path)
    assert r.alignment == 64 and r.data_offset == g.data_offset
    rkv = _reader_kv(r)
    assert rkv.keys() == g.kv.keys()
    assert rkv == g.kv
    for t in r.tensors:
        assert tuple(reversed(t.shape.tolist())) == g.info(t.name).shape
        assert t.data.tobytes() == np.asarray(g.raw(t.name)).tobytes()
    np.testing.assert_array_equal(
        gguf.quants.dequantize(r.tensors[2].data, Q.Q8_0), gguf.quants.dequantize(gguf.quants.quantize(X, Q.Q8_0),
                                                                                 Q.Q8_0))


def test_rewrite_of_gguf_writer_file_is_byte_identical(tmp_path, ref_file):
    """Our writer, fed what our reader found, reproduces gguf-py's file bit for bit (faithful kv types)."""
    g = open_gguf(ref_file)
    tensors = [(t.name, t.ggml_type, t.shape, np.asarray(g.raw(t.name))) for t in g.tensors.values()]
    out = write_gguf(tmp_path / "re.gguf", g.kv, g.kv_types, tensors, g.alignment, kv_item_types=g.kv_item_types)
    assert out.read_bytes() == ref_file.read_bytes()


def test_write_streamed_chunks_and_refusals(tmp_path):
    q8 = gguf.quants.quantize(X, Q.Q8_0)  # [8, 68]
    whole = write_gguf(tmp_path / "a.gguf", {}, None, [("w", int(Q.Q8_0), (8, 64), q8)])
    chunks = write_gguf(tmp_path / "b.gguf", {}, None, [("w", int(Q.Q8_0), (8, 64), (q8[i:i + 3] for i in (0, 3, 6)))])
    assert whole.read_bytes() == chunks.read_bytes()

    bad = tmp_path / "bad.gguf"
    with pytest.raises(L47Error, match="streamed"):
        write_gguf(bad, {}, None, [("w", int(Q.Q8_0), (8, 64), (q8[i:i + 3] for i in (0, 3)))])
    with pytest.raises(L47Error, match="tensor w"):
        write_gguf(bad, {}, None, [("w", int(Q.Q8_0), (8, 64), q8[:7])])
    with pytest.raises(L47Error, match="multiple of 32"):
        write_gguf(bad, {}, None, [("w", int(Q.Q8_0), (8, 48), q8)])
    with pytest.raises(L47Error, match="duplicate"):
        write_gguf(bad, {}, None, [("w", int(Q.F32), (8, 64), X), ("w", int(Q.F32), (8, 64), X)])
    with pytest.raises(L47Error, match="general.alignment"):
        write_gguf(bad, {"general.alignment": 64}, None, [], alignment=32)
    with pytest.raises(L47Error, match="x.small"):
        write_gguf(bad, {"x.small": 300}, {"x.small": VT.UINT8}, [])
    assert not bad.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_non_utf8_string_survives(tmp_path):
    p1 = write_gguf(tmp_path / "s1.gguf", {"k": b"\xff\xfe ok", "ks": ["a", "\udcff"]}, None, [])
    g = open_gguf(p1)
    p2 = write_gguf(tmp_path / "s2.gguf", g.kv, g.kv_types, [], kv_item_types=g.kv_item_types)
    assert p1.read_bytes() == p2.read_bytes()


def test_copy_with_tensor_replaced(tmp_path, ref_file):
    base = open_gguf(ref_file)
    target = "c.q8_0"
    new = gguf.quants.quantize(X + 0.5, Q.Q8_0)
    assert new.tobytes() != np.asarray(base.raw(target)).tobytes()

    # 1) plain: byte copy + one range overwritten
    out = copy_with_tensor_replaced(ref_file, tmp_path / "bundle.gguf", {target: new})
    a, b = ref_file.read_bytes(), out.read_bytes()
    ti = base.info(target)
    diff = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    assert len(a) == len(b) and diff.size > 0
    assert ti.offset <= diff.min() and diff.max() < ti.offset + ti.nbytes
    g = open_gguf(out)
    assert np.asarray(g.raw(target)).tobytes() == new.tobytes()
    assert [n for n in base.tensors if not tensors_equal_bytes(base, g, n)] == [target]

    # 2) with extra kv: header rewritten, data section copied as is
    extra = {"l47.provenance.seed": "7", "t.u32": 5, "t.str": "changed"}
    out2 = copy_with_tensor_replaced(base, tmp_path / "bundle2.gguf", {target: new}, extra_kv=extra)
    g2 = open_gguf(out2)
    assert g2.data_offset != base.data_offset  # the header grew: a real test of relative offsets
    assert [n for n in base.tensors if not tensors_equal_bytes(base, g2, n)] == [target]
    assert np.asarray(g2.raw(target)).tobytes() == new.tobytes()
    assert list(g2.kv) == list(base.kv) + ["l47.provenance.seed"]
    assert g2.kv_types["t.u32"] == VT.UINT32 and g2.kv["t.u32"] == 5 and g2.kv["t.str"] == "changed"
    for k in base.kv:
        if k not in extra:
            assert g2.kv[k] == base.kv[k] and g2.kv_types[k] == base.kv_types[k]
    r = gguf.GGUFReader(out2)  # the independent reader accepts the rewritten file
    assert r.fields["l47.provenance.seed"].contents() == "7"
    assert r.tensors[2].data.tobytes() == new.tobytes()

    # refusals: out == base (same path, a symlink, a hard link), wrong size, unknown / missing tensor
    link, hard = tmp_path / "link.gguf", tmp_path / "hard.gguf"
    link.symlink_to(ref_file)
    os.link(ref_file, hard)
    for same in (ref_file, link, hard):
        with pytest.raises(L47Error, match="base"):
            copy_with_tensor_replaced(ref_file, same, {target: new})
    assert ref_file.read_bytes() == a
    bad = tmp_path / "bad.gguf"
    with pytest.raises(L47Error, match=target):
        copy_with_tensor_replaced(ref_file, bad, {target: new[:-1]})
    with pytest.raises(L47Error, match="missing"):
        copy_with_tensor_replaced(ref_file, bad, {"output.weight": new})
    assert not bad.exists()


def test_copy_keeps_unknown_type_tensor(tmp_path):
    blob = np.arange(100, dtype=np.uint8)
    path = write_gguf(tmp_path / "u.gguf", {"general.architecture": "qwen4exp"}, None, [
        ("exps", 200, (4, 25), blob), ("w", int(Q.F32), (8, 64), X)])
    base = open_gguf(path)
    out = open_gguf(copy_with_tensor_replaced(path, tmp_path / "o.gguf", {"w": X * 2}, extra_kv={"p": "x"}))
    assert tensors_equal_bytes(base, out, "exps") and not tensors_equal_bytes(base, out, "w")
    with pytest.raises(L47Error, match="unknown"):
        copy_with_tensor_replaced(path, tmp_path / "o2.gguf", {"exps": blob})
    other = open_gguf(write_gguf(tmp_path / "u2.gguf", {}, None, [("exps", 200, (4, 25), blob[::-1].copy()),
                                                                    ("w", int(Q.F16), (8, 64), X.astype(np.float16))]))
    assert not tensors_equal_bytes(base, other, "exps")  # same size, different bytes
    assert not tensors_equal_bytes(base, other, "w")  # different type


def test_sha256_and_repr(ref_file):
    g = open_gguf(ref_file)
    assert g.sha256() == hashlib.sha256(ref_file.read_bytes()).hexdigest()
    assert g.sha256() == g.sha256()
    assert "ref.gguf" in repr(g)
    assert isinstance(g.info("a.f32"), TensorInfo)
    assert ref_file.read_bytes()[:4] == GGUF_MAGIC


def test_tensor_dequantizes_like_gguf_quants(ref_file):
    import torch

    g = open_gguf(ref_file)
    for name, qt in (("a.f32", Q.F32), ("b.f16", Q.F16), ("c.q8_0", Q.Q8_0), ("d.bf16", Q.BF16)):
        ref = gguf.quants.dequantize(np.asarray(g.raw(name)), qt).reshape(8, 64)
        t = g.tensor(name)
        assert t.dtype == torch.float32 and tuple(t.shape) == (8, 64)
        np.testing.assert_array_equal(t.numpy(), ref)  # exact: same f32 products
    np.testing.assert_array_equal(g.tensor("f.stack").numpy(), X3)
