"""Replay throughput: expert accesses per second on one core, per policy and slot count.

    synthetic Qwen3-Next-like trace (48 layers x 512 experts, top-10, >= 2000 tokens)
    -> sim.replay.replay per (policy, slots), warmed up (compiled) first
    -> median / min / max seconds over --repeats runs, interleaved across configurations
    -> table (last) and JSON (default benchmarks/results/replay.json)

Run: python benchmarks/bench_replay.py [--tokens 2000] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numba
import numpy as np

from sim.replay import replay
from sim.synthetic import generate, preset

POLICIES = ("lru", "rule", "lfuda", "markov", "belady")
TARGETS = {"lru": 2e6, "rule": 2e6, "markov": 1e6, "belady": 0.5e6}  # accesses/s on one core


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores_visible": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", default="1650,6144,12288,18432")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/replay.json)")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    traces = {
        "plain": generate(preset("qwen3-next", num_tokens=args.tokens)),
        "logits": generate(preset("qwen3-next", num_tokens=args.tokens, with_logits=True)),
    }
    configs = [(p, s, "plain") for p in POLICIES for s in slots] + [("rule", s, "logits") for s in slots]
    for p, _, t in configs:  # compile and warm up, untimed
        replay(traces[t].slice_tokens(0, 20), p, 2000)
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    results = {}
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for c in configs:
            p, s, t = c
            t0 = time.perf_counter()
            results[c] = replay(traces[t], p, s)
            times[c].append(time.perf_counter() - t0)
    rows = []
    for c in configs:
        p, s, t = c
        r, ts = results[c], np.array(times[c])
        rows.append({"policy": p, "slots": s, "trace": t, "accesses": r.accesses,
                     "hit_rate": r.hit_rate, "seconds_median": float(np.median(ts)),
                     "seconds_min": float(ts.min()), "seconds_max": float(ts.max()),
                     "accesses_per_s_median": r.accesses / float(np.median(ts)),
                     "target_per_s": TARGETS.get(p)})
    info = machine()
    out = Path(args.out or Path(__file__).parent / "results" / "replay.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "replay", "machine": info, "tokens": args.tokens,
                               "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"replay throughput, qwen3-next synthetic, {args.tokens} tokens "
          f"({rows[0]['accesses']} accesses), one core: {info['cpu']}")
    print(f"{'policy':<8} {'trace':<7} {'slots':>6} {'hit rate':>8} {'Macc/s med':>10} "
          f"{'min..max s':>15} {'target':>7}")
    for r in rows:
        tgt = "" if r["target_per_s"] is None else f"{r['target_per_s'] / 1e6:.1f}M"
        print(f"{r['policy']:<8} {r['trace']:<7} {r['slots']:>6} {r['hit_rate']:>8.4f} "
              f"{r['accesses_per_s_median'] / 1e6:>10.2f} "
              f"{r['seconds_min']:>7.3f}..{r['seconds_max']:<7.3f} {tgt:>7}")
    print(f"json: {out}")


if __name__ == "__main__":
    main()
