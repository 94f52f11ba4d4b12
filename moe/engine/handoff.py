"""A layer's CPU share of its misses, handed to a CPU worker and back inside the decode graph.

    compute stream, after the layer's ensure:
      _post_kernel: pending = whether the ensure served any position on the CPU (slot CPU_SLOT); if so,
          hidden [T, H] (model dtype) -> x (float32), the routed ids of those positions (-1 elsewhere)
          and their weights -> mapped pinned host memory, (layer, T) beside them; a barrier, a
          system-scope release, flag_in = seq
    CPU worker (one thread per SlotCache): spins on flag_in with acquire loads (numba, the GIL
      released), runs moe.kernels.cpu_experts.CpuExperts.moe on what was posted into `out`, and answers
      flag_out = seq with a release store
    compute stream, at the combine (before the routed down launch):
      _wait_kernel: if pending, one program spins on flag_out (volatile loads) until it reaches seq, a
          system-scope acquire; then dst [T, H] = addend (the shared expert's output, or 0) + (out if
          pending, else 0)

A layer call that serves nothing on the CPU (every miss copied, or none) hands nothing over: the worker
is not woken and the wait does not wait, so a split costs a call with no CPU share two short launches.

No host sync and fixed buffers: the post and the wait capture in the decode step's CUDA graph, and
between them the copies of the layer's other misses and the GPU's hits run while the CPU computes.
seq is a device counter each hand-over advances, so every one carries a new number; pending is a device
flag the post writes and the wait reads, on the same stream. The routed GPU
launches skip a CPU_SLOT position (its slot is below 0), so every expert of a row is added once, in a
fixed order: the GPU's in its down launch, the CPU's (summed by the worker in ascending j) in the
addend.

A worker that fails answers anyway (out zeroed) so the GPU never waits forever; `check()` raises
its error (GpuMoE.decode calls it each step). Its cost: docs/hybrid.md.
"""

from __future__ import annotations

import threading
import time

import torch
import triton
import triton.language as tl
from numba import njit

from expertcache.geometry import CPU_SLOT
from expertcache.pool import DeviceView, mapped_device_pointer
from moe.kernels.cpu_atomics import cpu_relax, load_acquire, store_release
from moe.kernels.cpu_experts import SPIN_PAUSES, CpuExperts
from moe.kernels.plan import GEMV_MAX_TOKENS

META_LAYER, META_ROWS = 0, 1
_CPU_SLOT = tl.constexpr(CPU_SLOT)
_META_LAYER, _META_ROWS = tl.constexpr(META_LAYER), tl.constexpr(META_ROWS)


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
                 fence_ptr, pending_ptr, layer, rows, always, H: tl.constexpr, K: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.arange(0, BLOCK_K)
    pm = p < rows * K
    slot = tl.load(slots_ptr + p, mask=pm, other=-1)
    on_cpu = (slot == _CPU_SLOT) & pm
    go = (tl.sum(on_cpu.to(tl.int32), axis=0) > 0) | (always != 0)
    tl.store(pending_ptr, go.to(tl.int32))
    if go:
        for r in range(rows):
            for h0 in tl.static_range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                tl.store(x_ptr + r * H + h, tl.load(hidden_ptr + r * H + h, mask=h < H).to(tl.float32), mask=h < H)
        tl.store(cid_ptr + p, tl.where(on_cpu, tl.load(ids_ptr + p, mask=pm, other=-1), -1), mask=pm)
        tl.store(cw_ptr + p, tl.load(w_ptr + p, mask=pm, other=0.0), mask=pm)
        tl.store(meta_ptr + _META_LAYER, layer)
        tl.store(meta_ptr + _META_ROWS, rows)
        raise_flag(seq_ptr, flag_ptr, fence_ptr)


@triton.jit
def _wait_kernel(flag_ptr, seq_ptr, pending_ptr, out_ptr, addend_ptr, dst_ptr, fence_ptr, rows, H: tl.constexpr,
                 BLOCK_H: tl.constexpr, ADDEND: tl.constexpr):
    go = tl.load(pending_ptr) != 0
    if go:
        await_flag(flag_ptr, seq_ptr, fence_ptr)
    for r in range(rows):
        for h0 in tl.static_range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            y = tl.load(out_ptr + r * H + h, mask=(h < H) & go, other=0.0, volatile=True)
            if ADDEND:
                y += tl.load(addend_ptr + r * H + h, mask=h < H, other=0.0)
            tl.store(dst_ptr + r * H + h, y, mask=h < H)


def _mapped(t: torch.Tensor) -> DeviceView:
    return DeviceView(mapped_device_pointer(t.data_ptr(), "cpu share"), t.dtype, t.numel() * t.element_size(), t)


class CpuShare:
    """The hand-off buffers, the device sequence counter and the CPU worker of one SlotCache.

    experts: the CpuExperts over the SlotCache's HostStore (the store's own pinned banks, read in place).
    One layer's share is in flight at a time (a layer waits for its own before the next posts), so one
    set of buffers serves every layer. `post` and `wait` launch on the current stream; `close` stops
    the worker; `check` raises the worker's error, if it had one. With `trace` a list, the worker appends
    (start ns, end ns, layer, served positions) of each answer, time.perf_counter_ns() (a timeline's CPU
    lane: benchmarks/hybrid_step.py); None (the default) records nothing.
    """

    def __init__(self, experts: CpuExperts, device: torch.device) -> None:
        cfg = experts.cfg
        experts.spin_pauses = SPIN_PAUSES  # its pool threads stay awake between a decode's layer calls
        self.experts, self.device, self.hidden, self.top_k = experts, device, cfg.hidden, cfg.top_k
        n, h, k = GEMV_MAX_TOKENS, cfg.hidden, cfg.top_k

        def pinned(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        self._host = {"x": pinned((n, h), torch.float32), "ids": pinned((n, k), torch.int32),
                      "weights": pinned((n, k), torch.float32), "out": pinned((n, h), torch.float32),
                      "meta": pinned(2, torch.int32), "flag_in": pinned(1, torch.int32),
                      "flag_out": pinned(1, torch.int32), "stop": pinned(1, torch.int32)}
        self._views = {name: _mapped(t) for name, t in self._host.items()}
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._seq = torch.zeros(1, dtype=torch.int32, device=device)
        self._fence = torch.zeros(1, dtype=torch.int32, device=device)
        self._pending = torch.zeros(1, dtype=torch.int32, device=device)
        self.error: BaseException | None = None
        self.trace: list[tuple[int, int, int, int]] | None = None
        self._thread = threading.Thread(target=self._serve, name="expertcache-cpu-share", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        a, last = self._np, 0
        while True:
            s = int(wait_post(a["flag_in"], a["stop"], last))
            if s < 0:
                return
            rows, layer = int(a["meta"][META_ROWS]), int(a["meta"][META_LAYER])
            trace, start = self.trace, time.perf_counter_ns()
            served = 0
            try:
                served = int((a["ids"][:rows] >= 0).sum())
                if served:
                    self.experts.moe(layer, a["x"][:rows], a["ids"][:rows], a["weights"][:rows], out=a["out"][:rows])
                else:  # a post with nothing served (post's `always`): answer at once, no kernel threads woken
                    a["out"][:rows] = 0.0
            except Exception as exc:  # kept for check(): the GPU must not wait forever
                a["out"][:rows] = 0.0
                self.error = exc
            if trace is not None:  # before the answer: whoever the answer releases finds the entry
                trace.append((start, time.perf_counter_ns(), layer, served))
            answer(a["flag_out"], s)
            last = s

    def post(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
             weights: torch.Tensor, always: bool = False) -> None:
        """Hand over the positions of hidden [T, H] whose slot is CPU_SLOT (ids, slots int32, weights
        float32 [T, k], on the device), when there are any; `always`: hand over even when there are
        none (the worker answers at once: the round trip alone, as measure_channels times it)."""
        self._open("post")
        v, rows = self._views, hidden.shape[0]
        _post_kernel[(1,)](hidden, ids, slots, weights, v["x"], v["ids"], v["weights"], v["meta"], self._seq,
                           v["flag_in"], self._fence, self._pending, layer, rows, int(always), H=self.hidden,
                           K=self.top_k, BLOCK_H=1024, BLOCK_K=triton.next_power_of_2(GEMV_MAX_TOKENS * self.top_k))

    def wait(self, addend: torch.Tensor | None, dst: torch.Tensor) -> torch.Tensor:
        """dst [T, H] float32 = addend (or 0) + the CPU's share of the last post, once it is back."""
        self._open("wait")
        v = self._views
        _wait_kernel[(1,)](v["flag_out"], self._seq, self._pending, v["out"], dst if addend is None else addend, dst,
                           self._fence, dst.shape[0], H=self.hidden, BLOCK_H=1024, ADDEND=addend is not None)
        return dst

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
