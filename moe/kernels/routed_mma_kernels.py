"""Triton kernels of the routed-expert GEMM on the tensor cores (host wrappers: moe.kernels.routed_mma).

    group (every launch, from slots [T, K] alone): pair p = t * K + j leads the group of its slot s when
        s is in [0, S) and p is s's first pair; the members are the pairs that hold s, in pair order
        (a slot twice in one row: two members), BLOCK_M of them a tile
    gate_up, grid (T * K, ceil(I / BLOCK_N)): the leader of each group (every other program returns)
        acc [2 BLOCK_N, BLOCK_M] = A · B per BLOCK_K = 128 columns, float32 accumulation:
        A = the weights, gate rows [tile) then up rows I + [tile) of slot s, dequantized in registers
            to values exact in the dot's operand type, in the layout of the dot's register operand
        B = hidden[members]^T [BLOCK_K, BLOCK_M], the same columns in the same order
        times the remaining scale -> act [T * K, I] f32 = weight * act(gate, up) at the members' pairs
        (gpt-oss: biases, clamp)
    down, grid (T * K, ceil(H / BLOCK_N)): the leader again
        A = down rows [tile) of slot s, B = act[member pairs]^T  -> y [T * K, H] f32
    combine, grid (T, ceil(H / BLOCK_H)): out[t] = Σ_{j = 0..K-1 in order, slots[t, j] in [0, S)} y[t * K + j]
        (+ Σ_j weights[t, j] * b2[slots[t, j]]) (+ addend[t]) -> out f32 and / or cast(out)

Legend: T = tokens, K = top_k, H = hidden, I = expert width, S = pool slots.

The weights are the dot's first operand (M = weight rows) and the tokens its second (N = BLOCK_M
members): at decode a slot has about one token, so the rows fill the tensor cores' M side, and on
Hopper wgmma reads its first operand from registers. The decode then runs on registers already in that
operand's layout: only the packed words (and the small activation tile) cross shared memory, never the
decoded tile. To make each thread's registers whole words, a block's 128 columns enter the dot in a
fixed order (_order): 4-bit words, dot position p = 32m + 16h + 8b + 2c + e holds column
8(4c + m) + 4e + 2h + b, so the thread of lane c reads words 4c .. 4c + 3 and each 32-bit register
pairs nibbles n and n + 4 of one word (one mask yields two values); fp8 words, column
4(8c + 2m + h) + 2e + b (bytes b and b + 2 of a word). The activations are loaded in column order and
permuted alike in registers on their way to shared memory. Dense weights keep the column order. fp8
rows are read as words, so their length is a multiple of 4 (the host checks); offsets within one slot's
matrix are int32 (OUT * IN < 2^31).

Values in the dot, each exact in bfloat16 (at most 6 significant bits, in range): int4's u - z, made
from the code's bits as the bfloat16 128 + u (0x4300 | u) less 128 + z; E2M1 codes' sign and 3 bits
placed in a bfloat16 (value * 2^-126, code 1 a subnormal) times the e4m3 block scale * 2^118 (nvfp4;
the remaining 2^8 joins the global scale) or times 2^126 and then 2^(e - 127) (mxfp4); e4m3 bytes'
bits placed in a bfloat16 (value * 2^-120) times 2^120; dense weights as stored. What remains (int4's
group scale, fp8's block scale, nvfp4's global scale) multiplies the block's float32 dot, BLOCK_K = 128
being one int4 group and one fp8 block. On the GPU the decode's bfloat16 pairs go through sm_90's
bfloat16x2 arithmetic, two values an instruction. PREC picks the operands: 0 bfloat16 (bf16
activations: the product of two exact operands), 1 float32 ("ieee": a float32 or float16 model),
2 the float32 act of a bf16 model's down as two bfloat16 parts (hi + lo, written so by the gate_up:
SPLIT; two dots, about 16 significant bits of each activation against exact weights). EMU (the CPU
interpreter): the same values without inline PTX, decoded and multiplied in float32 (the interpreter
holds bfloat16 as its bits, and its bfloat16 casts flush subnormals).

Every output element is written by one program in one fixed order, and the combine sums the K experts
of a token in order j, so the result is bitwise repeatable for fixed tiles; a
pair with no slot is never read. No program waits for another and there is no grid barrier: any other
stream's work may hold SMs meanwhile.
On CUDA the three launches are programmatic dependent launches (GDC), as the one-program-a-pair kernels':
each waits (griddepcontrol.wait) before reading anything, so the results are those of plain launches,
and the gate_up and the down let their successor launch while they run.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe.kernels.quant_kernels import FP8, INT4, MXFP4, NVFP4, SIGN_BITS
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
def _order(x, R: tl.constexpr, ORDER: tl.constexpr, EMU: tl.constexpr):
    """x [R, BLOCK_K] in column order -> the dot's K order: ORDER 1 the 4-bit words' (column
    8(4c + m) + 4e + 2h + b at p = 32m + 16h + 8b + 2c + e), 2 the fp8 words' (column 4(8c + 2m + h) +
    2e + b), 0 column order. A bfloat16 tile in column order goes through registers too, as the permuted
    ones do: Triton then stores it to one shared-memory buffer a step, whose wgmma descriptors stay
    uniform, rather than pipelining it from its load through several."""
    if ORDER == 1:
        x = tl.reshape(tl.permute(tl.reshape(x, [R, 4, 4, 2, 2, 2]), [0, 2, 4, 5, 1, 3]), [R, BLOCK_K])
    elif ORDER == 2:
        x = tl.reshape(tl.permute(tl.reshape(x, [R, 4, 4, 2, 2, 2]), [0, 2, 3, 5, 1, 4]), [R, BLOCK_K])
    elif x.dtype == tl.bfloat16:
        x = _in_registers(x, EMU)
    return x


@triton.jit
def _in_registers(a, EMU: tl.constexpr):
    """a itself through an opaque move (none under EMU): Triton then keeps a wgmma operand in registers
    rather than feeding it from its load's shared memory."""
    if not EMU:
        a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a], dtype=a.dtype, is_pure=True, pack=2)
    return a


@triton.jit
def _mul(a, b, EMU: tl.constexpr):
    """a * b of bfloat16 tensors of one shape, rounded to bfloat16 (exact here); two an instruction. The
    interpreter holds bfloat16 as its bits, so EMU computes in float32."""
    if EMU:
        out = (a.to(tl.float32) * b.to(tl.float32)).to(tl.bfloat16)
    else:
        out = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                        is_pure=True, pack=2)
    return out


@triton.jit
def _sub(a, b, EMU: tl.constexpr):
    """a - b of bfloat16 tensors of one shape (exact here), as _mul."""
    if EMU:
        out = (a.to(tl.float32) - b.to(tl.float32)).to(tl.bfloat16)
    else:
        out = tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                        is_pure=True, pack=2)
    return out


@triton.jit
def _affine(a, C: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr):
    """a * C + D of a bfloat16 tensor and constants (exact here), one bfloat16 instruction a pair."""
    if EMU:
        out = (a.to(tl.float32) * C + D).to(tl.bfloat16)
    elif C == 1.0:
        out = a + D
    elif D == 0.0:
        out = a * C
    else:
        out = a * C + D
    return out


@triton.jit
def _halves(y, EMU: tl.constexpr):
    """int32 [..] holding two bfloat16 bit patterns -> bfloat16 [.., 2], the low half first. EMU: float32
    of the same values (the interpreter's bfloat16 casts flush subnormals, which E2M1 and e4m3 use)."""
    if EMU:
        out = tl.join((y << 16).to(tl.float32, bitcast=True), (y & -65536).to(tl.float32, bitcast=True))
    else:
        out = tl.join(y.to(tl.int16).to(tl.bfloat16, bitcast=True),
                      (y >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))
    return out


@triton.jit
def _int4_pair(w, n: tl.constexpr, EMU: tl.constexpr):
    """Nibbles n and n + 4 of words w as two bfloat16 bit patterns 0x4300 | u (128 + u): one LOP3."""
    x = w >> (4 * n)
    if EMU:
        y = (x & 0x000F000F) | 0x43004300
    else:
        y = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [x],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return y


@triton.jit
def _e2m1_pair(w, n: tl.constexpr):
    """E2M1 codes n and n + 4 of words w as two bfloat16 bit patterns: the sign at bit 15, the exponent
    and mantissa at bits 6..8 (value * 2^-126)."""
    if n < 2:
        mag = w << (6 - 4 * n)
    else:
        mag = w >> (4 * n - 6)
    return (mag & 0x01C001C0) | ((w << (12 - 4 * n)) & SIGN_BITS)


@triton.jit
def _nibbles(words, R: tl.constexpr, FMT: tl.constexpr, EMU: tl.constexpr):
    """words [R, 16] of a 4-bit format -> bfloat16 [R, BLOCK_K] in the dot's K order (ORDER 1): int4's
    128 + u, E2M1's value * 2^-126."""
    w = tl.permute(tl.reshape(words, [R, 4, 4]), [0, 2, 1])  # [r, m, c]: word 4c + m
    if FMT == INT4:
        a6 = tl.join(tl.join(_halves(_int4_pair(w, 0, EMU), EMU), _halves(_int4_pair(w, 1, EMU), EMU)),
                     tl.join(_halves(_int4_pair(w, 2, EMU), EMU), _halves(_int4_pair(w, 3, EMU), EMU)))
    else:
        a6 = tl.join(tl.join(_halves(_e2m1_pair(w, 0), EMU), _halves(_e2m1_pair(w, 1), EMU)),
                     tl.join(_halves(_e2m1_pair(w, 2), EMU), _halves(_e2m1_pair(w, 3), EMU)))
    return tl.reshape(tl.permute(a6, [0, 1, 5, 4, 2, 3]), [R, BLOCK_K])  # [r, m, c, e, b, h] -> p


@triton.jit
def _spread(v, R: tl.constexpr):
    """[R, 4 m, 4 c] (a value per word 4c + m) -> [R, BLOCK_K] at the word's 8 positions of ORDER 1."""
    return tl.reshape(tl.broadcast_to(v[:, :, None, None, :, None], [R, 4, 2, 2, 4, 2]), [R, BLOCK_K])


@triton.jit
def _words(q_ptr, slot64, rows, row_ok, k0, PER: tl.constexpr, OUT: tl.constexpr, IN: tl.constexpr):
    """int32 words [R, BLOCK_K / PER] of PER codes each (code j in bits (32 / PER) j ..) of rows `rows`
    at columns [k0, k0 + BLOCK_K); 0 where masked. Offsets within a slot's matrix are int32."""
    wcol = k0 // PER + tl.arange(0, BLOCK_K // PER)
    return tl.load(q_ptr + slot64 * (OUT * (IN // PER)) + (rows[:, None] * (IN // PER) + wcol[None, :]),
                   mask=row_ok[:, None] & (wcol < IN // PER)[None, :], other=0)


@triton.jit
def _tile_scales(w, slot64, rows, row_ok, k0, OUT: tl.constexpr, IN: tl.constexpr, SUB: tl.constexpr,
                 FMT: tl.constexpr, ZP: tl.constexpr, EMU: tl.constexpr):
    """(sa, sb): what the weight tile at columns [k0, k0 + BLOCK_K) needs beside its codes, loaded a dot
    step ahead of it (the K loops carry them, so their round trip overlaps a step's work): fp8 its block
    scale [R] (sb the same); int4 its group scale [R] and (ZP) 128 + its zero as bfloat16 [R]; nvfp4 its
    e4m3 block scales * 2^118 and mxfp4 its 2^(e - 127) as bfloat16 [R, 4 m, 4 c] (a value per word
    4c + m), sb the post of _weight_tile (nvfp4: its global scale, read at any k0); dense: sa = sb = 1
    (0 for a row not ok). No block scale is read at k0 >= IN (the step after the last)."""
    ok = row_ok & (k0 < IN)
    _, s_ptr, s2_ptr, z_ptr = w
    if FMT == 0:
        sa = tl.where(row_ok, 1.0, 0.0)
        sb = sa
    elif FMT == FP8:
        PER_SUB: tl.constexpr = (SUB + 127) // 128  # block rows of a sub-matrix
        BLOCKS: tl.constexpr = (IN + 127) // 128  # scale columns
        SROWS: tl.constexpr = (OUT // SUB) * PER_SUB
        srow = (rows // SUB) * PER_SUB + (rows % SUB) // 128
        sa = tl.load(s_ptr + slot64 * (SROWS * BLOCKS) + (srow * BLOCKS + k0 // 128), mask=ok, other=0.0).to(tl.float32)
        sb = sa
    elif FMT == INT4:
        GROUPS: tl.constexpr = (IN + 127) // 128
        soff = slot64 * (OUT * GROUPS) + (rows * GROUPS + k0 // 128)
        sa = tl.load(s_ptr + soff, mask=ok, other=0.0).to(tl.float32)
        if ZP:
            sb = (tl.load(z_ptr + soff, mask=ok, other=0).to(tl.float32) + 128.0).to(tl.bfloat16)
        else:
            sb = sa
    else:
        BS: tl.constexpr = 16 if FMT == NVFP4 else 32
        NSC: tl.constexpr = IN // BS
        col = k0 + 32 * tl.arange(0, 4)[None, :] + 8 * tl.arange(0, 4)[:, None]  # [m, c]: word 4c + m's first column
        soff = slot64 * (OUT * NSC) + (rows[:, None, None] * NSC + (col // BS)[None, :, :])
        sm = row_ok[:, None, None] & (col < IN)[None, :, :]
        if FMT == MXFP4:
            e = tl.load(s_ptr + soff, mask=sm, other=0).to(tl.int32)
            if EMU:
                sa = tl.where(e > 0, e << 23, 4194304).to(tl.float32, bitcast=True)
            else:
                sa = tl.where(e > 0, e << 7, 64).to(tl.int16).to(tl.bfloat16, bitcast=True)
            sb = tl.where(row_ok, 1.0, 0.0)
        else:
            sa = (tl.load(s_ptr + soff, mask=sm, other=0.0).to(tl.float32) * 3.3230699894622896e35).to(tl.bfloat16)
            sb = tl.load(s2_ptr + slot64 * (OUT // SUB) + rows // SUB, mask=row_ok, other=0.0).to(tl.float32) * 256.0
    return sa, sb


@triton.jit
def _weight_tile(w, slot64, rows, row_ok, k0, sa, sb, OUT: tl.constexpr, IN: tl.constexpr, FMT: tl.constexpr,
                 ZP: tl.constexpr, EMU: tl.constexpr):
    """(a [R, BLOCK_K], post [R] float32): rows [R] of slot `slot64`'s matrix [OUT, IN] at columns
    [k0, k0 + BLOCK_K) in the dot's K order of FMT, with their scales (sa, sb) from _tile_scales; a the
    values exact in bfloat16 (dense: as stored), a row's dot with them times post its part of W' · x. A
    column past IN gives a finite value that meets a zero activation; a row not ok gives post 0. w: the
    matrix's pool banks (q, s, s2, z) [S, ...] as SlotMatrix.kernel_args."""
    R: tl.constexpr = rows.shape[0]
    q_ptr = w[0]
    if FMT == 0:
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(q_ptr + slot64 * (OUT * IN) + (rows[:, None] * IN + cols[None, :]),
                    mask=row_ok[:, None] & (cols < IN)[None, :], other=0.0)
        if a.dtype == tl.bfloat16:
            a = _in_registers(a, EMU)
        post = sa
    elif FMT == FP8:  # e4m3 values, 4 a word, in ORDER 2 (bytes b and b + 2 of a word a register)
        words = _words(q_ptr.to(tl.pointer_type(tl.int32), bitcast=True), slot64, rows, row_ok, k0, 4, OUT, IN)
        w4 = tl.permute(tl.reshape(words, [R, 4, 4, 2]), [0, 2, 3, 1])  # [r, m, h, c]: word 8c + 2m + h
        lo = ((w4 << 4) & 0x07F007F0) | ((w4 << 8) & SIGN_BITS)  # bytes 0 and 2: value * 2^-120
        hi = ((w4 >> 4) & 0x07F007F0) | (w4 & SIGN_BITS)  # bytes 1 and 3
        a6 = tl.join(_halves(lo, EMU), _halves(hi, EMU))  # [r, m, h, c, e, b]
        a = _affine(tl.reshape(tl.permute(a6, [0, 1, 2, 5, 3, 4]), [R, BLOCK_K]), 1.329227995784916e36, 0.0, EMU)
        post = sa
    elif FMT == INT4:  # u - z: the bfloat16 128 + u less 128 + z
        a = _nibbles(_words(q_ptr, slot64, rows, row_ok, k0, 8, OUT, IN), R, INT4, EMU)
        if ZP:
            a = _sub(a, tl.broadcast_to(sb[:, None], [R, BLOCK_K]), EMU)
        else:
            a = _affine(a, 1.0, -136.0, EMU)
        post = sa
    else:  # nvfp4's e2m1 * (e4m3 * 2^118); mxfp4's e2m1 * 2^126 * 2^(e - 127) (e = 0: 2^-127, subnormal)
        a = _nibbles(_words(q_ptr, slot64, rows, row_ok, k0, 8, OUT, IN), R, FMT, EMU)
        if FMT == MXFP4:
            a = _affine(a, 8.507059173023462e37, 0.0, EMU)  # 2^126
        a = _mul(a, _spread(sa, R), EMU)
        post = sb
    return a, post


@triton.jit
def _acts(b_rows, lo_off, valid, k0, IN: tl.constexpr, ORDER: tl.constexpr, PREC: tl.constexpr,
          EMU: tl.constexpr):
    """(hi, lo) [BLOCK_K, N]: the members' activations at columns [k0, k0 + BLOCK_K) in the dot's K
    order (b_rows [N, 1]: pointers to each member's row; valid [N]); lo (PREC 2: the bfloat16 low parts,
    lo_off elements after the high ones) or hi again. 0 past IN and for a member not valid."""
    N: tl.constexpr = valid.shape[0]
    cols = k0 + tl.arange(0, BLOCK_K)
    m = valid[:, None] & (cols < IN)[None, :]
    hi = tl.trans(_order(tl.load(b_rows + cols[None, :], mask=m, other=0.0), N, ORDER, EMU))
    lo = hi
    if PREC == 2:
        lo = tl.trans(_order(tl.load(b_rows + lo_off + cols[None, :], mask=m, other=0.0), N, ORDER, EMU))
    return hi, lo


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
def _dot(a, hi, lo, PREC: tl.constexpr, EMU: tl.constexpr):
    """a [M, BLOCK_K] · hi [BLOCK_K, N] (+ a · lo, PREC 2) -> [M, N] float32. One return: Triton's
    compiler type-checks the code after a constexpr branch's return too."""
    if PREC == 1:
        out = tl.dot(a.to(tl.float32), hi.to(tl.float32), input_precision="ieee")
    elif PREC == 0:
        out = _mma(a.to(tl.bfloat16), hi.to(tl.bfloat16), EMU)
    else:
        out = _mma(a, hi, EMU) + _mma(a, lo, EMU)
    return out


@triton.jit
def _block(acc, b_rows, lo_off, valid, w, slot64, rows, row_ok, k0, sa, sb, OUT: tl.constexpr, IN: tl.constexpr,
           FMT: tl.constexpr, ZP: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """acc [R, N] + the weight rows `rows` of slot `slot64` (as _weight_tile, its scales sa, sb) dotted
    with the members' activations at columns [k0, k0 + BLOCK_K) (as _acts)."""
    ORDER: tl.constexpr = 0 if FMT == 0 else (2 if FMT == FP8 else 1)
    hi, lo = _acts(b_rows, lo_off, valid, k0, IN, ORDER, PREC, EMU)
    a, post = _weight_tile(w, slot64, rows, row_ok, k0, sa, sb, OUT, IN, FMT, ZP, EMU)
    if FMT == 0:
        acc += _dot(a, hi, lo, PREC, EMU)
    else:
        acc += _dot(a, hi, lo, PREC, EMU) * post[:, None]
    return acc


@triton.jit
def _gate_up_out(acc, pair, valid, n, weights_ptr, b13_ptr, slot, act_ptr, lo_off, I: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
                 LIMIT: tl.constexpr, BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """The members' act from their gate and up dots acc [2 BLOCK_N, BLOCK_M] (gate rows n, then up):
    weight * act(gate, up) stored at act_ptr [pair, n] (SPLIT: as two bfloat16 parts, lo_off apart)."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N, BLOCK_M]), [1, 2, 0]))
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    act = _activation(weight[None, :], gate, up, b13_ptr, slot, True, n[:, None], I, ACT, ALPHA, LIMIT, BIAS)
    where = pair[None, :].to(tl.int64) * I + n[:, None]
    keep = valid[None, :] & (n < I)[:, None]
    if SPLIT:  # the down's two bfloat16 parts: about 16 significant bits of each float32
        hi = act.to(tl.bfloat16)
        tl.store(act_ptr + where, hi, mask=keep)
        tl.store(act_ptr + lo_off + where, (act - hi.to(tl.float32)).to(tl.bfloat16), mask=keep)
    else:
        tl.store(act_ptr + where, act, mask=keep)


@triton.jit(**MMA_JIT_OPTIONS)
def _gate_up_mma(x_ptr, slots_ptr, weights_ptr, w13, act_ptr, num_slots, tokens, b13_ptr, lo_off,
                 K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
                 PREC: tl.constexpr, EMU: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr = 0,
                 ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0, BIAS: tl.constexpr = False,
                 GDC: tl.constexpr = False):
    """x_ptr [T, H] hidden; slots_ptr *i32 [T * K]; weights_ptr *fp32 [T * K]; w13 the gate_up banks (q, s, s2,
    z) [S, 2I, H] in format FMT; act_ptr *fp32 [T * K, I] out, or (SPLIT) *bf16 [T * K, I] of the high
    parts and lo_off elements further the low ones (act = hi + lo); b13_ptr [S, 2I] (read when BIAS).
    GDC: launched programmatically: wait for the predecessors before reading, then let the down launch."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    slot, leader, hit, rank, count = _group(slots_ptr, tl.program_id(0), tokens, num_slots, K, TB, KB)
    if leader:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows are I further
        r = tl.arange(0, 2 * BLOCK_N)
        rows = tl.program_id(1) * BLOCK_N + r % BLOCK_N + (r // BLOCK_N) * I  # A: the gate rows, then the up rows
        row_ok = (tl.program_id(1) * BLOCK_N + r % BLOCK_N) < I
        slot64 = slot.to(tl.int64)
        COLS: tl.constexpr = (H + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole BLOCK_K steps over H
        m0 = 0
        while m0 < count:
            token, pair, valid = _members(hit, rank, m0, K, TB, KB, BLOCK_M)
            acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
            b_rows = x_ptr + token[:, None].to(tl.int64) * H  # [BLOCK_M, 1]
            sa, sb = _tile_scales(w13, slot64, rows, row_ok, 0, 2 * I, H, I, FMT, ZP, EMU)
            for k0 in range(0, COLS, BLOCK_K):  # constant bounds: the compiler pipelines the loop
                na, nb = _tile_scales(w13, slot64, rows, row_ok, k0 + BLOCK_K, 2 * I, H, I, FMT, ZP, EMU)
                acc = _block(acc, b_rows, 0, valid, w13, slot64, rows, row_ok, k0, sa, sb, 2 * I, H, FMT, ZP, PREC, EMU)
                sa, sb = na, nb
            _gate_up_out(acc, pair, valid, n, weights_ptr, b13_ptr, slot, act_ptr, lo_off, I, BLOCK_N, BLOCK_M,
                         ACT, ALPHA, LIMIT, BIAS, SPLIT)
            m0 += BLOCK_M


@triton.jit(**MMA_JIT_OPTIONS)
def _down_mma(act_ptr, slots_ptr, w2, y_ptr, num_slots, tokens, lo_off,
              K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
              PREC: tl.constexpr, EMU: tl.constexpr, GDC: tl.constexpr = False):
    """act_ptr *fp32 [T * K, I], or (PREC 2) *bf16 of the gate_up's SPLIT parts (lo_off apart); slots_ptr
    *i32 [T * K]; w2 the down banks [S, H, I]; y_ptr *fp32 [T * K, H] out (rows of pairs with a slot).
    GDC: as the gate_up's, then the combine may launch."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    slot, leader, hit, rank, count = _group(slots_ptr, tl.program_id(0), tokens, num_slots, K, TB, KB)
    if leader:
        h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = h < H
        slot64 = slot.to(tl.int64)
        m0 = 0
        while m0 < count:
            token, pair, valid = _members(hit, rank, m0, K, TB, KB, BLOCK_M)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            b_rows = act_ptr + pair[:, None].to(tl.int64) * I
            sa, sb = _tile_scales(w2, slot64, h, row_ok, 0, H, I, H, FMT, ZP, EMU)
            for k0 in range(0, I, BLOCK_K):
                na, nb = _tile_scales(w2, slot64, h, row_ok, k0 + BLOCK_K, H, I, H, FMT, ZP, EMU)
                acc = _block(acc, b_rows, lo_off, valid, w2, slot64, h, row_ok, k0, sa, sb, H, I, FMT, ZP, PREC, EMU)
                sa, sb = na, nb
            tl.store(y_ptr + pair[None, :].to(tl.int64) * H + h[:, None], acc, mask=valid[None, :] & row_ok[:, None])
            m0 += BLOCK_M


@triton.jit(**COMBINE_JIT_OPTIONS)
def _combine(y_ptr, slots_ptr, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
             K: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr, ADDEND: tl.constexpr,
             WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr, BIAS: tl.constexpr, GDC: tl.constexpr = False):
    """y_ptr *fp32 [T * K, H]; addend_ptr *fp32 [T, H] (read when ADDEND); out_ptr *fp32 [T, H] (written when
    WRITE_OUT); cast_ptr [T, H] the model dtype (written when WRITE_CAST); weights_ptr *fp32 [T * K] and b2_ptr
    [S, H] the down biases (read when BIAS). GDC: launched programmatically: wait for the down first
    (what follows launches when this one ends)."""
    if GDC:
        gdc_wait()
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    y = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):  # ordered combine: j = 0, 1, ..., K-1
        slot = tl.load(slots_ptr + token * K + j)
        live = (slot >= 0) & (slot < num_slots)
        y += tl.load(y_ptr + (token * K + j).to(tl.int64) * H + rows, mask=live & (rows < H), other=0.0)
    _finish_rows(y, token, rows, slots_ptr, num_slots, weights_ptr, b2_ptr, addend_ptr, out_ptr, cast_ptr, K, H,
                 BIAS, ADDEND, WRITE_OUT, WRITE_CAST)
