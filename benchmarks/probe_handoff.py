"""The in-graph hand-off of a layer's CPU share, probed: its round trip inside one CUDA graph.

    GPU, post:  x [T, H] float32 (device) -> xin (mapped pinned host memory); a barrier, a system-scope
                release, then flag_in = seq (seq: a device counter the post advances)
    CPU:        a thread spinning on flag_in (an acquire load, the GIL released) computes out from xin
                (echo: out = 2 x; experts: moe.kernels.cpu_experts on a Qwen3-30B-A3B-shaped layer), then
                flag_out = seq with a release store
    GPU, wait:  one program spinning on flag_out (volatile loads) until it reaches seq, a system-scope
                acquire, then out (mapped) -> a device buffer
    -> a CUDA graph of R (post, [GPU work], wait) steps, replayed; microseconds a step (CUDA events),
       against the same graph with the CPU side answering at once (echo) and without the hand-off

Only a probe of the mechanism (stream order, graph capture, no host sync, its cost); the product's
workers build on it. Run: python benchmarks/probe_handoff.py [--reps 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import benchmeta
import numpy as np
import torch
import triton
import triton.language as tl
from numba import njit

from expertcache.pool import DeviceView, mapped_device_pointer
from moe.engine.handoff import answer, await_flag, raise_flag, wait_post
from moe.kernels.cpu_atomics import load_acquire, store_release


@njit(nogil=True, cache=True)
def echo_worker(flag_in, flag_out, stop, xin, out):
    """Answer every post at once: out = 2 * xin, flag_out = its seq. Returns when stop[0] is set."""
    last = 0
    while True:
        s = load_acquire(flag_in, 0)
        if s != last:
            for j in range(xin.shape[0]):
                out[j] = 2.0 * xin[j]
            store_release(flag_out, 0, s)
            last = s
        elif load_acquire(stop, 0) != 0:
            return


@triton.jit
def post_kernel(x_ptr, xin_ptr, seq_ptr, flag_ptr, fence_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(xin_ptr + i, tl.load(x_ptr + i))
    raise_flag(seq_ptr, flag_ptr, fence_ptr)


@triton.jit
def wait_kernel(flag_ptr, seq_ptr, out_ptr, dst_ptr, fence_ptr, N: tl.constexpr):
    await_flag(flag_ptr, seq_ptr, fence_ptr)
    i = tl.arange(0, N)
    tl.store(dst_ptr + i, tl.load(out_ptr + i, volatile=True))


@triton.jit
def busy_kernel(ptr, N: tl.constexpr, ITERS: tl.constexpr):
    """GPU work beside the CPU's (a stand-in for the hits' GEMM): ITERS passes over N floats."""
    i = tl.arange(0, N)
    v = tl.load(ptr + i)
    for _ in range(ITERS):
        v = v * 1.0001 + 0.5
    tl.store(ptr + i, v)


def mapped(t: torch.Tensor) -> DeviceView:
    return DeviceView(mapped_device_pointer(t.data_ptr(), "handoff"), t.dtype, t.numel() * t.element_size(), t)


def run(mode: str, reps: int, hidden: int, busy_iters: int, handoff: bool) -> dict:
    dev = torch.device("cuda")
    n = hidden
    x = torch.randn(n, device=dev)
    dst = torch.empty(n, device=dev)
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    fence = torch.zeros(1, dtype=torch.int32, device=dev)
    busy = torch.randn(4096, device=dev)
    host = {k: torch.zeros(n if k in ("xin", "out") else 1, dtype=torch.float32 if k in ("xin", "out") else torch.int32,
                           pin_memory=True) for k in ("xin", "out", "flag_in", "flag_out", "stop")}
    views = {k: mapped(v) for k, v in host.items()}
    arrays = {k: v.numpy() for k, v in host.items()}
    experts = None
    if mode == "experts":
        experts = _experts(hidden)
    stop = arrays["stop"]

    def cpu_side():
        if mode == "echo":
            echo_worker(arrays["flag_in"], arrays["flag_out"], stop, arrays["xin"], arrays["out"])
            return
        last = 0
        x2 = arrays["xin"].reshape(1, -1)
        out2 = arrays["out"].reshape(1, -1)
        ids, weights = np.array([[3, 7, -1, -1, -1, -1, -1, -1]], np.int32), np.full((1, 8), 0.125, np.float32)
        while True:
            s = wait_post(arrays["flag_in"], stop, last)
            if s < 0:
                return
            experts.moe(0, x2, ids, weights, out=out2)
            answer(arrays["flag_out"], s)
            last = s

    def step():
        if handoff:
            post_kernel[(1,)](x, views["xin"], seq, views["flag_in"], fence, N=n)
        if busy_iters:
            busy_kernel[(1,)](busy, N=4096, ITERS=busy_iters)
        if handoff:
            wait_kernel[(1,)](views["flag_out"], seq, views["out"], dst, fence, N=n)

    worker = threading.Thread(target=cpu_side, daemon=True)
    worker.start()
    try:
        for _ in range(3):  # compile and warm up eagerly
            step()
        torch.cuda.synchronize()
        if handoff and mode == "echo":
            assert torch.equal(dst, 2 * x), "the echo came back wrong"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                step()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / reps)
        if handoff and mode == "echo":
            assert torch.equal(dst, 2 * x), "the echo came back wrong after the graph"
    finally:
        stop[0] = 1
        worker.join(timeout=10)
    return {"mode": mode, "handoff": handoff, "busy_iters": busy_iters, "us_per_step": float(np.median(times)),
            "us_spread": [float(min(times)), float(max(times))]}


def _experts(hidden: int):
    """CpuExperts over a one-layer bf16 store of 16 random experts of Qwen3-30B-A3B's shape."""
    from expertcache.formats import get_format
    from expertcache.pool import HostStore
    from moe.kernels.cpu_experts import CpuExperts
    from moe.model.config import MoEConfig

    cfg = MoEConfig(hidden=hidden, num_experts=16, top_k=8, expert_intermediate=768, dtype="bfloat16",
                    expert_format="bf16")
    banks = get_format("bf16").expert_banks(hidden, 768)
    store = HostStore.from_tensors({b.name: (torch.randn(16, *b.row_shape) * 0.02).to(b.dtype) for b in banks},
                                   pin=True)
    return CpuExperts(store, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "handoff.json"))
    args = ap.parse_args()
    rows = []
    for mode, handoff, busy in (("echo", False, 0), ("echo", True, 0), ("echo", False, 200), ("echo", True, 200),
                                ("experts", True, 0)):
        t0 = time.perf_counter()
        r = run(mode, args.reps, args.hidden, busy, handoff)
        rows.append(r)
        print(f"{mode:<8} handoff={handoff!s:<5} busy={busy:<4} {r['us_per_step']:8.2f} us a step "
              f"[{r['us_spread'][0]:.2f}, {r['us_spread'][1]:.2f}]  ({time.perf_counter() - t0:.1f} s)", flush=True)
    base = {(r["mode"], r["busy_iters"]): r["us_per_step"] for r in rows if not r["handoff"]}
    for r in rows:
        if r["handoff"] and (r["mode"], r["busy_iters"]) in base:
            r["round_trip_us"] = r["us_per_step"] - base[(r["mode"], r["busy_iters"])]
    Path(args.out).write_text(json.dumps({"bench": "probe_handoff", "machine": benchmeta.machine(),
                                          "reps": args.reps, "hidden": args.hidden, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
