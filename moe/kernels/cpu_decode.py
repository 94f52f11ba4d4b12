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

The packed E2M1 formats' dots take 16 bytes a step through `e2m1_fma16` / `e2m1_fma16x4`, which decode
the step's 32 codes in vector registers: where the kernels compile for AVX-512 (`PERMUTE`), each code
indexes a 16-entry table of the values in one register (vpermps: a permute per 16 codes, no shift or
conversion); elsewhere by the half-precision move above. Both give the same values, and the step's
multiply-adds are the same in both (per lane l < 16: t = lo * xe + hi * xo, acc += t * scale).

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

from expertcache.numba_cache import target_features

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


# ---------------------------------------------------------------- 16 bytes of E2M1 codes a step

PERMUTE = "avx512f" in target_features()  # the kernels' target has vpermps over 16 floats
F32 = ir.FloatType()
V16F, V16I, V16B, V16H = (ir.VectorType(t, 16) for t in (F32, I32, I8, I16))
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = tuple(v * 2.0 ** -14 for v in _E2M1) + tuple(-v * 2.0 ** -14 for v in _E2M1)  # code -> value / 2^14


def _splat(ty, value):
    return ir.Constant(ir.VectorType(ty, 16), [ir.Constant(ty, value)] * 16)


def _element_ptr(context, builder, ty, array, index):
    """Pointer to element `index` of a contiguous 1-D numba array."""
    return builder.gep(context.make_array(ty)(context, builder, array).data, [index])


def _load16(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _fma16(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _e2m1_16(builder, codes):
    """<16 x i8> codes (0..15) -> <16 x float> value / 2^14."""
    if PERMUTE:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I]),
                                            "llvm.x86.avx512.permvar.sf.512")
        return builder.call(fn, [ir.Constant(V16F, [ir.Constant(F32, v) for v in E2M1_TABLE]),
                                 builder.zext(codes, V16I)])
    c = builder.zext(codes, V16H)
    bits = builder.or_(builder.shl(builder.and_(c, _splat(I16, 7)), _splat(I16, 9)),
                       builder.shl(builder.and_(c, _splat(I16, 8)), _splat(I16, 12)))
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)


def _step_codes(context, builder, qty, q, qi):
    """The low and high nibbles' values of 16 bytes q[qi..qi+15]."""
    b = _load16(builder, _element_ptr(context, builder, qty, q, qi), V16B)
    return _e2m1_16(builder, builder.and_(b, _splat(I8, 15))), _e2m1_16(builder, builder.lshr(b, _splat(I8, 4)))


def _step_scales(builder, s0, s1):
    """<16 x float>: s0 in lanes 0..7 (the step's first 16-element block), s1 in lanes 8..15."""
    pair = ir.Constant(ir.VectorType(F32, 2), None)
    pair = builder.insert_element(builder.insert_element(pair, s0, I32(0)), s1, I32(1))
    return builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(I32, 16), [0] * 8 + [1] * 8))


def _contiguous_1d(ty, dtype) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == dtype


@intrinsic
def e2m1_fma16(typingctx, q, qi, xe, xo, s0, s1, acc):
    """One step of an E2M1 dot: for l < 16, with lo / hi the values / 2^14 of byte q[qi + l]'s nibbles,
    acc[l] += (lo * xe[qi + l] + hi * xo[qi + l]) * (s0 if l < 8 else s1). q uint8, xe / xo / acc
    float32, all contiguous 1-D (acc: at least 16 lanes)."""
    if not (_contiguous_1d(q, types.uint8) and all(_contiguous_1d(a, types.float32) for a in (xe, xo, acc))
            and isinstance(qi, types.Integer)):
        return None
    sig = types.none(q, qi, xe, xo, types.float32, types.float32, acc)

    def codegen(context, builder, sig, args):
        qv, i, xev, xov, s0v, s1v, accv = args
        i = context.cast(builder, i, sig.args[1], types.intp)
        lo, hi = _step_codes(context, builder, sig.args[0], qv, i)
        xe16 = _load16(builder, _element_ptr(context, builder, sig.args[2], xev, i), V16F)
        xo16 = _load16(builder, _element_ptr(context, builder, sig.args[3], xov, i), V16F)
        ptr = builder.bitcast(_element_ptr(context, builder, sig.args[6], accv, ir.Constant(ir.IntType(64), 0)),
                              V16F.as_pointer())
        t = _fma16(builder, hi, xo16, builder.fmul(lo, xe16))
        builder.store(_fma16(builder, t, _step_scales(builder, s0v, s1v), builder.load(ptr, align=4)), ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def e2m1_fma16x4(typingctx, q, qi, e0, o0, e1, o1, e2, o2, e3, o3, s0, s1, a0, a1, a2, a3):
    """e2m1_fma16 for 4 inputs (e_k, o_k) into 4 accumulators a_k, the step decoded once: per lane,
    lo, hi scaled first (lo * s, hi * s), then a_k += lo * e_k + hi * o_k."""
    floats = (e0, o0, e1, o1, e2, o2, e3, o3, a0, a1, a2, a3)
    if not (_contiguous_1d(q, types.uint8) and all(_contiguous_1d(a, types.float32) for a in floats)
            and isinstance(qi, types.Integer)):
        return None
    sig = types.none(q, qi, *floats[:8], types.float32, types.float32, *floats[8:])

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        lo, hi = _step_codes(context, builder, sig.args[0], args[0], i)
        scale = _step_scales(builder, args[10], args[11])
        lo, hi = builder.fmul(lo, scale), builder.fmul(hi, scale)
        for k in range(4):
            e16, o16 = (_load16(builder, _element_ptr(context, builder, sig.args[n], args[n], i), V16F)
                        for n in (2 + 2 * k, 3 + 2 * k))
            ptr = builder.bitcast(_element_ptr(context, builder, sig.args[12 + k], args[12 + k],
                                               ir.Constant(ir.IntType(64), 0)), V16F.as_pointer())
            acc = _fma16(builder, hi, o16, _fma16(builder, lo, e16, builder.load(ptr, align=4)))
            builder.store(acc, ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen
