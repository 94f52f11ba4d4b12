"""`expertcache sim` end to end, in process: tables, JSON, plots and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe.cli import build_parser, main
from sim.inputs import DEFAULT_TRACE_FRACS, default_trace
from sim.synthetic import generate, preset
from sim.trace import load_trace, save_trace
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


def test_the_choice_under_the_table_is_the_fastest_deployable_policy(capsys, small_trace):
    """Per slot count, the policy with the most modeled tok/s among those a server can run (never an
    oracle, though belady is faster), with its ratio to lru: read back from the same run's JSON."""
    argv = [small_trace, "--policies", "lru,rule,lfuda,markov,next-token,belady", "--slots", "64,128"]
    rows = run_json(capsys, *argv)
    assert main(["sim", *argv, "--workers", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index("choice by modeled tok/s (no overlap), never an oracle; belady (knows the whole future) is "
                     "the limit, next-token (knows the next token) an oracle to compare with:")
    for line, slots in zip(out[head + 1:head + 3], (64, 128)):
        mine = {r["policy"]: r["tokens_per_s"] for r in rows if r["slots"] == slots}
        best = max(("lru", "rule", "lfuda", "markov"), key=lambda p: (mine[p], [-ord(c) for c in p]))
        assert mine["belady"] > mine[best]
        assert line.startswith(f"  {slots} slots (") and f"): {best} {mine[best]:.1f} tok/s" in line
        assert f", {mine[best] / mine['lru']:.3f}x lru's;" in line
        assert line.endswith(f"; limit: belady {mine['belady']:.1f}; oracle: next-token {mine['next-token']:.1f}")


def test_the_choice_ranks_unpriced_traces_by_misses():
    """A trace without an expert size has no tok/s: the choice is the fewest misses, the oracles the
    limits, ties to the name."""
    from sim.replay import ORACLES, replay
    from sim.report import build_rows, choices, format_choices
    from sim.synthetic import SyntheticConfig

    trace = generate(SyntheticConfig(6, 10, 2, 60, seed=2))  # no expert size, no known model's shape
    results = [replay(trace, p, 20) for p in ("lru", "rule", "belady")]
    rows = build_rows(trace, results)
    assert rows[0].tokens_per_s is None
    (pick,) = choices(rows, ORACLES)
    misses = {r.policy: r.misses for r in results}
    want = min(("lru", "rule"), key=lambda p: (misses[p], p))
    assert pick["policy"] == want and pick["oracles"] == {"belady": misses["belady"]}
    assert pick["vs_lru"] == pytest.approx(misses[want] / misses["lru"]) and pick["vs_lru"] < 1
    head, line = format_choices(rows, ORACLES).splitlines()
    assert head.startswith("choice by fewest misses (the trace has no expert size to price them)")
    assert f"{want} {misses[want]} misses, {misses[want] / misses['lru']:.3f}x lru's; limit: belady" in line
    assert choices([r for r in rows if r.result.policy == "belady"], ORACLES) == []


def test_the_choice_under_a_budget_names_the_best_format(capsys):
    """--moe-cache-gb with two formats: a choice per (format, slots) and, per budget, the format and
    policy with the most tok/s."""
    assert main(["sim", "--preset", "olmoe-1b-7b", "--tokens", "60", "--moe-cache-gb", "4",
                 "--expert-format", "bf16,int4", "--policies", "lru,rule,belady", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "  4 GiB bf16, 341 slots (33.3 %): " in out and "  4 GiB int4, 1,024 slots (100.0 %): " in out
    assert "  4 GiB: int4 experts under " in out and "the most of its formats" in out


def test_synthetic_preset_run(capsys):
    assert main(["sim", "--preset", "qwen3-30b-a3b", "--tokens", "40", "--policies", "lru,rule",
                 "--slots", "800", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "40 tokens, 48 layers x 128 experts, top-8" in out


def test_the_default_is_the_embedded_gemma_trace_at_10_20_30_percent(capsys):
    """No trace and no --preset: the shipped real gemma-4 trace, at 10/20/30 % of its 3,840 keys, with
    the reference miss counts of lru and belady (the README of the real traces)."""
    args = build_parser().parse_args(["sim"])
    assert args.traces == [] and args.preset is None and args.slots is None
    assert args.slots_frac == "0.25,0.5,0.75" and DEFAULT_TRACE_FRACS == "0.1,0.2,0.3"
    trace = default_trace()
    assert trace.experts.shape == (128, 30, 1, 6) and trace.num_experts == 128
    assert trace.meta.license.startswith("Apache-2.0") and "Indoroid/DriftWood@31466a1" in trace.meta.source
    rows = run_json(capsys, "--policies", "lru,belady")
    assert [(r["policy"], r["slots"], r["misses"]) for r in rows] == [
        ("lru", 384, 11762), ("lru", 768, 6594), ("lru", 1152, 3958),
        ("belady", 384, 6323), ("belady", 768, 3533), ("belady", 1152, 2377)]
    assert [r["slots"] for r in run_json(capsys, "--policies", "lru", "--slots-frac", "0.5")] == [1920]


def test_the_embedded_trace_is_the_shared_one_byte_for_byte():
    from importlib import resources

    shipped = (resources.files("sim") / "data" / "gemma4-decode.npz").read_bytes()
    assert shipped == real_trace("gemma4-decode.npz").read_bytes()
    assert load_trace(real_trace("gemma4-decode.npz")) == default_trace()


def test_synthetic_flags_without_a_preset_are_refused(no_work):
    for flag, value in (("--tokens", "50"), ("--seed", "3")):
        message = sim_error(flag, value)
        assert f"{flag} sets up a synthetic trace: add --preset NAME" in message


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


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the command generates a synthetic trace or starts a sweep."""
    import sim.cli
    import sim.synthetic

    def boom(*args, **kwargs):
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(sim.cli, "sweep", boom)
    monkeypatch.setattr(sim.synthetic, "generate", boom)


def sim_error(*argv) -> str:
    """The message of `expertcache sim ARGV`, which must end in an 'error: ...' exit."""
    with pytest.raises(SystemExit) as err:
        main(["sim", *argv])
    assert isinstance(err.value.code, str) and err.value.code.startswith("error: ")
    return err.value.code


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "0"], "--tokens must be an integer >= 1, got 0"),
    (["--tokens", "-3"], "--tokens must be an integer >= 1, got -3"),
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--workers", "-1"], "--workers must be an integer >= 1, got -1"),
    (["--policies", ""], "--policies names no policy"),
    (["--policies", ","], "--policies names no policy"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--preset", "qwen3-next", "--tokens", "10000000"], "--tokens 10000000: the qwen3-next trace would hold"),
    (["--preset", "nope"], "--preset 'nope' is unknown"),
    (["--plot", "/nonexistent-folder/hit.png"], "--plot /nonexistent-folder/hit.png: folder"),
    (["--plot", "hit.txt"], "--plot hit.txt: matplotlib cannot write .txt"),
    (["--slots-frac", "2"], "--slots-frac needs fractions in (0, 1]"),
    (["--slots", ""], "--slots needs positive integers, got ''"),
    (["--slots", "abc"], "--slots takes comma-separated integers, got 'abc'"),
    (["--preset", ""], "--preset '' is unknown"),
])
def test_bad_synthetic_flags_fail_before_any_work(no_work, argv, needle):
    assert needle in sim_error(*argv)


def test_plot_folder_is_checked_before_the_sweep(no_work, small_trace, tmp_path):
    message = sim_error(small_trace, "--plot", str(tmp_path / "missing" / "hit.png"))
    assert "--plot" in message and "does not exist" in message and "mkdir -p" in message
    message = sim_error(small_trace, "--plot", str(tmp_path))
    assert f"--plot {tmp_path} is a folder" in message


def test_trace_with_synthetic_flags_is_refused(no_work, small_trace):
    assert "--seed, not both" in sim_error(small_trace, "--seed", "3")
    assert "--tokens, not both" in sim_error(small_trace, "--tokens", "0")


def test_more_slots_than_keys_is_refused(no_work, small_trace):
    message = sim_error(small_trace, "--slots", "64,100000")
    assert "--slots 100000" in message and "32 x 8 = 256 keys" in message
    assert "--slots <= 256" in message


def test_too_few_slots_from_a_fraction_names_the_fraction(no_work, small_trace):
    assert "--slots-frac gives 1 slot, too few" in sim_error(small_trace, "--slots-frac", "0.001")


def test_zero_token_trace_is_a_clear_error(no_work, tmp_path):
    t = generate(preset("mixtral", num_tokens=3)).slice_tokens(0, 0)
    save_trace(t, tmp_path / "empty.npz")
    message = sim_error(str(tmp_path / "empty.npz"))
    assert "experts has shape (0, 32, 1, 2)" in message and "no decode steps" in message


def write_bad_inputs(d) -> dict[str, str]:
    """name -> path of bad inputs a new user might pass."""
    (d / "ft").mkdir()
    (d / "random.npz").write_bytes(np.random.default_rng(2).bytes(500))
    np.save(d / "object.npy", np.array([None], dtype=object))
    (d / "bad.jsonl").write_text('{"layer": 0, "experts": [1], "token_idx": 0}\n{bad\n')
    (d / "empty.jsonl").write_text("")
    lines = [{"layer": layer, "experts": [1, 2], "token_idx": 0} for layer in range(10)]
    lines.append({"layer": 100_000_000, "experts": [1, 2], "token_idx": 0})
    (d / "huge-layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    meta = generate(preset("mixtral", num_tokens=3)).meta.to_dict()
    np.savez(d / "huge-e.npz", experts=np.zeros((2, 32, 2), dtype=np.int32) + [0, 1],
             meta=np.array(json.dumps(dict(meta, num_experts=2**29))))
    (d / "trace.json").write_text('{"layer": 0, "experts": [1], "token_idx": 0}\n')
    return {"missing": str(d / "absent.npz"), "not freetoken": str(d / "ft"),
            "random bytes": str(d / "random.npz"), "object npy": str(d / "object.npy"),
            "bad json": str(d / "bad.jsonl"), "empty jsonl": str(d / "empty.jsonl"),
            "huge layer": str(d / "huge-layer.jsonl"), "huge num_experts": str(d / "huge-e.npz"),
            "jsonl without suffix": str(d / "trace.json")}


BAD_INPUTS = {
    "missing": "no such file or directory",
    "not freetoken": "experts.npy: missing",
    "random bytes": "not a valid expertcache trace archive",
    "object npy": "single .npy array",
    "bad json": "bad.jsonl:2: not valid JSON",
    "empty jsonl": "no records",
    "huge layer": "huge-layer.jsonl:11: field 'layer' = 100000000 is over the limit",
    "huge num_experts": "meta.num_layers * meta.num_experts = 32 x 536870912",
    "jsonl without suffix": "must be named *.jsonl",
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_inputs_are_one_line_errors(no_work, tmp_path, name):
    message = sim_error(write_bad_inputs(tmp_path)[name], "--workers", "1")
    assert BAD_INPUTS[name] in message and "pickle" not in message.lower()


def test_policies_are_stripped_and_deduplicated(capsys, small_trace):
    rows = run_json(capsys, small_trace, "--policies", "lru, rule,lru", "--slots", "64,64")
    assert [(r["policy"], r["slots"]) for r in rows] == [("lru", 64), ("rule", 64)]


def test_several_plots_go_to_the_plot_folder(capsys, small_trace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert main(["sim", small_trace, small_trace, "--policies", "lru", "--slots", "64",
                 "--plot", "out/hit.png", "--json", "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)) == 2 and "plot: out/hit-1.png" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    for i in range(2):  # --json keeps stdout JSON and still writes the plots
        assert (tmp_path / "out" / f"hit-{i}.png").read_bytes()[:4] == b"\x89PNG"


def test_jsonl_keeps_its_sidecar_model(tmp_path):
    from sim.inputs import load_any
    from sim.jsonl import export_jsonl

    t = generate(preset("mixtral", num_tokens=4))
    export_jsonl(t, tmp_path / "run.jsonl")
    assert load_any(str(tmp_path / "run.jsonl")).meta.model == "synthetic:mixtral"
    (tmp_path / "run.jsonl.meta.json").unlink()
    assert load_any(str(tmp_path / "run.jsonl")).meta.model == "run"


def test_tok_s_columns_count_the_batch(capsys, tmp_path):
    """tok/s and tok/s ov both count every batch row: each is the cost model's tokens_per_s of
    its estimate (batch * 1e6 / us per decode step), in the JSON and in the table."""
    from sim.cli import PROFILES
    from sim.costmodel import estimate_decode
    from sim.replay import replay
    from sim.report import build_rows, format_table, model_shape

    trace = generate(preset("mixtral", num_tokens=30, batch=4))
    save_trace(trace, tmp_path / "b4.npz")
    rows = run_json(capsys, str(tmp_path / "b4.npz"), "--policies", "lru", "--slots", "96")
    profile, shape = PROFILES["engine"], model_shape(trace)
    res = replay(trace, "lru", 96)
    ov = estimate_decode(res.hist, res.tokens, shape, profile, batch=4, overlap=True)
    assert rows[0]["tokens_per_s_overlap"] == pytest.approx(ov.tokens_per_s)
    assert rows[0]["tokens_per_s_overlap"] == pytest.approx(4e6 / rows[0]["us_per_token_overlap"])
    assert rows[0]["tokens_per_s"] == pytest.approx(4e6 / rows[0]["us_per_token"])
    row = build_rows(trace, [res], profile)[0]
    line = format_table([row]).splitlines()[-1].split()
    assert float(line[-2]) == pytest.approx(row.tokens_per_s, abs=0.05)
    assert float(line[-1]) == pytest.approx(ov.tokens_per_s, abs=0.05)
