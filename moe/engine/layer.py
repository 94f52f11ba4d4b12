"""One MoE decode layer over the shared slot cache, with the shared expert optionally on the side stream.

    hidden [T, H] ─fork─► side stream (or first, in line): the shared expert as a one-slot routed call
       │     1 _shared_gate_up: act_s [T, Is] = sigmoid(x · gate_w) * silu(gate(x)) * up(x)
       │     2 _shared_down:    shared [T, H] f32 = down(act_s)                                  ─┐
       │                                                                                         │
       └─► 3 _router_kernel: ids [T, k] int32, weights [T, k] f32 (bf16 weights, f32 accumulate)  │
           4 ensure_kernel: slots [T, k], plan [Q, 2], count [1]                                 │
           5 _miss_copy_kernel(store, pool, plan, count)   (compute stream, right behind ensure) │
           6 _gate_up_kernel: act [T * k, I] f32                                                 │
           ─────────────────────────────────────────────────────────────────────────── join ◄───┘
           7 _down_kernel: out [T, H] = cast(Σ_j (in order) down[slots[t, j]] · act + shared)

Legend: T = tokens (1..GEMV_MAX_TOKENS), H = hidden, E = experts, k = top_k, I / Is = routed / shared
width, S = pool slots. Seven launches per layer with a shared expert (five without). One `SlotCache`
per model: every layer shares its HostStore (banks "gate_up" [L*E, 2I, H] and "down" [L*E, H, I],
rows indexed by key = layer * E + expert), SlotPool, DeviceCache and SideStream.
`forward(hidden, routing=(ids, weights))` skips launch 3 and routes as given (forced routing: the
decode benchmark replays a trace's routing through it; the default path is unchanged).

Overlap off (`OverlapMode.NONE`) launches 1..7 in that order on the current (compute) stream. Overlap
on launches the same kernels with the same arguments, 1-2 on the side stream: fork before the router,
join before launch 7, whose addend is the shared output. With MoEConfig.early_hits (the default where
the pool cannot hold every expert) the router
also writes pre (each chosen expert's slot before the ensure, -1 = absent), the side stream forks again
after it and runs 6a `_gate_up_hits` (the resident pairs, at pre), and launch 6 computes only the other
pairs (eight launches); with MoEConfig.hits_first instead, launch 6 is one persistent launch on the
compute stream that computes the resident pairs (at pre) before it waits for the copy, which releases
it at its start, and the others after (seven launches; the side stream runs only the shared expert);
every act row is still written by one program of the same code; the combine (routed + shared in float32, one
rounding to the model dtype) happens inside launch 7. Nothing on the compute stream writes `hidden`
or the shared expert's buffers (per layer: slots, act_s, shared), and every side-stream write lands
before the join, so the outputs, slot map and pool are bitwise equal with the flag on and off. The
layer's buffers are made at construction and reused (one per layer, rows [0, T) used), so a call
allocates only its output; `forward` reads nothing back to the host: capturable.
"""

from __future__ import annotations

import dataclasses

import torch

import moe.kernels.routed
import moe.kernels.router
from expertcache.copy import miss_copy
from expertcache.device import DeviceCache
from expertcache.geometry import CacheGeometry
from expertcache.pool import HostStore, SlotPool
from expertcache.streams import SideStream
from moe.model.config import MoEConfig
from moe.kernels.plan import GEMV_MAX_TOKENS, OverlapMode, make_routed_plan, select_overlap_mode
from moe.model.reference import SharedWeights, check_shared
from moe.kernels.routed import routed_down, routed_experts, routed_gate_up, routed_scratch
from moe.kernels.router import ROUTER_MAX_EXPERTS, router_scratch, router_topk

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


FRONT_RELEASE_PREFETCH = 2  # the routed down's prefetched experts with MoEConfig.front_release (at most k)


class MoELayer:
    """One MoE block of layer `layer` (0..L-1) reading its routed experts through `slots`.

    router_w: [E, H], kept in the config's dtype (the router kernel accumulates in float32).
    shared: (gate_up [2Is, H], down [H, Is], gate_w [1, H]) in the config's dtype, exactly when
    cfg.shared_intermediate > 0. `cfg.copy_overlap` picks the side stream; resolve
    EXPERTCACHE_MOE_COPY_OVERLAP into it (moe.model.config.copy_overlap_from_env) before building.
    Attributes `overlap_mode` / `overlap_reason` hold the decision of `refresh()`.
    Raises ValueError naming the argument whose shape, dtype or device disagrees with cfg.
    """

    def __init__(self, cfg: MoEConfig, layer: int, router_w: torch.Tensor, slots: SlotCache,
                 shared: SharedWeights | None = None) -> None:
        self.cfg, self.layer, self.slots = cfg, layer, slots
        self.dtype = DTYPES[cfg.dtype]
        self.device = slots.pool.device
        _check_weights(cfg, layer, router_w, shared, slots, self.dtype)
        self.router_w = router_w.to(self.device, self.dtype).contiguous()  # [E, H] model dtype
        self.shared = None if shared is None else tuple(w.to(self.device).contiguous() for w in shared)
        self._make_buffers()
        self.side: SideStream | None = None
        self.refresh()

    def _make_buffers(self) -> None:
        """Per-layer buffers of GEMV_MAX_TOKENS rows (rows [0, T) used), made once outside any capture."""
        cfg, n, dev = self.cfg, GEMV_MAX_TOKENS, self.device
        self._weights = torch.empty((n, cfg.top_k), dtype=torch.float32, device=dev)  # router out
        self._ids = torch.empty((n, cfg.top_k), dtype=torch.int32, device=dev)
        self._pre = torch.empty((n, cfg.top_k), dtype=torch.int32, device=dev)  # early hits: slots before ensure
        self._routed_out = torch.empty((n, cfg.hidden), dtype=torch.float32, device=dev)  # routed() only
        router_scratch(dev, cfg.num_experts)
        routed_scratch(dev, cfg.top_k, cfg.expert_intermediate)
        if self.shared is not None:  # the shared expert as a one-slot pool, written only by its launches
            gate_up, down, _ = self.shared
            self._shared_pool = (gate_up[None], down[None])  # [1, 2Is, H], [1, H, Is]
            self._shared_slots = torch.zeros((n, 1), dtype=torch.int32, device=dev)
            self._shared_act = torch.empty((n, cfg.shared_intermediate), dtype=torch.float32, device=dev)
            self._shared_out = torch.empty((n, cfg.hidden), dtype=torch.float32, device=dev)

    def refresh(self) -> None:
        """Decide the overlap mode (once per build or rebuild) and fetch the side stream if it applies;
        resolve MoEConfig.early_hits and front_release for the pool as it is now (`early_hits`,
        `front_release`).

        The decision must hold for every decode size 1..GEMV_MAX_TOKENS; the first size that
        declines gives the reason.
        """
        cfg = self.cfg
        keys = self.slots.num_layers * self.slots.num_experts
        # None: early hits unless the pool holds every expert (nothing is ever copied once it is full)
        self.early_hits = cfg.early_hits if cfg.early_hits is not None else self.slots.pool.num_slots < keys
        run = dataclasses.replace(cfg, early_hits=self.early_hits)
        sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
               if self.device.type == "cuda" else 132)
        for tokens in range(1, GEMV_MAX_TOKENS + 1):
            plan = make_routed_plan(tokens, run, sms)
            mode, reason = select_overlap_mode(run, "decode", str(self.device), 1, plan)
            if mode is OverlapMode.NONE:
                break
        self.overlap_mode, self.overlap_reason = mode, reason
        self.side = self.slots.side_stream() if mode is OverlapMode.SIDE_STREAM else None
        runs_early = mode is OverlapMode.SIDE_STREAM and self.early_hits and not cfg.hits_first
        self.front_release = cfg.front_release if cfg.front_release is not None else not runs_early
        self._configs = None  # _launch_configs' last (module defaults, result)

    def _launch_configs(self) -> tuple[moe.kernels.router.RouterConfig, moe.kernels.routed.RoutedConfig]:
        """The router's and the routed down's configs: the module defaults (read at each call), with
        front_release the router's weights loaded before its wait (where they fit, unless the default
        already says True), the down releasing the next launch and, unless RoutedConfig.down_prefetch
        is set, prefetching FRONT_RELEASE_PREFETCH experts' tiles instead of min(4, k): with the next
        router's programs launched beside it, 2 made one more resident layer 0.4-0.6 us faster than 4
        with the overlap on and off (docs/moe.md); and, unless RoutedConfig.copy_release is set, the
        miss copy releasing the gate_up after its wait (copy_release=True)."""
        defaults = (moe.kernels.router.DEFAULT_ROUTER, moe.kernels.routed.DEFAULT_CONFIG)
        if not self.front_release:
            return defaults
        if self._configs is None or any(a is not b for a, b in zip(self._configs[0], defaults)):
            router, routed = defaults  # derived once per pair of module defaults, not per call
            if router.early_weights is False:
                router = dataclasses.replace(router, early_weights=None)
            prefetch = routed.down_prefetch
            if prefetch is None:  # beside the next router's programs, two experts' tiles before the wait
                prefetch = min(FRONT_RELEASE_PREFETCH, self.cfg.top_k)
            release = True if routed.copy_release is None else routed.copy_release
            self._configs = (defaults, (router, dataclasses.replace(routed, down_release=True, down_prefetch=prefetch,
                                                                    copy_release=release)))
        return self._configs[1]

    def copy_release(self) -> bool:
        """Whether the miss copy lets the routed gate_up launch right after the copy's own wait: the
        resolved RoutedConfig.copy_release of _launch_configs (None there: off without front_release;
        with MoEConfig.hits_first the copy releases it at once instead)."""
        return bool(self._launch_configs()[1].copy_release)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.forward(hidden)

    def forward(self, hidden: torch.Tensor,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden [T, H] (cfg dtype, contiguous, on the pool's device) -> out [T, H] same dtype (new).

        Seven launches (five without a shared expert) on the current stream; when overlapping,
        eight, three of them on the side stream (seven, two there, with MoEConfig.early_hits off or
        MoEConfig.hits_first on); no host sync. Raises ValueError naming `hidden` for a wrong
        shape, dtype or device, and naming --moe-slots when T * top_k exceeds the pool's slots (a
        call could ask for more distinct experts than slots, which ensure refuses).

        routing: forced routing (benchmarks that replay a recorded trace): (ids [T, k] int32 expert
        ids in [0, E) or -1, weights [T, k] float32), contiguous on the pool's device. The router
        launch is skipped and ensure / the routed GEMM read these tensors as they are when the
        launches run, so static buffers refilled before each CUDA-graph replay stay capturable.
        `last_routing` is not written then (it keeps the router's last output). None (default):
        the router decides. Raises ValueError naming `routing` for a wrong shape, dtype or device.
        """
        self._check_hidden(hidden)
        if routing is not None:
            self._check_routing(routing, hidden.shape[0])
        out = torch.empty(hidden.shape, dtype=self.dtype, device=self.device)
        side = self.side if self.overlap_mode is OverlapMode.SIDE_STREAM else None
        if side is not None and self.shared is None and routing is not None:
            side = None  # no shared expert, and no router launch to start early hits from: nothing to overlap
        compute = torch.cuda.current_stream(self.device) if side is not None else None
        shared = None
        if self.shared is not None and side is not None:
            side.fork(compute)  # the side stream sees hidden as the compute stream left it
            with torch.cuda.stream(side.stream):
                shared = self.shared_expert(hidden)  # [T, H] f32, a buffer of this layer
        elif self.shared is not None:
            shared = self.shared_expert(hidden)
        early = (side, compute) if (side is not None and routing is None and self.early_hits
                                    and not self.cfg.hits_first) else None
        act, slots = self._routed_front(hidden, routing, early)
        if side is not None:
            side.join(compute)  # the down launch below reads `shared`
        routed_down(act, slots, self.slots.pool.tensor("down"), addend=shared, out_cast=out, after_gate_up=True,
                    config=self._launch_configs()[1])
        return out

    def _routed_front(self, hidden: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                      early: tuple[SideStream, torch.cuda.Stream] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Launches 3-6: hidden [T, H] -> (act [T * k, I] f32, slots [T, k] int32) for routed_down:
        router, ensure, miss copy and gate_up back to back. With `routing` (ids, weights) given, the
        router is skipped.

        early = (side, compute), the overlap with early hits (not with `routing`): the router also
        records each chosen expert's slot before the ensure (pre; -1 = not resident); the side stream
        forks again right after it and computes the gate_up rows of the resident pairs from pre,
        while the compute stream runs ensure, miss copy and the gate_up rows of the others. A
        resident expert keeps its slot through its ensure and the copy writes only victims' slots,
        so both halves read what the single gate_up would: the same act bits.

        MoEConfig.hits_first (not with `routing`): the router writes pre too, the miss copy releases
        the next launch at its start, and gate_up is one persistent part="first" launch on this
        stream: the resident pairs at pre while the ensure and copy run, the others after the copy
        (the same act bits)."""
        cfg, slots, tokens = self.cfg, self.slots, hidden.shape[0]
        pdl = cfg.pdl_chain  # programmatic launches for the router, ensure and copy (CUDA only)
        gate_up = slots.pool.tensor("gate_up")
        first = cfg.hits_first and routing is None
        pre = self._pre[:tokens] if early is not None or first else None
        if routing is None:
            weights, ids = router_topk(hidden, self.router_w, cfg.top_k, cfg.norm_topk_prob,
                                       weights=self._weights[:tokens], ids=self._ids[:tokens], pdl=pdl,
                                       config=self._launch_configs()[0],
                                       pre=None if pre is None else (slots.cache.slot_of,
                                                                     self.layer * cfg.num_experts, pre))
        else:
            ids, weights = routing
        if early is not None:
            side, compute = early
            side.fork(compute)  # the side stream sees weights and pre
            with torch.cuda.stream(side.stream):
                routed_gate_up(hidden, pre, weights, gate_up, part="hits", pre=pre)
        buf = slots.cache.ensure(self.layer, ids, pdl=pdl)  # slots [T, k], plan [Q, 2], count [1]
        miss_copy(slots.store, slots.pool, buf.plan, buf.count, pdl=pdl, release_next=pdl and first,
                  release_after_wait=pdl and not first and self.copy_release())
        part = "first" if first else "all" if pre is None else "rest"
        act = routed_gate_up(hidden, buf.slots, weights, gate_up, part=part, pre=pre)
        return act, buf.slots

    def last_routing(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int32) that the last forward / routed call of T tokens
        routed with: views of this layer's buffers, valid until its next call (read them after it,
        on its stream). Raises ValueError naming `tokens` outside 1..GEMV_MAX_TOKENS."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= GEMV_MAX_TOKENS:
            raise ValueError(f"MoELayer.last_routing: tokens must be an int in 1..{GEMV_MAX_TOKENS}, got {tokens!r}")
        return self._weights[:tokens], self._ids[:tokens]

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed half alone: hidden [T, H] -> [T, H] float32 (a buffer of this layer, reused)."""
        act, slots = self._routed_front(hidden)
        return routed_down(act, slots, self.slots.pool.tensor("down"), out=self._routed_out[:hidden.shape[0]],
                           after_gate_up=True, config=self._launch_configs()[1])

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sigmoid(x · gate_w) * down(silu(gate(x)) * up(x)), [T, H] float32.

        Two launches (moe.routed_experts over the one-slot pool, gate computed inside the first);
        float32 accumulation. Returns a buffer of this layer, overwritten by the next call. Cost
        O(T * (3 * Is + 1) * H).
        """
        gate_up, down = self._shared_pool
        tokens = x.shape[0]
        return routed_experts(x, self._shared_slots[:tokens], None, gate_up, down, gate_w=self.shared[2],
                              out=self._shared_out[:tokens], act=self._shared_act)

    def _check_routing(self, routing, tokens: int) -> None:
        _check_routing_pair(routing, tokens, self.cfg.top_k, self.device)

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


def _check_routing_pair(routing, tokens: int, top_k: int, device: torch.device) -> None:
    """Raise ValueError naming `routing` unless it is (ids int32 [T, k], weights float32 [T, k]),
    both contiguous on `device`."""
    ok = isinstance(routing, tuple) and len(routing) == 2
    for t, dtype in zip(routing if ok else (), (torch.int32, torch.float32)):
        ok = ok and isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == (tokens, top_k)
        ok = ok and t.device == device and t.is_contiguous()
    if not ok:
        got = [f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
               for t in (routing if isinstance(routing, tuple) else (routing,))]
        raise ValueError(f"MoELayer: routing must be (ids int32 [{tokens}, {top_k}], weights float32 "
                         f"[{tokens}, {top_k}]), contiguous on {device}, got {got}")


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
    if cfg.num_experts > ROUTER_MAX_EXPERTS:
        raise ValueError(f"MoELayer: MoEConfig.num_experts={cfg.num_experts} exceeds the router kernel's "
                         f"ROUTER_MAX_EXPERTS={ROUTER_MAX_EXPERTS}")
    check_shared(cfg, shared, "MoELayer", dtype)

