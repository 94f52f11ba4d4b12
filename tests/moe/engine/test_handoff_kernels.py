"""The hand-off's post, tail-zeroing and wait kernels in Triton's interpreter on CPU tensors (their GPU
runs, with the mapped memory and a CPU worker: tests/moe/engine/test_hybrid_gpu.py): which positions go
to the CPU, the tail's split of the first served expert, the act rows zeroed below its cut, and the
wait's combine routed + (the CPU's share + addend), rounded once."""

from __future__ import annotations

import pytest
import torch

from expertcache.geometry import CPU_SLOT
from expertcache.split import SPLIT_LEN
from moe.engine import handoff

H, K, E, I, LAYER, SCRATCH = 32, 3, 6, 64, 1, 4
IDS = [[0, 3, 5], [2, 3, 4]]


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    return tuple(InterpretedFunction(k.fn) for k in (handoff._post_kernel, handoff._zero_tail_kernel,
                                                      handoff._wait_kernel))


def _tables(copies3: int, rows3: int) -> tuple[torch.Tensor, torch.Tensor]:
    copies = torch.arange(SPLIT_LEN, dtype=torch.int32)
    copies[3] = copies3
    rows = torch.zeros(SPLIT_LEN, dtype=torch.int32)
    rows[3] = rows3
    return copies, rows


def _post(post, slots, count, tail=True, copies3=1, rows3=48):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn((2, H), generator=g).to(torch.bfloat16)
    ids = torch.tensor(IDS, dtype=torch.int32)
    buf = {"x": torch.zeros(8, H), "cid": torch.full((8, K), 9, dtype=torch.int32), "cw": torch.zeros(8, K),
           "meta": torch.full((4,), 9, dtype=torch.int32), "seq": torch.zeros(1, dtype=torch.int32),
           "flag": torch.zeros(1, dtype=torch.int32), "fence": torch.zeros(1, dtype=torch.int32),
           "pending": torch.full((1,), 9, dtype=torch.int32), "tail": torch.tensor([7, SCRATCH, I], dtype=torch.int32)}
    copies, rows = _tables(copies3, rows3)
    post[(1,)](hidden, ids, slots, torch.rand((2, K), generator=g), buf["x"], buf["cid"], buf["cw"], buf["meta"],
               buf["seq"], buf["flag"], buf["fence"], buf["pending"], LAYER, 2, 0,
               torch.tensor([count], dtype=torch.int32), copies, rows, buf["tail"], SCRATCH, E, H=H, K=K, BLOCK_H=32,
               BLOCK_K=8, TAIL=tail, INTER=I, SPLIT_LEN=SPLIT_LEN)
    return hidden, buf


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) as the interpreter casts it to dtype: bfloat16 by truncating the float32 bits (where the
    GPU and torch round to nearest even: tests/moe/engine/test_hybrid_gpu.py checks that cast)."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _zero_tail(zero_tail, buf, slots, act):
    zero_tail[(1,)](act, act.stride(0), slots, buf["tail"], SCRATCH, 2, K=K, INTER=I, BLOCK_I=64)


def _wait(wait, pending, dst, routed=None, addend=True, seed=5):
    """The wait of an answered post over fresh random out [8, H] and addend [2, H]: (out, addend)."""
    g = torch.Generator().manual_seed(seed)
    out, add = torch.randn((8, H), generator=g), torch.randn((2, H), generator=g)
    seq = torch.tensor([4], dtype=torch.int32)
    flag_out = seq.clone()  # the worker answered the last post
    wait[(1,)](flag_out, seq, torch.tensor([pending], dtype=torch.int32), out, add if addend else dst,
               dst if routed is None else routed, dst, torch.zeros(1, dtype=torch.int32), 2, H=H, BLOCK_H=32,
               ADDEND=addend, ROUTED=routed is not None)
    return out, add


def test_the_post_splits_the_first_served_expert_and_its_act_is_zeroed_below_the_cut(kernels):
    """3 misses (1 copied, experts 3 and 4 served), the table's tail 48 rows: expert 3 (the lowest CPU
    position) moves to the scratch slot at both its positions, tail = (key, scratch, cut 16), the worker
    is told (3, 16) and still gets both experts' positions; the tail zeroing zeroes act rows [0, 16) of the
    scratch positions only, every other act element bitwise kept."""
    post, zero_tail, _ = kernels
    slots = torch.tensor([[7, CPU_SLOT, 1], [0, CPU_SLOT, CPU_SLOT]], dtype=torch.int32)
    hidden, buf = _post(post, slots, count=1)
    assert slots.tolist() == [[7, SCRATCH, 1], [0, SCRATCH, CPU_SLOT]]
    assert buf["tail"].tolist() == [LAYER * E + 3, SCRATCH, 16]
    assert buf["meta"].tolist() == [LAYER, 2, 3, 16] and buf["pending"].item() == 1 and buf["flag"].item() == 1
    assert buf["cid"][:2].tolist() == [[-1, 3, -1], [-1, 3, 4]]
    assert torch.equal(buf["x"][:2], hidden.float())
    act = torch.randn((2 * K, I), generator=torch.Generator().manual_seed(4))
    before = act.clone()
    _zero_tail(zero_tail, buf, slots, act)
    want = before.clone()
    want[1, :16] = 0
    want[4, :16] = 0
    assert torch.equal(act, want)


@pytest.mark.parametrize(("count", "copies3", "rows3"), [(2, 1, 48), (1, 1, 0)])
def test_no_tail_where_the_copies_are_not_the_tables_or_it_gives_none(kernels, count, copies3, rows3):
    """A filling pool that copied more than copies[m], or a table without a tail for m: nothing moves to the
    scratch slot, tail's key is -1, the worker computes whole experts and the tail zeroing zeroes nothing."""
    post, zero_tail, _ = kernels
    base = [[7, CPU_SLOT, 1], [0, CPU_SLOT, CPU_SLOT]]
    slots = torch.tensor(base, dtype=torch.int32)
    _, buf = _post(post, slots, count=count, copies3=copies3, rows3=rows3)
    assert slots.tolist() == base and buf["tail"][0].item() == -1 and buf["meta"][2].item() == -1
    act = torch.randn((2 * K, I), generator=torch.Generator().manual_seed(4))
    before = act.clone()
    _zero_tail(zero_tail, buf, slots, act)
    assert torch.equal(act, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_wait_adds_routed_to_the_cpu_share_plus_addend_rounding_once(kernels, dtype):
    """With routed given, dst = routed + (out + addend) in float32, in that order (as the down adds its
    addend to its routed sum), then one cast to dst's dtype: bitwise torch's float32 sum, cast once."""
    *_, wait = kernels
    routed = torch.randn((2, H), generator=torch.Generator().manual_seed(6))
    dst = torch.full((2, H), float("nan"), dtype=dtype)
    out, addend = _wait(wait, 1, dst, routed=routed)
    want = routed + (out[:2] + addend)
    assert not torch.equal(want, (routed + out[:2]) + addend)  # the order shows in these inputs' bits
    assert torch.equal(dst, _cast(want, dtype))


def test_the_wait_combines_in_place_into_routed(kernels):
    *_, wait = kernels
    routed = torch.randn((2, H), generator=torch.Generator().manual_seed(6))
    y = routed.clone()
    out, addend = _wait(wait, 1, y, routed=y)
    assert torch.equal(y, routed + (out[:2] + addend))


def test_the_wait_without_routed_or_addend(kernels):
    """dst = out + addend without routed, dst = out alone without either (measure_channels' form)."""
    *_, wait = kernels
    dst = torch.full((2, H), float("nan"))
    out, addend = _wait(wait, 1, dst)
    assert torch.equal(dst, out[:2] + addend)
    out, _ = _wait(wait, 1, dst, addend=False, seed=7)
    assert torch.equal(dst, out[:2])


def test_nothing_pending_adds_no_cpu_share(kernels):
    """pending 0: out is not read (its contribution is 0): dst = routed + addend, or addend alone."""
    *_, wait = kernels
    routed = torch.randn((2, H), generator=torch.Generator().manual_seed(6))
    dst = torch.full((2, H), float("nan"), dtype=torch.bfloat16)
    _, addend = _wait(wait, 0, dst, routed=routed)
    assert torch.equal(dst, _cast(routed + addend, torch.bfloat16))
    dst = torch.full((2, H), float("nan"))
    _, addend = _wait(wait, 0, dst, seed=8)
    assert torch.equal(dst, addend)


def test_nothing_served_posts_nothing(kernels):
    """No CPU position: pending 0, no flag raised, tail's key -1, the payload untouched."""
    post, *_ = kernels
    slots = torch.tensor([[7, 2, 1], [0, 3, 5]], dtype=torch.int32)
    _, buf = _post(post, slots, count=0)
    assert buf["pending"].item() == 0 and buf["flag"].item() == 0 and buf["tail"][0].item() == -1
    assert (buf["cid"] == 9).all() and buf["meta"][0].item() == 9


def test_without_a_tail_the_post_leaves_the_slots_and_says_no_split(kernels):
    post, *_ = kernels
    base = [[7, CPU_SLOT, 1], [0, CPU_SLOT, CPU_SLOT]]
    slots = torch.tensor(base, dtype=torch.int32)
    _, buf = _post(post, slots, count=1, tail=False)
    assert slots.tolist() == base and buf["meta"].tolist()[1:3] == [2, -1] and buf["tail"][0].item() == 7


GDC_CHECK = r"""
import json
from moe.engine import handoff
from moe.kernels.triton_launch import compile_for_sm

post_types = ("*bf16", "*i32", "*i32", "*fp32", "*fp32", "*i32", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32",
              "i32", "i32", "i32", "*i32", "*i32", "*i32", "*i32", "i32", "i32")
zero_types = ("*fp32", "i32", "*i32", "*i32", "i32", "i32")
wait_types = ("*i32", "*i32", "*i32", "*fp32", "*fp32", "*fp32", "*bf16", "*i32", "i32")
out = []
for gdc in (False, True):
    for kernel, types, cx in (
            (handoff._post_kernel, post_types, dict(H=2048, K=8, BLOCK_H=1024, BLOCK_K=64, TAIL=True, INTER=768,
                                                    SPLIT_LEN=64, GDC=gdc)),
            (handoff._zero_tail_kernel, zero_types, dict(K=8, INTER=768, BLOCK_I=1024, GDC=gdc)),
            (handoff._wait_kernel, wait_types, dict(H=2048, BLOCK_H=1024, ADDEND=True, ROUTED=True, GDC=gdc))):
        ptx = compile_for_sm(kernel, types, cx, 4, 90, {})["ptx"]
        out.append(["griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx])
print(json.dumps(out))
"""


def test_the_hand_off_launches_compile_for_sm90_as_programmatic_launches():
    """With GDC the post and the tail zeroing wait for their predecessor and let their successor launch at
    once; the wait kernel waits (for the down, after its spin) and releases nothing early; without GDC
    none of them has either instruction. A child process without TRITON_INTERPRET."""
    from tests.conftest import compile_check
    assert compile_check(GDC_CHECK) == [[False, False]] * 3 + [[True, True], [True, True], [True, False]]
