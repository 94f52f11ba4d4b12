"""moe.model.linear_attention against transformers' Qwen3NextGatedDeltaNet with the same random weights:
a prompt through the prefill, then tokens one at a time through decode (the step kernel on a GPU, its
torch reference on the CPU), against the module's outputs for the whole sequence at once (it is causal),
float32; a prompt split in two prefills; bad geometry named; the CPU decode never runs the Triton step,
whose result the torch step meets."""

from __future__ import annotations

import pytest
import torch

from moe.engine.linear_attention import LinearAttentionState, linear_attention_decode, linear_attention_prefill
from moe.model.linear_attention import LinearAttentionShape, LinearAttentionWeights
from tests.conftest import device_or_skip


def _module(hk, hv, seed):
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=48, linear_num_key_heads=hk, linear_num_value_heads=hv,
                          linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = mod.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():  # fresh random values everywhere (the init leaves some constant)
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    shape = LinearAttentionShape(hk, hv, 16, 8, 4, 1e-6)
    w = LinearAttentionWeights(layer.in_proj_qkvz.weight.detach(), layer.in_proj_ba.weight.detach(),
                               layer.conv1d.weight.detach().squeeze(1), layer.A_log.detach(),
                               layer.dt_bias.detach(), layer.norm.weight.detach(), layer.out_proj.weight.detach())
    return layer, shape, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hk, hv", [(2, 2), (1, 3)])
def test_prefill_then_decode_is_the_module(hk, hv, dtype):
    """float32 within float32 roundings; bf16 (the module and its parameters cast, as a bf16 checkpoint
    loads) within one bf16 unit in the last place of the largest output."""
    device, _ = device_or_skip()
    layer, shape, w = _module(hk, hv, seed=hv)
    layer = layer.to(dtype)
    x = torch.randn(2, 11, 48).to(dtype)
    with torch.no_grad():
        want = layer(x)  # [2, 11, 48], every position
    w = LinearAttentionWeights(*(t.to(dtype).to(device) for t in vars(w).values()))
    state = LinearAttentionState.zeros(shape, 2, dtype, device)
    got = [linear_attention_prefill(x[:, :7].to(device), w, shape, state)]
    for t in range(7, 11):
        got.append(linear_attention_decode(x[:, t].to(device), w, shape, state)[:, None])
    got = torch.cat(got, dim=1).cpu()
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


def test_two_prefills_are_one():
    layer, shape, w = _module(2, 4, seed=3)
    x = torch.randn(1, 20, 48)
    with torch.no_grad():
        want = layer(x)
    state = LinearAttentionState.zeros(shape, 1, torch.float32, "cpu")
    got = torch.cat([linear_attention_prefill(x[:, :2], w, shape, state, chunk=4),
                     linear_attention_prefill(x[:, 2:], w, shape, state, chunk=8)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bad_geometry_is_named():
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        LinearAttentionShape(2, 3, 16, 8, 4, 1e-6)
    with pytest.raises(ValueError, match="linear_conv_kernel"):
        LinearAttentionShape(2, 2, 16, 8, 0, 1e-6)


def test_cpu_decode_runs_the_torch_step_not_the_kernel(monkeypatch):
    """On CPU tensors linear_attention_decode advances the state with delta_rule_step_reference (the CPU
    backend launches no Triton kernel); that reference and the step kernel (Triton's interpreter on the
    CPU, CUDA on a GPU) agree on the output and the state."""
    import moe.engine.linear_attention as la
    from moe.kernels.delta_rule import delta_rule_step, delta_rule_step_reference

    layer, shape, w = _module(2, 4, seed=5)
    x = torch.randn(2, 3, 48)
    with torch.no_grad():
        want = layer(x)

    def no_kernel(*args, **kw):
        raise AssertionError("delta_rule_step (the Triton kernel) ran on CPU tensors")

    monkeypatch.setattr(la, "delta_rule_step", no_kernel)
    state = LinearAttentionState.zeros(shape, 2, torch.float32, "cpu")
    got = torch.stack([linear_attention_decode(x[:, t], w, shape, state) for t in range(3)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    device, _ = device_or_skip()
    gen = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 4, 8, generator=gen)
    g, beta = -torch.rand(2, 4, generator=gen), torch.rand(2, 4, generator=gen)
    s0 = torch.randn(2, 4, 16, 8, generator=gen)
    ref_state, dev_state = s0.clone(), s0.to(device)
    ref = delta_rule_step_reference(q, k, v, g, beta, ref_state)
    out = delta_rule_step(*(t.to(device) for t in (q, k, v, g, beta)), dev_state)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_state.cpu(), ref_state, rtol=1e-5, atol=1e-5)


def test_the_step_kernel_on_cpu_tensors_without_the_interpreter_names_the_fix(monkeypatch):
    from moe.kernels.delta_rule import delta_rule_step

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = k = torch.randn(1, 1, 16)
    v, g, beta, state = torch.randn(1, 1, 8), torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1, 1, 16, 8)
    with pytest.raises(RuntimeError, match="delta_rule_step.*TRITON_INTERPRET=1"):
        delta_rule_step(q, k, v, g, beta, state)
