"""MoE block backends of the engine: decode through the expert cache, prefill around it.

    decode, hidden [B, H] of MoE layer m:
      CpuCachedMoE: route (f32) → HostCache.ensure(m, ids) → reference_copy(plan: store rows → CPU SlotPool)
                    → routed_reference(hidden, slots, weights, pool) (f32) + shared_expert (f32) → cast
      GpuMoE:       moe.engine.layer.MoELayer.forward over one moe.engine.layer.SlotCache (device ensure, miss copy,
                    routed GEMM by slot id), each layer launching from its resolved LaunchPlan (the
                    shared expert and early hits on the side stream where copy_overlap is on and applies);
                    no host sync, so the engine captures whole decode steps (moe.engine.graphs); with
                    forced_routing the ids / weights come from static buffers (set_routing), not the router
    prefill, hidden [T, H] (any T): moe_prefill for both — the cache is bypassed (below).

Legend: B = decode rows, T = prompt tokens, H = hidden, E = experts, k = top_k, S = slots, m = MoE layer.

Why prefill bypasses the cache: a prompt of a few hundred tokens routes to nearly every expert of
every layer, so pushing it through ensure would evict the whole decode working set (the sequences
already decoding would then miss on every expert of their next step), and one call may need more
distinct experts than there are slots (ensure refuses that). Chunking the prompt to S // k tokens
would work but still flush the pool. Instead prefill reads each used expert's rows straight from the
HostStore once per layer (on a GPU: copy-engine transfers from pinned memory into a ring of
PREFILL_STAGING staging slots, on their own stream, running ahead of the compute) and
leaves the slot map, policy state, clocks and counters untouched; an expert that already has a slot is computed from the pool instead (read only,
no transfer: the slot holds the same bytes). Both backends share this one function; the decode math
is the same formula.

Measured on the real traces with the host reference (benchmarks/bench_prefill_admission.py; the
figures are in docs/): pushing the prompt through the cache instead barely changes the misses of the
decode steps that follow (the decode working set turns over within a few steps anyway), while its
own copies are several times the experts streamed here (a small pool evicts prompt experts between
chunks); reading resident experts from their slots cuts what is streamed by a large factor.
"""

from __future__ import annotations

from typing import Protocol

import torch

from expertcache.copy import reference_copy
from expertcache.geometry import CacheGeometry
from expertcache.host import HostCache
from expertcache.pool import HostStore, SlotPool
from moe.engine.budget import PREFILL_STAGING
from moe.model.checkpoint import ModelWeights, MoEWeights
from moe.model.config import MoEConfig
from moe.engine.layer import MoELayer, SlotCache
from moe.model.reference import expert_mlp, route, shared_expert
from moe.kernels.routed import routed_reference
from moe.kernels.slot_matrix import SlotMatrix


class MoEBackend(Protocol):
    """What the engine asks of an MoE backend."""

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (out [B, H] hidden's dtype, routed ids [B, k] int32 when `record` else None)."""

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> out [T, H]; leaves the cache untouched."""


def expert_matrices(banks, cfg: MoEConfig) -> tuple[SlotMatrix, SlotMatrix]:
    """(gate_up [N, 2I, H] of 2 stacked matrices, down [N, H, I]) of a HostStore or SlotPool in the
    config's expert format (N = its keys or slots). No device work."""
    h, i = cfg.hidden, cfg.expert_intermediate
    return (SlotMatrix.of_pool(banks, cfg.format, "gate_up", 2 * i, h, 2),
            SlotMatrix.of_pool(banks, cfg.format, "down", h, i))


class PrefillStaging:
    """A ring of `num_slots` device slots (a SlotPool over the store's banks) and a copy stream: prefill
    copies the experts it needs that have no cache slot into the ring ahead of the compute, so the copy
    engine moves expert i + 1 .. i + num_slots while expert i is computed. Bytes: num_slots * the bytes
    of one expert, allocated once. Raises PoolError where the ring does not fit."""

    def __init__(self, store: HostStore, num_slots: int, device: torch.device) -> None:
        self.store = store
        self.pool = SlotPool(store.banks, num_slots, device=device)
        self.stream = torch.cuda.Stream(device=self.pool.device)

    def run(self, keys: list[int]) -> "_StagedCopies":
        """Start copying `keys` (store keys, in the order they will be computed) into the ring."""
        return _StagedCopies(self, keys)


class _StagedCopies:
    """The copies of one layer's streamed experts through a PrefillStaging ring. slot(i) makes the
    current stream wait for key i's copy and returns its ring slot; release(i) tells the ring the
    current stream's work with slot i is queued, which frees the slot for key i + ring size."""

    def __init__(self, staging: PrefillStaging, keys: list[int]) -> None:
        self.staging, self.keys = staging, keys
        self.ring = staging.pool.num_slots
        self.copied: list[torch.cuda.Event] = []
        self.freed: list[torch.cuda.Event] = []
        for i in range(min(self.ring, len(keys))):
            self._copy(i)

    def _copy(self, i: int) -> None:
        st = self.staging
        with torch.cuda.stream(st.stream):
            if i >= self.ring:  # the compute that read this slot last is queued before this copy
                st.stream.wait_event(self.freed[i - self.ring])
            for bank in st.store.banks:
                st.pool.tensor(bank.name)[i % self.ring].copy_(st.store.tensor(bank.name)[self.keys[i]],
                                                               non_blocking=True)
            done = torch.cuda.Event()
            done.record(st.stream)
        self.copied.append(done)

    def slot(self, i: int) -> int:
        torch.cuda.current_stream().wait_event(self.copied[i])
        return i % self.ring

    def release(self, i: int) -> None:
        freed = torch.cuda.Event()
        freed.record(torch.cuda.current_stream())
        self.freed.append(freed)
        if i + self.ring < len(self.keys):
            self._copy(i + self.ring)


def moe_prefill(store: HostStore, cfg: MoEConfig, w: MoEWeights, hidden: torch.Tensor,
                resident: tuple[torch.Tensor, SlotPool] | None = None,
                counts: list[int] | None = None, staging: PrefillStaging | None = None) -> torch.Tensor:
    """One MoE block over a prompt, experts read from `store` (cache bypassed): [T, H] -> [T, H].

    Math and precision of moe.model.reference.moe_reference: float32 products, one cast at the end;
    each expert's weights are its format's float32 decode (expertcache.formats). The used experts are
    computed in increasing id order, each over its tokens in increasing order (index_add_ into a
    float32 sum). An expert with a slot in `resident` = (slot_of [L_moe * E] int32, the SlotPool) is
    read from the pool (the same bytes, so the same result bit for bit) and nothing moves; the others
    are streamed: through `staging` (a GPU's PrefillStaging: copies on its stream, up to its ring size
    ahead of the compute) or, without one, moved to hidden's device as each is computed. Nothing of the
    cache is written. counts: optional [streamed, reused], incremented. Cost O(T * k * 3 * I * H +
    T * E * H) compute, (used experts without a slot) * the expert's bytes moved; one host sync (the
    layer's per-expert token counts and its E slot ids).
    """
    weights, ids = route(hidden, w.router, cfg.top_k, cfg.norm_topk_prob)  # [T, k] f32, i32
    k, e_count = ids.shape[1], cfg.num_experts
    gate_up, down = expert_matrices(store, cfg)
    pool = None if resident is None else expert_matrices(resident[1], cfg)
    base = w.index * e_count
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs by expert, tokens ascending
    per = torch.bincount(flat, minlength=e_count)
    if resident is not None:  # the one host read: token counts and slot ids together
        both = torch.cat([per, resident[0][base:base + e_count].to(per.device, torch.int64)]).tolist()
        per, slot_of = both[:e_count], both[e_count:]
    else:
        per, slot_of = per.tolist(), [-1] * e_count
    used = [e for e in range(e_count) if per[e]]
    streamed = [e for e in used if slot_of[e] < 0]
    staged = staging.run([base + e for e in streamed]) if staging is not None and streamed else None
    if staged is not None:
        st_gate_up, st_down = expert_matrices(staging.pool, cfg)
    starts = [0]
    for n in per:
        starts.append(starts[-1] + n)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    j = 0  # the next streamed expert
    for expert in used:
        pairs = order[starts[expert]:starts[expert + 1]]
        rows, cols = pairs // k, pairs % k
        slot = slot_of[expert]
        if slot >= 0:
            gu, dn = pool[0].dequantize([slot])[0], pool[1].dequantize([slot])[0]
        elif staged is not None:
            r = staged.slot(j)
            gu, dn = st_gate_up.dequantize([r])[0], st_down.dequantize([r])[0]
        else:
            gu = gate_up.dequantize([base + expert], hidden.device)[0]
            dn = down.dequantize([base + expert], hidden.device)[0]
        if counts is not None:
            counts[int(slot >= 0)] += 1
        out.index_add_(0, rows, expert_mlp(hidden[rows], gu, dn) * weights[rows, cols, None])
        if slot < 0:
            if staged is not None:
                staged.release(j)
            j += 1
    if w.shared is not None:
        out += shared_expert(hidden, w.shared)
    return out.to(hidden.dtype)


def _geometry(weights: ModelWeights, num_slots: int, max_batch: int) -> CacheGeometry:
    """The cache geometry, refusing a pool too small for `max_batch` rows of top_k experts or larger
    than every routed expert of the model."""
    spec = weights.spec
    if max_batch * spec.moe.top_k > num_slots:
        raise ValueError(f"--moe-slots {num_slots} is below max_batch={max_batch} * top_k={spec.moe.top_k}: "
                         "one decode step could route to more distinct experts than slots; raise "
                         "--moe-slots or lower max_batch")
    keys = spec.num_moe_layers * spec.moe.num_experts
    if num_slots > keys:
        raise ValueError(f"--moe-slots {num_slots} is above the model's {keys} routed experts ({spec.num_moe_layers} "
                         f"MoE layers x {spec.moe.num_experts}): a slot beyond them never holds one; pass "
                         f"--moe-slots {keys} to keep every expert resident")
    return CacheGeometry(spec.num_moe_layers, spec.moe.num_experts, num_slots)


class CpuCachedMoE:
    """The CPU backend: the exact host reference of the cache (HostCache) over a CPU SlotPool.

    Same slot map, policy, plan and counters as the GPU path would produce for the same routing;
    the miss copy is expertcache.copy.reference_copy and the routed compute moe.kernels.routed.routed_reference
    (float32), so a run exercises the cache's semantics end to end without a GPU.
    `cache` (HostCache) is public: its counters [L_moe, 3] give calls, accesses, misses per MoE layer.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 **constants) -> None:
        self.cfg, self.store = weights.spec.moe, weights.store
        self.cache = HostCache(_geometry(weights, num_slots, max_batch), policy, **constants)
        self.pool = SlotPool(self.store.banks, num_slots, device="cpu")
        self.prefill_counts = [0, 0]  # prefill's used experts: [streamed from the store, read from a slot]

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
                               *expert_matrices(self.pool, cfg))  # [B, H] f32
        if w.shared is not None:
            out = out + shared_expert(hidden, w.shared)
        return out.to(hidden.dtype), ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        resident = (torch.from_numpy(self.cache.slot_of), self.pool)
        return moe_prefill(self.store, self.cfg, w, hidden, resident, self.prefill_counts)


class GpuMoE:
    """The GPU backend: one moe.engine.layer.MoELayer per MoE layer over one shared moe.engine.layer.SlotCache.

    Built from the public constructors only. With `record`, the routed ids are a copy of what the
    layer routed with (MoELayer.last_routing, or the forced ids), made on the device, so a decode
    step that records stays capturable (moe.engine.graphs).
    forced_routing: route every decode call from static buffers instead of the router (benchmarks
    replaying a trace): `routing_buffers` ids int32 / weights float32 [L_moe, max_batch, k], filled per
    step with `set_routing` (ids -1 = no expert until then); prefill still uses the router.
    Raises what SlotPool (PoolError: the slots do not fit), SlotCache and MoELayer raise.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 forced_routing: bool = False, **constants) -> None:
        geometry = _geometry(weights, num_slots, max_batch)
        self.cfg, self.store = weights.spec.moe, weights.store
        pool = SlotPool(self.store.banks, num_slots, device=weights.device)
        self.slots = SlotCache(self.store, pool, geometry.num_layers, geometry.num_experts, policy, **constants)
        self.layers = {lw.mlp.index: MoELayer(self.cfg, lw.mlp.index, lw.mlp.router, self.slots, lw.mlp.shared)
                       for lw in weights.layers if isinstance(lw.mlp, MoEWeights)}
        self.routing_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefill_counts = [0, 0]  # prefill's used experts: [streamed from the store, read from a slot]
        self.staging = (PrefillStaging(self.store, PREFILL_STAGING, weights.device) if weights.device.type == "cuda"
                        else None)  # under Triton's interpreter on the CPU nothing is copied ahead
        if forced_routing:
            shape, dev = (geometry.num_layers, max_batch, self.cfg.top_k), weights.device
            self.routing_buffers = (torch.full(shape, -1, dtype=torch.int32, device=dev),
                                    torch.zeros(shape, dtype=torch.float32, device=dev))

    def set_routing(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Forced routing of the next decode step: ids int32, weights float32 [L_moe, B, k] (any device;
        on the model's device no host sync) into rows 0..B-1 of `routing_buffers`. Rows B.. keep
        theirs. Raises ValueError naming forced_routing (not enabled) or ids / weights (shape, dtype)."""
        if self.routing_buffers is None:
            raise ValueError("set_routing needs GpuMoE(..., forced_routing=True)")
        bids, bweights = self.routing_buffers
        for name, t, dtype in (("ids", ids, torch.int32), ("weights", weights, torch.float32)):
            ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == 3
            ok = ok and t.shape[0] == bids.shape[0] and 1 <= t.shape[1] <= bids.shape[1] and t.shape[2] == bids.shape[2]
            if not ok:
                raise ValueError(f"set_routing: {name} must be {dtype} [L_moe={bids.shape[0]}, B <= "
                                 f"max_batch={bids.shape[1]}, k={bids.shape[2]}], got "
                                 f"{list(getattr(t, 'shape', []))} {getattr(t, 'dtype', type(t).__name__)}")
        if ids.shape != weights.shape:
            raise ValueError(f"set_routing: ids {list(ids.shape)} and weights {list(weights.shape)} differ in shape")
        b = ids.shape[1]
        bids[:, :b].copy_(ids, non_blocking=True)
        bweights[:, :b].copy_(weights, non_blocking=True)

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer, b = self.layers[w.index], hidden.shape[0]
        routing = None
        if self.routing_buffers is not None:  # [b, k] views of [L_moe, max_batch, k]: contiguous
            routing = (self.routing_buffers[0][w.index, :b], self.routing_buffers[1][w.index, :b])
        out = layer.forward(hidden.contiguous(), routing)
        ids = None
        if record:  # what it routed with, copied on the device
            ids = (layer.last_routing(b)[1] if routing is None else routing[0]).clone()
        return out, ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """Eager, on the current stream, after the decode steps queued before it (their miss copies
        filled the slots it reads); the experts without a slot stream through self.staging's ring, their
        copies on its stream overlapping the compute. One host sync for the layer's counts and slot ids."""
        slots = self.slots
        return moe_prefill(self.store, self.cfg, w, hidden, (slots.cache.slot_of, slots.pool), self.prefill_counts,
                           self.staging)


def make_backend(weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 **constants) -> CpuCachedMoE | GpuMoE:
    """GpuMoE when the weights are on a CUDA device, else CpuCachedMoE."""
    cls = GpuMoE if weights.device.type == "cuda" else CpuCachedMoE
    return cls(weights, num_slots, policy, max_batch=max_batch, **constants)
