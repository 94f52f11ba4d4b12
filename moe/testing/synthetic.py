"""Random MoE models at a given geometry, for tests and benchmarks.

    MoEConfig, L layers, seed ──random_weights──► SyntheticWeights
        router [L, E, H], shared [(gate_up [2Is, H], down [H, Is], gate_w [1, H])] * L (or None),
        HostStore banks gate_up [L*E, 2I, H], down [L*E, H, I]   (pinned where CUDA is present;
        with a quantized MoEConfig.expert_format the same random experts quantized on `device`, in
        that format's banks)
    SyntheticWeights, S slots, device ──SyntheticModel──► SlotCache(store, SlotPool(S), DeviceCache)
        + L MoELayers; step(hidden [T, H]) runs layers 0..L-1, each on the previous one's output

Weights are made on `device` (fast on a GPU) and the experts copied into the host store, so a model at
a real geometry (4 layers of 512 experts of 6 MiB: 12 GiB) builds in seconds. Several models may share
one SyntheticWeights (one host store, separate pools and slot maps), e.g. overlap on and off side by side.
Every weight is N(0, 1/fan_in), which keeps activations within a small factor of order one through
a few layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from expertcache.copy import miss_copy
from expertcache.pool import HostStore, SlotPool
from moe.engine.layer import DTYPES, MoELayer, SlotCache
from moe.kernels.plan import LaunchPlan
from moe.model.checkpoint import write_experts
from moe.model.config import EXPERT_BIAS_BANKS, MoEConfig, copy_overlap_from_env
from moe.model.reference import SharedWeights, moe_reference
from moe.model.slot_matrix import SlotMatrix

CHUNK_EXPERTS = 64  # experts generated on the device per host copy ...
CHUNK_BYTES = 4 << 30  # ... fewer where their float32 draws (3 I H each) would pass this (Mixtral's experts: 6)


@dataclass
class SyntheticWeights:
    """router [L, E, H] on the device; shared: per layer SharedWeights on the device, or None; store:
    every routed expert, key = layer * E + expert (with its bias rows where cfg.expert_bias);
    router_bias [L, E] on the device where cfg.router_bias (gpt-oss), else None."""

    cfg: MoEConfig
    router: torch.Tensor
    shared: list[SharedWeights] | None
    store: HostStore
    router_bias: torch.Tensor | None = None
    score_bias: torch.Tensor | None = None  # [L, E] float32 where cfg.score_bias (GLM-4.5)

    @property
    def num_layers(self) -> int:
        return self.router.shape[0]


def _randn(shape, std: float, dtype, device, gen) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float32, device=device, generator=gen) * std).to(dtype)


def random_weights(cfg: MoEConfig, num_layers: int, device: str | torch.device = "cuda", seed: int = 0,
                   pin: bool | None = None) -> SyntheticWeights:
    """Random weights of `num_layers` layers of `cfg` (deterministic for a seed and device).

    pin: pin the host store (default: when CUDA is available). gpt-oss's block (cfg.router_bias, cfg.expert_bias): a
    router bias and expert biases N(0, 0.02^2) too; GLM-4.5's (cfg.score_bias): a float32 correction bias N(0,
    0.02^2), and an ungated shared expert where cfg.shared_gate is False. Cost: one device randn and one host copy per
    chunk of CHUNK_EXPERTS experts (fewer where their float32 draws would pass CHUNK_BYTES: the device holds a
    chunk's draws and its quantizing); host memory L * E * 3 * I * H * itemsize bytes.
    """
    device = torch.device(device)
    dtype = DTYPES[cfg.dtype]
    gen = torch.Generator(device).manual_seed(seed)
    h, e, i, s = cfg.hidden, cfg.num_experts, cfg.expert_intermediate, cfg.shared_intermediate
    router = _randn((num_layers, e, h), h ** -0.5, dtype, device, gen)
    shared = None
    if cfg.has_shared_expert:
        shared = [(_randn((2 * s, h), h ** -0.5, dtype, device, gen),
                   _randn((h, s), s ** -0.5, dtype, device, gen),
                   _randn((1, h), h ** -0.5, dtype, device, gen) if cfg.shared_gate else None)
                  for _ in range(num_layers)]
    router_bias = _randn((num_layers, e), 0.02, dtype, device, gen) if cfg.router_bias else None
    score_bias = _randn((num_layers, e), 0.02, torch.float32, device, gen) if cfg.score_bias else None
    fmt = cfg.format
    store = HostStore.empty(cfg.expert_banks(), num_layers * e, pin=pin)
    chunk = max(1, min(CHUNK_EXPERTS, CHUNK_BYTES // (3 * i * h * 4)))
    for first in range(0, num_layers * e, chunk):
        n = min(chunk, num_layers * e - first)
        gate_up = _randn((n, 2 * i, h), h ** -0.5, dtype, device, gen)
        down = _randn((n, h, i), i ** -0.5, dtype, device, gen)
        if fmt.dense and fmt.dtype == cfg.dtype:
            store.tensor("gate_up")[first:first + n].copy_(gate_up)
            store.tensor("down")[first:first + n].copy_(down)
        else:
            write_experts(store, fmt, "gate_up", gate_up, first, 2)
            write_experts(store, fmt, "down", down, first, 1)
        if cfg.expert_bias:
            for name, width in zip(EXPERT_BIAS_BANKS, (2 * i, h)):
                store.tensor(name)[first:first + n].copy_(_randn((n, width), 0.02, dtype, device, gen))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return SyntheticWeights(cfg, router, shared, store, router_bias, score_bias)


class SyntheticModel:
    """L MoE layers over one SlotCache of `num_slots` slots on `device`.

    copy_overlap: None reads EXPERTCACHE_MOE_COPY_OVERLAP (default weights.cfg.copy_overlap);
    a bool sets MoEConfig.copy_overlap. policy: eviction policy name (--moe-cache-policy).
    plan: None lets every layer resolve its LaunchPlan (moe.kernels.plan.resolve_launch_plan); a
    LaunchPlan is given to every layer as it is (tests and benchmarks that compare plans build one,
    e.g. dataclasses.replace(model.layers[0].plan, ...)), and kept through `rebuild`.
    Raises PoolError when the slots do not fit, RuntimeError when overlap is asked for on a GPU
    without cuda-python, ValueError when a layer cannot launch `plan`.
    """

    def __init__(self, weights: SyntheticWeights, num_slots: int, device: str | torch.device = "cuda", *,
                 copy_overlap: bool | None = None, policy: str = "lru", plan: LaunchPlan | None = None) -> None:
        overlap = copy_overlap_from_env(weights.cfg.copy_overlap) if copy_overlap is None else copy_overlap
        self.cfg = dataclasses.replace(weights.cfg, copy_overlap=overlap)
        self.weights = weights
        pool = SlotPool(weights.store.banks, num_slots, device)
        self.slots = SlotCache(weights.store, pool, weights.num_layers, self.cfg.num_experts, policy)
        self.layers = [
            MoELayer(self.cfg, layer, weights.router[layer], self.slots,
                     None if weights.shared is None else weights.shared[layer], plan=plan)
            for layer in range(weights.num_layers)
        ]

    @property
    def device(self) -> torch.device:
        return self.slots.pool.device

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """One decode step: hidden [T, H] through layers 0..L-1 -> [T, H]."""
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden

    def step_layers(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Like step, returning every layer's output [T, H] (layer l's input is output l - 1)."""
        outs = []
        for layer in self.layers:
            hidden = layer(hidden)
            outs.append(hidden)
        return outs

    def layer_experts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full expert tensors of one layer: gate_up [E, 2I, H], down [E, H, I], host views of a
        dense store, else the format's float32 dequantize of every expert (what the kernels compute with)."""
        cfg = self.cfg
        e, h, i = cfg.num_experts, cfg.hidden, cfg.expert_intermediate
        keys = torch.arange(layer * e, (layer + 1) * e)
        if cfg.format.dense:
            return self.weights.store.tensor("gate_up")[keys], self.weights.store.tensor("down")[keys]
        store = self.weights.store
        return (SlotMatrix.of_pool(store, cfg.format, "gate_up", 2 * i, h, 2).dequantize(keys),
                SlotMatrix.of_pool(store, cfg.format, "down", h, i).dequantize(keys))

    def reference(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """moe.model.reference.moe_reference of one layer on hidden's device, from the full expert tensors."""
        gate_up, down = (w.to(hidden.device) for w in self.layer_experts(layer))
        mod = self.layers[layer]
        return moe_reference(hidden, mod.router_w, gate_up, down, self.cfg, mod.shared)

    def warm_all(self) -> None:
        """Make every expert of every layer resident (needs num_slots >= L * E): per layer, ensures of
        top_k ids at a time (the decode step's shape, so the ensure kernel compiled for decode serves;
        one call of all E ids would compile a kernel for a query of E, minutes of ptxas at E = 512) and
        one miss copy each. Raises ValueError when the pool is too small."""
        e, k, pool = self.cfg.num_experts, self.cfg.top_k, self.slots.pool
        if pool.num_slots < len(self.layers) * e:
            raise ValueError(f"warm_all needs num_slots >= L * E = {len(self.layers) * e}, "
                             f"the pool has {pool.num_slots} (--slots)")
        ids = torch.full((-(-e // k) * k,), -1, dtype=torch.int32)  # -1: padding of the last call
        ids[:e] = torch.arange(e, dtype=torch.int32)
        ids = ids.reshape(-1, 1, k).to(self.device)
        for layer in range(len(self.layers)):
            for call in ids:
                buf = self.slots.cache.ensure(layer, call)
                miss_copy(self.slots.store, pool, buf.plan, buf.count)

    def rebuild(self, num_slots: int) -> None:
        """Pool of `num_slots`, cold slot map, same side stream; every layer re-resolves its plan (a
        plan given at construction is kept)."""
        self.slots.rebuild(num_slots)
        for layer in self.layers:
            layer.refresh()

    def close(self) -> None:
        self.slots.close()
