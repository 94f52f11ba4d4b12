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
    assert args.out is None and load_bench("hybrid_step")._args(["--out", "h.json"]).out == "h.json"


def test_layer_phases_follow_each_call_through_its_kernels():
    bench = load_bench("hybrid_step")

    def call(t0: float, copy: float, wait: float) -> list[dict]:
        seq = [("_split_kernel", 5.0), ("ensure_kernel", 4.0), ("_post_kernel", 4.0), ("_miss_copy_kernel", copy),
               ("_gate_up_kernel", 6.0), ("_zero_tail_kernel", 1.0), ("_down_kernel", 8.0), ("_wait_kernel", wait)]
        out, t = [], t0
        for name, dur in seq:
            out.append({"cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur + 0.5  # a gap between launches
        return out

    first, second = call(100.0, 50.0, 20.0), call(300.0, 70.0, 10.0)
    noise = [{"cat": "cpu_op", "name": "_post_kernel", "ts": 310.0, "dur": 1.0}]
    got = bench.layer_phases({"traceEvents": second + noise + first})
    assert got["ensure_post"] == {"median_us": 8.5, "calls": 2}
    assert got["copy"] == {"median_us": 60.5, "calls": 2}  # 50.5 and 70.5
    assert got["gate_up_after_copy"]["median_us"] == 6.5
    assert got["down"]["median_us"] == 10.0  # the zeroing and the down, with their gaps
    assert got["wait"]["median_us"] == 15.5  # 20.5 and 10.5
    first_end = first[-1]["ts"] + first[-1]["dur"]
    assert got["front"] == {"median_us": second[1]["ts"] - first_end, "calls": 1}
    assert got["layer"] == {"median_us": second[-1]["ts"] + second[-1]["dur"] - first_end, "calls": 1}


def test_layer_phases_of_a_trace_without_a_split_are_empty():
    got = load_bench("hybrid_step").layer_phases({"traceEvents": [{"cat": "kernel", "name": "ensure_kernel",
                                                                    "ts": 1.0, "dur": 1.0}]})
    assert set(got) == set(load_bench("hybrid_step").PHASES) and all(v["calls"] == 0 for v in got.values())
