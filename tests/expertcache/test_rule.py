"""`rule` and `lfuda` against scalar transcriptions of their documented formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from expertcache import CacheGeometry, HostCache, PolicyError, get_policy
from expertcache.policies.base import Clock
from expertcache.policies.rule import DCT, LAST_TOK, LC, LOG2_1P_TABLE

ONE = 1 << 16


def rule_score(L, E, layer, tok, key, last_tok, lc, dct, beta=4, w=3, halflife=64):
    lk = key // E
    later = lk > layer
    k = min(max((tok - 1 if later else tok) - last_tok, 0), 16384)
    d = lk - layer if later else L - layer + lk
    now = tok * L + layer
    def dc(t):
        return (t * ONE) // (halflife * L)
    lcv = max(lc - (dc(now) - dct), -30 * ONE)
    return -(k * ONE + d * math.floor(beta * ONE / L + 0.5)) + ((math.floor(w * 16 + 0.5) * lcv) >> 4)


def test_log2_table_is_log2_one_plus_two_to_minus_u():
    assert LOG2_1P_TABLE[0] == ONE  # log2(2) = 1
    assert LOG2_1P_TABLE[64] == round(math.log2(1.5) * ONE)
    assert LOG2_1P_TABLE[-1] == round(math.log2(1 + 2**-30) * ONE)
    assert (np.diff(LOG2_1P_TABLE) <= 0).all()


def test_rule_state_and_scores_follow_the_formulas():
    g = CacheGeometry(4, 8, 64)
    cache = HostCache(g, "rule")
    rng = np.random.default_rng(3)
    for c in range(400):
        ids = rng.choice(8, 3, replace=False).astype(np.int32)[None]
        cache.ensure(c % 4, ids)
    st = cache.state
    keys = np.flatnonzero(cache.slot_of >= 0)
    clk = Clock(cache.step, cache.tok, 1, 4, 8)
    got = cache.policy.scores(st, clk, keys, cache.slot_of[keys])
    want = [rule_score(4, 8, 1, cache.tok, int(key), int(st.key[LAST_TOK, key]),
                       int(st.key[LC, key]), int(st.key[DCT, key])) for key in keys]
    assert got.tolist() == want


def test_rule_keeps_the_decay_clock_of_the_last_use():
    """DCT = DC(now) = ((tok * L + layer) << 16) // (HALFLIFE * L) of the key's last use."""
    g = CacheGeometry(3, 8, 16)
    cache = HostCache(g, "rule", halflife=5)
    last = {}
    rng = np.random.default_rng(11)
    for c in range(90):
        layer = c % 3
        ids = rng.choice(8, 2, replace=False).astype(np.int32)[None]
        cache.ensure(layer, ids)
        for e in ids[0]:
            last[layer * 8 + int(e)] = ((cache.tok * 3 + layer) << 16) // (5 * 3)
    for key in range(g.num_keys):
        assert cache.state.key[DCT, key] == last.get(key, -1), key


def test_rule_use_count_grows_as_log2_of_count_without_decay():
    g = CacheGeometry(1, 4, 4)
    cache = HostCache(g, "rule", halflife=10**9)
    for n in range(1, 9):
        cache.ensure(0, np.array([[2]], dtype=np.int32))
        assert abs(cache.state.key[LC, 2] / ONE - math.log2(n)) < 0.03


def test_rule_keeps_the_layer_about_to_run():
    """LRU across a layer sweep evicts the layer that runs next; rule keeps it."""
    g = CacheGeometry(2, 4, 2)
    for policy, expect_hit in (("lru", False), ("rule", True)):
        cache = HostCache(g, policy)
        cache.ensure(0, np.array([[0]], dtype=np.int32))
        cache.ensure(1, np.array([[0]], dtype=np.int32))
        cache.ensure(1, np.array([[1]], dtype=np.int32))  # must evict layer 0's or layer 1's key
        res = cache.ensure(0, np.array([[0]], dtype=np.int32))
        assert (res.misses == 0) == expect_hit, policy


def test_near_miss_refresh_marks_close_experts_of_this_layer_only():
    g = CacheGeometry(2, 8, 8)
    cache = HostCache(g, "rule")
    ids = np.array([[1, 2]], dtype=np.int32)
    lidx = np.array([[1, 2, 5, 6, -1]], dtype=np.int32)
    lval = np.array([[3.0, 2.0, 1.75, 1.7, 9.0]], dtype=np.float32)
    cache.ensure(0, ids)
    cache.ensure(1, ids)
    cache.ensure(0, ids, lidx, lval)  # tok 2: expert 5 is within 0.25 of the 2nd logit
    assert cache.state.key[LAST_TOK, [1, 2, 5, 6]].tolist() == [2, 2, 1, -1]
    assert cache.state.key[LAST_TOK, 8 + 5] == -1


def test_rule_constants_are_checked():
    with pytest.raises(PolicyError, match="halflife"):
        get_policy("rule", CacheGeometry(2, 4, 4), halflife=0)
    with pytest.raises(PolicyError, match="near"):
        get_policy("rule", CacheGeometry(2, 4, 4), near=-1.0)


def test_lfuda_ages_out_once_hot_experts():
    g = CacheGeometry(1, 8, 2)
    cache = HostCache(g, "lfuda")
    for _ in range(3):
        cache.ensure(0, np.array([[0]], dtype=np.int32))  # expert 0: freq 3
    cache.ensure(0, np.array([[1]], dtype=np.int32))
    res = cache.ensure(0, np.array([[2]], dtype=np.int32))
    assert res.plan.tolist() == [[2, 1]], "the once-used expert goes, the hot one stays"
    assert cache.state.glob[0] == 1
    for e in (3, 4, 5):  # each new expert raises the age; eventually 0 is the lowest
        res = cache.ensure(0, np.array([[e]], dtype=np.int32))
    assert 0 not in cache.key_of.tolist()
