"""`markov`: evict the key least likely to be routed again soon, by per-layer routing transitions.

Which experts a layer routes to at this token says much about which it routes to at the next:
`markov` learns, per layer, how often expert b follows expert a one and two tokens later (a
decode step's routing is a set B of distinct experts per layer), predicts from the layer's latest
set how likely each of its experts is at the layer's next two calls, and evicts the resident key
with the lowest prediction, less a term for how far off its layer's next call is (a key whose layer
runs soon is needed soon). Everything is integer: counts in Q4 (a use adds 16), probabilities in
Q16 (ONE = 2**16).

State, int32 per key (layer l, expert e; survives eviction; Markov.__init__ bounds every field below
2**31, half the bytes of int64 to move), with J = `lags` (1 or 2):

    key[V]          the prediction: sum over lags j of p_j(e), Q16, set at the layer's last call
    key[HIST]       bit j: e was routed at the layer's call j + 1 calls ago (J bits)
    key[FREQ]       e's use count at its layer, Q4
    key[T + j*E + a]  Q4 count of "a routed at call c, e routed at call c + j + 1" (row a of the
                    layer's lag-j table, stored at e's key)
    key[R + j]      row total of the lag-j row whose source is e: sum over b of key[T + j*E + e]
                    at the keys (l, b)
    glob[l]         the layer's total FREQ (sum of key[FREQ] over its experts)

At a call of layer l with distinct experts B (n = |B|), before its victims are chosen:

    1. for j < J, every a with HIST bit j, every b in B: T_j[a, b] += 16, R_j[a] += 16; a row
       whose total passes 16 * row_cap is halved (each count >> 1) and its total recounted
    2. FREQ[b] += 16 for b in B; a layer whose total passes 16 * freq_cap is halved the same way
    3. HIST = (HIST << 1 | routed now) & (2**J - 1) for every expert of the layer
    4. for every expert e of the layer that has a slot or is in B (V = 0 for the others: only a
       resident key's V is ever read), with f = (n * (FREQ[e] + 8) << 16) // (glob[l] + 8 * E)
       (its smoothed share of the layer's uses, Q16) and for each lag j
       P_j = sum over b in B of T_j[b, e], D_j = sum over b in B of R_j[b]:
           p_j = ((n * P_j << 16) + 16 * prior * f) // (D_j + 16 * prior)
           V = sum over j of p_j, + RECENCY_Q if e is in B
       (with no transitions seen, p_j = f; RECENCY_Q = round(recency * ONE): a key routed now is
       kept a little longer than its transitions alone say, which the real traces reward)

The score of a resident key of layer lk at a call of layer l is

    score = V - d * BETA_Q,   d = lk - l if lk > l else L - l + lk  (layer calls until lk runs),
    BETA_Q = round(beta * ONE / L)

V changes only at a call of the key's own layer and d only with the clock, so the compiled
replay's victim index uses order = V and offsets[lk] = -d * BETA_Q (exact, shift 0); at each
call it re-indexes the layer's resident keys, whose V the call rewrote.

Hits and installs touch nothing of their own: the call's routing enters the state in steps 1-4
before its victims are chosen, so the layer's own resident keys are scored on what the call says
of the layer's next call (its routing is known when ensure runs), not on a prediction of this one.
Constants (docs/policies.md says how they were chosen): lags 2, beta 0.3, row_cap 100,
freq_cap 300, prior 1, recency 0.2.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from expertcache.errors import PolicyError
from expertcache.geometry import CacheGeometry
from expertcache.policies.base import CLK_EXPERTS, CLK_LAYER, CLK_LAYERS, Clock, Policy, PolicyKind, PolicyState

ONE_SHIFT = 16
Q4 = 16  # a use adds 16 to a count
FLOOR_Q4 = 8  # half a use: the frequency's smoothing per expert
MAX_LAGS = 2
TWO52 = np.int64(1 << 52)

V, HIST, FREQ, T = 0, 1, 2, 3
# Integer parameter vector: lags, BETA_Q, 16 * row_cap, 16 * freq_cap, prior, RECENCY_Q
P_LAGS, P_BETA_Q, P_ROW_CAP, P_FREQ_CAP, P_PRIOR, P_RECENCY_Q = 0, 1, 2, 3, 4, 5


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """A hint that arr[i, j] is read soon (LLVM's prefetch: read, locality 2, prefetcht1 on x86). At
    locality 3 (into L1 as well) the replay was slower: a call's 20 rows of 2 KiB, one stride of the
    state apart, fall into the same L1 sets and evict each other before they are read."""
    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        # the overloaded name (llvm.prefetch.p0, or .p0i8 where pointers are typed) from the pointer type
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()
    return types.void(arr, i, j), codegen


@njit(cache=True, inline="always")
def _qdiv(a, b, rb):
    """a // b for 0 <= a, b < 2**52 given rb = 1.0 / b, without a branch (the loops over a layer's
    experts vectorise): one float division per loop of the same b instead of an int64 division per
    key. Both are exact in float64 and a * rb is within 1 of a / b, so the truncated estimate is off by
    at most one and the remainder's sign corrects it."""
    d = np.int64(np.float64(a) * rb)
    r = a - d * b
    return d - np.int64(r < 0) + np.int64(r >= b)


@njit(cache=True, inline="always")
def _div_r(a, b, rb):
    """a // b for a >= 0, b > 0: _qdiv below 2**52, the integer division past it (huge row_cap or prior)."""
    if a >= TWO52 or b >= TWO52:
        return a // b
    return _qdiv(a, b, rb)


@njit(cache=True, inline="always")
def score(kst, prm, clk, key):
    num_layers = clk[CLK_LAYERS]
    layer = clk[CLK_LAYER]
    lk = key // clk[CLK_EXPERTS]
    d = lk - layer if lk > layer else num_layers - layer + lk
    return kst[V, key] - d * prm[P_BETA_Q]


@njit(cache=True, inline="always")
def order(kst, key):
    return kst[V, key]


@njit(cache=True)
def offsets(prm, clk, off):
    num_layers = clk[CLK_LAYERS]
    layer = clk[CLK_LAYER]
    for lk in range(num_layers):
        d = lk - layer if lk > layer else num_layers - layer + lk
        off[lk] = -d * prm[P_BETA_Q]
    return 0


@njit(cache=True, inline="always")
def _update_rows(kst, prm, j, E, base, rows, nr, cols, nc, off):
    """Step 1 for lag j of one call whose experts are cols[:nc] - off: T_j[a, b] += 16 and R_j[a] += 16 nc
    for every row a in rows[:nr] (the layer's experts), a row whose total passes the cap halved and
    recounted."""
    R = T + prm[P_LAGS] * E + j
    for r in range(nr):
        a = rows[r]
        row = kst[T + j * E + a, base:base + E]
        for i in range(nc):
            row[cols[i] - off] += Q4
        kst[R, base + a] += Q4 * nc
        if kst[R, base + a] > prm[P_ROW_CAP]:
            tot = 0
            for e in range(E):
                c = row[e] >> 1
                row[e] = c
                tot += c
            kst[R, base + a] = tot


@njit(cache=True, inline="always")
def _learn(kst, gst, prm, layer, E, q, n, acc, done):
    """Steps 1-3, step 1 without what the compiled replay applied ahead (_ahead): `done` bit 0 lag 0,
    bit 1 lag 1's rows routed at the layer's last call, bit 2 its other rows. The rows step 1 updates
    (HIST bit j set: routed j + 1 calls ago) are listed in acc's rows (free until step 4) in one pass
    that also shifts HIST."""
    base = layer * E
    lags = prm[P_LAGS]
    mask = (1 << lags) - 1
    hist = kst[HIST, base:base + E]  # one-dimensional views of the layer's part: the loops vectorise
    freq = kst[FREQ, base:base + E]
    skip1 = 3 if lags < 2 else (done >> 1) & 3  # lag 1's rows done ahead: 1 routed last call, 2 not
    cnt0 = 0
    cnt1 = 0
    if done & 1 and skip1 == 3:
        for a in range(E):
            hist[a] = (hist[a] << 1) & mask
    else:
        for a in range(E):
            h = hist[a]
            if h != 0:
                if h & 1:
                    acc[0, cnt0] = a
                    cnt0 += 1
                if (h >> 1) & 1 and not (skip1 >> (1 - (h & 1))) & 1:
                    acc[1, cnt1] = a
                    cnt1 += 1
                hist[a] = (h << 1) & mask
    if not done & 1:  # 1. transitions from the layer's call j + 1 calls ago to this one
        _update_rows(kst, prm, 0, E, base, acc[0], cnt0, q, n, base)
    if skip1 != 3:
        _update_rows(kst, prm, 1, E, base, acc[1], cnt1, q, n, base)
    for i in range(n):  # 2. frequency
        freq[q[i] - base] += Q4
    gst[layer] += Q4 * n
    if gst[layer] > prm[P_FREQ_CAP]:
        tot = 0
        for b in range(E):
            c = freq[b] >> 1
            freq[b] = c
            tot += c
        gst[layer] = tot
    for i in range(n):  # 3. history (shifted above)
        hist[q[i] - base] |= 1


@njit(cache=True, inline="always")
def _ahead(kst, prm, layer, E, ring, rn, acc):
    """Step 1 of the layer's next two calls applied now, to the rows this call's step 4 has just read
    (in cache): ring [4, >= n] holds the sorted experts (layer-local) of the layer's calls px, x (this
    one), c and c2 (its previous and next two in the batch), rn [4] their counts, -1 for a call outside
    the batch. Row a of T_j changes only at step 1 and is read only by step 4 of the layer's calls
    that route a, so an update may move back to just after the last such read before its call,
    keeping the order of the row's updates:
        lag 0 of c, rows x (read last by x)
        lag 1 of c, rows px & x (read last by x; px - x were done at px, as lag 1 of c2 below)
        lag 1 of c2, rows x - c (x & c are read by c and done there); only where px is in the batch,
            so that lag 1 of c, rows px & x (routed at x), is done first
    Step 1 of a call then runs only what was not done ahead: lag 0 from its layer's second call in
    the batch on, lag 1's rows px & x from the third (`done` 3), all of it from the fourth (7)."""
    base = layer * E
    nx, nc, n2 = rn[1], rn[2], rn[3]
    x = ring[1]
    if nc < 0:
        return
    _update_rows(kst, prm, 0, E, base, x, nx, ring[2], nc, 0)
    if prm[P_LAGS] < 2 or rn[0] < 0:
        return
    rows = acc[0]
    nr = 0
    i = 0
    px = ring[0]
    for r in range(nx):  # px & x
        while i < rn[0] and px[i] < x[r]:
            i += 1
        if i < rn[0] and px[i] == x[r]:
            rows[nr] = x[r]
            nr += 1
    _update_rows(kst, prm, 1, E, base, rows, nr, ring[2], nc, 0)
    if n2 >= 0:  # x - c
        nr = 0
        i = 0
        cc = ring[2]
        for r in range(nx):
            while i < nc and cc[i] < x[r]:
                i += 1
            if not (i < nc and cc[i] == x[r]):
                rows[nr] = x[r]
                nr += 1
        _update_rows(kst, prm, 1, E, base, rows, nr, ring[3], n2, 0)


@njit(cache=True, inline="always")
def _sum_rows(kst, r0, base, E, q, n, aj):
    """aj[:E] = the sum over i < n of the rows kst[r0 + q[i] - base, base:base + E], in aj's dtype,
    up to four rows a pass over aj (the first pass assigns: no zeroing pass)."""
    if n == 0:
        aj[:E] = 0
        return
    head = n - 4 * ((n - 1) // 4)  # 1-4 rows in the first pass, then four a pass
    s0 = kst[r0 + (q[0] - base), base:base + E]
    if head == 1:
        for e in range(E):
            aj[e] = s0[e]
    elif head == 2:
        s1 = kst[r0 + (q[1] - base), base:base + E]
        for e in range(E):
            aj[e] = s0[e] + s1[e]
    elif head == 3:
        s1 = kst[r0 + (q[1] - base), base:base + E]
        s2 = kst[r0 + (q[2] - base), base:base + E]
        for e in range(E):
            aj[e] = (s0[e] + s1[e]) + s2[e]
    else:
        s1 = kst[r0 + (q[1] - base), base:base + E]
        s2 = kst[r0 + (q[2] - base), base:base + E]
        s3 = kst[r0 + (q[3] - base), base:base + E]
        for e in range(E):
            aj[e] = (s0[e] + s1[e]) + (s2[e] + s3[e])
    i = head
    while i < n:
        s0 = kst[r0 + (q[i] - base), base:base + E]
        s1 = kst[r0 + (q[i + 1] - base), base:base + E]
        s2 = kst[r0 + (q[i + 2] - base), base:base + E]
        s3 = kst[r0 + (q[i + 3] - base), base:base + E]
        for e in range(E):
            aj[e] += (s0[e] + s1[e]) + (s2[e] + s3[e])
        i += 4


@njit(cache=True, inline="always")
def _row_sums(kst, prm, layer, E, q, n, acc):
    """Step 4's P_j: acc[j, e] = the sum over the call's experts b of T_j[b, e]."""
    for j in range(prm[P_LAGS]):
        _sum_rows(kst, T + j * E, layer * E, E, q, n, acc[j])


@njit(cache=True, inline="always")
def _predict(kst, gst, prm, layer, E, n, a0, a1, d0, d1, slot_of):
    """Step 4's V of every expert of the layer from P_j (a0, a1), D_j (d0, d1) and the frequency share."""
    base = layer * E
    lags = prm[P_LAGS]
    hist, freq, val = kst[HIST, base:base + E], kst[FREQ, base:base + E], kst[V, base:base + E]
    slots = slot_of[base:base + E]
    den_f = gst[layer] + FLOOR_Q4 * E
    prior = Q4 * prm[P_PRIOR]
    recency = prm[P_RECENCY_Q]
    r_f, r0, r1 = 1.0 / np.float64(den_f), 1.0 / np.float64(d0), 1.0 / np.float64(d1)
    # Bounds of this call's dividends: FREQ[e] <= the layer's total, P_j <= D_j - prior (a row's
    # entries sum to its total), f <= n ONE. Below 2**52 every expert takes the branch-free loop (at
    # any residency: it vectorises, and a branch per expert on its slot costs more than the work).
    top = max((n * den_f) << ONE_SHIFT, ((n * d0) << ONE_SHIFT) + prior * (n << ONE_SHIFT),
              ((n * d1) << ONE_SHIFT) + prior * (n << ONE_SHIFT), d0, d1)
    if top < TWO52:
        for e in range(E):  # p_j from P_j, D_j and f for every expert, kept where resident or routed now
            now = hist[e] & 1
            f = _qdiv((n * (freq[e] + FLOOR_Q4)) << ONE_SHIFT, den_f, r_f)
            v = _qdiv(((n * np.int64(a0[e])) << ONE_SHIFT) + prior * f, d0, r0)
            if lags > 1:
                v += _qdiv(((n * np.int64(a1[e])) << ONE_SHIFT) + prior * f, d1, r1)
            val[e] = v + recency * now if (slots[e] >= 0) | (now == 1) else 0
        return
    # Dividends past 2**52 (a huge row_cap or prior): the experts that need V one by one, _div_r
    # taking the integer division where the float one could round.
    for e in range(E):
        now = hist[e] & 1
        if slots[e] < 0 and now == 0:
            val[e] = 0
            continue
        f = _div_r((n * (freq[e] + FLOOR_Q4)) << ONE_SHIFT, den_f, r_f)
        v = _div_r(((n * np.int64(a0[e])) << ONE_SHIFT) + prior * f, d0, r0)
        if lags > 1:
            v += _div_r(((n * np.int64(a1[e])) << ONE_SHIFT) + prior * f, d1, r1)
        val[e] = v + recency * now


@njit(cache=True)
def observe(kst, gst, prm, layer, num_experts, q, n, acc, acc32, slot_of, done, ring, rn):
    """Steps 1-4 of the module docstring for the call of `layer` whose distinct keys are q[:n]
    (ascending), before its victims are chosen. Rewrites V of every expert of the layer (0 where it
    has no slot and is not routed now: only a resident key's V is ever read). acc: int64, acc32:
    int32 [>= lags, >= E] scratch. done: the lags (bit j) whose step 1 was applied ahead; ring, rn:
    the layer's neighbouring calls for step 1 ahead (_ahead; rn[2] = -1: none)."""
    E = num_experts
    base = layer * E
    for j in range(prm[P_LAGS]):  # step 4's rows stream in while steps 1-3 run
        for i in range(n):
            for e in range(0, E, 16):
                _prefetch(kst, T + j * E + (q[i] - base), base + e)
    _learn(kst, gst, prm, layer, E, q, n, acc, done)
    lags = prm[P_LAGS]
    R = T + lags * E
    prior = Q4 * prm[P_PRIOR]
    d0 = prior  # D_j
    d1 = prior
    for i in range(n):
        d0 += kst[R, q[i]]
        if lags > 1:
            d1 += kst[R + 1, q[i]]
    # P_j[e] <= D_j - prior (a row's entries sum to its total): in int32 while that fits, a quarter
    # of the instructions of int64 (no widening, 16 lanes a vector)
    if max(d0, d1) - prior < 1 << 31:
        _row_sums(kst, prm, layer, E, q, n, acc32)
        _ahead(kst, prm, layer, E, ring, rn, acc)
        _predict(kst, gst, prm, layer, E, n, acc32[0], acc32[1], d0, d1, slot_of)
    else:
        _row_sums(kst, prm, layer, E, q, n, acc)
        _predict(kst, gst, prm, layer, E, n, acc[0], acc[1], d0, d1, slot_of)
        _ahead(kst, prm, layer, E, ring, rn, acc)
    return 0


class Markov(Policy):
    name = "markov"
    kind = PolicyKind.MARKOV
    key_dtype = np.int32  # every key field stays below 2**31 (__init__ bounds them): half the bytes

    def __init__(self, geometry: CacheGeometry, lags: int = 2, beta: float = 0.3, row_cap: int = 100,
                 freq_cap: int = 300, prior: int = 1, recency: float = 0.2) -> None:
        super().__init__(geometry)
        if isinstance(lags, bool) or lags not in range(1, MAX_LAGS + 1):
            raise PolicyError(f"markov lags must be 1 or {MAX_LAGS}, got {lags!r}")
        if not beta >= 0 or row_cap < 1 or freq_cap < 1 or prior < 1 or not 0 <= recency <= 4:
            raise PolicyError("markov constants need beta >= 0, row_cap >= 1, freq_cap >= 1, prior >= 1, "
                              f"0 <= recency <= 4; got beta={beta}, row_cap={row_cap}, freq_cap={freq_cap}, "
                              f"prior={prior}, recency={recency}")
        E = geometry.num_experts
        # int32 key fields: a count stays below 16 * (cap + E) and V below (2 E + 4) * ONE
        if (2 * E + 4) << ONE_SHIFT >= 1 << 31:
            raise PolicyError(f"markov keeps its state in int32: at most {(1 << 14) - 3} experts a layer, "
                              f"got {E} (num_experts)")
        for name, cap in (("row_cap", row_cap), ("freq_cap", freq_cap)):
            if Q4 * (cap + E) >= 1 << 31:
                raise PolicyError(f"markov {name} must be below {(1 << 27) - E} at {E} experts a layer "
                                  f"(its counts are int32), got {cap}")
        # step 4's int64 dividends: n P_j << 16 + prior f with n distinct experts, P_j <= D_j
        n = min(E, geometry.num_slots)
        d_max = Q4 * prior + n * Q4 * (row_cap + E)
        if ((n * d_max) << ONE_SHIFT) + Q4 * prior * (n << ONE_SHIFT) >= 1 << 62:
            raise PolicyError(f"markov row_cap={row_cap} with prior={prior} at {n} routed experts a call "
                              "overflow its int64 predictions: lower row_cap or prior")
        self.lags = int(lags)
        self.beta_q = int(np.floor(beta * (1 << ONE_SHIFT) / geometry.num_layers + 0.5))
        self.row_cap, self.freq_cap, self.prior = int(row_cap), int(freq_cap), int(prior)
        self.recency_q = int(np.floor(recency * (1 << ONE_SHIFT) + 0.5))
        self.constants = dict(lags=lags, beta=beta, row_cap=row_cap, freq_cap=freq_cap, prior=prior,
                              recency=recency)
        self.key_fields = (("v", "hist", "freq")
                           + tuple(f"t{j}_{a}" for j in range(self.lags) for a in range(E))
                           + tuple(f"r{j}" for j in range(self.lags)))
        self.glob_fields = tuple(f"freq_total_{l}" for l in range(geometry.num_layers))

    def state_bytes(self) -> int:
        """Bytes of this policy's state at its geometry: (3 + J * (E + 1)) int32 fields per key and
        one int64 per layer."""
        g = self.geometry
        return 4 * len(self.key_fields) * g.num_keys + 8 * len(self.glob_fields)

    def params(self) -> np.ndarray:
        return np.array([self.lags, self.beta_q, Q4 * self.row_cap, Q4 * self.freq_cap, self.prior,
                         self.recency_q], dtype=np.int64)

    # ---- reference verbs ---------------------------------------------------------------------
    def on_hit(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        """Nothing: the call's routing enters the state in observe, before its victims are chosen."""

    on_install = on_hit

    def scores(self, st: PolicyState, clk: Clock, keys, slots) -> np.ndarray:
        L, l = clk.num_layers, clk.layer
        lk = keys // clk.num_experts
        d = np.where(lk > l, lk - l, L - l + lk)
        return st.key[V, keys] - d * self.beta_q

    def miss_priority(self, st: PolicyState, clk: Clock, keys, access) -> np.ndarray:
        """The score each missing key would have if resident: its prediction V, which observe has just
        set for every key the call routes to."""
        return self.scores(st, clk, keys, None)

    def observe(self, st: PolicyState, clk: Clock, keys: np.ndarray, slot_of: np.ndarray) -> None:
        E, l, J = clk.num_experts, clk.layer, self.lags
        base = l * E
        own = slice(base, base + E)
        B = keys - base  # the call's experts, ascending
        n = B.shape[0]
        R = T + J * E
        for j in range(J):  # 1
            rows = np.flatnonzero((st.key[HIST, own] >> j) & 1)
            tj = st.key[T + j * E: T + (j + 1) * E, own]  # [a, b]: a view
            tj[np.ix_(rows, B)] += Q4
            st.key[R + j, base + rows] += Q4 * n
            full = rows[st.key[R + j, base + rows] > Q4 * self.row_cap]
            tj[full] >>= 1
            st.key[R + j, base + full] = tj[full].sum(axis=1, dtype=np.int64)
        st.key[FREQ, keys] += Q4  # 2
        st.glob[l] += Q4 * n
        if st.glob[l] > Q4 * self.freq_cap:
            st.key[FREQ, own] >>= 1
            st.glob[l] = st.key[FREQ, own].sum(dtype=np.int64)
        routed = np.zeros(E, dtype=np.int64)  # 3
        routed[B] = 1
        st.key[HIST, own] = ((st.key[HIST, own] << 1) & ((1 << J) - 1)) | routed
        freq = st.key[FREQ, own].astype(np.int64)  # 4, in int64: the products pass 2**31
        f = ((n * (freq + FLOOR_Q4)) << ONE_SHIFT) // (st.glob[l] + FLOOR_Q4 * E)
        prior = Q4 * self.prior
        v = np.zeros(E, dtype=np.int64)
        for j in range(J):
            p = st.key[T + j * E + B, own].sum(axis=0, dtype=np.int64)
            dj = st.key[R + j, keys].sum(dtype=np.int64)
            v += (((n * p) << ONE_SHIFT) + prior * f) // (dj + prior)
        v += self.recency_q * routed
        st.key[V, own] = np.where((slot_of[own] >= 0) | (routed == 1), v, 0)

    def describe(self) -> str:
        c = self.constants
        return (f"markov(lags={c['lags']}, beta={c['beta']}, row_cap={c['row_cap']}, "
                f"freq_cap={c['freq_cap']}, prior={c['prior']}, recency={c['recency']})")
