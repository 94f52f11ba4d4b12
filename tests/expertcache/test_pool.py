"""Slot pool memory: Bank specs, the host store, the device pool and its size checks."""

import pytest
import torch

from expertcache.pool import Bank, HostStore, PoolError, SlotPool

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn

BANKS = (Bank("gate_up", (8, 16), BF16), Bank("down", (16, 4), BF16), Bank("scale", (4,), torch.float32))
SLOT_BYTES = 8 * 16 * 2 + 16 * 4 * 2 + 4 * 4


def test_bank_sizes_and_list_shape():
    b = Bank("gate_up", [8, 16], BF16)
    assert b.row_shape == (8, 16) and b.row_numel == 128 and b.row_bytes == 256
    assert Bank("w", (3,), FP8).row_bytes == 3


@pytest.mark.parametrize(
    "name, shape, dtype",
    [("", (4,), BF16), (3, (4,), BF16), ("w", (), BF16), ("w", (0, 4), BF16), ("w", (-1,), BF16),
     ("w", (True,), BF16), ("w", (2.0,), BF16), ("w", 4, BF16), ("w", (4,), "bfloat16")],
)
def test_bank_rejects_bad_specs(name, shape, dtype):
    with pytest.raises(PoolError):
        Bank(name, shape, dtype)


def test_host_store_from_tensors_shapes_and_bytes():
    gate_up = torch.randn(5, 8, 16).to(BF16)
    down = torch.randint(1, 255, (5, 48), dtype=torch.uint8).view(FP8)
    store = HostStore.from_tensors({"gate_up": gate_up, "down": down}, pin=False)
    assert store.num_keys == 5 and not store.pinned
    assert store.banks == (Bank("gate_up", (8, 16), BF16), Bank("down", (48,), FP8))
    assert store.bytes_per_expert == 256 + 48 and store.nbytes == 5 * 304
    assert torch.equal(store.tensor("gate_up"), gate_up)
    assert store.bank("down").dtype == FP8
    with pytest.raises(PoolError, match="no bank named"):
        store.tensor("up")


def test_host_store_empty_and_validation():
    store = HostStore.empty(BANKS, 7, pin=False)
    assert [tuple(store.tensor(b.name).shape) for b in BANKS] == [(7, 8, 16), (7, 16, 4), (7, 4)]
    assert store.nbytes == 7 * SLOT_BYTES
    with pytest.raises(PoolError, match="num_keys"):
        HostStore.empty(BANKS, 0, pin=False)
    with pytest.raises(PoolError, match="unique"):
        HostStore.empty((BANKS[0], BANKS[0]), 3, pin=False)
    with pytest.raises(PoolError, match="same number"):
        HostStore.from_tensors({"a": torch.zeros(3, 4), "b": torch.zeros(4, 4)}, pin=False)
    with pytest.raises(PoolError, match="num_keys, \\*row_shape"):
        HostStore.from_tensors({"a": torch.zeros(3)}, pin=False)


@pytest.mark.cpu_only
def test_device_view_needs_cuda():
    store = HostStore.empty(BANKS, 2, pin=False)
    with pytest.raises(RuntimeError, match="CUDA"):
        store.device_view("down")


def test_slot_pool_sizes_and_rebuild():
    pool = SlotPool(BANKS, 6, "cpu")
    assert pool.num_slots == 6 and pool.bytes_per_slot == SLOT_BYTES
    assert pool.nbytes == 6 * SLOT_BYTES and pool.available_bytes() is None
    assert tuple(pool.tensor("gate_up").shape) == (6, 8, 16) and pool.tensor("gate_up").dtype == BF16
    old = pool.tensor("down")
    pool.rebuild(11)
    assert pool.num_slots == 11 and tuple(pool.tensor("down").shape) == (11, 16, 4)
    assert pool.tensor("down") is not old and pool.nbytes == 11 * SLOT_BYTES
    with pytest.raises(PoolError, match="no bank named"):
        pool.tensor("up")


@pytest.mark.parametrize("slots", [0, -3, 1.5, True, None])
def test_slot_pool_rejects_bad_slot_counts(slots):
    with pytest.raises(PoolError, match="--moe-slots"):
        SlotPool(BANKS, slots, "cpu")


def test_slot_pool_over_memory_names_the_flag_and_the_maximum():
    budget = 10 * SLOT_BYTES + 5
    pool = SlotPool(BANKS, 10, "cpu", max_bytes=budget)
    with pytest.raises(PoolError, match=r"--moe-slots 11 .*at most 10 slots fit") as err:
        pool.rebuild(11)
    assert isinstance(err.value, ValueError)
    assert pool.num_slots == 10 and tuple(pool.tensor("scale").shape) == (10, 4)  # unchanged
    with pytest.raises(PoolError, match="at most 10 slots"):
        SlotPool(BANKS, 1000, "cpu", max_bytes=budget)


@pytest.mark.gpu
def test_gpu_pool_over_device_memory_raises():
    free, _ = torch.cuda.mem_get_info()
    slots = free // SLOT_BYTES + 1
    with pytest.raises(PoolError, match=r"--moe-slots .*at most \d+ slots fit"):
        SlotPool(BANKS, int(slots), "cuda")


@pytest.mark.gpu
def test_gpu_rebuild_frees_the_old_pool_first():
    big = Bank("w", (1 << 20,), torch.uint8)  # 1 MiB a slot
    pool = SlotPool((big,), 512, "cuda")
    assert pool.tensor("w").is_cuda
    base = torch.cuda.memory_allocated() - pool.nbytes
    pool.rebuild(256)
    assert torch.cuda.memory_allocated() - base == 256 << 20


@pytest.mark.gpu
def test_gpu_device_view_of_pinned_store():
    store = HostStore.empty(BANKS, 4)
    assert store.pinned and store.tensor("down").is_pinned()
    view = store.device_view("down", torch.int32)
    assert view.data_ptr() != 0 and view.dtype == torch.int32
    assert store.device_view("down", torch.int32) is view  # cached
    unpinned = HostStore.empty(BANKS, 4, pin=False)
    with pytest.raises(RuntimeError, match="pin=True"):
        unpinned.device_view("down")
