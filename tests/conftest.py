"""Shared test settings: hypothesis profiles and the location of the optional real traces.

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

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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
