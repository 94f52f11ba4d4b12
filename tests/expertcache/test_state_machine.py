"""A hypothesis state machine on the slot map, run for every registered policy.

Each step is one ensure call (valid, with or without router logits, or invalid). The
machine checks the contract's invariants after every call and drives a twin cache through
the compiled fast path, whose state must equal the reference bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from expertcache import CacheGeometry, EnsureError, HostCache, policy_names
from expertcache.geometry import NO_KEY
from expertcache.policies.base import Clock
from expertcache.replay import run_calls


def expected_victim_order(cache: HostCache, layer: int, ids: np.ndarray, lidx, lval):
    """Filled, unpinned slots sorted by (score, slot), scored as the call will see them:
    on a copy of the state after the call's clock tick, refresh and hit updates."""
    g, pol = cache.geometry, cache.policy
    st_ = cache.state.copy()
    step = cache.step + 1
    tok = cache.tok + (1 if layer == 0 else 0)
    keys = np.unique(layer * g.num_experts + ids[ids >= 0].astype(np.int64))
    base = int(cache.counters[:, 1].sum())
    clk = Clock(step, tok, layer, g.num_layers, g.num_experts, base)
    if lidx is not None and pol.uses_logits:
        pol.refresh(st_, clk, lidx, lval, ids.shape[1])
    slots = cache.slot_of[keys].astype(np.int64)
    hit = slots >= 0
    pol.on_hit(st_, clk, keys[hit], slots[hit], base + np.flatnonzero(hit))
    pol.observe(st_, clk, keys, cache.slot_of)
    cand = np.setdiff1d(np.flatnonzero(cache.key_of != NO_KEY), slots[hit])
    score = pol.scores(st_, clk, cache.key_of[cand].astype(np.int64), cand)
    return cand[np.lexsort((cand, score))]


class SlotMapMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize(
        num_layers=st.integers(1, 4),
        num_experts=st.integers(1, 8),
        slots=st.one_of(st.integers(1, 8), st.integers(9, 40)),
        k=st.integers(1, 4),
        rows=st.integers(1, 3),
    )
    def setup(self, num_layers, num_experts, slots, k, rows):
        self.g = CacheGeometry(num_layers, num_experts, slots)
        self.k, self.rows = k, rows
        self.ref = HostCache(self.g, self.policy)
        self.twin = HostCache(self.g, self.policy)
        self.layer = 0

    def _ids(self, data) -> np.ndarray:
        E, S = self.g.num_experts, self.g.num_slots
        budget = min(S, E)
        pool = data.draw(st.lists(st.integers(0, E - 1), min_size=1, max_size=budget, unique=True))
        ids = np.full((self.rows, self.k), -1, dtype=np.int32)
        for r in range(self.rows):
            row = data.draw(st.lists(st.sampled_from(pool), max_size=self.k, unique=True))
            ids[r, : len(row)] = row
        return ids

    def _logits(self, data, ids):
        E = self.g.num_experts
        T = data.draw(st.integers(1, 6))
        lidx = np.array(data.draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=T, max_size=T),
                                           min_size=self.rows, max_size=self.rows)), dtype=np.int32)
        vals = data.draw(st.lists(st.lists(st.sampled_from([-1.0, -0.5, -0.25, 0.0, 0.1, 0.25, 1.0]),
                                           min_size=T, max_size=T), min_size=self.rows, max_size=self.rows))
        return lidx, np.array(vals, dtype=np.float32)

    @rule(data=st.data(), with_logits=st.booleans(), advance=st.booleans())
    def ensure(self, data, with_logits, advance):
        layer = (self.layer + 1) % self.g.num_layers if advance else self.layer
        ids = self._ids(data)
        lidx, lval = self._logits(data, ids) if with_logits else (None, None)
        before = self.ref.snapshot()
        empties = np.flatnonzero(self.ref.key_of == NO_KEY)
        order = expected_victim_order(self.ref, layer, ids, lidx, lval)
        res = self.ref.ensure(layer, ids, lidx, lval)
        self.layer = layer
        self._check_call(before, empties, order, layer, ids, res)
        out, plan = run_calls(self.twin, ids[None], np.array([layer]),
                              None if lidx is None else lidx[None],
                              None if lval is None else lval[None])
        assert np.array_equal(out, res.slots) and np.array_equal(plan, res.plan)

    def _check_call(self, before, empties, order, layer, ids, res):
        E = self.g.num_experts
        keys = res.keys
        missing = keys[before.slot_of[keys] < 0]
        assert np.array_equal(res.plan[:, 0], missing), "plan lists each miss once, ascending"
        dest = res.plan[:, 1]
        assert len(set(dest.tolist())) == dest.shape[0], "plan destinations are distinct"
        e = min(len(empties), dest.shape[0])
        assert np.array_equal(dest[:e], empties[:e]), "lowest-index empty slots go first"
        assert np.array_equal(dest[e:], order[: dest.shape[0] - e]), "lowest (score, slot) evicted"
        hits = keys[before.slot_of[keys] >= 0]
        assert np.array_equal(self.ref.slot_of[hits], before.slot_of[hits]), "hits stay put"
        assert (self.ref.slot_of[keys] >= 0).all(), "every key of the call is resident"
        valid = ids >= 0
        assert np.array_equal(res.slots[valid], self.ref.slot_of[layer * E + ids[valid]])
        assert (res.slots[~valid] == -1).all()

    @rule(data=st.data(), kind=st.sampled_from(["layer", "id", "dtype", "shape", "too_many", "logits"]))
    def ensure_invalid(self, data, kind):
        g = self.g
        ids = self._ids(data)
        layer, lidx, lval = self.layer, None, None
        if kind == "layer":
            layer = data.draw(st.sampled_from([-1, g.num_layers]))
        elif kind == "id":
            ids[0, 0] = data.draw(st.sampled_from([-2, g.num_experts]))
        elif kind == "dtype":
            ids = ids.astype(np.int64)
        elif kind == "shape":
            ids = ids.reshape(-1)
        elif kind == "too_many":
            ids = np.arange(self.rows * self.k, dtype=np.int32).reshape(self.rows, self.k) % g.num_experts
            if len(np.unique(ids)) <= g.num_slots:
                return  # this geometry cannot ask for more distinct experts than slots
        else:
            lidx = np.zeros((self.rows + 1, 2), dtype=np.int32)
            lval = np.zeros((self.rows + 1, 2), dtype=np.float32)
        before = self.ref.snapshot()
        with pytest.raises(EnsureError):
            self.ref.ensure(layer, ids, lidx, lval)
        assert self.ref.snapshot().equals(before), "a refused call changes nothing"

    @invariant()
    def consistent(self):
        if hasattr(self, "ref"):
            self.ref.check()
            assert self.ref.snapshot().equals(self.twin.snapshot()), "fast path diverged"

    @precondition(lambda self: hasattr(self, "ref"))
    @invariant()
    def counters_add_up(self):
        c = self.ref.counters
        assert c[:, 0].sum() == self.ref.step
        assert (self.ref.key_of != NO_KEY).sum() <= c[:, 2].sum()


@pytest.mark.parametrize("policy", policy_names())
def test_slot_map_state_machine(policy):
    machine = type(f"Machine_{policy}", (SlotMapMachine,), {"policy": policy})
    machine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.parametrize("policy", policy_names())
def test_slot_map_state_machine_over_long_runs(policy):
    """The same machine over runs of 200 calls: long enough for rule's decay, lfuda's aging and markov's
    table halvings to act many times within one run (the long profile only)."""
    machine = type(f"LongMachine_{policy}", (SlotMapMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=200, stateful_step_count=200))
