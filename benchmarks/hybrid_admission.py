"""Which misses a hybrid split copies (admits): the policy's priority against the lowest keys and a random pick.

    real traces (../shared/traces or --traces DIR) x policies x slot counts (10 / 20 / 30 % of the keys)
    -> the host reference (expertcache.HostCache) under the hybrid split of each host profile (sim.service),
       its miss priority (Policy.miss_priority) as the product ranks the copies, or replaced by
       "key" (all equal: the lowest keys are copied) or "random" (a seeded draw per call)
    -> misses a token and modeled tok/s (sim.service.estimate_service) of each ranking, and without the fill
    -> table and JSON (default benchmarks/results/hybrid-admission.json)

Only the ranking differs between the first three; the copy counts are the same table. "no-fill" ranks
as "priority" but leaves out the rule that a pool still filling copies every miss its empty slots take.
lru and lfuda keep no per-key state: their priority is a fixed draw per (key, call clock)
(expertcache.split.hash_priority).

Run: python benchmarks/hybrid_admission.py [--traces DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchmeta
import numpy as np

from expertcache import CacheGeometry, HostCache, MissSplit
from sim.budget import trace_shape
from sim.replay import trace_calls
from sim.service import HOSTS, estimate_service
from sim.trace import load_trace

TRACES = ("gemma4-decode.npz", "flame-290m-a.npz", "mixtral-gsm8k.npz")
POLICIES = ("rule", "markov", "lfuda", "lru")
RANKINGS = ("priority", "key", "random", "no-fill")


class NoFill(MissSplit):
    """The same table without filling empty slots first: a pool still filling copies only copies[m]."""

    @property
    def fills(self) -> bool:
        return False


def run_one(trace, policy: str, slots: int, split, ranking: str, seed: int = 0):
    ids, layers, _, _ = trace_calls(trace)
    if ranking == "no-fill":  # ranks by the priority, without the fill
        split = NoFill(split.service, split.copies, split.costs)
    cache = HostCache(CacheGeometry(trace.num_layers, trace.num_experts, slots), policy, split=split)
    if ranking in ("key", "random"):
        rng = np.random.default_rng(seed)

        def other(st, clk, keys, access):
            if ranking == "key":
                return np.zeros(keys.shape[0], dtype=np.int64)
            return rng.integers(0, 1 << 30, keys.shape[0])
        cache.policy.miss_priority = other
    q = ids.shape[1] * ids.shape[2] + 1
    hist = np.zeros((trace.num_layers, q), dtype=np.int64)
    split_hist = np.zeros((q, q), dtype=np.int64)
    for c in range(ids.shape[0]):
        res = cache.ensure(int(layers[c]), ids[c])
        hist[int(layers[c]), res.misses] += 1
        split_hist[res.misses, res.copies] += 1
    return hist, split_hist, int(cache.counters[:, 2].sum()), int(cache.served.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    ap.add_argument("--hosts", default="h100-host,desktop")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid-admission.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'trace':<22}{'host':<11}{'policy':<8}{'slots':>6}" + "".join(f"{r + ' tok/s':>14}" for r in RANKINGS)
          + f"{'prio/key':>12}{'misses p/k/r':>22}")
    for name in TRACES:
        path = Path(args.traces) / name
        if not path.exists():
            print(f"{name}: absent from {args.traces}, skipped")
            continue
        trace = load_trace(path)
        shape = trace_shape(trace)
        total = trace.num_layers * trace.num_experts
        for host_name in args.hosts.split(","):
            host = HOSTS[host_name]
            split = host.split("hybrid", shape.expert_bytes)
            for policy in POLICIES:
                for frac in (0.1, 0.2, 0.3):
                    slots = max(round(frac * total), trace.batch * trace.meta.top_k)
                    got = {}
                    for ranking in RANKINGS:
                        hist, split_hist, misses, served = run_one(trace, policy, slots, split, ranking)
                        est = estimate_service(hist, trace.num_tokens, shape, host, split, batch=trace.batch,
                                               policy=policy, split_hist=split_hist)
                        got[ranking] = {"tokens_per_s": est.tokens_per_s, "misses": misses, "served": served}
                    rows.append({"trace": name, "host": host_name, "policy": policy, "slots": slots,
                                 "slots_frac": frac, **got})
                    ratio = got["priority"]["tokens_per_s"] / got["key"]["tokens_per_s"]
                    misses = "/".join(str(got[r]["misses"]) for r in RANKINGS)
                    print(f"{name:<22}{host_name:<11}{policy:<8}{slots:>6}"
                          + "".join(f"{got[r]['tokens_per_s']:>14.1f}" for r in RANKINGS)
                          + f"{ratio:>11.3f}x{misses:>22}")
    Path(args.out).write_text(json.dumps({"bench": "hybrid_admission", "machine": benchmeta.cpu_machine(),
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
