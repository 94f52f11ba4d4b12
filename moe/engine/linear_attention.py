"""Qwen3-Next's linear-attention layer (Gated DeltaNet): prefill and decode in torch around
moe.kernels.delta_rule, with the per-sequence state that replaces a KV cache.

    hidden [B, T, H] ─ in_proj_qkvz ─► per key head: q, k [Dk], then its Hv / Hk value heads' v, z [Dv]
                     ─ in_proj_ba   ─► per key head: its value heads' b, then a
    q | k | v (C = 2 Hk Dk + Hv Dv channels) ─ causal depthwise conv, kernel K, SiLU ─ continuing from
                                               conv [B, C, K - 1] (the last K - 1 inputs)
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (float32)
    o = the gated delta rule from state [B, Hv, Dk, Dv] float32 (chunked in prefill; in decode the step
        kernel on a CUDA device, its torch reference on the CPU, which launches no Triton kernel)
    out [B, T, H] = out_proj(norm_w * rms_norm(o) * silu(z)), the norm per value head

Rounding as the checkpoints' reference (transformers' Qwen3NextGatedDeltaNet): projections and the conv
in the model dtype, the delta rule in float32 and its output cast to the model dtype, the norm's
statistic in float32. Legend: B = rows, T = tokens, H = hidden, Hk / Hv = key / value heads, Dk / Dv
their dims, K = conv kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe.kernels.delta_rule import delta_rule_chunked, delta_rule_step, delta_rule_step_reference
from moe.model.linear_attention import LinearAttentionShape, LinearAttentionWeights


@dataclass
class LinearAttentionState:
    """A batch's recurrent state for one layer: conv [B, C, K - 1] (model dtype), delta [B, Hv, Dk, Dv]
    float32. zeros() is a fresh sequence's."""

    conv: torch.Tensor
    delta: torch.Tensor

    @staticmethod
    def zeros(shape: LinearAttentionShape, rows: int, dtype: torch.dtype, device) -> LinearAttentionState:
        return LinearAttentionState(
            torch.zeros(rows, shape.channels, shape.conv_kernel - 1, dtype=dtype, device=device),
            torch.zeros(rows, shape.value_heads, shape.key_dim, shape.value_dim, device=device))


class RecurrentCache:
    """The linear-attention layers' per-sequence state, the KV cache's counterpart: for each decoder
    layer in `layers`, a LinearAttentionState of `batch` rows (conv [batch, C, K - 1] in the model dtype,
    delta [batch, Hv, Dk, Dv] float32), allocated once, changed only in place (CUDA graphs read it).

    Cost: layers * batch * (C * (K - 1) * the dtype's bytes + Hv * Dk * Dv * 4) bytes (state_bytes).
    """

    def __init__(self, shape: LinearAttentionShape, layers: tuple[int, ...], batch: int, dtype: torch.dtype,
                 device) -> None:
        self.shape = shape
        self.states = {i: LinearAttentionState.zeros(shape, batch, dtype, device) for i in layers}

    @staticmethod
    def state_bytes(shape: LinearAttentionShape, layers: int, batch: int, dtype_bytes: int) -> int:
        """Bytes a RecurrentCache of `layers` layers and `batch` rows allocates."""
        conv = shape.channels * (shape.conv_kernel - 1) * dtype_bytes
        per_row = conv + shape.value_heads * shape.key_dim * shape.value_dim * 4
        return layers * batch * per_row

    def rows(self, layer: int, lo: int, hi: int) -> LinearAttentionState:
        """Rows lo..hi-1 of decoder layer `layer`'s state, as views (contiguous: the leading dim)."""
        st = self.states[layer]
        return LinearAttentionState(st.conv[lo:hi], st.delta[lo:hi])

    def reset(self, row: int) -> None:
        """A fresh sequence in `row`: its state zeroed in every layer."""
        for st in self.states.values():
            st.conv[row].zero_()
            st.delta[row].zero_()

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s state copied into row `dst` in every layer (the engine's swap-remove)."""
        for st in self.states.values():
            st.conv[dst].copy_(st.conv[src])
            st.delta[dst].copy_(st.delta[src])


def _project(x: torch.Tensor, w: LinearAttentionWeights, s: LinearAttentionShape):
    """x [..., H] -> (mixed q | k | v [..., C], z [..., Hv, Dv], b, a [..., Hv]) in the checkpoint's
    per-key-head interleaving."""
    rep = s.value_heads // s.key_heads
    qkvz = (x @ w.in_proj_qkvz.T).unflatten(-1, (s.key_heads, 2 * s.key_dim + 2 * rep * s.value_dim))
    q, k, v, z = qkvz.split([s.key_dim, s.key_dim, rep * s.value_dim, rep * s.value_dim], dim=-1)
    b, a = (x @ w.in_proj_ba.T).unflatten(-1, (s.key_heads, 2 * rep)).split([rep, rep], dim=-1)
    mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
    return mixed, z.reshape(*z.shape[:-2], s.value_heads, s.value_dim), b.flatten(-2), a.flatten(-2)


def _split(mixed: torch.Tensor, s: LinearAttentionShape):
    """q, k [..., Hk, Dk], v [..., Hv, Dv] from the conv's output channels."""
    kd = s.key_heads * s.key_dim
    q, k, v = mixed.split([kd, kd, s.value_heads * s.value_dim], dim=-1)
    return (q.unflatten(-1, (s.key_heads, s.key_dim)), k.unflatten(-1, (s.key_heads, s.key_dim)),
            v.unflatten(-1, (s.value_heads, s.value_dim)))


def _gates(b: torch.Tensor, a: torch.Tensor, w: LinearAttentionWeights):
    """beta = sigmoid(b) (model dtype), g = -exp(A_log) softplus(a + dt_bias) (float32)."""
    return b.sigmoid(), -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias)


def _out(o: torch.Tensor, z: torch.Tensor, w: LinearAttentionWeights, s: LinearAttentionShape, dtype):
    """out_proj(norm_w * rms_norm(o) * silu(z)): o float32 [..., Hv, Dv] cast to the model dtype first."""
    o = o.to(dtype).float()
    normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + s.eps)).to(dtype)
    gated = (w.norm_w * normed) * F.silu(z.float())
    return gated.to(dtype).flatten(-2) @ w.out_proj.T


def linear_attention_prefill(x: torch.Tensor, w: LinearAttentionWeights, s: LinearAttentionShape,
                             state: LinearAttentionState, chunk: int = 64) -> torch.Tensor:
    """x [B, T, H] (the rows' next T tokens) -> out [B, T, H] in x's dtype; `state` advanced in place
    past them. Cost: the projections, a depthwise conv over T + K - 1 inputs, delta_rule_chunked."""
    mixed, z, b, a = _project(x, w, s)
    window = torch.cat([state.conv, mixed.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
    conv = F.conv1d(window.to(w.conv_w.dtype), w.conv_w.unsqueeze(1), groups=s.channels)  # [B, C, T]
    state.conv.copy_(window[..., window.shape[-1] - (s.conv_kernel - 1):])
    q, k, v = _split(F.silu(conv).to(x.dtype).transpose(1, 2), s)
    beta, g = _gates(b, a, w)
    o, delta = delta_rule_chunked(q, k, v, g, beta, state.delta, chunk=chunk)
    state.delta.copy_(delta)
    return _out(o, z, w, s, x.dtype)


def linear_attention_decode(x: torch.Tensor, w: LinearAttentionWeights, s: LinearAttentionShape,
                            state: LinearAttentionState) -> torch.Tensor:
    """x [B, H] (one token a row) -> out [B, H] in x's dtype; `state` advanced in place (the conv window
    shifted, the delta state by delta_rule_step on a CUDA device, by delta_rule_step_reference elsewhere:
    the CPU backend runs without Triton). No host sync: CUDA-graph capturable."""
    mixed, z, b, a = _project(x, w, s)
    window = torch.cat([state.conv, mixed[..., None]], dim=-1)  # [B, C, K]
    conv = (window.float() * w.conv_w.float()).sum(-1).to(w.conv_w.dtype)  # [B, C], rounded once as conv1d
    state.conv.copy_(window[..., 1:])
    q, k, v = _split(F.silu(conv).to(x.dtype), s)
    beta, g = _gates(b, a, w)
    step = delta_rule_step if state.delta.device.type == "cuda" else delta_rule_step_reference
    o = step(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state.delta)
    return _out(o, z, w, s, x.dtype)
