"""CPU checks of the GPU decode path's pieces (Triton's interpreter; no CUDA API is touched).

    MoELayer.forward(hidden, routing=(ids, weights))  forced routing: equals the router's own path
                                                       bit for bit when given the router's output;
                                                       routes as told otherwise; bad pairs refused
    Engine + GpuMoE (the GPU backend, on the CPU)      float32 logits of prefill and evicting decode
                                                       within 1e-4 of transformers; graphs off on CPU
    random_decoder + GpuMoE(forced_routing)           a synthetic trace's routing drives the cache:
                                                       recorded = trace, misses = the simulator's
    benchmarks/bench_decode.py --dry-run               arguments and the simulator half
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.engine.backends import GpuMoE
from moe.engine.engine import Engine
from moe.engine.graphs import DecodeGraphs
from moe.engine.loading import cuda_graphs_from_env, load_model
from moe.model.checkpoint import load_checkpoint
from moe.model.config import MoEConfig
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
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cpu_only
def test_forced_routing_of_the_routers_output_is_bitwise_the_router_path():
    weights = random_weights(CFG, 2, "cpu", seed=3)
    routed, forced = SyntheticModel(weights, 10, "cpu"), SyntheticModel(weights, 10, "cpu")
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):  # 2 tokens x top-4 over 10 slots shared by 2 layers: every step evicts
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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
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
    with pytest.raises(ValueError, match="cuda_graphs"):
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
    trace = generate(SyntheticConfig(2, 16, 4, 6, batch=2, seed=9))  # [6, 2, 2, 4]
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
    with pytest.raises(ValueError, match="ids must be"):
        backend.set_routing(torch.from_numpy(trace.experts[0]).long(), torch.from_numpy(trace.weights[0]))
    with pytest.raises(ValueError, match="forced_routing"):
        GpuMoE(weights, slots, "lru", max_batch=2).set_routing(torch.zeros(2, 2, 4, dtype=torch.int32),
                                                                torch.zeros(2, 2, 4))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_decode", module)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_geometries_agree_with_their_decoder_preset_and_shape():
    """Each --geometry's random_decoder config, simulator preset and cost-model shape describe one MoE block
    (experts, top-k, H, I, bf16 bytes per expert), so the simulator prices what the engine runs."""
    from moe.model.spec import ModelSpec
    from moe.testing import random_decoder
    from sim.costmodel import SHAPES
    from sim.synthetic import PRESETS

    for name, geo in _bench().GEOMETRIES.items():
        moe = ModelSpec.from_hf(getattr(random_decoder, geo.config)(2)).moe
        preset, shape = PRESETS[geo.preset], SHAPES[geo.shape]
        block = (geo.num_experts, geo.top_k, geo.hidden, geo.inter)
        assert (moe.num_experts, moe.top_k, moe.hidden, moe.expert_intermediate) == block, name
        assert (preset.num_experts, preset.top_k) == (shape.num_experts, shape.top_k) == block[:2], name
        assert (shape.hidden, shape.expert_intermediate) == block[2:], name
        if preset.expert_bytes is not None:
            assert preset.expert_bytes == 3 * geo.hidden * geo.inter * 2, name


def test_bench_decode_dry_run_and_arguments(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "dry.json"
    res = bench.main(["--dry-run", "--layers", "2", "--warmup", "20", "--steps", "30", "--slots", "400",
                      "--configs", "lru,rule+overlap", "--out", str(out)])
    assert [(r["config"], r["batch"]) for r in res["rows"]] == [
        ("lru", 1), ("rule+overlap", 1), ("lru", 2), ("rule+overlap", 2)]
    for r in res["rows"]:
        sim = r["sim"]
        assert 0 < sim["hit_rate"] < 1 and sim["tokens_per_s"] > 0 and len(sim["layer_misses_window"]) == 2
        assert sum(sim["layer_misses_window"]) <= sum(sim["layer_misses_all"])
    assert out.is_file() and "| rule+overlap | 2 |" in capsys.readouterr().out
    assert bench.implied_overhead(110.0, 100.0, 2) == pytest.approx(bench.H200_SM_COPY.layer_overhead_us + 5.0)
    for bad, flag in ((["--configs", "fifo"], "--configs"), (["--batches", "9"], "--batches"),
                      (["--slots", "5"], "--slots"), (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit, match=flag):
            bench.parse(bad)


def test_bench_decode_replays_a_real_trace_at_its_geometry_with_markov():
    """FLAME's real routing at the flame-290m geometry, markov beside lru and rule: the simulator's
    misses of each are those of sim.replay on the same slice (dry run; the GPU half runs the same)."""
    from tests.conftest import real_trace

    path = real_trace("flame-290m-a.npz")
    bench = _bench()
    res = bench.main(["--dry-run", "--geometry", "flame-290m", "--trace", str(path), "--layers", "8",
                      "--warmup", "100", "--steps", "200", "--slots-frac", "0.5", "--batches", "1",
                      "--configs", "lru,rule,markov"])
    sims = {r["config"]: r["sim"] for r in res["rows"]}
    assert list(sims) == ["lru", "rule", "markov"]
    assert sims["markov"]["hit_rate"] > sims["lru"]["hit_rate"]
    with pytest.raises(SystemExit, match="--geometry qwen3-next needs 512"):
        bench.main(["--dry-run", "--trace", str(path), "--configs", "markov"])


def test_bench_decode_calibrates_on_the_miss_free_run(monkeypatch, tmp_path):
    """The GPU half's bookkeeping, with the measurement replaced by a stand-in whose step time is
    the uncalibrated prediction plus 7 us per layer: the calibration row must find 7 us more than
    the profile's overhead, and every cached configuration must then be predicted exactly (the
    model is linear in the overhead), with the uncalibrated prediction kept beside it."""
    import types

    bench = _bench()
    layers, extra = 2, 7.0

    def measure(weights, trace, args, policy, overlap, batch):
        sim = bench.simulate(trace, policy, args.slots, args.warmup, overlap)
        us = sim["us_per_step"] + layers * extra
        return {"us_per_step": us, "tokens_per_s": batch * 1e6 / us, "layer_misses_all": sim["layer_misses_all"],
                "step_us": {"median": us, "p10": us, "p90": us}, "chunk_tokens_per_s": [batch * 1e6 / us],
                "hit_rate": sim["hit_rate"], "misses_per_layer_per_step": sim["misses_per_layer_per_step"],
                "graphs": [batch], "memory": dict.fromkeys(("idle_allocated_gb", "peak_allocated_gb",
                                                           "idle_device_used_gb", "peak_device_used_gb"), 1.0)}

    fake = types.ModuleType("decode_gpu")
    fake.measure, fake.build_weights = measure, lambda args, config, fmt="bf16": (None, {"stand_in": True})
    monkeypatch.setitem(sys.modules, "decode_gpu", fake)
    monkeypatch.setattr(bench, "machine", lambda: {"gpu": "stand-in"})
    res = bench.main(["--layers", str(layers), "--warmup", "20", "--steps", "30", "--slots", "400",
                      "--batches", "1", "--configs", "lru,rule", "--out", str(tmp_path / "cal.json")])
    cal, *rows = res["rows"]
    assert (
        cal["config"] == "resident (calibration)"
        and cal["slots"] == layers * bench.GEOMETRIES["qwen3-next"].num_experts
    )
    assert cal["implied_layer_overhead_us"] == pytest.approx(bench.H200_SM_COPY.layer_overhead_us + extra)
    assert cal["tps_ratio"] == pytest.approx(1.0, rel=1e-9)  # the calibrated model predicts its own run
    assert [r["config"] for r in rows] == ["lru", "rule"]
    for r in rows:
        assert r["misses_equal"] and r["tps_ratio"] == pytest.approx(1.0, rel=1e-9)
        assert r["sim"]["layer_overhead_us"] == pytest.approx(cal["implied_layer_overhead_us"])
        assert r["sim_uncalibrated"]["tokens_per_s"] > r["sim"]["tokens_per_s"]  # 7 us less per layer


def test_bench_decode_compares_expert_formats_at_one_budget(capsys):
    """--moe-cache-gb gives each format the slots the budget holds (floor(G * 2**30 / its bytes per
    expert), at most L * E); the simulator prices each format's misses at its bytes; the table says
    how each compares with bf16 at the same budget."""
    from expertcache.formats import GIB, get_format

    bench = _bench()
    res = bench.main(
        [
            "--dry-run",
            "--geometry",
            "qwen3-30b",
            "--layers",
            "4",
            "--warmup",
            "20",
            "--steps",
            "40",
            "--moe-cache-gb",
            "0.5,1",
            "--expert-formats",
            "bf16,nvfp4",
            "--configs",
            "lru",
            "--batches",
            "1",
        ]
    )
    rows = {(r["format"], r["budget_gib"]): r for r in res["rows"]}
    for (fmt, gib), r in rows.items():
        per = get_format(fmt).expert_bytes(2048, 768)
        assert r["slots"] == min(int(gib * GIB) // per, 4 * 128)
        assert r["sim"]["bytes_copied_per_step"] == pytest.approx(
            r["sim"]["misses_per_layer_per_step"] * 4 * per, rel=1e-9)
    assert rows[("nvfp4", 0.5)]["vs_bf16_sim"] > 1 and rows[("bf16", 1.0)]["vs_bf16_sim"] == 1
    assert "| nvfp4 | 0.5 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--expert-formats"):
        bench.parse(["--expert-formats", "fp4"])
    with pytest.raises(SystemExit, match="--slots or --moe-cache-gb"):
        bench.parse(["--slots", "400", "--moe-cache-gb", "1"])
    with pytest.raises(SystemExit, match="--moe-cache-gb"):
        bench.parse(["--moe-cache-gb", "0.001", "--geometry", "qwen3-30b"])


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
