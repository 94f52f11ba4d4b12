"""Why prefill bypasses the expert cache: decode misses after a new request's prefill, when the prompt's
routing goes through the cache ("admit") and when it does not ("bypass", what moe.engine.backends does).

    trace [N, L, k] split into --seqs sequences of N / seqs tokens (flame-290m-a: 4 x 256 teacher-
    forced sequences; the synthetic qwen3-next preset: 8 layers, 4 x 256 tokens)
    per ordered pair (a, b) of sequences, per policy and slot count, from a cold cache:
      1. decode a's tokens [0, W): one ensure per layer per token (batch 1)       (the working set)
      2. prefill b's first P tokens:  bypass: nothing touches the cache (the prompt's experts are
                                              streamed once per layer, outside the pool)
                                      admit:  one ensure per layer over the prompt's rows, in chunks of
                                              min(P, S // k) rows (the most one call may ask)
      3. decode a and b together for D steps (batch 2: a from W, b from P)
    -> misses in step 3 (a's and b's together) and in step 2 (admit's copies), per mode; the ratio
       admit / bypass of step 3's misses; the prompt's distinct (layer, expert) pairs (what bypass
       streams) and how many of them had no slot when the prefill began (what it must stream when
       it computes resident experts from their slots); mean over the pairs
    -> table and JSON (--out)

Bypass streams every distinct (layer, expert) the prompt uses once per layer (a copy-engine transfer);
admit copies the prompt's misses into the pool, about as many, so the prefill's own traffic is alike,
and what differs is what the decode steps after it pay. The host reference (expertcache.HostCache)
runs every call, so the counts are the contract's.

Run: python benchmarks/bench_prefill_admission.py [--trace PATH] [--slots 128,256] [--policies lru,rule]
    [--warm 128] [--prompt 64,128] [--decode 64] [--out FILE]   (CPU only; a few minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

from expertcache.geometry import CacheGeometry
from expertcache.host import HostCache
from sim.synthetic import generate, preset
from sim.trace import load_trace

MODES = ("bypass", "admit")


def sequences(experts: np.ndarray, seqs: int) -> list[np.ndarray]:
    """[N, L, B, k] (B = 1) or [N, L, k] -> `seqs` arrays [N / seqs, L, k]."""
    ids = experts[:, :, 0] if experts.ndim == 4 else experts
    if ids.shape[0] % seqs:
        raise SystemExit(f"--seqs {seqs} does not divide the trace's {ids.shape[0]} tokens")
    return list(ids.reshape(seqs, ids.shape[0] // seqs, *ids.shape[1:]))


def scenario(a: np.ndarray, b: np.ndarray, num_experts: int, policy: str, slots: int, warm: int,
             prompt: int, decode: int, mode: str) -> dict:
    """Misses of the prefill (admit only) and of the `decode` steps after it. See the module."""
    layers, k = a.shape[1], a.shape[2]
    cache = HostCache(CacheGeometry(layers, num_experts, slots), policy)
    for t in range(warm):
        for layer in range(layers):
            cache.ensure(layer, a[t, layer][None].astype(np.int32))
    before = int(cache.counters[:, 2].sum())
    used = [np.unique(b[:prompt, layer]) for layer in range(layers)]
    streamed = sum(len(u) for u in used)
    not_resident = sum(int((cache.slot_of[layer * num_experts + u] < 0).sum()) for layer, u in enumerate(used))
    if mode == "admit":
        chunk = max(1, min(prompt, slots // k))
        for t0 in range(0, prompt, chunk):
            for layer in range(layers):
                cache.ensure(layer, np.ascontiguousarray(b[t0:t0 + chunk, layer]).astype(np.int32))
    prefill = int(cache.counters[:, 2].sum()) - before
    before = int(cache.counters[:, 2].sum())
    for s in range(decode):
        for layer in range(layers):
            rows = np.stack([a[warm + s, layer], b[prompt + s, layer]]).astype(np.int32)
            cache.ensure(layer, rows)
    return {"prefill_misses": prefill, "prompt_experts_streamed": streamed,
            "prompt_experts_not_resident": not_resident,
            "decode_misses": int(cache.counters[:, 2].sum()) - before,
            "decode_accesses": decode * layers * 2 * k}


def run(name: str, seqs: list[np.ndarray], num_experts: int, args: argparse.Namespace) -> list[dict]:
    rows = []
    n = seqs[0].shape[0]
    for prompt in args.prompt:
        if args.warm + args.decode > n or prompt + args.decode > n:
            raise SystemExit(f"--warm/--prompt + --decode exceed the {n} tokens of a sequence")
        for policy, slots in itertools.product(args.policies, args.slots):
            per = {m: [] for m in MODES}
            for ia, ib in itertools.permutations(range(len(seqs)), 2):
                for mode in MODES:
                    per[mode].append(scenario(seqs[ia], seqs[ib], num_experts, policy, slots, args.warm,
                                              prompt, args.decode, mode))
            mean = {m: {f: float(np.mean([r[f] for r in per[m]])) for f in per[m][0]} for m in MODES}
            ratio = [x["decode_misses"] / max(y["decode_misses"], 1) for x, y in zip(per["admit"], per["bypass"])]
            rows.append({"trace": name, "policy": policy, "slots": slots, "prompt": prompt, "pairs": len(ratio),
                         "mean": mean, "admit_over_bypass_decode_misses": {
                             "mean": float(np.mean(ratio)), "min": float(np.min(ratio)),
                             "max": float(np.max(ratio))}})
            print(f"{name} {policy} S={slots} P={prompt}: decode misses bypass "
                  f"{mean['bypass']['decode_misses']:.0f}, admit {mean['admit']['decode_misses']:.0f} "
                  f"(x{np.mean(ratio):.2f}); admit's prefill misses {mean['admit']['prefill_misses']:.0f}, "
                  f"bypass streams {mean['bypass']['prompt_experts_streamed']:.0f}", flush=True)
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"decode misses in the {args.decode} batch-2 steps after a prefill (mean over ordered sequence pairs; "
             f"{args.warm} warm-up steps of the decoding sequence)",
             "| trace | policy | slots | prompt | bypass | admit | admit / bypass [min, max] | admit's prefill "
             "misses | bypass: experts streamed | of them not resident |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, q = r["mean"], r["admit_over_bypass_decode_misses"]
        lines.append(f"| {r['trace']} | {r['policy']} | {r['slots']} | {r['prompt']} | "
                     f"{m['bypass']['decode_misses']:.0f} | {m['admit']['decode_misses']:.0f} | "
                     f"{q['mean']:.2f} [{q['min']:.2f}, {q['max']:.2f}] | {m['admit']['prefill_misses']:.0f} | "
                     f"{m['bypass']['prompt_experts_streamed']:.0f} | "
                     f"{m['bypass']['prompt_experts_not_resident']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="an expertcache-trace/1 file (default: the synthetic qwen3-next preset, "
                                    "8 layers x 1024 tokens)")
    ap.add_argument("--seqs", type=int, default=4, help="sequences the trace is split into")
    ap.add_argument("--slots", default=None, help="comma list (default: 1/4 and 1/2 of the keys)")
    ap.add_argument("--policies", default="lru,rule")
    ap.add_argument("--warm", type=int, default=128)
    ap.add_argument("--prompt", default="64,128")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.trace:
        trace = load_trace(args.trace)
        name = Path(args.trace).stem
    else:
        trace = generate(preset("qwen3-next", num_layers=8, num_tokens=1024))
        name = "synthetic:qwen3-next(8 layers)"
    experts = trace.experts
    num_experts = int(trace.meta.num_experts)
    seqs = sequences(experts, args.seqs)
    keys = seqs[0].shape[1] * num_experts
    args.slots = [int(s) for s in args.slots.split(",")] if args.slots else [keys // 4, keys // 2]
    args.policies = args.policies.split(",")
    args.prompt = [int(p) for p in args.prompt.split(",")]
    rows = run(name, seqs, num_experts, args)
    res = {"bench": "prefill-admission", "trace": name, "num_experts": num_experts,
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
           "seconds": time.time() - t0}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    print(table(rows, args))
    return res


if __name__ == "__main__":
    main()
