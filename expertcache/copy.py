"""The miss copy: rows of the host store into pool slots, as the ensure plan says.

    plan  int32 [Q, 2] (key, destination slot) rows, count int32 [1]: both in device memory,
          written by ensure; only the first `count` rows are live
    store[bank] [num_keys, *row]  (pinned, mapped host memory)
        -> miss_copy:    one persistent Triton kernel reads count and the plan on the device,
                         then every bank's row store[bank][key] -> pool[bank][slot] for every
                         live row: SM loads of mapped host memory over PCIe, 16 bytes a thread
                         (4 for a bank whose rows are not a multiple of 16 bytes: a format's
                         per-matrix scales, a few bytes an expert)
        -> pool[bank] [num_slots, *row]  (device memory)

With a tail (a hybrid miss split's, expertcache.split), one more row follows the plan's: tail int32
[3] = (key, slot, cut) on the device (key -1: none this call), the rows [cut, I) of one expert copied
into a scratch slot: of the banks of gate_up whose rows are [2I, ...] (its main part and per-row
scales) the gate and up rows [cut, I), of down's main part ("down" or "down.q", [H, ...]) the words
holding its input columns [cut, I) in every row, of every other bank (scales per block, global
scales, biases: a few KB) the whole row. A live plan row copies whole rows as ever.

The kernel launches a fixed grid and never reads `count` on the host, so a decode step that
includes it can be captured in one CUDA graph and replayed with any plan. `miss_copy_ce` is
the copy-engine path (eager, prefill: the plan is on the host), `reference_copy` the torch
reference. Plan rows whose key or slot is out of range are skipped by all three paths, and
two live rows must not share a slot (ensure never plans that).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from expertcache.pool import HostStore, SlotPool

MAX_BANKS = 8  # banks one launch copies (nvfp4 and int4 with zero points have 6); one kernel argument each
WORD_BYTES = 4  # the kernel moves int32 words: a bank's row must be a multiple of 4 bytes
VECTOR_BYTES = 16  # one load or store per thread moves 16 bytes (4 x int32) where a row is a multiple of 16
DEFAULT_NUM_CTAS = 16
DEFAULT_BLOCK_BYTES = 16384  # bytes one program moves per work item
DEFAULT_NUM_WARPS = 4


# Sizes that change with the pool or plan shape would otherwise each compile a new kernel.
_JIT_OPTIONS = {"do_not_specialize": ["num_rows", "num_keys", "num_slots"]}


@triton.jit(**_JIT_OPTIONS)
def _miss_copy_kernel(
    count_ptr,  # *i32 [1]: live plan rows (clamped to [0, num_rows]); read on the device only
    plan_ptr,  # *i32 [num_rows, 2]: (key, slot) per row, row-major
    num_rows,  # i32: Q, the plan's rows (its capacity)
    num_keys,  # i32: rows of each host bank; a row with a key outside [0, num_keys) is skipped
    num_slots,  # i32: rows of each pool bank; a row with a slot outside [0, num_slots) is skipped
    src_ptrs,  # tuple of NUM_BANKS *i32: host bank b as int32 words [num_keys, ROW_WORDS[b]]
    dst_ptrs,  # tuple of NUM_BANKS *i32: pool bank b as int32 words [num_slots, ROW_WORDS[b]]
    NUM_BANKS: tl.constexpr,  # banks copied per plan row, 1..MAX_BANKS
    ROW_WORDS: tl.constexpr,  # tuple: int32 words in one row of bank b (16-byte vectors where a multiple of 4)
    FIRST_CHUNK: tl.constexpr,  # tuple, NUM_BANKS + 1: bank b owns chunks [FIRST_CHUNK[b], [b + 1])
    CHUNKS_PER_ROW: tl.constexpr,  # FIRST_CHUNK[NUM_BANKS]: work items per plan row
    BLOCK: tl.constexpr,  # int32 words per work item (a power of two, >= 4)
    GDC: tl.constexpr = False,  # launched programmatically: wait for the predecessor before reading
    RELEASE: tl.constexpr = False,  # with GDC: the next launch may start right after this one's wait
    tail_ptr=None,  # with TAIL: *i32 [3] (key, slot, cut) of the tail row after the plan's (key -1: none)
    TAIL: tl.constexpr = False,
    INTER: tl.constexpr = 1,  # with TAIL: I, the expert width the tail cuts
    KIND: tl.constexpr = (),  # with TAIL, per bank: TAIL_WHOLE, TAIL_ROWS or TAIL_COLS (_tail_layout)
    UNIT: tl.constexpr = (),  # with TAIL, per bank: words of one matrix row (ROWS) or of one down row (COLS)
):
    if GDC:
        # By default no early launch of the next kernel: its programs would wait on the SMs for the
        # whole copy (long, with misses) and keep side-stream work off them.
        # RELEASE (miss_copy's release_after_wait): the next kernel's programs are scheduled while
        # this one reads its plan and copies (with no miss, the whole of this launch), and wait for
        # it on the SMs.
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()
    # Work item i = (plan row i // CHUNKS_PER_ROW, chunk i % CHUNKS_PER_ROW); program p takes
    # items p, p + grid, p + 2 * grid ..., so neighbouring programs read neighbouring chunks.
    n = tl.minimum(tl.maximum(tl.load(count_ptr), 0), num_rows)
    rows = n
    if TAIL:
        rows += (tl.load(tail_ptr) >= 0).to(tl.int32)
    total = rows * CHUNKS_PER_ROW
    lanes = tl.arange(0, BLOCK)
    item = tl.program_id(0)
    while item < total:  # a while loop: the interpreter cannot range() over device scalars
        row = item // CHUNKS_PER_ROW
        chunk = item - row * CHUNKS_PER_ROW
        if TAIL:
            on_tail = row == n
            pick = tl.where(on_tail, tail_ptr, plan_ptr + 2 * row)
            cut = tl.where(on_tail, tl.load(tail_ptr + 2), 0)
        else:
            pick = plan_ptr + 2 * row
        key = tl.load(pick).to(tl.int64)
        slot = tl.load(pick + 1).to(tl.int64)
        live = (key >= 0) & (key < num_keys) & (slot >= 0) & (slot < num_slots)
        for b in tl.static_range(NUM_BANKS):
            if live & (chunk >= FIRST_CHUNK[b]) & (chunk < FIRST_CHUNK[b + 1]):
                offs = (chunk - FIRST_CHUNK[b]) * BLOCK + lanes
                src = src_ptrs[b] + key * ROW_WORDS[b] + offs
                dst = dst_ptrs[b] + slot * ROW_WORDS[b] + offs
                if TAIL:
                    keep = offs < ROW_WORDS[b]
                    if KIND[b] == 1:  # TAIL_ROWS: matrix row r of [2I, ...]: gate / up row r mod I
                        keep &= (offs // UNIT[b]) % INTER >= cut
                    elif KIND[b] == 2:  # TAIL_COLS: word w of a down row holds inputs [w I / U, (w + 1) I / U)
                        keep &= ((offs % UNIT[b]) + 1) * INTER > cut * UNIT[b]
                    tl.store(dst, tl.load(src, mask=keep), mask=keep)
                elif ROW_WORDS[b] % BLOCK == 0:
                    tl.store(dst, tl.load(src))
                else:
                    tail = offs < ROW_WORDS[b]
                    tl.store(dst, tl.load(src, mask=tail), mask=tail)
        item += tl.num_programs(0)


_TWINS: dict[str, object] = {}


def _kernel_for(device: torch.device):
    """The kernel object that runs on `device`: compiled for CUDA, interpreted for CPU.

    Triton fixes the mode when a kernel is decorated (TRITON_INTERPRET at import); this
    builds the other mode's twin from the same source when needed, so the CUDA path never
    runs interpreted and the CPU path follows TRITON_INTERPRET at call time.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if device.type == "cuda":
        cls = JITFunction
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        cls = InterpretedFunction
    else:
        raise RuntimeError(
            "miss_copy runs its Triton kernel on a CUDA pool; for a CPU pool set "
            "TRITON_INTERPRET=1 (Triton's interpreter) or use reference_copy"
        )
    if isinstance(_miss_copy_kernel, cls):
        return _miss_copy_kernel
    if cls.__name__ not in _TWINS:
        _TWINS[cls.__name__] = cls(_miss_copy_kernel.fn, **_JIT_OPTIONS)
    return _TWINS[cls.__name__]


def _check_pair(store: HostStore, pool: SlotPool) -> None:
    if store.banks != pool.banks:
        raise ValueError(
            f"the HostStore banks {[(b.name, b.row_shape, b.dtype) for b in store.banks]} and "
            f"the SlotPool banks {[(b.name, b.row_shape, b.dtype) for b in pool.banks]} differ: "
            "build both from the same Bank specs"
        )


def _check_plan(pool: SlotPool, plan: torch.Tensor, count: torch.Tensor) -> None:
    if not isinstance(plan, torch.Tensor) or plan.dtype != torch.int32 or plan.dim() != 2 \
            or plan.shape[1] != 2 or plan.shape[0] < 1 or not plan.is_contiguous():
        raise ValueError(
            "plan must be a contiguous int32 tensor [Q >= 1, 2] of (key, slot) rows, got "
            f"{getattr(plan, 'dtype', type(plan))} {tuple(getattr(plan, 'shape', ()))}"
        )
    if not isinstance(count, torch.Tensor) or count.dtype != torch.int32 or count.numel() != 1:
        raise ValueError("count must be an int32 tensor [1] holding the live plan rows")
    for name, t in (("plan", plan), ("count", count)):
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device} but the pool is on {pool.device}: move {name}")


def _words_layout(store: HostStore, block_words: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ROW_WORDS, FIRST_CHUNK) of the kernel for the store's banks."""
    if len(store.banks) > MAX_BANKS:
        raise ValueError(
            f"miss_copy copies at most MAX_BANKS = {MAX_BANKS} banks in one launch, the store "
            f"has {len(store.banks)}: pack components into fewer banks"
        )
    row_words, first = [], [0]
    for b in store.banks:
        if b.row_bytes % WORD_BYTES:
            raise ValueError(
                f"bank {b.name!r} rows are {b.row_bytes} bytes; miss_copy moves 4-byte words, "
                "so pad the bank's row_shape to a multiple of 4 bytes"
            )
        row_words.append(b.row_bytes // 4)
        first.append(first[-1] + triton.cdiv(b.row_bytes // 4, block_words))
    return tuple(row_words), tuple(first)


TAIL_WHOLE, TAIL_ROWS, TAIL_COLS = 0, 1, 2


def tail_layout(store: HostStore, inter: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(KIND, UNIT) per bank of the store for a tail of experts of width `inter` (module docstring):
    TAIL_ROWS for a gate_up bank of rows [2I, ...] whose matrix rows are whole words (UNIT: words a
    row), TAIL_COLS for down's main part ("down", "down.q") whose rows are whole words (UNIT: words a
    row), TAIL_WHOLE (UNIT 0) for the others. Raises ValueError naming `inter` when it is not an int >= 1."""
    if isinstance(inter, bool) or not isinstance(inter, int) or inter < 1:
        raise ValueError(f"tail_layout: inter must be an int >= 1 (the expert width), got {inter!r}")
    kinds, units = [], []
    for b in store.banks:
        words = b.row_bytes // WORD_BYTES
        lead = b.row_shape[0] if b.row_shape else 0
        if b.name.startswith("gate_up") and len(b.row_shape) >= 2 and lead == 2 * inter and words % lead == 0:
            kinds.append(TAIL_ROWS)
            units.append(words // lead)
        elif b.name in ("down", "down.q") and len(b.row_shape) == 2 and words % lead == 0:
            kinds.append(TAIL_COLS)
            units.append(words // lead)
        else:
            kinds.append(TAIL_WHOLE)
            units.append(0)
    return tuple(kinds), tuple(units)


def _check_tail(pool: SlotPool, tail) -> tuple[torch.Tensor, int]:
    ok = isinstance(tail, tuple) and len(tail) == 2
    t, inter = tail if ok else (None, None)
    ok = ok and isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.numel() == 3 and t.is_contiguous()
    if not ok or isinstance(inter, bool) or not isinstance(inter, int) or inter < 1:
        raise ValueError("tail must be (int32 tensor [3] of (key, slot, cut), inter: the expert width >= 1)")
    if t.device != pool.device:
        raise ValueError(f"tail is on {t.device} but the pool is on {pool.device}: move tail")
    return t, inter


def _pointer_args(store: HostStore, pool: SlotPool) -> tuple[tuple, tuple]:
    """Per bank (source, destination) as int32 words: device views of the pinned store on
    CUDA, the CPU tensors themselves under the interpreter."""
    if pool.device.type == "cuda":
        srcs = tuple(store.device_view(b.name, torch.int32) for b in store.banks)
    else:
        srcs = tuple(store.tensor(b.name).view(store.num_keys, -1).view(torch.int32)
                     for b in store.banks)
    dsts = tuple(pool.tensor(b.name).view(pool.num_slots, -1).view(torch.int32)
                 for b in pool.banks)
    return srcs, dsts


def miss_copy(store: HostStore, pool: SlotPool, plan: torch.Tensor, count: torch.Tensor, *,
              num_ctas: int = DEFAULT_NUM_CTAS, block_bytes: int = DEFAULT_BLOCK_BYTES,
              num_warps: int = DEFAULT_NUM_WARPS, pdl: bool = False, release_after_wait: bool = False,
              tail: tuple[torch.Tensor, int] | None = None) -> None:
    """Copy store[bank][key] -> pool[bank][slot] for the first `count` rows of `plan`, and with `tail`
    = (int32 [3] (key, slot, cut) on the pool's device, I) the rows [cut, I) of one more expert (module
    docstring; key -1: none).

    plan:  int32 [Q, 2] (key, slot) rows on the pool's device; rows past count are ignored,
           rows with a key or slot out of range are skipped.
    count: int32 [1] on the pool's device, read only by the kernel (no host sync).
    num_ctas: programs of the persistent grid (SMs used). block_bytes: bytes a program moves
    per work item (a power of two >= 16). One launch on the current stream for all banks;
    CUDA-graph capturable once compiled (call it once before capturing). On a CPU pool it runs
    in Triton's interpreter when TRITON_INTERPRET=1, else raises RuntimeError. pdl: on CUDA, a
    programmatic dependent launch (it waits for its predecessor before reading the plan; same
    bytes copied). release_after_wait (with pdl on CUDA; no effect otherwise): the next programmatic
    launch on the stream may start right after the copy's own wait, before the plan is read; it must
    wait (griddepcontrol.wait) before it reads any slot the plan fills. Its programs then wait on the
    SMs for the whole copy, so it suits a stream with no other work that needs the SMs meanwhile.
    Raises ValueError for mismatched banks, rows not a multiple of 4 bytes, > MAX_BANKS banks,
    or a malformed plan or count. Cost: the live rows' bytes over PCIe, read by SM loads of mapped
    host memory (benchmarks/bench_copy.py compares it with the copy engines).
    """
    _check_pair(store, pool)
    _check_plan(pool, plan, count)
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1:
        raise ValueError(f"num_ctas must be a positive int, got {num_ctas!r}")
    if not isinstance(block_bytes, int) or block_bytes < VECTOR_BYTES or block_bytes & (block_bytes - 1):
        raise ValueError(f"block_bytes must be a power of two >= 16, got {block_bytes!r}")
    if not all(isinstance(v, bool) for v in (pdl, release_after_wait)):
        raise ValueError(f"pdl and release_after_wait must be bools, got {pdl!r} and {release_after_wait!r}")
    kernel = _kernel_for(pool.device)
    cuda = pool.device.type == "cuda"
    if cuda and not store.pinned:
        raise RuntimeError("miss_copy reads the store from pinned memory: build it with pin=True")
    block_words = block_bytes // 4
    row_words, first = _words_layout(store, block_words)
    srcs, dsts = _pointer_args(store, pool)
    extra = {}
    if tail is not None:
        t, inter = _check_tail(pool, tail)
        kinds, units = tail_layout(store, inter)
        extra = {"tail_ptr": t, "TAIL": True, "INTER": inter, "KIND": kinds, "UNIT": units}
    with torch.cuda.device(pool.device) if cuda else contextlib.nullcontext():
        kernel[(num_ctas,)](
            count, plan, plan.shape[0], store.num_keys, pool.num_slots, srcs, dsts,
            NUM_BANKS=len(row_words), ROW_WORDS=row_words, FIRST_CHUNK=first,
            CHUNKS_PER_ROW=first[-1], BLOCK=block_words, num_warps=num_warps, **extra,
            **({"GDC": True, "RELEASE": release_after_wait, "launch_pdl": True} if pdl and cuda else {}),
        )


def _live_rows(plan: np.ndarray, num_keys: int, num_slots: int) -> np.ndarray:
    """int64 [m', 2]: the rows of plan [m, 2] whose key and slot are in range."""
    plan = np.asarray(plan)
    if plan.ndim != 2 or plan.shape[1] != 2 or not np.issubdtype(plan.dtype, np.integer):
        raise ValueError(f"plan must be an integer array [m, 2] of (key, slot), got {plan.shape}")
    rows = plan.astype(np.int64)
    ok = (rows[:, 0] >= 0) & (rows[:, 0] < num_keys) & (rows[:, 1] >= 0) & (rows[:, 1] < num_slots)
    return rows[ok]


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(key, slot, length) runs of rows [m, 2] whose keys and slots both step by one."""
    runs: list[tuple[int, int, int]] = []
    for key, slot in rows.tolist():
        if runs and runs[-1][0] + runs[-1][2] == key and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((key, slot, 1))
    return runs


def miss_copy_ce(store: HostStore, pool: SlotPool, plan_host: np.ndarray,
                 stream: torch.cuda.Stream | None = None) -> int:
    """Copy-engine path for a plan on the host: eager decode and prefill.

    plan_host: integer array [m, 2] of (key, slot); rows out of range are skipped. Rows whose
    keys and slots both step by one merge into one copy. Issues one
    `copy_(non_blocking=True)` per (bank, run) from pinned memory on `stream` (default the
    current stream): DMA at the link's speed, no SMs used. A batched driver call
    (cudaMemcpyBatchAsync) would save the host's per-copy launch cost; these are plain
    per-run copies. Returns the number of copies issued.
    """
    _check_pair(store, pool)
    if pool.device.type == "cuda" and not store.pinned:
        raise RuntimeError("miss_copy_ce copies from pinned memory only: build the store with pin=True")
    runs = _runs(_live_rows(plan_host, store.num_keys, pool.num_slots))
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        for b in store.banks:
            src, dst = store.tensor(b.name), pool.tensor(b.name)
            for key, slot, length in runs:
                dst[slot:slot + length].copy_(src[key:key + length], non_blocking=True)
    return len(runs) * len(store.banks)


def reference_copy(store: HostStore, pool: SlotPool, plan: torch.Tensor, count: torch.Tensor) -> None:
    """The torch reference of miss_copy (index_copy per bank); works on CPU and CUDA.

    plan int32 [Q, 2], count int32 [1]: same meaning as in miss_copy. Reads count on the host.
    """
    _check_pair(store, pool)
    n = min(max(int(count.reshape(-1)[0].item()), 0), plan.shape[0])
    rows = torch.from_numpy(_live_rows(plan[:n].cpu().numpy().reshape(-1, 2),
                                       store.num_keys, pool.num_slots))
    if rows.shape[0] == 0:
        return
    keys, slots = rows[:, 0], rows[:, 1].to(pool.device)
    for b in store.banks:  # as bytes: index_copy has no float8 kernels
        src = _bytes(store.tensor(b.name)).index_select(0, keys).to(pool.device)
        _bytes(pool.tensor(b.name)).index_copy_(0, slots, src)


def reference_tail_copy(store: HostStore, pool: SlotPool, key: int, slot: int, cut: int, inter: int) -> None:
    """The torch reference of miss_copy's tail row: expert `key`'s rows [cut, I = inter) into `slot`
    (module docstring), the words tail_layout marks. Works on CPU and CUDA pools."""
    kinds, units = tail_layout(store, inter)
    for b, kind, unit in zip(store.banks, kinds, units):
        src = store.tensor(b.name)[key].reshape(-1).view(torch.int32).to(pool.device)
        dst = pool.tensor(b.name)[slot].reshape(-1).view(torch.int32)
        w = torch.arange(src.numel(), device=pool.device)
        if kind == TAIL_ROWS:
            keep = (w // unit) % inter >= cut
        elif kind == TAIL_COLS:
            keep = ((w % unit) + 1) * inter > cut * unit
        else:
            keep = torch.ones_like(w, dtype=torch.bool)
        dst[keep] = src[keep]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, row_bytes] view of a contiguous tensor [rows, *row]."""
    return t.view(t.shape[0], -1).view(torch.uint8)
