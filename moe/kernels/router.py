"""The MoE router of a decode step as one Triton launch: logits, softmax, top-k, renormalisation.

    hidden [T, H], router_w [E, H] (both the model dtype)
        │  grid (T, ceil(E / block_e)): program (t, b); block_e 2 up to 4 tokens, else 4 (RouterConfig)
        ├─ every program: logits[t, b * block_e + i] = Σ_h hidden[t, h] * router_w[e, h]   (f32 accumulate)
        │     -> scratch logits [T, E] float32; then one atomic arrival on counter[t]
        └─ the last program of token t to arrive (it resets counter[t] to 0):
              probs = softmax(logits[t]) in float32 over all E
              k times: the largest remaining prob (ties: the lower expert id), removed after
              (or one bitonic top-k over packed (prob, id) keys: RouterConfig.select)
              (weights [t, k] float32 descending, ids [t, k] int32); weights /= Σ weights when norm
              (pre: also the chosen experts' slots before the ensure, carried in the packed keys)
    -> weights [T, k] float32, ids [T, k] int32 (the order of moe.model.reference.route)

Legend: T = tokens (1..GEMV_MAX_TOKENS), H = hidden, E = experts (<= ROUTER_MAX_EXPERTS), k = top_k.

Why one launch with an arrival counter (as expertcache.device_ensure) rather than two launches
(logits, then one program per token for softmax + top-k): at decode size the router reads
E * H * 2 bytes (2 MiB at Qwen3-Next: about 0.5 us of HBM time), while each extra kernel in a
CUDA graph costs a few microseconds of launch gap; the logits GEMV must be spread over ~E / block_e
programs to reach bandwidth, and the arrival counter lets the last of them do the tiny O(k * E)
selection without a second launch. The result stays deterministic: every logit is made by one
program in a fixed order, and one program reads them all. The counters are zero between calls
(the last program resets its token's), so the launch is CUDA-graph capturable and replayable.
The weights stay in the model dtype: no float32 copy of router_w is kept anywhere.

`router_reference` is the same math in torch (weights upcast, float32, a stable sort so ties go to
the lower id) for the tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe.kernels.plan import GEMV_MAX_TOKENS
from moe.kernels.triton_launch import compile_for_sm, kernel_for

ROUTER_MAX_EXPERTS = 4096  # the selecting program holds all E probabilities in registers (ids: 12 bits)
PRE_SLOT_BITS: tl.constexpr = tl.constexpr(20)  # a packed key's low bits: slot + 1 (expertcache: slots < 2**20 - 1)
PRE_SLOT_MASK: tl.constexpr = tl.constexpr((1 << 20) - 1)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_JIT_OPTIONS: dict = {"do_not_specialize": ["key_base"]}


SELECTS = ("argmax", "packed", "topk", "logits")


@dataclass(frozen=True)
class RouterConfig:
    """Tiles of the router launch and how its last program selects the top k.

    block_e: experts (rows of router_w) per program, or None: 2 for T <= 4 tokens, 4 above (on the
    H200 at Qwen3-Next's router, 2 per program took 5.68 / 5.87 / 6.41 us at T = 1 / 2 / 4 against
    6.32 / 6.34 / 6.71 for 4, and 9.04 against 7.36 at T = 8: router-2026-11-30-a13cff3.json).
    chunk_h: hidden columns per load step. warps: num_warps. Each a power of two >= 1 (warps: 1..16). select: one of SELECTS (all four
    give the same ids, and bit-identical weights before renormalisation; the renormalising sum runs
    in the order of the selection's register layout, so renormalised weights may differ in the last
    bits between selections or warp counts, never between two calls of one config):
      "topk":   one bitonic top-k (tl.topk) over int64 keys prob bits << 32 | (E - 1 - id) (a
                non-negative float32's bits order like its value, so a key orders by prob, then by
                lower id), k rounded up to a power of two: 5.7-6.3 us against 8.3 us for "argmax" at
                Qwen3-Next's router, T = 1 on the H200 (benchmarks/results/router-2026-11-30-a13cff3.json);
      "packed": k rounds of tl.max over the same keys (half the data per reduction, no index pass);
      "argmax": k rounds of tl.max over (prob, id) pairs (ties to the lower id);
      "logits": one tl.topk over the logits themselves (an order-preserving int32 of each float's
                bits << 32 | (E - 1 - id)): softmax is monotonic, so the same experts, and no pass
                over the E logits for their max or their exponentials' sum when norm_topk_prob
                (the weights are then the softmax of the k chosen logits, within float32 rounding
                of the others'); without it one sum over E, and bit-identical weights. Exactly
                equal logits tie to the lower id as everywhere, except +0.0 against -0.0 (the
                positive zero first). The default: faster than "topk" in every cell measured on the
                H200 (Qwen3-Next T = 1: 5.11 against 5.68 us, T = 8: 6.95 against 7.25 at 4 per
                program; Qwen3-30B-A3B T = 1: 3.26 against 3.73; router-2026-12-01-39c993c.json).
    early_weights (opt-in): with a programmatic launch (router_topk's pdl), each program loads its
    router_w rows before its wait, held in registers, so their round trips overlap the predecessor's
    tail (the hidden state, its output, is read after the wait; the same sums in the same order, the
    same bits). Its rows must fit: block_e * H at most EARLY_WEIGHTS_MAX_ELEMENTS. False (the
    default): off; True: on, and a call whose rows do not fit is refused (ValueError naming the
    field); None: on where they fit. It pays when the predecessor releases the router early
    (RoutedConfig.down_release, whose measurements are there).
    Raises ValueError naming the field.
    """

    block_e: int | None = None  # None: by the token count (SMALL_T_BLOCK_E up to SMALL_T tokens)
    chunk_h: int = 1024
    warps: int = 4
    select: str = "logits"
    early_weights: bool | None = False

    def __post_init__(self) -> None:
        if self.early_weights is not None and not isinstance(self.early_weights, bool):
            raise ValueError(f"RouterConfig.early_weights must be None, True or False, got {self.early_weights!r}")
        for name in ("block_e", "chunk_h", "warps"):
            v = getattr(self, name)
            if name == "block_e" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"RouterConfig.{name} must be a power of two >= 1, got {v!r}")
        if self.warps > 16:
            raise ValueError(f"RouterConfig.warps must be <= 16, got {self.warps}")
        if self.select not in SELECTS:
            raise ValueError(f"RouterConfig.select must be one of {SELECTS}, got {self.select!r}")


DEFAULT_ROUTER = RouterConfig()
EARLY_WEIGHTS_MAX_ELEMENTS = 16384  # early_weights: router_w elements one program holds (32 KB of bf16)


@triton.jit
def _select_topk(row_ptr, ids_ptr, weights_ptr, slot_row_ptr, pre_ptr, E: tl.constexpr, K: tl.constexpr,
                 BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 SELECT: tl.constexpr, PRE: tl.constexpr):
    """Softmax over the E logits at row_ptr, then the top K (ties: lower id) into ids / weights.
    SELECT: 0 argmax rounds, 1 packed-key rounds, 2 bitonic top-k of packed keys, 3 bitonic top-k of
    the logits' keys, the softmax over the chosen k (RouterConfig).
    PRE: also pre[j] = slot_row[ids[j]]; with packed keys the E slots are loaded beside the logits and
    ride in the keys' low bits (below the id, so they never change the order): no load after the
    selection."""
    e = tl.arange(0, BLOCK_ALL)
    logit = tl.load(row_ptr + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")  # other programs' writes
    if PRE and SELECT != 0:  # slot + 1 in PRE_SLOT_BITS bits (0: absent); slot_of's slots are < 2**20 - 1
        low = tl.load(slot_row_ptr + e, mask=e < E, other=-1) + 1
    else:
        low = tl.zeros([BLOCK_ALL], dtype=tl.int32)
    kk = tl.arange(0, BLOCK_K)
    if SELECT == 3:  # top k of the logits; softmax over the chosen ones only (NORM) or one sum over E
        b = logit.to(tl.int32, bitcast=True)
        ordered = b ^ ((b >> 31) & 0x7FFFFFFF)  # int32 order == float order (negatives' magnitude flipped)
        keys = tl.where(e < E, (ordered.to(tl.int64) << 32) | ((E - 1 - e).to(tl.int64) << PRE_SLOT_BITS)
                        | low.to(tl.int64), -0x7FFFFFFFFFFFFFFF - 1)  # int64 min: never selected
        if BLOCK_K == 1:  # tl.topk needs k >= 2
            top = tl.full([BLOCK_K], tl.max(keys, axis=0), dtype=tl.int64)
        else:
            top = tl.topk(keys, BLOCK_K)  # descending
        ids = E - 1 - ((top >> PRE_SLOT_BITS) & 0xFFF).to(tl.int32)
        hi = (top >> 32).to(tl.int32)
        chosen = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        top_logit = tl.max(tl.where(kk < K, chosen, float("-inf")), axis=0)  # the largest of all E
        ex = tl.where(kk < K, tl.exp(chosen - top_logit), 0.0)
        if NORM:
            ws = ex / tl.sum(ex, axis=0)
        else:  # the same exponentials and sum as the full softmax below: the same bits
            ws = ex / tl.sum(tl.exp(logit - top_logit), axis=0)
    else:
        p = tl.exp(logit - tl.max(logit, axis=0))  # 0 past E
    if SELECT == 0:
        probs = tl.where(e < E, p / tl.sum(p, axis=0), -1.0)  # -1: never selected
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        ws = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(K):
            best, idx = tl.max(probs, axis=0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(kk == j, idx, ids)
            ws = tl.where(kk == j, best, ws)
            probs = tl.where(e == idx, -1.0, probs)
    elif SELECT != 3:
        probs = p / tl.sum(p, axis=0)  # >= 0: its bits order like its value
        bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
        keys = tl.where(e < E, (bits << 32) | ((E - 1 - e).to(tl.int64) << PRE_SLOT_BITS) | low.to(tl.int64),
                        -1)  # -1: never selected
        if SELECT == 1 or BLOCK_K == 1:  # tl.topk needs k >= 2
            top = tl.full([BLOCK_K], -1, dtype=tl.int64)
            for j in tl.static_range(K):
                best = tl.max(keys, axis=0)
                top = tl.where(kk == j, best, top)
                keys = tl.where(keys == best, -1, keys)
        else:
            top = tl.topk(keys, BLOCK_K)  # descending
        ids = E - 1 - ((top >> PRE_SLOT_BITS) & 0xFFF).to(tl.int32)  # bits PRE_SLOT_BITS .. 31
        ws = tl.where(kk < K, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    if NORM and SELECT != 3:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(ids_ptr + kk, ids, mask=kk < K)
    tl.store(weights_ptr + kk, ws, mask=kk < K)
    if PRE:
        if SELECT == 0:  # the slots after the selection: one more dependent load
            pre = tl.load(slot_row_ptr + ids, mask=kk < K, other=-1)
        else:
            pre = (top & PRE_SLOT_MASK).to(tl.int32) - 1
        tl.store(pre_ptr + kk, pre, mask=kk < K)


@triton.jit
def _router_tile(w_ptr, rows, h0, E: tl.constexpr, H: tl.constexpr, CHUNK_H: tl.constexpr, EVEN: tl.constexpr):
    """router_w[rows, h0:h0 + CHUNK_H] (zeros outside [E, H] unless EVEN)."""
    cols = h0 + tl.arange(0, CHUNK_H)
    if EVEN:
        return tl.load(w_ptr + rows[:, None] * H + cols[None, :])
    return tl.load(w_ptr + rows[:, None] * H + cols[None, :], mask=(rows[:, None] < E) & (cols[None, :] < H),
                   other=0.0)


@triton.jit(**_JIT_OPTIONS)
def _router_kernel(
    x_ptr,  # [T, H] hidden (model dtype), row-major
    w_ptr,  # [E, H] router weight (model dtype), row-major
    logits_ptr,  # *fp32 [T, E] scratch
    arrive_ptr,  # *i32 [T] arrival counters: 0 before and after every call
    ids_ptr,  # *i32 [T, K] out: expert ids, by weight descending
    weights_ptr,  # *fp32 [T, K] out: routing weights
    slot_of_ptr,  # *i32 [L * E] the slot map (read if PRE)
    key_base,  # this layer's first key, layer * E (read if PRE)
    pre_ptr,  # *i32 [T, K] out if PRE: slot_of[key_base + ids] as this launch found it (-1: absent)
    E: tl.constexpr,  # experts
    H: tl.constexpr,  # hidden
    K: tl.constexpr,  # top_k
    BLOCK_E: tl.constexpr,  # experts per program
    CHUNK_H: tl.constexpr,  # hidden columns per load step
    BLOCK_ALL: tl.constexpr,  # next power of two >= E
    BLOCK_K: tl.constexpr,  # next power of two >= K
    NORM: tl.constexpr,  # renormalise the top-k weights to sum to 1
    EVEN: tl.constexpr,  # E % BLOCK_E == 0 and H % CHUNK_H == 0: no masks
    SELECT: tl.constexpr,  # index of RouterConfig.select in SELECTS
    GDC: tl.constexpr = False,  # launched programmatically: wait for the predecessor, then free the next
    PRE: tl.constexpr = False,  # also write pre (the slots of the chosen experts before their ensure)
    EARLY_W: tl.constexpr = False,  # RouterConfig.early_weights: router_w loaded before the wait
):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E] experts
    early = ()
    if EARLY_W:  # router_w is no predecessor's output: its rows before the wait, the same tiles as below
        for h0 in tl.static_range(0, H, CHUNK_H):
            early = early + (_router_tile(w_ptr, rows, h0, E, H, CHUNK_H, EVEN),)
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_E, CHUNK_H], dtype=tl.float32)
    for h0 in tl.static_range(0, H, CHUNK_H):
        cols = h0 + tl.arange(0, CHUNK_H)
        if EVEN:
            x = tl.load(x_ptr + token * H + cols)
        else:
            x = tl.load(x_ptr + token * H + cols, mask=cols < H, other=0.0)
        if EARLY_W:
            w = early[h0 // CHUNK_H]
        else:
            w = _router_tile(w_ptr, rows, h0, E, H, CHUNK_H, EVEN)  # [BLOCK_E, CHUNK_H]
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(logits_ptr + token * E + rows, tl.sum(acc, axis=1), mask=rows < E)
    tl.debug_barrier()  # every thread's logits stored before the arrival
    arrived = tl.atomic_add(arrive_ptr + token, 1)  # acq_rel, gpu scope
    if arrived == tl.num_programs(1) - 1:
        tl.debug_barrier()
        tl.store(arrive_ptr + token, 0)
        _select_topk(logits_ptr + token * E, ids_ptr + token * K, weights_ptr + token * K,
                     slot_of_ptr + key_base, pre_ptr + token * K, E, K, BLOCK_ALL, BLOCK_K, NORM, SELECT, PRE)


SMALL_T, SMALL_T_BLOCK_E, BLOCK_E = 4, 2, 4  # RouterConfig.block_e=None: per program, by the token count


def block_e_for(config: RouterConfig, tokens: int) -> int:
    """Experts per program of a call of `tokens` tokens under `config`."""
    if config.block_e is not None:
        return config.block_e
    return SMALL_T_BLOCK_E if tokens <= SMALL_T else BLOCK_E


def _constexprs(num_experts: int, hidden: int, top_k: int, norm: bool, config: RouterConfig,
                tokens: int) -> dict:
    block_e = min(block_e_for(config, tokens), triton.next_power_of_2(num_experts))
    chunk_h = min(config.chunk_h, triton.next_power_of_2(hidden))
    fits = early_weights_held(block_e, hidden, chunk_h) <= EARLY_WEIGHTS_MAX_ELEMENTS
    return {"E": num_experts, "H": hidden, "K": top_k, "BLOCK_E": block_e, "CHUNK_H": chunk_h,
            "BLOCK_ALL": triton.next_power_of_2(num_experts), "BLOCK_K": triton.next_power_of_2(top_k),
            "NORM": bool(norm), "EVEN": num_experts % block_e == 0 and hidden % chunk_h == 0,
            "SELECT": SELECTS.index(config.select),
            "EARLY_W": fits if config.early_weights is None else config.early_weights}


def early_weights_held(block_e: int, hidden: int, chunk_h: int) -> int:
    """router_w elements one program holds with RouterConfig.early_weights (H rounded up to chunk_h)."""
    return block_e * triton.cdiv(hidden, chunk_h) * chunk_h


_SCRATCH: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def router_scratch(device: torch.device | str, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits float32 [GEMV_MAX_TOKENS, E], counters int32 [GEMV_MAX_TOKENS] zeros) on `device`.

    One pair per (device, E), made on first use and kept: call this (or router_topk) once before
    CUDA-graph capture so the captured call allocates nothing. Calls that share it must be ordered
    (one stream, or joined by events). Cost: one allocation and one zero fill on first use.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, num_experts)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty((GEMV_MAX_TOKENS, num_experts), dtype=torch.float32, device=device),
                         torch.zeros(GEMV_MAX_TOKENS, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def _check(name: str, t, dtypes, shape: tuple[int, ...] | None, device) -> None:
    """Raise ValueError naming `name` unless t is a contiguous tensor of `dtypes` and `shape` on `device`."""
    ok = isinstance(t, torch.Tensor) and t.dtype in dtypes and (shape is None or tuple(t.shape) == shape)
    if not ok or (device is not None and t.device != device) or not t.is_contiguous():
        got = f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"router_topk: {name} must be a contiguous {'/'.join(str(d) for d in dtypes)} "
                         f"tensor{'' if shape is None else f' of shape {list(shape)}'}"
                         f"{'' if device is None else f' on {device}'}, got {got}")


def _check_args(hidden, router_w, top_k, weights, ids) -> tuple[int, int, int]:
    """Validate on the host; return (T, E, H)."""
    _check("hidden", hidden, DTYPES, None, None)
    if hidden.dim() != 2 or not 1 <= hidden.shape[0] <= GEMV_MAX_TOKENS:
        raise ValueError(f"router_topk: hidden must be [T, H] with T in 1..{GEMV_MAX_TOKENS} "
                         f"(moe.kernels.plan.GEMV_MAX_TOKENS), got {list(hidden.shape)}")
    tokens, hid = hidden.shape
    if not isinstance(router_w, torch.Tensor) or router_w.dim() != 2:
        raise ValueError(f"router_topk: router_w must be [E, {hid}], got {getattr(router_w, 'shape', router_w)}")
    num_experts = router_w.shape[0]
    _check("router_w", router_w, (hidden.dtype,), (num_experts, hid), hidden.device)
    if not 1 <= num_experts <= ROUTER_MAX_EXPERTS:
        raise ValueError(f"router_topk: router_w has {num_experts} experts; 1..{ROUTER_MAX_EXPERTS} "
                         "(moe.kernels.router.ROUTER_MAX_EXPERTS) are served")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"router_topk: top_k={top_k!r} must be an int in [1, E={num_experts}]")
    if weights is not None:
        _check("weights", weights, (torch.float32,), (tokens, top_k), hidden.device)
    if ids is not None:
        _check("ids", ids, (torch.int32,), (tokens, top_k), hidden.device)
    return tokens, num_experts, hid


def _check_pre(pre, tokens: int, top_k: int, num_experts: int, device) -> None:
    """Raise ValueError naming `pre` unless it is (slot_of int32 [L * E], key_base, out int32 [T, k])."""
    ok = isinstance(pre, tuple) and len(pre) == 3
    if ok:
        slot_of, key_base, out = pre
        ok = (isinstance(key_base, int) and not isinstance(key_base, bool) and isinstance(slot_of, torch.Tensor)
              and slot_of.dim() == 1 and 0 <= key_base and key_base + num_experts <= slot_of.numel()
              and key_base % num_experts == 0)
    if not ok:
        raise ValueError("router_topk: pre must be (slot_of int32 [L * E], key_base = layer * E, "
                         f"out int32 [{tokens}, {top_k}])")
    _check("pre slot_of", slot_of, (torch.int32,), None, device)
    _check("pre out", out, (torch.int32,), (tokens, top_k), device)


def router_topk(hidden: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool, *,
                weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                config: RouterConfig | None = None, pdl: bool = False,
                pre: tuple[torch.Tensor, int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: hidden [T, H], router_w [E, H] -> (weights [T, k] float32, ids [T, k] int32).

    hidden and router_w share one dtype (bf16 / f16 / f32), contiguous; 1 <= T <= GEMV_MAX_TOKENS,
    E <= ROUTER_MAX_EXPERTS. Logits accumulate in float32; softmax in float32 over all E; top-k by
    weight descending, ties to the lower expert id; renormalised to sum 1 when norm_topk_prob.
    weights / ids: optional outputs to write into (for CUDA graphs). One launch on the current stream,
    no host sync; with the outputs given and router_scratch made it allocates nothing (capturable).
    Cost: reads E * H weight elements once per token (repeat tokens meet in L2), O(k * E) to select.
    pdl: on CUDA, a programmatic dependent launch (waits for its predecessor before reading; same
    results; MoEConfig.pdl_chain).
    pre: (slot_of int32 [L * E], key_base = layer * E, out int32 [T, k]): the selecting program also
    writes out[t, j] = slot_of[key_base + ids[t, j]] as it finds it (-1: not resident), the slots
    before this layer's ensure (MoELayer's early hits). Same ids and weights as without. With the
    packed selections ("topk", "packed") it reads this layer's E slots beside the logits and carries
    each in its key's low 20 bits, so no load follows the selection: slot_of's entries must be -1 or
    below 2**20 - 1 (expertcache.device_ensure.MAX_SLOTS - 1, as DeviceCache's are).
    Raises ValueError naming the argument whose shape, dtype, device or value is wrong;
    RuntimeError for CPU tensors without Triton's interpreter.
    """
    config = DEFAULT_ROUTER if config is None else config
    if not isinstance(config, RouterConfig):
        raise ValueError(f"router_topk: config must be a RouterConfig, "  # noqa: TRY004 (house: ValueError)
                         f"got {type(config).__name__}")
    tokens, num_experts, hid = _check_args(hidden, router_w, top_k, weights, ids)
    device = hidden.device
    if pre is not None:
        _check_pre(pre, tokens, top_k, num_experts, device)
    meta = _constexprs(num_experts, hid, top_k, norm_topk_prob, config, tokens)
    held = early_weights_held(meta["BLOCK_E"], hid, meta["CHUNK_H"])
    if config.early_weights and held > EARLY_WEIGHTS_MAX_ELEMENTS:
        raise ValueError(f"router_topk: RouterConfig.early_weights would hold {held} router_w elements per "
                         f"program (block_e * H), more than {EARLY_WEIGHTS_MAX_ELEMENTS}; set early_weights=False "
                         "or block_e=1")
    if weights is None:
        weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    if ids is None:
        ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    logits, arrive = router_scratch(device, num_experts)
    grid = (tokens, triton.cdiv(num_experts, meta["BLOCK_E"]))
    kernel = kernel_for(_router_kernel, device, _JIT_OPTIONS, "router_topk")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        gdc = bool(pdl) and device.type == "cuda"
        slot_of, key_base, pre_out = (ids, 0, ids) if pre is None else pre
        kernel[grid](hidden, router_w, logits, arrive, ids, weights, slot_of, key_base, pre_out, **meta,
                     num_warps=config.warps, PRE=pre is not None,
                     **({"GDC": True, "launch_pdl": True} if gdc else {}))
    return weights, ids


def router_reference(hidden: torch.Tensor, router_w: torch.Tensor, top_k: int,
                     norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk's math in torch: (weights [T, k] float32, ids [T, k] int32), weights upcast,
    float32 logits and softmax, a stable descending sort (ties: lower id), renormalised when asked."""
    probs = torch.softmax(hidden.float() @ router_w.float().T, dim=-1)  # [T, E]
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights = values[:, :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order[:, :top_k].to(torch.int32)


def compile_router_for_target(num_experts: int, hidden: int, top_k: int, dtype: str = "bf16",
                              norm_topk_prob: bool = True, config: RouterConfig = DEFAULT_ROUTER,
                              arch: int = 90, tokens: int = 1, pdl: bool = False, pre: bool = False) -> dict:
    """Compile the router ahead of time for CUDA sm_<arch> (no GPU; needs ptxas); Triton's asm dict.

    T sizes the grid and, with block_e=None, picks the experts per program (block_e_for): one binary
    serves T = 1..SMALL_T, another the rest. pdl: the programmatic-launch variant (router_topk's
    pdl). pre: the variant that also writes pre (router_topk's pre). Run it without TRITON_INTERPRET=1.
    """
    p = f"*{dtype}"
    types = (p, p, "*fp32", "*i32", "*i32", "*fp32", "*i32", "i32", "*i32")
    meta = _constexprs(num_experts, hidden, top_k, norm_topk_prob, config, tokens)
    if pdl:
        meta["GDC"] = True
    if pre:
        meta["PRE"] = True
    return compile_for_sm(_router_kernel, types, meta, config.warps, arch, _JIT_OPTIONS)
