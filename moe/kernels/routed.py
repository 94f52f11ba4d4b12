"""The routed-expert GEMM of a decode step (1..GEMV_MAX_TOKENS tokens), read from the slot pool by slot id.

    hidden [T, H], slots [T, k] int32, weights [T, k] float32 (or gate_w [1, H]: the shared expert)
    pool banks gate_up [S, 2I, H], down [S, H, I]        (expertcache.pool.SlotPool, indexed by slot)
        │
        ├─ routed_gate_up: 1 launch, grid (T * k, ceil(I / block_i))
        │     -> act [T * k, I] float32 = weight[t, j] * silu(gate) * up   (0 when no expert)
        │        weight = weights[t, j], or sigmoid(hidden[t] · gate_w) when gate_w is given
        │
        └─ routed_down: 1 launch, grid (T, ceil(H / block_h))
              y[t] = Σ_{j = 0..k-1 in order} down[slots[t, j]] · act[t * k + j]   (+ addend[t])
              -> out [T, H] float32 and / or out_cast [T, H] = cast(y) in the pool's dtype

    routed_experts = routed_gate_up then routed_down; a caller that must wait for other work between
    the two (the layer joins its side stream there) calls them one by one.

Legend: T = tokens, H = hidden, I = expert width, k = top_k, S = pool slots. A slot id outside
[0, S) (NO_SLOT = -1 in particular) contributes nothing. No expert weights are gathered or copied:
every program streams whole rows of one slot with 16-byte loads and accumulates in float32 (kernels:
moe.kernels.routed_kernels). The shared expert is the one-slot case: gate_up[None], down[None], slots all 0,
gate_w given; its launches use separately named entry kernels with the same code, so traces tell
them apart. `addend` + `out_cast` fuse an MoE layer's combine (routed + shared, one rounding) into
the down launch. Both launches have independent programs (no atomics, no grid barrier), so the
result is bitwise repeatable for a fixed RoutedConfig and any side-stream work may hold SMs
meanwhile. Nothing reads a device value on the host, so a call is CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from moe.model.config import MoEConfig
from moe.kernels.plan import (
    GEMV_BLOCK_H,
    GEMV_BLOCK_I,
    GEMV_MAX_TOKENS,
    RoutedPlan,
    make_routed_plan,
)
from moe.kernels.routed_kernels import (
    DOWN_ENTRIES,
    GATE_UP_ENTRIES,
    HITS_JIT_OPTIONS,
    JIT_OPTIONS,
    _gate_up_first,
    _gate_up_hits,
)
from moe.kernels.triton_launch import compile_for_sm, kernel_for

NO_SLOT = -1
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class RoutedConfig:
    """Tiles of the two launches; every field a power of two >= 1 (warps: 1..16).

    block_i: gate rows (and as many up rows) per gate_up program. chunk_h: hidden columns per
    load step of a gate_up program. block_h: output rows per down program. chunk_i: intermediate
    columns per load step of a down program. warps_gate_up / warps_down: num_warps of each launch.
    pdl: on CUDA, launch the routed gate_up and down with programmatic dependent launch (each waits
    for its predecessor before reading anything: same results; moe.kernels.routed_kernels). On by default:
    0.5-1.0 us faster at T = 1..8 on the H200 (20.10 vs 20.61 us at T = 1,
    benchmarks/results/routed-2026-11-30-8f6abaf.json). The shared expert's launches and a
    routed_down not launched right after routed_gate_up never use it.
    down_release (opt-in): with pdl, the down launch lets the next programmatic launch on the stream
    (the next layer's router, MoEConfig.pdl_chain) start right after its own wait instead of at its
    end; that launch still waits for the down to finish before it reads anything the down writes, so
    the bits are the same. On the H200 with RouterConfig.early_weights (the router's weights loaded
    during the down), a resident Qwen3-Next-like layer with the overlap on took 27.9-28.0 us against
    28.8-29.3 without early hits (MoEConfig.early_hits=False), but 33.8 against 29.8 with them (the
    default): the router then starts during the down and the early hits on the side stream start 8.2
    us after it ends; a decode step with misses took the same time (984.3 us against 984.1)
    (benchmarks/results/moe-copy-overlap-resident-2026-12-01-dr-rw-fd807ed.json,
    moe-copy-overlap-2026-12-01-dr-rw-8aa636d.json). So it stays off by default.
    down_prefetch (0 .. k, or None: min(DOWN_PREFETCH, k), the default): each routed down program
    loads all k experts' slots, then the weight tiles of the first down_prefetch experts, before its
    programmatic wait (moe.kernels.routed_kernels _down_body), so no later weight load waits for its slot's
    round trip; the same bits. 0 loads each slot in the loop, right before its expert's tiles. More
    than the call's k is refused. On the H200 at the Qwen3-Next shape, T = 1, the routed pair took
    18.73 us with 4 against 19.58 with 0 (1.26x and 1.32x the HBM floor; 1 and 2: 19.07-19.08), and
    at T = 8 112.96 against 114.64 (benchmarks/results/routed-2026-12-01-prefetch-78dca14.log).
    copy_release (None, the default, or a bool): whether MoELayer's miss copy lets the routed gate_up
    launch right after the copy's own wait (expertcache.copy.miss_copy(release_after_wait=True)) instead
    of at the copy's end, so its programs are scheduled while the copy reads its plan; they still wait
    for the copy before reading anything, so the same bits. None: where the layer's
    MoEConfig.front_release is on (no early hits on the side stream, whose SMs the waiting programs
    would hold through a copy). On the H200 one more resident Qwen3-Next-like layer took 24.77-24.96 us
    with it against 25.13-25.32 without, overlap on, and 31.3-31.4 against 31.6-31.7 off, in four
    calls (benchmarks/results/moe-copy-overlap-resident-2026-12-01-cr*.log, -cra-a8bb3a2.log).
    The defaults come from moe.kernels.plan (GEMV_BLOCK_I, GEMV_BLOCK_H) so make_routed_plan's grid is the
    one launched. Raises ValueError naming the field.
    """

    block_i: int = GEMV_BLOCK_I
    chunk_h: int = 1024  # i1x1024w2-h2x512w4: fastest at T = 1 of 25 tilings, and at T = 2, 4, 8 of the 5 timed there
    warps_gate_up: int = 2  # (benchmarks/results/routed-2026-11-30-tiles-a5afb19.json)
    block_h: int = GEMV_BLOCK_H
    chunk_i: int = 512
    warps_down: int = 4
    pdl: bool = True
    down_release: bool = False
    down_prefetch: int | None = None
    copy_release: bool | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("pdl", "down_release"):
                if not isinstance(v, bool):
                    raise ValueError(f"RoutedConfig.{f.name} must be a bool, got {v!r}")
                continue
            if f.name == "copy_release":
                if v is not None and not isinstance(v, bool):
                    raise ValueError(f"RoutedConfig.copy_release must be None or a bool, got {v!r}")
                continue
            if f.name == "down_prefetch":
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ValueError(f"RoutedConfig.down_prefetch must be None or an int >= 0, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"RoutedConfig.{f.name} must be a power of two >= 1, got {v!r}")
        for name in ("warps_gate_up", "warps_down"):
            if getattr(self, name) > 16:
                raise ValueError(f"RoutedConfig.{name} must be <= 16, got {getattr(self, name)}")

    @property
    def name(self) -> str:
        """Short label, e.g. 'i4x512w4-h4x512w4' (no programmatic launch), 'i4x1024w8-h2x512w4-pdl',
        'i1x1024w2-h2x512w4-pdl-dr' (down_release), 'i1x1024w2-h2x512w4-pdl-pf1' (down_prefetch=1; None,
        the default, adds nothing), '-cr' / '-nocr' (copy_release True / False; None adds nothing)."""
        release = {None: "", True: "-cr", False: "-nocr"}[self.copy_release]
        return (f"i{self.block_i}x{self.chunk_h}w{self.warps_gate_up}-"
                f"h{self.block_h}x{self.chunk_i}w{self.warps_down}{'-pdl' if self.pdl else ''}"
                f"{'-dr' if self.down_release else ''}{'' if self.down_prefetch is None else f'-pf{self.down_prefetch}'}"
                f"{release}")


DEFAULT_CONFIG = RoutedConfig()
DOWN_PREFETCH = 4  # RoutedConfig.down_prefetch=None: min(this, k) (fastest of 0, 1, 2, 4, 6, 10 at T = 1..8 on
# the H200: benchmarks/results/routed-2026-12-01-prefetch-{78dca14,825b221}.log)
PARTS = ("all", "hits", "rest", "first")  # routed_gate_up's part; the index of the first three is the
# gate_up kernels' PICK ("hits" and "first" launch their own persistent kernels)


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


def _even(hidden: int, inter: int, config: RoutedConfig) -> tuple[bool, bool]:
    """(gate_up EVEN, down EVEN): no row / column masks needed at these tiles."""
    block_i, chunk_h, block_h, chunk_i = _tiles(hidden, inter, config)
    return inter % block_i == 0 and hidden % chunk_h == 0, hidden % block_h == 0 and inter % chunk_i == 0


def compile_for_target(top_k: int, hidden: int, inter: int, dtype: str = "bf16",
                       config: RoutedConfig = DEFAULT_CONFIG, arch: int = 90,
                       shared_inter: int | None = None) -> dict[str, dict]:
    """Compile every variant MoELayer launches, ahead of time for CUDA sm_<arch> (no GPU; needs ptxas).

    dtype: Triton's name of the weight dtype ("bf16", "fp16", "fp32"). shared_inter: the shared
    expert's width Is (default I). T is not compiled in (it only sizes the grids), so one binary per
    variant serves T = 1..GEMV_MAX_TOKENS. Returns {variant: Triton's asm dict (ttir .. cubin)} for
    "_gate_up_hits" and "_gate_up_first" (the persistent parts "hits" and "first"),
    "_gate_up_kernel", "_down_kernel" (f32 out), "_down_kernel+combine" (addend, cast out),
    "_shared_gate_up" (k = 1, gate computed) and "_shared_down" (k = 1). Run it in a process without
    TRITON_INTERPRET=1 (the interpreter replaces the compiler's language hooks).
    """
    shared_inter = inter if shared_inter is None else shared_inter
    prefetch = down_prefetch(config, top_k)
    p = f"*{dtype}"
    gate_up_types = (p, "*i32", "*fp32", p, p, "*fp32", "i32", "*i32")
    result = {}
    block_i, chunk_h, _, _ = _tiles(hidden, inter, config)
    result["_gate_up_hits"] = compile_for_sm(
        _gate_up_hits, (p, "*fp32", p, "*fp32", "i32", "*i32", "i32"),
        {"K": top_k, "H": hidden, "I": inter, "BLOCK_I": block_i, "CHUNK_H": chunk_h,
         "EVEN": _even(hidden, inter, config)[0]}, config.warps_gate_up, arch, HITS_JIT_OPTIONS)
    result["_gate_up_first"] = compile_for_sm(
        _gate_up_first, (p, "*i32", "*fp32", p, "*fp32", "i32", "*i32", "i32"),
        {"K": top_k, "H": hidden, "I": inter, "BLOCK_I": block_i, "CHUNK_H": chunk_h,
         "EVEN": _even(hidden, inter, config)[0], "GDC": int(config.pdl)}, config.warps_gate_up, arch,
        HITS_JIT_OPTIONS)
    for name, k, width, is_shared, down_flags in (
            ("_gate_up_kernel", top_k, inter, False, None),
            ("_gate_up_kernel+rest", top_k, inter, False, None),
            ("_down_kernel", top_k, inter, False, (False, True, False)),
            ("_down_kernel+combine", top_k, inter, False, (True, False, True)),
            ("_shared_gate_up", 1, shared_inter, True, None),
            ("_shared_down", 1, shared_inter, True, (False, True, False))):
        block_i, chunk_h, block_h, chunk_i = _tiles(hidden, width, config)
        even_a, even_b = _even(hidden, width, config)
        shape = {"K": k, "H": hidden, "I": width}
        if down_flags is None:
            pick = PARTS.index("rest" if name.endswith("+rest") else "all")
            kernel, types, warps = GATE_UP_ENTRIES[is_shared], gate_up_types, config.warps_gate_up
            constexprs = dict(shape, BLOCK_I=block_i, CHUNK_H=chunk_h, EVEN=even_a, GATED=is_shared,
                              GDC=int(config.pdl and not is_shared), PICK=pick)
        else:
            kernel, warps = DOWN_ENTRIES[is_shared], config.warps_down
            types = ("*fp32", "*i32", p, "*fp32", "*fp32", p, "i32")
            constexprs = dict(shape, BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=even_b,
                              ADDEND=down_flags[0], WRITE_OUT=down_flags[1], WRITE_CAST=down_flags[2],
                              GDC=int(config.pdl and not is_shared),
                              **({} if is_shared else {"RELEASE": config.down_release,
                                                       "PREFETCH": prefetch}))
        result[name] = compile_for_sm(kernel, types, constexprs, warps, arch, JIT_OPTIONS)
    return result


_SCRATCH: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def routed_scratch(device: torch.device | str, top_k: int, inter: int) -> torch.Tensor:
    """The activation buffer routed_experts uses on `device`: float32 [GEMV_MAX_TOKENS * k, I].

    One buffer per (device, k, I), made on first use and kept: call this (or routed_experts)
    once before CUDA-graph capture so the captured call allocates nothing. Calls that share it
    must be ordered (one stream, or joined by events); work on another stream passes its own `act`.
    Cost: one allocation on first use.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, top_k, inter)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty((GEMV_MAX_TOKENS * top_k, inter), dtype=torch.float32, device=device)
    return _SCRATCH[key]


def _check_tensor(who: str, name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int, device) -> None:
    """Raise ValueError naming `name` unless t is a contiguous `ndim`-d tensor of `dtypes` on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{who}: {name} must be a torch.Tensor, "  # noqa: TRY004 (house: ValueError)
                         f"got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{who}: {name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{who}: {name} dtype must be one of {list(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{who}: {name} is on {t.device}, expected {device} (hidden's / slots' device)")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous (call .contiguous())")


def _check_slots(who: str, slots, device) -> tuple[int, int]:
    _check_tensor(who, "slots", slots, (torch.int32,), 2, device)
    tokens, top_k = slots.shape
    if not 1 <= tokens <= GEMV_MAX_TOKENS or top_k < 1:
        raise ValueError(f"{who}: slots must be [T, k >= 1] with T in 1..{GEMV_MAX_TOKENS} "
                         f"(moe.kernels.plan.GEMV_MAX_TOKENS), got {list(slots.shape)}")
    return tokens, top_k


def _check_gate_up(who, hidden, slots, weights, gate_up, gate_w, act) -> tuple[int, int, int, int, int]:
    """Validate routed_gate_up's arguments on the host (no device reads); return (T, k, S, H, I)."""
    _check_tensor(who, "hidden", hidden, DTYPES, 2, None)
    dev, (tokens, hid) = hidden.device, hidden.shape
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        raise ValueError(f"{who}: hidden has {tokens} tokens; 1..{GEMV_MAX_TOKENS} "
                         "(moe.kernels.plan.GEMV_MAX_TOKENS) are served here")
    _, top_k = _check_slots(who, slots, dev)
    if slots.shape[0] != tokens:
        raise ValueError(f"{who}: slots must be [{tokens}, k >= 1] (T of hidden), got {list(slots.shape)}")
    if gate_w is None:
        _check_tensor(who, "weights", weights, (torch.float32,), 2, dev)
        if tuple(weights.shape) != tuple(slots.shape):
            raise ValueError(f"{who}: weights must be {list(slots.shape)} like slots, got {list(weights.shape)}")
    else:
        if weights is not None:
            raise ValueError(f"{who}: pass weights=None with gate_w (sigmoid(hidden · gate_w) is the weight)")
        _check_tensor(who, "gate_w", gate_w, (hidden.dtype,), 2, dev)
        if tuple(gate_w.shape) != (1, hid):
            raise ValueError(f"{who}: gate_w must be [1, {hid}], got {list(gate_w.shape)}")
    _check_tensor(who, "gate_up", gate_up, (hidden.dtype,), 3, dev)
    num_slots, two_i, gate_h = gate_up.shape
    if two_i % 2 or gate_h != hid or num_slots < 1:
        raise ValueError(f"{who}: gate_up must be [S, 2I, {hid}], got {list(gate_up.shape)}")
    if act is not None:
        _check_tensor(who, "act", act, (torch.float32,), 2, dev)
        if act.shape[0] < tokens * top_k or act.shape[1] != two_i // 2:
            raise ValueError(f"{who}: act must be float32 [>= {tokens * top_k}, {two_i // 2}] (T * k, I), "
                             f"got {list(act.shape)}")
    return tokens, top_k, num_slots, hid, two_i // 2


def _check_down(who, act, slots, down, out, addend, out_cast) -> tuple[int, int, int, int, int]:
    """Validate routed_down's arguments on the host; return (T, k, S, H, I)."""
    _check_tensor(who, "down", down, DTYPES, 3, None)
    dev, (num_slots, hid, inter) = down.device, down.shape
    tokens, top_k = _check_slots(who, slots, dev)
    _check_tensor(who, "act", act, (torch.float32,), 2, dev)
    if act.shape[0] < tokens * top_k or act.shape[1] != inter:
        raise ValueError(f"{who}: act must be float32 [>= {tokens * top_k}, {inter}] (T * k, I of down), "
                         f"got {list(act.shape)}")
    for name, t, dtype in (("out", out, torch.float32), ("addend", addend, torch.float32),
                           ("out_cast", out_cast, down.dtype)):
        if t is not None:
            _check_tensor(who, name, t, (dtype,), 2, dev)
            if tuple(t.shape) != (tokens, hid):
                raise ValueError(f"{who}: {name} must be [{tokens}, {hid}], got {list(t.shape)}")
    return tokens, top_k, num_slots, hid, inter


def _device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


HITS_PROGRAMS_PER_SM = 8  # the early hits' persistent grid: programs per SM (16 warps at the default 2-warp
# gate_up tile; with pdl_chain the ensure and copy are resident before the hits take the SMs: docs/moe.md)
_SMS: dict[torch.device, int] = {}


def hits_programs(device: torch.device) -> int:
    """Default programs of a part="hits" launch: HITS_PROGRAMS_PER_SM per SM of `device` (4 SMs on CPU)."""
    if device not in _SMS:
        _SMS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
    return HITS_PROGRAMS_PER_SM * _SMS[device]


def _launch_persistent(hidden, slots, weights, gate_up, act, pre, dims, config, programs, first) -> None:
    """One persistent launch of at most `programs` programs over the (pair, tile) items. part="hits"
    (first False): only the pairs with pre >= 0, never programmatic (it waits on another stream's
    event, not its producer). part="first": those pairs before its wait (programmatic with
    RoutedConfig.pdl on CUDA), the others after it at `slots`."""
    tokens, top_k, num_slots, hid, inter = dims
    block_i, chunk_h, _, _ = _tiles(hid, inter, config)
    items = tokens * top_k * triton.cdiv(inter, block_i)
    programs = hits_programs(hidden.device) if programs is None else programs
    kernel = kernel_for(_gate_up_first if first else _gate_up_hits, hidden.device, HITS_JIT_OPTIONS,
                        "routed_gate_up")
    gdc = first and config.pdl and hidden.device.type == "cuda"
    head = (hidden, slots, weights) if first else (hidden, weights)
    extra = {"GDC": int(gdc), **({"launch_pdl": True} if gdc else {})} if first else {}
    with _device_ctx(hidden.device):
        kernel[(min(programs, items),)](*head, gate_up, act, num_slots, pre, tokens * top_k,
                                        K=top_k, H=hid, I=inter, BLOCK_I=block_i, CHUNK_H=chunk_h,
                                        EVEN=_even(hid, inter, config)[0], num_warps=config.warps_gate_up,
                                        **extra)


def _launch_gate_up(hidden, slots, weights, gate_up, gate_w, act, dims, config, part="all",
                    pre=None) -> torch.Tensor:
    """part "all" or "rest" (PICK 0 / 2): one program per (pair, row tile); "hits", "first":
    _launch_persistent."""
    tokens, top_k, num_slots, hid, inter = dims
    block_i, chunk_h, _, _ = _tiles(hid, inter, config)
    grid, _ = routed_grids(tokens, top_k, hid, inter, config)
    gated = gate_w is not None
    pick = PARTS.index(part)
    kernel = kernel_for(GATE_UP_ENTRIES[gated], hidden.device, JIT_OPTIONS, "routed_experts")
    with _device_ctx(hidden.device):
        gdc = config.pdl and not gated and hidden.device.type == "cuda"
        kernel[grid](hidden, slots, act if gated else weights, gate_w if gated else hidden, gate_up, act,
                     num_slots, slots if pre is None else pre, K=top_k, H=hid, I=inter, BLOCK_I=block_i,
                     CHUNK_H=chunk_h, EVEN=_even(hid, inter, config)[0], GATED=gated, GDC=int(gdc),
                     PICK=pick, num_warps=config.warps_gate_up, **({"launch_pdl": True} if gdc else {}))
    return act[:tokens * top_k]


def down_prefetch(config: RoutedConfig, top_k: int) -> int:
    """Experts whose down weight tiles a routed down program of a k = top_k call loads before its wait:
    config.down_prefetch, or min(DOWN_PREFETCH, k) for None. More than k is refused by name."""
    if config.down_prefetch is None:
        return min(DOWN_PREFETCH, top_k)
    if config.down_prefetch > top_k:
        raise ValueError(f"RoutedConfig.down_prefetch={config.down_prefetch} is more than the call's k = {top_k} "
                         "experts per token; set down_prefetch to at most k (or None)")
    return config.down_prefetch


def _launch_down(act, slots, down, out, addend, out_cast, shared, dims, config, after_gate_up) -> torch.Tensor:
    tokens, top_k, num_slots, hid, inter = dims
    prefetch = 0 if shared else down_prefetch(config, top_k)
    _, _, block_h, chunk_i = _tiles(hid, inter, config)
    _, grid = routed_grids(tokens, top_k, hid, inter, config)
    if out is None and out_cast is None:
        out = torch.empty((tokens, hid), dtype=torch.float32, device=down.device)
    kernel = kernel_for(DOWN_ENTRIES[bool(shared)], down.device, JIT_OPTIONS, "routed_experts")
    # programmatic launch only right behind a programmatic gate_up (the pair this option is about)
    gdc = config.pdl and after_gate_up and not shared and down.device.type == "cuda"
    with _device_ctx(down.device):
        kernel[grid](act, slots, down, act if addend is None else addend, act if out is None else out,
                     act if out_cast is None else out_cast, num_slots, K=top_k, H=hid, I=inter,
                     BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=_even(hid, inter, config)[1],
                     ADDEND=addend is not None, WRITE_OUT=out is not None, WRITE_CAST=out_cast is not None,
                     GDC=int(gdc), num_warps=config.warps_down,
                     **({} if shared else {"RELEASE": config.down_release, "PREFETCH": prefetch}),
                     **({"launch_pdl": True} if gdc else {}))
    return out_cast if out is None else out


def _config(who: str, config) -> RoutedConfig:
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, RoutedConfig):
        raise ValueError(f"{who}: config must be a RoutedConfig, "  # noqa: TRY004 (house: ValueError)
                         f"got {type(config).__name__}")
    return config


def routed_gate_up(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                   gate_up: torch.Tensor, *, gate_w: torch.Tensor | None = None,
                   act: torch.Tensor | None = None, config: RoutedConfig | None = None,
                   part: str = "all", pre: torch.Tensor | None = None,
                   programs: int | None = None) -> torch.Tensor:
    """The first launch of routed_experts (same arguments): returns act [T * k, I] float32, rows
    [0, T * k) of `act` (default routed_scratch(device, k, I)), to pass to routed_down.

    part / pre (routed experts only, not with gate_w): "all" (default) computes every (t, j) pair.
    With pre int32 [T, k] (the slots before the ensure, -1 = not resident: router_topk's `pre`),
    "hits" computes only the pairs with pre >= 0, at slot pre[t, j] (`slots` is not read), and "rest"
    only the others, at slots[t, j]; a pair not taken keeps its act rows untouched. A "hits" and a
    "rest" launch over the same pre write every row once, bit for bit as one "all" launch (the same
    program per pair), so the hits can run before the ensure decides the rest (MoELayer's early hits).
    The "hits" launch is persistent: `programs` programs (default hits_programs(device), 8 per SM)
    walk the pairs' row tiles, so work launched beside it on another stream still finds room on the
    SMs. "first" is both in one persistent launch: the pre >= 0 pairs at pre, then (after its
    programmatic wait, with RoutedConfig.pdl on CUDA) the others at slots, bit for bit as "all"; it
    is launched behind a miss copy that releases it early (MoEConfig.hits_first), so the resident
    experts' rows stream while the ensure and the copy run.
    """
    config = _config("routed_gate_up", config)
    dims = _check_gate_up("routed_gate_up", hidden, slots, weights, gate_up, gate_w, act)
    if part not in PARTS:
        raise ValueError(f"routed_gate_up: part must be one of {PARTS}, got {part!r}")
    if part != "all":
        if gate_w is not None:
            raise ValueError("routed_gate_up: part='hits' / 'rest' is for routed experts (gate_w=None)")
        _check_tensor("routed_gate_up", "pre", pre, (torch.int32,), 2, hidden.device)
        if tuple(pre.shape) != tuple(slots.shape):
            raise ValueError(f"routed_gate_up: pre must be {list(slots.shape)} like slots, got {list(pre.shape)}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"routed_gate_up: programs must be an int >= 1, got {programs!r}")
    act = routed_scratch(hidden.device, dims[1], dims[4]) if act is None else act
    if part in ("hits", "first"):
        _launch_persistent(hidden, slots, weights, gate_up, act, pre, dims, config, programs, part == "first")
        return act[:dims[0] * dims[1]]
    return _launch_gate_up(hidden, slots, weights, gate_up, gate_w, act, dims, config, part,
                           pre if part == "rest" else None)


def routed_down(act: torch.Tensor, slots: torch.Tensor, down: torch.Tensor, *,
                out: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                out_cast: torch.Tensor | None = None, shared: bool = False,
                config: RoutedConfig | None = None, after_gate_up: bool = False) -> torch.Tensor:
    """The second launch of routed_experts: act [>= T * k, I] float32 from routed_gate_up, slots
    [T, k], down [S, H, I]; out / addend / out_cast as routed_experts. shared: launch the shared
    expert's entry kernel (same code, another name in traces). after_gate_up: the last launch on this
    stream was routed_gate_up for these slots (only event waits between), so with config.pdl the
    down launch may overlap it. Returns out, else out_cast."""
    config = _config("routed_down", config)
    dims = _check_down("routed_down", act, slots, down, out, addend, out_cast)
    return _launch_down(act, slots, down, out, addend, out_cast, shared, dims, config, after_gate_up)


def routed_experts(hidden: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None,
                   gate_up: torch.Tensor, down: torch.Tensor, *, out: torch.Tensor | None = None,
                   config: RoutedConfig | None = None, gate_w: torch.Tensor | None = None,
                   addend: torch.Tensor | None = None, out_cast: torch.Tensor | None = None,
                   act: torch.Tensor | None = None) -> torch.Tensor:
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
    config:  tiles and warps (RoutedConfig; default DEFAULT_CONFIG).
    Returns out when given; else out_cast when given; else a new float32 [T, H]. Without out and
    with out_cast, no float32 result is written. The sum over j runs in order j = 0..k-1 and the
    result is bitwise repeatable. All tensors on one device: CUDA, or CPU under TRITON_INTERPRET=1.
    Two launches on the current stream, no host sync; with out / out_cast given and the scratch made
    it allocates nothing, so it can be captured in a CUDA graph. Cost: reads T * k * 3 * I * H
    weight elements (none for empty slots) plus T * k * I * 8 activation bytes (+ T * H * 4 of
    addend), writes T * H * (4 or the dtype's size). Raises ValueError naming the argument whose
    shape, dtype, device or layout is wrong; RuntimeError for CPU tensors without Triton's interpreter.
    """
    config = _config("routed_experts", config)
    dims = _check_gate_up("routed_experts", hidden, slots, weights, gate_up, gate_w, act)
    _check_tensor("routed_experts", "down", down, (hidden.dtype,), 3, hidden.device)
    if tuple(down.shape) != (dims[2], dims[3], dims[4]):
        raise ValueError(f"routed_experts: down must be {[dims[2], dims[3], dims[4]]} (S, H, I of gate_up), "
                         f"got {list(down.shape)}")
    act = routed_scratch(hidden.device, dims[1], dims[4]) if act is None else act
    _check_down("routed_experts", act, slots, down, out, addend, out_cast)
    act = _launch_gate_up(hidden, slots, weights, gate_up, gate_w, act, dims, config)
    return _launch_down(act, slots, down, out, addend, out_cast, gate_w is not None, dims, config, True)


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
