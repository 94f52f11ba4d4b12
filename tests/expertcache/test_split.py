"""The miss split: its table, and the host reference and the compiled replay agreeing on it bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache import (
    CPU_SLOT,
    NO_KEY,
    NO_SLOT,
    CacheGeometry,
    ChannelCosts,
    EnsureError,
    HostCache,
    MissSplit,
    policy_names,
)
from expertcache.formats import get_format, resolve_format
from expertcache.replay import run_calls
from expertcache.split import SPLIT_LEN, TAIL_MAX_MISSES, TAIL_STEPS, TAIL_TIE, rank_misses, tail_granule
from sim.belady import Belady

POLICIES = policy_names()


def _table(**costs) -> MissSplit:
    return MissSplit.hybrid(ChannelCosts(**costs))


def test_copy_and_cpu_tables():
    assert MissSplit.copy().copies.tolist() == list(range(SPLIT_LEN))
    assert MissSplit.copy().copies_all and not MissSplit.cpu().copies_all
    assert not MissSplit.cpu().copies.any()


def test_hybrid_table_is_the_brute_force_balance():
    costs = ChannelCosts(link_fixed_us=20.0, link_per_expert_us=170.0, cpu_fixed_us=15.0, cpu_per_expert_us=210.0)
    split = MissSplit.hybrid(costs)
    for m in range(40):
        times = [max(costs.link_us(c), costs.cpu_us(m - c)) for c in range(m + 1)]
        best = min(times)
        assert split.copies_for(m) == max(c for c, t in enumerate(times) if t == best)
    # both channels busy once a call has a few misses; about link / (link + cpu) of them copied
    assert split.copies_for(1) == 1 and 0 < split.copies_for(10) < 10
    assert abs(split.copies_for(1000) / 1000 - 210 / 380) < 0.01


def test_hybrid_table_ties_go_to_the_link():
    split = _table(link_fixed_us=0.0, link_per_expert_us=1.0, cpu_fixed_us=0.0, cpu_per_expert_us=1.0)
    assert [split.copies_for(m) for m in range(6)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("bad, field", [
    (dict(link_fixed_us=-1.0), "link_fixed_us"), (dict(cpu_per_expert_us=float("nan")), "cpu_per_expert_us"),
    (dict(link_per_expert_us=0.0), "link_per_expert_us"), (dict(cpu_fixed_us="1"), "cpu_fixed_us"),
])
def test_bad_costs_name_the_field(bad, field):
    args = dict(link_fixed_us=1.0, link_per_expert_us=1.0, cpu_fixed_us=1.0, cpu_per_expert_us=1.0) | bad
    with pytest.raises(ValueError, match=field):
        ChannelCosts(**args)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="--moe-miss-service"):
        MissSplit("auto", np.zeros(SPLIT_LEN, np.int32))
    with pytest.raises(ValueError, match=r"copies\[m\] must be in \[0, m\]"):
        MissSplit("hybrid", np.full(SPLIT_LEN, 1, np.int32))
    with pytest.raises(ValueError, match="int32"):
        MissSplit("hybrid", np.zeros(SPLIT_LEN, np.int64))
    with pytest.raises(ValueError, match="split must be a MissSplit"):
        HostCache(CacheGeometry(1, 4, 4), "lru", split="hybrid")
    with pytest.raises(ValueError, match="disagrees with service 'copy'"):
        MissSplit("copy", np.zeros(SPLIT_LEN, np.int32))
    with pytest.raises(ValueError, match="disagrees with service 'cpu'"):
        MissSplit("cpu", np.arange(SPLIT_LEN, dtype=np.int32))
    table = (np.arange(SPLIT_LEN) // 2).astype(np.int32)
    MissSplit("hybrid", table)
    assert table.flags.writeable, "the caller's array stays its own"


def test_a_split_refuses_a_query_past_its_table_and_changes_nothing():
    g = CacheGeometry(1, 2048, 2048)
    cache = HostCache(g, "lru", split=HALF)
    before = cache.snapshot()
    ids = np.arange(1024, dtype=np.int32).reshape(2, 512)
    with pytest.raises(EnsureError, match="rows \\* top_k"):
        cache.ensure(0, ids)
    with pytest.raises(EnsureError, match="rows \\* top_k"):
        run_calls(cache, ids[None], np.zeros(1, dtype=np.int64))
    assert cache.snapshot().equals(before)


@pytest.mark.parametrize(("fmt", "inter", "want"), [("bf16", 768, 16), ("fp8", 768, 128), ("int4", 768, 128),
                                                    ("nvfp4", 768, 16), ("mxfp4", 2880, 64), ("bf16", 2880, 48),
                                                    ("fp8", 2880, 0), ("int4-z", 1408, 128), ("mxfp4", 32, 0)])
def test_tail_granule_whole_scale_blocks_and_words(fmt, inter, want):
    """A granule divides the width into 2..TAIL_STEPS parts and is a multiple of the format's scale block, of
    the down inputs in one word of its main part, and of 16 (the CPU's gate_up items); 0 where none is."""
    f = resolve_format(fmt)
    g = tail_granule(f, inter)
    assert g == want
    if g:
        assert inter % g == 0 and 2 <= inter // g <= TAIL_STEPS and g % 16 == 0 and g % f.in_block == 0


def _brute_tail(costs, m, steps):
    """The least max(link, cpu) over every (c, n) of m misses, and every choice within TAIL_TIE of it."""
    times = {(c, n): float(costs.step_us(m, c, n / steps)) for c in range(m + 1) for n in range(steps)
             if c < m or n == 0}
    best = min(times.values())
    return best, {k for k, t in times.items() if t <= best * (1 + TAIL_TIE)}


@pytest.mark.parametrize("costs", [
    ChannelCosts(link_fixed_us=8.8, link_per_expert_us=176.4, cpu_fixed_us=50.0, cpu_per_expert_us=132.4),
    ChannelCosts(link_fixed_us=20.0, link_per_expert_us=170.0, cpu_fixed_us=15.0, cpu_per_expert_us=210.0),
    ChannelCosts(0.0, 1.0, 0.0, 1.0)])
def test_hybrid_tail_table_is_the_brute_force_balance(costs):
    """Every m's (copies, tail) is a least-time choice within the tie, the largest c of those, then the
    shortest tail; never slower than whole experts beyond the tie; a tail only beside a served expert."""
    inter, granule = 768, 64
    steps = inter // granule
    whole, split = MissSplit.hybrid(costs), MissSplit.hybrid(costs, inter, granule)
    assert split.tail and split.inter == inter
    for m in range(1, 24):
        best, ties = _brute_tail(costs, m, steps)
        c, r = int(split.copies[m]), int(split.link_rows[m])
        assert r % granule == 0 and (c, r // granule) in ties
        assert (c, r // granule) == max(ties, key=lambda k: (k[0], -k[1]))
        assert costs.step_us(m, c, r / inter) <= costs.step_us(m, whole.copies[m]) * (1 + TAIL_TIE)
        assert r == 0 or c < m
    assert not split.link_rows[TAIL_MAX_MISSES:].any()
    assert (split.copies[TAIL_MAX_MISSES:] == whole.copies[TAIL_MAX_MISSES:]).all()
    assert split.link_rows_given(5, int(split.copies[5])) == split.link_rows[5]
    assert split.link_rows_given(5, int(split.copies[5]) + 1) == 0  # a filling pool raised the copies: no tail


def test_tail_errors_name_the_field():
    costs = ChannelCosts(0.0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="granule"):
        MissSplit.hybrid(costs, 768, 100)
    with pytest.raises(ValueError, match="inter"):
        MissSplit.hybrid(costs, -1, 0)
    rows = np.zeros(SPLIT_LEN, dtype=np.int32)
    rows[3] = 64
    with pytest.raises(ValueError, match="link_rows"):
        MissSplit("hybrid", MissSplit.copy().copies, link_rows=rows, inter=768)  # copies[3] = 3: nothing served
    with pytest.raises(ValueError, match="link_rows"):
        MissSplit("hybrid", MissSplit.cpu().copies, link_rows=rows, inter=32)  # past the width
    assert MissSplit("hybrid", MissSplit.cpu().copies, link_rows=rows, inter=768).tail
    assert not MissSplit.hybrid(costs).tail and get_format("bf16").in_block == 1


def test_rank_misses_prefers_priority_then_the_lower_key():
    keys = np.array([3, 5, 8, 9], dtype=np.int64)
    assert rank_misses(np.array([0, 7, 0, 7]), keys, 2).tolist() == [False, True, False, True]
    assert rank_misses(np.array([0, 0, 0, 0]), keys, 3).tolist() == [True, True, True, False]
    assert rank_misses(np.array([1, 0, 0, 0]), keys, 2).tolist() == [True, True, False, False]


def _calls(seed: int, C: int, L: int, E: int, rows: int, k: int):
    rng = np.random.default_rng(seed)
    ids = np.full((C, rows, k), -1, dtype=np.int32)
    for c in range(C):
        for r in range(rows):
            n = rng.integers(1, k + 1)
            ids[c, r, :n] = rng.choice(E, n, replace=False)
    return ids, np.tile(np.arange(L), C // L)


# copies of m misses in a 1-8 range: half, rounded down (a mix of both channels at every m >= 2)
HALF = MissSplit("hybrid", (np.arange(SPLIT_LEN) // 2).astype(np.int32))


@pytest.mark.parametrize("policy", POLICIES)
def test_served_misses_get_no_slot_and_are_counted(policy):
    g = CacheGeometry(3, 16, 10)
    cache = HostCache(g, policy, split=HALF)
    ids, layers = _calls(3, 120, 3, 16, 2, 3)
    for c in range(ids.shape[0]):
        before = cache.snapshot()
        res = cache.ensure(int(layers[c]), ids[c])
        cache.check()
        m = res.misses
        empty = int((before.key_of < 0).sum())
        want = max(m // 2, min(m, empty))  # hybrid: a filling pool copies what its empty slots take
        assert res.copies == want and res.served.shape[0] == m - want
        assert (cache.slot_of[res.served] == NO_SLOT).all(), "a served miss is not admitted"
        assert (before.slot_of[res.served] == NO_SLOT).all()
        E = g.num_experts
        for key in res.served:
            assert (res.slots[ids[c] == key - layers[c] * E] == CPU_SLOT).all()
        valid = ids[c] >= 0
        assert ((res.slots >= 0) | (res.slots == CPU_SLOT))[valid].all()
        assert (res.slots[~valid] == NO_SLOT).all()
    assert cache.served.sum() > 0 and cache.served.sum() < cache.counters[:, 2].sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_service_admits_nothing(policy):
    cache = HostCache(CacheGeometry(2, 8, 6), policy, split=MissSplit.cpu())
    ids, layers = _calls(5, 40, 2, 8, 1, 2)
    for c in range(ids.shape[0]):
        res = cache.ensure(int(layers[c]), ids[c])
        assert res.plan.shape == (0, 2) and res.hits == 0
    assert (cache.key_of == NO_KEY).all()
    assert (cache.served == cache.counters[:, 2]).all() and (cache.counters[:, 2] == cache.counters[:, 1]).all()


@pytest.mark.parametrize("policy", ["rule", "markov"])
def test_the_copied_misses_are_those_of_highest_priority(policy):
    g = CacheGeometry(2, 12, 8)
    cache = HostCache(g, policy, split=HALF)
    seen = []
    priority = cache.policy.miss_priority

    def recorded(st, clk, keys, access):
        out = priority(st, clk, keys, access)
        seen.append((keys.copy(), out.copy()))
        return out

    cache.policy.miss_priority = recorded
    ids, layers = _calls(9, 200, 2, 12, 2, 3)
    distinct = 0
    for c in range(ids.shape[0]):
        seen.clear()
        res = cache.ensure(int(layers[c]), ids[c])
        if not res.served.shape[0]:
            continue
        (keys, prio), = seen
        order = sorted(range(len(keys)), key=lambda i: (-prio[i], keys[i]))
        assert sorted(res.plan[:, 0].tolist()) == sorted(keys[order[:res.copies]].tolist())
        assert res.served.tolist() == sorted(keys[order[res.copies:]].tolist())
        distinct += len(set(prio.tolist())) > 1
    assert distinct > 10, "the priorities must differ between keys for the check to mean anything"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("split", [MissSplit.copy(), MissSplit.cpu(), HALF,
                                   MissSplit.hybrid(ChannelCosts(5.0, 100.0, 15.0, 140.0)),
                                   MissSplit.hybrid(ChannelCosts(5.0, 100.0, 15.0, 140.0), 768, 64)],
                         ids=["copy", "cpu", "half", "hybrid", "hybrid-tail"])
def test_replay_matches_reference_with_a_split(policy, split):
    g = CacheGeometry(6, 24, 30)
    C, rows, k, T = 480, 2, 4, 8
    ids, layers = _calls(11, C, 6, 24, rows, k)
    rng = np.random.default_rng(4)
    lidx = rng.integers(-1, 24, size=(C, rows, T)).astype(np.int32)
    lval = rng.standard_normal((C, rows, T)).astype(np.float32)
    ref, fast = HostCache(g, policy, split=split), HostCache(g, policy, split=split)
    for c in range(C):
        last = ref.ensure(int(layers[c]), ids[c], lidx[c], lval[c])
    slots, plan = run_calls(fast, ids, layers, lidx, lval)
    assert ref.snapshot().equals(fast.snapshot())
    assert np.array_equal(slots, last.slots) and np.array_equal(plan, last.plan)
    if split.service != "copy":
        assert ref.served.sum() > 0


def test_belady_with_a_split_copies_the_soonest_reused():
    g = CacheGeometry(1, 8, 4)
    ids = np.array([[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[7, 5, -1, -1]], [[6, -1, -1, -1]]], dtype=np.int32)
    layers = np.zeros(4, dtype=np.int64)
    ref = HostCache(g, Belady.for_calls(g, ids, layers), split=HALF)
    assert ref.ensure(0, ids[0]).copies == 4, "a filling pool copies what its empty slots take"
    res = ref.ensure(0, ids[1])
    assert sorted(res.plan[:, 0].tolist()) == [5, 7], "keys 5 and 7 are used next"
    assert res.served.tolist() == [4, 6]
    fast = HostCache(g, Belady.for_calls(g, ids, layers), split=HALF)
    run_calls(fast, ids[:2], layers[:2])
    assert ref.snapshot().equals(fast.snapshot())


def test_cpu_never_copies_and_hybrid_fills_empty_slots_first():
    assert MissSplit.cpu().copies_given(5, 100) == 0
    assert HALF.copies_given(5, 100) == 5 and HALF.copies_given(5, 3) == 3 and HALF.copies_given(5, 0) == 2
