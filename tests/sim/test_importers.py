"""Tests of sim.importers and sim.jsonl: FreeToken directories and JSONL logs to and from Trace.

Random B == 1 traces round-trip losslessly through both layouts; malformed inputs raise
TraceError naming the file (and line and field); the real mixtral-gsm8k.raw.jsonl imports to
exactly the experts, weights and req_index of mixtral-gsm8k.npz.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import TraceWarning
from sim.importers import export_freetoken_dir, import_freetoken_dir
from sim.jsonl import export_jsonl, import_jsonl
from sim.trace import MAX_KEYS, MAX_LAYERS, Trace, TraceError, load_trace
from tests.sim.gen import random_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def make_trace(seed: int, n: int = 6, layers: int = 3, k: int = 2, num_experts: int = 8,
               **kw) -> Trace:
    """A random B == 1 (unless asked) trace with an extra meta key to carry through."""
    return random_trace(seed, n, layers, kw.pop("batch", 1), k, num_experts,
                        extra={"seed": seed, "note": "x"}, **kw)


trace_args = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31), "n": st.integers(1, 7), "layers": st.integers(1, 4),
    "k": st.integers(1, 3), "num_experts": st.integers(3, 10), "weights": st.booleans(),
    "req": st.booleans(), "logits": st.integers(0, 3)})


@settings(max_examples=25, deadline=None)
@given(trace_args)
def test_freetoken_round_trip(args: dict) -> None:
    t = make_trace(**args)
    with tempfile.TemporaryDirectory() as d:
        export_freetoken_dir(t, d)
        assert import_freetoken_dir(d) == t


@settings(max_examples=25, deadline=None)
@given(trace_args, st.sampled_from([None, "gsm8k"]))
def test_jsonl_round_trip(args: dict, dataset: str | None) -> None:
    t = make_trace(**args)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl"
        export_jsonl(t, path, dataset=dataset)
        assert import_jsonl(path) == t


def test_exports_refuse_batch_two(tmp_path: Path) -> None:
    t = make_trace(1, batch=2)
    with pytest.raises(TraceError, match="batch"):
        export_freetoken_dir(t, tmp_path / "ft")
    with pytest.raises(TraceError, match="batch"):
        export_jsonl(t, tmp_path / "t.jsonl")


def test_jsonl_export_refuses_split_request(tmp_path: Path) -> None:
    t = make_trace(2, n=4)
    t = replace(t, req_index=np.array([[0], [1], [1], [0]], dtype=np.int32))
    with pytest.raises(TraceError, match="req_index"):
        export_jsonl(t, tmp_path / "t.jsonl")


def test_jsonl_custom_keys_and_shuffled_lines(tmp_path: Path) -> None:
    t = make_trace(3, n=8, logits=2)
    keys = dict(request_key="req", layer_key="l", token_key="pos", experts_key="ids",
                weights_key="w", logit_idx_key="li", logit_val_key="lv")
    export_jsonl(t, tmp_path / "t.jsonl", write_meta=False, **keys)
    blocks: dict[int, list[str]] = {}
    for line in (tmp_path / "t.jsonl").read_text().splitlines():
        blocks.setdefault(json.loads(line)["req"], []).append(line)
    for block in blocks.values():  # requests stay in order; lines within each are shuffled
        random.Random(0).shuffle(block)
    text = "\n".join(line for block in blocks.values() for line in block)
    (tmp_path / "s.jsonl").write_text(text + "\n\n")
    meta = t.meta
    u = import_jsonl(tmp_path / "s.jsonl", model=meta.model, num_experts=meta.num_experts,
                     expert_bytes=meta.expert_bytes, source=meta.source, license=meta.license,
                     **keys)
    assert u == replace(t, meta=replace(meta, extra={}))


def jsonl_records(tokens: dict[int, int], k: int = 2) -> list[dict]:
    """Records for one request; tokens maps layer -> number of tokens recorded."""
    return [{"problem_id": 0, "layer": layer, "experts": [(tok + layer) % 4, 4 + tok % 3][:k],
             "token_idx": tok} for layer, count in tokens.items() for tok in range(count)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_jsonl_drops_tokens_missing_from_a_layer(tmp_path: Path) -> None:
    records = jsonl_records({0: 5, 1: 4, 2: 5})
    records = [r for r in records if not (r["layer"] == 2 and r["token_idx"] == 1)]
    with pytest.warns(TraceWarning) as caught:
        t = import_jsonl(write_jsonl(tmp_path / "t.jsonl", records), model="m")
    assert str(caught[0].message).endswith(
        "t.jsonl: dropped 2 tokens without a record in every layer 0..2: (request 0, token 1, missing from "
        "layer 2), (request 0, token 4, missing from layer 1); meta.dropped_tokens counts them")
    assert t.num_tokens == 3 and t.meta.extra["dropped_tokens"] == 2
    assert t.experts[:, 0, 0].tolist() == [[0, 4], [2, 6], [3, 4]]
    assert t.meta.num_experts == 7 and t.meta.extra["num_experts_inferred"] is True
    assert t.weights is None and t.req_index.tolist() == [[0], [0], [0]]


@pytest.mark.parametrize("field, fix", [
    ("request", "if 'request' is the problem_id field, rename it 'problem_id' on every line"),
    ("position", "if 'position' is the token_idx field, rename it 'token_idx' on every line"),
    ("latency_ms", "drop it from every line (e.g. jq -c 'del(.latency_ms)') or rename it to one of those"),
])
def test_jsonl_refuses_a_field_it_does_not_read(tmp_path: Path, field: str, fix: str) -> None:
    """A field the layout does not read is named, with the fields it reads, never ignored."""
    records = [dict(r, **{field: 0}) for r in jsonl_records({0: 2, 1: 2})]
    with pytest.raises(TraceError) as err:
        import_jsonl(write_jsonl(tmp_path / "t.jsonl", records), model="m")
    assert str(err.value).startswith(
        f"{tmp_path / 't.jsonl'}:1: field '{field}' is not read by this layout, whose fields are problem_id, "
        f"dataset, layer, token_idx, experts, gating_probs, logit_idx, logit_val: {fix}")


def test_jsonl_with_custom_keys_reads_only_those(tmp_path: Path) -> None:
    records = [{"req": 0, "l": r["layer"], "t": r["token_idx"], "e": r["experts"]} for r in jsonl_records({0: 2, 1: 2})]
    t = import_jsonl(write_jsonl(tmp_path / "t.jsonl", records), model="m", request_key="req", layer_key="l",
                     token_key="t", experts_key="e")
    assert t.num_tokens == 2
    with pytest.raises(TraceError, match="field 'layer' is not read by this layout, whose fields are req, dataset, l"):
        import_jsonl(write_jsonl(tmp_path / "u.jsonl", [dict(r, layer=0) for r in records]), model="m",
                     request_key="req", layer_key="l", token_key="t", experts_key="e")


def test_jsonl_dataset_makes_requests_distinct(tmp_path: Path) -> None:
    records = ([dict(r, dataset="a") for r in jsonl_records({0: 2, 1: 2})]
               + [dict(r, dataset="b") for r in jsonl_records({0: 3, 1: 3})])
    t = import_jsonl(write_jsonl(tmp_path / "t.jsonl", records), model="m", num_experts=8)
    assert t.req_index[:, 0].tolist() == [0, 0, 1, 1, 1]


GOOD = {"problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.6, 0.4],
        "token_idx": 0}
JSONL_ERRORS = [
    ("line 2", [GOOD, "{oops"], ":2:"),
    ("not object", [GOOD, "[1, 2]"], ":2:"),
    ("no layer", [GOOD, {k: v for k, v in GOOD.items() if k != "layer"}], "'layer'"),
    ("bad token", [GOOD, dict(GOOD, token_idx=-1)], "'token_idx'"),
    ("bad experts", [GOOD, dict(GOOD, token_idx=1, experts="1,2")], "'experts'"),
    ("float id", [GOOD, dict(GOOD, token_idx=1, experts=[1.0, 2])], "'experts'"),
    ("id < -1", [GOOD, dict(GOOD, token_idx=1, experts=[-2, 2])], "'experts'"),
    ("repeat id", [GOOD, dict(GOOD, token_idx=1, experts=[2, 2])], "'experts'"),
    ("k differs", [GOOD, dict(GOOD, token_idx=1, experts=[1, 2, 3],
                              gating_probs=[0.1, 0.2, 0.7])], "'experts'"),
    ("weights len", [GOOD, dict(GOOD, token_idx=1, gating_probs=[1.0])], "'gating_probs'"),
    ("weights mixed", [GOOD, {k: v for k, v in dict(GOOD, token_idx=1).items()
                              if k != "gating_probs"}], "'gating_probs'"),
    ("request mixed", [GOOD, {k: v for k, v in dict(GOOD, token_idx=1).items()
                              if k != "problem_id"}], "'problem_id'"),
    ("request type", [GOOD, dict(GOOD, token_idx=1, problem_id=[0])], "'problem_id'"),
    ("duplicate", [GOOD, GOOD], "line 1"),
    ("logit half", [GOOD, dict(GOOD, token_idx=1, logit_idx=[1])], "'logit_val'"),
    ("logit len", [dict(GOOD, logit_idx=[1, 2], logit_val=[0.5])], "'logit_val'"),
    ("id range", [GOOD, dict(GOOD, token_idx=1, experts=[9, 2])], "num_experts"),
    ("missing layer", [GOOD, dict(GOOD, layer=2)], "layer(s) [1]"),
    ("empty", [], "no records"),
]


@pytest.mark.parametrize("name, records, needle", JSONL_ERRORS,
                         ids=[case[0] for case in JSONL_ERRORS])
def test_jsonl_errors_name_line_and_field(tmp_path: Path, name: str, records: list,
                                          needle: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", records)
    kwargs = {"num_experts": 8} if name == "id range" else {}
    with pytest.raises(TraceError) as err:
        import_jsonl(path, model="m", **kwargs)
    message = str(err.value)
    assert str(path) in message and needle in message
    if name not in ("missing layer", "empty"):
        assert f"{path}:" in message  # names a line


def test_jsonl_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        import_jsonl(tmp_path / "absent.jsonl", model="m")
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    with pytest.raises(TraceError, match="model"):
        import_jsonl(path)
    (tmp_path / "t.jsonl.meta.json").write_text("[1]")
    with pytest.raises(TraceError, match="meta.json"):
        import_jsonl(path, model="m")
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(TraceError, match="UTF-8"):
        import_jsonl(tmp_path / "b.jsonl", model="m")


def test_freetoken_import_converts_and_infers(tmp_path: Path) -> None:
    experts = np.array([[[0, 5], [2, -1]], [[3, 1], [4, 0]]], dtype=np.int64)
    np.save(tmp_path / "experts.npy", experts)
    np.save(tmp_path / "req_index.npy", np.array([0, 0], dtype=np.int16))
    t = import_freetoken_dir(tmp_path, model="m", source="s")
    assert t.experts.dtype == np.int32 and t.experts[:, :, 0].tolist() == experts.tolist()
    assert t.meta.num_experts == 6 and t.meta.extra == {"num_experts_inferred": True}
    assert t.meta.phase == "decode" and t.req_index.dtype == np.int32
    (tmp_path / "meta.json").write_text(json.dumps(
        {"model": "stored", "num_experts": 16, "license": "MIT", "notes": "kept"}))
    t = import_freetoken_dir(tmp_path, num_experts=8, license="unknown")
    assert (t.meta.model, t.meta.num_experts, t.meta.license) == ("stored", 8, "MIT")
    assert t.meta.extra == {"notes": "kept"}
    assert import_freetoken_dir(tmp_path, license="CC-BY").meta.license == "CC-BY"


FT_ERRORS = [
    ("experts.npy", {"experts": np.zeros((2, 2, 2), dtype=np.float32)}),
    ("experts.npy", {"experts": np.zeros((2, 2), dtype=np.int32)}),
    ("experts.npy", {"experts": np.full((2, 2, 2), 2**40, dtype=np.int64)}),
    ("experts.npy", {"experts": np.array([[[1, 1]]], dtype=np.int32)}),
    ("experts.npy", {"experts": np.array([[[1, 9]]], dtype=np.int32)}),
    ("weights.npy", {"weights": np.ones((1, 1, 3), dtype=np.float32)}),
    ("weights.npy", {"weights": np.ones((1, 1, 2), dtype=np.int32)}),
    ("req_index.npy", {"req_index": np.zeros(2, dtype=np.int32)}),
    ("req_index.npy", {"req_index": np.zeros(1, dtype=np.float32)}),
    ("logit_val.npy", {"logit_idx": np.zeros((1, 1, 2), dtype=np.int32)}),
    ("logit_idx.npy", {"logit_val": np.zeros((1, 1, 2), dtype=np.float32)}),
    ("logit_idx.npy", {"logit_idx": np.full((1, 1, 2), 9, dtype=np.int32),
                       "logit_val": np.zeros((1, 1, 2), dtype=np.float32)}),
    ("logit_val.npy", {"logit_idx": np.zeros((1, 1, 2), dtype=np.int32),
                       "logit_val": np.zeros((1, 1, 3), dtype=np.float32)}),
    ("logit_idx.npy", {"logit_idx": np.zeros((2, 1, 2), dtype=np.int32),
                       "logit_val": np.zeros((2, 1, 2), dtype=np.float32)}),
]


@pytest.mark.parametrize("name, files", FT_ERRORS, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(FT_ERRORS)])
def test_freetoken_errors_name_the_file(tmp_path: Path, name: str, files: dict) -> None:
    files = {"experts": np.array([[[1, 2]]], dtype=np.int32), **files}
    for key, array in files.items():
        np.save(tmp_path / f"{key}.npy", array)
    with pytest.raises(TraceError, match=name):
        import_freetoken_dir(tmp_path, model="m", num_experts=8)


def test_freetoken_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a directory"):
        import_freetoken_dir(tmp_path / "absent")
    with pytest.raises(TraceError, match="experts.npy"):
        import_freetoken_dir(tmp_path)
    np.save(tmp_path / "experts.npy", np.array([[[1, 2]]], dtype=np.int32))
    with pytest.raises(TraceError, match="model"):
        import_freetoken_dir(tmp_path)
    (tmp_path / "meta.json").write_text("{bad")
    with pytest.raises(TraceError, match="meta.json"):
        import_freetoken_dir(tmp_path, model="m")
    (tmp_path / "meta.json").write_text(json.dumps({"model": "m", "num_layers": 2}))
    with pytest.raises(TraceError, match="num_layers"):
        import_freetoken_dir(tmp_path)
    (tmp_path / "meta.json").unlink()
    np.save(tmp_path / "experts.npy", np.full((1, 1, 2), -1, dtype=np.int32))
    with pytest.raises(TraceError, match="num_experts"):
        import_freetoken_dir(tmp_path, model="m")


def test_freetoken_export_removes_stale_files(tmp_path: Path) -> None:
    export_freetoken_dir(make_trace(4, logits=2), tmp_path)
    t = make_trace(5, weights=False, req=False)
    export_freetoken_dir(t, tmp_path)
    assert import_freetoken_dir(tmp_path) == t


def real(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"real trace {path} not present (it lives beside the checkout, not in it)")
    return path


def test_real_jsonl_reproduces_real_npz() -> None:
    raw, ref = real("mixtral-gsm8k.raw.jsonl"), load_trace(real("mixtral-gsm8k.npz"))
    with pytest.warns(TraceWarning, match=r"dropped 3 tokens .*\(request gsm8k/0, token 166, missing from layer 9\)"):
        t = import_jsonl(raw, model=ref.meta.model, num_experts=8)
    assert t.experts.shape == (244, 32, 1, 2) and t.meta.extra["dropped_tokens"] == 3
    assert np.array_equal(t.experts, ref.experts)
    assert np.array_equal(t.weights, ref.weights)
    assert np.array_equal(t.req_index, ref.req_index)


def test_jsonl_layer_index_is_bounded_before_allocating(tmp_path: Path) -> None:
    """One line with a huge layer index (the 11-line file that drove the CLI to ~21 GB) is
    refused at its line; the limit itself is a layer count, not an index."""
    records = [dict(GOOD, layer=layer) for layer in range(10)] + [dict(GOOD, layer=100_000_000)]
    with pytest.raises(TraceError, match=r":11: field 'layer' = 100000000 .* 0\.\.4095"):
        import_jsonl(write_jsonl(tmp_path / "t.jsonl", records), model="m")
    with pytest.raises(TraceError, match=r":1: field 'layer' = 4096"):
        import_jsonl(write_jsonl(tmp_path / "t.jsonl", [dict(GOOD, layer=MAX_LAYERS)]), model="m")


def test_jsonl_memory_follows_the_records_not_the_layer_count(tmp_path: Path) -> None:
    """500 requests and one record at the last legal layer: the importer must not keep a
    record set per (request, layer) (2 M sets, ~0.4 GB) before finding layers missing."""
    records = [dict(GOOD, problem_id=r) for r in range(500)] + [dict(GOOD, layer=MAX_LAYERS - 1)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=r"layer\(s\) \[1, 2, 3, 4, 5, 6, 7, 8\] and 4086 more"):
            import_jsonl(path, model="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6


def test_jsonl_huge_token_and_problem_ids_stay_sparse(tmp_path: Path) -> None:
    """token_idx and problem_id values only order the records; no array is indexed by them."""
    records = [dict(GOOD, problem_id=10**18, token_idx=t) for t in (10**15, 7)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    tracemalloc.start()
    try:
        t = import_jsonl(path, model="m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert t.experts.shape == (2, 1, 1, 2) and t.req_index.tolist() == [[0], [0]]
    assert peak < 5e6


@pytest.mark.parametrize("where", ["argument", "sidecar", "inferred"])
def test_jsonl_num_experts_is_bounded(tmp_path: Path, where: str) -> None:
    """num_experts from the caller, the sidecar or the largest id must keep L * E <= 2**24."""
    path = write_jsonl(tmp_path / "t.jsonl", [dict(GOOD, experts=[1, 2**31 - 1])
                                              if where == "inferred" else GOOD])
    kwargs = {"num_experts": MAX_KEYS + 1} if where == "argument" else {}
    if where == "sidecar":
        (tmp_path / "t.jsonl.meta.json").write_text(json.dumps({"num_experts": 2**29}))
    with pytest.raises(TraceError, match=r"num_experts.*16777216") as err:
        import_jsonl(path, model="m", **kwargs)
    if where == "inferred":
        assert "largest expert id 2147483647" in str(err.value)


def test_freetoken_meta_num_experts_is_bounded(tmp_path: Path) -> None:
    np.save(tmp_path / "experts.npy", np.array([[[1, 2]]], dtype=np.int32))
    (tmp_path / "meta.json").write_text(json.dumps({"model": "m", "num_experts": 2**29}))
    with pytest.raises(TraceError, match=r"meta\.json: .*num_experts = 1 x 536870912"):
        import_freetoken_dir(tmp_path)
    (tmp_path / "meta.json").unlink()
    np.save(tmp_path / "experts.npy", np.array([[[1, 2**31 - 2]]], dtype=np.int64))
    with pytest.raises(TraceError, match="largest expert id 2147483646"):
        import_freetoken_dir(tmp_path, model="m")


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def lying_npy(shape: tuple) -> bytes:
    """A .npy header declaring int32 `shape`, followed by only 8 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<i4", "fortran_order": False, "shape": shape})
    return buf.getvalue() + bytes(8)


FT_CORRUPT = {
    "random bytes": np.random.default_rng(1).bytes(300),
    "object array": _npy_bytes(np.array([None, {"a": 1}], dtype=object)),
    "truncated": _npy_bytes(np.zeros((4, 2, 2), dtype=np.int32))[:-5],
    "lying header": lying_npy((2**38, 1, 2)),  # 2 TiB of int32 declared over 8 bytes
    "bad header": b"\x93NUMPY\x01\x00\x10\x00{'descr': zz}  \n",
    "unclosed header": b"\x93NUMPY\x01\x00\x0c\x00{'shape': (3\n",  # numpy raises TokenError
}


@pytest.mark.parametrize("how", sorted(FT_CORRUPT))
def test_freetoken_corrupt_npy_is_a_trace_error(tmp_path: Path, how: str) -> None:
    """A damaged experts.npy names the file and np.save, never numpy's pickle advice, and no
    array is sized from a header that the file's bytes cannot back."""
    (tmp_path / "experts.npy").write_bytes(FT_CORRUPT[how])
    with pytest.raises(TraceError) as err:
        import_freetoken_dir(tmp_path, model="m", num_experts=8)
    message = str(err.value)
    assert str(tmp_path / "experts.npy") in message and "np.save" in message
    assert "pickle" not in message.lower()


def test_default_model_only_fills_a_missing_model(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    assert import_jsonl(path, default_model="stem").meta.model == "stem"
    (tmp_path / "t.jsonl.meta.json").write_text(json.dumps({"model": "Mixtral-8x7B"}))
    assert import_jsonl(path, default_model="stem").meta.model == "Mixtral-8x7B"
    assert import_jsonl(path, model="given", default_model="stem").meta.model == "given"
    np.save(tmp_path / "experts.npy", np.array([[[1, 2]]], dtype=np.int32))
    assert import_freetoken_dir(tmp_path, default_model="dir").meta.model == "dir"
