"""Decode with the misses split between the slots and the CPU kernels, against transformers, on the CPU.

    tiny random checkpoint of every family ─load_model(miss_service=hybrid | cpu)─► CpuCachedMoE: the
    split's copies into slots, its served misses through moe.kernels.cpu_experts from the HostStore
"""

from __future__ import annotations

import pytest
import torch

from expertcache.geometry import CPU_SLOT
from moe.engine.loading import load_model, resolve_miss_service
from tests.moe.families import assert_near, hf_logits, random_tokens

CALLS, ACCESSES, MISSES = 0, 1, 2


def _teacher_forced(engine, seq: list[int], prompt_len: int) -> torch.Tensor:
    out = [engine.prefill([seq[:prompt_len]], all_logits=True)[0]]
    out += [engine.decode_step([t]) for t in seq[prompt_len:]]
    return torch.cat(out)


@pytest.mark.parametrize("service", ["hybrid", "cpu"])
def test_split_decode_matches_transformers(checkpoint, service):
    """float32 logits within 1e-4 of transformers' while misses are served both ways, and greedy tokens
    identical; the split really served some misses on the CPU and (hybrid) copied others."""
    name, model, path = checkpoint
    top_k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=top_k + 1, max_seq_len=48, progress=False, miss_service=service)
    seq = random_tokens(12, seed=5)
    assert_near(_teacher_forced(engine, seq, prompt_len=6), hf_logits(model, seq).logits[0], rel=1e-4)
    cache = engine.moe.cache
    assert cache.served.sum() > 0
    if service == "cpu":
        assert (cache.served == cache.counters[:, MISSES]).all() and (cache.key_of < 0).all()
    else:
        assert (cache.served < cache.counters[:, MISSES]).any() and (cache.key_of >= 0).any()
    prompt = random_tokens(5, seed=6)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                             pad_token_id=0)[0, len(prompt):].tolist()
    fresh = load_model(path, "cpu", num_slots=top_k + 1, max_seq_len=48, progress=False, miss_service=service)
    assert fresh.generate([prompt], max_new_tokens=6) == [ref]


def test_same_request_same_tokens_every_run(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    runs = []
    for _ in range(3):
        engine = load_model(path, "cpu", num_slots=2 * k, max_batch=2, max_seq_len=48, progress=False,
                            miss_service="hybrid")
        runs.append((engine.generate([random_tokens(5, seed=7), random_tokens(3, seed=8)], max_new_tokens=8),
                     engine.moe.cache.snapshot()))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert runs[0][1].equals(runs[1][1]) and runs[0][1].equals(runs[2][1])


def test_split_cpu_backend_limits_and_counts(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    with pytest.raises(ValueError, match="--max-batch"):
        load_model(path, "cpu", num_slots=9 * k, max_batch=9, max_seq_len=16, progress=False, miss_service="hybrid")
    engine = load_model(path, "cpu", num_slots=k + 1, max_seq_len=32, progress=False, miss_service="cpu")
    engine.generate([random_tokens(4, seed=1)], max_new_tokens=3)
    from moe.engine.cachestats import cache_stats

    stats = cache_stats(engine.moe)
    assert stats.served == stats.total_misses > 0
    assert stats.bytes_copied == 0 and stats.slots_in_use == 0, "nothing was copied under cpu"
    from expertcache.split import ChannelCosts, MissSplit
    from moe.engine.backends import CpuCachedMoE
    from moe.model.checkpoint import load_checkpoint

    weights = load_checkpoint(path, "cpu", progress=False)
    inter = weights.spec.moe.expert_intermediate
    with pytest.raises(ValueError, match="expert_intermediate"):  # a tail built for other experts
        CpuCachedMoE(weights, k + 1, split=MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0), 2 * inter, inter))
    backend = CpuCachedMoE(weights, k + 1, split=MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0), inter, inter // 2))
    assert backend.scratch == k + 1 and backend.pool.num_slots == k + 2, "the scratch slot beside the cache's"


def test_the_memory_line_counts_the_tails_scratch_slot(checkpoint, caplog):
    """A hybrid split with a tail holds one slot beyond the cache's: the start's memory line names it and
    adds its bytes; copy holds none."""
    import logging

    from expertcache.split import tail_granule

    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    lines = {}
    for service in ("copy", "hybrid"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
            engine = load_model(path, "cpu", num_slots=k + 1, max_seq_len=32, progress=False, miss_service=service)
        lines[service] = next(r.message for r in caplog.records if r.message.startswith("device memory"))
        cfg = engine.moe.cfg
        tail = service == "hybrid" and tail_granule(cfg.format, cfg.expert_intermediate) > 0
        assert engine.moe.extra_slots == int(tail) and engine.moe.pool.num_slots == k + 1 + tail
        assert ("1 scratch slot" in lines[service]) == tail, lines[service]


def test_miss_service_choices_and_errors():
    assert resolve_miss_service("copy", "cpu").copies_all
    assert resolve_miss_service("auto", "cpu").copies_all
    assert resolve_miss_service("cpu", "cpu").service == "cpu"
    hybrid = resolve_miss_service("hybrid", "cpu")
    assert [hybrid.copies_for(m) for m in range(6)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="--moe-miss-service"):
        resolve_miss_service("fast", "cpu")
    with pytest.raises(ValueError, match="--cpu-threads"):
        resolve_miss_service("hybrid", "cpu", cpu_threads=0)
    with pytest.raises(ValueError, match="measure"):  # a GPU's table is balanced from measured channels
        resolve_miss_service("hybrid", "cuda")
    assert CPU_SLOT == -2


def test_the_cpu_kernels_take_every_decode_size_the_gpu_hands_over():
    """The hand-off posts up to GEMV_MAX_TOKENS rows of a GPU decode step to CpuExperts.moe."""
    from moe.kernels.cpu_experts import MAX_TOKENS
    from moe.kernels.plan import GEMV_MAX_TOKENS

    assert MAX_TOKENS >= GEMV_MAX_TOKENS


def test_hybrid_with_every_expert_in_a_slot_runs_as_copy(checkpoint):
    """Slots for every routed expert: a hybrid split's empty slots would take every miss and the pool never
    fills, so load_model runs it as copy (no CPU kernels, no hand-off, no scratch slot), says why, and
    decodes the tokens, admissions and counters copy does; one slot fewer keeps the split."""
    from moe.model.spec import ModelSpec, read_config

    name, model, path = checkpoint
    spec = ModelSpec.from_hf(read_config(path))
    keys = spec.num_moe_layers * spec.moe.num_experts
    prompts = [random_tokens(5, seed=11), random_tokens(4, seed=12)]
    runs = {}
    for service in ("copy", "hybrid", "auto"):
        engine = load_model(path, "cpu", num_slots=keys, max_batch=min(9, keys // spec.moe.top_k), max_seq_len=32,
                            progress=False, miss_service=service)  # 9 rows: beyond the CPU kernels' 8 where it fits
        if service != "copy":
            assert "the slots hold every routed expert" in engine.miss_service
        assert engine.moe.cache.split.copies_all and engine.moe.cpu_experts is None and engine.moe.extra_slots == 0
        runs[service] = (engine.generate(prompts, max_new_tokens=6), engine.moe.cache.snapshot())
    assert runs["hybrid"][0] == runs["copy"][0] == runs["auto"][0]
    assert runs["hybrid"][1].equals(runs["copy"][1])
    fewer = load_model(path, "cpu", num_slots=keys - 1, max_seq_len=32, progress=False, miss_service="hybrid")
    assert fewer.moe.cache.split.service == "hybrid" and "half of each call" in fewer.miss_service
