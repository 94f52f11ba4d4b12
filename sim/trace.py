"""Routing traces: the `expertcache-trace/1` file format and its in-memory form.

Data flow:
    .npz file --load_trace--> Trace --> replay, oracles, reports
    Trace --save_trace--> .npz file;  Trace --slice_tokens / concat_traces--> Trace

File (one .npz, written with np.savez_compressed; read by sim.archive: no pickle, every array's
size checked against the bytes stored before it is allocated):
    experts    int32   [N, L, k] or [N, L, B, k]  routed expert ids per (decode step, layer[, batch
                                                  row]) in token-major decode order; -1 = padding
    weights    float32 same shape as experts      optional router weights of those experts
    req_index  int32   [N] or [N, B]              optional request of each (step[, row]); -1 = none
    logit_idx  int32   [N, L, T] / [N, L, B, T]   optional top-T router logits: expert ids (T >= 1)
    logit_val  float32 same shape as logit_idx    ... and their values (both arrays or neither)
    meta       0-d unicode string holding a JSON object: format, model, num_layers, num_experts,
               top_k, expert_bytes (int or null), phase, source, license, and any other keys;
               optional hidden_size and moe_intermediate_size (H, I of one routed expert,
               both or neither) let the simulator price expert formats (sim/budget.py).
Arrays with other names are ignored on load and not written back.

In memory a Trace always holds the 4-D form (experts [N, L, B, k], req_index [N, B]); a file
with 3-D experts loads with B = 1, and save_trace writes B == 1 traces in the 3-D form.
A trace may have N = 0 decode steps (a slice can be empty); replaying one is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from expertcache.formats import FormatError, format_names, get_format
from expertcache.geometry import distinct_counts
from sim.archive import read_npz
from sim.errors import TraceError

FORMAT = "expertcache-trace/1"
REQUIRED_META_KEYS = ("format", "model", "num_layers", "num_experts", "top_k", "expert_bytes",
                      "phase", "source", "license")
OPTIONAL_ARRAYS = ("weights", "req_index", "logit_idx", "logit_val")
# Optional meta keys (kept in TraceMeta.extra): one routed expert's hidden size H and intermediate
# size I, gate_up [2I, H] + down [H, I]. With them, expert_bytes must be the bytes of that expert in
# one of the expert formats (expertcache.formats), bf16 for a bf16 model.
SHAPE_KEYS = ("hidden_size", "moe_intermediate_size")
# Size limits of meta, checked before anything is sized from it: a cache of the trace keeps
# per-key policy state (12-31 bytes a key for lru, lfuda and rule) and per-slot arrays for up to
# L*E slots, and the JSON-lines importer keeps records per layer. Real MoE models are far below
# both: Qwen3-Next has 48 x 512 = 24,576 keys, DeepSeek-V3 58 x 256 = 14,848, Mixtral 32 x 8.
MAX_LAYERS = 4096  # meta.num_layers; a JSON-lines 'layer' index must be below it
MAX_KEYS = 2**24  # meta.num_layers * meta.num_experts: 16.7 M keys, about 0.5 GiB of cache state
DTYPES = {"experts": np.int32, "weights": np.float32, "req_index": np.int32,
          "logit_idx": np.int32, "logit_val": np.float32}


def format_bytes(hidden: int, intermediate: int) -> dict[str, int]:
    """Bytes of one expert [2I, H] + [H, I] in each expert format, bf16 first; a format that cannot
    store the shape (in_features not a multiple of its block) is left out. No torch needed."""
    out = {}
    for name in sorted(format_names(), key=lambda n: (n != "bf16", n)):
        try:
            out[name] = get_format(name).expert_bytes(hidden, intermediate)
        except FormatError:
            continue
    return out


def _prefix(path: str | os.PathLike | None) -> str:
    return f"{path}: " if path else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class TraceMeta:
    """The JSON `meta` of a trace. `extra` holds every other key, kept on a round trip."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int | None
    phase: str
    source: str
    license: str
    extra: dict = field(default_factory=dict)

    @property
    def expert_shape(self) -> tuple[int, int] | None:
        """(hidden_size, moe_intermediate_size) from the optional meta keys, or None without them."""
        if not all(k in self.extra for k in SHAPE_KEYS):
            return None
        return int(self.extra["hidden_size"]), int(self.extra["moe_intermediate_size"])

    def to_dict(self) -> dict[str, Any]:
        """The meta as a JSON-ready dict: `format` and the required keys first, then `extra`."""
        d: dict[str, Any] = {"format": FORMAT, "model": self.model,
                             "num_layers": int(self.num_layers),
                             "num_experts": int(self.num_experts), "top_k": int(self.top_k),
                             "expert_bytes": None if self.expert_bytes is None
                             else int(self.expert_bytes),
                             "phase": self.phase, "source": self.source, "license": self.license}
        for key, value in self.extra.items():
            d.setdefault(key, value)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "") -> TraceMeta:
        """A checked TraceMeta from a parsed meta object. Raises TraceError naming the key."""
        missing = [k for k in REQUIRED_META_KEYS if k not in d]
        if missing:
            raise TraceError(f"{_prefix(path)}meta is missing required key(s) {missing}: add "
                             f"them to the meta JSON (expert_bytes may be null)")
        if d["format"] != FORMAT:
            raise TraceError(f"{_prefix(path)}meta.format is {d['format']!r}, expected "
                             f"{FORMAT!r}: convert the trace with sim.importers / sim.jsonl or fix 'format'")
        known = {k: d[k] for k in REQUIRED_META_KEYS if k != "format"}
        meta = cls(**known, extra={k: v for k, v in d.items() if k not in REQUIRED_META_KEYS})
        meta.validate(path)
        return meta

    @classmethod
    def from_json(cls, s: str, path: str = "") -> TraceMeta:
        """Parse and check a meta JSON string; `path` only labels error messages."""
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(f"{_prefix(path)}meta is not valid JSON ({e}): store meta as a 0-d "
                             f"string holding one JSON object") from None
        if not isinstance(d, dict):
            raise TraceError(f"{_prefix(path)}meta JSON is a {type(d).__name__}, not an object: "
                             f"store one JSON object with the keys {list(REQUIRED_META_KEYS)}")
        return cls.from_dict(d, path)

    def _validate_size(self, p: str) -> None:
        """Raise TraceError when num_layers or the key count L * E is over MAX_LAYERS / MAX_KEYS."""
        L, E = int(self.num_layers), int(self.num_experts)  # Python ints: L * E cannot wrap
        if L > MAX_LAYERS:
            raise TraceError(f"{p}meta.num_layers is {L}, over the limit of {MAX_LAYERS} MoE "
                             f"layers (real models have under 100): fix meta.num_layers")
        if L * E > MAX_KEYS:
            raise TraceError(f"{p}meta.num_layers * meta.num_experts = {L} x {E} = {L * E} keys, "
                             f"over the limit of {MAX_KEYS} (2**24; Qwen3-Next has 48 x 512 = "
                             f"24,576): fix meta.num_experts, the routed experts per layer")

    def validate(self, path: str = "") -> None:
        """Check every field's type and range. Raises TraceError naming the field."""
        p = _prefix(path)
        for key in ("model", "phase", "source", "license"):
            if not isinstance(getattr(self, key), str):
                raise TraceError(f"{p}meta.{key} must be a string, got "
                                 f"{getattr(self, key)!r}: set it to a string")
        if not self.model:
            raise TraceError(f"{p}meta.model is empty: name the model the trace was recorded on")
        for key in ("num_layers", "num_experts", "top_k"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise TraceError(f"{p}meta.{key} must be an integer >= 1, got {value!r}: fix it")
        self._validate_size(p)
        eb = self.expert_bytes
        if eb is not None and (not _is_int(eb) or eb < 1):
            raise TraceError(f"{p}meta.expert_bytes must be null or an integer >= 1 (bytes of "
                             f"one routed expert), got {eb!r}: fix it or set it to null")
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise TraceError(f"{p}meta.extra must be a dict with string keys: fix it")
        clash = [k for k in self.extra if k in REQUIRED_META_KEYS]
        if clash:
            raise TraceError(f"{p}meta.extra repeats required key(s) {clash}: set them as "
                             f"TraceMeta fields, not in extra")
        try:
            json.dumps(self.extra)
        except (TypeError, ValueError) as e:
            raise TraceError(f"{p}meta.extra is not JSON-serialisable ({e}): keep only JSON "
                             f"values (str, int, float, bool, None, list, dict) in it") from None
        self._validate_shape(p)

    def _validate_shape(self, p: str) -> None:
        """Check the optional SHAPE_KEYS: both or neither, integers >= 1, and expert_bytes (when
        set) the bytes of such an expert in some expert format. Raises TraceError naming the key."""
        have = [k for k in SHAPE_KEYS if k in self.extra]
        if not have:
            return
        if len(have) == 1:
            lack = SHAPE_KEYS[1 - SHAPE_KEYS.index(have[0])]
            raise TraceError(f"{p}meta.{have[0]} is set without meta.{lack}: give both (one routed "
                             f"expert is gate_up [2I, H] + down [H, I]) or neither")
        for key in SHAPE_KEYS:
            value = self.extra[key]
            if not _is_int(value) or value < 1:
                raise TraceError(f"{p}meta.{key} must be an integer >= 1, got {value!r}: fix it")
        if self.expert_bytes is None:
            return
        hidden, inter = self.expert_shape  # type: ignore[misc]
        sizes = format_bytes(hidden, inter)
        if self.expert_bytes not in sizes.values():
            known = ", ".join(f"{name} {b:,}" for name, b in sizes.items())
            raise TraceError(f"{p}meta.expert_bytes is {self.expert_bytes:,}, which no expert format "
                             f"gives for hidden_size {hidden}, moe_intermediate_size {inter} "
                             f"({known}): fix meta.expert_bytes (or set it to null) or the two "
                             f"shape keys")


def _check_array(name: str, a: Any) -> np.ndarray:
    want = np.dtype(DTYPES[name])
    if not isinstance(a, np.ndarray):
        raise TraceError(f"{name} must be a numpy array, got {type(a).__name__}: wrap it with "
                         f"np.asarray(..., dtype=np.{want.name})")
    if a.dtype != want:
        raise TraceError(f"{name} has dtype {a.dtype}, expected {want.name}: cast it with "
                         f"{name}.astype(np.{want.name}) after checking the values fit")
    return a


def _check_ids(name: str, a: np.ndarray, num_experts: int, lo: int = -1) -> None:
    """Raise TraceError naming the first entry of `a` outside [lo, num_experts)."""
    if a.size == 0 or (a.min() >= lo and a.max() < num_experts):
        return
    where = tuple(int(i) for i in np.argwhere((a < lo) | (a >= num_experts))[0])
    value = int(a[where])
    fix = (f"use ids >= 0 ({lo} pads)" if value < lo
           else f"fix the id or set meta.num_experts to at least {value + 1}")
    raise TraceError(f"{name}[{', '.join(map(str, where))}] = {value} is outside "
                     f"[{lo}, {num_experts}): {fix}")


def _check_distinct(name: str, experts: np.ndarray) -> None:
    """Raise TraceError naming the first (token, layer, row) that repeats a valid expert id."""
    s = np.sort(experts, axis=-1)
    dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(axis=-1)
    if dup.any():
        n, l, b = (int(i) for i in np.argwhere(dup)[0])
        raise TraceError(f"{name}[{n}, {l}, {b}] = {experts[n, l, b].tolist()} repeats an expert "
                         f"id (token {n}, layer {l}, row {b}): one token's k choices must be "
                         f"distinct; replace repeats with -1")


def _as_4d(experts: Any, others: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Add the B = 1 axis to 3-D experts (and 3-D weights/logits, 1-D req_index)."""
    if isinstance(experts, np.ndarray) and experts.ndim == 3:
        experts = experts[:, :, None, :]
        others = {k: (v[:, :, None, :] if k != "req_index" and isinstance(v, np.ndarray)
                      and v.ndim == 3 else v) for k, v in others.items()}
    r = others.get("req_index")
    if (isinstance(r, np.ndarray) and r.ndim == 1 and isinstance(experts, np.ndarray)
            and experts.ndim == 4 and experts.shape[2] == 1):
        others = {**others, "req_index": r[:, None]}
    return experts, others


@dataclass(frozen=True, eq=False)
class Trace:
    """A routing trace in decode order. 3-D inputs ([N, L, k], req_index [N]) gain B = 1.

    experts int32 [N, L, B, k] (-1 = padding); weights float32 like experts; req_index int32
    [N, B]; logit_idx int32 / logit_val float32 [N, L, B, T]. Equality compares every array
    exactly (dtype, shape, values) and the meta.
    """

    experts: np.ndarray
    meta: TraceMeta
    weights: np.ndarray | None = None
    req_index: np.ndarray | None = None
    logit_idx: np.ndarray | None = None
    logit_val: np.ndarray | None = None

    def __post_init__(self) -> None:
        experts, others = _as_4d(self.experts, {k: getattr(self, k) for k in OPTIONAL_ARRAYS})
        object.__setattr__(self, "experts", experts)
        for key, value in others.items():
            object.__setattr__(self, key, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        if self.meta != other.meta:
            return False
        for key in ("experts",) + OPTIONAL_ARRAYS:
            a, b = getattr(self, key), getattr(other, key)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or not np.array_equal(
                    a, b, equal_nan=a.dtype.kind == "f")):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def batch(self) -> int:
        return int(self.experts.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[3])

    @property
    def num_experts(self) -> int:
        return int(self.meta.num_experts)

    @property
    def accesses(self) -> int:
        """Sum over (token, layer) of the number of distinct valid ids among its B*k entries."""
        n, layers = self.experts.shape[:2]
        if n * layers == 0:  # distinct_counts cannot reshape an empty array with -1
            return 0
        return int(distinct_counts(self.experts.reshape(n * layers, -1)).sum())

    def validate(self) -> None:
        """Check dtypes, shapes, id ranges, distinct choices and meta. Raises TraceError."""
        if not isinstance(self.meta, TraceMeta):
            raise TraceError(f"meta must be a TraceMeta, got {type(self.meta).__name__}: build "
                             f"one with TraceMeta(...) or TraceMeta.from_json")
        self.meta.validate()
        e = _check_array("experts", self.experts)
        if e.ndim != 4:
            raise TraceError(f"experts must be [N, L, k] or [N, L, B, k] (ndim 3 or 4), got shape "
                             f"{e.shape}: reshape it to token-major [N, L, B, k]")
        n, l, b, k = e.shape
        if min(l, b, k) < 1:
            raise TraceError(f"experts shape {e.shape} has an empty layer, batch or top-k axis: "
                             f"L, B and k must be >= 1")
        for key, have in (("num_layers", l), ("top_k", k)):
            if getattr(self.meta, key) != have:
                raise TraceError(f"meta.{key} is {getattr(self.meta, key)} but experts has {have} "
                                 f"(shape {e.shape}): set meta.{key} to {have} or fix the array")
        _check_ids("experts", e, self.meta.num_experts)
        _check_distinct("experts", e)
        self._validate_optional()

    def _validate_optional(self) -> None:
        shape = self.experts.shape
        if self.weights is not None and _check_array("weights", self.weights).shape != shape:
            raise TraceError(f"weights has shape {self.weights.shape} but experts has {shape}: "
                             f"give one weight per expert entry, or drop weights")
        if self.req_index is not None:
            r = _check_array("req_index", self.req_index)
            if r.shape != shape[:1] + shape[2:3]:
                raise TraceError(f"req_index has shape {r.shape}, expected [N, B] = "
                                 f"{shape[:1] + shape[2:3]} (or [N] when B == 1): fix or drop it")
            if r.size and r.min() < -1:
                where = tuple(int(i) for i in np.argwhere(r < -1)[0])
                raise TraceError(f"req_index[{', '.join(map(str, where))}] = {int(r[where])} is "
                                 f"below -1: use request numbers >= 0 (-1 = no request)")
        if (self.logit_idx is None) != (self.logit_val is None):
            have, lack = (("logit_idx", "logit_val") if self.logit_val is None
                          else ("logit_val", "logit_idx"))
            raise TraceError(f"{have} is present without {lack}: store both top-T logit arrays "
                             f"or neither")
        if self.logit_idx is not None:
            li, lv = _check_array("logit_idx", self.logit_idx), _check_array("logit_val",
                                                                             self.logit_val)
            if li.ndim != 4 or li.shape[:3] != shape[:3] or li.shape[3] < 1:
                raise TraceError(f"logit_idx has shape {li.shape}, expected [N, L, B, T] with "
                                 f"[N, L, B] = {shape[:3]} and T >= 1: fix or drop the logits")
            if lv.shape != li.shape:
                raise TraceError(f"logit_val has shape {lv.shape} but logit_idx has {li.shape}: "
                                 f"both logit arrays must have one shape")
            _check_ids("logit_idx", li, self.meta.num_experts)

    def arrays(self) -> dict[str, np.ndarray]:
        """The present arrays by file name, 4-D form."""
        out = {"experts": self.experts}
        out.update({k: getattr(self, k) for k in OPTIONAL_ARRAYS if getattr(self, k) is not None})
        return out

    def slice_tokens(self, start: int | None, stop: int | None) -> Trace:
        """Decode steps [start, stop) (Python slice rules) of every array; same meta; views."""
        sl = slice(start, stop)
        return replace(self, **{k: v[sl] for k, v in self.arrays().items()})


def concat_traces(traces: Iterable[Trace]) -> Trace:
    """Traces joined along the token axis; meta of the first. req_index is kept as is.

    Raises TraceError when the list is empty, or model, geometry, expert_bytes, batch, the set
    of optional arrays or the logit width T differ.
    """
    ts = list(traces)
    if not ts:
        raise TraceError("concat_traces got no traces: pass at least one Trace")
    first = ts[0]
    for i, t in enumerate(ts[1:], 1):
        for key in ("model", "num_layers", "num_experts", "top_k", "expert_bytes"):
            if getattr(t.meta, key) != getattr(first.meta, key):
                raise TraceError(f"traces[{i}].meta.{key} is {getattr(t.meta, key)!r} but "
                                 f"traces[0] has {getattr(first.meta, key)!r}: concatenate "
                                 f"traces of one model and geometry only")
        if t.batch != first.batch:
            raise TraceError(f"traces[{i}] has batch B={t.batch} but traces[0] has "
                             f"B={first.batch}: concatenate traces of one batch width only")
        for key in OPTIONAL_ARRAYS:
            if (getattr(t, key) is None) != (getattr(first, key) is None):
                state = "absent" if getattr(t, key) is None else "present"
                raise TraceError(f"traces[{i}].{key} is {state} but not in traces[0]: give every "
                                 f"trace {key} or drop it from all (replace(t, {key}=None))")
        if first.logit_idx is not None and t.logit_idx.shape[3] != first.logit_idx.shape[3]:
            raise TraceError(f"traces[{i}].logit_idx has T={t.logit_idx.shape[3]} but traces[0] "
                             f"has T={first.logit_idx.shape[3]}: keep one logit width")
    joined = {k: np.concatenate([t.arrays()[k] for t in ts]) for k in first.arrays()}
    out = replace(first, **joined)
    out.validate()
    return out


def _read_npz(p: Path) -> tuple[dict[str, np.ndarray], str]:
    """The known arrays and the meta text of an .npz file. Raises TraceError."""
    arrays = read_npz(p, ("experts", "meta") + OPTIONAL_ARRAYS)
    for key in ("experts", "meta"):
        if key not in arrays:
            hint = ("experts int32 [N, L, k]" if key == "experts"
                    else "meta=np.array(json.dumps({...}))")
            raise TraceError(f"{p}: missing array '{key}': add {hint} (format {FORMAT})")
    m = arrays.pop("meta")
    if m.ndim != 0 or m.dtype.kind not in "US":
        raise TraceError(f"{p}: meta must be a 0-d string array holding JSON, got dtype "
                         f"{m.dtype} shape {m.shape}: store np.array(meta_json_string)")
    text = m.item()
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{p}: meta bytes are not UTF-8 ({e.reason} at byte {e.start}): "
                             f"store meta as a unicode string, np.array(meta_json)") from None
    return arrays, text


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file. 3-D files load with B = 1.

    Raises TraceError (naming the file and the field) for a missing, unreadable or damaged file
    (sim.archive: not a zip, a damaged member, an object array, a header larger than its data),
    missing `experts`/`meta`, bad meta (sizes over MAX_LAYERS / MAX_KEYS included), wrong
    dtype, shape or ndim, ids outside [-1, num_experts),
    meta/array disagreement, repeated ids in one row, or one logit array without the other.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such file: check the path (a trace is one .npz file)")
    arrays, text = _read_npz(p)
    meta = TraceMeta.from_json(text, path=str(p))
    experts = arrays.pop("experts")
    if experts.ndim not in (3, 4):
        raise TraceError(f"{p}: experts must be [N, L, k] or [N, L, B, k] (ndim 3 or 4), got "
                         f"shape {experts.shape}: reshape it to token-major order")
    trace = Trace(experts=experts, meta=meta, **arrays)
    try:
        trace.validate()
    except TraceError as e:
        raise TraceError(f"{p}: {e}") from None
    return trace


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Validate and write `trace` to exactly `path` (np.savez_compressed; no suffix added).

    B == 1 traces are written in the 3-D form ([N, L, k], req_index [N]); others in 4-D.
    Raises TraceError when the trace does not validate.
    """
    trace.validate()
    arrays = trace.arrays()
    if trace.batch == 1:
        arrays = {k: v[:, 0] if k == "req_index" else v[:, :, 0] for k, v in arrays.items()}
    with open(path, "wb") as f:
        np.savez_compressed(f, meta=np.array(trace.meta.to_json()), **arrays)
