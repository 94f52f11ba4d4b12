"""`belady`: the offline optimum (evict the resident key whose next use is furthest).

It needs the future, so it lives in the simulator only. From the calls of a replay,
    ids [C, rows, k], layers [C] -> accesses (each call's distinct keys, ascending)
    -> next_use int64 [A]: the call index of the key's next access (NEVER if none).
The policy keeps key[NEXT] = next use of the key's latest access; score = -NEXT, so a key
never used again (NEVER) goes first, then the furthest. Under the ensure contract
(every key of a call resident at once) this is optimal for miss counts. With a miss split
(expertcache.split) it copies the misses used again soonest and evicts as before: a limit of
the same split, no longer a proven optimum.
"""

from __future__ import annotations

import numpy as np

from expertcache.geometry import CacheGeometry
from expertcache.policies.base import Clock, Policy, PolicyKind, PolicyState
from expertcache.policies.oracle import NEXT

NEVER = np.int64(2**62)


def call_keys(ids: np.ndarray, layers: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The accesses of a sequence of calls, in replay order.

    ids int32 [C, rows, k], layers int [C] -> (call int64 [A], key int64 [A]): each call's
    distinct valid keys ascending, calls in order. O(C * rows * k * log(rows * k)).
    """
    C = ids.shape[0]
    keys = np.where(ids >= 0, layers.reshape(C, 1, 1).astype(np.int64) * num_experts + ids, -1)
    keys = np.sort(keys.reshape(C, -1), axis=1)
    first = np.ones(keys.shape, dtype=bool)
    first[:, 1:] = keys[:, 1:] != keys[:, :-1]
    keep = first & (keys >= 0)
    call = np.broadcast_to(np.arange(C, dtype=np.int64)[:, None], keys.shape)[keep]
    return call, keys[keep]


def next_use(call: np.ndarray, key: np.ndarray) -> np.ndarray:
    """For each access, the call index of the same key's next access (NEVER if none)."""
    order = np.lexsort((call, key))
    nxt = np.full(call.shape[0], NEVER, dtype=np.int64)
    same = key[order[1:]] == key[order[:-1]]
    nxt[order[:-1][same]] = call[order[1:][same]]
    return nxt


class Belady(Policy):
    """Built from the whole replay's accesses; valid only for that replay, from a cold start."""

    name = "belady"
    key_fields = ("next",)
    initial = {"next": int(NEVER)}
    oracle = True
    kind = PolicyKind.ORACLE

    def __init__(self, geometry: CacheGeometry, next_use: np.ndarray) -> None:
        super().__init__(geometry)
        self.next_use = np.ascontiguousarray(next_use, dtype=np.int64)

    @classmethod
    def for_calls(cls, geometry: CacheGeometry, ids: np.ndarray, layers: np.ndarray) -> Belady:
        return cls(geometry, next_use(*call_keys(ids, np.asarray(layers), geometry.num_experts)))

    def aux(self) -> np.ndarray:
        return self.next_use

    def on_hit(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        st.key[NEXT, keys] = self.next_use[access]

    on_install = on_hit

    def on_served(self, st: PolicyState, clk: Clock, keys, access) -> None:
        self.on_hit(st, clk, keys, None, access)

    def miss_priority(self, st: PolicyState, clk: Clock, keys, access) -> np.ndarray:
        """With a miss split, copy the misses used again soonest."""
        return -self.next_use[access]

    def scores(self, st: PolicyState, clk: Clock, keys, slots) -> np.ndarray:
        return -st.key[NEXT, keys]
