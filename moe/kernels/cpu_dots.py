"""Rows of an expert matrix in its format, dotted with token inputs on the CPU (numba, float32).

    one weight row (its bytes in an expert format, expertcache.formats) + x float32 [in]
        ──dot_<format>──► Σ_c W'[c] * x[c],  W' = the format's torch `decode` of the row
        ──dot4_<format>──► the same for 4 inputs at once (the row decoded once)
    one key's parts, rows [r0, r1), inputs xin[toks[tt]] (tt < ntok), the rows' first k columns (k = in:
    whole rows; fewer: a split expert's down rows, reading only those columns' bytes)
        ──rows_<format>──► out[tt, col0 + r - r0] = W'[r, :k] · xin[toks[tt], :k]

A row's bytes are read from memory once and decoded in SIMD registers (moe.kernels.cpu_decode); nothing
is written back. One token takes the fused dot; more take passes of 4 (the last one repeats its last
token), each decoding a byte once for 4 multiply-adds, so the decode is paid once per 4 tokens.

The packed 4-bit formats (int4, nvfp4, mxfp4) run over chunks of 128 inputs: 64 bytes read as 16 32-bit
words, word l holding inputs 8l..8l + 7 as its nibbles 0..7 (element 2j in byte j's low nibble). Step k of a
chunk takes nibble k of all 16 words by a shift and a mask (no byte shuffles), decodes the 16 codes in one
vector (cpu_decode: a 16-entry permute for E2M1, a conversion for int4) and multiplies them with 16
consecutive inputs, so x comes in the packed input order (cpu_decode.chunk_place): within each whole chunk,
input 8l + k at 16k + l; inputs past the last whole chunk stay in place. A chunk's 8 steps sum in two
chains per lane, then the lane's scale multiplies the sum into its accumulator: nvfp4's 8 block scales
(block l // 2 in lane l), mxfp4's 4 (l // 4), int4's one group scale. fp8 runs over its 128-wide scale
blocks the same way, 16 consecutive bytes a step (inputs in their natural order), each byte decoded by one
shift and mask of its sign-extended word into a half. The dense formats step over CHUNK consecutive
elements. No sum crosses lanes until the row's end, where the lanes add in a fixed tree (chunked dots) or
in order (dense); a row's bytes past its last whole chunk or step (a partial group or block, in_features
not a multiple of the step, a split expert's first k columns) go through a scalar tail.
Every sum has one fixed order for one binary, so a result is bitwise repeatable.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from expertcache.numba_cache import drop_stale_kernels
from moe.kernels import cpu_decode
from moe.kernels.cpu_decode import (
    CHUNK_BYTES,
    CHUNK_CODES,
    E2M1_UNIT,
    E4M3_UNIT,
    FASTMATH,
    KERNEL,
    LANES,
    WORD_BF16,
    e2m1_hi,
    e2m1_lo,
    e4m3,
    e8m0_f32,
    fp8_chunk,
    fp8_chunk4,
    int4_chunk,
    int4_chunk4,
    lane_array,
    lane_sum,
    mxfp4_chunk,
    mxfp4_chunk4,
    nvfp4_chunk,
    nvfp4_chunk4,
    stack_array,
    sum16,
    u4_hi,
    u4_lo,
    word_f32,
    zero_lanes,
)

CHUNK = LANES  # elements a vector step of the dense formats
FP8_BLOCK = 128  # fp8's scale block along the input (expertcache.formats.fp8.BLOCK)
INT4_GROUP_BYTES = 64  # int4's 128-element scale group, in bytes: one packed chunk
NVFP4_BLOCK_BYTES = 8  # nvfp4's 16-element scale block, in bytes (8 a chunk)
MXFP4_BLOCK_BYTES = 16  # mxfp4's 32-element scale block, in bytes (4 a chunk)
PASS = 4  # tokens a multi-token pass

# the dots inline cpu_decode's decoders: recompile them when it changes
drop_stale_kernels(__file__, (cpu_decode,))


@njit(**KERNEL, inline="always")
def _zero4(a0, a1, a2, a3):
    zero_lanes(a0)
    zero_lanes(a1)
    zero_lanes(a2)
    zero_lanes(a3)


def as_f32(v, word):
    """float32 of a dense element: a float32 as it is, a 16-bit word read by `word` (WORD_BF16 / WORD_F16).
    In the kernels numba compiles the overload below for each element type."""
    if isinstance(v, (float, np.floating)):
        return np.float32(v)
    if word == WORD_BF16:
        return np.array([int(v) << 16], np.uint32).view(np.float32)[0]
    return np.array([int(v)], np.uint16).view(np.float16).astype(np.float32)[0]


@overload(as_f32, jit_options={"_nrt": False})
def _as_f32(v, word):
    if isinstance(v, types.Float):
        return lambda v, word: v
    return lambda v, word: word_f32(v, word)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_dense(w, x, word):
    """w [n] float32, or uint16 bf16 / f16 words (word), x float32 [n] -> Σ w[c] x[c] float32."""
    total = np.float32(0)
    for c in range(w.shape[0]):
        total += as_f32(w[c], word) * x[c]
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_dense(w, x0, x1, x2, x3, word):
    """dot_dense of 4 inputs x0..x3 at once -> 4 float32."""
    n = w.shape[0]
    a0, a1, a2, a3 = lane_array(), lane_array(), lane_array(), lane_array()
    _zero4(a0, a1, a2, a3)
    for c in range(n // CHUNK):
        base = c * CHUNK
        for lane in range(CHUNK):
            j = base + lane
            v = as_f32(w[j], word)
            a0[lane] += v * x0[j]
            a1[lane] += v * x1[j]
            a2[lane] += v * x2[j]
            a3[lane] += v * x3[j]
    r0, r1, r2, r3 = lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)
    for j in range(n // CHUNK * CHUNK, n):
        v = as_f32(w[j], word)
        r0, r1, r2, r3 = r0 + v * x0[j], r1 + v * x1[j], r2 + v * x2[j], r3 + v * x3[j]
    return r0, r1, r2, r3


@njit(**KERNEL, inline="always")
def _zero16x4(a0, a1, a2, a3):
    for lane in range(16):
        a0[lane], a1[lane], a2[lane], a3[lane] = 0, 0, 0, 0


_lanes16 = stack_array(16)  # a chunked dot's per-lane accumulators


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_fp8(q, s, x):
    """q uint8 [n] e4m3fn bytes, s float32 [ceil(n / 128)] the row's block scales, x float32 [n]
    -> Σ q[c] * s[c // 128] * x[c]."""
    n = q.shape[0]
    acc = _lanes16()
    for lane in range(16):
        acc[lane] = 0
    for c in range(n // FP8_BLOCK):
        fp8_chunk(q, c * FP8_BLOCK, s, c, x, c * FP8_BLOCK, acc)
    total = sum16(acc)
    for j in range(n // FP8_BLOCK * FP8_BLOCK, n):
        total += e4m3(q[j]) * x[j] * s[j // FP8_BLOCK]
    return total * E4M3_UNIT


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_fp8(q, s, x0, x1, x2, x3):
    """dot_fp8 of 4 inputs x0..x3 at once -> 4 float32."""
    n = q.shape[0]
    a0, a1, a2, a3 = _lanes16(), _lanes16(), _lanes16(), _lanes16()
    _zero16x4(a0, a1, a2, a3)
    for c in range(n // FP8_BLOCK):
        fp8_chunk4(q, c * FP8_BLOCK, s, c, x0, x1, x2, x3, c * FP8_BLOCK, a0, a1, a2, a3)
    r0, r1, r2, r3 = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for j in range(n // FP8_BLOCK * FP8_BLOCK, n):
        v = e4m3(q[j]) * s[j // FP8_BLOCK]
        r0, r1, r2, r3 = r0 + v * x0[j], r1 + v * x1[j], r2 + v * x2[j], r3 + v * x3[j]
    return r0 * E4M3_UNIT, r1 * E4M3_UNIT, r2 * E4M3_UNIT, r3 * E4M3_UNIT


@njit(**KERNEL, inline="always")
def _int4_group(s, z, g, word, zero_points):
    """(scale, zero point) float32 of int4 group g (zero point 8 without a zero-point part)."""
    return word_f32(s[g], word), np.float32(z[g]) if zero_points else np.float32(8)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_int4(q, s, z, x, word, zero_points):
    """q uint8 [kb] nibbles of a row's first 2 kb inputs (element 2j low), s uint16 [ceil(2 kb / 128)] scales
    (word), z uint8 [same] zero points (read when zero_points, else 8), x float32 [2 kb] in the packed input
    order (cpu_decode.chunk_place) -> Σ (u[c] - z[c // 128]) * s[c // 128] * x[c]."""
    kb = q.shape[0]
    acc = _lanes16()
    for lane in range(16):
        acc[lane] = 0
    for c in range(kb // CHUNK_BYTES):
        scale, zero = _int4_group(s, z, c, word, zero_points)
        int4_chunk(q, c * CHUNK_BYTES, scale, zero, x, c * CHUNK_CODES, acc)
    total = sum16(acc)
    for j in range(kb // CHUNK_BYTES * CHUNK_BYTES, kb):
        scale, zero = _int4_group(s, z, j // INT4_GROUP_BYTES, word, zero_points)
        total += ((u4_lo(q[j]) - zero) * x[2 * j] + (u4_hi(q[j]) - zero) * x[2 * j + 1]) * scale
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_int4(q, s, z, x0, x1, x2, x3, word, zero_points):
    """dot_int4 of 4 inputs x0..x3 at once (each chunk decoded once) -> 4 float32."""
    kb = q.shape[0]
    a0, a1, a2, a3 = _lanes16(), _lanes16(), _lanes16(), _lanes16()
    _zero16x4(a0, a1, a2, a3)
    for c in range(kb // CHUNK_BYTES):
        scale, zero = _int4_group(s, z, c, word, zero_points)
        int4_chunk4(q, c * CHUNK_BYTES, scale, zero, x0, x1, x2, x3, c * CHUNK_CODES, a0, a1, a2, a3)
    r0, r1, r2, r3 = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for j in range(kb // CHUNK_BYTES * CHUNK_BYTES, kb):
        scale, zero = _int4_group(s, z, j // INT4_GROUP_BYTES, word, zero_points)
        lo, hi = (u4_lo(q[j]) - zero) * scale, (u4_hi(q[j]) - zero) * scale
        r0, r1 = r0 + lo * x0[2 * j] + hi * x0[2 * j + 1], r1 + lo * x1[2 * j] + hi * x1[2 * j + 1]
        r2, r3 = r2 + lo * x2[2 * j] + hi * x2[2 * j + 1], r3 + lo * x3[2 * j] + hi * x3[2 * j + 1]
    return r0, r1, r2, r3


@njit(**KERNEL, inline="always")
def _e2m1_scale(s, j, mx):
    """The scale of byte j's block: mxfp4's e8m0 (mx), else nvfp4's e4m3 (value / 256)."""
    return e8m0_f32(s[j // MXFP4_BLOCK_BYTES]) if mx else e4m3(s[j // NVFP4_BLOCK_BYTES])


@njit(**KERNEL, inline="always")
def _e2m1_chunk(q, c, s, x, acc, mx):
    if mx:
        mxfp4_chunk(q, c * CHUNK_BYTES, s, c * (CHUNK_BYTES // MXFP4_BLOCK_BYTES), x, c * CHUNK_CODES, acc)
    else:
        nvfp4_chunk(q, c * CHUNK_BYTES, s, c * (CHUNK_BYTES // NVFP4_BLOCK_BYTES), x, c * CHUNK_CODES, acc)


@njit(**KERNEL, inline="always")
def _e2m1_chunk4(q, c, s, x0, x1, x2, x3, a0, a1, a2, a3, mx):
    if mx:
        mxfp4_chunk4(q, c * CHUNK_BYTES, s, c * (CHUNK_BYTES // MXFP4_BLOCK_BYTES), x0, x1, x2, x3,
                     c * CHUNK_CODES, a0, a1, a2, a3)
    else:
        nvfp4_chunk4(q, c * CHUNK_BYTES, s, c * (CHUNK_BYTES // NVFP4_BLOCK_BYTES), x0, x1, x2, x3,
                     c * CHUNK_CODES, a0, a1, a2, a3)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_e2m1(q, s, x, mx):
    """q uint8 [kb] E2M1 nibbles of a row's first 2 kb inputs, s uint8 the row's block scales (mx: mxfp4's e8m0
    [2 kb / 32], else nvfp4's e4m3 [2 kb / 16]), x float32 [2 kb] in the packed input order
    -> Σ e2m1(q[c]) * scale(c) * x[c] / 2^14 (nvfp4: / 2^22 more, and without its global scale)."""
    kb = q.shape[0]
    acc = _lanes16()
    for lane in range(16):
        acc[lane] = 0
    for c in range(kb // CHUNK_BYTES):
        _e2m1_chunk(q, c, s, x, acc, mx)
    total = sum16(acc)
    for j in range(kb // CHUNK_BYTES * CHUNK_BYTES, kb):
        total += (e2m1_lo(q[j]) * x[2 * j] + e2m1_hi(q[j]) * x[2 * j + 1]) * _e2m1_scale(s, j, mx)
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_e2m1(q, s, x0, x1, x2, x3, mx):
    """dot_e2m1 of 4 inputs x0..x3 at once -> 4 float32."""
    kb = q.shape[0]
    a0, a1, a2, a3 = _lanes16(), _lanes16(), _lanes16(), _lanes16()
    _zero16x4(a0, a1, a2, a3)
    for c in range(kb // CHUNK_BYTES):
        _e2m1_chunk4(q, c, s, x0, x1, x2, x3, a0, a1, a2, a3, mx)
    r0, r1, r2, r3 = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for j in range(kb // CHUNK_BYTES * CHUNK_BYTES, kb):
        scale = _e2m1_scale(s, j, mx)
        lo, hi = e2m1_lo(q[j]) * scale, e2m1_hi(q[j]) * scale
        r0, r1 = r0 + lo * x0[2 * j] + hi * x0[2 * j + 1], r1 + lo * x1[2 * j] + hi * x1[2 * j + 1]
        r2, r3 = r2 + lo * x2[2 * j] + hi * x2[2 * j + 1], r3 + lo * x3[2 * j] + hi * x3[2 * j + 1]
    return r0, r1, r2, r3


# Rows [r0, r1) of one key's matrix against ntok inputs over the rows' first k input columns:
# out[tt, col0 + r - r0] = W'[r, :k] · xin[toks[tt], :k]. The parts are the key's rows of its banks,
# flattened (row r of a stacked matrix is sub-matrix r // rows), n in_features apart; xin float32 [*, >= n]
# in the format's input order for a matrix of k columns (packed: cpu_decode.chunk_place of k columns), toks int64
# [>= ntok], out float32 [>= ntok, *]. k = n is the whole row; a shorter k (a split expert's down rows,
# moe.kernels.cpu_experts) reads only the row's bytes and scales of those columns: a multiple of the
# format's scale block along the row (fp8 / int4: 128, nvfp4: 16, mxfp4: 32). One token takes the fused
# dot, more take passes of PASS (`_pass` / `_put`).

@njit(**KERNEL, inline="always")
def _pass(toks, t0, ntok):
    """The xin rows of the pass of PASS tokens from t0; past ntok, the last token again."""
    last = ntok - 1
    return toks[t0], toks[min(t0 + 1, last)], toks[min(t0 + 2, last)], toks[min(t0 + 3, last)]


@njit(**KERNEL, inline="always")
def _put(out, t0, ntok, col, r):
    """out[t0 + i, col] = r[i] for the pass's real tokens."""
    for i in range(min(PASS, ntok - t0)):
        out[t0 + i, col] = r[i]


@njit(**KERNEL, fastmath=FASTMATH)
def rows_dense(w, n, k, r0, r1, xin, toks, ntok, out, col0, word):
    """w [rows * n] float32, or uint16 bf16 / f16 words (word)."""
    for r in range(r0, r1):
        wr, col = w[r * n:r * n + k], col0 + r - r0
        if ntok == 1:
            out[0, col] = dot_dense(wr, xin[toks[0]], word)
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            _put(out, t0, ntok, col, dot4_dense(wr, xin[i0], xin[i1], xin[i2], xin[i3], word))


@njit(**KERNEL, fastmath=FASTMATH)
def rows_fp8(q, s, n, k, rows, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [stack * rows * n] e4m3fn bytes, s float32 [stack * ceil(rows / 128) * ceil(n / 128)] block scales
    (each sub-matrix of `rows` rows has its own block rows)."""
    blocks, used = (n + FP8_BLOCK - 1) // FP8_BLOCK, (k + FP8_BLOCK - 1) // FP8_BLOCK
    for r in range(r0, r1):
        srow = r // rows * ((rows + FP8_BLOCK - 1) // FP8_BLOCK) + r % rows // FP8_BLOCK
        qr, sr, col = q[r * n:r * n + k], s[srow * blocks:srow * blocks + used], col0 + r - r0
        if ntok == 1:
            out[0, col] = dot_fp8(qr, sr, xin[toks[0]])
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            _put(out, t0, ntok, col, dot4_fp8(qr, sr, xin[i0], xin[i1], xin[i2], xin[i3]))


@njit(**KERNEL, fastmath=FASTMATH)
def rows_int4(q, s, z, n, k, r0, r1, xin, toks, ntok, out, col0, word, zero_points):
    """q uint8 [rows * n / 2] nibbles, s uint16 [rows * ceil(n / 128)] scales (word), z uint8 [same] zero
    points (read when zero_points)."""
    nb, kb, groups, used = n // 2, k // 2, (n + 127) // 128, (k + 127) // 128
    for r in range(r0, r1):
        qr, sr, col = q[r * nb:r * nb + kb], s[r * groups:r * groups + used], col0 + r - r0
        zr = z[r * groups:r * groups + used] if zero_points else z[:0]
        if ntok == 1:
            out[0, col] = dot_int4(qr, sr, zr, xin[toks[0]], word, zero_points)
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            _put(out, t0, ntok, col, dot4_int4(qr, sr, zr, xin[i0], xin[i1], xin[i2], xin[i3], word, zero_points))


@njit(**KERNEL, fastmath=FASTMATH)
def rows_nvfp4(q, s, s2, n, k, rows, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 16] e4m3 scales, s2 float32 [stack] the
    sub-matrices' global scales."""
    _rows_e2m1(q, s, s2, n, k, rows, r0, r1, xin, toks, ntok, out, col0, False)


@njit(**KERNEL, fastmath=FASTMATH)
def rows_mxfp4(q, s, n, k, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 32] e8m0 scales."""
    _rows_e2m1(q, s, _ONE, n, k, n, r0, r1, xin, toks, ntok, out, col0, True)


_ONE = np.ones(1, np.float32)  # mxfp4's (absent) global scale


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def _rows_e2m1(q, s, s2, n, k, rows, r0, r1, xin, toks, ntok, out, col0, mx):
    """The E2M1 formats' rows (mx: mxfp4, whose s2 is _ONE and rows unused)."""
    nb, kb = n // 2, k // 2
    blocks, used = (n // 32, k // 32) if mx else (n // 16, k // 16)
    unit = E2M1_UNIT if mx else E2M1_UNIT * E4M3_UNIT
    for r in range(r0, r1):
        qr, sr, col = q[r * nb:r * nb + kb], s[r * blocks:r * blocks + used], col0 + r - r0
        glob = unit if mx else unit * s2[r // rows]
        if ntok == 1:
            out[0, col] = dot_e2m1(qr, sr, xin[toks[0]], mx) * glob
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            d0, d1, d2, d3 = dot4_e2m1(qr, sr, xin[i0], xin[i1], xin[i2], xin[i3], mx)
            _put(out, t0, ntok, col, (d0 * glob, d1 * glob, d2 * glob, d3 * glob))
