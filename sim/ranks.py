"""Replay over N GPUs of one host, expert-parallel: each rank caches only the experts it owns.

    Trace experts [N, L, B, k] (global ids)
    -> rank_trace(trace, R, r) for r in 0..R-1: ids through expertcache.ranks.rank_ids (local ids where r
       owns the expert, expert % R == r; -1 elsewhere), num_experts = local_experts(E, R, r)
    -> each rank's replay with the same per-GPU `slots` (a pool over the rank's L x E_r keys; one larger
       never fills, so it replays at L x E_r): per call (decode order) its misses, and its distinct experts
    -> per call the maximum over ranks of each: the slowest rank's misses (hist [L, B*k + 1], priced by
       sim.costmodel.estimate_ranks as that rank's copy) and the busiest rank's experts (layer_routed [L])
    -> ReplayResult with accesses and misses summed over the ranks

Every rank runs its own cold-start replay of the ensure contract with its own policy instance (belady
and next-token: the oracle of the rank's own future), exactly as one GPU's replay. A rank sees the router
logits the way it sees the routing: logit_idx through rank_ids, the other ranks' entries -1 (padding), so
rule's near-miss refresh on a rank measures from the k-th largest of its own experts' top-T logits (the
smallest of them where it has fewer than k): it refreshes every expert of its own that one GPU's rule
would, and may refresh a few more. Router weights keep the rank's entries and are 0 elsewhere. The miss
split (hybrid, cpu) is not modeled across ranks: the ranks share one host's CPU cores and memory
bandwidth, which the host profiles measure for one GPU only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from expertcache.errors import EnsureError
from expertcache.geometry import distinct_counts
from expertcache.ranks import check_ranks, local_experts, rank_ids
from expertcache.words import counted
from sim.costmodel import ALLREDUCES_PER_LAYER
from sim.replay import (
    ReplayResult,
    check_policies,
    check_replayable,
    min_slots,
    replay,
    run_jobs,
    slowest_first,
    warm_up,
)
from sim.trace import Trace


def rank_trace(trace: Trace, ranks: int, rank: int) -> Trace:
    """The trace `rank` of `ranks` replays: the same tokens, layers and shape, experts (and logit_idx)
    mapped by expertcache.ranks.rank_ids, weights 0 where the rank does not own the entry, meta.num_experts
    the rank's expert count (meta.extra gains "rank" and "ranks"). Raises ValueError naming `ranks` or
    `rank` (ranks must be <= the trace's experts)."""
    check_ranks(ranks, trace.num_experts)
    experts = rank_ids(trace.experts, ranks, rank)
    meta = replace(trace.meta, num_experts=local_experts(trace.num_experts, ranks, rank),
                   extra={**trace.meta.extra, "rank": rank, "ranks": ranks})
    weights = None if trace.weights is None else np.where(experts >= 0, trace.weights, np.float32(0))
    logit_idx = None if trace.logit_idx is None else rank_ids(trace.logit_idx, ranks, rank)
    return replace(trace, experts=experts, meta=meta, weights=weights, logit_idx=logit_idx)


def min_rank_slots(trace: Trace, ranks: int) -> int:
    """The most distinct experts one call of any rank asks for: the fewest slots a GPU runs on with
    `ranks` GPUs (min_slots of each rank's trace; min_slots(trace) at one rank)."""
    if ranks == 1:
        return min_slots(trace)
    return max(min_slots(rank_trace(trace, ranks, r)) for r in range(ranks))


def rank_slots(trace: Trace, ranks: int, rank: int, slots: int) -> int:
    """The slots `rank` replays at for a per-GPU pool of `slots`: at most its L x E_r keys (a larger
    pool never fills, and its misses are those of one that holds every key)."""
    return min(int(slots), trace.num_layers * local_experts(trace.num_experts, ranks, rank))


def replay_ranks(trace: Trace, policy: str, slots: int, ranks: int, *, use_logits: bool = True,
                 **constants) -> ReplayResult:
    """Replay `trace` over `ranks` GPUs with `slots` slots each (module docstring); ranks == 1 is
    sim.replay.replay itself. Cost: one replay per rank over its share of the accesses, plus O(calls *
    ranks). Raises ValueError naming `ranks`, and what `replay` raises (TraceError, PolicyError,
    EnsureError for a slot count below a rank's largest call)."""
    check_ranks(ranks, trace.num_experts)
    if ranks == 1:
        return replay(trace, policy, slots, use_logits=use_logits, **constants)
    check_replayable(trace)
    N, L, B, k = trace.experts.shape
    misses = np.zeros((ranks, N * L), dtype=np.int64)  # [R, C] each rank's misses a call
    distinct = np.zeros((ranks, N * L), dtype=np.int64)  # [R, C] each rank's distinct experts a call
    accesses = np.zeros(L, dtype=np.int64)
    layer_misses = np.zeros(L, dtype=np.int64)
    for r in range(ranks):
        mine = rank_trace(trace, ranks, r)
        res = replay(mine, policy, rank_slots(trace, ranks, r, slots), use_logits=use_logits,
                     call_misses=misses[r], **constants)
        distinct[r] = distinct_counts(mine.experts.reshape(N * L, -1))
        accesses += res.layer_accesses
        layer_misses += res.layer_misses
    layers = np.tile(np.arange(L), N)
    hist = np.zeros((L, B * k + 1), dtype=np.int64)
    np.add.at(hist, (layers, misses.max(axis=0)), 1)
    routed = np.zeros(L, dtype=np.int64)
    np.add.at(routed, layers, distinct.max(axis=0))
    return ReplayResult(policy, int(slots), N, N * L, accesses, layer_misses, hist, ranks=ranks,
                        layer_routed=routed, rank_misses=misses.sum(axis=1))


def _ranks_job(trace: Trace, job: tuple[str, int, int, bool]) -> ReplayResult:
    policy, slots, ranks, use_logits = job
    return replay_ranks(trace, policy, slots, ranks, use_logits=use_logits)


def sweep_ranks(trace: Trace, policies: list[str], slots: list[int], ranks: list[int], *,
                workers: int | None = None, progress: bool = True, use_logits: bool = True,
                say_compiling: Callable[[], None] | None = None) -> list[ReplayResult]:
    """replay_ranks of every (policy, slots, ranks) with ranks > 1 (sim.replay.sweep replays one GPU),
    in processes; results ordered by policy, then ranks, then slots. Raises before any work what
    `sweep` raises, ValueError naming `ranks` for a rank count above the trace's experts, and
    EnsureError naming --slots when a slot count is below a rank's largest call (min_rank_slots)."""
    check_policies(policies)
    check_replayable(trace)
    many = sorted({int(n) for n in ranks if n > 1})
    for n in many:
        check_ranks(n, trace.num_experts)
        need = min_rank_slots(trace, n)
        if min(slots) < need:
            raise EnsureError(f"{counted(min(slots), 'slot')} a GPU is too few (--slots): with --ranks {n} one "
                              f"call of a rank asks for {counted(need, 'distinct expert')}: give at least "
                              f"{counted(need, 'slot')}")
    if not many:
        return []
    warm_up(trace, policies, use_logits=use_logits, say=say_compiling)
    jobs = [(p, int(s), n, use_logits) for p in slowest_first(policies) for n in many for s in sorted(slots)]
    done = {job[:3]: r for job, r in zip(jobs, run_jobs(trace, jobs, _ranks_job, workers, progress))}
    return [done[(p, int(s), n)] for p in policies for n in many for s in slots]


def describe_ranks(ranks: list[int], allreduce_us: float) -> str | None:
    """One line for the report's title saying how rows of several GPUs are read, None when every rank
    count is 1."""
    if max(ranks) == 1:
        return None
    return (f"ranks: {', '.join(map(str, ranks))} GPUs of one host, expert e on GPU e % N, slots and %exp a GPU; "
            f"miss/tok and MB/tok summed over the GPUs; us/tok waits for the slowest GPU each layer, plus "
            f"{ALLREDUCES_PER_LAYER} all-reduces a layer at {allreduce_us:g} us each (--allreduce-us, assumed)")
