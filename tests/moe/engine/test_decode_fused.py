"""The engine's fused decode step (Engine._decode_body_fused: residual adds fused into RMSNorm, q / k
norm + RoPE + cache write in one launch, split-K decode attention over each row's own length) against
its torch decode step, on the CPU under Triton's interpreter: two engines over the same weights, one
each way, rows of different lengths, every family (qwen2_moe with a shared expert and q/k/v bias;
qwen3_moe with q/k norms; qwen3_next with linear-attention layers around an output-gated, half-rotated
attention layer and float32 (1 + w) norms; olmoe with whole-projection q / k norms and clip_qkv; gpt_oss
with sinks, a sliding layer's ring and YaRN), float32 (greedy tokens identical, logits within 1e-4), float16 and
bfloat16 (GPU only: the interpreter truncates float32 -> bfloat16 casts where the GPU and torch round to
nearest, so on the CPU the two paths drift apart by design, not by error). In 16 bits every expert is
routed (top-k = E): the router's top-k is discontinuous, and the two paths' rounding differences flip an
expert where two router logits nearly tie (measured on the H200 at top-4 of 16: 3 of 36 bf16 steps, each
moving its logits by 8-14 % of the largest), a change of routing, not of the attention under test.
Also: a prompt prefilled in chunks against the same prompt in one pass."""

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
            "qwen3": {**BASE, "model_type": "qwen3_moe", "attention_bias": False},
            "qwen3_next": {**BASE, "model_type": "qwen3_next", "num_hidden_layers": 3,
                           "shared_expert_intermediate_size": 32,
                           "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                           "partial_rotary_factor": 0.5, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
            "olmoe": {**BASE, "model_type": "olmoe", "intermediate_size": 32, "norm_topk_prob": False,
                      "attention_bias": True, "clip_qkv": 1.0},
            # sliding (a ring of 4, which the prompts and steps pass) and full layers, sinks, YaRN
            "gpt_oss": {**BASE, "model_type": "gpt_oss", "num_local_experts": 16, "intermediate_size": 32,
                        "attention_bias": True, "swiglu_limit": 7.0, "sliding_window": 4,
                        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 512,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0,
                                            "original_max_position_embeddings": 16, "truncate": False}}}


def _engines(family, dtype, **overrides):
    device, gpu = device_or_skip()
    config = {**FAMILIES[family], "torch_dtype": dtype, **overrides}
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
    every = {} if dtype == "float32" else {"num_experts_per_tok": BASE["num_experts"]}
    torch_engine, fused_engine = _engines(family, dtype, **every)
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
    for a, b in zip(torch_engine.context_state(), fused_engine.context_state(), strict=True):
        tol = 1e-5 if dtype == "float32" else 2e-2
        assert (a.float() - b.float()).abs().max().item() <= tol * a.float().abs().max().item()
    assert torch.equal(torch_engine.kv.lengths, fused_engine.kv.lengths)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prompt_prefilled_in_chunks_is_the_prompt_prefilled_at_once(family):
    """Chunks of 3 tokens (a chunk attends to the row's cached positions before it) against one pass:
    the same logits for every prompt position within float32 rounding, the same KV cache, the same
    decode after it; prefill_chunk is checked."""
    device, _ = device_or_skip()
    engines = []
    for chunk in (4096, 3):
        weights = random_decoder({**FAMILIES[family], "torch_dtype": "float32"}, device, seed=12)
        engines.append(Engine(weights, make_backend(weights, 32, "lru", max_batch=2), max_batch=2, max_seq_len=24,
                              cuda_graphs=False, prefill_chunk=chunk))
    whole, chunked = engines
    prompts = [[3, 9, 27, 17, 51, 4, 40, 33, 12, 7, 61], [8, 1]]
    want = [whole.join(p)[1] for p in prompts]
    got = [chunked.join(p)[1] for p in prompts]
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    assert whole.kv.lengths.tolist() == chunked.kv.lengths.tolist() == [11, 2]
    for a, b in zip(whole.context_state(), chunked.context_state(), strict=True):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
    step = [e.decode_step([5, 6]) for e in engines]
    assert (step[0] - step[1]).abs().max().item() <= 1e-4 * step[0].abs().max().item()
    (every,) = chunked.prefill([prompts[0]], all_logits=True)  # the logits after every prompt token
    (want_every,) = whole.prefill([prompts[0]], all_logits=True)
    assert every.shape == (11, FAMILIES[family]["vocab_size"])
    assert (every - want_every).abs().max().item() <= 1e-5 * want_every.abs().max().item()
    with pytest.raises(ValueError, match="--prefill-chunk must be a whole number of tokens >= 1.*got 0"):
        Engine(whole.weights, whole.moe, prefill_chunk=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_32k_context_decodes_as_the_torch_step(family):
    """Rows of 32,760 and 1,000 cached tokens (random keys and values, the same in both engines): the
    fused step, its attention walking each row's own length, against the torch step's SDPA over the
    whole cache under a length mask; float32, logits within 1e-4, greedy identical, for 3 steps; then
    the fused step alone under a CUDA graph gives its eager logits bitwise. GPU only: 32K keys a row
    take minutes in the interpreter."""
    device = torch.device("cuda")
    lengths, max_len = [32760, 1000], 32768
    gen = torch.Generator(device=device).manual_seed(3)
    engines = []
    for fused in (False, True, True):
        weights = random_decoder({**FAMILIES[family], "torch_dtype": "float32"}, device, seed=13)
        engine = Engine(weights, make_backend(weights, 32, "lru", max_batch=2), max_batch=2, max_seq_len=max_len,
                        cuda_graphs=len(engines) == 2)
        engine._fused = fused
        engine.prefill([[3, 9, 27], [8, 1, 60]])
        engines.append(engine)
    for layer in engines[0].spec.full_layers:
        for cache in ("k", "v"):
            fill = torch.randn(engines[0].kv.k[layer].shape, generator=gen, device=device)
            for engine in engines:
                getattr(engine.kv, cache)[layer][:, :, 3:].copy_(fill[:, :, 3:])
    for engine in engines:
        engine.kv.lengths[:2] = torch.tensor(lengths, device=device)
        engine._lengths = list(lengths)
    tokens = torch.tensor([5, 7], device=device)
    for _ in range(3):
        want, got, graphed = (engine.decode_step(tokens) for engine in engines)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
        assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
        assert torch.equal(graphed, got)
        tokens = want.argmax(dim=-1)
    assert engines[2].graphs is not None and engines[2].graphs.batch_sizes == [2]
