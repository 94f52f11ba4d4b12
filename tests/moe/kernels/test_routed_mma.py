"""The routed GEMM on the tensor cores (moe.kernels.routed_mma) against the torch reference that
dequantizes the same bytes (routed_reference), in every expert format.

    random experts ─format.quantize─► SlotMatrix gate_up [S, 2I, H], down [S, H, I] (or dense bf16 / f32)
    routed_experts_mma (Triton: the interpreter on the CPU, its bfloat16 dots multiplied as float32;
    compiled on a GPU) vs routed_reference: |got - ref| <= 1e-4 * max|ref|; slots outside [0, S) add
    nothing; two calls bitwise equal; more tokens on one slot than a tile takes (block_m) run in turns;
    gpt-oss's clamped SwiGLU with biases; the fused combine (addend, cast); every format at T = 1, 2, 8,
    16, 64 with SiLU and with the clamped SwiGLU; bad arguments named
every format's three launches compile for sm_90 with wgmma dots whose first operand (the decoded weights)
is in registers, and no local memory (no GPU)
GPU (`gpu`): the Qwen3-30B-A3B and Qwen3-Next expert shapes at T = 1..64, gpt-oss-20b's at 1..16, eager and graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.kernels.routed import NO_SLOT, routed_reference
from moe.kernels.routed_mma import MMA_MAX_TOKENS, check_mma_capability, routed_experts_mma
from moe.kernels.tiles import MmaTiles
from moe.model.slot_matrix import SlotMatrix
from tests.conftest import compile_check, device_or_skip
from tests.moe.kernels.test_routed import assert_close, make_route
from tests.moe.kernels.test_routed_formats import FORMATS, make_pool
from tests.moe.kernels.test_routed_gpt_oss import OAI, make_biases

SMALL = MmaTiles(block_m=16, block_n=32, down_block_n=32, block_h=64)
H, I = 160, 96  # int4 groups and fp8 blocks partial at both edges (H = 128 + 32, I < 128)


def _dense_pool(dtype, slots: int, hidden: int, inter: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (SlotMatrix.dense((torch.randn(slots, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device),
                             stack=2),
            SlotMatrix.dense((torch.randn(slots, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(device)))


def _pool(name: str, device, slots: int = 6, hidden: int = H, inter: int = I, seed: int = 1):
    if name in FORMATS:
        return make_pool(FORMATS[name], slots, hidden, inter, device, seed)
    return _dense_pool({"bf16": torch.bfloat16, "float32": torch.float32}[name], slots, hidden, inter, device, seed)


@pytest.mark.parametrize("name", [*sorted(FORMATS), "bf16"])
def test_matches_the_reference_of_the_same_bytes(name):
    device, _ = device_or_skip()
    gate_up, down = _pool(name, device)
    slots, weights = make_route(2, 3, 6, device, seed=2, pad=1)
    slots[1, 0] = 9  # >= S: adds nothing
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    got = routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL)
    assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-4)
    assert torch.equal(got, routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL))
    dropped = slots.clone()
    dropped[1, 0] = NO_SLOT
    assert torch.equal(got, routed_experts_mma(x, dropped, weights, gate_up, down, tiles=SMALL))


@pytest.mark.parametrize("name, dtype", [("int4", torch.float32), ("float32", torch.float32),
                                         ("nvfp4", torch.float16)])
def test_float32_and_float16_activations_multiply_in_float32(name, dtype):
    device, _ = device_or_skip()
    gate_up, down = _pool(name, device, seed=4)
    slots, weights = make_route(2, 3, 6, device, seed=5, pad=0)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    got = routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL)
    assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-5 if name == "float32" else 1e-4)


def test_a_slot_twice_in_one_row_is_two_pairs():
    """Forced routing may repeat an expert in a token's row: each (t, j) is its own member, weighted
    alone, as the one-program-a-pair kernels and the reference count it."""
    device, _ = device_or_skip()
    gate_up, down = _pool("int4", device, slots=6, hidden=128, inter=32, seed=15)
    slots = torch.tensor([[0, 1, 2], [3, 3, 5]], dtype=torch.int32, device=device)
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(16)).to(device)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(17)).bfloat16().to(device)
    got = routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL)
    assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-4)


def test_more_tokens_on_a_slot_than_a_tile_takes_run_in_turns():
    """24 tokens over 4 slots, top-3: about 18 tokens a slot, more than block_m = 16."""
    device, _ = device_or_skip()
    gate_up, down = _pool("mxfp4", device, slots=4, hidden=64, inter=32, seed=7)
    slots, weights = make_route(24, 3, 4, device, seed=8, pad=2)
    assert max(int((slots == s).sum()) for s in range(4)) > SMALL.block_m
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(9)).bfloat16().to(device)
    got = routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL)
    assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-4)


def test_gpt_oss_clamped_swiglu_with_biases_and_the_fused_combine():
    device, gpu = device_or_skip()
    gate_up, down = make_pool(FORMATS["mxfp4"], 6, 64, 32, device, seed=10)
    slots, weights = make_route(3, 4, 6, device, seed=11, pad=1)
    x = (6 * torch.randn(3, 64, generator=torch.Generator().manual_seed(12))).bfloat16().to(device)
    b13, b2 = make_biases(6, 64, 32, torch.bfloat16, device, seed=13, scale=2.0)
    cfg = OAI
    want = routed_reference(x, slots, weights, gate_up, down, cfg=cfg, gate_up_bias=b13, down_bias=b2)
    got = routed_experts_mma(x, slots, weights, gate_up, down, cfg=cfg, gate_up_bias=b13, down_bias=b2, tiles=SMALL)
    assert_close(got, want, 1e-4)
    addend = torch.randn(3, 64, generator=torch.Generator().manual_seed(14)).to(device)
    out = torch.empty(3, 64, device=device)
    cast = torch.empty(3, 64, dtype=torch.bfloat16, device=device)
    assert routed_experts_mma(x, slots, weights, gate_up, down, cfg=cfg, gate_up_bias=b13, down_bias=b2,
                              addend=addend, out=out, out_cast=cast, tiles=SMALL) is out
    assert torch.equal(out, got + addend)
    if gpu:  # the interpreter stores a bfloat16 by truncating the float32 bits
        assert torch.equal(cast, out.bfloat16())


@pytest.mark.parametrize("act", ["silu", "clamped-swiglu"])
@pytest.mark.parametrize("tokens", [1, 2, 8, 16, pytest.param(64, marks=pytest.mark.slow)])  # 64: the long profile
@pytest.mark.parametrize("name", [*sorted(FORMATS), "bf16"])
def test_every_format_from_1_to_64_tokens_silu_and_clamped_swiglu(name, tokens, act):
    """The weights are the dots' register operand, a block's columns in each format's order and the
    activations permuted alike: fresh random pools, routes and inputs at T = 1..64 (64: about 32 members
    a slot, two tiles in turn), SiLU and gpt-oss's clamped SwiGLU with both biases."""
    device, _ = device_or_skip()
    seed = 1000 + 97 * tokens + 31 * sorted(FORMATS).index(name) if name in FORMATS else 7000 + tokens
    seed += 500 if act == "silu" else 0
    gate_up, down = _pool(name, device, slots=8, seed=seed)
    slots, weights = make_route(tokens, 4, 8, device, seed=seed + 1, pad=tokens // 4)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed + 2))
    kw = {}
    if act != "silu":  # hidden scaled so that a good share of the gate / up dots pass the clamp limit
        x = 6 * x
        b13, b2 = make_biases(8, H, I, torch.bfloat16, device, seed=seed + 3, scale=2.0)
        kw = {"cfg": dataclasses.replace(OAI, hidden=H, expert_intermediate=I), "gate_up_bias": b13, "down_bias": b2}
    x = x.bfloat16().to(device)
    got = routed_experts_mma(x, slots, weights, gate_up, down, tiles=SMALL, **kw)
    assert_close(got, routed_reference(x, slots, weights, gate_up, down, **kw), 1e-4)


def test_bad_arguments_are_named():
    gate_up, down = _pool("fp8", "cpu", slots=2, hidden=128, inter=32)
    x, w = torch.zeros(1, 128, dtype=torch.bfloat16), torch.ones(1, 2)
    slots = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="tiles must be a MmaTiles"):
        routed_experts_mma(x, slots, w, gate_up, down, tiles=None)
    big = torch.zeros(MMA_MAX_TOKENS + 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"hidden has {MMA_MAX_TOKENS + 1} tokens; 1..{MMA_MAX_TOKENS}"):
        routed_experts_mma(big, slots, w, gate_up, down)
    _, other = _pool("nvfp4", "cpu", slots=2, hidden=128, inter=32)
    with pytest.raises(ValueError, match=r"down must be .* in gate_up's format fp8"):
        routed_experts_mma(x, slots, w, gate_up, other)
    odd_up, odd_down = _pool("fp8", "cpu", slots=2, hidden=128, inter=30)
    with pytest.raises(ValueError, match=r"mma_down: down is fp8 with 30 input columns; .*\(a multiple of 4\)"):
        routed_experts_mma(x, slots, w, odd_up, odd_down)
    assert MmaTiles().grids(3, 8, 2048, 768) == ((24, 24), (24, 32), (3, 8))
    with pytest.raises(ValueError, match="is not like"):
        MmaTiles.from_name("m16-i32w4-h64w4-c256w2-k2")
    assert MmaTiles.from_name("m32-i64w8-h16w2-c128w4") == MmaTiles(32, 64, 8, 16, 2, 128, 4)
    assert MmaTiles.from_name(MmaTiles().name) == MmaTiles()
    with pytest.raises(ValueError, match="'m16-i32' is not like m16-i32w4-h64w4-c256w2"):
        MmaTiles.from_name("m16-i32")
    for field, value in (("block_m", 8), ("block_n", 12), ("warps_down", 32)):
        with pytest.raises(ValueError, match=f"MmaTiles.{field} must be"):
            MmaTiles(**{field: value})


SM90 = """
import json
import re
from moe.kernels.routed_mma import compile_mma_for_target
from moe.kernels.tiles import MmaTiles
from moe.model.config import MoEConfig
REGISTER_A = r"wgmma[.]mma_async[^;]*[}], *[{]"  # {accumulators}, {the first operand's registers}, descriptor
found = {}
for fmt, tokens, bias, dtype in (("fp8", 1, False, "bf16"), ("nvfp4", 8, False, "bf16"), ("mxfp4", 64, True, "bf16"),
                                 ("int4", 16, False, "bf16"), ("bf16", 2, False, "bf16"), ("int4", 4, False, "fp16"),
                                 ("nvfp4", 2, False, "fp32")):
    cfg = MoEConfig(hidden=2880, num_experts=32, top_k=4, expert_intermediate=2880, norm_topk_prob=True,
                    activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0, expert_bias=True,
                    router_bias=True) if bias else None
    shape = (4, 2880, 2880) if bias else (8, 2048, 768)
    asm = compile_mma_for_target(*shape, dtype, tokens=tokens, expert_format=fmt, cfg=cfg, expert_bias=bias)
    found[fmt + "-" + dtype] = {name: [a["ptx"].count("wgmma.mma_async"), len(re.findall(REGISTER_A, a["ptx"])),
                                       a["ptx"].count("ld.local") + a["ptx"].count("st.local"),
                                       a["ptx"].count("griddepcontrol.wait"),
                                       a["ptx"].count("griddepcontrol.launch_dependents")]
                                for name, a in asm.items()}
print(json.dumps(found))
"""


def test_every_format_compiles_for_sm90_on_the_tensor_cores():
    """bf16 activations multiply on Hopper's wgmma, every one reading the decoded weights from registers;
    float16 and float32 ones (float32 dots, "ieee") compile too, the code after a constexpr branch's
    return included. Every launch is programmatic: each waits for its predecessors once, the gate_up
    and the down let their successor launch."""
    found = compile_check(SM90)
    assert sorted(found) == ["bf16-bf16", "fp8-bf16", "int4-bf16", "int4-fp16", "mxfp4-bf16", "nvfp4-bf16",
                             "nvfp4-fp32"]
    for variant, kernels in found.items():
        assert sorted(kernels) == ["_combine", "_down_mma", "_gate_up_mma"], variant
        for name, (wgmma, register_a, local, wait, release) in kernels.items():
            assert local == 0, f"{variant} {name} spills to local memory"
            assert register_a == wgmma, (variant, name, wgmma, register_a)
            assert (wait, release) == (1, int(name != "_combine")), (variant, name, wait, release)
            if variant.endswith("-bf16"):
                assert (wgmma > 0) == (name != "_combine"), (variant, name, wgmma)


# ---------------------------------------------------------------- GPU: the real expert shapes

SHAPES = {"qwen3-30b": (2048, 768, 8), "qwen3-next": (2048, 512, 10), "gpt-oss-20b": (2880, 2880, 4)}
# the float32 reference gathers T * k experts (gpt-oss-20b's are 99.5 MB each in float32): its T stop at 16
TOKENS = {"qwen3-30b": (1, 2, 4, 8, 16, 32, 64), "qwen3-next": (1, 2, 4, 8, 16, 32, 64),
          "gpt-oss-20b": (1, 2, 4, 8, 16)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*sorted(FORMATS), "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_real_shapes_from_1_to_64_tokens(name, shape):
    hidden, inter, top_k = SHAPES[shape]
    gate_up, down = _pool(name, "cuda", slots=48, hidden=hidden, inter=inter, seed=21)
    for tokens in TOKENS[shape]:
        slots, weights = make_route(tokens, top_k, 48, "cuda", seed=tokens, pad=tokens // 4)
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        got = routed_experts_mma(x, slots, weights, gate_up, down)
        assert_close(got, routed_reference(x, slots, weights, gate_up, down), 1e-4)
        assert torch.equal(got, routed_experts_mma(x, slots, weights, gate_up, down))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int4", "nvfp4", "fp8"])
def test_gpu_graph_replay_equals_eager(name):
    gate_up, down = _pool(name, "cuda", slots=32, hidden=2048, inter=768, seed=31)
    slots, weights = make_route(8, 8, 32, "cuda", seed=32, pad=3)
    x = torch.randn(8, 2048, device="cuda").bfloat16()
    out = torch.empty(8, 2048, device="cuda")
    eager = routed_experts_mma(x, slots, weights, gate_up, down, out=out).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed_experts_mma(x, slots, weights, gate_up, down, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9)])
def test_a_gpu_before_hopper_is_refused_naming_the_variable(capability):
    with pytest.raises(ValueError) as err:
        check_mma_capability(capability)
    assert "EXPERTCACHE_ROUTED_MMA=0" in str(err.value) and f"is {capability[0]}.{capability[1]}" in str(err.value)


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 0)])
def test_hopper_and_later_run_the_kernels(capability):
    check_mma_capability(capability)
