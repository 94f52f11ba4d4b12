"""Expert parallelism on the CPU: 2 ranks (processes joined by torch.distributed's gloo backend), each caching
the experts it owns, against one rank and against transformers, on the tiny checkpoint of every family.

    tiny checkpoint ─load_model(expert_shard=ExpertShard(E, 2, r))─► rank r: its experts' store and cache,
    decode / prefill adding both ranks' partial sums in rank order; attention and the rest replicated
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from expertcache.ranks import rank_keys
from moe.engine.expert_parallel import ExpertShard, shard_store
from moe.engine.loading import load_model
from moe.model.checkpoint import load_checkpoint
from moe.model.errors import CheckpointError
from tests.moe.families import FAMILIES, assert_near, hf_logits, num_experts, random_tokens

CALLS, ACCESSES, MISSES = 0, 1, 2
RANKS = 2


def _teacher_forced(engine, seq: list[int], prompt_len: int) -> torch.Tensor:
    out = [engine.prefill([seq[:prompt_len]], all_logits=True)[0]]
    out += [engine.decode_step([t]) for t in seq[prompt_len:]]
    return torch.cat(out)


def _rank_main(rank: int, ranks: int, path: str, init: str, experts: int, slots: int, out: str) -> None:
    """One rank: teacher-forced logits, greedy tokens of two rows, its cache's counters and keys -> `out`.rank."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        shard = ExpertShard(experts, ranks, rank)
        engine = load_model(path, "cpu", num_slots=slots, max_batch=2, max_seq_len=48, progress=False,
                            expert_shard=shard)
        logits = _teacher_forced(engine, random_tokens(12, seed=5), prompt_len=6)
        fresh = load_model(path, "cpu", num_slots=slots, max_batch=2, max_seq_len=48, progress=False,
                           expert_shard=shard)
        tokens = fresh.generate([random_tokens(5, seed=6), random_tokens(3, seed=7)], max_new_tokens=6)
        cache = fresh.moe.cache
        grouped = load_model(path, "cpu", num_slots=slots, max_batch=2, max_seq_len=48, progress=False,
                             expert_shard=shard)
        joined = torch.stack([g for _, g in grouped.join_many([random_tokens(5, seed=6), random_tokens(3, seed=7)])])
        torch.save({"logits": logits, "tokens": tokens, "joined": joined, "counters": cache.counters.copy(),
                    "key_of": cache.key_of.copy(), "experts": shard.experts}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _ranked(path, tmp_path, ranks: int, experts: int, slots: int) -> list[dict]:
    out = str(tmp_path / "rank")
    mp.start_processes(_rank_main, args=(ranks, str(path), f"file://{tmp_path / 'init'}", experts, slots, out),
                       nprocs=ranks, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(ranks)]


# a family's processes take seconds to start: two families that cover linear attention, a shared expert,
# grouped routing and a dense layer run by default (qwen3_next's 8 experts on 3 ranks: 3, 3 and 2 each),
# the rest in the long profile
SPAWNED = [pytest.param(name, 3 if name == "qwen3_next" else 2,
                        marks=() if name in ("qwen3_next", "glm4_moe") else pytest.mark.slow)
           for name in sorted(FAMILIES)]


@pytest.mark.parametrize("checkpoint, world", SPAWNED, indirect=["checkpoint"])
def test_ranks_match_one_rank_and_transformers(checkpoint, world, tmp_path):
    """float32 logits within 1e-4 of transformers' and greedy tokens identical to one rank's; every rank
    holds the same logits bit for bit; each rank's cache holds only its own keys, and the ranks' accesses
    add up to one rank's (each distinct expert of a call is one rank's)."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    ranks = _ranked(path, tmp_path, world, num_experts(model.config), slots=2 * k)
    seq = random_tokens(12, seed=5)
    assert_near(ranks[0]["logits"], hf_logits(model, seq).logits[0], rel=1e-4)
    assert all(torch.equal(ranks[0]["logits"], r["logits"]) for r in ranks[1:]), "the ranks diverged"
    one = load_model(path, "cpu", num_slots=2 * k, max_batch=2, max_seq_len=48, progress=False)
    want = one.generate([random_tokens(5, seed=6), random_tokens(3, seed=7)], max_new_tokens=6)
    assert all(r["tokens"] == want for r in ranks)
    single = load_model(path, "cpu", num_slots=2 * k, max_batch=2, max_seq_len=48, progress=False)
    alone = torch.stack([single.join(p)[1] for p in (random_tokens(5, seed=6), random_tokens(3, seed=7))])
    for r in ranks:  # two prompts joined in one pass over the ranks: one rank's joins one by one
        assert_near(r["joined"], alone, rel=1e-4)
        assert torch.equal(r["joined"].argmax(dim=-1), alone.argmax(dim=-1))
    counters = one.moe.cache.counters
    assert (sum(r["counters"][:, ACCESSES] for r in ranks) == counters[:, ACCESSES]).all()
    assert (ranks[0]["counters"][:, CALLS] == counters[:, CALLS]).all()
    for r in ranks:
        keys = r["key_of"][r["key_of"] >= 0]
        layers = counters.shape[0]
        assert len(keys) and (keys < layers * r["experts"]).all(), "a key outside the rank's L x E_r"


def test_shard_store_holds_the_ranks_rows(checkpoint):
    name, model, path = checkpoint
    weights = load_checkpoint(path, "cpu", progress=False)
    layers, experts = weights.spec.num_moe_layers, weights.spec.moe.num_experts
    seen = []
    for rank in range(RANKS):
        store = shard_store(weights.store, layers, ExpertShard(experts, RANKS, rank))
        rows = torch.from_numpy(rank_keys(layers, experts, RANKS, rank))
        kept = load_checkpoint(path, "cpu", progress=False, keys=rows.numpy()).store  # read that way at load
        for bank in weights.store.banks:  # every bank (biases too), row for row
            assert torch.equal(store.tensor(bank.name), weights.store.tensor(bank.name)[rows]), bank.name
            assert torch.equal(kept.tensor(bank.name), store.tensor(bank.name)), bank.name
        seen.append(rows.numpy())
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(layers * experts))


def test_expert_shard_refusals(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    experts = num_experts(model.config)
    with pytest.raises(ValueError, match="experts a layer"):
        load_model(path, "cpu", num_slots=k + 1, progress=False, expert_shard=ExpertShard(experts + 2, 2, 0))
    with pytest.raises(ValueError, match="--moe-miss-service copy"):
        load_model(path, "cpu", num_slots=k + 1, progress=False, miss_service="hybrid",
                   expert_shard=ExpertShard(experts, 2, 0))
    with pytest.raises(ValueError, match="rank must be"):
        ExpertShard(experts, 2, 2)
    with pytest.raises(ValueError, match="ranks must be"):
        ExpertShard(experts, experts + 1, 0)
    weights = load_checkpoint(path, "cpu", progress=False)
    for keys in ([], [0, 0], [-1], [weights.store.num_keys]):
        with pytest.raises(CheckpointError, match="keys must be distinct expert keys"):
            load_checkpoint(path, "cpu", progress=False, keys=keys)
    with pytest.raises(ValueError, match="shard the whole model's store"):
        shard_store(shard_store(weights.store, weights.spec.num_moe_layers, ExpertShard(experts, 2, 0)),
                    weights.spec.num_moe_layers, ExpertShard(experts, 2, 0))
