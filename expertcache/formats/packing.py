"""4-bit codes two per byte, and the FP4 E2M1 code (torch; shared by nvfp4, mxfp4 and int4).

    codes uint8 [..., 2k], each 0..15 ──pack_nibbles──► bytes uint8 [..., k]: element 2j in the low
        nibble, 2j + 1 in the high one (as ModelOpt NVFP4 `weight`, gpt-oss MXFP4 `*_blocks`, GPTQ
        `qweight` and compressed-tensors `weight_packed` put the lower index in the lower bits)
    E2M1 code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; code & 7 -> magnitude
        0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes. A value at midpoint i lies between codes i and i + 1;
# ties go to the even code (even mantissa bit), i.e. up at odd i (0.75, 1.75, 3.5), down at even i.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2k] codes in 0..15 -> uint8 [..., k], element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> uint8 [..., 2k] codes, the inverse of `pack_nibbles`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 x -> uint8 E2M1 codes: the nearest magnitude (ties to even, |x| > 6 saturates to 6),
    sign bit set where x < 0 (as ModelOpt's NVFP4 cast: -0.0 encodes as +0, a negative value that
    rounds to zero as -0).

    The magnitudes are evenly spaced within three ranges, so the code is a rounding there: below 2 in steps
    of 0.5 (code round(2 |x|)), from 2 to 4 in steps of 1 (code 2 + round(|x|)), from 4 in steps of 2 (code
    4 + round(|x| / 2), at most 7). The scalings are exact and torch.round rounds half to even, which is the
    even code at each midpoint (E2M1_MIDPOINTS; a value rounding up to a range's end gets that end's code
    from either formula). The range's scale and offset come from two comparisons by arithmetic, so the
    encode is a few elementwise passes (a search over the midpoints, or torch.where with scalar operands,
    measured slower on the CPU, where checkpoints are quantized at load)."""
    mag = x.abs()
    ge2 = (mag >= 2).to(torch.float32)
    ge4 = (mag >= 4).to(torch.float32)
    offset = (ge2 + ge4).mul_(2.0)  # 0, 2, 4
    scale = ge4.mul_(-0.5).sub_(ge2).add_(2.0)  # 2, 1, 0.5
    code = mag.mul_(scale).round_().add_(offset).clamp_(max=7).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> float32 values (code 8 gives -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    table = torch.cat((mags, -mags))
    return table[codes.long()]
