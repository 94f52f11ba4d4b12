"""The ensure and its miss copy in one launch (DeviceCache.ensure_copy).

    grid = G ensure programs + C copy programs, launched cooperatively (all co-resident)
      programs 0..G-1: the ensure, exactly as ensure_kernel runs it (expertcache.device_ensure);
        the program that commits the call (or records its refusal) then stores m + 1 to `ready`
        (a release, after a barrier behind every store of its commit; 1 for a refused call)
      programs G..G+C-1: wait for the predecessor (programmatic launch), then poll `ready` (an
        acquire) until it is set, and copy the first m plan rows as miss_copy does
        (expertcache.copy.copy_items), the plan read past L1; the last of them to finish (an
        arrival counter) zeroes `ready` and the counter for the next call

The same slot map, policy state, plan, count, counters and pool contents as ensure() followed by
miss_copy(), bit for bit, with one launch boundary less between the ensure and the routed GEMM that
reads the copied slots. The copy programs wait on programs of the same launch, so the grid must be
co-resident: a cooperative launch guarantees it (on the CPU interpreter the programs run in order,
the ensure's first). No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from expertcache.copy import copy_items
from expertcache.device_ensure import _ensure_program

ENSURE_COPY_JIT = {"do_not_specialize": ["layer", "num_experts", "num_layers", "num_slots", "n_ids", "k", "rows",
                                         "T", "num_rows", "store_keys"]}


@triton.jit(**ENSURE_COPY_JIT)
def ensure_copy_kernel(
    # the ensure's arguments (ensure_kernel's, in its order)
    ids_ptr, lidx_ptr, lval_ptr, slot_of_ptr, key_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, fprm_ptr,
    clock_ptr, counters_ptr, missed_ptr, out_ptr, plan_ptr, count_ptr, cand_ptr, arrive_ptr, status_ptr,
    mir_ptr, layer, num_experts, num_layers, num_slots, n_ids, k, rows, T,
    # the copy's
    ready_ptr,      # int32 [1]: 0 between calls; m + 1 once the call's plan is stored
    done_ptr,       # int32 [1]: copy programs finished (zero between calls)
    num_rows,       # i32: the plan's rows (its capacity)
    store_keys,     # i32: rows of each host bank
    src_ptrs, dst_ptrs,  # tuples of NUM_BANKS *i32: host banks, pool banks (as miss_copy)
    # constexprs: the ensure's, then the copy's
    POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SINGLE: tl.constexpr, SEQ_MAX: tl.constexpr,
    LEAN: tl.constexpr, EARLY: tl.constexpr, TABLE: tl.constexpr, MIRROR: tl.constexpr, GDC: tl.constexpr,
    LATE_RANKS: tl.constexpr, NARROW: tl.constexpr,
    NUM_BANKS: tl.constexpr, ROW_WORDS: tl.constexpr, FIRST_CHUNK: tl.constexpr, CHUNKS_PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr, GRID_ENSURE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < GRID_ENSURE:
        _ensure_program(pid, GRID_ENSURE, ready_ptr, True, ids_ptr, lidx_ptr, lval_ptr, slot_of_ptr, key_of_ptr,
                        kst_ptr, sst_ptr, gst_ptr, prm_ptr, fprm_ptr, clock_ptr, counters_ptr, missed_ptr, out_ptr,
                        plan_ptr, count_ptr, cand_ptr, arrive_ptr, status_ptr, mir_ptr, layer, num_experts,
                        num_layers, num_slots, n_ids, k, rows, T, POLICY, HAS_LOGITS, CHUNK, BLOCK_Q, BLOCK_R,
                        BLOCK_C, SINGLE, SEQ_MAX, LEAN, EARLY, TABLE, MIRROR, GDC, LATE_RANKS, NARROW)
    else:
        if GDC:  # the pool's slots may still be read by the launches before this one
            gdc_wait()
        ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
        while ready == 0:  # the committing program stores m + 1 once the plan is stored
            ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
        n = tl.minimum(ready - 1, num_rows)
        nprog = tl.num_programs(0) - GRID_ENSURE
        copy_items(pid - GRID_ENSURE, nprog, n, plan_ptr, store_keys, num_slots, src_ptrs, dst_ptrs, NUM_BANKS,
                   ROW_WORDS, FIRST_CHUNK, CHUNKS_PER_ROW, BLOCK, True)
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == nprog - 1:  # every copy program saw ready
            tl.store(ready_ptr, 0)
            tl.store(done_ptr, 0)
