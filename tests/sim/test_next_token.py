"""The next-token oracle (sim.next_token): with no window it is lru slot for slot, with a window past
the end it has belady's misses call for call, and it never beats belady."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.next_token import replay_next_token
from sim.replay import replay, trace_calls
from tests.sim.test_replay import make_trace, random_experts


def _draw(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    L, E = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 10))
    k, B = data.draw(st.integers(1, min(3, E))), data.draw(st.integers(1, 2))
    trace = make_trace(random_experts(rng, data.draw(st.integers(1, 30)), L, B, k, E), E)
    slots = data.draw(st.integers(min(B * k, E), L * E + 1))
    return trace, slots


def _run(trace, slots, window):
    ids, layers, _, _ = trace_calls(trace)
    return replay_next_token(ids, layers, trace.num_layers, trace.num_experts, slots, window)


@given(data=st.data())
def test_no_window_is_lru_and_a_window_past_the_end_is_belady(data):
    trace, slots = _draw(data)
    acc, miss, hist = _run(trace, slots, 0)
    lru = replay(trace, "lru", slots)
    assert np.array_equal(acc, lru.layer_accesses) and np.array_equal(miss, lru.layer_misses)
    assert np.array_equal(hist, lru.hist)  # every call's miss count
    _, miss, hist = _run(trace, slots, 10**9)
    opt = replay(trace, "belady", slots)
    assert np.array_equal(miss, opt.layer_misses) and np.array_equal(hist, opt.hist)


@given(data=st.data())
def test_one_token_of_lookahead_sits_between_belady_and_no_lookahead(data):
    trace, slots = _draw(data)
    got = replay(trace, "next-token", slots)
    assert got.accesses == trace.accesses
    assert replay(trace, "belady", slots).misses <= got.misses
    _, miss, _ = _run(trace, slots, trace.num_layers)
    assert np.array_equal(miss, got.layer_misses)  # the default window is one token of every layer


def test_bad_windows_and_too_few_slots_are_named():
    rng = np.random.default_rng(3)
    trace = make_trace(random_experts(rng, 5, 2, 1, 3, 6), 6)
    with pytest.raises(ValueError, match="window must be >= 0"):
        _run(trace, 6, -1)
    with pytest.raises(ValueError, match="num_slots=2"):
        _run(trace, 2, 1)
