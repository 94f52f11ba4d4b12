"""The expert-format interface: how one weight matrix W [out, in] of an expert is stored.

    W [out, in] bf16 / f16 / f32 ──quantize──► parts {suffix: tensor}, one part per bank
        bank name: the matrix's own name for the one part of bf16 (suffix ""), else f"{name}.{suffix}":
        "q" values (packed two per byte for the 4-bit formats), "s" scales, "s2" nvfp4's per-tensor
        global scale, "z" int4 zero points (asymmetric checkpoints)
    parts ──dequantize──► W' float32 [out, in]: the reference every kernel is checked against

An expert is two matrices, gate_up [2I, H] (gate_proj stacked over up_proj) and down [H, I]; its banks
are those of both (`expert_banks`), and row `key` of a HostStore / SlotPool bank is one expert's part.
A stacked matrix (`stack` = 2 for gate_up) is its sub-matrices quantized one by one, each part of them
concatenated along its first dimension: gate_proj and up_proj keep their own scales, as the checkpoints
store them (nvfp4's s2 of gate_up is [2]: gate's global scale, then up's).
`layout` (suffix, row shape, dtype name of each part) and the byte counts are integer arithmetic that
needs no torch, so the simulator can price a format without it; only `banks`, `quantize` and
`dequantize` import torch. A shape a format cannot store (in_features not a multiple of its packing
or scale block) is refused, never padded: the error names in_features and the multiple.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from expertcache.errors import FormatError

if TYPE_CHECKING:
    import torch

    from expertcache.pool import Bank

# Bytes per element of each dtype a part may have (names of torch dtypes).
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1}
INPUT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Part:
    """One stored component of a matrix: its bank suffix, row shape and dtype (a torch dtype's name)."""

    suffix: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def bank_name(name: str, suffix: str) -> str:
    """The bank of part `suffix` of matrix `name`: "gate_up" for bf16's part "", else "gate_up.q"."""
    return f"{name}.{suffix}" if suffix else name


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExpertFormat:
    """A storage format of expert matrices. Subclasses set the class constants and implement
    `_layout`, `_quantize`, `_dequantize` (and `_check_values` where codes or scales can be invalid).
    `_dequantize` decodes parts that may carry the same leading dimensions (several matrices at once,
    `decode_batch`): elementwise, so each matrix's values are those of decoding it alone.

    name: the registry key (`--moe-expert-format`). in_multiple: in_features must be a multiple of
    it (`in_rule` says why). main / pack: the part whose shape is [out, in / pack] (gives the matrix
    shape on dequantize). in_block: the inputs of a row one scale covers (fp8's 128-wide blocks, int4's
    groups, the E2M1 formats' blocks; 1 for the dense formats), so a row's inputs [0, c) with c a
    multiple of it are read with whole scales.
    """

    name: ClassVar[str] = ""
    in_multiple: ClassVar[int] = 1
    in_rule: ClassVar[str] = ""
    main: ClassVar[str] = "q"
    pack: ClassVar[int] = 1
    in_block: ClassVar[int] = 1  # inputs one scale covers along a row (1: none, or one per row)

    @property
    def key(self) -> str:
        """The name of this variant (`resolve_format` reads it back): the registry name, with the
        options of a variant the registry does not list (int4 "int4-f16-z": float16 scales, zero points)."""
        return self.name

    @property
    def dense(self) -> bool:
        """True for an unquantized format (one part, the matrix itself in a float dtype)."""
        return self.main == ""

    def layout(self, out_features: int, in_features: int, stack: int = 1) -> tuple[Part, ...]:
        """The parts of one [out_features, in_features] matrix made of `stack` sub-matrices of
        out_features / stack rows each (every part's first dimension is `stack` times the sub-matrix
        part's). Pure integer arithmetic.

        Raises FormatError naming out_features / in_features / stack when a dim is not a positive int,
        out_features is not a multiple of stack, or in_features is not a multiple of `in_multiple`
        (refused, not padded).
        """
        for field, v in (("out_features", out_features), ("in_features", in_features), ("stack", stack)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FormatError(f"{self.name}: {field} must be a positive int, got {v!r}")
        if out_features % stack:
            raise FormatError(f"{self.name}: out_features={out_features} is not a multiple of stack={stack} "
                              "(the sub-matrices stacked)")
        if in_features % self.in_multiple:
            raise FormatError(
                f"{self.name}: in_features={in_features} is not a multiple of {self.in_multiple} "
                f"({self.in_rule}); such a matrix is refused, not padded: choose another "
                "--moe-expert-format for this model"
            )
        parts = self._layout(out_features // stack, in_features)
        return tuple(Part(p.suffix, (stack * p.shape[0], *p.shape[1:]), p.dtype) for p in parts)

    def matrix_bytes(self, out_features: int, in_features: int, stack: int = 1) -> int:
        """Bytes of one [out, in] matrix of `stack` sub-matrices in this format, every part included."""
        return sum(p.nbytes for p in self.layout(out_features, in_features, stack))

    def expert_bytes(self, hidden: int, intermediate: int) -> int:
        """Bytes of one expert: gate_up [2I, H] (gate_proj and up_proj, stack 2) plus down [H, I]."""
        return self.matrix_bytes(2 * intermediate, hidden, 2) + self.matrix_bytes(hidden, intermediate)

    def banks(self, name: str, out_features: int, in_features: int, stack: int = 1) -> tuple[Bank, ...]:
        """The HostStore / SlotPool banks of matrix `name` [out, in] of `stack` sub-matrices, in layout order."""
        import torch

        from expertcache.pool import Bank

        return tuple(Bank(bank_name(name, p.suffix), p.shape, getattr(torch, p.dtype))
                     for p in self.layout(out_features, in_features, stack))

    def expert_banks(self, hidden: int, intermediate: int) -> tuple[Bank, ...]:
        """The banks of one expert: those of "gate_up" [2I, H] (stack 2), then those of "down" [H, I]."""
        return self.banks("gate_up", 2 * intermediate, hidden, 2) + self.banks("down", hidden, intermediate)

    def quantize(self, w: torch.Tensor, stack: int = 1) -> dict[str, torch.Tensor]:
        """Parts of `w` [out, in] (bfloat16 / float16 / float32, finite), on w's device; with `stack`,
        each of its `stack` row blocks is quantized alone and the parts are concatenated (dim 0).

        Deterministic round to nearest, ties to even; the scaling rule is the subclass's docstring.
        Cost: a few elementwise passes over w in float32. Raises FormatError naming `w` (not 2-D, its
        dtype, non-finite values), in_features or stack (see `layout`).
        """
        import torch

        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise FormatError(f"{self.name}.quantize: w must be a 2-D tensor [out_features, in_features], got {got}")
        if str(w.dtype).removeprefix("torch.") not in INPUT_DTYPES:
            raise FormatError(f"{self.name}.quantize: w.dtype must be one of {INPUT_DTYPES}, got {w.dtype}")
        layout = self.layout(*w.shape, stack)
        if not bool(torch.isfinite(w).all()):
            raise FormatError(f"{self.name}.quantize: w has non-finite values (nan / inf)")
        subs = [self._quantize(sub.float().contiguous()) for sub in w.chunk(stack)]
        parts = {k: torch.cat([p[k] for p in subs]).contiguous() for k in subs[0]}
        self._check_parts(parts, layout)
        return parts

    def dequantize(self, parts: Mapping[str, torch.Tensor], stack: int = 1) -> torch.Tensor:
        """W' float32 [out, in] from `parts` (exactly the layout's keys, shapes and dtypes) of a matrix
        of `stack` sub-matrices (each part's dim 0 split in `stack`, each sub-matrix decoded alone).

        Raises FormatError naming the part (parts['s'] ...) that is missing, extra, of the wrong shape
        or dtype, on another device, or holds an invalid code or scale (NaN, inf, out of range).
        """
        import torch

        if not isinstance(parts, Mapping):
            raise FormatError(f"{self.name}.dequantize: parts must be a mapping suffix -> tensor")
        main = parts.get(self.main)
        if not isinstance(main, torch.Tensor) or main.dim() != 2:
            raise FormatError(f"{self.name}.dequantize: parts[{self.main!r}] must be a 2-D tensor "
                              f"[out_features, in_features / {self.pack}]")
        out_features, in_features = main.shape[0], main.shape[1] * self.pack
        self._check_parts(parts, self.layout(out_features, in_features, stack))
        self._check_values(parts)
        return self.decode(parts, out_features, in_features, stack)

    def decode(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int,
               stack: int = 1) -> torch.Tensor:
        """W' float32 [out, in] of parts already checked (a store or pool's own rows): `dequantize` without
        the checks, so a GPU caller syncs nothing. The parts must have the layout's shapes. decode_batch of
        one matrix."""
        return self.decode_batch({k: v.unsqueeze(0) for k, v in parts.items()}, out_features, in_features, stack)[0]

    def decode_batch(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int,
                     stack: int = 1) -> torch.Tensor:
        """W' float32 [G, out, in] of G matrices at once, each part [G, *its layout shape] (a store or
        pool's rows of G experts, stacked): bit for bit `decode` of each, in the ops of one (prefill
        decodes a group of experts so, where the host's op count per expert would bound it)."""
        import torch

        if stack == 1 or self._stacks_decode_whole(out_features // stack):  # no copy of sub-matrices into one
            return self._dequantize(parts, out_features, in_features)
        subs = [{k: v.chunk(stack, dim=1)[i] for k, v in parts.items()} for i in range(stack)]
        return torch.cat([self._dequantize(p, out_features // stack, in_features) for p in subs], dim=1)

    def _stacks_decode_whole(self, sub_rows: int) -> bool:
        """True where a stack of sub-matrices of `sub_rows` rows decodes as one matrix of all their rows (no
        part spans rows across a sub-matrix's edge and none is per sub-matrix): the formats that say so."""
        return False

    def check(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int, stack: int = 1) -> None:
        """Refuse `parts` that are not exactly the layout of [out, in] (keys, shapes, dtypes, one device) or
        hold an invalid code or scale: FormatError naming the part. Cost: one pass over the scales (and
        over fp8 values for the NaN code)."""
        self._check_parts(parts, self.layout(out_features, in_features, stack))
        self._check_values(parts)

    def _check_parts(self, parts: Mapping[str, torch.Tensor], layout: tuple[Part, ...]) -> None:
        import torch

        want = [p.suffix for p in layout]
        if sorted(parts) != sorted(want):
            raise FormatError(f"{self.name}: parts must have exactly the keys {sorted(want)}, got {sorted(parts)}")
        devices = {t.device for t in parts.values() if isinstance(t, torch.Tensor)}
        for p in layout:
            t = parts[p.suffix]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != p.shape or t.dtype != getattr(torch, p.dtype):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise FormatError(f"{self.name}: parts[{p.suffix!r}] must be {p.dtype} {p.shape}, got {got}")
        if len(devices) != 1:
            raise FormatError(f"{self.name}: every part must be on one device, got {sorted(map(str, devices))}")

    def _check_values(self, parts: Mapping[str, torch.Tensor]) -> None:
        """Refuse invalid codes or scales (FormatError naming the part); nothing to check by default."""

    def _layout(self, out_features: int, in_features: int) -> tuple[Part, ...]:
        raise NotImplementedError

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _dequantize(self, parts: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        raise NotImplementedError


def check_finite(fmt: ExpertFormat, parts: Mapping[str, torch.Tensor], *suffixes: str) -> None:
    """Refuse a NaN / inf in the given parts (decoded to float32), naming the part."""
    import torch

    for suffix in suffixes:
        if not bool(torch.isfinite(parts[suffix].float()).all()):
            raise FormatError(f"{fmt.name}: parts[{suffix!r}] holds NaN or inf")
