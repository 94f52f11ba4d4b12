"""Expert formats: every registered format (and the int4 variants) against the numpy references of
tests/expertcache/numpy_formats.py, on fresh random matrices (hypothesis) and on edge cases.

    W (bf16 / f16 / f32) ──quantize──► parts ──dequantize──► W' float32
    (a) W' bit for bit == the numpy decode of the same bytes; the scales == the numpy scaling rule
    (b) every code is the nearest representable value of W / scale (brute force over the codebook),
        ties to even; the sign bit as the format defines it
    (c) per element, with the element's scale as divided by on quantize (s; nvfp4 s * s2; mxfp4 2^e):
        bf16 |W' - W| <= 2^-8 |W|;  fp8 <= 2^-4 |W| + 2^-10 s  (so <= 2^-4 amax of its 128 x 128 block);
        nvfp4 <= s * s2 where the e4m3 scale is normal (>= 2^-6);  mxfp4 <= 2 * 2^e (values in (6, 8) * 2^e
        clip to 6 * 2^e; so <= amax(block) / 2);  int4 <= s / 2 where s is normal (a subnormal float16 s
        rounds coarser, and the group's extreme may clip);  each times (1 + 2^-16) for float32 rounding
    (d) matrix_bytes == the banks' bytes == the parts' bytes; golden bytes per Qwen expert
    (e) bad inputs raise FormatError naming the argument, field or part; (f) registry errors
"""

from __future__ import annotations

import ast
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from expertcache.errors import FormatError
from expertcache.formats import BF16, FP8, INT4, MXFP4, NVFP4, format_names, get_format
from expertcache.pool import Bank
from tests.expertcache import numpy_formats as ref

FORMATS = [BF16(), FP8(), NVFP4(), MXFP4(), INT4(), INT4(scale_dtype="float16", zero_points=True)]
IDS = ["bf16", "fp8", "nvfp4", "mxfp4", "int4", "int4-f16-z"]
SPECIALS = ("zero_block", "zero_row", "huge", "neg_zero")


def make_matrix(fmt, out: int, cols: int, seed: int, exp: int, dtype: str, specials) -> torch.Tensor:
    """A random [out, n] matrix, n = cols rounded down to the format's multiple (at least one),
    N(0, 1) * 10^exp, with the chosen special values planted."""
    rng = np.random.default_rng(seed)
    n = max(fmt.in_multiple, cols // fmt.in_multiple * fmt.in_multiple)
    w = (rng.standard_normal((out, n)) * 10.0 ** exp).astype(np.float32)
    r, c = rng.integers(out), rng.integers(n)
    if "zero_block" in specials:
        w[r // 16 * 16:r // 16 * 16 + 16, c // 32 * 32:c // 32 * 32 + 32] = 0
    if "zero_row" in specials:
        w[r] = 0
    if "huge" in specials:  # one value far above the rest of its blocks (float16 range kept)
        w[r, c] = min(1024 * float(np.abs(w).max()), 6e4) or 1.0
    if "neg_zero" in specials:
        w[rng.random(w.shape) < 0.05] = -0.0
    return torch.from_numpy(w).to(getattr(torch, dtype))


matrix_args = dict(out=st.integers(1, 136), cols=st.integers(1, 300), seed=st.integers(0, 2 ** 32 - 1),
                   exp=st.integers(-4, 2), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
                   specials=st.sets(st.sampled_from(SPECIALS)))


def quantize_np(fmt, w: torch.Tensor):
    parts = fmt.quantize(w)
    return parts, {k: ref.raw(v) for k, v in parts.items()}, fmt.dequantize(parts).numpy()


def check_reference(fmt, w32: np.ndarray, parts: dict, deq: np.ndarray) -> None:
    """(a) the decode and the scales, bit for bit."""
    out, n = w32.shape
    want = ref.reference_dequantize(fmt.name, parts, out, n)
    assert deq.dtype == np.float32 and deq.shape == (out, n)
    assert np.array_equal(deq.view(np.uint32), want.view(np.uint32)), f"{fmt.name}: dequantize != numpy decode"
    if fmt.name == "bf16":
        assert np.array_equal(parts[""], ref.bf16_encode(w32)), "bf16: not the round-to-nearest-even bits"
        return
    scales = ref.reference_scales(fmt.name, w32, scale_dtype=getattr(fmt, "scale_dtype", None))
    for k, v in scales.items():
        assert np.array_equal(parts[k].view(np.uint8), v.view(np.uint8)), f"{fmt.name}: parts[{k!r}] != rule"
    if "z" in parts:
        assert (parts["z"] == 8).all()


def check_nearest(fmt, w32: np.ndarray, parts: dict) -> None:
    """(b) the codes are the nearest of W / scale, ties to even (brute force over the codebook)."""
    if fmt.name == "bf16":
        return  # bf16: check_reference compared the bits with round-to-nearest-even by bit arithmetic
    out, n = w32.shape
    x = w32 / ref.scale_per_element(fmt.name, parts, out, n)
    if fmt.name == "fp8":
        q = parts["q"].astype(np.int64)
        assert np.array_equal(q & 0x7F, ref.nearest_code(np.abs(x), ref.E4M3_VALUES, ref.E4M3_CODES))
        assert np.array_equal(q >> 7 == 1, np.signbit(x)), "fp8: the sign bit is x's (torch's cast)"
    elif fmt.name in ("nvfp4", "mxfp4"):
        codes = ref.unpack(parts["q"]).astype(np.int64)
        assert np.array_equal(codes & 7, ref.nearest_code(np.abs(x), ref.E2M1_VALUES, ref.E2M1_CODES))
        assert np.array_equal(codes >> 3 == 1, x < 0), f"{fmt.name}: the sign bit is x < 0 (ModelOpt)"
    else:
        q = ref.unpack(parts["q"]).astype(np.int64) - 8
        assert np.array_equal(q, ref.nearest_code(x, ref.INT4_CODES.astype(np.float32), ref.INT4_CODES))


def check_bounds(fmt, w32: np.ndarray, parts: dict, deq: np.ndarray) -> None:
    """(c) the error bounds of the module docstring."""
    out, n = w32.shape
    err, where = np.abs(deq.astype(np.float64) - w32), np.ones(w32.shape, bool)
    if fmt.name == "bf16":
        bound = 2.0 ** -8 * np.abs(w32)
    else:
        step = ref.scale_per_element(fmt.name, parts, out, n).astype(np.float64)
        if fmt.name == "fp8":
            bound = 2.0 ** -4 * np.abs(w32) + 2.0 ** -10 * step
            amax = ref.expand2d(ref.block_amax(w32, 128, 128), 128, out, n)
            assert (err <= 2.0 ** -4 * amax * (1 + 2 ** -16)).all(), "fp8: error above 2^-4 of the block amax"
        elif fmt.name == "nvfp4":
            bound, where = step, ref.per_input(ref.e4m3_decode(parts["s"]), 16, n) >= 2.0 ** -6
        elif fmt.name == "mxfp4":
            bound = 2 * step
        else:  # where the scale is a normal number of its dtype: a subnormal float16 scale rounds coarser
            tiny = np.finfo(np.float16).tiny if parts["s"].dtype == np.float16 else 2.0 ** -126
            bound, where = 0.5 * step, step >= tiny
    assert (err[where] <= bound[where] * (1 + 2 ** -16)).all(), f"{fmt.name}: error above the bound"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@given(**matrix_args)
def test_round_trip_reference_nearest_and_bounds(fmt, out, cols, seed, exp, dtype, specials):
    w = make_matrix(fmt, out, cols, seed, exp, dtype, specials)
    parts, raw, deq = quantize_np(fmt, w)
    w32 = w.float().numpy()
    check_reference(fmt, w32, raw, deq)
    check_nearest(fmt, w32, raw)
    check_bounds(fmt, w32, raw, deq)
    assert torch.equal(fmt.quantize(w)["q" if fmt.name != "bf16" else ""], parts[fmt.main]), "not deterministic"


def run_edge(fmt, rows) -> np.ndarray:
    """Quantize float32 `rows`, check (a) and (b), return W'."""
    w = torch.tensor(rows, dtype=torch.float32)
    _, raw, deq = quantize_np(fmt, w)
    check_reference(fmt, w.numpy(), raw, deq)
    check_nearest(fmt, w.numpy(), raw)
    check_bounds(fmt, w.numpy(), raw, deq)
    return deq


def signed(values) -> list[float]:
    return [float(v) for v in values]


MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # between neighbouring E2M1 magnitudes
MID_TO = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ... and where round-to-nearest-even takes them


def test_midpoints_round_to_even():
    """Inputs at exact midpoints of each codebook, with the scale forced to 1."""
    b = 2.0 ** -7  # bf16's step at 1
    assert signed(run_edge(BF16(), [[1 + b / 2, 1 + 3 * b / 2, -(1 + b / 2)]])[0]) == [1.0, 1 + 2 * b, -1.0]
    sub = 2.0 ** -9  # e4m3's smallest subnormal; 448 in the block makes its scale 1
    row = [448.0, 1.0625, 1.1875, -1.0625, sub / 2, 1.5 * sub]
    assert signed(run_edge(FP8(), [row])[0]) == [448.0, 1.0, 1.25, -1.0, 0.0, 2 * sub]
    # nvfp4: amax 2688 makes s2 = 1; a block with amax 6 has scale 1
    block = [6.0] + MIDPOINTS + [-m for m in MIDPOINTS] + [-0.0]
    deq = run_edge(NVFP4(), [[2688.0] + [0.0] * 15 + block])[0, 16:]
    assert signed(deq) == [6.0] + MID_TO + [-m for m in MID_TO] + [0.0]
    assert np.signbit(deq[8]) and not np.signbit(deq[15]), "-0.25 -> -0 (code 8), -0.0 -> +0 (ModelOpt)"
    # mxfp4: amax 6 -> exponent floor(log2 6) - 2 = 0; a block of amax 7.5 clips it to 6 (OCP rule)
    deq = run_edge(MXFP4(), [block + [0.0] * 16 + [7.5, 3.0] + [0.0] * 30])[0]
    assert signed(deq[:16]) == [6.0] + MID_TO + [-m for m in MID_TO] + [0.0]
    assert signed(deq[32:34]) == [6.0, 3.0]
    # int4: amax 7 -> scale 1
    row = [7.0, 0.5, 1.5, 2.5, 3.5, 6.5, -0.5, -1.5, -2.5, -6.5]
    assert signed(run_edge(INT4(), [row])[0]) == [7.0, 0.0, 2.0, 2.0, 4.0, 6.0, 0.0, -2.0, -2.0, -6.0]


def test_int4_subnormal_float16_scale_clips_the_extreme():
    """A group with amax 1.0221512e-06: amax / 7 is a float16 subnormal that rounds down to 2 * 2^-24, so
    the extreme -1.0221512e-06 / s = -8.57 clips to -8 (the reference decode and nearest rule still hold;
    the s / 2 bound is claimed only where s is normal)."""
    fmt = INT4(scale_dtype="float16", zero_points=True)
    row = [-1.0221512e-06] + [3e-7] * 127
    deq = run_edge(fmt, [row])[0]
    assert deq[0] == np.float32(-8 * 2.0 ** -23)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_zeros_and_one_huge_value(fmt):
    n = 256
    zero = fmt.quantize(torch.zeros(3, n))
    assert not fmt.dequantize(zero).any()
    want = {"fp8": {"s": 1.0}, "nvfp4": {"s": 1.0, "s2": 1.0}, "mxfp4": {"s": 0}, "int4": {"s": 1.0}}
    for k, v in want.get(fmt.name, {}).items():
        assert (zero[k].float() == v).all(), f"{fmt.name}: parts[{k!r}] of a zero matrix"
    w = torch.full((130, n), 1e-3)
    w[5, 7] = 3e4
    deq = run_edge(fmt, w.tolist())
    clip = 0.25 if fmt.name == "mxfp4" else 2 ** -4  # mxfp4: 3e4 / 2^12 = 7.3 clips to 6 (the OCP rule)
    assert deq[5, 7] == pytest.approx(3e4, rel=clip)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_input_dtype_and_layout_do_not_change_the_parts(fmt):
    w = torch.randn(64, 96).to(torch.bfloat16)
    want = fmt.quantize(w)
    for same in (w.t().contiguous().t(), w.float()):  # a transposed view; float32 holding the same values
        got = fmt.quantize(same)
        assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(1, 32), (130, 288), (1536, 2048), (2048, 768), (2048, 512)])
def test_bytes_are_the_banks_and_the_parts(fmt, shape):
    banks = fmt.banks("gate_up", *shape)
    assert fmt.matrix_bytes(*shape) == sum(b.row_bytes for b in banks)
    assert [b.name for b in banks] == [f"gate_up.{p.suffix}" if p.suffix else "gate_up" for p in fmt.layout(*shape)]
    if shape[0] * shape[1] <= 130 * 288:
        parts = fmt.quantize(torch.randn(shape))
        assert fmt.matrix_bytes(*shape) == sum(t.numel() * t.element_size() for t in parts.values())


# Bytes of one expert (gate_up [2I, H] + down [H, I]) for Qwen3-30B-A3B (H 2048, I 768), Qwen3-Next (I 512).
GOLDEN = {"bf16": (9437184, 6291456), "fp8": (4719744, 3146496), "nvfp4": (2654220, 1769484),
          "int4": (2433024, 1622016), "mxfp4": (2506752, 1671168)}


def test_expert_bytes_golden_and_banks():
    assert sorted(GOLDEN) == format_names()
    for name, (a3b, nxt) in GOLDEN.items():
        fmt = get_format(name)
        assert (fmt.expert_bytes(2048, 768), fmt.expert_bytes(2048, 512)) == (a3b, nxt)
        assert sum(b.row_bytes for b in fmt.expert_banks(2048, 768)) == a3b


def test_bf16_banks_are_the_ones_moe_builds():
    from moe.model.config import MoEConfig
    from moe.testing.synthetic import random_weights

    cfg = MoEConfig(hidden=64, num_experts=4, top_k=2, expert_intermediate=48, dtype="bfloat16")
    assert cfg.expert_format == "bf16" and cfg.format == BF16()
    store = random_weights(cfg, 1, device="cpu", pin=False).store
    banks = BF16().expert_banks(cfg.hidden, cfg.expert_intermediate)
    assert store.banks == banks == (Bank("gate_up", (96, 64), torch.bfloat16), Bank("down", (64, 48), torch.bfloat16))


def test_pricing_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from expertcache.formats import format_names, get_format\n"
            "print([get_format(n).expert_bytes(2048, 768) for n in format_names()])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ast.literal_eval(done.stdout) == [GOLDEN[n][0] for n in format_names()]


def raises(match: str):
    return pytest.raises(FormatError, match=match)


def test_bad_matrices_name_the_field():
    for fmt in FORMATS:
        with raises(r"w must be a 2-D tensor"):
            fmt.quantize(torch.ones(32))
        with raises(r"w must be a 2-D tensor"):
            fmt.quantize(np.ones((2, 32)))
        with raises(r"w\.dtype"):
            fmt.quantize(torch.ones(2, 32, dtype=torch.float64))
        with raises(r"w\.dtype"):
            fmt.quantize(torch.ones(2, 32, dtype=torch.int32))
        with raises(r"non-finite"):
            fmt.quantize(torch.tensor([[1.0, float("nan")] * 16]))
        with raises(r"out_features must be a positive int"):
            fmt.quantize(torch.ones(0, 32))
        for bad in (0, -1, 2.0, True):
            with raises(r"in_features must be a positive int"):
                fmt.layout(4, bad)
    # not a multiple of the packing / scale block: refused, never padded
    for fmt, n in ((NVFP4(), 24), (MXFP4(), 48), (INT4(), 129)):
        with raises(rf"in_features={n} is not a multiple of {fmt.in_multiple} .*refused, not padded"):
            fmt.quantize(torch.ones(2, n))
        with raises(r"in_features"):
            fmt.matrix_bytes(2, n)
    # partial blocks are stored: fp8 130 x 200 (ceil scales), int4 200 (a partial last group)
    assert FP8().layout(130, 200)[1].shape == (2, 2) and INT4().layout(3, 200)[1].shape == (3, 2)
    with raises(r"int4: scale_dtype"):
        INT4(scale_dtype="float32")
    with raises(r"overflow a float16 scale"):
        INT4(scale_dtype="float16").quantize(torch.full((1, 2), 1e6))


def test_bad_parts_name_the_part():
    w = torch.randn(4, 64)
    for fmt in FORMATS:
        parts = fmt.quantize(w)
        for k in parts:  # a missing part (the main one: its shape gives the matrix's, so named as such)
            with raises(rf"parts\[{fmt.main!r}\] must be a 2-D" if k == fmt.main else r"exactly the keys"):
                fmt.dequantize({j: v for j, v in parts.items() if j != k})
        with raises(r"exactly the keys"):
            fmt.dequantize({**parts, "x": parts[fmt.main]})
        for k, v in parts.items():
            if k != fmt.main:
                with raises(rf"parts\[{k!r}\] must be"):
                    fmt.dequantize({**parts, k: v[..., :0] if v.dim() else v.reshape(1, 1)})
                with raises(rf"parts\[{k!r}\] must be"):
                    fmt.dequantize({**parts, k: v.to(torch.float16) if v.dtype != torch.float16 else v.float()})
        with raises(rf"parts\[{fmt.main!r}\] must be a 2-D tensor"):
            fmt.dequantize({**parts, fmt.main: parts[fmt.main].reshape(-1)})
    fp8 = FP8().quantize(w)
    with raises(r"parts\['s'\] holds NaN"):
        FP8().dequantize({**fp8, "s": torch.full_like(fp8["s"], float("inf"))})
    q = fp8["q"].clone()
    q.view(torch.uint8)[0, 0] = 0x7F
    with raises(r"parts\['q'\] holds the e4m3fn NaN"):
        FP8().dequantize({**fp8, "q": q})
    nv = NVFP4().quantize(w)
    with raises(r"parts\['s2'\]"):
        NVFP4().dequantize({**nv, "s2": torch.zeros(1)})
    mx = MXFP4().quantize(w)
    with raises(r"parts\['s'\] holds the e8m0 NaN"):
        MXFP4().dequantize({**mx, "s": torch.full_like(mx["s"], 255)})
    zp = INT4(zero_points=True)
    i4 = zp.quantize(w)
    with raises(r"parts\['z'\]"):
        zp.dequantize({**i4, "z": torch.full_like(i4["z"], 16)})


def test_int4_zero_points_dequantize_q_minus_z():
    fmt, w = INT4(zero_points=True), torch.randn(3, 256)
    parts = fmt.quantize(w)
    assert torch.equal(fmt.dequantize(parts), INT4().dequantize({"q": parts["q"], "s": parts["s"]}))
    z = torch.randint(0, 16, parts["z"].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = fmt.dequantize({**parts, "z": z}).numpy()
    want = ref.reference_dequantize("int4", {k: ref.raw(v) for k, v in {**parts, "z": z}.items()}, 3, 256)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_registry():
    assert format_names() == ["bf16", "fp8", "int4", "mxfp4", "nvfp4"]
    assert all(get_format(n).name == n for n in format_names())
    for bad in ("fp4", "BF16", None):
        with raises(r"unknown expert format .* \(--moe-expert-format\): choose one of bf16, fp8, int4, mxfp4, nvfp4"):
            get_format(bad)


@pytest.mark.parametrize("name", ["bf16", "fp8", "nvfp4", "mxfp4", "int4"])
def test_slots_for_budget_is_the_floor_of_the_budget_over_the_expert(name):
    from expertcache.formats import GIB, get_format, slots_for_budget

    fmt = get_format(name)
    per = fmt.expert_bytes(2048, 768)
    for gib in (0.5, 1, 8, 23.75):
        slots = slots_for_budget(gib, fmt, 2048, 768)
        assert slots * per <= gib * GIB < (slots + 1) * per
    assert slots_for_budget(per / GIB, fmt, 2048, 768) == 1


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "8", None])
def test_slots_for_budget_refuses_a_budget_by_flag(bad):
    from expertcache.formats import get_format, slots_for_budget

    with pytest.raises(FormatError, match="--moe-cache-gb"):
        slots_for_budget(bad, get_format("bf16"), 2048, 768)
    with pytest.raises(FormatError, match="holds no bf16 expert"):
        slots_for_budget(0.001, get_format("bf16"), 2048, 768)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_a_stacked_matrix_is_its_sub_matrices_quantized_alone(fmt):
    """gate_up (stack 2): each part is gate_proj's part over up_proj's; each keeps its own scales."""
    gen = torch.Generator().manual_seed(11)
    gate, up = torch.randn(260, 256, generator=gen), 8 * torch.randn(260, 256, generator=gen)
    parts = fmt.quantize(torch.cat([gate, up]), stack=2)
    halves = fmt.quantize(gate), fmt.quantize(up)
    for k, v in parts.items():
        assert torch.equal(v.view(torch.uint8), torch.cat([h[k] for h in halves]).view(torch.uint8)), k
    assert [(p.suffix, p.shape) for p in fmt.layout(520, 256, stack=2)] == [
        (k, tuple(v.shape)) for k, v in parts.items()
    ]
    deq = fmt.dequantize(parts, stack=2)
    assert torch.equal(deq, torch.cat([fmt.dequantize(h) for h in halves]))
    assert fmt.matrix_bytes(520, 256, 2) == sum(t.numel() * t.element_size() for t in parts.values())
    with raises(r"out_features=5 is not a multiple of stack=2"):
        fmt.layout(5, 256, stack=2)
    with raises(r"stack must be a positive int"):
        fmt.layout(4, 256, stack=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("sub_rows", [256, 130])
def test_a_group_of_stacked_matrices_decodes_as_numpy_decodes_each_half(fmt, sub_rows):
    """decode_batch of 3 gate_up matrices (stack 2) of whole 128-blocks and groups (sub_rows 256: int4,
    mxfp4 and fp8 decode the stack as one matrix, broadcasting their scales) and of a partial block of
    rows (130): each half of each matrix bit for bit the numpy decode of its own parts."""
    gen = torch.Generator().manual_seed(sub_rows)
    mats = [torch.randn(2 * sub_rows, 256, generator=gen) * 4 ** i for i in range(3)]
    parts = [fmt.quantize(m, stack=2) for m in mats]
    got = fmt.decode_batch({k: torch.stack([p[k] for p in parts]) for k in parts[0]}, 2 * sub_rows, 256, 2)
    for g, p in zip(got, parts):
        for half in range(2):
            sub = {k: ref.raw(v.chunk(2)[half]) for k, v in p.items()}
            want = ref.reference_dequantize(fmt.name, sub, sub_rows, 256)
            have = g[half * sub_rows:(half + 1) * sub_rows].numpy()
            assert np.array_equal(have.view(np.uint32), want.view(np.uint32)), (fmt.name, half)


def test_stacking_changes_the_scale_shapes_where_a_block_would_span_both():
    # fp8: 2 x ceil(130 / 128) scale rows, not ceil(260 / 128); nvfp4: one global scale per sub-matrix
    assert FP8().layout(260, 256, stack=2)[1].shape == (4, 2) and FP8().layout(260, 256)[1].shape == (3, 2)
    assert NVFP4().layout(64, 32, stack=2)[2].shape == (2,) and NVFP4().layout(64, 32)[2].shape == (1,)
    from expertcache.formats import Float16, Float32, dense_format, resolve_format

    assert dense_format("bfloat16") is get_format("bf16") and resolve_format("float32") == Float32()
    assert Float16().expert_banks(8, 4) == (Bank("gate_up", (8, 8), torch.float16), Bank("down", (8, 4), torch.float16))
    with raises(r"no dense expert format for dtype 'int8'"):
        dense_format("int8")
    with raises(r"unknown expert format 'float64'"):
        resolve_format("float64")


def test_e2m1_encode_is_the_nearest_code_ties_to_even():
    """packing.e2m1_encode against the numpy brute force (nearest magnitude, ties to the even code, 6 above
    6) at every magnitude and midpoint, one float32 step either side of each, and random values over every
    range; the sign bit where x < 0 (-0.0 encodes as +0)."""
    from expertcache.formats.packing import E2M1_MAGNITUDES, E2M1_MIDPOINTS, e2m1_encode

    pts = np.array(E2M1_MAGNITUDES + E2M1_MIDPOINTS + (6.5, 7.0, 1e4), np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    rng = np.random.default_rng(3)
    mags = np.concatenate([near, rng.random(200_000).astype(np.float32) * 8, np.abs(rng.standard_normal(
        50_000)).astype(np.float32) * 1e-30]).astype(np.float32)
    x = np.concatenate([mags, -mags, np.array([-0.0], np.float32)])
    want = ref.nearest_code(np.abs(x), ref.E2M1_VALUES, ref.E2M1_CODES) | ((x < 0) << 3)
    got = e2m1_encode(torch.from_numpy(x)).numpy()
    assert got.dtype == np.uint8 and np.array_equal(got, want.astype(np.uint8))
    huge = torch.tensor([1e30, 3.4e38, -1e30, -3.4e38])  # beyond the brute force's float64 distances
    assert e2m1_encode(huge).tolist() == [7, 7, 15, 15]
