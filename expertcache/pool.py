"""Slot pool memory: every expert in host memory, the experts in use in GPU slots.

    Bank specs (name, row shape, dtype): the weight components of one expert
        -> HostStore: per bank a host tensor [num_keys, *row_shape], pinned when CUDA is
           present, indexed by key = layer * num_experts + expert
        -> SlotPool:  per bank a device tensor [num_slots, *row_shape], indexed by slot
    The miss copy (`expertcache.copy`) moves rows store[bank][key] -> pool[bank][slot]; the
    routed GEMM reads the pool by slot id. `HostStore.device_view` gives the device address
    of a pinned bank so a kernel can read host memory directly (zero copy, through UVA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

# Bytes the pool leaves free on the device for everything else (activations, graphs).
DEFAULT_RESERVE_BYTES = 1 << 30


class PoolError(ValueError):
    """A slot pool or host store that cannot be built as asked; the message names the fix."""


@dataclass(frozen=True)
class Bank:
    """One weight component of every expert, e.g. "gate_up" [2*I, H] bf16 or "down" [H, I].

    name: the bank's name, unique within a store or pool.
    row_shape: the shape of one expert's component (all dims >= 1).
    dtype: the element type (bf16, float8 bytes, uint8 packed weights, float32 scales ...).
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PoolError(f"Bank.name must be a non-empty str, got {self.name!r}")
        shape = tuple(self.row_shape) if isinstance(self.row_shape, (tuple, list)) else None
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
            raise PoolError(
                f"Bank {self.name!r}: row_shape must be a non-empty tuple of positive ints, "
                f"got {self.row_shape!r}"
            )
        object.__setattr__(self, "row_shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise PoolError(f"Bank {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def row_numel(self) -> int:
        """Elements in one expert's row."""
        n = 1
        for d in self.row_shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes in one expert's row."""
        return self.row_numel * self.dtype.itemsize


def _check_banks(banks: Sequence[Bank]) -> tuple[Bank, ...]:
    banks = tuple(banks)
    if not banks or not all(isinstance(b, Bank) for b in banks):
        raise PoolError("banks must be a non-empty sequence of Bank")
    names = [b.name for b in banks]
    if len(set(names)) != len(names):
        raise PoolError(f"bank names must be unique, got {names}")
    return banks


@dataclass(frozen=True)
class DeviceView:
    """The device address of one pinned host bank, usable as a Triton pointer argument.

    Holds a reference to the host tensor so the memory outlives every use of the view.
    `dtype` is the element type the kernel sees (any reinterpretation of the bytes).
    """

    ptr: int
    dtype: torch.dtype
    nbytes: int
    owner: torch.Tensor = field(repr=False, compare=False)

    def data_ptr(self) -> int:
        return self.ptr


def mapped_device_pointer(host_ptr: int, bank: str) -> int:
    """Device address of pinned host memory: cudaHostGetDevicePointer when cuda-python is
    present, otherwise the host address itself (valid on every UVA platform)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python layout
        except ImportError:
            return host_ptr
    err, dev_ptr = cudart.cudaHostGetDevicePointer(host_ptr, 0)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(
            f"bank {bank!r}: cudaHostGetDevicePointer failed ({err}); the host memory is not "
            "mapped into the device's address space. Build the HostStore with pin=True on a "
            "CUDA machine with unified addressing"
        )
    return int(dev_ptr)


class HostStore:
    """Every expert's banks in host memory: per bank a tensor [num_keys, *row_shape].

    Build with `from_tensors` or `empty`; row `key` of bank `b` is expert `key`'s component.
    Pinned (page-locked, mapped) when `pin` is true, the default wherever CUDA is available;
    plain CPU memory otherwise, which only the CPU paths (tests, reference) should use.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], pinned: bool) -> None:
        if not tensors:
            raise PoolError("a HostStore needs at least one bank")
        keys = {t.shape[0] if t.dim() else 0 for t in tensors.values()}
        if len(keys) != 1 or min(keys) < 1:
            shapes = {name: tuple(t.shape) for name, t in tensors.items()}
            raise PoolError(f"every bank needs the same number (>= 1) of key rows, got {shapes}")
        for name, t in tensors.items():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise PoolError(f"bank {name!r} must be a contiguous CPU tensor")
        self.banks = _check_banks(
            Bank(name, tuple(t.shape[1:]), t.dtype) for name, t in tensors.items()
        )
        self.num_keys = keys.pop()
        self.pinned = pinned
        self._tensors = dict(tensors)
        self._views: dict[tuple[str, torch.dtype], DeviceView] = {}

    @classmethod
    def from_tensors(cls, banks: Mapping[str, torch.Tensor], *, pin: bool | None = None) -> HostStore:
        """A store of the given tensors, each [num_keys, *row_shape] of any dtype.

        pin: copy into pinned memory (default: when CUDA is available). Tensors that are
        already pinned and contiguous, or any contiguous CPU tensor when not pinning, are used
        without a copy. Cost: one host copy of each tensor that needs pinning.
        """
        pin = torch.cuda.is_available() if pin is None else pin
        out = {}
        for name, t in banks.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                raise PoolError(f"bank {name!r} must be a tensor [num_keys, *row_shape]")
            t = t.detach().to("cpu").contiguous()
            if pin and not t.is_pinned():
                t = t.pin_memory()
            out[name] = t
        return cls(out, pinned=pin)

    @classmethod
    def empty(cls, banks: Sequence[Bank], num_keys: int, *, pin: bool | None = None) -> HostStore:
        """A store of uninitialised rows, [num_keys, *row_shape] per bank, for loaders to fill."""
        banks = _check_banks(banks)
        if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 1:
            raise PoolError(f"num_keys must be a positive int, got {num_keys!r}")
        pin = torch.cuda.is_available() if pin is None else pin
        tensors = {
            b.name: torch.empty((num_keys, *b.row_shape), dtype=b.dtype, pin_memory=pin)
            for b in banks
        }
        return cls(tensors, pinned=pin)

    def bank(self, name: str) -> Bank:
        for b in self.banks:
            if b.name == name:
                return b
        raise PoolError(f"no bank named {name!r}; the store has {[b.name for b in self.banks]}")

    def tensor(self, name: str) -> torch.Tensor:
        """The host tensor of one bank, [num_keys, *row_shape]."""
        self.bank(name)
        return self._tensors[name]

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one key's rows over all banks."""
        return sum(b.row_bytes for b in self.banks)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_expert * self.num_keys

    def device_view(self, name: str, dtype: torch.dtype | None = None) -> DeviceView:
        """A pointer argument for kernels reading bank `name` straight from host memory.

        dtype: the element type the kernel sees (default the bank's). The view's address is
        the mapped device address of the pinned tensor. Raises RuntimeError without CUDA, for
        an unpinned store, or when the memory is not mapped. Cached per (bank, dtype).
        """
        t = self.tensor(name)
        dtype = self.bank(name).dtype if dtype is None else dtype
        if (name, dtype) in self._views:
            return self._views[(name, dtype)]
        if not torch.cuda.is_available():
            raise RuntimeError(f"bank {name!r}: device_view needs a CUDA device")
        if not t.is_pinned():
            raise RuntimeError(
                f"bank {name!r} is in pageable memory, which a kernel cannot read: build the "
                "HostStore with pin=True"
            )
        torch.cuda.init()
        view = DeviceView(mapped_device_pointer(t.data_ptr(), name), dtype, t.nbytes, t)
        self._views[(name, dtype)] = view
        return view


class SlotPool:
    """The GPU slots: per bank a device tensor [num_slots, *row_shape], indexed by slot.

    banks: the Bank specs (the same as the HostStore's for the miss copy).
    num_slots: slots S (`--moe-slots`), >= 1.
    device: where the slots live ("cuda" = the current CUDA device, "cuda:1", or "cpu").
    max_bytes: the most bytes the pool may take; on CUDA the device's free memory less
        `reserve_bytes` also bounds it. Raises PoolError when S slots do not fit.
    Slot contents are undefined after construction and after `rebuild`.
    """

    def __init__(self, banks: Sequence[Bank], num_slots: int, device: str | torch.device = "cuda",
                 *, max_bytes: int | None = None, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        self.banks = _check_banks(banks)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self.num_slots = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self.rebuild(num_slots)

    @property
    def bytes_per_slot(self) -> int:
        return sum(b.row_bytes for b in self.banks)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def tensor(self, name: str) -> torch.Tensor:
        """The device tensor of one bank, [num_slots, *row_shape]."""
        if name not in self._tensors:
            raise PoolError(f"no bank named {name!r}; the pool has {[b.name for b in self.banks]}")
        return self._tensors[name]

    def available_bytes(self) -> int | None:
        """Bytes a pool may take now (its own current bytes included), or None if unbounded."""
        limits = [] if self.max_bytes is None else [self.max_bytes]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            limits.append(free + self.nbytes - self.reserve_bytes)
        return max(0, min(limits)) if limits else None

    def zero_slot(self, slot: int) -> None:
        """Zero every bank's row `slot` (all bytes: a scale bank's zeros are finite too)."""
        for b in self.banks:
            self.tensor(b.name)[slot].view(torch.uint8).zero_()

    def rebuild(self, num_slots: int) -> None:
        """Re-size the pool to `num_slots` slots: free the old tensors, then allocate.

        Checks the size first (PoolError, pool unchanged); contents are undefined after, so
        callers cold-start their slot maps. Cost: one device allocation per bank.
        """
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise PoolError(f"--moe-slots must be a positive int, got {num_slots!r}")
        if num_slots >= 2**31:
            raise PoolError(f"--moe-slots {num_slots} does not fit int32 slot ids")
        self._check_fits(num_slots)
        self._free()
        try:
            self._tensors = {
                b.name: torch.empty((num_slots, *b.row_shape), dtype=b.dtype, device=self.device)
                for b in self.banks
            }
        except torch.OutOfMemoryError as e:
            self._free()
            raise PoolError(
                f"--moe-slots {num_slots} ({num_slots * self.bytes_per_slot} bytes) did not fit "
                f"on {self.device}: lower --moe-slots ({e})"
            ) from None
        self.num_slots = num_slots

    def _check_fits(self, num_slots: int) -> None:
        room = self.available_bytes()
        need = num_slots * self.bytes_per_slot
        if room is None or need <= room:
            return
        fits = room // self.bytes_per_slot
        raise PoolError(
            f"--moe-slots {num_slots} needs {need / 2**30:.2f} GiB ({self.bytes_per_slot} bytes "
            f"a slot) but {room / 2**30:.2f} GiB fits on {self.device} (keeping "
            f"{self.reserve_bytes / 2**30:.2f} GiB free): at most {fits} slots fit; "
            "lower --moe-slots"
        )

    def _free(self) -> None:
        self._tensors = {}
        self.num_slots = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
