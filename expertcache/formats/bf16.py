"""bf16: the matrix itself, bfloat16 [out, in], 2 bytes a parameter (today's expert banks).

    W [out, in] ──quantize (round to nearest even, torch's cast)──► parts {"": bfloat16 [out, in]}
    The one part's bank keeps the matrix's name ("gate_up" [2I, H], "down" [H, I]), so the banks are
    exactly those moe/model/checkpoint.py and moe/testing/synthetic.py build for a bf16 model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from expertcache.formats.base import ExpertFormat, Part

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BF16(ExpertFormat):
    """Unquantized bfloat16; dequantize is the exact float32 of each value."""

    name = "bf16"
    main = ""

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        return (Part("", (out_features, in_features), "bfloat16"),)

    def _quantize(self, w: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        import torch

        return {"": w.to(torch.bfloat16).contiguous()}

    def _dequantize(self, parts: Mapping[str, "torch.Tensor"], out_features: int, in_features: int) -> "torch.Tensor":
        import torch

        return parts[""].to(torch.float32)
