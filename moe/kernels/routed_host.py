"""The host side of the routed GEMM that launches nothing: argument checks, the activation scratch,
and the ahead-of-time compile of every variant the layer launches (wrappers: moe.kernels.routed).

    routed_gate_up / routed_down arguments ──check_gate_up / check_down──► (T, k, S, H, I) and the
        weights as a SlotMatrix (a plain tensor: its dense format), no device reads
    device, k, I ──routed_scratch──► act float32 [GEMV_MAX_TOKENS * k, I], made once and kept
    k, H, I, dtype, RoutedTiles ──compile_for_target──► {variant: Triton's asm dict} for CUDA sm_<arch>

Legend: T = tokens, H = hidden, I = expert width, k = top_k, S = pool slots.
"""

from __future__ import annotations

import torch

from expertcache.formats import resolve_format
from moe.kernels.plan import DEFAULT_ROUTED_TILES, DOWN_PREFETCH, GEMV_MAX_TOKENS
from moe.kernels.routed_kernels import (
    DOWN_ENTRIES,
    GATE_UP_ENTRIES,
    HITS_JIT_OPTIONS,
    JIT_OPTIONS,
    _gate_up_hits,
)
from moe.kernels.tiles import RoutedTiles
from moe.kernels.triton_launch import compile_for_sm
from moe.model.config import MoEConfig
from moe.model.slot_matrix import CODES, SlotMatrix

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARTS = ("all", "hits", "rest")  # routed_gate_up's part; its index is the gate_up kernels' PICK


TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4nv", "uint8": "u8"}


def activation_args(cfg: MoEConfig | None, bias: bool) -> dict:
    """The ACT / ALPHA / LIMIT / BIAS constexprs of a routed gate_up launch: the experts' activation of
    `cfg` (None: SiLU) and whether their gate_up biases are added; {} for the plain SiLU block (the
    kernels' defaults, so its binaries are those of a block without these options)."""
    if cfg is None or cfg.activation == "silu":
        return {"BIAS": True} if bias else {}
    return {"ACT": 1, "ALPHA": float(cfg.swiglu_alpha), "LIMIT": float(cfg.swiglu_limit), "BIAS": bool(bias)}


def _matrix_types(expert_format: str | None, dtype: str, out: int, inn: int, stack: int) -> tuple[str, ...]:
    """Triton pointer types of a matrix's (q, s, s2, z) banks; a part the format lacks repeats q."""
    if expert_format is None:
        return (f"*{dtype}",) * 4
    fmt = resolve_format(expert_format)
    by = {p.suffix: f"*{TRITON_TYPES['uint8' if p.dtype == 'float8_e4m3fn' else p.dtype]}"
          for p in fmt.layout(out, inn, stack)}  # fp8 values as their bytes (SlotMatrix.kernel_args)
    q = "*i32" if fmt.pack == 2 else by[fmt.main]  # 4-bit values as int32 words
    return q, by.get("s", q), by.get("s2", q), by.get("z", q)


def _variant(expert_format: str | None, dtype: str, hidden: int, inter: int) -> tuple[dict, tuple, tuple]:
    """(FMT / ZP constexprs, gate_up's and down's pointer types) of weights in `expert_format` (None: dense
    of `dtype`; a dense format: dense of its dtype)."""
    fmt = None if expert_format is None else resolve_format(expert_format)
    if fmt is None or fmt.dense:
        weights = dtype if fmt is None else TRITON_TYPES[fmt.dtype]
        return {}, _matrix_types(None, weights, 2 * inter, hidden, 2), _matrix_types(None, weights, hidden, inter, 1)
    quant = {"FMT": CODES[fmt.name], "ZP": bool(getattr(fmt, "zero_points", False))}
    return (quant, _matrix_types(expert_format, dtype, 2 * inter, hidden, 2),
            _matrix_types(expert_format, dtype, hidden, inter, 1))


def compile_for_target(top_k: int, hidden: int, inter: int, dtype: str = "bf16",
                       tiles: RoutedTiles = DEFAULT_ROUTED_TILES, arch: int = 90, shared_inter: int | None = None,
                       down_release: bool = False, down_prefetch: int = DOWN_PREFETCH,
                       expert_format: str | None = None, shared_format: str | None = None,
                       cfg: MoEConfig | None = None, expert_bias: bool = False) -> dict[str, dict]:
    """Compile every variant MoELayer launches, ahead of time for CUDA sm_<arch> (no GPU; needs ptxas).

    dtype: Triton's name of the activation dtype ("bf16", "fp16", "fp32"), and of the dense weights.
    expert_format: the routed experts' format (fp8, nvfp4, mxfp4, int4, or bf16 / float16 / float32:
    expertcache.formats); None: dense weights of `dtype`. shared_inter: the shared expert's width Is
    (default I). shared_format: the shared expert's format (a quantized checkpoint's), None: dense of
    `dtype`. cfg / expert_bias: the routed experts' activation (None: SiLU) and biases (gpt-oss;
    the bias banks in `dtype`). down_release / down_prefetch: the routed down's (routed_down's
    release / prefetch, min(prefetch, k) experts, none for a quantized format). T is not compiled in
    (it only sizes the grids), so one binary per variant serves T = 1..GEMV_MAX_TOKENS. Returns
    {variant: Triton's asm dict (ttir .. cubin)} for "_gate_up_hits" (the early hits), "_gate_up_kernel",
    "_gate_up_kernel+rest", "_down_kernel" (f32 out), "_down_kernel+combine" (addend, cast out),
    "_shared_gate_up" (k = 1, gate computed) and "_shared_down" (k = 1). Run it in a process without
    TRITON_INTERPRET=1 (the interpreter replaces the compiler's language hooks).
    """
    shared_inter = inter if shared_inter is None else shared_inter
    p = f"*{dtype}"
    quant, w13, w2 = _variant(expert_format, dtype, hidden, inter)
    shared_quant, s13, s2 = _variant(shared_format, dtype, hidden, shared_inter)
    act = activation_args(cfg, expert_bias)
    bias = p if expert_bias else "*fp32"  # unread without biases: the launches pass the act buffer
    block_i, chunk_h, _, _ = tiles.capped(hidden, inter)
    result = {"_gate_up_hits": compile_for_sm(
        _gate_up_hits, (p, "*fp32", w13, "*fp32", "i32", "*i32", "i32", bias),
        {"K": top_k, "H": hidden, "I": inter, "BLOCK_I": block_i, "CHUNK_H": chunk_h,
         "EVEN": tiles.even(hidden, inter)[0], "FMT": 0, "ZP": False, **quant, **act}, tiles.warps_gate_up, arch,
        HITS_JIT_OPTIONS)}
    for name, k, width, is_shared, down_flags in (
            ("_gate_up_kernel", top_k, inter, False, None),
            ("_gate_up_kernel+rest", top_k, inter, False, None),
            ("_down_kernel", top_k, inter, False, (False, True, False)),
            ("_down_kernel+combine", top_k, inter, False, (True, False, True)),
            ("_shared_gate_up", 1, shared_inter, True, None),
            ("_shared_down", 1, shared_inter, True, (False, True, False))):
        block_i, chunk_h, block_h, chunk_i = tiles.capped(hidden, width)
        even_a, even_b = tiles.even(hidden, width)
        shape = {"K": k, "H": hidden, "I": width}
        routed = {"FMT": 0, "ZP": False, **(shared_quant if is_shared else quant)}
        if down_flags is None:
            pick = PARTS.index("rest" if name.endswith("+rest") else "all")
            kernel, warps = GATE_UP_ENTRIES[is_shared], tiles.warps_gate_up
            types = (p, "*i32", "*fp32", p, s13 if is_shared else w13, "*fp32", "i32", "*i32",
                     "*fp32" if is_shared else bias)
            constexprs = dict(shape, BLOCK_I=block_i, CHUNK_H=chunk_h, EVEN=even_a, GATED=is_shared,
                              GDC=int(not is_shared), PICK=pick, **routed, **({} if is_shared else act))
        else:
            kernel, warps = DOWN_ENTRIES[is_shared], tiles.warps_down
            types = ("*fp32", "*i32", s2 if is_shared else w2, "*fp32", "*fp32", p, "i32", "*fp32",
                     "*fp32" if is_shared else bias)
            prefetch = min(down_prefetch, top_k) if not quant else 0
            down_bias = {"BIAS": True} if expert_bias and not is_shared else {}
            constexprs = dict(shape, BLOCK_H=block_h, CHUNK_I=chunk_i, EVEN=even_b,
                              ADDEND=down_flags[0], WRITE_OUT=down_flags[1], WRITE_CAST=down_flags[2],
                              GDC=int(not is_shared), **routed, **down_bias,
                              **({} if is_shared else {"RELEASE": down_release, "PREFETCH": prefetch}))
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


def check_tensor(who: str, name: str, t, dtypes: tuple[torch.dtype, ...], ndim: int, device) -> None:
    """Raise ValueError naming `name` unless t is a contiguous `ndim`-d tensor of `dtypes` on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{who}: {name} must be a torch.Tensor, "
                         f"got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{who}: {name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{who}: {name} dtype must be one of {list(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{who}: {name} is on {t.device}, expected {device} (hidden's / slots' device)")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous (call .contiguous())")


def _check_slots(who: str, slots, device, max_tokens: int = GEMV_MAX_TOKENS) -> tuple[int, int]:
    check_tensor(who, "slots", slots, (torch.int32,), 2, device)
    tokens, top_k = slots.shape
    if not 1 <= tokens <= max_tokens or top_k < 1:
        raise ValueError(f"{who}: slots must be [T, k >= 1] with T in 1..{max_tokens}, got {list(slots.shape)}")
    return tokens, top_k


def as_matrix(who: str, name: str, w, device, stack: int, dtype: torch.dtype | None) -> SlotMatrix:
    """A pool matrix argument as a SlotMatrix: a SlotMatrix as it is (any format, on `device`), or a plain
    tensor [S, out, in] that must be contiguous, of `dtype` (the activations', when given) and on
    `device` (None: any). Raises ValueError naming `name`."""
    if isinstance(w, SlotMatrix):
        if device is not None and w.device != device:
            raise ValueError(f"{who}: {name} is on {w.device}, expected {device} (hidden's / slots' device)")
        if w.stack != stack:
            raise ValueError(f"{who}: {name} must be a stack of {stack} matrices, got stack={w.stack}")
        return w
    check_tensor(who, name, w, DTYPES if dtype is None else (dtype,), 3, device)
    try:
        return SlotMatrix.dense(w, stack)
    except ValueError as e:
        raise ValueError(f"{who}: {name} {list(w.shape)}: {e}") from None


def check_gate_up(
    who, hidden, slots, weights, gate_up, gate_w, act, max_tokens: int = GEMV_MAX_TOKENS
) -> tuple[tuple[int, int, int, int, int], SlotMatrix]:
    """Validate routed_gate_up's arguments on the host (no device reads); return ((T, k, S, H, I), gate_up
    as a SlotMatrix). max_tokens: the most tokens the caller's kernels serve."""
    check_tensor(who, "hidden", hidden, DTYPES, 2, None)
    dev, (tokens, hid) = hidden.device, hidden.shape
    if not 1 <= tokens <= max_tokens:
        raise ValueError(f"{who}: hidden has {tokens} tokens; 1..{max_tokens} are served here")
    _, top_k = _check_slots(who, slots, dev, max_tokens)
    if slots.shape[0] != tokens:
        raise ValueError(f"{who}: slots must be [{tokens}, k >= 1] (T of hidden), got {list(slots.shape)}")
    if gate_w is None:
        check_tensor(who, "weights", weights, (torch.float32,), 2, dev)
        if tuple(weights.shape) != tuple(slots.shape):
            raise ValueError(f"{who}: weights must be {list(slots.shape)} like slots, got {list(weights.shape)}")
    else:
        if weights is not None:
            raise ValueError(f"{who}: pass weights=None with gate_w (sigmoid(hidden · gate_w) is the weight)")
        check_tensor(who, "gate_w", gate_w, (hidden.dtype,), 2, dev)
        if tuple(gate_w.shape) != (1, hid):
            raise ValueError(f"{who}: gate_w must be [1, {hid}], got {list(gate_w.shape)}")
    matrix = as_matrix(who, "gate_up", gate_up, dev, 2, hidden.dtype)
    num_slots, two_i, gate_h = matrix.num_slots, matrix.out_features, matrix.in_features
    if two_i % 2 or gate_h != hid or num_slots < 1:
        raise ValueError(f"{who}: gate_up must be [S, 2I, {hid}], got {[num_slots, two_i, gate_h]}")
    if act is not None:
        check_tensor(who, "act", act, (torch.float32,), 2, dev)
        if act.shape[0] < tokens * top_k or act.shape[1] != two_i // 2:
            raise ValueError(f"{who}: act must be float32 [>= {tokens * top_k}, {two_i // 2}] (T * k, I), "
                             f"got {list(act.shape)}")
    return (tokens, top_k, num_slots, hid, two_i // 2), matrix


def check_down_beside(who: str, down, gate_up: SlotMatrix, dims, hidden: torch.Tensor) -> SlotMatrix:
    """down as a SlotMatrix [S, H, I] (S, H, I of gate_up's dims) in gate_up's format, on hidden's device
    (a plain tensor of hidden's dtype). Raises ValueError naming down."""
    matrix = as_matrix(who, "down", down, hidden.device, 1, hidden.dtype)
    if (matrix.num_slots, matrix.out_features, matrix.in_features) != tuple(dims[2:]) or matrix.fmt != gate_up.fmt:
        raise ValueError(
            f"{who}: down must be {list(dims[2:])} (S, H, I of gate_up) in gate_up's format {gate_up.fmt.name}, "
            f"got {[matrix.num_slots, matrix.out_features, matrix.in_features]} {matrix.fmt.name}")
    return matrix


def check_bias(who: str, name: str, bias, rows: int, width: int, device) -> None:
    """Raise ValueError naming `name` unless bias is a contiguous bf16 / f16 / f32 tensor [rows, width]
    (per-slot expert biases: [S, 2I] for the gate_up, [S, H] for the down) on `device`."""
    check_tensor(who, name, bias, DTYPES, 2, device)
    if tuple(bias.shape) != (rows, width):
        raise ValueError(f"{who}: {name} must be [{rows}, {width}] (one row a slot), got {list(bias.shape)}")


def check_down(who, act, slots, down, out, addend, out_cast,
               max_tokens: int = GEMV_MAX_TOKENS) -> tuple[tuple[int, int, int, int, int], SlotMatrix]:
    """Validate routed_down's arguments on the host; return ((T, k, S, H, I), down as a SlotMatrix).
    out_cast: the dtype of a plain down tensor, or any of bf16 / f16 / f32 with a SlotMatrix."""
    matrix = as_matrix(who, "down", down, None, 1, None)
    dev = matrix.device
    num_slots, hid, inter = matrix.num_slots, matrix.out_features, matrix.in_features
    tokens, top_k = _check_slots(who, slots, dev, max_tokens)
    check_tensor(who, "act", act, (torch.float32,), 2, dev)
    if act.shape[0] < tokens * top_k or act.shape[1] != inter:
        raise ValueError(f"{who}: act must be float32 [>= {tokens * top_k}, {inter}] (T * k, I of down), "
                         f"got {list(act.shape)}")
    cast_dtypes = DTYPES if isinstance(down, SlotMatrix) else (down.dtype,)
    for name, t, dtypes in (("out", out, (torch.float32,)), ("addend", addend, (torch.float32,)),
                            ("out_cast", out_cast, cast_dtypes)):
        if t is not None:
            check_tensor(who, name, t, dtypes, 2, dev)
            if tuple(t.shape) != (tokens, hid):
                raise ValueError(f"{who}: {name} must be [{tokens}, {hid}], got {list(t.shape)}")
    return (tokens, top_k, num_slots, hid, inter), matrix
