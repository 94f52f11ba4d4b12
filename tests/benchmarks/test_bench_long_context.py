"""benchmarks/bench_long_context.py end to end on the CPU at a tiny size: the wiring, not its figures."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench


def test_a_long_prompt_alone_and_beside_side_calls(tmp_path):
    out = tmp_path / "long.json"
    argv = ("--device cpu --small --layers 2 --vocab 512 --prompt-tokens 300 --prefill-chunk 64 --answer 8 "
            "--side-calls 2 --side-tokens 20 --side-answer 3 --max-batch 3").split()
    doc = load_bench("bench_long_context").main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["runs"].keys() == {"alone", "sides"}
    alone, sides = doc["runs"]["alone"], doc["runs"]["sides"]
    assert alone["sides"] == [] and [s["phase"] for s in sides["sides"]] == ["prefill"] * 2 + ["decode"] * 2
    for run in (alone, sides):
        assert run["prompt_tokens"] == 300 and run["answer_tokens"] == 8 and run["ttft_s"] > 0
    # the side calls submitted during the long prefill joined beside it: they answered before it did
    assert all(s["ttft_s"] < sides["ttft_s"] for s in sides["sides"] if s["phase"] == "prefill")
    assert sum(doc["finished"].values()) == 1 + 2 + 4 and set(doc["finished"]) <= {"stop", "length"}


@pytest.mark.parametrize("argv, flag", [(["--side-calls", "4"], "--max-batch"), (["--prompt-tokens", "0"],
                                                                                  "--prompt-tokens")])
def test_bad_options_are_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit):
        load_bench("bench_long_context")._args(argv)
    assert flag in capsys.readouterr().err
