"""Shared test settings: the `gpu` and `cpu_only` markers, hypothesis profiles, the optional real traces.

A test marked `gpu` needs a CUDA GPU and is skipped without one; a test marked `cpu_only` checks what
happens without a GPU (Triton's interpreter, a refusal) and is skipped where CUDA is present; a test
marked `slow` (a long property search or interpreter run) runs only in the long profile (HYPOTHESIS_PROFILE=long, `make
test-long`). The skips are made here, once (pytest_collection_modifyitems), not by each file.

HYPOTHESIS_PROFILE=ci (default) keeps the property tests inside CI's budget;
HYPOTHESIS_PROFILE=long runs them for much longer locally.
"""

import os
from pathlib import Path

try:  # without a GPU, Triton kernels run in Triton's interpreter on CPU tensors
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    torch = None

import pytest
from hypothesis import HealthCheck, settings

CUDA = torch is not None and torch.cuda.is_available()
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA, `cpu_only` tests with it, `slow` tests outside the long profile."""
    skip_gpu = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU")
    skip_cpu = pytest.mark.skip(reason="marked cpu_only: runs where CUDA is absent")
    skip_slow = pytest.mark.skip(reason="marked slow: runs in the long profile (HYPOTHESIS_PROFILE=long)")
    for item in items:
        if "slow" in item.keywords and PROFILE != "long":
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)
        if "cpu_only" in item.keywords and CUDA:
            item.add_marker(skip_cpu)


settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(PROFILE)

# Real routing traces are read from beside the checkout and never committed to it;
# EXPERTCACHE_TRACES names another folder (e.g. a git-ignored copy taken to a GPU machine).
TRACES = Path(os.environ.get("EXPERTCACHE_TRACES")
              or Path(__file__).resolve().parents[1].parent / "shared" / "traces")


def device_or_skip():
    """(device, is_gpu): CUDA when present, else CPU under Triton's interpreter."""
    if torch is None:
        pytest.skip("torch is not installed")
    if torch.cuda.is_available():
        return torch.device("cuda"), True
    return torch.device("cpu"), False


def real_trace(name: str) -> Path:
    """Path of a real trace, or skip the test when the folder is absent."""
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"real trace {path} not present (it lives beside the checkout, not in it)")
    return path


def compile_check(script: str):
    """Run `script` (Python source that prints JSON on its last line) in a child process without
    TRITON_INTERPRET, which would replace the compiler's language hooks; return the parsed JSON.
    Skips when there is no CUDA toolchain (ptxas) for the ahead-of-time compile."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=600, check=False)
    if proc.returncode and "ptxas" in proc.stderr.lower():
        pytest.skip(f"no CUDA toolchain for the ahead-of-time compile: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_bench(name: str):
    """benchmarks/<name>.py as a module (pytest's `pythonpath` puts benchmarks/ on sys.path, as running
    a script there does)."""
    import importlib

    return importlib.import_module(name)
