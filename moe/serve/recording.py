"""Routing capture of a serving run: the decode routing of every served request as a trace file.

    Engine(record_routing=True).routing()  int32 [N, L, B', k]   (B' = the widest step so far)
    Scheduler.req_rows                     N lists of request numbers, one per active row
        ──routing_trace──► sim.trace.Trace: experts int32 [N, L, max_batch, k], req_index int32
                           [N, max_batch], -1 in rows no sequence used that step
        ──save_trace──► expertcache-trace/1 .npz ──► `expertcache sim`, sim.replay.replay

One entry per decode step in the order the server ran them; row b of step n is the engine's row b
then (rows are compacted when a sequence leaves, so a request may change rows between steps; the
cache's ensure only sees the set of experts of a step, so the rows' order changes nothing). The meta names the experts'
format (`expert_format`) and, for a registered one, the expert's shape (hidden_size,
moe_intermediate_size), so `expertcache sim --expert-format` can price other formats. Prefill
is not in the trace: it bypasses the cache (moe.engine.backends), so replaying the trace from a cold cache
with the server's policy and slot count reproduces the server's miss counters exactly (CPU backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from expertcache.formats import format_names
from moe.serve.scheduler import Scheduler
from sim.trace import Trace, TraceMeta, save_trace


def routing_trace(scheduler: Scheduler, model: str, **extra) -> Trace:
    """The trace of every decode step `scheduler` ran so far. extra: more meta keys (JSON values).

    Call it on the scheduler thread (Scheduler.call) or after stop(): it reads the engine.
    Raises ValueError naming --record-routing when the engine does not record routing.
    """
    engine = scheduler.engine
    if not engine.record_routing:
        raise ValueError("the engine records no routing: start the server with --record-routing PATH")
    spec = engine.spec
    routing = engine.routing()  # [N, L, B', k]
    n, layers, rows, k = routing.shape
    width = engine.max_batch
    experts = np.full((n, layers, width, k), -1, dtype=np.int32)
    experts[:, :, :rows] = routing
    req_index = np.full((n, width), -1, dtype=np.int32)
    for step, numbers in enumerate(scheduler.req_rows[:n]):
        req_index[step, : len(numbers)] = numbers
    moe = spec.moe
    shape = {}  # the expert's shape, which sim.trace checks against a registered format's bytes
    if moe.expert_format in format_names():
        shape = {"hidden_size": moe.hidden, "moe_intermediate_size": moe.expert_intermediate}
    meta = TraceMeta(model=model, num_layers=spec.num_moe_layers, num_experts=moe.num_experts,
                     top_k=moe.top_k, expert_bytes=int(engine.moe.store.bytes_per_expert),
                     phase="decode", source="expertcache serve", license="same as the served model",
                     extra={"expert_format": moe.expert_format, **shape, **extra})
    return Trace(experts=experts, meta=meta, req_index=req_index)


def write_routing(scheduler: Scheduler, path: str | Path, model: str, **extra) -> Trace:
    """routing_trace(...) written to `path` (np.savez_compressed, no suffix added); returns it."""
    trace = routing_trace(scheduler, model, **extra)
    save_trace(trace, path)
    return trace
