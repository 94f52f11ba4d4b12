"""Both miss channels measured together at start: the link's copies into slots and the CPU's kernels.

    HostStore (pinned), MoEConfig, CUDA device ──measure_channels──► ChannelMeasure
        groups: G groups of n experts of one layer each, no expert in two groups, G * n experts'
              bytes at least ROTATION_BYTES where the store holds them (rotation())
        link: expertcache.copy.miss_copy of each group's n experts, and of each of them alone, in turn
              into a scratch pool of n slots, back to back in a CUDA graph replayed on a stream of its own
        cpu:  moe.kernels.cpu_experts.CpuExperts over each group, and over each of its experts alone, in
              turn, each call posted from the host to the hand-off's worker (CpuShare.host_call): the
              compiled loop a decode's layers reach, so the fixed time is theirs
        each channel alone, then both at once (a thread runs the CPU calls; numba releases the GIL)
        hand-off (first): moe.engine.handoff's post and wait replayed in a CUDA graph, handing over with
              nothing served (the round trip) and not (a layer call with no CPU share)
    ChannelMeasure ──.costs()──► expertcache.split.ChannelCosts: per expert, the slope between the 1- and
        the n-expert calls alone, and the n-expert call beside the other channel less the fixed part; the
        round trip beyond the two launches in the CPU's fixed part
    ChannelCosts, top_k, hand-off ──choose_service──► ("hybrid" | "copy", why)

Both channels read the same host memory, so what the split balances is each one's rate beside the other:
measured one at a time they overstate both, and a split balanced from those sends the CPU more than it
finishes in time. Each call reads other experts than the calls before it, as a decode step's layers do: the
same few experts over and over would stay in the host's last-level cache (hundreds of MB on server parts),
and the CPU would seem to read at cache speed. The measurement is a constant fixed at start, so the split
table it gives is too: a request decodes to the same tokens on every run of one process. The scratch pool is
freed before the slots are allocated. A layer call pays the hand-off's round trip (moe.engine.handoff) only when
the CPU serves a miss, so it is part of the CPU's fixed cost, which the table balances; the post and wait
that every call of a split launches, serving or not, auto's choice charges to hybrid.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from expertcache.copy import miss_copy
from expertcache.pool import HostStore, SlotPool
from expertcache.split import ChannelCosts, MissSplit
from moe.engine.handoff import CpuShare
from moe.kernels.cpu_experts import MAX_TOKENS, SPIN_PAUSES, CpuExperts, threads_in_use
from moe.model.config import MoEConfig

CALIBRATION_EXPERTS = 8  # experts of one call of each channel (the scratch pool's slots)
CALIBRATION_BYTES = 256 << 20  # ... fewer where the experts are large: at most these bytes a call (>= 2 experts)
ALONE_SECONDS = 0.2  # each channel's time alone, at each of its two call sizes
TOGETHER_SECONDS = 0.4  # both at once
LINK_BATCH = 16  # copy launches between two of the link's events (fewer where a call is over 64 MiB)
HANDOFF_ROUNDS = 64  # post / wait round trips with nothing served, timed back to back
ROTATION_BYTES = 2 << 30  # the experts' bytes each channel cycles through: past any host's last-level cache
MEASURE_TRIES = 3  # measurements at most, while one reads a channel slower alone than beside the other
ALONE_OVER_TOGETHER = 0.9  # ... by more than this: something else ran on the host meanwhile


@dataclass(frozen=True)
class ChannelMeasure:
    """Median call times (microseconds) of each channel: `experts` experts of `expert_bytes` bytes, for
    a model of `top_k` experts a token.

    link_one_us / link_all_us: a copy of 1 / of `experts` experts, alone; link_together_us: of
    `experts` while the CPU computes. cpu_*: the same for CpuExperts.moe on `threads` threads.
    handoff_us: a post and wait (moe.engine.handoff) handing over with nothing served: the round trip a
    layer call pays when the CPU serves. idle_us: the same two launches with nothing handed over, which
    every layer call of a split pays (so the CPU's fixed part holds the round trip beyond them).
    seconds: the measurement's wall time (after each kernel's first call).
    """

    expert_bytes: int
    experts: int
    top_k: int
    link_one_us: float
    link_all_us: float
    link_together_us: float
    cpu_one_us: float
    cpu_all_us: float
    cpu_together_us: float
    threads: int
    seconds: float
    handoff_us: float = 0.0
    idle_us: float = 0.0

    def _channel(self, one: float, whole: float, together: float) -> tuple[float, float, float]:
        """(fixed, per expert together, per expert alone) of one channel."""
        n = self.experts
        if whole > one:
            alone = (whole - one) / (n - 1)
            fixed = max(one - alone, 0.0)
        else:  # a slope lost in noise: all of it per expert
            alone, fixed = whole / n, 0.0
        return fixed, max(together - fixed, 1e-3 * together) / n, alone

    def costs(self) -> ChannelCosts:
        lf, lt, la = self._channel(self.link_one_us, self.link_all_us, self.link_together_us)
        cf, ct, ca = self._channel(self.cpu_one_us, self.cpu_all_us, self.cpu_together_us)
        extra = max(self.handoff_us - self.idle_us, 0.0)  # the launches are in idle_us, which every call pays
        return ChannelCosts(lf, lt, cf + extra, ct, link_alone_per_expert_us=la, cpu_alone_per_expert_us=ca)

    def gbps(self) -> dict[str, float]:
        """Each channel's bytes per second (GB/s) alone and together, from the per-expert times."""
        c = self.costs()
        return {name: self.expert_bytes / (us * 1e3) for name, us in (
            ("link_alone", c.link_alone_per_expert_us), ("link_together", c.link_per_expert_us),
            ("cpu_alone", c.cpu_alone_per_expert_us), ("cpu_together", c.cpu_per_expert_us))}

    @property
    def consistent(self) -> bool:
        """Whether each channel read at least ALONE_OVER_TOGETHER of its together rate alone. A channel has
        the host's memory to itself alone, so a slower alone phase means other work disturbed it, and the
        table balanced from it would be off for the whole process."""
        g = self.gbps()
        return (g["link_alone"] >= ALONE_OVER_TOGETHER * g["link_together"]
                and g["cpu_alone"] >= ALONE_OVER_TOGETHER * g["cpu_together"])

    def describe(self) -> str:
        g, c = self.gbps(), self.costs()
        return (f"link {g['link_alone']:.1f} GB/s alone, {g['link_together']:.1f} beside the CPU (fixed "
                f"{c.link_fixed_us:.1f} us); CPU on {self.threads} threads {g['cpu_alone']:.1f} GB/s alone, "
                f"{g['cpu_together']:.1f} beside the link (fixed {c.cpu_fixed_us:.1f} us, with the hand-off's "
                f"round trip of {self.handoff_us:.1f} beyond the {self.idle_us:.1f} us every layer call of a split "
                f"pays); experts of "
                f"{self.expert_bytes / 2**20:.2f} MiB, measured in {self.seconds:.2f} s")


def choose_service(costs: ChannelCosts, top_k: int, idle_us: float = 0.0, inter: int = 0,
                   granule: int = 0) -> tuple[str, str]:
    """("hybrid" | "copy", why) for --moe-miss-service auto: hybrid when its balanced table (MissSplit.hybrid,
    with the tail of `granule` rows of experts `inter` wide where granule > 0) takes less time than copying
    every miss, on the mean over a call's 0..top_k misses (one decode row: a warm cache misses few, a cold
    one top_k); the round trip is in costs' CPU fixed part, and every hybrid call pays `idle_us` (its post
    and wait, as measured without a tail: the tail's own work in them is not priced) whatever it serves."""
    m = np.arange(0, top_k + 1)
    split = MissSplit.hybrid(costs, inter, granule)
    copies, tails = split.copies[m], split.link_rows[m]
    copy_us = float(costs.step_us(m, m).mean())
    hybrid_us = float(costs.step_us(m, copies, tails / inter if inter else 0.0).mean()) + idle_us
    cut = (f"; the link takes {', '.join(str(int(r)) for r in tails[1:])} rows of a served expert's {inter}"
           if split.tail else "")
    why = (f"predicted per layer call over 0..{top_k} misses: copy {copy_us:.1f} us, hybrid {hybrid_us:.1f} us "
           f"with the hand-off (copying {', '.join(str(int(c)) for c in copies[1:])} of 1..{top_k}{cut})")
    return ("hybrid" if hybrid_us < copy_us else "copy"), why


def rotation(num_layers: int, num_experts: int, n: int, expert_bytes: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(layers [G], experts [G, n]): G groups of n distinct experts of one layer each, the layers taken in
    turn, no (layer, expert) in two groups; G = ceil(ROTATION_BYTES / (n * expert_bytes)), at most the
    num_layers * (num_experts // n) groups there are."""
    per_layer = num_experts // n
    if per_layer < 1 or num_layers < 1:
        raise ValueError(f"rotation: needs n <= num_experts and a layer, got n={n}, num_experts={num_experts}, "
                         f"num_layers={num_layers}")
    groups = min(-(-ROTATION_BYTES // (n * expert_bytes)), num_layers * per_layer)
    perms = [rng.permutation(num_experts)[:per_layer * n].reshape(per_layer, n) for _ in range(num_layers)]
    order = [(layer, j) for j in range(per_layer) for layer in range(num_layers)][:groups]
    layers = np.array([layer for layer, _ in order], np.int32)
    experts = np.stack([np.sort(perms[layer][j]) for layer, j in order]).astype(np.int32)
    return layers, experts


def _cpu_rows(cfg: MoEConfig, experts: np.ndarray, rng: np.random.Generator):
    """x, ids, weights of a CpuExperts.moe call computing each of `experts` once (top_k a row)."""
    k = cfg.top_k
    rows = -(-len(experts) // k)
    ids = np.full((rows, k), -1, np.int32)
    ids.reshape(-1)[:len(experts)] = experts
    x = rng.standard_normal((rows, cfg.hidden), dtype=np.float32)
    return x, ids, rng.random((rows, k), dtype=np.float32), np.empty((rows, cfg.hidden), np.float32)


def _median_call_us(fn, seconds: float) -> float:
    times, end = [], time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 >= end and len(times) >= 3:
            return float(np.median(times)) * 1e6


def measure_channels(store: HostStore, cfg: MoEConfig, device: torch.device | str) -> ChannelMeasure:
    """Time both channels alone and together (module docstring) on `device` (CUDA) for the experts of
    `store` (pinned, cfg.expert_banks()), and the hand-off's round trip. Its timed phases take
    4 * ALONE_SECONDS + TOGETHER_SECONDS after the kernels' first calls (again, up to MEASURE_TRIES in all,
    while a measurement is not `consistent`; the last one is returned), and a scratch pool of
    n = min(CALIBRATION_EXPERTS, E, MAX_TOKENS * top_k, max(2, CALIBRATION_BYTES / expert bytes)) slots;
    each channel cycles through the groups of rotation().
    The copies and the hand-off are timed as CUDA-graph replays, as the decode step runs them, so no
    launch cost of this thread is in them. Raises ValueError for a CPU device or an unpinned store,
    PoolError when the scratch slots do not fit."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_channels: device must be CUDA (the link's copies), got {device}")
    if not store.pinned:
        raise ValueError("measure_channels: the HostStore must be pinned (the miss copy reads mapped host memory)")
    n = min(CALIBRATION_EXPERTS, cfg.num_experts, MAX_TOKENS * cfg.top_k,
            max(2, CALIBRATION_BYTES // store.bytes_per_expert))
    if n < 2:
        raise ValueError(f"measure_channels: needs at least 2 experts a layer (MoEConfig.num_experts), "
                         f"got {cfg.num_experts}")
    rng = np.random.default_rng(0)
    layers, experts = rotation(store.num_keys // cfg.num_experts, cfg.num_experts, n, store.bytes_per_expert, rng)
    cpu = CpuExperts(store, cfg)
    cpu.spin_pauses = SPIN_PAUSES  # as a hybrid decode's CpuShare runs it
    # every expert of the rotation once a turn at either size: the n-expert calls a group each, the
    # 1-expert calls each of the group's experts alone
    calls = {n: [(int(layer), _cpu_rows(cfg, group, rng)) for layer, group in zip(layers, experts)],
             1: [(int(layer), _cpu_rows(cfg, group[j:j + 1], rng)) for layer, group in zip(layers, experts)
                 for j in range(len(group))]}
    pool = SlotPool(store.banks, n, device=device)
    try:
        return until_consistent(lambda p=pool: _measure(store, cfg, p, layers, experts, calls, cpu))
    finally:
        cpu.close()
        del pool
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the slots' free memory is read from the device


def until_consistent(measure_once) -> ChannelMeasure:
    """measure_once() until it gives a `consistent` ChannelMeasure, MEASURE_TRIES calls at most; the last one."""
    for _ in range(MEASURE_TRIES):
        got = measure_once()
        if got.consistent:
            break
    return got


def _replay_us(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, per: int) -> float:
    """One replay of `graph` on `stream`, timed by events: microseconds per each of its `per` rounds."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        graph.replay()
        stop.record(stream)
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / per


def _captured(stream: torch.cuda.Stream, fn, rounds: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `rounds` calls of fn (compiled and run once before)."""
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(rounds):
            fn()
    return graph


class _HandOff:
    """A layer call's post and wait with nothing served (every slot a GPU one) on a CpuShare of its own,
    captured HANDOFF_ROUNDS times back to back in two CUDA graphs: handing over (the round trip) and not
    (the launches alone). Made, compiled and captured before the timed phases (closed again should that
    fail); `us` times a replay."""

    def __init__(self, cpu: CpuExperts, cfg: MoEConfig, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.share, self.stream = CpuShare(cpu, device), stream
        k = cfg.top_k
        hidden = torch.randn((1, cfg.hidden), device=device)
        ids, slots = (torch.zeros((1, k), dtype=torch.int32, device=device) for _ in range(2))
        weights = torch.ones((1, k), dtype=torch.float32, device=device)
        dst = torch.empty((1, cfg.hidden), dtype=torch.float32, device=device)

        def round_trip(always: bool) -> None:
            self.share.post(0, hidden, ids, slots, weights, always=always)
            self.share.wait(None, dst)

        try:
            self.graphs = {always: _captured(stream, lambda a=always: round_trip(a), HANDOFF_ROUNDS)
                           for always in (True, False)}
        except BaseException:
            self.share.close()  # its worker would spin on for the rest of the process
            raise

    def us(self, always: bool) -> float:
        return float(np.median([_replay_us(self.graphs[always], self.stream, HANDOFF_ROUNDS) for _ in range(5)]))

    def close(self) -> None:
        self.share.close()


def _measure(store: HostStore, cfg: MoEConfig, pool: SlotPool, layers: np.ndarray, experts: np.ndarray,
             calls: dict, cpu: CpuExperts) -> ChannelMeasure:
    device, (groups, n) = pool.device, experts.shape
    turn = {size: 0 for size in (1, n)}

    def cpu_call(size: int) -> None:  # through the hand-off's worker, as a decode's layer pays it
        i = turn[size] = (turn[size] + 1) % len(calls[size])
        layer, args = calls[size][i]
        handoff.share.host_call(layer, *args)

    keys = layers[:, None].astype(np.int64) * cfg.num_experts + experts
    slots = np.broadcast_to(np.arange(n), (groups, n))
    plans = torch.tensor(np.stack([keys, slots], axis=2).astype(np.int32), device=device)  # [G, n, 2]
    counts = {size: torch.tensor([size], dtype=torch.int32, device=device) for size in (1, n)}
    stream = torch.cuda.Stream(device)
    # a replay copies every expert of the rotation once (LINK_BATCH rounds of them where they are few and
    # small): a copy of each group, or of each of its experts alone
    rounds = max(1, min(LINK_BATCH, (64 << 20) // (groups * n * store.bytes_per_expert)))
    batch = {n: rounds * groups, 1: rounds * groups * n}

    def copies(size: int) -> None:
        for g in range(groups):
            if size == n:
                miss_copy(store, pool, plans[g], counts[n])
            else:
                for j in range(n):
                    miss_copy(store, pool, plans[g, j:j + 1], counts[1])

    graphs = {size: _captured(stream, lambda s=size: copies(s), rounds)
              for size in (1, n)}  # compiles on the first call (cached on disk after the first run)

    def link_us(size: int, seconds: float, keep_going=lambda: True) -> list[float]:
        """Per-call times of the back-to-back copies of `size` experts, replay by replay."""
        out, end = [], time.perf_counter() + seconds
        while True:
            out.append(_replay_us(graphs[size], stream, batch[size]))
            if (time.perf_counter() >= end and len(out) >= 3) or not keep_going():
                return out

    handoff = _HandOff(cpu, cfg, device, stream)
    try:
        # the device's posts first: the host's calls then take the seqs after the device's last one
        t0 = time.perf_counter()
        round_trip, idle = handoff.us(True), handoff.us(False)
        w = time.perf_counter()
        for size in (1, n):  # first calls: compiles (cached on disk after the first run) and page-ins
            cpu_call(size)
            link_us(size, 0.0)
        t0 += time.perf_counter() - w  # not counted in the measurement's time
        return _timed(store, cfg, n, cpu_call, link_us, t0, round_trip, idle)
    finally:
        handoff.close()


def _timed(store: HostStore, cfg: MoEConfig, n: int, cpu_call, link_us, t0: float, round_trip: float,
           idle: float) -> ChannelMeasure:
    """The channels' timed phases of _measure (every kernel compiled and captured), after the hand-off's
    (from t0)."""
    link_one, link_all = (float(np.median(link_us(size, ALONE_SECONDS))) for size in (1, n))
    cpu_one, cpu_all = (_median_call_us(lambda s=size: cpu_call(s), ALONE_SECONDS) for size in (1, n))
    cpu_times: list[tuple[float, float]] = []
    stop = threading.Event()
    started = threading.Event()
    failed: list[BaseException] = []

    def cpu_loop() -> None:
        try:
            while not stop.is_set():
                a = time.perf_counter()
                cpu_call(n)
                cpu_times.append((a, time.perf_counter()))
                started.set()
        except BaseException as e:  # handed to the measuring thread
            failed.append(e)
            started.set()

    worker = threading.Thread(target=cpu_loop, name="expertcache-channels", daemon=True)
    worker.start()
    started.wait()
    w0 = time.perf_counter()
    link_together = link_us(n, TOGETHER_SECONDS, keep_going=lambda: not failed)
    w1 = time.perf_counter()
    stop.set()
    worker.join()
    if failed:
        raise failed[0]
    inside = [b - a for a, b in cpu_times if a >= w0 and b <= w1]
    if not inside:  # every CPU call outlasted the window: those that overlapped it
        inside = [b - a for a, b in cpu_times if a < w1 and b > w0]
    seconds = time.perf_counter() - t0
    return ChannelMeasure(store.bytes_per_expert, n, cfg.top_k, link_one, link_all, float(np.median(link_together)),
                          cpu_one, cpu_all, float(np.median(inside)) * 1e6, threads_in_use(), seconds, round_trip,
                          idle)
