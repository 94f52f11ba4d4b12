"""GPU decode with the misses split between the slots and a CPU worker inside the decode graph.

The decode tests measure no channels: their table is that of equal channels (an even split, so both
sides serve misses on a tiny checkpoint, whose experts' fixed costs would send the real table to copy
everything); the channels themselves are measured in test_channels_measured_together."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moe.engine import loading
from moe.engine.channels import ChannelMeasure, measure_channels
from moe.engine.loading import load_model
from tests.moe.families import assert_near, hf_logits, random_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def even_channels(request, monkeypatch):
    """Equal channels, no fixed parts: the hybrid table copies half of a call's misses (an odd one cut by a tail)."""
    if request.node.originalname != "test_channels_measured_together":
        monkeypatch.setattr(loading, "measure_channels",
                            lambda store, cfg, device: ChannelMeasure(store.bytes_per_expert, 8, cfg.top_k, 10.0,
                                                                      80.0, 80.0, 10.0, 80.0, 80.0, 4, 0.0))


def _teacher_forced(engine, seq: list[int], prompt_len: int) -> torch.Tensor:
    out = [engine.prefill([seq[:prompt_len]], all_logits=True)[0]]
    out += [engine.decode_step([t]).float().cpu() for t in seq[prompt_len:]]
    return torch.cat([o.float().cpu() for o in out])


@pytest.mark.parametrize("service", ["hybrid", "cpu"])
def test_gpu_split_decode_matches_transformers_in_graphs_and_eager(checkpoint, service):
    """float32 logits within 1e-4 of transformers' with CUDA graphs and eager, bit for bit between the
    two, greedy tokens identical; the device served misses on the CPU."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    seq = random_tokens(12, seed=5)
    ref = hf_logits(model, seq).logits[0]
    got = {}
    for graphs in (True, False):
        engine = load_model(path, "cuda", num_slots=k + 1, max_seq_len=48, progress=False, miss_service=service,
                            cuda_graphs=graphs)
        got[graphs] = _teacher_forced(engine, seq, prompt_len=6)
        served = engine.moe.slots.cache.served.sum().item()
        assert served > 0
        engine.moe.slots.close()
    assert_near(got[True], ref, rel=1e-4)
    assert torch.equal(got[True], got[False])


def test_gpu_hybrid_same_tokens_every_run(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    prompt = random_tokens(5, seed=6)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                             pad_token_id=0)[0, len(prompt):].tolist()
    for _ in range(3):
        engine = load_model(path, "cuda", num_slots=k + 1, max_seq_len=48, progress=False, miss_service="hybrid")
        assert engine.generate([prompt], max_new_tokens=6) == [ref]
        engine.moe.slots.close()


def test_gpu_hybrid_with_every_expert_in_a_slot_has_no_hand_off(checkpoint):
    """A hybrid split whose slots hold every routed expert runs as copy on the device too: no CPU share,
    no post / wait kernels in the plan, no scratch slot, and the tokens of copy."""
    from expertcache.split import ChannelCosts, MissSplit
    from moe.engine.backends import GpuMoE
    from moe.model.checkpoint import load_checkpoint

    name, model, path = checkpoint
    weights = load_checkpoint(path, "cuda", progress=False)
    keys = weights.spec.num_moe_layers * weights.spec.moe.num_experts
    backend = GpuMoE(weights, keys, split=MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0)))
    assert backend.slots.share is None and backend.extra_slots == 0
    assert not any(layer.plan.cpu_share for layer in backend.layers.values())
    prompt = random_tokens(5, seed=6)
    tokens = {}
    for service in ("copy", "hybrid"):
        engine = load_model(path, "cuda", num_slots=keys, max_seq_len=32, progress=False, miss_service=service)
        tokens[service] = engine.generate([prompt], max_new_tokens=6)
        assert engine.moe.slots.share is None
    assert tokens["hybrid"] == tokens["copy"]


def test_channels_measured_together(checkpoint, caplog):
    """measure_channels on a checkpoint's pinned store: every time and rate positive, within the 2 s the
    start may spend; load_model's auto logs what it measured and its pick."""
    name, model, path = checkpoint
    engine = load_model(path, "cuda", num_slots=model.config.num_experts_per_tok + 1, max_seq_len=16,
                        progress=False)
    m = measure_channels(engine.moe.store, engine.moe.cfg, "cuda")
    assert m.seconds < 2.0, m
    assert min(m.link_one_us, m.link_all_us, m.link_together_us, m.cpu_one_us, m.cpu_all_us, m.cpu_together_us) > 0
    g = m.gbps()
    assert all(v > 0 for v in g.values()), g
    engine.moe.slots.close()
    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        engine = load_model(path, "cuda", num_slots=model.config.num_experts_per_tok + 1, max_seq_len=16,
                            progress=False, miss_service="auto")
    assert "--moe-miss-service auto" in caplog.text and "chose " in caplog.text and "GB/s" in caplog.text
    engine.moe.slots.close()


def _hand_off_inputs(cfg):
    """(generator, (hidden [2, H] bf16, ids [2, 3] int32, weights, addend, dst full of NaN)) on the GPU."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn((2, cfg.hidden), generator=g).to(torch.bfloat16).cuda()
    ids = torch.tensor([[0, 3, 5], [2, 3, 4]], dtype=torch.int32, device="cuda")
    weights = torch.rand((2, 3), generator=g).cuda()
    addend = torch.randn((2, cfg.hidden), generator=g).cuda()
    return g, (hidden, ids, weights, addend, torch.full((2, cfg.hidden), float("nan"), device="cuda"))


def test_the_hand_off_serves_only_what_the_ensure_sent_to_the_cpu():
    """CpuShare on its own, in a CUDA graph: a call with no CPU_SLOT position wakes no worker and adds
    nothing (dst = addend); `always` hands over anyway and the worker answers with nothing served; a call
    with CPU positions gets CpuExperts' sum of exactly those, added to the addend."""
    from expertcache.geometry import CPU_SLOT
    from moe.engine.handoff import CpuShare
    from moe.kernels.cpu_experts import CpuExperts
    from moe.model.config import MoEConfig
    from moe.testing.synthetic import random_weights

    cfg = MoEConfig(hidden=256, num_experts=6, top_k=3, expert_intermediate=64, expert_format="bf16",
                    dtype="bfloat16")
    store = random_weights(cfg, 2, device="cpu", seed=4, pin=True).store
    experts = CpuExperts(store, cfg)
    share = CpuShare(experts, torch.device("cuda"))
    share.trace = []
    try:
        g, (hidden, ids, weights, addend, dst) = _hand_off_inputs(cfg)
        slots = torch.zeros((2, 3), dtype=torch.int32, device="cuda")
        always = [False]

        def call() -> None:
            share.post(1, hidden, ids, slots, weights, always=always[0])
            share.wait(addend, dst)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the inputs above, and the share's counters
        with torch.cuda.stream(stream):
            call()
            always[0] = True
            call()
            always[0] = False
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call()

        def replay() -> torch.Tensor:
            graph.replay()
            torch.cuda.synchronize()
            return dst.cpu()

        assert [e[2:] for e in share.trace] == [(1, 0)]  # the eager pair: only `always` handed over
        slots[0, 1] = slots[1, 2] = CPU_SLOT
        slots[0, 0] = 7
        served = replay()
        assert [e[2:] for e in share.trace] == [(1, 0), (1, 2)]
        cpu_ids = np.full((2, 3), -1, np.int32)
        cpu_ids[0, 1], cpu_ids[1, 2] = 3, 4
        want = experts.moe(1, hidden.float().cpu().numpy(), cpu_ids, weights.cpu().numpy())
        assert torch.equal(served, addend.cpu() + torch.from_numpy(want))
        slots.zero_()
        assert torch.equal(replay(), addend.cpu()) and len(share.trace) == 2  # nothing handed over
        share.check()
    finally:
        share.close()


def test_the_wait_adds_routed_to_the_cpu_share_and_the_addend_rounding_once():
    """CpuShare.wait with routed (the GPU's routed sum) into a bfloat16 dst: bitwise torch's
    (routed + (the CPU's share + addend)).to(bfloat16), the float32 sums in the order the down adds its
    addend; in place into a float32 routed the same sum, unrounded; nothing served: routed + addend."""
    from expertcache.geometry import CPU_SLOT
    from moe.engine.handoff import CpuShare
    from moe.kernels.cpu_experts import CpuExperts
    from moe.model.config import MoEConfig
    from moe.testing.synthetic import random_weights

    cfg = MoEConfig(hidden=256, num_experts=6, top_k=3, expert_intermediate=64, expert_format="bf16",
                    dtype="bfloat16")
    store = random_weights(cfg, 2, device="cpu", seed=4, pin=True).store
    experts = CpuExperts(store, cfg)
    share = CpuShare(experts, torch.device("cuda"))
    try:
        g, (hidden, ids, weights, addend, _) = _hand_off_inputs(cfg)
        routed = torch.randn((2, cfg.hidden), generator=g).cuda()
        dst = torch.full((2, cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        slots = torch.tensor([[7, CPU_SLOT, 1], [0, 2, CPU_SLOT]], dtype=torch.int32, device="cuda")
        cpu_ids = np.array([[-1, 3, -1], [-1, -1, 4]], np.int32)
        cpu = torch.from_numpy(experts.moe(1, hidden.float().cpu().numpy(), cpu_ids, weights.cpu().numpy()))
        want = routed.cpu() + (cpu + addend.cpu())
        share.post(1, hidden, ids, slots, weights)
        assert share.wait(addend, dst, routed=routed) is dst
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), want.to(torch.bfloat16))
        y = routed.clone()
        share.post(1, hidden, ids, slots, weights)
        share.wait(addend, y, routed=y)
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), want)
        share.post(1, hidden, ids, torch.zeros_like(slots), weights)  # nothing on the CPU: nothing handed over
        share.wait(addend, dst, routed=routed)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), (routed + addend).cpu().to(torch.bfloat16))
        with pytest.raises(ValueError, match="routed must be"):
            share.wait(addend, dst, routed=routed.bfloat16())
        share.check()
    finally:
        share.close()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_hand_off_splits_the_first_served_expert_with_a_tail(fmt):
    """CpuShare with a tail, in a CUDA graph: the post rewrites the first served expert's positions to the
    scratch slot and writes (key, scratch, cut) for the miss copy, which brings its rows [cut, I) into the
    scratch slot; the worker computes its rows [0, cut) (CpuExperts' split) beside the other served expert;
    the tail zeroing zeroes the scratch positions' act rows below the cut, and only theirs. A call whose
    copies differ from the table's copies[m] splits nothing."""
    from expertcache.copy import miss_copy, reference_tail_copy
    from expertcache.geometry import CPU_SLOT
    from expertcache.pool import SlotPool
    from expertcache.split import SPLIT_LEN, MissSplit
    from moe.engine.handoff import CpuShare
    from moe.kernels.cpu_experts import CpuExperts
    from moe.model.config import MoEConfig
    from moe.testing.synthetic import random_weights

    inter, E, layer = 64, 6, 1
    cfg = MoEConfig(hidden=256, num_experts=E, top_k=3, expert_intermediate=inter, expert_format=fmt,
                    dtype="bfloat16")
    store = random_weights(cfg, 2, device="cpu", seed=4, pin=True).store
    experts = CpuExperts(store, cfg)
    copies = np.arange(SPLIT_LEN, dtype=np.int32)
    copies[3] = 1  # 3 misses: one copied, two served, and the first of those split at 16 rows
    rows = np.zeros(SPLIT_LEN, dtype=np.int32)
    rows[3] = 48
    split = MissSplit("hybrid", copies, link_rows=rows, inter=inter)
    pool = SlotPool(store.banks, 5, device="cuda")
    for b in pool.banks:
        pool.tensor(b.name).view(torch.uint8).fill_(0)
    scratch = 4
    share = CpuShare(experts, torch.device("cuda"), split, scratch)
    try:
        g, (hidden, ids, weights, addend, dst) = _hand_off_inputs(cfg)
        base = torch.tensor([[7, CPU_SLOT, 1], [0, CPU_SLOT, CPU_SLOT]], dtype=torch.int32, device="cuda")
        slots = base.clone()
        count = torch.tensor([1], dtype=torch.int32, device="cuda")  # the ensure's copies
        plan = torch.tensor([[layer * E + 5, 1]], dtype=torch.int32, device="cuda")
        act = torch.randn((6, inter), generator=g).cuda()
        act0 = act.clone()

        def call() -> None:
            slots.copy_(base)
            act.copy_(act0)
            share.post(layer, hidden, ids, slots, weights, count=count)
            miss_copy(store, pool, plan, count, tail=(share.tail, inter))
            share.zero_tail(act, slots)
            share.wait(addend, dst)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call()
        graph.replay()
        torch.cuda.synchronize()
        cut = inter - 48
        # served: experts 3 (positions (0, 1), (1, 1): the first CPU position) and 4; 3 is split
        assert slots.cpu().tolist() == [[7, scratch, 1], [0, scratch, CPU_SLOT]]
        assert share.tail.cpu().tolist() == [layer * E + 3, scratch, cut]
        want_pool = SlotPool(store.banks, 5, device="cpu")
        for b in want_pool.banks:
            want_pool.tensor(b.name).view(torch.uint8).fill_(0)
        reference_tail_copy(store, want_pool, layer * E + 3, scratch, cut, inter)
        for b in pool.banks:
            assert torch.equal(pool.tensor(b.name)[scratch].cpu().view(torch.uint8),
                               want_pool.tensor(b.name)[scratch].view(torch.uint8)), b.name
        zeroed = act0.clone()
        zeroed[1, :cut] = 0
        zeroed[4, :cut] = 0
        assert torch.equal(act.cpu(), zeroed.cpu())
        cpu_ids = np.array([[-1, 3, -1], [-1, 3, 4]], np.int32)
        want = experts.moe(layer, hidden.float().cpu().numpy(), cpu_ids, weights.cpu().numpy(), split=(3, cut))
        assert torch.equal(dst.cpu(), addend.cpu() + torch.from_numpy(want))
        count.fill_(2)  # a filling pool copied more than the table's copies[3]: no split
        graph.replay()
        torch.cuda.synchronize()
        assert slots.cpu().tolist() == base.cpu().tolist() and share.tail.cpu()[0].item() == -1
        assert torch.equal(act.cpu(), act0.cpu())
        share.check()
    finally:
        share.close()


EXIT_SCRIPT = """
import sys
from pathlib import Path
from moe.engine.loading import load_model
from moe.testing.tiny_checkpoint import make_tiny_checkpoint
path = make_tiny_checkpoint(Path(sys.argv[1]) / "tiny", "qwen3_moe")
engine = load_model(path, "cuda", num_slots=6, max_batch=2, max_seq_len=64, progress=False, miss_service="hybrid",
                    cpu_threads=2)
logits = engine.prefill([[1, 2, 3, 4]])
for _ in range(4):
    logits = engine.decode_step(logits.argmax(-1).tolist())
print("decoded", flush=True)
sys.exit(0)
"""


@pytest.mark.gpu
def test_gpu_a_hybrid_engine_left_open_exits_cleanly(tmp_path):
    """A process that decodes with the CPU share's hand-off and exits without closing the engine (its
    worker threads, pinned buffers and mapped flags still live) ends with status 0 and no error."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "decoded" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "terminate called" not in run.stderr, run.stderr[-3000:]
