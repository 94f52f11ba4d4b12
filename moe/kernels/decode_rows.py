"""Prefill's group decode in one Triton launch a matrix: the group's slots read where they are, each value
written once as float32, bit for bit the format's torch decode.

    rows [(SlotMatrix, slot)] of one format and shape, from at most two matrices on one CUDA device (a pool
    and a staging ring) ──dequantize_rows_fast──► float32 [G, OUT, IN]
        the rows as a table int32 [G, 2] (source 0 or 1, slot), one small copy to the device, then one
        launch: a program decodes a tile of [BR rows, BC bytes] (2 BC values) of the group's rows, each
        row read from its own source and slot
    rows of more matrices, or a CPU device ──► slot_matrix.dequantize_rows (torch: the rows stacked, then
        ExpertFormat.decode_batch)

Why: prefill decodes every used expert of a layer, a group of up to 8 at a time. Stacking a group's parts
costs the host a select and a move per part and row before any decode, and torch decodes a packed matrix in
a dozen elementwise ops, each a pass over the float32 result; together they made an int4 prompt's layer
slower than copying its bytes. The arithmetic is the formats' own (expertcache.formats), in the same order:
    dense: float32(w)                                      (bf16, float16, float32: exact)
    int4:  float32(u - z) * float32(s)                    (u - z a small integer, exact)
    nvfp4: (e2m1(code) * float32(s)) * s2[sub-matrix]      (the first product exact)
    mxfp4: e2m1(code) * 2^(s - 127)                        (exact; 2^-127 the one subnormal)
so every value equals the torch decode's bit for bit (tests/moe/kernels/test_decode_rows.py). fp8 keeps the
torch decode (two ops a matrix, its scales per 128 x 128 block of each sub-matrix).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.triton_launch import kernel_for
from moe.model.slot_matrix import CODES, SlotMatrix, dequantize_rows

NVFP4 = tl.constexpr(CODES["nvfp4"])
MXFP4 = tl.constexpr(CODES["mxfp4"])
INT4 = tl.constexpr(CODES["int4"])
DENSE = tl.constexpr(0)
KERNEL_FORMATS = ("int4", "nvfp4", "mxfp4")  # the quantized formats the kernel decodes (and every dense one)
BR, BC = 16, 64  # a program's tile: rows, and bytes of each packed row (2 BC values; a dense row's 2 BC values)


@triton.jit
def _e2m1(code):
    """float32 value of E2M1 codes (int32 0..15): 0, 0.5, 1, 1.5, 2, 3, 4, 6, code 8.. negative (8: -0.0)."""
    m = code & 7
    e = m >> 1
    mant = (m & 1).to(tl.float32)
    # e = 0: mant * 0.5; else (1 + mant / 2) * 2^(e - 1): every value exact in float32
    mag = tl.where(e == 0, mant * 0.5, (1.0 + mant * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    # the sign bit set by hand: Triton's -x is 0 - x, which turns -0.0 into +0.0
    return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _decode_rows_kernel(qa, sa, s2a, za, qb, sb, s2b, zb, table_ptr, out_ptr, ROWS, OUT: tl.constexpr,
                        IN: tl.constexpr, S2N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
                        BR: tl.constexpr, BC: tl.constexpr):
    """out[r, c] (float32 [ROWS = G * OUT, IN]): row r % OUT of the slot table[r // OUT] = (source, slot)
    names, source 0 the parts qa (values), sa (scales), s2a (nvfp4's [S, S2N] global scales, S2N sub-matrices
    a matrix of OUT / S2N rows each), za (int4's zero points, ZP) and source 1 the same of b; a dense matrix
    is qa / qb alone ([S, OUT, IN] floats)."""
    BS: tl.constexpr = 16 if FMT == NVFP4 else (32 if FMT == MXFP4 else 128)
    NSC: tl.constexpr = (IN + BS - 1) // BS
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < ROWS
    g = tl.where(row_ok, rows // OUT, 0)
    src = tl.load(table_ptr + 2 * g, mask=row_ok, other=0)
    slot = tl.load(table_ptr + 2 * g + 1, mask=row_ok, other=0).to(tl.int64)
    on_a = (src == 0)[:, None]
    row_in = (slot * OUT + rows % OUT)[:, None]  # the row's index over its source's [S * OUT] rows
    c = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)  # value columns
    m = row_ok[:, None] & (c < IN)[None, :]
    if FMT == DENSE:
        off = row_in * IN + c[None, :]
        v = tl.load(tl.where(on_a, qa + off, qb + off), mask=m, other=0.0).to(tl.float32)
    else:
        b = tl.program_id(1) * BC + tl.arange(0, BC)  # byte columns
        qoff = row_in * (IN // 2) + b[None, :]
        qm = row_ok[:, None] & (b < IN // 2)[None, :]
        byte = tl.load(tl.where(on_a, qa + qoff, qb + qoff), mask=qm, other=0).to(tl.int32)
        code = tl.reshape(tl.join(byte & 15, byte >> 4), (BR, 2 * BC))  # value 2j low nibble, 2j + 1 high
        soff = row_in * NSC + (c // BS)[None, :]
        s_at = tl.where(on_a, sa + soff, sb + soff)
        if FMT == INT4:
            s = tl.load(s_at, mask=m, other=1.0).to(tl.float32)
            if ZP:
                z = tl.load(tl.where(on_a, za + soff, zb + soff), mask=m, other=8).to(tl.int32)
            else:
                z = 8
            v = (code - z).to(tl.float32) * s
        elif FMT == NVFP4:
            s = tl.load(s_at, mask=m, other=1.0).to(tl.float32)
            s2off = slot * S2N + (rows % OUT) // (OUT // S2N)
            s2 = tl.load(tl.where(src == 0, s2a + s2off, s2b + s2off), mask=row_ok, other=1.0)
            v = (_e2m1(code) * s) * s2[:, None]
        else:  # MXFP4: 2^(e - 127) from its bits, e = 0 the subnormal 2^-127
            e = tl.load(s_at, mask=m, other=127).to(tl.int32)
            v = _e2m1(code) * tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * IN + c[None, :], v, mask=m)


def decode_slots(sources: list[SlotMatrix], table: torch.Tensor) -> torch.Tensor:
    """float32 [G, out, in]: the decode of the G slots table (int32 [G, 2]: source index, slot) names, in
    one launch. sources: one or two SlotMatrix of one format (dense or one of KERNEL_FORMATS) and shape,
    contiguous, on the table's device (CUDA, or the CPU under TRITON_INTERPRET=1). Bit for bit the format's
    decode_batch of the slots' parts."""
    first = sources[0]
    fmt, out_features, in_features, stack = first.fmt, first.out_features, first.in_features, first.stack
    g = table.shape[0]
    out = torch.empty((g, out_features, in_features), dtype=torch.float32, device=table.device)
    if g == 0:
        return out
    a, b = sources[0].roles(), sources[-1].roles()
    s2n = stack if fmt.name == "nvfp4" else 1
    cols = in_features if fmt.dense else in_features // 2
    grid = (triton.cdiv(g * out_features, BR), triton.cdiv(cols, BC if not fmt.dense else 2 * BC))
    kernel = kernel_for(_decode_rows_kernel, table.device, {}, "decode_slots")
    kernel[grid](*a, *b, table, out, g * out_features, OUT=out_features, IN=in_features, S2N=s2n,
                 FMT=0 if fmt.dense else CODES[fmt.name], ZP=bool(getattr(fmt, "zero_points", False)), BR=BR,
                 BC=BC, num_warps=4)
    return out


def dequantize_rows_fast(rows: list[tuple[SlotMatrix, int]], device: torch.device | str) -> torch.Tensor:
    """slot_matrix.dequantize_rows (the same float32 [G, out, in], bit for bit), by one launch of the kernel
    where `device` is CUDA, the rows' format is dense or one of KERNEL_FORMATS and they come from at most two
    matrices on that device; else by torch. Raises ValueError as dequantize_rows does."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as the matrices name it
        device = torch.device("cuda", torch.cuda.current_device())
    first = rows[0][0] if rows else None
    sources: list[SlotMatrix] = []
    if device.type == "cuda" and first is not None and (first.fmt.dense or first.fmt.name in KERNEL_FORMATS):
        for m, _ in rows:
            if (m.fmt, m.out_features, m.in_features, m.stack) != (first.fmt, first.out_features,
                                                                    first.in_features, first.stack):
                break
            if not any(m is s for s in sources):
                sources.append(m)
        else:
            if len(sources) <= 2 and all(s.device == device for s in sources):
                # from pinned memory, so the copy is queued like the kernel (a pageable source may sync)
                table = torch.tensor([[next(i for i, s in enumerate(sources) if s is m), slot] for m, slot in rows],
                                     dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)
                return decode_slots(sources, table)
    return dequantize_rows(rows, device)
