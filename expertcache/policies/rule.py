"""`rule`: cycle-aware recency plus decayed frequency, with a near-miss refresh.

In a decode sweep a layer's experts are next needed when that layer runs again, so
plain LRU across layers evicts exactly the layer about to run. `rule` scores a resident
key by how many tokens ago it was used *and* how many layer calls remain until its layer
runs again, plus a log-count frequency that halves every HALFLIFE tokens.

Everything is Q16 fixed point (ONE = 2**16), int64. With L MoE layers, current layer l,
`now = tok * L + l`, the decay clock `DC(t) = (t * ONE) // (HALFLIFE * L)` (half-lives
since t = 0, Q16), and per-key state (survives eviction)

    key[LAST_TOK]  token of the last use (-1: never)
    key[LC]        log2 use count, Q16, as of key[DCT]
    key[DCT]       DC(now) at the last use (-1: never)

the score of a resident key of layer lk is

    tok_eff = tok - 1 if lk > l else tok         # layers after l have not run this step
    k       = clamp(tok_eff - LAST_TOK, 0, K_MAX)
    d       = lk - l if lk > l else L - l + lk    # layer calls until lk runs again
    lcv     = max(LC - (DC(now) - DCT), LC_FLOOR)
    score   = -(k * ONE + d * round(BETA * ONE / L)) + ((round(W * 16) * lcv) >> 4)

On a use (hit or install) LC becomes log2(2**lcv + 1), that is
`max(lcv, 0) + T[min(|lcv| >> 10, 1920)]` with the fixed table
`T[i] = round(log2(1 + 2**(-i / 64)) * ONE)`; a first use sets LC = 0; DCT = DC(now),
LAST_TOK = tok. The decay clock is kept per key as DC(now), not `now`: a score then needs
no division per key (one per call, for DC(now)), which is what a device kernel scoring
thousands of slots per call wants (docs/policies.md).

Near-miss refresh (with router logits): in each row, every expert of layer l whose logit
is >= (the row's k-th largest logit) - NEAR gets LAST_TOK = max(LAST_TOK, tok - 1). It is
applied before victims are chosen and pins nothing. Logit entries with index -1 are
padding; a row with fewer than k real entries uses its smallest.

Decay is a difference of the global clock DC, so the score splits exactly: without the
clamps, 16 * score + (16 * score's fraction) = ORDER(key) + OFF(lk, clock) with
`ORDER = 16 * LAST_TOK * ONE + W16 * (LC + DCT)` fixed between uses, and
score = (ORDER + OFF) >> 4; the clamps only raise the score. The compiled replay uses
this as its victim index (see policies.base), so it visits a few keys per miss.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from expertcache.errors import PolicyError
from expertcache.geometry import CacheGeometry
from expertcache.policies.base import (
    CLK_EXPERTS,
    CLK_LAYER,
    CLK_LAYERS,
    CLK_TOK,
    Clock,
    Policy,
    PolicyKind,
    PolicyState,
)

ONE_SHIFT = 16
ONE = 1 << ONE_SHIFT
TABLE_SHIFT = 10  # table step = 2**-6 in log2 units (Q16 >> 10)
TABLE_LEN = 30 * 64 + 1
# T[i] = round(log2(1 + 2^(-i/64)) * ONE); ties cannot occur (the values are irrational).
LOG2_1P_TABLE = np.floor(np.log2(1.0 + 2.0 ** (-np.arange(TABLE_LEN) / 64.0)) * ONE + 0.5).astype(
    np.int64
)

# Every LC a use leaves is at most LC_MAX: from x = lcv >= 30 * ONE the table's index is 1920 and
# T[1920] = 0, so LC = x, which is at most the LC before (DC never runs backwards); below that LC <
# 30 * ONE + T[0] = 31 * ONE. A first use leaves 0, so by induction every key's LC, and every
# resident key's lcv, is at most LC_MAX (Rule.int32_scores uses it).
LC_MAX = 31 * ONE - 1
INT32_MAX = (1 << 31) - 1

LAST_TOK, LC, DCT = 0, 1, 2
# Integer parameter vector (followed by the table).
P_BETA_Q, P_W_Q, P_DECAY_DIV, P_K_MAX, P_LC_FLOOR, P_TABLE = 0, 1, 2, 3, 4, 5
F_NEAR = 0


@njit(cache=True, inline="always")
def _dc(t, prm):
    # Equals (t << 16) // div: both are exact in float64 below 2**52, and a quotient
    # n / div with n < 2**52 is never rounded up to the next integer. Far cheaper than
    # an int64 division on a CPU.
    return np.int64(np.floor(np.float64(t << ONE_SHIFT) / np.float64(prm[P_DECAY_DIV])))


@njit(cache=True, inline="always")
def _decayed(lc, dct, dc_now, prm):
    return max(lc - (dc_now - dct), prm[P_LC_FLOOR])


@njit(cache=True, inline="always")
def touch(kst, prm, clk, key):
    tok = clk[CLK_TOK]
    dc_now = _dc(tok * clk[CLK_LAYERS] + clk[CLK_LAYER], prm)
    if kst[DCT, key] < 0:
        lc = 0
    else:
        x = _decayed(kst[LC, key], kst[DCT, key], dc_now, prm)
        i = abs(x) >> TABLE_SHIFT
        if i > TABLE_LEN - 1:
            i = TABLE_LEN - 1
        lc = max(x, 0) + prm[P_TABLE + i]
    kst[LC, key] = lc
    kst[DCT, key] = dc_now
    kst[LAST_TOK, key] = tok


@njit(cache=True, inline="always")
def score(kst, prm, clk, key):
    num_layers = clk[CLK_LAYERS]
    layer = clk[CLK_LAYER]
    tok = clk[CLK_TOK]
    lk = key // clk[CLK_EXPERTS]
    if lk > layer:
        k = tok - 1 - kst[LAST_TOK, key]
        d = lk - layer
    else:
        k = tok - kst[LAST_TOK, key]
        d = num_layers - layer + lk
    k = min(max(k, 0), prm[P_K_MAX])
    lcv = _decayed(kst[LC, key], kst[DCT, key], _dc(tok * num_layers + layer, prm), prm)
    return -((k << ONE_SHIFT) + d * prm[P_BETA_Q]) + ((prm[P_W_Q] * lcv) >> 4)


@njit(cache=True, inline="always")
def order(kst, prm, key):
    return ((kst[LAST_TOK, key] << ONE_SHIFT) << 4) + prm[P_W_Q] * (
        kst[LC, key] + kst[DCT, key])


@njit(cache=True)
def offsets(prm, clk, off):
    num_layers = clk[CLK_LAYERS]
    layer = clk[CLK_LAYER]
    tok = clk[CLK_TOK]
    common = -prm[P_W_Q] * _dc(tok * num_layers + layer, prm)
    for lk in range(num_layers):
        if lk > layer:
            off[lk] = common - (((tok - 1) << ONE_SHIFT) << 4) - 16 * (lk - layer) * prm[P_BETA_Q]
        else:
            off[lk] = common - ((tok << ONE_SHIFT) << 4) - 16 * (num_layers - layer + lk) * prm[P_BETA_Q]
    return 4


@njit(cache=True)
def _kth_largest(idx, val, k, buf):
    """The min(k, n)-th largest of the n real (idx >= 0) values of one row; NaN if n is 0.
    buf: float32 [>= T] scratch (an insertion sort, descending)."""
    n = 0
    for t in range(idx.shape[0]):
        if idx[t] >= 0:
            v = val[t]
            j = n
            while j > 0 and buf[j - 1] < v:
                buf[j] = buf[j - 1]
                j -= 1
            buf[j] = v
            n += 1
    if n == 0:
        return np.float32(np.nan)
    return buf[min(k, n) - 1]


@njit(cache=True)
def refresh(kst, fprm, clk, logit_idx, logit_val, k, changed, buf):
    base = clk[CLK_LAYER] * clk[CLK_EXPERTS]
    seen = clk[CLK_TOK] - 1
    nchanged = 0
    for r in range(logit_idx.shape[0]):
        kth = _kth_largest(logit_idx[r], logit_val[r], k, buf)
        if np.isnan(kth):
            continue
        thr = kth - fprm[F_NEAR]
        for t in range(logit_idx.shape[1]):
            if logit_idx[r, t] >= 0 and logit_val[r, t] >= thr:
                key = base + logit_idx[r, t]
                if kst[LAST_TOK, key] < seen:
                    kst[LAST_TOK, key] = seen
                    changed[nchanged] = key
                    nchanged += 1
    return nchanged


class Rule(Policy):
    name = "rule"
    key_fields = ("last_tok", "lc", "dct")
    initial = {"last_tok": -1, "lc": 0, "dct": -1}
    uses_logits = True
    kind = PolicyKind.RULE

    def __init__(
        self,
        geometry: CacheGeometry,
        beta: float = 4.0,
        w: float = 3.0,
        halflife: int = 64,
        k_max: int = 16384,
        lc_floor: int = -30,
        near: float = 0.25,
    ) -> None:
        super().__init__(geometry)
        if halflife < 1:
            raise PolicyError(f"rule halflife must be >= 1 token, got {halflife}")
        if k_max < 0 or lc_floor > 0 or near < 0 or beta < 0 or w < 0:
            raise PolicyError(
                "rule constants need beta >= 0, w >= 0, k_max >= 0, lc_floor <= 0, near >= 0; "
                f"got beta={beta}, w={w}, k_max={k_max}, lc_floor={lc_floor}, near={near}"
            )
        L = geometry.num_layers
        self.beta_q = int(np.floor(beta * ONE / L + 0.5))
        self.w_q = int(np.floor(w * 16 + 0.5))
        self.decay_div = halflife * L
        self.k_max = int(k_max)
        self.lc_floor = int(lc_floor) * ONE
        self.near = np.float32(near)
        self.constants = dict(beta=beta, w=w, halflife=halflife, k_max=k_max,
                              lc_floor=lc_floor, near=near)

    def int32_scores(self) -> bool:
        """Whether every score of a resident key, and every term of it, fits in int32 with these
        constants: k in [0, K_MAX], d in [1, L], lcv in [LC_FLOOR, LC_MAX] (see LC_MAX). A device
        kernel then computes the score in 32-bit arithmetic with the same values
        (expertcache.device.cache.resolve_launch: EnsureLaunch.narrow). True for the default constants at any
        layer count."""
        L = self.geometry.num_layers
        high = (self.w_q * LC_MAX) >> 4
        low = ((self.w_q * self.lc_floor) >> 4) - (self.k_max << ONE_SHIFT) - L * self.beta_q
        return (self.k_max << ONE_SHIFT <= INT32_MAX and L * self.beta_q <= INT32_MAX
                and self.w_q * LC_MAX <= INT32_MAX and self.w_q * self.lc_floor >= -INT32_MAX - 1
                and high <= INT32_MAX and low >= -INT32_MAX - 1)

    def params(self) -> np.ndarray:
        head = [self.beta_q, self.w_q, self.decay_div, self.k_max, self.lc_floor]
        return np.concatenate([np.array(head, dtype=np.int64), LOG2_1P_TABLE])

    def fparams(self) -> np.ndarray:
        return np.array([self.near], dtype=np.float32)

    def _lcv(self, st: PolicyState, keys: np.ndarray, now: int) -> np.ndarray:
        dc_now = (now << ONE_SHIFT) // self.decay_div
        return np.maximum(st.key[LC, keys] - (dc_now - st.key[DCT, keys]), self.lc_floor)

    def refresh(self, st, clk: Clock, logit_idx, logit_val, k) -> None:
        for idx_row, val_row in zip(logit_idx, logit_val):
            real = idx_row >= 0
            if not real.any():
                continue
            vals = np.sort(val_row[real])[::-1]
            kth = vals[min(k, len(vals)) - 1]
            near = real & (val_row >= kth - self.near)
            keys = clk.layer * clk.num_experts + idx_row[near].astype(np.int64)
            st.key[LAST_TOK, keys] = np.maximum(st.key[LAST_TOK, keys], clk.tok - 1)

    def on_hit(self, st: PolicyState, clk: Clock, keys, slots, access) -> None:
        now = clk.tok * clk.num_layers + clk.layer
        x = self._lcv(st, keys, now)
        grown = np.maximum(x, 0) + LOG2_1P_TABLE[np.minimum(np.abs(x) >> TABLE_SHIFT, TABLE_LEN - 1)]
        st.key[LC, keys] = np.where(st.key[DCT, keys] < 0, 0, grown)
        st.key[DCT, keys] = (now << ONE_SHIFT) // self.decay_div
        st.key[LAST_TOK, keys] = clk.tok

    on_install = on_hit

    def on_served(self, st: PolicyState, clk: Clock, keys, access) -> None:
        """A miss served on the CPU was used: its per-key state records the use, as a hit's does."""
        self.on_hit(st, clk, keys, None, access)

    def miss_priority(self, st: PolicyState, clk: Clock, keys, access) -> np.ndarray:
        """The score each missing key would have if resident (recency and decayed frequency)."""
        return self.scores(st, clk, keys, None)

    def scores(self, st: PolicyState, clk: Clock, keys, slots) -> np.ndarray:
        L, l, tok = clk.num_layers, clk.layer, clk.tok
        lk = keys // clk.num_experts
        later = lk > l
        k = np.where(later, tok - 1, tok) - st.key[LAST_TOK, keys]
        k = np.clip(k, 0, self.k_max)
        d = np.where(later, lk - l, L - l + lk)
        lcv = self._lcv(st, keys, tok * L + l)
        return -((k << ONE_SHIFT) + d * self.beta_q) + ((self.w_q * lcv) >> 4)

    def describe(self) -> str:
        c = self.constants
        return (f"rule(beta={c['beta']}, w={c['w']}, halflife={c['halflife']}, "
                f"near={c['near']})")
