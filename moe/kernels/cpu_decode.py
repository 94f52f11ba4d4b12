"""The CPU expert kernels' building blocks (numba): exact decoders of each format's codes, stack buffers.

    a weight code (an integer of the row's bytes) ──bf16 / f16 / e4m3 / _e2m1_* / _u4_*──► float32
    a scale code ──word_f32 (bf16 / f16) / e8m0_f32──► float32
    a packed chunk (64 bytes, 128 codes) / an fp8 block (128 bytes) ──*_chunk / *_chunk4──► per-lane sums

The decoders are LLVM intrinsics small enough for the compiler to vectorize in the dot loops of
moe.kernels.cpu_dots. All are exact; where a code is placed in a half-precision word, the row's dot
applies the power-of-two factor once, to its total:

    bf16      bits << 16 is the float32                       (bf16)
    float16   the half-precision bits, converted (vcvtph2ps)  (f16)
    e4m3fn    bits (s, e, m) moved into a half: (b & 0x7F) << 7 | sign << 15 = value * 2^-8
              (subnormals included: they become half subnormals)              (e4m3)
    E2M1      code (s, e, m) moved into a half: (c & 7) << 9 | sign << 15 = value * 2^-14  (_e2m1_*)
    int4      the nibble converted to float (the zero point is the caller's)   (_u4_*)

The chunk steps (`nvfp4_chunk`, `mxfp4_chunk`, `int4_chunk`, `fp8_chunk` and their 4-input `*_chunk4`)
decode 128 codes in vector registers and fold them into 16 per-lane accumulators. A packed chunk's 64
bytes are read as 16 32-bit words; its 8 steps take nibble k of every word by a shift and a mask (no byte
shuffle), so lane l of step k is input 8l + k (`chunk_place` gives the input order this asks of x). The
codes are decoded where the kernels compile for AVX-512 (`PERMUTE`) by a 16-entry table in one register
(vpermps: E2M1's values, or int4's codes minus the zero point); elsewhere by the half-precision move
(E2M1) or a conversion (int4), with the same values. fp8's 16 bytes a step go through one sign-extend,
shift and mask into halves. A chunk's steps sum in two chains per lane; the lane's scale (its block's, or
the group's) then multiplies the sum into the accumulator, and `sum16` adds the lanes in a fixed tree.
Each step also asks for the cache line PREFETCH_BYTES ahead of its own bytes, which keeps enough of a
row stream's misses in flight; it changes no value.

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


# ---------------------------------------------------------------- a chunk of 128 packed 4-bit codes

CHUNK_CODES = 128  # codes of a packed chunk: 64 bytes, read as 16 little-endian 32-bit words
CHUNK_BYTES = CHUNK_CODES // 2
PERMUTE = "avx512f" in target_features()  # the kernels' target has vpermps over 16 floats
F32 = ir.FloatType()
V16F, V16I, V16B, V16H = (ir.VectorType(t, 16) for t in (F32, I32, I8, I16))
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = tuple(v * 2.0 ** -14 for v in _E2M1) + tuple(-v * 2.0 ** -14 for v in _E2M1)  # code -> value / 2^14
I64 = ir.IntType(64)


def _vector(ty, values):
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def _splat(ty, value):
    return _vector(ty, [value] * 16)


def _element_ptr(context, builder, ty, array, index):
    """Pointer to element `index` of a contiguous 1-D numba array."""
    return builder.gep(context.make_array(ty)(context, builder, array).data, [index])


def _load(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _fma16(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _permute16(builder, table, codes):
    """<16 x float> table[codes[l]] (vpermps; codes 0..15)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I]),
                                        "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, codes])


def _e2m1_16(builder, codes):
    """<16 x i32> codes (0..15) -> <16 x float> value / 2^14."""
    if PERMUTE:
        return _permute16(builder, _vector(F32, E2M1_TABLE), codes)
    c = builder.trunc(codes, V16H)
    bits = builder.or_(builder.shl(builder.and_(c, _splat(I16, 7)), _splat(I16, 9)),
                       builder.shl(builder.and_(c, _splat(I16, 8)), _splat(I16, 12)))
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)


def _e4m3_16(builder, b):
    """<16 x i8> e4m3fn bytes -> <16 x float> value / 256: the byte sign-extended to 16 bits and shifted left
    by 7 holds the sign in bit 15 (and 14, cleared) and exponent and mantissa in bits 13..7: a half."""
    h = builder.and_(builder.shl(builder.sext(b, V16H), _splat(I16, 7)), _splat(I16, 0xBF80))
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 16)), V16F)


def _lanes_of(builder, ptr, n):
    """<16 x i8>: n bytes at ptr, byte l * n // 16 in lane l (each byte over 16 / n lanes)."""
    vty = ir.VectorType(I8, n)
    b = _load(builder, ptr, vty)
    return builder.shuffle_vector(b, b, _vector(I32, [lane * n // 16 for lane in range(16)]))


def _nvfp4_scales(builder, ptr):
    """A chunk's 8 e4m3 block scales (value / 256), block l // 2 in lane l."""
    h = builder.zext(_lanes_of(builder, ptr, 8), V16H)
    bits = builder.or_(builder.shl(builder.and_(h, _splat(I16, 0x7F)), _splat(I16, 7)),
                       builder.shl(builder.and_(h, _splat(I16, 0x80)), _splat(I16, 8)))
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), V16F)


def _mxfp4_scales(builder, ptr):
    """A chunk's 4 e8m0 block scales 2^(e - 127) (code 0: 2^-127), block l // 4 in lane l."""
    w = builder.zext(_lanes_of(builder, ptr, 4), V16I)
    scales = builder.bitcast(builder.shl(w, _splat(I32, 23)), V16F)
    return builder.select(builder.icmp_unsigned("==", w, _splat(I32, 0)), _splat(F32, 2.0 ** -127), scales)


_SCALES = {"nvfp4": _nvfp4_scales, "mxfp4": _mxfp4_scales}


# A chunk step asks for the line this far ahead of its bytes (prefetcht0): a 4-bit chunk decodes 128 codes
# from one cache line, too much work a line for the core's window to keep enough misses in flight, so
# without it the packed formats stall on memory while bf16 streams at several times their bytes a second.
# Past a row it reaches the rows after it (the next in a work item, or another item's: a hint, never a fault).
PREFETCH_BYTES = 2048


def _prefetch(builder, ptr):
    """prefetcht0 of the cache line at ptr (no fault past an array's end: a hint only)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), I32(0), I32(3), I32(1)])


def _chunk_codegen(kind: str, tokens: int):
    """Codegen of a chunk step for `tokens` inputs: args (q, qi, s, si, x_0.., xi, acc_0..) where (s, si) is
    the scale array and index (nvfp4 / mxfp4) or (scale, zero) float32 (int4)."""
    def codegen(context, builder, sig, args):
        q, qi, s, si = args[:4]
        xs, xi, accs = args[4:4 + tokens], args[4 + tokens], args[5 + tokens:]
        qi = context.cast(builder, qi, sig.args[1], types.intp)
        xi = context.cast(builder, xi, sig.args[4 + tokens], types.intp)
        for line in range(2 if kind == "fp8" else 1):  # the line PREFETCH_BYTES on (fp8: both of that chunk)
            _prefetch(builder, _element_ptr(context, builder, sig.args[0], q,
                                            builder.add(qi, I64(PREFETCH_BYTES + 64 * line))))
        if kind == "fp8":
            values = [_e4m3_16(builder, _load(builder, _element_ptr(context, builder, sig.args[0], q,
                                                                     builder.add(qi, I64(16 * k))), V16B))
                      for k in range(8)]
        else:
            words = _load(builder, _element_ptr(context, builder, sig.args[0], q, qi), V16I)
            codes = [builder.and_(builder.lshr(words, _splat(I32, 4 * k)), _splat(I32, 15)) for k in range(8)]
        if kind == "fp8":
            si = context.cast(builder, si, sig.args[3], types.intp)
            scale = _splat_value(builder, builder.load(_element_ptr(context, builder, sig.args[2], s, si)))
        elif kind != "int4":
            values = [_e2m1_16(builder, c) for c in codes]
        elif PERMUTE:  # a table of the 16 codes minus the zero point
            table = builder.fsub(_vector(F32, [float(c) for c in range(16)]), _splat_value(builder, si))
            values = [_permute16(builder, table, c) for c in codes]
        else:
            values = [builder.fsub(builder.uitofp(c, V16F), _splat_value(builder, si)) for c in codes]
        if kind == "int4":
            scale = _splat_value(builder, s)
        elif kind != "fp8":
            si = context.cast(builder, si, sig.args[3], types.intp)
            scale = _SCALES[kind](builder, _element_ptr(context, builder, sig.args[2], s, si))
        for n in range(tokens):
            sums = [None, None]  # two chains (even and odd k), added at the end
            for k in range(8):
                at = builder.add(xi, I64(16 * k))
                xk = _load(builder, _element_ptr(context, builder, sig.args[4 + n], xs[n], at), V16F)
                sums[k % 2] = builder.fmul(values[k], xk) if sums[k % 2] is None else \
                    _fma16(builder, values[k], xk, sums[k % 2])
            ptr = builder.bitcast(_element_ptr(context, builder, sig.args[5 + tokens + n], accs[n], I64(0)),
                                  V16F.as_pointer())
            acc = builder.load(ptr, align=4)
            builder.store(_fma16(builder, builder.fadd(sums[0], sums[1]), scale, acc), ptr, align=4)
        return context.get_dummy_value()
    return codegen


def _splat_value(builder, value):
    """<16 x float> of a float32 scalar."""
    v = builder.insert_element(ir.Constant(ir.VectorType(F32, 1), None), value, I32(0))
    return builder.shuffle_vector(v, v, _vector(I32, [0] * 16))


def _chunk_ok(kind: str, tokens: int, q, qi, s, si, floats, xi) -> bool:
    scales = (isinstance(s, types.Float) and isinstance(si, types.Float) if kind == "int4"
              else _contiguous_1d(s, types.float32 if kind == "fp8" else types.uint8) and isinstance(si, types.Integer))
    return (_contiguous_1d(q, types.uint8) and isinstance(qi, types.Integer) and isinstance(xi, types.Integer)
            and scales and len(floats) == 2 * tokens and all(_contiguous_1d(a, types.float32) for a in floats))


def _chunk_intrinsic(kind: str):
    """The chunk step of one input (kind: nvfp4, mxfp4, int4)."""
    @intrinsic
    def chunk(typingctx, q, qi, s, si, x, xi, acc):
        if not _chunk_ok(kind, 1, q, qi, s, si, (x, acc), xi):
            return None
        return types.none(q, qi, s, si, x, xi, acc), _chunk_codegen(kind, 1)
    return chunk


def _chunk4_intrinsic(kind: str):
    """The chunk step of 4 inputs into 4 accumulators, the codes decoded once."""
    @intrinsic
    def chunk4(typingctx, q, qi, s, si, x0, x1, x2, x3, xi, a0, a1, a2, a3):
        if not _chunk_ok(kind, 4, q, qi, s, si, (x0, x1, x2, x3, a0, a1, a2, a3), xi):
            return None
        return types.none(q, qi, s, si, x0, x1, x2, x3, xi, a0, a1, a2, a3), _chunk_codegen(kind, 4)
    return chunk4


# acc[l] += (Σ_k value(code k of word l) * x[xi + 16 k + l]) * scale[l] for l < 16, over the 128 codes of
# q[qi:qi + 64] (value: E2M1 / 2^14, or the int4 code minus `zero`; scale: the chunk's block scales by lane,
# or int4's one scale)
nvfp4_chunk, mxfp4_chunk, int4_chunk = (_chunk_intrinsic(k) for k in ("nvfp4", "mxfp4", "int4"))
nvfp4_chunk4, mxfp4_chunk4, int4_chunk4 = (_chunk4_intrinsic(k) for k in ("nvfp4", "mxfp4", "int4"))
# the same for fp8's 128 bytes q[qi:qi + 128] (one 128-wide block, scale s[si]) and x[xi + 16 k + l] =
# input 16 k + l: inputs in their natural order
fp8_chunk, fp8_chunk4 = _chunk_intrinsic("fp8"), _chunk4_intrinsic("fp8")


@intrinsic
def sum16(typingctx, acc):
    """acc[0] + ... + acc[15] of a float32 array by halves (a fixed tree: 8, 4, 2, 1 lanes)."""
    if not _contiguous_1d(acc, types.float32):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(builder.bitcast(_element_ptr(context, builder, sig.args[0], args[0], I64(0)),
                                         V16F.as_pointer()), align=4)
        width = 16
        while width > 1:
            width //= 2
            v = builder.fadd(builder.shuffle_vector(v, v, _vector(I32, list(range(width)))),
                             builder.shuffle_vector(v, v, _vector(I32, list(range(width, 2 * width)))))
        return builder.extract_element(v, I32(0))
    return types.float32(acc), codegen


def _contiguous_1d(ty, dtype) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype == dtype


@njit(**KERNEL, inline="always")
def chunk_place(i, cols):
    """Where input i of a packed matrix of `cols` columns sits in its input order: within each whole chunk of
    CHUNK_CODES inputs, input 8 l + k (word l's code k) at 16 k + l; inputs past the last whole chunk in place."""
    if i >= cols // CHUNK_CODES * CHUNK_CODES:
        return i
    e = i % CHUNK_CODES
    return i - e + (e % 8) * 16 + e // 8
