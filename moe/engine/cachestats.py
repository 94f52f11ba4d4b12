"""One view of the expert cache's counters for either backend (for /metrics and the trace check).

    CpuCachedMoE.cache (expertcache.host.HostCache): counters int64 [L, 3], clock, key_of   ─┐
    GpuMoE.slots.cache (expertcache.device.DeviceCache): .stats(bytes_per_expert), key_of  ─┴► CacheStats

Only decode steps reach the cache: prefill reads experts straight from the HostStore (or, for an expert that has a
slot, from the pool) and leaves the slot map, policy state, clocks and counters untouched (moe.engine.backends
explains why); `prefill_streamed` / `prefill_from_slots` count its experts. So `calls[l]` is the number of decode
steps so far (every step calls every MoE layer once, whatever the batch), and "per token" below means per decode step,
as the simulator's `misses_per_token` (a trace's N steps).
Legend: L = MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertcache.host import ACCESSES, CALLS, MISSES
from moe.engine.backends import CpuCachedMoE, GpuMoE


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was built. calls / accesses / misses: int64 [L] per MoE layer
    (accesses = distinct experts a step asked of that layer). steps: decode steps. num_slots: the
    pool's slots. bytes_per_expert: HostStore.bytes_per_expert. prefill_streamed / prefill_from_slots:
    (layer, expert) uses of prefill calls read from the HostStore / from a slot."""

    calls: np.ndarray
    accesses: np.ndarray
    misses: np.ndarray
    steps: int
    num_slots: int
    bytes_per_expert: int
    prefill_streamed: int = 0
    prefill_from_slots: int = 0
    served: int = 0  # misses computed on the CPU (a miss split): counted in misses, never copied

    @property
    def total_accesses(self) -> int:
        return int(self.accesses.sum())

    @property
    def total_misses(self) -> int:
        return int(self.misses.sum())

    @property
    def slots_in_use(self) -> int:
        """Slots holding an expert. Slots fill in order and are never emptied (the ensure contract),
        so that is every copied miss so far until the pool is full."""
        return min(self.total_misses - self.served, self.num_slots)

    @property
    def hit_rate(self) -> float:
        """1 - misses / accesses over every layer and decode step (0 before any access)."""
        acc = self.total_accesses
        return 1.0 - self.total_misses / acc if acc else 0.0

    @property
    def bytes_copied(self) -> int:
        """Bytes moved host -> slots by miss copies (each copied miss copies one expert's rows)."""
        return (self.total_misses - self.served) * self.bytes_per_expert

    @property
    def misses_per_layer_per_token(self) -> np.ndarray:
        """float64 [L]: misses of each layer per decode step."""
        return self.misses / max(self.steps, 1)


def cache_stats(backend: CpuCachedMoE | GpuMoE) -> CacheStats:
    """The counters of `backend`'s expert cache. On a GPU: one device sync (call it between steps).

    Under expert parallelism (moe.engine.expert_parallel.ExpertParallelMoE) the counters of this rank's
    cache. Raises TypeError for a backend that is neither CpuCachedMoE nor GpuMoE nor wraps one.
    """
    backend = getattr(backend, "local", backend)
    bpe = backend.store.bytes_per_expert
    if isinstance(backend, CpuCachedMoE):
        c = backend.cache.counters
        return CacheStats(c[:, CALLS].copy(), c[:, ACCESSES].copy(), c[:, MISSES].copy(), backend.cache.tok,
                          backend.cache.geometry.num_slots, bpe, *backend.prefill_counts,
                          served=int(backend.cache.served.sum()))
    if isinstance(backend, GpuMoE):
        cache = backend.slots.cache
        s = cache.stats(bpe)
        return CacheStats(s["calls"], s["accesses"], s["misses"], int(cache.clock[1].item()),
                          cache.geometry.num_slots, bpe, *backend.prefill_counts, served=s["served"])
    raise TypeError(f"cache_stats needs a CpuCachedMoE or GpuMoE backend, got {type(backend).__name__}")
