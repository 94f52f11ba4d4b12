"""Miss-copy bandwidth, host -> device: the SM copy kernel against the copy engines.

    pinned HostStore of `sources` experts (>= 4x the L2 in total; every timed call copies the
    next experts in turn, so no source is served from L2)
    -> per (expert size, misses): miss_copy for each --ctas, eager and under CUDA-graph
       replay, and the copy-engine peer (miss_copy_ce: one copy_(non_blocking=True) per bank
       and miss from pinned memory), all on the same plans
    -> CUDA-event times of each call (a sleep kernel ahead of the start event hides the host's
       launch cost), warm-up first, variants interleaved every repetition in a rotating
       order, medians
    -> table (last) and JSON (default benchmarks/results/copy.json)

Run: python benchmarks/bench_copy.py [--sizes 1.7,2.7,6.3] [--misses 1,2,4,10]
     [--ctas 8,16,32] [--banks 2] [--reps 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import benchmeta
import numpy as np
import torch

from expertcache.copy import DEFAULT_BLOCK_BYTES, DEFAULT_NUM_WARPS, miss_copy, miss_copy_ce
from expertcache.pool import Bank, HostStore, SlotPool

TARGET = "target: SM copy >= 0.9x the copy engine at 2.7 MiB and above with <= 16 SMs (num_ctas)"
SLEEP_CYCLES = 400_000  # ~200 us at 2 GHz: longer than the host takes to enqueue one call


def expert_banks(size_mib: float, num_banks: int) -> tuple[Bank, ...]:
    """bf16 banks summing to ~size_mib: one bank, or gate_up (2/3) + down (1/3)."""
    unit = 48 if num_banks == 2 else 16  # both parts stay multiples of 16 bytes
    total = max(unit, round(size_mib * 2**20 / unit) * unit)
    if num_banks == 1:
        return (Bank("w", (total // 2,), torch.bfloat16),)
    return (Bank("gate_up", (total // 3,), torch.bfloat16), Bank("down", (total // 6,), torch.bfloat16))


def random_store(banks, num_keys: int) -> HostStore:
    store = HostStore.empty(banks, num_keys, pin=True)
    for b in banks:  # random bytes made on the GPU, copied into pinned memory
        host = store.tensor(b.name).view(num_keys, -1).view(torch.uint8)
        for k in range(num_keys):
            host[k].copy_(torch.randint(0, 256, (b.row_bytes,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    return store


class Case:
    """One (expert size, misses) configuration and its timed variants."""

    def __init__(self, store: HostStore, misses: int, args) -> None:
        self.store, self.misses, self.args = store, misses, args
        self.pool = SlotPool(store.banks, max(misses, 1), "cuda")
        n = store.num_keys
        # plans[j] = rows (key, slot): the next `misses` sources, slots reversed so that
        # miss_copy_ce issues one copy per (bank, miss) instead of merging a run
        rows = [[((j * misses + i) % n, misses - 1 - i) for i in range(misses)] for j in range(n)]
        self.plans_host = np.array(rows, dtype=np.int32)
        self.plans = torch.from_numpy(self.plans_host).cuda()
        self.count = torch.tensor([misses], dtype=torch.int32, device="cuda")
        self.graph_plan = self.plans[0].clone()
        self.graphs = {c: self._capture(c) for c in args.ctas}
        self.turn = 0

    def _kw(self, ctas: int) -> dict:
        return {"num_ctas": ctas, "block_bytes": self.args.block_bytes, "num_warps": self.args.num_warps}

    def _capture(self, ctas: int) -> torch.cuda.CUDAGraph:
        miss_copy(self.store, self.pool, self.graph_plan, self.count, **self._kw(ctas))  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            miss_copy(self.store, self.pool, self.graph_plan, self.count, **self._kw(ctas))
        return graph

    def variants(self) -> dict:
        out = {}
        for c in self.args.ctas:
            out[f"sm{c}"] = lambda j, c=c: miss_copy(self.store, self.pool, self.plans[j],
                                                     self.count, **self._kw(c))
            out[f"graph{c}"] = lambda j, c=c: self.graphs[c].replay()
        out["ce"] = lambda j: miss_copy_ce(self.store, self.pool, self.plans_host[j])
        return out

    def time_once(self, name: str, fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        j = self.turn % self.store.num_keys
        self.turn += 1
        if name.startswith("graph"):
            self.graph_plan.copy_(self.plans[j])  # untimed: before the sleep and the start event
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(j)
        end.record()
        return start, end

    def run(self) -> dict:
        variants = self.variants()
        for _ in range(self.args.warmup):
            for name, fn in variants.items():
                self.time_once(name, fn)
        names = list(variants)
        times = {name: [] for name in names}
        for r in range(self.args.reps):  # interleaved: every variant once per round, and the
            order = names[r % len(names):] + names[:r % len(names)]  # first after a sync rotates
            events = {name: self.time_once(name, variants[name]) for name in order}
            torch.cuda.synchronize()
            for name, (s, e) in events.items():
                times[name].append(s.elapsed_time(e) * 1e3)  # us
        nbytes = self.misses * self.store.bytes_per_expert
        return {name: {"median_us": float(np.median(t)), "p10_us": float(np.percentile(t, 10)),
                       "p90_us": float(np.percentile(t, 90)),
                       "gbps": nbytes / (float(np.median(t)) * 1e-6) / 1e9} for name, t in times.items()}


def table(rows: list[dict], ctas: list[int]) -> str:
    small = [c for c in ctas if c <= 16]
    head = (["MiB", "miss"] + [f"sm{c}" for c in ctas] + [f"graph{c}" for c in ctas]
            + ["ce", "best<=16/ce"])
    lines = [TARGET, "GB/s per variant (sm = eager, graph = CUDA-graph replay; suffix = num_ctas)",
             " ".join(f"{h:>9}" for h in head)]
    for r in rows:
        v = r["variants"]
        best = max((v[f"{k}{c}"]["gbps"] for k in ("sm", "graph") for c in small), default=float("nan"))
        gbps = [v[f"{k}{c}"]["gbps"] for k in ("sm", "graph") for c in ctas] + [v["ce"]["gbps"]]
        cells = ([f"{r['size_mib']:.1f}", str(r["misses"])] + [f"{g:.1f}" for g in gbps]
                 + [f"{best / v['ce']['gbps']:.2f}"])
        lines.append(" ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.7,2.7,6.3", help="expert sizes in MiB")
    ap.add_argument("--misses", default="1,2,4,10")
    ap.add_argument("--ctas", default="8,16,32", help="num_ctas values of the SM copy")
    ap.add_argument("--banks", type=int, choices=(1, 2), default=2, help="1 bank, or gate_up + down")
    ap.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    ap.add_argument("--num-warps", type=int, default=DEFAULT_NUM_WARPS)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/copy.json)")
    args = ap.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    args.misses = [int(s) for s in args.misses.split(",")]
    args.ctas = [int(s) for s in args.ctas.split(",")]
    return args


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_copy needs a CUDA GPU (it times host -> device copies); see --help", file=sys.stderr)
        sys.exit(2)
    info = benchmeta.machine()
    l2 = info["l2_bytes"] or 60 << 20
    rows = []
    for size in args.sizes:
        banks = expert_banks(size, args.banks)
        expert_bytes = sum(b.row_bytes for b in banks)
        sources = max(8, 2 * max(args.misses), math.ceil(4 * l2 / expert_bytes))
        store = random_store(banks, sources)
        for misses in args.misses:
            result = Case(store, misses, args).run()
            rows.append({"size_mib": size, "expert_bytes": expert_bytes, "banks": len(banks),
                         "misses": misses, "sources": sources, "variants": result})
            print(f"{size} MiB x {misses}: " + ", ".join(f"{k} {v['gbps']:.1f}" for k, v in result.items()),
                  flush=True)
        del store
    out = Path(args.out or Path(__file__).parent / "results" / "copy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    doc = {"machine": info, "settings": settings, "target": TARGET, "rows": rows}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    print(table(rows, args.ctas))


if __name__ == "__main__":
    main()
