"""GPU kernel intervals from a torch.profiler Chrome trace, and the kernels launched inside a range.

    prof.export_chrome_trace(path) ──load_trace──► events (dicts)
        ──kernels──► [Kernel(name, stream, start_us, end_us, correlation)] sorted by start
        ──kernels_in_range(events, name)──► the kernels whose launch call (cuda_runtime / cuda_driver
          event) lies inside a `record_function(name)` range on the same thread, matched by the
          launch's correlation id

Eager launches carry one correlation id each, so the range attribution is exact. Kernels replayed from
a CUDA graph all share the graph launch's correlation id and sit on whatever streams the graph executor
chose, so for replays only names and times are meaningful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Kernel:
    """One kernel execution: name, CUPTI stream id, start / end in microseconds, correlation id."""

    name: str
    stream: int
    start: float
    end: float
    correlation: int

    @property
    def duration(self) -> float:
        return self.end - self.start


def load_trace(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace JSON. Raises TypeError for a file without an event list."""
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TypeError(f"{path}: no traceEvents list; write it with prof.export_chrome_trace")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def kernels(events: list[dict]) -> list[Kernel]:
    """Every GPU kernel event, sorted by start time."""
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        out.append(Kernel(e["name"], int(args.get("stream", -1)), float(e["ts"]),
                          float(e["ts"]) + float(e.get("dur", 0.0)), int(args.get("correlation", -1))))
    return sorted(out, key=lambda k: k.start)


def kernels_in_range(events: list[dict], range_name: str) -> list[Kernel]:
    """Kernels launched (eagerly) inside any `record_function(range_name)` range."""
    ranges = [(e.get("tid"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
              for e in events if e.get("name") == range_name and e.get("cat") == "user_annotation"]
    corr = set()
    for e in events:
        if e.get("cat") not in LAUNCH_CATEGORIES or "correlation" not in e.get("args", {}):
            continue
        ts = float(e["ts"])
        if any(tid == e.get("tid") and lo <= ts <= hi for tid, lo, hi in ranges):
            corr.add(int(e["args"]["correlation"]))
    return [k for k in kernels(events) if k.correlation in corr]


def named(ks: list[Kernel], fragment: str) -> list[Kernel]:
    """The kernels whose name contains `fragment`, in start order."""
    return [k for k in ks if fragment in k.name]
