"""fp8: float8 e4m3fn values with a float32 scale per 128 x 128 block, ~1 byte a parameter.

    parts "q" float8_e4m3fn [out, in]                          (checkpoint: `<name>.weight`)
          "s" float32 [ceil(out / 128), ceil(in / 128)]        (checkpoint: `<name>.weight_scale_inv`)
    W'[i, j] = float32(q[i, j]) * s[i // 128, j // 128]

The layout of Qwen's and DeepSeek's official fine-grained FP8 checkpoints (`quantization_config:
{quant_method: fp8, weight_block_size: [128, 128]}`), whose `weight_scale_inv` is multiplied in despite
its name (DeepSeek-V3 `inference/kernel.py` weight_dequant: y = x * s). Any shape is accepted: the last
block row / column is partial, as in those checkpoints.

Quantize: per block, s = amax(|W|) / 448 in float32 (an all-zero block: s = 1), then
q = e4m3(clamp(W / s, -448, 448)), round to nearest even (torch's float32 -> float8_e4m3fn cast).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part, ceil_div, check_finite

if TYPE_CHECKING:
    import torch

BLOCK = 128
E4M3_MAX = 448.0


def expand_blocks(s: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """s [..., ceil(rows / block), ceil(cols / block)] -> [..., rows, cols], each scale over its block."""
    return s.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]


@dataclass(frozen=True)
class FP8(ExpertFormat):
    """float8 e4m3fn with 128 x 128 float32 block scales (multiplied in on dequantize)."""

    name = "fp8"
    in_block = BLOCK

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        return (Part("q", (out_features, in_features), "float8_e4m3fn"),
                Part("s", (ceil_div(out_features, BLOCK), ceil_div(in_features, BLOCK)), "float32"))

    def _stacks_decode_whole(self, sub_rows: int) -> bool:
        return sub_rows % BLOCK == 0  # each sub-matrix's scales then cover whole 128-row blocks of its own

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        out_features, in_features = w.shape
        rb, cb = ceil_div(out_features, BLOCK), ceil_div(in_features, BLOCK)
        padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32, device=w.device)
        padded[:out_features, :in_features] = w.abs()
        amax = padded.view(rb, BLOCK, cb, BLOCK).amax(dim=(1, 3))  # [rb, cb]
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        x = w / expand_blocks(s, out_features, in_features, BLOCK)
        q = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"q": q.contiguous(), "s": s.contiguous()}

    def _check_values(self, parts: Mapping[str, torch.Tensor]) -> None:
        import torch

        check_finite(self, parts, "s")
        if bool(((parts["q"].view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise FormatError("fp8: parts['q'] holds the e4m3fn NaN code (0x7F / 0xFF)")

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        import torch

        if out_features % BLOCK == 0 and in_features % BLOCK == 0:  # whole blocks: each scale broadcast over its own
            lead = parts["q"].shape[:-2]
            q = parts["q"].view(*lead, out_features // BLOCK, BLOCK, in_features // BLOCK, BLOCK).to(torch.float32)
            return (q * parts["s"][..., :, None, :, None]).view(*lead, out_features, in_features)
        s = expand_blocks(parts["s"], out_features, in_features, BLOCK)
        return parts["q"].to(torch.float32) * s
