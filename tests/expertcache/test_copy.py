"""The miss copy: the Triton kernel (Triton's interpreter on CPU tensors, compiled on CUDA),
the copy-engine path and the torch reference, on random bytes over a poisoned pool.

The CPU tests set TRITON_INTERPRET=1 for their own duration: `miss_copy` picks the
interpreted or the compiled kernel at call time, so the compiled GPU tests in the same
process are unaffected.
"""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.copy import (
    MAX_BANKS,
    TAIL_COLS,
    TAIL_ROWS,
    TAIL_WHOLE,
    miss_copy,
    miss_copy_ce,
    reference_copy,
    reference_tail_copy,
    tail_layout,
)
from expertcache.formats import get_format
from expertcache.pool import Bank, HostStore, SlotPool

BF16, FP8, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8
POISON = 0xA5

# Bank sets: one bank; bf16 + float8 bytes of different row sizes; three banks and dtypes; the six
# banks of an nvfp4 expert (global scales of 8 and 4 bytes a row: words, not 16-byte vectors); int4
# with zero points (rows of 18 and 14 words).
BANK_SETS = {
    "bf16": (Bank("w", (4, 24), BF16),),
    "bf16+fp8": (Bank("gate_up", (6, 40), BF16), Bank("down", (80,), FP8)),
    "three": (Bank("gate_up", (2, 64), BF16), Bank("down", (48,), U8), Bank("scale", (4,), torch.float32)),
    "nvfp4": get_format("nvfp4").expert_banks(64, 32),
    "int4z": get_format("int4").__class__(zero_points=True).expert_banks(144, 28),
}
K, S = 13, 9


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_store(banks, num_keys, seed, pin=False) -> HostStore:
    """Random bytes in every row (never a constant), as each bank's dtype."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for b in banks:
        raw = torch.randint(0, 256, (num_keys, b.row_bytes), dtype=U8, generator=gen)
        tensors[b.name] = raw.view(b.dtype).view(num_keys, *b.row_shape)
    return HostStore.from_tensors(tensors, pin=pin)


def poisoned_pool(banks, num_slots, device) -> SlotPool:
    pool = SlotPool(banks, num_slots, device)
    poison(pool)
    return pool


def poison(pool: SlotPool) -> None:
    for b in pool.banks:
        pool.tensor(b.name).view(U8).fill_(POISON)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(U8).cpu()


def check(store: HostStore, pool: SlotPool, live: list[tuple[int, int]]) -> None:
    """Rows at the live slots equal the source bitwise; every other slot is still poison."""
    slots = {slot for _, slot in live}
    for b in store.banks:
        got, src = as_bytes(pool.tensor(b.name)), as_bytes(store.tensor(b.name))
        for key, slot in live:
            assert torch.equal(got[slot], src[key]), (b.name, key, slot)
        for slot in set(range(pool.num_slots)) - slots:
            assert bool((got[slot] == POISON).all()), (b.name, slot)


def plan_of(rows, device="cpu") -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 2)


def count_of(n, device="cpu") -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=device)


ROWS = [(3, 5), (12, 0), (0, 8), (7, 2), (3, 1), (9, 6)]  # distinct slots; key 3 twice


@pytest.mark.parametrize("bank_set", list(BANK_SETS))
@pytest.mark.parametrize("count", [0, 1, 4, len(ROWS)])
@pytest.mark.parametrize("block_bytes", [64, 16384])
def test_interpreter_copies_live_rows_only(interpret, bank_set, count, block_bytes):
    banks = BANK_SETS[bank_set]
    store = make_store(banks, K, seed=zlib.crc32(f"{bank_set}-{count}-{block_bytes}".encode()))
    pool = poisoned_pool(banks, S, "cpu")
    miss_copy(store, pool, plan_of(ROWS), count_of(count), num_ctas=3, block_bytes=block_bytes)
    check(store, pool, ROWS[:count])


@pytest.mark.parametrize("count", [-1, 100])
def test_interpreter_clamps_count_to_the_plan(interpret, count):
    banks = BANK_SETS["bf16+fp8"]
    store, pool = make_store(banks, K, seed=11), poisoned_pool(banks, S, "cpu")
    miss_copy(store, pool, plan_of(ROWS), count_of(count), num_ctas=2, block_bytes=128)
    check(store, pool, ROWS if count > 0 else [])


def test_interpreter_skips_rows_out_of_range(interpret):
    banks = BANK_SETS["three"]
    store, pool = make_store(banks, K, seed=5), poisoned_pool(banks, S, "cpu")
    rows = [(-1, 0), (K, 1), (2, -1), (2, S), (4, 3)]
    miss_copy(store, pool, plan_of(rows), count_of(len(rows)), num_ctas=4, block_bytes=32)
    check(store, pool, [(4, 3)])


@settings(max_examples=12)
@given(data=st.data())
def test_interpreter_matches_reference(data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        banks = BANK_SETS[data.draw(st.sampled_from(list(BANK_SETS)))]
        q = data.draw(st.integers(1, S))
        slots = data.draw(st.permutations(range(S)))[:q]
        keys = data.draw(st.lists(st.integers(0, K - 1), min_size=q, max_size=q))
        n = data.draw(st.integers(0, q))
        store = make_store(banks, K, seed=data.draw(st.integers(0, 2**31 - 1)))
        got, want = poisoned_pool(banks, S, "cpu"), poisoned_pool(banks, S, "cpu")
        plan = plan_of(list(zip(keys, slots)))
        miss_copy(store, got, plan, count_of(n), num_ctas=data.draw(st.integers(1, 20)),
                  block_bytes=data.draw(st.sampled_from([16, 64, 256, 4096])))
        reference_copy(store, want, plan, count_of(n))
        for b in banks:
            assert torch.equal(as_bytes(got.tensor(b.name)), as_bytes(want.tensor(b.name)))


# experts whose tail can be cut: (format, hidden, I) with I a multiple of the format's tail granule
TAIL_EXPERTS = {"bf16": ("bf16", 64, 32), "fp8": ("fp8", 64, 256), "nvfp4": ("nvfp4", 128, 32),
                "int4z": ("int4-z", 128, 256), "mxfp4": ("mxfp4", 128, 64)}


def tail_banks(name):
    from expertcache.formats import resolve_format

    fmt, hidden, inter = TAIL_EXPERTS[name]
    return resolve_format(fmt).expert_banks(hidden, inter), inter


def test_tail_layout_cuts_the_big_parts_and_copies_the_small_ones_whole():
    banks, inter = tail_banks("nvfp4")  # H 128, I 32: gate_up.q [64, 64] B, .s [64, 8] B, .s2 [2]; down.q [128, 16] ...
    store = make_store(banks, 2, seed=1)
    kinds, units = tail_layout(store, inter)
    by = dict(zip([b.name for b in banks], zip(kinds, units)))
    assert by["gate_up.q"] == (TAIL_ROWS, 16) and by["gate_up.s"] == (TAIL_ROWS, 2)
    assert by["down.q"] == (TAIL_COLS, 4) and by["down.s"][0] == TAIL_WHOLE and by["gate_up.s2"][0] == TAIL_WHOLE
    with pytest.raises(ValueError, match="inter"):
        tail_layout(store, 0)


def expected_tail(store, key, cut, inter):
    """{bank: bool mask [row bytes]} of the bytes a tail of key's rows [cut, inter) brings, by the formats'
    own shapes: gate / up rows >= cut, down's main columns >= cut, everything of the other banks."""
    out = {}
    for b in store.banks:
        shape = b.row_shape
        keep = torch.ones(b.row_bytes, dtype=torch.bool)
        whole_words = b.row_bytes % (4 * shape[0]) == 0
        if b.name.startswith("gate_up") and len(shape) == 2 and shape[0] == 2 * inter and whole_words:
            rows = torch.arange(shape[0]).repeat_interleave(b.row_bytes // shape[0])
            keep = rows % inter >= cut
        elif b.name in ("down", "down.q"):
            per_row = b.row_bytes // shape[0]
            col = (torch.arange(b.row_bytes) % per_row) * inter // per_row  # the input column a byte holds
            keep = col >= cut
        out[b.name] = keep
    return out


# the plan's rows beside the tail cost most for the widest experts: those two run in the long profile
TAIL_CASES = [pytest.param(name, count, marks=[pytest.mark.slow] if count and name in ("fp8", "int4z") else [],
                           id=f"{count}-{name}") for count in (0, 2) for name in TAIL_EXPERTS]


@pytest.mark.parametrize("name, count", TAIL_CASES)
def test_interpreter_tail_copies_the_cut_rows_beside_the_plan(interpret, name, count):
    """The tail row lands in its scratch slot exactly where the format keeps rows [cut, I) (and the small
    banks whole), everything else of that slot stays poison; the plan's rows are whole; the reference agrees."""
    from expertcache.formats import resolve_format
    from expertcache.split import tail_granule

    banks, inter = tail_banks(name)
    g = tail_granule(resolve_format(TAIL_EXPERTS[name][0]), inter)
    assert g > 0
    store = make_store(banks, K, seed=zlib.crc32(name.encode()) + count)
    for cut in (g, inter - g):
        got, want = poisoned_pool(banks, S, "cpu"), poisoned_pool(banks, S, "cpu")
        tail = torch.tensor([4, S - 1, cut], dtype=torch.int32)
        miss_copy(store, got, plan_of(ROWS[:2]), count_of(count), num_ctas=3, block_bytes=64, tail=(tail, inter))
        reference_copy(store, want, plan_of(ROWS[:2]), count_of(count))
        reference_tail_copy(store, want, 4, S - 1, cut, inter)
        masks = expected_tail(store, 4, cut, inter)
        for b in banks:
            g_all, w_all = as_bytes(got.tensor(b.name)), as_bytes(want.tensor(b.name))
            assert torch.equal(g_all, w_all), (b.name, cut)
            src, row = as_bytes(store.tensor(b.name))[4], g_all[S - 1]
            keep = masks[b.name]
            assert torch.equal(row[keep], src[keep]), (b.name, cut)
            assert bool((row[~keep] == POISON).all()), (b.name, cut)
            for key, slot in ROWS[:count]:
                assert torch.equal(g_all[slot], as_bytes(store.tensor(b.name))[key])
        # no tail this call (key -1): only the plan's rows
        poison(got)
        miss_copy(store, got, plan_of(ROWS[:2]), count_of(count), num_ctas=2, block_bytes=64,
                  tail=(torch.tensor([-1, S - 1, cut], dtype=torch.int32), inter))
        check(store, got, ROWS[:count])


def test_tail_errors_name_the_argument(interpret):
    banks, inter = tail_banks("bf16")
    store, pool = make_store(banks, K, seed=3), poisoned_pool(banks, S, "cpu")
    for bad in ((torch.zeros(2, dtype=torch.int32), inter), (torch.zeros(3, dtype=torch.int64), inter),
                (torch.zeros(3, dtype=torch.int32), 0), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="tail"):
            miss_copy(store, pool, plan_of(ROWS), count_of(1), tail=bad)


def test_reference_and_copy_engine_on_cpu():
    banks = BANK_SETS["bf16+fp8"]
    store = make_store(banks, K, seed=3)
    ref, ce = poisoned_pool(banks, S, "cpu"), poisoned_pool(banks, S, "cpu")
    reference_copy(store, ref, plan_of(ROWS), count_of(4))
    check(store, ref, ROWS[:4])
    runs = [(2, 3), (3, 4), (4, 5), (9, 0), (K, 1)]  # one run of three, one row, one skipped
    assert miss_copy_ce(store, ce, np.array(runs, dtype=np.int32)) == 2 * len(banks)
    check(store, ce, runs[:4])


def test_errors_name_the_fix(interpret, monkeypatch):
    banks = BANK_SETS["bf16"]
    store, pool = make_store(banks, K, seed=1), poisoned_pool(banks, S, "cpu")
    plan, count = plan_of(ROWS), count_of(2)
    with pytest.raises(ValueError, match="same Bank specs"):
        miss_copy(store, poisoned_pool(BANK_SETS["three"], S, "cpu"), plan, count)
    odd = (Bank("w", (3,), BF16),)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        miss_copy(make_store(odd, K, 2), poisoned_pool(odd, S, "cpu"), plan, count)
    many = tuple(Bank(f"b{i}", (16,), U8) for i in range(MAX_BANKS + 1))
    with pytest.raises(ValueError, match="MAX_BANKS"):
        miss_copy(make_store(many, K, 3), poisoned_pool(many, S, "cpu"), plan, count)
    with pytest.raises(ValueError, match="plan must be"):
        miss_copy(store, pool, plan.long(), count)
    with pytest.raises(ValueError, match="count must be"):
        miss_copy(store, pool, plan, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_ctas"):
        miss_copy(store, pool, plan, count, num_ctas=0)
    with pytest.raises(ValueError, match="block_bytes"):
        miss_copy(store, pool, plan, count, block_bytes=48)
    with pytest.raises(ValueError, match="pdl and release_after_wait must be"):
        miss_copy(store, pool, plan, count, pdl=1)
    with pytest.raises(ValueError, match="release_after_wait must be"):
        miss_copy(store, pool, plan, count, pdl=True, release_after_wait="yes")
    with pytest.raises(ValueError, match="plan must be"):
        miss_copy_ce(store, pool, np.zeros((2, 3), dtype=np.int32))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        miss_copy(store, pool, plan, count)


# ---- GPU: the compiled kernel on pinned memory, under graph replay, and the copy engines ----

GPU_BANKS = {  # small rows, and expert-sized rows of many chunks with a tail
    "small": BANK_SETS["three"],
    "expert": (Bank("gate_up", (256, 1000), BF16), Bank("down", (1000, 128), BF16)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("bank_set", list(GPU_BANKS))
@pytest.mark.parametrize("num_ctas", [1, 16, 200])
def test_gpu_miss_copy(bank_set, num_ctas):
    banks = GPU_BANKS[bank_set]
    store = make_store(banks, K, seed=num_ctas, pin=True)
    for count in (0, 1, 4, len(ROWS)):
        pool = poisoned_pool(banks, S, "cuda")
        miss_copy(store, pool, plan_of(ROWS, "cuda"), count_of(count, "cuda"), num_ctas=num_ctas)
        torch.cuda.synchronize()
        check(store, pool, ROWS[:count])


RELEASES = {"plain": {}, "pdl": {"pdl": True}, "pdl-release-after-wait": {"pdl": True, "release_after_wait": True}}


@pytest.mark.gpu
@pytest.mark.parametrize("launch", list(RELEASES))
def test_gpu_miss_copy_follows_new_plans_under_graph_replay(launch):
    """The same bytes however the copy is launched: plainly, programmatically, and letting the next
    launch start right after its wait."""
    banks = GPU_BANKS["expert"]
    store = make_store(banks, K, seed=21, pin=True)
    pool = poisoned_pool(banks, S, "cuda")
    plan, count = plan_of(ROWS, "cuda"), count_of(len(ROWS), "cuda")
    opts = RELEASES[launch]
    miss_copy(store, pool, plan, count, **opts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        miss_copy(store, pool, plan, count, **opts)
    rng = np.random.default_rng(7)
    for n in (0, 1, 3, len(ROWS), 2):
        rows = list(zip(rng.integers(0, K, len(ROWS)).tolist(), rng.permutation(S)[:len(ROWS)].tolist()))
        plan.copy_(plan_of(rows, "cuda"))
        count.fill_(n)
        poison(pool)
        graph.replay()
        torch.cuda.synchronize()
        check(store, pool, rows[:n])


@pytest.mark.gpu
def test_gpu_copy_engine_path_on_a_side_stream():
    banks = GPU_BANKS["expert"]
    store = make_store(banks, K, seed=33, pin=True)
    pool = poisoned_pool(banks, S, "cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    rows = [(4, 0), (5, 1), (6, 2), (0, 8), (12, 4)]
    assert miss_copy_ce(store, pool, np.array(rows), stream=stream) == 3 * len(banks)
    stream.synchronize()
    check(store, pool, rows)


@pytest.mark.gpu
def test_gpu_miss_copy_needs_pinned_memory():
    banks = BANK_SETS["bf16"]
    store, pool = make_store(banks, K, seed=1, pin=False), poisoned_pool(banks, S, "cuda")
    with pytest.raises(RuntimeError, match="pin=True"):
        miss_copy(store, pool, plan_of(ROWS, "cuda"), count_of(1, "cuda"))
