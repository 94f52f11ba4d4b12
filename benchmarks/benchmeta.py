"""What every benchmark records beside its numbers: the machine, the software versions, the commit.

    machine() -> {gpu, sms, l2_bytes, torch, triton, cuda, commit, date}
    cpu_machine() -> {cpu, cores, numba, numpy, torch, commit, date} (+ gpu where CUDA is present)
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


def commit() -> str:
    """EXPERTCACHE_COMMIT, else the checkout's HEAD, else "unknown"."""
    head = os.environ.get("EXPERTCACHE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
        check=False).stdout.strip()
    return head or "unknown"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine() -> dict:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None),  # a working set under it flatters reads
            "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "commit": commit(), "date": now()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else lscpu), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_machine() -> dict:
    """The machine of a CPU benchmark: the CPU model, the cores this process may use, numba's threads and
    the LLVM CPU and features it compiles for (expertcache.numba_cache), the versions of numba / numpy /
    torch, the commit; the GPU's name where CUDA is present. Needs no GPU."""
    import llvmlite.binding as ll
    import numba
    import numpy as np
    import torch
    from numba.core import config

    import expertcache.numba_cache  # noqa: F401  (its vector-width choice, as the kernels see it)

    info = {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "numba_threads": numba.get_num_threads(), "numba": numba.__version__,
            "numpy": np.__version__, "torch": torch.__version__, "commit": commit(), "date": now(),
            "llvm_cpu": config.CPU_NAME or ll.get_host_cpu_name(),
            "wide_vectors": "-prefer-256-bit" in (config.CPU_FEATURES or "")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


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
