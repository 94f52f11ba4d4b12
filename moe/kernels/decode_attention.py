"""Decode attention over a static KV cache that reads each row's length on the device (split-K
"flash decoding", GQA-aware, fixed shapes for CUDA graphs).

    q [B, Hq, D] (one new token a row), k / v cache [B, Hkv, max_len, D], lengths int64 [B]
    (row b's new token sits at position lengths[b], already written; it attends to 0..lengths[b]; a
    ring cache, a sliding layer's window of P = max_len positions, holds min(lengths[b] + 1, P) keys,
    every one seen)
        │
        ├─ _split_kernel, grid (B, Hkv, S): program (b, h, s) takes the G = Hq / Hkv query heads of kv
        │     head h and the s-th of S equal ranges of row b's lengths[b] + 1 keys, in blocks of
        │     BLOCK_N keys: scores q kᵀ * scale (float32), an online softmax (running max m, sum l),
        │     acc += p v (p rounded to the cache dtype for the dot, as flash attention does; a float32
        │     cache, and the CPU interpreter, whose 16-bit dots are wrong, multiply in float32)
        │     -> partial acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]   (an empty range: m = -inf, l = 0)
        │
        └─ _combine_kernel, grid (B, Hq): M = max_s m_s; out = Σ_s acc_s e^(m_s - M) / Σ_s l_s e^(m_s - M),
              the splits in order s = 0..S-1 -> out [B, Hq, D] in q's dtype; with sinks [Hq] (gpt-oss)
              the head's sink is one more logit of value zero: M = max(M, sink), the denominator
              + e^(sink - M)

The work of a step grows with the real lengths, not with max_len: a program walks only its share of
its row's keys, and S is fixed by the caller's shapes (so one CUDA graph serves every length). No
atomics; the combine's order is fixed, so a call is bitwise repeatable. Reference: decode_attention_reference
(float32 softmax(q kᵀ * scale + mask) v). Legend: B = rows, Hq / Hkv = query / kv heads, D = head dim,
S = splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per block of a split's loop
TARGET_PROGRAMS = 264  # split programs a call aims for (two per SM of an H200): S = this / (B * Hkv)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, lengths_ptr, acc_ptr, ml_ptr, scale, max_len,
                  HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                  SPLITS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, RING: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    n_keys = tl.load(lengths_ptr + b).to(tl.int32) + 1
    if RING:  # a ring of max_len positions: full once the row has that many
        n_keys = tl.minimum(n_keys, max_len)
    per = (n_keys + SPLITS - 1) // SPLITS
    start = s * per
    end = tl.minimum(start + per, n_keys)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * G + g  # [G_PAD] query heads of kv head h
    q = tl.load(q_ptr + (b * HQ + heads)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    kv_base = (b * HKV + h).to(tl.int64) * max_len * D
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    n0 = start
    while n0 < end:  # a while loop: Triton's interpreter cannot range() over loaded bounds
        offs = n0 + tl.arange(0, BLOCK)
        live = offs < end
        ptrs = kv_base + offs[:, None].to(tl.int64) * D + d[None, :]
        k = tl.load(k_ptr + ptrs, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=live[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(live[None, :], scores * scale, float("-inf"))  # [G_PAD, BLOCK]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
        n0 += BLOCK
    part = (b * HQ + heads) * SPLITS + s  # [G_PAD]
    ok = g < G
    tl.store(acc_ptr + part[:, None].to(tl.int64) * D + d[None, :], acc, mask=ok[:, None])
    tl.store(ml_ptr + part * 2, m, mask=ok)
    tl.store(ml_ptr + part * 2 + 1, l_sum, mask=ok)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, sinks_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                    SINKS: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    d = tl.arange(0, D)
    base = (b * HQ + hq) * SPLITS
    big = tl.load(ml_ptr + base * 2)  # split 0 always holds a key: its max is finite
    for s in tl.static_range(1, SPLITS):
        big = tl.maximum(big, tl.load(ml_ptr + (base + s) * 2))
    num = tl.zeros([D], dtype=tl.float32)
    den = 0.0
    if SINKS:  # the head's sink: one more logit, whose value is zero
        sink = tl.load(sinks_ptr + hq).to(tl.float32)
        big = tl.maximum(big, sink)
        den = tl.exp(sink - big)
    for s in tl.static_range(SPLITS):  # in order: a fixed sum
        w = tl.exp(tl.load(ml_ptr + (base + s) * 2) - big)  # an empty split: e^-inf = 0
        num += tl.load(acc_ptr + (base + s).to(tl.int64) * D + d) * w
        den += tl.load(ml_ptr + (base + s) * 2 + 1) * w
    tl.store(out_ptr + (b * HQ + hq) * D + d, (num / den).to(out_ptr.dtype.element_ty))


def splits_for(batch: int, kv_heads: int, max_len: int, programs: int = TARGET_PROGRAMS) -> int:
    """Splits per (row, kv head): about `programs` split programs in all, each with at least BLOCK_N of
    max_len's keys to walk."""
    return max(1, min(programs // max(batch * kv_heads, 1), triton.cdiv(max_len, BLOCK_N)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, splits: int | None = None, out: torch.Tensor | None = None, *,
                     sinks: torch.Tensor | None = None, ring: bool = False) -> torch.Tensor:
    """softmax(q kᵀ * scale) v of one new token a row over cache positions 0..lengths[b] (module
    docstring). q [B, Hq, D]; k_cache, v_cache [B', Hkv, max_len, D] with B' >= B (rows 0..B-1 are
    read), contiguous, q's dtype; lengths int64 [>= B] on q's device, each < max_len (not checked:
    a device value) unless `ring`: the cache is a ring of max_len positions (a sliding layer's window,
    moe.engine.attention.cache_positions) and a row sees its min(lengths[b] + 1, max_len) entries.
    sinks: [Hq] (any float dtype, on q's device): each head's sink logit, one more in its softmax with a
    value of zero (gpt-oss). splits: S (default splits_for). Returns out [B, Hq, D] in q's dtype.
    Raises ValueError naming the argument whose shape, dtype or device does not fit.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: q must be [B, Hq, D] and k_cache, v_cache one [B, Hkv, max_len, D] "
                         f"shape, got q {list(q.shape)}, k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}")
    b, hq, d = q.shape
    rows, hkv, max_len, dk = k_cache.shape
    if dk != d or hq % hkv or rows < b or d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention: k_cache {list(k_cache.shape)} does not fit q {list(q.shape)} (head dim "
                         "a power of two >= 16, Hq a multiple of Hkv, at least B cache rows)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"decode_attention: {name} must be contiguous, of q's dtype {q.dtype} and device "
                             f"{q.device}, got {t.dtype} on {t.device}")
    if lengths.dtype != torch.int64 or lengths.device != q.device or lengths.shape[0] < b:
        raise ValueError(f"decode_attention: lengths must be int64 [>= {b}] on {q.device}, got "
                         f"{lengths.dtype} {list(lengths.shape)} on {lengths.device}")
    if sinks is not None and (tuple(sinks.shape) != (hq,) or not sinks.is_floating_point()
                              or sinks.device != q.device or not sinks.is_contiguous()):
        raise ValueError(f"decode_attention: sinks must be a contiguous float [{hq}] tensor on {q.device}, got "
                         f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}")
    splits = splits_for(b, hkv, max_len) if splits is None else splits
    if splits < 1:
        raise ValueError(f"decode_attention: splits={splits} must be >= 1")
    q = q.contiguous()
    acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, hq, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    g_pad = max(16, triton.next_power_of_2(hq // hkv))
    # float32 dots for a float32 cache, and on the CPU: Triton's interpreter multiplies 16-bit floats wrongly
    ieee = q.dtype == torch.float32 or q.device.type == "cpu"
    _split_kernel[(b, hkv, splits)](q, k_cache, v_cache, lengths, acc, ml, scale, max_len, HQ=hq, HKV=hkv, D=d,
                                    G_PAD=g_pad, SPLITS=splits, BLOCK=BLOCK_N, IEEE=ieee, RING=bool(ring))
    _combine_kernel[(b, hq)](acc, ml, acc if sinks is None else sinks, out, HQ=hq, D=d, SPLITS=splits,
                             SINKS=sinks is not None)
    return out


def compile_for_target(heads: int, kv_heads: int, head_dim: int, splits: int, dtype: str = "bf16",
                       arch: int = 90, sinks: bool = False, ring: bool = False) -> dict[str, dict]:
    """Both kernels compiled ahead of time for CUDA sm_<arch> (no GPU; needs ptxas): {name: Triton's asm
    dict}. dtype: Triton's name of the cache dtype ("bf16", "fp16", "fp32"); sinks, ring: gpt-oss's
    sinks (of the cache dtype) and a sliding layer's ring."""
    from moe.kernels.triton_launch import compile_for_sm

    g_pad = max(16, triton.next_power_of_2(heads // kv_heads))
    p = f"*{dtype}"
    split = compile_for_sm(_split_kernel, (p, p, p, "*i64", "*fp32", "*fp32", "fp32", "i32"),
                           {"HQ": heads, "HKV": kv_heads, "D": head_dim, "G_PAD": g_pad, "SPLITS": splits,
                            "BLOCK": BLOCK_N, "IEEE": dtype == "fp32", "RING": ring}, 4, arch, {})
    combine = compile_for_sm(_combine_kernel, ("*fp32", "*fp32", p if sinks else "*fp32", p),
                             {"HQ": heads, "D": head_dim, "SPLITS": splits, "SINKS": sinks}, 4, arch, {})
    return {"_split_kernel": split, "_combine_kernel": combine}


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                               ring: bool = False) -> torch.Tensor:
    """float32 [B, Hq, D]: softmax(q kᵀ * scale) v over positions 0..lengths[b] of each row (a ring: its
    first min(lengths[b] + 1, max_len) entries), each query head h reading kv head h // (Hq / Hkv); with
    sinks [Hq], each head's sink one more logit in the softmax, of value zero."""
    b, hq, _ = q.shape
    hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    k = k_cache[:b].float().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, max_len, D]
    v = v_cache[:b].float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), k) * scale
    seen = lengths[:b, None].clamp(max=max_len - 1) if ring else lengths[:b, None]
    live = torch.arange(max_len, device=q.device)[None, :] <= seen
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    if sinks is None:
        return torch.einsum("bhn,bhnd->bhd", torch.softmax(scores, dim=-1), v)
    sink = sinks.float()[None, :, None].expand(b, hq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhn,bhnd->bhd", probs, v)
