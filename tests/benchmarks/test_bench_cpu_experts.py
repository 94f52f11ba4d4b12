"""benchmarks/bench_cpu_experts.py end to end at a tiny geometry (CPU: the JSON's keys, not its figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_bench

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_writes_every_figure_with_its_spread(tmp_path):
    out = tmp_path / "cpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_experts.py"), "--hidden", "256", "--intermediate", "128",
         "--formats", "bf16,int4,float32", "--tokens", "1,2", "--store-gib", "0.002", "--reps", "2", "--warmup", "1",
         "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {"cpu", "cores", "numba", "torch", "commit"} <= set(doc["machine"])
    assert doc["thread_env"] == {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}
    assert doc["geometry"]["hidden"] == 256 and doc["kernel_threads"] >= 1
    rows = {r["format"]: r for r in doc["rows"]}
    assert list(rows) == ["bf16", "int4", "float32"]
    for name, row in rows.items():
        assert set(row["tokens"]) == {"1", "2"} and row["expert_bytes"] > 0 and row["store_keys"] >= 16
        cell = row["tokens"]["1"]
        want = {"kernel"} | ({"torch"} if name != "int4" else set()) | ({"numpy"} if name == "float32" else set())
        assert set(cell) == want
        for figure in cell.values():
            assert figure["gbps"]["min"] <= figure["gbps"]["median"] <= figure["gbps"]["max"]
            assert set(figure["seconds"]) == {"median", "min", "max"}
    assert "int4" in proc.stdout.splitlines()[-3]  # the table comes last


@pytest.mark.parametrize("argv, message", [
    (["--formats", "bf16,fp4"], "--formats"),
    (["--tokens", "0,1"], "--tokens: each in 1..8"),
    (["--tokens", "one"], "not a comma list of ints"),
    (["--threads", "0"], "--threads"),
])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_bench("bench_cpu_experts").parse(argv)
    assert message in capsys.readouterr().err


def test_the_default_threads_leave_the_copy_thread_a_core():
    import numba

    bench = load_bench("bench_cpu_experts")
    cores = numba.config.NUMBA_NUM_THREADS
    assert bench.parse([]).threads == cores
    assert bench.parse(["--with-link"]).threads == max(1, cores - 1)
    assert bench.parse(["--with-link", "--threads", "1"]).threads == 1
