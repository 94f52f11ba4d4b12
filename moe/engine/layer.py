"""One MoE decode layer over the shared slot cache, launched from one resolved LaunchPlan.

    hidden [T, H]
       ├─ 1 _shared_gate_up: act_s [T, Is] = sigmoid(x · gate_w) * silu(gate(x)) * up(x)   (shared expert,
       │  2 _shared_down:    shared [T, H] f32 = down(act_s)                                 a one-slot pool)
       ├─ 3 _router_kernel:  ids [T, k] int32, weights [T, k] f32 (+ pre [T, k]: slots before the ensure)
       │  6a _gate_up_hits:  act rows of the pairs resident before the ensure, at pre     (early hits)
       ├─ 4 ensure_kernel:   slots [T, k], plan [Q, 2], count [1]
       │  4b _post_kernel (a miss split): the positions served on the CPU -> a CPU worker (moe.engine.handoff);
       │     with a tail, the first served expert's positions -> the scratch slot, (key, scratch, cut) -> tail
       │  5 _miss_copy_kernel(store, pool, plan, count[, tail]): with a tail, its rows [cut, I) -> the scratch slot
       │  6 _gate_up_kernel: act [T * k, I] f32 (with 6a: only the other pairs, "rest")
       │  6b _zero_tail_kernel (a miss split with a tail): the scratch positions' act rows [0, cut) zeroed
       ├─ 7 _down_kernel:    out [T, H] = cast(Σ_j (in order) down[slots[t, j]] · act + shared)
       │                     (a miss split: routed [T, H] f32 = the sum alone, no shared, no cast)
       └─ 7b _wait_kernel (a miss split): once the worker has answered,
                             out [T, H] = cast(routed + (the CPU's share + shared))

GLM-4.5's block (MoEConfig.scoring "sigmoid", score_bias, n_group / topk_group, routed_scaling,
shared_gate False) runs the same launches: 3 takes its sigmoid, grouped choice and scaling, 1 and 2 compute the shared
expert without a gate (weights of one). gpt-oss's block (MoEConfig.router_bias, expert_bias, activation
"swiglu_clamped") runs the same launches: 3 adds the router bias, 6 / 6a add each slot's gate_up bias and take the
clamped SwiGLU, 7 adds Σ_j weights[t, j] * down bias (the bias banks are pool banks: a miss copies them with the
expert).

Under LaunchPlan.routed_mma (EXPERTCACHE_ROUTED_MMA=1) the routed experts run the tensor-core kernels
(moe.kernels.routed_mma): 6 is their gate_up (its act in their layout), 7 their down and a combine
launch that adds shared and casts; the plan then has no early hits and no miss split, and 6 and 7 are
plain launches.

Legend: T = tokens (1..GEMV_MAX_TOKENS), H = hidden, E = experts, k = top_k, I / Is = routed / shared
width, S = pool slots. One `SlotCache` per model: every layer shares its HostStore (the banks of
MoEConfig.expert_format, expertcache.formats: "gate_up" [L*E, 2I, H] and "down" [L*E, H, I] for bf16,
"gate_up.q", "gate_up.s", ... for a quantized format; rows indexed by key = layer * E + expert),
SlotPool, DeviceCache and SideStream. The routed launches read the pool's banks as SlotMatrix
(moe.model.slot_matrix) and dequantize a quantized slot in registers; the miss copy moves every
bank of a missing expert in its one launch; the ensure does not know the format.

Which stream runs what, by LaunchPlan.mode (moe.kernels.plan.resolve_launch_plan picks it):

    INLINE                   compute: 1 2 3 4 5 6 7            (5 launches without a shared expert)
    SHARED_ON_SIDE           side:    fork─1 2─┐               (the pool holds every expert)
                             compute: 3 4 5 6 ─join─ 7
    SHARED_AND_HITS_ON_SIDE  side:    fork─1 2 ──── fork─6a─┐  (the pool cannot hold every expert)
                             compute: 3 ─────────── 4 5 6 ──join─ 7
    HITS_ON_SIDE             as above without 1 2           (no shared expert)

A miss split (LaunchPlan.cpu_share) adds to the compute stream, in every mode, 4b after 4, 6b after 6
(with a tail) and 7b after 7: the join comes before 7, so 7b reads the shared expert's finished output,
and the down of the copied and resident experts runs while the CPU computes its share.

On CUDA every launch of the compute chain is a programmatic dependent launch (LaunchPlan.pdl for 3,
4, 4b, 5; always for 6, 6b, 7 and 7b): each waits for its predecessor before it reads anything it
wrote, and lets its successor be scheduled at a point the plan names. 3, 4, 4b, 6 and 6b release their
successor right after their own wait; 5 and 7 at their end, or with LaunchPlan.front_release right after
their wait (7 then releases the next layer's 3; with a miss split 7b runs between them: it spins on the
CPU's answer while 7 runs, waits for 7 before reading its sum, and that 3 follows 7b's end), and that 3
then loads its weights
before its own wait (LaunchPlan.router_early_weights). 7 loads its slots and the first
LaunchPlan.down_prefetch experts' tiles before its wait. The side launches (1, 2, 6a) are plain:
they follow events (fork: before 3, and after 3 for 6a; join: before 7). The resolver turns the
releases off beside the early hits, whose SMs waiting programs would hold through a copy.

Every act row is written by one program of the same code in every mode (and a scratch position's rows
below its cut zeroed by 6b after it); the combine (routed + shared in float32, one rounding to the
model dtype) happens inside 7, or with a miss split inside 7b: routed + (the CPU's share + shared), in
the order 7 adds shared to its routed sum. Nothing on the compute stream
writes `hidden` or the shared expert's buffers (per layer: slots, act_s, shared), a resident expert
keeps its slot through its ensure while the copy writes only victims' slots (and the scratch slot,
which the cache never assigns), and every side-stream
write lands before the join, so outputs, slot map and pool are bitwise equal in every mode and with
every release on or off. `forward(hidden, routing=(ids, weights))` skips 3 (and so 6a) and routes as
given (forced routing: the decode benchmark replays a trace's routing through it). The layer's
buffers are made at construction and reused (one per layer, rows [0, T) used), so a call allocates
only its output; `forward` reads nothing back to the host: capturable.
"""

from __future__ import annotations

import torch

from expertcache.copy import miss_copy
from expertcache.device.cache import DeviceCache
from expertcache.geometry import CacheGeometry
from expertcache.pool import HostStore, SlotPool
from expertcache.split import MissSplit
from expertcache.streams import SideStream
from moe.engine.handoff import CpuShare
from moe.kernels.cpu_experts import CpuExperts
from moe.kernels.plan import GEMV_MAX_TOKENS, LaunchPlan, resolve_launch_plan
from moe.kernels.routed import device_sms, routed_down, routed_experts, routed_gate_up
from moe.kernels.routed_host import routed_scratch
from moe.kernels.routed_mma import MmaAct, mma_down, mma_gate_up, mma_scratch
from moe.kernels.router import ROUTER_MAX_EXPERTS, router_scratch, router_topk
from moe.model.config import EXPERT_BIAS_BANKS, MoEConfig, routed_mma_from_env
from moe.model.reference import SharedWeights, check_shared
from moe.model.slot_matrix import SlotMatrix

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SlotCache:
    """The cache objects one model shares: host store, slot pool, device cache, side stream.

    store: HostStore of the experts' banks (an expert format's `expert_banks`), L*E key rows each.
    pool: SlotPool of the same banks. num_layers, num_experts: L, E of the key space.
    policy: eviction policy name (`--moe-cache-policy`); constants: its overrides.
    The side stream is made on first request (`side_stream()`) and kept through `rebuild`.
    With a split that has a tail (MissSplit.tail), the pool's last slot is the scratch slot that a split
    expert's rows [cut, I) are copied into (`scratch`; zeroed at start, never assigned by the cache, which
    holds the pool's other slots); otherwise `scratch` is None.
    Raises ValueError when the store's rows are not L * E or the pool's banks are not the store's.
    """

    def __init__(self, store: HostStore, pool: SlotPool, num_layers: int, num_experts: int,
                 policy: str = "lru", split: MissSplit | None = None, cfg: MoEConfig | None = None,
                 **constants) -> None:
        if store.num_keys != num_layers * num_experts or store.banks != pool.banks:
            raise ValueError(f"the HostStore must hold {num_layers} * {num_experts} key rows (layers * experts) "
                             f"of the SlotPool's banks, got {store.num_keys} rows of "
                             f"{[b.name for b in store.banks]} for a pool of {[b.name for b in pool.banks]}")
        self.store, self.pool = store, pool
        self.num_layers, self.num_experts = num_layers, num_experts
        self.policy, self.constants = policy, constants
        self.split = MissSplit.copy() if split is None else split
        self.scratch: int | None = None
        if self.split.tail:
            if pool.num_slots < 2:
                raise ValueError(f"SlotCache: a split with a tail needs a scratch slot beside the cache's, got a pool "
                                 f"of {pool.num_slots}")
            self.scratch = pool.num_slots - 1
            self.pool.zero_slot(self.scratch)  # its rows below a cut are read (times a zeroed act) first
        self.cache = self._new_cache()
        self.side: SideStream | None = None
        self.share: CpuShare | None = None  # the CPU's share of the misses, with a split on a CUDA device
        if not self.split.copies_all:
            if cfg is None or pool.device.type != "cuda":
                raise ValueError("SlotCache: a miss split needs the MoEConfig (cfg) and a CUDA pool")
            self.share = CpuShare(CpuExperts(store, cfg), pool.device, self.split,
                                  -1 if self.scratch is None else self.scratch)

    @property
    def extra_slots(self) -> int:
        """Pool slots beyond the cache's: 1 for the scratch slot of a split with a tail, else 0."""
        return 0 if self.scratch is None else 1

    def _new_cache(self) -> DeviceCache:
        geometry = CacheGeometry(self.num_layers, self.num_experts, self.pool.num_slots - self.extra_slots)
        return DeviceCache(geometry, self.policy, device=self.pool.device, split=self.split, **self.constants)

    def side_stream(self) -> SideStream:
        """The model's side stream, made on first call (outside any capture). See SideStream."""
        if self.side is None:
            self.side = SideStream(self.pool.device)
        return self.side

    def rebuild(self, num_slots: int) -> None:
        """Re-size the cache to `num_slots` (the pool to that plus `extra_slots`) and cold-start the slot
        map (a new DeviceCache).

        The side stream and its events are kept. Graphs captured before must be captured again:
        they hold the old pool's and cache's memory. Raises PoolError (pool unchanged) when the
        slots do not fit.
        """
        self.pool.rebuild(num_slots + self.extra_slots)
        if self.scratch is not None:
            self.scratch = self.pool.num_slots - 1
            self.pool.zero_slot(self.scratch)  # its rows below a cut are read (times a zeroed act) first
            self.share.scratch = self.scratch
            self.share.tail[1] = self.scratch
        self.cache = self._new_cache()

    def close(self) -> None:
        """Destroy the side stream, if one was made, and stop the CPU share's worker; the layers over
        this cache then refuse to launch (CpuShare raises RuntimeError) rather than compute without it."""
        if self.side is not None:
            self.side.close()
            self.side = None
        if self.share is not None:
            self.share.close()


class MoELayer:
    """One MoE block of layer `layer` (0..L-1) reading its routed experts through `slots`.

    router_w: [E, H], kept in the config's dtype (the router kernel accumulates in float32).
    shared: (gate_up [2Is, H], down [H, Is], gate_w [1, H]) in the config's dtype, exactly when
    cfg.shared_intermediate > 0; gate_up and down may be one-slot SlotMatrix in a quantized format. `cfg.copy_overlap`
    is the user's side-stream choice; resolve EXPERTCACHE_MOE_COPY_OVERLAP into it
    (moe.model.config.copy_overlap_from_env) before building.
    plan: None (the product) resolves the LaunchPlan from the config, the pool and the device at
    each build and rebuild (`refresh`); a LaunchPlan (tests, benchmarks) is used as given and kept.
    Attribute `plan` holds the plan every call launches from.
    Raises ValueError naming the argument whose shape, dtype or device disagrees with cfg, the
    plan field the layer cannot launch (a side stream on a CPU device, a shared expert it lacks).
    router_b: [E], exactly when cfg.router_bias (gpt-oss's router bias). score_bias: [E] float32, exactly
    when cfg.score_bias (GLM-4.5's e_score_correction_bias; the router then takes cfg's sigmoid scoring,
    groups and scaling). With cfg.expert_bias the
    pool's EXPERT_BIAS_BANKS hold each slot's biases (a miss copies them with the expert) and the routed
    launches add them; cfg.activation picks the experts' activation (gpt-oss's clamped SwiGLU).
    """

    def __init__(self, cfg: MoEConfig, layer: int, router_w: torch.Tensor, slots: SlotCache,
                 shared: SharedWeights | None = None, plan: LaunchPlan | None = None,
                 router_b: torch.Tensor | None = None, score_bias: torch.Tensor | None = None) -> None:
        self.cfg, self.layer, self.slots = cfg, layer, slots
        self.dtype = DTYPES[cfg.dtype]
        self.device = slots.pool.device
        _check_weights(cfg, layer, router_w, shared, slots, self.dtype, router_b, score_bias)
        self.router_w = router_w.to(self.device, self.dtype).contiguous()  # [E, H] model dtype
        self.router_b = None if router_b is None else router_b.to(self.device, self.dtype).contiguous()  # [E]
        self.score_bias = (None if score_bias is None  # [E] float32, GLM-4.5's e_score_correction_bias
                           else score_bias.to(self.device, torch.float32).contiguous())
        self.shared = None if shared is None else tuple(
            w if w is None else w.to(self.device) if isinstance(w, SlotMatrix) else w.to(self.device).contiguous()
            for w in shared)
        self._matrices: tuple[SlotMatrix, SlotMatrix] | None = None
        self._make_buffers()
        self._given_plan = plan
        self.side: SideStream | None = None
        self.refresh()

    def _make_buffers(self) -> None:
        """Per-layer buffers of GEMV_MAX_TOKENS rows (rows [0, T) used), made once outside any capture."""
        cfg, n, dev = self.cfg, GEMV_MAX_TOKENS, self.device
        self._weights = torch.empty((n, cfg.top_k), dtype=torch.float32, device=dev)  # router out
        self._ids = torch.empty((n, cfg.top_k), dtype=torch.int32, device=dev)
        self._pre = torch.empty((n, cfg.top_k), dtype=torch.int32, device=dev)  # early hits: slots before ensure
        self._routed_out = torch.empty((n, cfg.hidden), dtype=torch.float32, device=dev)  # routed() only
        self._routed_sum = (torch.empty((n, cfg.hidden), dtype=torch.float32, device=dev)  # a miss split's down
                            if self.slots.share is not None else None)
        router_scratch(dev, cfg.num_experts)
        routed_scratch(dev, cfg.top_k, cfg.expert_intermediate)
        if self.shared is not None:  # the shared expert as a one-slot pool, written only by its launches
            gate_up, down, _ = self.shared  # tensors, or one-slot SlotMatrix in a checkpoint's format
            self._shared_pool = tuple(w if isinstance(w, SlotMatrix) else SlotMatrix.dense(w[None], stack)
                                      for w, stack in ((gate_up, 2), (down, 1)))
            self._shared_slots = torch.zeros((n, 1), dtype=torch.int32, device=dev)
            self._shared_ones = torch.ones((n, 1), dtype=torch.float32, device=dev)  # an ungated one's weights
            self._shared_act = torch.empty((n, cfg.shared_intermediate), dtype=torch.float32, device=dev)
            self._shared_out = torch.empty((n, cfg.hidden), dtype=torch.float32, device=dev)

    def refresh(self) -> None:
        """Resolve the launch plan for the pool as it is now (once per build or rebuild; a plan given
        at construction is kept) and fetch the side stream if the plan uses it."""
        plan = self._given_plan
        if plan is None:
            slots = self.slots
            plan = resolve_launch_plan(self.cfg, num_slots=slots.cache.geometry.num_slots,
                                       num_keys=slots.num_layers * slots.num_experts, device=str(self.device),
                                       num_sms=device_sms(self.device), copy_overlap=self.cfg.copy_overlap,
                                       miss_service=slots.split.service, routed_mma=routed_mma_from_env())
        _check_plan(plan, self.cfg, self.device, self.slots)
        if plan.routed_mma is not None:  # its scratch made outside any capture
            mma_scratch(self.device, self.cfg.top_k, self.cfg.hidden, self.cfg.expert_intermediate)
        self.plan = plan
        self.side = self.slots.side_stream() if plan.mode.side_stream else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.forward(hidden)

    def forward(self, hidden: torch.Tensor,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """hidden [T, H] (cfg dtype, contiguous, on the pool's device) -> out [T, H] same dtype (new).

        The launches of the plan's mode (module docstring): seven with a shared expert, five without,
        one more (the early hits) where the mode runs them on the side stream, and a miss split's 4b, 7b
        (and 6b with a tail); no host sync. Raises
        ValueError naming `hidden` for a wrong shape, dtype or device, and naming --moe-slots when
        T * top_k exceeds the pool's slots (a call could ask for more distinct experts than slots,
        which ensure refuses).

        routing: forced routing (benchmarks that replay a recorded trace): (ids [T, k] int32 expert
        ids in [0, E) or -1, weights [T, k] float32), contiguous on the pool's device. The router
        launch is skipped (and with it the early hits, which start from its output), and ensure / the
        routed GEMM read these tensors as they are when the launches run, so static buffers refilled
        before each CUDA-graph replay stay capturable. `last_routing` is not written then (it keeps
        the router's last output). None (default): the router decides. Raises ValueError naming
        `routing` for a wrong shape, dtype or device.
        """
        self._check_hidden(hidden)
        if routing is not None:
            self._check_routing(routing, hidden.shape[0])
        out = torch.empty(hidden.shape, dtype=self.dtype, device=self.device)
        mode, side = self.plan.mode, self.side
        shared_side = side is not None and mode.shared_on_side
        hits_side = side is not None and mode.hits_on_side and routing is None
        compute = torch.cuda.current_stream(self.device) if shared_side or hits_side else None
        shared = None
        if shared_side:
            side.fork(compute)  # the side stream sees hidden as the compute stream left it
            with torch.cuda.stream(side.stream):
                shared = self.shared_expert(hidden)  # [T, H] f32, a buffer of this layer
        elif self.shared is not None:
            shared = self.shared_expert(hidden)
        act, slots, weights = self._routed_front(hidden, routing, (side, compute) if hits_side else None)
        if compute is not None:
            side.join(compute)  # the launches below read `shared` and the early hits' rows
        if self.plan.cpu_share:  # the routed down first, then the wait adds the CPU's share and the shared expert's
            share = self.slots.share
            share.zero_tail(act, slots, pdl=True)
            routed = self._down(act, slots, weights, out=self._routed_sum[:hidden.shape[0]])
            share.wait(shared, out, routed=routed, pdl=True)
        else:
            self._down(act, slots, weights, addend=shared, out_cast=out)
        return out

    def pool_matrices(self) -> tuple[SlotMatrix, SlotMatrix]:
        """(gate_up [S, 2I, H] of 2 stacked matrices, down [S, H, I]) of the pool in the config's format,
        remade when the pool was rebuilt (cheap: no device work)."""
        pool, cfg = self.slots.pool, self.cfg
        first = pool.tensor(pool.banks[0].name)
        if self._matrices is None or self._matrices[0].parts[0] is not first:
            h, i = cfg.hidden, cfg.expert_intermediate
            self._matrices = (SlotMatrix.of_pool(pool, cfg.format, "gate_up", 2 * i, h, 2),
                              SlotMatrix.of_pool(pool, cfg.format, "down", h, i))
        return self._matrices

    def _biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up [S, 2I], down [S, H]) bias banks of the pool as it is now, or (None, None) for a
        block without expert biases."""
        if not self.cfg.expert_bias:
            return None, None
        pool = self.slots.pool
        return pool.tensor(EXPERT_BIAS_BANKS[0]), pool.tensor(EXPERT_BIAS_BANKS[1])

    def _down(self, act: torch.Tensor | MmaAct, slots: torch.Tensor, weights: torch.Tensor, **outs) -> torch.Tensor:
        """Launch 7: the routed down right behind the gate_up, with the plan's release and prefetch
        (and the slots' down biases, weighted as the gate_up weighted act, where the block has them);
        under the plan's routed_mma, the tensor-core down and combine."""
        plan, down_bias = self.plan, self._biases()[1]
        if plan.routed_mma is not None:
            return mma_down(act, slots, self.pool_matrices()[1], tiles=plan.routed_mma, down_bias=down_bias,
                            weights=None if down_bias is None else weights, **outs)
        return routed_down(act, slots, self.pool_matrices()[1], after_gate_up=True, tiles=plan.routed_tiles,
                           release=plan.front_release, prefetch=plan.down_prefetch, down_bias=down_bias,
                           weights=None if down_bias is None else weights, **outs)

    def _routed_front(self, hidden: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                      early: tuple[SideStream, torch.cuda.Stream] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launches 3-6: hidden [T, H] -> (act [T * k, I] f32, slots [T, k] int32, weights [T, k] f32) for the down:
        router, ensure, miss copy and gate_up back to back. With `routing` (ids, weights) given, the
        router is skipped.

        early = (side, compute), the early hits (not with `routing`): the router also records each
        chosen expert's slot before the ensure (pre; -1 = not resident); the side stream forks again
        right after it and computes the gate_up rows of the resident pairs from pre, while the compute
        stream runs ensure, miss copy and the gate_up rows of the others. A resident expert keeps its
        slot through its ensure and the copy writes only victims' slots, so both halves read what the
        single gate_up would: the same act bits."""
        cfg, slots, plan, tokens = self.cfg, self.slots, self.plan, hidden.shape[0]
        gate_up, gate_up_bias = self.pool_matrices()[0], self._biases()[0]
        pre = self._pre[:tokens] if early is not None else None
        if routing is None:
            weights, ids = router_topk(hidden, self.router_w, cfg.top_k, cfg.norm_topk_prob, router_b=self.router_b,
                                       scoring=cfg.scoring, score_bias=self.score_bias, n_group=cfg.n_group,
                                       topk_group=cfg.topk_group, scaling=cfg.routed_scaling,
                                       weights=self._weights[:tokens], ids=self._ids[:tokens], pdl=plan.pdl,
                                       tiles=plan.router_tiles, early_weights=plan.router_early_weights[tokens - 1],
                                       pre=None if pre is None else (slots.cache.slot_of,
                                                                     self.layer * cfg.num_experts, pre))
        else:
            ids, weights = routing
        if early is not None:
            side, compute = early
            side.fork(compute)  # the side stream sees weights and pre
            with torch.cuda.stream(side.stream):
                routed_gate_up(hidden, pre, weights, gate_up, part="hits", pre=pre, tiles=plan.routed_tiles,
                               programs=plan.hits_programs, cfg=cfg, gate_up_bias=gate_up_bias)
        buf = slots.cache.ensure(self.layer, ids, pdl=plan.pdl)  # slots [T, k], plan [Q, 2], count [1]
        if plan.cpu_share:  # the served misses go to the CPU while the link copies the others
            slots.share.post(self.layer, hidden, ids, buf.slots, weights, count=buf.count, pdl=plan.pdl)
        tail = None if slots.scratch is None else (slots.share.tail, cfg.expert_intermediate)
        miss_copy(slots.store, slots.pool, buf.plan, buf.count, pdl=plan.pdl, release_after_wait=plan.front_release,
                  tail=tail)
        if plan.routed_mma is not None:  # no early hits under the plan's routed_mma
            return (mma_gate_up(hidden, buf.slots, weights, gate_up, tiles=plan.routed_mma, cfg=cfg,
                                gate_up_bias=gate_up_bias), buf.slots, weights)
        act = routed_gate_up(hidden, buf.slots, weights, gate_up, part="all" if pre is None else "rest", pre=pre,
                             tiles=plan.routed_tiles, cfg=cfg, gate_up_bias=gate_up_bias)
        return act, buf.slots, weights

    def last_routing(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int32) that the last forward / routed call of T tokens
        routed with: views of this layer's buffers, valid until its next call (read them after it,
        on its stream). Raises ValueError naming `tokens` outside 1..GEMV_MAX_TOKENS."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= GEMV_MAX_TOKENS:
            raise ValueError(f"MoELayer.last_routing: tokens must be an int in 1..{GEMV_MAX_TOKENS}, got {tokens!r}")
        return self._weights[:tokens], self._ids[:tokens]

    def routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed half alone: hidden [T, H] -> [T, H] float32 (a buffer of this layer, reused)."""
        act, slots, weights = self._routed_front(hidden)
        if self.plan.cpu_share:
            self.slots.share.zero_tail(act, slots, pdl=True)
        y = self._down(act, slots, weights, out=self._routed_out[:hidden.shape[0]])
        return self.slots.share.wait(None, y, routed=y, pdl=True) if self.plan.cpu_share else y

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sigmoid(x · gate_w) * down(silu(gate(x)) * up(x)), [T, H] float32 (without gate_w,
        GLM-4.5's ungated shared expert: down(silu(gate(x)) * up(x)), weighted by ones).

        Two launches (moe.kernels.routed.routed_experts over the one-slot pool, gate computed inside the first);
        float32 accumulation. Returns a buffer of this layer, overwritten by the next call. Cost
        O(T * (3 * Is + 1) * H).
        """
        gate_up, down = self._shared_pool
        tokens, gate_w = x.shape[0], self.shared[2]
        return routed_experts(x, self._shared_slots[:tokens], self._shared_ones[:tokens] if gate_w is None else None,
                              gate_up, down, gate_w=gate_w, shared=True, out=self._shared_out[:tokens],
                              act=self._shared_act, tiles=self.plan.routed_tiles)

    def _check_routing(self, routing, tokens: int) -> None:
        _check_routing_pair(routing, tokens, self.cfg.top_k, self.device)

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        ok = (isinstance(hidden, torch.Tensor) and hidden.dim() == 2
              and 1 <= hidden.shape[0] <= GEMV_MAX_TOKENS and hidden.shape[1] == self.cfg.hidden)
        if not ok:
            raise ValueError(f"MoELayer: hidden must be [T, {self.cfg.hidden}] with T in 1..{GEMV_MAX_TOKENS} "
                             f"(decode), got {list(getattr(hidden, 'shape', []))}")
        slots = self.slots.cache.geometry.num_slots
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


def _check_plan(plan: LaunchPlan, cfg: MoEConfig, device: torch.device, slots: SlotCache) -> None:
    """Raise ValueError naming the LaunchPlan field this layer cannot launch."""
    if not isinstance(plan, LaunchPlan):
        raise ValueError(f"MoELayer: plan must be a LaunchPlan, got {type(plan).__name__}")
    if plan.cpu_share != (slots.share is not None):
        raise ValueError(f"MoELayer: LaunchPlan.cpu_share={plan.cpu_share} disagrees with the SlotCache's miss split "
                         f"({slots.split.service}): resolve the plan with miss_service={slots.split.service!r}")
    if plan.mode.shared_on_side and not cfg.has_shared_expert:
        raise ValueError(f"MoELayer: LaunchPlan.mode={plan.mode.value} runs a shared expert, which this block "
                         "has not (MoEConfig.shared_intermediate=0)")
    if plan.mode.side_stream and device.type != "cuda":
        raise ValueError(f"MoELayer: LaunchPlan.mode={plan.mode.value} needs a side stream, which a {device.type} "
                         "device has not; use OverlapMode.INLINE")


def _check_weights(cfg: MoEConfig, layer: int, router_w: torch.Tensor, shared: SharedWeights | None,
                   slots: SlotCache, dtype: torch.dtype, router_b: torch.Tensor | None,
                   score_bias: torch.Tensor | None) -> None:
    """Raise ValueError naming the argument that disagrees with cfg or the cache."""
    if not 0 <= layer < slots.num_layers or slots.num_experts != cfg.num_experts:
        raise ValueError(f"MoELayer: layer={layer} must be in [0, {slots.num_layers}) and the SlotCache's "
                         f"num_experts={slots.num_experts} must equal MoEConfig.num_experts={cfg.num_experts}")
    if tuple(router_w.shape) != (cfg.num_experts, cfg.hidden):
        raise ValueError(f"MoELayer: router_w must be [{cfg.num_experts}, {cfg.hidden}], got {list(router_w.shape)}")
    if (router_b is not None) != cfg.router_bias:
        raise ValueError(f"MoELayer: router_b must be given exactly when MoEConfig.router_bias (={cfg.router_bias}), "
                         f"got {'none' if router_b is None else 'one'}")
    if router_b is not None and tuple(router_b.shape) != (cfg.num_experts,):
        raise ValueError(f"MoELayer: router_b must be [{cfg.num_experts}], got {list(router_b.shape)}")
    if (score_bias is not None) != cfg.score_bias or (score_bias is not None
                                                       and tuple(score_bias.shape) != (cfg.num_experts,)):
        raise ValueError(f"MoELayer: score_bias must be a [{cfg.num_experts}] tensor exactly when MoEConfig.score_bias "
                         f"(={cfg.score_bias}), got {None if score_bias is None else list(score_bias.shape)}")
    want = cfg.expert_banks()
    if slots.store.banks != want:
        raise ValueError(
            f"MoELayer: the HostStore banks must be those of MoEConfig.expert_format={cfg.expert_format!r} "
            f"at hidden={cfg.hidden}, expert_intermediate={cfg.expert_intermediate}: "
            f"{[(b.name, list(b.row_shape), b.dtype) for b in want]}, got "
            f"{[(b.name, list(b.row_shape), b.dtype) for b in slots.store.banks]}"
        )
    if cfg.num_experts > ROUTER_MAX_EXPERTS:
        raise ValueError(f"MoELayer: MoEConfig.num_experts={cfg.num_experts} exceeds the router kernel's "
                         f"ROUTER_MAX_EXPERTS={ROUTER_MAX_EXPERTS}")
    check_shared(cfg, shared, "MoELayer", dtype)

