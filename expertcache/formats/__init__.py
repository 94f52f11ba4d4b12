"""The expert-format registry: one name per format; `--moe-expert-format` offers its keys.

    >>> format_names()
    ['bf16', 'fp8', 'int4', 'mxfp4', 'nvfp4']
    >>> get_format("nvfp4").expert_bytes(2048, 768)  # one Qwen3-30B-A3B expert
    2654216

Importing this package does not import torch (the simulator prices formats without it).
"""

from __future__ import annotations

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part, bank_name
from expertcache.formats.bf16 import BF16
from expertcache.formats.fp8 import FP8
from expertcache.formats.int4 import INT4
from expertcache.formats.mxfp4 import MXFP4
from expertcache.formats.nvfp4 import NVFP4

REGISTRY: dict[str, ExpertFormat] = {f.name: f for f in (BF16(), FP8(), NVFP4(), INT4(), MXFP4())}


def format_names() -> list[str]:
    """Registered names, sorted."""
    return sorted(REGISTRY)


def get_format(name: str) -> ExpertFormat:
    """The format `name`. Raises FormatError naming the choices for an unknown name (`--moe-expert-format`)."""
    fmt = REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise FormatError(f"unknown expert format {name!r} (--moe-expert-format): choose one of "
                          + ", ".join(format_names()))
    return fmt


__all__ = ["BF16", "FP8", "INT4", "MXFP4", "NVFP4", "REGISTRY", "ExpertFormat", "FormatError", "Part",
           "bank_name", "format_names", "get_format"]
