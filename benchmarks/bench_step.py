"""A whole decode step with every expert resident: tokens/s against the step's HBM floor, where the time
goes, and transformers on the same geometry beside it.

    --layers L decoder layers at Qwen3-30B-A3B's geometry (moe.testing.random_decoder.qwen3_30b_like:
    H 2048, 128 experts of I 768, top-8, attention 32 / 4 heads of 128 with q/k norms) with --vocab
    tokens (default Qwen3's 151,936: the head is part of the step), random bf16 weights on the GPU,
    the routed experts in each of --expert-formats (bf16, fp8, int4, nvfp4, mxfp4; the same random
    experts quantized)
    -> per format, routed kernels (--routed: "pair", the one-program-a-pair kernels, and / or "mma",
       the tensor-core kernels of EXPERTCACHE_ROUTED_MMA=1), batch B (--batches) and context C (--contexts):
         GpuMoE over L * E slots (every expert resident) with forced routing; first every expert is routed once (E / k
         warm-up steps, bench_prefill.resident_routing), so the timed steps never miss; Engine (CUDA graphs)
         prefill B short prompts, then every row's KV cache is filled with random keys and values to
         C - 1 positions (the step's cost depends on the length, not on what was said)
         -> --warmup steps, then --steps timed steps (CUDA events), routed by the synthetic
            Qwen3-30B-A3B preset (calibrated on real traces)
         -> a profile of --profile-steps graph replays: each kernel's time by part (attention, MoE,
            norms, GEMMs of the projections and the head, other), and a Chrome / Perfetto trace of one
            step (--trace-out)
    -> floor = the bytes a step must read once: every layer's attention weights and norms, the
       distinct experts the step routes to (per layer, from the trace, at the format's bytes an
       expert), the KV cache of B rows of C
       tokens, the final norm and the head; / the device-to-device copy bandwidth measured in the run
    -> --transformers: transformers' Qwen3MoeForCausalLM at the same geometry (its own random weights,
       bf16, its DynamicCache), B rows after a prompt of C tokens, the same number of greedy steps
       timed (contexts up to --transformers-max-context: its prefill is eager; bf16 rows only)
    -> table and --out JSON (GPU, versions, commit)

Target: at least 0.6x the floor at B = 1, C = 1K.
Run: python benchmarks/bench_step.py [--layers 8] [--batches 1,4] [--contexts 1024,8192,32768,131072] [--transformers]
     [--expert-formats bf16] [--routed pair] [--out step.json] [--trace-out step-trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from moe.model.config import ROUTED_MMA_ENV

GB = 1e9
PROMPT = 4
PARTS = (  # kernel name pattern -> part of the step (first match wins)
    ("attention", re.compile(r"_split_kernel|_combine_kernel|_qk_rope_write|flash|attn|sdpa|softmax", re.I)),
    ("moe", re.compile(r"_gate_up|_down_kernel|_down_mma|_combine\b|_shared_|_router|ensure|_copy|_miss|routed",
                       re.I)),
    ("norms", re.compile(r"_add_rms_norm|rms", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|sm90|cublas", re.I)),
)


def part_of(kernel: str) -> str:
    """The part of a decode step a kernel's name belongs to (PARTS), else "other"."""
    for part, pattern in PARTS:
        if pattern.search(kernel):
            return part
    return "other"


def step_bytes(spec, batch: int, context: int, distinct_experts: float,
               expert_bytes: int | None = None) -> dict[str, float]:
    """The bytes one decode step reads at least, by part: attention weights and norms of every layer,
    `distinct_experts` routed experts (summed over the layers) of `expert_bytes` each (None: the model
    dtype's gate, up and down), the KV cache of `batch` rows of `context` positions, the final norm
    and the head (V x H), the embedding rows."""
    itemsize = 4 if spec.moe.dtype == "float32" else 2
    h, d = spec.hidden, spec.head_dim
    qkvo = (spec.num_heads * d * h * 2 + spec.num_kv_heads * d * h * 2) * itemsize  # q, o and k, v
    qk = 2 * d if spec.qk_norm else (spec.num_heads + spec.num_kv_heads) * d if spec.qk_norm_full else 0
    norms = (2 * h + qk) * itemsize
    expert = 3 * spec.moe.expert_intermediate * h * itemsize if expert_bytes is None else expert_bytes
    return {"attention_weights": spec.num_layers * (qkvo + norms), "experts": distinct_experts * expert,
            "kv_cache": 2 * spec.num_layers * batch * spec.num_kv_heads * context * d * itemsize,
            "head": (spec.vocab_size * h + h) * itemsize, "embedding": batch * h * itemsize}


def measure(weights, args: argparse.Namespace, batch: int, context: int, trace_out: Path | None,
            routed: str = "pair") -> dict:
    """One (B, C): tokens/s over the timed steps, the distinct experts per step, the profile's parts;
    routed "mma": the decode layers' routed experts on the tensor-core kernels (EXPERTCACHE_ROUTED_MMA=1
    while the backend resolves its plan), "pair": the one-program-a-pair kernels."""
    import torch
    from bench_decode import make_trace
    from bench_prefill import resident_routing

    from moe.engine.backends import GpuMoE
    from moe.engine.engine import Engine

    spec = weights.spec
    layers, experts, k = spec.num_moe_layers, spec.moe.num_experts, spec.moe.top_k
    every = torch.from_numpy(resident_routing(layers, experts, k, layers * experts, batch)).cuda()  # every expert
    fill = every.shape[0]
    run = argparse.Namespace(geometry="qwen3-30b", layers=layers, warmup=args.warmup, steps=args.steps, seed=args.seed,
                             trace=None)
    trace = make_trace(run, batch)
    ids = torch.from_numpy(np.ascontiguousarray(trace.experts)).cuda()  # [N, L, B, k]
    route_w = torch.from_numpy(np.ascontiguousarray(trace.weights, dtype=np.float32)).cuda()
    before_env = os.environ.get(ROUTED_MMA_ENV)
    os.environ[ROUTED_MMA_ENV] = "1" if routed == "mma" else "0"
    try:
        backend = GpuMoE(weights, layers * experts, "lru", max_batch=batch, forced_routing=True)
    finally:
        if before_env is None:
            del os.environ[ROUTED_MMA_ENV]
        else:
            os.environ[ROUTED_MMA_ENV] = before_env
    plan = next(iter(backend.layers.values())).plan
    if (plan.routed_mma is not None) != (routed == "mma"):
        raise RuntimeError(f"bench_step: --routed {routed} asked, the layers' plan is {plan.summary()}")
    engine = Engine(weights, backend, max_batch=batch, max_seq_len=context + fill + args.warmup + args.steps + 8,
                    cuda_graphs=True)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = engine.prefill(torch.randint(0, spec.vocab_size, (batch, PROMPT), generator=gen).tolist()).argmax(-1)
    flat = torch.full((batch, k), 1.0 / k, device="cuda")
    for n in range(fill):  # every expert into its slot
        backend.set_routing(every[n], flat.expand(layers, batch, k).contiguous())
        tokens = engine.decode_step(tokens).argmax(-1)
    # every row's context: random keys and values up to position C - 1, the next token at C - 1
    start = engine.kv.lengths[0].item()
    for kc, vc in zip(engine.kv.k, engine.kv.v):
        if kc is None:  # a linear-attention layer: no KV cache
            continue
        kc[:batch, :, start:context].normal_()
        vc[:batch, :, start:context].normal_()
    engine.kv.lengths[:batch] = context - 1
    engine._lengths = [context - 1] * batch

    def step(n: int, toks):
        backend.set_routing(ids[n], route_w[n])
        return engine.decode_step(toks).argmax(-1)

    for n in range(args.warmup):
        tokens = step(n, tokens)
    torch.cuda.synchronize()
    before = backend.slots.cache.counters.cpu().numpy().copy()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    events[0].record()
    for j in range(args.steps):
        tokens = step(args.warmup + j, tokens)
        events[j + 1].record()
    torch.cuda.synchronize()
    misses = int((backend.slots.cache.counters.cpu().numpy() - before)[:, 2].sum())
    step_us = [events[j].elapsed_time(events[j + 1]) * 1e3 for j in range(args.steps)]
    window = trace.experts[args.warmup:args.warmup + args.steps]  # [steps, L, B, k]
    distinct = float(np.mean([sum(len(set(window[s, m].ravel().tolist())) for m in range(layers))
                              for s in range(window.shape[0])]))
    parts = profile(lambda n: step(n % args.steps, tokens), args.profile_steps, trace_out)
    backend.slots.close()
    return {"batch": batch, "context": context, "routed": routed, "plan": plan.summary(),
            "us_per_step": float(np.mean(step_us)),
            "tokens_per_s": batch * 1e6 / float(np.mean(step_us)),
            "step_us": {"median": float(np.median(step_us)), "p10": float(np.percentile(step_us, 10)),
                        "p90": float(np.percentile(step_us, 90))},
            "misses_in_window": misses, "distinct_experts_per_step": distinct, "parts_us_per_step": parts}


def profile(step, steps: int, trace_out: Path | None) -> dict[str, float]:
    """us per step of each part (PARTS) over `steps` replays of `step`, from the kernels' device times."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for n in range(steps):
            step(n)
        torch.cuda.synchronize()
    if trace_out is not None:
        prof.export_chrome_trace(str(trace_out))
    parts: dict[str, float] = {}
    for evt in prof.key_averages():
        device_us = getattr(evt, "device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "cuda_time_total", 0.0)
        if device_us and evt.device_type == torch.autograd.DeviceType.CUDA:
            parts[part_of(evt.key)] = parts.get(part_of(evt.key), 0.0) + device_us / steps
    return parts


def transformers_decode(args: argparse.Namespace, batch: int, context: int) -> dict:
    """transformers' Qwen3MoeForCausalLM at the same geometry: greedy steps after a C-token prompt."""
    import torch
    from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe.testing.random_decoder import qwen3_30b_like

    cfg = qwen3_30b_like(args.layers, vocab_size=args.vocab)
    config = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(args.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of the weights first
    try:
        with torch.device("cuda"):
            model = Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(prev)
    prompt = torch.randint(0, args.vocab, (batch, context), device="cuda")
    with torch.no_grad():
        cache = DynamicCache()
        out = model(prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.warmup):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del model, cache
    torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "tokens_per_s": batch * args.steps / seconds}


def table(rows: list[dict]) -> str:
    lines = ["decode step, every expert resident, CUDA graphs; floor = the step's bytes / d2d copy bandwidth; "
             "vs pair = tok/s over the pair kernels' row",
             f"{'format':>6} {'routed':>6} {'B':>3} {'context':>8} {'tok/s':>9} {'us/step':>9} {'floor us':>9} "
             f"{'ratio':>6} {'vs pair':>7} {'transformers':>12}  parts (us/step)"]
    for r in rows:
        tf, vs = r.get("transformers_tokens_per_s"), r.get("vs_pair")
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["parts_us_per_step"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{r['format']:>6} {r['routed']:>6} {r['batch']:>3} {r['context']:>8} {r['tokens_per_s']:9.1f} "
                     f"{r['us_per_step']:9.1f} {r['floor_us']:9.1f} {r['floor_ratio']:6.2f} "
                     f"{'-' if vs is None else f'{vs:.2f}':>7} {'-' if tf is None else f'{tf:.1f}':>12}  {parts}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-formats", default="bf16", help="comma list of the routed experts' formats")
    ap.add_argument("--routed", default="pair",
                    help="comma list of routed kernels: pair (one program a pair), mma (the tensor-core kernels)")
    ap.add_argument("--transformers", action="store_true", help="time transformers' decode beside each bf16 row")
    ap.add_argument("--transformers-max-context", type=int, default=8192)
    ap.add_argument("--out", help="JSON path")
    ap.add_argument("--trace-out", help="Chrome / Perfetto trace of the first row's profiled steps")
    args = ap.parse_args(argv)
    for name in ("batches", "contexts"):
        try:
            values = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            ap.error(f"--{name}: {getattr(args, name)!r} is not a comma list of ints")
        if not values or min(values) < (1 if name == "batches" else PROMPT + 2):
            ap.error(f"--{name}: each must be >= {1 if name == 'batches' else PROMPT + 2}")
        setattr(args, name, values)
    from expertcache.formats import get_format
    try:
        args.expert_formats = list(dict.fromkeys(get_format(f.strip()).name for f in args.expert_formats.split(",")))
    except (KeyError, ValueError) as e:
        ap.error(f"--expert-formats: {e}")
    args.routed = list(dict.fromkeys(v.strip() for v in args.routed.split(",")))
    if not args.routed or not set(args.routed) <= {"pair", "mma"}:
        ap.error(f"--routed: {','.join(args.routed)!r}: each must be pair or mma")
    if args.layers < 1 or args.steps < 1 or args.warmup < 0 or args.profile_steps < 1:
        ap.error("--layers, --steps and --profile-steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    import benchmeta
    import torch

    from moe.testing.random_decoder import qwen3_30b_like, random_decoder

    bandwidth = benchmeta.d2d_bandwidth()
    rows: list[dict] = []
    pair: dict[tuple, float] = {}  # (format, B, C) -> the pair kernels' tok/s
    for fmt in args.expert_formats:
        weights = random_decoder(qwen3_30b_like(args.layers, vocab_size=args.vocab), "cuda", seed=args.seed,
                                 expert_format=fmt)
        for routed in args.routed:
            for batch in args.batches:
                for context in args.contexts:
                    first = not rows and args.trace_out
                    r = measure(weights, args, batch, context, Path(args.trace_out) if first else None, routed)
                    parts = step_bytes(weights.spec, batch, context, r["distinct_experts_per_step"],
                                       weights.store.bytes_per_expert)
                    r.update(format=fmt, floor_bytes=parts, floor_us=sum(parts.values()) / bandwidth * 1e6)
                    r["floor_ratio"] = r["floor_us"] / r["us_per_step"]  # the share of the floor reached
                    if routed == "pair":
                        pair[fmt, batch, context] = r["tokens_per_s"]
                    elif (fmt, batch, context) in pair:
                        r["vs_pair"] = r["tokens_per_s"] / pair[fmt, batch, context]
                    if args.transformers and fmt == "bf16" and routed == args.routed[0] \
                            and context <= args.transformers_max_context:
                        r["transformers_tokens_per_s"] = transformers_decode(args, batch, context)["tokens_per_s"]
                        r["vs_transformers"] = r["tokens_per_s"] / r["transformers_tokens_per_s"]
                    rows.append(r)
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                    torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "bench_step", "machine": benchmeta.machine(),
                                              "copy_bandwidth_bytes_per_s": bandwidth,
                                              "settings": {k: v for k, v in vars(args).items()},
                                              "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
