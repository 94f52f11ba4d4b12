"""The host reference of the ensure contract: plain numpy, exact, one call at a time.

    ids [rows, k] int32 (expert ids, -1 = padding), layer
        -> query: distinct valid keys ascending
        -> hits (pinned, policy touched) / misses
        -> the split (expertcache.split): c = copies[m] misses copied, the others served on the CPU
        -> victims of the copied: lowest-index empty slots, then lowest (score, slot) evictable
        -> slot map update, plan [(key, slot)] of the copied, per-layer counters
        -> slots [rows, k] int32 (NO_SLOT for padding, CPU_SLOT for a miss served on the CPU)

The device kernels and the compiled replay (`expertcache.replay`) are checked against this
class bit for bit: same arrays, same values, after every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertcache.errors import EnsureError
from expertcache.geometry import CPU_SLOT, NO_KEY, NO_SLOT, CacheGeometry
from expertcache.policies import Policy, get_policy
from expertcache.policies.base import Clock, PolicyState
from expertcache.split import SPLIT_LEN, MissSplit, rank_misses

# Columns of the per-layer counters, int64 [L, 3].
CALLS, ACCESSES, MISSES = 0, 1, 2


@dataclass(frozen=True)
class EnsureResult:
    """What one ensure call returns.

    slots: int32 [rows, k], the slot of every routed id (NO_SLOT where ids is -1, CPU_SLOT where
           the id's miss is served on the CPU).
    plan:  int32 [c, 2], (key, destination slot) per copied miss in ascending key order.
    keys:  int64 [n], the query: distinct valid keys ascending.
    served: int64 [m - c], the misses served on the CPU (keys ascending).
    """

    slots: np.ndarray
    plan: np.ndarray
    keys: np.ndarray
    served: np.ndarray

    @property
    def copies(self) -> int:
        return int(self.plan.shape[0])

    @property
    def misses(self) -> int:
        return self.copies + int(self.served.shape[0])

    @property
    def hits(self) -> int:
        return int(self.keys.shape[0]) - self.misses


@dataclass
class Snapshot:
    """A copy of every array of the contract state, for parity checks."""

    slot_of: np.ndarray
    key_of: np.ndarray
    policy: PolicyState
    clock: np.ndarray
    counters: np.ndarray
    served: np.ndarray

    def equals(self, other: Snapshot) -> bool:
        return (
            np.array_equal(self.slot_of, other.slot_of)
            and np.array_equal(self.key_of, other.key_of)
            and self.policy.equals(other.policy)
            and np.array_equal(self.clock, other.clock)
            and np.array_equal(self.counters, other.counters)
            and np.array_equal(self.served, other.served)
        )


def validate_call(geometry: CacheGeometry, layer, ids, logit_idx=None, logit_val=None) -> np.ndarray:
    """Check one ensure call's arguments; return its query (distinct valid keys, int64 ascending).

    Raises EnsureError naming the argument to change. Reads nothing but its arguments.
    """
    L, E, S = geometry.num_layers, geometry.num_experts, geometry.num_slots
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < L:
        raise EnsureError(f"layer must be an int in [0, {L}), got {layer!r}")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 or ids.ndim != 2:
        raise EnsureError(
            f"ids must be an int32 array [rows, k], got {getattr(ids, 'dtype', type(ids))} "
            f"of shape {getattr(ids, 'shape', None)}"
        )
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise EnsureError(f"ids must have at least one row and one column, got {ids.shape}")
    bad = (ids < -1) | (ids >= E)
    if bad.any():
        raise EnsureError(
            f"ids holds expert id {int(ids[bad][0])} outside [0, {E}) (num_experts); "
            "use -1 for padding"
        )
    if (logit_idx is None) != (logit_val is None):
        raise EnsureError("logit_idx and logit_val come together: pass both or neither")
    if logit_idx is not None:
        _validate_logits(E, ids.shape[0], logit_idx, logit_val)
    valid = ids[ids >= 0].astype(np.int64)
    keys = np.unique(layer * E + valid)
    if keys.shape[0] > S:
        raise EnsureError(
            f"one call asks for {keys.shape[0]} distinct experts but the pool has {S} slots "
            "(--moe-slots): raise the slot count or lower the batch"
        )
    return keys


def _validate_logits(E: int, rows: int, logit_idx, logit_val) -> None:
    for name, arr, dtype in (("logit_idx", logit_idx, np.int32), ("logit_val", logit_val, np.float32)):
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 2:
            raise EnsureError(f"{name} must be a {np.dtype(dtype).name} array [rows, T]")
        if arr.shape[0] != rows or arr.shape[1] < 1:
            raise EnsureError(f"{name} has shape {arr.shape}; it needs [{rows}, T >= 1] like ids")
    if logit_idx.shape != logit_val.shape:
        raise EnsureError(f"logit_idx {logit_idx.shape} and logit_val {logit_val.shape} differ")
    if ((logit_idx < -1) | (logit_idx >= E)).any():
        raise EnsureError(f"logit_idx holds an expert id outside [0, {E}); use -1 for padding")
    if not np.isfinite(logit_val).all():
        raise EnsureError("logit_val holds NaN or infinity: pass finite router logits")


class HostCache:
    """One slot pool on the host, under one policy. See the module docstring for the flow.

    State (all public, all numpy): slot_of int32 [K], key_of int32 [S], policy state
    (PolicyState), clock int64 [2] = (step, tok), counters int64 [L, 3] (calls, accesses,
    misses), served int64 [L] (misses served on the CPU: counted in misses, never copied).
    split: the miss split (expertcache.split.MissSplit; None: every miss copied).
    Cost per call: O(n log n + S) for n routed ids (one scoring pass on misses).
    """

    def __init__(self, geometry: CacheGeometry, policy: Policy | str, split: MissSplit | None = None,
                 **constants) -> None:
        self.geometry = geometry
        self.policy = get_policy(policy, geometry, **constants) if isinstance(policy, str) else policy
        if self.policy.geometry != geometry:
            raise ValueError("the policy was built for another geometry")
        if split is not None and not isinstance(split, MissSplit):
            raise ValueError(f"split must be a MissSplit or None, got {type(split).__name__}")
        self.split = MissSplit.copy() if split is None else split
        self.slot_of = np.full(geometry.num_keys, NO_SLOT, dtype=np.int32)
        self.key_of = np.full(geometry.num_slots, NO_KEY, dtype=np.int32)
        self.state = self.policy.init_state()
        self.clock = np.zeros(2, dtype=np.int64)
        self.counters = np.zeros((geometry.num_layers, 3), dtype=np.int64)
        self.served = np.zeros(geometry.num_layers, dtype=np.int64)

    @property
    def step(self) -> int:
        return int(self.clock[0])

    @property
    def tok(self) -> int:
        return int(self.clock[1])

    def ensure(self, layer: int, ids: np.ndarray, logit_idx: np.ndarray | None = None,
               logit_val: np.ndarray | None = None) -> EnsureResult:
        """Map routed ids [rows, k] int32 of `layer` to slots; plan copies of the misses.

        logit_idx int32 / logit_val float32 [rows, T]: top-T router logits, used by
        policies with a near-miss refresh. Raises EnsureError (state untouched) for a
        layer or id out of range, a wrong dtype or shape, or more distinct keys than slots.
        """
        keys = validate_call(self.geometry, layer, ids, logit_idx, logit_val)
        if not self.split.copies_all and ids.size >= SPLIT_LEN:
            raise EnsureError(f"ids [rows, k] has {ids.size} entries: a miss split takes fewer than {SPLIT_LEN} "
                              "(decode batch rows * top_k)")
        g, pol, st = self.geometry, self.policy, self.state
        self.clock[0] += 1
        if layer == 0:
            self.clock[1] += 1
        base = int(self.counters[:, ACCESSES].sum())
        clk = Clock(self.step, self.tok, int(layer), g.num_layers, g.num_experts, base)
        access = base + np.arange(keys.shape[0], dtype=np.int64)
        if logit_idx is not None and pol.uses_logits:
            pol.refresh(st, clk, logit_idx, logit_val, ids.shape[1])

        slots = self.slot_of[keys].astype(np.int64)
        hit = slots != NO_SLOT
        pol.on_hit(st, clk, keys[hit], slots[hit], access[hit])
        pol.observe(st, clk, keys, self.slot_of)
        miss = np.flatnonzero(~hit)
        m = miss.shape[0]
        c = m if self.split.copies_all else self.split.copies_given(m, int((self.key_of == NO_KEY).sum()))
        if c < m:  # the split: the c misses of highest priority are copied, the others served
            copied = rank_misses(pol.miss_priority(st, clk, keys[miss], access[miss]), keys[miss], c)
            miss, served = miss[copied], miss[~copied]
        else:
            served = miss[:0]
        victims, vscores = self._victims(clk, pinned=slots[hit], m=c)

        plan = np.zeros((victims.shape[0], 2), dtype=np.int32)
        for j, (pos, slot) in enumerate(zip(miss, victims)):
            key, old = int(keys[pos]), int(self.key_of[slot])
            if old != NO_KEY:
                self.slot_of[old] = NO_SLOT
                pol.on_evict(st, clk, old, int(slot), int(vscores[j]))
            self.key_of[slot] = key
            self.slot_of[key] = slot
            pol.on_install(st, clk, np.array([key]), np.array([slot]), access[pos:pos + 1])
            plan[j] = (key, slot)
            slots[pos] = slot
        if served.shape[0]:
            pol.on_served(st, clk, keys[served], access[served])
            slots[served] = CPU_SLOT

        self.counters[layer] += (1, keys.shape[0], m)
        self.served[layer] += served.shape[0]
        out = np.full(ids.shape, NO_SLOT, dtype=np.int32)
        valid = ids >= 0
        out[valid] = slots[np.searchsorted(keys, layer * g.num_experts + ids[valid].astype(np.int64))]
        return EnsureResult(out, plan, keys, keys[served])

    def _victims(self, clk: Clock, pinned: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots for m misses and their scores (0 for empty slots): lowest-index empty
        slots first, then the lowest (score, slot) among filled, unpinned slots."""
        empty = np.flatnonzero(self.key_of == NO_KEY)[:m]
        need = m - empty.shape[0]
        if need == 0:
            return empty, np.zeros(m, dtype=np.int64)
        evictable = np.ones(self.geometry.num_slots, dtype=bool)
        evictable[pinned] = False
        evictable[self.key_of == NO_KEY] = False
        cand = np.flatnonzero(evictable)
        score = self.policy.scores(self.state, clk, self.key_of[cand].astype(np.int64), cand)
        order = np.lexsort((cand, score))[:need]
        return (np.concatenate([empty, cand[order]]),
                np.concatenate([np.zeros(empty.shape[0], dtype=np.int64), score[order]]))

    def snapshot(self) -> Snapshot:
        return Snapshot(self.slot_of.copy(), self.key_of.copy(), self.state.copy(),
                        self.clock.copy(), self.counters.copy(), self.served.copy())

    def check(self) -> None:
        """Assert every invariant of the slot map (used by the tests after each call)."""
        S = self.geometry.num_slots
        full = np.flatnonzero(self.key_of != NO_KEY)
        assert np.array_equal(self.slot_of[self.key_of[full]], full), "key_of/slot_of disagree"
        resident = np.flatnonzero(self.slot_of != NO_SLOT)
        assert resident.shape[0] == full.shape[0] <= S, "more resident keys than filled slots"
        assert np.array_equal(self.key_of[self.slot_of[resident]], resident), "slot_of/key_of disagree"
        assert np.array_equal(full, np.arange(full.shape[0])), "empty slots must be a suffix"
        assert (self.counters[:, MISSES] <= self.counters[:, ACCESSES]).all()
        assert (self.served <= self.counters[:, MISSES]).all()
