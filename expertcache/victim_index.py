"""The compiled replay's victim index: one tournament tree per layer over its experts.

    tv, ts int64 [L, 2P]: node (order value, slot) of layer lk's tree, P = pow2 >= E;
                          leaf P + e is expert e: its key's order if resident and
                          evictable, else (FREE, FREE); node i holds the lower of
                          children 2i and 2i+1 by (value, slot)
    mv, ms int64 [L]:     each tree's root, kept contiguous for the scan across layers

Setting a leaf is O(log E); refilling a whole layer (ix_fill) is O(E). The lowest candidate overall is the lowest (mv
+ off, ms) over the layers, an O(L) scan of two short arrays; taking it out sets its leaf to FREE.
"""

from __future__ import annotations

import numpy as np
from numba import njit

FREE = np.int64(2**62)
MAX = np.int64(2**63 - 1)


def ix_new(num_layers: int, num_experts: int):
    """An empty index: (tv, ts, mv, ms)."""
    p = 1
    while p < num_experts:
        p *= 2
    return (np.full((num_layers, 2 * p), FREE, dtype=np.int64),
            np.full((num_layers, 2 * p), FREE, dtype=np.int64),
            np.full(num_layers, FREE, dtype=np.int64), np.full(num_layers, FREE, dtype=np.int64))


@njit(cache=True, inline="always")
def _pull(tv, ts, layer, i):
    """Node i of layer's tree becomes the lower of its children by (value, slot)."""
    a = 2 * i
    va = tv[layer, a]
    vb = tv[layer, a + 1]
    sa = ts[layer, a]
    sb = ts[layer, a + 1]
    b = (vb < va) | ((vb == va) & (sb < sa))  # no branch: which child wins is data, unpredictable
    tv[layer, i] = vb if b else va
    ts[layer, i] = sb if b else sa


@njit(cache=True, inline="always")
def ix_set(tv, ts, mv, ms, layer, expert, v, s):
    """Leaf `expert` of `layer` becomes (v, s); (FREE, FREE) takes it out."""
    i = (tv.shape[1] >> 1) + expert
    tv[layer, i] = v
    ts[layer, i] = s
    i >>= 1
    while i >= 1:
        _pull(tv, ts, layer, i)
        i >>= 1
    mv[layer] = tv[layer, 1]
    ms[layer] = ts[layer, 1]


@njit(cache=True)
def ix_fill(tv, ts, mv, ms, layer, v, s, pinned, num_pinned):
    """Every leaf of `layer` at once: leaf e becomes (v[e], s[e]) where s[e] >= 0 (a resident key,
    v its order), (FREE, FREE) where s[e] < 0, past len(v) and at the experts pinned[:num_pinned];
    then every node above them. O(E), against O(E log E) for E ix_set calls."""
    p = tv.shape[1] >> 1
    E = v.shape[0]
    lv = tv[layer, p:p + E]
    ls = ts[layer, p:p + E]
    for e in range(E):  # no branch: the loop vectorises
        live = s[e] >= 0
        lv[e] = v[e] if live else FREE
        ls[e] = s[e] if live else FREE
    tv[layer, p + E:] = FREE
    ts[layer, p + E:] = FREE
    for i in range(num_pinned):
        tv[layer, p + pinned[i]] = FREE
        ts[layer, p + pinned[i]] = FREE
    for i in range(p - 1, 0, -1):
        _pull(tv, ts, layer, i)
    mv[layer] = tv[layer, 1]
    ms[layer] = ts[layer, 1]


@njit(cache=True, inline="always")
def ix_best(mv, ms, off):
    """The layer whose root has the lowest (value + off, slot); -1 if every tree is empty. Two min
    reductions without a branch (they vectorise), then the layer that holds both minima."""
    bv = MAX
    for lk in range(mv.shape[0]):
        v = mv[lk] + off[lk]
        bv = min(bv, v if mv[lk] != FREE else MAX)
    bs = MAX
    for lk in range(mv.shape[0]):
        v = mv[lk] + off[lk]
        bs = min(bs, ms[lk] if (mv[lk] != FREE) & (v == bv) else MAX)
    for lk in range(mv.shape[0]):
        if mv[lk] != FREE and ms[lk] == bs and mv[lk] + off[lk] == bv:
            return lk
    return -1
