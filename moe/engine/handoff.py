"""A layer's CPU share of its misses, handed to a CPU worker and back inside the decode graph.

    compute stream, after the layer's ensure:
      _post_kernel: pending = whether the ensure served any position on the CPU (slot CPU_SLOT); if so,
          hidden [T, H] (model dtype) -> x (float32), the routed ids of those positions (-1 elsewhere)
          and their weights -> mapped pinned host memory, (layer, T) beside them; a barrier, a
          system-scope release, flag_in = seq
    CPU worker (one thread per SlotCache): spins on flag_in with acquire loads (numba, the GIL
      released), computes what was posted into `out` as moe.kernels.cpu_experts.CpuExperts.moe would,
      and answers flag_out = seq with a release store. Its loop is compiled whole (serve_posts): it
      leads the CpuExperts' pool of threads (pool_run) post after post without returning to Python,
      holding the CpuExperts' lock; it returns between bursts (no post within the pool's spin), to wake
      the pool's threads once they sleep, and for a post that fails its checks (then served through
      CpuExperts.moe, whose error check() raises)
    compute stream, at the combine (after the routed down launch, which wrote the GPU's routed sum):
      _wait_kernel: if pending, one program spins on flag_out (volatile loads) until it reaches seq, a
          system-scope acquire; then dst [T, H] = routed + (addend (the shared expert's output, or 0) +
          (out if pending, else 0)) in float32, rounded once to dst's dtype (the model dtype at a layer)

With a tail (expertcache.split: MissSplit.link_rows), the post also splits the call's first served
expert (the one at the lowest position (t, j) on the CPU): from the ensure's copies c and the distinct
served experts s it takes r = link_rows[c + s] (0 unless c is the table's copies[c + s]); where r > 0
it rewrites that expert's positions from CPU_SLOT to the scratch slot, writes tail = (key, scratch,
cut = I - r) for the miss copy (expertcache.copy: rows [cut, I) into the scratch slot) and (expert, cut)
beside the payload, so the worker computes its rows [0, cut) only (CpuExperts.moe's split). Before the
down, _zero_tail_kernel (CpuShare.zero_tail) zeroes the act rows [0, cut) of the scratch positions: the
slot's rows below cut hold another expert's bytes, and the GPU's share of the expert is its rows [cut, I)
alone.

A layer call that serves nothing on the CPU (every miss copied, or none) hands nothing over: the worker
is not woken and the wait does not wait, so a split costs a call with no CPU share its short launches
(the post, the wait, and with a tail the zeroing).

No host sync and fixed buffers: the post and the wait capture in the decode step's CUDA graph, and
between them the copies of the layer's other misses and the GPU's gate_up and down run while the CPU
computes.
seq is a device counter each hand-over advances, so every one carries a new number; pending is a device
flag the post writes and the wait reads, on the same stream. The routed GPU
launches skip a CPU_SLOT position (its slot is below 0), so every expert of a row is added once, in a
fixed order: the GPU's in its down launch (routed), the CPU's (summed by the worker in ascending j)
added to the shared expert's output first, that sum to routed at the wait.

A worker that fails answers anyway (out zeroed) so the GPU never waits forever; `check()` raises
its error (GpuMoE.decode calls it each step). Its cost: docs/hybrid.md.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
import triton
import triton.language as tl
from numba import njit
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from expertcache.geometry import CPU_SLOT
from expertcache.pool import DeviceView, mapped_device_pointer
from expertcache.split import SPLIT_LEN, MissSplit
from moe.kernels.cpu_atomics import cpu_relax, load_acquire, monotonic_ns, store_release
from moe.kernels.cpu_decode import KERNEL
from moe.kernels.cpu_experts import ASLEEP, MAX_TOKENS, SPIN_PAUSES, CpuExperts, pool_run
from moe.kernels.plan import GEMV_MAX_TOKENS

META_LAYER, META_ROWS, META_SPLIT, META_CUT = 0, 1, 2, 3
_CPU_SLOT = tl.constexpr(CPU_SLOT)
_META_LAYER, _META_ROWS = tl.constexpr(META_LAYER), tl.constexpr(META_ROWS)
_META_SPLIT, _META_CUT = tl.constexpr(META_SPLIT), tl.constexpr(META_CUT)


@njit(nogil=True, cache=True)
def wait_post(flag_in, stop, last):
    """Spin until flag_in moves past `last` (return its value) or stop is set (return -1)."""
    while True:
        s = load_acquire(flag_in, 0)
        if s != last:
            return s
        if load_acquire(stop, 0) != 0:
            return -1
        cpu_relax()


@njit(nogil=True, cache=True)
def answer(flag_out, s):
    store_release(flag_out, 0, s)


# serve_posts' returns (with a post's seq): no post within `spin` waits (the last served), stop set (the last
# served), the pool has threads asleep (the post, not served: wake them and call again with woke), the
# post fails the checks (not served: CpuExperts.moe's checks name what is wrong)
IDLE, STOPPED, WAKE, CHECK = 0, 1, 2, 3
TRACE_LEN = 1 << 16  # answers a CpuShare's trace ring holds


@njit(**KERNEL)
def _post_served(meta, ids, rows_max, num_layers, num_experts, inter, granule):
    """The positions the posted call serves (ids >= 0), or -1 where it is not one CpuExperts.moe takes: rows,
    layer, ids, the split (expert, cut)."""
    rows, layer, expert, cut = meta[META_ROWS], meta[META_LAYER], meta[META_SPLIT], meta[META_CUT]
    if rows < 1 or rows > rows_max or layer < 0 or layer >= num_layers:
        return -1
    served, routed = 0, False
    for t in range(rows):
        for j in range(ids.shape[1]):
            if ids[t, j] < -1 or ids[t, j] >= num_experts:
                return -1
            served += ids[t, j] >= 0
            routed |= expert >= 0 and ids[t, j] == expert
    ok = expert < 0 or (expert < num_experts and 0 < cut < inter and granule > 0 and cut % granule == 0 and routed)
    return served if ok else -1


@njit(**KERNEL)
def record(ring, ring_at, start, end, layer, served):
    """Trace an answer: ring[ring_at[0] % len] = (start, end, layer, served), then ring_at[0] += 1 (released)."""
    at = ring_at[0]
    e = ring[at % ring.shape[0]]
    e[0], e[1], e[2], e[3] = start, end, layer, served
    store_release(ring_at, 0, at + 1)


@njit(**KERNEL)
def serve_posts(flag_in, flag_out, stop, meta, x, ids, weights, out, ctrl, gu, dn, spec, sc, num_layers,
                num_experts, inter, granule, last, pending, woke, spin, ring, ring_at, tracing):
    """The worker's loop, compiled: serve the post `pending` (when it is not `last`), then each later one
    as it comes (spinning with acquire loads on flag_in), leading the CpuExperts' pool (pool_run) with no
    return to Python between posts; answer each with flag_out = its seq. Returns (IDLE / STOPPED / WAKE /
    CHECK, seq) as above. A post serving nothing gets out = 0 and its answer at once, no pool call. With
    tracing[0], each answer is recorded first as (start ns, end ns, layer, served positions) in ring
    [TRACE_LEN, 4] at ring_at[0] % TRACE_LEN (then ring_at[0] += 1, released). woke: the pool was just
    woken for `pending` (its threads may not be spinning yet: no WAKE for it)."""
    s = pending
    while True:
        if s == last:
            waited = 0
            s = load_acquire(flag_in, 0)
            while s == last:
                if load_acquire(stop, 0) != 0:
                    return STOPPED, last
                if waited >= spin:
                    return IDLE, last
                waited += 1
                cpu_relax()
                s = load_acquire(flag_in, 0)
        start = monotonic_ns()
        served = _post_served(meta, ids, min(x.shape[0], MAX_TOKENS), num_layers, num_experts, inter, granule)
        if served < 0:
            return CHECK, s
        rows, layer, expert = meta[META_ROWS], meta[META_LAYER], meta[META_SPLIT]
        if served == 0:
            out[:rows] = 0.0
        else:
            if not (woke and s == pending) and load_acquire(ctrl, ASLEEP) > 0:
                return WAKE, s
            pool_run(ctrl, gu, dn, spec, sc, True, layer, num_experts, expert if expert >= 0 else -1,
                     meta[META_CUT] if expert >= 0 else 0, x[:rows], ids[:rows], weights[:rows], out[:rows], 0, 0)
        if tracing[0] != 0:
            record(ring, ring_at, start, monotonic_ns(), layer, served)
        store_release(flag_out, 0, s)
        last = s


@triton.jit
def raise_flag(seq_ptr, flag_ptr, fence_ptr):
    """After the program's payload stores: seq += 1, then flag = seq, the payload visible first (a barrier
    and a system-scope release)."""
    s = tl.load(seq_ptr) + 1
    tl.debug_barrier()
    tl.atomic_add(fence_ptr, 0, sem="release", scope="sys")  # the payload is visible before the flag
    tl.store(seq_ptr, s)
    tl.store(flag_ptr, s)


@triton.jit
def await_flag(flag_ptr, seq_ptr, fence_ptr):
    """Spin until flag reaches seq (volatile loads), then a system-scope acquire: the answer is read after."""
    s = tl.load(seq_ptr)
    v = tl.load(flag_ptr, volatile=True)
    while v != s:
        v = tl.load(flag_ptr, volatile=True)
    tl.atomic_add(fence_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _post_kernel(hidden_ptr, ids_ptr, slots_ptr, w_ptr, x_ptr, cid_ptr, cw_ptr, meta_ptr, seq_ptr, flag_ptr,
                 fence_ptr, pending_ptr, layer, rows, always, count_ptr, copies_ptr, link_rows_ptr, tail_ptr, scratch,
                 num_experts, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                 TAIL: tl.constexpr = False, INTER: tl.constexpr = 1, SPLIT_LEN: tl.constexpr = 1,
                 GDC: tl.constexpr = False):
    if GDC:  # a programmatic launch: the ensure's slots and count first; then the miss copy may launch
        gdc_wait()
        gdc_launch_dependents()
    p = tl.arange(0, BLOCK_K)
    pm = p < rows * K
    slot = tl.load(slots_ptr + p, mask=pm, other=-1)
    on_cpu = (slot == _CPU_SLOT) & pm
    go = (tl.sum(on_cpu.to(tl.int32), axis=0) > 0) | (always != 0)
    tl.store(pending_ptr, go.to(tl.int32))
    ids = tl.load(ids_ptr + p, mask=pm, other=-1)
    if TAIL:
        # s: the distinct experts served (a CPU position whose id no earlier CPU position has)
        q = tl.arange(0, BLOCK_K)
        on_q = (tl.load(slots_ptr + q, mask=q < rows * K, other=-1) == _CPU_SLOT) & (q < rows * K)
        ids_q = tl.load(ids_ptr + q, mask=q < rows * K, other=-1)
        earlier = (ids[:, None] == ids_q[None, :]) & on_q[None, :] & (q[None, :] < p[:, None])
        first = on_cpu & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
        served = tl.sum(first.to(tl.int32), axis=0)
        c = tl.load(count_ptr)
        m = tl.minimum(c + served, SPLIT_LEN - 1)
        nlink = tl.load(link_rows_ptr + m)
        nlink = tl.where((served > 0) & (tl.load(copies_ptr + m) == c), nlink, 0)
        lead = tl.min(tl.where(on_cpu, p, BLOCK_K), axis=0)  # the lowest CPU position
        expert = tl.sum(tl.where(p == lead, ids, 0), axis=0)
        split = on_cpu & (ids == expert) & (nlink > 0)
        tl.store(slots_ptr + p, tl.where(split, scratch, slot), mask=pm)
        tl.store(tail_ptr, tl.where(nlink > 0, layer * num_experts + expert, -1))
        tl.store(tail_ptr + 1, scratch)
        tl.store(tail_ptr + 2, INTER - nlink)
        if go:
            tl.store(meta_ptr + _META_SPLIT, tl.where(nlink > 0, expert, -1))
            tl.store(meta_ptr + _META_CUT, INTER - nlink)
    elif go:
        tl.store(meta_ptr + _META_SPLIT, -1)
    if go:
        r = 0
        while r < rows:  # while loops: Triton's interpreter cannot range() over a kernel argument
            for h0 in tl.static_range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                tl.store(x_ptr + r * H + h, tl.load(hidden_ptr + r * H + h, mask=h < H).to(tl.float32), mask=h < H)
            r += 1
        tl.store(cid_ptr + p, tl.where(on_cpu, ids, -1), mask=pm)
        tl.store(cw_ptr + p, tl.load(w_ptr + p, mask=pm, other=0.0), mask=pm)
        tl.store(meta_ptr + _META_LAYER, layer)
        tl.store(meta_ptr + _META_ROWS, rows)
        raise_flag(seq_ptr, flag_ptr, fence_ptr)


@triton.jit
def _zero_tail_kernel(act_ptr, act_stride, slots_ptr, tail_ptr, scratch, rows, K: tl.constexpr,
                      INTER: tl.constexpr, BLOCK_I: tl.constexpr, GDC: tl.constexpr = False):
    """The scratch slot's rows below the cut are another expert's: the act rows [0, cut) of the positions at
    the scratch slot add nothing."""
    if GDC:  # a programmatic launch: the gate_up's act first; then the down may launch
        gdc_wait()
        gdc_launch_dependents()
    cut = tl.load(tail_ptr + 2)
    pos = 0
    while pos < rows * K:
        if tl.load(slots_ptr + pos) == scratch:
            for i0 in tl.static_range(0, INTER, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                tl.store(act_ptr + pos * act_stride + i, tl.zeros((BLOCK_I,), tl.float32), mask=i < cut)
        pos += 1


@triton.jit
def _wait_kernel(flag_ptr, seq_ptr, pending_ptr, out_ptr, addend_ptr, routed_ptr, dst_ptr, fence_ptr, rows,
                 H: tl.constexpr, BLOCK_H: tl.constexpr, ADDEND: tl.constexpr, ROUTED: tl.constexpr,
                 GDC: tl.constexpr = False):
    """dst = routed + (out + addend) in float32 (the worker's out once it answered, 0 when nothing pending;
    routed, addend where given), one rounding to dst's dtype. dst may be routed: each element is loaded
    before the same program stores it. GDC: a programmatic launch behind the routed down, which may start
    while the down runs: pending (the post's, finished before the down's predecessors) and the answer are
    read at once, the down's routed sum and the addend after the wait for it."""
    go = tl.load(pending_ptr) != 0
    if go:
        await_flag(flag_ptr, seq_ptr, fence_ptr)
    if GDC:
        gdc_wait()
    r = 0
    while r < rows:
        for h0 in tl.static_range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            d = tl.load(out_ptr + r * H + h, mask=(h < H) & go, other=0.0, volatile=True)
            if ADDEND:
                d += tl.load(addend_ptr + r * H + h, mask=h < H, other=0.0)
            y = d
            if ROUTED:  # the GPU's routed sum first, as the down adds its addend
                y = tl.load(routed_ptr + r * H + h, mask=h < H, other=0.0) + d
            tl.store(dst_ptr + r * H + h, y.to(dst_ptr.dtype.element_ty), mask=h < H)
        r += 1


def _mapped(t: torch.Tensor) -> DeviceView:
    return DeviceView(mapped_device_pointer(t.data_ptr(), "cpu share"), t.dtype, t.numel() * t.element_size(), t)


class CpuShare:
    """The hand-off buffers, the device sequence counter and the CPU worker of one SlotCache.

    experts: the CpuExperts over the SlotCache's HostStore (the store's own pinned banks, read in place).
    One layer's share is in flight at a time (a layer waits for its own before the next posts), so one
    set of buffers serves every layer. `post`, `zero_tail` and `wait` launch on the current stream; `close`
    stops the worker; `check` raises the worker's error, if it had one. Set `trace` to a list to record each
    answer from then on as (start ns, end ns, layer, served positions) on time.perf_counter_ns()'s clock (a
    timeline's CPU lane: benchmarks/hybrid_step.py); reading it gives that list and the answers since;
    None (the default) records nothing.
    """

    def __init__(self, experts: CpuExperts, device: torch.device, split: MissSplit | None = None,
                 scratch: int = -1) -> None:
        cfg = experts.cfg
        experts.spin_pauses = SPIN_PAUSES  # its pool threads stay awake between a decode's layer calls
        self.experts, self.device, self.hidden, self.top_k = experts, device, cfg.hidden, cfg.top_k
        n, h, k = GEMV_MAX_TOKENS, cfg.hidden, cfg.top_k

        def pinned(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        self._host = {"x": pinned((n, h), torch.float32), "ids": pinned((n, k), torch.int32),
                      "weights": pinned((n, k), torch.float32), "out": pinned((n, h), torch.float32),
                      "meta": pinned(4, torch.int32), "flag_in": pinned(1, torch.int32),
                      "flag_out": pinned(1, torch.int32), "stop": pinned(1, torch.int32)}
        self._views = {name: _mapped(t) for name, t in self._host.items()}
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._seq = torch.zeros(1, dtype=torch.int32, device=device)
        self._fence = torch.zeros(1, dtype=torch.int32, device=device)
        self._pending = torch.zeros(1, dtype=torch.int32, device=device)
        self.tail: torch.Tensor | None = None  # (key, slot, cut) of the call's split expert, for the miss copy
        if split is not None and split.tail:
            if not 0 <= scratch or split.inter != cfg.expert_intermediate:
                raise ValueError(f"CpuShare: a split with a tail needs the scratch slot (got {scratch}) and "
                                 f"MissSplit.inter = MoEConfig.expert_intermediate ({split.inter} != "
                                 f"{cfg.expert_intermediate})")
            self._copies = torch.from_numpy(split.copies.astype(np.int32)).to(device)
            self._link_rows = torch.from_numpy(split.link_rows.astype(np.int32)).to(device)
            self.tail = torch.tensor([-1, scratch, cfg.expert_intermediate], dtype=torch.int32, device=device)
        self.scratch, self.num_experts = scratch, cfg.num_experts
        self.error: BaseException | None = None
        self._ring, self._ring_at = np.zeros((TRACE_LEN, 4), np.int64), np.zeros(1, np.int64)
        self._tracing, self._trace_head, self._trace_from = np.zeros(1, np.int64), [], None
        self._thread = threading.Thread(target=self._serve, name="expertcache-cpu-share", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        a, ex, cfg = self._np, self.experts, self.experts.cfg
        last = pending = 0
        while True:
            if pending == last:  # between bursts of posts: spin here, holding neither the GIL nor the calls' lock
                pending = int(wait_post(a["flag_in"], a["stop"], last))
                if pending < 0:
                    return
            with ex.leading() as ctrl:
                status, s = serve_posts(a["flag_in"], a["flag_out"], a["stop"], a["meta"], a["x"], a["ids"],
                                        a["weights"], a["out"], ctrl, ex.gate_up, ex.down, ex.spec, ex.scratch,
                                        ex.num_layers, cfg.num_experts, cfg.expert_intermediate, ex.tail_granule,
                                        last, pending, True, ex.spin_pauses, self._ring, self._ring_at,
                                        self._tracing)  # woke: leading() has just woken the pool
            s = int(s)
            if status == STOPPED:
                return
            if status == WAKE:  # post s not served yet (the pool fell asleep in a burst): again, woken
                pending = s
                continue
            if status == CHECK:
                self._serve_checked(s)
            last = pending = s

    def _serve_checked(self, s: int) -> None:
        """Post s through CpuExperts.moe, whose checks raise what is wrong with it (kept for check()); the
        answer is sent anyway, out zeroed, so the GPU does not wait forever."""
        a = self._np
        rows, layer = int(a["meta"][META_ROWS]), int(a["meta"][META_LAYER])
        split = (int(a["meta"][META_SPLIT]), int(a["meta"][META_CUT])) if a["meta"][META_SPLIT] >= 0 else None
        start, served = time.perf_counter_ns(), 0
        try:
            n = min(max(rows, 0), a["x"].shape[0])
            served = int((a["ids"][:n] >= 0).sum())
            self.experts.moe(layer, a["x"][:rows], a["ids"][:rows], a["weights"][:rows], out=a["out"][:rows],
                             split=split)
        except Exception as exc:  # kept for check(): the GPU must not wait forever
            a["out"][:] = 0.0
            self.error = exc
        if self._tracing[0]:  # before the answer: whoever the answer releases finds the entry
            record(self._ring, self._ring_at, start, time.perf_counter_ns(), layer, served)
        answer(a["flag_out"], s)

    @property
    def trace(self) -> list[tuple[int, int, int, int]] | None:
        """The worker's answers recorded since trace was set to a list (that list's entries first), as (start
        ns, end ns, layer, served positions) on time.perf_counter_ns()'s clock; None: not recording. The
        last TRACE_LEN answers are kept."""
        if self._trace_from is None:
            return None
        n = int(self._ring_at[0])
        return self._trace_head + [tuple(int(v) for v in self._ring[i % TRACE_LEN])
                                   for i in range(max(self._trace_from, n - TRACE_LEN), n)]

    @trace.setter
    def trace(self, value: list | None) -> None:
        if value is None:
            self._tracing[0], self._trace_from = 0, None
        else:
            self._trace_head, self._trace_from = list(value), int(self._ring_at[0])
            self._tracing[0] = 1

    def host_call(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
        """out [T, H] = the CPU's share of x [T, H] for ids / weights [T, k] (float32, int32, float32 numpy),
        posted from this thread as the device posts (payload, meta, then flag_in) and answered by the worker,
        this thread waiting with the GIL released: a call as a decode's layer pays it, without the GPU
        (moe.engine.channels times the CPU channel so). Nothing may be posted on the device meanwhile."""
        self._open("host_call")
        a, rows = self._np, x.shape[0]
        a["x"][:rows], a["ids"][:rows], a["weights"][:rows] = x, ids, weights
        a["meta"][:] = (layer, rows, -1, self.experts.cfg.expert_intermediate)
        prev = int(a["flag_out"][0])
        answer(a["flag_in"], prev + 1)  # after the payload (a release store), as the device's flag
        if int(wait_post(a["flag_out"], a["stop"], prev)) < 0:
            raise RuntimeError("CpuShare.host_call: the CPU share was closed while a call was posted")
        out[:rows] = a["out"][:rows]

    def post(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
             weights: torch.Tensor, always: bool = False, count: torch.Tensor | None = None,
             pdl: bool = False) -> None:
        """Hand over the positions of hidden [T, H] whose slot is CPU_SLOT (ids, slots int32, weights
        float32 [T, k], on the device), when there are any; `always`: hand over even when there are
        none (the worker answers at once: the round trip alone, as measure_channels times it). With a
        tail, count (int32 [1]: the ensure's copies) is needed, and a split expert's positions in `slots`
        become the scratch slot (module docstring). pdl (CUDA): a programmatic launch behind the ensure, which
        lets the miss copy launch right after its own wait."""
        self._open("post")
        v, rows = self._views, hidden.shape[0]
        tail = self.tail is not None
        if tail and count is None:
            raise ValueError("CpuShare.post: a split with a tail needs count (the ensure's copies)")
        extra = ((count, self._copies, self._link_rows, self.tail) if tail else (self._pending,) * 4)
        _post_kernel[(1,)](hidden, ids, slots, weights, v["x"], v["ids"], v["weights"], v["meta"], self._seq,
                           v["flag_in"], self._fence, self._pending, layer, rows, int(always), *extra, self.scratch,
                           self.num_experts, H=self.hidden, K=self.top_k, BLOCK_H=1024,
                           BLOCK_K=triton.next_power_of_2(GEMV_MAX_TOKENS * self.top_k), TAIL=tail,
                           INTER=self.experts.cfg.expert_intermediate, SPLIT_LEN=SPLIT_LEN,
                           **self._pdl_args(pdl))

    def zero_tail(self, act: torch.Tensor | None, slots: torch.Tensor | None, pdl: bool = False) -> None:
        """With a tail: zero the act rows [0, cut) of the positions at the scratch slot, act [T * k, I] float32
        and slots [T, k] the gate_up's, before the routed down reads them (the slot's rows below the cut are
        another expert's); without one, nothing. pdl (CUDA): a programmatic launch behind the gate_up."""
        if self.tail is None:
            return
        self._open("zero_tail")
        if act is None or slots is None:
            raise ValueError("CpuShare.zero_tail: a split with a tail needs act and slots")
        inter = self.experts.cfg.expert_intermediate
        _zero_tail_kernel[(1,)](act, act.stride(0), slots, self.tail, self.scratch, slots.shape[0], K=self.top_k,
                                INTER=inter, BLOCK_I=min(1024, triton.next_power_of_2(inter)), **self._pdl_args(pdl))

    def wait(self, addend: torch.Tensor | None, dst: torch.Tensor,
             routed: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
        """dst [T, H] = routed + (the CPU's share of the last post + addend), once the share is back: float32
        sums in that order (routed, addend: float32 [T, H], each 0 where not given), rounded once to dst's
        dtype (float32, or the model dtype: a layer's output). routed first, as the down adds an addend to
        its routed sum; dst may be routed itself. pdl (CUDA): a programmatic launch behind the routed down,
        which spins on the answer while the down runs and reads routed and addend once the down is done.
        Raises ValueError naming routed unless it is contiguous float32 [T, H] on dst's device."""
        self._open("wait")
        rows = dst.shape[0]
        if routed is not None and (routed.dtype != torch.float32 or tuple(routed.shape) != (rows, self.hidden)
                                   or routed.device != dst.device or not routed.is_contiguous()):
            raise ValueError(f"CpuShare.wait: routed must be contiguous float32 [{rows}, {self.hidden}] on "
                             f"{dst.device}, got {list(routed.shape)} {routed.dtype} on {routed.device}")
        v = self._views
        _wait_kernel[(1,)](v["flag_out"], self._seq, self._pending, v["out"], dst if addend is None else addend,
                           dst if routed is None else routed, dst, self._fence, rows, H=self.hidden, BLOCK_H=1024,
                           ADDEND=addend is not None, ROUTED=routed is not None, **self._pdl_args(pdl))
        return dst

    def _pdl_args(self, pdl: bool) -> dict:
        """A launch's programmatic arguments (GDC and the launch attribute) where pdl asks for one on CUDA; none
        elsewhere (the interpreter has no inline PTX)."""
        return {"GDC": True, "launch_pdl": True} if pdl and torch.device(self.device).type == "cuda" else {}

    def check(self) -> None:
        """Raise RuntimeError with the worker's error since the last check, or when the share is closed (a
        captured step replayed now would wait for a worker that is gone)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"the CPU expert worker failed: {err}") from err
        self._open("check")

    def _open(self, what: str) -> None:
        if self.closed:  # its worker is gone: a wait would spin forever
            raise RuntimeError(f"CpuShare.{what}: the CPU share is closed (SlotCache.close); build the backend again")

    @property
    def closed(self) -> bool:
        return bool(self._np["stop"][0])

    def close(self) -> None:
        """Stop the worker once the device has run what was queued (a post still queued would wait for a
        worker that is gone); idempotent. Engine.decode_step then refuses (check), so a decode step
        captured before is not replayed."""
        if not self.closed:
            torch.cuda.synchronize(self.device)
        self._np["stop"][0] = 1
        self._thread.join(timeout=10)
        self.experts.close()
