"""The gated delta rule of Qwen3-Next's linear-attention layers on the GPU: the decode step against its
HBM floor and torch, the chunked prefill against the token-by-token recurrence.

    geometry: Qwen3-Next-80B-A3B's linear attention (16 key heads, 32 value heads, head dims 128:
              a 2 MiB float32 state a row and layer), 36 layers' states so L2 cannot hold them
    decode  -> check first: the kernel's outputs and state against delta_rule_reference (float32)
            -> per rows B and variant (the kernel at --block-v columns a program; "torch": the same
               step in torch ops) one CUDA graph of a step at every layer, replayed in a rotating
               order (bench_routed's timing): us a layer step; median, min, max over reps
            -> floor = the state read and written once / device-to-device copy bandwidth (this run)
    prefill -> delta_rule_chunked (--chunk) against delta_rule_reference at T tokens, B = 1, one
               layer: ms each (median of 3) and the speedup
    -> table (last) and JSON (GPU name, torch / triton versions, commit)

Run on a GPU: python benchmarks/bench_delta_rule.py [--rows 1,4,16,64] [--block-v 16,32,64]
    [--prefill 1024,4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchmeta
import numpy as np
import torch
from bench_routed import time_variants

from moe.kernels.delta_rule import delta_rule_chunked, delta_rule_reference, delta_rule_step

HK, HV, DK, DV, LAYERS = 16, 32, 128, 128, 36


def inputs(b: int, t: int | None, seed: int):
    """bf16 q, k, v and float32 g (<= 0), beta in (0, 1), as the layer computes them; t=None: one token."""
    gen = torch.Generator().manual_seed(seed)
    lead = (b,) if t is None else (b, t)
    q, k = (torch.randn(*lead, HK, DK, generator=gen).bfloat16().cuda() for _ in range(2))
    v = torch.randn(*lead, HV, DV, generator=gen).bfloat16().cuda()
    g = (-torch.nn.functional.softplus(torch.randn(*lead, HV, generator=gen)) * 0.1).cuda()
    beta = torch.rand(*lead, HV, generator=gen).bfloat16().cuda()
    return q, k, v, g, beta


def decode_case(b: int, block_vs: list[int], bandwidth: float, args) -> dict:
    steps = [inputs(b, None, seed=b * 100 + i) for i in range(LAYERS)]
    states = [0.1 * torch.randn(b, HV, DK, DV, device="cuda") for _ in range(LAYERS)]
    q, k, v, g, beta = steps[0]
    want_o, want_s = delta_rule_reference(*(x[:, None] for x in steps[0]), states[0])
    s = states[0].clone()
    o = delta_rule_step(q, k, v, g, beta, s)
    err = max(float((o - want_o[:, 0]).abs().max()), float((s - want_s).abs().max()))
    if err > 1e-4:
        raise SystemExit(f"B={b}: the kernel differs from the reference by {err}; not timing")
    outs = [torch.empty(b, HV, DV, device="cuda") for _ in range(LAYERS)]

    def graph(fn):
        for _ in range(2):  # warm up (compiles) outside the capture
            fn()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fn()
        return gr

    def kernel(bv):
        return lambda: [delta_rule_step(*steps[i], states[i], out=outs[i], block_v=bv) for i in range(LAYERS)]

    def torch_step():
        for i in range(LAYERS):
            o_i, s_i = delta_rule_reference(*(x[:, None] for x in steps[i]), states[i])
            states[i].copy_(s_i)
            outs[i].copy_(o_i[:, 0])

    graphs = {f"kernel-bv{bv}": graph(kernel(bv)) for bv in block_vs}
    graphs["torch"] = graph(torch_step)
    timed = time_variants(graphs, LAYERS, args.reps, args.warmup)
    floor_us = 2 * b * HV * DK * DV * 4 / bandwidth * 1e6
    return {"rows": b, "check_max_abs_err": err, "floor_us": floor_us,
            "variants": {n: {**t, "x_floor": t["us_median"] / floor_us} for n, t in timed.items()}}


def prefill_case(t: int, chunk: int) -> dict:
    q, k, v, g, beta = inputs(1, t, seed=t)
    state = 0.1 * torch.randn(1, HV, DK, DV, device="cuda")
    ms = {}
    for name, fn in (("chunked", lambda: delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)),
                     ("recurrence", lambda: delta_rule_reference(q, k, v, g, beta, state))):
        runs = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) * 1e3)
        ms[name] = float(np.median(runs[1:]))
        ms[name + "_out"] = out
    err = max(float((ms["chunked_out"][i] - ms["recurrence_out"][i]).abs().max()) for i in range(2))
    return {"tokens": t, "chunk": chunk, "chunked_ms": ms["chunked"], "recurrence_ms": ms["recurrence"],
            "speedup": ms["recurrence"] / ms["chunked"], "max_abs_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--block-v", default="16,32,64")
    ap.add_argument("--prefill", default="1024,4096")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "delta-rule.json"))
    args = ap.parse_args()
    bandwidth = benchmeta.d2d_bandwidth()
    block_vs = [int(x) for x in args.block_v.split(",")]
    decode = [decode_case(int(b), block_vs, bandwidth, args) for b in args.rows.split(",")]
    prefill = [prefill_case(int(t), args.chunk) for t in args.prefill.split(",") if t]
    result = {"bench": "delta_rule", "machine": benchmeta.machine(), "d2d_bandwidth": bandwidth,
              "geometry": {"key_heads": HK, "value_heads": HV, "key_dim": DK, "value_dim": DV, "layers": LAYERS},
              "decode": decode, "prefill": prefill}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"d2d bandwidth {bandwidth / 1e9:.0f} GB/s; us a layer step, median [min, max], x the HBM floor")
    for row in decode:
        cells = "  ".join(f"{n} {t['us_median']:.2f} [{t['us_min']:.2f}, {t['us_max']:.2f}] {t['x_floor']:.2f}x"
                          for n, t in row["variants"].items())
        print(f"B={row['rows']:3d} floor {row['floor_us']:.2f}  {cells}")
    for row in prefill:
        print(
            f"prefill T={row['tokens']}: chunked {row['chunked_ms']:.1f} ms, recurrence {row['recurrence_ms']:.1f} ms "
            f"({row['speedup']:.1f}x), max abs err {row['max_abs_err']:.1e}"
        )
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()
