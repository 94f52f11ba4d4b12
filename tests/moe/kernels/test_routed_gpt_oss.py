"""The routed GEMM of gpt-oss's experts: per-slot biases after the gate_up and the down, and the clamped
SwiGLU, in the same two launches as the SiLU block (moe.kernels.routed, cfg / gate_up_bias / down_bias).

    random experts (dense bf16 / f32, or quantized: mxfp4 as gpt-oss ships them, fp8) + random biases
    routed_experts / routed_gate_up (all, hits + rest) + routed_down   (Triton: interpreter or GPU)
        vs routed_reference(cfg, biases) and a per-(token, expert) expert_mlp: |got - ref| <= rel * max|ref|,
        with inputs scaled so the clamps bite (gate above the limit, up beyond +-limit, both checked)
    bad biases and options refused by name; every variant compiles for sm_90 (no GPU needed)
GPU (`gpu`): gpt-oss-20b's expert shape (H = I = 2880, k = 4), bf16 and mxfp4, eager and graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from expertcache.formats import get_format
from moe.kernels.plan import QUANTIZED_ROUTED_TILES
from moe.kernels.routed import NO_SLOT, routed_down, routed_experts, routed_gate_up, routed_reference
from moe.model.config import MoEConfig
from moe.model.reference import expert_mlp
from tests.conftest import compile_check, device_or_skip
from tests.moe.kernels.test_routed import assert_close, make_pool, make_route
from tests.moe.kernels.test_routed_formats import make_pool as make_quantized_pool

OAI = MoEConfig(hidden=64, num_experts=12, top_k=4, expert_intermediate=32, norm_topk_prob=True,
                activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0, expert_bias=True, router_bias=True)


def make_biases(slots: int, hidden: int, inter: int, dtype, device, seed: int, scale: float = 1.0):
    """(gate_up_bias [S, 2I], down_bias [S, H]): random, never zero, `scale` times N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    b13, b2 = (scale * torch.randn(slots, n, generator=g) for n in (2 * inter, hidden))
    return tuple(torch.where(b == 0, 1e-3, b).to(dtype).to(device) for b in (b13, b2))


def case(dtype, tokens: int, seed: int, slots: int = 12, hidden: int = 64, inter: int = 32, top_k: int = 4,
         device=None):
    """hidden scaled by 6 so that a good share of the gate / up dots pass the clamp limit of 7."""
    device = device or device_or_skip()[0]
    gate_up, down = make_pool(slots, hidden, inter, dtype, device, seed)
    s, w = make_route(tokens, top_k, slots, device, seed + 1, pad=1)
    x = (6 * torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 2))).to(dtype).to(device)
    b13, b2 = make_biases(slots, hidden, inter, dtype, device, seed + 3, scale=2.0)
    return x, s, w, gate_up, down, b13, b2


def per_pair(x, slots, weights, gate_up, down, b13, b2, cfg) -> torch.Tensor:
    """Σ_j weights[t, j] * expert_mlp(x[t], expert slots[t, j], its biases) in float32, pair by pair."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if 0 <= s < gate_up.shape[0]:
                out[t] += float(weights[t, j]) * expert_mlp(x[t:t + 1], gate_up[s], down[s], cfg, b13[s], b2[s])[0]
    return out


def clamp_share(x, slots, gate_up, b13, limit: float) -> tuple[float, float]:
    """Shares of the live pairs' gate dots above `limit` and up dots beyond +-limit (bias included)."""
    live = slots.view(-1)[slots.view(-1) >= 0].long()
    tok = torch.arange(slots.shape[0], device=x.device).repeat_interleave(slots.shape[1])[slots.view(-1) >= 0]
    gu = torch.einsum("nih,nh->ni", gate_up[live].float(), x[tok].float()) + b13[live].float()
    inter = gu.shape[1] // 2
    return (gu[:, :inter] > limit).float().mean().item(), (gu[:, inter:].abs() > limit).float().mean().item()


@pytest.mark.parametrize("dtype, tokens", [(torch.bfloat16, 1), (torch.bfloat16, 5), (torch.float32, 3)])
def test_clamped_swiglu_with_biases_matches_the_references(dtype, tokens):
    x, s, w, gate_up, down, b13, b2 = case(dtype, tokens, seed=tokens)
    above, beyond = clamp_share(x, s, gate_up, b13, OAI.swiglu_limit)
    assert 0.05 < above < 0.95 and 0.05 < beyond < 0.95, (above, beyond)  # both clamps bite, not everywhere
    got = routed_experts(x, s, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2)
    assert_close(got, routed_reference(x, s, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2), 1e-4)
    assert_close(got, per_pair(x, s, w, gate_up, down, b13, b2, OAI), 1e-4)
    plain = routed_experts(x, s, w, gate_up, down)
    assert (got - plain).abs().max() > 0.1 * plain.abs().max()  # the options change the result


def test_each_option_alone_matches_the_reference():
    """Biases with SiLU, and the clamped SwiGLU without biases: each option is its own constexpr."""
    x, s, w, gate_up, down, b13, b2 = case(torch.bfloat16, 4, seed=21)
    silu = MoEConfig(hidden=64, num_experts=12, top_k=4, expert_intermediate=32)
    for cfg, biases in ((silu, {"gate_up_bias": b13, "down_bias": b2}), (OAI, {}), (None, {"gate_up_bias": b13})):
        got = routed_experts(x, s, w, gate_up, down, cfg=cfg, **biases)
        assert_close(got, routed_reference(x, s, w, gate_up, down, cfg=cfg, **biases), 1e-4)


def test_padding_adds_nothing_not_even_a_bias():
    """A pair without a slot contributes neither its down bias nor anything else."""
    x, s, w, gate_up, down, b13, b2 = case(torch.bfloat16, 2, seed=31)
    empty = torch.full_like(s, NO_SLOT)
    got = routed_experts(x, empty, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2)
    assert torch.equal(got, torch.zeros_like(got))


def test_hits_then_rest_equal_one_gate_up_and_the_down_bias_follows_the_weights():
    x, s, w, gate_up, down, b13, b2 = case(torch.bfloat16, 6, seed=41)
    pre = torch.where(torch.arange(s.numel(), device=s.device).view(s.shape) % 3 == 0, s, NO_SLOT)
    one = routed_gate_up(x, s, w, gate_up, cfg=OAI, gate_up_bias=b13).clone()
    act = torch.full_like(one, float("nan"))
    routed_gate_up(x, pre, w, gate_up, act=act, part="hits", pre=pre, cfg=OAI, gate_up_bias=b13)
    routed_gate_up(x, s, w, gate_up, act=act, part="rest", pre=pre, cfg=OAI, gate_up_bias=b13)
    assert torch.equal(act[:one.shape[0]], one)
    y = routed_down(one, s, down, down_bias=b2, weights=w)
    assert torch.equal(y, routed_experts(x, s, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2))
    doubled = routed_down(one, s, down, down_bias=b2, weights=2 * w)  # the bias term scales with the weights
    bias_term = (w[..., None] * torch.where(s[..., None] >= 0, b2[s.clamp(min=0).long()].float(), 0.0)).sum(1)
    assert_close(doubled - y, bias_term, 1e-5)


@pytest.mark.parametrize("name", ["mxfp4", "fp8"])
def test_quantized_experts_with_biases_match_the_reference_of_the_same_bytes(name):
    device, _ = device_or_skip()
    gate_up, down = make_quantized_pool(get_format(name), 6, 128, 64, device, seed=51)
    s, w = make_route(3, 4, 6, device, seed=52, pad=1)
    x = (6 * torch.randn(3, 128, generator=torch.Generator().manual_seed(53))).bfloat16().to(device)
    b13, b2 = make_biases(6, 128, 64, torch.bfloat16, device, seed=54, scale=2.0)
    got = routed_experts(x, s, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2,
                         tiles=QUANTIZED_ROUTED_TILES)
    want = routed_reference(x, s, w, gate_up, down, cfg=OAI, gate_up_bias=b13, down_bias=b2)
    assert_close(got, want, 1e-4)


@pytest.mark.parametrize("name, kwargs, match", [
    ("gate_up_bias shape", {"gate_up_bias": "short"}, r"gate_up_bias must be \[12, 64\]"),
    ("down_bias shape", {"down_bias": "short"}, r"down_bias must be \[12, 64\]"),
    ("cfg type", {"cfg": "swiglu"}, r"cfg must be a MoEConfig"),
])
def test_bad_biases_and_cfg_are_named(name, kwargs, match):
    x, s, w, gate_up, down, b13, b2 = case(torch.bfloat16, 2, seed=61)
    args = {k: ({"gate_up_bias": b13, "down_bias": b2}[k][:-1] if v == "short" else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        routed_experts(x, s, w, gate_up, down, **args)


def test_down_bias_needs_the_weights_and_the_shared_expert_takes_no_options():
    x, s, w, gate_up, down, b13, b2 = case(torch.bfloat16, 2, seed=71)
    act = routed_gate_up(x, s, w, gate_up)
    with pytest.raises(ValueError, match=r"down_bias needs weights"):
        routed_down(act, s, down, down_bias=b2)
    with pytest.raises(ValueError, match=r"weights are read only with down_bias"):
        routed_down(act, s, down, weights=w)
    one = torch.zeros((2, 1), dtype=torch.int32, device=x.device)
    gate_w = torch.randn(1, 64).bfloat16().to(x.device)
    with pytest.raises(ValueError, match=r"shared expert \(gate_w or shared=True\) is a SiLU block"):
        routed_experts(x, one, None, gate_up[:1], down[:1], gate_w=gate_w, cfg=OAI)
    with pytest.raises(ValueError, match=r"shared expert \(gate_w or shared=True\) is a SiLU block"):
        routed_experts(x, one, None, gate_up[:1], down[:1], gate_w=gate_w, gate_up_bias=b13[:1])
    ones = torch.ones((2, 1), device=x.device)
    with pytest.raises(ValueError, match=r"shared expert \(gate_w or shared=True\) is a SiLU block"):
        routed_experts(x, one, ones, gate_up[:1], down[:1], shared=True, cfg=OAI)


SM90_OAI = r"""
import json
from moe.kernels.plan import QUANTIZED_ROUTED_TILES
from moe.kernels.routed_host import compile_for_target
from moe.model.config import MoEConfig
cfg = MoEConfig(hidden=2880, num_experts=32, top_k=4, expert_intermediate=2880, activation="swiglu_clamped",
                expert_bias=True, router_bias=True)
out = {}
for fmt in (None, "mxfp4"):
    tiles = {} if fmt is None else {"tiles": QUANTIZED_ROUTED_TILES}
    asm = compile_for_target(4, 2880, 2880, "bf16", expert_format=fmt, cfg=cfg, expert_bias=True, **tiles)
    out[str(fmt)] = sorted(name for name, a in asm.items() if a.get("cubin"))
print(json.dumps(out))
"""


def test_gpt_oss_variants_compile_for_sm90():
    """Every variant the layer launches with biases and the clamped SwiGLU, dense and mxfp4, at gpt-oss-20b's
    expert shape (a child process without the interpreter)."""
    names = ["_down_kernel", "_down_kernel+combine", "_gate_up_hits", "_gate_up_kernel", "_gate_up_kernel+rest",
             "_shared_down", "_shared_gate_up"]
    assert compile_check(SM90_OAI) == {"None": names, "mxfp4": names}


# ---------------------------------------------------------------- GPU: gpt-oss-20b's expert shape

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "mxfp4"])
def test_gpu_gpt_oss_20b_shape_eager_and_graph(name):
    hidden = inter = 2880
    cfg = MoEConfig(hidden=hidden, num_experts=32, top_k=4, expert_intermediate=inter, activation="swiglu_clamped",
                    expert_bias=True, router_bias=True)
    if name == "bf16":
        gate_up, down = make_pool(24, hidden, inter, torch.bfloat16, "cuda", seed=81)
        tiles = {}
    else:
        gate_up, down = make_quantized_pool(get_format("mxfp4"), 24, hidden, inter, "cuda", seed=81)
        tiles = {"tiles": QUANTIZED_ROUTED_TILES}
    b13, b2 = make_biases(24, hidden, inter, torch.bfloat16, "cuda", seed=82, scale=2.0)
    for tokens in (1, 2, 8):
        s, w = make_route(tokens, 4, 24, "cuda", seed=83 + tokens, pad=1)
        x = (6 * torch.randn(tokens, hidden, device="cuda")).bfloat16()
        opts = {"cfg": cfg, "gate_up_bias": b13, "down_bias": b2, **tiles}
        got = routed_experts(x, s, w, gate_up, down, **opts)
        assert_close(got, routed_reference(x, s, w, gate_up, down, cfg=cfg, gate_up_bias=b13, down_bias=b2), 1e-3)
        out = torch.empty_like(got)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            routed_experts(x, s, w, gate_up, down, out=out, **opts)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)
        assert math.isfinite(out.abs().max().item())
