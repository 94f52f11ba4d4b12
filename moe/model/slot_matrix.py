"""One weight matrix of every slot, in an expert format, as the routed kernels read it.

    SlotPool banks "gate_up.q", "gate_up.s", ... (expertcache.formats: the format's parts, each
    [S, *part shape]) ──SlotMatrix.of_pool──► SlotMatrix(fmt, parts, out, in, stack)
    a plain tensor [S, out, in] (bf16 / f16 / f32) ──SlotMatrix.dense──► the same for a dense format
    SlotMatrix ──kernel_args──► (q, s, s2, z) pointers (an absent part: q again) + FMT / ZP constexprs
               ──dequantize──► float32 [S', out, in] of chosen slots: the torch reference
    (matrix, slot) rows of several matrices ──dequantize_rows──► float32 [G, out, in] in one decode (prefill)

gate_up is a stack of 2 sub-matrices (gate_proj over up_proj, each with its own scales), down a stack
of 1. No device work except the dequantizes. Legend: S = pool slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from expertcache.formats import ExpertFormat, bank_name, dense_format, resolve_format

# Kernel codes of the quantized formats (the routed kernels' FMT constexpr); 0 is a dense float matrix.
CODES = {"fp8": 1, "nvfp4": 2, "mxfp4": 3, "int4": 4}
DENSE_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class SlotMatrix:
    """Matrix [out_features, in_features] (of `stack` sub-matrices) of every slot in format `fmt`:
    `parts`, one tensor [S, *part shape] per part of fmt.layout(out, in, stack), in that order.

    Raises ValueError naming the part whose shape, dtype, device or layout disagrees with the format.
    """

    fmt: ExpertFormat
    parts: tuple[torch.Tensor, ...]
    out_features: int
    in_features: int
    stack: int = 1

    def __post_init__(self) -> None:
        layout = self.fmt.layout(self.out_features, self.in_features, self.stack)
        if not isinstance(self.parts, tuple) or len(self.parts) != len(layout):
            raise ValueError(f"SlotMatrix: {self.fmt.name} needs {len(layout)} parts "
                             f"({[p.suffix for p in layout]}), got {len(getattr(self, 'parts', ()))}")
        num = None
        for p, t in zip(layout, self.parts):
            want = getattr(torch, p.dtype)
            ok = isinstance(t, torch.Tensor) and t.dtype == want and t.dim() == 1 + len(p.shape)
            ok = ok and tuple(t.shape[1:]) == p.shape and t.is_contiguous() and t.shape[0] >= 1
            if not ok:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"SlotMatrix: {self.fmt.name} part {p.suffix or 'weights'!r} must be a contiguous "
                                 f"{p.dtype} [S, {', '.join(map(str, p.shape))}], got {got}")
            num = t.shape[0] if num is None else num
            if t.shape[0] != num or t.device != self.parts[0].device:
                raise ValueError(f"SlotMatrix: every part needs the same slots S on one device, part "
                                 f"{p.suffix!r} has {t.shape[0]} on {t.device}")
        if self.fmt.pack == 2 and self.in_features % 8:
            raise ValueError(f"SlotMatrix: the routed kernels read {self.fmt.name} values as 32-bit words of 8: "
                             f"in_features={self.in_features} must be a multiple of 8")

    @classmethod
    def of_pool(cls, pool, fmt: ExpertFormat | str, name: str, out_features: int, in_features: int,
                stack: int = 1) -> SlotMatrix:
        """Matrix `name` ("gate_up" [2I, H], stack 2; "down" [H, I]) of a SlotPool or HostStore (anything
        with `.tensor(bank)`) or a mapping bank -> tensor, whose banks are fmt.banks(name, ...)."""
        fmt = resolve_format(fmt) if isinstance(fmt, str) else fmt
        get = pool.__getitem__ if isinstance(pool, Mapping) else pool.tensor
        parts = tuple(get(bank_name(name, p.suffix)) for p in fmt.layout(out_features, in_features, stack))
        return cls(fmt, parts, out_features, in_features, stack)

    @classmethod
    def dense(cls, weights: torch.Tensor, stack: int = 1) -> SlotMatrix:
        """A plain [S, out, in] tensor of bf16 / f16 / f32 as the dense format of its dtype."""
        if not isinstance(weights, torch.Tensor) or weights.dim() != 3 or weights.dtype not in DENSE_DTYPES:
            got = (
                f"{weights.dtype} {list(weights.shape)}"
                if isinstance(weights, torch.Tensor)
                else type(weights).__name__
            )
            raise ValueError(f"SlotMatrix.dense: weights must be a bf16 / f16 / f32 tensor [S, out, in], got {got}")
        return cls(dense_format(DENSE_DTYPES[weights.dtype]), (weights,), weights.shape[1], weights.shape[2], stack)

    def to(self, device: torch.device | str) -> SlotMatrix:
        """The same matrix with every part on `device` (self when already there)."""
        device = torch.device(device)
        if self.device == device:
            return self
        return SlotMatrix(self.fmt, tuple(t.to(device) for t in self.parts), self.out_features, self.in_features,
                          self.stack)

    @property
    def num_slots(self) -> int:
        return self.parts[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def code(self) -> int:
        """The kernels' FMT constexpr: 0 for a dense format, else CODES."""
        return 0 if self.fmt.dense else CODES[self.fmt.name]

    @property
    def zero_points(self) -> bool:
        """The kernels' ZP constexpr: int4 with a zero-point part."""
        return bool(getattr(self.fmt, "zero_points", False))

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, s, s2, z): the parts by role; a part the format lacks is q again (never read). fp8 values
        go as their uint8 bytes (the kernels' masked loads need an integer `other`), 4-bit values as int32
        words of 8 (in_features is a multiple of 8). Made once per SlotMatrix."""
        return self._kernel_args

    def roles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, scales, global scales, zero points): the parts by role, as stored; a part the format lacks
        is the values again (never read)."""
        by = {p.suffix: t for p, t in zip(self.fmt.layout(self.out_features, self.in_features, self.stack),
                                          self.parts)}
        q = by[self.fmt.main]
        return q, by.get("s", q), by.get("s2", q), by.get("z", q)

    @cached_property
    def _kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raw, s, s2, z = self.roles()
        q = raw
        if q.dtype == torch.float8_e4m3fn:
            q = q.view(torch.uint8)
        elif self.fmt.pack == 2:  # 4-bit values two a byte: 8 a word
            q = q.view(torch.int32)
        return q, *((q if t is raw else t) for t in (s, s2, z))  # a lacking part: the kernels' view of q

    def dequantize(self, slots: torch.Tensor | list[int], device: torch.device | None = None) -> torch.Tensor:
        """float32 [n, out, in]: the format's torch dequantize of each slot in `slots` (ints, each in [0, S)),
        on `device` (default the matrix's; the slot's parts move there first). The reference the kernels are
        checked against. Cost: one dequantize_one per slot; one host read of `slots`."""
        ids = slots.reshape(-1).tolist() if isinstance(slots, torch.Tensor) else list(slots)
        device = self.device if device is None else torch.device(device)
        if not ids:
            return torch.empty((0, self.out_features, self.in_features), dtype=torch.float32, device=device)
        return torch.stack([self.dequantize_one(s, device) for s in ids])

    def dequantize_one(self, slot: int, device: torch.device | None = None) -> torch.Tensor:
        """float32 [out, in]: the format's decode of slot `slot` on `device` (default the matrix's), without
        a stack's copy and, for a dense format, in one cast (its decode is elementwise, so decoding the
        stack whole equals decoding each sub-matrix); a float32 dense matrix's is the slot's own memory."""
        device = self.device if device is None else torch.device(device)
        if self.fmt.dense:
            return self.parts[0][slot].to(device, non_blocking=True).to(torch.float32)
        layout = self.fmt.layout(self.out_features, self.in_features, self.stack)
        parts = {p.suffix: t[slot].to(device, non_blocking=True) for p, t in zip(layout, self.parts)}
        return self.fmt.decode(parts, self.out_features, self.in_features, self.stack)


def dequantize_rows(rows: list[tuple[SlotMatrix, int]], device: torch.device | str) -> torch.Tensor:
    """float32 [G, out, in]: the decode of each (matrix, slot) in `rows`, matrices of one format and shape
    (a pool's, a staging ring's, a store's), on `device`: each part of the G rows moved there and stacked,
    then decoded at once (ExpertFormat.decode_batch), bit for bit SlotMatrix.dequantize_one of each. The
    result is new memory, so a slot may be overwritten once the ops are queued. Prefill's group of experts:
    a few ops for the group where one expert's decode alone takes a dozen or more. Raises ValueError naming
    `rows` when they are empty or their formats or shapes differ."""
    if not rows:
        raise ValueError("dequantize_rows: rows is empty")
    first = rows[0][0]
    shape = (first.fmt, first.out_features, first.in_features, first.stack)
    if any((m.fmt, m.out_features, m.in_features, m.stack) != shape for m, _ in rows):
        raise ValueError("dequantize_rows: rows must be of one format, shape and stack")
    device = torch.device(device)
    parts = [torch.stack([m.parts[p][slot].to(device, non_blocking=True) for m, slot in rows])
             for p in range(len(first.parts))]
    if first.fmt.dense:
        return parts[0].to(torch.float32)
    layout = first.fmt.layout(first.out_features, first.in_features, first.stack)
    return first.fmt.decode_batch({p.suffix: t for p, t in zip(layout, parts)}, first.out_features,
                                  first.in_features, first.stack)
