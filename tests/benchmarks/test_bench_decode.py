"""benchmarks/bench_decode.py on the CPU: its geometries against their decoder, preset and shape; the
simulator half (--dry-run) on synthetic and real routing; the calibration's bookkeeping with the GPU half
replaced by a stand-in; expert formats at one budget."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import load_bench


def _bench():
    return load_bench("bench_decode")


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

    from moe.engine.channels import ChannelMeasure

    size = 4 * 2**20  # channels whose link alone runs at the profile's back-to-back rate: linked changes nothing
    chan = ChannelMeasure(size, 2, 8, 100.0, 100.0 + size / (bench.H200_SM_COPY.back_to_back_gbps * 1e3), 300.0,
                          80.0, 160.0, 200.0, 14, 1.2)
    fake = types.ModuleType("decode_gpu")
    fake.measure, fake.build_weights = measure, lambda args, config, fmt="bf16": (None, {"stand_in": True})
    fake.engine_split = lambda weights, service, tail=True, given=None: (None, given or chan)
    monkeypatch.setitem(sys.modules, "decode_gpu", fake)
    monkeypatch.setattr(bench, "machine", lambda: {"gpu": "stand-in"})
    res = bench.main(["--layers", str(layers), "--warmup", "20", "--steps", "30", "--slots", "400",
                      "--batches", "1", "--configs", "lru,rule", "--out", str(tmp_path / "cal.json")])
    cal, *rows = res["rows"]
    assert cal["config"] == "resident (calibration)"
    assert cal["slots"] == layers * bench.GEOMETRIES["qwen3-next"].num_experts
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
    res = bench.main(["--dry-run", "--geometry", "qwen3-30b", "--layers", "4", "--warmup", "20", "--steps", "40",
                      "--moe-cache-gb", "0.5,1", "--expert-formats", "bf16,nvfp4", "--configs", "lru",
                      "--batches", "1"])
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


def test_bench_decode_dry_run_replays_and_prices_the_engines_split():
    """With --miss-service the simulator replays the engine's own split (its misses counted as the device
    counts them) and prices both channels: hybrid above copy where few experts fit."""
    bench = _bench()
    argv = ["--dry-run", "--geometry", "qwen3-30b", "--layers", "4", "--warmup", "30", "--steps", "60",
            "--moe-cache-gb", "0.7", "--configs", "lru", "--batches", "1"]
    copy = bench.main(argv)["rows"][-1]
    hybrid = bench.main(argv + ["--miss-service", "hybrid"])["rows"][-1]
    assert hybrid["miss_service"] == "hybrid" and copy["miss_service"] == "copy"
    assert hybrid["sim"]["hit_rate"] != copy["sim"]["hit_rate"], "served misses are not admitted"
    assert hybrid["sim"]["tokens_per_s"] > 1.3 * copy["sim"]["tokens_per_s"]
    assert hybrid["sim"]["bytes_copied_per_step"] < copy["sim"]["bytes_copied_per_step"]
    both = bench.main(argv + ["--miss-service", "copy,hybrid"])["rows"]  # one set of weights, both services
    assert [r["miss_service"] for r in both] == ["copy", "hybrid"]
    assert both[1]["sim"]["tokens_per_s"] == pytest.approx(hybrid["sim"]["tokens_per_s"], rel=1e-12)
    assert both[1]["vs_copy_sim"] == pytest.approx(hybrid["sim"]["tokens_per_s"] / copy["sim"]["tokens_per_s"])
    assert "vs_copy_sim" not in both[0]
    with pytest.raises(SystemExit, match="--moe-miss-service"):
        bench.parse(argv + ["--miss-service", "copy,fast"])


def test_bench_decode_gpu_path_wiring_with_the_gpu_parts_replaced(monkeypatch):
    """Without --dry-run, with decode_gpu's GPU parts replaced: one build per format, each service calibrated
    under itself (cpu under copy), the hybrid split and host profile from the channels measured at start
    (recorded per format and service), every row measured under its own split, vs_copy beside each."""
    import types

    import decode_gpu

    from expertcache.split import MissSplit
    from moe.engine.channels import ChannelMeasure

    bench = _bench()
    builds, measured_runs, splits = [], [], []
    monkeypatch.setattr(bench, "machine", lambda: {"gpu": "none"})
    monkeypatch.setattr(decode_gpu, "build_weights",
                        lambda args, config, fmt: builds.append(fmt) or (types.SimpleNamespace(fmt=fmt), {}))
    chan = ChannelMeasure(2 * 2048 * 768 * 3, 8, 8, 10.0, 80.0, 90.0, 20.0, 160.0, 200.0, 14, 1.2, 9.0)

    def engine_split(weights, service, tail=True, given=None):
        splits.append((service if tail else f"{service} without a tail", given))
        return (None, None) if service == "copy" else (MissSplit.hybrid(chan.costs()), given or chan)

    def measure(weights, trace, run, policy, overlap, batch):
        measured_runs.append((run.slots, None if run.split is None else run.split.service))
        return {"us_per_step": 5000.0, "tokens_per_s": 200.0, "hit_rate": 0.5, "misses_per_layer_per_step": 1.0,
                "layer_misses_all": [], "step_us": {"median": 5000.0, "p10": 4900.0, "p90": 5100.0},
                "chunk_tokens_per_s": [199.0, 201.0], "memory": {"idle_allocated_gb": 1.0, "peak_allocated_gb": 2.0}}

    monkeypatch.setattr(decode_gpu, "engine_split", engine_split)
    monkeypatch.setattr(decode_gpu, "measure", measure)
    res = bench.main(["--geometry", "qwen3-30b", "--layers", "2", "--warmup", "10", "--steps", "20",
                      "--moe-cache-gb", "0.1", "--configs", "lru", "--batches", "1", "--expert-formats", "bf16",
                      "--miss-service", "copy,hybrid"])
    assert builds == ["bf16"] and splits == [("hybrid", None), ("hybrid", chan)], "measured once, before copy"
    splits.clear()
    whole = bench.main(["--geometry", "qwen3-30b", "--layers", "2", "--warmup", "10", "--steps", "20",
                        "--moe-cache-gb", "0.1", "--configs", "lru", "--batches", "1", "--expert-formats", "bf16",
                        "--miss-service", "hybrid-whole,hybrid"])
    assert splits == [("hybrid", None), ("hybrid without a tail", chan), ("hybrid", chan)], "one measurement"
    assert [r["miss_service"] for r in whole["rows"]] == ["hybrid-whole"] * 2 + ["hybrid"] * 2
    measured_runs[:] = measured_runs[:4]
    keys = 2 * 128
    assert measured_runs == [(keys, None), (res["rows"][1]["slots"], None), (keys, "hybrid"),
                             (res["rows"][1]["slots"], "hybrid")], "calibration then the budget, per service"
    assert [(r["config"], r["miss_service"]) for r in res["rows"]] == [
        ("resident (calibration)", "copy"), ("lru", "copy"), ("resident (calibration)", "hybrid"), ("lru", "hybrid")]
    assert res["channels"]["bf16/hybrid"]["handoff_us"] == 9.0 and res["channels"]["bf16/copy"]["service"] == "copy"
    link = chan.gbps()["link_alone"]  # both services' copies priced at the link measured (linked)
    assert all(r["sim"]["profile"].startswith(f"{bench.H200_SM_COPY.name}-link-{link:.1f}") for r in res["rows"])
    assert res["rows"][3]["vs_copy"] == 1.0 and "vs_copy_sim" in res["rows"][3]


def test_linked_scales_the_copy_table_to_the_measured_link():
    """linked: every copy priced at the measured link's speed, the table's latency shape kept."""
    from moe.engine.channels import ChannelMeasure

    bench = _bench()
    base = bench.H200_SM_COPY
    size = 9 * 2**20
    half = base.back_to_back_gbps / 2
    chan = ChannelMeasure(size, 4, 8, 150.0, 150.0 + 3 * size / (half * 1e3), 900.0, 80.0, 160.0, 200.0, 14, 1.2)
    got = bench.linked(base, chan)
    assert got.back_to_back_gbps == pytest.approx(half)
    assert got.h2d_ceiling_gbps == pytest.approx(base.h2d_ceiling_gbps / 2)
    for b in (2**20, 3 * 2**20, 7 * 2**20, 64 * 2**20):
        for m in (1, 3):
            assert got.copy_us(b, m) == pytest.approx(2 * base.copy_us(b, m), rel=1e-9)
    assert got.layer_overhead_us == base.layer_overhead_us and got.hbm_gbps == base.hbm_gbps
