"""bf16: the matrix itself, bfloat16 [out, in], 2 bytes a parameter (today's expert banks); and the
unregistered dense formats float16 / float32, the experts of a float16 / float32 model kept as they are.

    W [out, in] ──quantize (round to nearest even, torch's cast)──► parts {"": bfloat16 [out, in]}
    The one part's bank keeps the matrix's name ("gate_up" [2I, H], "down" [H, I]), so the banks are
    exactly those moe/model/checkpoint.py and moe/testing/synthetic.py build for a bf16 model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from expertcache.formats.base import ExpertFormat, Part

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BF16(ExpertFormat):
    """Unquantized bfloat16; dequantize is the exact float32 of each value."""

    name = "bf16"
    main = ""
    dtype: ClassVar[str] = "bfloat16"  # the torch dtype of the one part

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        return (Part("", (out_features, in_features), self.dtype),)

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        return {"": w.to(getattr(torch, self.dtype)).contiguous()}

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        import torch

        return parts[""].to(torch.float32)


@dataclass(frozen=True)
class Float16(BF16):
    """Unquantized float16: the experts of a float16 model as stored (not offered by --moe-expert-format)."""

    name = "float16"
    dtype: ClassVar[str] = "float16"


@dataclass(frozen=True)
class Float32(BF16):
    """Unquantized float32: the experts of a float32 model as stored (not offered by --moe-expert-format)."""

    name = "float32"
    dtype: ClassVar[str] = "float32"
