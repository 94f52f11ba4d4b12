"""Kernel intervals and range attribution from a hand-written Chrome trace (the profiler's layout)."""

import json

from moe.testing.kernel_trace import kernels, kernels_in_range, load_trace, named


def event(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def test_attribution_by_launch_inside_the_range(tmp_path):
    trace = [
        event("bench.shared_expert", "user_annotation", 10, 10),
        event("cudaLaunchKernel", "cuda_runtime", 12, 1, correlation=5),
        event("cuLaunchKernelEx", "cuda_driver", 25, 1, correlation=6),  # after the range
        event("cudaLaunchKernel", "cuda_runtime", 15, 1, tid=2, correlation=7),  # another thread
        event("gemv_bf16", "kernel", 40, 3, stream=20, correlation=5),
        event("_miss_copy_kernel", "kernel", 30, 50, stream=7, correlation=6),
        event("silu", "kernel", 44, 1, stream=20, correlation=7),
        {"ph": "i", "name": "marker", "ts": 1},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": trace}))
    events = load_trace(path)
    ks = kernels(events)
    assert [k.name for k in ks] == ["_miss_copy_kernel", "gemv_bf16", "silu"]
    assert ks[0].duration == 50 and ks[0].stream == 7
    assert [k.name for k in kernels_in_range(events, "bench.shared_expert")] == ["gemv_bf16"]
    assert [k.correlation for k in named(ks, "copy")] == [6]
