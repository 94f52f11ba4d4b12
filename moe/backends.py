"""MoE block backends of the engine: decode through the expert cache, prefill around it.

    decode, hidden [B, H] of MoE layer m:
      CpuCachedMoE: route (f32) → HostCache.ensure(m, ids) → reference_copy(plan: store rows → CPU SlotPool)
                    → routed_reference(hidden, slots, weights, pool) (f32) + shared_expert (f32) → cast
      GpuMoE:       moe.layer.MoELayer.forward over one moe.layer.SlotCache (device ensure, miss copy,
                    routed GEMM by slot id, shared expert on the side stream when copy_overlap is on)
    prefill, hidden [T, H] (any T): moe_prefill for both — the cache is bypassed (below).

Legend: B = decode rows, T = prompt tokens, H = hidden, E = experts, k = top_k, S = slots, m = MoE layer.

Why prefill bypasses the cache: a prompt of a few hundred tokens routes to nearly every expert of
every layer, so pushing it through ensure would evict the whole decode working set (the sequences
already decoding would then miss on every expert of their next step), and one call may need more
distinct experts than there are slots (ensure refuses that). Chunking the prompt to S // k tokens
would work but still flush the pool. Instead prefill reads each used expert's rows straight from the
HostStore once per layer (on a GPU: a copy-engine transfer from pinned memory per used expert, the
streaming that ARCHITECTURE.md names for prefill) and leaves the slot map, policy state, clocks and
counters untouched. Both backends share this one function; the decode math is the same formula.
"""

from __future__ import annotations

from typing import Protocol

import torch

from expertcache.copy import reference_copy
from expertcache.geometry import CacheGeometry
from expertcache.host import HostCache
from expertcache.pool import HostStore, SlotPool
from moe.checkpoint import ModelWeights, MoEWeights
from moe.config import MoEConfig
from moe.layer import MoELayer, SlotCache
from moe.reference import expert_mlp, route, shared_expert
from moe.routed import routed_reference


class MoEBackend(Protocol):
    """What the engine asks of an MoE backend."""

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (out [B, H] hidden's dtype, routed ids [B, k] int32 when `record` else None)."""

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> out [T, H]; leaves the cache untouched."""


def moe_prefill(store: HostStore, cfg: MoEConfig, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
    """One MoE block over a prompt, experts read from `store` (cache bypassed): [T, H] -> [T, H].

    Math and precision of moe.reference.moe_reference: float32 products, one cast at the end.
    Each used expert's rows move to hidden's device once (non-blocking from pinned memory).
    Cost O(T * k * 3 * I * H + T * E * H) compute, (used experts) * 3 * I * H elements moved;
    one host sync (the set of used experts).
    """
    weights, ids = route(hidden, w.router, cfg.top_k, cfg.norm_topk_prob)  # [T, k] f32, i32
    gate_up, down = store.tensor("gate_up"), store.tensor("down")  # [K, 2I, H], [K, H, I]
    base = w.index * cfg.num_experts
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    for expert in torch.unique(ids).tolist():
        rows, cols = torch.nonzero(ids == expert, as_tuple=True)
        gu = gate_up[base + expert].to(hidden.device, non_blocking=True)
        dn = down[base + expert].to(hidden.device, non_blocking=True)
        out.index_add_(0, rows, expert_mlp(hidden[rows], gu, dn) * weights[rows, cols, None])
    if w.shared is not None:
        out += shared_expert(hidden, w.shared)
    return out.to(hidden.dtype)


def _geometry(weights: ModelWeights, num_slots: int, max_batch: int) -> CacheGeometry:
    """The cache geometry, refusing a pool too small for `max_batch` rows of top_k experts."""
    spec = weights.spec
    if max_batch * spec.moe.top_k > num_slots:
        raise ValueError(f"--moe-slots {num_slots} is below max_batch={max_batch} * top_k={spec.moe.top_k}: "
                         "one decode step could route to more distinct experts than slots; raise "
                         "--moe-slots or lower max_batch")
    return CacheGeometry(spec.num_moe_layers, spec.moe.num_experts, num_slots)


class CpuCachedMoE:
    """The CPU backend: the exact host reference of the cache (HostCache) over a CPU SlotPool.

    Same slot map, policy, plan and counters as the GPU path would produce for the same routing;
    the miss copy is expertcache.copy.reference_copy and the routed compute moe.routed.routed_reference
    (float32), so a run exercises the cache's semantics end to end without a GPU.
    `cache` (HostCache) is public: its counters [L_moe, 3] give calls, accesses, misses per MoE layer.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 **constants) -> None:
        self.cfg, self.store = weights.spec.moe, weights.store
        self.cache = HostCache(_geometry(weights, num_slots, max_batch), policy, **constants)
        self.pool = SlotPool(self.store.banks, num_slots, device="cpu")

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] -> (out [B, H], ids [B, k] int32). Cost: one ensure, misses * 3 * I * H copied,
        B * k * 3 * I * H routed multiply-adds."""
        cfg = self.cfg
        weights, ids = route(hidden, w.router, cfg.top_k, cfg.norm_topk_prob)  # [B, k]
        res = self.cache.ensure(w.index, ids.numpy())
        if res.misses:
            count = torch.tensor([res.misses], dtype=torch.int32)
            reference_copy(self.store, self.pool, torch.from_numpy(res.plan), count)
        out = routed_reference(hidden, torch.from_numpy(res.slots), weights,
                               self.pool.tensor("gate_up"), self.pool.tensor("down"))  # [B, H] f32
        if w.shared is not None:
            out = out + shared_expert(hidden, w.shared)
        return out.to(hidden.dtype), ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return moe_prefill(self.store, self.cfg, w, hidden)


class GpuMoE:
    """The GPU backend: one moe.layer.MoELayer per MoE layer over one shared moe.layer.SlotCache.

    Built from the public constructors only. With `record`, the routed ids come from a second router
    GEMV (moe.reference.route on the layer's float32 router, the same call MoELayer makes, hence the
    same ids); decode steps that record are not meant for CUDA-graph capture.
    Raises what SlotPool (PoolError: the slots do not fit), SlotCache and MoELayer raise.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 **constants) -> None:
        geometry = _geometry(weights, num_slots, max_batch)
        self.cfg, self.store = weights.spec.moe, weights.store
        pool = SlotPool(self.store.banks, num_slots, device=weights.device)
        self.slots = SlotCache(self.store, pool, geometry.num_layers, geometry.num_experts, policy, **constants)
        self.layers = {lw.mlp.index: MoELayer(self.cfg, lw.mlp.index, lw.mlp.router, self.slots, lw.mlp.shared)
                       for lw in weights.layers if isinstance(lw.mlp, MoEWeights)}

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = self.layers[w.index]
        out = layer.forward(hidden.contiguous())
        ids = layer.last_routing(hidden.shape[0])[1].clone() if record else None  # what it routed with
        return out, ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return moe_prefill(self.store, self.cfg, w, hidden)


def make_backend(weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 **constants) -> CpuCachedMoE | GpuMoE:
    """GpuMoE when the weights are on a CUDA device, else CpuCachedMoE."""
    cls = GpuMoE if weights.device.type == "cuda" else CpuCachedMoE
    return cls(weights, num_slots, policy, max_batch=max_batch, **constants)
