"""What every GPU benchmark records beside its numbers: the GPU, the software versions, the commit.

    machine() -> {gpu, sms, l2_bytes, torch, triton, cuda, commit, date}

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
