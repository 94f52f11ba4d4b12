"""Rows of an expert matrix, decoded and dotted with token inputs on the CPU (numba, float32).

    row parts (bytes of one weight row in an expert format, expertcache.formats) + x float32 [in]
        ──dot_<format>──► Σ_c W'[c] * x[c] float32, W' = the format's torch `decode` of the row
    one key's parts, rows [r0, r1), inputs xin[toks[tt]] (tt < ntok)
        ──rows_<format>──► out[tt, col0 + r - r0] = W'[r] · xin[toks[tt]]  (each row read from memory once)

Each format's dot streams the row's bytes once and decodes them in SIMD registers; nothing is
written back. The decode tricks (all exact; the format's power-of-two factor is applied once, to
the row's total):

    bf16      bits << 16 is the float32                       (_bf16)
    float16   the half-precision bits, converted (vcvtph2ps)  (_f16)
    e4m3fn    bits (s, e, m) moved into a half: (b & 0x7F) << 7 | sign << 15 = value * 2^-8
              (subnormals included: they become half subnormals)              (_e4m3)
    E2M1      code (s, e, m) moved into a half: (c & 7) << 9 | sign << 15 = value * 2^-14  (_e2m1_*)
    int4      the nibble converted to float, less the zero point              (_u4_*)

The packed 4-bit formats read x as [even elements | odd elements] (`deinterleave`): byte j holds
elements 2j (low nibble) and 2j + 1 (high nibble), so one byte multiplies x[j] and x[in / 2 + j]
and the loop runs over bytes. A chunk of CHUNK bytes (E2M1: E2M1_CHUNK) has one scale per lane
(fp8 / int4 / mxfp4: one for the chunk, nvfp4: one per half), folded into a per-lane accumulator
that lives in registers (`stack_array`, which the compiler keeps in registers), so no reduction crosses
lanes until the row's end. Scales that are per chunk are read once per chunk; a row's bytes past
its last whole chunk (a partial int4 / fp8 group, or in_features not a multiple of the chunk) go
through a scalar tail. Every sum has one fixed order (the binary's vector lanes, then the lanes in
order, then the tail), so a result is bitwise repeatable; fastmath lets the compiler reassociate
into lanes and fuse multiply-adds, nothing more.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

# Every kernel function: compiled once and cached on disk, GIL released, and no reference counting: they
# allocate nothing and every array they see outlives the call (the store's banks, the caller's scratch),
# whereas counting the views they slice per row would be atomic operations on the banks' shared counters
# from every thread (numba's `_nrt` flag)
KERNEL = {"cache": True, "nogil": True, "_nrt": False}
# reassociation (vector lanes), contraction (FMA), no signed zeros: all deterministic for one binary
FASTMATH = {"reassoc", "contract", "nsz"}
CHUNK = 32  # bytes a vector step of fp8 / int4 (within one 128-element scale group)
E2M1_CHUNK = 16  # bytes a vector step of nvfp4 (two 16-element groups) / mxfp4 (one 32-element group)
FP8_BLOCK = 128  # fp8 scale block along the input (expertcache.formats.fp8.BLOCK)
INT4_GROUP_BYTES = 64  # int4's 128-element scale group, in bytes
NVFP4_BLOCK_BYTES = 8  # nvfp4's 16-element scale block, in bytes
MXFP4_BLOCK_BYTES = 16  # mxfp4's 32-element scale block, in bytes
# 16-bit words: how a half-precision word (dense values, int4 scales, biases) is read
WORD_BF16, WORD_F16 = 0, 1
E4M3_UNIT = np.float32(256.0)  # _e4m3 gives value / 256
E2M1_UNIT = np.float32(16384.0)  # _e2m1_* give value / 2^14

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _int(builder, value, ty, to: ir.IntType):
    """An integer argument of numba type `ty` as LLVM int `to` (truncated or zero-extended)."""
    if ty.bitwidth > to.width:
        return builder.trunc(value, to)
    if ty.bitwidth < to.width:
        return builder.zext(value, to)
    return value


def _half_to_f32(builder, bits16):
    return builder.fpext(builder.bitcast(bits16, ir.HalfType()), ir.FloatType())


@intrinsic
def _bf16(typingctx, bits):
    """float32 of bfloat16 bits (an integer's low 16 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = builder.zext(_int(builder, args[0], sig.args[0], I16), I32)
        return builder.bitcast(builder.shl(word, I32(16)), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f16(typingctx, bits):
    """float32 of float16 bits (an integer's low 16 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _half_to_f32(builder, _int(builder, args[0], sig.args[0], I16))
    return types.float32(bits), codegen


@intrinsic
def _e4m3(typingctx, byte):
    """value / 256 of a float8 e4m3fn byte, through a half (exact; the NaN code is the store's to refuse)."""
    if not isinstance(byte, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        b = builder.zext(_int(builder, args[0], sig.args[0], I8), I16)
        bits = builder.or_(builder.shl(builder.and_(b, I16(0x7F)), I16(7)),
                           builder.shl(builder.and_(b, I16(0x80)), I16(8)))
        return _half_to_f32(builder, bits)
    return types.float32(byte), codegen


def _e2m1_intrinsic(high: bool):
    @intrinsic
    def e2m1(typingctx, byte):
        if not isinstance(byte, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            b = _int(builder, args[0], sig.args[0], I8)
            code = builder.zext(builder.lshr(b, I8(4)) if high else b, I16)
            bits = builder.or_(builder.shl(builder.and_(code, I16(7)), I16(9)),
                               builder.shl(builder.and_(code, I16(8)), I16(12)))
            return _half_to_f32(builder, bits)
        return types.float32(byte), codegen
    return e2m1


_e2m1_lo = _e2m1_intrinsic(False)  # value / 2^14 of the low nibble's E2M1 code
_e2m1_hi = _e2m1_intrinsic(True)  # ... of the high nibble's


def _u4_intrinsic(high: bool):
    @intrinsic
    def u4(typingctx, byte):
        if not isinstance(byte, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            b = _int(builder, args[0], sig.args[0], I8)
            nibble = builder.lshr(b, I8(4)) if high else builder.and_(b, I8(15))
            return builder.uitofp(nibble, ir.FloatType())
        return types.float32(byte), codegen
    return u4


_u4_lo = _u4_intrinsic(False)  # float32 of the low nibble, 0..15
_u4_hi = _u4_intrinsic(True)  # ... of the high nibble


@intrinsic
def _f32_bits(typingctx, bits):
    """The float32 whose bits are the integer's low 32 bits."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_int(builder, args[0], sig.args[0], I32), ir.FloatType())
    return types.float32(bits), codegen


def stack_array(*shape: int):
    """An intrinsic () -> float32 array of `shape` (C order) on the stack of the function it is inlined into
    (its entry block): uninitialised and uncounted, so small per-call buffers cost no allocation and the
    compiler may keep them in registers."""
    array_type = types.Array(types.float32, len(shape), "C")
    strides = [4 * math.prod(shape[d + 1:]) for d in range(len(shape))]

    @intrinsic
    def stack(typingctx):
        def codegen(context, builder, sig, args):
            slots = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), math.prod(shape)))
            array = make_array(array_type)(context, builder)
            intp = [context.get_constant(types.intp, v) for v in (*shape, *strides, 4)]
            populate_array(array, data=builder.bitcast(slots, ir.FloatType().as_pointer()),
                           shape=tuple(intp[:len(shape)]), strides=tuple(intp[len(shape):-1]), itemsize=intp[-1],
                           meminfo=None)
            return array._getvalue()
        return array_type(), codegen
    return stack


# per-lane accumulators, kept in vector registers once the lane loops are unrolled
_lane_array = stack_array(CHUNK)


@njit(**KERNEL, inline="always")
def _zero(acc):
    for lane in range(CHUNK):
        acc[lane] = 0


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def _lane_sum(acc):
    total = np.float32(0)
    for lane in range(CHUNK):
        total += acc[lane]
    return total


@njit(**KERNEL, inline="always")
def word_f32(bits, word):
    """float32 of a 16-bit word read as bfloat16 (word WORD_BF16) or float16 (WORD_F16)."""
    return _bf16(bits) if word == WORD_BF16 else _f16(bits)


@njit(**KERNEL, inline="always")
def e8m0_f32(code):
    """2^(code - 127) of an e8m0 scale byte (code 255, NaN, is the store's to refuse)."""
    return _f32_bits(np.uint32(code) << np.uint32(23)) if code else np.float32(2.0 ** -127)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_words(w, x, word):
    """w uint16 [n] bf16 / f16 words (word), x float32 [n] -> Σ w[c] x[c] float32."""
    total = np.float32(0)
    if word == WORD_BF16:
        for c in range(w.shape[0]):
            total += _bf16(w[c]) * x[c]
    else:
        for c in range(w.shape[0]):
            total += _f16(w[c]) * x[c]
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_f32(w, x):
    """w, x float32 [n] -> Σ w[c] x[c] float32."""
    total = np.float32(0)
    for c in range(w.shape[0]):
        total += w[c] * x[c]
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_fp8(q, s, x):
    """q uint8 [n] e4m3fn bytes, s float32 [ceil(n / 128)] the row's block scales, x float32 [n]
    -> Σ q[c] * s[c // 128] * x[c]."""
    n = q.shape[0]
    acc = _lane_array()
    _zero(acc)
    for c in range(n // CHUNK):
        base = c * CHUNK
        scale = s[base // FP8_BLOCK]
        for lane in range(CHUNK):
            acc[lane] += _e4m3(q[base + lane]) * x[base + lane] * scale
    total = _lane_sum(acc)
    for j in range(n // CHUNK * CHUNK, n):
        total += _e4m3(q[j]) * x[j] * s[j // FP8_BLOCK]
    return total * E4M3_UNIT


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_int4(q, s, z, x, word, zero_points):
    """q uint8 [n / 2] nibbles (element 2j low), s uint16 [ceil(n / 128)] bf16 / f16 scales (word),
    z uint8 [same] zero points (read when zero_points, else 8), x float32 [n] as [even | odd]
    -> Σ (u[c] - z[c // 128]) * s[c // 128] * x[c]."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = _lane_array()
    _zero(acc)
    for c in range(nb // CHUNK):
        base = c * CHUNK
        g = base // INT4_GROUP_BYTES
        scale = word_f32(s[g], word)
        zero = np.float32(z[g]) if zero_points else np.float32(8)
        for lane in range(CHUNK):
            b = q[base + lane]
            acc[lane] += ((_u4_lo(b) - zero) * xe[base + lane] + (_u4_hi(b) - zero) * xo[base + lane]) * scale
    total = _lane_sum(acc)
    for j in range(nb // CHUNK * CHUNK, nb):
        g = j // INT4_GROUP_BYTES
        zero = np.float32(z[g]) if zero_points else np.float32(8)
        total += ((_u4_lo(q[j]) - zero) * xe[j] + (_u4_hi(q[j]) - zero) * xo[j]) * word_f32(s[g], word)
    return total


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_nvfp4(q, s, x):
    """q uint8 [n / 2] E2M1 nibbles, s uint8 [n / 16] e4m3 scales, x float32 [n] as [even | odd]
    -> Σ e2m1(q[c]) * s[c // 16] * x[c] (the global scale s2 is the caller's)."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = _lane_array()
    _zero(acc)
    for c in range(nb // E2M1_CHUNK):
        base = c * E2M1_CHUNK
        s0 = _e4m3(s[2 * c])
        s1 = _e4m3(s[2 * c + 1])
        for lane in range(E2M1_CHUNK):
            b = q[base + lane]
            scale = s0 if lane < NVFP4_BLOCK_BYTES else s1
            acc[lane] += (_e2m1_lo(b) * xe[base + lane] + _e2m1_hi(b) * xo[base + lane]) * scale
    total = _lane_sum(acc)
    for j in range(nb // E2M1_CHUNK * E2M1_CHUNK, nb):
        total += (_e2m1_lo(q[j]) * xe[j] + _e2m1_hi(q[j]) * xo[j]) * _e4m3(s[j // NVFP4_BLOCK_BYTES])
    return total * (E2M1_UNIT * E4M3_UNIT)


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def dot_mxfp4(q, s, x):
    """q uint8 [n / 2] E2M1 nibbles, s uint8 [n / 32] e8m0 scales, x float32 [n] as [even | odd]
    -> Σ e2m1(q[c]) * 2^(s[c // 32] - 127) * x[c]."""
    nb = q.shape[0]
    xe, xo = x[:nb], x[nb:]
    acc = _lane_array()
    _zero(acc)
    for c in range(nb // E2M1_CHUNK):
        base = c * E2M1_CHUNK
        scale = e8m0_f32(s[c])
        for lane in range(E2M1_CHUNK):
            b = q[base + lane]
            acc[lane] += (_e2m1_lo(b) * xe[base + lane] + _e2m1_hi(b) * xo[base + lane]) * scale
    return _lane_sum(acc) * E2M1_UNIT  # in_features is a multiple of 32: no tail


# Rows [r0, r1) of one key's matrix against ntok inputs: out[tt, col0 + r - r0] = W'[r] · xin[toks[tt]].
# The parts are the key's rows of its banks, flattened (row r of a stacked matrix is sub-matrix r // rows);
# xin float32 [*, n] in the format's input order, toks int64 [>= ntok], out float32 [>= ntok, *]. A row's
# bytes are read from memory once and from L1 for each further token.

@njit(**KERNEL, fastmath=FASTMATH)
def rows_words(w, n, r0, r1, xin, toks, ntok, out, col0, word):
    """w uint16 [rows * n] bf16 / f16 words (word)."""
    for r in range(r0, r1):
        wr = w[r * n:(r + 1) * n]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_words(wr, xin[toks[tt]], word)


@njit(**KERNEL, fastmath=FASTMATH)
def rows_f32(w, n, r0, r1, xin, toks, ntok, out, col0):
    """w float32 [rows * n]."""
    for r in range(r0, r1):
        wr = w[r * n:(r + 1) * n]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_f32(wr, xin[toks[tt]])


@njit(**KERNEL, fastmath=FASTMATH)
def rows_fp8(q, s, n, rows, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [stack * rows * n] e4m3fn bytes, s float32 [stack * ceil(rows / 128) * ceil(n / 128)] block scales
    (each sub-matrix of `rows` rows has its own block rows)."""
    blocks = (n + FP8_BLOCK - 1) // FP8_BLOCK
    for r in range(r0, r1):
        srow = r // rows * ((rows + FP8_BLOCK - 1) // FP8_BLOCK) + r % rows // FP8_BLOCK
        qr, sr = q[r * n:(r + 1) * n], s[srow * blocks:(srow + 1) * blocks]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_fp8(qr, sr, xin[toks[tt]])


@njit(**KERNEL, fastmath=FASTMATH)
def rows_int4(q, s, z, n, r0, r1, xin, toks, ntok, out, col0, word, zero_points):
    """q uint8 [rows * n / 2] nibbles, s uint16 [rows * ceil(n / 128)] scales (word), z uint8 [same] zero
    points (read when zero_points)."""
    nb, groups = n // 2, (n + 127) // 128
    for r in range(r0, r1):
        qr, sr = q[r * nb:(r + 1) * nb], s[r * groups:(r + 1) * groups]
        zr = z[r * groups:(r + 1) * groups] if zero_points else z[:0]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_int4(qr, sr, zr, xin[toks[tt]], word, zero_points)


@njit(**KERNEL, fastmath=FASTMATH)
def rows_nvfp4(q, s, s2, n, rows, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 16] e4m3 scales, s2 float32 [stack] the
    sub-matrices' global scales."""
    nb, blocks = n // 2, n // 16
    for r in range(r0, r1):
        qr, sr, glob = q[r * nb:(r + 1) * nb], s[r * blocks:(r + 1) * blocks], s2[r // rows]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_nvfp4(qr, sr, xin[toks[tt]]) * glob


@njit(**KERNEL, fastmath=FASTMATH)
def rows_mxfp4(q, s, n, r0, r1, xin, toks, ntok, out, col0):
    """q uint8 [rows * n / 2] E2M1 nibbles, s uint8 [rows * n / 32] e8m0 scales."""
    nb, blocks = n // 2, n // 32
    for r in range(r0, r1):
        qr, sr = q[r * nb:(r + 1) * nb], s[r * blocks:(r + 1) * blocks]
        for tt in range(ntok):
            out[tt, col0 + r - r0] = dot_mxfp4(qr, sr, xin[toks[tt]])


@njit(**KERNEL)
def deinterleave(x, out):
    """x float32 [n] -> out [n] = [x[0], x[2], ... | x[1], x[3], ...] (the packed formats' input order)."""
    half = x.shape[0] // 2
    for j in range(half):
        out[j] = x[2 * j]
        out[half + j] = x[2 * j + 1]
