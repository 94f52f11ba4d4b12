"""Replays over N GPUs of one host (sim.ranks) and their price (sim.costmodel.estimate_ranks): one GPU is the
plain replay and estimate exactly; N GPUs are each rank's host reference call by call, share one GPU's
accesses, miss only cold with pools that hold every key; `expertcache sim --ranks` end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from expertcache import CacheGeometry, HostCache
from moe.cli import main
from sim.costmodel import H200_SM_COPY, HardwareProfile, ModelShape, estimate_decode, estimate_ranks
from sim.inputs import default_trace
from sim.ranks import min_rank_slots, rank_trace, replay_ranks
from sim.replay import replay, sim_policy_names
from sim.report import build_rows, estimate, model_shape
from sim.synthetic import generate, preset
from tests.sim.gen import random_trace
from tests.sim.test_cli_user import expertcache_sim

# 12 tokens x 3 layers, batch 2, top-2 of 10 experts with padding, top-4 router logits
SMALL = random_trace(7, n=12, layers=3, batch=2, k=2, num_experts=10, logits=4)
POLICIES = sim_policy_names()


def keys_of(trace, ranks: int = 1, rank: int = 0) -> set[tuple[int, int]]:
    """The (layer, expert) pairs the trace routes to that `rank` owns (expert % ranks == rank)."""
    n, layer, _, _ = np.nonzero(trace.experts >= 0)
    ids = trace.experts[trace.experts >= 0]
    return {(int(la), int(e)) for la, e in zip(layer, ids) if e % ranks == rank}


def hist_of(call_misses: np.ndarray, layers: int, width: int) -> np.ndarray:
    """Calls of each layer by miss count, from each call's misses in decode order."""
    hist = np.zeros((layers, width), dtype=np.int64)
    np.add.at(hist, (np.tile(np.arange(layers), call_misses.shape[0] // layers), call_misses), 1)
    return hist


@pytest.mark.parametrize("policy", POLICIES)
def test_one_rank_is_the_plain_replay(policy):
    one, plain = replay_ranks(SMALL, policy, 9, 1), replay(SMALL, policy, 9)
    assert one.to_dict() == plain.to_dict() and np.array_equal(one.hist, plain.hist)
    assert one.ranks == 1 and one.layer_routed is None and "ranks" not in one.to_dict()


@pytest.mark.parametrize("policy", POLICIES)
def test_each_calls_misses_add_up_to_the_replay_and_change_nothing(policy):
    """call_misses (the compiled kernel's and next-token's per-call output): summed per layer they are the
    layer's misses, counted they are the histogram, and asking for them leaves every result as it was."""
    calls = np.full(SMALL.num_tokens * SMALL.num_layers, -1, dtype=np.int64)
    got, plain = replay(SMALL, policy, 7, call_misses=calls), replay(SMALL, policy, 7)
    assert got.to_dict() == plain.to_dict() and np.array_equal(got.hist, plain.hist)
    assert np.array_equal(np.bincount(np.tile(np.arange(3), 12), calls, minlength=3), plain.layer_misses)
    assert np.array_equal(hist_of(calls, 3, plain.hist.shape[1]), plain.hist)


@pytest.mark.parametrize("policy", ["lru", "rule", "lfuda"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_ranked_replay_is_each_ranks_host_reference_call_by_call(policy, ranks):
    """Every rank a HostCache of its own over expert // ranks of its experts (expert % ranks == rank), driven
    call by call in decode order with its share of the routing and logits: the slowest rank's misses, the
    busiest rank's distinct experts and the sums are what replay_ranks reports."""
    E, slots = SMALL.num_experts, 5
    caches = [HostCache(CacheGeometry(3, -(-(E - r) // ranks), slots), policy) for r in range(ranks)]
    misses = np.zeros((ranks, 36), dtype=np.int64)
    distinct = np.zeros((ranks, 36), dtype=np.int64)
    for c in range(36):
        n, layer = divmod(c, 3)
        ids, lidx = SMALL.experts[n, layer], SMALL.logit_idx[n, layer]
        for r, cache in enumerate(caches):
            mine = np.where((ids >= 0) & (ids % ranks == r), ids // ranks, -1).astype(np.int32)
            logits = np.where((lidx >= 0) & (lidx % ranks == r), lidx // ranks, -1).astype(np.int32)
            out = cache.ensure(layer, mine, logits, SMALL.logit_val[n, layer])
            misses[r, c], distinct[r, c] = out.misses, out.keys.shape[0]
    got = replay_ranks(SMALL, policy, slots, ranks)
    assert np.array_equal(got.hist, hist_of(misses.max(axis=0), 3, 5))
    assert got.hist.sum(axis=1).tolist() == [12, 12, 12]  # every row: one call per token
    assert got.rank_misses.tolist() == misses.sum(axis=1).tolist()
    assert got.misses == misses.sum() and got.accesses == distinct.sum()
    assert got.layer_routed.tolist() == np.bincount(np.tile(np.arange(3), 12), distinct.max(axis=0)).tolist()


@pytest.mark.parametrize("policy", POLICIES)
def test_two_ranks_share_one_gpus_accesses(policy):
    one, two = replay(SMALL, policy, 8), replay_ranks(SMALL, policy, 8, 2)
    assert np.array_equal(two.layer_accesses, one.layer_accesses)
    assert two.hist.sum(axis=1).tolist() == [SMALL.num_tokens] * 3
    assert two.rank_misses.sum() == two.misses and two.calls == one.calls
    routed = [len(keys_of(rank_trace(SMALL, 2, r))) for r in range(2)]  # the ranks' traces split the keys
    assert sum(routed) == len(keys_of(SMALL))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_pools_that_hold_every_key_of_a_rank_miss_only_cold(policy, ranks):
    """Slots a GPU >= every rank's L x E_r keys: each key misses once, on its first use (the distinct keys of
    each rank), and a larger pool (up to one GPU's L x E) gives the same."""
    holds = 3 * -(-SMALL.num_experts // ranks)
    for slots in (holds, 30):
        got = replay_ranks(SMALL, policy, slots, ranks)
        assert got.rank_misses.tolist() == [len(keys_of(SMALL, ranks, r)) for r in range(ranks)]
        assert got.misses == len(keys_of(SMALL))


# Round numbers: 1 GB/s = 1000 bytes/us (tests/sim/test_costmodel.py's toy machine), one all-reduce 1.5 us.
TOY = HardwareProfile(name="toy", h2d_points=((1000, 10.0), (3000, 20.0), (5000, 28.0)), h2d_ceiling_gbps=1.0,
                      back_to_back_gbps=0.3, hbm_gbps=1.0, layer_overhead_us=5.0, allreduce_us=1.5)
# expert 3000 B, shared 3000 B, router 80 B, non-MoE 920 B
SHAPE = ModelShape(num_layers=2, num_experts=4, top_k=2, hidden=10, expert_intermediate=50,
                   shared_intermediate=50, non_moe_bytes_per_layer=920)
HIST = np.array([[3, 1, 0], [2, 1, 1]], dtype=np.int64)  # 4 tokens, calls by the slowest rank's misses


def test_the_two_rank_estimate_by_hand():
    est = estimate_ranks(HIST, 4, SHAPE, TOY, ranks=2, routed=10, misses=6)
    # a call: router 0.08 + (shared 3000 + non-MoE 920) / 2 / 1000 = 1.96 + overhead 5 + 2 x 1.5 = 10.04 us;
    # 8 calls = 80.32, + 10 routed experts x 3 us = 110.32 us; copies 20 + 20 + 30 = 70; over 4 tokens
    assert est.compute_us_per_token == pytest.approx(110.32 / 4)
    assert est.copy_us_per_token == est.exposed_copy_us_per_token == pytest.approx(17.5)
    assert est.us_per_token == pytest.approx(110.32 / 4 + 17.5)
    assert est.bytes_copied_per_token == pytest.approx(6 * 3000 / 4)  # every rank's misses
    ov = estimate_ranks(HIST, 4, SHAPE, TOY, ranks=2, routed=10, misses=6, overlap=True)
    assert ov.exposed_copy_us_per_token == pytest.approx((18.5 + 18.5 + 28.5) / 4)  # half the shared expert hides


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", [None, "markov"])
def test_one_rank_is_estimate_decode_exactly(overlap, policy):
    prof = replace(TOY, policy_us=(("markov", 2.0, 0.5),))
    for batch, hist in ((1, HIST), (2, np.array([[1, 0, 0, 0, 1], [0, 0, 2, 0, 0]], dtype=np.int64))):
        tokens = int(hist[0].sum())
        want = estimate_decode(hist, tokens, SHAPE, prof, batch=batch, overlap=overlap, policy=policy)
        assert estimate_ranks(hist, tokens, SHAPE, prof, ranks=1, routed=1, misses=0, batch=batch,
                              overlap=overlap, policy=policy) == want


def test_one_gpus_rows_are_priced_as_before():
    trace = default_trace()
    shape = model_shape(trace)
    results = [replay(trace, p, 384) for p in ("lru", "rule", "belady")]
    for row, r in zip(build_rows(trace, results, H200_SM_COPY), results):
        assert row.us_per_token == estimate_decode(r.hist, r.tokens, shape, H200_SM_COPY, policy=r.policy).us_per_token
        assert row.tokens_per_s_overlap == estimate_decode(r.hist, r.tokens, shape, H200_SM_COPY, overlap=True,
                                                           policy=r.policy).tokens_per_s


def test_two_gpus_beat_one_on_a_miss_bound_trace_and_pay_their_all_reduces():
    trace = generate(preset("qwen3-30b-a3b", num_tokens=30))
    shape, slots = model_shape(trace), 48 * 128 // 10
    one, two = replay(trace, "lru", slots), replay_ranks(trace, "lru", slots, 2)
    free = replace(H200_SM_COPY, allreduce_us=0.0)
    assert estimate(one, shape, free).exposed_copy_us_per_token > estimate(one, shape, free).compute_us_per_token
    assert estimate(two, shape, free).tokens_per_s > estimate(one, shape, free).tokens_per_s
    priced = estimate(two, shape, replace(free, allreduce_us=10.0)).us_per_token
    assert priced - estimate(two, shape, free).us_per_token == pytest.approx(2 * 48 * 10.0)
    assert estimate(one, shape, replace(free, allreduce_us=10.0)) == estimate(one, shape, free)


@pytest.mark.parametrize("kw, name", [
    (dict(ranks=0, routed=0, misses=0), "ranks"),
    (dict(ranks=5, routed=0, misses=0), "ranks"),
    (dict(ranks=2, routed=None, misses=0), "routed"),
    (dict(ranks=2, routed=8 * 2 + 1, misses=0), "routed"),
    (dict(ranks=2, routed=3, misses=-1), "misses"),
    (dict(ranks=2, routed=3, misses=8 * 2 + 1), "misses"),
])
def test_bad_rank_estimates_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        estimate_ranks(HIST, 4, SHAPE, TOY, **kw)
    with pytest.raises(ValueError, match="allreduce_us"):
        replace(TOY, allreduce_us=-1.0)


def test_sim_ranks_1_2_through_the_installed_command():
    """--ranks 1,2 on the embedded default: a row per (policy, slots, ranks), one GPU's rows as a plain run's,
    the ranks column and line in the table, a choice line per rank count with its ratio to one GPU."""
    argv = ("--policies", "lru,rule", "--miss-service", "copy", "--workers", "1")
    proc = expertcache_sim(*argv, "--ranks", "1,2", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    plain = json.loads(expertcache_sim(*argv, "--json").stdout)
    two = [r for r in rows if r["ranks"] == 2]
    assert "ranks" not in plain[0] and [r for r in rows if r.pop("ranks") == 1] == plain
    assert [(r["policy"], r["slots"]) for r in two] == [(r["policy"], r["slots"]) for r in plain]
    for r, p in zip(two, plain):
        assert r["accesses"] == p["accesses"] and sum(r["rank_misses"]) == r["misses"]
    table = expertcache_sim(*argv, "--ranks", "1,2")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.startswith("ranks: 1, 2 GPUs of one host") for line in lines)
    assert next(x for x in lines if x.startswith("policy")).split()[:3] == ["policy", "slots", "ranks"]
    for slots in (384, 768, 1152):
        one = max(r["tokens_per_s"] for r in plain if r["slots"] == slots)
        top = min((r for r in two if r["slots"] == slots), key=lambda r: (-r["tokens_per_s"], r["policy"]))
        line = next(x for x in lines if x.startswith(f"  2 GPUs of {slots:,} slots ("))
        assert f"): {top['policy']} {top['tokens_per_s']:.1f} tok/s" in line
        assert line.endswith(f", {top['tokens_per_s'] / one:.2f}x one GPU's")  # no oracle ran


@pytest.mark.parametrize("argv, needles", [
    (["--ranks", "0"], ["--ranks"]),
    (["--ranks", "1,x"], ["--ranks"]),
    (["--ranks", "129"], ["--ranks 129", "128 experts"]),
    (["--ranks", "2", "--allreduce-us", "-1"], ["--allreduce-us"]),
    (["--ranks", "1,2", "--miss-service", "copy,hybrid"], ["--miss-service hybrid", "--ranks 2"]),
    (["--ranks", "2", "--slots", "2"], ["--slots", "--ranks 2"]),
])
def test_bad_rank_flags_are_refused_by_name(argv, needles):
    with pytest.raises(SystemExit) as err:
        main(["sim", *argv, "--workers", "1"])
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_a_slot_count_below_a_ranks_largest_call_is_refused():
    need = min_rank_slots(default_trace(), 2)
    assert 0 < need <= min_rank_slots(default_trace(), 1)
    with pytest.raises(SystemExit, match=f"with --ranks 2, one call of a GPU asks for {need} distinct"):
        main(["sim", "--ranks", "2", "--slots", str(need - 1), "--workers", "1"])


def test_a_budget_a_gpu_prices_each_rank_count(capsys):
    """--moe-cache-gb with --ranks 1,2: each GPU gets the budget's slots; the budget table gains the ranks
    column, and the default miss service is copy alone (no hybrid table) once a rank count is above 1."""
    argv = ["sim", "--preset", "olmoe-1b-7b", "--tokens", "20", "--moe-cache-gb", "1", "--policies", "lru",
            "--workers", "1"]
    assert main([*argv, "--ranks", "1,2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["ranks"] for r in rows] == [1, 2] and rows[0]["slots"] == rows[1]["slots"]
    assert "miss_service" not in rows[0]
    assert main([*argv, "--ranks", "1,2"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("budget"))
    assert head.split()[3:5] == ["slots", "ranks"] and "miss service, modeled on" not in out
