"""CUDA-graph decode: one captured decode step per batch size B, replayed with per-row state in device buffers.

    Engine.decode_step(tokens [B]) ──DecodeGraphs.run──►
        first call at B:  step(tokens) eagerly: a real, counted decode step that also compiles every
                          Triton kernel of that B and makes every lazily built buffer (ensure outputs,
                          scratch); then capture step(static tokens[:B]) into graph[B] (capture runs
                          nothing, so no state changes twice)
        later calls at B: static tokens[:B] <- tokens (device copy); graph[B].replay();
                          -> clones of its static outputs (the next replay overwrites them)

    read by graph[B], allocated outside it once and changed only in place (between replays):
        static tokens int64 [max_batch]            (run() copies each step's tokens in)
        KVCache k / v [max_batch, Hkv, max_len, D] per layer, lengths int64 [max_batch]
                                                   (prefill / join / leave write them eagerly; the
                                                    graph itself writes k / v at each row's position
                                                    and does lengths[:B] += 1)
        slot pool, device cache state, MoE layer buffers, forced-routing buffers (GpuMoE)
    written by graph[B] into its own memory pool:
        logits float32 [B, V]; with record_routing, routed ids int32 [L_moe, B, k]

Legend: B = active rows (1..max_batch), V = vocab, L_moe = MoE layers, k = top_k.

A row joining or leaving only changes B and those buffers, so graph[B] is keyed by B alone and stays
valid. Whatever reallocates a buffer a graph reads (SlotCache.rebuild, a new KVCache) invalidates
every graph: call `clear()` (the next step at each B captures again). Attention masks by the lengths
in device memory over the fixed max_len, so nothing in a step depends on a host-known length.

No garbage collection runs inside a capture: CUDA objects held by dead reference cycles (an earlier
engine's captured graphs) are collected just before it, and the collector is off while it runs. A
collection inside the capture would destroy those graphs there (cudaGraphExecDestroy), a call that
invalidates a capture in global mode; torch >= 2.10 no longer collects at the start of a capture.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]


@dataclass
class CapturedStep:
    """One captured decode step of B rows: its graph and the static outputs the graph writes."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # float32 [B, V]
    routing: torch.Tensor | None  # int32 [L_moe, B, k] when recording


class DecodeGraphs:
    """Captured decode steps of `step` (tokens int64 [B] on `device` -> (logits [B, V], routing or
    None)), one per batch size, captured on first use. `step` must launch work only (no host sync,
    no host state changes) and read every other input from buffers that outlive the graphs.

    Raises ValueError naming cuda_graphs when `device` is not a CUDA device, and max_batch when a
    batch does not fit.
    """

    def __init__(self, step: StepFn, max_batch: int, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA-graph decode needs a CUDA device, the model is on {device}: "
                             "pass cuda_graphs=False (or EXPERTCACHE_CUDA_GRAPHS=0)")
        self.step, self.max_batch, self.device = step, max_batch, device
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # static input
        self.captured: dict[int, CapturedStep] = {}

    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of tokens int64 [B] on the device -> (logits float32 [B, V], routing or None),
        tensors of their own. Cost: first call at B, an eager step plus one capture; then one
        device copy of B ids, one graph launch and the output clones; no host sync after the first."""
        b = tokens.shape[0]
        if tokens.dim() != 1 or not 1 <= b <= self.max_batch or tokens.dtype != torch.int64:
            raise ValueError(f"DecodeGraphs.run: tokens must be int64 [B], B in 1..max_batch={self.max_batch}, "
                             f"got {tokens.dtype} {list(tokens.shape)}")
        got = self.captured.get(b)
        if got is None:
            out = self.step(tokens)  # the warm-up is a real step
            self.captured[b] = self._capture(b)
            return out
        self.tokens[:b].copy_(tokens)
        got.graph.replay()
        return got.logits.clone(), None if got.routing is None else got.routing.clone()

    def _capture(self, b: int) -> CapturedStep:
        torch.cuda.synchronize(self.device)  # the eager step's work is done before capture begins
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.device(self.device), torch.cuda.graph(graph):
            logits, routing = self.step(self.tokens[:b])
        return CapturedStep(graph, logits, routing)

    def clear(self) -> None:
        """Drop every captured step (after a buffer they read was reallocated)."""
        self.captured.clear()

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured so far, ascending."""
        return sorted(self.captured)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Collect garbage now, then keep Python's cyclic collector off for the with-block (a capture)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
