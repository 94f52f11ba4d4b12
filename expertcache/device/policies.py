"""The per-policy pieces of the device ensure (expertcache.device.ensure), as Triton device functions.

    scoring, per program over its CHUNK of slots (a call that needs victims):
      lru     the stamps of the filled prefix [0, filled); the hits' stamps are raised to the call's
              step first, so no hit is among the lowest (no key_of, no pinned test)
      rule    with its mirror (at most MIRROR_MAX_LAYERS layers): two coalesced words per filled
              slot, lt | layer << LT_BITS and lc + dct; the hits pinned by PINNED over the first word
      lfuda   through key_of: each slot's priority, the hits pinned by one compare per query position
      rule    past MIRROR_MAX_LAYERS layers: through key_of too, from each slot's key's per-key rows
    early reads, at the start of the launch beside the query's loads (only the committing program
      writes them): rule's lc and dct (and from them the lc each use leaves), lfuda's hit counts and age
    touch, in the commit: lru's stamp; lfuda's count, priority and age; rule's lt, lc, dct (and mirror)
    near-miss refresh (rule, with router logits): lt = max(lt, tok - 1) of every near key

rule's score is computed in int32 where Rule.int32_scores holds for its constants (the same values,
fewer instructions per slot), else in int64. The state layouts are the policies' own
(expertcache.policies); the kernel passes them as the tensors of ensure.CacheTensors.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from expertcache.policies.base import PolicyKind
from expertcache.policies.markov import P_BETA_Q
from expertcache.split import HASH_GOLDEN as _GOLDEN
from expertcache.split import HASH_MIX as _MIX
from expertcache.split import HASH_STEP as _STEP

# The kernel's POLICY constexpr is Policy.kind (PolicyKind), the numbering the host and the replay use.
POLICY_LRU, POLICY_RULE = tl.constexpr(int(PolicyKind.LRU)), tl.constexpr(int(PolicyKind.RULE))
POLICY_LFUDA, POLICY_MARKOV = tl.constexpr(int(PolicyKind.LFUDA)), tl.constexpr(int(PolicyKind.MARKOV))
# rule's mirror, row 0 per slot: lt | layer << LT_BITS (at most MIRROR_MAX_LAYERS layers, lt < 2**56), or PINNED
# while the call being scored holds the slot's key as a hit (the call's commit rewrites the word)
LT_BITS = tl.constexpr(56)
MARKOV_BETA_Q = tl.constexpr(P_BETA_Q)  # markov's BETA_Q in the policy's params (prm)
LT_MASK = tl.constexpr((1 << 56) - 1)
MIRROR_MAX_LAYERS = 127  # layer indices <= 126: a packed word never equals PINNED
PINNED = tl.constexpr(0x7FFFFFFFFFFFFFFF)
# rule's constants in Policy.params (expertcache.policies.rule.Rule.params): beta, w, the decay divisor,
# k_max, lc_floor, then its growth table log2(1 + 2**-i/64) in Q16 for i in [0, 1920]
RULE_TABLE = tl.constexpr(5)
# expertcache.split.hash_priority's multipliers, as 64-bit unsigned constants
HASH_GOLDEN, HASH_STEP, HASH_MIX = tl.constexpr(_GOLDEN), tl.constexpr(_STEP), tl.constexpr(_MIX)


class RuleConstants(NamedTuple):
    """rule's integer constants, loaded from Policy.params at the start of the launch (no load waits
    for them later); zeros (and divisor 1) for the other policies, which read none."""

    beta: object
    w: object
    div: object
    kmax: object
    floor: object


@triton.jit
def _rule_constants(prm_ptr, POLICY: tl.constexpr):
    """RuleConstants of POLICY: rule's five loads from prm, or the placeholders."""
    rc = RuleConstants(0, 0, 1, 0, 0)
    if POLICY == POLICY_RULE:
        beta, w = tl.load(prm_ptr), tl.load(prm_ptr + 1)
        div, kmax, floor = tl.load(prm_ptr + 2), tl.load(prm_ptr + 3), tl.load(prm_ptr + 4)
        rc = RuleConstants(beta, w, div, kmax, floor)
    return rc


@triton.jit
def _decay_clock(tok, num_layers, layer, divisor):
    """rule's decay clock DC(now), one 64-bit division per program. On sm_90 that division is a
    subroutine call that no later load is moved above, so the kernel computes it only after its
    loads are issued."""
    return ((tok * num_layers + layer) << 16) // divisor


@triton.jit
def _rule_score(lk, lt, lcd, layer, tok, dc_now, num_layers, rc, NARROW: tl.constexpr):
    """rule's score of keys of layer lk with last use lt and lc + dct = lcd (int64); rc: RuleConstants.
    NARROW (where Rule.int32_scores holds): the same values in int32. lcd - DC(now) stays 64-bit and
    is clamped by a 64-bit compare, as is tok - lt from tok = 2**31 - 1 on (below it, for the whole
    call, every lt is in [0, tok] and the difference is 32-bit); every term after them fits in int32
    (k <= K_MAX, d <= L, lcv <= LC_MAX for a resident key), so the products, shifts and sums are 32-bit."""
    lk = lk.to(tl.int32)  # a layer: the int64 mirror row's low word, so the compares are 32-bit
    later = lk > layer
    lcv = lcd - dc_now  # no division per key
    if NARROW:
        if tok < 0x7FFFFFFF:  # the whole call: every lt is in [0, tok], so its difference is 32-bit
            t32 = tok.to(tl.int32)
            k32 = tl.where(later, t32 - 1, t32) - lt.to(tl.int32)
            k32 = tl.minimum(tl.maximum(k32, 0), rc.kmax.to(tl.int32))
        else:
            kk = tl.where(later, tok - 1, tok) - lt
            k32 = tl.where(kk < 0, 0, tl.where(kk > rc.kmax, rc.kmax.to(tl.int32), kk.to(tl.int32)))
        d = tl.where(later, lk - layer, num_layers - layer + lk)
        lcv = tl.where(lcv < rc.floor, rc.floor.to(tl.int32), lcv.to(tl.int32))
        score = (((rc.w.to(tl.int32) * lcv) >> 4) - (k32 << 16) - d * rc.beta.to(tl.int32)).to(tl.int64)
    else:
        kk = tl.where(later, tok - 1, tok) - lt
        kk = tl.minimum(tl.maximum(kk, 0), rc.kmax)
        d = tl.where(later, lk - layer, num_layers - layer + lk).to(tl.int64)
        lcv = tl.maximum(lcv, rc.floor)
        score = -((kk << 16) + d * rc.beta) + ((rc.w * lcv) >> 4)
    return score


@triton.jit
def _miss_rank(key, fmiss):
    """Per position, the call's misses with a smaller key (a miss's row in the plan). Only a call
    with misses needs it: its block reduction is kept off the path of a call that hits."""
    smaller = key[None, :] < key[:, None]
    return tl.sum((smaller & fmiss[None, :]).to(tl.int32), axis=1)


@triton.jit
def _miss_priority(cache, key, valid, nearset, now, g, rc, POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr,
                   NARROW: tl.constexpr):
    """Policy.miss_priority of each query position's key (read for its misses only): rule's score as if
    resident (after the near-miss refresh, applied here to the loaded lt: idempotent, so whether another
    program has stored it yet does not matter), markov's V (set by its learning launch before this one),
    else expertcache.split.hash_priority of (key, step) in wrapping 64-bit unsigned arithmetic."""
    if POLICY == POLICY_RULE:
        lt = tl.load(cache.kst + key, mask=valid, other=0)
        if HAS_LOGITS:
            rkey, near = nearset
            hit_near = tl.sum(((key[:, None] == rkey[None, :]) & near[None, :]).to(tl.int32), axis=1) > 0
            lt = tl.where(hit_near, tl.maximum(lt, now.tok - 1), lt)
        lc = tl.load(cache.kst + g.num_keys + key, mask=valid, other=0)
        dct = tl.load(cache.kst + 2 * g.num_keys + key, mask=valid, other=-1)
        lk = key.to(tl.int32) // g.num_experts
        prio = _rule_score(lk, lt, lc + dct, g.layer, now.tok, now.dc_now, g.num_layers, rc, NARROW)
    elif POLICY == POLICY_MARKOV:
        prio = tl.load(cache.kst + key, mask=valid, other=0).to(tl.int64)
    else:
        x = (key.to(tl.uint64) + 1) * HASH_GOLDEN + now.step.to(tl.uint64) * HASH_STEP
        x = x ^ (x >> 31)
        x = x * HASH_MIX
        x = x ^ (x >> 29)
        prio = (x >> 34).to(tl.int64)
    return prio


@triton.jit
def _priority_rank(prio, key, fmiss):
    """Per position, the call's first misses ahead of its key by (priority descending, key ascending):
    the split copies the misses of rank below copies[m]."""
    ahead = (prio[None, :] > prio[:, None]) | ((prio[None, :] == prio[:, None]) & (key[None, :] < key[:, None]))
    return tl.sum((ahead & fmiss[None, :]).to(tl.int32), axis=1)


@triton.jit
def _late_ranks(q, POLICY: tl.constexpr):
    """rule's miss ranks, reduced right after its scoring loads are issued, while they are in flight
    (or, in a call that does not score, there instead); zeros for lru and lfuda, whose ranks are
    reduced before the scoring."""
    if POLICY == POLICY_RULE:
        return _miss_rank(q.key, q.fmiss)
    return tl.zeros_like(q.key)


@triton.jit
def _mirror_refresh(slot_of_ptr, mir_ptr, nearset, tok, layer, q, SKIP_HITS: tl.constexpr):
    """The near-miss refresh of the resident near keys' mirrored lt, at their slots: row 0 holds
    lt | layer << LT_BITS and the near keys are this layer's, so the max of the packed words is the
    max of lt (a PINNED word stays). SKIP_HITS: not at the call's hit slots, so a scoring program
    never rewrites a pin that another program stamped there."""
    rkey, near = nearset
    rs = tl.load(slot_of_ptr + rkey, mask=near, other=-1)
    nm = near & (rs >= 0)
    if SKIP_HITS:
        pinned = tl.sum(((rs[:, None] == q.slot[None, :]) & q.hit[None, :]).to(tl.int32), axis=1) > 0
        nm = nm & ~pinned
    lt = tl.load(mir_ptr + rs, mask=nm, other=0)
    tl.store(mir_ptr + rs, tl.maximum(lt, (tok - 1) | (layer.to(tl.int64) << LT_BITS)), mask=nm)


@triton.jit
def _lru_scores(c, filled, cache, q, step):
    """lru: the filled slots are the prefix [0, filled) (no key_of load), and the hits' stamps are
    raised to this call's step first (every scoring program and the commit write the same). Every
    other filled slot has an older stamp and at least `need` of them exist (n <= S), so no hit is
    ever among the `need` lowest: no pinned test. Returns (evictable, score)."""
    tl.store(cache.sst + q.slot, step + 0 * q.slot, mask=q.hit)
    tl.debug_barrier()
    ev = c < filled
    return ev, tl.load(cache.sst + c, mask=ev, other=0)


@triton.jit
def _rule_mirror_scores(c, filled, cache, q, nearset, g, now, rc, HAS_LOGITS: tl.constexpr,
                        NARROW: tl.constexpr):
    """rule with its per-slot mirror: every input of a slot's score is one of two coalesced loads of
    the filled prefix [0, filled) (no key_of, no gather through keys, no division), and the hits are
    pinned by PINNED written over their row 0, one compare per slot instead of one per query position
    (the commit's touch rewrites those words). Every scoring program writes the same pins and the
    same near-miss refresh (the commit repeats the refresh; here it skips the hits' slots, so no
    program overwrites a pin), then its barrier. Returns (evictable, score, the late miss ranks)."""
    tl.store(cache.mirror + q.slot, PINNED + 0 * q.slot.to(tl.int64), mask=q.hit)
    if HAS_LOGITS:
        _mirror_refresh(cache.slot_of, cache.mirror, nearset, now.tok, g.layer, q, True)
    tl.debug_barrier()
    fm = c < filled
    ltk = tl.load(cache.mirror + c, mask=fm, other=0)
    lcd = tl.load(cache.mirror + g.num_slots + c, mask=fm, other=0)
    mrank = _miss_rank(q.key, q.fmiss)
    ev = fm & (ltk != PINNED)
    score = _rule_score(ltk >> LT_BITS, ltk & LT_MASK, lcd, g.layer, now.tok, now.dc_now, g.num_layers, rc,
                        NARROW)
    return ev, score, mrank


@triton.jit
def _keyed_scores(c, cache, ids_ptr, q, nearset, g, now, rc, POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr,
                  BLOCK_Q: tl.constexpr, NARROW: tl.constexpr):
    """lfuda, markov, and rule past MIRROR_MAX_LAYERS layers: each slot's key from key_of, the call's
    hits pinned, and the score from the slot's priority (lfuda) or its key's per-key rows (markov's V
    and layer distance, rule). Returns
    (evictable, score, the late miss ranks)."""
    cm = c < g.num_slots
    key = tl.load(cache.key_of + c, mask=cm, other=-1).to(tl.int64)
    # pinned: the call's hits. Their slots are re-read as scalars (the query's own loads, so L1
    # hits; no program writes slot_of before every program has scored), one compare per slot
    # each: no [CHUNK, BLOCK_Q] matrix in registers.
    pinned = c < 0
    for i in tl.static_range(BLOCK_Q):
        e = tl.load(ids_ptr + i, mask=i < g.n_ids, other=-1)
        live = (e >= 0) & (e < g.num_experts)
        s_i = tl.load(cache.slot_of + g.layer * g.num_experts + tl.where(live, e, 0), mask=live, other=-1)
        pinned = pinned | (c == s_i)
    ev = cm & (key >= 0) & (~pinned)
    if POLICY == POLICY_LFUDA:
        # loaded beside key_of (masked by cm, not by ev, so the two loads are independent and overlap)
        score = tl.load(cache.sst + g.num_slots + c, mask=cm, other=0)
        mrank = tl.zeros_like(q.key)
    elif POLICY == POLICY_MARKOV:
        # V (row 0 of the key's state, written by markov.py's launch before this one) less the
        # distance to the key's layer times BETA_Q
        kq = tl.where(ev, key, 0)
        v = tl.load(cache.kst + kq, mask=ev, other=0).to(tl.int64)  # markov's key rows are int32
        lk = kq.to(tl.int32) // g.num_experts
        d = tl.where(lk > g.layer, lk - g.layer, g.num_layers - g.layer + lk).to(tl.int64)
        score = v - d * tl.load(cache.prm + MARKOV_BETA_Q)
        mrank = tl.zeros_like(q.key)
    else:
        kq = tl.where(ev, key, 0)
        # lc and dct first: the refresh below rewrites only the lt row, so these two gathers
        # need not wait for its barrier
        lc = tl.load(cache.kst + g.num_keys + kq, mask=ev, other=0)
        dct = tl.load(cache.kst + 2 * g.num_keys + kq, mask=ev, other=0)
        if HAS_LOGITS:
            # the near-miss refresh first, in memory: every scoring program writes the same
            # values (the commit's own refresh repeats them), so each reads refreshed `lt` below
            # after its barrier, and no [CHUNK, BLOCK_R] match matrix is held in registers
            rkey, near = nearset
            lt_r = tl.load(cache.kst + rkey, mask=near, other=0)
            tl.store(cache.kst + rkey, tl.maximum(lt_r, now.tok - 1), mask=near)
            tl.debug_barrier()
        lt = tl.load(cache.kst + kq, mask=ev, other=0)
        mrank = _miss_rank(q.key, q.fmiss)
        lk = kq.to(tl.int32) // g.num_experts  # keys < 2**31: a 32-bit division
        score = _rule_score(lk, lt, lc + dct, g.layer, now.tok, now.dc_now, g.num_layers, rc, NARROW)
    return ev, score, mrank


@triton.jit
def _early_reads(cache, key, slot, valid, num_keys, POLICY: tl.constexpr):
    """What the commit's policy update reads, for every valid position (a repeated key reads what its
    first occurrence reads): rule's lc and dct of each key (dct < 0: never used), lfuda's hit counts
    (at the hits' slots) and its age; lru: nothing. Only the committing program writes them, so they
    are read at the start of the launch, beside the query's loads."""
    a, b = 0, 0
    if POLICY == POLICY_RULE:
        a = tl.load(cache.kst + num_keys + key, mask=valid, other=0)
        b = tl.load(cache.kst + 2 * num_keys + key, mask=valid, other=-1)
    elif POLICY == POLICY_LFUDA:
        a, b = tl.load(cache.sst + slot, mask=valid & (slot >= 0), other=0), tl.load(cache.gst)
    return a, b


@triton.jit
def _rule_grown(lc, dct, now, rc, prm_ptr, valid):
    """rule's lc of keys used now, from their lc and dct before (dct < 0: never used: 0); the growth
    term log2(1 + 2**-i/64) from the policy's table (prm[RULE_TABLE:], an L2 hit)."""
    x = tl.maximum(lc - (now.dc_now - tl.maximum(dct, 0)), rc.floor)
    ti = tl.minimum(tl.abs(x) >> 10, 1920)
    grown = tl.maximum(x, 0) + tl.load(prm_ptr + RULE_TABLE + ti, mask=valid, other=0)
    return tl.where(dct < 0, 0, grown)


@triton.jit
def _touch_rule(cache, q, sl, now, g, lc_new, MIRROR: tl.constexpr):
    """rule's use of every key of the call (hits and installs alike); lc_new: the keys' lc after it
    (_rule_grown, computed at the start of the launch: only the committing program writes lc and
    dct). MIRROR: also at each key's slot after this call (sl), lt | layer << LT_BITS and lc + dct."""
    key, first = q.key, q.first
    tl.store(cache.kst + g.num_keys + key, lc_new, mask=first)
    tl.store(cache.kst + 2 * g.num_keys + key, now.dc_now + 0 * key, mask=first)
    tl.store(cache.kst + key, now.tok + 0 * key, mask=first)
    if MIRROR:  # not for a miss served on the CPU: it has no slot
        own = first & ~q.served
        tl.store(cache.mirror + sl, (now.tok | (g.layer.to(tl.int64) << LT_BITS)) + 0 * key, mask=own)
        tl.store(cache.mirror + g.num_slots + sl, lc_new + now.dc_now, mask=own)


@triton.jit
def _touch_lfuda(cache, q, sl, evict, vscore, num_slots, hit_freq, age):
    """lfuda: hits count up at the age before the call; an install starts at 1 at the age raised by
    its own victim (victims ascend, so that is max(age, its score)). hit_freq, age: the hits' counts
    and the age as read at the start of the launch (only the committing program writes them)."""
    freq = tl.where(q.hit, hit_freq + 1, 1)
    base = tl.where(evict, tl.maximum(age, vscore), age)
    own = q.first & ~q.served  # a miss served on the CPU has no slot
    tl.store(cache.sst + sl, freq, mask=own)
    tl.store(cache.sst + num_slots + sl, tl.where(q.hit, age, base) + freq, mask=own)
    tl.store(cache.gst, tl.maximum(age, tl.max(tl.where(evict, vscore, age), axis=0)))


@triton.jit
def _near_loads(io, fprm_ptr, rows, T, BLOCK_R: tl.constexpr):
    """The near-miss set's loads (router logit ids and values, and rule's NEAR), issued at the start
    of the launch; _near works on them once the query's loads are out too."""
    r = tl.arange(0, BLOCK_R)
    rm = r < rows * T
    idx = tl.load(io.lidx + r, mask=rm, other=-1)
    val = tl.load(io.lval + r, mask=rm, other=0.0)
    return idx, val, tl.load(fprm_ptr)


@triton.jit
def _near(idx, val, near_by, layer, num_experts, rows, T, k, BLOCK_R: tl.constexpr):
    """Near-miss refresh set (key, near) per logit entry: its key, and whether its logit is within
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
