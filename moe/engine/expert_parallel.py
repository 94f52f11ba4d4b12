"""Expert parallelism: the routed experts of one model spread over N ranks (processes of one host joined by
torch.distributed; the CPU backend: load_model refuses a shard on a CUDA device), each rank caching only the
experts it owns.

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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from expertcache.pool import HostStore
from expertcache.ranks import check_ranks, local_experts, rank_ids, rank_keys
from moe.model.checkpoint import MoEWeights
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
        """Global expert ids (a CPU integer tensor, -1 = padding) -> this rank's local ids
        (expertcache.ranks.rank_ids), `other` where another rank owns the expert or the entry pads; same
        shape and dtype."""
        local = torch.from_numpy(rank_ids(ids.numpy(), self.ranks, self.rank))
        return local if other == -1 else torch.where(local < 0, other, local).to(ids.dtype)

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

    @property
    def store(self) -> HostStore:
        """The rank's HostStore (its experts' rows)."""
        return self.local.store

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
