"""moe.kernels.decode_norm against the torch path of moe.engine.attention (rms_norm, Rope, apply_rope, the cache
writes): the same rounding steps, so equal up to RMSNorm's float32 sum order and the cos / sin implementations (2
units in the last place of the largest value); bad arguments named. CPU: Triton's interpreter, whose cast from float32
to bfloat16 truncates where the GPU rounds to nearest even, so there a bf16 result is held to one unit in the last
place where the GPU's is bitwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe.engine.attention import Rope, apply_rope, rms_norm
from moe.kernels.decode_norm import add_rms_norm, qk_rope_write
from tests.conftest import device_or_skip

ULP = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype, gpu):
    """Within 2 units in the last place of the largest |want| (4 for bf16 in the interpreter, which
    truncates at each of the path's roundings)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulps = 4 if dtype == torch.bfloat16 and not gpu else 2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= ulps * ULP[dtype] * want.float().abs().max().item(), err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("add", [True, False], ids=["residual", "norm-only"])
@pytest.mark.parametrize("w_f32", [False, True], ids=["w-model-dtype", "w-f32"])
def test_add_rms_norm_is_the_add_then_rms_norm(dtype, add, w_f32):
    """w_f32: a float32 weight (Qwen3-Next's 1 + w), multiplied before the cast."""
    device, gpu = device_or_skip()
    g = torch.Generator().manual_seed(4)
    x, res = (torch.randn(3, 200, generator=g).to(dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(200, generator=g)).to(torch.float32 if w_f32 else dtype).to(device)
    s, h = add_rms_norm(x, w, 1e-6, residual=res if add else None)
    want_s = x + res if add else x
    if gpu or dtype != torch.bfloat16:
        assert torch.equal(s, want_s)
    else:
        _close(s, want_s, dtype, gpu)
    _close(h, rms_norm(want_s, w, 1e-6), dtype, gpu)


# (q / k norm, its weight's dtype, rotated dims of 32): qwen2 (none), qwen3 (model dtype, all), and
# qwen3_next ((1 + w) in float32, a quarter rotated) with the other combinations
VARIANTS = {"no-norm": (False, None, 32), "qk-norm": (True, None, 32), "no-norm-partial": (False, None, 8),
            "f32-norm": (True, torch.float32, 32), "f32-norm-partial": (True, torch.float32, 8)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("packed", [False, True], ids=["apart", "qkv-slices"])
def test_qk_rope_write_is_the_torch_projection_tail(dtype, variant, packed):
    device, gpu = device_or_skip()
    norm, norm_dtype, rot = VARIANTS[variant]
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, max_len = 3, 8, 2, 32, 50
    q = torch.randn(b, hq * d, generator=g).to(dtype).to(device)
    k = torch.randn(b, hkv * d, generator=g).to(dtype).to(device)
    v = torch.randn(b, hkv * d, generator=g).to(dtype).to(device)
    qn, kn = ((1 + 0.1 * torch.randn(d, generator=g)).to(norm_dtype or dtype).to(device) for _ in range(2))
    pos = torch.tensor([0, 17, 49], dtype=torch.int64, device=device)
    rope = Rope(rot, 1e6, torch.device(device))
    kc = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype).to(device)
    vc = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype).to(device)
    want_k, want_v = kc.clone(), vc.clone()
    args = (q, k, v)
    if packed:  # column slices of one [B, (Hq + 2 Hkv) D] projection, as the fused decode step passes them
        args = torch.cat([q, k, v], dim=1).split((hq * d, hkv * d, hkv * d), dim=1)
        assert args[1].stride(0) == (hq + 2 * hkv) * d
    got_q = qk_rope_write(*args, pos, rope.inv_freq, kc, vc, 1e-6, *((qn, kn) if norm else ()))
    q3, k3, v3 = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    if norm:
        q3, k3 = rms_norm(q3, qn, 1e-6), rms_norm(k3, kn, 1e-6)
    cos, sin = rope.cos_sin(pos, dtype)
    _close(got_q, apply_rope(q3, cos, sin), dtype, gpu)
    rows = torch.arange(b, device=device)
    want_k[rows, :, pos] = apply_rope(k3, cos, sin)
    want_v[rows, :, pos] = v3
    _close(kc, want_k, dtype, gpu)
    assert torch.equal(vc, want_v)  # v is copied, and nothing else in the caches moved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clip", [0.0, 0.75], ids=["no-clip", "clip"])
def test_qk_rope_write_norms_the_whole_projection_and_clips(dtype, clip):
    """OLMoE: RMSNorm over the whole q and k projection of a token (weights [Hq * D], [Hkv * D]), then q,
    k and v clamped to +-clip (0.75, exact in 16 bits, clamps about two values in five), against moe.engine.attention's
    _norm_and_clip and the torch rope; q, k, v as column slices of one projection."""
    from moe.engine.attention import _norm_and_clip

    device, gpu = device_or_skip()
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, max_len = 3, 4, 2, 32, 20
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
    qn = (1 + 0.2 * torch.randn(hq * d, generator=g)).to(dtype).to(device)
    kn = (1 + 0.2 * torch.randn(hkv * d, generator=g)).to(dtype).to(device)
    pos = torch.tensor([0, 7, 19], dtype=torch.int64, device=device)
    rope = Rope(d, 1e4, torch.device(device))
    kc = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype).to(device)
    vc = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype).to(device)
    want_k, want_v = kc.clone(), vc.clone()
    got_q = qk_rope_write(q, k, v, pos, rope.inv_freq, kc, vc, 1e-6, qn, kn, full_norm=True, clip=clip)

    # the two fields of AttentionWeights and three of ModelSpec that _norm_and_clip reads
    q2, k2, v2 = _norm_and_clip(q, k, v, SimpleNamespace(q_norm=qn, k_norm=kn),
                                SimpleNamespace(qk_norm_full=True, clip_qkv=clip, rms_eps=1e-6))
    if clip:
        assert (q2.abs() == clip).float().mean().item() > 0.2  # the clamp acts
    cos, sin = rope.cos_sin(pos, dtype)
    _close(got_q, apply_rope(q2.view(b, hq, d), cos, sin), dtype, gpu)
    rows = torch.arange(b, device=device)
    want_k[rows, :, pos] = apply_rope(k2.view(b, hkv, d), cos, sin)
    want_v[rows, :, pos] = v2.view(b, hkv, d)
    _close(kc, want_k, dtype, gpu)
    assert torch.equal(vc, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_rope_write_scales_by_yarn_and_writes_a_ring(dtype):
    """gpt-oss: YaRN's inverse frequencies and attention factor (cos and sin scaled before the cast, as
    Rope.cos_sin) and a sliding layer's ring of 12 positions, written at position % 12 (positions 3, 12
    and 29 land on entries 3, 0 and 5)."""
    device, gpu = device_or_skip()
    g = torch.Generator().manual_seed(6)
    b, hq, hkv, d, ring = 3, 4, 2, 32, 12
    q, k, v = (torch.randn(b, h * d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    pos = torch.tensor([3, 12, 29], dtype=torch.int64, device=device)
    rope = Rope(d, 1.5e5, torch.device(device), yarn=(32.0, 32.0, 1.0, 4096, False, 1.3466))
    kc = torch.randn(b + 1, hkv, ring, d, generator=g).to(dtype).to(device)
    vc = torch.randn(b + 1, hkv, ring, d, generator=g).to(dtype).to(device)
    want_k, want_v = kc.clone(), vc.clone()
    got_q = qk_rope_write(q, k, v, pos, rope.inv_freq, kc, vc, 1e-5, scaling=rope.scaling, ring=True)
    cos, sin = rope.cos_sin(pos, dtype)
    _close(got_q, apply_rope(q.view(b, hq, d), cos, sin), dtype, gpu)
    rows = torch.arange(b, device=device)
    want_k[rows, :, pos % ring] = apply_rope(k.view(b, hkv, d), cos, sin)
    want_v[rows, :, pos % ring] = v.view(b, hkv, d)
    _close(kc, want_k, dtype, gpu)
    assert torch.equal(vc, want_v)
    unscaled = qk_rope_write(q, k, v, pos, rope.inv_freq, kc.clone(), vc.clone(), 1e-5, ring=True)
    assert (unscaled.float() - got_q.float()).abs().max().item() > 0.1 * got_q.float().abs().max().item()


@pytest.mark.parametrize("bad, message", [
    ("weight", "weight must be a contiguous [5]"), ("residual", "residual must be a contiguous [2, 5]"),
])
def test_add_rms_norm_names_a_bad_argument(bad, message):
    device, _ = device_or_skip()
    x = torch.randn(2, 5, device=device)
    w, res = torch.ones(5, device=device), torch.randn(2, 5, device=device)
    if bad == "weight":
        w = w[:4]
    else:
        res = res.double()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        add_rms_norm(x, w, 1e-6, residual=res)


@pytest.mark.parametrize("bad, message", [("q", "q [2, 30]"), ("v", "v must be a [2, 16] tensor"),
                                          ("v-rows", "each row contiguous"), ("kv-stride", "k, v of one row stride"),
                                          ("norms", "give both q_norm and k_norm"), ("pos", "positions int64"),
                                          ("rotary", "inv_freq float32 [R / 2], 2 <= R <= 8"),
                                          ("norm-dtypes", "k_norm must be a [8] tensor of dtype torch.float32"),
                                          ("full-norm", "q_norm must be a [32] tensor"),
                                          ("full-norm-none", "full_norm needs both"),
                                          ("clip", "clip must be >= 0")])
def test_qk_rope_write_names_a_bad_argument(bad, message):
    device, _ = device_or_skip()
    q, k, v = torch.randn(2, 32, device=device), torch.randn(2, 16, device=device), torch.randn(2, 16, device=device)
    kc, vc = torch.zeros(2, 2, 4, 8, device=device), torch.zeros(2, 2, 4, 8, device=device)
    pos, inv = torch.zeros(2, dtype=torch.int64, device=device), torch.ones(4, device=device)
    norms, kw = (), {}
    if bad == "q":
        q = q[:, :30].contiguous()
    if bad == "full-norm":  # per-head weights where the whole projection's are needed
        norms, kw = (torch.ones(8, device=device), torch.ones(8, device=device)), {"full_norm": True}
    if bad == "full-norm-none":
        kw = {"full_norm": True}
    if bad == "clip":
        kw = {"clip": -1.0}
    if bad == "v":
        v = v[:, :8].contiguous()
    if bad == "v-rows":
        v = torch.randn(16, 2, device=device).t()  # [2, 16], columns contiguous
    if bad == "kv-stride":
        v = torch.randn(2, 24, device=device)[:, :16]  # rows contiguous, of another stride than k's
    if bad == "norms":
        norms = (torch.ones(8, device=device),)
    if bad == "pos":
        pos = pos.int()
    if bad == "rotary":
        inv = torch.ones(5, device=device)  # 10 rotated dims of 8
    if bad == "norm-dtypes":
        q, k, v, kc, vc = (t.half() for t in (q, k, v, kc, vc))
        norms = (torch.ones(8, device=device), torch.ones(8, device=device).half())
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        qk_rope_write(q, k, v, pos, inv, kc, vc, 1e-6, *norms, **kw)


SM90 = """
import json
from moe.kernels.decode_norm import compile_for_target
out = {}
for name, args, kw in (("qwen3-30b-a3b", (2048, 32, 4, 128), {}),
                       ("olmoe-1b-7b", (2048, 16, 16, 128), {"olmoe": True})):
    asm = compile_for_target(*args, **kw)
    out[name] = sorted(name for name, a in asm.items() if a.get("cubin"))
print(json.dumps(out))
"""


def test_compiles_for_sm90_at_qwen3_30b_a3b_and_olmoe_shapes():
    """Qwen3-30B-A3B's heads with per-head norms; OLMoE-1B-7B's with whole-projection norms and the clamp."""
    from tests.conftest import compile_check

    names = ["_add_rms_norm_kernel", "_qk_rope_write_kernel"]
    assert compile_check(SM90) == {"qwen3-30b-a3b": names, "olmoe-1b-7b": names}
