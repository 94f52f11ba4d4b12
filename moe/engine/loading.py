"""Load a Hugging Face MoE checkpoint into a ready decode Engine.

    <dir> (config.json, *.safetensors) ──load_checkpoint──► ModelWeights (device tensors + HostStore)
        ──make_backend──► CpuCachedMoE (device "cpu") | GpuMoE (CUDA): the expert cache of num_slots
                          (or of the slots cache_gb GiB hold: moe.engine.budget, from config.json first)
        ──Engine──► prefill / decode_step / generate

Supported `model_type`s: moe.model.spec.FAMILIES (qwen2_moe, qwen3_moe, qwen3_next, gpt_oss, glm4_moe, mixtral,
olmoe), on the GPU and the CPU backend. On the CPU every step is torch (the cache's host reference, the
torch attention, the delta rule's torch step): nothing launches a Triton kernel, so neither a GPU driver
nor Triton's interpreter is needed. The pieces are public for callers
that need them apart: moe.model.spec (config), moe.model.checkpoint (tensors), moe.engine.backends (MoE blocks),
moe.engine.engine (decoder). The GPU side-stream overlap is load_model's `copy_overlap`, or when that is None
EXPERTCACHE_MOE_COPY_OVERLAP; CUDA-graph decode is load_model's `cuda_graphs`, or when that is None
EXPERTCACHE_CUDA_GRAPHS (default: on for a CUDA device).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from expertcache.ranks import rank_keys
from expertcache.split import MISS_SERVICE_CHOICES, ChannelCosts, MissSplit, tail_granule
from moe.engine.backends import CpuCachedMoE, GpuMoE, make_backend
from moe.engine.budget import context_bytes, memory_split, prefix_cache_bytes, resolve_slots
from moe.engine.channels import ChannelMeasure, choose_service, measure_channels
from moe.engine.engine import PREFILL_CHUNK, Engine, check_prefill_chunk
from moe.engine.expert_parallel import ExpertParallelMoE, ExpertShard
from moe.engine.prefix import PREFIX_BLOCK_TOKENS
from moe.kernels.cpu_experts import set_threads, threads_in_use
from moe.model.checkpoint import ModelWeights, load_checkpoint
from moe.model.config import MoEConfig, copy_overlap_from_env
from moe.model.errors import CheckpointError
from moe.model.spec import FAMILIES, ModelSpec, read_config

CUDA_GRAPHS_ENV = "EXPERTCACHE_CUDA_GRAPHS"
logger = logging.getLogger(__name__)
__all__ = ["CheckpointError", "CpuCachedMoE", "Engine", "FAMILIES", "GpuMoE", "ModelSpec", "ModelWeights",
           "load_checkpoint", "load_model"]


def load_model(path: str | Path, device: str | torch.device = "cpu", *, num_slots: int | None = None,
               cache_gb: float | None = None, policy: str = "lru", dtype: str | None = None,
               expert_format: str | None = None, max_batch: int = 1,
               max_seq_len: int = 2048, record_routing: bool = False, progress: bool = True,
               copy_overlap: bool | None = None, cuda_graphs: bool | None = None, miss_service: str = "copy",
               cpu_threads: int | None = None, prefix_blocks: int = 0, prefix_block_tokens: int = PREFIX_BLOCK_TOKENS,
               prefill_chunk: int = PREFILL_CHUNK, expert_shard: ExpertShard | None = None, **constants) -> Engine:
    """Load checkpoint directory `path` and build an Engine over an expert cache of `num_slots` slots,
    or of the slots that `cache_gb` GiB hold (exactly one of the two; moe.engine.budget):
    min(floor(cache_gb * 2**30 / P), L * E) with P the bytes of one expert in the HostStore (3 * I * H
    parameters in its expert format), logged at INFO, and at WARNING when the budget holds every expert.
    expert_format: the routed experts' storage (--moe-expert-format: bf16, fp8, nvfp4, mxfp4, int4;
    default the checkpoint's own: its quantization's format, else the model dtype's); another format
    is quantized on load (moe.model.checkpoint).

    device: "cpu" (HostCache reference backend) or a CUDA device (MoELayer backend, pinned HostStore).
    policy: the eviction policy (--moe-cache-policy), constants: its overrides. dtype: model dtype
    (default: config.json's). max_batch / max_seq_len: the KV cache size. record_routing: keep decode
    routing (Engine.routing()). copy_overlap: the GPU side-stream overlap (--moe-copy-overlap); None
    leaves it to EXPERTCACHE_MOE_COPY_OVERLAP (off when unset). cuda_graphs: replay decode steps as CUDA
    graphs (moe.engine.graphs); None leaves it to EXPERTCACHE_CUDA_GRAPHS ("0": eager GPU decode, for
    debugging), else on for a CUDA device and off on the CPU. miss_service (--moe-miss-service): how
    misses are served (choose_miss_service; on a GPU, hybrid and auto measure both channels first, and
    Engine.miss_service says what was chosen and why). cpu_threads (--cpu-threads): the CPU expert kernels' threads
    (default: every core). prefix_blocks / prefix_block_tokens: the engine's prefix cache (Engine; 0: none).
    prefill_chunk (--prefill-chunk): prompt tokens a prefill pass takes at once (Engine).
    expert_shard: this process's rank of expert parallelism (moe.engine.expert_parallel; torch.distributed
    initialized by the caller): only the experts the rank owns are kept as the checkpoint is read, num_slots /
    cache_gb are the rank's, and decode adds the ranks' partial sums; the CPU backend and miss service copy only.
    Cost: reads the checkpoint once; host memory holds every routed expert.
    Raises CheckpointError (config key or quantization field, file, tensor, --moe-expert-format),
    ValueError (both or neither of num_slots / cache_gb, a
    cache_gb that is not > 0 or holds fewer than max_batch * top_k experts, num_slots below
    max_batch * top_k or above L * E, an unknown policy, cuda_graphs or EXPERTCACHE_CUDA_GRAPHS=1 on the CPU), PoolError
    (slots that do not fit on the device). The slot count is checked from config.json before any tensor
    is read; the messages name the serve flags (--moe-slots, --moe-cache-gb, --max-batch).
    """
    check_miss_service(miss_service, cpu_threads)
    check_prefill_chunk(prefill_chunk, prefix_block_tokens if prefix_blocks else 0)
    spec = ModelSpec.from_hf(read_config(path), dtype=dtype, expert_format=expert_format)
    if expert_shard is not None:
        _check_shard(expert_shard, spec, device, miss_service)
    budget = resolve_slots(spec, num_slots, cache_gb, max_batch=max_batch,
                           experts=None if expert_shard is None else expert_shard.experts)
    if cache_gb is not None:
        logger.log(logging.WARNING if budget.capped else logging.INFO, "%s", budget.describe())
    num_slots = budget.slots
    source, fix = ("cuda_graphs=True", "pass cuda_graphs=None or False") if cuda_graphs else \
        (f"{CUDA_GRAPHS_ENV}=1", f"unset {CUDA_GRAPHS_ENV} or set it to 0")
    if cuda_graphs is None:
        cuda_graphs = cuda_graphs_from_env(device)
    if cuda_graphs and torch.device(device).type != "cuda":  # before any tensor is read
        raise ValueError(f"{source} asks for CUDA-graph decode, which needs a CUDA device, and the model is to "
                         f"load on {device}: {fix}")
    keys = None if expert_shard is None else rank_keys(spec.num_moe_layers, expert_shard.num_experts,
                                                         expert_shard.ranks, expert_shard.rank)
    weights = load_checkpoint(path, device, dtype=dtype, progress=progress, expert_format=expert_format,
                              copy_overlap=copy_overlap_from_env() if copy_overlap is None else copy_overlap,
                              keys=keys)  # a rank keeps its own experts only
    service = choose_miss_service(miss_service, device, cpu_threads,
                                  lambda: measure_channels(weights.store, weights.spec.moe, weights.device),
                                  weights.spec.moe, fits_all=budget.slots >= budget.keys)
    if expert_shard is None:
        backend = make_backend(weights, num_slots, policy, max_batch=max_batch, split=service.split, **constants)
    else:
        backend = ExpertParallelMoE(CpuCachedMoE(weights, num_slots, policy, max_batch=max_batch,
                                                 shard=expert_shard, **constants), expert_shard)
    if weights.device.type == "cuda":  # the KV cache is allocated last: say which flags to lower if it cannot be
        kv = context_bytes(weights.spec, max_batch, max_seq_len)
        kept = prefix_cache_bytes(weights.spec, prefix_blocks, prefix_block_tokens)
        free = torch.cuda.mem_get_info(weights.device)[0]
        if kv + kept > free:
            prefix = f" and the prefix cache {kept / 2**30:.3g} GiB (--kv-cache-gb)" if kept else ""
            raise ValueError(f"the KV cache needs {kv / 2**30:.3g} GiB (--max-batch {max_batch} x --max-seq-len "
                             f"{max_seq_len}){prefix} but {free / 2**30:.3g} GiB of the device are free after the "
                             f"weights and {budget.slot_bytes / 2**30:.3g} GiB of expert slots: lower --max-seq-len "
                             f"or --max-batch{', --kv-cache-gb' if kept else ''}, or --moe-cache-gb / --moe-slots")
    logger.info("%s", memory_split(budget, weights.spec, max_batch, max_seq_len, prefix_blocks, prefix_block_tokens,
                                   backend.extra_slots))
    engine = Engine(weights, backend, max_batch=max_batch, max_seq_len=max_seq_len, record_routing=record_routing,
                    cuda_graphs=cuda_graphs, prefix_blocks=prefix_blocks, prefix_block_tokens=prefix_block_tokens,
                    prefill_chunk=prefill_chunk)
    engine.miss_service = service.note
    return engine




def _check_shard(shard: ExpertShard, spec: ModelSpec, device, miss_service: str) -> None:
    """Refuse an expert shard that does not fit this load: another model's expert count, a CUDA device, a
    miss service other than copy. Raises ValueError naming what to change."""
    if shard.num_experts != spec.moe.num_experts:
        raise ValueError(f"expert_shard is for {shard.num_experts} experts a layer, the checkpoint has "
                         f"{spec.moe.num_experts}: build it with ExpertShard({spec.moe.num_experts}, ranks, rank)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"expert parallelism runs on the CPU backend only, asked for {device}: load on 'cpu'")
    if miss_service != "copy":
        raise ValueError(f"--moe-miss-service {miss_service} with expert parallelism: the ranks would share one "
                         f"host's cores; use --moe-miss-service copy")


def check_miss_service(service: str, cpu_threads: int | None = None) -> None:
    """Raise ValueError naming --moe-miss-service for an unknown service, and --cpu-threads for a count
    outside [1, the cores numba may use]; nothing is read or set."""
    if service not in MISS_SERVICE_CHOICES:
        raise ValueError(f"--moe-miss-service must be one of {', '.join(MISS_SERVICE_CHOICES)}, got {service!r}")
    if cpu_threads is not None:
        import numba

        top = numba.config.NUMBA_NUM_THREADS
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 1 <= cpu_threads <= top:
            raise ValueError(f"--cpu-threads must be an int in [1, {top}] (the cores numba may use), "
                             f"got {cpu_threads!r}")


class MissService(NamedTuple):
    """A resolved --moe-miss-service: the split, and a line saying what was chosen and why (logged at
    INFO and printed by the server, except for the default, copy)."""

    split: MissSplit
    note: str


def resolve_miss_service(service: str, device, cpu_threads: int | None = None,
                         measure: Callable[[], ChannelMeasure] | None = None,
                         cfg: MoEConfig | None = None, fits_all: bool = False) -> MissSplit:
    """choose_miss_service(...).split."""
    return choose_miss_service(service, device, cpu_threads, measure, cfg, fits_all).split


def choose_miss_service(service: str, device, cpu_threads: int | None = None,
                        measure: Callable[[], ChannelMeasure] | None = None,
                        cfg: MoEConfig | None = None, fits_all: bool = False) -> MissService:
    """The miss split of --moe-miss-service on `device`, and the CPU kernels' threads (--cpu-threads).

    copy: every miss copied into a slot; cpu: every routed expert computed on the CPU from host memory
    (nothing admitted); hybrid: each call's misses split between the two channels so that both finish
    together; auto: hybrid where that is predicted faster than copying, else copy. On a GPU, hybrid and
    auto call `measure` (moe.engine.channels.measure_channels on the model's store) and balance the
    table from both channels' rates measured together; the note says what was measured and chosen. On the
    CPU backend there is no link to balance against: hybrid balances equal channels (half of each call's
    misses, an odd one cut by a tail where cfg allows), auto is copy. On a
    GPU the served misses are handed to a CPU worker inside the decode graph (moe.engine.handoff), and
    without cpu_threads the kernels take every core but two (the launching and the spinning threads');
    the server also sets OMP_WAIT_POLICY=PASSIVE before torch loads (moe.serve.cli.cpu_worker_env).
    With cfg (the model's MoEConfig), a hybrid split also cuts a served expert where that balances the
    channels closer (expertcache.split: a tail, in steps of tail_granule of cfg's expert format and width).
    fits_all: the slots hold every routed expert; hybrid and auto are then copy, measuring nothing
    (expertcache.split.split_for_slots: such a split would serve nothing on the CPU).
    Raises ValueError as check_miss_service does, and naming `measure` when a GPU hybrid or auto lacks it.
    """
    check_miss_service(service, cpu_threads)
    granule = 0 if cfg is None else tail_granule(cfg.format, cfg.expert_intermediate)
    tail = (cfg.expert_intermediate, granule) if granule else (0, 0)
    on_gpu = torch.device(device).type == "cuda"
    flag = f"--moe-miss-service {service}"
    if service == "copy":
        return _noted(MissSplit.copy(), f"{flag}: every miss copied into a slot")
    if fits_all and service in ("hybrid", "auto"):
        set_threads(cpu_threads)
        return _noted(MissSplit.copy(), f"{flag}: copy (the slots hold every routed expert: a miss is an expert's "
                                        "first use, copied into an empty slot, and nothing is left for the CPU)")
    if on_gpu and service != "cpu" and measure is None:
        raise ValueError(f"resolve_miss_service: {flag} on a GPU needs `measure` (the channels measured "
                         "together, moe.engine.channels.measure_channels)")
    if cpu_threads is not None:
        set_threads(cpu_threads)
    elif on_gpu:  # two cores stay with the decode's launching thread and the hand-off's spinning one
        import numba

        set_threads(max(1, numba.config.NUMBA_NUM_THREADS - 2))
    threads = f"{threads_in_use()} CPU threads"
    if service == "cpu":
        return _noted(MissSplit.cpu(), f"{flag}: every routed expert computed on the CPU ({threads})")
    if not on_gpu:
        if service == "auto":
            set_threads(cpu_threads)
            return _noted(MissSplit.copy(), f"{flag}: copy (the CPU backend has no link to balance against)")
        return _noted(MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0), *tail),
                      f"{flag}: half of each call's misses copied, the rest computed on the CPU ({threads}; "
                      "the CPU backend has no link to balance against)")
    measured = measure()
    costs = measured.costs()
    chosen, why = choose_service(costs, measured.top_k, measured.idle_us, *tail)
    note = f"{flag}: {measured.describe()}; {why}" + (f"; chose {chosen}" if service == "auto" else "")
    if service == "auto" and chosen == "copy":
        set_threads(cpu_threads)
        return _noted(MissSplit.copy(), note)
    return _noted(MissSplit.hybrid(costs, *tail), note)


def _noted(split: MissSplit, note: str) -> MissService:
    if not note.startswith("--moe-miss-service copy:"):  # the default says nothing
        logger.info("%s", note)
    return MissService(split, note)


def cuda_graphs_from_env(device: torch.device) -> bool:
    """EXPERTCACHE_CUDA_GRAPHS: "0" -> False, "1" -> True, unset or "" -> whether `device` is CUDA.
    Raises ValueError naming the variable for any other value."""
    value = os.environ.get(CUDA_GRAPHS_ENV, "").strip()
    if value == "":
        return torch.device(device).type == "cuda"
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{CUDA_GRAPHS_ENV}={value!r}: set it to 1 (CUDA-graph decode) or 0 (eager), or unset it")
