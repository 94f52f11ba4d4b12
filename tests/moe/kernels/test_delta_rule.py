"""moe.kernels.delta_rule: the reference recurrence against transformers' Qwen3-Next implementation (its
torch recurrent and chunked forms), the chunked prefill and the decode kernel against the reference, on
fresh random inputs with a random initial state and grouped value heads; bad arguments named.
CPU: the kernel under Triton's interpreter; all float32, so within a few float32 roundings."""

from __future__ import annotations

import pytest
import torch

from moe.kernels.delta_rule import block_v_for, delta_rule_chunked, delta_rule_reference, delta_rule_step
from tests.conftest import device_or_skip


def _inputs(b, t, hk, hv, dk, dv, seed, dtype=torch.float32):
    """q, k, v, g (log decays, <= 0), beta in (0, 1), and an initial state, as the layer makes them."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(b, t, hv, generator=gen)) * torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen).to(dtype)
    state = 0.3 * torch.randn(b, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _transformers():
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return module.torch_recurrent_gated_delta_rule, module.torch_chunk_gated_delta_rule


@pytest.mark.parametrize("hk, hv", [(2, 2), (2, 6)])
def test_reference_is_the_checkpoints_recurrence(hk, hv):
    recurrent, chunked = _transformers()
    q, k, v, g, beta, state = _inputs(2, 9, hk, hv, 16, 8, seed=hv)
    o, s = delta_rule_reference(q, k, v, g, beta, state)
    # the layer repeats each key head for its value heads before these (transformers 5.17's need it)
    qr, kr = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    for fn in (recurrent, chunked):
        want_o, want_s = fn(qr, kr, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, want_o.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, want_s.float(), rtol=1e-5, atol=1e-5)
    o0, _ = delta_rule_reference(q, k, v, g, beta)  # no state: zeros
    want_o, _ = recurrent(qr, kr, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o0, want_o.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, chunk", [(1, 64), (7, 3), (64, 64), (100, 16), (130, 64)])
def test_chunked_is_the_recurrence(t, chunk):
    q, k, v, g, beta, state = _inputs(2, t, 2, 4, 32, 16, seed=t)
    before = state.clone()
    o, s = delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    want_o, want_s = delta_rule_reference(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, want_s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 32, 16), (1, 3, 16, 40)])
def test_step_kernel_is_the_reference(dtype, hk, hv, dk, dv):
    """Six decode steps through the kernel, the state advanced in place, against the reference's
    outputs and final state from the same bf16 or float32 inputs."""
    device, _ = device_or_skip()
    q, k, v, g, beta, state = _inputs(3, 6, hk, hv, dk, dv, seed=dk + dv, dtype=dtype)
    want_o, want_s = delta_rule_reference(q, k, v, g, beta, state)
    s = state.to(device)
    for i in range(6):
        args = (x[:, i].contiguous().to(device) for x in (q, k, v, g, beta))
        o = delta_rule_step(*args, s, block_v=16)
        torch.testing.assert_close(o.cpu(), want_o[:, i], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-4, atol=1e-4)


def test_block_v_keeps_the_gpu_busy():
    assert [block_v_for(b, 32, 128) for b in (1, 4, 16, 64)] == [16, 32, 64, 64]
    assert block_v_for(1, 4, 40) == 16


def test_bad_arguments_are_named():
    q, k, v, g, beta = (x[:, 0].contiguous() for x in _inputs(2, 1, 2, 4, 16, 8, seed=1)[:5])
    state = torch.zeros(2, 4, 16, 8)
    with pytest.raises(ValueError, match="q and k"):
        delta_rule_step(q, k[:, :1].contiguous(), v, g, beta, state)
    with pytest.raises(ValueError, match="Hv a multiple"):
        delta_rule_step(q, k, v[:, :3].contiguous(), g[:, :3].contiguous(), beta[:, :3].contiguous(), state[:, :3])
    with pytest.raises(ValueError, match="beta must be"):
        delta_rule_step(q, k, v, g, beta[:, :2].contiguous(), state)
    with pytest.raises(ValueError, match="state must be a float32"):
        delta_rule_step(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match="power of two"):
        delta_rule_step(q[..., :12].contiguous(), k[..., :12].contiguous(), v, g, beta, state[:, :, :12].contiguous())
    with pytest.raises(ValueError, match="chunk must be"):
        delta_rule_chunked(*(x[:, None] for x in (q, k, v, g, beta)), chunk=0)
