"""The small fused launches of a decode layer's non-MoE part: the residual add with RMSNorm, and q / k
per-head RMSNorm with RoPE and the KV-cache write.

    add_rms_norm:  x [B, H] (+ residual [B, H]) -> s = x + residual (the residual stream, model dtype)
                   and h = weight * rms_norm(s), one program a row: a read of x, residual and weight,
                   a write of s and h (the torch path: an add, then RMSNorm in 5 kernels)
    qk_rope_write: q [B, Hq * D], k, v [B, Hkv * D] (the projections' outputs, each row contiguous: column
                   slices of one [B, (Hq + 2 Hkv) * D] projection do), positions [B] int64
                   -> q heads normed (qwen3's q_norm) and rotated at position[b], returned [B, Hq, D];
                   k heads normed (k_norm) and rotated, written with v into the layer's cache rows
                   [b, :, position[b]]; one program a (row, head) (the torch path: about 20 kernels);
                   OLMoE's norms over the whole q and k projection and its clamp of q, k, v
                   (clip_qkv) in the same launch, each program reading its whole row for the statistic

Rounding follows moe.engine.attention exactly where it rounds: the add in the model dtype, RMSNorm's
statistic in float32 then a cast and the weight's multiply in the model dtype (a float32 weight,
Qwen3-Next's 1 + w: the multiply in float32 before the one cast), RoPE over the first R dims of a head
(all D, or Qwen3-Next's partial rotary; the rest pass through) with cos / sin from
float32 frequencies cast to the model dtype and x·cos + rot(x)·sin with each product and the sum
rounded; only the order of RMSNorm's float32 sum differs. Legend: B = rows, H = hidden, Hq / Hkv =
query / kv heads, D = head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms(x, n: tl.constexpr, eps):
    """rsqrt(mean(x²) + eps) of a float32 vector of n valid entries (the rest 0)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                         ADD: tl.constexpr, W_F32: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * N + offs, x, mask=ok)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if W_F32:  # (x / rms) * w in float32, one cast
        tl.store(out_ptr + row * N + offs, (xf * _rms(xf, N, eps) * w).to(x.dtype), mask=ok)
    else:
        y = (xf * _rms(xf, N, eps)).to(x.dtype)
        tl.store(out_ptr + row * N + offs, (w * y.to(tl.float32)).to(x.dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, h): s = x + residual in x's dtype (x itself without residual), h = weight * rms_norm(s)
    (moe.engine.attention.rms_norm's rounding). x, residual [B, H] contiguous, weight [H] (x's dtype, or
    float32: multiplied before the cast), one device. Raises ValueError naming the argument that does
    not fit."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"add_rms_norm: x must be a contiguous [B, H] tensor, got {list(x.shape)}")
    for name, t, shape in (("weight", weight, (x.shape[1],)), ("residual", residual, tuple(x.shape))):
        dtypes = (x.dtype, torch.float32) if name == "weight" else (x.dtype,)
        if t is not None and (tuple(t.shape) != shape or t.dtype not in dtypes or t.device != x.device
                              or not t.is_contiguous()):
            raise ValueError(f"add_rms_norm: {name} must be a contiguous {list(shape)} tensor of x's dtype "
                             f"{x.dtype}{' (or float32)' if name == 'weight' else ''} on {x.device}, got "
                             f"{list(t.shape)} {t.dtype} on {t.device}")
    b, n = x.shape
    s = torch.empty_like(x) if residual is not None else x
    out = torch.empty_like(x) if out is None else out
    _add_rms_norm_kernel[(b,)](x, x if residual is None else residual, weight, s, out, eps, N=n,
                               BLOCK=triton.next_power_of_2(n), ADD=residual is not None,
                               W_F32=weight.dtype == torch.float32 and x.dtype != torch.float32)
    return s, out


@triton.jit
def _normed(x, w_ptr, at, r, dtype, NORM_F32: tl.constexpr):
    """x (float32) / rms times the norm weight at `at`, rounded as moe.engine.attention.rms_norm."""
    w = tl.load(w_ptr + at).to(tl.float32)
    if NORM_F32:
        return (x * r * w).to(dtype)
    return (w * (x * r).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _clip(x, clip, CLIP: tl.constexpr):
    """x clamped to +-clip in float32, back in x's dtype (torch's clamp of a 16-bit tensor), when CLIP."""
    if CLIP:
        return tl.minimum(tl.maximum(x.to(tl.float32), -clip), clip).to(x.dtype)
    return x


@triton.jit
def _row_rms(row_ptr, n: tl.constexpr, NB: tl.constexpr, eps):
    """rsqrt(mean(x²) + eps) over the n entries at row_ptr (a whole q or k projection of one token)."""
    i = tl.arange(0, NB)
    x = tl.load(row_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    return _rms(x, n, eps)


@triton.jit
def _rope_head(src_ptr, norm_ptr, d, cos, sin, eps, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
               NORM_F32: tl.constexpr, r_full, norm_at, FULL: tl.constexpr, clip, CLIP: tl.constexpr):
    """One head [D] (src_ptr its first element), normed by norm_ptr's weight when NORM (FULL: by the
    whole projection's statistic r_full and the weight's entries from norm_at, OLMoE), clamped to +-clip
    when CLIP, its first R dims rotated by cos / sin [D] (model dtype as float32; only the first R used):
    x·cos + rot(x)·sin, each product and the sum rounded to the model dtype (rot(x) = (-x[R/2:R],
    x[:R/2])); dims R.. pass."""
    HALF: tl.constexpr = R // 2
    at = tl.where(d < R, (d + HALF) % R, d)  # the rotation partner of each rotated dim
    x = tl.load(src_ptr + d)
    partner = tl.load(src_ptr + at)
    dtype = x.dtype
    if NORM:
        xf = x.to(tl.float32)
        r = r_full if FULL else _rms(xf, D, eps)
        x = _normed(xf, norm_ptr, norm_at + d, r, dtype, NORM_F32)
        partner = _normed(partner.to(tl.float32), norm_ptr, norm_at + at, r, dtype, NORM_F32)
    x = _clip(x, clip, CLIP)
    partner = _clip(partner, clip, CLIP)
    rot = tl.where(d < HALF, -partner.to(tl.float32), partner.to(tl.float32))
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (rot * sin).to(dtype).to(tl.float32)
    return tl.where(d < R, (a + b).to(dtype), x)


@triton.jit
def _qk_rope_write_kernel(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, inv_freq_ptr, pos_ptr, q_out_ptr,
                          k_cache_ptr, v_cache_ptr, eps, scaling, clip, max_len, sq, skv, HQ: tl.constexpr,
                          HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
                          NORM_F32: tl.constexpr, SCALED: tl.constexpr, RING: tl.constexpr, FULL: tl.constexpr,
                          NBQ: tl.constexpr, NBK: tl.constexpr, CLIP: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)  # 0..HQ-1: a query head; HQ..HQ+HKV-1: a kv head
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + row)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % (R // 2))  # emb = cat(freqs, freqs) over R dims
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.cos(freq)
    sin = tl.sin(freq)
    if SCALED:  # YaRN's attention factor, in float32 before the cast (Rope.cos_sin)
        cos = cos * scaling
        sin = sin * scaling
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    if head < HQ:
        r_full = _row_rms(q_ptr + row * sq, HQ * D, NBQ, eps) if FULL else 1.0
        y = _rope_head(q_ptr + row * sq + head * D, q_norm_ptr, d, cos, sin, eps, D, R, NORM, NORM_F32,
                       r_full, head * D if FULL else 0, FULL, clip, CLIP)
        tl.store(q_out_ptr + (row * HQ + head) * D + d, y)
    else:
        h = head - HQ
        r_full = _row_rms(k_ptr + row * skv, HKV * D, NBK, eps) if FULL else 1.0
        y = _rope_head(k_ptr + row * skv + h * D, k_norm_ptr, d, cos, sin, eps, D, R, NORM, NORM_F32,
                       r_full, h * D if FULL else 0, FULL, clip, CLIP)
        slot = pos % max_len if RING else pos  # a ring: position p at p % max_len
        at = ((row * HKV + h).to(tl.int64) * max_len + slot) * D + d
        tl.store(k_cache_ptr + at, y)
        tl.store(v_cache_ptr + at, _clip(tl.load(v_ptr + row * skv + h * D + d), clip, CLIP))


def _rows_contiguous(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (a column slice of a contiguous matrix is)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def qk_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, *,
                  scaling: float = 1.0, ring: bool = False, full_norm: bool = False,
                  clip: float = 0.0) -> torch.Tensor:
    """q [B, Hq * D], k, v [B, Hkv * D] (rows contiguous, k and v of one row stride: column slices of
    one q / k / v projection qualify) -> q normed (q_norm given) and rotated at positions[b], as
    [B, Hq, D]; k normed (k_norm) and rotated, and v, written to k_cache / v_cache [B', Hkv, max_len, D]
    at [b, :, positions[b]] (positions int64 [>= B] on the device, each < max_len: not checked, a device
    value). inv_freq: float32 [R / 2] (moe.engine.attention.Rope.inv_freq): the first R dims of a head
    turn (R even, <= D). q_norm / k_norm: q's dtype, or both float32 (Qwen3-Next's 1 + w, multiplied
    before the cast). scaling: cos and sin multiplied by it in float32 before the cast (YaRN's attention
    factor, Rope.scaling). ring: the cache is a ring of max_len positions (a sliding layer's window),
    position p written at p % max_len; positions may then pass max_len. full_norm (OLMoE's
    qk_norm_full): q_norm [Hq * D] and k_norm [Hkv * D] norm the whole projection of a token, not each
    head. clip > 0 (OLMoE's clip_qkv): q, k (after their norms) and v clamped to +-clip. Raises
    ValueError naming the argument that does not fit."""
    b = q.shape[0]
    hkv, max_len, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1] // d if q.dim() == 2 else 0
    if q.dim() != 2 or q.shape[1] != hq * d or hq % max(hkv, 1) or d & (d - 1) or d < 2:
        raise ValueError(f"qk_rope_write: q {list(q.shape)} must be [B, Hq * D] with Hq a multiple of the cache's "
                         f"{hkv} kv heads of D = {d} (a power of two)")
    norm_f32 = q_norm is not None and q_norm.dtype == torch.float32 and q.dtype != torch.float32
    for name, t, shape in (("k", k, (b, hkv * d)), ("v", v, (b, hkv * d)), ("v_cache", v_cache, tuple(k_cache.shape)),
                           ("q_norm", q_norm, (hq * d if full_norm else d,)),
                           ("k_norm", k_norm, (hkv * d if full_norm else d,))):
        dtype = torch.float32 if norm_f32 and name.endswith("norm") else q.dtype
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device
                              or not (_rows_contiguous(t) if name in ("k", "v") else t.is_contiguous())):
            raise ValueError(
                f"qk_rope_write: {name} must be a {list(shape)} tensor of dtype {dtype} on "
                f"{q.device}, {'each row' if name in ('k', 'v') else 'all'} contiguous, got {list(t.shape)} "
                f"{t.dtype} on {t.device} with strides {tuple(t.stride())}"
            )
    if not _rows_contiguous(q) or k.stride(0) != v.stride(0):
        raise ValueError(f"qk_rope_write: q's rows must be contiguous and k, v of one row stride, got strides "
                         f"q {tuple(q.stride())}, k {tuple(k.stride())}, v {tuple(v.stride())}")
    if (q_norm is None) != (k_norm is None) or (full_norm and q_norm is None):
        raise ValueError("qk_rope_write: give both q_norm and k_norm, or neither (full_norm needs both)")
    if not clip >= 0:
        raise ValueError(f"qk_rope_write: clip must be >= 0 (0: no clamp), got {clip}")
    rot = 2 * inv_freq.shape[0] if inv_freq.dim() == 1 else 0
    if (k_cache.dtype != q.dtype or not k_cache.is_contiguous() or k_cache.shape[0] < b
            or not 2 <= rot <= d or inv_freq.dtype != torch.float32
            or positions.dtype != torch.int64 or positions.shape[0] < b):
        raise ValueError(f"qk_rope_write: k_cache must be a contiguous [>= {b}, Hkv, max_len, D] tensor of q's "
                         f"dtype, inv_freq float32 [R / 2], 2 <= R <= {d}, positions int64 [>= {b}]; got k_cache "
                         f"{list(k_cache.shape)} "
                         f"{k_cache.dtype}, inv_freq {list(inv_freq.shape)} {inv_freq.dtype}, positions "
                         f"{list(positions.shape)} {positions.dtype}")
    q_out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    norm = q_norm is not None
    _qk_rope_write_kernel[(b, hq + hkv)](q, k, v, q_norm if norm else q, k_norm if norm else q, inv_freq, positions,
                                         q_out, k_cache, v_cache, eps, float(scaling), float(clip), max_len,
                                         q.stride(0), k.stride(0), HQ=hq, HKV=hkv, D=d, R=rot, NORM=norm,
                                         NORM_F32=norm_f32, SCALED=scaling != 1.0, RING=bool(ring),
                                         FULL=bool(full_norm), NBQ=triton.next_power_of_2(hq * d),
                                         NBK=triton.next_power_of_2(hkv * d), CLIP=clip > 0)
    return q_out


def compile_for_target(hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str = "bf16",
                       arch: int = 90, rotary_dim: int = 0, olmoe: bool = False) -> dict[str, dict]:
    """Both kernels (qk_rope_write with q / k norms; olmoe: over the whole projection, with the clamp)
    compiled ahead of time for CUDA sm_<arch> (no GPU; needs ptxas): {name: Triton's asm dict}. dtype:
    Triton's name of the model dtype."""
    from moe.kernels.triton_launch import compile_for_sm

    p = f"*{dtype}"
    norm = compile_for_sm(_add_rms_norm_kernel, (p, p, p, p, p, "fp32"),
                          {"N": hidden, "BLOCK": triton.next_power_of_2(hidden), "ADD": True, "W_F32": False}, 4,
                          arch, {})
    rope = compile_for_sm(_qk_rope_write_kernel,
                          (p, p, p, p, p, "*fp32", "*i64", p, p, p, "fp32", "fp32", "fp32", "i32", "i32", "i32"),
                          {"HQ": heads, "HKV": kv_heads, "D": head_dim, "R": rotary_dim or head_dim, "NORM": True,
                           "NORM_F32": False, "SCALED": False, "RING": False, "FULL": olmoe,
                           "NBQ": triton.next_power_of_2(heads * head_dim),
                           "NBK": triton.next_power_of_2(kv_heads * head_dim), "CLIP": olmoe}, 4, arch, {})
    return {"_add_rms_norm_kernel": norm, "_qk_rope_write_kernel": rope}
