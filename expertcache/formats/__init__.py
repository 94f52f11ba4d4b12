"""The expert-format registry: one name per format; `--moe-expert-format` offers its keys.

    >>> format_names()
    ['bf16', 'fp8', 'int4', 'mxfp4', 'nvfp4']
    >>> get_format("nvfp4").expert_bytes(2048, 768)  # one Qwen3-30B-A3B expert
    2654220

Importing this package does not import torch (the simulator prices formats without it).

A VRAM budget (`--moe-cache-gb G`, in GiB: G * 2**30 bytes) becomes a slot count per format:
`slots_for_budget(G, fmt, H, I)` = floor(G * 2**30 / fmt.expert_bytes(H, I)).
`slots_for_bytes(G, P)` is the same for any P bytes per expert (the server prices a float16 /
float32 checkpoint's unquantized banks with it).
"""

from __future__ import annotations

import math

from expertcache.errors import FormatError
from expertcache.formats.base import ExpertFormat, Part, bank_name
from expertcache.formats.bf16 import BF16, Float16, Float32
from expertcache.formats.fp8 import FP8
from expertcache.formats.int4 import INT4
from expertcache.formats.mxfp4 import MXFP4
from expertcache.formats.nvfp4 import NVFP4

REGISTRY: dict[str, ExpertFormat] = {f.name: f for f in (BF16(), FP8(), NVFP4(), INT4(), MXFP4())}
# The model dtype's own format of unquantized experts, by torch dtype name.
DENSE: dict[str, ExpertFormat] = {"bfloat16": REGISTRY["bf16"], "float16": Float16(), "float32": Float32()}


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


def dense_format(dtype: str) -> ExpertFormat:
    """The unquantized format of experts stored in torch dtype `dtype` ("bfloat16" -> bf16, "float16",
    "float32"). Raises FormatError naming the dtype for any other."""
    fmt = DENSE.get(dtype) if isinstance(dtype, str) else None
    if fmt is None:
        raise FormatError(f"no dense expert format for dtype {dtype!r}: one of {sorted(DENSE)}")
    return fmt


# int4 variants that checkpoints store (GPTQ: float16 scales; asymmetric ones: zero points), by key
VARIANTS: dict[str, ExpertFormat] = {f.key: f for f in (INT4(scale_dtype="float16"), INT4(zero_points=True),
                                                        INT4(scale_dtype="float16", zero_points=True))}


def resolve_format(name: str) -> ExpertFormat:
    """A format by its `key`, as MoEConfig.expert_format holds it: a registered one (`get_format`), a dense
    one ("float16", "float32") or an int4 variant ("int4-f16", "int4-z", "int4-f16-z"). Raises
    FormatError naming the choices."""
    for fmt in (*DENSE.values(), *VARIANTS.values()):
        if name == fmt.key:
            return fmt
    return get_format(name)


GIB = 1 << 30


def slots_for_budget(gib: float, fmt: ExpertFormat, hidden: int, intermediate: int) -> int:
    """Slots of experts in `fmt` ([2I, H] gate_up + [H, I] down) that `gib` GiB of slot memory holds.

    Raises FormatError naming --moe-cache-gb for a budget that is not a finite number > 0 or that holds
    no expert at all.
    """
    per_expert = fmt.expert_bytes(hidden, intermediate)
    return slots_for_bytes(gib, per_expert, f"{fmt.name} expert of {per_expert:,} bytes (H {hidden}, I {intermediate})")


def slots_for_bytes(gib: float, per_expert: int, what: str = "expert") -> int:
    """floor(gib * 2**30 / per_expert): slots of `per_expert` bytes each in `gib` GiB of slot memory.

    what: the expert as the error names it. Raises FormatError naming --moe-cache-gb for a budget that
    is not a finite number > 0 or that holds no expert (with the smallest budget that holds one).
    """
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < float("inf"):
        raise FormatError(f"--moe-cache-gb must be a number of GiB > 0, got {gib!r}")
    slots = int(gib * GIB) // per_expert
    if slots < 1:
        raise FormatError(f"--moe-cache-gb {gib:g} holds no {what}: give at least {gib_at_least(per_expert)}")
    return slots


def gib_at_least(nbytes: int) -> str:
    """`nbytes` in GiB rounded up to 4 decimals, so that the budget printed holds them."""
    return f"{math.ceil(nbytes / GIB * 1e4) / 1e4:.4f}"


__all__ = ["DENSE", "GIB", "gib_at_least", "slots_for_budget", "slots_for_bytes", "BF16", "FP8", "INT4", "MXFP4",
           "NVFP4", "REGISTRY", "ExpertFormat", "Float16", "Float32", "FormatError", "Part", "bank_name",
           "dense_format", "format_names", "get_format", "resolve_format"]
