"""The MoE router of a decode step as one Triton launch: logits, softmax, top-k, renormalisation.

    hidden [T, H], router_w [E, H] (both the model dtype)
        │  grid (T, ceil(E / block_e)): program (t, b); block_e by the token count (RouterTiles)
        ├─ every program: logits[t, b * block_e + i] = Σ_h hidden[t, h] * router_w[e, h]   (f32 accumulate)
        │     (+ router_b[e] in float32: gpt-oss's router bias)
        │     -> scratch logits [T, E] float32; then one atomic arrival on counter[t]
        └─ the last program of token t to arrive (it resets counter[t] to 0):
              one bitonic top-k over the logits' order-preserving keys (ties: the lower expert id)
              weights = softmax over the chosen k logits (norm) or their full-softmax values (no norm)
              (weights [t, k] float32 descending, ids [t, k] int32)
              (GLM-4.5, SIGMOID: the keys order sigmoid(logit) + score_bias within the best groups;
               weights = the chosen sigmoids, renormalised; ids in the keys' order; x SCALE)
              (pre: also the chosen experts' slots before the ensure, carried in the keys' low bits)
    -> weights [T, k] float32, ids [T, k] int32 (the order of moe.model.reference.route)

Legend: T = tokens (1..GEMV_MAX_TOKENS), H = hidden, E = experts (<= ROUTER_MAX_EXPERTS), k = top_k.

Why one launch with an arrival counter (as expertcache.device.ensure) rather than two launches
(logits, then one program per token for softmax + top-k): at decode size the router reads its
E * H weights once and is bound by latency, not bytes, while each extra kernel in a CUDA graph adds
a launch gap; the logits GEMV must be spread over ~E / block_e programs to reach bandwidth, and the
arrival counter lets the last of them do the tiny O(k * E) selection without a second launch. The
result stays deterministic: every logit is made by one program in a fixed order, and one program
reads them all. The counters are zero between calls (the last program resets its token's), so the
launch is CUDA-graph capturable and replayable. The weights stay in the model dtype: no float32 copy
of router_w is kept anywhere.

Why the top-k of the logits: softmax is monotonic, so the k largest logits are the k largest
probabilities; with norm_topk_prob the weights are the softmax of the k chosen logits, so the
selecting program needs no pass over all E for their maximum and their exponentials' sum (within
float32 rounding of the full softmax renormalised); without it one sum over E, the full softmax's
bits. Exactly equal logits tie to the lower id, except +0.0 against -0.0 (the positive zero first).

`router_reference` is the same math in torch (weights upcast, float32, a stable sort so ties go to
the lower id) for the tests.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe.kernels.plan import DEFAULT_ROUTER_TILES, GEMV_MAX_TOKENS
from moe.kernels.tiles import EARLY_WEIGHTS_MAX_ELEMENTS, RouterTiles
from moe.kernels.triton_launch import compile_for_sm, kernel_for

ROUTER_MAX_EXPERTS = 4096  # the selecting program holds all E logits in registers (ids: 12 bits)
PRE_SLOT_BITS: tl.constexpr = tl.constexpr(20)  # a key's low bits: slot + 1 (expertcache: slots < 2**20 - 1)
PRE_SLOT_MASK: tl.constexpr = tl.constexpr((1 << 20) - 1)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_TILES = DEFAULT_ROUTER_TILES
_JIT_OPTIONS: dict = {"do_not_specialize": ["key_base"]}


@triton.jit
def _select_topk(row_ptr, ids_ptr, weights_ptr, slot_row_ptr, pre_ptr, score_bias_ptr, E: tl.constexpr,
                 K: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 PRE: tl.constexpr, SIGMOID: tl.constexpr, SCORE_BIAS: tl.constexpr, GROUPS: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, SCALE: tl.constexpr, BLOCK_G: tl.constexpr):
    """The top K of the E logits at row_ptr (ties: lower id) into ids / weights, by one tl.topk over
    int64 keys: an order-preserving int32 of each logit's bits << 32 | (E - 1 - id) << PRE_SLOT_BITS
    | (slot + 1 with PRE, else 0). NORM: weights = softmax of the chosen K logits; else the full
    softmax's values (one sum over E).
    SIGMOID (GLM-4.5): the keys order sigmoid(logit) (+ score_bias[e] with SCORE_BIAS) instead, -inf
    outside the TOPK_GROUP of GROUPS equal groups whose two best such values sum highest (ties: the
    lower group); the weights are the chosen experts' sigmoid(logit), over their sum + 1e-20 with NORM.
    Either way the weights are multiplied by SCALE (routed_scaling_factor; 1.0: no multiply).
    PRE: also pre[j] = slot_row[ids[j]]; the E slots are loaded beside the logits and ride in the
    keys' low bits (below the id, so they never change the order): no load after the selection."""
    e = tl.arange(0, BLOCK_ALL)
    logit = tl.load(row_ptr + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")  # other programs' writes
    if PRE:  # slot + 1 in PRE_SLOT_BITS bits (0: absent); slot_of's slots are < 2**20 - 1
        low = tl.load(slot_row_ptr + e, mask=e < E, other=-1) + 1
    else:
        low = tl.zeros([BLOCK_ALL], dtype=tl.int32)
    kk = tl.arange(0, BLOCK_K)
    value = logit
    if SIGMOID:
        value = tl.sigmoid(logit)
        if SCORE_BIAS:
            value += tl.load(score_bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        value = tl.where(e < E, value, float("-inf"))
        if GROUPS > 1:
            value = _keep_best_groups(value, e, E, GROUPS, TOPK_GROUP, BLOCK_G)
    b = value.to(tl.int32, bitcast=True)
    ordered = b ^ ((b >> 31) & 0x7FFFFFFF)  # int32 order == float order (negatives' magnitude flipped)
    keys = tl.where(e < E, (ordered.to(tl.int64) << 32) | ((E - 1 - e).to(tl.int64) << PRE_SLOT_BITS)
                    | low.to(tl.int64), -0x7FFFFFFFFFFFFFFF - 1)  # int64 min: never selected
    if BLOCK_K == 1:  # tl.topk needs k >= 2
        top = tl.full([BLOCK_K], tl.max(keys, axis=0), dtype=tl.int64)
    else:
        top = tl.topk(keys, BLOCK_K)  # descending
    ids = E - 1 - ((top >> PRE_SLOT_BITS) & 0xFFF).to(tl.int32)
    if SIGMOID:  # the weights are the chosen experts' own scores, without the bias
        chosen = tl.load(row_ptr + ids, mask=kk < K, other=0.0, cache_modifier=".cg")
        ex = tl.where(kk < K, tl.sigmoid(chosen), 0.0)
        if NORM:
            ws = ex / (tl.sum(ex, axis=0) + 1e-20)
        else:
            ws = ex
    else:
        hi = (top >> 32).to(tl.int32)
        chosen = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        top_logit = tl.max(tl.where(kk < K, chosen, float("-inf")), axis=0)  # the largest of all E
        ex = tl.where(kk < K, tl.exp(chosen - top_logit), 0.0)
        if NORM:
            ws = ex / tl.sum(ex, axis=0)
        else:  # the full softmax's exponentials and sum
            ws = ex / tl.sum(tl.exp(logit - top_logit), axis=0)
    if SCALE != 1.0:
        ws = ws * SCALE
    tl.store(ids_ptr + kk, ids, mask=kk < K)
    tl.store(weights_ptr + kk, ws, mask=kk < K)
    if PRE:
        pre = (top & PRE_SLOT_MASK).to(tl.int32) - 1
        tl.store(pre_ptr + kk, pre, mask=kk < K)


@triton.jit
def _keep_best_groups(value, e, E: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      BLOCK_G: tl.constexpr):
    """value [BLOCK_ALL] with -inf outside the TOPK_GROUP best of GROUPS groups of E // GROUPS experts
    (a group's worth: its two largest values summed; ties: the lower group), as transformers' GLM-4.5
    router masks them. Unrolled over the groups: a few max reductions each."""
    SIZE: tl.constexpr = E // GROUPS
    group = e // SIZE
    g = tl.arange(0, BLOCK_G)
    worth = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(GROUPS):
        mine = tl.where(group == j, value, float("-inf"))
        best = tl.max(mine, axis=0)
        first = tl.min(tl.where(mine == best, e, E), axis=0)  # the best's lowest index
        second = tl.max(tl.where(e == first, float("-inf"), mine), axis=0)
        worth = tl.where(g == j, best + second, worth)
    keep = g < 0  # [BLOCK_G] all False
    for _ in tl.static_range(TOPK_GROUP):  # the best group not kept yet, lowest index on ties
        left = tl.where(keep | (g >= GROUPS), float("-inf"), worth)
        top = tl.max(left, axis=0)
        pick = tl.min(tl.where((left == top) & ~keep & (g < GROUPS), g, BLOCK_G), axis=0)
        keep = keep | (g == pick)
    kept = tl.sum(tl.where(keep[None, :] & (group[:, None] == g[None, :]), 1, 0), axis=1) > 0  # [BLOCK_ALL]
    return tl.where(kept & (e < E), value, float("-inf"))


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
    bias_ptr,  # [E] router bias (model dtype; read if BIAS)
    score_bias_ptr,  # *fp32 [E] GLM-4.5's e_score_correction_bias (read if SCORE_BIAS)
    E: tl.constexpr,  # experts
    H: tl.constexpr,  # hidden
    K: tl.constexpr,  # top_k
    BLOCK_E: tl.constexpr,  # experts per program
    CHUNK_H: tl.constexpr,  # hidden columns per load step
    BLOCK_ALL: tl.constexpr,  # next power of two >= E
    BLOCK_K: tl.constexpr,  # next power of two >= K
    NORM: tl.constexpr,  # renormalise the top-k weights to sum to 1
    EVEN: tl.constexpr,  # E % BLOCK_E == 0 and H % CHUNK_H == 0: no masks
    GDC: tl.constexpr = False,  # launched programmatically: wait for the predecessor, then free the next
    PRE: tl.constexpr = False,  # also write pre (the slots of the chosen experts before their ensure)
    EARLY_W: tl.constexpr = False,  # router_w's rows loaded before the wait (router_topk's early_weights)
    BIAS: tl.constexpr = False,  # add bias[e] to each logit (gpt-oss's router)
    SIGMOID: tl.constexpr = False,  # GLM-4.5's scores: sigmoid(logit) (_select_topk)
    SCORE_BIAS: tl.constexpr = False,  # + score_bias[e] for the choice only
    GROUPS: tl.constexpr = 1,  # n_group
    TOPK_GROUP: tl.constexpr = 1,  # topk_group
    SCALE: tl.constexpr = 1.0,  # routed_scaling_factor
    BLOCK_G: tl.constexpr = 1,  # next power of two >= GROUPS
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
    logit = tl.sum(acc, axis=1)
    if BIAS:
        logit += tl.load(bias_ptr + rows, mask=rows < E, other=0.0).to(tl.float32)
    tl.store(logits_ptr + token * E + rows, logit, mask=rows < E)
    tl.debug_barrier()  # every thread's logits stored before the arrival
    arrived = tl.atomic_add(arrive_ptr + token, 1)  # acq_rel, gpu scope
    if arrived == tl.num_programs(1) - 1:
        tl.debug_barrier()
        tl.store(arrive_ptr + token, 0)
        _select_topk(logits_ptr + token * E, ids_ptr + token * K, weights_ptr + token * K,
                     slot_of_ptr + key_base, pre_ptr + token * K, score_bias_ptr, E, K, BLOCK_ALL, BLOCK_K, NORM, PRE,
                     SIGMOID, SCORE_BIAS, GROUPS, TOPK_GROUP, SCALE, BLOCK_G)


def _constexprs(num_experts: int, hidden: int, top_k: int, norm: bool, tiles: RouterTiles, tokens: int,
                early_weights: bool) -> dict:
    block_e, chunk_h = tiles.block_e_for(tokens, num_experts), tiles.chunk_for(hidden)
    return {"E": num_experts, "H": hidden, "K": top_k, "BLOCK_E": block_e, "CHUNK_H": chunk_h,
            "BLOCK_ALL": triton.next_power_of_2(num_experts), "BLOCK_K": triton.next_power_of_2(top_k),
            "NORM": bool(norm), "EVEN": num_experts % block_e == 0 and hidden % chunk_h == 0,
            "EARLY_W": early_weights}


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
                tiles: RouterTiles = DEFAULT_TILES, pdl: bool = False, early_weights: bool = False,
                pre: tuple[torch.Tensor, int, torch.Tensor] | None = None,
                router_b: torch.Tensor | None = None, scoring: str = "softmax",
                score_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: hidden [T, H], router_w [E, H] -> (weights [T, k] float32, ids [T, k] int32).

    hidden and router_w share one dtype (bf16 / f16 / f32), contiguous; 1 <= T <= GEMV_MAX_TOKENS,
    E <= ROUTER_MAX_EXPERTS. Logits accumulate in float32; top-k by weight descending, ties to the
    lower expert id; softmax in float32 (over the chosen k when norm_topk_prob, which renormalises
    them to sum 1; over all E otherwise).
    weights / ids: optional outputs to write into (for CUDA graphs). One launch on the current stream,
    no host sync; with the outputs given and router_scratch made it allocates nothing (capturable).
    Cost: reads E * H weight elements once per token (repeat tokens meet in L2), O(k * E) to select.
    tiles: RouterTiles. pdl: on CUDA, a programmatic dependent launch (waits for its predecessor
    before reading; same results). early_weights: each program loads its router_w rows before that
    wait, held in registers, so their round trips overlap the predecessor's tail (the same sums in
    the same order: the same bits); the rows must fit (RouterTiles.early_weights_fit).
    pre: (slot_of int32 [L * E], key_base = layer * E, out int32 [T, k]): the selecting program also
    writes out[t, j] = slot_of[key_base + ids[t, j]] as it finds it (-1: not resident), the slots
    before this layer's ensure (MoELayer's early hits). Same ids and weights as without. It reads
    this layer's E slots beside the logits and carries each in its key's low 20 bits, so no load
    follows the selection: slot_of's entries must be -1 or below 2**20 - 1
    (expertcache.device.ensure.MAX_SLOTS - 1, as DeviceCache's are).
    router_b: [E] in router_w's dtype, added to every logit in float32 before the selection (gpt-oss's
    router: top-k of the biased logits, softmax over them with norm_topk_prob).
    Raises ValueError naming the argument whose shape, dtype, device or value is wrong (early_weights
    whose rows do not fit included); RuntimeError for CPU tensors without Triton's interpreter.
    """
    if not isinstance(tiles, RouterTiles):
        raise ValueError(f"router_topk: tiles must be a RouterTiles, "
                         f"got {type(tiles).__name__}")
    if not isinstance(early_weights, bool):
        raise ValueError(f"router_topk: early_weights must be a bool, got {early_weights!r}")
    tokens, num_experts, hid = _check_args(hidden, router_w, top_k, weights, ids)
    device = hidden.device
    if pre is not None:
        _check_pre(pre, tokens, top_k, num_experts, device)
    if router_b is not None:
        _check("router_b", router_b, (router_w.dtype,), (num_experts,), device)
    _check_selection(scoring, score_bias, n_group, topk_group, scaling, num_experts, top_k, device)
    if early_weights and not tiles.early_weights_fit(num_experts, hid, tokens):
        raise ValueError(f"router_topk: early_weights would hold {tiles.early_weights_held(num_experts, hid, tokens)} "
                         f"router_w elements per program (block_e * H), more than {EARLY_WEIGHTS_MAX_ELEMENTS}; "
                         "pass early_weights=False or smaller RouterTiles.block_e_small / block_e")
    meta = _constexprs(num_experts, hid, top_k, norm_topk_prob, tiles, tokens, early_weights)
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
        kernel[grid](hidden, router_w, logits, arrive, ids, weights, slot_of, key_base, pre_out,
                     router_w if router_b is None else router_b, logits if score_bias is None else score_bias, **meta,
                     num_warps=tiles.warps, PRE=pre is not None, **({"BIAS": True} if router_b is not None else {}),
                     **_selection(scoring, score_bias is not None, n_group, topk_group, scaling),
                     **({"GDC": True, "launch_pdl": True} if gdc else {}))
    return weights, ids


def _check_selection(scoring, score_bias, n_group, topk_group, scaling, num_experts: int, top_k: int, device) -> None:
    """Raise ValueError naming scoring / score_bias / n_group / topk_group / scaling unless they are a
    selection the kernel makes (grouping and the score bias only with "sigmoid" scoring)."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"router_topk: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if score_bias is not None:
        if scoring != "sigmoid":
            raise ValueError("router_topk: score_bias is the sigmoid router's (scoring='sigmoid')")
        _check("score_bias", score_bias, (torch.float32,), (num_experts,), device)
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"router_topk: {name} must be an int >= 1, got {value!r}")
    if n_group > 1 and (scoring != "sigmoid" or num_experts % n_group or num_experts // n_group < 2
                        or topk_group > n_group or top_k > topk_group * (num_experts // n_group)):
        raise ValueError(f"router_topk: n_group={n_group}, topk_group={topk_group} must group the {num_experts} "
                         f"experts evenly in groups of >= 2 (scoring='sigmoid'), keep topk_group <= n_group and "
                         f"leave >= top_k={top_k} experts")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < float("inf"):
        raise ValueError(f"router_topk: scaling must be a finite number > 0, got {scaling!r}")


def _selection(scoring: str, score_bias: bool, n_group: int, topk_group: int, scaling: float) -> dict:
    """The kernel's selection constexprs ({} for the softmax router without scaling: its own binaries)."""
    out: dict = {}
    if scoring == "sigmoid":
        out.update(SIGMOID=True, SCORE_BIAS=score_bias, GROUPS=n_group, TOPK_GROUP=topk_group,
                   BLOCK_G=triton.next_power_of_2(n_group))
    if scaling != 1.0:
        out["SCALE"] = float(scaling)
    return out


def router_reference(
    hidden: torch.Tensor,
    router_w: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    router_b: torch.Tensor | None = None,
    **selection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk's math in torch: (weights [T, k] float32, ids [T, k] int32), weights upcast,
    float32 logits (+ router_b) and softmax, a stable descending sort (ties: lower id), renormalised
    when asked. `selection` (scoring="sigmoid", score_bias, n_group, topk_group, scaling): that router,
    moe.model.reference.route's."""
    if selection:
        from moe.model.reference import route

        return route(hidden, router_w, top_k, norm_topk_prob, router_b, **selection)
    logits = hidden.float() @ router_w.float().T  # [T, E]
    if router_b is not None:
        logits = logits + router_b.float()
    probs = torch.softmax(logits, dim=-1)
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights = values[:, :top_k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order[:, :top_k].to(torch.int32)


def compile_router_for_target(num_experts: int, hidden: int, top_k: int, dtype: str = "bf16",
                              norm_topk_prob: bool = True, tiles: RouterTiles = DEFAULT_TILES,
                              arch: int = 90, tokens: int = 1, pdl: bool = False, pre: bool = False,
                              early_weights: bool = False, bias: bool = False, selection: dict | None = None) -> dict:
    """Compile the router ahead of time for CUDA sm_<arch> (no GPU; needs ptxas); Triton's asm dict.

    T sizes the grid and picks the experts per program (RouterTiles.block_e_for): one binary serves
    T = 1..SMALL_T, another the rest. pdl, pre, early_weights, bias (router_b): those variants
    (router_topk's arguments). Run it without TRITON_INTERPRET=1.
    """
    p = f"*{dtype}"
    types = (p, p, "*fp32", "*i32", "*i32", "*fp32", "*i32", "i32", "*i32", p, "*fp32")
    meta = _constexprs(num_experts, hidden, top_k, norm_topk_prob, tiles, tokens, early_weights)
    if bias:
        meta["BIAS"] = True
    if selection:  # router_topk's scoring / score_bias (a bool here) / n_group / topk_group / scaling
        meta.update(_selection(selection.get("scoring", "softmax"), bool(selection.get("score_bias")),
                               selection.get("n_group", 1), selection.get("topk_group", 1),
                               selection.get("scaling", 1.0)))
    if pdl:
        meta["GDC"] = True
    if pre:
        meta["PRE"] = True
    return compile_for_sm(_router_kernel, types, meta, tiles.warps, arch, _JIT_OPTIONS)
