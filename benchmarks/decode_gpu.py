"""The GPU half of benchmarks/bench_decode.py: build the random decoder once, time one configuration.

    build_weights(args, config, fmt) -> ModelWeights on cuda (moe.testing.random_decoder's `config` at --layers,
                           --vocab), routed experts in format `fmt` in one pinned HostStore shared by every
                           configuration of the format
    measure(weights, trace, args, policy, overlap, B):
        weights with MoEConfig.copy_overlap = overlap ─► GpuMoE(forced_routing) of --slots slots ─► Engine
        memory idle ─► prefill B prompts ─► warm-up steps ─► counters ─► timed steps (events) ─► counters
        ─► memory peak; every step: set_routing(trace ids / weights of step n, on the device) ─►
        decode_step(previous argmax) ─► argmax (no host sync inside the loop); trace None: the model's
        own router routes every step (benchmarks/peer_llamacpp.py)

Legend: B = batch rows, L = layers, k = top_k, N = warmup + steps decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import numpy as np
import torch

from expertcache.split import MissSplit
from moe.engine.backends import GpuMoE
from moe.engine.channels import ChannelMeasure, measure_channels
from moe.engine.engine import Engine
from moe.engine.loading import resolve_miss_service
from moe.model.checkpoint import ModelWeights
from moe.testing import random_decoder as decoders
from sim.trace import Trace

GB = 1e9
PROMPT = 4  # prompt tokens per row (prefill bypasses the cache)


def build_weights(args: argparse.Namespace, config: str, fmt: str = "bf16") -> tuple[ModelWeights, dict]:
    """The decoder of every configuration of expert format `fmt`, and how long building (quantizing and
    pinning) it took: moe.testing.random_decoder's config maker `config` at --layers and --vocab. The same
    seed gives the same random experts in every format."""
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.time()
    config = getattr(decoders, config)(args.layers, vocab_size=args.vocab)
    weights = decoders.random_decoder(config, "cuda", seed=args.seed, expert_format=fmt)
    torch.cuda.synchronize()
    store = weights.store
    return weights, {"seconds": time.time() - t0, "host_store_gb": store.nbytes / GB,
                     "bytes_per_expert": store.bytes_per_expert,
                     "pinned": bool(store.tensor(store.banks[0].name).is_pinned())}


def _memory(peak: bool) -> dict:
    free, total = torch.cuda.mem_get_info()
    key = "peak" if peak else "idle"
    alloc = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    return {f"{key}_allocated_gb": alloc / GB, f"{key}_device_used_gb": (total - free) / GB}


def _spread(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90))}


def engine_split(weights: ModelWeights, service: str, tail: bool = True,
                 given: ChannelMeasure | None = None) -> tuple[MissSplit | None, ChannelMeasure | None]:
    """The engine's miss split for --miss-service `service` on these weights (None: copy), as load_model
    resolves it (tail False: a hybrid split of whole experts only, the A/B of expertcache.split's tail),
    and the channels it measured at start (None where it measured nothing); `given`: balance from these
    channels instead of measuring (two tables of one run compared on the same rates)."""
    measured: list[ChannelMeasure] = []

    def measure() -> ChannelMeasure:
        measured.append(given or measure_channels(weights.store, weights.spec.moe, weights.device))
        return measured[0]

    split = resolve_miss_service(service, weights.device, measure=measure, cfg=weights.spec.moe if tail else None)
    return (None if split.copies_all else split), (measured[0] if measured else None)


class Runner:
    """One configuration's engine, fed the trace's routing step by step (trace None: the model's own
    router routes)."""

    def __init__(self, weights: ModelWeights, trace: Trace | None, args: argparse.Namespace, policy: str,
                 overlap: bool, batch: int) -> None:
        moe_cfg = dataclasses.replace(weights.spec.moe, copy_overlap=overlap)
        weights = dataclasses.replace(weights, spec=dataclasses.replace(weights.spec, moe=moe_cfg))
        split = getattr(args, "split", None)  # the run's miss split (engine_split), None: copy
        self.backend = GpuMoE(weights, args.slots, policy, max_batch=batch, forced_routing=trace is not None,
                              split=split)
        plans = [layer.plan for layer in self.backend.layers.values()]
        if {plan.mode.side_stream for plan in plans} != {overlap}:
            raise SystemExit(f"overlap {'on' if overlap else 'off'} did not apply: {plans[0].reason}")
        self.plan = plans[0].summary()
        steps = args.warmup + args.steps
        self.engine = Engine(weights, self.backend, max_batch=batch, max_seq_len=PROMPT + steps + 1,
                             cuda_graphs=not args.eager)
        self.ids = self.route_weights = None
        if trace is not None:  # [N, L, B, k] on the device: each step's routing is a device-to-device copy
            self.ids = torch.from_numpy(np.ascontiguousarray(trace.experts)).cuda()
            self.route_weights = torch.from_numpy(np.ascontiguousarray(trace.weights, dtype=np.float32)).cuda()
        self.batch, self.vocab = batch, weights.spec.vocab_size

    def prefill(self, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, self.vocab, (self.batch, PROMPT), generator=gen).tolist()
        return self.engine.prefill(prompts).argmax(dim=-1)

    def step(self, n: int, tokens: torch.Tensor) -> torch.Tensor:
        if self.ids is not None:
            self.backend.set_routing(self.ids[n], self.route_weights[n])  # [L, B, k]
        return self.engine.decode_step(tokens).argmax(dim=-1)

    def counters(self) -> np.ndarray:
        """int64 [L, 4]: calls, accesses, misses (copied and served) and misses served on the CPU per layer
        (a sync)."""
        cache = self.backend.slots.cache
        counts = cache.counters.cpu().numpy()
        served = cache.served.cpu().numpy() if cache.served.shape[0] == counts.shape[0] else np.zeros(counts.shape[0])
        return np.concatenate([counts, served.reshape(-1, 1).astype(np.int64)], axis=1)

    def close(self) -> None:
        self.backend.slots.close()


def measure(weights: ModelWeights, trace: Trace | None, args: argparse.Namespace, policy: str, overlap: bool,
            batch: int) -> dict:
    """Time `args.steps` decode steps after `args.warmup` for one configuration. See the module."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = Runner(weights, trace, args, policy, overlap, batch)
    torch.cuda.synchronize()
    memory = _memory(peak=False)
    tokens = run.prefill(args.seed)
    for n in range(args.warmup):
        tokens = run.step(n, tokens)
    torch.cuda.synchronize()
    before = run.counters()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    events[0].record()
    for j in range(args.steps):
        tokens = run.step(args.warmup + j, tokens)
        events[j + 1].record()
    torch.cuda.synchronize()
    after = run.counters()
    run.backend.slots.cache.check()  # raises EnsureError if any call was refused
    memory.update(_memory(peak=True))
    step_us = [events[j].elapsed_time(events[j + 1]) * 1e3 for j in range(args.steps)]
    chunks = np.array_split(np.array(step_us), args.chunks)
    window = after - before
    layers = window.shape[0]
    out = {"us_per_step": float(np.sum(step_us)) / args.steps,
           "tokens_per_s": batch * args.steps / (float(np.sum(step_us)) * 1e-6),
           "step_us": _spread(step_us),
           "chunk_tokens_per_s": [batch * len(c) / (float(c.sum()) * 1e-6) for c in chunks],
           "hit_rate": 1.0 - int(window[:, 2].sum()) / max(int(window[:, 1].sum()), 1),
           "misses_per_layer_per_step": float(window[:, 2].sum()) / layers / args.steps,
           "served_per_layer_per_step": float(window[:, 3].sum()) / layers / args.steps,
           "layer_misses_all": after[:, 2].tolist(), "layer_misses_window": window[:, 2].tolist(),
           "split_service": "copy" if run.backend.slots.split.copies_all else run.backend.slots.split.service,
           "graphs": [] if run.engine.graphs is None else run.engine.graphs.batch_sizes,
           "memory": memory, "plan": run.plan}
    run.close()
    del run
    return out
