"""benchmarks/bench_agent.py end to end on the CPU at a tiny size: the session's wiring, not its figures."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench


def test_a_tiny_session_with_and_without_kept_prefixes(tmp_path):
    bench = load_bench("bench_agent")
    out = tmp_path / "agent.json"
    argv = ("--device cpu --small --layers 2 --vocab 512 --turns 4 --start-tokens 150 --grow 40 --answer 6 "
            "--side-every 2 --side-calls 2 --side-tokens 20 --side-answer 3 --max-batch 3 --max-seq-len 512 "
            "--kv-cache-gb 0.05 --slots-frac 0.5").split()
    doc = bench.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["runs"].keys() == {"kept", "none"}
    kept, none = (doc["runs"][name]["sessions"][0] for name in ("kept", "none"))
    assert [r["context_tokens"] for r in kept] == [r["context_tokens"] for r in none]  # the same session
    assert kept[0]["cached_tokens"] == 0 and all(r["cached_tokens"] == 0 for r in none)
    # every later turn restores what the last one kept: its prompt and the answer's fed tokens (all but
    # the last), in whole 64-token blocks, the new prompt's last token always computed
    for last, row in zip(kept, kept[1:]):
        held = last["context_tokens"] + last["answer_tokens"] - 1
        assert row["cached_tokens"] == min(held // 64, (row["context_tokens"] - 1) // 64) * 64 > 0
    assert [len(r["side_latency_s"]) for r in kept] == [0, 2, 0, 2]
    assert all(r["ttft_s"] > 0 and r["worst_gap_s"] >= 0 for r in kept + none)
    for name in ("kept", "none"):
        finished = doc["runs"][name]["finished"]
        assert sum(finished.values()) == 1 + 4 + 4 and set(finished) <= {"stop", "length"}  # the warm-up too
    assert doc["runs"]["kept"]["prefix_stats"]["restored"] == sum(r["cached_tokens"] for r in kept)


def test_the_baseline_resends_the_kept_sessions_prompts_of_its_turns(tmp_path):
    out = tmp_path / "agent.json"
    doc = load_bench("bench_agent").main([*"--device cpu --small --layers 2 --vocab 512 --turns 5 --start-tokens 70 "
                                          "--grow 10 --answer 3 --side-every 0 --max-seq-len 256 --kv-cache-gb 0.01 "
                                          "--baseline-every 3".split(), "--out", str(out)])
    kept, none = (doc["runs"][name]["sessions"][0] for name in ("kept", "none"))
    assert doc["baseline_turns"] == [0, 3, 4] and [r["turn"] for r in none] == [0, 3, 4]  # every 3rd and the last
    assert [r["context_tokens"] for r in none] == [kept[t]["context_tokens"] for t in (0, 3, 4)]
    assert all(r["cached_tokens"] == 0 for r in none) and sum(doc["runs"]["none"]["finished"].values()) == 1 + 3
    assert json.loads(out.read_text())["runs"]["none"]["sessions"][0] == none


def test_the_soak_stops_after_the_turn_that_ends_its_time(tmp_path):
    out = tmp_path / "soak.json"
    doc = load_bench("bench_agent").main([*"--device cpu --small --layers 2 --vocab 512 --turns 3 --start-tokens 70 "
                                          "--grow 10 --answer 3 --side-every 0 --max-seq-len 256 --kv-cache-gb 0.01 "
                                          "--minutes 0.0001".split(), "--out", str(out)])
    assert set(doc["runs"]) == {"kept"} and json.loads(out.read_text())["runs"]["kept"]["sessions"]
    assert len(doc["runs"]["kept"]["sessions"]) == 1 and 1 <= len(doc["runs"]["kept"]["sessions"][0]) <= 3


@pytest.mark.parametrize("argv, flag", [(["--turns", "0"], "--turns"), (["--slots-frac", "0"], "--slots-frac"),
                                        (["--kv-cache-gb", "0"], "--kv-cache-gb"),
                                        (["--baseline-every", "0"], "--baseline-every"),
                                        (["--expert-format", "int3"], "--expert-format")])
def test_bad_options_are_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit):
        load_bench("bench_agent")._args(argv)
    assert flag in capsys.readouterr().err


def test_the_session_runs_on_quantized_experts(tmp_path):
    """--expert-format: the host store and the slots hold the experts in that format (fp8 here)."""
    doc = load_bench("bench_agent").main([*"--device cpu --small --layers 2 --vocab 512 --turns 2 --start-tokens 70 "
                                          "--grow 10 --answer 3 --side-every 0 --max-seq-len 256 --kv-cache-gb 0.01 "
                                          "--expert-format fp8".split(), "--out", str(tmp_path / "agent.json")])
    assert doc["expert_format"] == "fp8" and doc["expert_bytes"] < 3 * 256 * 64 * 2  # under bf16's bytes
    assert sum(doc["runs"]["kept"]["finished"].values()) == 1 + 2
