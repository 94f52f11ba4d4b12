"""The ensure contract compiled with numba, for replaying many calls at once.

    ids [C, rows, k] int32, layers [C] -> for each call, exactly HostCache.ensure:
    query, hits, the miss split (copies[m] copied by priority, the rest served on the CPU),
    victims (empty suffix first, then lowest (score, slot)), installs, counters [L, 3],
    served [L], a miss histogram [L, Q + 1] (calls with m misses, per layer) and, when asked, each
    call's misses [C] (what a caller that combines several pools call by call needs: sim.ranks).

The state arrays are the HostCache's own (slot_of, key_of, policy state, clock,
counters), updated in place, so a replay can be interleaved with reference calls and
compared bit for bit. The policy's verbs are plain calls into its module, dispatched on
`Policy.kind`; numba compiles one specialisation per kind (see `kind_tag`) and caches it
on disk (passing the verbs as function arguments breaks numba's cache across processes).
A new policy adds its branch to the dispatch functions below. Arguments are validated by
`validate_calls` first: the kernel trusts them.

Victims come from an index (expertcache.victim_index), not a scan of the pool: per layer
a tournament tree over the resident keys' `order` (policies.base), visited across layers in
increasing lower bound of the score until no lower score can remain. Cost per call:
O(n^2) to sort n <= rows * k routed ids, O(log E) per key touched, and O(L + log E) per
candidate visited: a few per miss for the registered policies, never the whole pool.

markov's step 1 (its transition counts) is applied ahead within a batch: each call, right after its
step 4 has read its experts' rows, adds the layer's next two calls' transitions to those rows while
they are in cache (markov._ahead; the batch's later calls are known), with the same integers as
running step 1 at each call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from expertcache import split, victim_index
from expertcache.errors import EnsureError
from expertcache.geometry import CPU_SLOT, CacheGeometry, distinct_counts
from expertcache.numba_cache import drop_stale_kernels
from expertcache.policies import base, lfuda, lru, markov, oracle, rule
from expertcache.policies.base import (
    CLK_EXPERTS,
    CLK_LAYER,
    CLK_LAYERS,
    CLK_STEP,
    CLK_TOK,
    CLOCK_LEN,
    PolicyKind,
)
from expertcache.split import HASH_GOLDEN, HASH_MIX, HASH_STEP, SPLIT_LEN
from expertcache.victim_index import FREE, ix_best, ix_fill, ix_new, ix_set

# the kernels inline the policy modules, the victim index and the split's hash: recompile them when one changes
drop_stale_kernels(__file__, (lfuda, lru, markov, oracle, rule, victim_index, base, split))


@njit(cache=True)
def _sorted_distinct(q, n):
    """Insertion-sort q[:n] in place and drop duplicates; return the distinct count."""
    for i in range(1, n):
        v = q[i]
        j = i - 1
        while j >= 0 and q[j] > v:
            q[j + 1] = q[j]
            j -= 1
        q[j + 1] = v
    d = 0
    for i in range(n):
        if d == 0 or q[i] != q[d - 1]:
            q[d] = q[i]
            d += 1
    return d


@njit(cache=True)
def _call_experts(ids, c, out):
    """The distinct experts of call c (ids [C, rows, k], -1 padding), ascending, into out; their count."""
    n = 0
    for r in range(ids.shape[1]):
        for j in range(ids.shape[2]):
            if ids[c, r, j] >= 0:
                out[n] = ids[c, r, j]
                n += 1
    return _sorted_distinct(out, n)


@njit(cache=True, inline="always")
def _before(v1, s1, v2, s2):
    return v1 < v2 or (v1 == v2 and s1 < s2)


# ---- policy verbs, dispatched on Policy.kind (a new policy adds its branch here) ----------
# The kind travels as the number of dimensions of an empty array (`kind_tag`): a
# compile-time constant, so numba compiles (and caches) one kernel per kind with the other
# kinds' branches folded away, and the cache keys hold array types only.
def kind_tag(kind: int) -> np.ndarray:
    """An empty int8 array of kind + 1 dimensions."""
    return np.empty((0,) * (kind + 1), dtype=np.int8)



@njit(cache=True, inline="always")
def _touch(tag, kst, sst, gst, prm, clk, aux, key, slot, access, installed):
    kind = tag.ndim - 1
    if kind == PolicyKind.LRU:
        lru.touch(sst, clk, slot)
    elif kind == PolicyKind.RULE:
        rule.touch(kst, prm, clk, key)
    elif kind == PolicyKind.LFUDA:
        lfuda.touch(sst, gst, slot, installed)
    elif kind != PolicyKind.MARKOV:  # markov learns from the whole call (markov.observe)
        oracle.touch(kst, aux, key, access)


@njit(cache=True, inline="always")
def _hash_priority(key, step):
    """expertcache.split.hash_priority of one key."""
    x = (np.uint64(key) + np.uint64(1)) * np.uint64(HASH_GOLDEN) + np.uint64(step) * np.uint64(HASH_STEP)
    x ^= x >> np.uint64(31)
    x *= np.uint64(HASH_MIX)
    x ^= x >> np.uint64(29)
    return np.int64(x >> np.uint64(34))


@njit(cache=True, inline="always")
def _priority(tag, kst, prm, clk, aux, key, access):
    """Policy.miss_priority of one missing key (a draw per (key, step) for the policies whose state is
    per slot)."""
    kind = tag.ndim - 1
    if kind == PolicyKind.RULE:
        return rule.score(kst, prm, clk, key)
    if kind == PolicyKind.MARKOV:
        return markov.score(kst, prm, clk, key)
    if kind == PolicyKind.ORACLE:
        return -aux[access]
    return _hash_priority(key, clk[CLK_STEP])


@njit(cache=True, inline="always")
def _served(tag, kst, prm, clk, aux, key, access):
    """Policy.on_served of one missing key served on the CPU (per-key state only)."""
    kind = tag.ndim - 1
    if kind == PolicyKind.RULE:
        rule.touch(kst, prm, clk, key)
    elif kind == PolicyKind.ORACLE:
        oracle.touch(kst, aux, key, access)


@njit(cache=True)
def _split(tag, kst, prm, clk, aux, q, miss_pos, m, c, access, prio, copy_pos, served_pos):
    """The split of one call's m misses (miss_pos[:m], ascending key): the c of highest
    (priority, lower key) into copy_pos[:c], the others into served_pos[:m - c], both ascending."""
    for j in range(m):
        i = miss_pos[j]
        prio[j] = _priority(tag, kst, prm, clk, aux, q[i], access + i)
    nc = 0
    ns = 0
    for j in range(m):  # rank of miss j: misses before it in (priority desc, key asc)
        r = 0
        for t in range(m):
            if prio[t] > prio[j] or (prio[t] == prio[j] and t < j):
                r += 1
        if r < c:
            copy_pos[nc] = miss_pos[j]
            nc += 1
        else:
            served_pos[ns] = miss_pos[j]
            ns += 1
    return ns


@njit(cache=True, inline="always")
def _score(tag, kst, sst, prm, clk, key, slot):
    kind = tag.ndim - 1
    if kind == PolicyKind.LRU:
        return lru.score(sst, slot)
    if kind == PolicyKind.RULE:
        return rule.score(kst, prm, clk, key)
    if kind == PolicyKind.LFUDA:
        return lfuda.score(sst, slot)
    if kind == PolicyKind.MARKOV:
        return markov.score(kst, prm, clk, key)
    return oracle.score(kst, key)


@njit(cache=True, inline="always")
def _order(tag, kst, sst, prm, clk, key, slot):
    """The victim index's order (see policies.base): the score, except for `rule` and `markov`."""
    if tag.ndim - 1 == PolicyKind.RULE:
        return rule.order(kst, prm, key)
    if tag.ndim - 1 == PolicyKind.MARKOV:
        return markov.order(kst, key)
    return _score(tag, kst, sst, prm, clk, key, slot)


@njit(cache=True, inline="always")
def _offsets(tag, prm, clk, off):
    """Fill off [L] and return the shift of the victim index's lower bound."""
    if tag.ndim - 1 == PolicyKind.RULE:
        return rule.offsets(prm, clk, off)
    if tag.ndim - 1 == PolicyKind.MARKOV:
        return markov.offsets(prm, clk, off)
    off[:] = 0
    return 0


@njit(cache=True)
def _select(tag, need, tv, ts, mv, ms, off, shift, key_of, num_experts, kst, sst, prm, clk,
            vslot, vscore, taken_s, taken_v):
    """The `need` lowest (score, slot) among indexed slots, ascending, into vslot/vscore.

    Takes candidates out of the index in increasing (order + off, slot) and scores each;
    stops once no remaining slot can beat the worst one kept: its lower bound
    (order + off) >> shift is above that score (or equal with a higher slot when shift
    is 0, where the bound order is the score order). Candidates not kept go back in;
    the kept ones stay out. taken_s, taken_v: int64 [S] scratch.
    """
    cnt = 0
    nt = 0
    while True:
        lk = ix_best(mv, ms, off)
        if lk < 0:
            break
        s = ms[lk]
        if cnt == need:
            lb = (mv[lk] + off[lk]) >> shift
            if lb > vscore[need - 1] or (shift == 0 and lb == vscore[need - 1] and s > vslot[need - 1]):
                break
        key = np.int64(key_of[s])
        taken_s[nt] = s
        taken_v[nt] = mv[lk]
        nt += 1
        ix_set(tv, ts, mv, ms, lk, key - lk * num_experts, FREE, FREE)
        sc = _score(tag, kst, sst, prm, clk, key, s)
        if cnt == need and not _before(sc, s, vscore[need - 1], vslot[need - 1]):
            continue
        j = cnt if cnt < need else need - 1
        while j > 0 and _before(sc, s, vscore[j - 1], vslot[j - 1]):
            vscore[j] = vscore[j - 1]
            vslot[j] = vslot[j - 1]
            j -= 1
        vscore[j] = sc
        vslot[j] = s
        if cnt < need:
            cnt += 1
    for i in range(nt):  # put back what was visited but not kept
        s = taken_s[i]
        kept = False
        for j in range(need):
            if vslot[j] == s:
                kept = True
        if not kept:
            key = np.int64(key_of[s])
            lk = key // num_experts
            ix_set(tv, ts, mv, ms, lk, key - lk * num_experts, taken_v[i], s)


@njit(cache=True)
def replay_calls(tag, ids, layers, logit_idx, logit_val, has_logits, num_experts,
                 slot_of, key_of, kst, sst, gst, prm, fprm, aux, clock, counters, hist,
                 out_slots, plan, tv, ts, mv, ms, copies, fill, served, split_hist, call_misses):
    """Run every call of ids [C, rows, k] through the contract; see the module docstring.

    out_slots int32 [rows, k] and plan int32 [rows * k, 2] receive the last call's
    result; the return value is that call's copy count. tv, ts, mv, ms: an empty victim
    index (victim_index.ix_new), filled here from the slot map. copies int32 [>= rows * k + 1]:
    the split's table (MissSplit.copies); fill: whether empty slots take every miss they can first
    (MissSplit.fills); served int64 [L]: misses served on the CPU, per layer; split_hist int64
    [>= Q + 1, >= Q + 1]: calls by (misses, copies), summed over layers; call_misses int64 [C] or [0]:
    each call's misses (copied or served), written when it has C entries.
    """
    C, rows, k = ids.shape
    S = key_of.shape[0]
    L = counters.shape[0]
    Q = rows * k
    E = num_experts
    q = np.empty(Q, dtype=np.int64)
    qslot = np.empty(Q, dtype=np.int64)
    miss_pos = np.empty(Q, dtype=np.int64)
    vslot = np.empty(Q, dtype=np.int64)
    vscore = np.empty(Q, dtype=np.int64)
    prio = np.empty(Q, dtype=np.int64)
    copy_pos = np.empty(Q, dtype=np.int64)
    served_pos = np.empty(Q, dtype=np.int64)
    changed = np.empty(logit_idx.shape[1] * logit_idx.shape[2], dtype=np.int64)
    buf = np.empty(logit_idx.shape[2], dtype=np.float32)
    taken_s = np.empty(S, dtype=np.int64)
    taken_v = np.empty(S, dtype=np.int64)
    clk = np.zeros(CLOCK_LEN, dtype=np.int64)
    clk[CLK_LAYERS] = L
    clk[CLK_EXPERTS] = E
    clk[CLK_STEP] = clock[0]
    clk[CLK_TOK] = clock[1]
    off = np.zeros(L, dtype=np.int64)
    acc = np.empty((markov.MAX_LAGS, E), dtype=np.int64)
    acc32 = np.empty((markov.MAX_LAGS, E), dtype=np.int32)
    pins = np.empty(E, dtype=np.int64)  # markov: the call's experts, pinned in ix_fill
    # markov's step 1 ahead (markov._ahead): per layer the experts of its previous, current and next
    # two calls in the batch (ring[l, i] with count rn[l, i], -1: none), the calls seen, and each
    # call's next of the same layer
    is_markov = tag.ndim - 1 == PolicyKind.MARKOV
    ring = np.empty((L if is_markov else 0, 4, Q), dtype=np.int64)
    rn = np.full((L if is_markov else 0, 4), -1, dtype=np.int64)
    rc = np.full((L if is_markov else 0, 4), -1, dtype=np.int64)
    seen = np.zeros(L if is_markov else 0, dtype=np.int64)
    nxt = np.full(C if is_markov else 0, -1, dtype=np.int64)
    if is_markov:
        last = np.full(L, -1, dtype=np.int64)
        for c in range(C - 1, -1, -1):
            nxt[c] = last[layers[c]]
            last[layers[c]] = c
    filled = 0
    while filled < S and key_of[filled] >= 0:
        key = np.int64(key_of[filled])
        a = _order(tag, kst, sst, prm, clk, key, np.int64(filled))
        ix_set(tv, ts, mv, ms, key // E, key % E, a, np.int64(filled))
        filled += 1
    access = counters[:, 1].sum()
    m = 0
    for c in range(C):
        layer = np.int64(layers[c])
        clock[0] += 1
        if layer == 0:
            clock[1] += 1
        clk[CLK_STEP] = clock[0]
        clk[CLK_TOK] = clock[1]
        clk[CLK_LAYER] = layer
        if is_markov:
            done = 0
            if seen[layer] == 0:
                rc[layer, 0] = -1
                rn[layer, 0] = -1
                rc[layer, 1] = c
                rn[layer, 1] = _call_experts(ids, c, ring[layer, 1])
                rc[layer, 2] = nxt[c]
                rn[layer, 2] = -1 if nxt[c] < 0 else _call_experts(ids, nxt[c], ring[layer, 2])
            else:
                done = 1 if seen[layer] == 1 else (3 if seen[layer] == 2 else 7)
                for i in range(3):
                    rc[layer, i] = rc[layer, i + 1]
                    rn[layer, i] = rn[layer, i + 1]
                    for r in range(max(rn[layer, i], 0)):
                        ring[layer, i, r] = ring[layer, i + 1, r]
            nn = -1 if rc[layer, 2] < 0 else nxt[rc[layer, 2]]
            rc[layer, 3] = nn
            rn[layer, 3] = -1 if nn < 0 else _call_experts(ids, nn, ring[layer, 3])
            seen[layer] += 1
            n = rn[layer, 1]
            for i in range(n):
                q[i] = layer * E + ring[layer, 1, i]
        else:
            n = 0
            for r in range(rows):
                for j in range(k):
                    e = ids[c, r, j]
                    if e >= 0:
                        q[n] = layer * E + e
                        n += 1
            n = _sorted_distinct(q, n)
        if has_logits:
            nch = 0
            if tag.ndim - 1 == PolicyKind.RULE:
                nch = rule.refresh(kst, fprm, clk, logit_idx[c], logit_val[c], k, changed, buf)
            for i in range(nch):
                s = slot_of[changed[i]]
                if s >= 0:
                    ix_set(tv, ts, mv, ms, layer, changed[i] - layer * E,
                           _order(tag, kst, sst, prm, clk, changed[i], np.int64(s)), np.int64(s))
        m = 0
        for i in range(n):  # hits: touch and pin (out of the index for this call)
            s = slot_of[q[i]]
            qslot[i] = s
            if s >= 0:
                _touch(tag, kst, sst, gst, prm, clk, aux, q[i], np.int64(s), access + i, False)
                if tag.ndim - 1 != PolicyKind.MARKOV:  # markov's ix_fill below pins them with the layer
                    ix_set(tv, ts, mv, ms, layer, q[i] - layer * E, FREE, FREE)
            else:
                miss_pos[m] = i
                m += 1
        if tag.ndim - 1 == PolicyKind.MARKOV:  # the call rewrites the order of every key of its layer
            markov.observe(kst, gst, prm, layer, E, q, n, acc, acc32, slot_of, done, ring[layer], rn[layer])
            for i in range(n):  # the call's hits stay pinned (out of the index)
                pins[i] = q[i] - layer * E
            ix_fill(tv, ts, mv, ms, layer, kst[markov.V, layer * E:(layer + 1) * E],
                    slot_of[layer * E:(layer + 1) * E], pins, n)
        c_m = copies[m]
        if fill and c_m < min(m, S - filled):  # hybrid: an empty slot takes a miss without evicting
            c_m = min(m, S - filled)
        ns = 0
        if c_m < m:  # the split: miss_pos keeps the copied ones, served_pos the others
            ns = _split(tag, kst, prm, clk, aux, q, miss_pos, m, c_m, access, prio, copy_pos, served_pos)
            for j in range(c_m):
                miss_pos[j] = copy_pos[j]
        ne = min(c_m, S - filled)
        for j in range(ne):
            vslot[j] = filled + j
            vscore[j] = 0
        if c_m > ne:
            shift = _offsets(tag, prm, clk, off)
            _select(tag, c_m - ne, tv, ts, mv, ms, off, shift, key_of, E, kst, sst, prm, clk,
                    vslot[ne:], vscore[ne:], taken_s, taken_v)
        filled += ne
        for j in range(c_m):  # evict and install, in ascending key order
            i = miss_pos[j]
            s = vslot[j]
            old = key_of[s]
            if old >= 0:
                slot_of[old] = -1
                if tag.ndim - 1 == PolicyKind.LFUDA:
                    lfuda.evicted(gst, vscore[j])
            key_of[s] = q[i]
            slot_of[q[i]] = s
            qslot[i] = s
            _touch(tag, kst, sst, gst, prm, clk, aux, q[i], s, access + i, True)
            plan[j, 0] = q[i]
            plan[j, 1] = s
        for j in range(ns):  # served on the CPU: no slot, not indexed
            i = served_pos[j]
            _served(tag, kst, prm, clk, aux, q[i], access + i)
        for i in range(n):  # unpin: every resident key of the call back in the index
            if qslot[i] >= 0:
                ix_set(tv, ts, mv, ms, layer, q[i] - layer * E,
                       _order(tag, kst, sst, prm, clk, q[i], qslot[i]), qslot[i])
        access += n
        counters[layer, 0] += 1
        counters[layer, 1] += n
        counters[layer, 2] += m
        served[layer] += ns
        hist[layer, m] += 1
        split_hist[m, c_m] += 1
        if call_misses.shape[0] == C:
            call_misses[c] = m
        if c == C - 1:
            for r in range(rows):
                for j in range(k):
                    e = ids[c, r, j]
                    out_slots[r, j] = -1
                    if e >= 0:
                        s = slot_of[layer * E + e]
                        out_slots[r, j] = s if s >= 0 else CPU_SLOT
            m = c_m
    return m


def validate_calls(geometry: CacheGeometry, ids: np.ndarray, layers: np.ndarray,
                   logit_idx: np.ndarray | None = None, logit_val: np.ndarray | None = None) -> None:
    """Check a batch of calls as HostCache.ensure checks one; raise EnsureError if any fails.

    ids int32 [C, rows, k]; layers int [C]; logits int32 / float32 [C, rows, T] or None.
    Nothing is run when this raises.
    """
    L, E, S = geometry.num_layers, geometry.num_experts, geometry.num_slots
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 or ids.ndim != 3:
        raise EnsureError(f"ids must be an int32 array [calls, rows, k], got "
                          f"{getattr(ids, 'dtype', type(ids))} {getattr(ids, 'shape', None)}")
    if min(ids.shape) < 1:
        raise EnsureError(f"ids needs at least one call, row and column, got {ids.shape}")
    layers = np.asarray(layers)
    if layers.shape != ids.shape[:1] or layers.dtype.kind not in "iu":
        raise EnsureError(f"layers must be ints of shape [{ids.shape[0]}], got {layers.shape}")
    if ((layers < 0) | (layers >= L)).any():
        raise EnsureError(f"a layer is outside [0, {L}) (num_layers)")
    bad = (ids < -1) | (ids >= E)
    if bad.any():
        c = int(np.argwhere(bad)[0][0])
        raise EnsureError(f"call {c}: expert id {int(ids[bad][0])} outside [0, {E}) "
                          "(num_experts); use -1 for padding")
    distinct = distinct_counts(ids)
    if distinct.max() > S:
        c = int(distinct.argmax())
        raise EnsureError(f"call {c} asks for {int(distinct[c])} distinct experts but the pool "
                          f"has {S} slots (--moe-slots): raise the slot count")
    if (logit_idx is None) != (logit_val is None):
        raise EnsureError("logit_idx and logit_val come together: pass both or neither")
    if logit_idx is not None:
        if (logit_idx.dtype != np.int32 or logit_val.dtype != np.float32 or logit_idx.ndim != 3
                or logit_idx.shape != logit_val.shape or logit_idx.shape[:2] != ids.shape[:2]):
            raise EnsureError(f"logit_idx int32 / logit_val float32 must both be [{ids.shape[0]}, "
                              f"{ids.shape[1]}, T]; got {logit_idx.shape} {logit_idx.dtype}, "
                              f"{logit_val.shape} {logit_val.dtype}")
        if ((logit_idx < -1) | (logit_idx >= E)).any():
            raise EnsureError(f"logit_idx holds an expert id outside [0, {E}); use -1 for padding")
        if not np.isfinite(logit_val).all():
            raise EnsureError("logit_val holds NaN or infinity: pass finite router logits")


def run_calls(cache, ids: np.ndarray, layers, logit_idx: np.ndarray | None = None,
              logit_val: np.ndarray | None = None, hist: np.ndarray | None = None,
              split_hist: np.ndarray | None = None, call_misses: np.ndarray | None = None):
    """Replay calls through `cache` (a HostCache) in place with the compiled kernel.

    ids int32 [C, rows, k]; layers int [C]; logits [C, rows, T] or None; hist int64
    [L, >= Q + 1] (Q = rows * k) accumulates calls by miss count, split_hist int64 [>= Q + 1, >= Q + 1]
    calls by (misses, copies), call_misses int64 [C] receives each call's misses (copied or served), in
    call order. The cache's split (HostCache.split) applies, and its `served` counts
    grow. Returns the last call's (slots int32 [rows, k], plan int32 [c, 2] of its copies). Raises
    EnsureError before running anything.
    """
    g = cache.geometry
    validate_calls(g, ids, layers, logit_idx, logit_val)
    if not cache.split.copies_all and ids.shape[1] * ids.shape[2] >= SPLIT_LEN:
        raise EnsureError(f"ids [calls, rows, k] has {ids.shape[1] * ids.shape[2]} entries a call: a miss split "
                          f"takes fewer than {SPLIT_LEN} (decode batch rows * top_k)")
    layers = np.ascontiguousarray(layers, dtype=np.int64)
    rows, k = ids.shape[1:]
    if hist is None:
        hist = np.zeros((g.num_layers, rows * k + 1), dtype=np.int64)
    elif hist.dtype != np.int64 or hist.shape[0] != g.num_layers or hist.shape[1] < rows * k + 1:
        raise ValueError(f"hist must be int64 [{g.num_layers}, >= {rows * k + 1}]")
    has_logits = logit_idx is not None and cache.policy.uses_logits
    if not has_logits:
        logit_idx = np.full((1, 1, 1), -1, dtype=np.int32)
        logit_val = np.zeros((1, 1, 1), dtype=np.float32)
    if split_hist is None:
        split_hist = np.zeros((rows * k + 1, rows * k + 1), dtype=np.int64)
    elif split_hist.dtype != np.int64 or min(split_hist.shape) < rows * k + 1 or split_hist.ndim != 2:
        raise ValueError(f"split_hist must be int64 [>= {rows * k + 1}, >= {rows * k + 1}]")
    if call_misses is None:
        call_misses = np.zeros(0, dtype=np.int64)
    elif call_misses.dtype != np.int64 or call_misses.shape != ids.shape[:1]:
        raise ValueError(f"call_misses must be int64 [{ids.shape[0]}] (one entry a call)")
    out = np.empty((rows, k), dtype=np.int32)
    plan = np.empty((rows * k, 2), dtype=np.int32)
    pol, st = cache.policy, cache.state
    m = replay_calls(kind_tag(pol.kind), np.ascontiguousarray(ids), layers, logit_idx, logit_val, has_logits,
                     g.num_experts, cache.slot_of, cache.key_of, st.key, st.slot, st.glob,
                     pol.params(), pol.fparams(), pol.aux(), cache.clock, cache.counters, hist,
                     out, plan, *ix_new(g.num_layers, g.num_experts), cache.split.copies,
                     cache.split.fills, cache.served, split_hist, call_misses)
    return out, plan[:m].copy()
