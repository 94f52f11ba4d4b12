"""gpt-oss's MoE block in the torch references against transformers' GptOssMLP, on the CPU.

    GptOssMLP (float32, every parameter drawn; inputs scaled so the clamps of its SwiGLU bite)
        its weights in this project's layout: gate_up [E, 2I, H] = the interleaved columns of
        experts.gate_up_proj [E, H, 2I] split (gate = ::2, up = 1::2) and transposed, down [E, H, I],
        the biases split alike
    compared: moe_reference (route with the router bias, softmax over the top-k, experts with biases and
    the clamped SwiGLU), routed_reference over a pool in another slot order, moe_prefill streaming the
    experts from a HostStore with their bias banks: each within float32 rounding of transformers;
    MoEConfig.from_hf on transformers' own GptOssConfig; the GPU layer (MoELayer, under Triton's
    interpreter) call after call while it evicts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from expertcache.pool import Bank, HostStore, SlotPool
from moe.engine.backends import moe_prefill
from moe.engine.layer import MoELayer, SlotCache
from moe.kernels.routed import routed_reference
from moe.model.checkpoint import EXPERT_BIAS_BANKS, MoEWeights
from moe.model.config import MoEConfig
from moe.model.reference import gated_activation, moe_reference, route

H, I, E, K = 32, 24, 8, 3


@pytest.fixture(scope="module")
def block():
    """(transformers' GptOssMLP, MoEConfig, our tensors: router_w, router_b, gate_up, down, b_gate_up, b_down)."""
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    mlp = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    cfg = MoEConfig.from_hf({**config.to_dict(), "torch_dtype": "float32"})
    gu, gub = mlp.experts.gate_up_proj.detach(), mlp.experts.gate_up_proj_bias.detach()
    ours = (mlp.router.weight.detach(), mlp.router.bias.detach(),
            torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous(),  # [E, 2I, H]
            mlp.experts.down_proj.detach().transpose(1, 2).contiguous(),  # [E, H, I]
            torch.cat([gub[:, ::2], gub[:, 1::2]], dim=-1), mlp.experts.down_proj_bias.detach())
    return mlp, cfg, ours


def _hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)) * 2.0


def _theirs(mlp, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return mlp(x[None])[0][0]


def test_the_config_reads_gpt_oss_semantics():
    cfg = MoEConfig.from_hf({**GptOssConfig(swiglu_limit=5.0).to_dict(), "torch_dtype": "bfloat16"})
    assert (cfg.num_experts, cfg.top_k, cfg.expert_intermediate, cfg.shared_intermediate) == (128, 4, 2880, 0)
    assert cfg.norm_topk_prob and cfg.expert_bias and cfg.router_bias
    assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) == ("swiglu_clamped", 1.702, 5.0)
    with pytest.raises(ValueError, match="MoEConfig.activation='gelu' is not one of"):
        MoEConfig(hidden=8, num_experts=4, top_k=2, expert_intermediate=8, activation="gelu")
    with pytest.raises(ValueError, match="MoEConfig.swiglu_limit must be a finite number > 0"):
        MoEConfig(hidden=8, num_experts=4, top_k=2, expert_intermediate=8, swiglu_limit=float("inf"))


def test_moe_reference_is_gpt_oss_mlp(block):
    mlp, cfg, (rw, rb, gu, dn, bgu, bdn) = block
    x = _hidden(40, seed=1)
    got = moe_reference(x, rw, gu, dn, cfg, biases=(rb, bgu, bdn))
    torch.testing.assert_close(got, _theirs(mlp, x), rtol=1e-5, atol=1e-5)
    # the clamps are exercised: gate values above the limit and up values beyond it on both sides
    pre = torch.einsum("th,eoh->teo", x, gu) + bgu  # [T, E, 2I]
    assert (pre[..., :I] > cfg.swiglu_limit).any() and (pre[..., I:] > cfg.swiglu_limit).any()
    assert (pre[..., I:] < -cfg.swiglu_limit).any()
    with pytest.raises(ValueError, match="give biases exactly when"):
        moe_reference(x, rw, gu, dn, cfg)


def test_the_router_bias_changes_the_choice(block):
    mlp, cfg, (rw, rb, *_rest) = block
    x = _hidden(40, seed=2)
    _, with_bias = route(x, rw, K, True, rb)
    _, without = route(x, rw, K, True)
    with torch.no_grad():
        ref = torch.topk(mlp.router(x)[0], K, dim=-1).indices
    assert torch.equal(with_bias.long(), ref) and not torch.equal(without, with_bias)


def test_routed_reference_over_a_pool_with_bias_rows(block):
    mlp, cfg, (rw, rb, gu, dn, bgu, bdn) = block
    x = _hidden(6, seed=4)
    weights, ids = route(x, rw, K, True, rb)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(5))  # slot s holds expert perm[s]
    slot_of = torch.argsort(perm)
    got = routed_reference(x, slot_of[ids.long()].int(), weights, gu[perm], dn[perm], cfg=cfg,
                           gate_up_bias=bgu[perm], down_bias=bdn[perm])
    torch.testing.assert_close(got, _theirs(mlp, x), rtol=1e-5, atol=1e-5)


def test_moe_prefill_streams_the_experts_with_their_biases(block):
    mlp, cfg, (rw, rb, gu, dn, bgu, bdn) = block
    banks = cfg.format.expert_banks(H, I) + (Bank(EXPERT_BIAS_BANKS[0], (2 * I,), torch.float32),
                                             Bank(EXPERT_BIAS_BANKS[1], (H,), torch.float32))
    store = HostStore.empty(banks, E, pin=False)
    for name, t in (("gate_up", gu), ("down", dn), (EXPERT_BIAS_BANKS[0], bgu), (EXPERT_BIAS_BANKS[1], bdn)):
        store.tensor(name).copy_(t)
    x = _hidden(50, seed=6)
    got = moe_prefill(store, cfg, MoEWeights(0, rw, None, rb), x)
    torch.testing.assert_close(got, _theirs(mlp, x), rtol=1e-5, atol=1e-5)


def test_gated_activation_is_silu_by_default():
    gu = torch.randn(5, 2 * I, generator=torch.Generator().manual_seed(7)) * 4
    want = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    assert torch.equal(gated_activation(gu), want)
    assert torch.equal(gated_activation(gu, MoEConfig(hidden=8, num_experts=4, top_k=2, expert_intermediate=I)), want)


def test_the_gpu_layer_computes_the_block_while_evicting(block):
    """MoELayer (router with its bias, device ensure, miss copy of the experts and their bias rows, routed
    launches with biases and the clamped SwiGLU; Triton's interpreter on the CPU) equals GptOssMLP call
    after call, with 5 slots for 8 experts, so most calls evict."""
    mlp, cfg, (rw, rb, gu, dn, bgu, bdn) = block
    assert cfg.expert_banks() == cfg.format.expert_banks(H, I) + (Bank(EXPERT_BIAS_BANKS[0], (2 * I,), torch.float32),
                                                                   Bank(EXPERT_BIAS_BANKS[1], (H,), torch.float32))
    store = HostStore.empty(cfg.expert_banks(), E, pin=False)
    for name, t in (("gate_up", gu), ("down", dn), (EXPERT_BIAS_BANKS[0], bgu), (EXPERT_BIAS_BANKS[1], bdn)):
        store.tensor(name).copy_(t)
    slots = SlotCache(store, SlotPool(store.banks, 5, device="cpu"), 1, E, "lru")
    layer = MoELayer(cfg, 0, rw, slots, router_b=rb)
    misses = 0
    for step in range(6):
        x = _hidden(1, seed=10 + step)
        want = _theirs(mlp, x)  # float32 sums in another order: within 1e-5 of the output's scale
        torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
        misses = int(slots.cache.counters[0, 2])
    assert misses > K  # calls after the first evicted and copied bias rows back in
    with pytest.raises(ValueError, match=r"router_b must be given exactly when MoEConfig.router_bias"):
        MoELayer(cfg, 0, rw, slots)
    with pytest.raises(ValueError, match=r"router_b must be \[8\]"):
        MoELayer(cfg, 0, rw, slots, router_b=rb[:-1])
