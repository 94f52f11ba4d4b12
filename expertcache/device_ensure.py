"""Device ensure: the ensure contract as one Triton launch, CUDA-graph capturable.

    ids [Q] int32 (rows * k, -1 = padding) + the slot map and policy state on the device
      every program: query (distinct keys ascending, hits, misses m, empty slots)
      if m > empty slots, every program scores its CHUNK of slots (pinned ones excluded)
        and keeps its BLOCK_Q lowest packed keys (score << SLOT_BITS | slot) in registers
      programs 0..G-2 write theirs to scratch and publish a flag (a release store)
      program G-1 commits: when it needs victims it publishes its own, waits for every
        flag of this launch (acquire loads) and merges; else it waits for no one. It
        writes refresh, evictions, installs, policy updates, plan [Q, 2] (key, slot),
        count [1], slots [Q], counters [L, 3], clock [3]

No host sync and fixed shapes: the miss count only ever lives in device memory. A refused
call (an id outside [-1, E), more distinct keys than slots) sets `status` and changes
nothing else.

Why this is safe. The committer changes state only (a) after every other program has
published this launch's flag, which each does after its last read of the state, or (b)
when the call needs no victims, in which case no one's candidates are read: a late
program that sees part of the commit may score garbage, but it only writes scratch.
Each program counts its own launches in flags[pid] (read at its start, published at its
end; the committer's own entry is its epoch), so a flag can never be mistaken for one of
another launch, and restoring the clock or the maps (benchmarks do) cannot confuse it.
The committer spins only on programs of its own grid with lower index, which the GPU
dispatches no later than it; the grid is small (S / CHUNK programs), so all fit at once.
Victim selection costs one pass over the pool split across programs plus one sort (or a
few minima) per program and one merge: never a pass per miss.
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
    key = tl.where(valid, layer * num_experts + e, 0).to(tl.int64)
    earlier = (key[:, None] == key[None, :]) & valid[None, :] & (i[None, :] < i[:, None])
    first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    slot = tl.load(slot_of_ptr + key, mask=valid, other=-1).to(tl.int64)
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
    lcv = tl.maximum(lc - (dc_now - dct), tl.load(prm_ptr + 4))
    return -((kk << 16) + d * tl.load(prm_ptr)) + ((tl.load(prm_ptr + 1) * lcv) >> 4)


@triton.jit
def _chunk_state(pid, key_of_ptr, kst_ptr, sst_ptr, num_slots, num_keys, POLICY: tl.constexpr,
                 CHUNK: tl.constexpr):
    """This program's slots and what their scores need, loaded at the start of the launch
    beside the query (so scoring waits on no further load): slot c [CHUNK], its key, and
    the policy's inputs (lru: step of last touch; lfuda: priority; rule: the key's
    last_tok, lc, dct)."""
    c = pid * CHUNK + tl.arange(0, CHUNK)
    cm = c < num_slots
    ckey = tl.load(key_of_ptr + c, mask=cm, other=-1).to(tl.int64)
    if POLICY == 0:
        a = tl.load(sst_ptr + c, mask=cm, other=0)
        b = a
        d = a
    elif POLICY == 2:
        a = tl.load(sst_ptr + num_slots + c, mask=cm, other=0)
        b = a
        d = a
    else:
        live = ckey >= 0
        kq = tl.where(live, ckey, 0)
        a = tl.load(kst_ptr + kq, mask=live, other=0)
        b = tl.load(kst_ptr + num_keys + kq, mask=live, other=0)
        d = tl.load(kst_ptr + 2 * num_keys + kq, mask=live, other=0)
    return c, ckey, a, b, d


@triton.jit
def _chunk_scores(c, ckey, a, b, d, prm_ptr, slot, hit, rkey, near, layer, tok, dc_now,
                  num_layers, num_experts, num_slots, POLICY: tl.constexpr,
                  HAS_LOGITS: tl.constexpr):
    """Packed keys (score << 20 | slot) of this program's slots; INT64_MAX for slots
    that are empty, pinned (hit by this call) or past the pool."""
    pinned = tl.sum(((c[:, None] == slot[None, :]) & hit[None, :]).to(tl.int32), axis=1) > 0
    ev = (c < num_slots) & (ckey >= 0) & (~pinned)
    if POLICY == 1:
        lt = a
        if HAS_LOGITS:
            hot = tl.sum(((ckey[:, None] == rkey[None, :]) & near[None, :]).to(tl.int32), axis=1) > 0
            lt = tl.where(hot, tl.maximum(lt, tok - 1), lt)
        score = _rule_score(tl.where(ev, ckey, 0), lt, b, d, layer, tok, dc_now, num_layers,
                            num_experts, prm_ptr)
    else:
        score = a
    return tl.where(ev, (score.to(tl.int64) << 20) | c.to(tl.int64), 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _keys_of(sel, packed, keys):
    """The key beside each of sel [BLOCK_Q] in (packed, keys) [N] (packed values distinct)."""
    return tl.sum(tl.where(packed[None, :] == sel[:, None], keys[None, :], 0), axis=1)


@triton.jit
def _seq_lowest(packed, need, BLOCK_Q: tl.constexpr):
    j = tl.arange(0, BLOCK_Q)
    sel = tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64)
    i = 0
    while i < need:  # a while loop: Triton's interpreter cannot range() a tensor
        v = tl.min(packed, axis=0)
        sel = tl.where(j == i, v, sel)
        packed = tl.where(packed == v, 0x7FFFFFFFFFFFFFFF, packed)
        i += 1
    return sel


@triton.jit
def _lowest(packed, need, N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The `need` (<= BLOCK_Q) lowest of packed [N] (distinct values), ascending, in a
    register vector [BLOCK_Q] padded with INT64_MAX: successive minima when few are
    needed, else one sort whose first BLOCK_Q entries are the column minima of the sorted
    vector folded to [N / BLOCK_Q, BLOCK_Q]."""
    if N < BLOCK_Q:
        sel = _seq_lowest(packed, need, BLOCK_Q)
    elif need <= SEQ_MAX:
        sel = _seq_lowest(packed, need, BLOCK_Q)
    else:
        sel = tl.min(tl.reshape(tl.sort(packed), [N // BLOCK_Q, BLOCK_Q]), axis=0)
    return sel


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
def _commit(ids_n, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, out_ptr,
            plan_ptr, count_ptr, counters_ptr, clock_ptr, sel, selkey, valid, key, first, slot, hit,
            fmiss, mrank, n, m, ne, filled, rkey, near, step, tok, dc_now, layer, num_slots,
            num_keys, mine, POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr,
            BLOCK_Q: tl.constexpr):
    """Apply one call: refresh, evictions and installs in ascending key order, touches,
    plan, slots, counters and clock. Runs in one program; `sel` [BLOCK_Q] holds the
    victims (packed keys, ascending) and `selkey` their keys, in registers."""
    if POLICY == 1:
        if HAS_LOGITS:
            lt = tl.load(kst_ptr + rkey, mask=near, other=0)
            tl.store(kst_ptr + rkey, tl.maximum(lt, tok - 1), mask=near)
            tl.debug_barrier()
    miss = valid & (slot < 0)
    from_cand = miss & (mrank >= ne)
    j = tl.arange(0, BLOCK_Q)
    pick = (j[None, :] == (mrank - ne)[:, None]) & from_cand[:, None]
    cand = tl.sum(tl.where(pick, sel[None, :], 0), axis=1)
    old = tl.sum(tl.where(pick, selkey[None, :], 0), axis=1)
    vslot = tl.where(from_cand, cand & ((1 << 20) - 1), filled + mrank)
    vscore = cand >> 20
    evict = fmiss & from_cand
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
    tl.store(out_ptr + j, tl.where(valid, sl, -1).to(tl.int32), mask=j < ids_n)
    tl.store(count_ptr, m)
    # `mine` [4]: this layer's counters, read at the start of the launch (no round trip here)
    j4 = tl.arange(0, 4)
    tl.store(counters_ptr + layer * 3 + j4, mine + tl.where(j4 == 0, 1, tl.where(j4 == 1, n, m)),
             mask=j4 < 3)
    tl.store(clock_ptr + j4, tl.where(j4 == 0, step, tl.where(j4 == 1, tok, filled + ne)),
             mask=j4 < 3)


@triton.jit
def _gather_candidates(cand_ptr, flags_ptr, sel, selkey, need, epoch, pid,
                       BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr):
    """The committing program (the last one): publish its own candidates, wait until
    every other program has published this launch's (flag == epoch), merge them all.
    Returns the `need` lowest packed keys [BLOCK_Q] and their keys."""
    j = tl.arange(0, BLOCK_Q)
    tl.store(cand_ptr + pid * BLOCK_Q + j, sel)
    tl.store(cand_ptr + BLOCK_C + pid * BLOCK_Q + j, selkey)
    g = tl.arange(0, BLOCK_G)
    gm = g < pid
    seen = tl.min(tl.where(gm, tl.atomic_add(flags_ptr + g, 0, mask=gm, sem="acquire"), epoch), axis=0)
    while seen < epoch:
        seen = tl.min(tl.where(gm, tl.atomic_add(flags_ptr + g, 0, mask=gm, sem="acquire"), epoch),
                      axis=0)
    tl.debug_barrier()
    c = tl.arange(0, BLOCK_C)
    cm = c < (pid + 1) * BLOCK_Q
    every = tl.load(cand_ptr + c, mask=cm, other=0x7FFFFFFFFFFFFFFF, volatile=True)
    keys = tl.load(cand_ptr + BLOCK_C + c, mask=cm, other=-1, volatile=True)
    sel = _lowest(every, need, BLOCK_C, BLOCK_Q)
    return sel, _keys_of(sel, every, keys)


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
    clock_ptr,      # int64 [3]: step, tok, filled slots (the last is device-only)
    counters_ptr,   # int64 [L, 3]: calls, accesses, misses per layer
    out_ptr,        # int32 [n_ids]: out: slot of each id, -1 for padding
    plan_ptr,       # int32 [BLOCK_Q, 2]: out: (key, slot) per miss, ascending key
    count_ptr,      # int32 [1]: out: misses of this call = rows of the plan in use
    cand_ptr,       # int64 [2, BLOCK_C]: scratch: BLOCK_Q candidates per program, their keys
    flags_ptr,      # int64 [G]: launches each program has finished publishing (never reset)
    status_ptr,     # int32 [1]: 0, or the code of the last refused call
    layer,          # this call's MoE layer
    num_experts, num_layers, num_slots, n_ids,
    k,              # routed experts per row (the k of the k-th logit)
    rows, T,        # logit rows and entries per row
    POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr, SINGLE: tl.constexpr,
):
    pid = tl.program_id(0)
    last = tl.num_programs(0) - 1  # the committing program
    num_keys = num_layers * num_experts
    epoch = tl.load(flags_ptr + pid) + 1  # this launch's number, as this program counts
    valid, key, first, slot, hit, fmiss, mrank, n, m, bad = _query(
        ids_ptr, slot_of_ptr, layer, num_experts, n_ids, BLOCK_Q)
    c, ckey, ca, cb, cd = _chunk_state(pid, key_of_ptr, kst_ptr, sst_ptr, num_slots, num_keys,
                                       POLICY, CHUNK)
    step = tl.load(clock_ptr) + 1
    tok = tl.load(clock_ptr + 1) + tl.where(layer == 0, 1, 0).to(tl.int64)
    filled = tl.load(clock_ptr + 2)
    j4 = tl.arange(0, 4)
    mine = tl.load(counters_ptr + layer * 3 + j4, mask=j4 < 3, other=0)
    dc_now = 0
    if POLICY == 1:
        dc_now = ((tok * num_layers + layer) << 16) // tl.load(prm_ptr + 2)
    ne = tl.minimum(m, num_slots - filled)
    need = m - ne
    ok = (bad == 0) & (n <= num_slots)
    if HAS_LOGITS:
        rkey, near = _near(lidx_ptr, lval_ptr, fprm_ptr, layer, num_experts, rows, T, k, BLOCK_R)
    else:
        rkey = tl.zeros([BLOCK_R], dtype=tl.int64)
        near = rkey != 0
    sel = tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64)
    selkey = tl.full([BLOCK_Q], -1, tl.int64)
    if ok & (need > 0):
        packed = _chunk_scores(c, ckey, ca, cb, cd, prm_ptr, slot, hit, rkey, near, layer, tok,
                               dc_now, num_layers, num_experts, num_slots, POLICY, HAS_LOGITS)
        sel = _lowest(packed, need, CHUNK, BLOCK_Q)
        selkey = _keys_of(sel, packed, ckey)
        if not SINGLE:
            if pid == last:
                sel, selkey = _gather_candidates(cand_ptr, flags_ptr, sel, selkey, need, epoch,
                                                 pid, BLOCK_Q, BLOCK_C, BLOCK_G)
            else:
                j = tl.arange(0, BLOCK_Q)
                tl.store(cand_ptr + pid * BLOCK_Q + j, sel)
                tl.store(cand_ptr + BLOCK_C + pid * BLOCK_Q + j, selkey)
    if pid == last:
        if not SINGLE:
            tl.store(flags_ptr + pid, epoch)
        if ok:
            _commit(n_ids, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, out_ptr,
                    plan_ptr, count_ptr, counters_ptr, clock_ptr, sel, selkey, valid, key, first, slot,
                    hit, fmiss, mrank, n, m, ne, filled, rkey, near, step, tok, dc_now, layer,
                    num_slots, num_keys, mine, POLICY, HAS_LOGITS, BLOCK_Q)
        else:
            tl.store(status_ptr, tl.where(bad > 0, 1, 2))
    else:
        # Every other program publishes every launch, scoring or not; the committer waits
        # for these only when it needs candidates, so a call without evictions waits for no one.
        tl.debug_barrier()  # this program's candidates stored before its flag
        tl.atomic_xchg(flags_ptr + pid, epoch, sem="release")
