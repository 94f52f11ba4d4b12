"""The torch MoE reference against a brute-force per-token loop written the way transformers computes.

Legend: T = tokens, H = hidden, E = experts, k = top_k, I = expert width, Is = shared expert width.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moe.model.config import MoEConfig
from moe.model.reference import expert_mlp, moe_reference, route, shared_expert

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}  # (rtol, atol relative to max |out|)


def make_inputs(cfg: MoEConfig, tokens: int, dtype: torch.dtype, seed: int):
    """Fresh random, never-zero inputs scaled so every linear keeps unit variance."""
    g = torch.Generator().manual_seed(seed)
    h, e, i, s = cfg.hidden, cfg.num_experts, cfg.expert_intermediate, cfg.shared_intermediate

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype)

    hidden = rnd(tokens, h, fan_in=1)  # [T, H]
    router_w = rnd(e, h, fan_in=h / 4)  # [E, H]: sharp enough routing to separate the top-k
    gate_up = rnd(e, 2 * i, h, fan_in=h)  # [E, 2I, H]
    down = rnd(e, h, i, fan_in=i)  # [E, H, I]
    shared = (rnd(2 * s, h, fan_in=h), rnd(h, s, fan_in=s), rnd(1, h, fan_in=h)) if s else None
    return hidden, router_w, gate_up, down, shared


def brute_force(hidden, router_w, gate_up, down, cfg, shared):
    """Per token: float32 softmax, sort, top-k, renormalise; each expert's linears in the input dtype."""
    dt, i = hidden.dtype, cfg.expert_intermediate
    out = torch.empty_like(hidden)

    def mlp(x, w13, w2, width):
        return F.linear(F.silu(F.linear(x, w13[:width])) * F.linear(x, w13[width:]), w2)

    for t in range(hidden.shape[0]):
        x = hidden[t:t + 1]  # [1, H]
        logits = [float((x.float()[0] * router_w[e].float()).sum()) for e in range(cfg.num_experts)]
        peak = max(logits)
        probs = [math.exp(v - peak) for v in logits]
        probs = [p / sum(probs) for p in probs]
        chosen = sorted(range(cfg.num_experts), key=lambda e: -probs[e])[:cfg.top_k]
        norm = sum(probs[e] for e in chosen) if cfg.norm_topk_prob else 1.0
        acc = torch.zeros(1, cfg.hidden, dtype=dt)
        for e in chosen:
            acc = acc + (mlp(x, gate_up[e], down[e], i) * torch.tensor(probs[e] / norm).to(dt)).to(dt)
        if shared is not None:
            s_up, s_down, s_gate = shared
            acc = acc + torch.sigmoid(F.linear(x, s_gate)) * mlp(x, s_up, s_down, cfg.shared_intermediate)
        out[t] = acc[0]
    return out


CONFIGS = {
    "qwen2-shared": MoEConfig(hidden=64, num_experts=16, top_k=4, expert_intermediate=32,
                              shared_intermediate=48, norm_topk_prob=False),
    "qwen3-noshared": MoEConfig(hidden=64, num_experts=16, top_k=4, expert_intermediate=32,
                                norm_topk_prob=True),
    "mixtral": MoEConfig(hidden=48, num_experts=8, top_k=2, expert_intermediate=40, norm_topk_prob=True),
    "top1": MoEConfig(hidden=32, num_experts=4, top_k=1, expert_intermediate=16, shared_intermediate=16),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_matches_brute_force(name, dtype, seed):
    cfg = CONFIGS[name]
    hidden, router_w, gate_up, down, shared = make_inputs(cfg, tokens=7, dtype=dtype, seed=seed)
    got = moe_reference(hidden, router_w, gate_up, down, cfg, shared)
    want = brute_force(hidden, router_w, gate_up, down, cfg, shared)
    assert got.dtype == dtype and got.shape == hidden.shape
    assert want.abs().max() > 0.1  # a real signal, not a near-zero output
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * float(want.abs().max()))


@pytest.mark.parametrize("seed", range(4))
def test_route_weights_and_ids(seed):
    g = torch.Generator().manual_seed(seed)
    hidden, router_w = torch.randn(9, 32, generator=g), torch.randn(12, 32, generator=g)
    weights, ids = route(hidden, router_w, 3, norm_topk_prob=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and weights.shape == (9, 3)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    probs = torch.softmax(hidden @ router_w.T, -1)
    torch.testing.assert_close(probs.gather(1, ids.long()).max(-1).values, probs.max(-1).values)
    raw, raw_ids = route(hidden, router_w, 3, norm_topk_prob=False)
    assert torch.equal(raw_ids, ids) and bool((raw.sum(-1) < 1).all())
    torch.testing.assert_close(raw, probs.gather(1, ids.long()))


def test_route_rejects_bad_top_k_and_shape():
    hidden, router_w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k"):
        route(hidden, router_w, 5, True)
    with pytest.raises(ValueError, match="router_w"):
        route(hidden, torch.randn(4, 7), 2, True)


def test_expert_mlp_layout_gate_then_up():
    g = torch.Generator().manual_seed(5)
    x, w_gate, w_up, w_down = (torch.randn(*s, generator=g) for s in ((3, 8), (5, 8), (5, 8), (8, 5)))
    got = expert_mlp(x, torch.cat([w_gate, w_up]), w_down)
    torch.testing.assert_close(got, (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T)
    with pytest.raises(ValueError, match="w_down"):
        expert_mlp(x, torch.cat([w_gate, w_up]), w_down.T)
    with pytest.raises(ValueError, match="w_gate_up"):
        expert_mlp(x, w_gate, w_down)


def test_shared_expert_gate_effect():
    cfg = CONFIGS["qwen2-shared"]
    hidden, router_w, gate_up, down, (s_up, s_down, s_gate) = make_inputs(cfg, 5, torch.float32, seed=11)
    routed = moe_reference(hidden, router_w, gate_up, down,
                           MoEConfig(cfg.hidden, cfg.num_experts, cfg.top_k, cfg.expert_intermediate))
    plain = expert_mlp(hidden, s_up, s_down)  # [T, H], ungated
    contrib = {}
    for sign in (1, -1):
        out = moe_reference(hidden, router_w, gate_up, down, cfg, (s_up, s_down, sign * s_gate))
        contrib[sign] = out - routed
        gate = torch.sigmoid(sign * hidden @ s_gate.T)  # [T, 1]
        torch.testing.assert_close(contrib[sign], gate * plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(contrib[1] + contrib[-1], plain, rtol=1e-5, atol=1e-5)  # σ(z) + σ(-z) = 1
    big = moe_reference(hidden, router_w, gate_up, down, cfg, (s_up, s_down, 1e4 * s_gate))
    gate_on = (hidden @ s_gate.T > 0).float()  # saturated gate: all or nothing per token
    torch.testing.assert_close(big - routed, gate_on * plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(shared_expert(hidden, (s_up, s_down, s_gate)), contrib[1])


def test_no_shared_expert_is_routed_sum():
    cfg = CONFIGS["qwen3-noshared"]
    hidden, router_w, gate_up, down, shared = make_inputs(cfg, 6, torch.float32, seed=21)
    assert shared is None
    weights, ids = route(hidden, router_w, cfg.top_k, True)
    want = torch.stack([
        sum(weights[t, j] * expert_mlp(hidden[t:t + 1], gate_up[ids[t, j]], down[ids[t, j]])[0]
            for j in range(cfg.top_k))
        for t in range(6)])
    torch.testing.assert_close(moe_reference(hidden, router_w, gate_up, down, cfg), want)


def test_shape_and_presence_errors_name_argument():
    cfg = CONFIGS["qwen2-shared"]
    hidden, router_w, gate_up, down, shared = make_inputs(cfg, 3, torch.float32, seed=31)
    with pytest.raises(ValueError, match="shared"):
        moe_reference(hidden, router_w, gate_up, down, cfg)
    with pytest.raises(ValueError, match="shared"):
        moe_reference(hidden, router_w, gate_up, down, CONFIGS["qwen3-noshared"], shared)
    with pytest.raises(ValueError, match="experts_down"):
        moe_reference(hidden, router_w, gate_up, down.transpose(1, 2), cfg, shared)
    with pytest.raises(ValueError, match="router_w"):
        moe_reference(hidden, router_w[:-1], gate_up, down, cfg, shared)
    with pytest.raises(ValueError, match="hidden"):
        moe_reference(hidden[None], router_w, gate_up, down, cfg, shared)
