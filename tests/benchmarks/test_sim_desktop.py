"""benchmarks/sim_desktop.py: the real `expertcache sim` per model, each service's best policy, the table."""

from __future__ import annotations

import json

from tests.conftest import load_bench


def test_one_model_gives_its_rows_best_policies_and_table(tmp_path, capsys):
    bench = load_bench("sim_desktop")
    out = tmp_path / "desktop.json"
    result = bench.main(["--models", "qwen3-30b-a3b", "--tokens", "40", "--moe-cache-gb", "4",
                         "--expert-formats", "bf16", "--policies", "lru,markov", "--out", str(out)])
    assert json.loads(out.read_text())["best"] == result["best"]
    (entry,) = result["best"]["qwen3-30b-a3b"]
    rows = result["rows"]["qwen3-30b-a3b"]
    assert {r["policy"] for r in rows} == {"lru", "markov"} and entry["format"] == "bf16"
    for service in bench.SERVICES:  # the best of the rows, for each service
        assert entry[service]["tokens_per_s"] == max(r["miss_service"][service]["tokens_per_s"] for r in rows)
    assert entry["hybrid_over_copy"] == entry["hybrid"]["tokens_per_s"] / entry["copy"]["tokens_per_s"]
    assert entry["hybrid_over_copy"] > 1, "at 4 GiB few bf16 experts fit: the CPU's share helps"
    assert f"| qwen3-30b-a3b | bf16 ({entry['slots']:,}) |" in capsys.readouterr().out
