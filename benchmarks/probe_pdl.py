"""What a chain of programmatic dependent launches guarantees, measured with %globaltimer.

    A: a long streaming kernel (frees its dependents at once)
    B: launched programmatically after A; frees its dependents at once; waits for A only with --wait-b
    C: launched programmatically after B; waits for B (griddepcontrol.wait)

Printed per setting (B waiting or not, eager or CUDA-graph replay), in us relative to A's end:
B's first start, B's end, C's first start, and C's first return from its wait. A negative
"c_wait" with B not waiting means a launch that never waits can complete while its own predecessor
still runs, so a wait for it says nothing about the launch before it. Needs a CUDA GPU (sm_90).
Usage: python benchmarks/probe_pdl.py [--out FILE]
"""
import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def kern_a(x_ptr, n, ts_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for it in range(ITERS):
        offs = (pid * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs % n)
    tl.store(x_ptr + n + pid * BLOCK + tl.arange(0, BLOCK), acc)
    tl.atomic_max(ts_ptr + 0, _now())  # A's last end


@triton.jit
def kern_b(ts_ptr, WAIT: tl.constexpr):
    tl.atomic_min(ts_ptr + 1, _now())  # B's first start
    gdc_launch_dependents()
    if WAIT:
        gdc_wait()
    tl.atomic_max(ts_ptr + 2, _now())  # B's end


@triton.jit
def kern_c(ts_ptr):
    tl.atomic_min(ts_ptr + 3, _now())  # C's first start
    gdc_wait()
    tl.atomic_min(ts_ptr + 4, _now())  # C's first return from its wait


def run(wait_b: bool, graph: bool) -> list[dict]:
    """Five rounds of A, B, C (eager, or each round captured then replayed once)."""
    n = 1 << 26
    x = torch.randn(n + 132 * 4 * 1024, device="cuda")
    ts = torch.tensor([0, 2**62, 0, 2**62, 2**62], dtype=torch.int64, device="cuda")

    def step():
        kern_a[(132 * 4,)](x, n, ts, ITERS=64, BLOCK=1024, num_warps=4)
        kern_b[(4,)](ts, WAIT=wait_b, launch_pdl=True, num_warps=1)
        kern_c[(4,)](ts, launch_pdl=True, num_warps=1)
    step()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        ts.copy_(torch.tensor([0, 2**62, 0, 2**62, 2**62], dtype=torch.int64))
        if graph:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                step()
            ts.copy_(torch.tensor([0, 2**62, 0, 2**62, 2**62], dtype=torch.int64))
            g.replay()
        else:
            step()
        torch.cuda.synchronize()
        a_end, b_start, b_end, c_start, c_wait = ts.tolist()
        out.append({"b_start-a_end_us": (b_start - a_end) / 1e3, "b_end-a_end_us": (b_end - a_end) / 1e3,
                    "c_start-a_end_us": (c_start - a_end) / 1e3, "c_wait-a_end_us": (c_wait - a_end) / 1e3})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for every round's numbers")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for w in (False, True):
        for g in (False, True):
            res[f"wait_b={w},graph={g}"] = rounds = run(w, g)
            print(f"B waits {w}, graph {g}:", json.dumps(rounds[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
