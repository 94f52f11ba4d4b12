"""`markov`'s learning step on the device: steps 1-4 of expertcache.policies.markov for one ensure call,
in two Triton launches over the DeviceCache's own state tensors, bit for bit the host's `Markov.observe`.

    ids [R] (the call's routed expert ids of `layer`, any order, duplicates and -1 padding allowed)
      -> routed[e] (the call's distinct experts, n of them), then, with the state's fields
         (kst [fields, L * E] int32, gst [L] int64, as expertcache.policies.markov lays them out; the
         arithmetic is in int64, as the host's):
         1. for each lag j, each row a with HIST bit j: T_j[a, b] += 16 for routed b, R_j[a] += 16 n;
            a row past the cap is halved and recounted
         2. FREQ[b] += 16 for routed b, the layer's total += 16 n, halved past the cap
         3. HIST = (HIST << 1 | routed) masked to the lags' bits
         4. V of every expert of the layer that has a slot or is routed now (0 for the others):
            the Q16 transition shares at each lag smoothed towards the frequency share, + RECENCY_Q
            for the experts routed now

Two launches, graph capturable, needing no host value but `layer`, a launch argument:
  rows     (ROW_PROGRAMS programs a lag) step 1, one transition row per program (the rows are
           independent; each program finds its row as the i-th bit HIST marks, by a prefix sum); its
           first program also lists the call's distinct experts in a scratch vector and takes step 2
           (the frequencies, which no other program of the launch reads)
  predict  (E / PREDICT_CHUNK programs, a chunk of the layer's experts each) steps 3-4, the routed
           experts' rows read PREDICT_ROWS at a time from that list as one 2-D tile
so a call reads some 2 J k rows of E counts, in parallel. The divisions are int64 floor divisions, which the host's
float division by a reciprocal (markov._div_r, markov._qdiv) reproduces exactly. DeviceCache.ensure launches both
before the ensure kernel, which then scores markov's keys from V (expertcache.device.policies._keyed_scores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertcache.policies import markov

# the state's layout and fixed-point constants, as constexprs the compiled kernel may read
FLOOR_Q4, FREQ, HIST = tl.constexpr(markov.FLOOR_Q4), tl.constexpr(markov.FREQ), tl.constexpr(markov.HIST)
ONE_SHIFT, Q4, T, V = (tl.constexpr(markov.ONE_SHIFT), tl.constexpr(markov.Q4), tl.constexpr(markov.T),
                       tl.constexpr(markov.V))
MAX_LAGS = markov.MAX_LAGS
# Every scalar argument: Triton would otherwise compile a kernel per value of 1 (and make it a constant,
# on which `.to` fails) and per alignment of the others.
ROWS_JIT = {"do_not_specialize": ["layer", "num_ids", "row_stride", "num_slots", "lags", "row_cap", "freq_cap"]}
PREDICT_JIT = {"do_not_specialize": ["layer", "num_ids", "row_stride", "num_slots", "lags", "prior", "recency"]}
ROW_PROGRAMS = tl.constexpr(16)  # programs per lag of the rows launch: each updates marked rows i, i + 16, ...
# The rows launch runs one warp a program: its reductions then stay within a warp (no shared-memory
# exchange between warps). With 4 warps a program, Triton 3.6's code for it (then with the membership
# reduced over an [E, ids] tile) gave different rows on repeats of one launch from the same state on an
# H100 (tests/expertcache/test_device_ensure_gpu.py's repeat test). The membership is now counted id by
# id, so one warp holds it in registers; tests/expertcache/test_device_markov.py checks that the kernel
# compiles as one warp and spills nothing.
ROW_WARPS = 1
PREDICT_CHUNK = 64  # experts a program of the predictions launch (E / 64 programs)
PREDICT_ROWS = 16  # routed rows the predictions read at once, as one [16, PREDICT_CHUNK] tile


@triton.jit
def _routed(ids_ptr, num_ids, num_slots, offs, ok, E: tl.constexpr, IDS: tl.constexpr):
    """(routed[e] int64 0 / 1 over the layer's experts, n distinct, refused: an id outside [-1, E) or more
    distinct experts than slots, as the ensure refuses them). Membership is counted id by id into an
    int32 vector, elementwise (no [E, ids] tile and no reduction across it: a program of one warp keeps
    it in registers); an id that int32 would wrap is outside [-1, E), so the call is refused anyway."""
    own = offs.to(tl.int32)
    hits = tl.zeros_like(own)
    t = 0
    while t < num_ids:
        hits += (own == tl.load(ids_ptr + t).to(tl.int32)).to(tl.int32)
        t += 1
    routed = tl.where(ok & (hits > 0), 1, 0)
    n = tl.sum(routed, axis=0).to(tl.int64)
    at = tl.arange(0, IDS)
    idv = tl.load(ids_ptr + at, mask=at < num_ids, other=-1).to(tl.int64)
    bad = tl.sum(((at < num_ids) & ((idv < -1) | (idv >= E))).to(tl.int32), axis=0)
    return routed.to(tl.int64), n, ((bad > 0) | (n > num_slots)).to(tl.int32)


@triton.jit(**ROWS_JIT)
def _markov_rows_kernel(kst_ptr, gst_ptr, ids_ptr, routed_ptr, layer, num_ids, row_stride, num_slots, lags, row_cap,
                        freq_cap, E: tl.constexpr, BLOCK: tl.constexpr, IDS: tl.constexpr):
    """Step 1, one row per program (the rows are independent): program (j, i) updates the transition rows
    of lag j whose HIST bit j is set, the i-th, (i + ROW_PROGRAMS)-th, ... of them (about k a lag);
    program (0, 0) also lists the call's distinct experts, ascending, in routed_ptr for the second launch,
    and takes step 2 (the frequencies and the layer's total: no other program here reads them)."""
    pid = tl.program_id(0)
    j = pid // ROW_PROGRAMS
    i = pid % ROW_PROGRAMS
    offs = tl.arange(0, BLOCK).to(tl.int64)
    ok = offs < E
    base = layer * E
    col = base + offs
    routed, n, refused = _routed(ids_ptr, num_ids, num_slots, offs, ok, E, IDS)
    if (j < lags) & (refused == 0):
        if pid == 0:
            tl.store(routed_ptr + tl.cumsum(routed, axis=0) - 1, offs, mask=routed == 1)
            # 2. frequency (read by no other program of this launch; the predictions read it after)
            freq = tl.load(kst_ptr + FREQ * row_stride + col, mask=ok, other=0).to(tl.int64) + Q4 * routed
            total = tl.load(gst_ptr + layer) + Q4 * n
            if total > freq_cap:
                freq = freq >> 1
                total = tl.sum(tl.where(ok, freq, 0), axis=0)
            tl.store(kst_ptr + FREQ * row_stride + col, freq.to(tl.int32), mask=ok)
            tl.store(gst_ptr + layer, total)
        # the marked rows' ranks in int32 (E < 2^31), the row's address in int64
        bit = tl.where(ok, (tl.load(kst_ptr + HIST * row_stride + col, mask=ok, other=0) >> j) & 1, 0)
        rank = tl.cumsum(bit, axis=0)  # the r-th marked row has rank r + 1
        marked = tl.sum(bit, axis=0)
        R = T + lags * E
        r = i
        while r < marked:
            a = tl.sum(tl.where((bit == 1) & (rank == r + 1), offs.to(tl.int32), 0), axis=0).to(tl.int64)
            row = kst_ptr + (T + j * E + a) * row_stride + col
            vals = tl.load(row, mask=ok, other=0).to(tl.int64) + Q4 * routed
            tot = tl.load(kst_ptr + (R + j) * row_stride + base + a).to(tl.int64) + Q4 * n
            if tot > row_cap:
                vals = vals >> 1
                tot = tl.sum(vals, axis=0)
            tl.store(row, vals.to(tl.int32), mask=ok)
            tl.store(kst_ptr + (R + j) * row_stride + base + a, tot.to(tl.int32))
            r += ROW_PROGRAMS


@triton.jit(**PREDICT_JIT)
def _markov_predict_kernel(kst_ptr, gst_ptr, ids_ptr, routed_ptr, slot_of_ptr, layer, num_ids, row_stride,
                           num_slots, lags, prior, recency, E: tl.constexpr, BLOCK: tl.constexpr,
                           IDS: tl.constexpr, CHUNK: tl.constexpr, RB: tl.constexpr, MAXJ: tl.constexpr):
    """Steps 3-4 after the rows launch, CHUNK of the layer's experts a program: history, and V from the
    routed experts' (updated) rows, RB of them at once as one [RB, CHUNK] tile, listed by the rows launch."""
    full = tl.arange(0, BLOCK).to(tl.int64)
    every, n, refused = _routed(ids_ptr, num_ids, num_slots, full, full < E, E, IDS)  # n and the refusal: the layer's
    offs = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ok = offs < E
    if refused == 0:
        routed, n_here, bad_here = _routed(ids_ptr, num_ids, num_slots, offs, ok, E, IDS)  # this chunk's experts
        base = layer * E
        col = base + offs
        # 3. history
        hist = tl.load(kst_ptr + HIST * row_stride + col, mask=ok, other=0).to(tl.int64)
        hist = ((hist << 1) & ((1 << lags) - 1)) | routed
        tl.store(kst_ptr + HIST * row_stride + col, hist.to(tl.int32), mask=ok)
        # 4. predictions for the experts with a slot or routed now: the routed experts' rows summed
        freq = tl.load(kst_ptr + FREQ * row_stride + col, mask=ok, other=0).to(tl.int64)  # step 2's, launch 1
        total = tl.load(gst_ptr + layer)
        f = ((n * (freq + FLOOR_Q4)) << ONE_SHIFT) // (total + FLOOR_Q4 * E)
        pq = prior.to(tl.int64) * Q4
        R = T + lags * E
        v = tl.zeros([CHUNK], dtype=tl.int64)
        at = tl.arange(0, RB)
        for j in tl.static_range(MAXJ):
            if j < lags:
                acc = tl.zeros([CHUNK], dtype=tl.int64)
                d = pq
                i = tl.full([], 0, tl.int64)
                while i < n:
                    m = i + at < n
                    b = tl.load(routed_ptr + i + at, mask=m, other=0)  # [RB]
                    rows = tl.load(kst_ptr + (T + j * E + b[:, None]) * row_stride + col[None, :],
                                   mask=m[:, None] & ok[None, :], other=0)  # [RB, CHUNK]
                    acc += tl.sum(rows.to(tl.int64), axis=0)
                    d += tl.sum(
                        tl.load(kst_ptr + (R + j) * row_stride + base + b, mask=m, other=0).to(tl.int64), axis=0
                    )
                    i += RB
                v += (((n * acc) << ONE_SHIFT) + pq * f) // d
        v += recency.to(tl.int64) * routed
        keep = (tl.load(slot_of_ptr + col, mask=ok, other=-1) >= 0) | (routed == 1)
        tl.store(kst_ptr + V * row_stride + col, tl.where(keep, v, 0).to(tl.int32), mask=ok)


def markov_observe(kst: torch.Tensor, gst: torch.Tensor, params: torch.Tensor | tuple, layer: int,
                   ids: torch.Tensor, slot_of: torch.Tensor, num_experts: int, num_slots: int | None = None) -> None:
    """Steps 1-4 of `markov` for one call of `layer` with routed ids `ids` (int32 or int64 [any];
    -1 = none), on the device state kst int32 [fields, L * E], gst int64 [>= L] and slot_of int32
    [L * E] (the slot map before the call), in place. params: Markov.params() (lags, BETA_Q,
    16 * row_cap, 16 * freq_cap, prior, RECENCY_Q). A call the ensure refuses (an id outside [-1, E), more
    distinct experts than `num_slots`) leaves the state as it was. Raises ValueError naming the
    argument that does not fit."""
    params = tuple(int(p) for p in params)
    lags = params[0]
    E = num_experts
    if kst.dtype != torch.int32 or kst.dim() != 2 or not kst.is_contiguous() or kst.shape[1] % E:
        raise ValueError(f"markov_observe: kst must be a contiguous int32 [fields, L * {E}] tensor, got "
                         f"{kst.dtype} {list(kst.shape)}")
    L = kst.shape[1] // E
    if kst.shape[0] != T + lags * (E + 1):
        raise ValueError(f"markov_observe: kst has {kst.shape[0]} fields, markov with lags {lags} at E = {E} "
                         f"has {T + lags * (E + 1)}")
    if lags not in range(1, MAX_LAGS + 1):
        raise ValueError(f"markov_observe: params' lags must be 1 or {MAX_LAGS}, got {lags}")
    if not 0 <= layer < L:
        raise ValueError(f"markov_observe: layer {layer} is outside [0, {L})")
    for name, t, dtypes, size in (("gst", gst, (torch.int64,), L), ("slot_of", slot_of, (torch.int32,), L * E),
                                  ("ids", ids, (torch.int32, torch.int64), 1)):
        if t.dtype not in dtypes or t.device != kst.device or not t.is_contiguous() or t.numel() < size:
            raise ValueError(f"markov_observe: {name} must be a contiguous {' or '.join(map(str, dtypes))} tensor "
                             f"of at least {size} values on {kst.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    launch_observe(kst, gst, params, layer, ids, slot_of, E, L * E if num_slots is None else num_slots)


def launch_observe(kst, gst, params: tuple, layer: int, ids, slot_of, num_experts: int, num_slots: int,
                   scratch: torch.Tensor | None = None) -> None:
    """markov_observe's two launches without its checks: for DeviceCache.ensure, whose own tensors and
    checked ids these are (no per-call validation on the decode path). scratch: int64 [>= E] on kst's
    device, the call's distinct experts between the launches (allocated here when None; a captured
    caller passes its own)."""
    lags, _, row_cap, freq_cap, prior, recency = params
    if scratch is None:
        scratch = torch.empty(num_experts, dtype=torch.int64, device=kst.device)
    block, width = triton.next_power_of_2(num_experts), triton.next_power_of_2(max(ids.numel(), 2))
    _markov_rows_kernel[(MAX_LAGS * ROW_PROGRAMS.value,)](kst, gst, ids, scratch, layer, ids.numel(), kst.stride(0),
                                                         num_slots, lags, row_cap, freq_cap, E=num_experts,
                                                         BLOCK=block, IDS=width, num_warps=ROW_WARPS)
    chunk = min(block, PREDICT_CHUNK)
    _markov_predict_kernel[(triton.cdiv(num_experts, chunk),)](
        kst, gst, ids, scratch, slot_of, layer, ids.numel(), kst.stride(0), num_slots, lags, prior, recency,
        E=num_experts, BLOCK=block, IDS=width, CHUNK=chunk, RB=PREDICT_ROWS, MAXJ=MAX_LAGS)
