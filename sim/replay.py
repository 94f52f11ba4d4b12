"""Replay a routing trace through the ensure contract, in decode order, from a cold start.

    Trace experts [N, L, B, k] -> calls: token-major, layers 0..L-1 (ids [N*L, B, k])
    -> one HostCache per (policy, slots), driven by the compiled kernel (expertcache.replay)
    -> ReplayResult: per-layer accesses and misses, miss histogram [L, B*k + 1]

`sweep` runs many (policy, slots) replays in parallel processes with a progress bar. Its kernels are
numba's, compiled on first use and kept in numba's on-disk cache: `warm_up` first replays the trace's
first token through each policy in this process, so the kernels are compiled (or loaded) once, before
the bar starts and before the worker processes fork (they inherit them), and `announce_compiles` says
so just before numba compiles anything. Jobs are submitted slowest policy first, so the bar's estimate
of the time left runs high early rather than low.
Policies come from the expertcache registry plus the simulator's oracles (`belady`, the whole future;
`next-token`, the next token's routing: sim.next_token).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from numba.core import event
from tqdm import tqdm

from expertcache import CacheGeometry, HostCache, get_policy, policy_names
from expertcache.errors import EnsureError, PolicyError
from expertcache.geometry import distinct_counts
from expertcache.host import ACCESSES, MISSES
from expertcache.replay import run_calls
from expertcache.split import MissSplit
from expertcache.words import counted
from sim.belady import Belady
from sim.next_token import replay_next_token
from sim.trace import Trace, TraceError

ORACLES = ("belady", "next-token")
COMPILE_NOTICE = "compiling the replay (first run only; cached after): this takes a minute or two"
# Submission order of a sweep's jobs, slowest replay first (the throughput table of
# benchmarks/bench_replay.py, docs/simulator.md "Replay engine"); unlisted policies go last.
SLOWEST_FIRST = ("markov", "belady", "next-token", "rule", "lfuda", "lru")


def sim_policy_names() -> list[str]:
    """Every policy the simulator can replay: the registry's and the oracles."""
    return sorted(set(policy_names()) | set(ORACLES))


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of one replay. Arrays: layer_accesses / layer_misses int64 [L], hist int64
    [L, B*k + 1] (calls of each layer by miss count).

    A replay over ranks > 1 GPUs (sim.ranks) sums accesses and misses over the ranks, counts its calls
    in hist by the slowest rank's misses, and adds layer_routed int64 [L] (the busiest rank's distinct
    experts, summed over each layer's calls) and rank_misses int64 [ranks]; `slots` is each rank's."""

    policy: str
    slots: int
    tokens: int
    calls: int
    layer_accesses: np.ndarray = field(repr=False)
    layer_misses: np.ndarray = field(repr=False)
    hist: np.ndarray = field(repr=False)
    service: str = "copy"  # the miss split's service (expertcache.split); hist counts every miss
    layer_served: np.ndarray | None = field(default=None, repr=False)  # misses served on the CPU, [L]
    split_hist: np.ndarray | None = field(default=None, repr=False)  # calls by (misses, copies) [Q+1, Q+1]
    ranks: int = 1
    layer_routed: np.ndarray | None = field(default=None, repr=False)
    rank_misses: np.ndarray | None = field(default=None, repr=False)

    @property
    def accesses(self) -> int:
        return int(self.layer_accesses.sum())

    @property
    def misses(self) -> int:
        return int(self.layer_misses.sum())

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.accesses if self.accesses else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens

    @property
    def served(self) -> int:
        """Misses served on the CPU (0 without a split)."""
        return 0 if self.layer_served is None else int(self.layer_served.sum())

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "slots": self.slots,
            "tokens": self.tokens,
            "calls": self.calls,
            "accesses": self.accesses,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "misses_per_token": self.misses_per_token,
            "layer_accesses": self.layer_accesses.tolist(),
            "layer_misses": self.layer_misses.tolist(),
            **({"service": self.service, "served": self.served} if self.service != "copy" else {}),
            **({"ranks": self.ranks, "rank_misses": self.rank_misses.tolist()} if self.ranks > 1 else {}),
        }


def trace_calls(trace: Trace):
    """A trace's ensure calls in decode order.

    Returns ids int32 [N*L, B, k], layers int64 [N*L], and logit_idx int32 / logit_val
    float32 [N*L, B, T] (or None, None).
    """
    N, L, B, k = trace.experts.shape
    ids = np.ascontiguousarray(trace.experts.reshape(N * L, B, k))
    layers = np.tile(np.arange(L, dtype=np.int64), N)
    if trace.logit_idx is None:
        return ids, layers, None, None
    T = trace.logit_idx.shape[-1]
    return (ids, layers, np.ascontiguousarray(trace.logit_idx.reshape(N * L, B, T)),
            np.ascontiguousarray(trace.logit_val.reshape(N * L, B, T)))


def check_policies(names: list[str]) -> None:
    """Raise PolicyError naming --policies and the choices for the first unknown name."""
    for name in names:
        if name not in sim_policy_names():
            raise PolicyError(f"unknown policy {name!r} (--policies): choose from "
                              + ", ".join(sim_policy_names()))


def check_replayable(trace: Trace) -> None:
    """Raise TraceError naming `experts` when the trace has no decode step to replay (N = 0):
    such a trace loads and slices fine, but has no hit rate and no per-token figures."""
    if trace.num_tokens == 0:
        raise TraceError(f"experts has shape {tuple(trace.experts.shape)}: the trace has no "
                         f"decode steps (N = 0), so there is nothing to replay: record or "
                         f"slice at least one token")


def min_slots(trace: Trace) -> int:
    """The most distinct experts one call of the trace asks for: the fewest slots it runs on
    (0 for a trace without decode steps)."""
    N, L = trace.experts.shape[:2]
    if N * L == 0:  # distinct_counts cannot reshape an empty array with -1
        return 0
    return int(distinct_counts(trace.experts.reshape(N * L, -1)).max())


def make_policy(name: str, geometry: CacheGeometry, ids, layers, **constants):
    """A registry policy, or an oracle built from the calls it will see."""
    if name == "belady":
        if constants:
            raise PolicyError("belady takes no constants")
        return Belady.for_calls(geometry, ids, layers)
    if name == "next-token":
        raise PolicyError("next-token is no HostCache policy: sim.replay.replay runs it (sim.next_token)")
    check_policies([name])
    return get_policy(name, geometry, **constants)


def replay(trace: Trace, policy: str, slots: int, *, use_logits: bool = True, split: MissSplit | None = None,
           call_misses: np.ndarray | None = None, **constants) -> ReplayResult:
    """Replay `trace` through `policy` with `slots` slots (cold start), every miss copied or, with
    `split`, divided between the link and the CPU (expertcache.split). call_misses int64 [N*L], when
    given, receives each call's misses in decode order. Cost: O(calls * S)
    in the worst case, usually far less (one scoring pass per call with evictions).
    Raises TraceError for a trace without decode steps (check_replayable), PolicyError for
    next-token with a split (its own pass has none)."""
    check_replayable(trace)
    ids, layers, lidx, lval = trace_calls(trace)
    if not use_logits:
        lidx = lval = None
    geometry = CacheGeometry(trace.num_layers, trace.num_experts, int(slots))
    if policy == "next-token":  # its own pass (sim.next_token): its scores move with the clock
        if split is not None and not split.copies_all:
            raise PolicyError("next-token replays without a miss split: leave it out of a hybrid sweep")
        if constants:
            raise PolicyError("next-token takes no constants")
        if min_slots(trace) > int(slots):
            raise EnsureError(f"{counted(int(slots), 'slot')} is too few (--slots): one call of this trace "
                              f"asks for {counted(min_slots(trace), 'distinct expert')}")
        acc, miss, hist = replay_next_token(ids, layers, trace.num_layers, trace.num_experts, int(slots),
                                            call_misses=call_misses)
        return ReplayResult(policy, int(slots), trace.num_tokens, int(ids.shape[0]), acc, miss, hist)
    cache = HostCache(geometry, make_policy(policy, geometry, ids, layers, **constants), split=split)
    q = ids.shape[1] * ids.shape[2] + 1
    hist = np.zeros((geometry.num_layers, q), dtype=np.int64)
    split_hist = np.zeros((q, q), dtype=np.int64)
    run_calls(cache, ids, layers, lidx, lval, hist=hist, split_hist=split_hist, call_misses=call_misses)
    return ReplayResult(policy, int(slots), trace.num_tokens, int(ids.shape[0]),
                        cache.counters[:, ACCESSES].copy(), cache.counters[:, MISSES].copy(), hist,
                        cache.split.service, cache.served.copy(), split_hist)


class _FirstCompile(event.Listener):
    """Calls `say()` when numba starts its first compile (a kernel found in no cache), once."""

    def __init__(self, say: Callable[[], None]) -> None:
        self.say = say
        self.said = False

    def on_start(self, ev: event.Event) -> None:
        if not self.said:
            self.said = True
            self.say()

    def on_end(self, ev: event.Event) -> None:
        pass


@contextmanager
def announce_compiles(say: Callable[[], None]) -> Iterator[_FirstCompile]:
    """Within the block, call `say()` once, just before numba compiles a kernel that neither this process
    nor numba's on-disk cache holds (nothing is said when every kernel is cached); `.said` tells after."""
    listener = _FirstCompile(say)
    with event.install_listener("numba:compile", listener):
        yield listener


def warm_up(trace: Trace, policies: list[str], *, use_logits: bool = True,
            say: Callable[[], None] | None = None) -> bool:
    """Compile (or load from numba's cache) the kernels that replaying `trace` through `policies` runs, in
    this process, by replaying its first decode step through each; `say()` is called once before the first
    compile. Returns True when something was compiled. Cost: a few ms a policy once cached; the compile
    itself when not. Raises what `replay` raises."""
    first = trace.slice_tokens(0, 1)
    slots = max(1, min_slots(first))
    with announce_compiles(say or (lambda: None)) as listener:
        for policy in policies:
            replay(first, policy, slots, use_logits=use_logits)
    return listener.said


_WORKER_TRACE: Trace | None = None
Job = tuple  # the arguments of one replay, as the runner of run_jobs takes them


def _init_worker(trace: Trace) -> None:
    global _WORKER_TRACE
    _WORKER_TRACE = trace


def _run_one(args: tuple[Callable[[Trace, Job], ReplayResult], Job]) -> ReplayResult:
    runner, job = args
    assert _WORKER_TRACE is not None
    return runner(_WORKER_TRACE, job)


def run_jobs(trace: Trace, jobs: list[Job], runner: Callable[[Trace, Job], ReplayResult], workers: int | None,
             progress: bool) -> list[ReplayResult]:
    """runner(trace, job) of every job, in processes (`runner` a module-level function, so the workers can
    unpickle it); results in job order. workers: processes (default the CPU count, at most len(jobs))."""
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    bar = tqdm(total=len(jobs), desc="replay", unit="run", disable=not progress, leave=False)
    results: dict[int, ReplayResult] = {}
    if workers <= 1:
        for i, job in enumerate(jobs):
            results[i] = runner(trace, job)
            bar.update()
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(workers, mp.get_context(method), _init_worker, (trace,)) as ex:
            futures = {ex.submit(_run_one, (runner, job)): i for i, job in enumerate(jobs)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                bar.update()
    bar.close()
    return [results[i] for i in range(len(jobs))]


def _replay_job(trace: Trace, job: tuple[str, int, bool, MissSplit | None]) -> ReplayResult:
    policy, slots, use_logits, split = job
    return replay(trace, policy, slots, use_logits=use_logits, split=split)


def slowest_first(policies: list[str]) -> list[str]:
    """`policies` in the order a sweep submits them: slowest replay first (SLOWEST_FIRST), unlisted last."""
    rank = {p: i for i, p in enumerate(SLOWEST_FIRST)}
    return sorted(policies, key=lambda p: rank.get(p, len(rank)))


def sweep_splits(trace: Trace, jobs: list[tuple[str, int, MissSplit]], *, workers: int | None = None,
                 progress: bool = True, use_logits: bool = True) -> list[ReplayResult]:
    """Replay every (policy, slots, split) job (the kernels compiled already: run after `sweep`);
    results in job order. Raises what `replay` raises."""
    return run_jobs(trace, [(p, int(s), use_logits, sp) for p, s, sp in jobs], _replay_job, workers, progress)


def sweep(trace: Trace, policies: list[str], slots: list[int], *, workers: int | None = None,
          progress: bool = True, use_logits: bool = True,
          say_compiling: Callable[[], None] | None = None) -> list[ReplayResult]:
    """Replay every (policy, slots) pair; results ordered by policy, then slots.

    workers: processes (default: the CPU count, at most the number of jobs); 1 runs in
    this process. The kernels are compiled first, in this process (warm_up; say_compiling is
    called before a compile). Raises PolicyError / EnsureError / TraceError before any work for
    a bad policy name, a slot count below the largest call (`min_slots`) or a trace without decode
    steps (`check_replayable`).
    """
    check_policies(policies)
    check_replayable(trace)
    need = min_slots(trace)
    if min(slots) < need:
        raise EnsureError(f"{counted(min(slots), 'slot')} is too few (--slots): one call of this trace asks "
                          f"for {counted(need, 'distinct expert')}: give at least {counted(need, 'slot')}")
    warm_up(trace, policies, use_logits=use_logits, say=say_compiling)
    jobs = [(p, int(s), use_logits, None) for p in slowest_first(policies) for s in sorted(slots)]
    results = {job[:2]: r for job, r in zip(jobs, run_jobs(trace, jobs, _replay_job, workers, progress))}
    return [results[(p, int(s))] for p in policies for s in slots]
