"""The ensure contract, checked the same way for every registered policy."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache import (
    NO_SLOT,
    CacheGeometry,
    EnsureError,
    HostCache,
    PolicyError,
    get_policy,
    policy_names,
)
from expertcache.replay import run_calls

POLICIES = policy_names()


def ids_of(*rows) -> np.ndarray:
    return np.array(rows, dtype=np.int32)


@pytest.fixture(params=POLICIES)
def policy(request) -> str:
    return request.param


def test_registry_names_and_unknown_policy():
    assert {"lru", "rule", "lfuda"} <= set(POLICIES)
    assert "belady" not in POLICIES, "oracles are not deployable"
    with pytest.raises(PolicyError, match=r"--moe-cache-policy.*lfuda, lru, markov, rule"):
        get_policy("nope", CacheGeometry(2, 4, 4))
    with pytest.raises(PolicyError, match="bad constants"):
        get_policy("lru", CacheGeometry(2, 4, 4), beta=3)


def test_cold_start_fills_lowest_empty_slots_in_key_order(policy):
    cache = HostCache(CacheGeometry(2, 8, 6), policy)
    res = cache.ensure(0, ids_of([5, 2, 7]))
    assert res.plan.tolist() == [[2, 0], [5, 1], [7, 2]]
    assert res.slots.tolist() == [[1, 0, 2]]
    res = cache.ensure(1, ids_of([0, 5]))
    assert res.plan.tolist() == [[8, 3], [13, 4]]
    assert cache.counters.tolist() == [[1, 3, 3], [1, 2, 2]]
    assert (cache.step, cache.tok) == (2, 1)


def test_duplicates_and_padding_share_and_skip(policy):
    cache = HostCache(CacheGeometry(1, 8, 4), policy)
    res = cache.ensure(0, ids_of([3, 1, -1], [1, 3, 6], [-1, -1, -1]))
    assert res.keys.tolist() == [1, 3, 6]
    assert res.slots.tolist() == [[1, 0, NO_SLOT], [0, 1, 2], [NO_SLOT] * 3]
    assert res.misses == 3 and cache.counters[0].tolist() == [1, 3, 3]
    res = cache.ensure(0, ids_of([1, 6, 3]))
    assert res.misses == 0 and res.hits == 3 and res.plan.shape == (0, 2)


def test_hits_are_pinned_when_everything_else_is_older(policy):
    g = CacheGeometry(1, 16, 3)
    cache = HostCache(g, policy)
    cache.ensure(0, ids_of([0, 1, 2]))
    for _ in range(3):
        cache.ensure(0, ids_of([0, 1]))
    res = cache.ensure(0, ids_of([0, 1, 9]))
    assert res.plan.tolist() == [[9, 2]], "only the unpinned slot may be taken"


def test_full_pool_of_one_call_evicts_everything_else(policy):
    cache = HostCache(CacheGeometry(2, 4, 4), policy)
    cache.ensure(0, ids_of([0, 1, 2, 3]))
    res = cache.ensure(1, ids_of([3, 2, 1, 0]))
    assert sorted(res.plan[:, 1].tolist()) == [0, 1, 2, 3]
    assert (cache.slot_of[:4] == NO_SLOT).all()
    cache.check()


@pytest.mark.parametrize(
    "layer, ids, logits, field",
    [
        (2, ids_of([0]), None, "layer"),
        (-1, ids_of([0]), None, "layer"),
        (0, ids_of([4]), None, "num_experts"),
        (0, ids_of([-2]), None, "padding"),
        (0, np.array([[0]], dtype=np.int64), None, "int32"),
        (0, np.array([0], dtype=np.int32), None, "rows, k"),
        (0, ids_of([0, 1], [2, 3]), None, "--moe-slots"),
        (0, ids_of([0]), (np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32)), "logit_idx"),
        (0, ids_of([0]), (np.zeros((1, 1), np.int32), None), "both"),
        (0, ids_of([0]), (np.full((1, 1), 4, np.int32), np.zeros((1, 1), np.float32)), "logit_idx"),
        (0, ids_of([0]), (np.zeros((1, 1), np.int32), np.full((1, 1), np.nan, np.float32)), "finite"),
    ],
)
def test_refused_calls_name_the_field_and_change_nothing(policy, layer, ids, logits, field):
    cache = HostCache(CacheGeometry(2, 4, 3), policy)
    cache.ensure(0, ids_of([1, 2]))
    before = cache.snapshot()
    lidx, lval = logits if logits else (None, None)
    with pytest.raises(EnsureError, match=field):
        cache.ensure(layer, ids, lidx, lval)
    assert cache.snapshot().equals(before)
    with pytest.raises(EnsureError, match=field):
        run_calls(cache, ids[None] if ids.ndim == 2 else ids, np.array([layer]),
                  None if lidx is None else lidx[None], None if lval is None else lval[None])
    assert cache.snapshot().equals(before)


def test_same_calls_same_state(policy):
    rng = np.random.default_rng(7)
    g = CacheGeometry(3, 16, 12)
    a, b = HostCache(g, policy), HostCache(g, policy)
    for c in range(200):
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(2)]).astype(np.int32)
        a.ensure(c % 3, ids)
        b.ensure(c % 3, ids)
    assert a.snapshot().equals(b.snapshot())


def test_fast_path_matches_reference_on_a_long_replay(policy):
    """Many calls in one compiled launch end in the reference's exact state."""
    rng = np.random.default_rng(11)
    g = CacheGeometry(6, 24, 40)
    C, rows, k, T = 600, 2, 4, 8
    ids = np.full((C, rows, k), -1, dtype=np.int32)
    for c in range(C):
        for r in range(rows):
            n = rng.integers(0, k + 1)
            ids[c, r, :n] = rng.choice(24, n, replace=False)
    layers = np.tile(np.arange(6), C // 6)
    lidx = rng.integers(-1, 24, size=(C, rows, T)).astype(np.int32)
    lval = rng.standard_normal((C, rows, T)).astype(np.float32)
    ref, fast = HostCache(g, policy), HostCache(g, policy)
    for c in range(C):
        ref.ensure(int(layers[c]), ids[c], lidx[c], lval[c])
    run_calls(fast, ids, layers, lidx, lval)
    assert ref.snapshot().equals(fast.snapshot())
    assert ref.counters[:, 2].sum() > 0
