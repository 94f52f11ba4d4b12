"""Device ensure: the ensure contract as one Triton launch, CUDA-graph capturable.

    ids [Q] int32 (rows * k, -1 = padding) + the slot map and policy state on the device
      every program: query (distinct keys ascending, hits, misses m, empty slots)
      if m > empty slots, every program scores its CHUNK of slots (pinned ones excluded)
        and finds its BLOCK_Q lowest packed keys (score << SLOT_BITS | slot)
      one program (SINGLE): commits at once, the victims still in registers;
      several: each writes its candidates to scratch, and the last program to arrive (an
        atomic counter, reset by it) merges them and commits
      commit: refresh, evictions, installs and policy updates, and writes
        plan [Q, 2] (key, slot), count [1], slots [Q], counters [L, 3], clock [2]

No host sync and fixed shapes: the miss count only ever lives in device memory. A call
with misses has every program arrive, scoring or not, so the committing program runs only
after every other program has read the pre-call state; a call without misses (or a refused
one) is committed by program 0 at once, since its commit leaves slot_of and key_of, the only
state the decision reads, as they were. A refused call (an id outside [-1, E), more
distinct keys than slots) sets `status` and changes nothing else.
Victim selection costs one pass over the pool split across programs, then per program
and in the merge either up to SEQ_MAX successive minima over registers or one sort: never
a pass over the pool per miss.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

SEQ_MAX = 16  # default: up to this many victims by successive minima, more by a sort (k <= 16 at batch 1:
# no sort is compiled, a smaller kernel that was faster in every lru cell with misses on the H200, docs/gpu.md)
SLOT_BITS = 20  # packed key = score * 2**20 + slot: slots < 2**20, |score| < 2**43
MAX_SLOTS = 1 << SLOT_BITS
MAX_QUERY = 1 << 10  # ids per call: fewer (the query's tallies are packed in 10-bit fields)
# rule's mirror, row 0 per slot: lt | layer << LT_BITS (layers <= MIRROR_MAX_LAYERS, lt < 2**56), or PINNED
# while the call being scored holds the slot's key as a hit (the call's commit rewrites the word)
LT_BITS = tl.constexpr(56)
LT_MASK = tl.constexpr((1 << 56) - 1)
MIRROR_MAX_LAYERS = 127  # layer indices <= 126: a packed word never equals PINNED
PINNED = tl.constexpr(0x7FFFFFFFFFFFFFFF)
ST_BAD_ID, ST_TOO_MANY = 1, 2  # status codes
POLICY_LRU, POLICY_RULE, POLICY_LFUDA = 0, 1, 2  # == expertcache.policies.base KIND_*


@triton.jit
def _query_loads(ids_ptr, slot_of_ptr, layer, num_experts, n_ids, kst_ptr, sst_ptr, gst_ptr, num_keys,
                 BLOCK_Q: tl.constexpr, POLICY: tl.constexpr, EARLY: tl.constexpr):
    """The query's loads: per position i the id's key and its slot (before the call). EARLY: also
    the commit's policy reads that need only the key or the slot, for every valid position (a
    repeated key reads what its first occurrence reads): rule's lc and dct (_rule_reads), lfuda's hit
    count and age. Issued at the start of the launch, before any arithmetic that does not need them
    (rule's decay clock, the near-miss set), so their round trips overlap it."""
    i = tl.arange(0, BLOCK_Q)
    im = i < n_ids
    e = tl.load(ids_ptr + i, mask=im, other=-1)
    bad_i = im & ((e < -1) | (e >= num_experts))
    valid = im & (e >= 0) & (e < num_experts)
    key = tl.where(valid, layer * num_experts + e, 0)  # int32: keys < 2**31 (L * E)
    slot = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    raw_a, raw_b = 0, 0
    if EARLY:
        if POLICY == 1:
            raw_a, raw_b = _rule_reads(kst_ptr, key, valid, num_keys)
        elif POLICY == 2:
            raw_a, raw_b = _lfuda_reads(sst_ptr, gst_ptr, slot, valid & (slot >= 0))
    return valid, bad_i, key, slot, raw_a, raw_b


@triton.jit
def _query_tally(valid, bad_i, key, slot, BLOCK_Q: tl.constexpr):
    """The query's fate of each position: first (first occurrence of a valid key), hit / fmiss (first
    and resident / absent), and the call's bad ids, distinct keys n and misses m."""
    i = tl.arange(0, BLOCK_Q)
    earlier = (key[:, None] == key[None, :]) & valid[None, :] & (i[None, :] < i[:, None])
    first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    hit = first & (slot >= 0)
    fmiss = first & (slot < 0)
    # bad, n and m in one block reduction (each < 2**10: the host refuses rows * k >= 1024)
    tally = tl.sum(bad_i.to(tl.int32) << 20 | first.to(tl.int32) << 10 | fmiss.to(tl.int32), axis=0)
    bad, n, m = tally >> 20, (tally >> 10) & 1023, tally & 1023
    return first, hit, fmiss, n, m, bad


@triton.jit
def _miss_rank(key, fmiss):
    """Per position, the call's misses with a smaller key (a miss's row in the plan). Only a call
    with misses needs it: its block reduction is kept off the path of a call that hits."""
    smaller = key[None, :] < key[:, None]
    return tl.sum((smaller & fmiss[None, :]).to(tl.int32), axis=1)


@triton.jit
def _ranks_if(key, fmiss, LATE_RANKS: tl.constexpr):
    """_miss_rank with LATE_RANKS, else zeros (unused: the ranks were reduced before the scoring)."""
    if LATE_RANKS:
        return _miss_rank(key, fmiss)
    return tl.zeros_like(key)


@triton.jit
def _near_loads(lidx_ptr, lval_ptr, fprm_ptr, rows, T, BLOCK_R: tl.constexpr):
    """The near-miss set's loads (router logit ids and values, NEAR), issued at the start of the
    launch; _near works on them once the query's loads are out too."""
    r = tl.arange(0, BLOCK_R)
    rm = r < rows * T
    idx = tl.load(lidx_ptr + r, mask=rm, other=-1)
    val = tl.load(lval_ptr + r, mask=rm, other=0.0)
    return idx, val, tl.load(fprm_ptr)


@triton.jit
def _near(idx, val, near_by, layer, num_experts, rows, T, k, BLOCK_R: tl.constexpr):
    """Near-miss refresh set: per logit entry, its key and whether its logit is within
    NEAR (near_by) of its row's k-th largest (rows with fewer than k real entries: their smallest)."""
    r = tl.arange(0, BLOCK_R)
    real = (r < rows * T) & (idx >= 0)
    same = ((r // T)[:, None] == (r // T)[None, :]) & real[:, None] & real[None, :]
    gt = tl.sum((same & (val[None, :] > val[:, None])).to(tl.int32), axis=1)
    ge = tl.sum((same & (val[None, :] >= val[:, None])).to(tl.int32), axis=1)
    kk = tl.minimum(tl.sum(same.to(tl.int32), axis=1), k)
    is_kth = real & (gt < kk) & (kk <= ge)
    kth = tl.max(tl.where(same & is_kth[None, :], val[None, :], float("-inf")), axis=1)
    near = real & (val >= kth - near_by)
    return (layer * num_experts + tl.where(real, idx, 0)).to(tl.int64), near


@triton.jit
def _decay_clock(tok, num_layers, layer, divisor):
    """rule's decay clock DC(now), one 64-bit division per program. On sm_90 that division is a
    subroutine call that no later load is moved above, so the kernel computes it only after its
    loads are issued."""
    return ((tok * num_layers + layer) << 16) // divisor


@triton.jit
def _log2_1p_q16(i):
    """T[i] = round(log2(1 + 2**(-i / 64)) * 2**16) for int64 i in [0, 1920]: rule's
    growth table, computed in float64 (every entry is at least 2e-4 from a rounding
    boundary, far beyond float64's error; tests compare all 1921 entries with the host
    table), so no dependent load of a table."""
    u = -(i.to(tl.float64) / 64.0)
    return tl.floor(tl.log2(1.0 + tl.exp2(u)) * 65536.0 + 0.5).to(tl.int64)


@triton.jit
def _rule_score(lk, lt, lcd, layer, tok, dc_now, num_layers, rc_beta, rc_w, rc_kmax, rc_floor,
                NARROW: tl.constexpr = False):
    """rule's score of keys of layer lk with last use lt and lc + dct = lcd (int64); rc_*: its
    constants (prm[0, 1, 3, 4]), loaded at the start of the launch so no load waits here.
    NARROW (DeviceCache(narrow_score=True), rule's default where Rule.int32_scores holds): the same
    values in int32. lcd - DC(now) stays 64-bit and is clamped by a 64-bit compare, as is tok - lt
    from tok = 2**31 - 1 on (below it, for the whole call, every lt is in [0, tok] and the difference
    is 32-bit); every term after them fits in int32 (k <= K_MAX, d <= L, lcv <= LC_MAX for a
    resident key), so the products, shifts and sums are 32-bit. In the sm_90 SASS of one 2048-slot
    program of 8 warps, the scoring of a thread's 8 slots takes 258 instructions instead of 462."""
    lk = lk.to(tl.int32)  # a layer: the int64 mirror row's low word, so the compares are 32-bit
    later = lk > layer
    lcv = lcd - dc_now  # no division per key
    if NARROW:
        if tok < 0x7FFFFFFF:  # the whole call: every lt is in [0, tok], so its difference is 32-bit
            t32 = tok.to(tl.int32)
            k32 = tl.where(later, t32 - 1, t32) - lt.to(tl.int32)
            k32 = tl.minimum(tl.maximum(k32, 0), rc_kmax.to(tl.int32))
        else:
            kk = tl.where(later, tok - 1, tok) - lt
            k32 = tl.where(kk < 0, 0, tl.where(kk > rc_kmax, rc_kmax.to(tl.int32), kk.to(tl.int32)))
        d = tl.where(later, lk - layer, num_layers - layer + lk)
        lcv = tl.where(lcv < rc_floor, rc_floor.to(tl.int32), lcv.to(tl.int32))
        score = (((rc_w.to(tl.int32) * lcv) >> 4) - (k32 << 16) - d * rc_beta.to(tl.int32)).to(tl.int64)
    else:
        kk = tl.where(later, tok - 1, tok) - lt
        kk = tl.minimum(tl.maximum(kk, 0), rc_kmax)
        d = tl.where(later, lk - layer, num_layers - layer + lk).to(tl.int64)
        lcv = tl.maximum(lcv, rc_floor)
        score = -((kk << 16) + d * rc_beta) + ((rc_w * lcv) >> 4)
    return score


@triton.jit
def _mirror_refresh(slot_of_ptr, mir_ptr, rkey, near, tok, layer, slot, hit, SKIP_HITS: tl.constexpr):
    """The near-miss refresh of the resident near keys' mirrored lt, at their slots: row 0 holds
    lt | layer << LT_BITS and the near keys are this layer's, so the max of the packed words is the
    max of lt (a PINNED word stays). SKIP_HITS: not at the call's hit slots (`slot` where `hit`), so
    a scoring program never rewrites a pin that another program stamped there."""
    rs = tl.load(slot_of_ptr + rkey, mask=near, other=-1)
    nm = near & (rs >= 0)
    if SKIP_HITS:
        pinned = tl.sum(((rs[:, None] == slot[None, :]) & hit[None, :]).to(tl.int32), axis=1) > 0
        nm = nm & ~pinned
    lt = tl.load(mir_ptr + rs, mask=nm, other=0)
    tl.store(mir_ptr + rs, tl.maximum(lt, (tok - 1) | (layer.to(tl.int64) << LT_BITS)), mask=nm)


@triton.jit
def _chunk_candidates(pid, need, ids_ptr, slot_of_ptr, n_ids, key_of_ptr, kst_ptr, sst_ptr, rc_beta, rc_w, rc_kmax,
                      rc_floor,
                      cand_ptr, rkey, near, layer, tok, dc_now, num_layers, num_experts, num_slots, num_keys,
                      slot, hit, step, filled, mir_ptr, qkey, fmiss,
                      POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr, STORE_SEQ: tl.constexpr,
                      LEAN: tl.constexpr, MIRROR: tl.constexpr = False, LATE_RANKS: tl.constexpr = False,
                      NARROW: tl.constexpr = False):
    """Score this program's slots; return its BLOCK_Q lowest packed keys (successive minima), kept
    in scratch for the merge (STORE_SEQ, or a sort: see _lowest), and with LATE_RANKS the query's
    miss ranks (_miss_rank of qkey, fmiss; else zeros): their block reduction then runs right after
    the scoring loads are issued, while those are in flight, instead of before them."""
    c = pid * CHUNK + tl.arange(0, CHUNK)
    if LEAN and POLICY == 0:
        # lru, lean: the filled slots are the prefix [0, filled) (no key_of load), and the hits'
        # stamps are raised to this call's step first (every scoring program and the commit write
        # the same). Every other filled slot has an older stamp and at least `need` of them exist
        # (n <= S), so no hit is ever among the `need` lowest: no pinned test.
        tl.store(sst_ptr + slot, step + 0 * slot, mask=hit)
        tl.debug_barrier()
        ev = c < filled
        score = tl.load(sst_ptr + c, mask=ev, other=0)
        mrank = _ranks_if(qkey, fmiss, LATE_RANKS)
    elif MIRROR:
        # rule with its per-slot mirror (DeviceCache(rule_mirror=True)): every input of a slot's score
        # is one of two coalesced loads of the filled prefix [0, filled) (no key_of, no gather through
        # keys, no division), and the hits are pinned by PINNED written over their row 0, one compare
        # per slot instead of one per query position (the commit's touch rewrites those words). Every
        # scoring program writes the same pins and the same near-miss refresh (the commit repeats the
        # refresh; here it skips the hits' slots, so no program overwrites a pin), then its barrier.
        tl.store(mir_ptr + slot, PINNED + 0 * slot.to(tl.int64), mask=hit)
        if HAS_LOGITS:
            _mirror_refresh(slot_of_ptr, mir_ptr, rkey, near, tok, layer, slot, hit, True)
        tl.debug_barrier()
        fm = c < filled
        ltk = tl.load(mir_ptr + c, mask=fm, other=0)
        lcd = tl.load(mir_ptr + num_slots + c, mask=fm, other=0)
        mrank = _ranks_if(qkey, fmiss, LATE_RANKS)
        ev = fm & (ltk != PINNED)
        score = _rule_score(ltk >> LT_BITS, ltk & LT_MASK, lcd, layer, tok, dc_now, num_layers,
                            rc_beta, rc_w, rc_kmax, rc_floor, NARROW)
    else:
        cm = c < num_slots
        key = tl.load(key_of_ptr + c, mask=cm, other=-1).to(tl.int64)
        # pinned: the call's hits. Their slots are re-read as scalars (the query's own loads, so L1
        # hits; no program writes slot_of before every program has scored), one compare per slot
        # each: no [CHUNK, BLOCK_Q] matrix in registers.
        pinned = c < 0
        for q in tl.static_range(BLOCK_Q):
            e = tl.load(ids_ptr + q, mask=q < n_ids, other=-1)
            live = (e >= 0) & (e < num_experts)
            s_q = tl.load(slot_of_ptr + layer * num_experts + tl.where(live, e, 0), mask=live, other=-1)
            pinned = pinned | (c == s_q)
        ev = cm & (key >= 0) & (~pinned)
        # lru / lfuda: the per-slot score is loaded beside key_of (masked by cm, not by ev, so the
        # two loads are independent and overlap); rule's per-key state needs the key first
        if POLICY == 0:
            score = tl.load(sst_ptr + c, mask=cm, other=0)
            mrank = _ranks_if(qkey, fmiss, LATE_RANKS)
        elif POLICY == 2:
            score = tl.load(sst_ptr + num_slots + c, mask=cm, other=0)
            mrank = _ranks_if(qkey, fmiss, LATE_RANKS)
        else:
            kq = tl.where(ev, key, 0)
            # lc and dct first: the refresh below rewrites only the lt row, so these two gathers
            # need not wait for its barrier
            lc = tl.load(kst_ptr + num_keys + kq, mask=ev, other=0)
            dct = tl.load(kst_ptr + 2 * num_keys + kq, mask=ev, other=0)
            if HAS_LOGITS:
                # the near-miss refresh first, in memory: every scoring program writes the same
                # values (the commit's own refresh repeats them), so each reads refreshed `lt` below
                # after its barrier, and no [CHUNK, BLOCK_R] match matrix is held in registers
                lt_r = tl.load(kst_ptr + rkey, mask=near, other=0)
                tl.store(kst_ptr + rkey, tl.maximum(lt_r, tok - 1), mask=near)
                tl.debug_barrier()
            lt = tl.load(kst_ptr + kq, mask=ev, other=0)
            mrank = _ranks_if(qkey, fmiss, LATE_RANKS)
            lk = kq.to(tl.int32) // num_experts  # keys < 2**31: a 32-bit division
            score = _rule_score(lk, lt, lc + dct, layer, tok, dc_now, num_layers, rc_beta, rc_w, rc_kmax, rc_floor,
                                NARROW)
    packed = tl.where(ev, (score.to(tl.int64) << 20) | c.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    return _lowest(packed, need, cand_ptr + pid * BLOCK_Q, CHUNK, BLOCK_Q, SEQ_MAX, STORE_SEQ), mrank


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
    """The programs' candidates, merged: the `need` lowest ascending (see _lowest, not stored
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


@triton.jit
def _rule_reads(kst_ptr, key, first, num_keys):
    """rule's lc and dct of each key (dct < 0: never used)."""
    lc = tl.load(kst_ptr + num_keys + key, mask=first, other=0)
    dct = tl.load(kst_ptr + 2 * num_keys + key, mask=first, other=-1)
    return lc, dct


@triton.jit
def _lfuda_reads(sst_ptr, gst_ptr, slot, hit):
    """lfuda's hit counts (at the hits' slots) and its age."""
    return tl.load(sst_ptr + slot, mask=hit, other=0), tl.load(gst_ptr)


@triton.jit
def _policy_reads(kst_ptr, sst_ptr, gst_ptr, prm_ptr, key, first, slot, hit, num_keys, dc_now, rc_floor,
                  POLICY: tl.constexpr,
                  TABLE: tl.constexpr):
    """What the commit's policy update reads: rule's lc and dct of each key, and from them the lc
    its use leaves (a, _rule_grown; b unused); lfuda's hit counts and age (lru: nothing). Only the
    committing program writes them, so they may be read at the start of the launch, beside the
    query's loads (EARLY: _rule_reads / _lfuda_reads in _query_loads, then _rule_grown)."""
    if POLICY == 1:
        lc, dct = _rule_reads(kst_ptr, key, first, num_keys)
        a = _rule_grown(lc, dct, dc_now, rc_floor, prm_ptr, first, TABLE)
        b = 0
    elif POLICY == 2:
        a, b = _lfuda_reads(sst_ptr, gst_ptr, slot, hit)
    else:
        a, b = 0, 0
    return a, b


@triton.jit
def _rule_grown(lc, dct, dc_now, rc_floor, prm_ptr, first, TABLE: tl.constexpr):
    """rule's lc of keys used now, from their lc and dct before (dct < 0: never used: 0).
    TABLE: the growth term loaded from the policy's table (prm[5:], an L2 hit) instead of computed
    in float64 (DeviceCache(rule_table=True))."""
    x = tl.maximum(lc - (dc_now - tl.maximum(dct, 0)), rc_floor)
    ti = tl.minimum(tl.abs(x) >> 10, 1920)
    if TABLE:
        grown = tl.maximum(x, 0) + tl.load(prm_ptr + 5 + ti, mask=first, other=0)
    else:
        grown = tl.maximum(x, 0) + _log2_1p_q16(ti)
    return tl.where(dct < 0, 0, grown)


@triton.jit
def _touch_rule(kst_ptr, key, first, tok, dc_now, num_keys, lc_new, mir_ptr, sl, num_slots, layer,
                MIRROR: tl.constexpr):
    """rule's use of every key of the call (hits and installs alike); lc_new: the keys' lc after it
    (_policy_reads: only the committing program writes lc and dct, so they are read, and lc_new
    computed, at the start of the launch)."""
    tl.store(kst_ptr + num_keys + key, lc_new, mask=first)
    tl.store(kst_ptr + 2 * num_keys + key, dc_now + 0 * key, mask=first)
    tl.store(kst_ptr + key, tok + 0 * key, mask=first)
    if MIRROR:  # at the key's slot (sl: its slot after this call): lt | layer << LT_BITS, and lc + dct
        tl.store(mir_ptr + sl, (tok | (layer.to(tl.int64) << LT_BITS)) + 0 * key, mask=first)
        tl.store(mir_ptr + num_slots + sl, lc_new + dc_now, mask=first)


@triton.jit
def _touch_lfuda(sst_ptr, gst_ptr, sl, first, hit, evict, vscore, num_slots, hit_freq, age):
    """lfuda: hits count up at the age before the call; an install starts at 1 at the
    age raised by its own victim (victims ascend, so that is max(age, its score)). hit_freq, age:
    the hits' counts and the age as loaded at the start of the launch (only the committing program
    writes them)."""
    freq = tl.where(hit, hit_freq + 1, 1)
    base = tl.where(evict, tl.maximum(age, vscore), age)
    tl.store(sst_ptr + sl, freq, mask=first)
    tl.store(sst_ptr + num_slots + sl, tl.where(hit, age, base) + freq, mask=first)
    tl.store(gst_ptr, tl.maximum(age, tl.max(tl.where(evict, vscore, age), axis=0)))


@triton.jit
def _commit(ids_n, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, cand_ptr,
            out_ptr, plan_ptr, count_ptr, counters_ptr, clock_ptr, valid, key, first, slot,
            hit, fmiss, mrank, n, m, ne, filled, rkey, near, step, tok, dc_now, layer, num_layers,
            num_slots, num_keys, mine, best, early_a, early_b, rc_floor, POLICY: tl.constexpr,
            HAS_LOGITS: tl.constexpr,
            EARLY: tl.constexpr,
            BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr, LEAN: tl.constexpr, TABLE: tl.constexpr,
            mir_ptr, MIRROR: tl.constexpr, HITS_ONLY: tl.constexpr = False):
    """Apply one call: refresh, evictions and installs in ascending key order, touches,
    plan, slots, counters and clock. Runs in one program. The victims: `best` (registers)
    when successive minima found them, else cand[0:] (the sort's output). HITS_ONLY: the call
    has no miss (m == 0): only the refresh, touches, slots, count, counters and clock are compiled."""
    if POLICY == 1:
        if HAS_LOGITS:
            lt = tl.load(kst_ptr + rkey, mask=near, other=0)
            if MIRROR:  # the resident near keys' mirrored lt too, at their slots before this call
                _mirror_refresh(slot_of_ptr, mir_ptr, rkey, near, tok, layer, slot, hit, False)
            tl.store(kst_ptr + rkey, tl.maximum(lt, tok - 1), mask=near)
            tl.debug_barrier()
    if HITS_ONLY:  # every valid position is a hit: its slot stays, nothing is evicted or installed
        sl = slot
        evict = fmiss
        vscore = tl.zeros([BLOCK_Q], dtype=tl.int64)
    else:
        miss = valid & (slot < 0)
        from_cand = miss & (mrank >= ne)
        r = tl.where(from_cand, mrank - ne, 0)
        evicts = True
        if LEAN:  # no victim gather, no old-owner load and no barrier when nothing is evicted
            evicts = m > ne
        cand = tl.zeros([BLOCK_Q], dtype=tl.int64)
        if evicts:
            cand = _victims(best, cand_ptr, r, from_cand, m - ne, BLOCK_Q, SEQ_MAX)
        vslot = tl.where(from_cand, cand & ((1 << 20) - 1), filled + mrank)
        vscore = cand >> 20
        evict = fmiss & from_cand
        old = tl.full([BLOCK_Q], -1, tl.int32)
        if evicts:
            old = tl.load(key_of_ptr + vslot, mask=evict, other=-1)
            tl.debug_barrier()  # every old owner read before any slot is rewritten
        tl.store(slot_of_ptr + old, -1, mask=evict & (old >= 0))
        tl.store(key_of_ptr + vslot, key.to(tl.int32), mask=fmiss)
        tl.store(slot_of_ptr + key, vslot.to(tl.int32), mask=fmiss)
        tl.store(plan_ptr + 2 * mrank, key.to(tl.int32), mask=fmiss)
        tl.store(plan_ptr + 2 * mrank + 1, vslot.to(tl.int32), mask=fmiss)
        sl = tl.where(slot >= 0, slot, vslot)
    if not EARLY:  # read now (early_reads=False), or at the start of the launch (early_a, early_b)
        early_a, early_b = _policy_reads(kst_ptr, sst_ptr, gst_ptr, prm_ptr, key, first, slot, hit, num_keys,
                                         dc_now, rc_floor, POLICY, TABLE)
    if POLICY == 0:
        tl.store(sst_ptr + sl, step + 0 * sl, mask=first)
    elif POLICY == 2:
        _touch_lfuda(sst_ptr, gst_ptr, sl, first, hit, evict, vscore, num_slots, early_a, early_b)
    else:
        _touch_rule(kst_ptr, key, first, tok, dc_now, num_keys, early_a, mir_ptr, sl, num_slots, layer, MIRROR)
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
    missed_ptr,     # int64 [1]: all layers' misses so far (counters[:, 2].sum()); min(it, S) slots are filled
    out_ptr,        # int32 [n_ids]: out: slot of each id, -1 for padding
    plan_ptr,       # int32 [BLOCK_Q, 2]: out: (key, slot) per miss, ascending key
    count_ptr,      # int32 [1]: out: misses of this call = rows of the plan in use
    cand_ptr,       # int64 [BLOCK_C]: scratch: candidates per program, then merged
    arrive_ptr,     # int32 [1]: scratch: programs arrived (zero between calls)
    status_ptr,     # int32 [1]: 0, or the code of the last refused call
    mir_ptr,        # int64 [2, S]: with MIRROR (rule), per slot: its key's lt | layer << LT_BITS (PINNED
                    # while a scoring call holds it as a hit) and lc + dct (else unread)
    layer,          # this call's MoE layer
    num_experts, num_layers, num_slots, n_ids,
    k,              # routed experts per row (the k of the k-th logit)
    rows, T,        # logit rows and entries per row
    POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SINGLE: tl.constexpr, SEQ_MAX: tl.constexpr,
    LEAN: tl.constexpr = False,  # DeviceCache(lean=True), its default: see _chunk_candidates, _commit
    EARLY: tl.constexpr = False,  # DeviceCache(early_reads=True), its default: see _policy_reads
    TABLE: tl.constexpr = False,  # DeviceCache(rule_table=True), its default: rule's growth term from its table
    MIRROR: tl.constexpr = False,  # DeviceCache(rule_mirror=True): rule scores from its per-slot mirror
    GDC: tl.constexpr = False,  # launched programmatically: wait for the predecessor, then free the next
    LATE_RANKS: tl.constexpr = False,  # DeviceCache(late_ranks=True): see _chunk_candidates
    NARROW: tl.constexpr = False,  # DeviceCache(narrow_score=True): rule's score in int32 (_rule_score)
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_keys = num_layers * num_experts
    # The loads that do not depend on the query first (Triton keeps their order), so their round
    # trips overlap the query's dependent pair of loads instead of following its reductions.
    step = tl.load(clock_ptr) + 1
    tok = tl.load(clock_ptr + 1) + tl.where(layer == 0, 1, 0).to(tl.int64)
    missed = tl.load(missed_ptr)  # one word, whatever the layer count (the commit adds this call's m)
    j4 = tl.arange(0, 4)
    mine = tl.load(counters_ptr + layer * 3 + j4, mask=j4 < 3, other=0)
    dc_now = 0
    rc_beta, rc_w, rc_kmax, rc_floor, rc_div = 0, 0, 0, 0, 1
    if POLICY == 1:  # rule's constants
        rc_beta, rc_w = tl.load(prm_ptr), tl.load(prm_ptr + 1)
        rc_div, rc_kmax, rc_floor = tl.load(prm_ptr + 2), tl.load(prm_ptr + 3), tl.load(prm_ptr + 4)
    if HAS_LOGITS:
        lidx, lval, near_by = _near_loads(lidx_ptr, lval_ptr, fprm_ptr, rows, T, BLOCK_R)
    # The query's loads (and EARLY, DeviceCache(early_reads=True), the commit's policy reads beside
    # them), then the arithmetic that needs none of them: rule's decay clock, the near-miss set.
    valid, bad_i, key, slot, raw_a, raw_b = _query_loads(ids_ptr, slot_of_ptr, layer, num_experts, n_ids, kst_ptr,
                                                         sst_ptr, gst_ptr, num_keys, BLOCK_Q, POLICY, EARLY)
    if POLICY == 1:
        dc_now = _decay_clock(tok, num_layers, layer, rc_div)
    if HAS_LOGITS:
        rkey, near = _near(lidx, lval, near_by, layer, num_experts, rows, T, k, BLOCK_R)
    else:
        rkey = tl.zeros([BLOCK_R], dtype=tl.int64)
        near = rkey != 0
    early_a, early_b = raw_a, raw_b
    if EARLY and POLICY == 1:  # each key's lc after this call's use (its growth table's load follows at once)
        early_a = _rule_grown(raw_a, raw_b, dc_now, rc_floor, prm_ptr, valid, TABLE)
    first, hit, fmiss, n, m, bad = _query_tally(valid, bad_i, key, slot, BLOCK_Q)
    filled = tl.minimum(missed, num_slots)
    ne = tl.minimum(m, num_slots - filled)
    ok = (bad == 0) & (n <= num_slots)
    if ok & (m == 0):
        # Every key of the call is resident: no program scores, arrives or waits, and program 0
        # commits at once (such a call leaves slot_of and key_of, the only state any program's
        # query reads, as they were). Its commit is compiled apart, without the miss path, and
        # laid out first, so a call that hits runs a short straight stretch of the kernel.
        if pid == 0:
            _commit(n_ids, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr,
                    cand_ptr, out_ptr, plan_ptr, count_ptr, counters_ptr, clock_ptr, valid,
                    key, first, slot, hit, fmiss, 0, n, m, ne, filled, rkey, near, step,
                    tok, dc_now, layer, num_layers, num_slots, num_keys, mine, 0, early_a, early_b, rc_floor, POLICY,
                    HAS_LOGITS, EARLY, BLOCK_Q, SEQ_MAX, LEAN, TABLE, mir_ptr, MIRROR, True)
    else:
        _ensure_misses(pid, ids_ptr, slot_of_ptr, key_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, clock_ptr,
                       counters_ptr, missed_ptr, out_ptr, plan_ptr, count_ptr, cand_ptr, arrive_ptr,
                       status_ptr, mir_ptr, layer, num_experts, num_layers, num_slots, n_ids, valid, key,
                       first, slot, hit, fmiss, n, m, bad, ok, ne, filled, missed, mine, rkey, near,
                       step, tok, dc_now, rc_beta, rc_w, rc_kmax, rc_floor, num_keys, early_a, early_b, POLICY,
                       HAS_LOGITS, CHUNK, BLOCK_Q, BLOCK_C, SINGLE, SEQ_MAX, LEAN, EARLY, TABLE, MIRROR, LATE_RANKS,
                       NARROW)


@triton.jit
def _ensure_misses(pid, ids_ptr, slot_of_ptr, key_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr, clock_ptr,
                   counters_ptr, missed_ptr, out_ptr, plan_ptr, count_ptr, cand_ptr, arrive_ptr,
                   status_ptr, mir_ptr, layer, num_experts, num_layers, num_slots, n_ids, valid, key,
                   first, slot, hit, fmiss, n, m, bad, ok, ne, filled, missed, mine, rkey, near,
                   step, tok, dc_now, rc_beta, rc_w, rc_kmax, rc_floor, num_keys, early_a, early_b,
                   POLICY: tl.constexpr,
                   HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_C: tl.constexpr, SINGLE: tl.constexpr, SEQ_MAX: tl.constexpr, LEAN: tl.constexpr,
                   EARLY: tl.constexpr, TABLE: tl.constexpr, MIRROR: tl.constexpr,
                   LATE_RANKS: tl.constexpr = False, NARROW: tl.constexpr = False):
    """A call with misses, or a refused one: scoring where victims are needed, the arrival, the
    merge and the commit (or the refusal's status)."""
    # the miss ranks: reduced here, or (LATE_RANKS) by the scoring, right behind its loads
    if not LATE_RANKS:
        mrank = _miss_rank(key, fmiss)
    best = tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64)
    if ok & (m > ne):
        best, late = _chunk_candidates(pid, m - ne, ids_ptr, slot_of_ptr, n_ids, key_of_ptr, kst_ptr,
                                       sst_ptr, rc_beta, rc_w, rc_kmax, rc_floor, cand_ptr, rkey, near, layer, tok,
                                       dc_now, num_layers, num_experts, num_slots, num_keys, slot, hit, step,
                                       filled, mir_ptr, key, fmiss, POLICY,
                                       HAS_LOGITS, CHUNK, BLOCK_Q, SEQ_MAX, not SINGLE, LEAN, MIRROR, LATE_RANKS,
                                       NARROW)
    else:
        late = _ranks_if(key, fmiss, LATE_RANKS)
    if LATE_RANKS:
        mrank = late
    tl.debug_barrier()
    # A refused call changes nothing, so every program, however late it reads the maps, finds the
    # same refusal: program 0 records it at once and no one arrives. Any other call: every program
    # arrives; the last one commits.
    if SINGLE:
        commits = pid == 0  # one program: nothing to wait for
    elif ~ok:
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
                    best = _merge(cand_ptr, tl.num_programs(0), m - ne, BLOCK_Q, BLOCK_C, SEQ_MAX)
                tl.debug_barrier()
            _commit(n_ids, key_of_ptr, slot_of_ptr, kst_ptr, sst_ptr, gst_ptr, prm_ptr,
                    cand_ptr, out_ptr, plan_ptr, count_ptr, counters_ptr, clock_ptr, valid,
                    key, first, slot, hit, fmiss, mrank, n, m, ne, filled, rkey, near, step,
                    tok, dc_now, layer, num_layers, num_slots, num_keys, mine, best, early_a, early_b, rc_floor,
                    POLICY,
                    HAS_LOGITS, EARLY, BLOCK_Q, SEQ_MAX, LEAN, TABLE, mir_ptr, MIRROR)
            tl.store(missed_ptr, missed + m)
        else:
            tl.store(status_ptr, tl.where(bad > 0, 1, 2))
