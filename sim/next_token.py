"""`next-token`: the oracle that knows only the next token's routing, the ceiling of a policy that
predicts one token ahead (as `markov` does) where `belady`, knowing the whole future, is the ceiling of
any policy.

At the call of layer l of token t it knows the routing of the next W calls (W = the trace's layer count
by default: the rest of token t and token t + 1 up to layer l, one token of every layer). A resident
key whose next use falls in that window is known; the others are not. Victims, under the ensure
contract (every key of a call resident at once, the call's hits pinned):
    the unknown keys first, least recently used first; then the known keys, furthest next use first;
    ties by slot, ascending.
So W = 0 is `lru`, slot for slot: the same free-slot order, victim order and install order (a call's
misses in ascending key order into its victims in ascending (score, slot) order) as the compiled
replay of expertcache.replay; and a window past the trace's end has `belady`'s misses, call for call
(tests/sim/test_next_token.py).

    ids [C, rows, k], layers [C] -> accesses (sim.belady.call_keys) and each one's next use
    -> one pass over the calls, each eviction a scan of the slots (O(calls with evictions * S * m))
    -> per-layer accesses and misses, and the histogram of calls by misses, as a ReplayResult has them
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sim.belady import call_keys, next_use

UNKNOWN = np.int64(1) << np.int64(61)  # below every known key's score (-next use > -2**62)


@njit(cache=True)
def _replay(call, key, nxt, layers, num_slots, window, num_keys, accesses, misses, hist, call_misses):
    """The replay of the module docstring over the accesses (call, key, nxt: int64 [A], calls in order,
    each call's keys ascending); fills accesses / misses [L], hist [L, M] and, when it has an entry a
    call, call_misses [C] in place."""
    S = num_slots
    slot_of = np.full(num_keys, -1, np.int64)
    key_of = np.full(S, -1, np.int64)
    last = np.zeros(S, np.int64)  # the call count (this call included) at the slot key's last use
    next_of = np.zeros(num_keys, np.int64)  # the key's next use, from its latest access
    pinned = np.full(S, -1, np.int64)  # the call that pins the slot
    score = np.empty(S, np.int64)
    vslot = np.empty(S, np.int64)
    miss_keys = np.empty(S + 1, np.int64)
    miss_next = np.empty(S + 1, np.int64)
    filled = 0
    a = 0
    A = call.shape[0]
    for c in range(layers.shape[0]):
        layer = layers[c]
        step = c + 1
        m = 0
        n = 0
        while a < A and call[a] == c:
            x = key[a]
            s = slot_of[x]
            if s >= 0:  # a hit: touched and pinned
                last[s] = step
                next_of[x] = nxt[a]
                pinned[s] = c
            else:
                miss_keys[m] = x
                miss_next[m] = nxt[a]
                m += 1
            n += 1
            a += 1
        free = min(m, S - filled)
        for j in range(free):
            vslot[j] = filled + j
        need = m - free
        if need > 0:  # every slot below `filled` holds a key; the ones above are this call's free ones
            for s in range(filled):
                t = next_of[key_of[s]]
                score[s] = -t if t <= c + window else last[s] - UNKNOWN
            for j in range(need):  # the need lowest (score, slot), ascending
                best = -1
                for s in range(filled):
                    if pinned[s] != c and (best < 0 or score[s] < score[best]):
                        best = s
                vslot[free + j] = best
                pinned[best] = c  # taken
        filled += free
        for j in range(m):  # install in ascending key order
            s = vslot[j]
            old = key_of[s]
            if old >= 0:
                slot_of[old] = -1
            key_of[s] = miss_keys[j]
            slot_of[miss_keys[j]] = s
            last[s] = step
            next_of[miss_keys[j]] = miss_next[j]
            pinned[s] = c
        accesses[layer] += n
        misses[layer] += m
        hist[layer, m] += 1
        if call_misses.shape[0] == layers.shape[0]:
            call_misses[c] = m


def replay_next_token(ids: np.ndarray, layers: np.ndarray, num_layers: int, num_experts: int, num_slots: int,
                      window: int | None = None, call_misses: np.ndarray | None = None,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layer accesses int64 [L], layer misses int64 [L], hist int64 [L, rows * k + 1]) of the calls
    ids int32 [C, rows, k] (-1 = none), layers [C] through the next-token oracle with `num_slots` slots
    (cold start) and a window of `window` calls (default num_layers); call_misses int64 [C], when given,
    receives each call's misses. Raises ValueError naming
    num_slots when a call asks for more distinct experts than slots, or window when negative."""
    window = num_layers if window is None else int(window)
    if window < 0:
        raise ValueError(f"next-token: window must be >= 0 calls, got {window}")
    layers = np.asarray(layers, dtype=np.int64)
    call, key = call_keys(ids, layers, num_experts)
    per_call = np.bincount(call, minlength=ids.shape[0]) if call.size else np.zeros(ids.shape[0], np.int64)
    if per_call.size and per_call.max() > num_slots:
        raise ValueError(f"next-token: a call asks for {int(per_call.max())} distinct experts, more than "
                         f"num_slots={num_slots}")
    accesses = np.zeros(num_layers, np.int64)
    misses = np.zeros(num_layers, np.int64)
    hist = np.zeros((num_layers, ids.shape[1] * ids.shape[2] + 1), np.int64)
    _replay(call, key, next_use(call, key), layers, np.int64(num_slots), np.int64(min(window, 1 << 60)),
            np.int64(num_layers * num_experts), accesses, misses, hist,
            np.zeros(0, np.int64) if call_misses is None else call_misses)
    return accesses, misses, hist
