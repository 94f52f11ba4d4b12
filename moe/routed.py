"""The routed-expert GEMM of a decode step (1..GEMV_MAX_TOKENS tokens), read from the slot pool by slot id.

    hidden [T, H], slots [T, k] int32, weights [T, k] float32
    pool banks gate_up [S, 2I, H], down [S, H, I]        (expertcache.pool.SlotPool, indexed by slot)
        │
        ├─ launch 1, _gate_up_kernel, grid (T * k, ceil(I / block_i)): program (t * k + j, tile)
        │     reads gate rows [tile) and up rows [I + tile) of slot slots[t, j], both · hidden[t]
        │     -> act [T * k, I] float32 = weights[t, j] * silu(gate) * up   (0 when no expert)
        │
        └─ launch 2, _down_kernel, grid (T, ceil(H / block_h)): program (t, tile)
              for j = 0 .. k-1 in order: acc += down[slots[t, j]][tile, :] * act[t * k + j, :]
              -> out [T, H] float32 = Σ_j weights[t, j] * down(silu(gate(x)) * up(x))

Legend: T = tokens, H = hidden, I = expert width, k = top_k, S = pool slots. A slot id outside
[0, S) (NO_SLOT = -1 in particular) contributes nothing. No expert weights are gathered or copied:
every program streams whole rows of one slot with 16-byte loads and accumulates in float32.
Both launches have independent programs (no atomics, no grid barrier), so the result is bitwise
repeatable for a fixed RoutedConfig and any side-stream work may hold SMs meanwhile. A slot that
several tokens route to is read once per token; the repeats run side by side and meet in L2.
Nothing reads a device value on the host, so a call is CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe.config import MoEConfig
from moe.plan import (
    GEMV_BLOCK_H,
    GEMV_BLOCK_I,
    GEMV_MAX_TOKENS,
    RoutedPlan,
    make_routed_plan,
)

NO_SLOT = -1
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_JIT_OPTIONS = {"do_not_specialize": ["num_slots"]}  # a pool rebuilt with new S keeps its kernels


@dataclass(frozen=True)
class RoutedConfig:
    """Tiles of the two launches; every field a power of two >= 1 (warps: 1..16).

    block_i: gate rows (and as many up rows) per gate_up program. chunk_h: hidden columns per
    load step of a gate_up program. block_h: output rows per down program. chunk_i: intermediate
    columns per load step of a down program. warps_gate_up / warps_down: num_warps of each launch.
    The defaults come from moe.plan (GEMV_BLOCK_I, GEMV_BLOCK_H) so make_routed_plan's grid is the
    one launched. Raises ValueError naming the field.
    """

    block_i: int = GEMV_BLOCK_I
    chunk_h: int = 1024  # i4x1024w8-h4x512w4: fastest of the H200 sweep at T = 1, 2, 4 and 8
    warps_gate_up: int = 8  # (benchmarks/results/routed-2026-11-30.json)
    block_h: int = GEMV_BLOCK_H
    chunk_i: int = 512
    warps_down: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"RoutedConfig.{f.name} must be a power of two >= 1, got {v!r}")
        for name in ("warps_gate_up", "warps_down"):
            if getattr(self, name) > 16:
                raise ValueError(f"RoutedConfig.{name} must be <= 16, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        """Short label, e.g. 'i4x512w4-h4x512w4'."""
        return (f"i{self.block_i}x{self.chunk_h}w{self.warps_gate_up}-"
                f"h{self.block_h}x{self.chunk_i}w{self.warps_down}")


DEFAULT_CONFIG = RoutedConfig()


@triton.jit(**_JIT_OPTIONS)
def _gate_up_kernel(
    x_ptr,  # [T, H] hidden (bf16 / f16 / f32), row-major
    slots_ptr,  # *i32 [T * K]: slot of (token, j); outside [0, num_slots) = no expert
    weights_ptr,  # *fp32 [T * K]: routing weight of (token, j)
    w13_ptr,  # [S, 2I, H] gate_up bank: rows [0, I) gate, [I, 2I) up
    act_ptr,  # *fp32 [T * K, I] out: weight * silu(gate . x) * (up . x); 0 for no expert
    num_slots,  # i32: S
    K: tl.constexpr,  # top_k
    H: tl.constexpr,  # hidden
    I: tl.constexpr,  # expert width
    BLOCK_I: tl.constexpr,  # gate rows per program
    CHUNK_H: tl.constexpr,  # hidden columns per load step
    EVEN: tl.constexpr,  # I % BLOCK_I == 0 and H % CHUNK_H == 0: no row / column masks
):
    pair = tl.program_id(0)  # t * K + j
    token = pair // K
    slot = tl.load(slots_ptr + pair)
    live = (slot >= 0) & (slot < num_slots)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] gate rows
    base = w13_ptr + tl.where(live, slot, 0).to(tl.int64) * (2 * I * H)
    gate_ptrs = base + rows[:, None] * H  # [BLOCK_I, 1]; up rows are I * H further
    acc_gate = tl.zeros([BLOCK_I, CHUNK_H], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, CHUNK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, CHUNK_H):  # unrolled: every step's loads are independent
        cols = h0 + tl.arange(0, CHUNK_H)  # [CHUNK_H]
        if EVEN:
            x = tl.load(x_ptr + token * H + cols)
            mask = live
        else:
            x = tl.load(x_ptr + token * H + cols, mask=cols < H, other=0.0)
            mask = live & (rows[:, None] < I) & (cols[None, :] < H)
        gate = tl.load(gate_ptrs + cols[None, :], mask=mask, other=0.0)  # [BLOCK_I, CHUNK_H]
        up = tl.load(gate_ptrs + I * H + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)[None, :]
        acc_gate += gate.to(tl.float32) * xf
        acc_up += up.to(tl.float32) * xf
    gate_dot = tl.sum(acc_gate, axis=1)  # [BLOCK_I]
    up_dot = tl.sum(acc_up, axis=1)
    weight = tl.load(weights_ptr + pair)
    act = tl.where(live, weight * gate_dot * tl.sigmoid(gate_dot) * up_dot, 0.0)
    tl.store(act_ptr + pair * I + rows, act, mask=rows < I)


@triton.jit(**_JIT_OPTIONS)
def _down_kernel(
    act_ptr,  # *fp32 [T * K, I]: from _gate_up_kernel, routing weight folded in
    slots_ptr,  # *i32 [T * K]: slot of (token, j); outside [0, num_slots) = no expert
    w2_ptr,  # [S, H, I] down bank
    out_ptr,  # *fp32 [T, H] out
    num_slots,  # i32: S
    K: tl.constexpr,  # top_k
    H: tl.constexpr,  # hidden
    I: tl.constexpr,  # expert width
    BLOCK_H: tl.constexpr,  # output rows per program
    CHUNK_I: tl.constexpr,  # intermediate columns per load step
    EVEN: tl.constexpr,  # H % BLOCK_H == 0 and I % CHUNK_I == 0: no row / column masks
):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] output rows
    acc = tl.zeros([BLOCK_H, CHUNK_I], dtype=tl.float32)
    for j in tl.static_range(K):  # ordered combine: j = 0, 1, ..., K-1 into one accumulator
        slot = tl.load(slots_ptr + token * K + j)
        live = (slot >= 0) & (slot < num_slots)
        down_ptrs = w2_ptr + tl.where(live, slot, 0).to(tl.int64) * (H * I) + rows[:, None] * I
        for i0 in tl.static_range(0, I, CHUNK_I):
            cols = i0 + tl.arange(0, CHUNK_I)  # [CHUNK_I]
            if EVEN:
                a = tl.load(act_ptr + (token * K + j) * I + cols)
                mask = live
            else:
                a = tl.load(act_ptr + (token * K + j) * I + cols, mask=cols < I, other=0.0)
                mask = live & (rows[:, None] < H) & (cols[None, :] < I)
            d = tl.load(down_ptrs + cols[None, :], mask=mask, other=0.0)  # [BLOCK_H, CHUNK_I]
            acc += d.to(tl.float32) * a[None, :]
    tl.store(out_ptr + token * H + rows, tl.sum(acc, axis=1), mask=rows < H)


_TWINS: dict[tuple[str, str], object] = {}


def _kernel_for(kernel, device: torch.device):
    """`kernel` compiled for a CUDA device, interpreted for CPU tensors (TRITON_INTERPRET=1).

    Triton fixes the mode at decoration time; this builds the other mode's twin from the same
    source, as expertcache.copy does. Raises RuntimeError for CPU tensors without the interpreter.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if device.type == "cuda":
        cls = JITFunction
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        cls = InterpretedFunction
    else:
        raise RuntimeError("routed_experts runs Triton kernels on CUDA tensors; for CPU tensors set "
                           "TRITON_INTERPRET=1 (Triton's interpreter) before importing triton")
    if isinstance(kernel, cls):
        return kernel
    key = (kernel.fn.__name__, cls.__name__)
    if key not in _TWINS:
        _TWINS[key] = cls(kernel.fn, **_JIT_OPTIONS)
    return _TWINS[key]


def _tiles(hidden: int, inter: int, config: RoutedConfig) -> tuple[int, int, int, int]:
    """(block_i, chunk_h, block_h, chunk_i) of `config`, each capped at its dimension's power of two."""
    h2, i2 = triton.next_power_of_2(hidden), triton.next_power_of_2(inter)
    return (min(config.block_i, i2), min(config.chunk_h, h2), min(config.block_h, h2),
            min(config.chunk_i, i2))


def routed_grids(tokens: int, top_k: int, hidden: int, inter: int,
                 config: RoutedConfig = DEFAULT_CONFIG) -> tuple[tuple[int, int], tuple[int, int]]:
    """(gate_up grid, down grid) that routed_experts launches: ((T * k, ceil(I / block_i)),
    (T, ceil(H / block_h))). O(1)."""
    block_i, _, block_h, _ = _tiles(hidden, inter, config)
    return (tokens * top_k, triton.cdiv(inter, block_i)), (tokens, triton.cdiv(hidden, block_h))


def routed_plan(tokens: int, cfg: MoEConfig, num_sms: int = 132,
                config: RoutedConfig = DEFAULT_CONFIG) -> RoutedPlan:
    """make_routed_plan's "gemv-slots" plan with the gate_up grid of `config`. O(1).

    Raises ValueError naming `tokens` outside 1..GEMV_MAX_TOKENS (or `num_sms` < 1).
    """
    plan = make_routed_plan(tokens, cfg, num_sms)
    if plan.family != "gemv-slots":
        raise ValueError(f"routed_plan: tokens={tokens} exceeds GEMV_MAX_TOKENS={GEMV_MAX_TOKENS}; "
                         f"routed_experts serves decode steps only")
    grid, _ = routed_grids(tokens, cfg.top_k, cfg.hidden, cfg.expert_intermediate, config)
    return dataclasses.replace(plan, grid=grid)


def compile_for_target(top_k: int, hidden: int, inter: int, dtype: str = "bf16",
                       config: RoutedConfig = DEFAULT_CONFIG, arch: int = 90) -> dict[str, dict]:
    """Compile both kernels ahead of time for CUDA sm_<arch> (no GPU needed; needs ptxas).

    dtype: Triton's name of the weight dtype ("bf16", "fp16", "fp32"). T is not compiled in (it only
    sizes the grids), so one binary per kernel serves T = 1..GEMV_MAX_TOKENS. Returns
    {kernel name: Triton's asm dict (ttir, ttgir, llir, ptx, cubin)}. Run it in a process without
    TRITON_INTERPRET=1 (the interpreter replaces the compiler's language hooks).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    block_i, chunk_h, block_h, chunk_i = _tiles(hidden, inter, config)
    shape = {"K": top_k, "H": hidden, "I": inter}
    launches = (
        (_gate_up_kernel, (f"*{dtype}", "*i32", "*fp32", f"*{dtype}", "*fp32", "i32"), config.warps_gate_up,
         dict(shape, BLOCK_I=block_i, CHUNK_H=chunk_h, EVEN=inter % block_i == 0 and hidden % chunk_h == 0)),
        (_down_kernel, ("*fp32", "*i32", f"*{dtype}", "*fp32", "i32"), config.warps_down,
         dict(shape, BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=hidden % block_h == 0 and inter % chunk_i == 0)),
    )
    result = {}
    for kernel, types, warps, constexprs in launches:
        fn = JITFunction(kernel.fn, **_JIT_OPTIONS)
        signature = {**dict(zip(fn.arg_names, types)), **{c: "constexpr" for c in constexprs}}
        aligned = {(n,): [["tt.divisibility", 16]] for n, ty in enumerate(types) if ty.startswith("*")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        result[kernel.fn.__name__] = compiled.asm
    return result


_SCRATCH: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def routed_scratch(device: torch.device | str, top_k: int, inter: int) -> torch.Tensor:
    """The activation buffer routed_experts uses on `device`: float32 [GEMV_MAX_TOKENS * k, I].

    One buffer per (device, k, I), made on first use and kept: call this (or routed_experts)
    once before CUDA-graph capture so the captured call allocates nothing. Calls that share it
    must be ordered (one stream, or joined by events). Cost: one allocation on first use.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, top_k, inter)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty((GEMV_MAX_TOKENS * top_k, inter), dtype=torch.float32, device=device)
    return _SCRATCH[key]


def _check_tensor(name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int, device) -> None:
    """Raise ValueError naming `name` unless t is a contiguous `ndim`-d tensor of `dtypes` on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"routed_experts: {name} must be a torch.Tensor, "  # noqa: TRY004 (house: ValueError)
                         f"got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"routed_experts: {name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"routed_experts: {name} dtype must be one of {list(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"routed_experts: {name} is on {t.device}, hidden is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"routed_experts: {name} must be contiguous (call .contiguous())")


def _check_args(hidden, slots, weights, gate_up, down, out) -> tuple[int, int, int, int, int]:
    """Validate every argument on the host (no device reads); return (T, k, S, H, I)."""
    _check_tensor("hidden", hidden, DTYPES, 2, None)
    dev, (tokens, hid) = hidden.device, hidden.shape
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        raise ValueError(f"routed_experts: hidden has {tokens} tokens; 1..{GEMV_MAX_TOKENS} "
                         "(moe.plan.GEMV_MAX_TOKENS) are served here")
    _check_tensor("slots", slots, (torch.int32,), 2, dev)
    _check_tensor("weights", weights, (torch.float32,), 2, dev)
    _check_tensor("gate_up", gate_up, (hidden.dtype,), 3, dev)
    _check_tensor("down", down, (hidden.dtype,), 3, dev)
    top_k = slots.shape[1]
    if slots.shape[0] != tokens or top_k < 1:
        raise ValueError(f"routed_experts: slots must be [{tokens}, k >= 1], got {list(slots.shape)}")
    if tuple(weights.shape) != tuple(slots.shape):
        raise ValueError(f"routed_experts: weights must be {list(slots.shape)} like slots, "
                         f"got {list(weights.shape)}")
    num_slots, two_i, gate_h = gate_up.shape
    if two_i % 2 or gate_h != hid or num_slots < 1:
        raise ValueError(f"routed_experts: gate_up must be [S, 2I, {hid}], got {list(gate_up.shape)}")
    inter = two_i // 2
    if tuple(down.shape) != (num_slots, hid, inter):
        raise ValueError(f"routed_experts: down must be [{num_slots}, {hid}, {inter}] (S, H, I of gate_up), "
                         f"got {list(down.shape)}")
    if out is not None:
        _check_tensor("out", out, (torch.float32,), 2, dev)
        if tuple(out.shape) != (tokens, hid):
            raise ValueError(f"routed_experts: out must be [{tokens}, {hid}], got {list(out.shape)}")
    return tokens, top_k, num_slots, hid, inter


def routed_experts(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, *, out: torch.Tensor | None = None,
                   config: RoutedConfig | None = None) -> torch.Tensor:
    """Σ_j weights[t, j] * down(silu(gate(x_t)) * up(x_t)) over the experts in slots[t, j].

    hidden:  [T, H] bf16 / f16 / f32, contiguous, 1 <= T <= GEMV_MAX_TOKENS.
    slots:   [T, k] int32 slot ids into the pool; -1 (or any id outside [0, S)) adds nothing.
    weights: [T, k] float32 routing weights.
    gate_up: [S, 2I, H] pool bank, rows [0, I) gate and [I, 2I) up; down: [S, H, I]; hidden's dtype.
    out:     optional float32 [T, H] to write into (for CUDA graphs); else a new tensor.
    config:  tiles and warps (RoutedConfig; default DEFAULT_CONFIG).
    Returns out, [T, H] float32, accumulated in float32; the sum over j runs in order j = 0..k-1
    and the result is bitwise repeatable. All tensors on one device: CUDA, or CPU under
    TRITON_INTERPRET=1. Two launches on the current stream, no host sync; with `out` given and
    the scratch made (routed_scratch) it allocates nothing, so it can be captured in a CUDA graph.
    Cost: reads T * k * 3 * I * H weight elements (none for empty slots) plus T * k * I * 8
    activation bytes, writes T * H * 4. Raises ValueError naming the argument whose shape, dtype,
    device or layout is wrong; RuntimeError for CPU tensors without Triton's interpreter.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, RoutedConfig):
        raise ValueError(f"routed_experts: config must be a RoutedConfig, "  # noqa: TRY004 (house: ValueError)
                         f"got {type(config).__name__}")
    tokens, top_k, num_slots, hid, inter = _check_args(hidden, slots, weights, gate_up, down, out)
    device = hidden.device
    if out is None:
        out = torch.empty((tokens, hid), dtype=torch.float32, device=device)
    act = routed_scratch(device, top_k, inter)  # [GEMV_MAX_TOKENS * k, I]; the first T * k rows used
    block_i, chunk_h, block_h, chunk_i = _tiles(hid, inter, config)
    grid_a, grid_b = routed_grids(tokens, top_k, hid, inter, config)
    gate_up_kernel, down_kernel = _kernel_for(_gate_up_kernel, device), _kernel_for(_down_kernel, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        gate_up_kernel[grid_a](
            hidden, slots, weights, gate_up, act, num_slots, K=top_k, H=hid, I=inter,
            BLOCK_I=block_i, CHUNK_H=chunk_h, EVEN=inter % block_i == 0 and hid % chunk_h == 0,
            num_warps=config.warps_gate_up)
        down_kernel[grid_b](
            act, slots, down, out, num_slots, K=top_k, H=hid, I=inter,
            BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=hid % block_h == 0 and inter % chunk_i == 0,
            num_warps=config.warps_down)
    return out


def routed_reference(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, *,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch reference of routed_experts (same arguments): gathers the T * k experts' rows, then bmm.

    Linears run in `compute_dtype` (float32: the reference; hidden's dtype: the torch baseline of
    benchmarks/bench_routed.py); the combine over j is float32. Returns [T, H] float32. No host
    sync. Cost: gathers T * k * 3 * I * H weight elements into new tensors, then reads them again.
    """
    tokens, top_k = slots.shape
    num_slots, two_i, hid = gate_up.shape
    live = (slots >= 0) & (slots < num_slots)  # [T, k]
    idx = torch.where(live, slots, 0).long().flatten()  # [T * k]
    x = hidden.to(compute_dtype).repeat_interleave(top_k, dim=0)  # [T * k, H]
    gu = torch.bmm(gate_up[idx].to(compute_dtype), x[:, :, None])[..., 0]  # [T * k, 2I]
    act = F.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2:]  # [T * k, I]
    y = torch.bmm(down[idx].to(compute_dtype), act[:, :, None])[..., 0].float()  # [T * k, H]
    y = y * (weights * live).flatten()[:, None]
    return y.view(tokens, top_k, hid).sum(dim=1)
