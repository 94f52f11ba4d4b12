"""What every GPU benchmark records beside its numbers: the GPU, the software versions, the commit.

    machine() -> {gpu, sms, l2_bytes, torch, triton, cuda, commit, date}
    d2d_bandwidth() / link_bandwidth(): the device's copy bandwidth and the host link's, measured in the
    run (the floors and limits the benchmarks divide by)

The commit is EXPERTCACHE_COMMIT when set (a GPU machine receives a working tree without .git),
else `git rev-parse HEAD`, else "unknown".
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def machine() -> dict:
    import torch
    import triton

    commit = os.environ.get("EXPERTCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
        check=False).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None),  # a working set under it flatters reads
            "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def d2d_bandwidth(reps: int = 20) -> float:
    """Device-to-device copy of 2 GiB of random int16: bytes read + written per second, the median of
    `reps` runs after 3 warm-ups (the HBM floors of the benchmarks)."""
    import numpy as np
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * src.nbytes / float(np.median(times[3:]))


def link_bandwidth(reps: int = 6) -> float:
    """Pinned host -> device copies of 256 MiB (the copy engine): bytes per second, the median of the
    runs after the first."""
    import numpy as np
    import torch

    src = torch.empty(2 ** 28, dtype=torch.uint8).pin_memory()
    dst = torch.empty(2 ** 28, dtype=torch.uint8, device="cuda")
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        out.append(src.numel() / (a.elapsed_time(b) * 1e-3))
    return float(np.median(out[1:]))
