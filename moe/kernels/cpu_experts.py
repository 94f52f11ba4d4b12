"""Routed experts computed on the CPU, reading each expert in place from the HostStore (numba, float32).

    x [T, H] float32, ids [T, k] int32 (expert of MoE layer `layer`, -1: not the CPU's), weights [T, k],
    split: None or (expert, cut)
        │ plan (the caller): units = the distinct keys layer * E + id in order of first appearance (the
        │                split expert's moved last), each with its tokens in increasing order and its
        │                rows c[u] (I; cut for the split expert); unit_of / pos_of [T, k] locate (t, j)'s result
        ├─ gate_up_rows  items (unit, GATE_UP_ROWS block of i < c[u]): act[u, t, p(i)] =
        │                act(gate_i · x[t] + b_gate_i, up_i · x[t] + b_up_i), t the unit's tokens   [U, T, I]
        ├─ down_rows     items (unit, DOWN_ROWS block of o), once every gate_up item is done:
        │                y[u, tt, o] = down_o[:c[u]] · act[u, t, :c[u]] + b_o (tt: t's place among the
        │                unit's tokens; no b_o for the split expert)
        └─ combine_rows  the caller: out[t, o] = Σ_{j ascending, ids[t, j] >= 0} weights[t, j] * y[u, tt, o]
                         with (u, tt) = (unit_of[t, j], pos_of[t, j])

A split expert is computed in two parts that add up to the whole: the CPU takes its intermediate rows
[0, cut) (gate and up rows, down's columns) here, the GPU the rows [cut, I) from a scratch slot the link
copied them into, with down's bias (expertcache.split: the split evens out the two channels' times to
within a granule of rows rather than a whole expert). p(i) places act in down's input order for a matrix
of c[u] columns: i, or for the packed formats chunk_place(i, c[u]) (moe.kernels.cpu_decode), so down's dots
read the first c[u] columns of each row and only their bytes and scales.

Legend: T = tokens (1..MAX_TOKENS), H = hidden, I = expert width, k = top_k, E = experts a layer,
U = units (<= T * k). act = silu(gate) * up, or gpt-oss's (clamp(up, -l, l) + 1) * g * sigmoid(alpha g)
with g = min(gate, l) (moe.model.reference.gated_activation). Each key's weights are read from memory once
per call, for all of its tokens, and decoded in registers by the format's row dots (moe.kernels.cpu_dots:
one token fused, more in passes of 4 that decode each byte once a pass). The packed 4-bit formats take
their input in chunk order (cpu_decode.chunk_place): x is placed so once per call and gate_up_rows writes
act so.

The items run on the calling thread and a pool of persistent threads (set_threads' count in all), which
take them one at a time by compare-exchange on a ticket; between calls the pool's threads spin for up to
`spin_pauses` waits, then sleep until the next call. A decode's hand-off (moe.engine.handoff) keeps them
spinning: its layer calls come back to back, and waking sleeping threads (futex wake-ups, on a VM's vCPUs
inter-processor interrupts) would be the CPU share's fixed cost. The CPU backend, whose torch work runs
between the calls on the same cores, lets them sleep at once.

Every output element is computed by one work item in one fixed order, and every thread runs the items
through one compiled function (pool_run, with one call site of the item loop, so no thread's copy is
optimized apart), so results are bitwise equal for any thread count or schedule (the order does depend
on the routing and the split: an expert with one token takes the fused dot, one with more the 4-token
passes, which may differ in the last bits). The kernels release the GIL; scratch (act, y, the plan) belongs to the
CpuExperts, so one call runs at a time per instance (a lock).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import njit

from expertcache.formats import bank_name
from expertcache.numba_cache import drop_stale_kernels
from expertcache.pool import HostStore
from expertcache.split import tail_granule
from moe.kernels import cpu_decode, cpu_dots
from moe.kernels.cpu_atomics import compare_exchange, cpu_relax, fetch_add, load_acquire, store_release
from moe.kernels.cpu_decode import FASTMATH, KERNEL, WORD_BF16, WORD_F16, chunk_place, stack_array, word_f32
from moe.kernels.cpu_dots import rows_dense, rows_fp8, rows_int4, rows_mxfp4, rows_nvfp4
from moe.model.config import ACTIVATIONS, EXPERT_BIAS_BANKS, MoEConfig
from moe.model.slot_matrix import CODES

MAX_TOKENS = 8
# waits (cpu_relax) a pool thread spins for the next call before it sleeps: a few milliseconds, above the
# gap between a decode step's layer calls, so a hand-off finds its threads awake
SPIN_PAUSES = 100_000
_THREADS: list[int] = []  # set_threads' count (the process's, whichever thread calls)


def set_threads(n: int | None) -> None:
    """Run every later CpuExperts.moe on n threads, the calling one and n - 1 of its pool (None: numba's
    NUMBA_NUM_THREADS, by default every core). A pool of another size is replaced at its next call."""
    _THREADS[:] = [] if n is None else [int(n)]


def threads_in_use() -> int:
    """The threads a CpuExperts.moe call runs on now (set_threads', else NUMBA_NUM_THREADS)."""
    return _THREADS[0] if _THREADS else numba.config.NUMBA_NUM_THREADS


GATE_UP_ROWS = 8  # intermediate rows (each a gate and an up row) of a gate_up work item
DOWN_ROWS = 32  # output rows of a down work item
DENSE, FP8, NVFP4, MXFP4, INT4 = 0, CODES["fp8"], CODES["nvfp4"], CODES["mxfp4"], CODES["int4"]
WORD_F32 = 2  # a dense float32 matrix / float32 biases (beside cpu_decode's 16-bit words)
NO_BIAS = -1
SILU, SWIGLU_CLAMPED = ACTIVATIONS.index("silu"), ACTIVATIONS.index("swiglu_clamped")
WORDS = {"bfloat16": WORD_BF16, "float16": WORD_F16, "float32": WORD_F32}

# the kernels here inline cpu_decode's and cpu_dots': recompile them when one of those changes
drop_stale_kernels(__file__, (cpu_decode, cpu_dots))


class Matrix(NamedTuple):
    """One expert matrix of every key as the kernels read it (gate_up: 2 stacked sub-matrices of I rows,
    down: 1 of H). Each array is a zero-copy view of a HostStore bank flattened to [num_keys, -1], or a
    [1, 1] placeholder for a part the format lacks."""

    rows: int  # rows of one sub-matrix
    cols: int  # in_features
    words: np.ndarray  # uint16: bf16 / f16 dense values
    floats: np.ndarray  # float32: float32 dense values
    q: np.ndarray  # uint8: fp8 bytes, 4-bit codes two a byte
    s8: np.ndarray  # uint8: nvfp4 e4m3 scales, mxfp4 e8m0 scales
    s16: np.ndarray  # uint16: int4 bf16 / f16 scales
    s32: np.ndarray  # float32: fp8 block scales, nvfp4 global scales (one per sub-matrix)
    z: np.ndarray  # uint8: int4 zero points
    bias16: np.ndarray  # uint16: bias [num_keys, stack * rows] in a 16-bit model dtype
    bias32: np.ndarray  # float32: bias in a float32 model


class Spec(NamedTuple):
    """What the kernels compute: the format (CODES; DENSE 0), how its words read, the activation."""

    fmt: int
    word: int  # dense values / int4 scales: WORD_BF16, WORD_F16 (WORD_F32: a float32 dense matrix)
    zero_points: bool  # int4 with a zero-point bank
    packed: bool  # 4-bit codes two a byte: inputs in chunk order (chunk_place)
    bias: int  # NO_BIAS, or the biases' word (WORD_BF16, WORD_F16, WORD_F32)
    activation: int  # SILU or SWIGLU_CLAMPED
    alpha: float
    limit: float


class Scratch(NamedTuple):
    """A call's intermediate arrays, made once per CpuExperts (U = MAX_TOKENS * top_k units at most)."""

    xin: np.ndarray  # float32 [MAX_TOKENS, H]: x in gate_up's input order
    act: np.ndarray  # float32 [U, MAX_TOKENS, I]: a unit's activations by token, in down's input order
    y: np.ndarray  # float32 [U, MAX_TOKENS, H]: a unit's expert outputs by place among its tokens
    unit_key: np.ndarray  # int64 [U]
    unit_tok: np.ndarray  # int64 [U, MAX_TOKENS]: a unit's tokens, increasing
    unit_m: np.ndarray  # int64 [U]: its token count
    unit_cut: np.ndarray  # int64 [U]: its intermediate rows computed, I (a split expert: cut; only the last unit)
    unit_of: np.ndarray  # int64 [MAX_TOKENS, k]: the unit of (t, j), -1 where ids[t, j] < 0
    pos_of: np.ndarray  # int64 [MAX_TOKENS, k]: t's place among that unit's tokens


@njit(**KERNEL)
def rows_dot(m, spec, key, r0, r1, k, xin, toks, ntok, out, col0):
    """out[tt, col0 + r - r0] = W'[r, :k] · xin[toks[tt], :k] for the (stacked) rows r in [r0, r1) of key `key`'s
    matrix m and tt < ntok: a row's first k <= m.cols columns (k a multiple of the format's scale block where
    k < m.cols); xin float32 [*, >= m.cols] in the format's input order for k columns, out float32 [>= ntok, *]."""
    n = m.cols
    if spec.fmt == DENSE:
        if spec.word == WORD_F32:
            rows_dense(m.floats[key], n, k, r0, r1, xin, toks, ntok, out, col0, spec.word)
        else:
            rows_dense(m.words[key], n, k, r0, r1, xin, toks, ntok, out, col0, spec.word)
    elif spec.fmt == FP8:
        rows_fp8(m.q[key], m.s32[key], n, k, m.rows, r0, r1, xin, toks, ntok, out, col0)
    elif spec.fmt == INT4:
        z = m.z[key] if spec.zero_points else m.z[0]
        rows_int4(m.q[key], m.s16[key], z, n, k, r0, r1, xin, toks, ntok, out, col0, spec.word, spec.zero_points)
    elif spec.fmt == NVFP4:
        rows_nvfp4(m.q[key], m.s8[key], m.s32[key], n, k, m.rows, r0, r1, xin, toks, ntok, out, col0)
    else:
        rows_mxfp4(m.q[key], m.s8[key], n, k, r0, r1, xin, toks, ntok, out, col0)


@njit(**KERNEL)
def bias_of(m, spec, key, row):
    """Bias of row `row` (stacked index) of key `key`'s matrix, float32 (0 without biases)."""
    if spec.bias == NO_BIAS:
        return np.float32(0)
    if spec.bias == WORD_F32:
        return m.bias32[key, row]
    return word_f32(m.bias16[key, row], spec.bias)


@njit(**KERNEL, fastmath=FASTMATH)
def activation(gate, up, spec):
    """silu(gate) * up, or gpt-oss's clamped SwiGLU (spec.activation), float32."""
    if spec.activation == SILU:
        return gate / (np.float32(1) + np.exp(-gate)) * up
    limit = np.float32(spec.limit)
    g = min(gate, limit)
    u = max(min(up, limit), -limit)
    return (u + np.float32(1)) * (g / (np.float32(1) + np.exp(-np.float32(spec.alpha) * g)))


_gate_up_block = stack_array(MAX_TOKENS, 2 * GATE_UP_ROWS)  # [tt, gate rows | up rows] of a block


@njit(**KERNEL)
def gate_up_rows(gu, spec, key, i0, i1, cols, xin, toks, ntok, act):
    """act[toks[tt], p(i)] = activation(gate_i · xin[toks[tt]] + b_gate_i, up_i · xin[toks[tt]] + b_up_i) of key
    `key` for i in [i0, i1), tt < ntok; p(i) is the input order of a down matrix of `cols` columns (the
    unit's rows, I or a split expert's cut; chunk_place(i, cols) when spec.packed). xin float32
    [*, H] in gate_up's input order, toks int64 [>= ntok] (token rows), act float32 [*, I]."""
    inter = gu.rows
    block = _gate_up_block()
    # the block's columns of gate and up rows; np.int64 keeps a constant from typing as a literal, which
    # would compile every row function once more for it
    gate_col, up_col = np.int64(0), np.int64(GATE_UP_ROWS)
    for b0 in range(i0, i1, GATE_UP_ROWS):
        b1 = min(i1, b0 + GATE_UP_ROWS)
        rows_dot(gu, spec, key, b0, b1, gu.cols, xin, toks, ntok, block, gate_col)
        rows_dot(gu, spec, key, inter + b0, inter + b1, gu.cols, xin, toks, ntok, block, up_col)
        for i in range(b0, b1):
            p = chunk_place(i, cols) if spec.packed else i
            b_gate, b_up = bias_of(gu, spec, key, i), bias_of(gu, spec, key, inter + i)
            for tt in range(ntok):
                gate, up = block[tt, gate_col + i - b0] + b_gate, block[tt, up_col + i - b0] + b_up
                act[toks[tt], p] = activation(gate, up, spec)


@njit(**KERNEL)
def down_rows(dn, spec, key, o0, o1, cols, act, toks, ntok, y):
    """y[tt, o] = down_o[:cols] · act[toks[tt], :cols] + b_o of key `key` for o in [o0, o1), tt < ntok: the
    first `cols` columns (I, or a split expert's cut: then no b_o, which the GPU's part adds). act float32
    [*, I] in down's input order for `cols` columns (gate_up_rows' output), toks int64 [>= ntok], y float32
    [>= ntok, H]."""
    rows_dot(dn, spec, key, o0, o1, cols, act, toks, ntok, y, o0)
    if spec.bias != NO_BIAS and cols == dn.cols:
        for o in range(o0, o1):
            b = bias_of(dn, spec, key, o)
            for tt in range(ntok):
                y[tt, o] += b


@njit(**KERNEL, fastmath=FASTMATH)
def combine_rows(o0, o1, unit_of, pos_of, weights, y, out):
    """out[t, o0:o1] = Σ_{j ascending, unit_of[t, j] >= 0} weights[t, j] * y[unit_of[t, j], pos_of[t, j], o0:o1]
    for t < out.shape[0]."""
    for t in range(out.shape[0]):
        dst = out[t, o0:o1]
        for o in range(o1 - o0):
            dst[o] = 0
        for j in range(unit_of.shape[1]):
            u = unit_of[t, j]
            if u >= 0:
                w = weights[t, j]
                src = y[u, pos_of[t, j], o0:o1]
                for o in range(o1 - o0):
                    dst[o] += w * src[o]


@njit(**KERNEL)
def plan_units(ids, layer, num_experts, split, cut, inter, sc):
    """Fill sc's unit arrays from ids [T, k] (row-major first appearance order); the unit of expert `split`
    (-1: none) computes rows [0, cut) of its `inter` and is then moved last, so that only the last unit's
    gate_up items are fewer (_phase). Returns the unit count."""
    n = 0
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                sc.unit_of[t, j] = -1
                continue
            key = layer * num_experts + ids[t, j]
            u = 0
            while u < n and sc.unit_key[u] != key:
                u += 1
            if u == n:
                sc.unit_key[u] = key
                sc.unit_m[u] = 0
                sc.unit_cut[u] = cut if ids[t, j] == split else inter
                n += 1
            m = sc.unit_m[u]
            if m == 0 or sc.unit_tok[u, m - 1] != t:  # t repeats only within its own row
                sc.unit_tok[u, m] = t
                sc.unit_m[u] = m + 1
            sc.unit_of[t, j] = u
            sc.pos_of[t, j] = sc.unit_m[u] - 1
    s = 0
    while s < n and sc.unit_cut[s] == inter:
        s += 1
    last = n - 1
    if s < last:  # swap the split unit with the last one
        sc.unit_key[s], sc.unit_key[last] = sc.unit_key[last], sc.unit_key[s]
        sc.unit_m[s], sc.unit_m[last] = sc.unit_m[last], sc.unit_m[s]
        sc.unit_cut[s], sc.unit_cut[last] = sc.unit_cut[last], sc.unit_cut[s]
        for i in range(sc.unit_tok.shape[1]):
            sc.unit_tok[s, i], sc.unit_tok[last, i] = sc.unit_tok[last, i], sc.unit_tok[s, i]
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                if sc.unit_of[t, j] == s:
                    sc.unit_of[t, j] = last
                elif sc.unit_of[t, j] == last:
                    sc.unit_of[t, j] = s
    return n


@njit(**KERNEL)
def input_order(spec, x, xin):
    """xin[t] = x[t] in gate_up's input order (chunk_place when spec.packed) for t < T."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        for c in range(n):
            xin[t, chunk_place(c, n) if spec.packed else c] = x[t, c]


# The pool's control words (int64), each on a cache line of its own. A ticket is tag << TAG_SHIFT | the
# phase's next item, tag the call's generation: a thread takes an item only by a compare-exchange on a
# ticket of the generation it saw published, so a thread that arrives late, or still runs the previous
# call's loop, takes nothing of a later call.
_LINE = 8
GEN, UNITS, TICKET_UP, DONE_UP, TICKET_DOWN, DONE_DOWN, STOP, ASLEEP = (i * _LINE for i in range(8))
CTRL_WORDS = 8 * _LINE  # ASLEEP: the pool's threads asleep (not spinning) now
TAG_SHIFT, ITEM_MASK, GEN_MASK = 32, (1 << 32) - 1, (1 << 31) - 1


@njit(**KERNEL)
def _take(ctrl, ticket, gen, total):
    """The next item below `total` of phase `ticket` in call `gen`, or -1 (none left, or another call's)."""
    while True:
        t = load_acquire(ctrl, ticket)
        if (t >> TAG_SHIFT) != gen or (t & ITEM_MASK) >= total:
            return -1
        if compare_exchange(ctrl, ticket, t, t + 1) == t:
            return t & ITEM_MASK


@njit(**KERNEL)
def _phase(ctrl, gu, dn, spec, sc, gen, n, down):
    """Take and compute call `gen`'s items of one phase (down: the down rows, else the gate_up rows) of its
    n units until none is left, counting each done; returns the phase's item count. Item u * blocks + b is
    unit u's block b; the last unit's gate_up blocks end at its rows (sc.unit_cut, plan_units)."""
    rows, step = (dn.rows, DOWN_ROWS) if down else (gu.rows, GATE_UP_ROWS)
    ticket, done = (TICKET_DOWN, DONE_DOWN) if down else (TICKET_UP, DONE_UP)
    blocks = (rows + step - 1) // step
    total = n * blocks
    if n > 0 and not down:
        total -= blocks - (sc.unit_cut[n - 1] + step - 1) // step
    while True:
        item = _take(ctrl, ticket, gen, total)
        if item < 0:
            return total
        u, b = item // blocks, item % blocks
        r0, cut = b * step, sc.unit_cut[u]
        if down:
            r1 = min(rows, r0 + step)
            down_rows(dn, spec, sc.unit_key[u], r0, r1, cut, sc.act[u], sc.unit_tok[u], sc.unit_m[u], sc.y[u])
        else:
            r1 = min(cut, r0 + step)
            gate_up_rows(gu, spec, sc.unit_key[u], r0, r1, cut, sc.xin, sc.unit_tok[u], sc.unit_m[u], sc.act[u])
        fetch_add(ctrl, done, 1)


@njit(**KERNEL)
def run_call(ctrl, gu, dn, spec, sc, gen):
    """Take and compute call `gen`'s gate_up items until none is left, wait for every one of them to be
    done, then the same for its down items (any number of threads at once, the caller among them).
    Returns the down item count, or -1 where a later call was published meanwhile."""
    n = load_acquire(ctrl, UNITS)
    total = _phase(ctrl, gu, dn, spec, sc, gen, n, False)
    while load_acquire(ctrl, DONE_UP) < total:  # every act row is written before a down item reads it
        if load_acquire(ctrl, GEN) != gen:
            return -1
        cpu_relax()
    return _phase(ctrl, gu, dn, spec, sc, gen, n, True)


@njit(**KERNEL, inline="always")
def _publish(ctrl, spec, layer, num_experts, split, cut, inter, x, ids, sc):
    """The leader's start of a call: plan it and publish it; returns its generation. The tickets move to
    the new call first, so no thread of the previous call takes an item while the plan is rewritten; the
    plan is published with the generation (release)."""
    gen = (ctrl[GEN] + 1) & GEN_MASK
    store_release(ctrl, TICKET_UP, gen << TAG_SHIFT)
    store_release(ctrl, TICKET_DOWN, gen << TAG_SHIFT)
    store_release(ctrl, DONE_UP, 0)
    store_release(ctrl, DONE_DOWN, 0)
    n = plan_units(ids, layer, num_experts, split, cut, inter, sc)
    input_order(spec, x, sc.xin)
    store_release(ctrl, UNITS, n)
    store_release(ctrl, GEN, gen)
    return gen


@njit(**KERNEL)
def pool_run(ctrl, gu, dn, spec, sc, lead, layer, num_experts, split, cut, x, ids, weights, out, spin, last):
    """Every thread's one entry, so that each work item runs the same compiled code whichever thread
    takes it (run_call has one call site here). lead: the calling thread of CpuExperts.moe: publish the
    call of layer / x / ids / split (the split expert, -1: none) and cut, take part, wait for every down
    item, then out [T, H] = the combined experts (serial: T * k * H multiply-adds cost less than handing
    them out); returns its generation. Otherwise a pool thread (split, cut, x, ids, weights, out unread):
    take part in every call published after generation `last`; return the last one seen once `spin` waits
    (cpu_relax) pass with no new call, or -1 when STOP is set. Arguments trusted."""
    while True:
        if lead:
            gen = _publish(ctrl, spec, layer, num_experts, split, cut, gu.rows, x, ids, sc)
        else:
            waited = 0
            gen = load_acquire(ctrl, GEN)
            while gen == last:
                if load_acquire(ctrl, STOP) != 0:
                    return -1
                if waited >= spin:
                    return last
                waited += 1
                cpu_relax()
                gen = load_acquire(ctrl, GEN)
        total = run_call(ctrl, gu, dn, spec, sc, gen)
        if lead:  # its own call: never overtaken, so total is its down item count
            while load_acquire(ctrl, DONE_DOWN) < total:
                cpu_relax()
            combine_rows(0, dn.rows, sc.unit_of[:x.shape[0]], sc.pos_of[:x.shape[0]], weights, sc.y, out)
            return gen
        last = gen


def _halt(ctrl: np.ndarray, cond: threading.Condition, threads: list[threading.Thread]) -> None:
    """Set STOP, wake every sleeping pool thread and wait for each to return (but the calling one). Run
    by close, when the owner is collected, and at exit: a thread still in its kernel as the interpreter
    finalizes would be ended inside it, which aborts the process."""
    ctrl[STOP] = 1
    with cond:
        cond.notify_all()
    for t in threads:
        if t is not threading.current_thread() and t.ident is not None:
            t.join(timeout=10)


class _Pool:
    """`size` persistent threads that take part in a CpuExperts' calls beside the calling thread.

    A thread spins (pool_run) up to the owner's `spin_pauses` waits for the next call, then sleeps on a
    condition until one is published; `wake` (before each call) notifies the sleepers. The threads hold
    the owner only weakly while asleep: once it is collected they stop."""

    def __init__(self, owner: CpuExperts, size: int) -> None:
        self.size, self.ctrl, self.cond = size, np.zeros(CTRL_WORDS, np.int64), threading.Condition()
        self.threads = [threading.Thread(target=_pool_thread, args=(weakref.ref(owner), self), daemon=True,
                                         name=f"expertcache-cpu-experts-{i}") for i in range(size)]
        self._finalizer = weakref.finalize(owner, _halt, self.ctrl, self.cond, self.threads)  # also at exit
        for t in self.threads:
            t.start()

    def wake(self) -> None:
        if self.ctrl[ASLEEP]:
            with self.cond:
                self.cond.notify_all()

    def close(self) -> None:
        self._finalizer()


def _pool_thread(owner_ref, pool: _Pool) -> None:
    last = 0
    while True:
        owner = owner_ref()
        if owner is None:
            return
        g, spin, idle = owner._kernel_args, owner.spin_pauses, owner._idle_args
        del owner
        last = int(pool_run(pool.ctrl, *g, False, 0, 1, -1, 0, *idle, spin, last))
        del g, idle
        if last < 0:
            return
        with pool.cond:
            pool.ctrl[ASLEEP] += 1
            while pool.ctrl[GEN] == last and not pool.ctrl[STOP]:
                pool.cond.wait()
            pool.ctrl[ASLEEP] -= 1
        if pool.ctrl[STOP]:
            return


# (part suffix, part dtype) -> the Matrix field that holds it
_FIELDS = {("", "bfloat16"): "words", ("", "float16"): "words", ("", "float32"): "floats", ("q", "uint8"): "q",
           ("q", "float8_e4m3fn"): "q", ("s", "float32"): "s32", ("s", "float8_e4m3fn"): "s8", ("s", "uint8"): "s8",
           ("s", "bfloat16"): "s16", ("s", "float16"): "s16", ("s2", "float32"): "s32", ("z", "uint8"): "z"}


def _placeholder(dtype) -> np.ndarray:
    return np.zeros((1, 1), dtype=dtype)


def _view(store: HostStore, name: str, dtype) -> np.ndarray:
    """Bank `name` as a numpy [num_keys, -1] array of `dtype` over the same bytes (no copy)."""
    t = store.tensor(name)
    return t.view(torch.uint8).numpy().reshape(store.num_keys, -1).view(dtype)


def _matrix(store: HostStore, cfg: MoEConfig, name: str, rows: int, cols: int, stack: int) -> Matrix:
    fmt = cfg.format
    by = {p.suffix: p for p in fmt.layout(stack * rows, cols, stack)}
    views = dict(words=_placeholder(np.uint16), floats=_placeholder(np.float32), q=_placeholder(np.uint8),
                 s8=_placeholder(np.uint8), s16=_placeholder(np.uint16), s32=_placeholder(np.float32),
                 z=_placeholder(np.uint8), bias16=_placeholder(np.uint16), bias32=_placeholder(np.float32))
    for suffix, part in by.items():
        field = _FIELDS[(suffix, part.dtype)]
        views[field] = _view(store, bank_name(name, suffix), views[field].dtype)
    if cfg.expert_bias:
        bank = EXPERT_BIAS_BANKS[0] if name == "gate_up" else EXPERT_BIAS_BANKS[1]
        field = "bias32" if cfg.dtype == "float32" else "bias16"
        views[field] = _view(store, bank, views[field].dtype)
    return Matrix(rows, cols, **views)


def _spec(cfg: MoEConfig) -> Spec:
    fmt = cfg.format
    if not fmt.dense and fmt.name not in CODES:
        raise ValueError(f"CpuExperts: MoEConfig.expert_format={cfg.expert_format!r} has no CPU kernel; "
                         f"it computes the dense formats and {sorted(CODES)} (with the int4 variants)")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"CpuExperts: MoEConfig.activation={cfg.activation!r} is not one of {ACTIVATIONS}")
    word = WORDS[fmt.dtype] if fmt.dense else WORDS[getattr(fmt, "scale_dtype", "bfloat16")]
    return Spec(fmt=0 if fmt.dense else CODES[fmt.name], word=word,
                zero_points=bool(getattr(fmt, "zero_points", False)), packed=fmt.pack == 2,
                bias=WORDS[cfg.dtype] if cfg.expert_bias else NO_BIAS,
                activation=ACTIVATIONS.index(cfg.activation), alpha=float(cfg.swiglu_alpha),
                limit=float(cfg.swiglu_limit))


def _array(name: str, value, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """`value` (numpy array or CPU torch tensor) as a C-contiguous numpy array of dtype and shape, or
    ValueError naming `name`."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        value = value.numpy()
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape \
            or not value.flags.c_contiguous:
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise ValueError(f"CpuExperts.moe: {name} must be a C-contiguous {np.dtype(dtype).name} array "
                         f"{list(shape)} (numpy or CPU torch), got {got}")
    return value


class CpuExperts:
    """The routed experts of a HostStore, computed on the CPU (the module's pipeline).

    store: a HostStore whose banks are exactly cfg.expert_banks() (any format the routed kernels
    compute: bf16 / float16 / float32, fp8, int4 and its variants, nvfp4, mxfp4), L * E keys.
    cfg: hidden H, expert_intermediate I, num_experts E, top_k k, expert_format, activation and its
    alpha / limit, expert_bias. The banks are read in place (numpy views, no copy).
    Raises ValueError naming the MoEConfig field (format, activation) or the store banks that disagree.
    """

    def __init__(self, store: HostStore, cfg: MoEConfig) -> None:
        self.spec = _spec(cfg)
        want = cfg.expert_banks()
        if store.banks != want:
            raise ValueError(
                f"CpuExperts: the HostStore banks must be those of MoEConfig.expert_format={cfg.expert_format!r} "
                f"at hidden={cfg.hidden}, expert_intermediate={cfg.expert_intermediate}, "
                f"expert_bias={cfg.expert_bias}: {[(b.name, list(b.row_shape), b.dtype) for b in want]}, got "
                f"{[(b.name, list(b.row_shape), b.dtype) for b in store.banks]}")
        if store.num_keys % cfg.num_experts:
            raise ValueError(f"CpuExperts: the HostStore's {store.num_keys} keys are not a whole number of layers of "
                             f"MoEConfig.num_experts={cfg.num_experts}")
        self.cfg, self.store = cfg, store
        self.tail_granule = tail_granule(cfg.format, cfg.expert_intermediate)  # split cuts' step; 0: none
        self.num_layers = store.num_keys // cfg.num_experts
        h, i = cfg.hidden, cfg.expert_intermediate
        self.gate_up = _matrix(store, cfg, "gate_up", i, h, 2)
        self.down = _matrix(store, cfg, "down", h, i, 1)
        units = MAX_TOKENS * cfg.top_k
        self.scratch = Scratch(
            xin=np.zeros((MAX_TOKENS, h), np.float32), act=np.zeros((units, MAX_TOKENS, i), np.float32),
            y=np.zeros((units, MAX_TOKENS, h), np.float32), unit_key=np.zeros(units, np.int64),
            unit_tok=np.zeros((units, MAX_TOKENS), np.int64), unit_m=np.zeros(units, np.int64),
            unit_cut=np.zeros(units, np.int64),
            unit_of=np.zeros((MAX_TOKENS, cfg.top_k), np.int64), pos_of=np.zeros((MAX_TOKENS, cfg.top_k), np.int64))
        self._lock = threading.Lock()
        self._kernel_args = (self.gate_up, self.down, self.spec, self.scratch)
        # a pool thread's stand-ins for the leader's arguments (unread, of the same types)
        self._idle_args = (np.zeros((1, h), np.float32), np.full((1, cfg.top_k), -1, np.int32),
                           np.zeros((1, cfg.top_k), np.float32), np.zeros((1, h), np.float32))
        self.spin_pauses = 0
        self._pool: _Pool | None = None

    def moe(self, layer: int, x, ids, weights, out=None, split=None) -> np.ndarray:
        """out [T, H] float32 = Σ_{j ascending, ids[t, j] >= 0} weights[t, j] * expert(layer * E + ids[t, j])(x[t]).

        x float32 [T, H] (T in 1..MAX_TOKENS), ids int32 [T, k] (-1: a position that is not the CPU's),
        weights float32 [T, k], out: float32 [T, H] to write into (e.g. pinned memory; may be x itself),
        else a new array. numpy arrays or CPU torch tensors, C-contiguous. Each distinct key's weights are
        read once. split: None, or (expert, cut) with expert an id that ids routes (in [0, E)) and cut in
        (0, I) a multiple of self.tail_granule (expertcache.split.tail_granule; 0: this format and width
        split nothing): that expert's part of rows [0, cut) alone, down_[:, :cut] @ act(gate_up rows
        [0, cut) of x), without down's bias (its other rows are computed on the GPU from a scratch slot,
        with the bias), weighted and summed as the others. Cost: the keys' expert bytes from memory (the
        split expert's of its rows [0, cut)), T * k * 3 * I * H multiply-adds, on threads_in_use() threads
        (this one and its pool) with the GIL released. Raises ValueError naming the argument (layer, x,
        ids, weights, out, split) before anything is written.
        """
        cfg = self.cfg
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"CpuExperts.moe: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        rows = x.shape[0] if isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 2 else 0
        if not 1 <= rows <= MAX_TOKENS:
            raise ValueError(f"CpuExperts.moe: x must be [T, {cfg.hidden}] with T in 1..{MAX_TOKENS}, got "
                             f"{list(x.shape) if hasattr(x, 'shape') else type(x).__name__}")
        x = _array("x", x, np.float32, (rows, cfg.hidden))
        ids = _array("ids", ids, np.int32, (rows, cfg.top_k))
        weights = _array("weights", weights, np.float32, (rows, cfg.top_k))
        if bool(((ids < -1) | (ids >= cfg.num_experts)).any()):
            raise ValueError(f"CpuExperts.moe: ids must be in [-1, {cfg.num_experts}) (MoEConfig.num_experts), got "
                             f"{ids.min()}..{ids.max()}")
        out = np.empty((rows, cfg.hidden), np.float32) if out is None else _array("out", out, np.float32,
                                                                                (rows, cfg.hidden))
        if not out.flags.writeable:
            raise ValueError("CpuExperts.moe: out must be writeable")
        expert, cut = self._split(split, ids)
        # read-only inputs would compile pool_run once more, for the leader alone: its items would then
        # run other code than the pool threads' (module docstring: one compiled item code)
        x, ids, weights = (a if a.flags.writeable else a.copy() for a in (x, ids, weights))
        with self.leading() as ctrl:
            pool_run(ctrl, self.gate_up, self.down, self.spec, self.scratch, True, int(layer),
                     cfg.num_experts, expert, cut, x, ids, weights, out, 0, 0)
        return out

    @contextlib.contextmanager
    def leading(self):
        """Hold the calls' lock with the pool made (or remade at set_threads' size) and woken; gives its ctrl
        words, for a compiled caller that runs pool_run as the leader (with self.gate_up, self.down,
        self.spec, self.scratch) any number of times before it returns: moe.engine.handoff's worker.
        While the pool has threads asleep (ctrl[ASLEEP]), a call still completes, on fewer threads."""
        with self._lock:
            size = threads_in_use() - 1
            if self._pool is None or self._pool.size != size:
                if self._pool is not None:
                    self._pool.close()
                self._pool = _Pool(self, size)
            self._pool.wake()
            yield self._pool.ctrl

    def _split(self, split, ids: np.ndarray) -> tuple[int, int]:
        """(expert, cut) of moe's `split` as ints, (-1, 0) for None, or ValueError naming split."""
        if split is None:
            return -1, 0
        inter, granule = self.cfg.expert_intermediate, self.tail_granule
        if not granule:
            raise ValueError(f"CpuExperts.moe: split must be None: experts of MoEConfig.expert_format="
                             f"{self.cfg.expert_format!r} and expert_intermediate={inter} cannot be split "
                             f"(expertcache.split.tail_granule is 0), got {split!r}")
        ok = isinstance(split, tuple) and len(split) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in split)
        expert, cut = (int(v) for v in split) if ok else (-1, 0)
        if not (ok and 0 <= expert < self.cfg.num_experts and 0 < cut < inter and cut % granule == 0):
            raise ValueError(f"CpuExperts.moe: split must be None or (expert, cut), ints with expert in "
                             f"[0, {self.cfg.num_experts}) and cut in (0, {inter}) a multiple of {granule}, "
                             f"got {split!r}")
        if not bool((ids == expert).any()):
            raise ValueError(f"CpuExperts.moe: split names expert {expert}, which ids does not route")
        return expert, cut

    def close(self) -> None:
        """Stop the pool's threads (a later call starts them again)."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
