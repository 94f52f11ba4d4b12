"""nvfp4: FP4 E2M1 values two per byte, an e4m3 scale per 16 values along the input, and a float32
global scale per matrix; 4.5 bits a parameter.

    parts "q"  uint8 [out, in / 2], element 2j in the low nibble     (ModelOpt: `weight`)
          "s"  float8_e4m3fn [out, in / 16]                          (ModelOpt: `weight_scale`)
          "s2" float32 [1]                                           (ModelOpt: `weight_scale_2`)
    W'[i, j] = (e2m1(q[i, j]) * float32(s[i, j // 16])) * s2   (the first product is exact in float32,
    so W' is the correctly rounded v * s * s2; ModelOpt's reference rounds s * s2 first: <= 1 ulp apart)

NVIDIA ModelOpt's NVFP4 checkpoint layout. in_features must be a multiple of 16 (refused otherwise,
as ModelOpt's get_weights_scaling_factor asserts). The H200 has no FP4 tensor cores: kernels
dequantize in registers; v * s is exact in bf16 too, so a kernel may apply s2 after accumulating.

Quantize follows ModelOpt's NVFP4QTensor (modelopt/torch/quantization/qtensor/nvfp4_tensor.py), all
float32: s2 = amax(|W|) / (6 * 448); s = e4m3(amax(|block|) / (6 * s2)), round to nearest even;
q = nearest E2M1 of W / (float32(s) * s2), ties to even, sign bit where the quotient is < 0. Where
ModelOpt would divide by zero we use 1 instead: s2 = 1 for an all-zero matrix, and s = 1 for a block
whose scale is zero (ModelOpt sets 1 only where the scale is zero before the e4m3 cast; we also do it
where the cast underflows to zero, whose codes ModelOpt leaves undefined). Either way W' is 0 there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part, check_finite

if TYPE_CHECKING:
    import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class NVFP4(ExpertFormat):
    """E2M1 values, e4m3 scales per 16 values, a float32 global scale (ModelOpt NVFP4)."""

    name = "nvfp4"
    in_multiple = BLOCK
    in_block = BLOCK
    in_rule = "one e4m3 scale per 16 values along the input"
    pack = 2

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        return (Part("q", (out_features, in_features // 2), "uint8"),
                Part("s", (out_features, in_features // BLOCK), "float8_e4m3fn"),
                Part("s2", (1,), "float32"))

    def _stacks_decode_whole(self, sub_rows: int) -> bool:
        return True  # the per-sub-matrix global scales go to their own rows (_dequantize)

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        from expertcache.formats.packing import e2m1_encode, pack_nibbles

        out_features, in_features = w.shape
        amax = w.abs().amax().reshape(1)
        s2 = amax / (E2M1_MAX * E4M3_MAX)
        s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))
        blocks = w.view(out_features, in_features // BLOCK, BLOCK)
        s = (blocks.abs().amax(dim=-1) / (E2M1_MAX * s2)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        s = torch.where(s.float() > 0, s.float(), 1.0).to(torch.float8_e4m3fn)
        x = blocks / (s.float() * s2).unsqueeze(-1)
        q = pack_nibbles(e2m1_encode(x.view(out_features, in_features)))
        return {"q": q.contiguous(), "s": s.contiguous(), "s2": s2.contiguous()}

    def _check_values(self, parts: Mapping[str, torch.Tensor]) -> None:
        check_finite(self, parts, "s", "s2")
        if not bool((parts["s2"] > 0).all()):
            raise FormatError(f"nvfp4: parts['s2'] (weight_scale_2) must be > 0, got {parts['s2'].tolist()}")

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        from expertcache.formats.packing import e2m1_decode, unpack_nibbles

        lead = parts["q"].shape[:-2]  # decode_batch's matrices
        v = e2m1_decode(unpack_nibbles(parts["q"])).view(*lead, out_features, in_features // BLOCK, BLOCK)
        vs = v * parts["s"].float().unsqueeze(-1)  # exact: 2 x 4 significant bits
        # s2 [..., n]: the global scales of n stacked sub-matrices (decode_batch), each over its own rows
        s2 = parts["s2"].repeat_interleave(out_features // parts["s2"].shape[-1], dim=-1)
        return (vs * s2.reshape(*lead, out_features, 1, 1)).view(*lead, out_features, in_features)
