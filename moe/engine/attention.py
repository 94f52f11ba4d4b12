"""Attention of the decoder: RMSNorm, RoPE, GQA attention over a static per-sequence KV cache.

    x [T, H] ─q/k/v proj (+bias)─► q [T, Hq, D], k / v [T, Hkv, D]
             ─(qwen3) per-head RMSNorm of q, k─► RoPE at the tokens' positions
             ─► write k, v into KVCache row b at positions [pos, pos + T)
             ─► softmax(q kᵀ / √D + causal / length mask) v ─► [T, Hq * D] ─o proj─► [T, H]

    prefill: one sequence (row b), T prompt tokens at positions 0..T-1, causal; in chunks, a chunk at
             positions start..start+T-1 attends to the row's cached 0..start-1 and causally to itself.
    decode:  B sequences (rows 0..B-1), one token each at position lengths[b], attending to
             cache positions 0..lengths[b]; lengths may differ per row, so no padding is needed.

Qwen3-Next (ModelSpec.attn_gate, rotary_dim < D): the output before o proj is multiplied by
sigmoid(gate proj(x)) in the model dtype, and RoPE turns only the first rotary_dim dims of a head.
gpt-oss (ModelSpec.sinks, sliding_window): each head's softmax has one more logit, its learned sink,
whose value is zero; a sliding layer's query sees itself and the window - 1 keys before it, and its
KV cache is a ring of the window's positions (cache_positions); both in torch (_softmax_attend, in
blocks of QUERY_BLOCK queries in prefill) and in the fused decode step's launches
(attention_decode_fused); the rope is YaRN (Rope's yarn).

KVCache holds k, v per full-attention decoder layer as [B, Hkv, max_len, D] in the model dtype
(None for a linear-attention layer, whose state is moe.engine.linear_attention's), allocated once;
decode writes with index tensors and masks by `lengths` (a device tensor), so a decode step has fixed
shapes and reads nothing back to the host (CUDA-graph capturable). The arithmetic follows
transformers' Qwen2-MoE / Qwen3-MoE: RMSNorm in float32 then cast and scaled by the weight, RoPE
cos/sin from float32 inverse frequencies cast to the model dtype, softmax in float32.
Legend: T = tokens, B = sequences, H = hidden, Hq / Hkv = query / kv heads, D = head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from moe.kernels.decode_attention import decode_attention
from moe.kernels.decode_norm import qk_rope_write
from moe.model.checkpoint import AttentionWeights
from moe.model.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * (x / rms(x)) in x's dtype, the statistic in float32 (transformers' RMSNorm).

    The weight's dtype says where it multiplies: a weight of x's dtype multiplies after the cast to it
    (Qwen2-MoE / Qwen3-MoE); a float32 weight (Qwen3-Next's 1 + w, stored so by the loader) before it,
    in float32 (for a float32 x the two are the same)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (x32 * weight).to(x.dtype)
    return weight * x32.to(x.dtype)


class Rope:
    """Rotary embedding of the first `dims` dims of a head (all of them, or Qwen3-Next's partial
    rotary) and base theta: cos / sin [T, dims] for integer positions [T].

    yarn: ModelSpec.rope_yarn (gpt-oss): the inverse frequencies blend interpolated (/ factor) and
    extrapolated ones along a linear ramp between the dims where beta_fast and beta_slow rotations fit
    the original context, and cos / sin are scaled by the attention factor before the cast
    (transformers' YaRN, float32)."""

    def __init__(self, dims: int, theta: float, device: torch.device, yarn: tuple[float, ...] = ()) -> None:
        exps = torch.arange(0, dims, 2, dtype=torch.float, device=device) / dims
        self.inv_freq = 1.0 / (theta ** exps)  # [dims / 2] float32
        self.scaling = 1.0
        if yarn:
            factor, fast, slow, original, truncate, self.scaling = yarn
            pos_freqs = theta ** exps

            def correction(rotations: float) -> float:  # the dim at which `rotations` turns fit `original`
                return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

            low, high = correction(fast), correction(slow)
            if truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dims - 1)
            ramp = ((torch.arange(dims // 2, dtype=torch.float32, device=device) - low)
                    / (high - low if high != low else 0.001)).clamp(0, 1)
            extrapolate = 1 - ramp
            self.inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dims / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, dims]
        if self.scaling != 1.0:
            return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with its first R dims rotated by cos / sin [T, R] (rotate-half convention within
    those R; the other D - R dims pass through)."""
    r = cos.shape[-1]
    rot, keep = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if keep is None else torch.cat((out, keep), dim=-1)


def cache_positions(spec: ModelSpec, layer: int, max_len: int) -> int:
    """The positions decoder layer `layer`'s KV cache holds a row: max_len, or a sliding layer's window
    when it is shorter (a ring: position p at p % window, the older ones overwritten, never seen again)."""
    window = spec.window(layer)
    return window if 0 < window < max_len else max_len


class KVCache:
    """Per softmax-attention decoder layer k, v [B, Hkv, P, D] (None at a linear-attention layer), P =
    cache_positions (max_len, or a sliding layer's window as a ring); `lengths` int64 [B] tokens cached
    per row; ring[layer]: P for a ring layer, else 0.

    Cost: 2 * B * Hkv * D * (the layers' P summed) elements of the model dtype, allocated at construction.
    """

    def __init__(self, spec: ModelSpec, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        full = set(spec.full_layers)
        self.k, self.v, self.ring = [], [], []
        for i in range(spec.num_layers):
            positions = cache_positions(spec, i, max_len)
            shape = (batch, spec.num_kv_heads, positions, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device) if i in full else None)
            self.v.append(torch.zeros(shape, dtype=dtype, device=device) if i in full else None)
            self.ring.append(positions if positions < max_len else 0)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        self.batch, self.max_len = batch, max_len


def _gated(out: torch.Tensor, x: torch.Tensor, w: AttentionWeights) -> torch.Tensor:
    """The attention's output [T, Hq * D] times sigmoid of the output gate (Qwen3-Next), in the model
    dtype; unchanged without a gate. x: the layer's input [T, H]."""
    return out if w.gate is None else out * torch.sigmoid(F.linear(x, w.gate, w.gate_bias))


def _norm_and_clip(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: AttentionWeights,
                   spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OLMoE's steps between the projection and RoPE, on q [T, Hq * D], k, v [T, Hkv * D]: RMSNorm of the
    whole q and k (spec.qk_norm_full), then q, k, v clamped to +-spec.clip_qkv (when > 0), in the model
    dtype as transformers does. Unchanged (the same tensors) for the other families."""
    if spec.qk_norm_full:
        q, k = rms_norm(q, w.q_norm, spec.rms_eps), rms_norm(k, w.k_norm, spec.rms_eps)
    if spec.clip_qkv:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    return q, k, v


def _project(x: torch.Tensor, w: AttentionWeights, spec: ModelSpec, positions: torch.Tensor,
             rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> q [T, Hq, D], k [T, Hkv, D] (normed, rotated), v [T, Hkv, D]."""
    t, d = x.shape[0], spec.head_dim
    q, k, v = _norm_and_clip(F.linear(x, w.q, w.q_bias), F.linear(x, w.k, w.k_bias), F.linear(x, w.v, w.v_bias),
                             w, spec)
    q, k, v = q.view(t, spec.num_heads, d), k.view(t, spec.num_kv_heads, d), v.view(t, spec.num_kv_heads, d)
    if spec.qk_norm:
        q, k = rms_norm(q, w.q_norm, spec.rms_eps), rms_norm(k, w.k_norm, spec.rms_eps)
    cos, sin = rope.cos_sin(positions, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


QUERY_BLOCK = 256  # queries the sink / window attention scores at once (its [Hq, block, keys] float32 scores)


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [N, Hq, D] against k, v [N, Hkv, S, D] (each query its own keys: rows of a batch, or one
    sequence's broadcast), visible [N, S] bool -> [N, Hq, D] in v's dtype: softmax over the visible
    keys' scores (float32, scaled) and, with sinks [Hq], each head's sink logit as one more key whose
    value is zero (gpt-oss: the sink takes a share of the probability and contributes nothing)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(n, hkv, hq // hkv, d)
    scores = torch.einsum("nhgd,nhsd->nhgs", qg, k.float()) * scale  # [N, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1).expand(n, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhgs,nhsd->nhgd", probs.to(v.dtype), v)  # [N, Hkv, G, D]
    return out.reshape(n, hq, d)


def _windowed(positions: torch.Tensor, keys: int | torch.Tensor, window: int) -> torch.Tensor:
    """visible [N, S]: a key at position j (keys: the positions 0..keys-1, or a tensor [S] of them) seen
    by a query at position p when j <= p and, with a window, j > p - window."""
    j = (torch.arange(keys, device=positions.device) if isinstance(keys, int) else keys)[None, :]
    seen = j <= positions[:, None]
    return seen & (j > positions[:, None] - window) if window else seen


def _attend_in_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                      key_positions: int | torch.Tensor, window: int, sinks: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """One sequence's queries q [T, Hq, D] at positions start..start+T-1 against its keys, values
    [1, Hkv, S, D] at key_positions (_windowed's keys), QUERY_BLOCK queries at a time
    (_softmax_attend) -> [T, Hq, D]."""
    t = q.shape[0]
    return torch.cat([
        _softmax_attend(q[i:i + QUERY_BLOCK], keys.expand(min(QUERY_BLOCK, t - i), -1, -1, -1),
                        values.expand(min(QUERY_BLOCK, t - i), -1, -1, -1),
                        _windowed(torch.arange(start + i, start + min(i + QUERY_BLOCK, t), device=q.device),
                                  key_positions, window), sinks, scale)
        for i in range(0, t, QUERY_BLOCK)])


def _ring_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: AttentionWeights, spec: ModelSpec,
                  cache: KVCache, layer: int, row: int, start: int) -> torch.Tensor:
    """A sliding layer's prefill through its ring of P = window positions: the chunk's queries [T, Hq, D]
    attend to the ring's last P - 1 positions before `start` and to the chunk's own k, v [T, Hkv, D];
    then the chunk's last P positions go into the ring (at p % P). Returns [T, Hq, D]."""
    t, ring, dev = q.shape[0], cache.ring[layer], q.device
    before = torch.arange(max(0, start - ring + 1), start, device=dev)  # positions still in the ring
    kp = torch.cat([before, torch.arange(start, start + t, device=dev)])  # [S] key positions
    keys = torch.cat([cache.k[layer][row, :, before % ring], k.transpose(0, 1)], dim=1)[None]  # [1, Hkv, S, D]
    values = torch.cat([cache.v[layer][row, :, before % ring], v.transpose(0, 1)], dim=1)[None]
    out = _attend_in_blocks(q, keys, values, start, kp, spec.window(layer), w.sinks, spec.head_dim ** -0.5)
    last = torch.arange(max(start, start + t - ring), start + t, device=dev)
    cache.k[layer][row, :, last % ring] = k[last - start].transpose(0, 1)
    cache.v[layer][row, :, last % ring] = v[last - start].transpose(0, 1)
    return out


def attention_prefill(x: torch.Tensor, w: AttentionWeights, spec: ModelSpec, rope: Rope, cache: KVCache,
                      layer: int, row: int, start: int = 0, tap=None) -> torch.Tensor:
    """Prompt tokens x [T, H] of sequence `row` at positions start..start+T-1 -> [T, H]; writes their
    k, v into cache row `row` there. start > 0 is a later chunk of a chunked prefill: its queries attend
    to the row's cached positions 0..start-1 and causally within the chunk (start = 0: exactly the
    one-chunk computation). tap(layer, start, k, v): handed the chunk's k, v [T, Hkv, D] as they are
    cached (a sliding layer's ring keeps only its last window of them; moe.engine.prefix saves them all).

    Cost O(T * H * (Hq + 2 Hkv) * D / H + T * (start + T) * Hq * D). Raises ValueError naming max_seq_len
    when the prompt does not fit the cache.
    """
    t = x.shape[0]
    if start + t > cache.max_len:
        raise ValueError(f"a prompt of {start + t} tokens exceeds max_seq_len={cache.max_len}: raise max_seq_len")
    q, k, v = _project(x, w, spec, torch.arange(start, start + t, device=x.device), rope)
    if tap is not None:
        tap(layer, start, k, v)
    if cache.ring[layer]:  # a sliding layer's ring
        out = _ring_prefill(q, k, v, w, spec, cache, layer, row, start)
        return F.linear(_gated(out.reshape(t, -1), x, w), w.o, w.o_bias)
    cache.k[layer][row, :, start:start + t] = k.transpose(0, 1)
    cache.v[layer][row, :, start:start + t] = v.transpose(0, 1)
    gqa = spec.num_heads != spec.num_kv_heads
    window = spec.window(layer)
    if w.sinks is not None or window:  # gpt-oss: sinks, sliding windows; in blocks of queries
        n = start + t
        out = _attend_in_blocks(q, cache.k[layer][row:row + 1, :, :n], cache.v[layer][row:row + 1, :, :n], start,
                                n, window, w.sinks, spec.head_dim ** -0.5)  # [T, Hq, D]
        return F.linear(_gated(out.reshape(t, -1), x, w), w.o, w.o_bias)
    if start == 0:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=gqa)  # [1, Hq, T, D]
    else:  # queries at start..n-1 see keys 0..their own position: causal from the lower right, which flash
        # attention takes as it is (an explicit [T, n] mask would be materialized, and sends GQA to the math kernel)
        n = start + t
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], cache.k[layer][row:row + 1, :, :n],
                                             cache.v[layer][row:row + 1, :, :n], attn_mask=causal_lower_right(t, n),
                                             enable_gqa=gqa)
    return F.linear(_gated(out[0].transpose(0, 1).reshape(t, -1), x, w), w.o, w.o_bias)


def attention_decode_fused(x: torch.Tensor, w: AttentionWeights, spec: ModelSpec, rope: Rope, cache: KVCache,
                           layer: int, batch: int) -> torch.Tensor:
    """attention_decode in one GEMM of the q / k / v projections together (w.qkv), q / k norm, RoPE and
    the cache write in one launch (moe.kernels.decode_norm.qk_rope_write, reading the projection's
    column slices in place, OLMoE's whole-projection norms and clamp of q, k, v included), then split-K
    decode attention that walks each row's own cached length, read on the device
    (moe.kernels.decode_attention), so a step's cost grows with the rows' lengths, not max_len.
    gpt-oss: YaRN's attention factor scales cos / sin in the rope launch, a sliding layer's ring is
    written at position % window and read whole once full, and the heads' sinks enter the attention's
    combine. The same rounding steps as the torch path up to the sum orders
    (tests/moe/engine/test_decode_fused.py). The engine's path on a CUDA device."""
    b = batch
    pos = cache.lengths[:b]  # [B]
    q, k, v, *gate = F.linear(x, w.qkv, w.qkv_bias).split(w.qkv_rows, dim=1)
    norms = (w.q_norm, w.k_norm) if spec.qk_norm or spec.qk_norm_full else ()
    ring = bool(cache.ring[layer])
    q = qk_rope_write(q, k, v, pos, rope.inv_freq, cache.k[layer], cache.v[layer], spec.rms_eps, *norms,
                      scaling=rope.scaling, ring=ring, full_norm=spec.qk_norm_full, clip=spec.clip_qkv or 0.0)
    out = decode_attention(q, cache.k[layer], cache.v[layer], pos, spec.head_dim ** -0.5, sinks=w.sinks,
                           ring=ring).reshape(b, -1)
    if gate:
        out = out * torch.sigmoid(gate[0])
    return F.linear(out, w.o, w.o_bias)


def attention_decode(x: torch.Tensor, w: AttentionWeights, spec: ModelSpec, rope: Rope, cache: KVCache,
                     layer: int, batch: int) -> torch.Tensor:
    """One token for each of cache rows 0..B-1 (B = batch), x [B, H], at positions cache.lengths[:B]
    -> [B, H]; writes the new k, v.

    The caller advances cache.lengths after the last layer. Fixed shapes, no host reads.
    Cost O(B * H * (Hq + 2 Hkv) * D / H + B * Hq * max_len * D).
    """
    b = batch
    pos = cache.lengths[:b]  # [B]
    q, k, v = _project(x, w, spec, pos, rope)  # [B, Hq, D], [B, Hkv, D] x2
    rows = torch.arange(b, device=x.device)
    ring = cache.ring[layer]
    at = pos % ring if ring else pos
    cache.k[layer][rows, :, at] = k
    cache.v[layer][rows, :, at] = v
    window = spec.window(layer)
    if ring or w.sinks is not None or window:  # gpt-oss: sinks, sliding windows
        if ring:  # entry i holds position i until the ring fills, then one of the last `ring`: all seen
            entries = torch.arange(ring, device=x.device)[None, :]
            visible = (entries <= pos[:, None]) | (pos[:, None] >= ring)
        else:
            visible = _windowed(pos, cache.max_len, window)
        out = _softmax_attend(q, cache.k[layer][:b], cache.v[layer][:b], visible, w.sinks, spec.head_dim ** -0.5)
        return F.linear(_gated(out.reshape(b, -1), x, w), w.o, w.o_bias)
    live = torch.arange(cache.max_len, device=x.device)[None, :] <= pos[:, None]  # [B, max_len]
    out = F.scaled_dot_product_attention(q[:, :, None, :], cache.k[layer][:b], cache.v[layer][:b],
                                         attn_mask=live[:, None, None, :],
                                         enable_gqa=spec.num_heads != spec.num_kv_heads)  # [B, Hq, 1, D]
    return F.linear(_gated(out.reshape(b, -1), x, w), w.o, w.o_bias)
