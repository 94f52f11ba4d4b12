"""The routed-expert GEMM on the tensor cores: pairs grouped by slot, each slot's rows dequantized once
for all of its tokens (kernels: moe.kernels.routed_mma_kernels).

    hidden [T, H], slots [T, k] int32, weights [T, k] float32, gate_up / down SlotMatrix in any expert
    format (expertcache.formats) or dense tensors
        │
        ├─ gate_up: 1 launch, grid (T * k, ceil(I / block_n)); the leader pair of each slot's group
        │     -> act [T * k, I] float32 = weight[t, j] * act(gate, up)   (gpt-oss: biases, clamped SwiGLU)
        ├─ down:    1 launch, grid (T * k, ceil(H / down_block_n))  -> y [T * k, H] float32 per pair
        └─ combine: 1 launch, grid (T, ceil(H / block_h))
              out[t] = Σ_{j = 0..k-1 in order} y[t * k + j] (+ Σ_j weights[t, j] * down_bias[slots[t, j]])
                       (+ addend[t])  -> out [T, H] float32 and / or out_cast = cast(out)

routed_experts (moe.kernels.routed) runs one program per (token, expert) and dequantizes an expert's rows
once per token on the CUDA cores; here a slot's weight tile is dequantized once per program and fed to
tl.dot with all of its tokens (1..block_m a tile, more in turn), so the dequantize is paid once per slot
and the multiply-adds run on the tensor cores. The weight rows are the dot's M side and its register
operand (Hopper's wgmma reads it from registers), the tokens its N side: at decode a slot has about one
token, and the decoded tile never crosses shared memory. The results agree with routed_reference within
float32 rounding of another summation order (the dots' operands are exact:
moe.kernels.routed_mma_kernels), and are bitwise repeatable for fixed MmaTiles. Legend: T = tokens
(1..MMA_MAX_TOKENS), k = top_k, H = hidden, I = expert width, S = pool slots; a slot id outside [0, S)
adds nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe.kernels.plan import DEFAULT_MMA_TILES
from moe.kernels.routed import _check_block, _device_ctx, _down_bias, _format_args
from moe.kernels.routed_host import activation_args, check_down, check_down_beside, check_gate_up, check_tensor
from moe.kernels.routed_mma_kernels import COMBINE_JIT_OPTIONS, MMA_JIT_OPTIONS, _combine, _down_mma, _gate_up_mma
from moe.kernels.tiles import MmaTiles, next_pow2
from moe.kernels.triton_launch import kernel_for
from moe.model.config import MoEConfig
from moe.model.slot_matrix import CODES

MMA_MAX_TOKENS = 64  # decode and small prefill chunks
FP8_CODE = CODES["fp8"]  # SlotMatrix.code of fp8, whose codes the kernels read 4 a word
# the dots' operands by activation dtype: (gate_up's PREC, down's PREC) of routed_mma_kernels._dot
# (0 bfloat16, 1 float32 "ieee", 2 the float32 act as two bfloat16 parts); float16 weights and
# activations are not exact in bfloat16, so a float16 model's dots run in float32
PRECISION = {torch.bfloat16: (0, 2), torch.float16: (1, 1), torch.float32: (1, 1)}

_SCRATCH: dict[tuple[torch.device, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def check_mma_capability(capability: tuple[int, int]) -> None:
    """Raise ValueError naming EXPERTCACHE_ROUTED_MMA unless a GPU of this compute capability runs the kernels:
    their decode uses sm_90's bfloat16x2 arithmetic and their dots Hopper's wgmma (sm_90 and later)."""
    if tuple(capability) < (9, 0):
        raise ValueError(f"the tensor-core routed kernels need compute capability 9.0 or later (Hopper); this GPU "
                         f"is {capability[0]}.{capability[1]}: set EXPERTCACHE_ROUTED_MMA=0 or unset it")


def _scratch_device(device: torch.device | str) -> torch.device:
    """`device` with its index (the current CUDA device's where none is given): the scratches' key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def mma_scratch(device: torch.device | str, top_k: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(act float32 [MMA_MAX_TOKENS * k, I], y float32 [MMA_MAX_TOKENS * k, H]) that routed_experts_mma
    uses on `device`, made on first use and kept (call it before CUDA-graph capture). Calls that share
    them must be ordered on one stream. Raises ValueError (check_mma_capability) on a GPU before Hopper."""
    device = _scratch_device(device)
    key = (device, top_k, hidden, inter)
    if key not in _SCRATCH:  # checked once, where the layer makes it before any launch or capture
        if device.type == "cuda":
            check_mma_capability(torch.cuda.get_device_capability(device))
        rows = MMA_MAX_TOKENS * top_k
        _SCRATCH[key] = (torch.empty((rows, inter), dtype=torch.float32, device=device),
                         torch.empty((rows, hidden), dtype=torch.float32, device=device))
    return _SCRATCH[key]


class MmaAct(NamedTuple):
    """mma_gate_up's output for mma_down: the scratch `act` (float32 [MMA_MAX_TOKENS * k, I]; with
    `split` its bytes hold the bfloat16 high parts of T * k rows, then lo_off elements further the low
    ones) and the call's T, k."""

    act: torch.Tensor
    split: bool
    tokens: int
    top_k: int

    @property
    def kernel_arg(self) -> tuple[torch.Tensor, int]:
        """(the act pointer the kernels take, lo_off)."""
        if self.split:
            return self.act.view(-1).view(torch.bfloat16), self.act.numel()
        return self.act, 0


def mma_gate_up(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up, *,
                tiles: MmaTiles = DEFAULT_MMA_TILES, cfg: MoEConfig | None = None,
                gate_up_bias: torch.Tensor | None = None) -> MmaAct:
    """The first launch of routed_experts_mma (same arguments): the weighted activations for mma_down.
    Raises ValueError naming the argument whose shape, dtype, device or value is wrong."""
    _check_tiles(tiles)
    dims, gate_up = check_gate_up("mma_gate_up", hidden, slots, weights, gate_up, None, None,
                                  max_tokens=MMA_MAX_TOKENS)
    tokens, top_k, num_slots, hid, inter = dims
    _check_block("mma_gate_up", False, cfg, gate_up_bias, dims, hidden.device)
    _check_words("mma_gate_up", "gate_up", gate_up)
    act = MmaAct(mma_scratch(hidden.device, top_k, hid, inter)[0], PRECISION[hidden.dtype][1] == 2, tokens, top_k)
    act_arg, lo_off = act.kernel_arg
    kernel = kernel_for(_gate_up_mma, hidden.device, MMA_JIT_OPTIONS, "mma_gate_up")
    with _device_ctx(hidden.device):
        kernel[tiles.grids(tokens, top_k, hid, inter)[0]](
            hidden, slots, weights, gate_up.kernel_args(), act_arg, num_slots, tokens,
            act.act if gate_up_bias is None else gate_up_bias, lo_off,
            **_group_args(tokens, top_k, hid, inter, tiles, hidden.device.type != "cuda"),
            BLOCK_N=tiles.block_n, PREC=PRECISION[hidden.dtype][0], SPLIT=act.split, num_warps=tiles.warps_gate_up,
            **_format_args(gate_up), **activation_args(cfg, gate_up_bias is not None),
            **_pdl(hidden.device))
    return act


def mma_down(act: MmaAct, slots: torch.Tensor, down, *, out: torch.Tensor | None = None,
             addend: torch.Tensor | None = None, out_cast: torch.Tensor | None = None,
             tiles: MmaTiles = DEFAULT_MMA_TILES, down_bias: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """The down and the combine of routed_experts_mma, from mma_gate_up's `act` for the same slots.
    down_bias / weights: routed_down's. Returns out, else out_cast, else a new float32 [T, H]. Raises
    ValueError naming the argument whose shape, dtype, device or value is wrong."""
    _check_tiles(tiles)
    if not isinstance(act, MmaAct):
        raise ValueError(f"mma_down: act must be mma_gate_up's MmaAct, got {type(act).__name__}")
    dims, down = check_down("mma_down", act.act, slots, down, out, addend, out_cast, max_tokens=MMA_MAX_TOKENS)
    _check_words("mma_down", "down", down)
    tokens, top_k, num_slots, hid, inter = dims
    if (tokens, top_k) != (act.tokens, act.top_k):
        raise ValueError(f"mma_down: slots are [{tokens}, {top_k}] but act holds [{act.tokens}, {act.top_k}] "
                         "(mma_gate_up's call)")
    bias = _down_bias("mma_down", down_bias, weights, slots, dims, False)
    device = act.act.device
    if out is None and out_cast is None:
        out = torch.empty((tokens, hid), dtype=torch.float32, device=device)
    _, down_grid, combine_grid = tiles.grids(tokens, top_k, hid, inter)
    y = mma_scratch(device, top_k, hid, inter)[1]
    act_arg, lo_off = act.kernel_arg
    b2, bias_weights = (y, y) if bias is None else bias
    down_kernel = kernel_for(_down_mma, device, MMA_JIT_OPTIONS, "mma_down")
    combine_kernel = kernel_for(_combine, device, COMBINE_JIT_OPTIONS, "mma_down")
    with _device_ctx(device):
        down_kernel[down_grid](act_arg, slots, down.kernel_args(), y, num_slots, tokens, lo_off,
                               **_group_args(tokens, top_k, hid, inter, tiles, device.type != "cuda"),
                               BLOCK_N=tiles.down_block_n, PREC=2 if act.split else 1, num_warps=tiles.warps_down,
                               **_format_args(down), **_pdl(device))
        combine_kernel[combine_grid](y, slots, y if addend is None else addend, y if out is None else out,
                                     y if out_cast is None else out_cast, num_slots, bias_weights, b2,
                                     K=top_k, H=hid, BLOCK_H=min(tiles.block_h, next_pow2(hid)),
                                     ADDEND=addend is not None, WRITE_OUT=out is not None,
                                     WRITE_CAST=out_cast is not None, BIAS=bias is not None,
                                     num_warps=tiles.warps_combine, **_pdl(device))
    return out_cast if out is None else out


def routed_experts_mma(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                       gate_up, down, *, out: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                       out_cast: torch.Tensor | None = None, tiles: MmaTiles = DEFAULT_MMA_TILES,
                       cfg: MoEConfig | None = None, gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """routed_experts' result (addend[t] + Σ_j weights[t, j] * expert(x_t) over the slots of row t) for
    routed experts, on the tensor cores: mma_gate_up then mma_down.

    hidden [T, H] bf16 / f16 / f32 with 1 <= T <= MMA_MAX_TOKENS; slots [T, k] int32 (a slot twice in a
    row counts twice, as in routed_experts); weights [T, k] float32; gate_up [S, 2I, H] and down
    [S, H, I]: SlotMatrix of one format, or dense tensors of hidden's dtype; out / addend / out_cast /
    cfg / gate_up_bias / down_bias as routed_experts. Three launches on the current stream, no host
    sync, nothing allocated once mma_scratch is made:
    CUDA-graph capturable. Returns out when given,
    else out_cast when given, else a new float32 [T, H]. Raises ValueError naming the argument whose
    shape, dtype, device or value is wrong.
    """
    _check_tiles(tiles)
    dims, gate_up = check_gate_up("routed_experts_mma", hidden, slots, weights, gate_up, None, None,
                                  max_tokens=MMA_MAX_TOKENS)
    down = check_down_beside("routed_experts_mma", down, gate_up, dims, hidden)
    if out_cast is not None:
        check_tensor("routed_experts_mma", "out_cast", out_cast, (hidden.dtype,), 2, hidden.device)
    act = mma_gate_up(hidden, slots, weights, gate_up, tiles=tiles, cfg=cfg, gate_up_bias=gate_up_bias)
    return mma_down(act, slots, down, out=out, addend=addend, out_cast=out_cast, tiles=tiles, down_bias=down_bias,
                    weights=None if down_bias is None else weights)


def _check_tiles(tiles) -> None:
    if not isinstance(tiles, MmaTiles):
        raise ValueError(f"routed_experts_mma: tiles must be a MmaTiles, got {type(tiles).__name__}")


def _check_words(who: str, name: str, matrix) -> None:
    """The kernels read fp8 codes 4 a 32-bit word: refuse an fp8 matrix whose rows are not whole words."""
    if matrix.code == FP8_CODE and matrix.in_features % 4:
        raise ValueError(f"{who}: {name} is fp8 with {matrix.in_features} input columns; the tensor-core kernels "
                         "read its codes 4 a word (a multiple of 4)")


def _pdl(device: torch.device) -> dict:
    """The launch arguments of a programmatic dependent launch on CUDA (each kernel waits for its
    predecessors before reading; the results are those of plain launches), none elsewhere."""
    return {"GDC": True, "launch_pdl": True} if device.type == "cuda" else {}


def _group_args(tokens: int, top_k: int, hidden: int, inter: int, tiles: MmaTiles, emu: bool) -> dict:
    """The constexprs of the group and its shape, shared by the gate_up and the down (emu: the CPU
    interpreter's float32 products)."""
    return {"K": top_k, "H": hidden, "I": inter, "TB": max(2, next_pow2(tokens)), "KB": max(2, next_pow2(top_k)),
            "BLOCK_M": tiles.block_m, "EMU": emu}


def compile_mma_for_target(top_k: int, hidden: int, inter: int, dtype: str = "bf16", tokens: int = 1,
                           tiles: MmaTiles = DEFAULT_MMA_TILES, arch: int = 90, expert_format: str | None = None,
                           cfg: MoEConfig | None = None, expert_bias: bool = False) -> dict[str, dict]:
    """Compile the three launches of routed_experts_mma ahead of time for CUDA sm_<arch> (no GPU; needs
    ptxas), at `tokens` tokens (T sizes the group's registers: one binary per power of two). dtype:
    Triton's name of the activation dtype; expert_format, cfg, expert_bias as
    moe.kernels.routed_host.compile_for_target. Returns {"_gate_up_mma", "_down_mma", "_combine"
    (addend, cast out)}: Triton's asm dicts, each programmatic as launched on CUDA. Run it without
    TRITON_INTERPRET=1."""
    from moe.kernels.routed_host import _variant
    from moe.kernels.triton_launch import compile_for_sm

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    prec_up, prec_down = PRECISION[torch_dtype]
    quant, w13, w2 = _variant(expert_format, dtype, hidden, inter)
    quant = {"FMT": 0, "ZP": False, **quant}
    bias = f"*{dtype}" if expert_bias else "*fp32"
    act = "*bf16" if prec_down == 2 else "*fp32"
    group = {**_group_args(tokens, top_k, hidden, inter, tiles, emu=False), **quant}
    p = f"*{dtype}"
    return {
        "_gate_up_mma": compile_for_sm(
            _gate_up_mma, (p, "*i32", "*fp32", w13, act, "i32", "i32", bias, "i32"),
            {**group, "BLOCK_N": tiles.block_n, "PREC": prec_up, "SPLIT": prec_down == 2,
             "GDC": True, **activation_args(cfg, expert_bias)},
            tiles.warps_gate_up, arch, MMA_JIT_OPTIONS, divisible=("lo_off",)),
        "_down_mma": compile_for_sm(
            _down_mma, (act, "*i32", w2, "*fp32", "i32", "i32", "i32"),
            {**group, "BLOCK_N": tiles.down_block_n, "PREC": prec_down, "GDC": True}, tiles.warps_down, arch,
            MMA_JIT_OPTIONS,
            divisible=("lo_off",)),
        "_combine": compile_for_sm(
            _combine, ("*fp32", "*i32", "*fp32", "*fp32", p, "i32", "*fp32", bias),
            {"K": top_k, "H": hidden, "BLOCK_H": min(tiles.block_h, next_pow2(hidden)), "ADDEND": True,
             "WRITE_OUT": False, "WRITE_CAST": True, "BIAS": expert_bias, "GDC": True}, tiles.warps_combine, arch,
            COMBINE_JIT_OPTIONS),
    }
