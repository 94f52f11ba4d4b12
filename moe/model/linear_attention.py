"""Qwen3-Next's linear-attention layer (Gated DeltaNet) as a checkpoint describes it: its geometry from
config.json's linear_* keys, and one layer's tensors. The compute and the per-sequence state are
moe.engine.linear_attention's.

Legend: H = hidden, Hk / Hv = key / value heads, Dk / Dv their dims, K = conv kernel, C = the conv's
channels (q | k | v).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearAttentionShape:
    """The layer's geometry, from config.json's linear_* keys."""

    key_heads: int  # linear_num_key_heads
    value_heads: int  # linear_num_value_heads, a multiple of key_heads
    key_dim: int  # linear_key_head_dim
    value_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    eps: float  # rms_norm_eps

    def __post_init__(self) -> None:
        for name, key in (("key_heads", "linear_num_key_heads"), ("value_heads", "linear_num_value_heads"),
                          ("key_dim", "linear_key_head_dim"), ("value_dim", "linear_value_head_dim"),
                          ("conv_kernel", "linear_conv_kernel_dim")):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention: {key} must be >= 1, got {getattr(self, name)}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"linear attention: linear_num_value_heads ({self.value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.key_heads})")

    @property
    def channels(self) -> int:
        """C: the conv's channels, q | k | v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass
class LinearAttentionWeights:
    """One layer's tensors, as the checkpoint names them (linear_attn.*)."""

    in_proj_qkvz: torch.Tensor  # [2 Hk Dk + 2 Hv Dv, H]
    in_proj_ba: torch.Tensor  # [2 Hv, H]
    conv_w: torch.Tensor  # [C, K] (conv1d.weight squeezed)
    a_log: torch.Tensor  # [Hv] (A_log)
    dt_bias: torch.Tensor  # [Hv]
    norm_w: torch.Tensor  # [Dv] (norm.weight)
    out_proj: torch.Tensor  # [H, Hv Dv]
