"""The engine's fused decode step (Engine._decode_body_fused: residual adds fused into RMSNorm, q / k
norm + RoPE + cache write in one launch, split-K decode attention over each row's own length) against
its torch decode step, on the CPU under Triton's interpreter: two engines over the same weights, one
each way, rows of different lengths, both families (qwen2_moe with a shared expert and q/k/v bias;
qwen3_moe with q/k norms), float32 (greedy tokens identical, logits within 1e-4), float16 and
bfloat16 (GPU only: the interpreter truncates float32 -> bfloat16 casts where the GPU and torch round to
nearest, so on the CPU the two paths drift apart by design, not by error)."""

from __future__ import annotations

import pytest
import torch

from moe.engine.backends import make_backend
from moe.engine.engine import Engine
from moe.testing.random_decoder import random_decoder
from tests.conftest import device_or_skip

BASE = {"num_hidden_layers": 2, "hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-6}
FAMILIES = {"qwen2": {**BASE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 32, "qkv_bias": True},
            "qwen3": {**BASE, "model_type": "qwen3_moe", "attention_bias": False}}


def _engines(family, dtype):
    device, gpu = device_or_skip()
    config = {**FAMILIES[family], "torch_dtype": dtype}
    engines = []
    for fused in (False, True):
        weights = random_decoder(config, device, seed=11)
        engine = Engine(weights, make_backend(weights, 32, "lru", max_batch=2), max_batch=2, max_seq_len=24,
                        cuda_graphs=False)
        engine._fused = fused
        engines.append(engine)
    return engines


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_fused_step_is_the_torch_step(family, dtype):
    if dtype == "bfloat16" and not device_or_skip()[1]:
        pytest.skip("the interpreter truncates bfloat16 casts: checked on a GPU")
    torch_engine, fused_engine = _engines(family, dtype)
    prompts = [[3, 9, 27, 17, 51], [8, 1, 60]]  # rows of different lengths
    tokens = [e.prefill(prompts).argmax(dim=-1) for e in (torch_engine, fused_engine)]
    assert torch.equal(tokens[0], tokens[1])
    for _ in range(6):
        want = torch_engine.decode_step(tokens[0])
        got = fused_engine.decode_step(tokens[1])
        scale = want.abs().max().item()
        if dtype == "float32":
            assert (got - want).abs().max().item() <= 1e-4 * scale
            assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
        else:  # 16-bit rounding at every sublayer: the paths' sum orders may move a value by an ulp there
            assert (got - want).abs().max().item() <= 2e-2 * scale
        tokens = [want.argmax(dim=-1), want.argmax(dim=-1)]  # both fed the same tokens
    for a, b in zip(torch_engine.kv.k + torch_engine.kv.v, fused_engine.kv.k + fused_engine.kv.v):
        tol = 1e-5 if dtype == "float32" else 2e-2
        assert (a.float() - b.float()).abs().max().item() <= tol * a.float().abs().max().item()
    assert torch.equal(torch_engine.kv.lengths, fused_engine.kv.lengths)
