"""CPU checks of the GPU decode path's pieces (Triton's interpreter; no CUDA API is touched).

    MoELayer.forward(hidden, routing=(ids, weights))  forced routing: equals the router's own path
                                                       bit for bit when given the router's output;
                                                       routes as told otherwise; bad pairs refused
    Engine + GpuMoE (the GPU backend, on the CPU)      float32 logits of prefill and evicting decode
                                                       within 1e-4 of transformers; graphs off on CPU
    random_decoder + GpuMoE(forced_routing)           a synthetic trace's routing drives the cache:
                                                       recorded = trace, misses = the simulator's
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe.engine.backends import GpuMoE
from moe.engine.engine import Engine
from moe.engine.graphs import DecodeGraphs
from moe.engine.loading import cuda_graphs_from_env, load_model
from moe.model.checkpoint import load_checkpoint
from moe.model.config import ROUTED_MMA_ENV, MoEConfig
from moe.model.reference import expert_mlp, shared_expert
from moe.testing.random_decoder import random_decoder
from moe.testing.synthetic import SyntheticModel, random_weights
from moe.testing.tiny_checkpoint import randomize
from sim.replay import replay
from sim.synthetic import SyntheticConfig, generate
from tests.moe.families import COMMON, FAMILIES, assert_near, family_index, hf_run, random_tokens, router_choice

BF16 = torch.bfloat16
CFG = MoEConfig(hidden=64, num_experts=16, top_k=4, expert_intermediate=32, shared_intermediate=32,
                norm_topk_prob=True)


@pytest.mark.cpu_only
def test_forced_routing_of_the_routers_output_is_bitwise_the_router_path():
    weights = random_weights(CFG, 2, "cpu", seed=3)
    routed, forced = SyntheticModel(weights, 10, "cpu"), SyntheticModel(weights, 10, "cpu")
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):  # 2 tokens x top-4 over 10 slots shared by 2 layers: every step evicts
        x = torch.randn(2, CFG.hidden, generator=gen).to(BF16)
        for a, b in zip(routed.layers, forced.layers):
            before = b.last_routing(2)[1].clone()
            y = a(x)
            w, ids = (t.clone() for t in a.last_routing(2))
            z = b.forward(x, routing=(ids, w))
            assert torch.equal(y.view(torch.int16), z.view(torch.int16))
            assert torch.equal(b.last_routing(2)[1], before), "forced routing must not run the router"
            x = y
    ca, cb = routed.slots.cache, forced.slots.cache
    assert torch.equal(ca.slot_of, cb.slot_of) and torch.equal(ca.counters, cb.counters)
    assert int(cb.counters[:, 2].sum()) > 0


@pytest.mark.cpu_only
def test_forced_routing_routes_as_told():
    weights = random_weights(CFG, 1, "cpu", seed=5)
    model = SyntheticModel(weights, 8, "cpu")
    layer = model.layers[0]
    x = torch.randn(2, CFG.hidden, generator=torch.Generator().manual_seed(6)).to(BF16)
    ids = torch.tensor([[15, 0, 7, -1], [3, 15, 9, 1]], dtype=torch.int32)  # -1: no expert
    w = torch.tensor([[0.5, 0.25, 0.25, 0.9], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float32)
    got = layer.forward(x, routing=(ids, w)).float()
    gate_up, down = model.layer_experts(0)
    want = shared_expert(x, layer.shared)
    for t in range(2):
        for j in range(CFG.top_k):
            if ids[t, j] >= 0:
                want[t] += w[t, j] * expert_mlp(x[t:t + 1], gate_up[ids[t, j]], down[ids[t, j]])[0]
    torch.testing.assert_close(got, want.to(BF16).float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert set(model.slots.cache.key_of.tolist()) >= {15, 0, 7, 3, 9, 1}


def test_forced_routing_refuses_bad_pairs():
    model = SyntheticModel(random_weights(CFG, 1, "cpu", seed=0), 8, "cpu")
    x = torch.zeros(2, CFG.hidden, dtype=BF16)
    ids, w = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    for bad in ((ids.long(), w), (ids, w.double()), (ids[:1], w), (ids, w[:, :3]), (ids,), ids):
        with pytest.raises(ValueError, match="routing must be"):
            model.layers[0].forward(x, routing=bad)
    assert int(model.slots.cache.counters.sum()) == 0, "a refused call launches nothing"


# the GPU backend under the interpreter takes seconds a family: two that cover a shared expert, grouped
# routing and a dense layer run by default, the others (linear attention's qwen3_next too) in the long profile
INTERPRETED = [pytest.param(name, marks=() if name in ("glm4_moe", "mixtral") else pytest.mark.slow)
               for name in sorted(FAMILIES)]


@pytest.fixture(scope="module", params=INTERPRETED)
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    randomize(model, seed=7 + family_index(request.param))
    path = tmp_path_factory.mktemp(f"cpu-gpu-backend-{request.param}")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.mark.cpu_only
def test_gpu_backend_engine_matches_transformers_float32(checkpoint):
    model, path = checkpoint
    k = model.config.num_experts_per_tok
    weights = load_checkpoint(path, "cpu", progress=False)
    engine = Engine(weights, GpuMoE(weights, 2 * k, "rule", max_batch=2), max_batch=2, max_seq_len=32,
                    record_routing=True)
    assert engine.graphs is None
    seqs = [random_tokens(8, seed=60), random_tokens(10, seed=61)]
    first = engine.prefill([seqs[0][:5], seqs[1][:7]])
    steps = [engine.decode_step([seqs[0][5 + j], seqs[1][7 + j]]) for j in range(3)]
    with torch.no_grad():
        for row, (seq, plen) in enumerate(zip(seqs, (5, 7))):
            out, router = hf_run(model, seq)
            got = torch.stack([first[row]] + [s[row] for s in steps])
            assert_near(got, out.logits[0, plen - 1:], rel=1e-4)
            for m, choice in enumerate(router_choice(model, router)):  # the family's choice scores
                ref = choice[plen:plen + 3].topk(k, dim=-1).indices.numpy()
                np.testing.assert_array_equal(engine.routing()[:, m, row], ref)
    assert int(engine.moe.slots.cache.counters[:, 2].sum()) > 0


@pytest.mark.cpu_only
def test_the_tensor_core_routed_kernels_match_transformers_float32(checkpoint, monkeypatch):
    """EXPERTCACHE_ROUTED_MMA=1: every layer's plan runs routed_mma (no early hits), the cache evicting,
    and the logits stay within 1e-4 of transformers as with the one-program-a-pair kernels."""
    model, path = checkpoint
    monkeypatch.setenv(ROUTED_MMA_ENV, "1")
    k = model.config.num_experts_per_tok
    weights = load_checkpoint(path, "cpu", progress=False)
    engine = Engine(weights, GpuMoE(weights, 2 * k, "lru", max_batch=2), max_batch=2, max_seq_len=32)
    assert all(layer.plan.routed_mma is not None and not layer.plan.mode.hits_on_side
               for layer in engine.moe.layers.values())
    seq = random_tokens(7, seed=62)
    first = engine.prefill([seq[:5]])
    steps = [engine.decode_step([seq[5 + j]]) for j in range(2)]
    with torch.no_grad():
        out, _ = hf_run(model, seq)
    assert_near(torch.stack([first[0]] + [s[0] for s in steps]), out.logits[0, 4:7], rel=1e-4)
    assert int(engine.moe.slots.cache.counters[:, 2].sum()) > 0


def test_cpu_engines_never_build_cuda_graphs(checkpoint, monkeypatch):
    model, path = checkpoint
    monkeypatch.delenv("EXPERTCACHE_CUDA_GRAPHS", raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU engine touched torch.cuda graph APIs")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    engine = load_model(path, "cpu", num_slots=16, max_seq_len=16, progress=False)
    assert engine.graphs is None
    assert len(engine.generate([random_tokens(3, seed=1)], max_new_tokens=3)[0]) == 3
    with monkeypatch.context() as m:  # refused before any tensor is read
        m.setattr("moe.engine.loading.load_checkpoint", lambda *a, **k: pytest.fail("tensors were read"))
        with pytest.raises(ValueError, match="cuda_graphs=True asks for CUDA-graph decode.*pass cuda_graphs=None"):
            load_model(path, "cpu", num_slots=16, progress=False, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeGraphs(lambda t: (t, None), 1, torch.device("cpu"))
    assert cuda_graphs_from_env(torch.device("cpu")) is False
    monkeypatch.setenv("EXPERTCACHE_CUDA_GRAPHS", "0")
    assert cuda_graphs_from_env(torch.device("cuda")) is False
    monkeypatch.setenv("EXPERTCACHE_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="EXPERTCACHE_CUDA_GRAPHS"):
        cuda_graphs_from_env(torch.device("cpu"))


TINY = {"model_type": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "qkv_bias": False, "vocab_size": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


@pytest.mark.cpu_only
def test_trace_driven_routing_gives_the_simulators_misses():
    weights = random_decoder(TINY, "cpu", seed=2)
    trace = generate(SyntheticConfig(2, 16, 4, 3, batch=2, seed=9))  # [3, 2, 2, 4]
    slots = 12
    backend = GpuMoE(weights, slots, "lru", max_batch=2, forced_routing=True)
    engine = Engine(weights, backend, max_batch=2, max_seq_len=16, record_routing=True)
    tokens = engine.prefill([[1, 2, 3], [4, 5]]).argmax(dim=-1)
    for n in range(trace.num_tokens):
        backend.set_routing(torch.from_numpy(trace.experts[n]), torch.from_numpy(trace.weights[n]))
        tokens = engine.decode_step(tokens).argmax(dim=-1)
    np.testing.assert_array_equal(engine.routing(), trace.experts)
    sim = replay(trace, "lru", slots, use_logits=False)
    np.testing.assert_array_equal(backend.slots.cache.counters[:, 2].numpy(), sim.layer_misses)
    assert sim.layer_misses.sum() > slots, "the trace must fill the pool and evict"
    with pytest.raises(ValueError, match="ids must be"):
        backend.set_routing(torch.from_numpy(trace.experts[0]).long(), torch.from_numpy(trace.weights[0]))
    with pytest.raises(ValueError, match="forced_routing"):
        GpuMoE(weights, slots, "lru", max_batch=2).set_routing(torch.zeros(2, 2, 4, dtype=torch.int32),
                                                                torch.zeros(2, 2, 4))


def test_collector_paused_collects_first_and_then_pauses():
    """moe.engine.graphs.collector_paused: dead cycles are freed on entry, no automatic collection inside,
    and the collector is back on after (also after an exception)."""
    import gc
    import weakref

    from moe.engine.graphs import collector_paused

    class Node:
        pass

    dead = Node()
    dead.self = dead
    ref, runs = weakref.ref(dead), []
    del dead
    def watch(phase, info):
        return runs.append(phase)
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(watch)
    try:
        with pytest.raises(RuntimeError), collector_paused():
            assert ref() is None
            runs.clear()
            _ = [[] for _ in range(1000)]
            assert runs == [] and not gc.isenabled()
            raise RuntimeError("leaves the block")
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    assert gc.isenabled()
