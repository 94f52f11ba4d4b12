"""The routed GEMM over quantized slots (fp8, nvfp4, mxfp4, int4, int4 with zero points) against the torch
reference that dequantizes the same bytes (moe.kernels.routed.routed_reference of a SlotMatrix).

    random bf16 experts ─format.quantize (gate over up: stack 2)─► SlotMatrix gate_up [S, 2I, H], down [S, H, I]
    routed_experts / routed_gate_up + routed_down (Triton: the interpreter on the CPU, compiled on a GPU)
        vs routed_reference: |got - ref| <= 1e-4 * max|ref| (float32 sums of the same products in
        another order; the interpreter and the GPU alike), padding and out-of-range slots add nothing,
        two calls bitwise equal, the early hits + rest bitwise one gate_up
Shapes: tiny on the CPU (H and I that no tile divides; fp8 blocks and int4 groups partial at the edge),
the Qwen3-30B-A3B and Qwen3-Next expert shapes on the GPU (`gpu`).
"""

from __future__ import annotations

import math

import pytest
import torch

from expertcache.formats import INT4, get_format
from moe.kernels.plan import QUANTIZED_ROUTED_TILES
from moe.kernels.routed import NO_SLOT, routed_down, routed_experts, routed_gate_up, routed_reference
from moe.kernels.tiles import RoutedTiles
from moe.model.reference import shared_expert
from moe.model.slot_matrix import SlotMatrix, dequantize_rows
from tests.conftest import compile_check, device_or_skip
from tests.moe.kernels.test_routed import assert_close, make_route

FORMATS = {"fp8": get_format("fp8"), "nvfp4": get_format("nvfp4"), "mxfp4": get_format("mxfp4"),
           "int4": get_format("int4"), "int4-f16-z": INT4(scale_dtype="float16", zero_points=True)}


def make_pool(fmt, slots: int, hidden: int, inter: int, device, seed: int) -> tuple[SlotMatrix, SlotMatrix]:
    """Random experts (N(0, 1/fan_in), never zero) quantized to `fmt`; int4 zero points drawn at random."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, fan_in):
        w = torch.randn(*shape, generator=g) / math.sqrt(fan_in)
        return torch.where(w == 0, 1e-3, w).bfloat16()

    def matrix(w, out, inn, stack):
        parts = fmt.quantize(w.reshape(slots * out, inn), stack=slots * stack)
        if "z" in parts:
            parts["z"] = torch.randint(0, 16, parts["z"].shape, dtype=torch.uint8, generator=g)
        layout = fmt.layout(out, inn, stack)
        return SlotMatrix(fmt, tuple(parts[p.suffix].reshape(slots, *p.shape).to(device) for p in layout),
                          out, inn, stack)

    return (matrix(rnd(slots, 2 * inter, hidden, fan_in=hidden), 2 * inter, hidden, 2),
            matrix(rnd(slots, hidden, inter, fan_in=inter), hidden, inter, 1))


def format_pools(name: str, seed: int) -> tuple[SlotMatrix, SlotMatrix]:
    """gate_up (stack 2) and down of 3 slots in format `name` (FORMATS, or the dense bf16 / float32)."""
    if name in FORMATS:
        return make_pool(FORMATS[name], 3, 128, 64, "cpu", seed=seed)
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    g = torch.Generator().manual_seed(seed)
    return (SlotMatrix.dense(torch.randn(3, 128, 128, generator=g).to(dtype), stack=2),
            SlotMatrix.dense(torch.randn(3, 128, 64, generator=g).to(dtype)))


@pytest.mark.parametrize("name", [*sorted(FORMATS), "bf16", "float32"])
def test_dequantize_one_is_the_formats_dequantize_of_that_slot_bitwise(name):
    """The per-slot decode (no stack copy; a dense stack in one cast) gives the format's checked
    dequantize of the slot's parts, sub-matrix by sub-matrix."""
    for m in format_pools(name, seed=11):
        for slot in (0, 2):
            one = m.dequantize_one(slot)
            assert one.dtype == torch.float32 and one.shape == (m.out_features, m.in_features)
            parts = {p.suffix: t[slot] for p, t in zip(m.fmt.layout(m.out_features, m.in_features, m.stack), m.parts)}
            assert torch.equal(one, m.fmt.dequantize(parts, m.stack))
            assert torch.equal(m.dequantize([slot])[0], one)


@pytest.mark.parametrize("name", [*sorted(FORMATS), "bf16", "float32"])
def test_dequantize_rows_decodes_a_group_of_several_matrices_bitwise(name):
    """prefill's group decode: rows of two matrices of one format (a pool's and a ring's), slots in any
    order and repeated, give each row's dequantize_one bit for bit, in new memory."""
    pools = (format_pools(name, seed=21), format_pools(name, seed=22))
    for i in (0, 1):  # gate_up, down
        rows = [(pools[0][i], 2), (pools[1][i], 0), (pools[0][i], 0), (pools[1][i], 2), (pools[0][i], 2)]
        got = dequantize_rows(rows, "cpu")
        assert got.dtype == torch.float32 and got.shape == (len(rows), rows[0][0].out_features, rows[0][0].in_features)
        for g, (m, slot) in zip(got, rows):
            assert torch.equal(g, m.dequantize_one(slot))
        owned = {t.untyped_storage().data_ptr() for m, _ in rows for t in m.parts}
        assert got.untyped_storage().data_ptr() not in owned
    with pytest.raises(ValueError, match="rows must be of one format"):
        dequantize_rows([(pools[0][0], 0), (pools[0][1], 0)], "cpu")
    with pytest.raises(ValueError, match="rows is empty"):
        dequantize_rows([], "cpu")


# chunks of 64 inputs (two tiles of 32 for the 128-blocks of fp8 and int4, four of 16 for nvfp4)
SMALL = RoutedTiles(block_i=8, chunk_h=64, warps_gate_up=2, block_h=16, chunk_i=32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_matches_the_reference_of_the_same_bytes(name):
    """H 96, I 48 (32 for mxfp4): no chunk divides H; the fp8 blocks and int4 groups are partial."""
    device, _ = device_or_skip()
    inter = 32 if name == "mxfp4" else 48  # mxfp4: inputs a multiple of 32
    gate_up, down = make_pool(FORMATS[name], 5, 96, inter, device, seed=1)
    slots, weights = make_route(2, 3, 5, device, seed=2, pad=1)
    slots[1, 2] = 9  # >= S: adds nothing
    hidden_t = torch.randn(2, 96, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    tiles = SMALL
    got = routed_experts(hidden_t, slots, weights, gate_up, down, tiles=tiles)
    want = routed_reference(hidden_t, slots, weights, gate_up, down)
    assert_close(got, want, 1e-4)
    assert torch.equal(got, routed_experts(hidden_t, slots, weights, gate_up, down, tiles=tiles))
    dropped = slots.clone()
    dropped[1, 2] = NO_SLOT
    assert torch.equal(got, routed_experts(hidden_t, dropped, weights, gate_up, down, tiles=tiles))


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "int4-f16-z"])
def test_hits_and_rest_are_one_gate_up_and_the_combine_fuses(name):
    device, gpu = device_or_skip()
    gate_up, down = make_pool(FORMATS[name], 6, 64, 32, device, seed=4)
    slots, weights = make_route(2, 3, 6, device, seed=5, pad=0)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    want = routed_gate_up(x, slots, weights, gate_up, act=torch.empty(6, 32, device=device), tiles=SMALL).clone()
    hit = torch.tensor([[True, False, True], [False, True, False]], device=device)
    pre = torch.where(hit, slots, torch.full_like(slots, NO_SLOT))
    act = torch.full((6, 32), float("nan"), device=device)
    routed_gate_up(x, slots, weights, gate_up, act=act, part="hits", pre=pre, programs=2, tiles=SMALL)
    routed_gate_up(x, slots.clone(), weights, gate_up, act=act, part="rest", pre=pre, tiles=SMALL)
    assert torch.equal(act, want)
    addend = torch.randn(2, 64, generator=torch.Generator().manual_seed(7)).to(device)
    cast = torch.empty(2, 64, dtype=torch.bfloat16, device=device)
    out = routed_down(want, slots, down, addend=addend, out=torch.empty(2, 64, device=device), out_cast=cast,
                      tiles=SMALL)
    assert torch.equal(out, routed_down(want, slots, down, tiles=SMALL) + addend)
    if gpu:
        assert torch.equal(cast, out.bfloat16())


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_a_quantized_shared_expert(name):
    """The gated one-slot call (the shared expert) over a quantized pool: sigmoid(x · gate_w) times the
    expert of the decoded bytes."""
    device, _ = device_or_skip()
    gate_up, down = make_pool(FORMATS[name], 1, 64, 32, device, seed=9)
    gate_w = (torch.randn(1, 64, generator=torch.Generator().manual_seed(10)) / 8).bfloat16().to(device)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(11)).bfloat16().to(device)
    zeros = torch.zeros(2, 1, dtype=torch.int32, device=device)
    got = routed_experts(x, zeros, None, gate_up, down, gate_w=gate_w, act=torch.empty(8, 32, device=device),
                         tiles=SMALL)
    want = shared_expert(x, (gate_up.dequantize([0])[0], down.dequantize([0])[0], gate_w))
    assert_close(got, want, 1e-4)


def test_a_format_mismatch_is_named():
    gate_up, _ = make_pool(FORMATS["fp8"], 2, 64, 32, "cpu", seed=8)
    _, down = make_pool(FORMATS["nvfp4"], 2, 64, 32, "cpu", seed=8)
    x, slots, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"down must be .* in gate_up's format fp8"):
        routed_experts(x, slots, w, gate_up, down)
    with pytest.raises(ValueError, match=r"part 's' must be a contiguous float32"):
        SlotMatrix(gate_up.fmt, (gate_up.parts[0], gate_up.parts[1].double()), 64, 64, 2)


SM90_FORMATS = r"""
import json
from moe.kernels.plan import QUANTIZED_ROUTED_TILES
from moe.kernels.routed_host import compile_for_target
out = {}
for fmt in ("fp8", "nvfp4", "mxfp4", "int4", "int4-f16-z"):
    asm = compile_for_target(8, 2048, 768, "bf16", tiles=QUANTIZED_ROUTED_TILES, expert_format=fmt, shared_format=fmt)
    out[fmt] = sorted(name for name, a in asm.items() if a.get("cubin"))
print(json.dumps(out))
"""


def test_every_format_compiles_for_sm90():
    """Every variant the layer launches, for every quantized format, at the Qwen3-30B-A3B shape (a child
    process without the interpreter)."""
    names = ["_down_kernel", "_down_kernel+combine", "_gate_up_hits", "_gate_up_kernel", "_gate_up_kernel+rest",
             "_shared_down", "_shared_gate_up"]
    assert compile_check(SM90_FORMATS) == {f: names for f in ("fp8", "nvfp4", "mxfp4", "int4", "int4-f16-z")}


# ---------------------------------------------------------------- GPU: the real expert shapes

SHAPES = {"qwen3-30b": (2048, 768, 8), "qwen3-next": (2048, 512, 10)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_real_shapes(name, shape):
    """T = 1, 2 and 8 in one test: one compile of the format's kernels per (format, shape), which the
    T values share (T only sizes the grids)."""
    hidden, inter, top_k = SHAPES[shape]
    for tokens in (1, 2, 8):
        gate_up, down = make_pool(FORMATS[name], 24, hidden, inter, "cuda", seed=tokens)
        slots, weights = make_route(tokens, top_k, 24, "cuda", seed=tokens + 1, pad=tokens // 2)
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        got = routed_experts(x, slots, weights, gate_up, down, tiles=QUANTIZED_ROUTED_TILES)
        assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-4)
        assert torch.equal(got, routed_experts(x, slots, weights, gate_up, down, tiles=QUANTIZED_ROUTED_TILES))
