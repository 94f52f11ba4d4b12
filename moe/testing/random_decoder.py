"""A random-weight decoder at a given geometry, ready for moe.engine.engine.Engine (benchmarks, tests).

    config.json-like dict ──ModelSpec.from_hf──► spec (qwen2_moe family: RMSNorm, RoPE, GQA attention,
                                                       sigmoid-gated shared expert)
    spec, device, seed ──random_decoder──► ModelWeights
        MoE blocks: moe.testing.synthetic.random_weights (router [L_moe, E, H], shared experts, HostStore of
                    every routed expert, pinned where CUDA is present)
        attention q / k / v / o, embedding, lm_head: N(0, 1/fan_in) on `device` (embedding N(0, 1));
        norms 1

`qwen3_next(num_layers)` is Qwen3-Next-80B-A3B's own decoder (model_type qwen3_next): every fourth layer
gated full attention (16 query heads, 2 KV heads, head_dim 256, a quarter rotated), the others Gated
DeltaNet linear attention (16 key / 32 value heads of 128, conv kernel 4), (1 + w) norms, every layer an
MoE layer of 512 experts (I 512, top-10) and a shared expert of 512.
`gpt_oss_20b(num_layers)` is gpt-oss-20b's decoder (model_type gpt_oss, its block's biases, clamped
SwiGLU, sinks and sliding windows; random norms stay 1).
`glm_4_5_air(num_layers)` is GLM-4.5-Air's decoder (model_type glm4_moe), every layer MoE.
`mixtral_8x7b(num_layers)` and `olmoe_1b_7b(num_layers)` are those releases' decoders.
`qwen3_next_like(num_layers)` is the MoE geometry of Qwen3-Next-80B-A3B (H 2048, 512 experts of
I 512, top-10, one shared expert of 512, bf16) with standard attention (16 query heads, 2 KV heads,
head_dim 128) in place of its linear / gated attention, and every layer an MoE layer. The
vocabulary defaults to 32768 rather than 151936 so the lm_head GEMV (V * H * 2 bytes per step) stays
small next to the MoE layers the simulator models; pass vocab_size to change it.
Legend: L_moe = MoE layers, E = experts, H = hidden, I = expert width, V = vocab.
"""

from __future__ import annotations

from typing import Any

import torch

from moe.model.checkpoint import TORCH_DTYPES, AttentionWeights, DenseWeights, LayerWeights, ModelWeights, MoEWeights
from moe.model.linear_attention import LinearAttentionWeights
from moe.model.spec import LINEAR, ModelSpec
from moe.testing.synthetic import random_weights


def qwen3_next_like(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of the Qwen3-Next-like decoder described in the module docstring."""
    return {"model_type": "qwen2_moe", "num_hidden_layers": num_layers, "hidden_size": 2048,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "intermediate_size": 5120,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "qkv_bias": False,
            "vocab_size": vocab_size, "rope_theta": 1e7, "rms_norm_eps": 1e-6, "torch_dtype": dtype,
            "tie_word_embeddings": False}


def qwen3_next(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of Qwen3-Next-80B-A3B's decoder (module docstring), `num_layers` layers deep
    (every fourth full attention), the vocabulary cut to `vocab_size`."""
    return {"model_type": "qwen3_next", "num_hidden_layers": num_layers, "hidden_size": 2048,
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "intermediate_size": 5120,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
            "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "vocab_size": vocab_size, "rope_theta": 1e7, "rms_norm_eps": 1e-6, "torch_dtype": dtype,
            "tie_word_embeddings": False}


def _randn(shape, std: float, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float32, device=device, generator=gen) * std).to(dtype)


def _norm(spec: ModelSpec, n: int, dtype, device, gen) -> torch.Tensor:
    """An RMSNorm weight: ones, or for (1 + w) norms the float32 1 + w with w ~ 0.1 N(0, 1) drawn in the
    model dtype (as the loader stores it)."""
    if not spec.norm_one_plus:  # gpt-oss multiplies in float32: its weights are stored so (the loader's)
        return torch.ones(n, dtype=torch.float32 if spec.norm_float32 else dtype, device=device)
    return 1.0 + _randn((n,), 0.1, dtype, device, gen).float()


def _attention(spec: ModelSpec, dtype, device, gen) -> AttentionWeights:
    h, d = spec.hidden, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    bias = (lambda n: _randn((n,), 0.02, dtype, device, gen)) if spec.qkv_bias else (lambda n: None)
    full = spec.qk_norm_full  # OLMoE's norms span the whole projection, the others' one head
    norm = (lambda n: _norm(spec, n, dtype, device, gen)) if spec.qk_norm or full else (lambda n: None)
    gate = _randn((q_rows, h), h ** -0.5, dtype, device, gen) if spec.attn_gate else None
    return AttentionWeights(
        q=_randn((q_rows, h), h**-0.5, dtype, device, gen),
        k=_randn((kv_rows, h), h**-0.5, dtype, device, gen),
        v=_randn((kv_rows, h), h**-0.5, dtype, device, gen),
        o=_randn((h, q_rows), q_rows**-0.5, dtype, device, gen),
        q_bias=bias(q_rows),
        k_bias=bias(kv_rows),
        v_bias=bias(kv_rows),
        o_bias=bias(h) if spec.o_bias else None,
        q_norm=norm(q_rows if full else d),
        k_norm=norm(kv_rows if full else d),
        gate=gate,
        gate_bias=bias(q_rows) if gate is not None else None,
        sinks=_randn((spec.num_heads,), 1.0, dtype, device, gen) if spec.sinks else None,
    )


def _linear_attention(spec: ModelSpec, dtype, device, gen) -> LinearAttentionWeights:
    """Gated DeltaNet weights: projections N(0, 1/fan_in), conv taps N(0, 1/K), decay rates A = e^A_log
    uniform in [1, 16) as transformers initialises them, dt_bias 1, the gated norm's weight 1."""
    s, h = spec.linear, spec.hidden
    kd, vd = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    a = torch.rand(s.value_heads, device=device, generator=gen) * 15 + 1
    return LinearAttentionWeights(
        in_proj_qkvz=_randn((2 * kd + 2 * vd, h), h ** -0.5, dtype, device, gen),
        in_proj_ba=_randn((2 * s.value_heads, h), h ** -0.5, dtype, device, gen),
        conv_w=_randn((s.channels, s.conv_kernel), s.conv_kernel ** -0.5, dtype, device, gen),
        a_log=a.log().to(dtype), dt_bias=torch.ones(s.value_heads, dtype=dtype, device=device),
        norm_w=torch.ones(s.value_dim, dtype=dtype, device=device),
        out_proj=_randn((h, vd), vd ** -0.5, dtype, device, gen))


def qwen3_30b_like(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict at Qwen3-30B-A3B's geometry (qwen3_moe: H 2048, 128 experts of I 768, top-8,
    no shared expert, norm_topk_prob; attention 32 / 4 heads of 128 with q/k norms), every layer MoE,
    the vocabulary cut to `vocab_size` as qwen3_next_like does."""
    return {"model_type": "qwen3_moe", "num_hidden_layers": num_layers, "hidden_size": 2048, "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
            "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "attention_bias": False, "vocab_size": vocab_size, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
            "torch_dtype": dtype, "tie_word_embeddings": False}


def flame_290m_like(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict with FLAME-MoE-290M's MoE block (H 1024, 64 experts of I 704, top-6, a shared
    expert of I 1408), so its real routing trace (../shared/traces/flame-290m-a.npz) can drive the
    engine: qwen2_moe (FLAME's two ungated shared experts become one gated expert of their width),
    attention 16 / 16 heads of 64, the vocabulary cut to `vocab_size`."""
    return {**qwen3_next_like(num_layers, vocab_size=vocab_size, dtype=dtype), "hidden_size": 1024,
            "num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 704,
            "shared_expert_intermediate_size": 1408, "norm_topk_prob": False, "intermediate_size": 2816,
            "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64, "rope_theta": 1e4}


def gpt_oss_20b(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of gpt-oss-20b's decoder (model_type gpt_oss: H 2880, 32 experts of I 2880,
    top-4, router and expert biases, the clamped SwiGLU; attention 64 / 8 heads of 64 with biases and
    sinks, sliding (window 128) and full layers alternating, YaRN rope), `num_layers` layers deep, the
    vocabulary cut to `vocab_size` (the release's: 201088)."""
    return {"model_type": "gpt_oss", "num_hidden_layers": num_layers, "hidden_size": 2880,
            "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
            "layer_types": ["sliding_attention" if j % 2 == 0 else "full_attention" for j in range(num_layers)],
            "attention_bias": True, "swiglu_limit": 7.0, "vocab_size": vocab_size, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "torch_dtype": dtype, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}}


def glm_4_5_air(num_layers: int = 8, *, vocab_size: int = 32768, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of GLM-4.5-Air's decoder (model_type glm4_moe: H 4096, 128 experts of I 1408,
    top-8 by sigmoid scores with a correction bias, one ungated shared expert of 1408; attention 96 / 8
    heads of 128 with q / k / v biases, half of each head rotated), `num_layers` layers deep and every
    one an MoE layer (the release's first layer is dense), the vocabulary cut to `vocab_size` (151552)."""
    return {"model_type": "glm4_moe", "num_hidden_layers": num_layers, "hidden_size": 4096,
            "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "norm_topk_prob": True,
            "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
            "use_qk_norm": False, "vocab_size": vocab_size, "rms_norm_eps": 1e-5, "torch_dtype": dtype,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}


def mixtral_8x7b(num_layers: int = 4, *, vocab_size: int = 32000, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of Mixtral-8x7B's decoder (model_type mixtral: H 4096, 8 experts of I 14336, top-2,
    softmax over the top-k; attention 32 / 8 heads of 128, no sliding window as the releases), `num_layers`
    layers deep (the release's 32), its own vocabulary of 32000."""
    return {"model_type": "mixtral", "num_hidden_layers": num_layers, "hidden_size": 4096,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "sliding_window": None,
            "vocab_size": vocab_size, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "torch_dtype": dtype,
            "tie_word_embeddings": False}


def olmoe_1b_7b(num_layers: int = 16, *, vocab_size: int = 50304, dtype: str = "bfloat16") -> dict[str, Any]:
    """A config.json dict of OLMoE-1B-7B's decoder (model_type olmoe: H 2048, 64 experts of I 1024, top-8,
    no renormalisation; attention 16 / 16 heads of 128 with whole-projection q / k norms), all of its 16
    layers by default, its own vocabulary of 50304."""
    return {"model_type": "olmoe", "num_hidden_layers": num_layers, "hidden_size": 2048,
            "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
            "num_attention_heads": 16, "num_key_value_heads": 16, "clip_qkv": None, "vocab_size": vocab_size,
            "rope_theta": 1e4, "rms_norm_eps": 1e-5, "torch_dtype": dtype, "tie_word_embeddings": False}


def random_decoder(
    config: dict[str, Any],
    device: str | torch.device = "cuda",
    *,
    seed: int = 0,
    pin: bool | None = None,
    copy_overlap: bool = False,
    expert_format: str | None = None,
) -> ModelWeights:
    """Random ModelWeights for a config.json dict (qwen2_moe / qwen3_moe / qwen3_next / gpt_oss / glm4_moe / mixtral /
    olmoe keys; see moe.model.spec).

    device: where everything but the routed experts goes; the routed experts go to a HostStore
    (pinned when `pin`, default: when CUDA is available), in `expert_format` (an expertcache.formats
    name; default the model dtype's): the same random experts, quantized on `device`. Deterministic
    for (config, device, seed). Cost: one device randn per tensor, one host copy per 64 experts; host
    memory L_moe * E experts of the format's bytes. Raises CheckpointError naming a bad config key
    (ModelSpec.from_hf).
    """
    device = torch.device(device)
    spec = ModelSpec.from_hf(config, copy_overlap=copy_overlap, expert_format=expert_format)
    dtype = TORCH_DTYPES[spec.dtype]
    moe = random_weights(spec.moe, spec.num_moe_layers, device, seed=seed, pin=pin)
    gen = torch.Generator(device).manual_seed(seed + 1)
    h, v = spec.hidden, spec.vocab_size
    layers = []
    for layer in range(spec.num_layers):
        if spec.sparse[layer]:
            m = spec.moe_index(layer)
            mlp = MoEWeights(m, moe.router[m], None if moe.shared is None else moe.shared[m],
                             None if moe.router_bias is None else moe.router_bias[m],
                             None if moe.score_bias is None else moe.score_bias[m])
        else:
            i = spec.dense_intermediate
            mlp = DenseWeights(_randn((2 * i, h), h ** -0.5, dtype, device, gen),
                               _randn((h, i), i ** -0.5, dtype, device, gen))
        mixer = (_linear_attention(spec, dtype, device, gen) if spec.layer_types[layer] == LINEAR
                 else _attention(spec, dtype, device, gen))
        layers.append(LayerWeights(_norm(spec, h, dtype, device, gen), _norm(spec, h, dtype, device, gen), mixer,
                                   mlp))
    embed = _randn((v, h), 1.0, dtype, device, gen)
    lm_head = embed if spec.tie_word_embeddings else _randn((v, h), h ** -0.5, dtype, device, gen)
    return ModelWeights(spec, embed, _norm(spec, h, dtype, device, gen), lm_head, layers, moe.store, device)
