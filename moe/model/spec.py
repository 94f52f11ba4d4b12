"""Model specification: a Hugging Face config.json -> one validated, frozen ModelSpec.

    <dir>/config.json ──read_config──► dict ──ModelSpec.from_hf──► ModelSpec
                                              ├─ MoEConfig.from_hf (the MoE block: H, E, k, I, Is, norm_topk_prob)
                                              └─ attention / rope / norm / layout fields (docs/models.md)

Every family (`model_type`: FAMILIES), the fields it reads and how the families differ: docs/models.md.
MoE layers are numbered 0..L_moe-1 in layer order; that number is the cache's `layer`
(key = moe_index * E + e). A quantization_config (fine-grained fp8, ModelOpt NVFP4, GPTQ and
compressed-tensors int4, gpt-oss's MXFP4) is read by moe.model.quantized.parse_quantization; any other
is refused naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe.model.config import DTYPES, MoEConfig
from moe.model.errors import CheckpointError
from moe.model.linear_attention import LinearAttentionShape
from moe.model.quantized import QUANT_CONFIG_KEYS, parse_quantization

UNQUANTIZED_ONLY = ("a tensor that config.json does not declare quantized must be a bfloat16 / float16 / "
                    "float32 tensor: declare the checkpoint's quantization_config (fp8, modelopt NVFP4, gptq "
                    "or compressed-tensors pack-quantized int4 load), or serve the model's unquantized original")


@dataclass(frozen=True)
class Family:
    """What differs between the supported families' decoder layers."""

    bias_key: str  # config key of the q/k/v (and, where o_bias, o) projection bias
    bias_default: bool
    o_bias: bool  # whether o_proj follows bias_key (else o_proj has no bias)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    linear_layers: bool = False  # Qwen3-Next: layer_types, output-gated partial-rotary attention, (1 + w) norms
    norm_topk_default: bool = False  # norm_topk_prob when config.json lacks it (transformers' default)
    oai: bool = False  # gpt-oss: attention sinks, sliding / full layers, YaRN rope, float32 norm multiply
    qk_norm_key: str = ""  # config key that turns qk_norm on (its default False), where the family has one
    partial_rotary_default: float = 0.0  # > 0: partial_rotary_factor's default (glm4_moe: 0.5)
    dense_first_key: str = ""  # config key of the number of leading dense layers (glm4_moe: first_k_dense_replace)
    olmo: bool = False  # OLMoE: q / k RMSNorm over the whole projection, clip_qkv


FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family(bias_key="qkv_bias", bias_default=True, o_bias=False, qk_norm=False),
    "qwen3_moe": Family(bias_key="attention_bias", bias_default=False, o_bias=True, qk_norm=True),
    "qwen3_next": Family(bias_key="attention_bias", bias_default=False, o_bias=True, qk_norm=True, linear_layers=True,
                         norm_topk_default=True),
    "gpt_oss": Family(bias_key="attention_bias", bias_default=True, o_bias=True, qk_norm=False, oai=True),
    "mixtral": Family(bias_key="attention_bias", bias_default=False, o_bias=False, qk_norm=False),
    "glm4_moe": Family(bias_key="attention_bias", bias_default=False, o_bias=False, qk_norm=False,
                       qk_norm_key="use_qk_norm", partial_rotary_default=0.5, dense_first_key="first_k_dense_replace"),
    "olmoe": Family(bias_key="attention_bias", bias_default=False, o_bias=True, qk_norm=False, olmo=True),
}
FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"  # layer_types values


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a checkpoint's shape that the loader and the engine need.

    model_type: a FAMILIES key. num_layers: decoder layers. hidden: H. vocab_size: V.
    num_heads / num_kv_heads: query / key-value heads (GQA groups = num_heads // num_kv_heads).
    head_dim: D. rope_theta: RoPE base. rms_eps: RMSNorm epsilon. tie_word_embeddings: lm_head is the
    embedding. qkv_bias / o_bias / qk_norm: attention variants. dense_intermediate: the dense MLP width.
    sparse: per layer, True for an MoE layer. moe: the MoE block (its dtype is the model's dtype, its
    expert_format the routed experts' storage). quant: how the checkpoint stores its quantized linears
    (moe.model.quantized.CheckpointQuant), None for an unquantized one.
    layer_types: per layer FULL, LINEAR or SLIDING (() = every layer FULL). rotary_dim: the rotated dims
    of a head (0 = head_dim). attn_gate: full attention's sigmoid output gate. norm_one_plus: RMSNorm
    scales by (1 + weight) in float32 (the loader stores that factor as a float32 weight). linear: the
    linear-attention layers' shape (None without any). norm_float32: RMSNorm multiplies its weight in
    float32 before the cast (gpt-oss; stored as a float32 weight). sinks: each attention head has a
    learned sink logit in its softmax (gpt-oss). sliding_window: the keys a SLIDING layer's query sees
    (itself and the window - 1 before it). rope_yarn: YaRN's (factor, beta_fast, beta_slow,
    original_max_position_embeddings, truncate, attention_factor) or () for the plain rope.
    qk_norm_full: q / k RMSNorm over the whole projection (q_norm [Hq * D], k_norm [Hkv * D]; OLMoE), in
    place of qk_norm's per head. clip_qkv: > 0 clamps q, k (after their norms) and v to +-clip_qkv (OLMoE's
    clip_qkv; 0 = none).
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
    quant: Any = None
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    attn_gate: bool = False
    norm_one_plus: bool = False
    linear: LinearAttentionShape | None = None
    norm_float32: bool = False
    sinks: bool = False
    sliding_window: int = 0
    rope_yarn: tuple[float, ...] = ()
    qk_norm_full: bool = False
    clip_qkv: float = 0.0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
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
        kinds = {FULL, SLIDING} if self.sliding_window or self.sinks else {FULL, LINEAR}  # gpt-oss's, Qwen3-Next's
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= kinds:
            raise CheckpointError(f"config.json: layer_types must list {' or '.join(map(repr, sorted(kinds)))} for "
                                  f"each of the {self.num_layers} layers, got {list(self.layer_types)}")
        if (LINEAR in self.layer_types) != (self.linear is not None):
            raise CheckpointError("ModelSpec.linear must be given exactly when a layer is linear_attention")
        if self.qk_norm and self.qk_norm_full:
            raise CheckpointError(
                "ModelSpec: qk_norm (per head) and qk_norm_full (whole projection) exclude each other"
            )
        if isinstance(self.clip_qkv, bool) or not isinstance(self.clip_qkv, (int, float)) \
                or not (math.isfinite(self.clip_qkv) and self.clip_qkv >= 0):
            raise CheckpointError(f"config.json: clip_qkv must be a finite number > 0 (or null), got {self.clip_qkv!r}")
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
            raise CheckpointError(f"config.json: partial_rotary_factor gives {self.rotary_dim} rotated dims of "
                                  f"head_dim={self.head_dim}; it must give an even number in 2..head_dim")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The decoder layers with softmax attention, full or sliding-window (those that hold a KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != LINEAR)

    def window(self, layer: int) -> int:
        """The keys a query of decoder layer `layer` sees at most: sliding_window for a SLIDING layer, else 0
        (all of its row's)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The decoder layers with linear attention (those that hold a recurrent state)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

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
    def from_hf(cls, config: Mapping[str, Any], *, dtype: str | None = None, copy_overlap: bool = False,
                expert_format: str | None = None) -> ModelSpec:
        """Read a config.json dict. dtype overrides the config's `dtype` / `torch_dtype`. expert_format:
        the routed experts' storage (--moe-expert-format: a name of expertcache.formats.format_names);
        None keeps the checkpoint's own (its quantization's format, else the model dtype's).

        Raises CheckpointError naming the unsupported model_type (and the supported ones), the
        missing key, the unsupported field (rope scaling, sliding window), a quantization_config
        field it cannot serve, an unsupported torch_dtype / dtype, or an expert format that is unknown
        or does not fit the experts' shape (naming --moe-expert-format).
        """
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointError(f"config.json model_type={model_type!r} is not supported; supported: "
                                  f"{sorted(FAMILIES)}")
        family = FAMILIES[model_type]
        quant = parse_quantization(config)
        if quant is not None and quant.method == "mxfp4" and not family.oai:
            raise CheckpointError(f"config.json quantization_config.quant_method='mxfp4' is gpt-oss's expert layout; "
                                  f"model_type={model_type!r} does not ship it (serve the unquantized checkpoint, "
                                  "with --moe-expert-format mxfp4 for MXFP4 experts)")
        config = _aliased(config)
        config.setdefault("norm_topk_prob", family.norm_topk_default)
        config["torch_dtype"] = _model_dtype(config, dtype)  # what MoEConfig.from_hf reads
        fmt = _expert_format(expert_format, quant)
        try:
            moe = MoEConfig.from_hf(config, copy_overlap=copy_overlap, expert_format=fmt)
        except KeyError as e:
            raise CheckpointError(str(e.args[0])) from None
        except ValueError as e:
            if "expert_format" not in str(e):
                raise
            raise CheckpointError(f"--moe-expert-format {fmt}: {e}") from None
        _check_attention_kind(config, family)
        num_layers, hidden = _require(config, "num_hidden_layers"), _require(config, "hidden_size")
        heads = _require(config, "num_attention_heads")
        bias = bool(config.get(family.bias_key, family.bias_default))
        head_dim = config.get("head_dim") or hidden // heads
        extra = _qwen3_next_fields(config, num_layers, head_dim) if family.linear_layers else {}
        if family.oai:
            extra = _oai_fields(config, num_layers)
        if model_type == "mixtral" and config.get("sliding_window"):
            extra = _sliding_everywhere(config, num_layers)
        if family.partial_rotary_default:
            extra = {"rotary_dim": _rotary_dim(config, head_dim, family.partial_rotary_default)}
        qk_norm = bool(config.get(family.qk_norm_key, False)) if family.qk_norm_key else family.qk_norm
        if family.olmo:
            extra = {"qk_norm_full": True, "clip_qkv": _clip_qkv(config)}
        sparse = (_dense_first(config, num_layers, family.dense_first_key) if family.dense_first_key
                  else _sparse_layers(config, num_layers))
        return cls(
            model_type=model_type, num_layers=num_layers, hidden=hidden,
            vocab_size=_require(config, "vocab_size"), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(_rope_theta(config)), rms_eps=float(_require(config, "rms_norm_eps")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias and family.o_bias, qk_norm=qk_norm,
            dense_intermediate=int(config.get("intermediate_size") or 0),
            sparse=sparse, moe=moe, quant=quant, **extra,
        )


def _clip_qkv(config: Mapping[str, Any]) -> float:
    """OLMoE's clip_qkv: null (the releases') -> 0 (no clamp); else a finite number > 0, or CheckpointError."""
    value = config.get("clip_qkv")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"config.json clip_qkv must be a finite number > 0 or null, got {value!r}")
    return float(value)


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of checkpoint directory `path` as a dict; ModelOpt's hf_quant_config.json beside it
    becomes its quantization_config (quant_method "modelopt") when config.json has none. Raises
    CheckpointError naming the file."""
    config = _read_json(Path(path) / "config.json", "pass a Hugging Face checkpoint directory")
    hf_quant = Path(path) / "hf_quant_config.json"
    if not any(config.get(k) for k in QUANT_CONFIG_KEYS) and hf_quant.is_file():
        config["quantization_config"] = {"quant_method": "modelopt", **_read_json(hf_quant, "")}
    return config


def _read_json(file: Path, hint: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist: {hint}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return data


def _expert_format(name: str | None, quant) -> str:
    """MoEConfig.expert_format: --moe-expert-format when given (a registered name), else the
    checkpoint's quantized format, else "" (the model dtype's)."""
    if name is None:
        return quant.format.key if quant is not None else ""
    from expertcache.formats import FormatError, get_format

    try:
        return get_format(name).key
    except FormatError as e:
        raise CheckpointError(str(e)) from None


def _aliased(config: Mapping[str, Any]) -> dict[str, Any]:
    """config with `num_experts` filled from `num_local_experts`: transformers >= 5 saves Qwen3-MoE's
    expert count under the latter (an attribute alias), released checkpoints under the former."""
    out = dict(config)
    if out.get("num_experts") is None and out.get("num_local_experts") is not None:
        out["num_experts"] = out["num_local_experts"]
    return out


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


def _check_attention_kind(config: Mapping[str, Any], family: Family) -> None:
    """Refuse rope scaling (but gpt-oss's YaRN) and Qwen's sliding windows, which the engine does not implement."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key) or {}
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default" and not (family.oai and kind == "yarn"):
            raise CheckpointError(f"config.json {key}.rope_type={kind!r}: only the default rope is served"
                                  f"{' (and yarn)' if family.oai else ''}")
    if config.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true: only full attention is served; "
                              "set it to false to serve within the window-free context")


def _oai_fields(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss's ModelSpec fields: layer_types (given, or sliding / full alternating from layer 0, as
    transformers decides), sliding_window, sinks, the float32 norm multiply and YaRN's parameters
    (transformers' defaults for absent ones: beta_fast 32, beta_slow 1, truncate true, the attention
    factor 0.1 ln(factor) + 1). Raises CheckpointError naming the key."""
    types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    window = config.get("sliding_window")
    if SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CheckpointError(f"config.json sliding_window must be an int >= 1 for the sliding_attention layers, "
                              f"got {window!r}")
    yarn: tuple[float, ...] = ()
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) == "yarn":
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        for key, value in (("factor", factor), ("original_max_position_embeddings", original)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise CheckpointError(f"config.json rope_parameters.{key} must be a number > 0 for yarn, got {value!r}")
        def mscale(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        attention = params.get("attention_factor")
        if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
            attention = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        elif attention is None:
            attention = mscale(factor)
        yarn = (float(factor), float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                float(original), float(bool(params.get("truncate", True))), float(attention))
    return {"layer_types": tuple(types), "sliding_window": int(window or 0) if SLIDING in types else 0,
            "sinks": True, "norm_float32": True, "rope_yarn": yarn}


def _qwen3_next_fields(config: Mapping[str, Any], num_layers: int, head_dim: int) -> dict[str, Any]:
    """qwen3_next's ModelSpec fields: layer_types (given, or every full_attention_interval-th layer
    full, default 4, as transformers decides), rotary_dim = int(head_dim * partial_rotary_factor)
    (default 0.25), the output gate, (1 + w) norms and the linear-attention shape (transformers'
    defaults for absent linear_* keys). Raises CheckpointError naming the key."""
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise CheckpointError(f"config.json full_attention_interval must be an int >= 1, got {interval!r}")
        types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    rotary = _rotary_dim(config, head_dim, 0.25)
    linear = None
    if LINEAR in types:
        try:
            linear = LinearAttentionShape(
                key_heads=int(config.get("linear_num_key_heads", 16)),
                value_heads=int(config.get("linear_num_value_heads", 32)),
                key_dim=int(config.get("linear_key_head_dim", 128)),
                value_dim=int(config.get("linear_value_head_dim", 128)),
                conv_kernel=int(config.get("linear_conv_kernel_dim", 4)), eps=float(_require(config, "rms_norm_eps")))
        except ValueError as e:
            raise CheckpointError(f"config.json: {e}") from None
    return {"layer_types": tuple(types), "rotary_dim": rotary, "attn_gate": True,
            "norm_one_plus": True, "linear": linear}


def _sliding_everywhere(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Mixtral with a `sliding_window`: every layer attends to the window's keys (itself and the
    window - 1 before it, as transformers masks). Raises CheckpointError naming the key."""
    window = config["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"config.json sliding_window must be an int >= 1 or null, got {window!r}")
    return {"layer_types": (SLIDING,) * num_layers, "sliding_window": window}


def _rotary_dim(config: Mapping[str, Any], head_dim: int, default: float) -> int:
    """int(head_dim * partial_rotary_factor) (read from rope_parameters or the top level, else `default`),
    as transformers rotates. Raises CheckpointError naming the key unless it is an even number in 2..head_dim."""
    params = config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", default))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"config.json partial_rotary_factor must be in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise CheckpointError(f"config.json: partial_rotary_factor gives {rotary} rotated dims of head_dim={head_dim}; "
                              "it must give an even number in 2..head_dim")
    return rotary


def _dense_first(config: Mapping[str, Any], num_layers: int, key: str) -> tuple[bool, ...]:
    """Per layer, True past the first config[key] (dense) layers, as transformers builds glm4_moe. Raises
    CheckpointError naming the key, or intermediate_size when dense layers need it."""
    first = config.get(key, 1)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < num_layers:
        raise CheckpointError(f"config.json {key} must be an int in [0, num_hidden_layers={num_layers}), got {first!r}")
    if first and not config.get("intermediate_size"):
        raise CheckpointError(f"config.json is missing 'intermediate_size', which the {key}={first} dense layers need")
    return tuple(i >= first for i in range(num_layers))


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
