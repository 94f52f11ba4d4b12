"""What the shared-expert side stream saves while the miss copy runs, and the whole layer vs the HBM floor.

    4 synthetic layers at Qwen3-Next geometry (H 2048, I 512, E 512, top-10, shared Is 512, bf16; one
    pinned HostStore of 12 GiB shared by every model), batch --tokens, random hidden each step
    -> miss mode: two models, overlap off and on, over pools of --slots (default 1650 of the 2048
       keys: ~2 misses per layer and step once warm, so every step copies)
       1. bitwise check: outputs, slot maps and filled slots equal, eager then CUDA graph
       2. calibration: one eager step under the profiler; the shared expert's kernels (inside a
          record_function range) must run on the side stream, ensure / copy / routed GEMM on another
       3. ABAB timing: each round replays both step graphs on the same input (same misses), order
          alternating, CUDA events behind a sleep kernel; saving = median paired difference / L
       4. profiler trace of --profile replays per mode: copy start slip (ensure end -> copy start),
          share of missing layers whose shared expert ends inside the copy, copy duration on vs off,
          kernels per layer (every kernel of the replays / (replays * L); the eager step's count too)
    -> resident mode: pools of L*E slots, every expert made resident first; ABAB timing of the
       whole layer vs the HBM floor (weights read per layer / device-to-device bandwidth measured now);
       then --profile replays per mode under the profiler: each kernel's median duration and the
       median gap between consecutive kernels of the compute chain (router .. routed down)
       (--no-miss-mode: this part only); with --marginal-from D also steps of the first D layers,
       interleaved with the full ones, for one more layer's cost without the step's fixed cost
    Both modes run each model under the launch plan its layers resolve (moe.kernels.plan; the
    overlap is the only difference between the two models), and record that plan in results.json.
    -> Chrome traces (open in Perfetto): step_{off,on}.json (one decode step), replays_{off,on}.json,
       resident_replays_{off,on}.json;
       results.json with everything; a table printed last.

Run: python benchmarks/bench_moe_copy_overlap.py --out-dir OUT [--slots 1650] [--tokens 1] [--reps 300]
The resident-layer marginal (docs/layer.md):
     python benchmarks/bench_moe_copy_overlap.py --out-dir OUT --no-miss-mode --layers 12 --marginal-from 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from benchmeta import d2d_bandwidth, machine

from moe.model.config import MoEConfig
from moe.testing.kernel_trace import kernels, kernels_in_range, load_trace, named
from moe.testing.synthetic import SyntheticModel, random_weights

CFG = MoEConfig(hidden=2048, num_experts=512, top_k=10, expert_intermediate=512, shared_intermediate=512,
                norm_topk_prob=True)
SLEEP_CYCLES = 200_000  # ~100 us: longer than the host takes to launch one step graph
FAST_LINK = 100e9  # bytes/s, above any PCIe 5 x16 link: a copy longer than one expert at this speed missed
RANGE = "bench.shared_expert"
TARGET = "target: whole layer (all experts resident, graph replay) <= 1.5x the HBM floor"


def first_layers(model: SyntheticModel, hidden: torch.Tensor, depth: int | None) -> torch.Tensor:
    """model.step through layers 0..depth-1 only (all of them when depth is None)."""
    for layer in model.layers[:depth]:
        hidden = layer(hidden)
    return hidden


class Graph:
    """One captured decode step (all layers, or the first `depth`) of a model, static input copied in
    per replay."""

    def __init__(self, model: SyntheticModel, tokens: int, depth: int | None = None) -> None:
        self.model = model
        self.x = torch.zeros(tokens, CFG.hidden, dtype=torch.bfloat16, device="cuda")
        first_layers(model, self.x, depth)  # compiles and allocates before capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = first_layers(model, self.x, depth)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.graph.replay()
        return self.out


def same_state(a: SyntheticModel, b: SyntheticModel, slots_too: bool) -> bool:
    ca, cb = a.slots.cache, b.slots.cache
    ok = torch.equal(ca.slot_of, cb.slot_of) and torch.equal(ca.key_of, cb.key_of)
    if ok and slots_too:
        filled = torch.nonzero(ca.key_of >= 0).flatten()
        for bank in ("gate_up", "down"):
            ta, tb = a.slots.pool.tensor(bank), b.slots.pool.tensor(bank)
            ok = ok and torch.equal(ta[filled].view(torch.int16), tb[filled].view(torch.int16))
    return ok


def bitwise(models: dict, graphs: dict | None, xs: list[torch.Tensor]) -> bool:
    """Run both models on xs (eager, or graph replays) and compare outputs and state bit for bit."""
    ok = True
    for x in xs:
        outs = {m: (graphs[m](x) if graphs else models[m].step(x)).view(torch.int16).clone() for m in models}
        ok = ok and torch.equal(outs["off"], outs["on"]) and same_state(models["off"], models["on"], False)
    return ok and same_state(models["off"], models["on"], True)


def calibrate(models: dict, x: torch.Tensor, out_dir: Path) -> dict:
    """One eager step per mode under the profiler, shared expert in RANGE: its kernel names and streams."""
    info = {}
    for mode, model in models.items():
        for layer in model.layers:
            inner = layer.shared_expert
            layer.shared_expert = lambda h, inner=inner: _ranged(inner, h)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.step(x)
            torch.cuda.synchronize()
        for layer in model.layers:
            del layer.shared_expert  # back to the method
        path = out_dir / f"eager_step_{mode}.json"
        prof.export_chrome_trace(str(path))
        events = load_trace(path)
        shared, every = kernels_in_range(events, RANGE), kernels(events)
        compute = {k.stream for k in named(every, "_miss_copy_kernel") + named(every, "ensure_kernel")}
        info[mode] = {"kernels_per_layer": len(every) / len(model.layers),
                      "kernel_names": sorted({k.name for k in every}),
                      "shared_names": sorted({k.name for k in shared}), "shared_kernels": [k.name for k in shared],
                      "shared_streams": sorted({k.stream for k in shared}), "compute_streams": sorted(compute),
                      "other_names": sorted({k.name for k in every} - {k.name for k in shared})}
    on = info["on"]
    on["side_stream_ok"] = (
        not set(on["shared_streams"]) & set(on["compute_streams"]) and len(on["compute_streams"]) == 1
    )
    on["ambiguous_names"] = sorted(set(on["shared_names"]) & set(on["other_names"]))
    on["per_layer_exclusive"] = sum(n not in on["ambiguous_names"] for n in on["shared_kernels"]) // len(
        models["on"].layers)
    return info


def _ranged(fn, h):
    with torch.profiler.record_function(RANGE):
        return fn(h)


def timed(fn, x) -> tuple:
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(x)
    end.record()
    return start, end


def replay_round(graphs: dict, order, x: torch.Tensor) -> dict:
    """Replay graphs[k] for k in `order` on input x (copied in first, untimed), each timed by CUDA events
    behind a sleep kernel; microseconds per key."""
    for k in order:
        graphs[k].x.copy_(x)
    events = {k: timed(lambda _, k=k: graphs[k].graph.replay(), None) for k in order}
    torch.cuda.synchronize()
    return {k: s.elapsed_time(e) * 1e3 for k, (s, e) in events.items()}


def spread(t) -> dict:
    """Median, p10 and p90 of the values t (us)."""
    return {"median_us": float(np.median(t)), "p10_us": float(np.percentile(t, 10)),
            "p90_us": float(np.percentile(t, 90))}


def abab(graphs: dict, xs: list[torch.Tensor], counters: torch.Tensor) -> dict:
    """Round r replays off and on with xs[r], order alternating; per-mode and paired times in us.

    counters: the on model's DeviceCache counters [L, 3], read after each round (outside the timing)
    to count the misses of each step."""
    times, misses = {"off": [], "on": []}, []
    seen = int(counters[:, 2].sum())
    for r, x in enumerate(xs):
        for mode, us in replay_round(graphs, ("off", "on") if r % 2 == 0 else ("on", "off"), x).items():
            times[mode].append(us)
        now = int(counters[:, 2].sum())
        misses.append(now - seen)
        seen = now
    diff = np.array(times["off"]) - np.array(times["on"])
    return {"off": spread(times["off"]), "on": spread(times["on"]), "paired_saving": spread(diff), "rounds": len(xs),
            "misses_per_step_mean": float(np.mean(misses)), "steps_without_miss": int(np.sum(np.array(misses) == 0))}


def marginal(graphs: dict, short: dict, xs: list[torch.Tensor], extra_layers: int) -> dict:
    """The cost of one more layer: each round replays the full step graphs and the graphs of the first
    D layers (`short`) of both modes, order rotating (replay_round); per round and mode (full - short) /
    extra_layers (the layers D..L-1), so the step's fixed cost (the graph's launch, the first layer's
    router waiting on nothing before it) cancels; median, p10, p90 in us."""
    both = {(m, g): (graphs if g == "full" else short)[m] for m in graphs for g in ("full", "short")}
    keys = list(both)
    times: dict = {k: [] for k in keys}
    for r, x in enumerate(xs):
        for k, us in replay_round(both, keys[r % len(keys):] + keys[: r % len(keys)], x).items():
            times[k].append(us)
    out = {}
    for m in graphs:
        per = (np.array(times[(m, "full")]) - np.array(times[(m, "short")])) / extra_layers
        out[m] = {**spread(per), "full_step_median_us": float(np.median(times[(m, "full")])),
                  "short_step_median_us": float(np.median(times[(m, "short")]))}
    return out


def profile_replays(graph: Graph, xs: list[torch.Tensor], path: Path) -> list:
    """Replay the graph once per x under the profiler (after one unprofiled replay); write the Chrome
    trace to `path` and return its kernels in start order."""
    graph(xs[0])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for x in xs:
            graph(x)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return kernels(load_trace(path))


def replay_metrics(graph: Graph, xs: list[torch.Tensor], path: Path, shared_names: set, per_layer: int,
                   expert_bytes: int) -> dict:
    """Profile replays of one mode; per layer: copy slip, copy duration, shared-end-inside-copy."""
    ks = profile_replays(graph, xs, path)
    ensures, copies = named(ks, "ensure_kernel"), named(ks, "_miss_copy_kernel")
    missed_us = expert_bytes / FAST_LINK * 1e6
    out = {"layers": len(copies), "kernels": len(ks),
           "slip_us": [c.start - e.end for e, c in zip(ensures, copies)],
           "copy_us": [c.duration for c in copies], "missed": [c.duration > missed_us for c in copies]}
    shared = [k for k in ks if k.name in shared_names]
    if shared_names and per_layer and len(shared) == per_layer * len(copies):
        ends = [max(k.end for k in shared[i * per_layer:(i + 1) * per_layer]) for i in range(len(copies))]
        out["shared_inside_copy"] = [c.start <= e <= c.end for c, e in zip(copies, ends)]
    return out


def summarize(m: dict) -> dict:
    miss = np.array(m["missed"], dtype=bool)
    copy = np.array(m["copy_us"])
    out = {"layers": m["layers"], "layers_missed": int(miss.sum()),
           "kernels_per_layer": m["kernels"] / m["layers"] if m["layers"] else None,
           "median_slip_us": float(np.median(m["slip_us"])),
           "copy_us_median_missed": float(np.median(copy[miss])) if miss.any() else None}
    if "shared_inside_copy" in m:
        inside = np.array(m["shared_inside_copy"], dtype=bool)
        out["shared_inside_copy_share_missed"] = float(inside[miss].mean()) if miss.any() else None
        out["shared_inside_copy_share_all"] = float(inside.mean())
    return out


def step_trace(graph: Graph, x: torch.Tensor, path: Path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph(x)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def overlap_models(weights, num_slots: int) -> dict:
    """The two models of a mode, overlap off and on, each under the plan its layers resolve."""
    models = {m: SyntheticModel(weights, num_slots, "cuda", copy_overlap=m == "on") for m in ("off", "on")}
    if models["on"].layers[0].side is None:
        raise SystemExit(f"overlap did not apply: {models['on'].layers[0].plan.reason}")
    return models


def miss_mode(weights, args, xs, out_dir: Path) -> dict:
    models = overlap_models(weights, args.slots)
    n = args.bitwise_steps
    eager_ok = bitwise(models, None, xs[:n])
    calib = calibrate(models, xs[n], out_dir)
    graphs = {m: Graph(models[m], args.tokens) for m in models}  # one more step each (zeros)
    graph_ok = bitwise(models, graphs, xs[n + 1:2 * n + 1])
    pos = 2 * n + 1
    for x in xs[pos:pos + args.warmup]:  # fill the pool to steady state
        for graph in graphs.values():
            graph(x)
    pos += args.warmup
    timing = abab(graphs, xs[pos:pos + args.reps], models["on"].slots.cache.counters)
    pos += args.reps
    prof, plans = {}, {m: model.layers[0].plan.summary() for m, model in models.items()}
    names = set(calib["on"]["shared_names"]) - set(calib["on"]["ambiguous_names"])
    for mode, graph in graphs.items():
        raw = replay_metrics(graph, xs[pos:pos + args.profile], out_dir / f"replays_{mode}.json",
                             names if mode == "on" else set(), calib["on"]["per_layer_exclusive"],
                             weights.store.bytes_per_expert)
        prof[mode] = summarize(raw)
        step_trace(graph, xs[pos + args.profile], out_dir / f"step_{mode}.json")
    for m in models.values():
        m.close()
    return {"plan": plans, "bitwise_eager": eager_ok, "bitwise_graph": graph_ok, "calibration": calib, "timing": timing,
            "saving_per_layer_us": timing["paired_saving"]["median_us"] / len(weights.router),
            "profile": prof, "misses_per_layer_per_step": timing["misses_per_step_mean"] / len(weights.router)}


CHAIN = ("_router_kernel", "ensure_kernel", "_miss_copy_kernel", "_gate_up_kernel", "_down_kernel")


def resident_breakdown(graph: Graph, xs: list[torch.Tensor], path: Path) -> dict:
    """Profile replays of a resident step graph: median duration of each kernel, and the median gap
    from the end of each compute-chain kernel (CHAIN, in launch order) to the start of the next one
    (negative: the next one started early, as a programmatic dependent launch may)."""
    ks = profile_replays(graph, xs, path)
    durations: dict[str, list[float]] = {}
    for k in ks:
        durations.setdefault(k.name, []).append(k.duration)
    chain = [k for k in ks if any(c in k.name for c in CHAIN)]
    gaps: dict[str, list[float]] = {}
    def name(k):
        return next(c for c in CHAIN if c in k.name)
    for a, b in itertools.pairwise(chain):
        gaps.setdefault(f"{name(a)}->{name(b)}", []).append(b.start - a.end)
    # the early hits' gate_up (side stream): its start after its router's end, the down's start after its end
    for h in named(ks, "_gate_up_hits"):
        r = max((k for k in chain if "_router_kernel" in k.name and k.start <= h.start), key=lambda k: k.start)
        d = min((k for k in chain if "_down_kernel" in k.name and k.start >= r.start), key=lambda k: k.start)
        gaps.setdefault("_router_kernel->_gate_up_hits", []).append(h.start - r.end)
        gaps.setdefault("_gate_up_hits->_down_kernel", []).append(d.start - h.end)
    def med(d):
        return {n: float(np.median(v)) for n, v in sorted(d.items())}
    return {"kernel_us": med(durations), "gap_us": med(gaps), "kernels": len(ks), "replays": len(xs)}


def resident_mode(weights, args, xs, out_dir: Path) -> dict:
    L, E = weights.num_layers, CFG.num_experts
    clock = [time.time()]
    seconds = {}  # wall seconds of each phase (device time is scarce: see where it goes)

    def lap(name: str) -> None:
        seconds[name] = time.time() - clock[0]
        clock[0] = time.time()

    models = overlap_models(weights, L * E)
    plans = {m: model.layers[0].plan.summary() for m, model in models.items()}
    for m in models.values():
        m.warm_all()
    lap("models")
    graphs = {m: Graph(models[m], args.tokens) for m in models}
    lap("graphs")
    timing = abab(graphs, xs[: args.reps], models["on"].slots.cache.counters)
    lap("timing")
    new_misses = int(timing["misses_per_step_mean"] * timing["rounds"])
    bw = d2d_bandwidth()
    h, i, s = CFG.hidden, CFG.expert_intermediate, CFG.shared_intermediate
    experts = min(args.tokens * CFG.top_k, E)  # distinct experts read at most
    weight_bytes = 2 * (E * h + experts * 3 * i * h + 3 * s * h + h)  # bf16 router, experts, shared + gate
    floor_us = weight_bytes / bw * 1e6
    per_layer = {m: timing[m]["median_us"] / L for m in ("off", "on")}
    extra, short = None, {}
    if args.marginal_from:  # the layers D..L-1 alone: steps of L and of D layers, the difference
        short = {m: Graph(models[m], args.tokens, depth=args.marginal_from) for m in models}
        extra = marginal(graphs, short, xs[: args.reps], L - args.marginal_from)
        extra = {"from_layer": args.marginal_from, "layer_us": {m: v["median_us"] for m, v in extra.items()},
                 "ratio_to_floor": {m: v["median_us"] / floor_us for m, v in extra.items()}, "timing": extra}
        lap("marginal")
    breakdown = {m: resident_breakdown(graphs[m], xs[: args.profile], out_dir / f"resident_replays_{m}.json")
                 for m in graphs} if args.profile else {}
    lap("profile")
    print("resident mode phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
          + "; plans: " + ", ".join(f"{m} {plan_line(p)}" for m, p in plans.items()), flush=True)
    for m in models.values():
        m.close()
    del models, graphs, short
    torch.cuda.empty_cache()
    return {
        "marginal": extra,
        "settings_layers": L,
        "plan": plans,
        "timing": timing,
        "misses_during_timing": new_misses,
        "d2d_bytes_per_s": bw,
        "weight_bytes_per_layer": weight_bytes,
        "hbm_floor_us": floor_us,
        "layer_us": per_layer,
        "ratio_to_floor": {m: per_layer[m] / floor_us for m in per_layer},
        "breakdown": breakdown,
        "note": "router, experts and shared expert all read in bf16, as counted here",
        "phase_seconds": seconds,
    }


def plan_line(plan: dict) -> str:
    """One line of a LaunchPlan.summary(): the mode and the releases that are on."""
    on = ["front_release"] if plan["front_release"] else []
    if any(plan["router_early_weights"]):
        on.append("router_early_weights")
    return f"{plan['mode']} ({', '.join(on) or 'no release'}; down_prefetch {plan['down_prefetch']})"


def marginal_line(r: dict) -> str:
    """One line of the marginal layer cost of a resident run (--marginal-from)."""
    mg = r["marginal"]
    t = mg["timing"]
    return (f"one more layer (layers {mg['from_layer']}..{r['settings_layers'] - 1} of {r['settings_layers']}, "
            f"step of {r['settings_layers']} minus step of {mg['from_layer']}, per round): off "
            f"{t['off']['median_us']:.1f} us ({mg['ratio_to_floor']['off']:.2f}x) [p10 {t['off']['p10_us']:.1f}, "
            f"p90 {t['off']['p90_us']:.1f}], on {t['on']['median_us']:.1f} us ({mg['ratio_to_floor']['on']:.2f}x) "
            f"[p10 {t['on']['p10_us']:.1f}, p90 {t['on']['p90_us']:.1f}]")


def table(res: dict) -> str:
    resi = res["resident_mode"]
    def fmt(v, spec=".1f"):
        return "n/a" if v is None else format(v, spec)
    lines = []
    if "miss_mode" in res:
        miss = res["miss_mode"]
        t, p = miss["timing"], miss["profile"]
        lines += [
            (
                f"bitwise on == off: eager {miss['bitwise_eager']}, graph {miss['bitwise_graph']}; "
                f"side stream separate: {miss['calibration']['on']['side_stream_ok']}"
            ),
            f"miss mode ({res['settings']['slots']} slots, {miss['misses_per_layer_per_step']:.2f} misses/layer/step)",
            *(f"  plan {m}: {plan_line(plan)}" for m, plan in miss["plan"].items()),
            (
                f"  step median off {t['off']['median_us']:.1f} us, on {t['on']['median_us']:.1f} us; paired saving "
                f"{t['paired_saving']['median_us']:.1f} us [p10 {t['paired_saving']['p10_us']:.1f}, "
                f"p90 {t['paired_saving']['p90_us']:.1f}] = {miss['saving_per_layer_us']:.2f} us per layer"
            ),
            (
                f"  copy start slip (median): off {fmt(p['off']['median_slip_us'], '.2f')} us, "
                f"on {fmt(p['on']['median_slip_us'], '.2f')} us"
            ),
            (
                f"  copy duration (median, missing layers): off {fmt(p['off']['copy_us_median_missed'])} us, "
                f"on {fmt(p['on']['copy_us_median_missed'])} us"
            ),
            (
                f"  shared expert ends inside the copy: {fmt(p['on'].get('shared_inside_copy_share_missed'), '.0%')} "
                f"of missing layers ({fmt(p['on'].get('shared_inside_copy_share_all'), '.0%')} of all)"
            ),
            (
                f"  kernels per layer: eager step off {miss['calibration']['off']['kernels_per_layer']:.1f}, "
                f"on {miss['calibration']['on']['kernels_per_layer']:.1f}; graph replays off "
                f"{fmt(p['off']['kernels_per_layer'])}, on {fmt(p['on']['kernels_per_layer'])}"
            ),
        ]
    lines += [TARGET, *(f"  resident plan {m}: {plan_line(plan)}" for m, plan in resi["plan"].items()),
              (f"  HBM floor {resi['hbm_floor_us']:.1f} us/layer ({resi['weight_bytes_per_layer'] / 1e6:.1f} MB at "
              f"{resi['d2d_bytes_per_s'] / 1e12:.2f} TB/s); layer off {resi['layer_us']['off']:.1f} us "
              f"({resi['ratio_to_floor']['off']:.2f}x), on {resi['layer_us']['on']:.1f} us "
              f"({resi['ratio_to_floor']['on']:.2f}x); misses while timing: {resi['misses_during_timing']}")]
    if resi.get("marginal"):
        lines.append("  " + marginal_line(resi))
    for mode, b in resi.get("breakdown", {}).items():
        lines.append(f"  resident {mode}, profiled medians: kernels "
                     + ", ".join(f"{n} {v:.2f}" for n, v in b["kernel_us"].items()) + " us; gaps "
                     + ", ".join(f"{n} {v:.2f}" for n, v in b["gap_us"].items()) + " us")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True, help="folder for results.json and the Chrome traces")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--marginal-from", type=int, default=None, metavar="D",
                    help="resident mode: also time a step of the first D layers and report one more layer's "
                         "cost, (step of --layers - step of D) / (--layers - D), which leaves out the step's "
                         "fixed cost (e.g. --layers 12 --marginal-from 4)")
    ap.add_argument("--slots", type=int, default=1650, help="pool slots in miss mode (of layers * 512 keys)")
    ap.add_argument("--tokens", type=int, default=1, help="batch: tokens per decode step (1..8)")
    ap.add_argument("--reps", type=int, default=300, help="ABAB rounds")
    ap.add_argument("--warmup", type=int, default=80, help="graph steps before timing (fill the pool)")
    ap.add_argument("--bitwise-steps", type=int, default=4)
    ap.add_argument("--profile", type=int, default=40, help="replays under the profiler per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-miss-mode", dest="miss_mode", action="store_false",
                    help="the resident mode only (the layer against the HBM floor, with its kernel breakdown)")
    args = ap.parse_args(argv)
    if args.marginal_from is not None and not 0 < args.marginal_from < args.layers:
        ap.error(f"--marginal-from must be in [1, --layers), got {args.marginal_from} with --layers {args.layers}")
    return args


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_moe_copy_overlap needs a CUDA GPU; see --help", file=sys.stderr)
        sys.exit(2)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    weights = random_weights(CFG, args.layers, "cuda", seed=args.seed)
    print(f"weights: {args.layers} layers, pinned host store of {weights.store.nbytes / 2**30:.1f} GiB "
          f"[{time.time() - t0:.0f} s]", flush=True)
    gen = torch.Generator("cuda").manual_seed(args.seed + 1)
    count = 2 * args.bitwise_steps + 2 + args.warmup + args.reps + args.profile + 1
    xs = [torch.randn(args.tokens, CFG.hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(count)]
    res = {"machine": machine(), "settings": vars(args), "config": CFG.__dict__}
    if args.miss_mode:
        res["miss_mode"] = miss_mode(weights, args, xs, out_dir)
        torch.cuda.empty_cache()
    res["resident_mode"] = resident_mode(weights, args, xs, out_dir)
    res["seconds"] = time.time() - t0
    (out_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out_dir / 'results.json'} and Chrome traces step_*.json / replays_*.json ({res['seconds']:.0f} s)")
    print(table(res))


if __name__ == "__main__":
    main()
