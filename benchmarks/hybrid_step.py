"""One hybrid decode step on a timeline, and a small hybrid decode for compute-sanitizer.

    build_weights (decode_gpu: the random decoder at --geometry, --layers, --expert-format)
    -> the engine's miss split: measured at start (decode_gpu.engine_split, as load_model does) or, with
       --even, the table of equal channels (every call split in half: the CPU works whatever the experts'
       size, for the sanitizer's small run)
    -> decode_gpu.Runner (forced routing from the synthetic Qwen3-30B-A3B preset, CUDA graphs): prefill,
       --warmup steps (the first captures the graph)
    -> --trace-out: --steps graph replays under torch.profiler (CPU and CUDA activities) with the CPU
       share's trace on (moe.engine.handoff.CpuShare.trace); the workers' answers are added to the
       exported Chrome / Perfetto trace as a process of their own ("expertcache CPU workers", one slice
       per layer's share: layer and served positions), placed on the profiler's clock by a marker taken
       inside a record_function range; -> a summary: step time, the workers' busy time per step, the
       positions they served, and the layer calls' GPU timeline by phase (layer_phases: medians over the
       profiled calls of the MoE layers that handed a share over)
    -> without --trace-out: --steps replays, then the cache's and the workers' checks (no error) and
       the share's answers counted (only layer calls that served on the CPU hand over, and together they
       served what the cache counted): what compute-sanitizer runs (--small: 4 layers of OLMoE-1B-7B's
       geometry); with a measured split, the channels' line as load_model logs it

Run: python benchmarks/hybrid_step.py --trace-out hybrid-step-trace.json [--layers 8 --slots-frac 0.14] [--out F]
     compute-sanitizer --tool memcheck python benchmarks/hybrid_step.py --small --even
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import time
from pathlib import Path

import numpy as np

WORKER_PID = 7_000_000  # the CPU workers' process in the merged trace (beside the profiler's pids)


def merge_worker_events(trace: dict, events: list[tuple[int, int, int, int]], align_ns: int) -> int:
    """Add the CPU workers' answers to a Chrome trace dict in place; returns how many were added. The
    profiler's "expertcache.align" range (ts in us) was opened just before time.perf_counter_ns() read
    align_ns, so a worker time t ns sits at ts_align + (t - align_ns) / 1000 on the trace's clock.
    Raises ValueError when the trace lacks the marker."""
    marks = [e for e in trace.get("traceEvents", []) if e.get("name") == "expertcache.align" and "ts" in e]
    if not marks:
        raise ValueError("the profiler trace has no expertcache.align range to place the CPU workers by")
    base = float(marks[0]["ts"])
    out = trace["traceEvents"]
    out.append({"ph": "M", "name": "process_name", "pid": WORKER_PID, "args": {"name": "expertcache CPU workers"}})
    out.append({"ph": "M", "name": "thread_name", "pid": WORKER_PID, "tid": 0, "args": {"name": "CpuShare worker"}})
    for start, end, layer, served in events:
        out.append({"ph": "X", "name": f"cpu experts L{layer}", "pid": WORKER_PID, "tid": 0,
                    "ts": base + (start - align_ns) / 1e3, "dur": (end - start) / 1e3,
                    "args": {"layer": layer, "served_positions": served}})
    return len(events)


PHASES = ("front", "ensure_post", "copy", "gate_up_after_copy", "down", "wait", "layer")


def layer_phases(trace: dict) -> dict:
    """The GPU timeline of each MoE layer call with a miss split, by phase (us, medians over the calls with
    their count), from a Chrome trace's kernel events on the compute stream of the calls:

        front               the previous call's wait end -> this call's ensure start (the layer's attention,
                            norms and router: what runs before the channels can start)
        ensure_post         ensure start -> post end
        copy                post end -> miss copy end (the link's copies)
        gate_up_after_copy  miss copy end -> gate_up end (the routed gate_up, which waits for the copy)
        down                gate_up end -> down end (the routed down, and the tail's zeroing before it)
        wait                down end -> wait end (the wait for the CPU's answer and the combine)
        layer               the previous call's wait end -> this call's wait end

    A call is the kernels ensure, post, miss copy, gate_up, down and wait in that order (a call with
    early hits or a shared expert has others in between, on another stream or beside these); the first
    call has no front or layer."""
    kernels = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "ts" in e),
                     key=lambda e: e["ts"])
    wanted = ("ensure_kernel", "_post_kernel", "_miss_copy_kernel", "_gate_up_kernel", "_down_kernel",
              "_wait_kernel")
    calls, at, prev_end = {name: [] for name in PHASES}, 0, None
    while True:
        found, i = {}, at
        for name in wanted:
            while i < len(kernels) and kernels[i]["name"] != name:
                i += 1
            if i == len(kernels):
                break
            found[name] = kernels[i]
            i += 1
        if len(found) < len(wanted):
            break
        start = {n: float(e["ts"]) for n, e in found.items()}
        end = {n: float(e["ts"]) + float(e.get("dur", 0.0)) for n, e in found.items()}
        phases = {"ensure_post": end["_post_kernel"] - start["ensure_kernel"],
                  "copy": end["_miss_copy_kernel"] - end["_post_kernel"],
                  "gate_up_after_copy": end["_gate_up_kernel"] - end["_miss_copy_kernel"],
                  "down": end["_down_kernel"] - end["_gate_up_kernel"],
                  "wait": end["_wait_kernel"] - end["_down_kernel"]}
        if prev_end is not None:
            phases["front"] = start["ensure_kernel"] - prev_end
            phases["layer"] = end["_wait_kernel"] - prev_end
        for name, v in phases.items():
            calls[name].append(v)
        prev_end, at = end["_wait_kernel"], i
    return {name: {"median_us": float(np.median(v)), "calls": len(v)} if v else {"median_us": None, "calls": 0}
            for name, v in calls.items()}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3-30b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--expert-format", default="bf16")
    ap.add_argument("--slots-frac", type=float, default=0.14, help="share of the L * E experts in slots")
    ap.add_argument("--service", default="hybrid", choices=("hybrid", "cpu"))
    ap.add_argument("--even", action="store_true", help="the table of equal channels instead of measuring them")
    ap.add_argument("--small", action="store_true", help="4 layers of OLMoE-1B-7B's geometry (the sanitizer's run)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-out", help="the merged Chrome / Perfetto trace (.json or .json.gz)")
    ap.add_argument("--out", help="the summary as JSON, with the channels measured at start and the machine")
    args = ap.parse_args(argv)
    if args.small:
        args.geometry, args.layers = "olmoe-1b-7b", 4
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    import torch
    from bench_decode import GEOMETRIES, make_trace
    from decode_gpu import Runner, build_weights, engine_split

    from expertcache.split import ChannelCosts, MissSplit, tail_granule

    geo = GEOMETRIES[args.geometry]
    if args.trace_out:  # before any graph is captured: the profiler then sees the replays' kernels
        from torch.profiler import _utils as profiler_utils

        profiler_utils._init_for_cuda_graphs()
    weights, _ = build_weights(args, geo.config, args.expert_format)
    if args.even and args.service == "hybrid":
        import numba

        from moe.kernels.cpu_experts import set_threads

        set_threads(max(1, numba.config.NUMBA_NUM_THREADS - 2))  # as load_model leaves the launching threads two
        cfg = weights.spec.moe  # equal channels, and the tail the engine cuts these experts by
        granule = tail_granule(cfg.format, cfg.expert_intermediate)
        args.split = MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0), cfg.expert_intermediate if granule else 0,
                                      granule)
        measured = None
    else:
        args.split, measured = engine_split(weights, args.service)
    args.slots = max(geo.top_k, round(args.slots_frac * args.layers * geo.num_experts))
    args.trace, args.eager, args.chunks = None, False, 1  # synthetic routing, CUDA graphs (decode_gpu's fields)
    run = Runner(weights, make_trace(args, 1), args, "lru", False, 1)
    share = run.backend.slots.share
    tokens = run.prefill(args.seed)
    for n in range(args.warmup):
        tokens = run.step(n, tokens)
    torch.cuda.synchronize()
    served_before = int(run.backend.slots.cache.served.sum().item())
    events: list[tuple[int, int, int, int]] = []
    share.trace = events
    step_us = []
    result = {"bench": "hybrid_step", "geometry": args.geometry, "layers": args.layers, "format": args.expert_format,
              "slots": args.slots, "service": args.service, "even": args.even,
              "channels": None if measured is None else {**dataclasses.asdict(measured), "gbps": measured.gbps()}}
    if args.trace_out:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("expertcache.align"):
                align_ns = time.perf_counter_ns()
            for j in range(args.steps):
                t0 = time.perf_counter_ns()
                with record_function(f"decode step {j}"):
                    tokens = run.step(args.warmup + j, tokens)
                    torch.cuda.synchronize()
                step_us.append((time.perf_counter_ns() - t0) / 1e3)
        raw = Path(args.trace_out).with_suffix(".raw.json")
        prof.export_chrome_trace(str(raw))
        chrome = json.loads(raw.read_text())
        raw.unlink()
        result["layer_phases"] = layer_phases(chrome)
        result["worker_events"] = merge_worker_events(chrome, share.trace, align_ns)
        text = json.dumps(chrome)
        out = Path(args.trace_out)
        if out.suffix == ".gz":
            out.write_bytes(gzip.compress(text.encode()))
        else:
            out.write_text(text)
        result["trace_out"] = str(out)
    else:
        for j in range(args.steps):
            t0 = time.perf_counter_ns()
            tokens = run.step(args.warmup + j, tokens)
            torch.cuda.synchronize()
            step_us.append((time.perf_counter_ns() - t0) / 1e3)
    events = share.trace  # the answers recorded since it was set
    share.trace = None
    run.backend.check()
    run.backend.slots.cache.check()
    busy = sum(e - s for s, e, _, _ in events) / 1e3
    result.update({"steps": args.steps, "step_us": step_us, "answers": len(events),
                   "served_positions": int(sum(e[3] for e in events)),
                   "worker_busy_us_per_step": busy / max(args.steps, 1),
                   "worker_busy_share": busy / max(float(np.sum(step_us)), 1e-9)})
    served = int(run.backend.slots.cache.served.sum().item()) - served_before
    # a layer call hands over only what its ensure served on the CPU: every answer serves, and together
    # they served what the cache counted (positions against keys: one row, so each position is a key)
    if result["served_positions"] != served or any(e[3] == 0 for e in events):
        raise SystemExit(f"the CPU share answered {len(events)} times serving {result['served_positions']} positions "
                         f"(each {[e[3] for e in events]}), but the cache served {served} in {args.steps} steps")
    run.close()
    if measured is not None:
        print(measured.describe())
    print(json.dumps({k: v for k, v in result.items() if k != "channels"}, indent=1))
    if args.out:
        import benchmeta

        result["machine"] = benchmeta.machine()
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
