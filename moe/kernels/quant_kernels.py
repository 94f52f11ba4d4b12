"""The routed kernels' reads of a quantized slot: dequantize in registers, multiply, accumulate
(used by moe.kernels.routed_kernels; the formats are expertcache.formats, their torch references
the formats' `dequantize`).

    one call of _qacc: rows [R] of slot `slot`'s matrix [OUT, IN] (OUT / SUB stacked sub-matrices),
    input columns [c0, c0 + CHUNK), x read from its row pointer:
      fp8:   e4m3 bytes [R, NB, 128] -> float32 (Triton's cast); per 128-column block the dot with x,
             times the block's float32 scale, into acc [R, NB]
      4-bit: int32 words [R, CHUNK / 8], 8 values a word (value j in bits 4j..4j + 3); per word the 8
             products with x summed, times the word's scale, into acc [R, CHUNK / 8]
             nvfp4 / mxfp4: two E2M1 codes per integer operation, placed in float16 halves
             (value * 2^-14, exact) and converted; the scale e4m3 * the sub-matrix's float32
             global scale (nvfp4) or 2^(e - 127) (mxfp4); the caller's sum times E2M1_UNIT = 2^14
             int4: the float32 2^23 + u (bits 0x4B000000 | u) less 2^23 + z: u - z exactly; the
             bf16 / f16 group scale
    _qsum: acc summed over its columns -> [R] float32

Every format is weight-only: x (bf16 / f16 / f32 activations) and the products are float32. A row
that is not ok (past OUT, or of a slot outside the pool) and a column past IN read nothing and add 0.
The sums run in a fixed order, so a call's result is bitwise repeatable.
Legend: R = rows of the call, S = pool slots, NB = the chunk's 128-column blocks (one when CHUNK < 128).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe.model.slot_matrix import CODES

# Kernel codes of the formats (constexpr FMT, moe.model.slot_matrix.CODES); 0 is a dense float matrix.
FP8 = tl.constexpr(CODES["fp8"])
NVFP4 = tl.constexpr(CODES["nvfp4"])
MXFP4 = tl.constexpr(CODES["mxfp4"])
INT4 = tl.constexpr(CODES["int4"])
E2M1_UNIT = tl.constexpr(16384.0)  # _pair returns value * 2^-14


SIGN_BITS = tl.constexpr(-2147450880)  # 0x80008000 as an int32: the sign bit of both halves
MAG_BITS = tl.constexpr(0x0E000E00)  # bits 9-11 of both halves: an E2M1 magnitude as a float16's


@triton.jit
def _halves(h):
    """int32 [..] holding two float16 -> (float32 of the low half, float32 of the high half)."""
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pair(words, k: tl.constexpr, FMT: tl.constexpr):
    """E2M1 values k and k + 4 of 32-bit words of 8 nibbles (value j in bits 4j..4j + 3), as float32
    value * 2^-14: each code's sign and magnitude bits placed in a float16 (code 1 a subnormal), whose
    conversion is exact; two values per integer operation."""
    if k == 3:
        mag = (words >> 3) & MAG_BITS
        sign = words & SIGN_BITS
    else:
        mag = (words << (9 - 4 * k)) & MAG_BITS
        sign = (words << (12 - 4 * k)) & SIGN_BITS
    return _halves(mag | sign)


@triton.jit
def _scale_tile(s_ptr, s2_ptr, z_ptr, slot64, rows, row_ok, col0, OUT: tl.constexpr, IN: tl.constexpr,
                SUB: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr):
    """(scale [R, N] float32, zero [R, N] float32) of rows [R] at the blocks holding columns col0 [N];
    nvfp4's global scale folded in; zero is int4's zero point (8 without ZP), else 0."""
    BS: tl.constexpr = 16 if FMT == NVFP4 else (32 if FMT == MXFP4 else 128)
    NSC: tl.constexpr = (IN + BS - 1) // BS  # scale columns
    PER_SUB: tl.constexpr = (SUB + 127) // 128  # fp8: block rows of a sub-matrix
    SROWS: tl.constexpr = (OUT // SUB) * PER_SUB if FMT == FP8 else OUT  # scale rows
    if FMT == FP8:
        srow = (rows // SUB) * PER_SUB + (rows % SUB) // 128
    else:
        srow = rows
    offs = slot64 * (SROWS * NSC) + srow[:, None].to(tl.int64) * NSC + (col0 // BS)[None, :]
    m = row_ok[:, None] & (col0 < IN)[None, :]
    zero = tl.zeros(offs.shape, dtype=tl.float32)
    if FMT == MXFP4:  # e8m0: 2^(e - 127), e = 0 is 2^-127 (a float32 subnormal)
        e = tl.load(s_ptr + offs, mask=m, other=0).to(tl.int32)
        s = tl.where(e > 0, (e << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39)
    else:
        s = tl.load(s_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if FMT == NVFP4:
        s2 = tl.load(s2_ptr + slot64 * (OUT // SUB) + rows // SUB, mask=row_ok, other=0.0)
        s = s * s2[:, None]
    if FMT == INT4:
        if ZP:
            zero = tl.load(z_ptr + offs, mask=m, other=0).to(tl.float32)
        else:
            zero += 8.0
    return s, zero


@triton.jit
def _qacc(acc, x_ptr, w, slot, rows, row_ok, c0, OUT: tl.constexpr, IN: tl.constexpr, SUB: tl.constexpr,
          FMT: tl.constexpr, ZP: tl.constexpr, CHUNK: tl.constexpr):
    """acc + the products of rows [R] of slot `slot` (row_ok [R]: the row exists and the slot is live;
    slot must be a valid index where any row is ok) with x, input columns [c0, c0 + CHUNK): x_ptr the
    input row (bf16 / f16 / f32; read up to IN). w: the matrix's pool banks (q, s, s2, z) [S, ...] in
    the format's layout (expertcache.formats; unused ones any pointer; fp8's values as uint8, the
    4-bit formats' as int32 words of 8 values).
    fp8: acc [R, NB] of the chunk's 128-column blocks, each block's dot scaled once;
    4-bit: acc [R, CHUNK / 8], one entry per word: its 8 products summed, then scaled once."""
    q_ptr, s_ptr, s2_ptr, z_ptr = w
    slot64 = slot.to(tl.int64)
    if FMT == FP8:
        TB: tl.constexpr = 128 if CHUNK >= 128 else CHUNK
        NB: tl.constexpr = CHUNK // TB
        col0 = c0 + tl.arange(0, NB) * TB  # [NB]
        cols = col0[:, None] + tl.arange(0, TB)[None, :]  # [NB, TB]
        x = tl.load(x_ptr + cols, mask=cols < IN, other=0.0).to(tl.float32)
        offs = slot64 * (OUT * IN) + rows[:, None, None].to(tl.int64) * IN + cols[None]
        m = row_ok[:, None, None] & (cols < IN)[None]
        v = tl.load(q_ptr + offs, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s, _ = _scale_tile(s_ptr, s2_ptr, z_ptr, slot64, rows, row_ok, col0, OUT, IN, SUB, FMT, ZP)
        acc = acc + tl.sum(v * x[None], axis=2) * s
    else:
        NW: tl.constexpr = CHUNK // 8
        col = c0 + 8 * tl.arange(0, NW)  # [NW] first column of each word
        cm = col < IN
        offs = slot64 * (OUT * (IN // 8)) + rows[:, None].to(tl.int64) * (IN // 8) + (col // 8)[None, :]
        words = tl.load(q_ptr + offs, mask=row_ok[:, None] & cm[None, :], other=0)  # [R, NW] int32
        s, zero = _scale_tile(s_ptr, s2_ptr, z_ptr, slot64, rows, row_ok, col, OUT, IN, SUB, FMT, ZP)
        t = tl.zeros(words.shape, dtype=tl.float32)
        if FMT == INT4:  # u - z exactly: the float32 2^23 + u (bits 0x4B000000 | u) less 2^23 + z
            bias = 8388608.0 + zero
            for k in tl.static_range(8):
                v = (((words >> (4 * k)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - bias
                t = t + v * tl.load(x_ptr + col + k, mask=cm, other=0.0).to(tl.float32)[None, :]
        else:
            for k in tl.static_range(4):
                a, b = _pair(words, k, FMT)
                t = t + a * tl.load(x_ptr + col + k, mask=cm, other=0.0).to(tl.float32)[None, :]
                t = t + b * tl.load(x_ptr + col + (k + 4), mask=cm, other=0.0).to(tl.float32)[None, :]
        acc = acc + t * s
    return acc


@triton.jit
def _qacc_zeros(R: tl.constexpr, CHUNK: tl.constexpr, FMT: tl.constexpr):
    """The accumulator of _qacc: float32 zeros [R, NB] (fp8) or [R, CHUNK / 8] (4-bit)."""
    TB: tl.constexpr = 128 if CHUNK >= 128 else CHUNK
    N: tl.constexpr = CHUNK // TB if FMT == FP8 else CHUNK // 8
    return tl.zeros([R, N], dtype=tl.float32)


@triton.jit
def _qsum(acc, FMT: tl.constexpr):
    """[R] float32: acc summed over its columns (the E2M1 formats' unit restored)."""
    total = tl.sum(acc, axis=1)
    if FMT == NVFP4 or FMT == MXFP4:
        total = total * E2M1_UNIT
    return total
