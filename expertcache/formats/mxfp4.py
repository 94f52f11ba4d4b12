"""mxfp4: FP4 E2M1 values two per byte with an e8m0 (power of two) scale per 32 values along the input;
4.25 bits a parameter.

    parts "q" uint8 [out, in / 2], element 2j in the low nibble   (gpt-oss: `*_blocks` [out, in / 32, 16])
          "s" uint8 [out, in / 32], biased exponent e              (gpt-oss: `*_scales`)
    W'[i, j] = e2m1(q[i, j]) * 2^(s[i, j // 32] - 127)   (exact in float32)

The OCP Microscaling (MX) v1.0 MXFP4 format as gpt-oss ships its experts (`convert_moe_packed_tensors`:
low nibble first, exponent = scale - 127). in_features must be a multiple of 32 (refused otherwise).
e8m0 code 255 is NaN and is refused on dequantize.

Quantize per the OCP MX spec (section 6.3, as Microsoft's microxcaling reference implements it): the
shared exponent of a block is floor(log2(amax(|block|))) - 2 (2 = E2M1's largest exponent), clamped
to the e8m0 range [-127, 127] (an all-zero block gets -127, its log2 being -inf); q = nearest E2M1 of
W / 2^e, ties to even, |x| > 6 saturating to 6 (so a block's largest values in (6, 8) * 2^e clip).
ModelOpt's MXFP4QTensor instead uses ceil(log2(amax / 6)), which never clips; we follow the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part

if TYPE_CHECKING:
    import torch

BLOCK = 32
E2M1_EMAX = 2
E8M0_BIAS = 127


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^e for int e in [-127, 127], built from the bits (2^-127 is subnormal)."""
    import torch

    normal = ((e.clamp(min=-126) + 127).to(torch.int32) << 23).view(torch.float32)
    return torch.where(e >= -126, normal, torch.tensor(2.0 ** -127, dtype=torch.float32, device=e.device))


@dataclass(frozen=True)
class MXFP4(ExpertFormat):
    """E2M1 values with an e8m0 scale per 32 values (OCP MX; gpt-oss `*_blocks` / `*_scales`)."""

    name = "mxfp4"
    in_multiple = BLOCK
    in_block = BLOCK
    in_rule = "one e8m0 scale per 32 values along the input"
    pack = 2

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        return (Part("q", (out_features, in_features // 2), "uint8"),
                Part("s", (out_features, in_features // BLOCK), "uint8"))

    def _stacks_decode_whole(self, sub_rows: int) -> bool:
        return True  # every part is per row

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        from expertcache.formats.packing import e2m1_encode, pack_nibbles

        out_features, in_features = w.shape
        blocks = w.view(out_features, in_features // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=-1)
        _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2) = exponent - 1
        e = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        x = blocks / pow2(e).unsqueeze(-1)  # exact: a power of two
        q = pack_nibbles(e2m1_encode(x.view(out_features, in_features)))
        return {"q": q.contiguous(), "s": (e + E8M0_BIAS).to(torch.uint8).contiguous()}

    def _check_values(self, parts: Mapping[str, torch.Tensor]) -> None:
        if bool((parts["s"] == 255).any()):
            raise FormatError("mxfp4: parts['s'] holds the e8m0 NaN code 255")

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        from expertcache.formats.packing import e2m1_decode, unpack_nibbles

        lead = parts["q"].shape[:-2]  # decode_batch's matrices
        v = e2m1_decode(unpack_nibbles(parts["q"])).view(*lead, out_features, in_features // BLOCK, BLOCK)
        scale = pow2(parts["s"].int() - E8M0_BIAS)
        return (v * scale.unsqueeze(-1)).view(*lead, out_features, in_features)
