"""Tests of sim.trace: the expertcache-trace/1 format, round trips and every validation error.

Small random traces (int32 experts [N, L, B, k] with distinct ids per row and -1 padding,
float32 weights, int32 req_index, top-T logits) go through save_trace/load_trace, slicing and
concatenation; malformed files and Traces must raise TraceError naming the field.
"""

from __future__ import annotations

import io
import json
import tempfile
import tracemalloc
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.trace import (
    FORMAT,
    MAX_KEYS,
    MAX_LAYERS,
    REQUIRED_META_KEYS,
    Trace,
    TraceError,
    TraceMeta,
    concat_traces,
    load_trace,
    save_trace,
)
from tests.sim.gen import random_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


make_trace = random_trace


trace_args = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31), "n": st.integers(1, 6), "layers": st.integers(1, 4),
    "batch": st.integers(1, 2), "k": st.integers(1, 3), "num_experts": st.integers(3, 10),
    "weights": st.booleans(), "req": st.booleans(), "logits": st.integers(0, 3)})


@settings(max_examples=30, deadline=None)
@given(trace_args)
def test_npz_round_trip(args: dict) -> None:
    t = make_trace(**args)
    t.validate()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.npz"
        save_trace(t, path)
        assert load_trace(path) == t
        with np.load(path) as z:
            assert z["experts"].ndim == (3 if args["batch"] == 1 else 4)
            assert ("req_index" in z.files) == args["req"]
            if args["req"]:
                assert z["req_index"].ndim == (1 if args["batch"] == 1 else 2)


def test_three_d_input_gets_batch_axis() -> None:
    t = make_trace(1, logits=2)
    flat = Trace(experts=t.experts[:, :, 0], meta=t.meta, weights=t.weights[:, :, 0],
                 req_index=t.req_index[:, 0], logit_idx=t.logit_idx[:, :, 0],
                 logit_val=t.logit_val[:, :, 0])
    assert flat == t and flat.batch == 1 and flat.req_index.shape == (t.num_tokens, 1)


def test_properties_and_accesses() -> None:
    experts = np.array([[[[0, 1], [1, 2]], [[-1, -1], [3, -1]]],
                        [[[4, -1], [-1, 4]], [[5, 6], [7, 0]]]], dtype=np.int32)
    meta = TraceMeta("m", 2, 8, 2, None, "decode", "s", "l")
    t = Trace(experts=experts, meta=meta)
    t.validate()
    assert (t.num_tokens, t.num_layers, t.batch, t.top_k, t.num_experts) == (2, 2, 2, 2, 8)
    assert t.accesses == 3 + 1 + 1 + 4


def test_meta_json_round_trip_keeps_extra() -> None:
    meta = make_trace(3, extra={"notes": "x", "nested": {"a": [1, 2]}}).meta
    d = json.loads(meta.to_json())
    assert d["format"] == FORMAT and d["nested"] == {"a": [1, 2]}
    assert TraceMeta.from_json(meta.to_json()) == meta


def test_slice_and_concat() -> None:
    t = make_trace(4, n=9, batch=2, logits=2)
    parts = [t.slice_tokens(0, 2), t.slice_tokens(2, 7), t.slice_tokens(7, None)]
    assert [p.num_tokens for p in parts] == [2, 5, 2]
    assert concat_traces(parts) == t
    assert parts[1].meta == t.meta and np.array_equal(parts[1].experts, t.experts[2:7])


@pytest.mark.parametrize("change, field", [
    (lambda t: replace(t, meta=replace(t.meta, model="other")), "model"),
    (lambda t: replace(t, meta=replace(t.meta, num_experts=9)), "num_experts"),
    (lambda t: replace(t, weights=None), "weights"),
    (lambda t: replace(t, logit_idx=t.logit_idx[..., :1], logit_val=t.logit_val[..., :1]),
     "logit_idx"),
])
def test_concat_refuses_mismatch(change, field) -> None:
    t = make_trace(5, logits=2)
    with pytest.raises(TraceError, match=field):
        concat_traces([t, change(t)])


def test_concat_refuses_batch_mismatch_and_empty() -> None:
    with pytest.raises(TraceError, match="batch"):
        one, two = make_trace(6, batch=1), make_trace(6, batch=2)
        concat_traces([one, replace(two, meta=one.meta)])
    with pytest.raises(TraceError, match="no traces"):
        concat_traces([])


def write_npz(path: Path, t: Trace, *, meta: object = None, drop: str = "",
              **arrays: np.ndarray) -> Path:
    """An .npz like save_trace writes (3-D when B == 1), with fields dropped or replaced."""
    out = {k: (v[:, 0] if k == "req_index" else v[:, :, 0]) if t.batch == 1 else v
           for k, v in t.arrays().items()}
    out["meta"] = np.array(t.meta.to_json() if meta is None else meta)
    out.update(arrays)
    out.pop(drop, None)
    np.savez(path, **out)
    return path


def meta_with(t: Trace, **changes: object) -> str:
    d = t.meta.to_dict()
    d.update(changes)
    return json.dumps({k: v for k, v in d.items() if v is not ...})


BASE = make_trace(7, n=5, layers=3, k=2, num_experts=8, logits=2)
E3 = BASE.experts[:, :, 0]

FILE_ERRORS = [
    ("experts", dict(drop="experts")),
    ("meta", dict(drop="meta")),
    ("meta", dict(meta="{not json")),
    ("meta", dict(meta="[1, 2]")),
    ("meta", dict(meta=np.array([BASE.meta.to_json()]))),
    ("format", dict(meta=meta_with(BASE, format="expertcache-trace/0"))),
    ("num_layers", dict(meta=meta_with(BASE, num_layers="3"))),
    ("num_layers", dict(meta=meta_with(BASE, num_layers=4))),
    ("top_k", dict(meta=meta_with(BASE, top_k=3))),
    ("num_experts", dict(meta=meta_with(BASE, num_experts=0))),
    ("expert_bytes", dict(meta=meta_with(BASE, expert_bytes=-5))),
    ("model", dict(meta=meta_with(BASE, model=""))),
    ("license", dict(meta=meta_with(BASE, license=3))),
    ("experts", dict(experts=E3.astype(np.int64))),
    ("int32", dict(experts=E3.astype(np.int16))),
    ("experts", dict(experts=E3[:, :, 0])),
    ("experts", dict(experts=E3[None])),
    ("experts[1, 2, 0, 0] = 8", dict(experts=np.where(np.arange(5)[:, None, None] == 1,
                                                np.array([[0, 1], [2, 3], [8, 1]]), E3)
                              .astype(np.int32))),
    ("experts[0, 0, 0, 0] = -2", dict(experts=np.full_like(E3, -2))),
    ("experts[0, 1, 0]", dict(experts=np.where(
        (np.arange(5)[:, None, None] == 0) & (np.arange(3)[None, :, None] == 1), 4, E3)
        .astype(np.int32))),
    ("weights", dict(weights=BASE.weights[:, :, 0].astype(np.float64))),
    ("float32", dict(weights=BASE.weights[:, :, 0].astype(np.float16))),
    ("weights", dict(weights=BASE.weights[:, :2, 0])),
    ("req_index", dict(req_index=BASE.req_index[:, 0].astype(np.int64))),
    ("req_index", dict(req_index=BASE.req_index[:3, 0])),
    ("req_index", dict(req_index=np.full(5, -3, dtype=np.int32))),
    ("logit_val", dict(drop="logit_val")),
    ("logit_idx", dict(drop="logit_idx")),
    ("logit_idx", dict(logit_idx=BASE.logit_idx[:, :, 0, :0])),
    ("logit_idx", dict(logit_idx=BASE.logit_idx[:4, :, 0])),
    ("logit_val", dict(logit_val=BASE.logit_val[:, :, 0, :1])),
    ("logit_idx", dict(logit_idx=np.full_like(BASE.logit_idx[:, :, 0], 8))),
    ("logit_val", dict(logit_val=BASE.logit_val[:, :, 0].astype(np.float64))),
    ("weights", dict(weights=np.array([None] * 5, dtype=object))),
    ("UTF-8", dict(meta=np.array(b"\xff{}"))),
]


@pytest.mark.parametrize("field, how", FILE_ERRORS, ids=[f"{f}-{i}" for i, (f, _) in
                                                          enumerate(FILE_ERRORS)])
def test_load_errors_name_the_field(tmp_path: Path, field: str, how: dict) -> None:
    path = write_npz(tmp_path / "t.npz", BASE, **how)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert field in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("key", [k for k in REQUIRED_META_KEYS])
def test_missing_meta_key_is_named(tmp_path: Path, key: str) -> None:
    path = write_npz(tmp_path / "t.npz", BASE, meta=meta_with(BASE, **{key: ...}))
    with pytest.raises(TraceError, match=key):
        load_trace(path)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(TraceError, match="not an .npz"):
        load_trace(tmp_path / "text.npz")
    with open(tmp_path / "one.npz", "wb") as f:
        np.save(f, E3)
    with pytest.raises(TraceError, match=r"single \.npy"):
        load_trace(tmp_path / "one.npz")


def test_batch_req_index_needs_two_dims() -> None:
    t = make_trace(8, batch=2)
    with pytest.raises(TraceError, match="req_index"):
        replace(t, req_index=t.req_index[:, 0]).validate()


def test_in_memory_validate_errors() -> None:
    t = make_trace(9)
    cases = [
        ("experts", replace(t, experts=t.experts.tolist())),
        ("meta", replace(t, meta=t.meta.to_dict())),
        ("extra", replace(t, meta=replace(t.meta, extra={"model": "x"}))),
        ("extra", replace(t, meta=replace(t.meta, extra={"a": object()}))),
        ("expert_bytes", replace(t, meta=replace(t.meta, expert_bytes=True))),
        ("experts", replace(t, experts=t.experts[:, :0])),
    ]
    for field, bad in cases:
        with pytest.raises(TraceError, match=field):
            bad.validate()
    with pytest.raises(TraceError, match="meta"):
        save_trace(cases[1][1], "/nonexistent/never-written.npz")


def real(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"real trace {path} not present (it lives beside the checkout, not in it)")
    return path


@pytest.mark.parametrize("name, shape, experts, accesses", [
    ("mixtral-gsm8k.npz", (244, 32, 1, 2), 8, 15616),
    ("flame-290m-a.npz", (1024, 8, 1, 6), 64, 49152),
])
def test_real_traces_load(tmp_path: Path, name: str, shape: tuple, experts: int,
                          accesses: int) -> None:
    t = load_trace(real(name))
    assert t.experts.shape == shape and t.num_experts == experts
    assert t.accesses == accesses and t.weights is not None and t.req_index is not None
    save_trace(t, tmp_path / name)
    assert load_trace(tmp_path / name) == t


def test_meta_size_limits_name_the_field(tmp_path: Path) -> None:
    """num_layers and the key count L * E are bounded before anything is sized from them;
    the bound itself is legal."""
    meta = BASE.meta
    replace(meta, num_layers=1, num_experts=MAX_KEYS).validate()
    replace(meta, num_layers=MAX_LAYERS, num_experts=1).validate()
    with pytest.raises(TraceError, match=r"meta\.num_experts.*16777216"):
        replace(meta, num_experts=2**29).validate()
    with pytest.raises(TraceError, match=r"meta\.num_layers is 4097.*4096"):
        replace(meta, num_layers=MAX_LAYERS + 1, num_experts=1).validate()
    path = write_npz(tmp_path / "t.npz", BASE, meta=meta_with(BASE, num_experts=2**29))
    with pytest.raises(TraceError, match=r"num_experts = 3 x 536870912"):
        load_trace(path)


def test_zero_token_trace_loads_with_no_accesses(tmp_path: Path) -> None:
    """A trace may have no decode steps (a slice can be empty); it loads and counts 0 accesses."""
    path = write_npz(tmp_path / "t.npz", BASE, experts=E3[:0], weights=BASE.weights[:0, :, 0],
                     req_index=BASE.req_index[:0, 0], logit_idx=BASE.logit_idx[:0, :, 0],
                     logit_val=BASE.logit_val[:0, :, 0])
    t = load_trace(path)
    assert t.experts.shape == (0, 3, 1, 2) and t.accesses == 0
    assert BASE.slice_tokens(2, 2).accesses == 0


def _lying_header_npz(path: Path) -> None:
    """A stored .npz whose experts header claims 2**38 entries (1 TiB) over a few bytes."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<i4", "fortran_order": False, "shape": (2**38,)})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("experts.npy", buf.getvalue() + bytes(120))
        z.writestr("meta.npy", _npy(np.array(BASE.meta.to_json())))


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _corrupt(path: Path, how: str) -> None:
    save_trace(BASE, path)
    good = path.read_bytes()
    if how == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(600))
    elif how.startswith("truncated"):
        path.write_bytes(good[:int(len(good) * float(how.split()[1]))])
    elif how == "flipped bytes":
        bad = bytearray(good)
        for i in range(60, 260):
            bad[i] ^= 0x5A
        path.write_bytes(bytes(bad))
    elif how == "object .npy":
        path.write_bytes(_npy(np.array([{"a": 1}, None], dtype=object)))
    elif how == "garbage members":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("experts.npy", b"not an array at all")
            z.writestr("meta.npy", b"\x00" * 40)
    elif how == "garbage header":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("experts.npy", b"\x93NUMPY\x01\x00\x10\x00{'descr': zz}  \n")
            z.writestr("meta.npy", _npy(np.array(BASE.meta.to_json())))
    elif how == "unclosed header":  # numpy's header parser raises tokenize.TokenError
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("experts.npy", b"\x93NUMPY\x01\x00\x0c\x00{'shape': (3\n")
            z.writestr("meta.npy", _npy(np.array(BASE.meta.to_json())))
    elif how == "object member":
        np.savez(path, experts=E3, meta=np.array([BASE.meta.to_dict()], dtype=object))
    elif how == "short member data":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("experts.npy", _npy(E3)[:-7])
            z.writestr("meta.npy", _npy(np.array(BASE.meta.to_json())))
    elif how == "bad checksum":
        np.savez(path, experts=E3, meta=np.array(BASE.meta.to_json()))
        raw = bytearray(path.read_bytes())
        at = raw.index(_npy(E3)[-8:])
        raw[at:at + 8] = bytes(8)
        path.write_bytes(bytes(raw))
    elif how == "lying header":
        _lying_header_npz(path)


CORRUPTIONS = ["random bytes", "truncated 0.5", "truncated 0.95", "truncated 0.999",
               "flipped bytes", "object .npy", "garbage members", "garbage header",
               "unclosed header", "object member", "short member data", "bad checksum",
               "lying header"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_archives_are_trace_errors(tmp_path: Path, how: str) -> None:
    """Every damaged file is a TraceError naming the file and how to write a trace, never
    numpy's pickle advice, and nothing is allocated from a size the bytes cannot back."""
    path = tmp_path / "t.npz"
    _corrupt(path, how)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    message = str(err.value)
    assert str(path) in message and "save_trace" in message
    assert "pickle" not in message.lower()


def test_sizes_claimed_by_zip_and_header_are_not_allocated(tmp_path: Path) -> None:
    """A deflated member whose zip directory and .npy header both claim 1 GiB, over ~100
    stored bytes, is refused before numpy could size an array from them."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<i4", "fortran_order": False, "shape": (2**28,)})
    path = tmp_path / "t.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("experts.npy", buf.getvalue() + bytes(4096))
        z.writestr("meta.npy", _npy(np.array(BASE.meta.to_json())))
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")  # central directory entry of experts.npy: its file size
    raw[at + 24:at + 28] = (2**30 + len(buf.getvalue())).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match="more than the archive can hold"):
            load_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6
