"""Replay: golden miss counts, Belady as the limit, and agreement with the host reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertcache import CacheGeometry, HostCache, PolicyError
from sim.belady import Belady
from sim.replay import min_slots, replay, sim_policy_names, sweep, trace_calls
from sim.trace import Trace, TraceError, TraceMeta, load_trace
from tests.conftest import real_trace

# Reference results under the ensure contract (global pool, decode order, cold start).
MIXTRAL = {  # slots: (lru misses, belady misses), 15,616 accesses
    32: (15616, 9723), 64: (10267, 6494), 96: (10127, 4423), 128: (7268, 2972),
    160: (5055, 1937), 192: (3297, 1153), 224: (1578, 570),
}
FLAME = {  # 49,152 accesses
    64: (38472, 25883), 128: (31694, 17362), 256: (19791, 8054), 384: (8757, 2925),
    448: (3977, 1331),
}


def make_trace(experts: np.ndarray, num_experts: int, logits=None) -> Trace:
    N, L, B, k = experts.shape
    meta = TraceMeta(model="test", num_layers=L, num_experts=num_experts, top_k=k,
                     expert_bytes=None, phase="decode", source="test", license="CC0-1.0")
    lidx, lval = logits if logits is not None else (None, None)
    return Trace(experts=experts, meta=meta, logit_idx=lidx, logit_val=lval)


def random_experts(rng, N, L, B, k, E, pad=0.1) -> np.ndarray:
    ex = np.argsort(rng.random((N, L, B, E)), axis=-1)[..., :k].astype(np.int32)
    ex[rng.random(ex.shape) < pad] = -1
    return ex


# A small fixed trace: 24 tokens x 3 layers x top-2 of 6 experts, with padding.
SMALL = np.array(
    [[[4, 1], [0, 5], [2, 3]], [[4, 0], [0, 1], [2, -1]], [[1, 4], [5, 0], [3, 2]],
     [[4, 2], [1, 5], [2, 0]], [[0, 4], [0, 3], [4, 2]], [[4, 1], [5, 0], [2, 3]],
     [[3, 4], [0, 1], [1, 2]], [[4, 1], [-1, 5], [2, 3]], [[5, 4], [0, 5], [3, 2]],
     [[4, 1], [2, 0], [2, 5]], [[0, 1], [0, 5], [2, 3]], [[4, 1], [4, 5], [0, 3]],
     [[4, 3], [0, 5], [2, 3]], [[1, 2], [1, 5], [2, 1]], [[4, 1], [0, 5], [5, 3]],
     [[4, 0], [3, 5], [2, 3]], [[2, 1], [0, 4], [2, 4]], [[4, 1], [0, 5], [2, 3]],
     [[4, 5], [0, 2], [1, 3]], [[4, 1], [0, 5], [2, 0]], [[3, 1], [0, 5], [2, 3]],
     [[4, 1], [1, 5], [4, 3]], [[4, 2], [0, 5], [2, 3]], [[0, 1], [0, 3], [2, 5]]],
    dtype=np.int32)[:, :, None, :]
# Golden misses on SMALL for every policy at 3, 4, 6, 9 and 12 slots (142 accesses).
SMALL_GOLDEN = {
    "belady": [109, 81, 56, 35, 28],
    "lfuda": [142, 124, 79, 45, 38],
    "lru": [142, 139, 79, 48, 40],
    "markov": [122, 101, 62, 43, 35],
    "next-token": [109, 81, 66, 44, 39],
    "rule": [117, 95, 59, 43, 37],
}
SMALL_SLOTS = [3, 4, 6, 9, 12]


def test_golden_miss_counts_on_a_small_trace():
    trace = make_trace(SMALL, 6)
    assert set(SMALL_GOLDEN) == set(sim_policy_names()), "add golden counts for new policies"
    got = {p: [replay(trace, p, s).misses for s in SMALL_SLOTS] for p in sim_policy_names()}
    assert got == SMALL_GOLDEN


@pytest.mark.parametrize("name, table", [("mixtral-gsm8k.npz", MIXTRAL), ("flame-290m-a.npz", FLAME)])
def test_reference_results_on_real_traces(name, table):
    trace = load_trace(real_trace(name))
    results = sweep(trace, ["lru", "belady"], sorted(table), workers=2, progress=False)
    got = {}
    for r in results:
        got.setdefault(r.slots, [0, 0])[r.policy == "belady"] = r.misses
    assert {s: tuple(v) for s, v in got.items()} == table
    assert all(r.accesses == trace.accesses for r in results)


@given(data=st.data())
def test_belady_never_misses_more_than_any_policy(data):
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    L, E = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 10))
    k, B = data.draw(st.integers(1, min(3, E))), data.draw(st.integers(1, 2))
    trace = make_trace(random_experts(rng, data.draw(st.integers(1, 30)), L, B, k, E), E)
    slots = data.draw(st.integers(min(B * k, E), L * E + 1))
    opt = replay(trace, "belady", slots).misses
    for p in sim_policy_names():
        assert opt <= replay(trace, p, slots).misses, p


def test_belady_host_reference_agrees_with_replay():
    rng = np.random.default_rng(5)
    trace = make_trace(random_experts(rng, 40, 3, 2, 2, 8), 8)
    ids, layers, _, _ = trace_calls(trace)
    g = CacheGeometry(3, 8, 9)
    ref = HostCache(g, Belady.for_calls(g, ids, layers))
    for c in range(ids.shape[0]):
        ref.ensure(int(layers[c]), ids[c])
    assert ref.counters[:, 2].sum() == replay(trace, "belady", 9).misses


def test_replay_uses_logits_only_when_asked():
    rng = np.random.default_rng(9)
    N, L, E, k, T = 60, 4, 16, 2, 6
    ex = random_experts(rng, N, L, 1, k, E, pad=0.0)
    lidx = np.concatenate([ex, random_experts(rng, N, L, 1, T - k, E, pad=0.0)], axis=-1)
    lval = np.sort(rng.standard_normal((N, L, 1, T)).astype(np.float32), axis=-1)[..., ::-1].copy()
    trace = make_trace(ex, E, (lidx.astype(np.int32), lval))
    with_l = replay(trace, "rule", 20)
    without = replay(trace, "rule", 20, use_logits=False)
    assert with_l.accesses == without.accesses
    assert replay(trace, "lru", 20).misses == replay(trace, "lru", 20, use_logits=False).misses
    assert with_l.hist.sum() == N * L and with_l.hist.shape == (L, k + 1)


def test_sweep_orders_results_and_checks_names():
    trace = make_trace(SMALL, 6)
    res = sweep(trace, ["rule", "lru"], [4, 9], workers=2, progress=False)
    assert [(r.policy, r.slots) for r in res] == [("rule", 4), ("rule", 9), ("lru", 4), ("lru", 9)]
    assert [r.misses for r in res] == [95, 43, 139, 48]
    with pytest.raises(PolicyError, match="--policies"):
        sweep(trace, ["nope"], [4])


def test_a_trace_without_decode_steps_is_refused_naming_experts():
    """N = 0 loads and slices fine, but has nothing to replay: a TraceError, not a numpy
    reshape error or a division by zero."""
    empty = make_trace(SMALL[:0], 6)
    assert min_slots(empty) == 0
    with pytest.raises(TraceError, match=r"experts has shape \(0, 3, 1, 2\).*no decode steps"):
        replay(empty, "lru", 4)
    with pytest.raises(TraceError, match="no decode steps"):
        sweep(empty, ["lru"], [4], workers=1, progress=False)
