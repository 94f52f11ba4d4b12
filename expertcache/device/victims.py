"""Victim selection of the device ensure (expertcache.device.ensure): the lowest packed keys.

    packed [N] int64 per program (score << SLOT_BITS | slot, INT64_MAX where not evictable)
      need <= SEQ_MAX: successive minima over registers -> best [BLOCK_Q] (and, on several
        programs, the program's candidates in scratch)
      more: one sort, its lowest BLOCK_Q to scratch (none is compiled when SEQ_MAX >= BLOCK_Q)
    the committing program of several: _merge reads every program's BLOCK_Q candidates, the same way
    the commit: _victims gives each miss its victim, from registers or from scratch

Keys are distinct (the slot is in the low bits), so the lowest `need` are well defined and ascend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _minima(packed, need, best, j, out_ptr, STORE_SEQ: tl.constexpr):
    """best[0:need] = the need lowest of packed (distinct values), ascending, by successive minima;
    also written to out[0:BLOCK_Q] when STORE_SEQ."""
    i = 0
    while i < need:  # a while loop: Triton's interpreter cannot range() a tensor
        v = tl.min(packed, axis=0)
        best = tl.where(j == i, v, best)
        packed = tl.where(packed == v, 0x7FFFFFFFFFFFFFFF, packed)
        i += 1
    if STORE_SEQ:
        tl.store(out_ptr + j, best)
    return best


@triton.jit
def _lowest(packed, need, out_ptr, N: tl.constexpr, BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr,
            STORE_SEQ: tl.constexpr):
    """The `need` (<= BLOCK_Q) lowest of packed [N] (distinct values), ascending.

    need <= SEQ_MAX: successive minima over registers, returned as best [BLOCK_Q] (padded with
    INT64_MAX) and also written to out[0:BLOCK_Q] when STORE_SEQ (another program merges them).
    Otherwise one sort, whose lowest BLOCK_Q are written to out[0:BLOCK_Q] (best is all padding).
    """
    j = tl.arange(0, BLOCK_Q)
    best = tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64)
    if SEQ_MAX >= BLOCK_Q:  # every need fits successive minima: no sort is compiled at all
        best = _minima(packed, need, best, j, out_ptr, STORE_SEQ)
    elif need <= SEQ_MAX:
        best = _minima(packed, need, best, j, out_ptr, STORE_SEQ)
    else:
        if N < BLOCK_Q:  # a chunk narrower than the query: pad the rest of out
            tl.store(out_ptr + j, best)
            tl.debug_barrier()
        n = tl.arange(0, N)
        tl.store(out_ptr + n, tl.sort(packed), mask=n < BLOCK_Q)
    return best


@triton.jit
def _merge(cand_ptr, G, need, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, SEQ_MAX: tl.constexpr):
    """The G programs' candidates, merged: the `need` lowest ascending (see _lowest, not stored
    when successive minima find them)."""
    j = tl.arange(0, BLOCK_C)
    c = tl.load(cand_ptr + j, mask=j < G * BLOCK_Q, other=0x7FFFFFFFFFFFFFFF)
    tl.debug_barrier()  # all read before cand[0:] is rewritten
    return _lowest(c, need, cand_ptr, BLOCK_C, BLOCK_Q, SEQ_MAX, False)


@triton.jit
def _victims(best, cand_ptr, r, from_cand, need, BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr):
    """Per query position, its victim's packed key (position r of the call's victims): from
    registers (`best`) when successive minima found them, else from scratch (the sort's output)."""
    if need <= SEQ_MAX:
        jj = tl.arange(0, BLOCK_Q)
        cand = tl.sum(tl.where(jj[None, :] == r[:, None], best[None, :], 0), axis=1)
    else:
        cand = tl.load(cand_ptr + r, mask=from_cand, other=0)
    return cand
