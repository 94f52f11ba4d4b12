"""The policy interface: integer state arrays, their update on hit and on install, and a score.

Every policy keeps its state in three int64 arrays whose layout is the same on the host
(numpy), in the compiled replay (numba) and on the device (torch):

    key  [nk, K]   per-key fields (survive eviction), K = L * E keys
    slot [ns, S]   per-slot fields (belong to whichever key the slot holds)
    glob [ng]      policy-wide fields

A policy implements the contract's verbs twice, over the same arrays:

* the reference verbs (`on_hit`, `on_install`, `scores`, `on_evict`, `refresh`, `observe`):
  numpy, vectorised over the keys of one call, written to be read;
* the fast verbs: numba `@njit` scalar functions in the policy's module (`touch`, `score`,
  and where the policy needs them `evicted`, `refresh`, `order`, `offsets`, `observe`), which the
  compiled replay calls per key and per slot through a dispatch on `Policy.kind`
  (expertcache.replay). Tests hold the two to bit-for-bit agreement.

The victim index of the compiled replay needs, for every resident key of layer lk at
every clock, a lower bound `score >= (order(key) + offsets[lk]) >> shift` where `order`
changes only when the key's state does (a touch, or a refresh that reports the key).
Policies whose score changes only on a touch use order = score and no offsets; `rule`
gives an order and offsets that make the bound exact while no clamp is active.

Scores are int64; the lowest `(score, slot index)` among evictable slots is evicted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import numpy as np

from expertcache.geometry import CacheGeometry

# Clock vector handed to the fast verbs, int64 [CLOCK_LEN].
CLK_STEP, CLK_TOK, CLK_LAYER, CLK_LAYERS, CLK_EXPERTS = range(5)
CLOCK_LEN = 5


@dataclass(frozen=True)
class Clock:
    """Where one ensure call stands: its call clock, token clock and layer.

    step: calls so far, this one included. tok: decode steps so far, this one included.
    access_base: distinct-key accesses before this call (oracles index their future by it).
    """

    step: int
    tok: int
    layer: int
    num_layers: int
    num_experts: int
    access_base: int = 0


@dataclass
class PolicyState:
    """A policy's integer state: key [nk, K] (the policy's key_dtype: int64, or int32 where its
    per-key tables dominate, as markov's), slot [ns, S] and glob [ng] int64."""

    key: np.ndarray
    slot: np.ndarray
    glob: np.ndarray

    def copy(self) -> PolicyState:
        return PolicyState(self.key.copy(), self.slot.copy(), self.glob.copy())

    def equals(self, other: PolicyState) -> bool:
        return (
            np.array_equal(self.key, other.key)
            and np.array_equal(self.slot, other.slot)
            and np.array_equal(self.glob, other.glob)
        )


class PolicyKind(IntEnum):
    """The one numbering of the policies (Policy.kind), shared by the compiled replay, which dispatches
    its verbs on it (expertcache.replay), and the device ensure, which takes it as its POLICY constexpr
    (expertcache.device.cache). A new policy adds a member here."""

    LRU = 0
    RULE = 1
    LFUDA = 2
    MARKOV = 3
    ORACLE = 4  # future-knowing policies of the simulator: no device ensure


class Policy:
    """Base of every eviction policy. Subclasses set the ClassVars and the verbs."""

    name: ClassVar[str]
    key_fields: ClassVar[tuple[str, ...]] = ()
    slot_fields: ClassVar[tuple[str, ...]] = ()
    glob_fields: ClassVar[tuple[str, ...]] = ()
    # Initial value of every field, by name (0 where absent).
    initial: ClassVar[dict[str, int]] = {}
    # dtype of the key rows: int64, or int32 where the policy bounds every key field below 2**31 (half
    # the bytes of per-key tables to move, on the host and on the device)
    key_dtype: ClassVar[type] = np.int64
    uses_logits: ClassVar[bool] = False
    # Oracles see the future and exist in the simulator only.
    oracle: ClassVar[bool] = False
    kind: ClassVar[PolicyKind]

    def __init__(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry

    # ---- state ---------------------------------------------------------------------------
    def init_state(self) -> PolicyState:
        g = self.geometry

        def block(fields: tuple[str, ...], n: int, dtype=np.int64) -> np.ndarray:
            arr = np.zeros((len(fields), n), dtype=dtype)
            for i, f in enumerate(fields):
                if self.initial.get(f, 0):  # zero rows stay untouched: markov's tables are large
                    arr[i] = self.initial[f]
            return arr

        glob = np.array([self.initial.get(f, 0) for f in self.glob_fields], dtype=np.int64)
        return PolicyState(
            block(self.key_fields, g.num_keys, self.key_dtype), block(self.slot_fields, g.num_slots), glob
        )

    def params(self) -> np.ndarray:
        """Integer constants for the fast verbs and the device kernels, int64 [P]."""
        return np.zeros(1, dtype=np.int64)

    def fparams(self) -> np.ndarray:
        """Floating constants (only for comparing router logits), float32 [P]."""
        return np.zeros(1, dtype=np.float32)

    def aux(self) -> np.ndarray:
        """Read-only side input of the fast verbs (an oracle's future), int64 [A]."""
        return np.zeros(1, dtype=np.int64)

    # ---- reference verbs (numpy, one call's keys at a time) ------------------------------
    def refresh(
        self, st: PolicyState, clk: Clock, logit_idx: np.ndarray, logit_val: np.ndarray, k: int
    ) -> None:
        """Near-miss refresh from router logits, before victims are chosen. Default: none."""

    def on_hit(self, st: PolicyState, clk: Clock, keys: np.ndarray, slots: np.ndarray,
               access: np.ndarray) -> None:
        raise NotImplementedError

    def on_install(self, st: PolicyState, clk: Clock, keys: np.ndarray, slots: np.ndarray,
                   access: np.ndarray) -> None:
        raise NotImplementedError

    def scores(self, st: PolicyState, clk: Clock, keys: np.ndarray,
               slots: np.ndarray) -> np.ndarray:
        """int64 eviction score of each resident (key, slot); the lowest is evicted first."""
        raise NotImplementedError

    def on_evict(self, st: PolicyState, clk: Clock, key: int, slot: int, score: int) -> None:
        """The resident `key` leaves `slot` (its score was `score`). Default: nothing."""

    def observe(self, st: PolicyState, clk: Clock, keys: np.ndarray, slot_of: np.ndarray) -> None:
        """The call's distinct keys `keys` (ascending), after its hits are touched and before its
        victims are chosen (slot_of: the slot map before the call): for a policy that learns from
        the whole call (markov). Default: nothing."""

    def miss_priority(self, st: PolicyState, clk: Clock, keys: np.ndarray, access: np.ndarray) -> np.ndarray:
        """int64 per missing key (ascending, none resident) of how strongly the policy expects it to be used
        again soon, read after the call's hits are touched and before its victims are chosen: the split
        (expertcache.split) copies the misses of highest priority and serves the others on the CPU.
        Default, for policies whose state is per slot: a fixed draw per (key, call clock)
        (expertcache.split.hash_priority), which beat copying the lowest keys on the real traces."""
        from expertcache.split import hash_priority

        return hash_priority(keys, clk.step)

    def on_served(self, st: PolicyState, clk: Clock, keys: np.ndarray, access: np.ndarray) -> None:
        """The missing `keys` were served on the CPU (used, but given no slot). Default: nothing, for
        policies whose state is per slot."""

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class PolicyInfo:
    """One registry entry: how to build the policy, and what it is."""

    name: str
    factory: Callable[..., Policy]
    summary: str
    oracle: bool = False
