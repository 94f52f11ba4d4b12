"""Importers and exporters between other routing-trace layouts and `expertcache-trace/1`: the FreeToken
directory here, JSON lines in sim/jsonl.py, and the meta both build.

Data flow (every import returns a validated Trace with B = 1; every export takes B == 1 only):
    FreeToken directory: experts.npy [N, L, K] (any int dtype), optional weights.npy [N, L, K]
        (float), logit_idx.npy (int) / logit_val.npy (float) [N, L, T], req_index.npy [N] (int),
        meta.json  --import_freetoken_dir-->  Trace  --export_freetoken_dir-->  same directory
    stored meta keys + arguments + the arrays  --build_meta-->  TraceMeta (num_experts inferred
        from the largest id when neither gives it)
Integer arrays become int32 (range-checked), float arrays float32. Errors are TraceError naming
the file and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sim.archive import read_npy
from sim.trace import FORMAT, MAX_KEYS, Trace, TraceError, TraceMeta, _check_distinct, _check_ids

INT32 = np.iinfo(np.int32)
# FreeToken file per Trace field: (file name, "i"nteger or "f"loat, ndim)
_FT_FILES = {"experts": ("experts.npy", "i", 3), "weights": ("weights.npy", "f", 3),
             "req_index": ("req_index.npy", "i", 1), "logit_idx": ("logit_idx.npy", "i", 3),
             "logit_val": ("logit_val.npy", "f", 3)}


def read_meta_json(path: Path) -> dict[str, Any]:
    """The JSON object stored at `path`, or {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not valid JSON ({e}): fix or remove the file") from None
    if not isinstance(d, dict):
        raise TraceError(f"{path}: holds a {type(d).__name__}, not a JSON object: store the "
                         f"trace meta as one object")
    return d


def build_meta(base: dict[str, Any], args: dict[str, Any], arrays: dict[str, np.ndarray], *,
                default_source: str, where: str, default_model: str | None = None,
                dropped: int = 0) -> TraceMeta:
    """Meta from stored keys, then arguments that are not None (license only when not
    "unknown"), then defaults; num_experts, when neither gives it, is max id + 1 (flagged)."""
    d = {k: v for k, v in base.items() if k != "format"}
    d.update({k: v for k, v in args.items() if v is not None and (k, v) != ("license", "unknown")})
    if "model" not in d and default_model is None:
        raise TraceError(f"{where}: model unknown: pass model=... or add 'model' to the meta JSON")
    if "num_experts" not in d:
        ids = [arrays[k] for k in ("experts", "logit_idx") if k in arrays]
        top = max((int(a.max()) for a in ids if a.size), default=-1)
        if top < 0:
            raise TraceError(f"{where}: no valid expert id to infer num_experts from: pass "
                             f"num_experts=... or add 'num_experts' to the meta JSON")
        keys = arrays["experts"].shape[1] * (top + 1)
        if keys > MAX_KEYS:
            raise TraceError(f"{where}: the largest expert id {top} makes num_experts {top + 1} "
                             f"and L * E = {keys} keys, over the limit of {MAX_KEYS}: fix the "
                             f"ids or give num_experts in the meta JSON")
        d.update(num_experts=top + 1, num_experts_inferred=True)
    if dropped:
        d["dropped_tokens"] = dropped
    e = arrays["experts"]
    defaults = {"model": default_model, "num_layers": e.shape[1], "top_k": e.shape[-1],
                "expert_bytes": None, "phase": "decode", "source": default_source, "license": "unknown"}
    for key, value in defaults.items():
        d.setdefault(key, value)
    d["format"] = FORMAT
    return TraceMeta.from_dict(d, where)


def finish_import(trace: Trace, where: str) -> Trace:
    try:
        trace.validate()
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None
    return trace


def _load_npy(path: Path, kind: str, ndim: int) -> np.ndarray:
    """One FreeToken array as int32 ("i") or float32 ("f"), checked. Raises TraceError."""
    a = read_npy(path, "save the array alone with np.save")
    if a.ndim != ndim:
        want = {1: "[N]", 3: "[N, L, T]" if path.name.startswith("logit") else "[N, L, K]"}
        raise TraceError(f"{path}: expected {want[ndim]}, got shape {a.shape}: reshape it")
    if kind == "f":
        if a.dtype.kind != "f":
            raise TraceError(f"{path}: dtype {a.dtype} is not a float type: save floats")
        return a.astype(np.float32)
    if a.dtype.kind not in "iu":
        raise TraceError(f"{path}: dtype {a.dtype} is not an integer type: save integers "
                         f"(any int dtype)")
    if a.size and (int(a.min()) < -1 or int(a.max()) > INT32.max):
        raise TraceError(f"{path}: values span [{int(a.min())}, {int(a.max())}], outside "
                         f"[-1, {INT32.max}]: ids are >= 0 with -1 as padding")
    return a.astype(np.int32)


def _check_freetoken_shapes(d: Path, arrays: dict[str, np.ndarray]) -> None:
    n, l, k = arrays["experts"].shape
    for key, shape in (("weights", (n, l, k)), ("req_index", (n,))):
        if key in arrays and arrays[key].shape != shape:
            raise TraceError(f"{d / _FT_FILES[key][0]}: shape {arrays[key].shape}, expected "
                             f"{shape} to match experts.npy {(n, l, k)}: fix or remove the file")
    if ("logit_idx" in arrays) != ("logit_val" in arrays):
        have, lack = ("logit_idx", "logit_val") if "logit_idx" in arrays else ("logit_val",
                                                                               "logit_idx")
        raise TraceError(f"{d / _FT_FILES[lack][0]}: missing while {_FT_FILES[have][0]} exists: "
                         f"write both logit files or neither")
    if "logit_idx" in arrays:
        li, lv = arrays["logit_idx"], arrays["logit_val"]
        if li.shape[:2] != (n, l) or li.shape[2] < 1:
            raise TraceError(f"{d / 'logit_idx.npy'}: shape {li.shape}, expected [N, L, T] with "
                             f"[N, L] = {(n, l)} and T >= 1: fix or remove the logit files")
        if lv.shape != li.shape:
            raise TraceError(f"{d / 'logit_val.npy'}: shape {lv.shape} differs from "
                             f"logit_idx.npy {li.shape}: write both with one shape")


def import_freetoken_dir(path: str | os.PathLike, *, model: str | None = None,
                         num_experts: int | None = None, expert_bytes: int | None = None,
                         source: str | None = None, license: str = "unknown",
                         default_model: str | None = None) -> Trace:
    """A FreeToken-style trace directory as a Trace (B = 1, phase "decode" unless meta.json says).

    Meta keys come from meta.json where present; arguments that are not None override them
    (license only when not left at "unknown"); default_model names the model when neither
    does. num_experts: argument, meta.json, else max id + 1 with
    meta.extra["num_experts_inferred"] = True. Raises TraceError naming the file.
    """
    d = Path(path)
    if not d.is_dir():
        raise TraceError(f"{d}: not a directory: pass the trace directory holding experts.npy")
    if not (d / "experts.npy").is_file():
        raise TraceError(f"{d / 'experts.npy'}: missing: a FreeToken trace directory needs "
                         f"experts.npy [N, L, K]")
    arrays = {key: _load_npy(d / name, kind, ndim) for key, (name, kind, ndim)
              in _FT_FILES.items() if (d / name).is_file()}
    _check_freetoken_shapes(d, arrays)
    base = read_meta_json(d / "meta.json")
    args = dict(model=model, num_experts=num_experts, expert_bytes=expert_bytes, source=source,
                license=license)
    meta = build_meta(base, args, arrays, default_source=f"freetoken:{d.name}",
                       default_model=default_model, where=str(d / "meta.json") if base else str(d))
    for key in ("experts", "logit_idx"):
        if key in arrays:
            _check_ids(str(d / _FT_FILES[key][0]), arrays[key], meta.num_experts)
    _check_distinct(str(d / "experts.npy"), arrays["experts"][:, :, None, :])
    return finish_import(Trace(meta=meta, **arrays), str(d))


def export_freetoken_dir(trace: Trace, path: str | os.PathLike) -> None:
    """Write a B == 1 trace as a FreeToken directory (created if needed), meta.json included.

    Optional files the trace lacks are removed from the directory so a re-import is exact.
    Raises TraceError when the trace does not validate or has B > 1.
    """
    trace.validate()
    if trace.batch != 1:
        raise TraceError(f"trace has batch B={trace.batch}: the FreeToken layout holds one "
                         f"sequence per step; export one batch row at a time (B == 1)")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    arrays = trace.arrays()
    for key, (name, _, _) in _FT_FILES.items():
        if key in arrays:
            np.save(d / name, arrays[key][:, 0] if key == "req_index" else arrays[key][:, :, 0])
        else:
            (d / name).unlink(missing_ok=True)
    (d / "meta.json").write_text(json.dumps(trace.meta.to_dict(), indent=2) + "\n",
                                 encoding="utf-8")
