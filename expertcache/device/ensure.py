"""Device ensure: the ensure contract as one Triton launch, CUDA-graph capturable.

    ids [Q] int32 (rows * k, -1 = padding) + the slot map and policy state on the device
      every program: query (distinct keys ascending, hits, misses m, empty slots), and beside its
        loads the commit's policy reads (policies._early_reads)
      if m > empty slots, every program scores its CHUNK of slots (pinned ones excluded; the
        per-policy scoring is in policies.py) and finds its BLOCK_Q lowest packed keys
        (score << SLOT_BITS | slot; victims.py)
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

The kernel takes the cache's tensors as one tuple argument (CacheTensors) and the call's as
another (CallTensors); each field is its own kernel parameter, so the kernel reads them as it
would separate arguments, with no load of a pointer first. The loads that need no query (clock,
counters, the filled count, rule's constants, the router logits) are issued first, then the
query's, then the arithmetic that needs none of them, so their round trips overlap.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from expertcache.device.policies import (
    POLICY_LFUDA,
    POLICY_LRU,
    POLICY_RULE,
    _decay_clock,
    _early_reads,
    _keyed_scores,
    _late_ranks,
    _lru_scores,
    _mirror_refresh,
    _miss_priority,
    _miss_rank,
    _near,
    _near_loads,
    _priority_rank,
    _rule_constants,
    _rule_grown,
    _rule_mirror_scores,
    _touch_lfuda,
    _touch_rule,
)
from expertcache.device.victims import _lowest, _merge, _victims

SEQ_MAX = 16  # up to this many victims by successive minima, more by a sort (k <= 16: none is compiled)
SLOT_BITS = 20  # packed key = score * 2**20 + slot: slots < 2**20, |score| < 2**43
MAX_SLOTS = 1 << SLOT_BITS
ST_BAD_ID, ST_TOO_MANY = 1, 2  # status codes
# The scalars that change between calls or pools: specialising on them would compile a kernel per value.
JIT_OPTIONS = {"do_not_specialize": ["layer", "num_experts", "num_layers", "num_slots", "n_ids", "k", "rows", "T"]}


class CacheTensors(NamedTuple):
    """One DeviceCache's tensors, as ensure_kernel's `cache` argument."""

    slot_of: object  # int32 [L * E]: slot of each key, -1 = absent
    key_of: object  # int32 [S]: key in each slot, -1 = empty (always a suffix)
    kst: object  # int64 [NK, L * E] (markov: int32): per-key policy state
    sst: object  # int64 [NS, S]: per-slot policy state
    gst: object  # int64 [NG]: policy-wide state
    mirror: object  # int64 [2, S] (rule with MIRROR): per slot its key's lt | layer << LT_BITS (PINNED
    # while a scoring call holds it as a hit) and lc + dct; else [1], unread
    prm: object  # int64 [P]: integer policy constants (Policy.params)
    fprm: object  # float32 [F]: float policy constants (Policy.fparams)
    clock: object  # int64 [2]: step, tok
    counters: object  # int64 [L, 3]: calls, accesses, misses per layer
    missed: object  # int64 [1]: every layer's copied misses so far (with a split, counters[:, 2] less served);
    # min(it, S) slots are filled
    status: object  # int32 [1]: 0, or the code of the last refused call
    arrive: object  # int32 [1]: scratch: programs arrived (zero between calls)
    split: object  # int32 [SPLIT_LEN] (SPLIT): the miss split's copies[m]; else [1], unread
    served: object  # int64 [L] (SPLIT): misses served on the CPU per layer; else [1], unread


class CallTensors(NamedTuple):
    """One call's tensors, as ensure_kernel's `io` argument."""

    ids: object  # int32 [n_ids]: routed expert ids of this call (rows * k), -1 = padding
    lidx: object  # int32 [rows * T]: top-T router logit expert ids (read if HAS_LOGITS)
    lval: object  # float32 [rows * T]: their logits
    slots: object  # int32 [n_ids]: out: slot of each id, -1 for padding
    plan: object  # int32 [BLOCK_Q, 2]: out: (key, slot) per miss, ascending key
    count: object  # int32 [1]: out: misses of this call = rows of the plan in use
    cand: object  # int64 [BLOCK_C]: scratch: candidates per program, then merged


# Triton's type of each runtime argument of ensure_kernel, for compiles without a GPU (compile_for_sm)
KERNEL_TYPES = (CacheTensors("*i32", "*i32", "*i64", "*i64", "*i64", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64",
                             "*i32", "*i32", "*i32", "*i64"),
                CallTensors("*i32", "*i32", "*fp32", "*i32", "*i32", "*i32", "*i64")) + ("i32",) * 8


class Dims(NamedTuple):
    """The call's layer and ids, and the pool's sizes (kernel scalars)."""

    layer: object
    n_ids: object
    num_experts: object
    num_layers: object
    num_slots: object
    num_keys: object


class Now(NamedTuple):
    """This call's clocks: step, tok, and rule's decay clock DC(now) (0 for the other policies)."""

    step: object
    tok: object
    dc_now: object


class Query(NamedTuple):
    """Per query position [BLOCK_Q]: a valid id, its key, its first occurrence, its slot before the
    call, first occurrences that hit / miss and are copied (every miss without a split), and the
    positions whose miss the split serves on the CPU."""

    valid: object
    key: object
    first: object
    slot: object
    hit: object
    fmiss: object
    served: object


class Tally(NamedTuple):
    """The call's distinct keys n, copied misses m (every miss without a split), copies into empty
    slots ne, filled slots before it, and every miss (copied or served)."""

    n: object
    m: object
    ne: object
    filled: object
    misses: object


@triton.jit(**JIT_OPTIONS)
def ensure_kernel(
    cache,  # CacheTensors: the slot map, policy state and constants, clock, counters, status
    io,  # CallTensors: this call's ids and router logits, its outputs and scratch
    layer,  # this call's MoE layer
    num_experts, num_layers, num_slots, n_ids,
    k,  # routed experts per row (the k of the k-th logit)
    rows, T,  # logit rows and entries per row
    POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SINGLE: tl.constexpr, SEQ_MAX: tl.constexpr,
    MIRROR: tl.constexpr,  # rule scores from its per-slot mirror (DeviceCache.launch.mirror)
    NARROW: tl.constexpr,  # rule's score in int32 (DeviceCache.launch.narrow)
    GDC: tl.constexpr = False,  # launched programmatically: wait for the predecessor, then free the next
    SPLIT: tl.constexpr = False,  # a miss split (cache.split): some misses served on the CPU, not copied
    FILL: tl.constexpr = False,  # with SPLIT: empty slots take every miss they can first (MissSplit.fills)
):
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    g = Dims(layer, n_ids, num_experts, num_layers, num_slots, num_layers * num_experts)
    # The loads that do not depend on the query first (Triton keeps their order), so their round
    # trips overlap the query's dependent pair of loads instead of following its reductions.
    step = tl.load(cache.clock) + 1
    tok = tl.load(cache.clock + 1) + tl.where(layer == 0, 1, 0).to(tl.int64)
    missed = tl.load(cache.missed)  # one word, whatever the layer count (the commit adds this call's m)
    j4 = tl.arange(0, 4)
    mine = tl.load(cache.counters + layer * 3 + j4, mask=j4 < 3, other=0)
    rc = _rule_constants(cache.prm, POLICY)
    if HAS_LOGITS:
        lidx, lval, near_by = _near_loads(io, cache.fprm, rows, T, BLOCK_R)
    # The query's loads and the commit's policy reads beside them, then the arithmetic that needs
    # none of them: rule's decay clock, the near-miss set.
    valid, bad_i, key, slot = _query_loads(io.ids, cache.slot_of, g, BLOCK_Q)
    raw_a, raw_b = _early_reads(cache, key, slot, valid, g.num_keys, POLICY)
    dc_now = 0
    if POLICY == POLICY_RULE:
        dc_now = _decay_clock(tok, num_layers, layer, rc.div)
    now = Now(step, tok, dc_now)
    if HAS_LOGITS:
        nearset = _near(lidx, lval, near_by, layer, num_experts, rows, T, k, BLOCK_R)
    else:
        rkey = tl.zeros([BLOCK_R], dtype=tl.int64)
        nearset = (rkey, rkey != 0)
    early_a = raw_a
    if POLICY == POLICY_RULE:  # each key's lc after this call's use (its growth table's load follows at once)
        early_a = _rule_grown(raw_a, raw_b, now, rc, cache.prm, valid)
    first, hit, fmiss, n, m, bad = _query_tally(valid, bad_i, key, slot, BLOCK_Q)
    served = valid & (valid == 0)
    c = m
    filled = tl.minimum(missed, num_slots)
    if SPLIT:  # the copies[m] misses of highest priority are copied, the others served on the CPU
        c = tl.load(cache.split + m)
        if FILL:  # hybrid: every miss an empty slot takes without evicting is copied (a pool still filling)
            c = tl.maximum(c, tl.minimum(m, num_slots - filled))
        if c < m:
            prio = _miss_priority(cache, key, valid, nearset, now, g, rc, POLICY, HAS_LOGITS, NARROW)
            rank = _priority_rank(prio, key, fmiss)
            served = valid & (slot < 0) & (rank >= c)
            fmiss = fmiss & (rank < c)
    q = Query(valid, key, first, slot, hit, fmiss, served)
    t = Tally(n, c, tl.minimum(c, num_slots - filled), filled, m)
    ok = (bad == 0) & (n <= num_slots)
    if ok & (m == 0):
        # Every key of the call is resident: no program scores, arrives or waits, and program 0
        # commits at once (such a call leaves slot_of and key_of, the only state any program's
        # query reads, as they were). Its commit is compiled apart, without the miss path, and
        # laid out first, so a call that hits runs a short straight stretch of the kernel.
        if pid == 0:
            _commit(cache, io, q, t, 0, 0, mine, nearset, now, g, (early_a, raw_b), POLICY, HAS_LOGITS,
                    BLOCK_Q, SEQ_MAX, MIRROR, True, False)
    else:
        _ensure_misses(pid, cache, io, q, t, bad, ok, missed, mine, nearset, now, g, rc, (early_a, raw_b),
                       POLICY, HAS_LOGITS, CHUNK, BLOCK_Q, BLOCK_C, SINGLE, SEQ_MAX, MIRROR, NARROW, SPLIT)


@triton.jit
def _query_loads(ids_ptr, slot_of_ptr, g, BLOCK_Q: tl.constexpr):
    """The query's loads: per position its id's key and the key's slot before the call, and which
    positions are valid ids and which are bad ones (outside [-1, E))."""
    i = tl.arange(0, BLOCK_Q)
    im = i < g.n_ids
    e = tl.load(ids_ptr + i, mask=im, other=-1)
    bad_i = im & ((e < -1) | (e >= g.num_experts))
    valid = im & (e >= 0) & (e < g.num_experts)
    key = tl.where(valid, g.layer * g.num_experts + e, 0)  # int32: keys < 2**31 (L * E)
    slot = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    return valid, bad_i, key, slot


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
def _ensure_misses(pid, cache, io, q, t, bad, ok, missed, mine, nearset, now, g, rc, early,
                   POLICY: tl.constexpr, HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_C: tl.constexpr, SINGLE: tl.constexpr, SEQ_MAX: tl.constexpr, MIRROR: tl.constexpr,
                   NARROW: tl.constexpr, SPLIT: tl.constexpr):
    """A call with misses, or a refused one: scoring where victims are needed, the arrival, the
    merge and the commit (or the refusal's status)."""
    if POLICY != POLICY_RULE:  # lru, lfuda: the miss ranks here; rule's behind its scoring loads
        mrank = _miss_rank(q.key, q.fmiss)
    best = tl.full([BLOCK_Q], 0x7FFFFFFFFFFFFFFF, tl.int64)
    if ok & (t.m > t.ne):
        best, late = _chunk_candidates(pid, t.m - t.ne, cache, io, q, nearset, now, g, rc, t.filled, POLICY,
                                       HAS_LOGITS, CHUNK, BLOCK_Q, SEQ_MAX, not SINGLE, MIRROR, NARROW)
    else:
        late = _late_ranks(q, POLICY)
    if POLICY == POLICY_RULE:
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
        commits = tl.atomic_add(cache.arrive, 1) == tl.num_programs(0) - 1
        if commits:
            tl.store(cache.arrive, 0)
    if commits:
        tl.debug_barrier()
        if ok:
            if t.m > t.ne:
                if not SINGLE:
                    best = _merge(io.cand, tl.num_programs(0), t.m - t.ne, BLOCK_Q, BLOCK_C, SEQ_MAX)
                tl.debug_barrier()
            _commit(cache, io, q, t, mrank, best, mine, nearset, now, g, early, POLICY, HAS_LOGITS, BLOCK_Q,
                    SEQ_MAX, MIRROR, False, SPLIT)
            tl.store(cache.missed, missed + t.m)
        else:
            tl.store(cache.status, tl.where(bad > 0, 1, 2))


@triton.jit
def _chunk_candidates(pid, need, cache, io, q, nearset, now, g, rc, filled, POLICY: tl.constexpr,
                      HAS_LOGITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr,
                      SEQ_MAX: tl.constexpr, STORE_SEQ: tl.constexpr, MIRROR: tl.constexpr,
                      NARROW: tl.constexpr):
    """Score this program's slots; return its BLOCK_Q lowest packed keys (successive minima), kept
    in scratch for the merge (STORE_SEQ, or a sort: see victims._lowest), and rule's miss
    ranks (reduced right after its scoring loads are issued; zeros for the others)."""
    c = pid * CHUNK + tl.arange(0, CHUNK)
    if POLICY == POLICY_LRU:
        ev, score = _lru_scores(c, filled, cache, q, now.step)
        mrank = tl.zeros_like(q.key)
    elif MIRROR:
        ev, score, mrank = _rule_mirror_scores(c, filled, cache, q, nearset, g, now, rc, HAS_LOGITS, NARROW)
    else:
        ev, score, mrank = _keyed_scores(c, cache, io.ids, q, nearset, g, now, rc, POLICY, HAS_LOGITS,
                                         BLOCK_Q, NARROW)
    packed = tl.where(ev, (score.to(tl.int64) << 20) | c.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    return _lowest(packed, need, io.cand + pid * BLOCK_Q, CHUNK, BLOCK_Q, SEQ_MAX, STORE_SEQ), mrank


@triton.jit
def _commit(cache, io, q, t, mrank, best, mine, nearset, now, g, early, POLICY: tl.constexpr,
            HAS_LOGITS: tl.constexpr, BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr, MIRROR: tl.constexpr,
            HITS_ONLY: tl.constexpr, SPLIT: tl.constexpr):
    """Apply one call: refresh, evictions and installs in ascending key order, touches, plan,
    slots, counters and clock. Runs in one program. early: the policy reads of the launch's start
    (rule: the lc each use leaves, lfuda: the hits' counts and the age). HITS_ONLY: the call has no
    miss (m == 0): only the refresh, touches, slots, count, counters and clock are compiled."""
    if POLICY == POLICY_RULE:
        if HAS_LOGITS:
            rkey, near = nearset
            lt = tl.load(cache.kst + rkey, mask=near, other=0)
            if MIRROR:  # the resident near keys' mirrored lt too, at their slots before this call
                _mirror_refresh(cache.slot_of, cache.mirror, nearset, now.tok, g.layer, q, False)
            tl.store(cache.kst + rkey, tl.maximum(lt, now.tok - 1), mask=near)
            tl.debug_barrier()
    if HITS_ONLY:  # every valid position is a hit: its slot stays, nothing is evicted or installed
        sl = q.slot
        evict = q.fmiss
        vscore = tl.zeros([BLOCK_Q], dtype=tl.int64)
    else:
        sl, evict, vscore = _evict_install(cache, io, q, t, mrank, best, BLOCK_Q, SEQ_MAX)
    if POLICY == POLICY_LRU:
        tl.store(cache.sst + sl, now.step + 0 * sl, mask=q.first & ~q.served)
    elif POLICY == POLICY_LFUDA:
        _touch_lfuda(cache, q, sl, evict, vscore, g.num_slots, early[0], early[1])
    elif POLICY == POLICY_RULE:
        _touch_rule(cache, q, sl, now, g, early[0], MIRROR)
    # markov: no touch (its learning step is markov.py's launch, before this one)
    i = tl.arange(0, BLOCK_Q)
    tl.store(io.slots + i, tl.where(q.valid, tl.where(q.served, -2, sl), -1).to(tl.int32), mask=i < g.n_ids)
    tl.store(io.count, t.m)
    # `mine` [4]: this layer's counters, read at the start of the launch (no round trip here)
    j = tl.arange(0, 4)
    tl.store(cache.counters + g.layer * 3 + j, mine + tl.where(j == 0, 1, tl.where(j == 1, t.n, t.misses)),
             mask=j < 3)
    if SPLIT:
        tl.store(cache.served + g.layer, tl.load(cache.served + g.layer) + (t.misses - t.m))
    tl.store(cache.clock, now.step)
    tl.store(cache.clock + 1, now.tok)


@triton.jit
def _evict_install(cache, io, q, t, mrank, best, BLOCK_Q: tl.constexpr, SEQ_MAX: tl.constexpr):
    """The misses' slots: the first ne (by key) into the empty slots [filled, filled + ne), the rest
    into the victims in ascending packed order; the victims' old keys leave slot_of, the plan gets
    (key, slot) at each miss's rank. A commit that evicts nothing gathers no victim and loads no old
    owner. Returns each position's slot after the call, whether it evicts, and its victim's score."""
    miss = q.valid & (q.slot < 0) & ~q.served
    from_cand = miss & (mrank >= t.ne)
    r = tl.where(from_cand, mrank - t.ne, 0)
    evicts = t.m > t.ne
    cand = tl.zeros([BLOCK_Q], dtype=tl.int64)
    if evicts:
        cand = _victims(best, io.cand, r, from_cand, t.m - t.ne, BLOCK_Q, SEQ_MAX)
    vslot = tl.where(from_cand, cand & ((1 << 20) - 1), t.filled + mrank)
    vscore = cand >> 20
    evict = q.fmiss & from_cand
    old = tl.full([BLOCK_Q], -1, tl.int32)
    if evicts:
        old = tl.load(cache.key_of + vslot, mask=evict, other=-1)
        tl.debug_barrier()  # every old owner read before any slot is rewritten
    tl.store(cache.slot_of + old, -1, mask=evict & (old >= 0))
    tl.store(cache.key_of + vslot, q.key.to(tl.int32), mask=q.fmiss)
    tl.store(cache.slot_of + q.key, vslot.to(tl.int32), mask=q.fmiss)
    tl.store(io.plan + 2 * mrank, q.key.to(tl.int32), mask=q.fmiss)
    tl.store(io.plan + 2 * mrank + 1, vslot.to(tl.int32), mask=q.fmiss)
    return tl.where(q.slot >= 0, q.slot, vslot), evict, vscore
