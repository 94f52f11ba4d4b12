"""JSON lines: one routing record per (request, layer, token), to and from `expertcache-trace/1`.

    FILE.jsonl, one object a line, e.g.
        {"dataset": "gsm8k", "problem_id": 0, "layer": 3, "experts": [7, 0],
         "gating_probs": [0.8, 0.2], "token_idx": 12}
      (+ optional sidecar FILE.jsonl.meta.json: the trace meta)
    --import_jsonl--> records by (request, layer, token) --> tokens with a record in every layer
        (the others dropped, with a TraceWarning naming them) --> Trace (B = 1)
    Trace --export_jsonl--> the same layout (+ sidecar)

FIELDS_HELP lists the fields a record may have; any other is refused. Errors are TraceError naming
the file, line and field and the fix.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expertcache.words import counted
from sim.errors import TraceWarning
from sim.importers import INT32, build_meta, finish_import, read_meta_json
from sim.trace import MAX_LAYERS, Trace, TraceError, _is_int

FIELDS_HELP = """\
JSON-lines traces (FILE.jsonl): one object per (request, layer, token), e.g.
  {"dataset": "gsm8k", "problem_id": 0, "layer": 3, "token_idx": 12, "experts": [7, 0], "gating_probs": [0.8, 0.2]}
  layer         integer >= 0, required: the MoE layer; L = the highest layer + 1
  token_idx     integer >= 0, required: the token's position in its request
  experts       list of integers, required: the routed expert ids, -1 pads (one length on every line)
  problem_id    integer or string, optional: the request; requests replay one after another, in the
                order of their first line (without it, one request)
  dataset       integer or string, optional: with problem_id, the request is (dataset, problem_id)
  gating_probs  list of numbers, optional: the router weights of `experts`
  logit_idx     list of integers, optional, with logit_val: top-T router logits' expert ids
  logit_val     list of numbers, optional, with logit_idx: their values (rule's near-miss refresh)
Any other field is refused. Every line has the same fields; a token without a record in every layer
is dropped, with a warning naming it. FILE.jsonl.meta.json, when present, holds the meta (model,
num_experts, expert_bytes, hidden_size, moe_intermediate_size, source, license, ...)."""
# Names a log may give a field of this layout, and which field they mean (JsonlKeys attribute): the
# error that refuses them says which field to rename them to.
_LIKELY = {"request": "request", "request_id": "request", "req": "request", "req_id": "request",
           "seq": "request", "seq_id": "request", "sequence_id": "request", "sample_id": "request",
           "prompt_id": "request", "token": "token", "position": "token", "pos": "token",
           "layer_idx": "layer", "layer_id": "layer", "expert_ids": "experts", "topk_ids": "experts",
           "selected_experts": "experts", "weights": "weights", "probs": "weights",
           "routing_weights": "weights", "topk_weights": "weights"}


@dataclass(frozen=True)
class JsonlKeys:
    """Field names of the JSONL layout."""

    request: str = "problem_id"
    dataset: str = "dataset"
    layer: str = "layer"
    token: str = "token_idx"
    experts: str = "experts"
    weights: str = "gating_probs"
    logit_idx: str = "logit_idx"
    logit_val: str = "logit_val"


@dataclass(frozen=True)
class _Cell:
    """One parsed JSONL record's payload."""

    line: int
    experts: list
    weights: list | None
    logit_idx: list | None
    logit_val: list | None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def _jsonl_int(obj: dict, key: str, where: str) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field '{key}': every line needs it")
    if not _is_int(obj[key]) or obj[key] < 0:
        raise TraceError(f"{where}: field '{key}' = {obj[key]!r} is not an integer >= 0: fix it")
    return obj[key]

def _jsonl_list(obj: dict, key: str, where: str, ints: bool) -> list:
    if key not in obj:
        raise TraceError(f"{where}: missing field '{key}': every line needs it")
    v = obj[key]
    ok = (_is_int if ints else lambda x: isinstance(x, (int, float)) and not isinstance(x, bool))
    if not isinstance(v, list) or not v or not all(ok(x) for x in v):
        raise TraceError(f"{where}: field '{key}' must be a non-empty list of "
                         f"{'integers' if ints else 'numbers'}, got {str(v)[:80]}: fix the line")
    if ints and (min(v) < -1 or max(v) > INT32.max):
        raise TraceError(f"{where}: field '{key}' = {v} holds an id outside [-1, {INT32.max}]: "
                         f"ids are >= 0, -1 pads")
    return v

def _check_fields(obj: dict, keys: JsonlKeys, where: str) -> None:
    """Raise TraceError naming the fields of `obj` this layout does not read, and the ones it does."""
    known = vars(keys)
    unknown = [k for k in obj if k not in known.values()]
    if not unknown:
        return
    meant = [(k, known[_LIKELY[k]]) for k in unknown if k in _LIKELY]
    fix = (f"if '{meant[0][0]}' is the {meant[0][1]} field, rename it '{meant[0][1]}' on every line" if meant
           else f"drop it from every line (e.g. jq -c 'del(.{unknown[0]})') or rename it to one of those")
    raise TraceError(f"{where}: field{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)} "
                     f"{'are' if len(unknown) > 1 else 'is'} not read by this layout, whose fields are "
                     f"{', '.join(known.values())}: {fix} (expertcache sim --help lists what each means)")


def _parse_record(obj: dict, keys: JsonlKeys, where: str, line: int) -> tuple[tuple, _Cell, tuple]:
    """((request, layer, token), payload, form) of one JSONL object; form = present fields."""
    _check_fields(obj, keys, where)
    for key in (keys.request, keys.dataset):
        if key in obj and not (isinstance(obj[key], str) or _is_int(obj[key])):
            raise TraceError(f"{where}: field '{key}' = {obj[key]!r} must be a string or an "
                             f"integer: fix the line")
    has_ds = keys.dataset in obj
    rid = (obj[keys.dataset], obj.get(keys.request)) if has_ds else obj.get(keys.request)
    layer, tok = _jsonl_int(obj, keys.layer, where), _jsonl_int(obj, keys.token, where)
    if layer >= MAX_LAYERS:
        raise TraceError(f"{where}: field '{keys.layer}' = {layer} is over the limit: layer "
                         f"indices run 0..{MAX_LAYERS - 1} (real models have under 100 MoE "
                         f"layers): fix the line, or the layer key if '{keys.layer}' is another "
                         f"field")
    experts = _jsonl_list(obj, keys.experts, where, ints=True)
    valid = [x for x in experts if x >= 0]
    if len(set(valid)) != len(valid):
        raise TraceError(f"{where}: field '{keys.experts}' = {experts} repeats an expert id: one "
                         f"token's choices must be distinct (pad with -1)")
    weights = _jsonl_list(obj, keys.weights, where, ints=False) if keys.weights in obj else None
    if weights is not None and len(weights) != len(experts):
        raise TraceError(f"{where}: field '{keys.weights}' has {len(weights)} entries but "
                         f"'{keys.experts}' has {len(experts)}: give one weight per expert")
    if (keys.logit_idx in obj) != (keys.logit_val in obj):
        have, lack = ((keys.logit_idx, keys.logit_val) if keys.logit_idx in obj
                      else (keys.logit_val, keys.logit_idx))
        raise TraceError(f"{where}: field '{lack}' is missing while '{have}' is present: give "
                         f"both logit fields or neither")
    li = lv = None
    if keys.logit_idx in obj:
        li = _jsonl_list(obj, keys.logit_idx, where, ints=True)
        lv = _jsonl_list(obj, keys.logit_val, where, ints=False)
        if len(lv) != len(li):
            raise TraceError(f"{where}: field '{keys.logit_val}' has {len(lv)} entries but "
                             f"'{keys.logit_idx}' has {len(li)}: give one value per logit id")
    form = (keys.request in obj, has_ds, weights is not None, len(experts),
            None if li is None else len(li))
    return (rid, layer, tok), _Cell(line, experts, weights, li, lv), form

def _form_error(where: str, form: tuple, first: tuple, first_line: int,
                keys: JsonlKeys) -> TraceError:
    def say(v: Any) -> str:
        return "present" if v is True else "absent" if v in (False, None) else f"{v} entries long"
    names = (keys.request, keys.dataset, keys.weights, keys.experts, keys.logit_idx)
    name, a, b = next((n, a, b) for n, a, b in zip(names, form, first) if a != b)
    return TraceError(f"{where}: field '{name}' is {say(a)} here but {say(b)} on line "
                      f"{first_line}: every line needs the same fields and list lengths "
                      f"(pad experts with -1)")

def _read_jsonl(path: Path, keys: JsonlKeys) -> tuple[dict, dict, tuple]:
    """Records keyed by (request, layer, token); request -> first-appearance order; form."""
    cells: dict[tuple, _Cell] = {}
    requests: dict[Any, int] = {}
    first: tuple | None = None
    first_line = 0
    with open(path, encoding="utf-8", errors="strict") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg}): each line must be one "
                                 f"JSON object") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: a {type(obj).__name__}, not a JSON object: write "
                                 f"one object per (request, layer, token)")
            key, cell, form = _parse_record(obj, keys, where, line_no)
            if first is None:
                first, first_line = form, line_no
            elif form != first:
                raise _form_error(where, form, first, first_line, keys)
            if key in cells:
                raise TraceError(f"{where}: repeats (request {key[0]!r}, layer {key[1]}, token "
                                 f"{key[2]}) of line {cells[key].line}: remove one of the two")
            cells[key] = cell
            requests.setdefault(key[0], len(requests))
    if first is None:
        raise TraceError(f"{path}: no records: write one JSON object per (request, layer, token)")
    return cells, requests, first

def _assemble(path: Path, cells: dict, requests: dict,
              form: tuple) -> tuple[dict[str, np.ndarray], np.ndarray, list]:
    """Arrays [N, L, ...] of the tokens present in every layer; line numbers [N, L]; the tokens
    dropped, as (request, token, layers without a record for it).

    Memory is proportional to the records: tokens are kept by value (sets), never as indices
    of a dense axis, and the arrays hold one entry per record kept."""
    num_layers = 1 + max(layer for _, layer, _ in cells)
    seen: dict[Any, dict[int, set]] = {rid: {} for rid in requests}  # request -> layer -> tokens
    for rid, layer, tok in cells:
        seen[rid].setdefault(layer, set()).add(tok)
    rows: list[tuple[Any, int]] = []
    req: list[int] = []
    dropped: list[tuple[Any, int, list[int]]] = []
    for rid, order in requests.items():
        if len(seen[rid]) < num_layers:
            missing = [layer for layer in range(num_layers) if layer not in seen[rid]]
            shown = f"{missing[:8]}" + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise TraceError(f"{path}: request {rid!r} has no records for layer(s) {shown}: "
                             f"every request needs layers 0..{num_layers - 1}")
        common = sorted(set.intersection(*seen[rid].values()))
        for tok in sorted(set.union(*seen[rid].values()) - set(common)):
            dropped.append((rid, tok, [layer for layer in range(num_layers) if tok not in seen[rid][layer]]))
        rows += [(rid, tok) for tok in common]
        req += [order] * len(common)
    if not rows:
        raise TraceError(f"{path}: no token has a record in every layer: nothing to import")
    grid = [[cells[(rid, layer, tok)] for layer in range(num_layers)] for rid, tok in rows]
    arrays = {"experts": np.array([[c.experts for c in g] for g in grid], dtype=np.int32)}
    if form[2]:
        arrays["weights"] = np.array([[c.weights for c in g] for g in grid], dtype=np.float32)
    if form[4] is not None:
        arrays["logit_idx"] = np.array([[c.logit_idx for c in g] for g in grid], dtype=np.int32)
        arrays["logit_val"] = np.array([[c.logit_val for c in g] for g in grid],
                                       dtype=np.float32)
    if form[0] or form[1]:
        arrays["req_index"] = np.array(req, dtype=np.int32)
    lines = np.array([[c.line for c in g] for g in grid], dtype=np.int64)
    return arrays, lines, dropped

def _dropped_message(path: Path, dropped: list, num_layers: int, shown: int = 3) -> str:
    """What the TraceWarning of dropped tokens says: how many, the first `shown` (request, token, layers)."""
    def one(rid: Any, tok: int, layers: list[int]) -> str:
        req = "" if rid is None else f"request {'/'.join(map(str, rid)) if isinstance(rid, tuple) else rid}, "
        where = ", ".join(map(str, layers[:4])) + (" ..." if len(layers) > 4 else "")
        return f"({req}token {tok}, missing from {'layer' if len(layers) == 1 else 'layers'} {where})"
    more = f" and {len(dropped) - shown} more" if len(dropped) > shown else ""
    return (f"{path}: dropped {counted(len(dropped), 'token')} without a record in every layer 0..{num_layers - 1}: "
            f"{', '.join(one(*d) for d in dropped[:shown])}{more}; meta.dropped_tokens counts them")


def _check_ids_lines(path: Path, field: str, a: np.ndarray, lines: np.ndarray,
                     num_experts: int) -> None:
    bad = (a < -1) | (a >= num_experts)
    if bad.any():
        n, layer, j = np.argwhere(bad)[0]
        raise TraceError(f"{path}:{lines[n, layer]}: field '{field}' holds id {a[n, layer, j]} "
                         f"outside [-1, {num_experts}): fix the id, or raise num_experts "
                         f"(num_experts=... or the meta JSON's 'num_experts')")

def import_jsonl(path: str | os.PathLike, *, model: str | None = None,
                 num_experts: int | None = None, expert_bytes: int | None = None,
                 source: str | None = None, license: str = "unknown",
                 request_key: str = "problem_id", layer_key: str = "layer",
                 token_key: str = "token_idx", experts_key: str = "experts",
                 weights_key: str = "gating_probs", dataset_key: str = "dataset",
                 logit_idx_key: str = "logit_idx", logit_val_key: str = "logit_val",
                 default_model: str | None = None) -> Trace:
    """A JSONL routing log, one object per (request, layer, token), as a Trace (B = 1).

    Requests are decoded one after another at batch 1, in order of first appearance; a request
    is (dataset, problem_id) when the dataset field is present. req_index is that order (absent
    when no line has a request or dataset field). weights (float32) from `weights_key`, logits
    from `logit_idx_key`/`logit_val_key`, each only when every line has them. Within a request
    the order of lines does not matter.

    Alignment rule: within a request, tokens are identified by token_idx and kept in ascending
    order; a token enters the trace only if every layer 0..L-1 (L = highest layer + 1) has a
    record for it. A token missing from any layer is dropped whole, with a TraceWarning naming how
    many and the first few (request, token, layers), and meta.extra["dropped_tokens"] counts them.
    mixtral-gsm8k.raw.jsonl lost 1-2 records in 14 of its 64 (problem, layer) streams, always at the
    stream's end (problem 0 keeps tokens 0..165 of 0..167, problem 1 keeps 0..77 of 0..78), so
    token_idx is the position in each layer's stream; the rule drops 3 of 247 tokens and reproduces
    mixtral-gsm8k.npz's experts and weights [244, 32, 2] exactly. A record lost mid-stream upstream
    shifts that layer's later tokens by one; no importer can undo that.

    Meta: arguments that are not None override the sidecar `<path>.meta.json` (written by
    export_jsonl; license only when not "unknown"); num_experts otherwise is max id + 1 with
    meta.extra["num_experts_inferred"] = True; phase defaults to "decode". model is needed
    from one of the two, or default_model. A field that is none of the keys is refused (FIELDS_HELP).
    Raises TraceError naming the file, line and field.
    """
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such file: check the path of the JSONL trace")
    keys = JsonlKeys(request_key, dataset_key, layer_key, token_key, experts_key, weights_key,
                     logit_idx_key, logit_val_key)
    try:
        cells, requests, form = _read_jsonl(p, keys)
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not UTF-8 text ({e}): write the JSONL file as UTF-8") from None
    arrays, lines, dropped = _assemble(p, cells, requests, form)
    if dropped:
        warnings.warn(_dropped_message(p, dropped, arrays["experts"].shape[1]), TraceWarning, stacklevel=2)
    args = dict(model=model, num_experts=num_experts, expert_bytes=expert_bytes, source=source,
                license=license)
    base = read_meta_json(_sidecar(p))
    meta = build_meta(base, args, arrays, default_source=f"jsonl:{p.name}", dropped=len(dropped),
                       default_model=default_model, where=str(_sidecar(p)) if base else str(p))
    _check_ids_lines(p, keys.experts, arrays["experts"], lines, meta.num_experts)
    if "logit_idx" in arrays:
        _check_ids_lines(p, keys.logit_idx, arrays["logit_idx"], lines, meta.num_experts)
    return finish_import(Trace(meta=meta, **arrays), str(p))

def _request_blocks(trace: Trace) -> list[tuple[int | None, int, int]]:
    """(request, start, stop) runs of decode steps; each request must form one run."""
    n = trace.num_tokens
    if trace.req_index is None:
        return [(None, 0, n)]
    r = trace.req_index[:, 0]
    cuts = (np.flatnonzero(np.diff(r)) + 1).tolist()
    blocks = [(int(r[s]), s, e) for s, e in zip([0] + cuts, cuts + [n]) if s < e]
    seen: set[int] = set()
    for rid, start, _ in blocks:
        if rid in seen:
            raise TraceError(f"req_index: request {rid} has tokens in more than one run (again "
                             f"at token {start}): the JSONL layout keeps a request's tokens "
                             f"together; give each run its own request number")
        seen.add(rid)
    return blocks

def export_jsonl(trace: Trace, path: str | os.PathLike, *, request_key: str = "problem_id",
                 layer_key: str = "layer", token_key: str = "token_idx",
                 experts_key: str = "experts", weights_key: str = "gating_probs",
                 dataset_key: str = "dataset", logit_idx_key: str = "logit_idx",
                 logit_val_key: str = "logit_val", dataset: str | None = None,
                 write_meta: bool = True) -> None:
    """Write a B == 1 trace as JSONL: per request run, layers 0..L-1, tokens in order.

    Each line: [dataset,] request (= req_index value; both omitted when req_index is None),
    layer, experts, [weights], [logit ids and values], token (position in the request). With
    write_meta the meta goes to `<path>.meta.json`, so import_jsonl(path) gives back the trace
    exactly when req_index numbers runs 0, 1, 2, ... Raises TraceError for B > 1, a request
    split over several runs, or a trace that does not validate.
    """
    trace.validate()
    if trace.batch != 1:
        raise TraceError(f"trace has batch B={trace.batch}: the JSONL layout is batch 1; export "
                         f"one batch row at a time (B == 1)")
    keys = JsonlKeys(request_key, dataset_key, layer_key, token_key, experts_key, weights_key,
                     logit_idx_key, logit_val_key)
    cols = {k: a[:, :, 0].tolist() for k, a in trace.arrays().items() if k != "req_index"}
    fields = [(keys.experts, "experts"), (keys.weights, "weights"),
              (keys.logit_idx, "logit_idx"), (keys.logit_val, "logit_val")]
    fields = [(key, cols[name]) for key, name in fields if name in cols]
    with open(path, "w", encoding="utf-8") as f:
        for rid, start, stop in _request_blocks(trace):
            head: dict[str, Any] = {}
            if rid is not None:
                head = ({keys.dataset: dataset} if dataset is not None else {})
                head[keys.request] = rid
            for layer in range(trace.num_layers):
                for n in range(start, stop):
                    rec = {**head, keys.layer: layer}
                    rec.update((key, col[n][layer]) for key, col in fields)
                    rec[keys.token] = n - start
                    f.write(json.dumps(rec) + "\n")
    if write_meta:
        _sidecar(Path(path)).write_text(trace.meta.to_json() + "\n", encoding="utf-8")
