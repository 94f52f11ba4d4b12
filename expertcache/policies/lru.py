"""`lru`: evict the slot touched longest ago.

State: slot[LAST] = the call clock `step` at which the slot was last hit or installed.
Score = slot[LAST]. Ties (slots touched in the same call) go to the lowest slot index.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from expertcache.policies.base import CLK_STEP, Clock, FastVerbs, Policy, PolicyState
from expertcache.policies.noop import no_evicted, no_refresh, zero_offsets

LAST = 0


@njit(cache=True)
def _touch(kst, sst, gst, prm, clk, aux, key, slot, access, installed):  # noqa: ARG001
    sst[LAST, slot] = clk[CLK_STEP]


@njit(cache=True)
def _score(kst, sst, gst, prm, clk, key, slot):  # noqa: ARG001
    return sst[LAST, slot]


class LRU(Policy):
    name = "lru"
    slot_fields = ("last",)
    fast = FastVerbs(_touch, _score, no_evicted, no_refresh, _score, zero_offsets)

    def on_hit(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        st.slot[LAST, slots] = clk.step

    on_install = on_hit

    def scores(self, st: PolicyState, clk: Clock, keys, slots) -> np.ndarray:
        return st.slot[LAST, slots].copy()
