"""benchmarks/peer_llamacpp.py on the CPU: the vendored source's commit and its stripping, cmake's
arguments, the converter's command, and the shared checkpoint (small geometry) loading in expertcache
with the logits transformers gives for the same weights."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from moe.engine.channels import ChannelMeasure
from tests.conftest import load_bench

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
SMALL = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
         "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _peer():
    return load_bench("peer_llamacpp")


def _fake_sdist(root, commit=COMMIT):
    src = root / "vendor" / "llama.cpp"
    for rel in ("CMakeLists.txt", "convert_hf_to_gguf.py", "ggml/src/ggml.c", "models/ggml-vocab.gguf",
                "docs/build.md", "tests/test-x.cpp", "tools/server/webui/index.html", "tools/quantize/q.cpp",
                "examples/simple/simple.cpp", "app/CMakeLists.txt"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    head = root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    head.parent.mkdir(parents=True)
    head.write_text(commit + "\n")
    return src


def test_prepare_records_the_commit_and_strips_what_a_build_does_not_read(tmp_path):
    peer = _peer()
    root = tmp_path / "llama_cpp_python-0.3.36"
    _fake_sdist(root)
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    meta = peer.main(["prepare", "--sdist", str(sdist), "--out", str(tmp_path / "peer")])
    assert json.loads((tmp_path / "peer" / "llama.cpp.json").read_text()) == meta
    assert meta["commit"] == COMMIT and meta["sdist"] == "llama-cpp-python==0.3.36"
    with tarfile.open(tmp_path / "peer" / "llama.cpp.tar.gz") as tar:
        names = set(tar.getnames())
    kept = {"llama.cpp/CMakeLists.txt", "llama.cpp/convert_hf_to_gguf.py", "llama.cpp/ggml/src/ggml.c",
            "llama.cpp/tools/quantize/q.cpp", "llama.cpp/app/CMakeLists.txt", "llama.cpp/examples"}
    assert kept <= names
    for gone in ("models", "docs", "tests", "tools/server/webui", "examples/simple"):
        assert not any(n == f"llama.cpp/{gone}" or n.startswith(f"llama.cpp/{gone}/") for n in names), gone


@pytest.mark.parametrize("broken, message", [("head", "HEAD is missing"), ("commit", "not a commit"),
                                             ("converter", "convert_hf_to_gguf.py is missing")])
def test_a_source_that_is_not_the_sdist_is_refused_by_name(tmp_path, broken, message):
    peer = _peer()
    src = _fake_sdist(tmp_path, commit="not-a-commit" if broken == "commit" else COMMIT)
    if broken == "head":
        (tmp_path / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD").unlink()
    if broken == "converter":
        (src / "convert_hf_to_gguf.py").unlink()
    with pytest.raises(SystemExit, match=message):
        peer.vendored_source(tmp_path)


def test_cmake_builds_cuda_for_one_arch_and_nothing_extra(tmp_path):
    peer = _peer()
    cuda = peer.cmake_configure_args(tmp_path / "s", tmp_path / "b", "90")
    assert "-DGGML_CUDA=ON" in cuda and "-DCMAKE_CUDA_ARCHITECTURES=90" in cuda
    for off in ("LLAMA_CURL", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_SERVER"):
        assert f"-D{off}=OFF" in cuda
    assert not any("CUDA" in a for a in peer.cmake_configure_args(tmp_path / "s", tmp_path / "b", None))


def test_the_converter_is_told_the_pre_tokenizer_and_writes_bf16(tmp_path):
    peer = _peer()
    cmd = peer.convert_command(tmp_path / "llama.cpp", tmp_path / "m", tmp_path / "m.gguf")
    shim = cmd[-1]
    assert cmd[1] == "-c" and "get_vocab_base_pre = lambda self, tokenizer: 'qwen2'" in shim
    assert repr([str(tmp_path / "m"), "--outtype", "bf16", "--outfile", str(tmp_path / "m.gguf")]) in shim
    compile(shim, "<shim>", "exec")


@pytest.mark.parametrize("argv, message", [(["checkpoint", "--out", "x", "--layers", "0"], "--layers"),
                                           (["checkpoint", "--out", "x", "--vocab", "100"], "--vocab"),
                                           (["bench-ours", "--model", "m", "--out", "o", "--formats", "bf16,fp4"],
                                            "--formats bf16,fp4")])
def test_bad_checkpoint_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        _peer().parse(argv)
    assert message in capsys.readouterr().err


def test_the_checkpoint_loads_in_expertcache_with_transformers_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe.engine.loading import load_model

    peer = _peer()
    path = tmp_path / "qwen3moe"
    config = peer.make_checkpoint(path, 2, 400, seed=5, geometry={**peer.GEOMETRY, **SMALL})
    experts = config.get("num_local_experts", config.get("num_experts"))  # the key moved in transformers 5
    assert experts == 8 and config["moe_intermediate_size"] == 32
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config["vocab_size"] == 400
    ids = tokenizer("the cache maps the router's experts to slots")["input_ids"]
    assert tokenizer.decode(ids) == "the cache maps the router's experts to slots"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = load_model(path, "cpu", num_slots=4, dtype="float32", max_seq_len=32, progress=False)
    logits = engine.prefill([ids[:6]])
    steps = [engine.decode_step([t]) for t in ids[6:9]]
    with torch.no_grad():
        want = model(torch.tensor([ids[:9]])).logits[0, 5:9]
    got = torch.cat([logits] + steps)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_llama_configs_put_the_last_layers_experts_on_the_gpu():
    peer = _peer()
    layer_bytes = [100 + i for i in range(12)]
    got = {c["share"]: c for c in peer.llama_configs(layer_bytes)}
    assert [got[s]["n_cpu_moe"] for s in ("all", "half", "quarter", "none")] == [0, 6, 9, 12]
    assert got["quarter"]["gpu_expert_bytes"] == sum(layer_bytes[9:])
    assert got["none"]["gpu_expert_bytes"] == 0 and got["none"]["cpu_expert_bytes"] == sum(layer_bytes)
    for c in got.values():
        assert c["gpu_expert_bytes"] + c["cpu_expert_bytes"] == sum(layer_bytes)


def test_cache_slots_hold_llama_cpp_s_gpu_expert_bytes():
    peer = _peer()
    assert peer.cache_slots(10 * 1000 + 999, 1000, 12, 128, 8) == 10
    assert peer.cache_slots(0, 1000, 12, 128, 8) == 8  # at least one token's experts
    assert peer.cache_slots(10 ** 12, 1000, 12, 128, 8) == 12 * 128  # at most every expert


def test_llama_bench_json_and_nvidia_smi_lines_are_read():
    peer = _peer()
    out = json.dumps([{"build_commit": "0c1e5709", "n_cpu_moe": 6, "n_gen": 128, "n_threads": 16,
                       "model_size": 123, "model_type": "qwen3moe 30B.A3B BF16", "gpu_info": "NVIDIA H200",
                       "cpu_info": "Xeon", "avg_ts": 100.0, "samples_ts": [101.0, 97.5, 99.0]}])
    got = peer.parse_llama_bench(out)
    assert (got["tokens_per_s"], got["tokens_per_s_min"], got["tokens_per_s_max"], got["reps"]) == (
        99.0,
        97.5,
        101.0,
        3,
    )
    assert got["n_cpu_moe"] == 6 and got["build_commit"] == "0c1e5709"
    with pytest.raises(SystemExit, match="2 tests"):
        peer.parse_llama_bench(json.dumps([json.loads(out)[0]] * 2))
    assert peer.peak_mib("512\n14021\n\n13900\nNo devices were found\n") == 14021
    assert peer.peak_mib("") is None


def test_llama_bench_runs_without_the_openmp_settings_of_this_project_s_runs(tmp_path, monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE, which the hybrid runs set, makes llama.cpp's threads sleep at every barrier:
    llama-bench gets the environment without OpenMP's settings, and each row says what was removed."""
    peer = _peer()
    env, removed = peer.llama_bench_env({"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0",
                                         "CUDA_VISIBLE_DEVICES": "0"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert removed == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    model = tmp_path / "qwen3moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_experts_per_tok": 8, "num_experts": 128}))
    seen = []

    def run(cmd, **kw):
        seen.append(kw["env"])
        out = [{"build_commit": "0c1e5709", "n_cpu_moe": int(cmd[cmd.index("--n-cpu-moe") + 1]), "n_gen": 8,
                "n_threads": 16, "model_size": 1, "model_type": "qwen3moe", "samples_ts": [10.0]}]
        return peer.subprocess.CompletedProcess(cmd, 0, json.dumps(out), "")

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(peer, "gguf_paths", lambda m: {"BF16": tmp_path / "m.bf16.gguf"})
    monkeypatch.setattr(peer, "gguf_expert_bytes", lambda g, src: ([100] * 4, 400))
    monkeypatch.setattr(peer.subprocess, "run", run)
    monkeypatch.setattr(peer, "DevicePeak", _NoPeak)
    monkeypatch.setattr(peer.time, "sleep", lambda s: None)
    got = peer.bench_llama(peer.parse(["bench-llama", "--model", str(model), "--build-dir", str(tmp_path),
                                       "--out", str(tmp_path / "out")]))
    assert len(seen) == len(got["rows"]) == 4 and all("OMP_WAIT_POLICY" not in e for e in seen)
    assert all(r["env_removed"] == {"OMP_WAIT_POLICY": "PASSIVE"} for r in got["rows"])


class _NoPeak:
    peak_mib = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_report_pairs_each_gguf_with_its_formats_and_states_both_bounds():
    peer = _peer()
    layer = 128 * 3 * 2048 * 768 * 2  # one layer's bf16 experts
    llama = {"rows": [{"gguf": "BF16", "share": "half", "n_cpu_moe": 6, "layer_expert_bytes": [layer] * 12,
                       "gpu_expert_bytes": 6 * layer, "cpu_expert_bytes": 6 * layer, "top_k": 8,
                       "num_experts": 128, "tokens_per_s": 200.0, "device_peak_mib": 9000}]}
    mk = {"gguf": "BF16", "format": "bf16", "share": "half", "slots": 768, "bytes_per_expert": layer // 128,
          "layers": 12, "hit_rate": 0.5}
    ours = {"rows": [{**mk, "routing": "model", "tokens_per_s": 250.0, "misses_per_layer_per_step": 4.0},
                     {**mk, "routing": "trace", "tokens_per_s": 150.0, "misses_per_layer_per_step": 0.0}]}
    lim = {"host_read_bytes_per_s": 70e9, "link_bytes_per_s": 55e9}
    (row,) = peer.report_rows(llama, ours, lim)
    cpu_bytes = 6 * layer * 8 / 128  # 8 of 128 experts in each of the 6 CPU layers
    assert row["llama_cpu_bytes_per_token"] == cpu_bytes
    assert row["llama_cpu_bound_tokens_per_s"] == pytest.approx(70e9 / cpu_bytes)
    model = row["ours"]["bf16"]["model"]
    assert model["copied_bytes_per_token"] == 4.0 * 12 * (layer // 128)
    assert model["link_bound_tokens_per_s"] == pytest.approx(55e9 / (48 * layer // 128))
    assert model["vs_llama"] == 1.25 and row["ours"]["bf16"]["trace"]["link_bound_tokens_per_s"] is None
    text = peer.table([row])
    assert "BF16    half     6" in text and "bf16 250.0 / 150.0 (768 slots, x1.25 / x0.75, bound -)" in text


def test_a_hybrid_row_stands_beside_the_bound_of_both_channels():
    peer = _peer()
    layer = 128 * 3 * 2048 * 768 * 2
    llama = {"rows": [{"gguf": "BF16", "share": "none", "n_cpu_moe": 12, "layer_expert_bytes": [layer] * 12,
                       "gpu_expert_bytes": 0, "cpu_expert_bytes": 12 * layer, "top_k": 8,
                       "num_experts": 128, "tokens_per_s": 90.0, "device_peak_mib": 3000}]}
    mk = {"gguf": "BF16", "format": "bf16", "share": "none", "slots": 8, "bytes_per_expert": layer // 128,
          "layers": 12, "hit_rate": 0.0, "misses_per_layer_per_step": 8.0}
    gbps = {"link_alone": 55.0, "link_together": 50.0, "cpu_alone": 60.0, "cpu_together": 45.0}
    ours = {"rows": [{**mk, "routing": r, "tokens_per_s": 120.0, "miss_service": "hybrid",
                      "served_per_layer_per_step": 3.0, "channels": {"gbps": gbps}} for r in ("model", "trace")]
            + [{**mk, "routing": r, "tokens_per_s": 70.0} for r in ("model", "trace")]}  # copy, as before services
    (row,) = peer.report_rows(llama, ours, {"host_read_bytes_per_s": 90e9, "link_bytes_per_s": 55e9})
    hybrid, copy = row["ours"]["bf16+hybrid"]["trace"], row["ours"]["bf16"]["trace"]
    miss_bytes = 8.0 * 12 * (layer // 128)
    assert hybrid["channels_bound_tokens_per_s"] == pytest.approx(95e9 / miss_bytes)
    assert hybrid["vs_bound"] == pytest.approx(120.0 / (95e9 / miss_bytes))
    assert hybrid["served_bytes_per_token"] == pytest.approx(3.0 * 12 * (layer // 128))
    assert hybrid["copied_bytes_per_token"] == pytest.approx(5.0 * 12 * (layer // 128))
    assert copy["miss_service"] == "copy" and "channels_bound_tokens_per_s" not in copy
    assert copy["vs_bound"] == pytest.approx(70.0 / (55e9 / miss_bytes))
    assert "bf16+hybrid 120.0 / 120.0" in peer.table([row])


def _llama_rows(layer: int, shares) -> dict:
    """llama.json of BF16 rows, one per (share, n_cpu_moe) of `shares`, 12 layers of `layer` expert bytes."""
    return {"rows": [{"gguf": "BF16", "share": share, "n_cpu_moe": n, "layer_expert_bytes": [layer] * 12,
                      "gpu_expert_bytes": (12 - n) * layer, "cpu_expert_bytes": n * layer, "top_k": 8,
                      "num_experts": 128, "tokens_per_s": 100.0, "device_peak_mib": 9000} for share, n in shares]}


def test_bench_ours_refuses_an_unknown_miss_service(capsys):
    with pytest.raises(SystemExit):
        _peer().parse(["bench-ours", "--model", "m", "--out", "o", "--miss-services", "copy,fast"])
    assert "--miss-services" in capsys.readouterr().err


def test_bench_ours_runs_each_miss_service_over_one_load_and_the_report_pairs_them(tmp_path, monkeypatch):
    """bench-ours' wiring with the GPU's parts replaced: one load per format, each --miss-services value's
    split from decode_gpu.engine_split (measured for hybrid), a row per (service, share, routing) under
    the requested service's name, and the report's FORMAT+hybrid columns beside the channels' bound."""
    import types

    import bench_decode
    import decode_gpu

    from moe.model import checkpoint

    peer = _peer()
    layer = 128 * 3 * 2048 * 768 * 2
    llama = _llama_rows(layer, (("half", 6), ("none", 12)))
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    loads, splits = [], []
    spec = types.SimpleNamespace(num_layers=12, moe=types.SimpleNamespace(num_experts=128, top_k=8))
    store = types.SimpleNamespace(bytes_per_expert=layer // 128)
    weights = types.SimpleNamespace(spec=spec, store=store)
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: loads.append(k["expert_format"]) or weights)
    monkeypatch.setattr(bench_decode, "make_trace", lambda run, batch: "trace")
    measured = ChannelMeasure(layer // 128, 8, 8, 10.0, 80.0, 90.0, 20.0, 160.0, 200.0, 14, 1.2, 9.0)
    gbps = measured.gbps()

    def engine_split(weights, service):
        splits.append(service)
        if service == "copy":
            return None, None
        return types.SimpleNamespace(service="hybrid", fills=True), measured

    def measure(weights, trace, run, policy, overlap, batch):
        served = 0.0 if run.split is None else 3.0
        return {"tokens_per_s": 80.0 if run.split is None else 130.0, "hit_rate": 0.3,
                "misses_per_layer_per_step": 6.0, "served_per_layer_per_step": served,
                "split_service": "copy" if run.split is None else "hybrid"}

    monkeypatch.setattr(decode_gpu, "engine_split", engine_split)
    monkeypatch.setattr(decode_gpu, "measure", measure)
    args = peer.parse(["bench-ours", "--model", "m", "--out", str(tmp_path), "--formats", "bf16",
                       "--miss-services", "copy,auto"])
    rows = peer.bench_ours(args)["rows"]
    assert loads == ["bf16"] and splits == ["copy", "auto"]
    assert {(r["miss_service"], r["share"], r["routing"]) for r in rows} == {
        (s, sh, ro) for s in ("copy", "auto") for sh in ("half", "none") for ro in ("model", "trace")}
    assert all(r["split_service"] == ("copy" if r["miss_service"] == "copy" else "hybrid") for r in rows)
    (half, none) = peer.report_rows(llama, {"rows": rows}, {"host_read_bytes_per_s": 90e9, "link_bytes_per_s": 55e9})
    auto = none["ours"]["bf16+auto"]["trace"]
    both = (gbps["link_together"] + gbps["cpu_together"]) * 1e9
    assert auto["channels_bound_tokens_per_s"] == pytest.approx(both / (6.0 * 12 * (layer // 128)))
    assert rows[-1]["channels"]["handoff_us"] == 9.0 and rows[-1]["channels"]["gbps"] == gbps
    assert auto["tokens_per_s"] == 130.0 and none["ours"]["bf16"]["trace"]["tokens_per_s"] == 80.0
    assert "bf16+auto 130.0 / 130.0" in peer.table([half, none])


def test_the_second_bound_adds_the_miss_free_step_of_the_same_format_and_service():
    """The `all` row's step less its own few misses is the GPU's part of a step; a row with misses is
    also set beside its misses' time over the channels after that part. No such bound at `all` itself,
    nor for a format or service with no `all` row in the run."""
    peer = _peer()
    layer = 128 * 3 * 2048 * 768 * 2
    bpe = layer // 128
    llama = _llama_rows(layer, (("all", 0), ("none", 12)))
    gbps = {"link_alone": 55.0, "link_together": 50.0, "cpu_alone": 60.0, "cpu_together": 45.0}
    mk = {"gguf": "BF16", "format": "bf16", "bytes_per_expert": bpe, "layers": 12, "hit_rate": 0.5,
          "routing": "trace", "miss_service": "hybrid", "channels": {"gbps": gbps}, "slots": 8}
    ours = {"rows": [{**mk, "share": "all", "tokens_per_s": 1000.0, "misses_per_layer_per_step": 0.05,
                      "split": None},  # every expert in slots: the split ran as copy, its misses over the link
                     {**mk, "share": "none", "tokens_per_s": 100.0, "misses_per_layer_per_step": 8.0,
                      "split": "hybrid"},
                     {**mk, "miss_service": "copy", "channels": None, "share": "none", "tokens_per_s": 50.0,
                      "misses_per_layer_per_step": 8.0}]}
    (all_row, none) = peer.report_rows(llama, ours, {"host_read_bytes_per_s": 90e9, "link_bytes_per_s": 55e9})
    fixed = 1 / 1000.0 - 0.05 * 12 * bpe / 55e9  # the cold misses of `all` crossed the link alone
    got = none["ours"]["bf16+hybrid"]["trace"]
    assert got["resident_step_us"] == pytest.approx(fixed * 1e6)
    miss_s = 8.0 * 12 * bpe / 95e9
    assert got["step_bound_tokens_per_s"] == pytest.approx(1 / (miss_s + fixed))
    assert got["vs_step_bound"] == pytest.approx(100.0 * (miss_s + fixed))
    assert got["vs_step_bound"] > got["vs_bound"]
    assert "step_bound_tokens_per_s" not in all_row["ours"]["bf16+hybrid"]["trace"]
    at_all = all_row["ours"]["bf16+hybrid"]["trace"]  # ran as copy: its bound is the link's, as copy's
    assert "channels_bound_tokens_per_s" not in at_all
    assert at_all["link_bound_tokens_per_s"] == pytest.approx(55e9 / (0.05 * 12 * bpe))
    assert "step_bound_tokens_per_s" not in none["ours"]["bf16"]["trace"]  # copy ran no `all` row here


def test_bench_ours_runs_the_shares_asked_and_keeps_the_other_rows(tmp_path, monkeypatch):
    """--shares all: only llama.cpp's `all` configuration runs; ours.json keeps the other shares' rows of
    an earlier run (so `all` is rerun alone beside them), and an unknown share is refused by name."""
    import types

    import bench_decode
    import decode_gpu

    from moe.model import checkpoint

    peer = _peer()
    layer = 128 * 3 * 2048 * 768 * 2
    llama = _llama_rows(layer, (("all", 0), ("none", 12)))
    (tmp_path / "llama.json").write_text(json.dumps(llama))
    old = [{"format": "bf16", "miss_service": "copy", "share": share, "routing": "model", "tokens_per_s": 1.0}
           for share in ("all", "none")]
    (tmp_path / "ours.json").write_text(json.dumps({"rows": old}))
    spec = types.SimpleNamespace(num_layers=12, moe=types.SimpleNamespace(num_experts=128, top_k=8))
    weights = types.SimpleNamespace(spec=spec, store=types.SimpleNamespace(bytes_per_expert=layer // 128))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: weights)
    monkeypatch.setattr(bench_decode, "make_trace", lambda run, batch: "trace")
    monkeypatch.setattr(decode_gpu, "engine_split", lambda weights, service: (None, None))
    slots = []
    monkeypatch.setattr(decode_gpu, "measure", lambda weights, trace, run, *a: slots.append(run.slots) or
                        {"tokens_per_s": 2.0, "hit_rate": 1.0})
    args = peer.parse(["bench-ours", "--model", "m", "--out", str(tmp_path), "--formats", "bf16",
                       "--miss-services", "copy", "--shares", "all"])
    peer.bench_ours(args)
    rows = json.loads((tmp_path / "ours.json").read_text())["rows"]
    assert slots == [12 * 128, 12 * 128]  # model and trace routing, every expert in slots
    assert sorted((r["share"], r["tokens_per_s"]) for r in rows) == [("all", 2.0), ("all", 2.0), ("none", 1.0)]
    with pytest.raises(SystemExit):
        peer.parse(["bench-ours", "--model", "m", "--out", "o", "--shares", "all,most"])
