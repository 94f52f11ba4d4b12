"""MoE block configuration: a checkpoint's config.json dict -> one validated, frozen MoEConfig.

    config.json (dict) ──from_hf──► MoEConfig ──► plan.make_routed_plan / reference.moe_reference
    EXPERTCACHE_MOE_COPY_OVERLAP ──copy_overlap_from_env──► MoEConfig.copy_overlap

Families read by `MoEConfig.from_hf` (chosen by `model_type`, or by the keys present when it is absent):

| family                    | experts             | expert MLP width        | shared expert                      | top-k renormalised |
|---------------------------|---------------------|-------------------------|------------------------------------|--------------------|
| qwen2_moe, qwen3_next     | `num_experts`       | `moe_intermediate_size` | `shared_expert_intermediate_size`  | `norm_topk_prob`   |
| qwen3_moe                 | `num_experts`       | `moe_intermediate_size` | none                               | `norm_topk_prob`   |
| mixtral                   | `num_local_experts` | `intermediate_size`     | none                               | always             |

All families read `hidden_size` and `num_experts_per_tok`. `norm_topk_prob` defaults to False when
absent (the transformers default for the Qwen configs). Mixtral takes the softmax over its top-k
logits, which equals the full softmax's top-k renormalised to sum to 1, so it maps to
`norm_topk_prob=True`. The dtype comes from `torch_dtype` (or `dtype`), default "bfloat16".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

COPY_OVERLAP_ENV = "EXPERTCACHE_MOE_COPY_OVERLAP"
DTYPES = ("float32", "float16", "bfloat16")
SHARED_FAMILIES = ("qwen2_moe", "qwen3_next")
FAMILIES = SHARED_FAMILIES + ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE block.

    hidden: model width H. num_experts: routed experts E. top_k: experts per token k.
    expert_intermediate: routed expert MLP width I. shared_intermediate: shared expert width Is
    (0 = no shared expert). norm_topk_prob: renormalise the top-k weights to sum to 1.
    dtype: weight/activation dtype name ("float32", "float16", "bfloat16").
    copy_overlap: run the shared expert on a side stream while the miss copy is in flight.
    pdl_chain: launch the router, ensure and miss copy with programmatic dependent launch too (each
    waits for its predecessor before reading anything, so the same results). On by default: on the
    H200 a step of four layers with misses ran 20-24 us faster with the overlap on (997-999 against
    1020-1021 us) and the resident layer 1.4 us faster with the overlap off, the same with it on
    (docs/moe.md). False launches them plainly.
    early_hits: with the side stream in use (copy_overlap on and applied), the gate_up rows of the
    experts already resident run on the side stream right after the router, beside the ensure and
    miss copy (moe.engine.layer); the same output bits. No effect with the overlap off. None (the default):
    on unless the pool holds every expert of every layer (MoELayer.refresh decides; then no step after
    the pool fills misses, there is no copy to hide, and on the H200 one more resident layer took 25.2
    us without early hits against 28.5 with them: docs/moe.md).
    front_release: the routed down lets the next layer's router launch right after its own wait
    (RoutedConfig.down_release) and the router loads its weights before its wait (RouterConfig.early_weights,
    where they fit), the down prefetches 2 experts' tiles (RoutedConfig.down_prefetch, unless it is
    set), and the miss copy lets the routed gate_up launch right after its own wait
    (RoutedConfig.copy_release, unless it is set); the same output bits. None (the default): on unless the layer runs early hits
    (beside them both made the resident layer slower, 33.8 against 29.8 us; without them faster: with
    the overlap off one more resident layer took 31.6 against 32.8 us). False: the module defaults
    (moe.kernels.routed.DEFAULT_CONFIG, moe.kernels.router.DEFAULT_ROUTER) decide, as they do for standalone calls.
    hits_first: the routed gate_up is one persistent launch on the compute stream that computes the
    experts resident before the ensure first, released by the miss copy at its start (with
    pdl_chain), so their rows stream while the ensure and the copy run, then the others after the
    copy (moe.kernels.routed part="first"); the same output bits. With the overlap on the side stream then
    runs only the shared expert (early_hits is not used). Off by default.

    Raises ValueError naming the field on any invalid value.
    """

    hidden: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0
    norm_topk_prob: bool = False
    dtype: str = "bfloat16"
    copy_overlap: bool = False
    pdl_chain: bool = True
    early_hits: bool | None = None
    hits_first: bool = False
    front_release: bool | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "num_experts", "top_k", "expert_intermediate"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("shared_intermediate", self.shared_intermediate, minimum=0)
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name in ("norm_topk_prob", "copy_overlap", "pdl_chain", "hits_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("early_hits", "front_release"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be None, True or False, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"MoEConfig.dtype={self.dtype!r} is not one of {DTYPES}")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate > 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, copy_overlap: bool = False) -> "MoEConfig":
        """Read a Qwen2-MoE / Qwen3-Next / Qwen3-MoE / Mixtral config.json dict.

        Raises KeyError naming the missing key, ValueError for an unknown `model_type` or an invalid value.
        """
        family = _family(config)
        mixtral = family == "mixtral"
        shared = _require(config, "shared_expert_intermediate_size") if family in SHARED_FAMILIES else 0
        return cls(
            hidden=_require(config, "hidden_size"),
            num_experts=_require(config, "num_local_experts" if mixtral else "num_experts"),
            top_k=_require(config, "num_experts_per_tok"),
            expert_intermediate=_require(config, "intermediate_size" if mixtral else "moe_intermediate_size"),
            shared_intermediate=shared,
            norm_topk_prob=True if mixtral else bool(config.get("norm_topk_prob", False)),
            dtype=str(config.get("torch_dtype", config.get("dtype", "bfloat16"))),
            copy_overlap=copy_overlap,
        )


def copy_overlap_from_env(default: bool = False) -> bool:
    """EXPERTCACHE_MOE_COPY_OVERLAP: "1" -> True, "0" -> False, unset or "" -> `default`.

    The variable, when set, wins over the config field. Raises ValueError naming the variable otherwise.
    """
    value = os.environ.get(COPY_OVERLAP_ENV, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{COPY_OVERLAP_ENV}={value!r}: set it to 1 (overlap on) or 0 (off), or unset it")


def _family(config: Mapping[str, Any]) -> str:
    """The config's family: `model_type` when present, else guessed from the keys."""
    family = config.get("model_type")
    if family is None:
        if "num_local_experts" in config:
            return "mixtral"
        return "qwen2_moe" if "shared_expert_intermediate_size" in config else "qwen3_moe"
    if family not in FAMILIES:
        raise ValueError(f"config.json model_type={family!r} is not one of {FAMILIES}")
    return family


def _require(config: Mapping[str, Any], key: str) -> Any:
    if key not in config:
        raise KeyError(f"config.json is missing {key!r}, which this model_type needs")
    return config[key]


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MoEConfig.{name} must be an int >= {minimum}, got {value!r}")
