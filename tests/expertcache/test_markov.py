"""`markov` against a scalar transcription of its documented formulas, and what it learns."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from expertcache import CacheGeometry, HostCache, PolicyError, get_policy
from expertcache.policies.base import Clock
from expertcache.policies.markov import FREQ, HIST, T, V, _div_r
from expertcache.replay import run_calls

ONE = 1 << 16


class Scalar:
    """The module docstring's steps 1-4 and score, one python int at a time. call(): the routing of
    one call; resident(key): whether V is kept (a slot before the call, or routed now)."""

    def __init__(self, L, E, lags=2, beta=0.3, row_cap=100, freq_cap=300, prior=1, recency=0.2):
        self.L, self.E, self.J = L, E, lags
        self.recency = math.floor(recency * ONE + 0.5)
        self.beta_q = math.floor(beta * ONE / L + 0.5)
        self.row_cap, self.freq_cap, self.prior = 16 * row_cap, 16 * freq_cap, 16 * prior
        self.t = {}  # (l, j, a, b) -> count
        self.r = {}  # (l, j, a) -> row total
        self.freq = [[0] * E for _ in range(L)]
        self.total = [0] * L
        self.hist = [[0] * E for _ in range(L)]
        self.v = [[0] * E for _ in range(L)]

    def call(self, l, experts, resident):
        E, n = self.E, len(experts)
        for j in range(self.J):
            for a in range(E):
                if not (self.hist[l][a] >> j) & 1:
                    continue
                for b in experts:
                    self.t[l, j, a, b] = self.t.get((l, j, a, b), 0) + 16
                self.r[l, j, a] = self.r.get((l, j, a), 0) + 16 * n
                if self.r[l, j, a] > self.row_cap:
                    for b in range(E):
                        self.t[l, j, a, b] = self.t.get((l, j, a, b), 0) // 2
                    self.r[l, j, a] = sum(self.t[l, j, a, b] for b in range(E))
        for b in experts:
            self.freq[l][b] += 16
        self.total[l] += 16 * n
        if self.total[l] > self.freq_cap:
            self.freq[l] = [c // 2 for c in self.freq[l]]
            self.total[l] = sum(self.freq[l])
        for e in range(E):
            self.hist[l][e] = ((self.hist[l][e] << 1) & ((1 << self.J) - 1)) | int(e in experts)
        for e in range(E):
            f = (n * (self.freq[l][e] + 8) * ONE) // (self.total[l] + 8 * E)
            v = 0
            for j in range(self.J):
                p = sum(self.t.get((l, j, b, e), 0) for b in experts)
                d = sum(self.r.get((l, j, b), 0) for b in experts)
                v += (n * p * ONE + self.prior * f) // (d + self.prior)
            v += self.recency if e in experts else 0
            self.v[l][e] = v if resident(l * E + e) else 0

    def score(self, layer, key):
        lk, e = divmod(key, self.E)
        d = lk - layer if lk > layer else self.L - layer + lk
        return self.v[lk][e] - d * self.beta_q


@pytest.mark.parametrize("lags, row_cap, freq_cap", [(2, 100, 300), (1, 3, 5), (2, 2, 4)])
def test_markov_state_and_scores_follow_the_formulas(lags, row_cap, freq_cap):
    L, E = 3, 7
    cache = HostCache(CacheGeometry(L, E, 9), "markov", lags=lags, row_cap=row_cap, freq_cap=freq_cap)
    ref = Scalar(L, E, lags=lags, row_cap=row_cap, freq_cap=freq_cap)
    rng = np.random.default_rng(lags * 100 + row_cap)
    R = T + lags * E
    for c in range(240):
        layer = c % L
        ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(int(rng.integers(1, 3)))]).astype(np.int32)
        if layer != 0:  # scores before the call, as its victims see them
            clk = Clock(cache.step + 1, cache.tok, layer, L, E)
            full = np.flatnonzero(cache.key_of >= 0)
            keys = cache.key_of[full].astype(np.int64)
            got = cache.policy.scores(cache.state, clk, keys, full)
            assert got.tolist() == [ref.score(layer, int(k)) for k in keys]
        before = cache.slot_of.copy()
        res = cache.ensure(layer, ids)
        routed = sorted(int(k) - layer * E for k in res.keys)
        ref.call(layer, routed, lambda key, b=before, lo=layer * E, r=routed: b[key] >= 0 or key - lo in r)
        st = cache.state
        for e in range(E):
            key = layer * E + e
            assert st.key[V, key] == ref.v[layer][e], (c, e)
            assert st.key[HIST, key] == ref.hist[layer][e]
            assert st.key[FREQ, key] == ref.freq[layer][e]
            for j in range(lags):
                assert st.key[R + j, key] == ref.r.get((layer, j, e), 0)
                for a in range(E):
                    assert st.key[T + j * E + a, key] == ref.t.get((layer, j, a, e), 0)
        assert st.glob[layer] == ref.total[layer]


def test_markov_keeps_the_expert_that_follows_and_lru_does_not():
    """One layer cycles 0 -> 1 -> 2 -> 3 -> 0 among 4 experts with 3 slots: LRU evicts exactly the
    expert needed next (it never hits); markov learns the cycle and, once it has, evicts the expert
    needed last, as Belady does (a miss every third call)."""
    ids = np.array([[[t % 4]] for t in range(400)], dtype=np.int32)
    misses = {}
    for policy in ("lru", "markov"):
        cache = HostCache(CacheGeometry(1, 4, 3), policy)
        run_calls(cache, ids, np.zeros(400, dtype=np.int64))
        misses[policy] = int(cache.counters[0, 2])
    assert misses["lru"] == 400
    assert misses["markov"] < 400 // 3 + 20, misses


def test_markov_constants_and_state_size():
    g = CacheGeometry(48, 128, 1650)
    p = get_policy("markov", g)
    assert p.constants == dict(lags=2, beta=0.3, row_cap=100, freq_cap=300, prior=1, recency=0.2)
    assert p.state_bytes() == 4 * (3 + 2 * 129) * 48 * 128 + 8 * 48  # int32 key rows, int64 layer totals
    st = p.init_state()
    assert st.key.dtype == np.int32 and st.glob.dtype == np.int64
    assert st.key.nbytes + st.glob.nbytes + st.slot.nbytes == p.state_bytes()
    assert get_policy("markov", g, lags=1).state_bytes() == 4 * (3 + 129) * 48 * 128 + 8 * 48
    for bad in (dict(lags=3), dict(lags=0), dict(beta=-1), dict(row_cap=0), dict(freq_cap=0), dict(prior=0),
                dict(recency=-0.1), dict(recency=5), dict(row_cap=2**27 - 128), dict(freq_cap=2**27),
                dict(prior=2**40)):
        with pytest.raises(PolicyError, match="markov"):
            get_policy("markov", g, **bad)
    get_policy("markov", g, freq_cap=2**27 - 129)  # the largest int32 counts allow
    get_policy("markov", CacheGeometry(4, 8, 4), row_cap=2**27 - 9)
    with pytest.raises(PolicyError, match="row_cap=262144 with prior=1"):  # 4096 routed: int64 products
        get_policy("markov", CacheGeometry(1, 4096, 4096), row_cap=2**18)
    get_policy("markov", CacheGeometry(1, 4096, 4096), row_cap=2**16)
    with pytest.raises(PolicyError, match="num_experts"):  # V of 16382 routed experts passes 2**31
        get_policy("markov", CacheGeometry(1, 16382, 16))
    get_policy("markov", CacheGeometry(1, 16381, 16))


@pytest.mark.parametrize("slots, rows, prior", [(6, 1, 1), (40, 2, 1), (70, 4, 2**26)])
def test_compiled_replay_equals_the_reference(slots, rows, prior):
    """run_calls (the compiled observe) against HostCache.ensure (the numpy reference) after every call:
    few experts resident, most resident, and a prior so large that the dividends pass 2**52 at 32
    routed experts (V one by one, the integer division)."""
    g = CacheGeometry(2, 80, slots)
    ref, fast = HostCache(g, "markov", prior=prior), HostCache(g, "markov", prior=prior)
    rng = np.random.default_rng(slots)
    for c in range(160):
        ids = rng.integers(-1, 80, size=(rows, 16 if rows == 4 else 3)).astype(np.int32)
        ref.ensure(c % 2, ids)
        run_calls(fast, ids[None], np.array([c % 2]))
        assert np.array_equal(ref.slot_of, fast.slot_of) and np.array_equal(ref.key_of, fast.key_of), c
        assert ref.state.equals(fast.state), c
        assert np.array_equal(ref.counters, fast.counters), c


@pytest.mark.parametrize("lags, row_cap, slots, rows, prior", [(2, 100, 12, 1, 1), (2, 3, 40, 2, 1), (1, 2, 20, 1, 1),
                                                          (2, 5, 70, 4, 2**26)])
def test_compiled_replay_of_many_calls_equals_the_reference(lags, row_cap, slots, rows, prior):
    """run_calls over batches of many calls (step 1 applied ahead to the rows step 4 has just read,
    markov._ahead) against HostCache.ensure one call at a time: the batches cut at random points, the
    layers in turn and out of turn (a layer called twice in a row, or skipped), row caps that halve
    often."""
    L, E = 3, 40
    g = CacheGeometry(L, E, slots)
    kw = dict(lags=lags, row_cap=row_cap, prior=prior)
    ref, fast = HostCache(g, "markov", **kw), HostCache(g, "markov", **kw)
    rng = np.random.default_rng(slots + rows)
    C = 300
    k = 16 if rows == 4 else 5
    ids = rng.integers(-1, E, size=(C, rows, k)).astype(np.int32)
    ids[ids >= 0] %= rng.integers(8, E + 1)  # some calls of few distinct experts
    layers = np.where(rng.random(C) < 0.8, np.arange(C) % L, rng.integers(0, L, size=C))
    cuts = np.sort(np.concatenate([[0, C], rng.choice(np.arange(1, C), size=6, replace=False)]))
    for a, b in zip(cuts[:-1], cuts[1:]):
        for c in range(a, b):
            ref.ensure(int(layers[c]), ids[c])
        run_calls(fast, ids[a:b], layers[a:b])
        assert np.array_equal(ref.slot_of, fast.slot_of) and np.array_equal(ref.key_of, fast.key_of), b
        assert ref.state.equals(fast.state), b
        assert np.array_equal(ref.counters, fast.counters), b


@njit
def _div_r_many(a, b):
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        out[i] = _div_r(a[i], b[i], 1.0 / np.float64(b[i]))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2**20, 2**40, 2**52 - 1, 2**52, 2**62]),
       st.sampled_from([1, 3, 2**16 + 1, 2**30, 2**45, 2**52 - 1, 2**53 + 5]))
def test_div_r_is_floor_division(seed, a_max, b_max):
    """The compiled replay's division by a reciprocal is exact: quotients at and around integers
    (a = q * b + {-1, 0, 1}), operands up to 2**52 and past it (the integer fallback)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(1, b_max, size=400, endpoint=True, dtype=np.int64)
    a = rng.integers(0, a_max, size=400, endpoint=True, dtype=np.int64)
    a[200:] = np.clip((a[200:] // b[200:]) * b[200:] + rng.integers(-1, 2, size=200), 0, None)  # around exact quotients
    np.testing.assert_array_equal(_div_r_many(a, b), a // b)
