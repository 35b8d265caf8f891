"""The dump file format (DESIGN §3.1, dumps/README.md): round trip, interoperability with the safetensors library
(an independent parser and writer), memory mapping, the validator (every problem, all at once), atomic writes,
inject-convention normalisation and fp16 hh.

Tolerances: storage is bit-exact, so round trips are compared with np.array_equal (dtype included). The only
arithmetic is the xn_div4 → raw normalisation: stored f32 inj' = f32(W·(xn/4)) times 4 is exactly 4·inj', so it is
compared to the float64 reference W·xn at f32 rounding of an O(10) sum of 4n terms: rtol 1e-5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy as stn

from l47.dumps import (Dump, DumpError, DumpMeta, SCHEMA_VERSION, doc_hash, dump_nbytes, read_dump, validate_dump,
                       write_dump)
from l47.dumps.schema import META_KEY, _order
from l47.errors import L47Error
from l47.model.names import ROLE_ID, ROLES

# tiny dims (the README's worked example uses the same): T=3, hc=4, n=256, f=64, r=32, V=1024, k=5
T, HC, N, F, RK, V, K = 3, 4, 256, 64, 32, 1024, 5


def make_meta(**over) -> DumpMeta:
    kw = dict(
        schema_version=SCHEMA_VERSION, doc_id="doc-0", layer=2, n=N, f=F, hc=HC, r=RK, V=V, model="sha256:" + "ab" * 32,
        engine={"name": "hf", "version": "5.24.0", "settings": {"weight_policy": "exact", "path": "prompt"}},
        inj_convention="raw", hh_precision="f32",
        provenance={"assistant": "generated", "user": "written", "template": "written",
                    "generation": {"prompt": "hi", "seed": 7, "model": "tiny",
                                   "sampler": {"temperature": 0.8, "top_p": 0.95, "top_k": 40}}},
        text="Héllo — world", source={"file": "docs.jsonl", "line": 3, "sha256": "00" * 32},
    )
    kw.update(over)
    return DumpMeta(**kw)


def make_arrays(seed: int = 0, t: int = T, refs: bool = True, logits: bool = True) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    a = {
        "tokens": g.integers(0, V, t + 1).astype(np.int32),
        "R": g.standard_normal((t, HC, N)).astype(np.float32),
        "inj": (8 * g.standard_normal((t, HC))).astype(np.float32),
        "hh": g.standard_normal((t, F)).astype(np.float32),
        "sgv": g.standard_normal(t).astype(np.float32),
        "yr": g.standard_normal((t, N)).astype(np.float32),
        "role": np.array([ROLE_ID["template"], ROLE_ID["user"], ROLE_ID["assistant"]] * t, np.uint8)[:t],
    }
    if refs:
        a["ref_logp"] = -np.abs(g.standard_normal(t)).astype(np.float32)
        a["ref_top_ids"] = g.integers(0, V, (t, K)).astype(np.int32)
        a["ref_top_logits"] = g.standard_normal((t, K)).astype(np.float32)
    if logits:
        a["ref_logits"] = g.standard_normal((t, V)).astype(np.float16)
    return a


def assert_same_arrays(d: Dump, arrays: dict[str, np.ndarray]):
    assert set(d.arrays()) == set(arrays)
    for k, v in arrays.items():
        got = getattr(d, k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert np.array_equal(got, v), k


# --- round trip and interoperability --------------------------------------------------------------------


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("refs", [True, False])
def test_round_trip(tmp_path, mmap, refs):
    arrays, meta = make_arrays(refs=refs, logits=refs), make_meta()
    p = write_dump(tmp_path / "d.safetensors", arrays, meta)
    d = read_dump(p, mmap=mmap)
    assert_same_arrays(d, arrays)
    assert d.meta == meta
    assert d.T == T and np.array_equal(d.targets, arrays["tokens"][1:])
    assert d.verified is refs
    # a Dump writes back to the same bytes
    p2 = write_dump(tmp_path / "d2.safetensors", d)
    assert doc_hash(p2) == doc_hash(p)


def test_interop_with_safetensors_library(tmp_path):
    """Our files parse with safetensors' own (Rust) reader, and files its writer made read with ours."""
    arrays, meta = make_arrays(), make_meta()
    p = write_dump(tmp_path / "ours.safetensors", arrays, meta)
    theirs = stn.load_file(p)
    assert set(theirs) == set(arrays)
    for k in arrays:
        assert theirs[k].dtype == arrays[k].dtype and np.array_equal(theirs[k], arrays[k]), k
    from safetensors import safe_open
    with safe_open(p, framework="numpy") as fh:
        assert DumpMeta.from_json(fh.metadata()[META_KEY]) == meta

    q = tmp_path / "theirs.safetensors"
    stn.save_file(arrays, q, metadata={META_KEY: meta.to_json()})
    d = read_dump(q)
    assert_same_arrays(d, arrays)
    assert d.meta == meta


def test_header_layout_and_size_formula(tmp_path):
    """8-byte LE length, space-padded JSON, arrays aligned to their dtype, array bytes = dump_nbytes."""
    arrays, meta = make_arrays(), make_meta()
    p = write_dump(tmp_path / "d.safetensors", arrays, meta)
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    assert hlen % 8 == 0
    header = json.loads(raw[8:8 + hlen])
    assert json.loads(header["__metadata__"][META_KEY]) == json.loads(meta.to_json())
    for k, info in header.items():
        if k != "__metadata__":
            assert (8 + hlen + info["data_offsets"][0]) % arrays[k].dtype.itemsize == 0, k
    assert len(raw) - 8 - hlen == dump_nbytes(T, N, F, HC, V, k=K, ref_logits=True)
    # the formula term by term, from the arrays themselves
    assert dump_nbytes(T, N, F, HC, V, k=K, ref_logits=True) == sum(a.nbytes for a in arrays.values())
    assert dump_nbytes(1024, 2560, 640, 4) == 1024 * 53_785 + 4  # README: ~52.5 KiB per token at real dims
    assert _order(["role", "ref_logits", "tokens"]) == ["tokens", "ref_logits", "role"]


def test_identity_is_the_tokens_file_hash_is_provenance(tmp_path):
    """Dump.sha256 (the document's identity) = sha256 of the token ids as little-endian int32, whatever the
    metadata; Dump.file_sha256 = sha256 of the file bytes (changes with doc_id)."""
    arrays, meta = make_arrays(), make_meta()
    mem = Dump(path=None, meta=meta, **arrays)
    again = Dump(path=None, meta=make_meta(), **make_arrays())
    assert mem.sha256 == again.sha256 and mem.file_sha256 == again.file_sha256
    p = write_dump(tmp_path / "d.safetensors", mem)
    assert mem.file_sha256 == doc_hash(p) == hashlib.sha256(p.read_bytes()).hexdigest() == read_dump(p).file_sha256
    tok = hashlib.sha256(np.asarray(arrays["tokens"]).astype("<i4").tobytes()).hexdigest()
    assert mem.sha256 == read_dump(p).sha256 == tok
    changed = Dump(path=None, meta=make_meta(doc_id="doc-1"), **arrays)
    assert changed.file_sha256 != mem.file_sha256 and changed.sha256 == mem.sha256  # renamed: same document
    other = dict(arrays, tokens=np.asarray(arrays["tokens"]).copy())
    other["tokens"][0] += 1
    assert Dump(path=None, meta=meta, **other).sha256 != mem.sha256


# --- memory mapping -------------------------------------------------------------------------------------


def _root_base(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None and not isinstance(a, np.memmap):
        a = a.base
    return a


def test_mmap_read_is_a_view_of_the_file(tmp_path):
    """With mmap=True the arrays are read-only views of the mapped file: bytes changed on disk afterwards show
    through. mmap=False holds its own copy."""
    arrays, meta = make_arrays(), make_meta()
    p = write_dump(tmp_path / "d.safetensors", arrays, meta)
    mapped, loaded = read_dump(p, mmap=True), read_dump(p, mmap=False)
    assert isinstance(_root_base(mapped.R), np.memmap)
    assert not isinstance(_root_base(loaded.R), np.memmap)
    for d in (mapped, loaded):
        with pytest.raises(ValueError):
            d.R[0, 0, 0] = 1.0
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    off = 8 + hlen + json.loads(raw[8:8 + hlen])["R"]["data_offsets"][0]
    with open(p, "r+b") as fh:  # overwrite R[0, 0, 0] in place
        fh.seek(off)
        fh.write(np.float32(123.5).tobytes())
        fh.flush()
    assert mapped.R[0, 0, 0] == np.float32(123.5)
    assert loaded.R[0, 0, 0] == arrays["R"][0, 0, 0]


# --- the validator --------------------------------------------------------------------------------------


def _nan_R(a, m):
    a["R"] = a["R"].copy()
    a["R"][1, 2, 7] = np.nan
    a["R"][2, 0, 0] = np.inf
    return a, m


def _set(k, v):
    def f(a, m):
        a[k] = v(a[k])
        return a, m
    return f


def _del(k):
    def f(a, m):
        del a[k]
        return a, m
    return f


def _meta(**kw):
    return lambda a, m: (a, dataclasses.replace(m, **kw))


# mutation -> substrings the problem list must contain
CASES = {
    "nan_in_R": (_nan_R, ["R: expected finite values, found 2 non-finite (first at [1, 2, 7])"]),
    "hh_wrong_shape": (_set("hh", lambda x: x[:, :-1].copy()), ["hh: expected shape [3, 64], found [3, 63]"]),
    "hh_wrong_length": (_set("hh", lambda x: x[:-1].copy()), ["hh: expected shape [3, 64], found [2, 64]"]),
    "yr_wrong_dtype": (_set("yr", lambda x: x.astype(np.float64)), ["yr: expected dtype float32, found float64"]),
    "tokens_wrong_dtype": (_set("tokens", lambda x: x.astype(np.int64)), ["tokens: expected dtype int32"]),
    "missing_yr": (_del("yr"), ["yr: expected present, found missing"]),
    "bad_role_code": (_set("role", lambda x: np.array([0, 6, 1], np.uint8)),
                      ["role: expected codes 0..5", "1 out of range (first at [1]: 6)"]),
    "bad_schema_version": (_meta(schema_version=2), ["meta.schema_version: expected 1, found 2"]),
    "token_out_of_range": (_set("tokens", lambda x: np.array([0, 1, V, 2], np.int32)),
                           ["tokens: expected ids in [0, 1024), found 1 out of range (first at [2]: 1024)"]),
    "top_id_out_of_range": (_set("ref_top_ids", lambda x: np.full_like(x, -1)), ["ref_top_ids: expected ids in"]),
    "inf_in_ref_logits": (_set("ref_logits", lambda x: np.where(np.arange(V) == 5, np.float16(np.inf), x)),
                          ["ref_logits: expected finite values, found 3 non-finite (first at [0, 5])"]),
    "bad_inj_convention": (_meta(inj_convention="div4"), ["meta.inj_convention: expected one of"]),
    "bad_hh_precision": (_meta(hh_precision="bf16"), ["meta.hh_precision: expected one of"]),
    "dims_disagree": (_meta(n=512), ["R: expected shape [3, 4, 512]", "yr: expected shape [3, 512]"]),
    "ref_trio_incomplete": (_del("ref_top_logits"), ["ref_top_logits: expected present with ref_logp"]),
    "unknown_array": (lambda a, m: ({**a, "xf": a["yr"]}, m), ["xf: expected no such array"]),
    "provenance_value": (_meta(provenance={"assistant": "copied", "user": "written", "template": "written"}),
                         ["meta.provenance.assistant: expected one of"]),
    "provenance_missing_role": (_meta(provenance={"assistant": "generated"}),
                                ["meta.provenance: expected an entry for every role", "'template', 'user'"]),
    "engine_settings": (_meta(engine={"name": "hf", "version": "1"}), ["meta.engine.settings: expected dict"]),
    "empty_document": (lambda a, m: (make_arrays(t=0, refs=False, logits=False), m), ["tokens: expected at least 2"]),
    "positive_logp": (_set("ref_logp", lambda x: np.abs(x) + 1), ["ref_logp: expected log-probabilities <= 0"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validator_catches(case):
    arrays, meta = make_arrays(), make_meta()
    assert validate_dump(arrays, meta, "x") == []  # the unmutated dump is clean: each case below is its mutation
    mutate, needles = CASES[case]
    a, m = mutate(dict(arrays), meta)
    problems = validate_dump(a, m, "x")
    joined = "; ".join(problems)
    for s in needles:
        assert s in joined, (s, problems)


def test_validator_metadata_as_dict():
    arrays, d = make_arrays(), json.loads(make_meta().to_json())
    assert validate_dump(arrays, d, "x") == []
    del d["hh_precision"]
    d["layer"] = True  # a JSON bool is not an int
    d["hh_precison"] = "f16"  # typo: an unknown field
    joined = "; ".join(validate_dump(arrays, d, "x"))
    for s in ("meta.hh_precision: expected present, found missing", "meta.layer: expected int, found bool",
              "meta.hh_precison: expected no such field"):
        assert s in joined


def test_several_problems_in_one_message(tmp_path):
    a, m = make_arrays(), make_meta(schema_version=9)
    a = _nan_R(a, m)[0]
    del a["yr"]
    a["role"] = np.array([0, 2, 200], np.uint8)
    a["hh"] = a["hh"][:, :10].copy()
    p = tmp_path / "bad.safetensors"
    with pytest.raises(DumpError) as ei:
        write_dump(p, a, m)
    e = ei.value
    assert isinstance(e, L47Error) and len(e.problems) == 5
    msg = str(e)
    assert msg.startswith(str(p) + ": dump: expected a valid l47 dump")
    assert "; ".join(e.problems) in msg and "5 problem(s)" in msg
    for field_ in ("R: expected finite", "yr: expected present", "role: expected codes", "hh: expected shape",
                   "meta.schema_version"):
        assert field_ in msg


def test_read_refuses_invalid_file_and_reports_all(tmp_path):
    """A file written around the validator (by the safetensors library) is refused on read, every problem named;
    validate=False still opens it."""
    a = make_arrays()
    a["sgv"] = a["sgv"].copy()
    a["sgv"][0] = np.nan
    a["role"] = np.array([0, 9, 1], np.uint8)
    p = tmp_path / "bad.safetensors"
    stn.save_file(a, p, metadata={META_KEY: make_meta().to_json()})
    with pytest.raises(DumpError) as ei:
        read_dump(p)
    msg = str(ei.value)
    assert str(p) in msg and "sgv: expected finite" in msg and "role: expected codes" in msg
    assert np.isnan(read_dump(p, validate=False).sgv[0])


def test_read_refuses_bf16_truncated_and_foreign_files(tmp_path):
    a = make_arrays(refs=False, logits=False)
    p = write_dump(tmp_path / "d.safetensors", a, make_meta())
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DumpError, match="truncated"):
        read_dump(trunc)
    foreign = tmp_path / "foreign.safetensors"
    stn.save_file(a, foreign)  # no l47 metadata
    with pytest.raises(DumpError, match="not an l47 dump"):
        read_dump(foreign)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(DumpError, match="not a safetensors file"):
        read_dump(garbage)
    # a BF16 array (numpy has no bfloat16): patch the dtype tag of `hh` in a valid header (same length)
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + hlen].replace(b'"hh":{"dtype":"F32"', b'"hh":{"dtype":"BF16"')
    header = header[:-1] if header.endswith(b" ") else header
    bf = tmp_path / "bf16.safetensors"
    bf.write_bytes(raw[:8] + header.ljust(hlen) + raw[8 + hlen:])
    with pytest.raises(DumpError) as ei:
        read_dump(bf)
    assert "hh: expected dtype float32, found safetensors dtype BF16" in str(ei.value)


def _with_header(raw: bytes, header: bytes) -> bytes:
    """A dump's bytes with its header replaced (8-byte length + space-padded JSON, its data section kept)."""
    hlen = int.from_bytes(raw[:8], "little")
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + raw[8 + hlen:]


def _refused(path, *must):
    """read_dump refuses the file in one message naming it and each of `must`; the file is byte-identical."""
    before = path.read_bytes()
    with pytest.raises(DumpError) as ei:
        read_dump(path)
    msg = str(ei.value)
    assert str(path) in msg and "\n" not in msg, msg
    for m in must:
        assert m in msg, (m, msg)
    assert path.read_bytes() == before
    return msg


def test_header_refused_before_parsing_when_no_dump_can_have_it(tmp_path, monkeypatch):
    """A header nested deeper than a dump's (today json.loads would raise RecursionError), a header larger than
    1 MiB + the data section, one with more structure than a dump's, and metadata JSON nested too deep: each is
    one DumpError naming the file and the field, and json.loads is never called on the header."""
    import dumps.schema as S

    raw = write_dump(tmp_path / "d.safetensors", make_arrays(refs=False, logits=False), make_meta()).read_bytes()
    data = len(raw) - 8 - int.from_bytes(raw[:8], "little")
    cases = {
        "deep": (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, ("header", "nested at most 3 deep", "found 10000 deep")),
        "deep_list": (b"[" * 40_000 + b"]" * 40_000, ("header", "outside JSON strings", "found 80000")),
        "large": (b'{"x":"' + b"a" * ((1 << 20) + data) + b'"}', ("header", "1 MiB + the", f"{data}-byte data")),
        "meta_deep": (json.dumps({"__metadata__": {META_KEY: "[" * 50_000}}).encode(),
                      (f"__metadata__.{META_KEY}", "nested at most 8 deep", "found 50000")),
    }
    calls = []
    real_loads = json.loads
    monkeypatch.setattr(S.json, "loads", lambda s, *a, **k: calls.append(len(s)) or real_loads(s, *a, **k))
    for name, (header, must) in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(_with_header(raw, header))
        calls.clear()
        _refused(p, *must)
        assert len(calls) == (1 if name == "meta_deep" else 0), (name, calls)  # meta_deep: its flat header only


def test_header_scan_depth_matches_the_parsed_json():
    """Reference: the nesting depth of the Python object json.loads builds, on 3,000 random valid JSON texts
    whose strings hold quotes, backslashes and brackets (ASCII-escaped and not): the byte scan's depth must be equal
    (exact: integers), and the bytes outside strings equal the text's length minus its string literals'."""
    import random

    from dumps.schema import _string_spans

    rng = random.Random(0)

    def rstr():
        return "".join(rng.choice('ab"\\[]{}é\n ') for _ in range(rng.randint(0, 8)))

    def robj(d):
        if d == 0 or rng.random() < 0.3:
            return rng.choice([rstr(), 1, -2.5e3, None, True])
        if rng.random() < 0.5:
            return [robj(d - 1) for _ in range(rng.randint(0, 3))]
        return {rstr(): robj(d - 1) for _ in range(rng.randint(0, 3))}

    def depth(o):
        kids = o.values() if isinstance(o, dict) else o if isinstance(o, list) else None
        return 0 if kids is None else 1 + max((depth(x) for x in kids), default=0)

    def literals(o):  # total length of the string literals json.dumps writes for o (keys and values)
        if isinstance(o, str):
            return len(json.dumps(o, ensure_ascii=asc).encode())
        if isinstance(o, dict):
            return sum(literals(k) + literals(v) for k, v in o.items())
        return sum(literals(x) for x in o) if isinstance(o, list) else 0

    for _ in range(3000):
        o, asc = robj(6), rng.random() < 0.5
        raw = json.dumps(o, ensure_ascii=asc).encode()
        b = np.frombuffer(raw, dtype=np.uint8)
        spans = _string_spans(b)
        assert b.size - int((spans[:, 1] - spans[:, 0] + 1).sum()) == len(raw) - literals(o)
        from dumps.schema import json_shape_problem

        d = depth(o)
        assert json_shape_problem(raw, "h", d) is None
        if d:
            assert f"found {d} deep" in json_shape_problem(raw, "h", d - 1)


def test_real_headers_are_far_inside_the_caps(tmp_path):
    """A dump with the longest text a position can carry in practice (a 64-byte token of quotes and backslashes
    per position, escaped twice in the header) stays under the header caps with room to spare."""
    from dumps.schema import _HEADER_SLACK, _MAX_STRUCTURE

    t = 64
    p = write_dump(tmp_path / "long.safetensors", make_arrays(t=t, refs=True, logits=False),
                   make_meta(text='"\\\n' * 16 * t))
    raw = p.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    assert hlen < (len(raw) - 8 - hlen) and hlen < _HEADER_SLACK
    assert read_dump(p).T == t
    from dumps.schema import _string_spans

    b = np.frombuffer(raw[8:8 + hlen], dtype=np.uint8)
    spans = _string_spans(b)
    assert b.size - int((spans[:, 1] - spans[:, 0] + 1).sum()) < _MAX_STRUCTURE // 50


# --- atomic writes --------------------------------------------------------------------------------------


def test_invalid_write_leaves_nothing(tmp_path):
    a = make_arrays()
    del a["yr"]
    with pytest.raises(DumpError):
        write_dump(tmp_path / "sub" / "d.safetensors", a, make_meta())
    assert list(tmp_path.iterdir()) == []  # not even the directory


def test_failed_write_keeps_old_file_and_no_tmp(tmp_path, monkeypatch):
    p = write_dump(tmp_path / "d.safetensors", make_arrays(seed=0), make_meta())
    before = p.read_bytes()

    def boom(*args, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_dump(p, make_arrays(seed=1), make_meta())
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["d.safetensors"]


# --- conventions ----------------------------------------------------------------------------------------


def test_inj_xn_div4_is_normalised_to_raw(tmp_path):
    """An engine with the xn/4 convention stores inject_w · (xn/4); the loader must return inject_w · xn."""
    g = np.random.default_rng(3)
    w_inject = g.standard_normal((HC, HC * N)) / np.sqrt(N)  # [hc, hc·n] f64
    xn = g.standard_normal((T, HC * N))  # [T, hc·n] f64
    raw_ref = xn @ w_inject.T  # [T, hc] f64: the raw convention, reference
    stored = ((xn / 4) @ w_inject.T).astype(np.float32)  # [T, hc] f32, what the xn_div4 engine writes
    a = make_arrays()
    a["inj"] = stored
    p = write_dump(tmp_path / "d.safetensors", a, make_meta(inj_convention="xn_div4"))
    for mmap in (True, False):
        d = read_dump(p, mmap=mmap)
        assert d.meta.inj_convention == "raw"
        assert d.inj.dtype == np.float32
        np.testing.assert_array_equal(d.inj, stored * np.float32(4))
        np.testing.assert_allclose(d.inj, raw_ref, rtol=1e-5, atol=1e-5)
        assert not np.allclose(d.inj, stored, rtol=1e-2)  # the ×4 is not a no-op on these values
    # re-written, it is a raw dump with the same (normalised) values
    d2 = read_dump(write_dump(tmp_path / "d2.safetensors", read_dump(p)))
    assert d2.meta.inj_convention == "raw" and np.array_equal(d2.inj, stored * np.float32(4))


def test_fp16_hh_stored_as_f32(tmp_path):
    a = make_arrays()
    a["hh"] = a["hh"].astype(np.float16).astype(np.float32)  # Strata's prompt path rounds hh to fp16
    meta = make_meta(hh_precision="f16")
    d = read_dump(write_dump(tmp_path / "d.safetensors", a, meta))
    assert d.hh.dtype == np.float32 and np.array_equal(d.hh, a["hh"]) and d.meta.hh_precision == "f16"
    # values that are not fp16 are a mislabelled dump
    b = make_arrays()
    problems = validate_dump(b, meta, "x")
    assert any(p.startswith("hh: expected fp16-exact values") and f"found {b['hh'].size} values" in p for p in problems)
    # storing fp16 dtype itself is refused (the format stores f32)
    c = dict(a, hh=a["hh"].astype(np.float16))
    assert "hh: expected dtype float32, found float16" in validate_dump(c, meta, "x")


def test_roles_in_another_order_are_remapped(tmp_path):
    perm = ("assistant", "user", "template", "system", "think", "tool")
    a = make_arrays()
    canon = a["role"].copy()
    a["role"] = np.array([perm.index(ROLES[c]) for c in canon], np.uint8)  # codes in the file's own order
    d = read_dump(write_dump(tmp_path / "d.safetensors", a, make_meta(roles=perm)))
    assert d.meta.roles == ROLES and np.array_equal(d.role, canon)


def test_meta_json_round_trip_and_errors():
    m = make_meta()
    assert DumpMeta.from_json(m.to_json()) == m
    assert json.loads(m.to_json())["roles"] == list(ROLES)
    with pytest.raises(DumpError, match="unparsable JSON"):
        DumpMeta.from_json("{not json", "f.safetensors")
    with pytest.raises(DumpError) as ei:
        DumpMeta.from_json(json.dumps({"schema_version": 1}), "f.safetensors")
    assert "meta.doc_id: expected present" in str(ei.value) and "meta.text: expected present" in str(ei.value)


def test_dumps_imports_only_allowed_modules():
    """DESIGN §2: dumps/ may import numpy, torch, safetensors, stdlib and l47.model.names / the base modules
    (l47.errors, l47.fileio: the one atomic writer) only."""
    code = ("import sys, l47.dumps; bad = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'transformers', 'gguf', 'scipy', 'matplotlib', 'typer', 'rich'}); "
            "core = sorted(m for m in sys.modules if m.startswith('l47.') and not m.startswith('l47.dumps') "
            "and m not in ('l47.model', 'l47.model.names', 'l47.errors', 'l47.fileio')); print(bad, core)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[] []"
