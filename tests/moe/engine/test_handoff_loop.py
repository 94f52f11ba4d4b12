"""The hand-off worker's compiled loop (moe.engine.handoff.serve_posts) on the CPU: the device's side of the
protocol played by the test (payload, meta, then flag_in = seq), each answer checked bit for bit against
CpuExperts.moe of the same post. The loop's GPU runs, with mapped memory and the post and wait kernels:
tests/moe/engine/test_hybrid_gpu.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moe.engine.handoff import (
    CHECK,
    IDLE,
    META_CUT,
    META_LAYER,
    META_ROWS,
    META_SPLIT,
    STOPPED,
    TRACE_LEN,
    WAKE,
    serve_posts,
)
from moe.kernels.cpu_experts import ASLEEP, SPIN_PAUSES, CpuExperts, set_threads
from moe.model.config import MoEConfig
from moe.testing.synthetic import random_weights

H, I, E, K, L, ROWS = 256, 128, 6, 3, 2, 8


@pytest.fixture(scope="module")
def experts():
    cfg = MoEConfig(hidden=H, num_experts=E, top_k=K, expert_intermediate=I, expert_format="nvfp4",
                    activation="swiglu_clamped", expert_bias=True)
    ex = CpuExperts(random_weights(cfg, L, device="cpu", seed=5, pin=False).store, cfg)
    set_threads(2)
    yield ex
    set_threads(None)
    ex.close()


class Device:
    """The device's side: the mapped buffers as numpy arrays, and posts."""

    def __init__(self) -> None:
        self.flag_in, self.flag_out, self.stop = (np.zeros(1, np.int32) for _ in range(3))
        self.meta = np.zeros(4, np.int32)
        self.x, self.out = np.zeros((ROWS, H), np.float32), np.zeros((ROWS, H), np.float32)
        self.ids, self.weights = np.full((ROWS, K), -1, np.int32), np.zeros((ROWS, K), np.float32)
        self.ring, self.ring_at, self.tracing = np.zeros((TRACE_LEN, 4), np.int64), np.zeros(1, np.int64), \
            np.ones(1, np.int64)
        self.seq = 0

    def post(self, layer, x, ids, weights, split=None) -> int:
        rows = x.shape[0]
        self.x[:rows], self.ids[:rows], self.weights[:rows] = x, ids, weights
        self.meta[META_LAYER], self.meta[META_ROWS] = layer, rows
        self.meta[META_SPLIT], self.meta[META_CUT] = split if split is not None else (-1, I)
        self.seq += 1
        self.flag_in[0] = self.seq
        return self.seq

    def answered(self, seq: int, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        while self.flag_out[0] != seq and time.monotonic() < end:
            time.sleep(1e-4)
        return self.flag_out[0] == seq

    def serve(self, ex: CpuExperts, last: int, pending: int, woke: bool = False, spin: int = 10 ** 9,
              rewake: bool = False):
        """serve_posts under ex.leading(); with rewake, called again with woke after each WAKE, as the
        worker does."""
        while True:
            with ex.leading() as ctrl:
                status, s = serve_posts(self.flag_in, self.flag_out, self.stop, self.meta, self.x, self.ids,
                                        self.weights, self.out, ctrl, ex.gate_up, ex.down, ex.spec, ex.scratch,
                                        ex.num_layers, E, I, ex.tail_granule, last, pending, woke, spin, self.ring,
                                        self.ring_at, self.tracing)
            if not (rewake and status == WAKE):
                return int(status), int(s)
            pending, woke = int(s), True


def _calls(seed: int):
    rng = np.random.default_rng(seed)
    for rows in (1, 3, 8):
        x = rng.standard_normal((rows, H)).astype(np.float32)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(rows)]).astype(np.int32)
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[0, 0] = 2
        yield rows % L, x, ids, rng.random((rows, K)).astype(np.float32)


def test_each_post_is_answered_with_what_moe_gives_and_traced(experts):
    """Posts of 1, 3 and 8 rows, one with a split expert and one serving nothing, answered in turn by one
    running loop; its trace records each; stop ends it."""
    calls = list(_calls(1))
    split = (2, experts.tail_granule)
    want = [experts.moe(layer, x, ids, w, split=split if n == 1 else None)
            for n, (layer, x, ids, w) in enumerate(calls)]
    dev = Device()
    got = {}
    runner = threading.Thread(target=lambda: got.setdefault("r", dev.serve(experts, 0, 0, rewake=True)))
    runner.start()
    try:
        for n, (layer, x, ids, w) in enumerate(calls):
            s = dev.post(layer, x, ids, w, split if n == 1 else None)
            assert dev.answered(s)
            assert np.array_equal(dev.out[:x.shape[0]].view(np.uint32), want[n].view(np.uint32)), n
        dev.out[:] = 7.0
        s = dev.post(1, calls[0][1], np.full((1, K), -1, np.int32), calls[0][3])  # nothing served
        assert dev.answered(s) and (dev.out[:1] == 0).all() and (dev.out[1:] == 7).all()
    finally:
        dev.stop[0] = 1
        runner.join(timeout=60)
    assert got["r"] == (STOPPED, 4)
    trace = dev.ring[:int(dev.ring_at[0])]
    assert [int(e[2]) for e in trace] == [1, 1, 0, 1]
    assert [int(e[3]) for e in trace] == [int((c[2] >= 0).sum()) for c in calls] + [0]
    assert (trace[:, 0] <= trace[:, 1]).all() and (np.diff(trace[:, 0]) >= 0).all()


def test_a_bad_post_is_left_to_the_checked_path_and_idle_returns(experts):
    """An id out of range, a split expert not routed, a layer out of range: CHECK with the post's seq,
    unanswered; with no post within `spin` waits the loop returns IDLE with the last seq it served."""
    dev = Device()
    layer, x, ids, w = next(_calls(2))
    s = dev.post(layer, x, ids, w)
    assert dev.serve(experts, 0, s, spin=1000, rewake=True) == (IDLE, s)
    assert dev.flag_out[0] == s
    for bad in ("id", "split", "layer", "cut"):
        bad_ids, split, lay = ids.copy(), None, layer
        if bad == "id":
            bad_ids[0, 1] = E
        elif bad == "split":
            split = (int(np.setdiff1d(np.arange(E), ids)[0]), experts.tail_granule)
        elif bad == "cut":
            split = (2, experts.tail_granule + 1)
        else:
            lay = L
        before = dev.flag_out[0]
        s = dev.post(lay, x, bad_ids, w, split)
        assert dev.serve(experts, before, s, spin=1000, rewake=True) == (CHECK, s), bad
        assert dev.flag_out[0] == before, bad  # not answered: the worker's Python path raises the error
        dev.flag_out[0] = s


def test_a_pool_asleep_is_woken_before_the_post_is_served(experts):
    """With the pool's threads asleep (spin 0), a post returns WAKE unserved; called again with woke (the
    pool woken by leading()), it is served."""
    calls = list(_calls(3))
    want = experts.moe(*calls[2])
    dev = Device()
    experts.spin_pauses = 0
    try:
        experts.moe(*calls[0])  # the pool made; its threads go to sleep at once after
        deadline = time.monotonic() + 30
        while experts._pool.ctrl[ASLEEP] == 0 and time.monotonic() < deadline:
            time.sleep(1e-3)
        s = dev.post(*calls[2])
        assert dev.serve(experts, 0, s, spin=1000) == (WAKE, s)
        assert dev.flag_out[0] == 0
        assert dev.serve(experts, 0, s, woke=True, spin=1000) == (IDLE, s)
        assert np.array_equal(dev.out[:8].view(np.uint32), want.view(np.uint32))
    finally:
        experts.spin_pauses = SPIN_PAUSES
