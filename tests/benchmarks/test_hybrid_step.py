"""benchmarks/hybrid_step.py's CPU half: the CPU workers' slices placed on the profiler's clock."""

from __future__ import annotations

import pytest

from tests.conftest import load_bench


def test_worker_answers_land_on_the_profiler_clock_by_the_marker():
    bench = load_bench("hybrid_step")
    trace = {"traceEvents": [{"name": "decode step 0", "ph": "X", "ts": 5000.0, "dur": 900.0, "pid": 1, "tid": 1},
                             {"name": "expertcache.align", "ph": "X", "ts": 4000.0, "dur": 1.0, "pid": 1, "tid": 1}]}
    align = 10_000_000_000  # ns on the worker's clock, read inside the marker's range
    events = [(align + 1_250_000, align + 1_400_000, 3, 5), (align + 1_500_000, align + 1_510_000, 4, 0)]
    assert bench.merge_worker_events(trace, events, align) == 2
    slices = [e for e in trace["traceEvents"] if e.get("pid") == bench.WORKER_PID and e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in slices] == [("cpu experts L3", 5250.0, 150.0),
                                                                 ("cpu experts L4", 5500.0, 10.0)]
    assert slices[0]["args"] == {"layer": 3, "served_positions": 5}
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names[0]["args"]["name"] == "expertcache CPU workers"


def test_a_trace_without_the_marker_is_refused():
    with pytest.raises(ValueError, match="expertcache.align"):
        load_bench("hybrid_step").merge_worker_events({"traceEvents": []}, [(1, 2, 0, 1)], 0)


def test_small_is_the_sanitizers_geometry():
    args = load_bench("hybrid_step")._args(["--small", "--even"])
    assert (args.geometry, args.layers, args.even) == ("olmoe-1b-7b", 4, True)
