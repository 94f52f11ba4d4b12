"""Tile sizes of the MoE layer's Triton launches: small frozen dataclasses that check themselves.

    RouterTiles ──block_e / chunk_h / early_weights_fit──► the router launch's constexprs (moe.kernels.router)
    RoutedTiles ──capped / gate_up_grid / down_grid──► the routed gate_up and down launches (moe.kernels.routed)
    MmaTiles ──grids──► the tensor-core routed launches (moe.kernels.routed_mma)

A tile larger than its dimension is capped at the dimension's next power of two, so one set of
tiles serves every shape. The defaults are the tiles the layer launches (moe.kernels.plan's
LaunchPlan holds them); docs/layer.md says how they were chosen. No torch, no Triton: decidable
on the host.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

GEMV_BLOCK_I = 1  # routed gate_up: rows of gate (and as many of up) per program
GEMV_BLOCK_H = 2  # routed down: output rows per program
SMALL_T = 4  # the router takes RouterTiles.block_e_small experts per program up to this many tokens
EARLY_WEIGHTS_MAX_ELEMENTS = 16384  # router_w elements one program may hold in registers (32 KB of bf16)
MAX_WARPS = 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _check_pow2_fields(obj) -> None:
    """Raise ValueError naming the field unless every field is a power of two >= 1 and every
    field named warps* is at most MAX_WARPS."""
    cls = type(obj).__name__
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{cls}.{f.name} must be a power of two >= 1, got {v!r}")
        if f.name.startswith("warps") and v > MAX_WARPS:
            raise ValueError(f"{cls}.{f.name} must be <= {MAX_WARPS}, got {v}")


@dataclass(frozen=True)
class RouterTiles:
    """Tiles of the router launch (grid (T, ceil(E / block_e))); every field a power of two >= 1.

    block_e_small: experts (rows of router_w) per program for calls of up to SMALL_T tokens.
    block_e: experts per program above SMALL_T tokens (fewer, longer programs when every token's
    logits already fill the GPU). chunk_h: hidden columns per load step. warps: num_warps (<= 16).
    Raises ValueError naming the field.
    """

    block_e_small: int = 2
    block_e: int = 4
    chunk_h: int = 1024
    warps: int = 4

    def __post_init__(self) -> None:
        _check_pow2_fields(self)

    def block_e_for(self, tokens: int, num_experts: int) -> int:
        """Experts per program of a call of `tokens` tokens over E = num_experts (capped at E's power of two)."""
        return min(self.block_e_small if tokens <= SMALL_T else self.block_e, next_pow2(num_experts))

    def chunk_for(self, hidden: int) -> int:
        """Hidden columns per load step at width H = hidden (capped at H's power of two)."""
        return min(self.chunk_h, next_pow2(hidden))

    def early_weights_held(self, num_experts: int, hidden: int, tokens: int) -> int:
        """router_w elements one program holds when it loads its rows before its wait (H rounded up
        to the load step)."""
        chunk = self.chunk_for(hidden)
        return self.block_e_for(tokens, num_experts) * (-(-hidden // chunk)) * chunk

    def early_weights_fit(self, num_experts: int, hidden: int, tokens: int) -> bool:
        """Whether a program's router_w rows fit in registers (EARLY_WEIGHTS_MAX_ELEMENTS) at this call."""
        return self.early_weights_held(num_experts, hidden, tokens) <= EARLY_WEIGHTS_MAX_ELEMENTS

    @property
    def name(self) -> str:
        """Short label, e.g. 'b2-4w4' (block_e_small-block_e, warps) or 'b8w2' when both are equal."""
        block = (
            f"{self.block_e_small}" if self.block_e_small == self.block_e else f"{self.block_e_small}-{self.block_e}"
        )
        return f"b{block}w{self.warps}" + ("" if self.chunk_h == 1024 else f"c{self.chunk_h}")


@dataclass(frozen=True)
class RoutedTiles:
    """Tiles of the routed gate_up and down launches; every field a power of two >= 1 (warps <= 16).

    block_i: gate rows (and as many up rows) per gate_up program. chunk_h: hidden columns per load
    step of a gate_up program. warps_gate_up: its num_warps. block_h: output rows per down program.
    chunk_i: intermediate columns per load step of a down program. warps_down: its num_warps.
    The defaults of block_i and block_h are GEMV_BLOCK_I and GEMV_BLOCK_H, so
    moe.kernels.plan.make_routed_plan's default grid is the one launched. Raises ValueError naming the field.
    """

    block_i: int = GEMV_BLOCK_I
    chunk_h: int = 1024
    warps_gate_up: int = 2
    block_h: int = GEMV_BLOCK_H
    chunk_i: int = 512
    warps_down: int = 4

    def __post_init__(self) -> None:
        _check_pow2_fields(self)

    def capped(self, hidden: int, inter: int) -> tuple[int, int, int, int]:
        """(block_i, chunk_h, block_h, chunk_i), each capped at its dimension's power of two."""
        h2, i2 = next_pow2(hidden), next_pow2(inter)
        return min(self.block_i, i2), min(self.chunk_h, h2), min(self.block_h, h2), min(self.chunk_i, i2)

    def gate_up_grid(self, tokens: int, top_k: int, hidden: int, inter: int) -> tuple[int, int]:
        """(T * k, ceil(I / block_i)): one program per (token, routed slot, row tile)."""
        block_i = self.capped(hidden, inter)[0]
        return tokens * top_k, -(-inter // block_i)

    def down_grid(self, tokens: int, hidden: int, inter: int) -> tuple[int, int]:
        """(T, ceil(H / block_h)): one program per (token, output row tile)."""
        block_h = self.capped(hidden, inter)[2]
        return tokens, -(-hidden // block_h)

    def even(self, hidden: int, inter: int) -> tuple[bool, bool]:
        """(gate_up, down): whether the tiles divide the shape, so the launch needs no masks."""
        block_i, chunk_h, block_h, chunk_i = self.capped(hidden, inter)
        return inter % block_i == 0 and hidden % chunk_h == 0, hidden % block_h == 0 and inter % chunk_i == 0

    @property
    def name(self) -> str:
        """Short label i<block_i>x<chunk_h>w<warps>-h<block_h>x<chunk_i>w<warps>, e.g. 'i1x1024w2-h2x512w4'."""
        return (f"i{self.block_i}x{self.chunk_h}w{self.warps_gate_up}-"
                f"h{self.block_h}x{self.chunk_i}w{self.warps_down}")


MMA_MIN_BLOCK = 16  # tl.dot's least M and N


@dataclass(frozen=True)
class MmaTiles:
    """Tiles of the tensor-core routed launches (moe.kernels.routed_mma); every field a power of two
    >= 1, block_m and the block_n fields >= MMA_MIN_BLOCK, warps <= 16.

    block_m: member tokens of a slot per dot (more members take more tiles). block_n: gate rows (and
    as many up rows) per gate_up program; warps_gate_up its num_warps. down_block_n: output rows per
    down program; warps_down its num_warps. block_h: output rows per combine program; warps_combine
    its num_warps. Raises ValueError naming the field.
    """

    block_m: int = 16
    block_n: int = 32
    warps_gate_up: int = 4
    down_block_n: int = 64
    warps_down: int = 4
    block_h: int = 256
    warps_combine: int = 2

    def __post_init__(self) -> None:
        _check_pow2_fields(self)
        for name in ("block_m", "block_n", "down_block_n"):
            if getattr(self, name) < MMA_MIN_BLOCK:
                raise ValueError(f"MmaTiles.{name} must be >= {MMA_MIN_BLOCK} (tl.dot's least M and N), "
                                 f"got {getattr(self, name)}")

    def grids(self, tokens: int, top_k: int, hidden: int, inter: int) -> tuple[tuple[int, ...], ...]:
        """(gate_up, down, combine) grids: (T * k, ceil(I / block_n)), (T * k, ceil(H /
        down_block_n)), (T, ceil(H / block_h)); a gate_up or down program whose pair does not lead its
        slot's group returns at once."""
        pairs = tokens * top_k
        return ((pairs, -(-inter // self.block_n)), (pairs, -(-hidden // self.down_block_n)),
                (tokens, -(-hidden // self.block_h)))

    @classmethod
    def from_name(cls, name: str) -> MmaTiles:
        """The tiles of a `name` label. Raises ValueError for a label of another form or bad tiles."""
        m = re.fullmatch(r"m(\d+)-i(\d+)w(\d+)-h(\d+)w(\d+)-c(\d+)w(\d+)", name)
        if m is None:
            raise ValueError(f"{name!r} is not like {cls().name}")
        return cls(*(int(g) for g in m.groups()))

    @property
    def name(self) -> str:
        """Short label m<block_m>-i<block_n>w<warps>-h<down_block_n>w<warps>-c<block_h>w<warps>."""
        return (f"m{self.block_m}-i{self.block_n}w{self.warps_gate_up}-h{self.down_block_n}w{self.warps_down}"
                f"-c{self.block_h}w{self.warps_combine}")
