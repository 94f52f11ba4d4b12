"""Prefill's group decode of packed 4-bit experts in one Triton kernel: bit for bit the format's torch decode.

    rows [(SlotMatrix, slot)] of one packed format (int4, nvfp4, mxfp4) ──dequantize_rows_fast──►
        float32 [G, OUT, IN]: each row's parts moved to the device and stacked (slot_matrix.stack_rows),
        then every value decoded in one launch: a program reads a tile of [BR rows, BC bytes], splits each
        byte in its two codes and writes the [BR, 2 BC] float32 values with their scales applied
    other formats, or a CPU device ──► slot_matrix.dequantize_rows (torch)

Why: torch decodes a packed matrix in a dozen elementwise ops, each a pass over the float32 result, so a
prompt's layer of experts in int4 spent far longer decoding than copying its bytes. The kernel writes the
result once. Its arithmetic is the formats' own (expertcache.formats), in the same order:
    int4:  float32(u - z) * float32(s)                    (u - z a small integer, exact)
    nvfp4: (e2m1(code) * float32(s)) * s2[sub-matrix]      (the first product exact)
    mxfp4: e2m1(code) * 2^(s - 127)                        (exact; 2^-127 the one subnormal)
so every value equals the torch decode's bit for bit (tests/moe/kernels/test_decode_rows.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.triton_launch import kernel_for
from moe.model.slot_matrix import CODES, SlotMatrix, dequantize_rows, stack_rows

NVFP4 = tl.constexpr(CODES["nvfp4"])
MXFP4 = tl.constexpr(CODES["mxfp4"])
INT4 = tl.constexpr(CODES["int4"])
PACKED = ("int4", "nvfp4", "mxfp4")  # the formats this kernel decodes
BR, BC = 16, 64  # a program's tile: rows, and bytes of each row (2 BC values)


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
def _decode_rows_kernel(q_ptr, s_ptr, s2_ptr, z_ptr, out_ptr, ROWS, OUT: tl.constexpr, IN: tl.constexpr,
                        S2N: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr):
    """out[r, c] (float32, [ROWS = G * OUT, IN]) of q [ROWS, IN / 2] bytes, scales s [ROWS, ceil(IN / BS)],
    nvfp4's s2 [G, S2N] (S2N sub-matrices a matrix, each OUT / S2N rows), int4's zero points z (ZP)."""
    BS: tl.constexpr = 16 if FMT == NVFP4 else (32 if FMT == MXFP4 else 128)
    NSC: tl.constexpr = (IN + BS - 1) // BS
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < ROWS
    r64 = rows.to(tl.int64)
    b = tl.program_id(1) * BC + tl.arange(0, BC)  # byte columns
    qm = row_ok[:, None] & (b < IN // 2)[None, :]
    byte = tl.load(q_ptr + r64[:, None] * (IN // 2) + b[None, :], mask=qm, other=0).to(tl.int32)
    code = tl.reshape(tl.join(byte & 15, byte >> 4), (BR, 2 * BC))  # value 2j low nibble, 2j + 1 high
    c = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)  # value columns
    m = row_ok[:, None] & (c < IN)[None, :]
    soff = r64[:, None] * NSC + (c // BS)[None, :]
    if FMT == INT4:
        s = tl.load(s_ptr + soff, mask=m, other=1.0).to(tl.float32)
        if ZP:
            z = tl.load(z_ptr + soff, mask=m, other=8).to(tl.int32)
        else:
            z = 8
        v = (code - z).to(tl.float32) * s
    elif FMT == NVFP4:
        s = tl.load(s_ptr + soff, mask=m, other=1.0).to(tl.float32)
        g = rows // OUT
        sub = (rows % OUT) // (OUT // S2N)
        s2 = tl.load(s2_ptr + g.to(tl.int64) * S2N + sub, mask=row_ok, other=1.0)
        v = (_e2m1(code) * s) * s2[:, None]
    else:  # MXFP4: 2^(e - 127) from its bits, e = 0 the subnormal 2^-127
        e = tl.load(s_ptr + soff, mask=m, other=127).to(tl.int32)
        scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        v = _e2m1(code) * scale
    tl.store(out_ptr + r64[:, None] * IN + c[None, :], v, mask=m)


def decode_packed(parts: dict[str, torch.Tensor], fmt, out_features: int, in_features: int, stack: int) -> torch.Tensor:
    """float32 [G, out, in]: the decode of G stacked matrices of packed format `fmt` (parts [G, *layout
    shape], contiguous, on one device), bit for bit fmt.decode_batch. CUDA tensors, or CPU tensors
    under TRITON_INTERPRET=1."""
    q = parts["q"]
    g = q.shape[0]
    out = torch.empty((g, out_features, in_features), dtype=torch.float32, device=q.device)
    if g == 0:
        return out
    s = parts["s"]
    s2, z = parts.get("s2", s), parts.get("z", s)  # the part, or any pointer where the format has none
    s2n = s2.shape[-1] if "s2" in parts else 1
    grid = (triton.cdiv(g * out_features, BR), triton.cdiv(in_features // 2, BC))
    kernel = kernel_for(_decode_rows_kernel, q.device, {}, "decode_packed")
    kernel[grid](q, s, s2, z, out, g * out_features, OUT=out_features, IN=in_features, S2N=s2n, FMT=CODES[fmt.name],
                 ZP="z" in parts, BR=BR, BC=BC, num_warps=4)
    return out


def dequantize_rows_fast(rows: list[tuple[SlotMatrix, int]], device: torch.device | str) -> torch.Tensor:
    """slot_matrix.dequantize_rows (the same float32 [G, out, in], bit for bit), decoded by one Triton
    launch where the rows are of a packed format and `device` is CUDA; else by torch."""
    device = torch.device(device)
    first = rows[0][0] if rows else None
    if device.type != "cuda" or first is None or first.fmt.name not in PACKED:
        return dequantize_rows(rows, device)
    first, parts = stack_rows(rows, device)
    layout = first.fmt.layout(first.out_features, first.in_features, first.stack)
    return decode_packed({p.suffix: t for p, t in zip(layout, parts)}, first.fmt, first.out_features,
                         first.in_features, first.stack)
