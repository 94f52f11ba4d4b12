"""Cache geometry: how many MoE layers, experts per layer and slots one pool has.

A key names one expert of one layer: `key = layer * num_experts + expert`. Expert ids,
keys and slots are never mixed; `NO_SLOT` marks an absent key, `NO_KEY` an empty slot, and
`CPU_SLOT` a routed id whose miss is served on the CPU (expertcache.split): it has no slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_SLOT = -1
NO_KEY = -1
MAX_QUERY = 1 << 10  # ids one ensure call may take: fewer (the device query's tallies are packed in 10-bit fields)
CPU_SLOT = -2


@dataclass(frozen=True)
class CacheGeometry:
    """Shape of one slot pool shared by all MoE layers.

    num_layers: MoE layers L (layer ids 0..L-1 in decode order).
    num_experts: routed experts per layer E (expert ids 0..E-1).
    num_slots: slots S in the pool (`--moe-slots`).
    """

    num_layers: int
    num_experts: int
    num_slots: int

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_experts", "num_slots"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.num_keys >= 2**31:
            raise ValueError(
                f"num_layers * num_experts = {self.num_keys} keys do not fit int32 keys"
            )

    @property
    def num_keys(self) -> int:
        """L * E: every (layer, expert) pair."""
        return self.num_layers * self.num_experts

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def layer_of(self, key: int) -> int:
        return key // self.num_experts


def distinct_counts(ids: np.ndarray) -> np.ndarray:
    """Distinct valid (>= 0) ids per call: ids int [C, ...] -> int64 [C]. O(C q log q)."""
    flat = np.sort(ids.reshape(ids.shape[0], -1), axis=1)
    new = np.ones(flat.shape, dtype=bool)
    new[:, 1:] = flat[:, 1:] != flat[:, :-1]
    return ((flat >= 0) & new).sum(axis=1)
