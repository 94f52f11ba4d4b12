"""DeviceCache.ensure_copy: the ensure and its miss copy in one launch against ensure() followed by
miss_copy(), bit for bit (state, plan, count, slots, pool contents), on the CPU interpreter and on
the GPU (`gpu`: eager, programmatic and under CUDA-graph replay)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertcache import CacheGeometry, EnsureError, policy_names
from expertcache.copy import miss_copy
from expertcache.device import DeviceCache
from expertcache.pool import Bank, HostStore, SlotPool
from tests.conftest import device_or_skip

BANKS = (Bank("gate_up", (4, 24), torch.bfloat16), Bank("down", (80,), torch.float8_e4m3fn))


def store_and_pools(L, E, S, device, seed):
    """A store of random bytes (never constant) and two pools poisoned alike."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {b.name: torch.randint(0, 256, (L * E, b.row_bytes), dtype=torch.uint8, generator=gen)
               .view(b.dtype).view(L * E, *b.row_shape) for b in BANKS}
    store = HostStore.from_tensors(tensors, pin=device.type == "cuda")
    pools = []
    for _ in range(2):
        pool = SlotPool(BANKS, S, device)
        for b in BANKS:
            pool.tensor(b.name).view(torch.uint8).fill_(0xA5)
        pools.append(pool)
    return store, pools


def same(a: DeviceCache, b: DeviceCache, pa: SlotPool, pb: SlotPool) -> None:
    assert a.snapshot().equals(b.snapshot())
    for bank in BANKS:
        assert torch.equal(pa.tensor(bank.name).view(torch.uint8), pb.tensor(bank.name).view(torch.uint8)), bank.name
    assert int(b.ready.item()) == 0 and int(b.done.item()) == 0  # zero again for the next call


def run_pair(policy, L, E, S, rows, k, calls, seed, pdl=False, graph=False, num_ctas=3, **tiles):
    device, _ = device_or_skip()
    g = CacheGeometry(L, E, S)
    store, (pa, pb) = store_and_pools(L, E, S, device, seed)
    a, b = DeviceCache(g, policy, device=device, **tiles), DeviceCache(g, policy, device=device, **tiles)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((calls, rows, E)), axis=-1)[..., :k].astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1
    ids_buf = torch.zeros((rows, k), dtype=torch.int32, device=device)
    copies = 0

    def step(layer):
        buf_a = a.ensure(layer, ids_buf, pdl=pdl)
        miss_copy(store, pa, buf_a.plan, buf_a.count, pdl=pdl, num_ctas=num_ctas, block_bytes=64)
        return buf_a, b.ensure_copy(layer, ids_buf, store, pb, pdl=pdl, num_ctas=num_ctas, block_bytes=64)

    replay = None
    for c in range(calls):
        layer = c % L
        ids_buf.copy_(torch.as_tensor(ids[c]))
        if graph and replay is None and c >= L:  # capture one call per layer after every kernel compiled
            graphs = []
            for lay in range(L):
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    out = step(lay)
                graphs.append((gr, out))
            replay = graphs
        if replay is not None:
            replay[layer][0].replay()
            buf_a, buf_b = replay[layer][1]
        else:
            buf_a, buf_b = step(layer)
        m = int(buf_a.count.item())
        copies += m
        assert int(buf_b.count.item()) == m
        assert torch.equal(buf_a.plan[:m], buf_b.plan[:m]) and torch.equal(buf_a.slots, buf_b.slots)
        same(a, b, pa, pb)
    return copies


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("chunk", [8, 64], ids=["several-programs", "one-program"])
def test_ensure_copy_matches_ensure_then_copy(policy, chunk):
    """While the pool fills and once every call evicts, with padding, on several ensure programs (the
    last to arrive commits and tells the copy) and on one."""
    copies = run_pair(policy, L=2, E=16, S=12, rows=2, k=3, calls=24, seed=chunk, chunk=chunk)
    assert copies > 24


def test_ensure_copy_of_a_refused_call_copies_nothing():
    """A refused call (an id out of range) changes nothing and copies nothing; the next call works."""
    device, _ = device_or_skip()
    g = CacheGeometry(1, 8, 4)
    store, (_, pool) = store_and_pools(1, 8, 4, device, 3)
    dev = DeviceCache(g, "lru", device=device)
    before = [pool.tensor(b.name).clone() for b in BANKS]
    dev.ensure_copy(0, torch.tensor([[1, 9]], dtype=torch.int32, device=device), store, pool)
    assert all(torch.equal(t, pool.tensor(b.name)) for t, b in zip(before, BANKS))
    assert int(dev.ready.item()) == 0 and int(dev.done.item()) == 0
    with pytest.raises(EnsureError, match="refused"):
        dev.check()
    buf = dev.ensure_copy(0, torch.tensor([[1, 2]], dtype=torch.int32, device=device), store, pool)
    assert int(buf.count.item()) == 2
    for b in BANKS:
        got = pool.tensor(b.name).view(torch.uint8).reshape(4, -1)
        src = store.tensor(b.name).view(torch.uint8).reshape(8, -1)
        assert torch.equal(got[:2].cpu(), src[1:3].cpu())


def test_ensure_copy_checks_its_pool():
    device, _ = device_or_skip()
    store, (pool, _) = store_and_pools(1, 8, 4, device, 5)
    dev = DeviceCache(CacheGeometry(1, 8, 5), "lru", device=device)
    ids = torch.tensor([[1]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="must be this cache's"):
        dev.ensure_copy(0, ids, store, pool)
    dev = DeviceCache(CacheGeometry(1, 8, 4), "lru", device=device)
    for bad in ({"num_ctas": 0}, {"block_bytes": 48}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dev.ensure_copy(0, ids, store, pool, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("pdl, graph", [(False, False), (True, False), (True, True)],
                         ids=["eager", "programmatic", "graph"])
@pytest.mark.parametrize("S, tiles", [(48, {}), (1650, {}), (1650, {"chunk": 512})],
                         ids=["48", "1650", "1650-four-programs"])
def test_gpu_ensure_copy_matches_ensure_then_copy(policy, pdl, graph, S, tiles):
    """On the GPU: eager, programmatic launches, and one call per layer captured in CUDA graphs and
    replayed with new routing; 16 copy programs as the layer runs them."""
    _, gpu = device_or_skip()
    if not gpu:
        pytest.skip("needs CUDA")
    copies = run_pair(policy, L=4, E=max(16, S // 2), S=S, rows=2, k=8, calls=48, seed=S, pdl=pdl,
                      graph=graph, num_ctas=16, **tiles)
    assert copies > 48


COMPILE_CHECK = r"""
import json
from expertcache.ensure_copy import ENSURE_COPY_JIT, ensure_copy_kernel
from moe.triton_launch import compile_for_sm

types = ("*i32", "*i32", "*fp32", "*i32", "*i32", "*i64", "*i64", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64",
         "*i32", "*i32", "*i32", "*i64", "*i32", "*i32", "*i64") + ("i32",) * 8 + ("*i32", "*i32", "i32", "i32",
         ("*i32", "*i32"), ("*i32", "*i32"))
out = []
for policy, chunk, single, warps, rule in ((0, 2048, True, 4, False), (1, 2048, True, 8, True), (0, 512, False, 4, False)):
    cx = dict(POLICY=policy, HAS_LOGITS=False, CHUNK=chunk, BLOCK_Q=16, BLOCK_R=1, BLOCK_C=16 if single else 64,
              SINGLE=single, SEQ_MAX=16, LEAN=True, EARLY=True, TABLE=True, MIRROR=rule, GDC=True,
              LATE_RANKS=rule, NARROW=rule, NUM_BANKS=2, ROW_WORDS=(1048576, 524288), FIRST_CHUNK=(0, 256, 384),
              CHUNKS_PER_ROW=384, BLOCK=4096, GRID_ENSURE=1 if single else 4)
    ptx = compile_for_sm(ensure_copy_kernel, types, cx, warps, 90, ENSURE_COPY_JIT)["ptx"]
    out.append([".local" not in ptx, "gpu.acquire" in ptx, "gpu.release.exch" in ptx, "griddepcontrol.wait" in ptx,
                ".cg" in ptx])
print(json.dumps(out))
"""


def test_ensure_copy_compiles_for_sm90():
    """The one-launch ensure and copy compiles for sm_90 (lru on one program and on four, rule with its
    mirror and int32 score) without spills, with the copy's acquire of `ready`, the committing
    program's release of it, the programmatic wait and the plan read past L1. A child process without
    TRITON_INTERPRET."""
    from tests.conftest import compile_check
    assert compile_check(COMPILE_CHECK) == [[True] * 5] * 3
