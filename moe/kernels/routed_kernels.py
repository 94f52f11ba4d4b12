"""Triton kernels of the routed-expert GEMM (host wrappers: moe.kernels.routed).

    gate_up body, grid (T * K, ceil(I / BLOCK_I)): program (t * K + j, tile)
        hidden [T, H] · gate rows [tile) and up rows [I + tile) of slot slots[t, j]   (pool [S, 2I, H])
        weight = weights[t, j]                      (GATED=False: the router's weight)
               = sigmoid(hidden[t] · gate_w)        (GATED=True: the shared expert's gate, computed in
                                                     the same pass over hidden by every program)
        -> act [T * K, I] f32 = weight * silu(gate) * up   (0 when slots[t, j] is outside [0, S))
           (gpt-oss: BIAS adds the slot's gate_up bias b13 [S, 2I] to gate and up first, ACT = 1 takes
            its clamped SwiGLU with ALPHA, LIMIT: moe.model.reference.gated_activation)
    down body, grid (T, ceil(H / BLOCK_H)): program (t, tile)
        for j = 0 .. K-1 in order: acc += down[slots[t, j]][tile, :] * act[t * K + j, :]  (pool [S, H, I])
        y = Σ acc (+ Σ_j weights[t, j] * b2[slots[t, j], tile] when BIAS) (+ addend[t, tile] when ADDEND)
          -> out f32 (WRITE_OUT) and/or cast(y) (WRITE_CAST)

Legend: T = tokens, H = hidden, I = expert width, K = top_k (1 for the shared expert), S = pool slots.

Expert formats (FMT, ZP constexprs; moe.model.slot_matrix.SlotMatrix gives them): w13 and w2 are the
matrix's pool banks (q, s, s2, z). FMT = 0 (dense bf16 / f16 / f32) reads q as above; the quantized
formats (fp8, nvfp4, mxfp4, int4) dequantize each tile in registers (moe.kernels.quant_kernels): a
gate_up program takes its BLOCK_I gate rows and their up rows together (one pass over hidden), a down
program its BLOCK_H rows of every expert in order j = 0..K-1, accumulating elementwise in float32 and
summing once at the end, so the combine order is the dense one. The shared expert (GATED) is dense or
in its checkpoint's format; its gate row sigmoid(hidden · gate_w) is dense either way.

Programmatic dependent launch (GDC = 1, CUDA only; never for the shared expert's launches nor the
early hits, which wait on an event of another stream): the routed gate_up and down are launched with
the programmatic-serialization attribute, so each may be scheduled while its predecessor drains; each
waits (griddepcontrol.wait) before reading anything its predecessors write, so the results are those
of plain launches, bit for bit, and gate_up then lets down launch. Without GDC (the shared expert,
the early hits and the CPU interpreter, which has no inline PTX) the bodies are the plain ones.
Variants that loaded more before the wait were slower and are not kept (docs/decisions.md).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe.kernels.quant_kernels import _qacc, _qacc_zeros, _qsum

JIT_OPTIONS = {"do_not_specialize": ["num_slots"]}  # a pool rebuilt with new S keeps its kernels
HITS_JIT_OPTIONS = {"do_not_specialize": ["num_slots", "n_pairs"]}  # _gate_up_hits: and any T


@triton.jit
def _gate_up_body(x_ptr, slots_ptr, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, pre_ptr, b13_ptr,
                  K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                  CHUNK_H: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
                  PICK: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr, ACT: tl.constexpr,
                  ALPHA: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr):
    if GDC:  # everything below reads the predecessors' output; then the down launch may start
        gdc_wait()
        gdc_launch_dependents()
    pair = tl.program_id(0)  # t * K + j
    if PICK == 2:  # the rest: pairs not resident before the ensure, at the ensure's slot
                   # (the early hits, pre >= 0, run in _gate_up_hits_body)
        take = tl.load(pre_ptr + pair) < 0
        slot = tl.load(slots_ptr + pair)
    else:
        slot = tl.load(slots_ptr + pair)
        take = True
    if take:  # a pair not taken writes nothing (the other launch writes its rows)
        _gate_up_rows(x_ptr, slot, pair, tl.program_id(1), weights_ptr, gate_w_ptr, w13, act_ptr,
                      num_slots, b13_ptr, K, H, I, BLOCK_I, CHUNK_H, EVEN, GATED, FMT, ZP, ACT, ALPHA, LIMIT, BIAS)


@triton.jit
def _gate_up_hits_body(x_ptr, weights_ptr, w13, act_ptr, num_slots, pre_ptr, n_pairs, b13_ptr,
                       K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                       CHUNK_H: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr,
                       ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr):
    """The early hits: a persistent grid (fewer programs than tiles, so the SMs keep room for the
    ensure, copy and rest launched beside it) walks the (pair, tile) items; a pair with pre < 0 is
    skipped, any other is computed at slot pre[pair] exactly as _gate_up_body does it."""
    TILES: tl.constexpr = (I + BLOCK_I - 1) // BLOCK_I
    items = n_pairs * TILES
    w = tl.program_id(0)
    slot = tl.load(pre_ptr + w // TILES, mask=w < items, other=-1)
    while w < items:  # a while loop: Triton's interpreter cannot range() a tensor
        # the next item's slot is loaded before this item's rows, so its round trip overlaps them
        nxt = w + tl.num_programs(0)
        slot_next = tl.load(pre_ptr + nxt // TILES, mask=nxt < items, other=-1)
        if slot >= 0:
            _gate_up_rows(x_ptr, slot, w // TILES, w % TILES, weights_ptr, x_ptr, w13, act_ptr, num_slots,
                          b13_ptr, K, H, I, BLOCK_I, CHUNK_H, EVEN, False, FMT, ZP, ACT, ALPHA, LIMIT, BIAS)
        w = nxt
        slot = slot_next


@triton.jit
def _gate_up_rows(x_ptr, slot, pair, tile, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, b13_ptr,
                  K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                  CHUNK_H: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, FMT: tl.constexpr,
                  ZP: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                  BIAS: tl.constexpr):
    token = pair // K
    live = (slot >= 0) & (slot < num_slots)
    rows = tile * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] gate rows
    if FMT != 0:
        gate_dot, up_dot = _gate_up_qdots(x_ptr + token * H, slot, live, tile, w13, H, I, BLOCK_I, CHUNK_H, FMT, ZP)
        if GATED:  # the shared expert's gate: sigmoid(hidden · gate_w), a dense row
            weight = _gate_weight(x_ptr + token * H, gate_w_ptr, H, CHUNK_H)
    else:  # the dense pass computes the shared expert's gate in the same pass over hidden
        gate_dot, up_dot, weight = _gate_up_dense(x_ptr + token * H, slot, live, rows, gate_w_ptr, w13[0], H, I,
                                                  BLOCK_I, CHUNK_H, EVEN, GATED)
    if not GATED:
        weight = tl.load(weights_ptr + pair)
    act = _activation(weight, gate_dot, up_dot, b13_ptr, slot, live, rows, I, ACT, ALPHA, LIMIT, BIAS)
    tl.store(act_ptr + pair * I + rows, tl.where(live, act, 0.0), mask=rows < I)


@triton.jit
def _activation(weight, gate_dot, up_dot, b13_ptr, slot, live, rows, I: tl.constexpr, ACT: tl.constexpr,
                ALPHA: tl.constexpr, LIMIT: tl.constexpr, BIAS: tl.constexpr):
    """[BLOCK_I] float32 weight * act of one slot's gate and up dots: (+ the slot's gate_up bias b13
    [S, 2I] when BIAS) then silu(gate) * up (ACT 0) or gpt-oss's clamped SwiGLU (ACT 1: g = min(gate,
    LIMIT), (clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA * g)); moe.model.reference.gated_activation."""
    if BIAS:
        base = b13_ptr + tl.where(live, slot, 0).to(tl.int64) * (2 * I)
        ok = live & (rows < I)
        gate_dot += tl.load(base + rows, mask=ok, other=0.0).to(tl.float32)
        up_dot += tl.load(base + I + rows, mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:
        g = tl.minimum(gate_dot, LIMIT)
        u = tl.minimum(tl.maximum(up_dot, -LIMIT), LIMIT)
        return weight * ((u + 1.0) * (g * tl.sigmoid(g * ALPHA)))
    return weight * gate_dot * tl.sigmoid(gate_dot) * up_dot


@triton.jit
def _gate_weight(x_ptr, gate_w_ptr, H: tl.constexpr, CHUNK_H: tl.constexpr):
    """sigmoid(x · gate_w) in float32 over H (x and gate_w rows [H] of any float dtype)."""
    acc = tl.zeros([CHUNK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, CHUNK_H):
        cols = h0 + tl.arange(0, CHUNK_H)
        x = tl.load(x_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        acc += tl.load(gate_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32) * x
    return tl.sigmoid(tl.sum(acc, axis=0))


@triton.jit
def _gate_up_qdots(x_ptr, slot, live, tile, w13, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                   CHUNK_H: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr):
    """(gate · x, up · x) [BLOCK_I] float32 of gate rows tile * BLOCK_I + [0, BLOCK_I) of a quantized
    slot: the gate and up rows interleaved in one call of _qacc per chunk of hidden (x [H])."""
    r = tl.arange(0, 2 * BLOCK_I)
    gate_row = tile * BLOCK_I + r // 2
    rows = gate_row + (r % 2) * I  # gate row, then its up row, of the stacked [2I, H] matrix
    row_ok = live & (gate_row < I)
    acc = _qacc_zeros(2 * BLOCK_I, CHUNK_H, FMT)
    for c0 in tl.static_range(0, H, CHUNK_H):
        acc = _qacc(acc, x_ptr, w13, tl.where(live, slot, 0), rows, row_ok, c0, 2 * I, H, I, FMT, ZP, CHUNK_H)
    return tl.split(tl.reshape(_qsum(acc, FMT), [BLOCK_I, 2]))


@triton.jit
def _gate_up_dense(x_ptr, slot, live, rows, gate_w_ptr, w13_ptr, H: tl.constexpr, I: tl.constexpr,
                   BLOCK_I: tl.constexpr, CHUNK_H: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr):
    """(gate · x, up · x) [BLOCK_I] float32 of gate rows `rows` of a dense slot (x [H]), and the shared
    expert's weight sigmoid(x · gate_w) when GATED (else 0.0), summed in the same pass over x."""
    base = w13_ptr + tl.where(live, slot, 0).to(tl.int64) * (2 * I * H)
    gate_ptrs = base + rows[:, None] * H  # [BLOCK_I, 1]; up rows are I * H further
    acc_gate = tl.zeros([BLOCK_I, CHUNK_H], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, CHUNK_H], dtype=tl.float32)
    acc_g = tl.zeros([CHUNK_H], dtype=tl.float32)  # GATED only: x · gate_w
    for h0 in tl.static_range(0, H, CHUNK_H):  # unrolled: every step's loads are independent
        cols = h0 + tl.arange(0, CHUNK_H)  # [CHUNK_H]
        if EVEN:
            x = tl.load(x_ptr + cols)
            mask = live
        else:
            x = tl.load(x_ptr + cols, mask=cols < H, other=0.0)
            mask = live & (rows[:, None] < I) & (cols[None, :] < H)
        gate = tl.load(gate_ptrs + cols[None, :], mask=mask, other=0.0)  # [BLOCK_I, CHUNK_H]
        up = tl.load(gate_ptrs + I * H + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        acc_gate += gate.to(tl.float32) * xf[None, :]
        acc_up += up.to(tl.float32) * xf[None, :]
        if GATED:
            if EVEN:
                gw = tl.load(gate_w_ptr + cols)
            else:
                gw = tl.load(gate_w_ptr + cols, mask=cols < H, other=0.0)
            acc_g += gw.to(tl.float32) * xf
    weight = 0.0
    if GATED:
        weight = tl.sigmoid(tl.sum(acc_g, axis=0))  # the same value in every program of the token
    return tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1), weight


@triton.jit
def _down_tile(w2_ptr, slot, num_slots, rows, i0, H: tl.constexpr, I: tl.constexpr, CHUNK_I: tl.constexpr,
               EVEN: tl.constexpr):
    """down[slot, rows, i0:i0 + CHUNK_I] (zeros for a slot outside [0, num_slots), or outside [H, I]
    unless EVEN)."""
    live = (slot >= 0) & (slot < num_slots)
    cols = i0 + tl.arange(0, CHUNK_I)
    ptrs = w2_ptr + tl.where(live, slot, 0).to(tl.int64) * (H * I) + rows[:, None] * I + cols[None, :]
    mask = live if EVEN else live & (rows[:, None] < H) & (cols[None, :] < I)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _down_body(act_ptr, slots_ptr, w2, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
               K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr,
               CHUNK_I: tl.constexpr, EVEN: tl.constexpr, ADDEND: tl.constexpr,
               WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr, GDC: tl.constexpr,
               RELEASE: tl.constexpr = False, PREFETCH: tl.constexpr = 0, FMT: tl.constexpr = 0,
               ZP: tl.constexpr = False, BIAS: tl.constexpr = False):
    """RELEASE (with GDC; the layer's LaunchPlan.front_release): right after the wait the next
    programmatic launch (the next layer's router) may start; it still waits for this launch to finish
    before it reads what this launch writes.
    PREFETCH > 0 (LaunchPlan.down_prefetch): every expert's slot, then the weight tiles of the first
    PREFETCH experts, are loaded before the programmatic wait: the slots and the pool rows are final
    before this launch starts (the routed gate_up lets it launch, by gdc_launch_dependents, only after
    its own wait, which returns once the ensure and the miss copy are complete, so nothing this launch
    loads predates the copy), so no weight load waits for its slot's round trip and the first ones
    overlap the gate_up's tail. They are plain loads: on sm_90 a .cg
    load is a strong GPU-scope load, much slower for these tiles. The activations, the gate_up's
    output, are read after the wait, and the sum runs in the same order: the same bits.
    A quantized FMT prefetches nothing (PREFETCH is the dense path's).
    BIAS (gpt-oss): y += Σ_j (in order) weights[token, j] * b2[slots[token, j], rows] after the routed
    sum (b2 [S, H], the down biases; act already carries each expert's weight)."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] output rows
    if FMT != 0:
        if GDC:
            gdc_wait()
            if RELEASE:
                gdc_launch_dependents()
        y = _down_qsum(act_ptr, slots_ptr, w2, num_slots, token, rows, K, H, I, BLOCK_H, CHUNK_I, FMT, ZP)
    else:
        y = _down_dense_sum(act_ptr, slots_ptr, w2[0], num_slots, token, rows, K, H, I, BLOCK_H, CHUNK_I, EVEN,
                            GDC, RELEASE, PREFETCH)
    _finish_rows(y, token, rows, slots_ptr, num_slots, weights_ptr, b2_ptr, addend_ptr, out_ptr, cast_ptr, K, H,
                 BIAS, ADDEND, WRITE_OUT, WRITE_CAST)


@triton.jit
def _finish_rows(y, token, rows, slots_ptr, num_slots, weights_ptr, b2_ptr, addend_ptr, out_ptr, cast_ptr,
                 K: tl.constexpr, H: tl.constexpr, BIAS: tl.constexpr, ADDEND: tl.constexpr,
                 WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr):
    """The routed sum y [BLOCK_H] of `token`'s output rows, finished: + Σ_j (in order) weights[token, j] *
    b2[slots[token, j], rows] (BIAS), + addend (ADDEND), then stored as float32 (WRITE_OUT) and / or
    rounded once to the output's dtype (WRITE_CAST)."""
    if BIAS:
        for j in tl.static_range(K):
            slot = tl.load(slots_ptr + token * K + j)
            live = (slot >= 0) & (slot < num_slots)
            bias = tl.load(b2_ptr + tl.where(live, slot, 0).to(tl.int64) * H + rows, mask=live & (rows < H), other=0.0)
            y += tl.load(weights_ptr + token * K + j) * bias.to(tl.float32)
    if ADDEND:  # the combine: routed + addend in float32, then (below) one rounding to the model dtype
        y = y + tl.load(addend_ptr + token * H + rows, mask=rows < H, other=0.0)
    if WRITE_OUT:
        tl.store(out_ptr + token * H + rows, y, mask=rows < H)
    if WRITE_CAST:
        tl.store(cast_ptr + token * H + rows, y.to(cast_ptr.dtype.element_ty), mask=rows < H)


@triton.jit
def _down_qsum(act_ptr, slots_ptr, w2, num_slots, token, rows, K: tl.constexpr, H: tl.constexpr,
               I: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_I: tl.constexpr, FMT: tl.constexpr, ZP: tl.constexpr):
    """[BLOCK_H] float32: Σ_j (in order) down[slots[token, j]][rows, :] · act[token * K + j] of a
    quantized pool, one accumulator over every expert, summed once."""
    acc = _qacc_zeros(BLOCK_H, CHUNK_I, FMT)
    for j in tl.static_range(K):  # ordered combine: j = 0, 1, ..., K-1 into one accumulator
        slot = tl.load(slots_ptr + token * K + j)
        live = (slot >= 0) & (slot < num_slots)
        for i0 in tl.static_range(0, I, CHUNK_I):
            acc = _qacc(acc, act_ptr + (token * K + j) * I, w2, tl.where(live, slot, 0), rows, live & (rows < H), i0,
                        H, I, H, FMT, ZP, CHUNK_I)
    return _qsum(acc, FMT)


@triton.jit
def _down_dense_sum(act_ptr, slots_ptr, w2_ptr, num_slots, token, rows, K: tl.constexpr, H: tl.constexpr,
                    I: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_I: tl.constexpr, EVEN: tl.constexpr,
                    GDC: tl.constexpr, RELEASE: tl.constexpr, PREFETCH: tl.constexpr):
    """[BLOCK_H] float32 routed sum of a dense pool (the programmatic wait inside, after the prefetch)."""
    NCH: tl.constexpr = (I + CHUNK_I - 1) // CHUNK_I
    slots = ()
    early = ()
    if PREFETCH > 0:
        for j in tl.static_range(K):
            slots = slots + (tl.load(slots_ptr + token * K + j),)
        for j in tl.static_range(PREFETCH):
            for i0 in tl.static_range(0, I, CHUNK_I):
                early = early + (_down_tile(w2_ptr, slots[j], num_slots, rows, i0, H, I, CHUNK_I, EVEN),)
    if GDC:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()
    acc = tl.zeros([BLOCK_H, CHUNK_I], dtype=tl.float32)
    for j in tl.static_range(K):  # ordered combine: j = 0, 1, ..., K-1 into one accumulator
        if PREFETCH > 0:
            slot = slots[j]
        else:
            slot = tl.load(slots_ptr + token * K + j)
        for i0 in tl.static_range(0, I, CHUNK_I):
            cols = i0 + tl.arange(0, CHUNK_I)  # [CHUNK_I]
            if EVEN:
                a = tl.load(act_ptr + (token * K + j) * I + cols)
            else:
                a = tl.load(act_ptr + (token * K + j) * I + cols, mask=cols < I, other=0.0)
            if j < PREFETCH:
                d = early[j * NCH + i0 // CHUNK_I]
            else:
                d = _down_tile(w2_ptr, slot, num_slots, rows, i0, H, I, CHUNK_I, EVEN)
            acc += d.to(tl.float32) * a[None, :]  # d: [BLOCK_H, CHUNK_I]
    return tl.sum(acc, axis=1)  # [BLOCK_H] routed sum, fixed order


# Entry kernels. The shared expert's two launches run the same bodies as the routed ones under their
# own names, so that a profile (moe.testing.kernel_trace, the overlap bench's breakdown) tells them
# apart and the side stream's launches can be checked by name. Arguments of the gate_up entries:
#   x_ptr [T, H] hidden; slots_ptr *i32 [T * K]; weights_ptr *fp32 [T * K] (unread when GATED);
#   gate_w_ptr [H] shared gate (read only when GATED); w13: the gate_up banks (q, s, s2, z), dense: q
#   [S, 2I, H]; act_ptr *fp32 [T * K, I] out; num_slots i32 S; pre_ptr *i32 [T * K] (PICK 2); b13_ptr
#   [S, 2I] gate_up biases (read when BIAS); constexprs as the body (GDC: launched with programmatic
#   serialization; FMT / ZP: the format, moe.kernels.quant_kernels; ACT / ALPHA / LIMIT: the activation).
# Arguments of the down entries:
#   act_ptr *fp32 [T * K, I]; slots_ptr *i32 [T * K]; w2: the down banks, dense: q [S, H, I]; addend_ptr *fp32 [T, H]
#   (read when ADDEND); out_ptr *fp32 [T, H] (written when WRITE_OUT); cast_ptr [T, H] model dtype (written when
#   WRITE_CAST); num_slots i32 S; weights_ptr *fp32 [T * K] and b2_ptr [S, H] down biases (read when BIAS); constexprs
#   as the body (GDC as gate_up).

@triton.jit(**JIT_OPTIONS)
def _gate_up_kernel(x_ptr, slots_ptr, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, pre_ptr, b13_ptr,
                    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                    CHUNK_H: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
                    PICK: tl.constexpr, FMT: tl.constexpr = 0, ZP: tl.constexpr = False, ACT: tl.constexpr = 0,
                    ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0, BIAS: tl.constexpr = False):
    _gate_up_body(x_ptr, slots_ptr, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, pre_ptr, b13_ptr,
                  K, H, I, BLOCK_I, CHUNK_H, EVEN, GATED, GDC, PICK, FMT, ZP, ACT, ALPHA, LIMIT, BIAS)


@triton.jit(**HITS_JIT_OPTIONS)
def _gate_up_hits(x_ptr, weights_ptr, w13, act_ptr, num_slots, pre_ptr, n_pairs, b13_ptr,
                  K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                  CHUNK_H: tl.constexpr, EVEN: tl.constexpr, FMT: tl.constexpr = 0, ZP: tl.constexpr = False,
                  ACT: tl.constexpr = 0, ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0,
                  BIAS: tl.constexpr = False):
    _gate_up_hits_body(x_ptr, weights_ptr, w13, act_ptr, num_slots, pre_ptr, n_pairs, b13_ptr,
                       K, H, I, BLOCK_I, CHUNK_H, EVEN, FMT, ZP, ACT, ALPHA, LIMIT, BIAS)


@triton.jit(**JIT_OPTIONS)
def _shared_gate_up(x_ptr, slots_ptr, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, pre_ptr, b13_ptr,
                    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                    CHUNK_H: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
                    PICK: tl.constexpr, FMT: tl.constexpr = 0, ZP: tl.constexpr = False):
    _gate_up_body(x_ptr, slots_ptr, weights_ptr, gate_w_ptr, w13, act_ptr, num_slots, pre_ptr, b13_ptr,
                  K, H, I, BLOCK_I, CHUNK_H, EVEN, GATED, GDC, PICK, FMT, ZP, 0, 1.702, 7.0, False)


@triton.jit(**JIT_OPTIONS)
def _down_kernel(act_ptr, slots_ptr, w2, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
                 K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr,
                 CHUNK_I: tl.constexpr, EVEN: tl.constexpr, ADDEND: tl.constexpr,
                 WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr, GDC: tl.constexpr,
                 RELEASE: tl.constexpr = False, PREFETCH: tl.constexpr = 0, FMT: tl.constexpr = 0,
                 ZP: tl.constexpr = False, BIAS: tl.constexpr = False):
    _down_body(act_ptr, slots_ptr, w2, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
               K, H, I, BLOCK_H, CHUNK_I, EVEN, ADDEND, WRITE_OUT, WRITE_CAST, GDC, RELEASE, PREFETCH, FMT, ZP,
               BIAS)


@triton.jit(**JIT_OPTIONS)
def _shared_down(act_ptr, slots_ptr, w2, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
                 K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr,
                 CHUNK_I: tl.constexpr, EVEN: tl.constexpr, ADDEND: tl.constexpr,
                 WRITE_OUT: tl.constexpr, WRITE_CAST: tl.constexpr, GDC: tl.constexpr,
                 FMT: tl.constexpr = 0, ZP: tl.constexpr = False):
    _down_body(act_ptr, slots_ptr, w2, addend_ptr, out_ptr, cast_ptr, num_slots, weights_ptr, b2_ptr,
               K, H, I, BLOCK_H, CHUNK_I, EVEN, ADDEND, WRITE_OUT, WRITE_CAST, GDC, False, 0, FMT, ZP, False)


GATE_UP_ENTRIES = {False: _gate_up_kernel, True: _shared_gate_up}  # keyed by "is the shared expert"
DOWN_ENTRIES = {False: _down_kernel, True: _shared_down}
