"""benchmarks/bench_prefill_admission.py on a small synthetic trace: its bookkeeping against direct
replays with the host reference, and the invariants that hold whatever the routing."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.geometry import CacheGeometry
from expertcache.host import HostCache
from sim.synthetic import SyntheticConfig, generate
from sim.trace import save_trace
from tests.conftest import load_bench


def _bench():
    return load_bench("bench_prefill_admission")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pa") / "small.npz"
    save_trace(generate(SyntheticConfig(num_layers=2, num_experts=16, top_k=2, num_tokens=96, seed=3)), path)
    return path


def test_scenario_counts_match_a_direct_replay(trace_path):
    bench = _bench()
    from sim.trace import load_trace

    a, b = bench.sequences(load_trace(trace_path).experts, 4)[:2]
    warm, prompt, decode, slots = 10, 6, 5, 12
    for mode in bench.MODES:
        got = bench.scenario(a, b, 16, "lru", slots, warm, prompt, decode, mode)
        cache = HostCache(CacheGeometry(2, 16, slots), "lru")  # the same calls, written out
        for t in range(warm):
            for layer in range(2):
                cache.ensure(layer, a[t, layer][None].astype(np.int32))
        resident = set(np.flatnonzero(cache.slot_of >= 0).tolist())
        used = {layer * 16 + int(e) for layer in range(2) for e in np.unique(b[:prompt, layer])}
        m0 = int(cache.counters[:, 2].sum())
        if mode == "admit":  # chunk = min(prompt, slots // k) = 6 rows: one call per layer
            for layer in range(2):
                cache.ensure(layer, np.ascontiguousarray(b[:prompt, layer]).astype(np.int32))
        m1 = int(cache.counters[:, 2].sum())
        for s in range(decode):
            for layer in range(2):
                cache.ensure(layer, np.stack([a[warm + s, layer], b[prompt + s, layer]]).astype(np.int32))
        assert got == {"prefill_misses": m1 - m0, "prompt_experts_streamed": len(used),
                       "prompt_experts_not_resident": len(used - resident),
                       "decode_misses": int(cache.counters[:, 2].sum()) - m1, "decode_accesses": decode * 2 * 2 * 2}
        if mode == "bypass":
            assert got["prefill_misses"] == 0
        else:  # every prompt expert without a slot misses at least once when admitted
            assert got["prefill_misses"] >= got["prompt_experts_not_resident"] > 0


def test_main_writes_rows_and_checks_lengths(trace_path, tmp_path):
    bench = _bench()
    out = tmp_path / "pa.json"
    res = bench.main(["--trace", str(trace_path), "--slots", "8,16", "--warm", "8", "--prompt", "4",
                      "--decode", "4", "--policies", "lru,rule", "--out", str(out)])
    assert out.is_file() and len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["pairs"] == 12 and r["mean"]["bypass"]["prefill_misses"] == 0
        q = r["admit_over_bypass_decode_misses"]
        assert q["min"] <= q["mean"] <= q["max"]
    with pytest.raises(SystemExit, match="--decode"):
        bench.main(["--trace", str(trace_path), "--warm", "20", "--decode", "10", "--prompt", "4"])
    with pytest.raises(SystemExit, match="--seqs"):
        bench.main(["--trace", str(trace_path), "--seqs", "5"])
