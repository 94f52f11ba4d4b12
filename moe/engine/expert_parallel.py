"""Expert parallelism: the routed experts of one model spread over N ranks (processes of one host, one GPU
or CPU each, joined by torch.distributed), each rank caching only the experts it owns.

    rank r of N (ExpertShard):  owns expert e where e % N == r, as local id e // N (expertcache.ranks)
    its HostStore               the owned experts' rows only (shard_store), keys layer * E_r + local id
    its backend                 the cache over its own L x E_r keys and slots (CpuCachedMoE with `shard`):
                                route (every rank routes every token, the same ids), ensure the owned ids
                                (the others -1, padding), copy its misses over its own link, its experts'
                                weighted sum: a float32 partial [T, H]
    ExpertParallelMoE           partials of every rank gathered and added in rank order 0..N-1 (the same
                                order on every rank: every rank holds the same sum, bit for bit, on every
                                run), then the shared expert, then one cast to the model dtype

Everything else of the model (attention, dense layers, the shared expert, the KV cache) is replicated: each
rank computes it in full from the same hidden state, so the ranks stay identical without exchanging
anything else. What N ranks buy is N pools of slots and N links at once for the routed experts, which
dominate an offloaded MoE's memory and its misses. Prefill reads each rank's own experts the same way
(moe_prefill_routed with the shard) and adds the partials in the same order.

The sum over ranks associates the experts' terms differently from one rank's (each rank adds its own in
top-k order, then the ranks are added), so N ranks agree with one rank to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from expertcache.pool import HostStore
from expertcache.ranks import check_ranks, local_experts, rank_keys
from moe.model.checkpoint import ModelWeights, MoEWeights
from moe.model.reference import shared_expert


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `ranks` over a model of `num_experts` routed experts a layer; `group`: the
    torch.distributed process group the ranks share (None: the default group)."""

    num_experts: int
    ranks: int
    rank: int
    group: object = None

    def __post_init__(self) -> None:
        check_ranks(self.ranks, self.num_experts)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank must be an int in [0, {self.ranks}) (ranks={self.ranks}), got {self.rank!r}")

    @property
    def experts(self) -> int:
        """The experts a layer this rank owns (E_r)."""
        return local_experts(self.num_experts, self.ranks, self.rank)

    def local_ids(self, ids: torch.Tensor, other: int = -1) -> torch.Tensor:
        """Global expert ids (any integer tensor, -1 = padding) -> this rank's local ids, `other` where
        another rank owns the expert or the entry pads; same shape and dtype."""
        mine = (ids >= 0) & (ids % self.ranks == self.rank)
        return torch.where(mine, ids // self.ranks, other).to(ids.dtype)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's float32 partial [T, H] (this one's given), gathered and added in rank order."""
        parts = [torch.empty_like(partial) for _ in range(self.ranks)]
        dist.all_gather(parts, partial.contiguous(), group=self.group)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out


def shard_store(store: HostStore, num_layers: int, shard: ExpertShard) -> HostStore:
    """The HostStore of `shard`'s rank: the rows of the experts it owns (expertcache.ranks.rank_keys), in
    its local key order, pinned as `store` is. Raises ValueError naming the store when it does not hold
    num_layers x num_experts keys."""
    want = num_layers * shard.num_experts
    if store.num_keys != want:
        raise ValueError(f"the HostStore holds {store.num_keys} expert rows, not the model's {num_layers} MoE layers "
                         f"x {shard.num_experts} experts = {want}: shard the whole model's store")
    rows = torch.from_numpy(rank_keys(num_layers, shard.num_experts, shard.ranks, shard.rank))
    return HostStore.from_tensors({b.name: store.tensor(b.name).index_select(0, rows) for b in store.banks},
                                  pin=store.pinned)


def shard_weights(weights: ModelWeights, shard: ExpertShard) -> ModelWeights:
    """`weights` with the store of `shard`'s rank (shard_store); everything else shared with `weights`."""
    return replace(weights, store=shard_store(weights.store, weights.spec.num_moe_layers, shard))


class ExpertParallelMoE:
    """The MoE backend of one rank: `local` (a CpuCachedMoE built with the same `shard`) computes the
    rank's experts; decode and prefill add the ranks' partials (ExpertShard.reduce), then the shared
    expert, and cast once (module docstring)."""

    def __init__(self, local, shard: ExpertShard) -> None:
        self.local, self.shard = local, shard

    @property
    def extra_slots(self) -> int:
        return self.local.extra_slots

    @property
    def cache(self):
        """The rank's HostCache (over its own L x E_r keys)."""
        return self.local.cache

    def check(self) -> None:
        self.local.check()

    def _finish(self, w: MoEWeights, hidden: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        out = self.shard.reduce(partial)
        if w.shared is not None:
            out += shared_expert(hidden, w.shared)
        return out.to(hidden.dtype)

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        partial, ids = self.local.decode_routed(w, hidden)
        return self._finish(w, hidden, partial), ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return self._finish(w, hidden, self.local.prefill_routed(w, hidden))


# the Engine calls that run the model or change its rows: the leader sends each to every other rank first
STEP_CALLS = frozenset({"prefill", "join", "start_join", "advance", "abort_join", "leave", "decode_step",
                        "generate"})
_CURRENT, _OTHER = "<the joining prompt>", "<another joining prompt>"  # a Joining argument, as sent
_STOP = "<stop>"


class LeaderEngine:
    """Rank 0's Engine under expert parallelism: each call of STEP_CALLS is first broadcast (its name and
    arguments, torch.distributed.broadcast_object_list over `group`) to the ranks running `follow`, then run
    here; every rank so runs the same calls in the same order, and the MoE layers' gathers meet. Everything
    else (attributes, properties, read-only calls) is the wrapped engine's. `stop()` ends the followers."""

    def __init__(self, engine, group=None) -> None:
        self.engine, self.group = engine, group

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if name not in STEP_CALLS:
            return attr

        def call(*args, **kwargs):
            sent = tuple(_CURRENT if a is not None and a is self.engine.joining else
                         _OTHER if type(a).__name__ == "Joining" else a for a in args)
            _broadcast([name, sent, kwargs], self.group)
            return attr(*args, **kwargs)

        return call

    def stop(self) -> None:
        """Tell every follower to return."""
        _broadcast([_STOP, (), {}], self.group)


def _broadcast(message: list, group) -> list:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def follow(engine, group=None) -> int:
    """A rank other than 0: run every call LeaderEngine broadcasts, in order, on this rank's `engine`, until
    its stop(). A call that raises here raised on the leader too (the same call on the same state); it is
    counted and the loop goes on. Returns the number of calls run."""
    calls = 0
    while True:
        name, args, kwargs = _broadcast([None, (), {}], group)
        if name == _STOP:
            return calls
        args = tuple(a if not isinstance(a, str) else engine.joining if a == _CURRENT else
                     object() if a == _OTHER else a for a in args)  # object(): a Joining that is not this one
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception:  # the leader raised the same on the same state, and answers its client
            pass
        calls += 1


# a follower waits for the leader's next call as long as the server is idle: no collective timeout
IDLE = timedelta(days=365)


def free_init_method() -> str:
    """A torch.distributed init method on this host: tcp://127.0.0.1 at a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def load_ranked(path: str, ranks: int, init: str, load: dict):
    """Rank 0 of `ranks` processes of expert parallelism on this host: start ranks 1..N-1 (spawned
    processes that load the checkpoint at `path` with `load`, load_model's keyword arguments, their own
    ExpertShard, then `follow`), load rank 0's engine, and wait until every rank has loaded. Returns
    (LeaderEngine, the follower processes). Raises ValueError with the first rank's load error (the
    followers then exit)."""
    from moe.engine.loading import load_model
    from moe.model.spec import ModelSpec, read_config

    experts = ModelSpec.from_hf(read_config(path), dtype=load.get("dtype"),
                                expert_format=load.get("expert_format")).moe.num_experts
    check_ranks(ranks, experts)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower, args=(rank, ranks, init, str(path), experts, load), daemon=True,
                         name=f"expertcache-rank-{rank}") for rank in range(1, ranks)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=ranks, timeout=IDLE)
    engine, error = None, None
    try:
        engine = load_model(path, expert_shard=ExpertShard(experts, ranks, 0), **load)
    except Exception as e:  # every rank's outcome is gathered before anyone raises
        error = f"rank 0: {e}"
    errors = _gather_errors(error, ranks)
    if errors:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=30)
        raise ValueError(errors[0])
    return LeaderEngine(engine), procs


def stop_ranked(leader: LeaderEngine, procs: list, timeout: float = 30.0) -> list[int | None]:
    """End the followers (LeaderEngine.stop) and rank 0's process group; wait for the processes. Returns
    their exit codes (None: still running after `timeout` s, then killed)."""
    leader.stop()
    dist.destroy_process_group()
    codes = []
    for p in procs:
        p.join(timeout=timeout)
        if p.exitcode is None:
            p.kill()
        codes.append(p.exitcode)
    return codes


def _gather_errors(error: str | None, ranks: int) -> list[str]:
    seen: list[str | None] = [None] * ranks
    dist.all_gather_object(seen, error)
    return [e for e in seen if e]


def _follower(rank: int, ranks: int, init: str, path: str, experts: int, load: dict) -> None:
    """Rank `rank`'s process (load_ranked): load, report, then follow the leader until it stops; it exits
    when the process that started it is gone."""
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    from moe.engine.loading import load_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks, timeout=IDLE)
    engine, error = None, None
    try:
        engine = load_model(path, expert_shard=ExpertShard(experts, ranks, rank), **load)
    except Exception as e:
        error = f"rank {rank}: {e}"
    if not _gather_errors(error, ranks):
        follow(engine)
    dist.destroy_process_group()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
