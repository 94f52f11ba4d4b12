"""Device ensure: the ensure contract as one Triton launch, CUDA-graph capturable.

    ids [Q] int32 (rows * k, -1 = padding) + the slot map and policy state on the device
      every program: query (distinct keys ascending, hits, misses m, empty slots)
      if m > empty slots, every program scores its CHUNK of slots (pinned ones excluded)
        and writes its BLOCK_Q lowest packed keys (score << SLOT_BITS | slot) to scratch
      the last program to arrive (an atomic counter, reset by it): merges the candidates,
        commits refresh, evictions, installs and policy updates, and writes
        plan [Q, 2] (key, slot), count [1], slots [Q], counters [L, 3], clock [2]

No host sync and fixed shapes: the miss count only ever lives in device memory. A call
with misses has every program arrive, scoring or not, so the committing program runs only
after every other program has read the pre-call state; a call without misses (or a refused
one) is committed by program 0 at once, since its commit leaves slot_of and key_of, the only
state the decision reads, as they were. A refused call (an id outside [-1, E), more
distinct keys than slots) sets `status` and changes nothing else.
Victim selection costs one pass over the pool split across programs plus one sort per
program and one merge: never a pass per miss.
"""

from __future__ import annotations

import triton
import triton.language as tl

SEQ_MAX: tl.constexpr = tl.constexpr(4)  # up to this many victims: successive minima, else a sort
SLOT_BITS = 20  # packed key = score * 2**20 + slot: slots < 2**20, |score| < 2**43
MAX_SLOTS = 1 << SLOT_BITS
ST_BAD_ID, ST_TOO_MANY = 1, 2  # status codes
POLICY_LRU, POLICY_RULE, POLICY_LFUDA = 0, 1, 2  # == expertcache.policies.base KIND_*


@triton.jit
def _query(ids_ptr, slot_of_ptr, layer, num_experts, n_ids, BLOCK_Q: tl.constexpr):
    """Distinct keys and their fate. Per position i: key, first (first occurrence of a
    valid key), slot (before the call), hit / fmiss (first and resident / absent), mrank
    (misses with a smaller key)."""
    i = tl.arange(0, BLOCK_Q)
    im = i < n_ids
    e = tl.load(ids_ptr + i, mask=im, other=-1)
    bad = tl.sum((im & ((e < -1) | (e >= num_experts))).to(tl.int32), axis=0)
    valid = im & (e >= 0) & (e < num_experts)
    key = tl.where(valid, layer * num_experts + e, 0)  # int32: keys < 2**31 (L * E)
    earlier = (key[:, None] == key[None, :]) & valid[None, :] & (i[None, :] < i[:, None])
    first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    slot = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    hit = first & (slot >= 0)
    fmiss = first & (slot < 0)
    smaller = key[None, :] < key[:, None]
    mrank = tl.sum((smaller & fmiss[None, :]).to(tl.int32), axis=1)
    n = tl.sum(first.to(tl.int32), axis=0)
    m = tl.sum(fmiss.to(tl.int32), axis=0)
    return valid, key, first, slot, hit, fmiss, mrank, n, m, bad


@triton.jit
def _near(lidx_ptr, lval_ptr, fprm_ptr, layer, num_experts, rows, T, k,
          BLOCK_R: tl.constexpr):
    """Near-miss refresh set: per logit entry, its key and whether its logit is within
    NEAR of its row's k-th largest (rows with fewer than k real entries: their smallest)."""
    r = tl.arange(0, BLOCK_R)
    rm = r < rows * T
    idx = tl.load(lidx_ptr + r, mask=rm, other=-1)
    val = tl.load(lval_ptr + r, mask=rm, other=0.0)
    real = rm & (idx >= 0)
    same = ((r // T)[:, None] == (r // T)[None, :]) & real[:, None] & real[None, :]
    gt = tl.sum((same & (val[None, :] > val[:, None])).to(tl.int32), axis=1)
    ge = tl.sum((same & (val[None, :] >= val[:, None])).to(tl.int32), axis=1)
    kk = tl.minimum(tl.sum(same.to(tl.int32), axis=1), k)
    is_kth = real & (gt < kk) & (kk <= ge)
    kth = tl.max(tl.where(same & is_kth[None, :], val[None, :], float("-inf")), axis=1)
    near = real & (val >= kth - tl.load(fprm_ptr))
    return (layer * num_experts + tl.where(real, idx, 0)).to(tl.int64), near


@triton.jit
def _log2_1p_q16(i):
    """T[i] = round(log2(1 + 2**(-i / 64)) * 2**16) for int64 i in [0, 1920]: rule's
    growth table, computed in float64 (every entry is at least 2e-4 from a rounding
    boundary, far beyond float64's error; tests compare all 1921 entries with the host
    table), so no dependent load of a table."""
    u = -(i.to(tl.float64) / 64.0)
    return tl.floor(tl.log2(1.0 + tl.exp2(u)) * 65536.0 + 0.5).to(tl.int64)


@triton.jit
def _rule_score(key, lt, lc, dct, layer, tok, dc_now, num_layers, num_experts, prm_ptr):
    lk = key.to(tl.int32) // num_experts  # keys < 2**31: a 32-bit division
    later = lk > layer
    kk = tl.where(later, tok - 1, tok) - lt
    kk = tl.minimum(tl.maximum(kk, 0), tl.load(prm_ptr + 3))
    d = tl.where(later, lk - layer, num_layers - layer + lk).to(tl.int64)
    lcv = tl.maximum(lc - (dc_now - dct), tl.load(prm_ptr + 4))  # no division per key
    return -((kk << 16) + d * tl.load(prm_ptr)) + ((tl.load(prm_ptr + 1) * lcv) >> 4)


@triton.jit
def _chunk_candidates(pid, need, key_of_ptr, kst_ptr, sst_ptr, prm_ptr, cand_ptr, slot, hit,
                      rkey, near, layer, tok, dc_now, num_layers, num_experts, num_slots, num_keys,
                      POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_Q: tl.constexpr):
    """Score this program's slots and keep its BLOCK_Q lowest packed keys in scratch."""
    c = pid * CHUNK + tl.arange(0, CHUNK)
    cm = c < num_slots
    key = tl.load(key_of_ptr + c, mask=cm, other=-1).to(tl.int64)
    pinned = tl.sum(((c[:, None] == slot[None, :]) & hit[None, :]).to(tl.int32), axis=1) > 0
    ev = cm & (key >= 0) & (~pinned)
    if POLICY == 0:
        score = tl.load(sst_ptr + c, mask=ev, other=0)
    elif POLICY == 2:
        score = tl.load(sst_ptr + num_slots + c, mask=ev, other=0)
    else:
        kq = tl.where(ev, key, 0)
        lt = tl.load(kst_ptr + kq, mask=ev, other=0)
        if HAS_LOGITS:
            hot = tl.sum(((kq[:, None] == rkey[None, :]) & near[None, :]).to(tl.int32), axis=1) > 0
            lt = tl.where(hot, tl.maximum(lt, tok - 1), lt)
        lc = tl.load(kst_ptr + num_keys + kq, mask=ev, other=0)
        dct = tl.load(kst_ptr + 2 * num_keys + kq, mask=ev, other=0)
        score = _rule_score(kq, lt, lc, dct, layer, tok, dc_now, num_layers, num_experts, prm_ptr)
    packed = tl.where(ev, (score.to(tl.int64) << 20) | c.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    _lowest(packed, need, cand_ptr + pid * BLOCK_Q, CHUNK, BLOCK_Q)


@triton.jit
def _lowest(packed, need, out_ptr, N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The `need` (<= BLOCK_Q) lowest of packed [N] (distinct values) ascending into
    out[0:BLOCK_Q], the rest padded with INT64_MAX: by successive minima over registers
    when few are needed, else one sort."""
    j = tl.arange(0, BLOCK_Q)
    if need <= SEQ_MAX:
        tl.store(out_ptr + j, tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64))
        tl.debug_barrier()
        i = 0
        while i < need:  # a while loop: Triton's interpreter cannot range() a tensor
            v = tl.min(packed, axis=0)
            tl.store(out_ptr + i, v)
            packed = tl.where(packed == v, 0x7FFFFFFFFFFFFFFF, packed)
            i += 1
    else:
        n = tl.arange(0, N)
        tl.store(out_ptr + n, tl.sort(packed), mask=n < BLOCK_Q)


@triton.jit
def _merge(cand_ptr, G, need, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """The programs' candidates, merged: the `need` lowest ascending at cand[0:]."""
    j = tl.arange(0, BLOCK_C)
    c = tl.load(cand_ptr + j, mask=j < G * BLOCK_Q, other=0x7FFFFFFFFFFFFFFF)
    tl.debug_barrier()  # all read before cand[0:] is rewritten
    _lowest(c, need, cand_ptr, BLOCK_C, BLOCK_Q)


@triton.jit
def _touch_rule(kst_ptr, prm_ptr, key, first, tok, dc_now, num_keys):
    """rule's use of every key of the call (hits and installs alike)."""
    lc = tl.load(kst_ptr + num_keys + key, mask=first, other=0)
    dct = tl.load(kst_ptr + 2 * num_keys + key, mask=first, other=-1)
    x = tl.maximum(lc - (dc_now - tl.maximum(dct, 0)), tl.load(prm_ptr + 4))
    grown = tl.maximum(x, 0) + _log2_1p_q16(tl.minimum(tl.abs(x) >> 10, 1920))
    tl.store(kst_ptr + num_keys + key, tl.where(dct < 0, 0, grown), mask=first)
    tl.store(kst_ptr + 2 * num_keys + key, dc_now + 0 * key, mask=first)
    tl.store(kst_ptr + key, tok + 0 * key, mask=first)


@triton.jit
def _touch_lfuda(sst_ptr, gst_ptr, sl, first, hit, evict, vscore, num_slots):
    """lfuda: hits count up at the age before the call; an install starts at 1 at the
    age raised by its own victim (victims ascend, so that is max(age, its score))."""
    age = tl.load(gst_ptr)
    freq = tl.where(hit, tl.load(sst_ptr + sl, mask=hit, other=0) + 1, 1)
    base = tl.where(evict, tl.maximum(age, vscore), age)
    tl.store(sst_ptr + sl, freq, mask=first)
    tl.store(sst_ptr + num_slots + sl, tl.where(hit, age, base) + freq, mask=first)
    tl.store(gst_ptr, tl.maximum(age, tl.max(tl.where(evict, vscore, age), axis=0)))


@triton.jit
def _commit(ids_n, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, cand_ptr,
            out_ptr, plan_ptr, count_ptr, counters_ptr, clock_ptr, valid, key, first, slot,
            hit, fmiss, mrank, n, m, ne, filled, rkey, near, step, tok, dc_now, layer, num_layers,
            num_slots, num_keys, mine, POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr,
            BLOCK_Q: tl.constexpr):
    """Apply one call: refresh, evictions and installs in ascending key order, touches,
    plan, slots, counters and clock. Runs in one program."""
    if POLICY == 1:
        if HAS_LOGITS:
            lt = tl.load(kst_ptr + rkey, mask=near, other=0)
            tl.store(kst_ptr + rkey, tl.maximum(lt, tok - 1), mask=near)
            tl.debug_barrier()
    miss = valid & (slot < 0)
    from_cand = miss & (mrank >= ne)
    cand = tl.load(cand_ptr + tl.where(from_cand, mrank - ne, 0), mask=from_cand, other=0)
    vslot = tl.where(from_cand, cand & ((1 << 20) - 1), filled + mrank)
    vscore = cand >> 20
    evict = fmiss & from_cand
    old = tl.load(key_of_ptr + vslot, mask=evict, other=-1)
    tl.debug_barrier()  # every old owner read before any slot is rewritten
    tl.store(slot_of_ptr + old, -1, mask=evict & (old >= 0))
    tl.store(key_of_ptr + vslot, key.to(tl.int32), mask=fmiss)
    tl.store(slot_of_ptr + key, vslot.to(tl.int32), mask=fmiss)
    tl.store(plan_ptr + 2 * mrank, key.to(tl.int32), mask=fmiss)
    tl.store(plan_ptr + 2 * mrank + 1, vslot.to(tl.int32), mask=fmiss)
    sl = tl.where(slot >= 0, slot, vslot)
    if POLICY == 0:
        tl.store(sst_ptr + sl, step + 0 * sl, mask=first)
    elif POLICY == 2:
        _touch_lfuda(sst_ptr, gst_ptr, sl, first, hit, evict, vscore, num_slots)
    else:
        _touch_rule(kst_ptr, prm_ptr, key, first, tok, dc_now, num_keys)
    i = tl.arange(0, BLOCK_Q)
    tl.store(out_ptr + i, tl.where(valid, sl, -1).to(tl.int32), mask=i < ids_n)
    tl.store(count_ptr, m)
    # `mine` [4]: this layer's counters, read at the start of the launch (no round trip here)
    j = tl.arange(0, 4)
    tl.store(counters_ptr + layer * 3 + j, mine + tl.where(j == 0, 1, tl.where(j == 1, n, m)),
             mask=j < 3)
    tl.store(clock_ptr, step)
    tl.store(clock_ptr + 1, tok)


@triton.jit(do_not_specialize=["layer", "num_experts", "num_layers", "num_slots", "n_ids", "k",
                               "rows", "T"])
def ensure_kernel(
    ids_ptr,        # int32 [n_ids]: routed expert ids of this call (rows * k), -1 = padding
    lidx_ptr,       # int32 [rows * T]: top-T router logit expert ids (read if HAS_LOGITS)
    lval_ptr,       # float32 [rows * T]: their logits
    slot_of_ptr,    # int32 [L * E]: slot of each key, -1 = absent
    key_of_ptr,     # int32 [S]: key in each slot, -1 = empty (always a suffix)
    kst_ptr,        # int64 [NK, L * E]: per-key policy state
    sst_ptr,        # int64 [NS, S]: per-slot policy state
    gst_ptr,        # int64 [NG]: policy-wide state
    prm_ptr,        # int64 [P]: integer policy constants (Policy.params)
    fprm_ptr,       # float32 [F]: float policy constants (Policy.fparams)
    clock_ptr,      # int64 [2]: step, tok
    counters_ptr,   # int64 [L, 3]: calls, accesses, misses per layer
    out_ptr,        # int32 [n_ids]: out: slot of each id, -1 for padding
    plan_ptr,       # int32 [BLOCK_Q, 2]: out: (key, slot) per miss, ascending key
    count_ptr,      # int32 [1]: out: misses of this call = rows of the plan in use
    cand_ptr,       # int64 [BLOCK_C]: scratch: candidates per program, then merged
    arrive_ptr,     # int32 [1]: scratch: programs arrived (zero between calls)
    status_ptr,     # int32 [1]: 0, or the code of the last refused call
    layer,          # this call's MoE layer
    num_experts, num_layers, num_slots, n_ids,
    k,              # routed experts per row (the k of the k-th logit)
    rows, T,        # logit rows and entries per row
    POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr, SINGLE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_keys = num_layers * num_experts
    valid, key, first, slot, hit, fmiss, mrank, n, m, bad = _query(
        ids_ptr, slot_of_ptr, layer, num_experts, n_ids, BLOCK_Q)
    step = tl.load(clock_ptr) + 1
    tok = tl.load(clock_ptr + 1) + tl.where(layer == 0, 1, 0).to(tl.int64)
    li = tl.arange(0, BLOCK_L)
    missed = tl.sum(tl.load(counters_ptr + li * 3 + 2, mask=li < num_layers, other=0), axis=0)
    j4 = tl.arange(0, 4)
    mine = tl.load(counters_ptr + layer * 3 + j4, mask=j4 < 3, other=0)
    filled = tl.minimum(missed, num_slots)
    dc_now = 0
    if POLICY == 1:  # rule's decay clock DC(now): one division per program
        dc_now = ((tok * num_layers + layer) << 16) // tl.load(prm_ptr + 2)
    ne = tl.minimum(m, num_slots - filled)
    ok = (bad == 0) & (n <= num_slots)
    if HAS_LOGITS:
        rkey, near = _near(lidx_ptr, lval_ptr, fprm_ptr, layer, num_experts, rows, T, k, BLOCK_R)
    else:
        rkey = tl.zeros([BLOCK_R], dtype=tl.int64)
        near = rkey != 0
    if ok & (m > ne):
        _chunk_candidates(pid, m - ne, key_of_ptr, kst_ptr, sst_ptr, prm_ptr, cand_ptr, slot, hit,
                          rkey, near, layer, tok, dc_now, num_layers, num_experts, num_slots,
                          num_keys, POLICY, HAS_LOGITS, CHUNK, BLOCK_Q)
    tl.debug_barrier()
    # A call without a miss (or a refused one) changes neither slot_of nor key_of, so every program,
    # however late it reads them, finds the same m == 0 (or the same refusal): program 0 commits it
    # at once and no one arrives. Any other call: every program arrives; the last one commits.
    quick = (m == 0) | (~ok)
    if SINGLE:
        commits = pid == 0  # one program: nothing to wait for
    elif quick:
        commits = pid == 0
    else:
        commits = tl.atomic_add(arrive_ptr, 1) == tl.num_programs(0) - 1
        if commits:
            tl.store(arrive_ptr, 0)
    if commits:
        tl.debug_barrier()
        if ok:
            if m > ne:
                if not SINGLE:
                    _merge(cand_ptr, tl.num_programs(0), m - ne, BLOCK_Q, BLOCK_C)
                tl.debug_barrier()
            _commit(n_ids, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr,
                    cand_ptr, out_ptr, plan_ptr, count_ptr, counters_ptr, clock_ptr, valid,
                    key, first, slot, hit, fmiss, mrank, n, m, ne, filled, rkey, near, step,
                    tok, dc_now, layer, num_layers, num_slots, num_keys, mine, POLICY, HAS_LOGITS,
                    BLOCK_Q)
        else:
            tl.store(status_ptr, tl.where(bad > 0, 1, 2))
