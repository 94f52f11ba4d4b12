"""`lfuda`: least-frequently-used with dynamic aging (Arlitt et al., the policy Squid ships).

Plain LFU keeps once-hot experts forever; dynamic aging lets them go. A policy-wide
inflation value AGE is raised to the score of every evicted slot, and a slot's priority
is AGE at its last use plus its use count:

    slot[FREQ]  uses since install (1 on install, +1 per call that hits it)
    slot[PRIO]  glob[AGE] + slot[FREQ], set at each use
    score       slot[PRIO]
    evict       glob[AGE] = max(glob[AGE], score of the victim)

Within a call, hits update first (with the AGE of before the call); each miss then
evicts its victim and installs, so an install sees the AGE raised by its own victim.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from expertcache.policies.base import Clock, Policy, PolicyKind, PolicyState

FREQ, PRIO = 0, 1
AGE = 0


@njit(cache=True, inline="always")
def touch(sst, gst, slot, installed):
    if installed:
        sst[FREQ, slot] = 1
    else:
        sst[FREQ, slot] += 1
    sst[PRIO, slot] = gst[AGE] + sst[FREQ, slot]


@njit(cache=True, inline="always")
def score(sst, slot):
    return sst[PRIO, slot]


@njit(cache=True, inline="always")
def evicted(gst, victim_score):
    if victim_score > gst[AGE]:
        gst[AGE] = victim_score


class LFUDA(Policy):
    name = "lfuda"
    slot_fields = ("freq", "prio")
    glob_fields = ("age",)
    kind = PolicyKind.LFUDA

    def on_hit(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        st.slot[FREQ, slots] += 1
        st.slot[PRIO, slots] = st.glob[AGE] + st.slot[FREQ, slots]

    def on_install(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        st.slot[FREQ, slots] = 1
        st.slot[PRIO, slots] = st.glob[AGE] + 1

    def scores(self, st: PolicyState, clk: Clock, keys, slots) -> np.ndarray:
        return st.slot[PRIO, slots].copy()

    def on_evict(self, st: PolicyState, clk: Clock, key: int, slot: int, score: int) -> None:
        st.glob[AGE] = max(int(st.glob[AGE]), int(score))
