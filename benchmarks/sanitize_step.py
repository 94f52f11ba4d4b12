"""A small captured decode step (ensure + miss copy per layer) for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 benchmarks/sanitize_step.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize_step.py

Every policy; 4 layers x 32 experts, 40 slots on 3 programs (evictions every step), batch 2,
top-4 with the router's top-6 logits (rule's near-miss refresh);
eager calls first (compilation), then a CUDA graph replayed with fresh routing. Checks
the pool against the host store at the end, so a wrong copy fails too.
"""

from __future__ import annotations

import numpy as np
import torch

from expertcache import CacheGeometry, policy_names
from expertcache.copy import miss_copy
from expertcache.device.cache import DeviceCache, EnsureTuning
from expertcache.pool import Bank, HostStore, SlotPool


def run(policy: str) -> None:
    L, E, S, rows, k, T = 4, 32, 40, 2, 4, 6
    g = CacheGeometry(L, E, S)
    rng = np.random.default_rng(1)
    banks = [Bank("gate_up", (2, 64), torch.bfloat16), Bank("down", (64,), torch.bfloat16)]
    store = HostStore.from_tensors({b.name: torch.randn((L * E, *b.row_shape)).to(b.dtype)
                                    for b in banks})
    pool = SlotPool(banks, S, "cuda")
    dev = DeviceCache(g, policy, device="cuda", tuning=EnsureTuning(chunk=16))
    ids = torch.zeros((L, rows, k), dtype=torch.int32, device="cuda")
    lidx = torch.zeros((L, rows, T), dtype=torch.int32, device="cuda")
    lval = torch.zeros((L, rows, T), dtype=torch.float32, device="cuda")

    def feed():
        top = np.argsort(rng.random((L, rows, E)), -1)[..., :T].astype(np.int32)
        lidx.copy_(torch.as_tensor(top))
        ids.copy_(lidx[..., :k])
        vals = -np.sort(-rng.standard_normal((L, rows, T)), -1).astype(np.float32)
        lval.copy_(torch.as_tensor(np.round(vals * 4) / 4))

    def step():
        for layer in range(L):
            buf = dev.ensure(layer, ids[layer], lidx[layer], lval[layer])
            miss_copy(store, pool, buf.plan, buf.count)

    feed()
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        feed()
        graph.replay()
    torch.cuda.synchronize()
    dev.check()
    key_of = dev.key_of.cpu()
    for b in banks:
        want = store.tensor(b.name)[key_of.long()]
        assert torch.equal(pool.tensor(b.name).cpu(), want), (policy, b.name)
    print(policy, "ok", dev.counters.sum(0).tolist())


if __name__ == "__main__":
    for p in policy_names():
        run(p)
