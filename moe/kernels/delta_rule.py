"""The gated delta rule of Qwen3-Next's linear-attention layers (Gated DeltaNet), per value head:

    q, k [Dk] l2-normed (q then scaled by Dk^-1/2), v [Dv], decay a = exp(g) (g <= 0), beta in (0, 1)
    S <- a S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q          (state S [Dk, Dv], float32)

that is S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, a fixed-size state per sequence
and head in place of a KV cache. Value heads share key heads in consecutive groups of Hv / Hk, as
the checkpoints lay them out.

    delta_rule_reference  T tokens, one at a time in torch (float32): the definition the others meet
    delta_rule_step       decode, one token a row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
                          state [B, Hv, Dk, Dv] float32 updated in place -> o [B, Hv, Dv] float32.
                          One Triton program a (row, value head, block of BV columns): given k and q the
                          columns of S are independent, so S is read and written once (the step's HBM
                          floor) and nothing is reduced across programs. CUDA tensors (or CPU tensors
                          under Triton's interpreter, for its tests)
    delta_rule_step_reference  the same step in torch, any device: the CPU engine's decode step
    delta_rule_chunked    prefill, T tokens of each row in chunks of C (torch, float32): within a chunk,
                          with G the cumulative sum of g and b = exp(G),
                              (I + A) U = diag(beta) (V - diag(b) K S0),  A[t, j] = beta_t e^(G_t - G_j) k_t.k_j (j < t)
                              O   = diag(b) Q S0 + (e^(G_t - G_i) [i <= t] * Q K^T) U
                              S_C = e^(G_C) S0 + K^T (e^(G_C - G_i) U_i)
                          (the recurrence unrolled over the chunk: one triangular solve and a few GEMMs
                          a chunk instead of C rank-1 updates)

Legend: B = rows (sequences), T = tokens, Hk / Hv = key / value heads, Dk / Dv = their head dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.triton_launch import kernel_for

EPS = 1e-6  # the l2 norm's epsilon, as the checkpoints' reference implementation uses


def _prepare(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> float32 [..., Hv, Dk]: l2-normed, q scaled by Dk^-1/2, each key head repeated
    for its Hv / Hk value heads."""
    q, k = (x.float() * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + EPS) for x in (q, k))
    rep = hv // k.shape[-2]
    q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def _check(q, k, v, g, beta, state, tokens: bool) -> None:
    """Shapes, dtypes and devices of the three functions' arguments; ValueError names the one that does not fit."""
    lead = 3 if tokens else 2  # [B, T, H, D] or [B, H, D]
    if q.dim() != lead + 1 or k.shape != q.shape:
        raise ValueError(f"delta rule: q and k must be [B{', T' if tokens else ''}, Hk, Dk] alike, got "
                         f"{list(q.shape)} and {list(k.shape)}")
    hk, dk = q.shape[-2:]
    if v.dim() != lead + 1 or v.shape[:lead - 1] != q.shape[:lead - 1] or v.shape[-2] % hk:
        raise ValueError(f"delta rule: v must be [{', '.join(map(str, q.shape[:lead - 1]))}, Hv, Dv] with Hv a "
                         f"multiple of Hk = {hk}, got {list(v.shape)}")
    hv, dv = v.shape[-2:]
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != tuple(v.shape[:-1]):
            raise ValueError(f"delta rule: {name} must be {list(v.shape[:-1])} (one value a token and value "
                             f"head), got {list(t.shape)}")
    want = (q.shape[0], hv, dk, dv)
    if state is not None and (tuple(state.shape) != want or state.dtype != torch.float32):
        raise ValueError(f"delta rule: state must be a float32 {list(want)} tensor, got {state.dtype} "
                         f"{list(state.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"delta rule: {name} is on {t.device}, q on {q.device}")


def delta_rule_reference(q, k, v, g, beta, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Hv, Dv] float32, final state [B, Hv, Dk, Dv] float32) of T tokens a row, one at a time.
    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] (any float dtypes); state: the state
    before the first token (zeros when None; not modified). Cost O(T Hv Dk Dv), T small torch ops."""
    _check(q, k, v, g, beta, state, tokens=True)
    b, t, hv, dv = v.shape
    q, k = _prepare(q, k, hv)
    s = torch.zeros(b, hv, q.shape[-1], dv, device=q.device) if state is None else state.clone()
    o = torch.empty(b, t, hv, dv, device=q.device)
    for i in range(t):
        s = s * g[:, i].float().exp()[..., None, None]
        u = beta[:, i].float()[..., None] * (v[:, i].float() - torch.einsum("bhkv,bhk->bhv", s, k[:, i]))
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        o[:, i] = torch.einsum("bhkv,bhk->bhv", s, q[:, i])
    return o, s


def delta_rule_step_reference(q, k, v, g, beta, state) -> torch.Tensor:
    """delta_rule_step in torch: one decode token a row through delta_rule_reference, state [B, Hv, Dk, Dv]
    float32 advanced in place, o [B, Hv, Dv] float32 returned. Same arguments (no contiguity needed);
    works on any device without Triton. Cost O(B Hv Dk Dv) in a few torch ops. Raises ValueError
    naming the argument that does not fit."""
    o, s = delta_rule_reference(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
    state.copy_(s)
    return o[:, 0]


def delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_reference's result, `chunk` tokens at a time in the form of the module docstring.
    Same arguments; state is not modified. Cost O(T C (Dk + Dv) + T Dk Dv) per head in GEMMs, one
    triangular solve of C x C a chunk. Raises ValueError for chunk < 1 or a misshapen argument."""
    _check(q, k, v, g, beta, state, tokens=True)
    if chunk < 1:
        raise ValueError(f"delta_rule_chunked: chunk must be >= 1, got {chunk}")
    b, t, hv, dv = v.shape
    q, k = (x.transpose(1, 2) for x in _prepare(q, k, hv))  # [B, Hv, T, Dk]
    v, g, beta = v.float().transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    s = torch.zeros(b, hv, q.shape[-1], dv, device=q.device) if state is None else state.clone()
    o = torch.empty(b, hv, t, dv, device=q.device)
    for c0 in range(0, t, chunk):
        qc, kc, vc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk]
        gc, bc = g[:, :, c0:c0 + chunk].cumsum(-1), beta[:, :, c0:c0 + chunk]  # [B, Hv, C]
        n = gc.shape[-1]
        below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(below, gc[..., :, None] - gc[..., None, :], float("-inf")).exp()  # e^(G_t - G_i), i <= t
        kk = kc @ kc.transpose(-1, -2)
        a = (bc[..., :, None] * decay * kk).tril(-1)
        rhs = bc[..., None] * (vc - gc.exp()[..., None] * (kc @ s))
        eye = torch.eye(n, device=q.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        o[:, :, c0:c0 + chunk] = gc.exp()[..., None] * (qc @ s) + (decay * (qc @ kc.transpose(-1, -2))) @ u
        tail = (gc[..., -1:] - gc).exp()  # e^(G_C - G_i)
        s = gc[..., -1].exp()[..., None, None] * s + kc.transpose(-1, -2) @ (tail[..., None] * u)
    return o.transpose(1, 2), s


@triton.jit
def _delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BV: tl.constexpr):
    """Program (row * HV + value head, column block): q, k of the head's key head (l2-normed here), the
    state's columns [DK, BV] decayed, updated and read once; o's BV columns."""
    bh = tl.program_id(0)
    hk_row = (bh // HV) * (HV // GROUP) + (bh % HV) // GROUP  # q, k row of [B * Hk, DK]
    dk = tl.arange(0, DK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok = cols < DV
    q = tl.load(q_ptr + hk_row * DK + dk).to(tl.float32)
    k = tl.load(k_ptr + hk_row * DK + dk).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay = tl.exp(tl.load(g_ptr + bh).to(tl.float32))
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    v = tl.load(v_ptr + bh * DV + cols, mask=ok, other=0.0).to(tl.float32)
    at = s_ptr + bh * DK * DV + dk[:, None] * DV + cols[None, :]
    s = tl.load(at, mask=ok[None, :], other=0.0) * decay  # [DK, BV]
    u = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    tl.store(at, s, mask=ok[None, :])
    tl.store(o_ptr + bh * DV + cols, tl.sum(s * q[:, None], axis=0), mask=ok)


def block_v_for(rows: int, value_heads: int, value_dim: int) -> int:
    """Columns a program: the widest of 64 / 32 / 16 that still gives 512 programs (about four an SM of
    an H200), else 16. On the H200 at Qwen3-Next's 32 value heads of 128 this picks 16 at one row, 32
    at four and 64 from sixteen, the fastest of the three at each (bench_delta_rule.py)."""
    for bv in (64, 32):
        if rows * value_heads * triton.cdiv(value_dim, bv) >= 512:
            return bv
    return 16


def delta_rule_step(q, k, v, g, beta, state, out=None, block_v: int | None = None) -> torch.Tensor:
    """One decode token a row: state [B, Hv, Dk, Dv] float32 advanced in place, o [B, Hv, Dv] float32
    returned (into `out` when given). q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], any float
    dtypes, contiguous, one CUDA device (CPU tensors only under TRITON_INTERPRET=1: elsewhere use
    delta_rule_step_reference); Dk a power of two; block_v: columns a program (block_v_for when None).
    Graph capturable: no host sync. Raises ValueError naming the argument that does not fit,
    RuntimeError for CPU tensors without Triton's interpreter."""
    _check(q, k, v, g, beta, state, tokens=False)
    b, hv, dv = v.shape
    dk = q.shape[-1]
    if dk & (dk - 1):
        raise ValueError(f"delta_rule_step: the key head dim must be a power of two, got {dk}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if not t.is_contiguous():
            raise ValueError(f"delta_rule_step: {name} must be contiguous")
    if out is None:
        out = torch.empty(b, hv, dv, dtype=torch.float32, device=v.device)
    elif tuple(out.shape) != (b, hv, dv) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"delta_rule_step: out must be a contiguous float32 {[b, hv, dv]} tensor")
    bv = min(block_v or block_v_for(b, hv, dv), triton.next_power_of_2(dv))
    kernel = kernel_for(_delta_step_kernel, v.device, {}, "delta_rule_step")
    kernel[(b * hv, triton.cdiv(dv, bv))](q, k, v, g, beta, state, out, HV=hv, GROUP=hv // q.shape[1], DK=dk, DV=dv,
                                          BV=bv)
    return out
