"""Decode tokens/s of the engine (CUDA-graph replay) beside the simulator's prediction for the same trace.

    --layers L decoder layers at --geometry: qwen3-next (moe.testing.random_decoder.qwen3_next_like: H 2048,
    512 experts of I 512, top-10, shared expert 512, bf16; attention 16 / 2 heads of 128) or qwen3-30b
    (qwen3_30b_like: H 2048, 128 experts of I 768, top-8, no shared expert; attention 32 / 4 heads of
    128 with q/k norms) or flame-290m (flame_290m_like: H 1024, 64 experts of I 704, top-6, shared
    expert 1408: FLAME-MoE-290M's block, for its real trace) or qwen3-next-80b (random_decoder.qwen3_next:
    Qwen3-Next-80B-A3B's own decoder, model_type qwen3_next: every fourth layer gated full attention of
    16 / 2 heads of 256, the others Gated DeltaNet linear attention, the same MoE block as qwen3-next)
    or gpt-oss-20b (random_decoder.gpt_oss_20b: gpt-oss-20b's own decoder, 32 experts of I 2880 top-4
    with biases and the clamped SwiGLU, sliding and full attention with sinks; --expert-formats mxfp4 is
    its released format) or glm-4.5-air (random_decoder.glm_4_5_air: GLM-4.5-Air's own decoder, 128
    experts of I 1408 top-8 by sigmoid scores, an ungated shared expert, 96 / 8 heads of 128) or
    mixtral-8x7b (random_decoder.mixtral_8x7b: 8 experts of I 14336 top-2, 32 / 8 heads of 128) or
    olmoe-1b-7b (random_decoder.olmoe_1b_7b: 64 experts of I 1024 top-8, 16 / 16 heads of 128 with
    whole-projection q / k norms);
    --vocab; random weights; per --expert-formats F (bf16, fp8, nvfp4, mxfp4,
    int4; default bf16) one pinned HostStore of every routed expert in F (the same random experts,
    quantized; L * 512 * 6 MiB: 25.8 GB at L = 8 in bf16), built and freed one format at a time
    slots: --slots N, --slots-frac f of L * E, or --moe-cache-gb G[,G..]: per format floor(G * 2**30 /
    its bytes per expert) (at most L * E), so every format gets the same VRAM budget
    trace, per batch B: sim.synthetic preset of the geometry (qwen3-next, qwen3-30b-a3b; L layers, B rows,
    warmup + steps tokens: calibrated on real traces, docs/synthetic.md), or --trace (its first L
    layers, B rows, warmup + steps tokens)
    -> per format, budget, config (lru, rule, rule+overlap) and B, GPU:
         GpuMoE(forced_routing=True) over --slots slots, Engine (CUDA graphs), prefill B short prompts;
         step n: set_routing(trace step n) (device copy) -> decode_step (eager + capture at n = 0, graph
         replay after) -> argmax; --warmup steps, then --steps timed with a CUDA event between steps;
         cache counters read before and after the timed window (outside it); memory after the build
         (idle) and after the run (peak: max allocated; device used from mem_get_info)
    -> calibration, per B (skip with --no-calibrate): the same measurement with every expert given a
       slot (L * 512 slots, lru): the miss-free step, the model's fixed cost (MoE layers, attention,
       norms, head, sampling); the cost model's per-layer overhead is set so that it predicts that
       run exactly, and only the misses remain to be predicted
    -> simulator, same trace slice and slots: sim.replay from a cold start without router logits (as
       the engine's ensure); the timed window = replay(warmup + steps) - replay(warmup);
       sim.costmodel.estimate_decode(window histogram, H200_SM_COPY with the calibrated overhead:
       the SM miss copy's table of times by size, scaled to the link this machine measured, `linked`)
       -> predicted us / step, tokens/s (and the uncalibrated profile's, for reference); implied layer
       overhead = the profile's + (measured - predicted) us per step / L. On the GPU both channels are
       measured once per format before its first service (moe.engine.channels, as load_model's hybrid
       does): every service's rows then run after the same measurement and are priced from its rates
    -> per format the simulator prices a miss at the format's bytes per expert (sim.costmodel.ModelShape
       routed_expert_bytes) and is calibrated on that format's own miss-free run
    -> --out JSON (GPU name, torch / triton versions, commit), a table printed last: per row the format,
       budget, slots, hit rate, misses and bytes copied per step, tokens/s measured and predicted, and
       tokens/s over bf16's at the same budget, B and config.
    --dry-run: the simulator's half only (no GPU).

Measured tokens/s = B * steps / (time from the first to the last event): the mean over the window,
which is what the simulator predicts. The step times' median and p10 / p90, and tokens/s per chunk of
the window (--chunks), give the spread. The engine's counters must equal the simulator's replay
exactly (same calls, same policy; `misses_equal`): the device ensure is bit-exact with the host one.

Run: python benchmarks/bench_decode.py --out decode.json [--layers 8] [--slots-frac 0.5] [--batches 1,2]
     python benchmarks/bench_decode.py --geometry qwen3-30b --layers 16 --moe-cache-gb 4.5 \
         --expert-formats bf16,fp8,nvfp4,int4 --configs lru --batches 1 --out decode-formats.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from benchmeta import machine

from expertcache import policy_names
from expertcache.formats import FormatError, format_names, get_format, slots_for_budget
from expertcache.split import MISS_SERVICE_CHOICES, MissSplit, tail_granule
from sim.costmodel import H200_SM_COPY, SHAPES, HardwareProfile, estimate_decode
from sim.replay import replay
from sim.service import DEFAULT_HOST, HOSTS, estimate_service
from sim.trace import Trace

DEVICE_POLICIES = tuple(policy_names())  # every registered policy has a device ensure


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A decoder geometry of the bench: its random_decoder config maker, synthetic preset and cost-model shape."""

    config: str  # moe.testing.random_decoder function
    preset: str  # sim.synthetic preset
    shape: str  # sim.costmodel.SHAPES key
    num_experts: int
    top_k: int
    hidden: int
    inter: int


GEOMETRIES = {"qwen3-next": Geometry("qwen3_next_like", "qwen3-next", "qwen3-next", 512, 10, 2048, 512),
              "qwen3-next-80b": Geometry("qwen3_next", "qwen3-next", "qwen3-next", 512, 10, 2048, 512),
              "qwen3-30b": Geometry("qwen3_30b_like", "qwen3-30b-a3b", "qwen3-30b-a3b", 128, 8, 2048, 768),
              "flame-290m": Geometry("flame_290m_like", "flame-like", "flame-290m", 64, 6, 1024, 704),
              "gpt-oss-20b": Geometry("gpt_oss_20b", "gpt-oss-20b", "gpt-oss-20b", 32, 4, 2880, 2880),
              "glm-4.5-air": Geometry("glm_4_5_air", "glm-4.5-air", "glm-4.5-air", 128, 8, 4096, 1408),
              "mixtral-8x7b": Geometry("mixtral_8x7b", "mixtral", "mixtral-8x7b", 8, 2, 4096, 14336),
              "olmoe-1b-7b": Geometry("olmoe_1b_7b", "olmoe-1b-7b", "olmoe-1b-7b", 64, 8, 2048, 1024)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="decoder (= MoE) layers")
    ap.add_argument("--geometry", default="qwen3-next", choices=sorted(GEOMETRIES), help="model geometry")
    ap.add_argument("--expert-formats", default="bf16",
                    help="comma-separated expert formats, each a run of its own: " + ", ".join(format_names()))
    ap.add_argument("--slots", type=int, help="pool slots (default: --slots-frac of layers * E)")
    ap.add_argument("--slots-frac", type=float, default=0.5, help="slots as a fraction of all experts")
    ap.add_argument("--moe-cache-gb", help="comma-separated VRAM budgets in GiB: per format the slots they hold "
                                           "(instead of --slots / --slots-frac)")
    ap.add_argument("--batches", default="1,2", help="comma-separated batch sizes")
    ap.add_argument("--configs", default="lru,rule,rule+overlap",
                    help="comma-separated POLICY or POLICY+overlap, POLICY in " + ", ".join(DEVICE_POLICIES))
    ap.add_argument("--trace", help="routing trace (.npz, .jsonl, FreeToken dir) instead of the synthetic preset")
    ap.add_argument("--warmup", type=int, default=300, help="decode steps before timing (the first captures)")
    ap.add_argument("--steps", type=int, default=500, help="timed decode steps")
    ap.add_argument("--chunks", type=int, default=5, help="chunks of the timed window for the tokens/s spread")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary size (Qwen3-Next: 151936)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="eager decode instead of CUDA-graph replay")
    ap.add_argument("--miss-service", default="copy",
                    help="comma-separated --moe-miss-service values, each run over the same weights (" +
                         ", ".join(MISS_SERVICE_CHOICES) + "): on the GPU each format's engine measures "
                         "both channels at start as load_model does, and the simulator replays the same split, "
                         "priced at those rates; a dry run splits and prices with the default host profile "
                         "(sim.service); hybrid-whole: hybrid splitting whole experts only (no tail, "
                         "expertcache.split), to compare: a format's split services after its first balance the "
                         "channels that one measured")
    ap.add_argument("--dry-run", action="store_true", help="simulator only (no GPU)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the miss-free run; predict with the H200_SM_COPY profile's own overhead")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    _check_args(args)
    return args


def _check_args(args: argparse.Namespace) -> None:
    for flag in ("layers", "warmup", "steps", "chunks", "vocab"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} must be >= 1, got {getattr(args, flag)}")
    if args.chunks > args.steps:
        raise SystemExit(f"error: --chunks {args.chunks} exceeds --steps {args.steps}")
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise SystemExit(f"error: --batches takes comma-separated ints, got {args.batches!r}") from None
    if not args.batches or min(args.batches) < 1 or max(args.batches) > 8:
        raise SystemExit(f"error: --batches must be in 1..8 (moe.kernels.plan.GEMV_MAX_TOKENS), got {args.batches}")
    args.configs = [_config(c) for c in args.configs.split(",") if c.strip()]
    from moe.engine.loading import check_miss_service

    args.miss_services = list(dict.fromkeys(m.strip() for m in args.miss_service.split(",") if m.strip()))
    try:
        if not args.miss_services:
            raise ValueError("--miss-service is empty")
        for service in args.miss_services:
            check_miss_service("hybrid" if service == WHOLE else service)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    args.miss_service = args.miss_services[0]
    args.split, args.host = None, None  # per format (run_format): the engine's split and the host it measured
    args.channels_of = {}  # per format: the channels measured before its first service (_channels)
    if not args.configs:
        raise SystemExit("error: --configs is empty")
    geo = GEOMETRIES[args.geometry]
    try:
        args.expert_formats = list(dict.fromkeys(get_format(f.strip()).name for f in args.expert_formats.split(",")
                                                 if f.strip()))
    except FormatError as e:
        raise SystemExit(f"error: --expert-formats: {e}") from None
    if not args.expert_formats:
        raise SystemExit("error: --expert-formats is empty")
    keys = args.layers * geo.num_experts
    args.pools = {fmt: _pools(args, fmt, geo, keys) for fmt in args.expert_formats}  # fmt -> [(budget, slots)]
    for fmt, pools in args.pools.items():
        for budget, slots in pools:
            if not max(args.batches) * geo.top_k <= slots <= keys:
                raise SystemExit(f"error: {fmt} at {'--slots' if budget is None else f'--moe-cache-gb {budget:g}'}: "
                                 f"{slots} slots, must be in [max batch * {geo.top_k}, layers * {geo.num_experts} = "
                                 f"{keys}]")


def _pools(args: argparse.Namespace, fmt: str, geo: Geometry, keys: int) -> list[tuple[float | None, int]]:
    """(budget GiB or None, slots) of each pool a format runs: one per --moe-cache-gb (capped at L * E), else
    --slots or --slots-frac."""
    if args.moe_cache_gb is None:
        if args.slots is None and not 0 < args.slots_frac <= 1:
            raise SystemExit(f"error: --slots-frac must be in (0, 1], got {args.slots_frac}")
        return [(None, args.slots if args.slots is not None else max(1, round(args.slots_frac * keys)))]
    if args.slots is not None:
        raise SystemExit("error: give --slots or --moe-cache-gb, not both")
    try:
        budgets = [float(g) for g in args.moe_cache_gb.split(",") if g.strip()]
        return [(g, min(slots_for_budget(g, get_format(fmt), geo.hidden, geo.inter), keys)) for g in budgets]
    except (ValueError, FormatError) as e:
        raise SystemExit(f"error: --moe-cache-gb {args.moe_cache_gb!r}: {e}") from None


def _config(text: str) -> tuple[str, bool]:
    policy, _, extra = text.strip().partition("+")
    if policy not in DEVICE_POLICIES or extra not in ("", "overlap"):
        raise SystemExit(f"error: --configs entry {text!r}: use POLICY or POLICY+overlap, POLICY in "
                         + ", ".join(DEVICE_POLICIES))
    return policy, extra == "overlap"


def config_name(policy: str, overlap: bool) -> str:
    return policy + ("+overlap" if overlap else "")


def make_trace(args: argparse.Namespace, batch: int) -> Trace:
    """The decode trace of one batch size: [warmup + steps, layers, batch, k] ids and their weights.

    Synthetic (the geometry's preset, calibrated on real traces; docs/synthetic.md) unless --trace.
    Raises SystemExit naming --trace / --layers / --steps when a trace file is too small or of another model.
    """
    tokens, geo = args.warmup + args.steps, GEOMETRIES[args.geometry]
    if args.trace is None:
        from sim.synthetic import generate, preset

        return generate(preset(geo.preset, num_layers=args.layers, num_tokens=tokens, batch=batch,
                               seed=args.seed))
    from sim.inputs import load_any

    full = load_any(args.trace)
    n, layers, rows, k = full.experts.shape
    if (full.num_experts, k) != (geo.num_experts, geo.top_k):
        raise SystemExit(f"error: --trace has {full.num_experts} experts, top-{k}; --geometry {args.geometry} "
                         f"needs {geo.num_experts}, top-{geo.top_k}")
    if n < tokens or layers < args.layers or rows < batch:
        raise SystemExit(f"error: --trace holds {n} tokens x {layers} layers x {rows} rows; the run needs "
                         f"{tokens} (--warmup + --steps) x {args.layers} (--layers) x {batch} (--batches)")
    weights = full.weights[:tokens, :args.layers, :batch] if full.weights is not None else None
    if weights is None:
        weights = np.full((tokens, args.layers, batch, k), 1.0 / k, dtype=np.float32)
    return Trace(experts=np.ascontiguousarray(full.experts[:tokens, :args.layers, :batch]),
                 meta=dataclasses.replace(full.meta, num_layers=args.layers),
                 weights=np.ascontiguousarray(weights, dtype=np.float32))


def head(trace: Trace, tokens: int) -> Trace:
    """The first `tokens` decode steps of a trace (ids only)."""
    return Trace(experts=np.ascontiguousarray(trace.experts[:tokens]), meta=trace.meta)


def replay_window(trace: Trace, policy: str, slots: int, warmup: int, split: MissSplit | None = None) -> dict:
    """The simulator on the timed window (decode steps warmup..end) of `trace`, from a cold start at
    step 0, under the engine's miss split (None: copy): the window's histogram of misses per call
    [L, B*k + 1] and of (misses, copies), its per-layer misses and accesses, and the whole run's
    per-layer misses. Every prediction for this (trace, policy, slots, split) reuses it."""
    full = replay(trace, policy, slots, use_logits=False, split=split)
    warm = replay(head(trace, warmup), policy, slots, use_logits=False, split=split)
    q = max(full.split_hist.shape[0], warm.split_hist.shape[0])
    split_hist = np.zeros((q, q), dtype=np.int64)
    split_hist[:full.split_hist.shape[0], :full.split_hist.shape[1]] += full.split_hist
    split_hist[:warm.split_hist.shape[0], :warm.split_hist.shape[1]] -= warm.split_hist
    return {"hist": full.hist - warm.hist, "misses": full.layer_misses - warm.layer_misses,
            "split": split, "split_hist": split_hist,
            "accesses": int((full.layer_accesses - warm.layer_accesses).sum()),
            "misses_all": full.layer_misses, "steps": trace.experts.shape[0] - warmup,
            "batch": trace.experts.shape[2]}


def predict(window: dict, overlap: bool, profile: HardwareProfile = H200_SM_COPY, geometry: str = "qwen3-next",
            fmt: str = "bf16", policy: str | None = None) -> dict:
    """Hit rate, per-layer misses and the cost model's predicted us per step and tokens/s of a
    replay_window under `profile`, the geometry's routed experts priced at `fmt`'s bytes, `policy`'s
    extra ensure time (profile.policy_call_us) charged to every layer call."""
    miss, steps = window["misses"], window["steps"]
    layers, geo = miss.shape[0], GEOMETRIES[geometry]
    shape = dataclasses.replace(SHAPES[geo.shape], num_layers=layers,
                                routed_expert_bytes=get_format(fmt).expert_bytes(geo.hidden, geo.inter))
    split = window.get("split")
    if split is not None and not split.copies_all:  # both channels, on the host the profile measured
        host = dataclasses.replace(window.get("host") or HOSTS[DEFAULT_HOST].for_format(fmt), gpu=profile)
        svc = estimate_service(window["hist"], steps, shape, host, split, batch=window["batch"], policy=policy,
                               split_hist=window["split_hist"], overlap=overlap)
        est = dataclasses.replace(estimate_decode(window["hist"], steps, shape, profile, batch=window["batch"],
                                                  policy=policy), us_per_token=svc.us_per_token,
                                  tokens_per_s=svc.tokens_per_s, exposed_copy_us_per_token=svc.miss_us_per_token,
                                  bytes_copied_per_token=svc.copies_per_token * shape.expert_bytes)
    else:
        est = estimate_decode(window["hist"], steps, shape, profile, batch=window["batch"], overlap=overlap,
                              policy=policy)
    acc = window["accesses"]
    return {"hit_rate": 1.0 - int(miss.sum()) / acc if acc else 0.0,
            "misses_per_layer_per_step": float(miss.sum()) / layers / steps,
            "layer_misses_all": window["misses_all"].tolist(), "layer_misses_window": miss.tolist(),
            "us_per_step": est.us_per_token, "tokens_per_s": est.tokens_per_s,
            "bytes_copied_per_step": est.bytes_copied_per_token,
            "compute_us_per_step": est.compute_us_per_token,
            "exposed_copy_us_per_step": est.exposed_copy_us_per_token,
            "layer_overhead_us": profile.layer_overhead_us, "profile": profile.name}


def simulate(trace: Trace, policy: str, slots: int, warmup: int, overlap: bool,
             profile: HardwareProfile = H200_SM_COPY, geometry: str = "qwen3-next", fmt: str = "bf16") -> dict:
    """predict(replay_window(...)): one configuration under one profile."""
    return predict(replay_window(trace, policy, slots, warmup), overlap, profile, geometry, fmt, policy)


def implied_overhead(measured_us: float, predicted_us: float, layers: int,
                     profile: HardwareProfile = H200_SM_COPY) -> float:
    """The per-layer overhead (us) that would make the cost model predict `measured_us` per step:
    its prediction is linear in the overhead, with `layers` calls per step."""
    return profile.layer_overhead_us + (measured_us - predicted_us) / layers


def calibrate(weights, trace: Trace, args: argparse.Namespace, batch: int, fmt: str) -> dict:
    """The miss-free run: every expert gets a slot (L * E slots), so after the first touches a step is
    the model's fixed cost (MoE layers, attention, norms, head, sampling) in format `fmt`. The cost
    model's per-layer overhead is set so that it predicts this run exactly; that profile then
    predicts the cached configurations of the format, whose difference from it is the misses alone."""
    from decode_gpu import measure

    geo = GEOMETRIES[args.geometry]
    resident = argparse.Namespace(**{**vars(args), "slots": args.layers * geo.num_experts})
    if args.miss_service == "cpu":  # cpu fills no slot, so its resident run is not miss-free: copy's is
        resident.split = None
    gpu = measure(weights, trace, resident, "lru", False, batch)
    window = replay_window(trace, "lru", resident.slots, args.warmup)
    base = getattr(args, "copy_profile", None) or H200_SM_COPY  # the copy at this machine's link (linked)
    sim = predict(window, False, base, geometry=args.geometry, fmt=fmt)
    overhead = implied_overhead(gpu["us_per_step"], sim["us_per_step"], args.layers, base)
    profile = dataclasses.replace(base, name=f"{base.name}-calibrated-{fmt}-b{batch}", layer_overhead_us=overhead)
    calibrated = predict(window, False, profile, args.geometry, fmt)  # = gpu, by construction
    return {"config": "resident (calibration)", "miss_service": args.miss_service, "format": fmt, "budget_gib": None,
            "batch": batch,
            "slots": resident.slots, "sim": calibrated, "sim_uncalibrated": sim, "gpu": gpu,
            "misses_equal": gpu["layer_misses_all"] == sim["layer_misses_all"],
            "tps_ratio": gpu["tokens_per_s"] / calibrated["tokens_per_s"],
            "implied_layer_overhead_us": overhead, "profile": profile}


def run_format(fmt: str, traces: dict, args: argparse.Namespace, res: dict) -> None:
    """Every batch, pool and config of one expert format: its weights built (GPU), calibrated per batch,
    measured and predicted; rows appended to res["rows"]."""
    weights = None
    if not args.dry_run:
        from decode_gpu import build_weights

        weights, res["build"][fmt] = build_weights(args, GEOMETRIES[args.geometry].config, fmt)
    for service in args.miss_services:  # each calibrated under itself: a split's hand-off is in its fixed time
        args.miss_service, args.tail = service, service != WHOLE
        _format_split(weights, fmt, args, res)
        _run_service(weights, fmt, traces, args, res)
    del weights


def _run_service(weights, fmt: str, traces: dict, args: argparse.Namespace, res: dict) -> None:
    for batch in args.batches:
        profile = H200_SM_COPY
        if not args.dry_run and not args.no_calibrate:
            cal = calibrate(weights, traces[batch], args, batch, fmt)
            profile = cal.pop("profile")
            res["rows"].append(cal)
        for budget, slots in args.pools[fmt]:
            windows: dict[str, dict] = {}  # per policy: overlap changes only the prediction
            for policy, overlap in args.configs:
                if policy not in windows:
                    windows[policy] = {**replay_window(traces[batch], policy, slots, args.warmup, args.split),
                                       "host": args.host}
                res["rows"].append(_row(weights, traces[batch], args, fmt, budget, slots, batch, policy, overlap,
                                        windows[policy], profile))


WHOLE = "hybrid-whole"  # --miss-service: hybrid without a tail (whole experts only)


def _format_split(weights, fmt: str, args: argparse.Namespace, res: dict) -> None:
    """args.split / args.host / args.copy_profile for format `fmt`: on the GPU the channels measured once per
    format before its first service (_channels; recorded in res["channels"]["<fmt>/<service>"] with the
    service each resolved to), the engine's own split balanced from them, a host profile of those rates and
    the copy table at the measured link (linked) for the prediction; in a dry run the split the default
    host profile gives."""
    args.split, args.host, args.copy_profile = None, None, None
    geo = GEOMETRIES[args.geometry]
    base = "hybrid" if args.miss_service == WHOLE else args.miss_service
    if args.dry_run:
        if args.miss_service != "copy":
            host = HOSTS[DEFAULT_HOST].for_format(fmt)
            service = "hybrid" if base == "auto" else base
            granule = tail_granule(get_format(fmt), geo.inter) if args.tail else 0
            split = host.split(service, get_format(fmt).expert_bytes(geo.hidden, geo.inter),
                               geo.inter if granule else 0, granule)
            args.split = None if split.copies_all else split
        return
    from decode_gpu import engine_split

    measured = _channels(weights, fmt, args)
    args.copy_profile = linked(H200_SM_COPY, measured)
    if args.miss_service != "copy":
        args.split, _ = engine_split(weights, base, tail=args.tail, given=measured)
    g = measured.gbps()
    # a call that serves misses pays the CPU's fixed part (its kernels' and the hand-off's round trip);
    # the post and wait every layer call of the split launches are in the overhead its calibration implies
    args.host = dataclasses.replace(HOSTS[DEFAULT_HOST], name=f"measured-at-start-{fmt}", formats=(),
                                    link_together_gbps=g["link_together"], cpu_gbps=g["cpu_alone"],
                                    cpu_together_gbps=g["cpu_together"], cpu_fixed_us=measured.costs().cpu_fixed_us,
                                    source="moe.engine.channels at start")
    res.setdefault("channels", {})[f"{fmt}/{args.miss_service}"] = {
        **dataclasses.asdict(measured), "gbps": g, "service": "copy" if args.split is None else args.split.service}


def _channels(weights, fmt: str, args: argparse.Namespace):
    """The channels of format `fmt` (moe.engine.channels.measure_channels, as load_model's hybrid measures
    them), measured once per format and run, before its first service's rows: every row of the format
    runs after the same measurement, and every service balances and is priced from the same rates."""
    if fmt not in args.channels_of:
        from decode_gpu import engine_split

        args.channels_of[fmt] = engine_split(weights, "hybrid")[1]
    return args.channels_of[fmt]


def linked(profile: HardwareProfile, measured) -> HardwareProfile:
    """`profile` on the link measured on this machine (a ChannelMeasure's link alone): HardwareProfile.at_link."""
    return profile.at_link(measured.gbps()["link_alone"])


def _row(weights, trace, args, fmt, budget, slots, batch, policy, overlap, window, profile) -> dict:
    row = {"config": config_name(policy, overlap), "miss_service": args.miss_service, "format": fmt,
           "budget_gib": budget, "batch": batch,
           "slots": slots, "sim": predict(window, overlap, profile, args.geometry, fmt, policy)}
    if profile is not H200_SM_COPY:  # the uncalibrated profile's prediction, for reference
        row["sim_uncalibrated"] = predict(window, overlap, geometry=args.geometry, fmt=fmt, policy=policy)
    if not args.dry_run:
        from decode_gpu import measure

        run = argparse.Namespace(**{**vars(args), "slots": slots})
        row["gpu"] = gpu = measure(weights, trace, run, policy, overlap, batch)
        row["misses_equal"] = gpu["layer_misses_all"] == row["sim"]["layer_misses_all"]
        row["tps_ratio"] = gpu["tokens_per_s"] / row["sim"]["tokens_per_s"]
        row["implied_layer_overhead_us"] = implied_overhead(gpu["us_per_step"], row["sim"]["us_per_step"],
                                                            args.layers, profile)
    return row


def speedups(rows: list[dict]) -> None:
    """Each row's tokens/s over bf16's at the same budget (or slots), batch, config and miss service,
    measured and predicted (`vs_bf16`, `vs_bf16_sim`), and over the copy service's of the same format,
    budget, batch and config (`vs_copy`, `vs_copy_sim`); absent without a row to compare with."""
    def key(r):
        return r["budget_gib"], r["batch"], r["config"], r.get("miss_service", "copy")

    base = {key(r): r for r in rows if r["format"] == "bf16" and r["config"] != "resident (calibration)"}
    copy = {(r["format"], *key(r)[:3]): r for r in rows
            if r.get("miss_service", "copy") == "copy" and r["config"] != "resident (calibration)"}
    for r in rows:
        c = copy.get((r["format"], *key(r)[:3]))
        if c is not None and c is not r and r["config"] != "resident (calibration)":
            r["vs_copy_sim"] = r["sim"]["tokens_per_s"] / c["sim"]["tokens_per_s"]
            if "gpu" in r and "gpu" in c:
                r["vs_copy"] = r["gpu"]["tokens_per_s"] / c["gpu"]["tokens_per_s"]
    for r in rows:
        b = base.get(key(r))
        if (
            b is None
            or r["config"] == "resident (calibration)"
            or (r["budget_gib"] is None and r["slots"] != b["slots"])
        ):
            continue
        r["vs_bf16_sim"] = r["sim"]["tokens_per_s"] / b["sim"]["tokens_per_s"]
        if "gpu" in r and "gpu" in b:
            r["vs_bf16"] = r["gpu"]["tokens_per_s"] / b["gpu"]["tokens_per_s"]


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t0 = time.time()
    res: dict = {"settings": {k: v for k, v in vars(args).items()}, "rows": [], "build": {}}
    traces = {b: make_trace(args, b) for b in args.batches}
    if not args.dry_run:
        res["machine"] = machine()
    for fmt in args.expert_formats:
        run_format(fmt, traces, args, res)
    speedups(res["rows"])
    res["seconds"] = time.time() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {args.out} ({res['seconds']:.0f} s)")
    print(table(res))
    return res


def table(res: dict) -> str:
    s = res["settings"]
    geo = GEOMETRIES[s["geometry"]]
    calibrated = not (s["no_calibrate"] or s["dry_run"])
    overhead = ("from the miss-free run of each format and batch size" if calibrated
                else f"{H200_SM_COPY.layer_overhead_us:g} us")
    lines = [
        f"decode, {s['layers']} layers x {geo.num_experts} experts (top-{geo.top_k}, {s['geometry']} geometry), "
        f"trace {s['trace'] or 'synthetic:' + geo.preset}, {s['steps']} timed steps after {s['warmup']}; "
        f"sim = sim.costmodel {H200_SM_COPY.name} (SM miss copy){'' if s['dry_run'] else ' at the link measured'} "
        f"at each format's bytes per expert, its per-layer overhead {overhead}"
        f"; target |measured / sim - 1| <= 15 %",
        "| format | GiB | slots | config | B | hit meas | hit sim | miss/layer/step | MB copied/step | "
        "step us med [p10, p90] | tok/s meas [chunk min, max] | tok/s sim | meas/sim | vs bf16 (sim) | "
        "GB idle / peak alloc |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = s["layers"] * geo.num_experts
    for r in res["rows"]:
        sim, g = r["sim"], r.get("gpu")  # the calibration row predicts itself exactly (meas/sim = 1)
        gib = "-" if r["budget_gib"] is None else f"{r['budget_gib']:g}"
        service = r.get("miss_service", "copy")
        config = r["config"] + ("" if service == "copy" else f" {service}")
        head = (f"| {r['format']} | {gib} | {r['slots']} ({100 * r['slots'] / keys:.0f} %) | {config} | "
                f"{r['batch']} |")
        mb = sim["bytes_copied_per_step"] / 1e6
        vs = (f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-") + (f" ({r['vs_bf16_sim']:.2f}x)" if "vs_bf16_sim" in r
                                                                   else "")
        if "vs_copy_sim" in r:
            vs += f"; vs copy {r['vs_copy']:.2f}x" if "vs_copy" in r else "; vs copy -"
            vs += f" ({r['vs_copy_sim']:.2f}x)"
        if g is None:
            lines.append(f"{head} n/a | {sim['hit_rate']:.4f} | {sim['misses_per_layer_per_step']:.2f} | {mb:.1f} | "
                         f"n/a | n/a | {sim['tokens_per_s']:.1f} | n/a | {vs} | n/a |")
            continue
        m = g["memory"]
        lines.append(
            f"{head} {g['hit_rate']:.4f}{'' if r['misses_equal'] else ' (!= sim)'} | {sim['hit_rate']:.4f} | "
            f"{g['misses_per_layer_per_step']:.2f} | {mb:.1f} | {g['step_us']['median']:.0f} "
            f"[{g['step_us']['p10']:.0f}, {g['step_us']['p90']:.0f}] | {g['tokens_per_s']:.1f} "
            f"[{min(g['chunk_tokens_per_s']):.1f}, {max(g['chunk_tokens_per_s']):.1f}] | "
            f"{sim['tokens_per_s']:.1f} | {r['tps_ratio']:.3f} | {vs} | "
            f"{m['idle_allocated_gb']:.2f} / {m['peak_allocated_gb']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
