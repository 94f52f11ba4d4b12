"""The CPU expert kernels' building blocks (numba): exact decoders of each format's codes, stack buffers.

    a weight code (an integer of the row's bytes) ──bf16 / f16 / e4m3 / _e2m1_* / _u4_*──► float32
    a scale code ──word_f32 (bf16 / f16) / e8m0_f32──► float32
    x float32 [n] ──deinterleave──► [even elements | odd elements] (the packed formats' input order)

The decoders are LLVM intrinsics small enough for the compiler to vectorize in the dot loops of
moe.kernels.cpu_dots. All are exact; where a code is placed in a half-precision word, the row's dot
applies the power-of-two factor once, to its total:

    bf16      bits << 16 is the float32                       (bf16)
    float16   the half-precision bits, converted (vcvtph2ps)  (f16)
    e4m3fn    bits (s, e, m) moved into a half: (b & 0x7F) << 7 | sign << 15 = value * 2^-8
              (subnormals included: they become half subnormals)              (e4m3)
    E2M1      code (s, e, m) moved into a half: (c & 7) << 9 | sign << 15 = value * 2^-14  (_e2m1_*)
    int4      the nibble converted to float (the zero point is the caller's)   (_u4_*)

`stack_array` gives a function a small float32 buffer on its own stack, uncounted: the dots' per-lane
accumulators, which the compiler keeps in vector registers.
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
LANES = 32  # float32 accumulators of a dot (2 AVX-512 registers, 4 AVX2 ones)
# 16-bit words: how a half-precision word (dense values, int4 scales, biases) is read
WORD_BF16, WORD_F16 = 0, 1
E4M3_UNIT = np.float32(256.0)  # e4m3 gives value / 256
E2M1_UNIT = np.float32(16384.0)  # e2m1_lo / e2m1_hi give value / 2^14

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
def bf16(typingctx, bits):
    """float32 of bfloat16 bits (an integer's low 16 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = builder.zext(_int(builder, args[0], sig.args[0], I16), I32)
        return builder.bitcast(builder.shl(word, I32(16)), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def f16(typingctx, bits):
    """float32 of float16 bits (an integer's low 16 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _half_to_f32(builder, _int(builder, args[0], sig.args[0], I16))
    return types.float32(bits), codegen


@intrinsic
def e4m3(typingctx, byte):
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


e2m1_lo = _e2m1_intrinsic(False)  # value / 2^14 of the low nibble's E2M1 code
e2m1_hi = _e2m1_intrinsic(True)  # ... of the high nibble's


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


u4_lo = _u4_intrinsic(False)  # float32 of the low nibble, 0..15
u4_hi = _u4_intrinsic(True)  # ... of the high nibble


@intrinsic
def f32_bits(typingctx, bits):
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


# a dot's per-lane accumulators, kept in vector registers once its lane loops are unrolled
lane_array = stack_array(LANES)


@njit(**KERNEL, inline="always")
def zero_lanes(acc):
    for lane in range(LANES):
        acc[lane] = 0


@njit(**KERNEL, inline="always", fastmath=FASTMATH)
def lane_sum(acc):
    total = np.float32(0)
    for lane in range(LANES):
        total += acc[lane]
    return total


@njit(**KERNEL, inline="always")
def word_f32(bits, word):
    """float32 of a 16-bit word read as bfloat16 (word WORD_BF16) or float16 (WORD_F16)."""
    return bf16(bits) if word == WORD_BF16 else f16(bits)


@njit(**KERNEL, inline="always")
def e8m0_f32(code):
    """2^(code - 127) of an e8m0 scale byte (code 255, NaN, is the store's to refuse)."""
    return f32_bits(np.uint32(code) << np.uint32(23)) if code else np.float32(2.0 ** -127)


@njit(**KERNEL)
def deinterleave(x, out):
    """x float32 [n] -> out [n] = [x[0], x[2], ... | x[1], x[3], ...] (the packed formats' input order)."""
    half = x.shape[0] // 2
    for j in range(half):
        out[j] = x[2 * j]
        out[half + j] = x[2 * j + 1]
