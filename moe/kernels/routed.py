"""The routed-expert GEMM of a decode step (1..GEMV_MAX_TOKENS tokens), read from the slot pool by slot id.

    hidden [T, H], slots [T, k] int32, weights [T, k] float32 (or gate_w [1, H]: the shared expert)
    pool banks gate_up [S, 2I, H], down [S, H, I]        (expertcache.pool.SlotPool, indexed by slot;
        or SlotMatrix: those matrices in an expert format, fp8 / nvfp4 / mxfp4 / int4, dequantized in
        registers by the same two launches, moe.model.slot_matrix)
        │
        ├─ routed_gate_up: 1 launch, grid (T * k, ceil(I / block_i))
        │     -> act [T * k, I] float32 = weight[t, j] * silu(gate) * up   (0 when no expert)
        │        (gpt-oss: + gate_up_bias[slot] first, its clamped SwiGLU for silu(gate) * up: cfg)
        │        weight = weights[t, j], or sigmoid(hidden[t] · gate_w) when gate_w is given
        │     (part="hits": a persistent launch of the pairs resident before the ensure, at pre;
        │      part="rest": the others; together the bits of one part="all" launch)
        │
        └─ routed_down: 1 launch, grid (T, ceil(H / block_h))
              y[t] = Σ_{j = 0..k-1 in order} down[slots[t, j]] · act[t * k + j]   (+ addend[t])
                     (gpt-oss: + Σ_j weights[t, j] * down_bias[slots[t, j]] before the addend)
              -> out [T, H] float32 and / or out_cast [T, H] = cast(y) in the pool's dtype

    routed_experts = routed_gate_up then routed_down; a caller that must wait for other work between
    the two (the layer joins its side stream there) calls them one by one.

Legend: T = tokens, H = hidden, I = expert width, k = top_k, S = pool slots. A slot id outside
[0, S) (NO_SLOT = -1 in particular) contributes nothing. No expert weights are gathered or copied:
every program streams whole rows of one slot with 16-byte loads and accumulates in float32 (kernels:
moe.kernels.routed_kernels; argument checks, scratch and the ahead-of-time compile:
moe.kernels.routed_host). The shared expert is the one-slot case: gate_up[None], down[None], slots
all 0, gate_w given; its launches use separately named entry kernels with the same code, so traces
tell them apart. `addend` + `out_cast` fuse an MoE layer's combine (routed + shared, one rounding)
into the down launch. Both launches have independent programs (no atomics, no grid barrier), so the
result is bitwise repeatable for fixed RoutedTiles and any side-stream work may hold SMs meanwhile.
On CUDA the routed gate_up and down are programmatic dependent launches (moe.kernels.routed_kernels).
Nothing reads a device value on the host, so a call is CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from moe.kernels.plan import DEFAULT_ROUTED_TILES, DOWN_PREFETCH, HITS_PROGRAMS_PER_SM
from moe.kernels.routed_host import (
    PARTS,
    activation_args,
    check_bias,
    check_down,
    check_down_beside,
    check_gate_up,
    check_tensor,
    routed_scratch,
)
from moe.kernels.routed_kernels import (
    DOWN_ENTRIES,
    GATE_UP_ENTRIES,
    HITS_JIT_OPTIONS,
    JIT_OPTIONS,
    _gate_up_hits,
)
from moe.kernels.tiles import RoutedTiles
from moe.kernels.triton_launch import kernel_for
from moe.model.config import MoEConfig
from moe.model.reference import gated_activation
from moe.model.slot_matrix import SlotMatrix

NO_SLOT = -1
DEFAULT_TILES = DEFAULT_ROUTED_TILES
INTERPRETER_SMS = 4  # SMs a CPU device counts as (the early hits' default grid under the interpreter)


def routed_grids(tokens: int, top_k: int, hidden: int, inter: int,
                 tiles: RoutedTiles = DEFAULT_TILES) -> tuple[tuple[int, int], tuple[int, int]]:
    """(gate_up grid, down grid) that routed_experts launches: ((T * k, ceil(I / block_i)),
    (T, ceil(H / block_h))). O(1)."""
    return tiles.gate_up_grid(tokens, top_k, hidden, inter), tiles.down_grid(tokens, hidden, inter)


_SMS: dict[torch.device, int] = {}


def device_sms(device: torch.device) -> int:
    """SMs of `device`: the CUDA device's multiprocessor count, INTERPRETER_SMS on the CPU."""
    if device not in _SMS:
        _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else INTERPRETER_SMS)
    return _SMS[device]


def hits_programs(device: torch.device) -> int:
    """Default programs of a part="hits" launch: HITS_PROGRAMS_PER_SM per SM of `device`."""
    return HITS_PROGRAMS_PER_SM * device_sms(device)


def _device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _format_args(matrix: SlotMatrix) -> dict:
    """The FMT / ZP constexprs of a launch over `matrix`."""
    return {"FMT": matrix.code, "ZP": matrix.zero_points}


def _launch_hits(hidden, weights, gate_up: SlotMatrix, act, pre, dims, tiles, programs, cfg=None,
                 gate_up_bias=None) -> None:
    """One persistent launch of at most `programs` programs over the (pair, tile) items of the pairs
    with pre >= 0; never programmatic (it waits on another stream's event, not its producer)."""
    tokens, top_k, num_slots, hid, inter = dims
    block_i, chunk_h, _, _ = tiles.capped(hid, inter)
    items = tokens * top_k * triton.cdiv(inter, block_i)
    kernel = kernel_for(_gate_up_hits, hidden.device, HITS_JIT_OPTIONS, "routed_gate_up")
    with _device_ctx(hidden.device):
        kernel[(min(programs, items),)](hidden, weights, gate_up.kernel_args(), act, num_slots, pre, tokens * top_k,
                                        act if gate_up_bias is None else gate_up_bias,
                                        K=top_k, H=hid, I=inter, BLOCK_I=block_i, CHUNK_H=chunk_h,
                                        EVEN=tiles.even(hid, inter)[0], num_warps=tiles.warps_gate_up,
                                        **_format_args(gate_up), **activation_args(cfg, gate_up_bias is not None))


def _launch_gate_up(hidden, slots, weights, gate_up: SlotMatrix, gate_w, act, dims, tiles, part="all",
                    pre=None, cfg=None, gate_up_bias=None, shared=False) -> torch.Tensor:
    """part "all" or "rest" (PICK 0 / 2): one program per (pair, row tile); programmatic on CUDA
    unless the shared expert's (gated, or `shared`: an ungated one, weighted by `weights`)."""
    tokens, top_k, num_slots, hid, inter = dims
    block_i, chunk_h, _, _ = tiles.capped(hid, inter)
    grid, _ = routed_grids(tokens, top_k, hid, inter, tiles)
    gated = gate_w is not None
    shared = shared or gated
    kernel = kernel_for(GATE_UP_ENTRIES[shared], hidden.device, JIT_OPTIONS, "routed_experts")
    with _device_ctx(hidden.device):
        gdc = not shared and hidden.device.type == "cuda"
        kernel[grid](hidden, slots, act if gated else weights, gate_w if gated else hidden, gate_up.kernel_args(),
                     act, num_slots, slots if pre is None else pre, act if gate_up_bias is None else gate_up_bias,
                     K=top_k, H=hid, I=inter, BLOCK_I=block_i,
                     CHUNK_H=chunk_h, EVEN=tiles.even(hid, inter)[0], GATED=gated, GDC=int(gdc),
                     PICK=PARTS.index(part), num_warps=tiles.warps_gate_up,
                     **_format_args(gate_up), **({} if gated else activation_args(cfg, gate_up_bias is not None)),
                     **({"launch_pdl": True} if gdc else {}))
    return act[:tokens * top_k]


def _launch_down(act, slots, down: SlotMatrix, out, addend, out_cast, shared, dims, tiles, after_gate_up,
                 release, prefetch, down_bias=None) -> torch.Tensor:
    tokens, top_k, num_slots, hid, inter = dims
    _, _, block_h, chunk_i = tiles.capped(hid, inter)
    _, grid = routed_grids(tokens, top_k, hid, inter, tiles)
    device = down.device
    if out is None and out_cast is None:
        out = torch.empty((tokens, hid), dtype=torch.float32, device=device)
    kernel = kernel_for(DOWN_ENTRIES[bool(shared)], device, JIT_OPTIONS, "routed_experts")
    # programmatic launch only right behind a programmatic gate_up (its producer)
    gdc = after_gate_up and not shared and device.type == "cuda"
    routed = {"RELEASE": release, "PREFETCH": min(prefetch, top_k) if down.fmt.dense else 0}
    if down_bias is not None:
        routed["BIAS"] = True
    b2, weights = (act, act) if down_bias is None else down_bias
    with _device_ctx(device):
        kernel[grid](act, slots, down.kernel_args(), act if addend is None else addend, act if out is None else out,
                     act if out_cast is None else out_cast, num_slots, weights, b2, K=top_k, H=hid, I=inter,
                     BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=tiles.even(hid, inter)[1],
                     ADDEND=addend is not None, WRITE_OUT=out is not None, WRITE_CAST=out_cast is not None,
                     GDC=int(gdc), num_warps=tiles.warps_down, **({} if shared else routed), **_format_args(down),
                     **({"launch_pdl": True} if gdc else {}))
    return out_cast if out is None else out


def _check_options(who: str, tiles, release=False, prefetch=0, programs=None,
                   names: tuple[str, str] = ("release", "prefetch")) -> None:
    """Raise ValueError naming the option unless tiles is RoutedTiles, release a bool, prefetch an
    int >= 0 and programs None or an int >= 1 (`names`: the caller's names of release and prefetch)."""
    if not isinstance(tiles, RoutedTiles):
        raise ValueError(f"{who}: tiles must be a RoutedTiles, "
                         f"got {type(tiles).__name__}")
    if not isinstance(release, bool):
        raise ValueError(f"{who}: {names[0]} must be a bool, got {release!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{who}: {names[1]} must be an int >= 0, got {prefetch!r}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"{who}: programs must be an int >= 1, got {programs!r}")


def routed_gate_up(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                   gate_up: torch.Tensor, *, gate_w: torch.Tensor | None = None,
                   act: torch.Tensor | None = None, tiles: RoutedTiles = DEFAULT_TILES,
                   part: str = "all", pre: torch.Tensor | None = None,
                   programs: int | None = None, cfg: MoEConfig | None = None,
                   gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The first launch of routed_experts (same arguments): returns act [T * k, I] float32, rows
    [0, T * k) of `act` (default routed_scratch(device, k, I)), to pass to routed_down.

    part / pre (routed experts only, not with gate_w): "all" (default) computes every (t, j) pair.
    With pre int32 [T, k] (the slots before the ensure, -1 = not resident: router_topk's `pre`),
    "hits" computes only the pairs with pre >= 0, at slot pre[t, j] (`slots` is not read), and "rest"
    only the others, at slots[t, j]; a pair not taken keeps its act rows untouched. A "hits" and a
    "rest" launch over the same pre write every row once, bit for bit as one "all" launch (the same
    program per pair), so the hits can run before the ensure decides the rest (MoELayer's early hits).
    The "hits" launch is persistent: `programs` programs (default hits_programs(device)) walk the
    pairs' row tiles, so work launched beside it on another stream still finds room on the SMs.
    cfg / gate_up_bias: routed_experts'. Raises ValueError naming the argument whose shape, dtype,
    device or value is wrong.
    """
    _check_options("routed_gate_up", tiles, programs=programs)
    dims, gate_up = check_gate_up("routed_gate_up", hidden, slots, weights, gate_up, gate_w, act)
    if part not in PARTS:
        raise ValueError(f"routed_gate_up: part must be one of {PARTS}, got {part!r}")
    _check_block("routed_gate_up", gate_w is not None, cfg, gate_up_bias, dims, hidden.device)
    if part != "all":
        if gate_w is not None:
            raise ValueError("routed_gate_up: part='hits' / 'rest' is for routed experts (gate_w=None)")
        check_tensor("routed_gate_up", "pre", pre, (torch.int32,), 2, hidden.device)
        if tuple(pre.shape) != tuple(slots.shape):
            raise ValueError(f"routed_gate_up: pre must be {list(slots.shape)} like slots, got {list(pre.shape)}")
    act = routed_scratch(hidden.device, dims[1], dims[4]) if act is None else act
    if part == "hits":
        programs = hits_programs(hidden.device) if programs is None else programs
        _launch_hits(hidden, weights, gate_up, act, pre, dims, tiles, programs, cfg, gate_up_bias)
        return act[:dims[0] * dims[1]]
    return _launch_gate_up(hidden, slots, weights, gate_up, gate_w, act, dims, tiles, part,
                           pre if part == "rest" else None, cfg, gate_up_bias)


def routed_down(act: torch.Tensor, slots: torch.Tensor, down: torch.Tensor, *,
                out: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                out_cast: torch.Tensor | None = None, shared: bool = False,
                tiles: RoutedTiles = DEFAULT_TILES, after_gate_up: bool = False, release: bool = False,
                prefetch: int = DOWN_PREFETCH, down_bias: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """The second launch of routed_experts: act [>= T * k, I] float32 from routed_gate_up, slots
    [T, k], down [S, H, I]; out / addend / out_cast as routed_experts. Returns out, else out_cast.

    shared: launch the shared expert's entry kernel (same code, another name in traces; no release,
    no prefetch). after_gate_up: the last launch on this stream was routed_gate_up for these slots
    (only event waits between), so on CUDA the down is a programmatic launch behind it. release (with
    that): the next programmatic launch on the stream may start right after the down's own wait.
    prefetch: each program loads all k slots, then the weight tiles of the first min(prefetch, k)
    experts, before its wait (0: each slot in the loop, right before its expert's tiles); the same
    bits. down_bias [S, H] (gpt-oss's per-slot down biases, with `weights` [T, k] float32, the routing
    weights the gate_up applied): y += Σ_j weights[t, j] * down_bias[slots[t, j]] after the routed sum.
    Raises ValueError naming the argument whose shape, dtype, device or value is wrong.
    """
    _check_options("routed_down", tiles, release, prefetch)
    dims, down = check_down("routed_down", act, slots, down, out, addend, out_cast)
    bias = _down_bias("routed_down", down_bias, weights, slots, dims, shared)
    return _launch_down(act, slots, down, out, addend, out_cast, shared, dims, tiles, after_gate_up,
                        release, prefetch, bias)


def _check_block(who: str, shared: bool, cfg, gate_up_bias, dims, device) -> None:
    """Raise ValueError naming cfg / gate_up_bias unless they suit a routed gate_up (the shared
    expert's, gated or not, takes neither)."""
    if cfg is not None and not isinstance(cfg, MoEConfig):
        raise ValueError(f"{who}: cfg must be a MoEConfig or None, got {type(cfg).__name__}")
    if shared and (gate_up_bias is not None or (cfg is not None and cfg.activation != "silu")):
        raise ValueError(f"{who}: the shared expert (gate_w or shared=True) is a SiLU block without biases: "
                         "pass cfg=None and gate_up_bias=None")
    if gate_up_bias is not None:
        check_bias(who, "gate_up_bias", gate_up_bias, dims[2], 2 * dims[4], device)


def _down_bias(who: str, down_bias, weights, slots, dims, shared: bool):
    """(down_bias, weights) checked for the down launch, or None without a bias. Raises ValueError
    naming down_bias or weights."""
    if down_bias is None:
        if weights is not None:
            raise ValueError(f"{who}: weights are read only with down_bias; pass weights=None")
        return None
    if shared:
        raise ValueError(f"{who}: the shared expert has no down bias; pass down_bias=None")
    check_bias(who, "down_bias", down_bias, dims[2], dims[3], slots.device)
    if weights is None:
        raise ValueError(f"{who}: down_bias needs weights (the routing weights [T, k] float32 the gate_up applied)")
    check_tensor(who, "weights", weights, (torch.float32,), 2, slots.device)
    if tuple(weights.shape) != tuple(slots.shape):
        raise ValueError(f"{who}: weights must be {list(slots.shape)} like slots (the routing weights), "
                         f"got {list(weights.shape)}")
    return down_bias, weights


def routed_experts(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                   gate_up: torch.Tensor, down: torch.Tensor, *, out: torch.Tensor | None = None,
                   tiles: RoutedTiles = DEFAULT_TILES, gate_w: torch.Tensor | None = None,
                   addend: torch.Tensor | None = None, out_cast: torch.Tensor | None = None,
                   act: torch.Tensor | None = None, down_release: bool = False,
                   down_prefetch: int = DOWN_PREFETCH, cfg: MoEConfig | None = None,
                   gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None, shared: bool = False) -> torch.Tensor:
    """addend[t] + Σ_j weights[t, j] * down(silu(gate(x_t)) * up(x_t)) over the experts in slots[t, j].

    hidden:  [T, H] bf16 / f16 / f32, contiguous, 1 <= T <= GEMV_MAX_TOKENS.
    slots:   [T, k] int32 slot ids into the pool; -1 (or any id outside [0, S)) adds nothing.
    weights: [T, k] float32 routing weights; None when gate_w is given.
    gate_up: [S, 2I, H] pool bank, rows [0, I) gate and [I, 2I) up; down: [S, H, I]; hidden's dtype.
    out:     optional float32 [T, H] to write into (for CUDA graphs).
    gate_w:  optional [1, H] in hidden's dtype: every weight is sigmoid(hidden[t] · gate_w) (float32
             dot, computed inside the gate_up launch): the gated shared expert, called with
             gate_up[None], down[None] and slots all 0. Launches the shared entry kernels.
    addend:  optional float32 [T, H] added to the sum (after the ordered sum over j, in float32).
    out_cast: optional [T, H] in hidden's dtype: receives cast(addend + sum), the layer's output.
    act:     optional float32 [>= T * k, I] activation buffer; default routed_scratch(device, k, I).
    tiles:   RoutedTiles of both launches. down_release / down_prefetch: routed_down's release / prefetch.
    cfg:     the experts' activation (cfg.activation; None: SiLU), gpt-oss's clamped SwiGLU included.
    gate_up_bias [S, 2I], down_bias [S, H]: per-slot expert biases (gpt-oss), added after each linear
             (routed_reference's); not with gate_w.
    shared:  launch the shared expert's entry kernels (never programmatic) without a gate: an ungated
             shared expert (GLM-4.5's), weighted by `weights` (ones); implied by gate_w.
    Returns out when given; else out_cast when given; else a new float32 [T, H]. Without out and
    with out_cast, no float32 result is written. The sum over j runs in order j = 0..k-1 and the
    result is bitwise repeatable. All tensors on one device: CUDA, or CPU under TRITON_INTERPRET=1.
    Two launches on the current stream, no host sync; with out / out_cast given and the scratch made
    it allocates nothing, so it can be captured in a CUDA graph. Cost: reads T * k * 3 * I * H
    weight elements (none for empty slots) plus T * k * I * 8 activation bytes (+ T * H * 4 of
    addend), writes T * H * (4 or the dtype's size). Raises ValueError naming the argument whose
    shape, dtype, device or layout is wrong; RuntimeError for CPU tensors without Triton's interpreter.
    """
    _check_options("routed_experts", tiles, down_release, down_prefetch, names=("down_release", "down_prefetch"))
    dims, gate_up = check_gate_up("routed_experts", hidden, slots, weights, gate_up, gate_w, act)
    down = check_down_beside("routed_experts", down, gate_up, dims, hidden)
    act = routed_scratch(hidden.device, dims[1], dims[4]) if act is None else act
    if out_cast is not None:
        check_tensor("routed_experts", "out_cast", out_cast, (hidden.dtype,), 2, hidden.device)
    check_down("routed_experts", act, slots, down, out, addend, out_cast)
    if not isinstance(shared, bool):
        raise ValueError(f"routed_experts: shared must be a bool, got {shared!r}")
    shared = shared or gate_w is not None
    _check_block("routed_experts", shared, cfg, gate_up_bias, dims, hidden.device)
    bias = _down_bias("routed_experts", down_bias, None if down_bias is None else weights, slots, dims, shared)
    act = _launch_gate_up(hidden, slots, weights, gate_up, gate_w, act, dims, tiles, cfg=cfg, gate_up_bias=gate_up_bias,
                          shared=shared)
    return _launch_down(act, slots, down, out, addend, out_cast, shared, dims, tiles, True,
                        down_release, down_prefetch, bias)


def routed_reference(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                     gate_up: torch.Tensor | SlotMatrix, down: torch.Tensor | SlotMatrix, *,
                     compute_dtype: torch.dtype = torch.float32, cfg: MoEConfig | None = None,
                     gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                     act_cut: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of routed_experts (same arguments): gathers the T * k experts' rows, then bmm.
    cfg: the experts' activation (moe.model.reference.gated_activation; SiLU without it); gate_up_bias
    [S, 2I] and down_bias [S, H]: per-slot biases (gpt-oss), added after each linear. act_cut [T, k]
    int: position (t, j)'s act rows [0, act_cut[t, j]) are zeroed before the down (a split expert's
    rows [cut, I) computed from the scratch slot, moe.engine.handoff); None: none zeroed.

    A SlotMatrix in a quantized format is dequantized (its format's torch `dequantize`, float32) slot
    by slot first: the reference of the dequantize-in-registers kernels. Linears run in `compute_dtype`
    (float32: the reference; hidden's dtype: the torch baseline of benchmarks/bench_routed.py); the
    combine over j is float32. Returns [T, H] float32. No host sync for plain tensors (one for a
    SlotMatrix: its slot ids). Cost: gathers T * k * 3 * I * H weight elements into new tensors, then
    reads them again.
    """
    tokens, top_k = slots.shape
    num_slots = gate_up.num_slots if isinstance(gate_up, SlotMatrix) else gate_up.shape[0]
    live = (slots >= 0) & (slots < num_slots)  # [T, k]
    idx = torch.where(live, slots, 0).long().flatten()  # [T * k]
    w13 = gate_up.dequantize(idx) if isinstance(gate_up, SlotMatrix) else gate_up[idx]  # [T * k, 2I, H]
    w2 = down.dequantize(idx) if isinstance(down, SlotMatrix) else down[idx]  # [T * k, H, I]
    hid = w13.shape[2]
    x = hidden.to(compute_dtype).repeat_interleave(top_k, dim=0)  # [T * k, H]
    gu = torch.bmm(w13.to(compute_dtype), x[:, :, None])[..., 0]  # [T * k, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias[idx].to(compute_dtype)
    act = gated_activation(gu, cfg)  # [T * k, I]
    if act_cut is not None:
        cols = torch.arange(act.shape[1], device=act.device)
        act = torch.where(cols[None, :] < act_cut.flatten().to(act.device)[:, None], 0.0, act)
    y = torch.bmm(w2.to(compute_dtype), act[:, :, None])[..., 0]  # [T * k, H]
    if down_bias is not None:
        y = y + down_bias[idx].to(compute_dtype)
    y = y.float()
    # a position without a slot (padding, a miss served on the CPU) adds 0, whatever its gathered slot holds
    y = torch.where(live.flatten()[:, None], y * weights.flatten()[:, None], 0.0)
    return y.view(tokens, top_k, hid).sum(dim=1)
