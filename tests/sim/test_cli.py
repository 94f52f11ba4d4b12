"""`expertcache sim` end to end, in process: tables, JSON, plots and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe.cli import build_parser, main
from sim.cli import DEFAULT_PRESET
from sim.synthetic import generate, preset
from sim.trace import save_trace
from tests.conftest import real_trace


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "small.npz"
    save_trace(generate(preset("mixtral", num_tokens=60, seed=4)), path)
    return str(path)


def run_json(capsys, *argv) -> list[dict]:
    assert main(["sim", *argv, "--json", "--workers", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_one_object_per_policy_and_slots(capsys, small_trace):
    rows = run_json(capsys, small_trace, "--policies", "lru,rule,belady", "--slots", "64,128")
    assert [(r["policy"], r["slots"]) for r in rows] == [
        ("lru", 64), ("lru", 128), ("rule", 64), ("rule", 128), ("belady", 64), ("belady", 128)]
    for r in rows:
        assert {"policy", "slots", "accesses", "misses", "hit_rate"} <= set(r)
        assert r["hit_rate"] == pytest.approx(1 - r["misses"] / r["accesses"])
        assert len(r["layer_misses"]) == 32
    by = {(r["policy"], r["slots"]): r for r in rows}
    assert by[("belady", 64)]["misses"] <= by[("lru", 64)]["misses"]
    assert by[("lru", 64)]["gap_recovered"] == 0.0 and by[("belady", 128)]["gap_recovered"] == 1.0


def test_json_on_the_real_trace_matches_the_reference(capsys):
    path = str(real_trace("mixtral-gsm8k.npz"))
    rows = run_json(capsys, path, "--policies", "lru,belady", "--slots", "64,128")
    assert [r["misses"] for r in rows] == [10267, 7268, 6494, 2972]
    assert rows[0]["mb_copied_per_token"] > 0 and rows[0]["tokens_per_s"] > 0


def test_table_plot_and_per_layer(capsys, small_trace, tmp_path):
    png = tmp_path / "hit.png"
    assert main(["sim", small_trace, "--slots-frac", "0.25,0.5", "--per-layer", "--plot", str(png),
                 "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "gap rec." in out and "rule" in out and "lfuda" in out
    assert any(line.startswith("layer") and "rule@" in line for line in out.splitlines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_preset_run(capsys):
    assert main(["sim", "--preset", "qwen3-30b-a3b", "--tokens", "40", "--policies", "lru,rule",
                 "--slots", "800", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "40 tokens, 48 layers x 128 experts, top-8" in out


def test_default_is_the_qwen3_next_preset():
    args = build_parser().parse_args(["sim"])
    assert args.traces == [] and args.preset is None and args.slots is None
    assert DEFAULT_PRESET == "qwen3-next"
    cfg = preset(DEFAULT_PRESET)
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tokens) == (48, 512, 10, 2000)
    assert args.slots_frac == "0.25,0.5,0.75"


@pytest.mark.parametrize("argv, needle", [
    (["--policies", "lru,nope"], "--policies"),
    (["--slots", "12,x"], "--slots"),
    (["--slots", "0"], "--slots"),
    (["--slots-frac", "1.5"], "--slots-frac"),
    (["--preset", "nope"], "qwen3-next"),
])
def test_bad_flags_name_the_flag(argv, needle, small_trace):
    full = ["sim", *argv] if argv[0] == "--preset" else ["sim", small_trace, *argv]
    with pytest.raises(SystemExit, match=needle):
        main(full)


def test_too_few_slots_and_bad_files_are_errors(tmp_path, small_trace):
    with pytest.raises(SystemExit, match="--slots"):
        main(["sim", small_trace, "--slots", "1", "--workers", "1"])
    bad = tmp_path / "bad.npz"
    np.savez(bad, experts=np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(SystemExit, match="meta"):
        main(["sim", str(bad)])
    with pytest.raises(SystemExit, match="not both"):
        main(["sim", small_trace, "--preset", "mixtral"])


def test_profile_flag_prices_the_same_replay_differently(capsys):
    """--profile engine (default: the engine's measured SM copy and layer time) against copy-engine:
    the same hit counts, a different modeled speed, and the table names the profile it used."""
    args = ["--preset", "qwen3-next", "--tokens", "30", "--policies", "lru", "--slots-frac", "0.5", "--workers", "1"]
    engine = run_json(capsys, *args)
    copy_engine = run_json(capsys, *args, "--profile", "copy-engine")
    assert [r["misses"] for r in engine] == [r["misses"] for r in copy_engine]
    assert engine[0]["tokens_per_s"] < copy_engine[0]["tokens_per_s"]  # slower copy, larger layer overhead
    assert main(["sim", *args]) == 0
    assert "nvidia-h200-sm-copy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sim", *args, "--profile", "a100"])
