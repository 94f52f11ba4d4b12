"""In-kernel durations (Nsight Compute) of the ensure against flashlib's lru_ensure, and of the
routed GEMM and the router at Qwen3-Next's shape, T = 1.

Under CUDA-graph replay (bench_ensure.py, bench_routed.py) a kernel's time includes its launch, ramp
and tail in the graph; ncu times each kernel alone, caches flushed (its default), which separates
what a kernel does from what its launch costs. Two steps:

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
launch__registers_per_thread,launch__grid_size --csv --log-file ncu.csv python benchmarks/probe_ncu.py
    python benchmarks/probe_ncu.py --summarize ncu.csv [--out probe.json]

The run: for 512 and 1650 slots and m = 0 and 1 misses per call (k = 10, bench_ensure's sequences),
the lru DeviceCache warmed then PROBE_CALLS timed calls, the same for flashlib (when installed);
then PROBE_CALLS routed_experts calls and router_topk calls. The summary is the median of each
group's last PROBE_CALLS launches.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

PROBE_CALLS = 8
SLOTS, MISSES = (512, 1650), (0, 1)


def run() -> None:
    import torch
    from bench_ensure import flashlib_state, sequence
    from bench_routed import make_pool

    from expertcache import CacheGeometry
    from expertcache.device.cache import DeviceCache
    from moe.kernels.routed import routed_experts
    from moe.kernels.router import router_topk

    for S in SLOTS:
        for m in MISSES:
            warm, calls, E = sequence("lru", S, m, PROBE_CALLS, 0)
            dev = DeviceCache(CacheGeometry(1, E, S), "lru")
            for w in torch.as_tensor(warm, device="cuda"):
                dev.ensure(0, w)
            ids = torch.as_tensor(calls, device="cuda")
            for c in range(len(calls)):
                dev.ensure(0, ids[c])
            torch.cuda.synchronize()
            try:
                from flashlib.kernels.slot_cache import lru_ensure
            except ImportError:
                print("flashlib not installed: its groups are left out", file=sys.stderr)
                continue
            state, outs = flashlib_state(S, E)
            for w in torch.as_tensor(warm, device="cuda"):
                lru_ensure(w.reshape(-1), **state, **outs)
            for c in range(len(calls)):
                lru_ensure(ids[c].reshape(-1), **state, **outs)
            torch.cuda.synchronize()
    gate_up, down = make_pool("qwen3-next", 64)
    hidden = torch.randn(1, 2048, device="cuda").bfloat16()
    slots = torch.randperm(64)[:10].to(torch.int32).cuda().view(1, 10)
    weights = torch.softmax(torch.randn(1, 10, device="cuda"), -1)
    out = torch.empty(1, 2048, device="cuda")
    for _ in range(PROBE_CALLS):
        routed_experts(hidden, slots, weights, gate_up, down, out=out)
    router_w = torch.randn(512, 2048, device="cuda").bfloat16()
    for _ in range(PROBE_CALLS):
        router_topk(hidden, router_w, 10, True)
    torch.cuda.synchronize()


def summarize(path: Path) -> dict:
    """Group ncu's rows into runs of consecutive launches of one kernel; per run: launches, grid,
    registers, and the median duration (us) and DRAM bytes read of its last PROBE_CALLS launches."""
    rows, header = [], None
    for r in csv.reader(path.open()):
        if r and r[0] == "ID":
            header = r
        elif header and len(r) == len(header):
            rows.append(dict(zip(header, r)))
    launches: dict[int, dict] = {}
    for r in rows:
        k = launches.setdefault(int(r["ID"]), {"name": r["Kernel Name"].split("(")[0]})
        k[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    runs: list[list[dict]] = []  # ensure kernels: consecutive launches; the routed pair and router: by name
    by_name: dict[str, list[dict]] = {}
    for i in sorted(launches):
        k = launches[i]
        if "ensure" not in k["name"]:
            if k["name"] not in by_name:
                by_name[k["name"]] = []
                runs.append(by_name[k["name"]])
            by_name[k["name"]].append(k)
        elif runs and runs[-1][-1]["name"] == k["name"]:
            runs[-1].append(k)
        else:
            runs.append([k])
    keep = ("ensure_kernel", "_lru_ensure_kernel", "_gate_up_kernel", "_down_kernel", "_router_kernel")
    out = []
    for run_ in runs:
        if not any(run_[0]["name"].endswith(n) for n in keep):
            continue
        last = run_[-PROBE_CALLS:]
        out.append({"kernel": run_[0]["name"], "launches": len(run_), "grid": int(last[0]["launch__grid_size"]),
                    "registers": int(last[0]["launch__registers_per_thread"]),
                    "us_median": float(np.median([k["gpu__time_duration.sum"] for k in last])) / 1e3,
                    "dram_bytes_read_median": float(np.median([k["dram__bytes_read.sum"] for k in last]))})
    return {"probe_calls": PROBE_CALLS, "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", type=Path, default=None, help="ncu --csv log to summarize (no GPU needed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.summarize is None:
        run()
        return
    result = summarize(args.summarize)
    for r in result["runs"]:
        print(f"{r['kernel']:>20} grid {r['grid']:>5} regs {r['registers']:>3} launches {r['launches']:>4}: "
              f"{r['us_median']:.2f} us, {r['dram_bytes_read_median'] / 1e6:.3f} MB read")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
