"""GPU decode with the misses split between the slots and a CPU worker inside the decode graph."""

from __future__ import annotations

import pytest
import torch

from moe.engine.loading import load_model
from tests.moe.families import assert_near, hf_logits, random_tokens

pytestmark = pytest.mark.gpu


def _teacher_forced(engine, seq: list[int], prompt_len: int) -> torch.Tensor:
    out = [engine.prefill([seq[:prompt_len]], all_logits=True)[0]]
    out += [engine.decode_step([t]).float().cpu() for t in seq[prompt_len:]]
    return torch.cat([o.float().cpu() for o in out])


@pytest.mark.parametrize("service", ["hybrid", "cpu"])
def test_gpu_split_decode_matches_transformers_in_graphs_and_eager(checkpoint, service):
    """float32 logits within 1e-4 of transformers' with CUDA graphs and eager, bit for bit between the
    two, greedy tokens identical; the device served misses on the CPU."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    seq = random_tokens(12, seed=5)
    ref = hf_logits(model, seq).logits[0]
    got = {}
    for graphs in (True, False):
        engine = load_model(path, "cuda", num_slots=k + 1, max_seq_len=48, progress=False, miss_service=service,
                            cuda_graphs=graphs)
        got[graphs] = _teacher_forced(engine, seq, prompt_len=6)
        served = engine.moe.slots.cache.served.sum().item()
        assert served > 0
        engine.moe.slots.close()
    assert_near(got[True], ref, rel=1e-4)
    assert torch.equal(got[True], got[False])


def test_gpu_hybrid_same_tokens_every_run(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    prompt = random_tokens(5, seed=6)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                             pad_token_id=0)[0, len(prompt):].tolist()
    for _ in range(3):
        engine = load_model(path, "cuda", num_slots=k + 1, max_seq_len=48, progress=False, miss_service="hybrid")
        assert engine.generate([prompt], max_new_tokens=6) == [ref]
        engine.moe.slots.close()
