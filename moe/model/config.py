"""MoE block configuration: a checkpoint's config.json dict -> one validated, frozen MoEConfig.

    config.json (dict) ──from_hf──► MoEConfig ──► plan.resolve_launch_plan / reference.moe_reference
    EXPERTCACHE_MOE_COPY_OVERLAP ──copy_overlap_from_env──► MoEConfig.copy_overlap
    EXPERTCACHE_ROUTED_MMA ──routed_mma_from_env──► the launch plan's routed kernels (moe.kernels.plan)

The fields each family's MoE block reads (experts, widths, shared expert, routing): docs/models.md.
The routed experts' storage format (`expert_format`, expertcache.formats) is not in config.json: the
loader gives it (the checkpoint's quantization, or --moe-expert-format); by default the experts are
unquantized in the model dtype ("bf16", "float16" or "float32").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from expertcache.formats import ExpertFormat, FormatError, dense_format, resolve_format
from expertcache.words import counted

COPY_OVERLAP_ENV = "EXPERTCACHE_MOE_COPY_OVERLAP"
ROUTED_MMA_ENV = "EXPERTCACHE_ROUTED_MMA"
DTYPES = ("float32", "float16", "bfloat16")
SHARED_FAMILIES = ("qwen2_moe", "qwen3_next")
FAMILIES = SHARED_FAMILIES + ("qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe")
SCORINGS = ("softmax", "sigmoid")  # the router's score of an expert (glm4_moe: sigmoid)
ACTIVATIONS = ("silu", "swiglu_clamped")  # silu(gate) * up; gpt-oss's clamped SwiGLU
EXPERT_BIAS_BANKS = ("gate_up_bias", "down_bias")  # gpt-oss's per-expert biases [2I], [H], in the model dtype


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE block.

    hidden: model width H. num_experts: routed experts E. top_k: experts per token k.
    expert_intermediate: routed expert MLP width I. shared_intermediate: shared expert width Is
    (0 = no shared expert). norm_topk_prob: renormalise the top-k weights to sum to 1.
    dtype: weight/activation dtype name ("float32", "float16", "bfloat16").
    copy_overlap: the user's choice of the side stream (the one launch option a user sets): run the
    shared expert and the resident experts' gate_up beside the router, ensure and miss copy where
    moe.kernels.plan.resolve_launch_plan finds it applies. Every other launch choice is resolved there.
    expert_format: how the routed experts are stored in the host store and the slots (an
    expertcache.formats name: bf16, fp8, nvfp4, mxfp4, int4, or the dense float16 / float32); "" (the
    default) resolves at construction to the model dtype's dense format (bf16 for bfloat16).
    activation: the experts' gated activation, an ACTIVATIONS name ("silu": silu(gate) * up;
    "swiglu_clamped": gpt-oss's, with swiglu_alpha and swiglu_limit). expert_bias: each routed expert
    has a gate_up bias [2I] and a down bias [H] (gpt-oss). router_bias: the router has a bias [E].
    scoring: "softmax" (over the E logits) or "sigmoid" (each logit alone; glm4_moe). score_bias: a
    bias [E] added to the scores to choose the experts only (glm4_moe's e_score_correction_bias).
    n_group / topk_group: the experts form n_group equal groups and the choice stays within the
    topk_group groups whose two best biased scores sum highest (1 / 1: no grouping). routed_scaling:
    the chosen weights' factor (after the renormalisation). shared_gate: the shared expert's output
    is scaled by sigmoid(x · gate_w) (Qwen); False: added as it is (glm4_moe).

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
    expert_format: str = ""
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    router_bias: bool = False
    scoring: str = "softmax"
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    shared_gate: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "num_experts", "top_k", "expert_intermediate"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("shared_intermediate", self.shared_intermediate, minimum=0)
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name in ("norm_topk_prob", "copy_overlap", "expert_bias", "router_bias", "score_bias", "shared_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoEConfig.scoring={self.scoring!r} is not one of {SCORINGS}")
        _check_int("n_group", self.n_group, minimum=1)
        _check_int("topk_group", self.topk_group, minimum=1)
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"MoEConfig.n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} may not exceed it")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            kept = counted(self.topk_group * (self.num_experts // self.n_group), "expert")
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds the {kept} of the "
                             f"{counted(self.topk_group, 'group')} kept (topk_group)")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"MoEConfig.n_group={self.n_group}: a group's worth is its two best experts, so "
                             "each group needs at least 2")
        value = self.routed_scaling
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"MoEConfig.routed_scaling must be a finite number > 0, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r} is not one of {ACTIVATIONS}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"MoEConfig.{name} must be a finite number > 0, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"MoEConfig.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.expert_format == "":
            object.__setattr__(self, "expert_format", dense_format(self.dtype).name)
        try:
            fmt = resolve_format(self.expert_format)
            fmt.expert_bytes(self.hidden, self.expert_intermediate)  # the shape must fit the format
        except FormatError as e:
            raise ValueError(f"MoEConfig.expert_format={self.expert_format!r}: {e}") from None

    @property
    def format(self) -> ExpertFormat:
        """The routed experts' ExpertFormat (expertcache.formats) of `expert_format`."""
        return resolve_format(self.expert_format)

    def expert_banks(self) -> tuple:
        """The HostStore banks of one routed expert (expertcache.pool.Bank): those of expert_format
        (e.g. "gate_up" [2I, H] and "down" [H, I] unquantized), and with expert_bias EXPERT_BIAS_BANKS
        in the model dtype, so a miss copies an expert's biases with its weights and `--moe-cache-gb`
        prices them."""
        import torch

        from expertcache.pool import Bank

        banks = self.format.expert_banks(self.hidden, self.expert_intermediate)
        if self.expert_bias:
            dtype = getattr(torch, self.dtype)
            banks += (Bank(EXPERT_BIAS_BANKS[0], (2 * self.expert_intermediate,), dtype),
                      Bank(EXPERT_BIAS_BANKS[1], (self.hidden,), dtype))
        return banks

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate > 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, copy_overlap: bool = False, expert_format: str = "") -> MoEConfig:
        """Read a Qwen2-MoE / Qwen3-Next / Qwen3-MoE / Mixtral / gpt-oss / GLM-4.5 / OLMoE config.json dict
        (expert_format: the experts' storage, from the loader; "" = the model dtype's dense format).

        Raises KeyError naming the missing key, ValueError for an unknown `model_type` or an invalid value.
        """
        family = _family(config)
        mixtral = family in ("mixtral", "gpt_oss")  # experts under num_local_experts, softmax over the top-k
        oai, glm = family == "gpt_oss", family == "glm4_moe"
        shared = _require(config, "shared_expert_intermediate_size") if family in SHARED_FAMILIES else 0
        if glm:
            shared = _require(config, "moe_intermediate_size") * int(config.get("n_shared_experts") or 0)
        experts = "num_local_experts" if mixtral else "n_routed_experts" if glm else "num_experts"
        width = "intermediate_size" if mixtral or family == "olmoe" else "moe_intermediate_size"  # OLMoE: no dense MLP
        return cls(
            hidden=_require(config, "hidden_size"),
            num_experts=_require(config, experts),
            top_k=_require(config, "num_experts_per_tok"),
            expert_intermediate=_require(config, width),
            shared_intermediate=shared,
            norm_topk_prob=True if mixtral else bool(config.get("norm_topk_prob", False)),
            dtype=str(config.get("torch_dtype", config.get("dtype", "bfloat16"))),
            copy_overlap=copy_overlap,
            expert_format=expert_format,
            activation="swiglu_clamped" if oai else "silu",
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)) if oai else 1.702,
            swiglu_limit=float(config.get("swiglu_limit", 7.0)) if oai else 7.0,
            expert_bias=oai, router_bias=oai,
            scoring="sigmoid" if glm else "softmax", score_bias=glm,
            n_group=int(config.get("n_group") or 1) if glm else 1,
            topk_group=int(config.get("topk_group") or 1) if glm else 1,
            routed_scaling=float(config.get("routed_scaling_factor", 1.0)) if glm else 1.0,
            shared_gate=not glm,
        )


def copy_overlap_from_env(default: bool = False) -> bool:
    """EXPERTCACHE_MOE_COPY_OVERLAP: "1" -> True, "0" -> False, unset or "" -> `default`.

    The variable, when set, wins over the config field. Raises ValueError naming the variable otherwise.
    """
    return _flag_from_env(COPY_OVERLAP_ENV, default, "overlap")


def routed_mma_from_env(default: bool = False) -> bool:
    """EXPERTCACHE_ROUTED_MMA: "1" -> the decode layers' routed experts run on the tensor-core kernels
    (moe.kernels.routed_mma), "0" -> the one-program-a-pair kernels (moe.kernels.routed), unset or "" ->
    `default`. Raises ValueError naming the variable otherwise."""
    return _flag_from_env(ROUTED_MMA_ENV, default, "the tensor-core routed kernels")


def _flag_from_env(name: str, default: bool, what: str) -> bool:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name}={value!r}: set it to 1 ({what} on) or 0 (off), or unset it")


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
