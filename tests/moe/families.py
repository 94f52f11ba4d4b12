"""The tiny random checkpoints of every family that the model and engine tests compare against transformers,
and the comparisons they share.

    FAMILIES[name] = (config class, model class, config fields beyond COMMON)
        ─tests/moe/conftest.py checkpoint fixture─► (name, transformers model, saved checkpoint directory)
    hf_logits / hf_run / hf_logits_and_router: transformers' logits and router choice scores
    assert_near: elementwise |got - ref| <= rel * (|ref| + max|ref|); routing_alike: the engine's experts
    against transformers' bf16 and float32 routers; broken_copy: a checkpoint with edited tensors or config
"""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "qwen2": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
              dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
              dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, head_dim=32, attention_bias=True,
                   tie_word_embeddings=True)),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   dict(num_hidden_layers=4, head_dim=32, partial_rotary_factor=0.5, num_experts=8,
                        num_experts_per_tok=3, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM,
                 dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                      routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, head_dim=16,
                      attention_bias=True, use_qk_norm=True)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM,
              dict(num_experts=16, num_experts_per_tok=4, intermediate_size=32, attention_bias=True)),
}
# fixes each family's index in the seeds as families are added
ORDER = ("qwen2", "qwen3", "qwen3_next", "glm4_moe", "mixtral", "olmoe")


def family_index(name: str) -> int:
    """The family's place in ORDER (its models' seeds depend on it, not on how many families sort before it)."""
    return ORDER.index(name)


EXPERT = ("mlp.experts.3.up_proj.weight", "block_sparse_moe.experts.3.w3.weight")  # the first MoE layer's (Mixtral: w3)


def num_experts(cfg) -> int:
    return {"glm4_moe": getattr(cfg, "n_routed_experts", 0),
            "mixtral": getattr(cfg, "num_local_experts", 0)}.get(cfg.model_type) or cfg.num_experts


def moe_layers(cfg) -> int:
    if cfg.model_type == "mixtral":
        return cfg.num_hidden_layers
    if cfg.model_type == "glm4_moe":
        return cfg.num_hidden_layers - cfg.first_k_dense_replace
    return cfg.num_hidden_layers - len(getattr(cfg, "mlp_only_layers", None) or [])


def hf_logits(model, tokens: list[int], **kw):
    with torch.no_grad():
        return model(torch.tensor([tokens]), **kw)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_near(got: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Elementwise |got - ref| <= rel * (|ref| + max|ref|)."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * scale)


def hf_run(model, seq: list[int]):
    """transformers' forward of one sequence: (its output, its router logits L_moe x [T, E]). The logits
    are recorded by hooks on GLM-4.5's routers (transformers 5.17 does not return them for it) and read
    from the output (output_router_logits) for the others."""
    ids = torch.tensor([seq], device=model.device)
    if model.config.model_type != "glm4_moe":
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        return out, list(out.router_logits)
    recorded = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda mod, args, out: recorded.append(out[0] if isinstance(out, tuple) else out))
             for g in gates]
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out, recorded


def router_choice(model, router_logits) -> torch.Tensor:
    """transformers' router logits (L_moe x [T, E]) as the scores whose top-k is its choice, [L_moe, T, E]
    float32: the logits themselves (softmax routers), or GLM-4.5's sigmoid scores plus each layer's
    e_score_correction_bias, -inf outside the topk_group groups whose two best such scores sum highest."""
    logits = torch.stack([r.float() for r in router_logits])
    cfg = model.config
    if cfg.model_type != "glm4_moe":
        return logits
    biases = [layer.mlp.gate.e_score_correction_bias.float() for layer in model.model.layers
              if hasattr(layer.mlp, "gate")]
    scores = torch.sigmoid(logits) + torch.stack(biases)[:, None, :]  # [L, T, E]
    grouped = scores.view(*scores.shape[:2], cfg.n_group, -1)
    worth = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [L, T, n_group]
    keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(-1, worth.topk(cfg.topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)


def hf_logits_and_router(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 logits [T, V] and router choice scores [L_moe, T, E] (router_choice) of one sequence."""
    out, router = hf_run(model, seq)
    return out.logits[0].float(), router_choice(model, router).to(out.logits.device)


def routing_alike(ids: torch.Tensor, router16: torch.Tensor, router32: torch.Tensor, k: int) -> bool:
    """ids [L, k] the engine routed one token to; router16 / router32 [L, E] transformers' bf16 / float32
    router choice scores for it (router_choice) -> True where every layer chose transformers' bf16 experts;
    False where the first layer that differs is explained: the engine chose the float32 router's experts there, or the
    gap it crossed (transformers' k-th bf16 logit less the lowest of the experts only the engine chose)
    is within twice transformers' own bf16 noise at that layer (max |router16 - router32|);
    AssertionError where it is not."""
    for layer in range(router16.shape[0]):
        theirs = set(router16[layer].topk(k).indices.tolist())
        mine = set(ids[layer].tolist())
        if mine != theirs:
            logits = router16[layer]
            gap = (logits.topk(k).values[-1] - logits[sorted(mine - theirs)].min()).item()
            noise = (router16[layer] - router32[layer]).abs().max().item()
            truth = set(router32[layer].topk(k).indices.tolist())
            assert mine == truth or gap <= 2 * noise, (layer, sorted(mine), sorted(theirs), sorted(truth), gap, noise)
            return False
    return True


def broken_copy(path, tmp_path, edit_tensors=None, edit_config=None):
    out = tmp_path / "broken"
    shutil.copytree(path, out)
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out
