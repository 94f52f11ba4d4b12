"""routed_experts (Triton, from the slot pool by slot id) against torch references built from the same pool.

Legend: T = tokens, H = hidden, I = expert width, k = top_k, S = pool slots. CPU runs use Triton's
interpreter (tests/conftest.py), so their shapes are tiny; the `gpu` tests use the Qwen3-Next shape.
"""

import math

import pytest
import torch

from moe.kernels.plan import GEMV_MAX_TOKENS, make_routed_plan
from moe.kernels.routed import (
    NO_SLOT,
    routed_down,
    routed_experts,
    routed_gate_up,
    routed_grids,
    routed_reference,
    routed_scratch,
)
from moe.kernels.tiles import RoutedTiles
from moe.model.config import MoEConfig
from moe.model.reference import expert_mlp, moe_reference, route, shared_expert
from tests.conftest import compile_check, device_or_skip

QWEN3_NEXT = {"hidden": 2048, "inter": 512, "top_k": 10}  # H, I, k of the Qwen3-Next-like layer


def make_pool(slots: int, hidden: int, inter: int, dtype: torch.dtype, device, seed: int):
    """(gate_up [S, 2I, H], down [S, H, I]) of random, never-zero weights with unit-variance linears."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, fan_in):
        w = torch.randn(*shape, generator=g) / math.sqrt(fan_in)
        return torch.where(w == 0, 1e-3, w).to(dtype).to(device)

    return rnd(slots, 2 * inter, hidden, fan_in=hidden), rnd(slots, hidden, inter, fan_in=inter)


def make_route(tokens: int, top_k: int, num_slots: int, device, seed: int, pad: int = 1):
    """slots [T, k] int32 (k distinct per token, repeats across tokens, `pad` entries NO_SLOT) and
    weights [T, k] float32 in [0.05, 1)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:top_k] for _ in range(tokens)])
    flat = slots.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:pad]] = NO_SLOT
    weights = 0.05 + 0.95 * torch.rand(tokens, top_k, generator=g)
    return slots.to(torch.int32).to(device), weights.to(device)


def per_pair_reference(hidden, slots, weights, gate_up, down) -> torch.Tensor:
    """Σ_j weights[t, j] * expert_mlp(hidden[t], pool[slots[t, j]]) in float32, one (t, j) at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if 0 <= s < gate_up.shape[0]:
                out[t] += float(weights[t, j]) * expert_mlp(hidden[t:t + 1], gate_up[s], down[s])[0]
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """|got - want| <= rel * max|want| elementwise (float32 sums of the same products, any order)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    assert scale > 0
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


# ---------------------------------------------------------------- correctness (CPU interpreter or GPU)


@pytest.mark.parametrize("dtype, tokens, top_k", [
    (torch.bfloat16, 1, 2), (torch.bfloat16, 8, 4), (torch.float16, 3, 3), (torch.float32, 5, 2),
])
def test_matches_per_pair_reference(dtype, tokens, top_k):
    device, _ = device_or_skip()
    gate_up, down = make_pool(12, 64, 32, dtype, device, seed=tokens)
    slots, weights = make_route(tokens, top_k, 12, device, seed=top_k, pad=1)
    flat = slots.view(-1).tolist()
    live = [s for s in flat if s != NO_SLOT]
    assert NO_SLOT in flat and (tokens < 3 or len(set(live)) < len(live))  # padding and repeats covered
    hidden = torch.randn(tokens, 64).to(dtype).to(device)
    got = routed_experts(hidden, slots, weights, gate_up, down)
    assert_close(got, per_pair_reference(hidden, slots, weights, gate_up, down), 1e-4)
    assert_close(got, routed_reference(hidden, slots, weights, gate_up, down), 1e-4)


@pytest.mark.parametrize("tiles", [
    RoutedTiles(block_i=8, chunk_h=32, warps_gate_up=2, block_h=32, chunk_i=16, warps_down=1),
    RoutedTiles(block_i=64, chunk_h=64, block_h=1, chunk_i=8),
])
def test_uneven_shapes_and_other_tiles(tiles):
    """H and I that no tile divides: every row and column mask is exercised."""
    device, _ = device_or_skip()
    gate_up, down = make_pool(7, 48, 20, torch.bfloat16, device, seed=3)
    slots, weights = make_route(4, 3, 7, device, seed=4, pad=2)
    hidden = torch.randn(4, 48).bfloat16().to(device)
    got = routed_experts(hidden, slots, weights, gate_up, down, tiles=tiles)
    assert_close(got, per_pair_reference(hidden, slots, weights, gate_up, down), 1e-4)


def test_matches_moe_reference_through_a_slot_map():
    """moe_reference on the expert tensors == routed_experts on a pool holding them at permuted slots."""
    device, _ = device_or_skip()
    cfg = MoEConfig(hidden=64, num_experts=10, top_k=3, expert_intermediate=32, norm_topk_prob=True)
    gate_up_e, down_e = make_pool(cfg.num_experts, 64, 32, torch.bfloat16, device, seed=5)  # by expert
    router_w = (torch.randn(cfg.num_experts, 64) / 4).bfloat16().to(device)
    hidden = torch.randn(6, 64).bfloat16().to(device)
    slot_of = torch.randperm(16, generator=torch.Generator().manual_seed(6))[:cfg.num_experts].to(device)
    gate_up = torch.zeros(16, 64, 64, dtype=torch.bfloat16, device=device)  # S = 16 > E: spare slots
    down = torch.zeros(16, 64, 32, dtype=torch.bfloat16, device=device)
    gate_up[slot_of], down[slot_of] = gate_up_e, down_e
    weights, ids = route(hidden, router_w, cfg.top_k, cfg.norm_topk_prob)
    slots = slot_of[ids.long()].to(torch.int32)
    got = routed_experts(hidden, slots, weights, gate_up, down)
    want = moe_reference(hidden, router_w, gate_up_e, down_e, cfg)  # bf16, rounded once
    assert_close(got.bfloat16().float(), want.float(), 1e-2)


def test_empty_and_out_of_range_slots_add_nothing():
    device, _ = device_or_skip()
    gate_up, down = make_pool(6, 64, 32, torch.bfloat16, device, seed=7)
    hidden = torch.randn(2, 64).bfloat16().to(device)
    weights = torch.rand(2, 3, device=device)
    empty = torch.full((2, 3), NO_SLOT, dtype=torch.int32, device=device)
    assert torch.equal(routed_experts(hidden, empty, weights, gate_up, down), torch.zeros(2, 64, device=device))
    slots = torch.tensor([[1, NO_SLOT, 4], [2, 3, 5]], dtype=torch.int32, device=device)
    odd = slots.clone()
    odd[0, 1], odd[1, 2] = 6, 1 << 30  # ids >= S, like NO_SLOT, contribute nothing
    dropped = slots.clone()
    dropped[1, 2] = NO_SLOT
    assert torch.equal(routed_experts(hidden, odd, weights, gate_up, down),
                       routed_experts(hidden, dropped, weights, gate_up, down))


def test_bitwise_repeatable_and_out_reuse():
    device, _ = device_or_skip()
    gate_up, down = make_pool(12, 64, 32, torch.bfloat16, device, seed=8)
    slots, weights = make_route(4, 4, 12, device, seed=9)
    hidden = torch.randn(4, 64).bfloat16().to(device)
    first = routed_experts(hidden, slots, weights, gate_up, down)
    out = torch.full((4, 64), float("nan"), device=device)
    again = routed_experts(hidden, slots, weights, gate_up, down, out=out)
    assert again is out and torch.equal(first, out)
    slots2, weights2 = make_route(4, 4, 12, device, seed=10)
    routed_experts(hidden, slots2, weights2, gate_up, down, out=out)  # same out, new route
    assert_close(out, per_pair_reference(hidden, slots2, weights2, gate_up, down), 1e-4)
    assert not torch.equal(out, first)


UNEVEN = {"block_h": 32, "chunk_i": 8, "warps_down": 1}


# one depth of each tiling by default, every depth of both in the long profile (the interpreter is slow)
@pytest.mark.parametrize("prefetch, tiles", [
    pytest.param(1, {}, id="default-1"), pytest.param(3, UNEVEN, id="uneven-3"),
    *(pytest.param(p, t, id=f"{name}-{p}", marks=pytest.mark.slow)
      for p, t, name in ((2, {}, "default"), (3, {}, "default"), (1, UNEVEN, "uneven"), (2, UNEVEN, "uneven")))])
def test_down_prefetch_changes_no_bit(prefetch, tiles):
    """down_prefetch (the slots and the first experts' weight tiles loaded before the wait) sums in
    the same order: bit for bit no prefetch, with H and I no tile divides (several chunks of I per
    expert), padding, repeated and out-of-range slots, and the fused combine."""
    device, _ = device_or_skip()
    gate_up, down = make_pool(7, 48, 20, torch.bfloat16, device, seed=30)
    slots, weights = make_route(4, 3, 7, device, seed=31, pad=2)
    slots[1, 2] = 9  # >= S: adds nothing, prefetched or not
    hidden = torch.randn(4, 48).bfloat16().to(device)
    addend = torch.randn(4, 48, generator=torch.Generator().manual_seed(32)).to(device)
    tiles = RoutedTiles(**tiles)
    want = routed_experts(hidden, slots, weights, gate_up, down, tiles=tiles, down_prefetch=0)
    assert torch.equal(routed_experts(hidden, slots, weights, gate_up, down, tiles=tiles, down_prefetch=prefetch), want)
    got = routed_experts(hidden, slots, weights, gate_up, down, addend=addend, tiles=tiles, down_prefetch=prefetch)
    assert torch.equal(got, routed_experts(hidden, slots, weights, gate_up, down, addend=addend, tiles=tiles,
                                           down_prefetch=0))


def test_down_prefetch_past_k_prefetches_all_k():
    """A prefetch above the call's k loads all k experts (the default DOWN_PREFETCH = 4 at k = 3
    too); a negative one is refused by name before anything is launched."""
    device, _ = device_or_skip()
    gate_up, down = make_pool(7, 48, 20, torch.bfloat16, device, seed=33)
    slots, weights = make_route(2, 3, 7, device, seed=34)
    hidden = torch.randn(2, 48).bfloat16().to(device)
    want = routed_experts(hidden, slots, weights, gate_up, down, down_prefetch=3)
    assert torch.equal(routed_experts(hidden, slots, weights, gate_up, down, down_prefetch=10), want)
    assert torch.equal(routed_experts(hidden, slots, weights, gate_up, down), want)
    act = routed_gate_up(hidden, slots, weights, gate_up)
    before = act.clone()
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="prefetch"):
            routed_down(act, slots, down, prefetch=bad)
    with pytest.raises(ValueError, match="release"):
        routed_down(act, slots, down, release=1)
    assert torch.equal(act, before)


# ---------------------------------------------------------------- the layer's options: combine, shared gate


def test_addend_and_out_cast_fuse_the_combine():
    """out = addend + routed sum (float32, after the ordered sum), out_cast = its one rounding."""
    device, gpu = device_or_skip()
    gate_up, down = make_pool(12, 64, 32, torch.bfloat16, device, seed=14)
    slots, weights = make_route(3, 4, 12, device, seed=15)
    hidden = torch.randn(3, 64).bfloat16().to(device)
    addend = torch.randn(3, 64, generator=torch.Generator().manual_seed(16)).to(device)
    plain = routed_experts(hidden, slots, weights, gate_up, down)
    out, cast = torch.empty(3, 64, device=device), torch.empty(3, 64, dtype=torch.bfloat16, device=device)
    got = routed_experts(hidden, slots, weights, gate_up, down, out=out, addend=addend, out_cast=cast)
    assert got is out
    assert torch.equal(out, plain + addend)  # same float32 add as the old torch combine
    want = (plain + addend).to(torch.bfloat16)
    if gpu:  # cvt.rn.bf16.f32: torch's round to nearest even (the sm_90 check below looks for it)
        assert torch.equal(cast, want)
    else:  # Triton's interpreter truncates its float32 -> bf16 casts: within one bf16 step
        step = want.float().abs() * 2.0 ** -7
        assert bool(((cast.float() - want.float()).abs() <= step).all())
    only = torch.full((3, 64), float("nan"), dtype=torch.bfloat16, device=device)
    assert routed_experts(hidden, slots, weights, gate_up, down, addend=addend, out_cast=only) is only
    assert torch.equal(only, cast)


def test_two_phase_calls_equal_one_call():
    device, _ = device_or_skip()
    gate_up, down = make_pool(12, 64, 32, torch.bfloat16, device, seed=17)
    slots, weights = make_route(2, 3, 12, device, seed=18)
    hidden = torch.randn(2, 64).bfloat16().to(device)
    act = routed_gate_up(hidden, slots, weights, gate_up)
    assert act.shape == (6, 32) and act.dtype == torch.float32
    assert torch.equal(routed_down(act, slots, down), routed_experts(hidden, slots, weights, gate_up, down))


@pytest.mark.parametrize("tokens", [1, 3])
def test_hits_then_rest_equal_one_gate_up(tokens):
    """part="hits" (slots from pre) and part="rest" (the ensure's slots, where pre < 0) write every
    act row once, bit for bit as one part="all" launch over the final slots; a part leaves the other
    part's rows untouched (NaN sentinels stay)."""
    device, _ = device_or_skip()
    gate_up, _ = make_pool(12, 64, 32, torch.bfloat16, device, seed=31)
    slots, weights = make_route(tokens, 4, 12, device, seed=32, pad=0)
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(33)).bfloat16().to(device)
    g = torch.Generator().manual_seed(34)
    hit = torch.rand(slots.shape, generator=g) < 0.5
    hit.view(-1)[0], hit.view(-1)[-1] = True, False  # both parts non-empty
    pre = torch.where(hit.to(device), slots, torch.full_like(slots, NO_SLOT))
    want = routed_gate_up(hidden, slots, weights, gate_up, act=torch.empty(tokens * 4, 32, device=device)).clone()
    act = torch.full((tokens * 4, 32), float("nan"), device=device)
    routed_gate_up(hidden, slots, weights, gate_up, act=act, part="hits", pre=pre, programs=3)  # a few items each
    rows = hit.view(-1).to(device)
    assert torch.equal(act[rows], want[rows]) and bool(act[~rows].isnan().all())
    stale = slots.clone()  # "hits" never reads slots; "rest" never reads pre's slot values
    routed_gate_up(hidden, stale, weights, gate_up, act=act, part="rest", pre=pre)
    assert torch.equal(act, want)


def test_parts_need_pre_and_routed_experts():
    device, _ = device_or_skip()
    gate_up, _ = make_pool(4, 16, 8, torch.bfloat16, device, seed=35)
    slots, weights = make_route(1, 2, 4, device, seed=36, pad=0)
    hidden = torch.randn(1, 16).bfloat16().to(device)
    with pytest.raises(ValueError, match="part must be one of"):
        routed_gate_up(hidden, slots, weights, gate_up, part="misses", pre=slots)
    with pytest.raises(ValueError, match="pre"):
        routed_gate_up(hidden, slots, weights, gate_up, part="hits")
    with pytest.raises(ValueError, match="pre must be"):
        routed_gate_up(hidden, slots, weights, gate_up, part="rest", pre=slots[:, :1].contiguous())
    with pytest.raises(ValueError, match="programs must be"):
        routed_gate_up(hidden, slots, weights, gate_up, part="hits", pre=slots, programs=0)
    with pytest.raises(ValueError, match="part must be one of"):
        routed_gate_up(hidden, slots, weights, gate_up, part="first", pre=slots)


@pytest.mark.parametrize("tokens", [1, 5])
def test_gated_one_slot_call_is_the_shared_expert(tokens):
    """gate_w: every weight is sigmoid(hidden · gate_w), computed in the gate_up launch."""
    device, _ = device_or_skip()
    gate_up, down = make_pool(1, 64, 24, torch.bfloat16, device, seed=19)
    gate_w = (torch.randn(1, 64, generator=torch.Generator().manual_seed(20)) / 8).bfloat16().to(device)
    hidden = torch.randn(tokens, 64).bfloat16().to(device)
    zeros = torch.zeros(tokens, 1, dtype=torch.int32, device=device)
    act = torch.empty(GEMV_MAX_TOKENS, 24, device=device)
    got = routed_experts(hidden, zeros, None, gate_up, down, gate_w=gate_w, act=act)
    assert_close(got, shared_expert(hidden, (gate_up[0], down[0], gate_w)), 1e-4)
    weights = torch.sigmoid(hidden.float() @ gate_w.float().T)  # [T, 1]
    assert_close(got, routed_experts(hidden, zeros, weights, gate_up, down), 1e-5)
    flipped = routed_experts(hidden, zeros, None, gate_up, down, gate_w=-gate_w, act=act)
    assert_close(got - flipped, (2 * weights - 1) * routed_experts(hidden, zeros, torch.ones_like(weights),
                                                                   gate_up, down), 1e-4)


def test_ungated_shared_expert_is_the_expert_mlp_under_its_own_entry_kernels():
    """shared=True without gate_w (GLM-4.5's shared experts): weights of one, the shared expert's entry
    kernels (their names in a trace), bit for bit the routed entries' result."""
    from moe.kernels import routed_kernels

    device, _ = device_or_skip()
    gate_up, down = make_pool(1, 64, 24, torch.bfloat16, device, seed=21)
    hidden = torch.randn(3, 64).bfloat16().to(device)
    zeros = torch.zeros(3, 1, dtype=torch.int32, device=device)
    ones = torch.ones(3, 1, device=device)
    got = routed_experts(hidden, zeros, ones, gate_up, down, shared=True)
    assert_close(got, shared_expert(hidden, (gate_up[0], down[0], None)), 1e-4)
    assert torch.equal(got, routed_experts(hidden, zeros, ones, gate_up, down))
    from moe.kernels import routed as routed_mod

    launched = []
    real = routed_mod.kernel_for

    def recording(fn, *args, **kwargs):
        launched.append(fn)
        return real(fn, *args, **kwargs)

    try:
        routed_mod.kernel_for = recording
        routed_experts(hidden, zeros, ones, gate_up, down, shared=True)
    finally:
        routed_mod.kernel_for = real
    assert launched == [routed_kernels._shared_gate_up, routed_kernels._shared_down]
    with pytest.raises(ValueError, match="shared must be a bool"):
        routed_experts(hidden, zeros, ones, gate_up, down, shared=1)


@pytest.mark.parametrize("name, kwargs", [
    ("weights", {"gate_w": torch.zeros(1, 16, dtype=torch.bfloat16)}),  # weights given too
    ("gate_w", {"weights": None, "gate_w": torch.zeros(1, 8, dtype=torch.bfloat16)}),
    ("gate_w", {"weights": None, "gate_w": torch.zeros(1, 16)}),
    ("addend", {"addend": torch.zeros(2, 16, dtype=torch.bfloat16)}),
    ("addend", {"addend": torch.zeros(1, 16)}),
    ("out_cast", {"out_cast": torch.zeros(2, 16)}),
    ("act", {"act": torch.zeros(3, 8)}),
    ("act", {"act": torch.zeros(4, 4)}),
])
def test_bad_options_are_named(name, kwargs):
    with pytest.raises(ValueError, match=name):
        routed_experts(**{**_args(), **kwargs})


# ---------------------------------------------------------------- validation, plan, scratch


def _args():
    gate_up, down = make_pool(4, 16, 8, torch.bfloat16, "cpu", seed=0)
    slots = torch.zeros(2, 2, dtype=torch.int32)
    return {"hidden": torch.zeros(2, 16, dtype=torch.bfloat16), "slots": slots, "weights": torch.ones(2, 2),
            "gate_up": gate_up, "down": down}


@pytest.mark.parametrize("name, bad", [
    ("hidden", torch.zeros(16, dtype=torch.bfloat16)),
    ("hidden", torch.zeros(GEMV_MAX_TOKENS + 1, 16, dtype=torch.bfloat16)),
    ("hidden", torch.zeros(2, 16, dtype=torch.int32)),
    ("hidden", torch.zeros(16, 2, dtype=torch.bfloat16).T),
    ("slots", torch.zeros(2, 2, dtype=torch.int64)),
    ("slots", torch.zeros(3, 2, dtype=torch.int32)),
    ("weights", torch.ones(2, 2, dtype=torch.float16)),
    ("weights", torch.ones(2, 3)),
    ("gate_up", torch.zeros(4, 16, 16)),
    ("gate_up", torch.zeros(4, 16, 8, dtype=torch.bfloat16)),
    ("gate_up", torch.zeros(4, 15, 16, dtype=torch.bfloat16)),
    ("gate_up", torch.zeros(4, 16, 16, dtype=torch.bfloat16)[:, ::2]),
    ("down", torch.zeros(4, 16, 4, dtype=torch.bfloat16)),
    ("down", torch.zeros(3, 16, 8, dtype=torch.bfloat16)),
    ("out", torch.zeros(2, 16, dtype=torch.bfloat16)),
    ("out", torch.zeros(1, 16)),
    ("tiles", "default"), ("down_release", None), ("down_prefetch", -1),
])
def test_bad_arguments_are_named(name, bad):
    args = {**_args(), name: bad}
    with pytest.raises(ValueError, match=name):
        routed_experts(**args)


@pytest.mark.gpu
def test_device_mismatch_is_named():
    args = _args()
    args["slots"] = args["slots"].cuda()
    with pytest.raises(ValueError, match="slots"):
        routed_experts(**args)


@pytest.mark.parametrize("tokens", range(1, GEMV_MAX_TOKENS + 1))
def test_plan_grid_is_the_launched_grid(tokens):
    cfg = MoEConfig(hidden=2048, num_experts=512, top_k=10, expert_intermediate=512)
    assert make_routed_plan(tokens, cfg).grid == routed_grids(tokens, 10, 2048, 512)[0] == (tokens * 10, 512)
    other = RoutedTiles(block_i=16, block_h=8)
    plan = make_routed_plan(tokens, cfg, other)
    assert plan.grid == routed_grids(tokens, 10, 2048, 512, other)[0] == (tokens * 10, 32)
    assert routed_grids(tokens, 10, 2048, 512, other)[1] == (tokens, 256)
    assert not plan.needs_coresident_grid


def test_scratch_is_made_once_per_device_and_shape():
    a = routed_scratch("cpu", 3, 40)
    assert a is routed_scratch(torch.device("cpu"), 3, 40)
    assert a.shape == (GEMV_MAX_TOKENS * 3, 40) and a.dtype == torch.float32
    assert routed_scratch("cpu", 4, 40) is not a


SM90_CHECK = r"""
import json, re
from moe.kernels.routed_host import compile_for_target
asm = compile_for_target(10, 2048, 512, "bf16")
out = {name: [bool(a.get("cubin")), bool(re.search(r"ld\.global(\.\w+)*\.v4\.b32", a["ptx"]))]
       for name, a in asm.items()}
out["combine_rounds_to_nearest_even"] = "cvt.rn.bf16.f32" in asm["_down_kernel+combine"]["ptx"]
out["griddepcontrol"] = sorted(n for n, a in asm.items() if "griddepcontrol.wait" in a["ptx"])
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_16_byte_loads():
    """Every variant the layer launches (routed, fused combine, shared expert with its gate, early
    hits), default tiles, Qwen3-Next shape, compiles for sm_90 (T only sizes the grid, so one binary
    serves T = 1..8) and streams the weights with 16-byte vector loads. Runs in a child process
    without TRITON_INTERPRET, which would replace the compiler's language hooks."""
    result = compile_check(SM90_CHECK)
    assert result == {name: [True, True] for name in ("_gate_up_kernel", "_gate_up_hits", "_gate_up_kernel+rest",
                                                      "_down_kernel", "_down_kernel+combine", "_shared_gate_up",
                                                      "_shared_down")} | {
        "combine_rounds_to_nearest_even": True,
        # programmatic launches, except the shared expert's and the early hits' (launched behind an
        # event wait on the side stream)
        "griddepcontrol": ["_down_kernel", "_down_kernel+combine", "_gate_up_kernel", "_gate_up_kernel+rest"]}


RELEASE_CHECK = r"""
import json
from moe.kernels.routed_host import compile_for_target
out = {}
for release in (False, True):
    asm = compile_for_target(10, 2048, 512, "bf16", down_release=release)
    out[str(release)] = {name: [bool(asm[name].get("cubin")), "griddepcontrol.launch_dependents" in asm[name]["ptx"]]
                         for name in ("_down_kernel", "_down_kernel+combine")}
print(json.dumps(out))
"""


def test_down_release_lets_the_next_launch_start_for_sm90():
    """Only down_release makes the down launches (both variants the layer launches) let the next
    programmatic launch start: griddepcontrol.launch_dependents in their PTX. A child process (no
    interpreter)."""
    assert compile_check(RELEASE_CHECK) == {
        "False": {"_down_kernel": [True, False], "_down_kernel+combine": [True, False]},
        "True": {"_down_kernel": [True, True], "_down_kernel+combine": [True, True]},
    }


PREFETCH_CHECK = r"""
import json
from moe.kernels.routed_host import compile_for_target
out = {}
for prefetch in (0, 1, 10, None):
    asm = compile_for_target(10, 2048, 512, "bf16", **({} if prefetch is None else {"down_prefetch": prefetch}))
    for name in ("_down_kernel", "_down_kernel+combine"):
        ptx = asm[name]["ptx"]
        head = ptx[:ptx.index("griddepcontrol.wait")]
        out[f"{name}/{prefetch}"] = [head.count("ld.global.b32"), head.count("ld.global.v4.b32"), ".cg" in ptx]
print(json.dumps(out))
"""


def test_down_prefetch_loads_before_the_wait_for_sm90():
    """down_prefetch=N (the default DOWN_PREFETCH: 4 at k = 10): both down variants the layer
    launches issue the k = 10 slot loads and N experts' weight tiles (one 16-byte load per thread
    each at the default tile) before their programmatic wait, as plain loads (a .cg load on sm_90 is
    a strong one, much slower for the down); 0 issues none. A child process (no interpreter)."""
    got = compile_check(PREFETCH_CHECK)
    for name in ("_down_kernel", "_down_kernel+combine"):
        assert got[f"{name}/0"] == [0, 0, False]
        assert got[f"{name}/1"] == [10, 1, False]
        assert got[f"{name}/10"] == [10, 10, False]
        assert got[f"{name}/None"] == [10, 4, False]  # the default: min(DOWN_PREFETCH, k)


# ---------------------------------------------------------------- GPU: the Qwen3-Next shape


def _qwen_case(tokens: int, seed: int):
    gate_up, down = make_pool(96, QWEN3_NEXT["hidden"], QWEN3_NEXT["inter"], torch.bfloat16, "cuda", seed)
    slots, weights = make_route(tokens, QWEN3_NEXT["top_k"], 96, "cuda", seed + 1, pad=tokens // 2)
    hidden = torch.randn(tokens, QWEN3_NEXT["hidden"], device="cuda").bfloat16()
    return hidden, slots, weights, gate_up, down


LAUNCH_MODES = {
    "default": {},
    "down-release": {"down_release": True},  # routed_experts options
    "down-prefetch": {"down_prefetch": 1},
    "down-prefetch-all": {"down_prefetch": 10},
    "no-prefetch": {"down_prefetch": 0},
    "down-release-prefetch-2": {"down_release": True, "down_prefetch": 2},
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(LAUNCH_MODES))
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_qwen3_next_shape(tokens, mode):
    args = _qwen_case(tokens, seed=tokens)
    options = LAUNCH_MODES[mode]
    got = routed_experts(*args, **options)
    assert_close(got, routed_reference(*args), 1e-3)
    assert torch.equal(got, routed_experts(*args, **options))
    assert torch.equal(got, routed_experts(*args))  # the launch mode changes no bit


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(LAUNCH_MODES))
def test_gpu_cuda_graph_replay_follows_slots_and_weights(mode):
    """Inside one graph a device copy rewrites a routed slot's weights right before the routed
    launches (as the miss copy does); with programmatic launches too, the replay sees the new bytes."""
    hidden, slots, weights, gate_up, down = _qwen_case(4, seed=11)
    slots[0, 0] = 7  # a live slot (padding is -1)
    src = torch.randn(down[:1].shape, device="cuda").bfloat16()
    out = torch.empty(4, QWEN3_NEXT["hidden"], device="cuda")
    options = LAUNCH_MODES[mode]
    routed_experts(hidden, slots, weights, gate_up, down, out=out, **options)  # compile, make the scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        down[7].copy_(src[0])  # a device copy rewriting a routed slot's down weights
        routed_experts(hidden, slots, weights, gate_up, down, out=out, **options)
    for seed in (12, 13):
        new_slots, new_weights = make_route(4, QWEN3_NEXT["top_k"], 96, "cuda", seed, pad=3)
        new_slots[0, 0] = 7  # the slot the graph rewrites stays routed
        src.copy_(torch.randn(src.shape, device="cuda").bfloat16())
        slots.copy_(new_slots)
        weights.copy_(new_weights)
        hidden.copy_(torch.randn_like(hidden))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, routed_reference(hidden, slots, weights, gate_up, down), 1e-3)
        assert torch.equal(out, routed_experts(hidden, slots, weights, gate_up, down))


@pytest.mark.gpu
def test_gpu_qwen3_next_shared_expert_and_combine():
    """The layer's shared expert (one-slot pool, gate in the gate_up launch) and the fused combine."""
    hidden, slots, weights, gate_up, down = _qwen_case(2, seed=31)
    s_up, s_down = make_pool(1, QWEN3_NEXT["hidden"], 512, torch.bfloat16, "cuda", seed=32)
    gate_w = (torch.randn(1, QWEN3_NEXT["hidden"], device="cuda") / 45).bfloat16()
    zeros = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    shared = routed_experts(hidden, zeros, None, s_up, s_down, gate_w=gate_w,
                            act=torch.empty(GEMV_MAX_TOKENS, 512, device="cuda"))
    assert_close(shared, shared_expert(hidden, (s_up[0], s_down[0], gate_w)), 1e-3)
    cast = torch.empty(2, QWEN3_NEXT["hidden"], dtype=torch.bfloat16, device="cuda")
    routed_experts(hidden, slots, weights, gate_up, down, addend=shared, out_cast=cast)
    assert torch.equal(cast, (routed_experts(hidden, slots, weights, gate_up, down) + shared).bfloat16())


@pytest.mark.gpu
def test_gpu_hits_equal_one_gate_up():
    """At the Qwen3-Next shape and the default tiles, the early hits (the default persistent grid,
    each item's next slot loaded ahead) write the same bits as one part="all" gate_up."""
    hidden, slots, weights, gate_up, _ = _qwen_case(3, seed=51)
    hit = torch.rand(slots.shape, generator=torch.Generator().manual_seed(52)) < 0.7
    pre = torch.where(hit.cuda(), slots, torch.full_like(slots, NO_SLOT))
    want = routed_gate_up(hidden, slots, weights, gate_up, act=torch.empty(30, 512, device="cuda")).clone()
    act = torch.full((30, 512), float("nan"), device="cuda")
    routed_gate_up(hidden, slots, weights, gate_up, act=act, part="hits", pre=pre)
    rows = hit.view(-1).cuda() & (slots.view(-1) >= 0)
    assert torch.equal(act[rows], want[rows])
