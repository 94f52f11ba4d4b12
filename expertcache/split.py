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

Whole experts balance the channels only to within one expert's time. With a `tail` (the expert width I
and a granule of its rows, `tail_granule`), the first served miss of a call is split along I: the CPU
computes its intermediate rows [0, I - r) and the link copies rows [I - r, I) (gate and up rows, down's
columns) into a scratch slot that the cache never assigns, where the GPU computes them; r =
link_rows[m], a multiple of the granule in [0, I). The split expert is still served (no slot, not
admitted). The table then balances max(link(c + r / I), cpu(m - c - r / I)) over c and r together;
every choice within TAIL_TIE (1 %) of the least time is a tie, which goes to the larger c, then the
smaller r: a tail takes an admission only where it saves more than that (a lone miss of equal channels
is cut in half rather than copied). A call whose copies the empty slots raised above copies[m] splits
nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from expertcache.formats import ExpertFormat
from expertcache.formats.base import ITEMSIZE
from expertcache.geometry import MAX_QUERY

# Misses one call may have: fewer than the ensure's query (rows * k < MAX_QUERY).
SPLIT_LEN = MAX_QUERY
MISS_SERVICES = ("copy", "hybrid", "cpu")
MISS_SERVICE_CHOICES = (*MISS_SERVICES, "auto")  # --moe-miss-service: auto resolves to copy or hybrid at start
TAIL_ROWS = 16  # a tail's rows are a multiple of the CPU kernels' gate_up item (moe.kernels.cpu_experts)
TAIL_STEPS = 64  # at most this many tail sizes per expert (a wider expert takes a coarser granule)
TAIL_MAX_MISSES = 256  # calls of more misses (never a decode step's) split no expert
TAIL_TIE = 0.01  # choices within this share of the least time are ties (to more copies, then a shorter tail)


def tail_granule(fmt: ExpertFormat, inter: int) -> int:
    """The rows a split expert's tail moves by for experts of width `inter` in `fmt`, or 0 where such an
    expert cannot be split: a multiple of TAIL_ROWS, of the format's scale block along down's inputs
    (fmt.in_block) and of the inputs in one 4-byte word of down's main part (the miss copy moves words),
    dividing `inter` into at least 2 and at most TAIL_STEPS parts where such a multiple exists."""
    main = next(p for p in fmt.layout(1, inter) if p.suffix == fmt.main)
    per_word = max(1, 4 * inter // (main.shape[-1] * ITEMSIZE[main.dtype]))  # down's inputs in one word
    g0 = math.lcm(TAIL_ROWS, fmt.in_block, per_word)
    for g in range(g0, inter // 2 + 1, g0):
        if inter % g == 0 and inter // g <= TAIL_STEPS:
            return g
    return 0


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

    def step_us(self, m, c, f=0.0) -> np.ndarray:
        """The misses' time of a call with m misses of which c are copied (and the fraction f of one
        served expert, its tail): the slower channel, each at its together rate while the other has
        work, else at its own."""
        m, c, f = np.asarray(m), np.asarray(c), np.asarray(f, dtype=np.float64)
        link, cpu = c + f, m - c - f
        return np.maximum(self.link_us(link, alone=cpu <= 0), self.cpu_us(cpu, alone=link <= 0))


@dataclass(frozen=True, eq=False)
class MissSplit:
    """How many of a call's misses go to the link: `copies` int32 [SPLIT_LEN], copies[m] in [0, m].

    service: "copy" (every miss copied: the cache as without a split), "cpu" (none copied: every
    miss computed on the CPU, so no slot is ever filled) or "hybrid" (the balanced table of `costs`).
    link_rows int32 [SPLIT_LEN] (hybrid with a tail): rows [inter - link_rows[m], inter) of the first
    served expert that the link copies and the GPU computes (0: none), where copies[m] < m; inter: the
    expert width it cuts (0: no tail). Build with `copy()`, `cpu()` or `hybrid(costs, inter, granule)`.
    """

    service: str
    copies: np.ndarray
    costs: ChannelCosts | None = None
    link_rows: np.ndarray | None = None
    inter: int = 0

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
        r = self.link_rows
        if r is None:
            r = np.zeros(SPLIT_LEN, dtype=np.int32)
        if not isinstance(r, np.ndarray) or r.dtype != np.int32 or r.shape != (SPLIT_LEN,):
            raise ValueError(f"MissSplit.link_rows must be int32 [{SPLIT_LEN}]")
        if isinstance(self.inter, bool) or not isinstance(self.inter, int) or self.inter < 0:
            raise ValueError(f"MissSplit.inter must be an int >= 0 (the expert width; 0: no tail), got {self.inter!r}")
        if r.any() and (self.service != "hybrid" or ((r < 0) | (r >= self.inter)).any() or (r[c >= m] != 0).any()):
            raise ValueError("MissSplit.link_rows[m] must be in [0, inter) and 0 where copies[m] = m, under "
                             "service 'hybrid' only")
        r = r.copy()
        r.setflags(write=False)
        object.__setattr__(self, "link_rows", r)

    @classmethod
    def copy(cls) -> MissSplit:
        return cls("copy", np.arange(SPLIT_LEN, dtype=np.int32))

    @classmethod
    def cpu(cls) -> MissSplit:
        return cls("cpu", np.zeros(SPLIT_LEN, dtype=np.int32))

    @classmethod
    def hybrid(cls, costs: ChannelCosts, inter: int = 0, granule: int = 0) -> MissSplit:
        """The balanced table of `costs` (module docstring); with `granule` > 0 (tail_granule of experts of
        width `inter`), a served expert's tail balances the channels in steps of granule / inter of an
        expert. Cost: O(SPLIT_LEN^2) once, and O(TAIL_MAX_MISSES^2 * inter / granule) with a tail."""
        if not isinstance(costs, ChannelCosts):
            raise ValueError(f"MissSplit.hybrid needs ChannelCosts, got {type(costs).__name__}")
        for name, v in (("inter", inter), ("granule", granule)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"MissSplit.hybrid: {name} must be an int >= 0, got {v!r}")
        if granule and (inter % granule or inter // granule < 2):
            raise ValueError(f"MissSplit.hybrid: granule={granule} must divide inter={inter} into 2 or more parts "
                             "(tail_granule gives it)")
        m = np.arange(SPLIT_LEN)[:, None]
        c = np.arange(SPLIT_LEN)[None, :]
        cc = np.minimum(c, m)  # both channels at their together rates: a balance, not a race to one side
        t = np.where(c <= m, np.maximum(costs.link_us(cc), costs.cpu_us(m - cc)), np.inf)  # [m, c]
        best = t.min(axis=1, keepdims=True)
        # the largest c reaching the least time (a copied expert is admitted and may hit later)
        copies = (SPLIT_LEN - 1 - np.argmax((t == best)[:, ::-1], axis=1)).astype(np.int32)
        link_rows = np.zeros(SPLIT_LEN, dtype=np.int32)
        if granule:
            _balance_tails(costs, inter // granule, granule, copies, link_rows)
        return cls("hybrid", copies, costs, link_rows, inter if granule else 0)

    @property
    def fills(self) -> bool:
        """True when the empty slots take every miss they can (hybrid), before the table applies."""
        return self.service == "hybrid"

    @property
    def tail(self) -> bool:
        """True when some call splits a served expert between the CPU and the link (a scratch slot)."""
        return bool(self.link_rows.any())

    def copies_given(self, misses: int, empty: int) -> int:
        """How many of a call's `misses` are copied when the pool has `empty` empty slots."""
        c = int(self.copies[misses])
        return max(c, min(misses, empty)) if self.fills else c

    def link_rows_given(self, misses: int, copies: int) -> int:
        """The tail rows of a call's first served miss that the link takes, when `copies` of its `misses`
        are copied (0 unless copies is the table's own copies[misses])."""
        return int(self.link_rows[misses]) if copies == int(self.copies[misses]) else 0

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
        tail = (f"; tail rows of 1..8 misses (of {self.inter}): {self.link_rows[1:9].tolist()}" if self.tail else "")
        return (f"{self.service} (link {c.link_fixed_us:.1f} + {c.link_per_expert_us:.1f} us/expert, "
                f"cpu {c.cpu_fixed_us:.1f} + {c.cpu_per_expert_us:.1f} us/expert; copies of 1..8 misses: "
                f"{self.copies[1:9].tolist()}{tail})")


def split_for_slots(split: MissSplit | None, num_slots: int, keys: int) -> MissSplit | None:
    """The split a cache of `num_slots` slots over `keys` routed experts (L * E) runs: None (copy) for a
    hybrid split whose slots hold every routed expert, else `split`. There the empty slots take every miss
    (MissSplit.fills) and the pool never fills, so the split would serve nothing on the CPU and only add
    the hand-off's kernels to each layer; the cache, its admissions and its outputs are the same as copy's."""
    return None if split is not None and split.fills and num_slots >= keys else split


def _balance_tails(costs: ChannelCosts, steps: int, granule: int, copies: np.ndarray, link_rows: np.ndarray) -> None:
    """For m in [1, TAIL_MAX_MISSES): the (c, tail) of least max(link(c + f), cpu(m - c - f)) with f = n / steps,
    n in [0, steps) and n = 0 where c = m; ties (within TAIL_TIE of the least) to the larger c, then the
    smaller n. Writes copies[m] and link_rows[m] = n * granule in place."""
    top = min(SPLIT_LEN, TAIL_MAX_MISSES)
    m = np.arange(top)[:, None, None]
    c = np.arange(top)[None, :, None]
    f = (np.arange(steps) / steps)[None, None, :]
    link, cpu = c + f, m - c - f
    t = np.maximum(costs.link_us(link), costs.cpu_us(cpu))
    t = np.where((c < m) | ((c == m) & (f == 0)), t, np.inf)  # [m, c, n]
    for mm in range(1, top):
        tm = t[mm]  # [c, n]
        cs, ns = np.nonzero(tm <= tm.min() * (1 + TAIL_TIE))
        pick = np.lexsort((ns, -cs))[0]
        copies[mm], link_rows[mm] = cs[pick], ns[pick] * granule


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
