"""Model specification: a Hugging Face config.json -> one validated, frozen ModelSpec.

    <dir>/config.json ──read_config──► dict ──ModelSpec.from_hf──► ModelSpec
                                              ├─ MoEConfig.from_hf (the MoE block: H, E, k, I, Is, norm_topk_prob)
                                              └─ attention / rope / norm / layout fields (table below)

Families (`model_type`), the fields read beyond the MoE block, and how they differ:

| model_type | q/k/v bias                   | o bias          | q/k RMSNorm | shared expert |
|------------|------------------------------|-----------------|-------------|---------------|
| qwen2_moe  | `qkv_bias` (default true)    | none            | no          | sigmoid-gated |
| qwen3_moe  | `attention_bias` (def false) | `attention_bias`| per head    | none          |

Both read num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (default
hidden_size // num_attention_heads), rope theta (`rope_parameters.rope_theta`, transformers >= 5, or
`rope_theta`), rms_norm_eps, vocab_size, tie_word_embeddings, decoder_sparse_step, mlp_only_layers and
intermediate_size (the dense MLP of layers that are not sparse). `num_local_experts` stands in for a
missing `num_experts` (transformers >= 5 writes Qwen3-MoE configs that way). Layer l is sparse (an MoE layer) when
`l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0`, as transformers decides. MoE layers
are numbered 0..L_moe-1 in layer order; that number is the cache's `layer` (key = moe_index * E + e).
Only the default rope and full attention are served: a scaled rope or a sliding window is refused.

Only unquantized checkpoints load: a `quantization_config` (or `compression_config`) whose
`quant_method` is not in SUPPORTED_QUANT_METHODS (empty today) is refused, and the model dtype
(`torch_dtype`, or `dtype` as transformers >= 5 writes it; default bfloat16) must be one of
moe.model.config.DTYPES unless the caller overrides it. moe.model.checkpoint refuses quantized tensors themselves
(float8 / integer dtypes, scale tensors beside a weight), whatever config.json says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from moe.model.config import DTYPES, MoEConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as is; the message names the file, field or tensor to fix."""


# quant_method values the loader implements; a later piece adds fp8 / nvfp4 / int4. Until then every
# quantized checkpoint is refused with UNQUANTIZED_ONLY, which says how to get one that loads.
SUPPORTED_QUANT_METHODS: tuple[str, ...] = ()
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")  # the latter: older compressed-tensors
UNQUANTIZED_ONLY = ("only unquantized checkpoints (bfloat16 / float16 / float32 tensors) load today: serve "
                    "the model's unquantized original instead (for example Qwen/Qwen3-30B-A3B, the bf16 "
                    "release that Qwen/Qwen3-30B-A3B-FP8 was quantized from), or dequantize this one to "
                    "bf16 and drop quantization_config from config.json")


@dataclass(frozen=True)
class Family:
    """What differs between the supported families' decoder layers."""

    bias_key: str  # config key of the q/k/v (and, where o_bias, o) projection bias
    bias_default: bool
    o_bias: bool  # whether o_proj follows bias_key (else o_proj has no bias)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE


FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family(bias_key="qkv_bias", bias_default=True, o_bias=False, qk_norm=False),
    "qwen3_moe": Family(bias_key="attention_bias", bias_default=False, o_bias=True, qk_norm=True),
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a checkpoint's shape that the loader and the engine need.

    model_type: a FAMILIES key. num_layers: decoder layers. hidden: H. vocab_size: V.
    num_heads / num_kv_heads: query / key-value heads (GQA groups = num_heads // num_kv_heads).
    head_dim: D. rope_theta: RoPE base. rms_eps: RMSNorm epsilon. tie_word_embeddings: lm_head is the
    embedding. qkv_bias / o_bias / qk_norm: attention variants. dense_intermediate: the dense MLP width.
    sparse: per layer, True for an MoE layer. moe: the MoE block (its dtype is the model's dtype).
    """

    model_type: str
    num_layers: int
    hidden: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    dense_intermediate: int
    sparse: tuple[bool, ...]
    moe: MoEConfig

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config.json: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config.json: num_attention_heads={self.num_heads} must be a multiple of "
                                  f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim={self.head_dim} must be even for RoPE")
        if len(self.sparse) != self.num_layers:
            raise CheckpointError(f"ModelSpec.sparse has {len(self.sparse)} entries for {self.num_layers} layers")
        if not any(self.sparse):
            raise CheckpointError("config.json: no layer is an MoE layer (check mlp_only_layers and "
                                  "decoder_sparse_step); expertcache serves MoE models")

    @property
    def dtype(self) -> str:
        return self.moe.dtype

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse)

    def moe_index(self, layer: int) -> int:
        """The MoE layer number (the cache's layer) of decoder layer `layer`, or -1 for a dense layer."""
        return sum(self.sparse[:layer]) if self.sparse[layer] else -1

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, dtype: str | None = None,
                copy_overlap: bool = False) -> "ModelSpec":
        """Read a config.json dict. dtype overrides the config's `dtype` / `torch_dtype`.

        Raises CheckpointError naming the unsupported model_type (and the supported ones), the
        missing key, the unsupported field (rope scaling, sliding window), a quantization_config's
        quant_method, or an unsupported torch_dtype / dtype.
        """
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointError(f"config.json model_type={model_type!r} is not supported; supported: "
                                  f"{sorted(FAMILIES)}")
        family = FAMILIES[model_type]
        _check_quantization(config)
        config = _aliased(config)
        config["torch_dtype"] = _model_dtype(config, dtype)  # what MoEConfig.from_hf reads
        try:
            moe = MoEConfig.from_hf(config, copy_overlap=copy_overlap)
        except KeyError as e:
            raise CheckpointError(str(e.args[0])) from None
        _check_attention_kind(config)
        num_layers, hidden = _require(config, "num_hidden_layers"), _require(config, "hidden_size")
        heads = _require(config, "num_attention_heads")
        bias = bool(config.get(family.bias_key, family.bias_default))
        return cls(
            model_type=model_type, num_layers=num_layers, hidden=hidden,
            vocab_size=_require(config, "vocab_size"), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rope_theta=float(_rope_theta(config)), rms_eps=float(_require(config, "rms_norm_eps")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias and family.o_bias, qk_norm=family.qk_norm,
            dense_intermediate=int(config.get("intermediate_size") or 0),
            sparse=_sparse_layers(config, num_layers), moe=moe,
        )


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of checkpoint directory `path` as a dict. Raises CheckpointError naming the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist: pass a Hugging Face checkpoint directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None


def _aliased(config: Mapping[str, Any]) -> dict[str, Any]:
    """config with `num_experts` filled from `num_local_experts`: transformers >= 5 saves Qwen3-MoE's
    expert count under the latter (an attribute alias), released checkpoints under the former."""
    out = dict(config)
    if out.get("num_experts") is None and out.get("num_local_experts") is not None:
        out["num_experts"] = out["num_local_experts"]
    return out


def _check_quantization(config: Mapping[str, Any]) -> None:
    """Refuse a quantization_config whose quant_method the loader does not implement (today: any)."""
    for key in QUANT_CONFIG_KEYS:
        quant = config.get(key)
        if not quant:
            continue
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        if method not in SUPPORTED_QUANT_METHODS:
            supported = ", ".join(SUPPORTED_QUANT_METHODS) or "none yet"
            raise CheckpointError(f"config.json {key}.quant_method={method!r}: this checkpoint is quantized "
                                  f"and the loader implements no such quant_method (supported: {supported}); "
                                  f"{UNQUANTIZED_ONLY}")


def _model_dtype(config: Mapping[str, Any], override: str | None) -> str:
    """The model dtype: `override` (load_checkpoint's dtype=, --dtype) when given, else the config's
    torch_dtype (or dtype, as transformers >= 5 writes it), else bfloat16; one of DTYPES."""
    if override is not None:
        if override not in DTYPES:
            raise CheckpointError(f"dtype={override!r} is not one of {DTYPES}")
        return override
    key = "torch_dtype" if config.get("torch_dtype") is not None else "dtype"
    value = config.get(key) or "bfloat16"
    if value not in DTYPES:
        raise CheckpointError(f"config.json {key}={value!r} is not a dtype the loader serves ({', '.join(DTYPES)}); "
                              f"{UNQUANTIZED_ONLY}. If the tensors are stored in one of those dtypes, set "
                              f"{key} to it or pass --dtype (load_model's dtype=)")
    return value


def _require(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise CheckpointError(f"config.json is missing {key!r}, which model_type={config.get('model_type')!r} needs")
    return config[key]


def _rope_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise CheckpointError("config.json is missing 'rope_theta' (or rope_parameters.rope_theta)")
    return theta


def _check_attention_kind(config: Mapping[str, Any]) -> None:
    """Refuse rope scaling and sliding windows, which the engine does not implement."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"config.json {key}.rope_type={kind!r}: only the default rope is served")
    if config.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true: only full attention is served; "
                              "set it to false to serve within the window-free context")


def _sparse_layers(config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Per layer, True when transformers builds an MoE block there."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    experts = config.get("num_experts") or 0
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    if not all(sparse) and not config.get("intermediate_size"):
        raise CheckpointError("config.json is missing 'intermediate_size', which the dense (mlp_only / "
                              "decoder_sparse_step) layers need")
    return sparse
