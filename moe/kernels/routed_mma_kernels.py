"""Triton kernels of the routed-expert GEMM on the tensor cores (host wrappers: moe.kernels.routed_mma).

    group (every launch, from slots [T, K] alone): pair p = t * K + j leads the group of its slot s when
        s is in [0, S) and p is s's first pair; the members are the pairs that hold s, in pair order
        (a slot twice in one row: two members), BLOCK_M of them a tile
    gate_up, grid (T * K, ceil(I / BLOCK_N)): the leader of each group (every other program returns)
        A = hidden[members] [BLOCK_M, H], B = gate rows [tile) and up rows [I + tile) of slot s, each
        BLOCK_K = 128 columns dequantized in registers to values exact in the dot's operand type, one
        tl.dot a block (dense, fp8) or one per nibble of its 16 words (4-bit: K = 16, the columns
        8l + k and the activations gathered alike), float32 accumulation, times the remaining scale
        -> act [T * K, I] f32 = weight * act(gate, up) at the members' pairs (gpt-oss: biases, clamp)
    down, grid (T * K, ceil(H / BLOCK_N)): the leader again
        A = act[member pairs] [BLOCK_M, I], B = down rows [tile) of slot s  -> y [T * K, H] f32
    combine, grid (T, ceil(H / BLOCK_H)): out[t] = Σ_{j = 0..K-1 in order, slots[t, j] in [0, S)} y[t * K + j]
        (+ Σ_j weights[t, j] * b2[slots[t, j]]) (+ addend[t]) -> out f32 and / or cast(out)

Legend: T = tokens, K = top_k, H = hidden, I = expert width, S = pool slots.

Values in the dot: each format's codes times the scales that keep them exact in bfloat16 (nvfp4's e2m1 *
e4m3 block scale, mxfp4's e2m1 * 2^e: at most 6 significant bits; int4's u - z, made from the code's
bits as the bfloat16 128 + u less 128 + z, and fp8's e4m3 alone); what remains (int4's group scale,
fp8's block scale, nvfp4's global scale) multiplies the block's float32 dot, BLOCK_K = 128 being one
int4 group and one fp8 block. Decoding each nibble where its dot reads it keeps the decoded tile out of
shared memory (only the raw words cross it). PREC picks the operands: 0 bfloat16
(bf16 activations: the product of two exact operands), 1 float32 ("ieee": a float32 or float16 model),
2 the float32 act of a bf16 model's down as two bfloat16 parts (hi + lo, written so by the gate_up:
SPLIT; two dots, about 16 significant bits of each activation against exact weights). EMU (the CPU
interpreter): the bfloat16 operands are multiplied as float32, the same products.

Every output element is written by one program in one fixed order, and the combine sums the K experts of
a token in order j, so the result is bitwise repeatable for fixed tiles; a pair with no slot is never
read. No atomics and no grid barrier: any other stream's work may hold SMs meanwhile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe.kernels.quant_kernels import INT4, MXFP4, NVFP4
from moe.kernels.routed_kernels import _activation, _finish_rows

BLOCK_K = tl.constexpr(128)  # columns a dot step: one int4 group, one fp8 block, 8 nvfp4 / 4 mxfp4 blocks
MMA_JIT_OPTIONS = {"do_not_specialize": ["num_slots", "tokens"]}  # a new S or T keeps the binary
COMBINE_JIT_OPTIONS = {"do_not_specialize": ["num_slots"]}
FAR = tl.constexpr(1 << 30)  # above any pair index


@triton.jit
def _group(slots_ptr, pair, tokens, num_slots, K: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr):
    """(slot s of `pair`, whether `pair` leads s's group, hit [TB * KB] int32 (the pair t * K + j, at
    t * KB + j, holds s), rank [TB * KB] (its place among the members), count (members)). The members
    are pairs, in pair order, so a slot twice in one row is two members."""
    t = tl.arange(0, TB)[:, None]
    j = tl.arange(0, KB)[None, :]
    ok = (t < tokens) & (j < K)
    s = tl.load(slots_ptr + t * K + j, mask=ok, other=-1)
    slot = tl.load(slots_ptr + pair)
    hit = tl.reshape((ok & (s == slot)).to(tl.int32), [TB * KB])
    rank = tl.cumsum(hit, axis=0) - 1
    count = tl.sum(hit, axis=0)
    first = tl.min(tl.where(hit > 0, _pairs(K, TB, KB), FAR), axis=0)
    leader = (slot >= 0) & (slot < num_slots) & (pair == first)
    return slot, leader, hit, rank, count


@triton.jit
def _pairs(K: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr):
    """[TB * KB] the pair index t * K + j at t * KB + j."""
    n = tl.arange(0, TB * KB)
    return (n // KB) * K + n % KB


@triton.jit
def _members(hit, rank, m0, K: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr):
    """(token [BLOCK_M], pair [BLOCK_M], valid [BLOCK_M]) of members m0 .. m0 + BLOCK_M - 1."""
    sel = (hit[:, None] > 0) & (rank[:, None] == (m0 + tl.arange(0, BLOCK_M))[None, :])  # [TB * KB, BLOCK_M]
    pair = tl.sum(tl.where(sel, _pairs(K, TB, KB)[:, None], 0), axis=0)
    valid = tl.sum(sel.to(tl.int32), axis=0) > 0
    return pair // K, pair, valid


@triton.jit
def _weight_tile(w, slot64, rows, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr, SUB: tl.constexpr,
                 FMT: tl.constexpr):
    """(values [R, BLOCK_K] float32, post [R] float32) of rows [R] of slot `slot64`'s dense (FMT 0) or fp8
    matrix [OUT, IN] (OUT / SUB stacked sub-matrices), columns [k0, k0 + BLOCK_K): the row's dot over
    these columns times post is its part of W' · x. values are exact in bfloat16 (dense: as they are);
    a row not ok and a column past IN give 0 and post 0 for a row not ok. w: the matrix's pool banks
    (q, s, s2, z) [S, ...] as SlotMatrix.kernel_args."""
    if FMT == 0:
        values, post = _dense_tile(w[0], slot64, rows.to(tl.int64), row_ok, k0, OUT, IN)
    else:
        values, post = _fp8_tile(w, slot64, rows, row_ok, k0, OUT, IN, SUB)
    return values, post


@triton.jit
def _words(q_ptr, slot64, rows64, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr):
    """(words [R, BLOCK_K / 8] int32 of 8 codes each (code j in bits 4j..4j + 3), col8: the first column
    of each word) of a 4-bit matrix's rows at columns [k0, k0 + BLOCK_K); 0 where masked."""
    col8 = k0 + 8 * tl.arange(0, BLOCK_K // 8)
    words = tl.load(q_ptr + slot64 * (OUT * (IN // 8)) + rows64[:, None] * (IN // 8) + (col8 // 8)[None, :],
                    mask=row_ok[:, None] & (col8 < IN)[None, :], other=0)
    return words, col8


@triton.jit
def _dense_tile(q_ptr, slot64, rows64, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr):
    cols = k0 + tl.arange(0, BLOCK_K)
    m = row_ok[:, None] & (cols < IN)[None, :]
    v = tl.load(q_ptr + slot64 * (OUT * IN) + rows64[:, None] * IN + cols[None, :], mask=m, other=0.0)
    return v.to(tl.float32), tl.where(row_ok, 1.0, 0.0)


@triton.jit
def _fp8_tile(w, slot64, rows, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr, SUB: tl.constexpr):
    """e4m3 values; post the 128 x 128 block's scale (each sub-matrix has its own block rows)."""
    q_ptr, s_ptr, _, _ = w
    cols = k0 + tl.arange(0, BLOCK_K)
    m = row_ok[:, None] & (cols < IN)[None, :]
    v = tl.load(q_ptr + slot64 * (OUT * IN) + rows.to(tl.int64)[:, None] * IN + cols[None, :], mask=m, other=0)
    PER_SUB: tl.constexpr = (SUB + 127) // 128  # block rows of a sub-matrix
    BLOCKS: tl.constexpr = (IN + 127) // 128  # scale columns
    SROWS: tl.constexpr = (OUT // SUB) * PER_SUB
    srow = (rows // SUB) * PER_SUB + (rows % SUB) // 128
    post = tl.load(s_ptr + slot64 * (SROWS * BLOCKS) + srow.to(tl.int64) * BLOCKS + k0 // 128, mask=row_ok,
                   other=0.0)
    return v.to(tl.float8e4nv, bitcast=True).to(tl.float32), post.to(tl.float32)


@triton.jit
def _mma(a, b, EMU: tl.constexpr):
    """a [M, BLOCK_K] bfloat16 · b [BLOCK_K, N] bfloat16 -> [M, N] float32 (EMU: the same exact operands
    multiplied in float32, for Triton's CPU interpreter, whose 16-bit dots are wrong)."""
    if EMU:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _load_a(a_rows, cols, mask, lo_off, PREC: tl.constexpr):
    """(a, lo) at columns cols of the rows a_rows [M, 1]: lo (PREC 2: the bfloat16 low parts, lo_off
    elements after the high ones) or a again."""
    a = tl.load(a_rows + cols, mask=mask, other=0.0)
    lo = a
    if PREC == 2:
        lo = tl.load(a_rows + lo_off + cols, mask=mask, other=0.0)
    return a, lo


@triton.jit
def _dot(a, lo, values, PREC: tl.constexpr, EMU: tl.constexpr):
    """a [M, BLOCK_K] (+ lo, PREC 2) · values [N, BLOCK_K] float32, transposed -> [M, N] float32. One
    return: Triton's compiler type-checks the code after a constexpr branch's return too."""
    if PREC == 1:
        out = tl.dot(a.to(tl.float32), tl.trans(values), input_precision="ieee")
    elif PREC == 0:
        out = _mma(a.to(tl.bfloat16), tl.trans(values.to(tl.bfloat16)), EMU)
    else:
        b = tl.trans(values.to(tl.bfloat16))
        out = _mma(a, b, EMU) + _mma(lo, b, EMU)
    return out


@triton.jit
def _block(acc, a_rows, lo_off, valid, w, slot64, rows, row_ok, k0, OUT: tl.constexpr,
           IN: tl.constexpr, SUB: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr, PREC: tl.constexpr,
           EMU: tl.constexpr):
    """acc [M, R] + the activations' columns [k0, k0 + BLOCK_K) (rows a_rows [M, 1], pointers to each
    member's row; valid [M]) dotted with the weight rows `rows` of slot `slot64` (as _weight_tile)."""
    if FMT == INT4:
        acc = _int4_block(acc, a_rows, lo_off, valid, w, slot64, rows, row_ok, k0, OUT, IN, ZP, PREC, EMU)
    elif FMT == NVFP4 or FMT == MXFP4:
        acc = _e2m1_block(acc, a_rows, lo_off, valid, w, slot64, rows, row_ok, k0, OUT, IN, SUB, FMT, PREC, EMU)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        a, lo = _load_a(a_rows, cols[None, :], valid[:, None] & (cols < IN)[None, :], lo_off, PREC)
        values, post = _weight_tile(w, slot64, rows, row_ok, k0, OUT, IN, SUB, FMT)
        acc += _dot(a, lo, values, PREC, EMU) * post[None, :]
    return acc


@triton.jit
def _int4_block(acc, a_rows, lo_off, valid, w, slot64, rows, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr,
                ZP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """_block of int4: one dot per nibble k of the group's 16 words (K = 16: the columns 8l + k, the
    activations gathered alike), so the codes are decoded where the dot reads them, with no reshape.
    A code u becomes the bfloat16 128 + u by its bits (0x4300 | u), less 128 + z: u - z, exact (on
    the GPU two values a half-precision instruction). The group's scale multiplies the sum of the 8 dots."""
    q_ptr, s_ptr, _, z_ptr = w
    rows64 = rows.to(tl.int64)
    words, col8 = _words(q_ptr, slot64, rows64, row_ok, k0, OUT, IN)  # [R, 16]
    GROUPS: tl.constexpr = (IN + 127) // 128
    soff = slot64 * (OUT * GROUPS) + rows64 * GROUPS + k0 // 128
    post = tl.load(s_ptr + soff, mask=row_ok, other=0.0).to(tl.float32)
    if ZP:
        zero = tl.load(z_ptr + soff, mask=row_ok, other=0).to(tl.float32)[:, None]
    else:
        zero = 8.0
    amask = valid[:, None] & (col8 < IN)[None, :]
    block = tl.zeros(acc.shape, dtype=tl.float32)
    for k in tl.static_range(8):
        a, lo = _load_a(a_rows, (col8 + k)[None, :], amask, lo_off, PREC)  # [M, 16]
        codes = (words >> (4 * k)) & 15
        values = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 + zero)
        block += _dot(a, lo, values, PREC, EMU)
    return acc + block * post[None, :]


@triton.jit
def _e2m1_block(acc, a_rows, lo_off, valid, w, slot64, rows, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr,
                SUB: tl.constexpr, FMT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """_block of nvfp4 / mxfp4 as _int4_block's dots: nibble k of the 16 words (columns 8l + k, in block
    8l // BS); each code's bits placed in a float16 (value * 2^-14, exact), times its block's scale
    * 2^14 in float32 (exact), the dot's operand; nvfp4's global scale multiplies the sum."""
    q_ptr, s_ptr, s2_ptr, _ = w
    rows64 = rows.to(tl.int64)
    words, col8 = _words(q_ptr, slot64, rows64, row_ok, k0, OUT, IN)  # [R, 16]
    BS: tl.constexpr = 16 if FMT == NVFP4 else 32
    NSC: tl.constexpr = IN // BS
    sc = col8 // BS  # [16] each word's block
    soff = slot64 * (OUT * NSC) + rows64[:, None] * NSC + sc[None, :]
    sm = row_ok[:, None] & (col8 < IN)[None, :]
    if FMT == MXFP4:  # e8m0: 2^(e - 127), e = 0 is 2^-127 (a float32 subnormal)
        e = tl.load(s_ptr + soff, mask=sm, other=0).to(tl.int32)
        scale = tl.where(e > 0, (e << 23).to(tl.float32, bitcast=True), 5.877471754111438e-39) * 16384.0
        post = tl.where(row_ok, 1.0, 0.0)
    else:
        scale = tl.load(s_ptr + soff, mask=sm, other=0.0).to(tl.float32) * 16384.0
        post = tl.load(s2_ptr + slot64 * (OUT // SUB) + rows // SUB, mask=row_ok, other=0.0).to(tl.float32)
    amask = valid[:, None] & (col8 < IN)[None, :]
    block = tl.zeros(acc.shape, dtype=tl.float32)
    for k in tl.static_range(8):
        a, lo = _load_a(a_rows, (col8 + k)[None, :], amask, lo_off, PREC)
        c = words >> (4 * k)
        h = ((c & 7) << 9) | ((c & 8) << 12)
        values = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
        block += _dot(a, lo, values, PREC, EMU)
    return acc + block * post[None, :]


@triton.jit(**MMA_JIT_OPTIONS)
def _gate_up_mma(x_ptr, slots_ptr, weights_ptr, w13, act_ptr, num_slots, tokens, b13_ptr, lo_off,
                 K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
                 PREC: tl.constexpr, EMU: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr = 0,
                 ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0, BIAS: tl.constexpr = False):
    """x_ptr [T, H] hidden; slots_ptr *i32 [T * K]; weights_ptr *fp32 [T * K]; w13 the gate_up banks (q, s, s2,
    z) [S, 2I, H] in format FMT; act_ptr *fp32 [T * K, I] out, or (SPLIT) *bf16 [T * K, I] of the high
    parts and lo_off elements further the low ones (act = hi + lo); b13_ptr [S, 2I] (read when BIAS)."""
    slot, leader, hit, rank, count = _group(slots_ptr, tl.program_id(0), tokens, num_slots, K, TB, KB)
    if leader:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows are I further
        row_ok = n < I
        slot64 = slot.to(tl.int64)
        m0 = 0
        while m0 < count:
            token, pair, valid = _members(hit, rank, m0, K, TB, KB, BLOCK_M)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            a_rows = x_ptr + token[:, None].to(tl.int64) * H  # [BLOCK_M, 1]
            for k0 in range(0, H, BLOCK_K):
                acc_g = _block(acc_g, a_rows, 0, valid, w13, slot64, n, row_ok, k0, 2 * I, H, I, FMT, ZP,
                               PREC, EMU)
                acc_u = _block(acc_u, a_rows, 0, valid, w13, slot64, n + I, row_ok, k0, 2 * I, H, I, FMT, ZP,
                               PREC, EMU)
            weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
            act = _activation(weight[:, None], acc_g, acc_u, b13_ptr, slot, True, n, I, ACT, ALPHA, LIMIT, BIAS)
            where = pair[:, None].to(tl.int64) * I + n[None, :]
            keep = valid[:, None] & row_ok[None, :]
            if SPLIT:  # the down's two bfloat16 parts: about 16 significant bits of each float32
                hi = act.to(tl.bfloat16)
                tl.store(act_ptr + where, hi, mask=keep)
                tl.store(act_ptr + lo_off + where, (act - hi.to(tl.float32)).to(tl.bfloat16), mask=keep)
            else:
                tl.store(act_ptr + where, act, mask=keep)
            m0 += BLOCK_M


@triton.jit(**MMA_JIT_OPTIONS)
def _down_mma(act_ptr, slots_ptr, w2, y_ptr, num_slots, tokens, lo_off,
              K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
              PREC: tl.constexpr, EMU: tl.constexpr):
    """act_ptr *fp32 [T * K, I], or (PREC 2) *bf16 of the gate_up's SPLIT parts (lo_off apart); slots_ptr
    *i32 [T * K]; w2 the down banks [S, H, I]; y_ptr *fp32 [T * K, H] out (rows of pairs with a slot)."""
    slot, leader, hit, rank, count = _group(slots_ptr, tl.program_id(0), tokens, num_slots, K, TB, KB)
    if leader:
        h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = h < H
        slot64 = slot.to(tl.int64)
        m0 = 0
        while m0 < count:
            token, pair, valid = _members(hit, rank, m0, K, TB, KB, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            a_rows = act_ptr + pair[:, None].to(tl.int64) * I
            for k0 in range(0, I, BLOCK_K):
                acc = _block(acc, a_rows, lo_off, valid, w2, slot64, h, row_ok, k0, H, I, H, FMT, ZP, PREC,
                             EMU)
            tl.store(y_ptr + pair[:, None].to(tl.int64) * H + h[None, :], acc, mask=valid[:, None] & row_ok[None, :])
            m0 += BLOCK_M


@triton.jit(**COMBINE_JIT_OPTIONS)
def _combine(y_ptr, slots_ptr, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
             K: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr, ADDEND: tl.constexpr,
             WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr, BIAS: tl.constexpr):
    """y_ptr *fp32 [T * K, H]; addend_ptr *fp32 [T, H] (read when ADDEND); out_ptr *fp32 [T, H] (written when
    WRITE_OUT); cast_ptr [T, H] the model dtype (written when WRITE_CAST); weights_ptr *fp32 [T * K] and b2_ptr
    [S, H] the down biases (read when BIAS)."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):  # ordered combine: j = 0, 1, ..., K-1
        slot = tl.load(slots_ptr + token * K + j)
        live = (slot >= 0) & (slot < num_slots)
        y += tl.load(y_ptr + (token * K + j).to(tl.int64) * H + rows, mask=live & (rows < H), other=0.0)
    _finish_rows(y, token, rows, slots_ptr, num_slots, weights_ptr, b2_ptr, addend_ptr, out_ptr, cast_ptr, K, H,
                 BIAS, ADDEND, WRITE_OUT, WRITE_CAST)
