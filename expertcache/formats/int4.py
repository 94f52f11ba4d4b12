"""int4: 4-bit integers two per byte with a scale per group of 128 along the input; ~4.13 bits a parameter.

    parts "q" uint8 [out, in / 2]: u = q + 8 in 0..15, element 2j in the low nibble
          "s" bfloat16 (or float16) [out, ceil(in / 128)]
          "z" uint8 [out, ceil(in / 128)], zero points 0..15 (only with zero_points=True)
    W'[i, j] = float32(u[i, j] - z[i, j // 128]) * float32(s[i, j // 128]), z = 8 without "z" (exact)

The unsigned nibble with an implicit zero point of 8 is what GPTQ (`qweight` / `qzeros` / `scales`,
sym=True writes zeros of 8) and compressed-tensors `pack-quantized` (int4 + 8 packed low bits first)
store, so the loader repacks their int32 words without touching a value; GPTQ's `g_idx` must be in
order (the loader's check). in_features must be even (two per byte); a last partial group is allowed
(ceil, as GPTQ's and compressed-tensors' scale shapes are).

Quantize (symmetric, round to nearest even): per group s = bf16(amax(|group|) / 7) (an all-zero group:
s = 1), q = clamp(round(W / float32(s)), -8, 7). amax / 7 maps the group's extreme to +-7 and never
clips (error <= s / 2 everywhere); -8 is representable but unused. GPTQ's sym=True uses
s = 2 * amax / 15 with zero 8, and compressed-tensors s = amax / 7.5 in [-8, 7]: both a finer step
that clips a positive extreme (round(7.5) = 8 > 7). Quantizing with zero_points=True writes z = 8.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part, ceil_div, check_finite

if TYPE_CHECKING:
    import torch

GROUP = 128
QMAX = 7
ZERO = 8
SCALE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class INT4(ExpertFormat):
    """Symmetric 4-bit integers, a scale per 128 inputs; optional zero points for asymmetric checkpoints.

    scale_dtype: "bfloat16" (default) or "float16" (GPTQ's). zero_points: add part "z".
    """

    scale_dtype: str = "bfloat16"
    zero_points: bool = False

    name = "int4"
    in_multiple = 2
    in_block = GROUP
    in_rule = "two 4-bit values per byte"
    pack = 2

    @property
    def key(self) -> str:
        """"int4", "int4-f16", "int4-z" or "int4-f16-z" (float16 scales, zero points)."""
        return self.name + ("-f16" if self.scale_dtype == "float16" else "") + ("-z" if self.zero_points else "")

    def __post_init__(self) -> None:
        if self.scale_dtype not in SCALE_DTYPES:
            raise FormatError(f"int4: scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if not isinstance(self.zero_points, bool):
            raise FormatError(f"int4: zero_points must be a bool, got {self.zero_points!r}")

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        groups = (out_features, ceil_div(in_features, GROUP))
        parts = (Part("q", (out_features, in_features // 2), "uint8"), Part("s", groups, self.scale_dtype))
        return parts + ((Part("z", groups, "uint8"),) if self.zero_points else ())

    def _stacks_decode_whole(self, sub_rows: int) -> bool:
        return True  # every part is per row

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        from expertcache.formats.packing import pack_nibbles

        out_features, in_features = w.shape
        groups = ceil_div(in_features, GROUP)
        whole = in_features % GROUP == 0  # whole groups: no padded copy, the scales broadcast over them
        if whole:
            amax = w.view(out_features, groups, GROUP).abs().amax(dim=-1)
        else:
            padded = torch.zeros(out_features, groups * GROUP, dtype=torch.float32, device=w.device)
            padded[:, :in_features] = w.abs()
            amax = padded.view(out_features, groups, GROUP).amax(dim=-1)
        s = (amax / QMAX).to(getattr(torch, self.scale_dtype))
        if not bool(torch.isfinite(s).all()):
            raise FormatError(f"int4.quantize: w's |values| up to {float(amax.max())} overflow a "
                              f"{self.scale_dtype} scale; use scale_dtype='bfloat16'")
        s = torch.where(s > 0, s, torch.ones_like(s))
        if whole:
            x = (w.view(out_features, groups, GROUP) / s.float().unsqueeze(-1)).view(out_features, in_features)
        else:
            x = w / s.float().repeat_interleave(GROUP, dim=1)[:, :in_features]
        u = x.round_().clamp_(-ZERO, QMAX).add_(ZERO).to(torch.uint8)
        parts = {"q": pack_nibbles(u).contiguous(), "s": s.contiguous()}
        if self.zero_points:
            parts["z"] = torch.full(s.shape, ZERO, dtype=torch.uint8, device=w.device)
        return parts

    def _check_values(self, parts: Mapping[str, torch.Tensor]) -> None:
        check_finite(self, parts, "s")
        if self.zero_points and bool((parts["z"] > 15).any()):
            raise FormatError("int4: parts['z'] (zero points) must be in 0..15")

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        import torch

        from expertcache.formats.packing import unpack_nibbles

        u = unpack_nibbles(parts["q"])  # [..., out, in] uint8
        s = parts["s"].float()
        if in_features % GROUP == 0:  # whole groups: the scale and zero point broadcast over each group
            lead = u.shape[:-1]
            z = parts["z"].float().unsqueeze(-1) if self.zero_points else float(ZERO)
            v = u.view(*lead, in_features // GROUP, GROUP).float() - z  # u - z: small integers, exact in float32
            return (v * s.unsqueeze(-1)).view(*lead, in_features)
        u = u.to(torch.int32)
        z = parts["z"].to(torch.int32) if self.zero_points else torch.full_like(parts["s"], ZERO, dtype=torch.int32)
        z, s = (t.repeat_interleave(GROUP, dim=-1)[..., :in_features] for t in (z, s))
        return (u - z).to(torch.float32) * s
