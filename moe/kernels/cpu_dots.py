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

The packed 4-bit formats take x as [even elements | odd elements]: byte j holds elements 2j (low nibble)
and 2j + 1 (high nibble), so it multiplies x[j] and x[in / 2 + j] and the loops run over bytes. A step
of CHUNK bytes (E2M1: E2M1_CHUNK, decoded by cpu_decode.e2m1_fma16 / e2m1_fma16x4) has one scale per
lane (fp8 / int4 / mxfp4: one for the step, nvfp4: one per half), folded into per-lane accumulators in
registers, so no sum crosses lanes until the row's end. A row's bytes past its last whole step (a
partial int4 / fp8 group, in_features not a multiple of the step) go through a scalar tail. Every sum
has one fixed order (the binary's vector lanes, then the lanes in order, then the tail), so a result is
bitwise repeatable.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from expertcache.numba_cache import drop_stale_kernels
from moe.kernels import cpu_decode
from moe.kernels.cpu_decode import (
    E2M1_UNIT,
    E4M3_UNIT,
    FASTMATH,
    KERNEL,
    LANES,
    WORD_BF16,
    e2m1_fma16,
    e2m1_fma16x4,
    e2m1_hi,
    e2m1_lo,
    e4m3,
    e8m0_f32,
    lane_array,
    lane_sum,
    stack_array,
    u4_hi,
    u4_lo,
    word_f32,
    zero_lanes,
)

CHUNK = LANES  # bytes a vector step of fp8 / int4 (within one 128-element scale group) and the dense formats
E2M1_CHUNK = 16  # bytes a vector step of nvfp4 (two 16-element blocks) / mxfp4 (one 32-element block)
FP8_BLOCK = 128  # fp8's scale block along the input (expertcache.formats.fp8.BLOCK)
INT4_GROUP_BYTES = 64  # int4's 128-element scale group, in bytes
NVFP4_BLOCK_BYTES = 8  # nvfp4's 16-element scale block, in bytes
NVFP4_MAX_BLOCKS = 1024  # scale blocks of an nvfp4 row the kernels decode at once (in_features <= 16384)
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


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_fp8(q, s, x):
    """q uint8 [n] e4m3fn bytes, s float32 [ceil(n / 128)] the row's block scales, x float32 [n]
    -> Σ q[c] * s[c // 128] * x[c]."""
    n = q.shape[0]
    acc = lane_array()
    zero_lanes(acc)
    for c in range(n // CHUNK):
        base = c * CHUNK
        scale = s[base // FP8_BLOCK]
        for lane in range(CHUNK):
            acc[lane] += e4m3(q[base + lane]) * x[base + lane] * scale
    total = lane_sum(acc)
    for j in range(n // CHUNK * CHUNK, n):
        total += e4m3(q[j]) * x[j] * s[j // FP8_BLOCK]
    return total * E4M3_UNIT


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_fp8(q, s, x0, x1, x2, x3):
    """dot_fp8 of 4 inputs x0..x3 at once -> 4 float32."""
    n = q.shape[0]
    a0, a1, a2, a3 = lane_array(), lane_array(), lane_array(), lane_array()
    _zero4(a0, a1, a2, a3)
    for c in range(n // CHUNK):
        base = c * CHUNK
        scale = s[base // FP8_BLOCK]
        for lane in range(CHUNK):
            j = base + lane
            v = e4m3(q[j]) * scale
            a0[lane] += v * x0[j]
            a1[lane] += v * x1[j]
            a2[lane] += v * x2[j]
            a3[lane] += v * x3[j]
    r0, r1, r2, r3 = lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)
    for j in range(n // CHUNK * CHUNK, n):
        v = e4m3(q[j]) * s[j // FP8_BLOCK]
        r0, r1, r2, r3 = r0 + v * x0[j], r1 + v * x1[j], r2 + v * x2[j], r3 + v * x3[j]
    return r0 * E4M3_UNIT, r1 * E4M3_UNIT, r2 * E4M3_UNIT, r3 * E4M3_UNIT


@njit(**KERNEL, inline="always")
def _int4_group(s, z, g, word, zero_points):
    """(scale, zero point) float32 of int4 group g (zero point 8 without a zero-point part)."""
    return word_f32(s[g], word), np.float32(z[g]) if zero_points else np.float32(8)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_int4(q, s, z, x, word, zero_points):
    """q uint8 [n / 2] nibbles (element 2j low), s uint16 [ceil(n / 128)] bf16 / f16 scales (word),
    z uint8 [same] zero points (read when zero_points, else 8), x float32 [n] as [even | odd]
    -> Σ (u[c] - z[c // 128]) * s[c // 128] * x[c]."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = lane_array()
    zero_lanes(acc)
    for c in range(nb // CHUNK):
        base = c * CHUNK
        scale, zero = _int4_group(s, z, base // INT4_GROUP_BYTES, word, zero_points)
        for lane in range(CHUNK):
            b = q[base + lane]
            acc[lane] += ((u4_lo(b) - zero) * xe[base + lane] + (u4_hi(b) - zero) * xo[base + lane]) * scale
    total = lane_sum(acc)
    for j in range(nb // CHUNK * CHUNK, nb):
        scale, zero = _int4_group(s, z, j // INT4_GROUP_BYTES, word, zero_points)
        total += ((u4_lo(q[j]) - zero) * xe[j] + (u4_hi(q[j]) - zero) * xo[j]) * scale
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_int4(q, s, z, x0, x1, x2, x3, word, zero_points):
    """dot_int4 of 4 inputs x0..x3 at once -> 4 float32."""
    nb = q.shape[0]
    e0, o0, e1, o1, e2, o2, e3, o3 = x0[:nb], x0[nb:], x1[:nb], x1[nb:], x2[:nb], x2[nb:], x3[:nb], x3[nb:]
    a0, a1, a2, a3 = lane_array(), lane_array(), lane_array(), lane_array()
    _zero4(a0, a1, a2, a3)
    for c in range(nb // CHUNK):
        base = c * CHUNK
        scale, zero = _int4_group(s, z, base // INT4_GROUP_BYTES, word, zero_points)
        for lane in range(CHUNK):
            j = base + lane
            lo, hi = (u4_lo(q[j]) - zero) * scale, (u4_hi(q[j]) - zero) * scale
            a0[lane] += lo * e0[j] + hi * o0[j]
            a1[lane] += lo * e1[j] + hi * o1[j]
            a2[lane] += lo * e2[j] + hi * o2[j]
            a3[lane] += lo * e3[j] + hi * o3[j]
    r0, r1, r2, r3 = lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)
    for j in range(nb // CHUNK * CHUNK, nb):
        scale, zero = _int4_group(s, z, j // INT4_GROUP_BYTES, word, zero_points)
        lo, hi = (u4_lo(q[j]) - zero) * scale, (u4_hi(q[j]) - zero) * scale
        r0, r1 = r0 + lo * e0[j] + hi * o0[j], r1 + lo * e1[j] + hi * o1[j]
        r2, r3 = r2 + lo * e2[j] + hi * o2[j], r3 + lo * e3[j] + hi * o3[j]
    return r0, r1, r2, r3


@njit(**KERNEL, inline="always")
def decode_e4m3_row(s, out):
    """out[j] = e4m3(s[j]) (value / 256) for j < s.shape[0]: a row's nvfp4 block scales decoded once, in
    vector registers, before its dots read them as floats."""
    for j in range(s.shape[0]):
        out[j] = e4m3(s[j])


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_nvfp4(q, s, x):
    """q uint8 [n / 2] E2M1 nibbles, s float32 [n / 16] the row's e4m3 scales as decode_e4m3_row gives them,
    x float32 [n] as [even | odd] -> Σ e2m1(q[c]) * s[c // 16] * x[c] (the global scale s2 is the caller's)."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = lane_array()
    zero_lanes(acc)
    for c in range(nb // E2M1_CHUNK):
        e2m1_fma16(q, c * E2M1_CHUNK, xe, xo, s[2 * c], s[2 * c + 1], acc)
    total = lane_sum(acc)
    for j in range(nb // E2M1_CHUNK * E2M1_CHUNK, nb):
        total += (e2m1_lo(q[j]) * xe[j] + e2m1_hi(q[j]) * xo[j]) * s[j // NVFP4_BLOCK_BYTES]
    return total * (E2M1_UNIT * E4M3_UNIT)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_nvfp4(q, s, x0, x1, x2, x3):
    """dot_nvfp4 of 4 inputs x0..x3 at once -> 4 float32."""
    nb = q.shape[0]
    e0, o0, e1, o1, e2, o2, e3, o3 = x0[:nb], x0[nb:], x1[:nb], x1[nb:], x2[:nb], x2[nb:], x3[:nb], x3[nb:]
    a0, a1, a2, a3 = lane_array(), lane_array(), lane_array(), lane_array()
    _zero4(a0, a1, a2, a3)
    for c in range(nb // E2M1_CHUNK):
        e2m1_fma16x4(q, c * E2M1_CHUNK, e0, o0, e1, o1, e2, o2, e3, o3, s[2 * c], s[2 * c + 1], a0, a1, a2, a3)
    r0, r1, r2, r3 = lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)
    for j in range(nb // E2M1_CHUNK * E2M1_CHUNK, nb):
        scale = s[j // NVFP4_BLOCK_BYTES]
        lo, hi = e2m1_lo(q[j]) * scale, e2m1_hi(q[j]) * scale
        r0, r1 = r0 + lo * e0[j] + hi * o0[j], r1 + lo * e1[j] + hi * o1[j]
        r2, r3 = r2 + lo * e2[j] + hi * o2[j], r3 + lo * e3[j] + hi * o3[j]
    unit = E2M1_UNIT * E4M3_UNIT
    return r0 * unit, r1 * unit, r2 * unit, r3 * unit


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_mxfp4(q, s, x):
    """q uint8 [n / 2] E2M1 nibbles, s uint8 [n / 32] e8m0 scales, x float32 [n] as [even | odd]
    -> Σ e2m1(q[c]) * 2^(s[c // 32] - 127) * x[c] (in_features is a multiple of 32: no tail)."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = lane_array()
    zero_lanes(acc)
    for c in range(nb // E2M1_CHUNK):
        scale = e8m0_f32(s[c])
        e2m1_fma16(q, c * E2M1_CHUNK, xe, xo, scale, scale, acc)
    return lane_sum(acc) * E2M1_UNIT


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot4_mxfp4(q, s, x0, x1, x2, x3):
    """dot_mxfp4 of 4 inputs x0..x3 at once -> 4 float32."""
    nb = q.shape[0]
    e0, o0, e1, o1, e2, o2, e3, o3 = x0[:nb], x0[nb:], x1[:nb], x1[nb:], x2[:nb], x2[nb:], x3[:nb], x3[nb:]
    a0, a1, a2, a3 = lane_array(), lane_array(), lane_array(), lane_array()
    _zero4(a0, a1, a2, a3)
    for c in range(nb // E2M1_CHUNK):
        scale = e8m0_f32(s[c])
        e2m1_fma16x4(q, c * E2M1_CHUNK, e0, o0, e1, o1, e2, o2, e3, o3, scale, scale, a0, a1, a2, a3)
    unit = E2M1_UNIT
    return lane_sum(a0) * unit, lane_sum(a1) * unit, lane_sum(a2) * unit, lane_sum(a3) * unit


# Rows [r0, r1) of one key's matrix against ntok inputs over the rows' first k input columns:
# out[tt, col0 + r - r0] = W'[r, :k] · xin[toks[tt], :k]. The parts are the key's rows of its banks,
# flattened (row r of a stacked matrix is sub-matrix r // rows), n in_features apart; xin float32 [*, >= n]
# in the format's input order for a matrix of k columns (packed: [even | odd] halves of k / 2), toks int64
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


_nvfp4_scales = stack_array(NVFP4_MAX_BLOCKS)  # a row's block scales, decoded


@njit(**KERNEL, fastmath=FASTMATH)
def rows_nvfp4(q, s, s2, n, k, rows, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 16] e4m3 scales, s2 float32 [stack] the
    sub-matrices' global scales; n / 16 <= NVFP4_MAX_BLOCKS."""
    nb, kb, blocks, used = n // 2, k // 2, n // 16, k // 16
    scales = _nvfp4_scales()[:used]
    for r in range(r0, r1):
        qr, col, glob = q[r * nb:r * nb + kb], col0 + r - r0, s2[r // rows]
        decode_e4m3_row(s[r * blocks:r * blocks + used], scales)
        if ntok == 1:
            out[0, col] = dot_nvfp4(qr, scales, xin[toks[0]]) * glob
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            d0, d1, d2, d3 = dot4_nvfp4(qr, scales, xin[i0], xin[i1], xin[i2], xin[i3])
            _put(out, t0, ntok, col, (d0 * glob, d1 * glob, d2 * glob, d3 * glob))


@njit(**KERNEL, fastmath=FASTMATH)
def rows_mxfp4(q, s, n, k, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 32] e8m0 scales."""
    nb, kb, blocks, used = n // 2, k // 2, n // 32, k // 32
    for r in range(r0, r1):
        qr, sr, col = q[r * nb:r * nb + kb], s[r * blocks:r * blocks + used], col0 + r - r0
        if ntok == 1:
            out[0, col] = dot_mxfp4(qr, sr, xin[toks[0]])
        for t0 in range(0, ntok if ntok > 1 else 0, PASS):
            i0, i1, i2, i3 = _pass(toks, t0, ntok)
            _put(out, t0, ntok, col, dot4_mxfp4(qr, sr, xin[i0], xin[i1], xin[i2], xin[i3]))
