"""One MoE decode layer over the shared slot cache, with the shared expert optionally on the side stream.

    hidden [T, H] ──fork──► side stream: shared = sigmoid(x @ gate_wᵀ) * down(silu(gate(x)) * up(x))  ─┐
       │                                                                                              │
       └─► route (router GEMV f32, softmax, top-k, renorm) → ids [T, k] int32, weights [T, k] f32     │
           → cache.ensure(layer, ids) → slots [T, k], plan [Q, 2], count [1]                          │
           → miss_copy(store, pool, plan, count)            (on the compute stream, right behind ensure)
           → routed_experts(hidden, slots, weights, pool gate_up, pool down) → routed [T, H] f32 ──join─► out

    out [T, H] = (routed + shared) cast to hidden's dtype.

Legend: T = tokens (1..GEMV_MAX_TOKENS), H = hidden, E = experts, k = top_k, I / Is = routed / shared
width, S = pool slots. One `SlotCache` per model: every layer shares its HostStore (banks "gate_up"
[L*E, 2I, H] and "down" [L*E, H, I], rows indexed by key = layer * E + expert), SlotPool, DeviceCache
and SideStream.

Overlap off (`OverlapMode.NONE`) launches everything on the current (compute) stream: the routed path,
then the shared expert, then the combine. Overlap on launches the same kernels with the same
arithmetic, the shared expert on the side stream: fork before the router, join before the combine.
Nothing on the compute stream writes `hidden` before the join (the routed path only reads it), and
the shared output made on the side stream is `record_stream`ed onto the compute stream, so the caching
allocator never hands its memory out before the combine has read it. The outputs are therefore
bitwise equal with the flag on and off. `forward` reads nothing back to the host: capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertcache.copy import miss_copy
from expertcache.device import DeviceCache
from expertcache.geometry import CacheGeometry
from expertcache.pool import HostStore, SlotPool
from expertcache.streams import SideStream
from moe.config import MoEConfig
from moe.plan import GEMV_MAX_TOKENS, OverlapMode, make_routed_plan, select_overlap_mode
from moe.reference import SharedWeights, check_shared, route
from moe.routed import routed_experts

BANKS = ("gate_up", "down")  # the HostStore / SlotPool banks a layer reads, in this order
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SlotCache:
    """The cache objects one model shares: host store, slot pool, device cache, side stream.

    store: HostStore with banks "gate_up" [L*E, 2I, H] and "down" [L*E, H, I].
    pool: SlotPool of the same banks. num_layers, num_experts: L, E of the key space.
    policy: eviction policy name (`--moe-cache-policy`); constants: its overrides.
    The side stream is made on first request (`side_stream()`) and kept through `rebuild`.
    Raises ValueError naming the bank whose shape disagrees with (L, E).
    """

    def __init__(self, store: HostStore, pool: SlotPool, num_layers: int, num_experts: int,
                 policy: str = "lru", **constants) -> None:
        names = tuple(b.name for b in store.banks)
        if names != BANKS or store.num_keys != num_layers * num_experts:
            raise ValueError(f"the HostStore must hold banks {BANKS} of {num_layers} * {num_experts} key "
                             f"rows (layers * experts), got banks {names} of {store.num_keys} rows")
        self.store, self.pool = store, pool
        self.num_layers, self.num_experts = num_layers, num_experts
        self.policy, self.constants = policy, constants
        self.cache = self._new_cache()
        self.side: SideStream | None = None

    def _new_cache(self) -> DeviceCache:
        geometry = CacheGeometry(self.num_layers, self.num_experts, self.pool.num_slots)
        return DeviceCache(geometry, self.policy, device=self.pool.device, **self.constants)

    def side_stream(self) -> SideStream:
        """The model's side stream, made on first call (outside any capture). See SideStream."""
        if self.side is None:
            self.side = SideStream(self.pool.device)
        return self.side

    def rebuild(self, num_slots: int) -> None:
        """Re-size the pool to `num_slots` and cold-start the slot map (a new DeviceCache).

        The side stream and its events are kept. Graphs captured before must be captured again:
        they hold the old pool's and cache's memory. Raises PoolError (pool unchanged) when the
        slots do not fit.
        """
        self.pool.rebuild(num_slots)
        self.cache = self._new_cache()

    def close(self) -> None:
        """Destroy the side stream, if one was made."""
        if self.side is not None:
            self.side.close()
            self.side = None


class MoELayer:
    """One MoE block of layer `layer` (0..L-1) reading its routed experts through `slots`.

    router_w: [E, H] (kept as a float32 copy: the router runs in float32, as moe.reference.route).
    shared: (gate_up [2Is, H], down [H, Is], gate_w [1, H]) in the config's dtype, exactly when
    cfg.shared_intermediate > 0. `cfg.copy_overlap` picks the side stream; resolve
    EXPERTCACHE_MOE_COPY_OVERLAP into it (moe.config.copy_overlap_from_env) before building.
    Attributes `overlap_mode` / `overlap_reason` hold the decision of `refresh()`.
    Raises ValueError naming the argument whose shape, dtype or device disagrees with cfg.
    """

    def __init__(self, cfg: MoEConfig, layer: int, router_w: torch.Tensor, slots: SlotCache,
                 shared: SharedWeights | None = None) -> None:
        self.cfg, self.layer, self.slots = cfg, layer, slots
        self.dtype = DTYPES[cfg.dtype]
        self.device = slots.pool.device
        _check_weights(cfg, layer, router_w, shared, slots, self.dtype)
        self.router_w = router_w.to(self.device, torch.float32).contiguous()  # [E, H] f32
        self.shared = None if shared is None else tuple(w.to(self.device).contiguous() for w in shared)
        self._routed_out: dict[int, torch.Tensor] = {}  # T -> [T, H] f32, reused so graphs keep it
        self.side: SideStream | None = None
        self.refresh()

    def refresh(self) -> None:
        """Decide the overlap mode (once per build or rebuild) and fetch the side stream if it applies.

        The decision must hold for every decode size 1..GEMV_MAX_TOKENS; the first size that
        declines gives the reason.
        """
        sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
               if self.device.type == "cuda" else 132)
        for tokens in range(1, GEMV_MAX_TOKENS + 1):
            plan = make_routed_plan(tokens, self.cfg, sms)
            mode, reason = select_overlap_mode(self.cfg, "decode", str(self.device), 1, plan)
            if mode is OverlapMode.NONE:
                break
        self.overlap_mode, self.overlap_reason = mode, reason
        self.side = self.slots.side_stream() if mode is OverlapMode.SIDE_STREAM else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.forward(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (cfg dtype, contiguous, on the pool's device) -> out [T, H] same dtype.

        Launches on the current stream (plus the side stream when overlapping); no host sync.
        Raises ValueError naming `hidden` for a wrong shape, dtype or device, and naming
        --moe-slots when T * top_k exceeds the pool's slots (a call could ask for more distinct
        experts than slots, which ensure refuses).
        """
        self._check_hidden(hidden)
        if self.overlap_mode is OverlapMode.SIDE_STREAM:
            return self._forward_overlap(hidden)
        routed = self.routed(hidden)
        shared = None if self.shared is None else self.shared_expert(hidden)
        return self._combine(routed, shared)

    def _forward_overlap(self, hidden: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        self.side.fork(compute)  # the side stream sees hidden as the compute stream left it
        with torch.cuda.stream(self.side.stream):
            shared = self.shared_expert(hidden)  # [T, H], allocated on the side stream
        shared.record_stream(compute)  # read by the combine below, on the compute stream
        routed = self.routed(hidden)  # router, ensure, miss copy, routed GEMM: back to back
        self.side.join(compute)
        return self._combine(routed, shared)

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed half: hidden [T, H] -> [T, H] float32 (a buffer reused per T). See the module."""
        cfg, slots = self.cfg, self.slots
        weights, ids = route(hidden, self.router_w, cfg.top_k, cfg.norm_topk_prob)  # [T, k] f32 / i32
        buf = slots.cache.ensure(self.layer, ids)  # slots [T, k], plan [Q, 2], count [1]
        miss_copy(slots.store, slots.pool, buf.plan, buf.count)
        tokens = hidden.shape[0]
        if tokens not in self._routed_out:
            self._routed_out[tokens] = torch.empty((tokens, cfg.hidden), dtype=torch.float32,
                                                   device=self.device)
        return routed_experts(hidden, buf.slots, weights, slots.pool.tensor("gate_up"),
                              slots.pool.tensor("down"), out=self._routed_out[tokens])

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sigmoid(x @ gate_wᵀ) * down(silu(gate(x)) * up(x)), [T, H] in x's dtype.

        Matmuls in the weights' dtype with float32 accumulation (cuBLAS / CPU BLAS). Cost
        O(T * (3 * Is + 1) * H).
        """
        gate_up, down, gate_w = self.shared
        inter = down.shape[1]
        gu = x @ gate_up.T  # [T, 2Is]
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [T, Is]
        return torch.sigmoid(x @ gate_w.T) * (act @ down.T)  # [T, 1] * [T, H]

    def _combine(self, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """routed [T, H] f32 (+ shared [T, H]) -> [T, H] in the layer's dtype."""
        out = routed if shared is None else routed + shared  # float32
        return out.to(self.dtype)

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        ok = (isinstance(hidden, torch.Tensor) and hidden.dim() == 2
              and 1 <= hidden.shape[0] <= GEMV_MAX_TOKENS and hidden.shape[1] == self.cfg.hidden)
        if not ok:
            raise ValueError(f"MoELayer: hidden must be [T, {self.cfg.hidden}] with T in 1..{GEMV_MAX_TOKENS} "
                             f"(decode), got {list(getattr(hidden, 'shape', []))}")
        slots = self.slots.pool.num_slots
        if hidden.shape[0] * self.cfg.top_k > slots:
            raise ValueError(f"MoELayer: {hidden.shape[0]} tokens route up to {hidden.shape[0] * self.cfg.top_k} "
                             f"experts per layer but the pool has {slots} slots: raise --moe-slots or "
                             "lower the batch")
        if hidden.dtype != self.dtype or hidden.device != self.device or not hidden.is_contiguous():
            raise ValueError(f"MoELayer: hidden must be contiguous {self.dtype} on {self.device} "
                             f"(MoEConfig.dtype, the pool's device), got {hidden.dtype} on {hidden.device}")


def _check_weights(cfg: MoEConfig, layer: int, router_w: torch.Tensor, shared: SharedWeights | None,
                   slots: SlotCache, dtype: torch.dtype) -> None:
    """Raise ValueError naming the argument that disagrees with cfg or the cache."""
    if not 0 <= layer < slots.num_layers or slots.num_experts != cfg.num_experts:
        raise ValueError(f"MoELayer: layer={layer} must be in [0, {slots.num_layers}) and the SlotCache's "
                         f"num_experts={slots.num_experts} must equal MoEConfig.num_experts={cfg.num_experts}")
    if tuple(router_w.shape) != (cfg.num_experts, cfg.hidden):
        raise ValueError(f"MoELayer: router_w must be [{cfg.num_experts}, {cfg.hidden}], got {list(router_w.shape)}")
    h, i = cfg.hidden, cfg.expert_intermediate
    for bank, shape in zip(BANKS, ((2 * i, h), (h, i))):
        b = slots.store.bank(bank)
        if b.row_shape != shape or b.dtype != dtype:
            raise ValueError(f"MoELayer: bank {bank!r} rows must be {list(shape)} {dtype} (MoEConfig "
                             f"hidden/expert_intermediate/dtype), got {list(b.row_shape)} {b.dtype}")
    check_shared(cfg, shared, "MoELayer", dtype)

