"""The miss split: how the misses of one ensure call divide between the link and the CPU.

    a call's m misses ──c = copies[m], for hybrid at least min(m, empty slots)──►
        c of them copied over the link into slots (admitted: computed on the GPU, as every miss is
          without a split)
        m - c computed on the CPU from host memory (served: no slot, no victim, the slot map unchanged)
    which c: the misses ranked by the policy's miss priority (Policy.miss_priority: how strongly it
    expects the key to be used again), highest first, ties to the lower key

Under hybrid, a pool that still has empty slots copies every miss they can take: filling an empty slot
evicts nothing, and a miss served instead would miss again. `cpu` never copies (every routed expert on
the CPU, the baseline of computing experts where they live).

Every expert already lives in host memory, so a miss can be served two ways, and both channels read
the same DRAM. `copies` is a table fixed at start, so the split is a function of the routing, the cache
state and constants only, never of a timing: the host reference (HostCache), the compiled replay and
the device read the same table and agree bit for bit, and a request gives the same tokens every run.

A balanced table (`MissSplit.hybrid`) sends to the link the count that makes both channels finish
together: for m misses the c in [0, m] with the least max(link(c), cpu(m - c)), where each channel
costs a fixed time once it has any expert plus a time per expert at the bandwidths measured with both
channels running at once (ChannelCosts); ties go to the larger c, since a copied expert is admitted and
may hit later. The balance uses the together rates even where one side would run alone and faster:
a table that sent a call's few misses all to a faster CPU would never admit anything, and the cache
would stop hitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertcache.geometry import MAX_QUERY

# Misses one call may have: fewer than the ensure's query (rows * k < MAX_QUERY).
SPLIT_LEN = MAX_QUERY
MISS_SERVICES = ("copy", "hybrid", "cpu")
MISS_SERVICE_CHOICES = (*MISS_SERVICES, "auto")  # --moe-miss-service: auto resolves to copy or hybrid at start


def _check_us(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"ChannelCosts.{name} must be a number of microseconds, got {value!r}")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"ChannelCosts.{name} must be finite and >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ChannelCosts:
    """Microseconds of each channel for n > 0 experts of one call: fixed + per_expert * n (0 for n = 0).

    link: the miss copy into slots (its first-copy latency and each expert's bytes over the link's
    bandwidth); cpu: the hand-off round trip and each expert's bytes over the CPU kernels' read
    bandwidth. The per-expert times are those measured with the two channels running together; the
    *_alone ones (default: the same) apply to a call whose other channel has nothing to do.
    """

    link_fixed_us: float
    link_per_expert_us: float
    cpu_fixed_us: float
    cpu_per_expert_us: float
    link_alone_per_expert_us: float | None = None
    cpu_alone_per_expert_us: float | None = None

    def __post_init__(self) -> None:
        for name in ("link_alone_per_expert_us", "cpu_alone_per_expert_us"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, name.replace("_alone", "")))
        for name in ("link_fixed_us", "link_per_expert_us", "cpu_fixed_us", "cpu_per_expert_us",
                     "link_alone_per_expert_us", "cpu_alone_per_expert_us"):
            object.__setattr__(self, name, _check_us(name, getattr(self, name)))
            if name.endswith("per_expert_us") and getattr(self, name) == 0:
                raise ValueError(f"ChannelCosts.{name} must be > 0")

    @classmethod
    def from_bandwidths(cls, expert_bytes: int, link_gbps: float, cpu_gbps: float, link_fixed_us: float = 0.0,
                        cpu_fixed_us: float = 0.0, link_alone_gbps: float | None = None,
                        cpu_alone_gbps: float | None = None) -> ChannelCosts:
        """Costs of experts of `expert_bytes` at link_gbps / cpu_gbps (GB/s, measured together) and, for a
        channel working alone, link_alone_gbps / cpu_alone_gbps (default: the same)."""
        rates = {"link_gbps": link_gbps, "cpu_gbps": cpu_gbps,
                 "link_alone_gbps": link_gbps if link_alone_gbps is None else link_alone_gbps,
                 "cpu_alone_gbps": cpu_gbps if cpu_alone_gbps is None else cpu_alone_gbps}
        for name, v in (("expert_bytes", expert_bytes), *rates.items()):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not v > 0:
                raise ValueError(f"ChannelCosts.from_bandwidths: {name} must be > 0, got {v!r}")
        us = {k: expert_bytes / (v * 1e3) for k, v in rates.items()}
        return cls(link_fixed_us, us["link_gbps"], cpu_fixed_us, us["cpu_gbps"], us["link_alone_gbps"],
                   us["cpu_alone_gbps"])

    def link_us(self, n, alone=False) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        per = np.where(alone, self.link_alone_per_expert_us, self.link_per_expert_us)
        return np.where(n > 0, self.link_fixed_us + n * per, 0.0)

    def cpu_us(self, n, alone=False) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        per = np.where(alone, self.cpu_alone_per_expert_us, self.cpu_per_expert_us)
        return np.where(n > 0, self.cpu_fixed_us + n * per, 0.0)

    def step_us(self, m, c) -> np.ndarray:
        """The misses' time of a call with m misses of which c are copied: the slower channel, each at
        its together rate while the other has work, else at its own."""
        m, c = np.asarray(m), np.asarray(c)
        return np.maximum(self.link_us(c, alone=(m - c) == 0), self.cpu_us(m - c, alone=c == 0))


@dataclass(frozen=True, eq=False)
class MissSplit:
    """How many of a call's misses go to the link: `copies` int32 [SPLIT_LEN], copies[m] in [0, m].

    service: "copy" (every miss copied: the cache as without a split), "cpu" (none copied: every
    miss computed on the CPU, so no slot is ever filled) or "hybrid" (the balanced table of `costs`).
    Build with `copy()`, `cpu()` or `hybrid(costs)`.
    """

    service: str
    copies: np.ndarray
    costs: ChannelCosts | None = None

    def __post_init__(self) -> None:
        if self.service not in MISS_SERVICES:
            raise ValueError(f"MissSplit.service must be one of {MISS_SERVICES} (--moe-miss-service), "
                             f"got {self.service!r}")
        c = self.copies
        if not isinstance(c, np.ndarray) or c.dtype != np.int32 or c.shape != (SPLIT_LEN,):
            raise ValueError(f"MissSplit.copies must be int32 [{SPLIT_LEN}]")
        m = np.arange(SPLIT_LEN)
        if ((c < 0) | (c > m)).any():
            raise ValueError("MissSplit.copies[m] must be in [0, m]")
        if (self.service == "copy" and (c != m).any()) or (self.service == "cpu" and c.any()):
            raise ValueError(f"MissSplit.copies disagrees with service {self.service!r}: copy copies every miss "
                             "(copies[m] = m), cpu none (0); give service 'hybrid' for another table")
        c = c.copy()  # the caller's array stays its own
        c.setflags(write=False)
        object.__setattr__(self, "copies", c)

    @classmethod
    def copy(cls) -> MissSplit:
        return cls("copy", np.arange(SPLIT_LEN, dtype=np.int32))

    @classmethod
    def cpu(cls) -> MissSplit:
        return cls("cpu", np.zeros(SPLIT_LEN, dtype=np.int32))

    @classmethod
    def hybrid(cls, costs: ChannelCosts) -> MissSplit:
        """The balanced table of `costs` (module docstring). Cost: O(SPLIT_LEN^2) once."""
        if not isinstance(costs, ChannelCosts):
            raise ValueError(f"MissSplit.hybrid needs ChannelCosts, got {type(costs).__name__}")
        m = np.arange(SPLIT_LEN)[:, None]
        c = np.arange(SPLIT_LEN)[None, :]
        cc = np.minimum(c, m)  # both channels at their together rates: a balance, not a race to one side
        t = np.where(c <= m, np.maximum(costs.link_us(cc), costs.cpu_us(m - cc)), np.inf)  # [m, c]
        best = t.min(axis=1, keepdims=True)
        # the largest c reaching the least time (a copied expert is admitted and may hit later)
        copies = (SPLIT_LEN - 1 - np.argmax((t == best)[:, ::-1], axis=1)).astype(np.int32)
        return cls("hybrid", copies, costs)

    @property
    def fills(self) -> bool:
        """True when the empty slots take every miss they can (hybrid), before the table applies."""
        return self.service == "hybrid"

    def copies_given(self, misses: int, empty: int) -> int:
        """How many of a call's `misses` are copied when the pool has `empty` empty slots."""
        c = int(self.copies[misses])
        return max(c, min(misses, empty)) if self.fills else c

    @property
    def copies_all(self) -> bool:
        """True when every miss is copied (the cache behaves as without a split)."""
        return self.service == "copy"

    def copies_for(self, misses: int) -> int:
        return int(self.copies[misses])

    def describe(self) -> str:
        if self.costs is None:
            return self.service
        c = self.costs
        return (f"{self.service} (link {c.link_fixed_us:.1f} + {c.link_per_expert_us:.1f} us/expert, "
                f"cpu {c.cpu_fixed_us:.1f} + {c.cpu_per_expert_us:.1f} us/expert; copies of 1..8 misses: "
                f"{self.copies[1:9].tolist()})")


# splitmix64's constants: a key's draw is a fixed function of (key, step) that looks uniform
HASH_GOLDEN, HASH_STEP, HASH_MIX = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def hash_priority(keys: np.ndarray, step: int) -> np.ndarray:
    """A uniform-looking draw in [0, 2**30) per key, a fixed function of (key, the call clock step): the
    miss priority of policies that keep no per-key state. Copying the lowest keys instead would admit the
    same low expert ids every time and leave the others to miss for good."""
    with np.errstate(over="ignore"):
        x = (keys.astype(np.uint64) + np.uint64(1)) * np.uint64(HASH_GOLDEN) + np.uint64(step) * np.uint64(HASH_STEP)
        x ^= x >> np.uint64(31)
        x *= np.uint64(HASH_MIX)
        x ^= x >> np.uint64(29)
    return (x >> np.uint64(34)).astype(np.int64)


def rank_misses(priority: np.ndarray, keys: np.ndarray, copies: int) -> np.ndarray:
    """Which of a call's misses are copied: a bool mask over `keys` (int64, ascending) marking the
    `copies` with the highest priority (int64), ties to the lower key."""
    order = np.lexsort((keys, -priority.astype(np.int64)))
    copied = np.zeros(keys.shape[0], dtype=bool)
    copied[order[:copies]] = True
    return copied
