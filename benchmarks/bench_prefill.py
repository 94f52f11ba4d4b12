"""Time to first token of long prompts with a quarter of the experts in slots, against the copy-engine
limit of the experts that must cross PCIe.

    --layers L decoder layers at Qwen3-30B-A3B's geometry (moe.testing.random_decoder.qwen3_30b_like,
    random bf16 weights, --vocab tokens), routed experts in a pinned HostStore in --expert-format (default
    bf16)
    -> GpuMoE over --slots-frac of the L * E experts (default a quarter); decode steps routed to
       experts 0..S/L-1 of every layer fill the slots first (forced routing), so prefill finds that
       quarter resident and streams the rest from host memory
    -> per prompt length P (--prompts): Engine.prefill of one random prompt of P tokens (chunks of
       --prefill-chunk), CUDA events around it, median of --reps (the first run compiles and is not
       timed); the experts prefill streamed and read from slots (GpuMoE.prefill_counts)
    -> limit = the streamed experts' bytes / the link's speed (pinned -> device copies of 256 MiB,
       measured in the run): the copy-engine time that prefill cannot go below while it streams
    -> the same prefill without the overlap (--no-serial skips it): GpuMoE's staging ring removed, so
       each streamed expert is copied on the compute stream when its turn comes and the compute waits
       for it; the overlap's saving is that TTFT less the streamed one, on the same prompt and slots
    -> --trace-out: a Chrome / Perfetto trace of the shortest prompt's prefill
    -> table and --out JSON (GPU, versions, commit)

Run: python benchmarks/bench_prefill.py [--layers 8] [--prompts 1024,8192,32768] [--slots-frac 0.25]
     [--expert-format int4] [--no-serial] [--out prefill.json] [--trace-out prefill-trace.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from expertcache.formats import format_names


def resident_routing(layers: int, experts: int, top_k: int, slots: int, batch: int = 1) -> np.ndarray:
    """int32 [N, L, batch, k] forced routing of N decode steps that route every layer to its experts
    0..slots/L - 1 (k distinct a step, every row alike), so an LRU cache of `slots` slots ends up
    holding them (bench_step: slots = L * E, every expert)."""
    per_layer = min(experts, slots // layers)
    steps = -(-per_layer // top_k)
    ids = (np.arange(steps * top_k) % per_layer).reshape(steps, 1, 1, top_k)
    for n in range(steps):  # a step's k ids must be distinct: shift a short last step
        row = ids[n, 0, 0]
        if len(set(row.tolist())) < top_k:
            ids[n, 0, 0] = np.arange(top_k) % experts
    return np.ascontiguousarray(np.broadcast_to(ids, (steps, layers, batch, top_k))).astype(np.int32)


def copy_limit(streamed: int, bytes_per_expert: int, link_bytes_per_s: float) -> float:
    """Seconds the copy engine needs for `streamed` experts of `bytes_per_expert` bytes."""
    return streamed * bytes_per_expert / link_bytes_per_s


def measure(weights, args: argparse.Namespace, prompt_len: int, trace_out: Path | None,
            overlap: bool = True) -> dict:
    import torch

    from moe.engine.backends import GpuMoE
    from moe.engine.engine import Engine

    spec = weights.spec
    layers, experts, k = spec.num_moe_layers, spec.moe.num_experts, spec.moe.top_k
    slots = max(k, int(args.slots_frac * layers * experts))
    backend = GpuMoE(weights, slots, "lru", max_batch=1, forced_routing=True)
    if not overlap:  # every streamed expert copied on the compute stream as its turn comes
        backend.staging = None
    engine = Engine(weights, backend, max_batch=1, max_seq_len=prompt_len + 8, cuda_graphs=False,
                    prefill_chunk=args.prefill_chunk)
    fill = torch.from_numpy(resident_routing(layers, experts, k, slots)).cuda()
    flat = torch.full((layers, 1, k), 1.0 / k, device="cuda")
    tokens = engine.prefill([[1, 2, 3, 4]]).argmax(-1)
    for n in range(fill.shape[0]):
        backend.set_routing(fill[n], flat)
        tokens = engine.decode_step(tokens).argmax(-1)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=gen).tolist()
    engine.prefill([prompt])  # compiles; not timed
    times, counts, unused = [], [], []
    for _ in range(args.reps):
        before = list(backend.prefill_counts)
        unused_before = backend.staging.prefetched_unused if backend.staging is not None else 0
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.prefill([prompt]).argmax(-1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
        counts.append([a - b for a, b in zip(backend.prefill_counts, before)])
        unused.append((backend.staging.prefetched_unused if backend.staging is not None else 0) - unused_before)
    if trace_out is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.prefill([prompt])
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace_out))
    backend.slots.close()
    streamed, reused = counts[-1]
    return {
        "prompt_tokens": prompt_len,
        "slots": slots,
        "ttft_s": float(np.median(times)),
        "ttft_s_min": min(times),
        "ttft_s_max": max(times),
        "prefill_tokens_per_s": prompt_len / float(np.median(times)),
        "experts_streamed": streamed,
        "experts_from_slots": reused,
        "prefetched_unused": unused[-1],
        "bytes_per_expert": weights.store.bytes_per_expert,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompts", default="1024,8192,32768")
    ap.add_argument("--slots-frac", type=float, default=0.25)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="Engine prefill_chunk (default the engine's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-format", choices=format_names(), default=None,
                    help="the routed experts' format in the host store and the slots (default: bf16)")
    ap.add_argument("--no-serial", dest="serial", action="store_false",
                    help="skip the same prefill without the staging ring's overlap")
    ap.add_argument("--out")
    ap.add_argument("--trace-out")
    args = ap.parse_args(argv)
    try:
        args.prompts = [int(v) for v in args.prompts.split(",")]
    except ValueError:
        ap.error(f"--prompts: {args.prompts!r} is not a comma list of ints")
    if min(args.prompts) < 1 or args.layers < 1 or args.reps < 1:
        ap.error("--prompts, --layers and --reps must be >= 1")
    if not 0 < args.slots_frac <= 1:
        ap.error(f"--slots-frac must be in (0, 1], got {args.slots_frac}")
    if args.prefill_chunk is None:
        from moe.engine.engine import PREFILL_CHUNK

        args.prefill_chunk = PREFILL_CHUNK
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    import benchmeta

    from moe.testing.random_decoder import qwen3_30b_like, random_decoder

    weights = random_decoder(qwen3_30b_like(args.layers, vocab_size=args.vocab), "cuda", seed=args.seed,
                             expert_format=args.expert_format)
    link = benchmeta.link_bandwidth()
    rows = []
    for i, p in enumerate(sorted(args.prompts)):
        r = measure(weights, args, p, Path(args.trace_out) if args.trace_out and i == 0 else None)
        r["copy_limit_s"] = copy_limit(r["experts_streamed"], r["bytes_per_expert"], link)
        r["ttft_over_limit"] = r["ttft_s"] / r["copy_limit_s"] if r["copy_limit_s"] else None
        serial = ""
        if args.serial:
            s = measure(weights, args, p, None, overlap=False)
            r.update(serial_ttft_s=s["ttft_s"], serial_ttft_s_min=s["ttft_s_min"], serial_ttft_s_max=s["ttft_s_max"],
                     serial_experts_streamed=s["experts_streamed"], overlap_saving_s=s["ttft_s"] - r["ttft_s"],
                     serial_over_overlap=s["ttft_s"] / r["ttft_s"])
            serial = (f"; without the overlap {s['ttft_s'] * 1e3:.1f} ms (saves {r['overlap_saving_s'] * 1e3:.1f} ms, "
                      f"{r['serial_over_overlap']:.2f}x)")
        rows.append(r)
        print(f"prompt {p:>6}: TTFT {r['ttft_s'] * 1e3:8.1f} ms ({r['prefill_tokens_per_s']:8.0f} tok/s), "
              f"{r['experts_streamed']} experts streamed, {r['experts_from_slots']} from slots, copy limit "
              f"{r['copy_limit_s'] * 1e3:.1f} ms ({r['ttft_over_limit'] or 0:.2f}x){serial}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "bench_prefill", "machine": benchmeta.machine(),
                                              "link_bytes_per_s": link, "settings": vars(args),
                                              "expert_format": weights.spec.moe.expert_format, "rows": rows},
                                             indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
