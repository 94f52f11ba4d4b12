"""Independent numpy references of the expert formats, written from the formats' definitions.

    torch parts ──to_numpy (raw bytes: uint8 / uint16 views)──► decoders by bit fields
        bf16 bits << 16; e4m3fn sign / 4-bit exponent (bias 7) / 3-bit mantissa; e2m1 sign / 2-bit
        exponent (bias 1) / 1-bit mantissa; e8m0 2^(e - 127); nibbles low then high
    ──reference_dequantize──► float32 [out, in]          (every product formed as the format defines)
    w float32 ──reference_scales──► the scales quantize must write (amax rules, numpy float32 arithmetic)
    codebooks (value, code) for the brute-force nearest checks

No torch cast or torch arithmetic is used on values; torch only hands over the bytes.
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32


def raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as numpy: uint8 for 1-byte dtypes, uint16 bits for bfloat16, numpy's
    own float16 / float32 (IEEE types numpy decodes itself)."""
    if t.dtype == torch.float32:
        return t.numpy()
    if t.element_size() == 1:
        return t.contiguous().view(torch.uint8).numpy()
    bits = t.contiguous().view(torch.int16).numpy()
    return bits.view(np.float16) if t.dtype == torch.float16 else bits.view(np.uint16)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(F32)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite x)."""
    bits = x.astype(F32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag).astype(F32)


def e2m1_decode(n: np.ndarray) -> np.ndarray:
    n = n.astype(np.int64)
    sign = np.where(n & 0x8, -1.0, 1.0)
    e, m = (n >> 1) & 0x3, n & 0x1
    mag = np.where(e == 0, m * 0.5, (2 + m) * np.exp2(e - 2.0))
    return (sign * mag).astype(F32)


def e8m0_decode(b: np.ndarray) -> np.ndarray:
    return np.ldexp(F32(1.0), b.astype(np.int32) - 127).astype(F32)


def unpack(b: np.ndarray) -> np.ndarray:
    """uint8 [..., k] -> codes [..., 2k], the low nibble first."""
    return np.stack((b & 0xF, b >> 4), axis=-1).reshape(*b.shape[:-1], -1)


def per_input(s: np.ndarray, block: int, n: int) -> np.ndarray:
    return np.repeat(s, block, axis=-1)[..., :n]


def expand2d(s: np.ndarray, block: int, rows: int, cols: int) -> np.ndarray:
    return np.repeat(np.repeat(s, block, axis=0)[:rows], block, axis=1)[:, :cols]


def scale_per_element(name: str, parts: dict[str, np.ndarray], out: int, n: int) -> np.ndarray:
    """The float32 scale each element was divided by on quantize (int4: s; nvfp4: s * s2 rounded)."""
    if name == "fp8":
        return expand2d(parts["s"], 128, out, n)
    if name == "nvfp4":
        return per_input(e4m3_decode(parts["s"]) * parts["s2"][0], 16, n)
    if name == "mxfp4":
        return per_input(e8m0_decode(parts["s"]), 32, n)
    return per_input(int4_scale(parts["s"]), 128, n)


def int4_scale(s: np.ndarray) -> np.ndarray:
    return s.astype(F32) if s.dtype == np.float16 else bf16_decode(s)


def reference_dequantize(name: str, parts: dict[str, np.ndarray], out: int, n: int) -> np.ndarray:
    if name == "bf16":
        return bf16_decode(parts[""])
    if name == "fp8":
        return e4m3_decode(parts["q"]) * expand2d(parts["s"], 128, out, n)
    v = e2m1_decode(unpack(parts["q"]))
    if name == "nvfp4":
        return (v * per_input(e4m3_decode(parts["s"]), 16, n)) * parts["s2"][0]
    if name == "mxfp4":
        return v * per_input(e8m0_decode(parts["s"]), 32, n)
    u = unpack(parts["q"]).astype(np.int64)
    z = per_input(parts["z"].astype(np.int64), 128, n) if "z" in parts else 8
    return (u - z).astype(F32) * per_input(int4_scale(parts["s"]), 128, n)


def block_amax(w: np.ndarray, rb: int, cb: int) -> np.ndarray:
    """amax of |w| over blocks of rb rows x cb columns (partial last blocks included)."""
    out, n = w.shape
    a = np.zeros((-(-out // rb) * rb, -(-n // cb) * cb), F32)
    a[:out, :n] = np.abs(w)
    return a.reshape(a.shape[0] // rb, rb, a.shape[1] // cb, cb).max(axis=(1, 3))


def nearest_code(x: np.ndarray, values: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Brute force: for each x, the code of the nearest value, ties to the even code."""
    out = np.empty(x.shape, np.int64)
    flat, res = x.reshape(-1).astype(np.float64), out.reshape(-1)
    for i in range(0, flat.size, 4096):
        d = np.abs(flat[i:i + 4096, None] - values[None, :].astype(np.float64))
        best = d == d.min(axis=1, keepdims=True)
        ties = best & ((codes[None, :] & 1) == 0)
        pick = np.where(best.sum(axis=1) > 1, ties.argmax(axis=1), best.argmax(axis=1))
        res[i:i + 4096] = codes[pick]
    return out


E4M3_CODES = np.arange(0x7F)  # non-negative finite e4m3fn codes (0x7F is NaN)
E4M3_VALUES = e4m3_decode(E4M3_CODES)
E2M1_CODES = np.arange(8)
E2M1_VALUES = e2m1_decode(E2M1_CODES)
INT4_CODES = np.arange(-8, 8)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Non-negative float32 (<= 448) -> e4m3fn code, round to nearest even."""
    return nearest_code(x, E4M3_VALUES, E4M3_CODES).astype(np.uint8)


def reference_scales(name: str, w: np.ndarray, **options) -> dict[str, np.ndarray]:
    """The scale parts quantize must produce for float32 w, per the formats' rules."""
    if name == "fp8":
        amax = block_amax(w, 128, 128)
        return {"s": np.where(amax > 0, amax / F32(448), F32(1)).astype(F32)}
    if name == "nvfp4":
        amax = np.abs(w).max()
        s2 = amax / F32(6 * 448) if amax > 0 else F32(1)
        s = e4m3_encode(np.minimum(block_amax(w, 1, 16) / (F32(6) * F32(s2)), F32(448)))
        return {"s": np.where(s == 0, np.uint8(0x38), s), "s2": np.array([s2], F32)}  # 0x38 = 1.0
    if name == "mxfp4":
        amax = block_amax(w, 1, 32)
        mant, exp = np.frexp(amax)
        e = np.where(amax > 0, exp - 1 - 2, -127).clip(-127, 127)
        return {"s": (e + 127).astype(np.uint8)}
    amax = block_amax(w, 1, 128)
    if options.get("scale_dtype") == "float16":
        s = (amax / F32(7)).astype(np.float16)
        return {"s": np.where(s == 0, np.float16(1), s)}
    s = bf16_encode(amax / F32(7))
    return {"s": np.where(s == 0, bf16_encode(np.ones_like(amax)), s)}
