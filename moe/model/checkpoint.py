"""Checkpoint loading: a Hugging Face directory -> ModelWeights (device tensors) + HostStore (routed experts).

    <dir>/config.json ──ModelSpec.from_hf──► spec
    <dir>/model.safetensors.index.json | <dir>/*.safetensors ──TensorReader──► name -> file
        per decoder layer l (tqdm):
            attention, norms, router, shared expert, dense MLP ──► torch tensors on `device` (model dtype)
            routed experts e of MoE layer m ──► HostStore rows key = m * E + e:
                 "gate_up" [2I, H] = gate_proj [I, H] stacked over up_proj [I, H];  "down" [H, I]
        embed_tokens, norm, lm_head (the embedding when tie_word_embeddings) ──► device

Routed experts are read in either layout transformers writes: per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]; what
`save_pretrained` writes) or fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]; transformers >= 5's in-memory layout); gpt-oss's experts are `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up in alternating columns and `down_proj` [E, I, H] (or, as released, their
MXFP4 `*_blocks` / `*_scales`), with biases (_load_oai_experts). Qwen3-Next's linear-attention layers are
`linear_attn.*` (_load_linear_attention). Every tensor's shape is checked against the spec before it
is converted; a missing or misshapen tensor raises CheckpointError naming it.

Expert formats: the HostStore holds the routed experts in spec.moe.expert_format (expertcache.formats;
its banks `gate_up.q`, `gate_up.s`, ... or `gate_up` / `down` for a dense one). A quantized checkpoint
(spec.quant, moe.model.quantized: fp8, ModelOpt NVFP4, GPTQ, compressed-tensors int4) whose format is
the one asked for keeps its experts' bytes (repacked, no value changed); another format is reached by
the checkpoint format's dequantize (float32) and the target's round-to-nearest quantize, gate_proj and
up_proj each alone (the stack of gate_up). A shared expert that the checkpoint quantized stays in the
checkpoint's format (one-slot SlotMatrix on the device, whatever --moe-expert-format says). Every other
weight (attention, norms, router, shared expert gate, dense MLPs, embedding, lm_head) is served in the
model dtype: a quantized one is dequantized on load.

Without a quantization_config every tensor read must be stored as BF16 / F16 / F32 (or F64), and no
quantization tensor may sit beside it. A quantized layout is then refused naming its tensor: float8 /
int8 / uint8 / int32 weights, FP8 block scales (`<module>.weight_scale_inv`), modelopt / compressed-tensors
scales and packed weights (`weight_scale`, `weight_scale_2`, `input_scale`, `weight_packed`, ...), GPTQ /
AWQ (`qweight`, `qzeros`, `scales`, `g_idx`), bitsandbytes (`<weight>.absmax`, `.SCB`, `.quant_state.*`)
and gpt-oss MXFP4 experts (`<weight>_blocks`, `<weight>_scales`).
Legend: H = hidden, E = routed experts, I / Is = routed / shared expert width, Id = dense MLP width,
Hq / Hkv = query / kv heads, D = head_dim, V = vocab.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from expertcache.formats import ExpertFormat, FormatError, bank_name
from expertcache.pool import HostStore
from moe.model.config import EXPERT_BIAS_BANKS
from moe.model.errors import CheckpointError
from moe.model.linear_attention import LinearAttentionWeights
from moe.model.quantized import read_parts
from moe.model.reference import SharedWeights
from moe.model.slot_matrix import SlotMatrix
from moe.model.spec import LINEAR, UNQUANTIZED_ONLY, ModelSpec, read_config

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# safetensors dtypes converted faithfully to the model dtype (F64 rounds as F32 does); anything else
# (F8_E4M3, F8_E5M2, I8, U8, I32, ...) is a quantized or packed weight.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# `<module>.<name>`: FP8 block scales, modelopt / compressed-tensors scales and packed weights, GPTQ / AWQ
MODULE_QUANT_NAMES = frozenset({
    "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_zero_point",
    "weight_global_scale", "input_global_scale", "weight_shape", "qweight", "qzeros", "scales", "g_idx"})
BNB_QUANT = re.compile(r"(.+\.weight)\.(absmax|quant_map|SCB|nested_absmax|nested_quant_map|quant_state\..+)")


@dataclass
class AttentionWeights:
    """q [Hq*D, H], k / v [Hkv*D, H], o [H, Hq*D]; biases [rows] or None; q_norm / k_norm [D] or None (float32 1 + w
    for Qwen3-Next, moe.engine.attention.rms_norm; OLMoE's [Hq*D] / [Hkv*D]); gate [Hq*D, H] (and gate_bias):
    Qwen3-Next's output gate, the gate half of each head's rows of its q_proj (which interleaves per head D query rows
    and D gate rows), or None.

    q, k, v (and the gate) are stored as one matrix, qkv [(Hq + 2 Hkv (+ Hq)) * D, H] (and their biases as
    qkv_bias), with q, k, v, gate (q_bias, ...) views of its rows: the fused decode step projects a token
    with one GEMM of them all, no copy of the weights. qkv_rows: the rows of each, in order."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [Hq] gpt-oss's per-head sink logits, model dtype
    qkv: torch.Tensor = field(init=False, repr=False)
    qkv_bias: torch.Tensor | None = field(init=False, repr=False)
    qkv_rows: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        mats = [self.q, self.k, self.v] + ([] if self.gate is None else [self.gate])
        biases = [self.q_bias, self.k_bias, self.v_bias] + ([] if self.gate is None else [self.gate_bias])
        self.qkv_rows = tuple(m.shape[0] for m in mats)
        self.qkv = torch.cat(mats)
        parts = self.qkv.split(self.qkv_rows)
        self.q, self.k, self.v = parts[:3]
        self.gate = parts[3] if self.gate is not None else None
        if any(b is None for b in biases) != all(b is None for b in biases):
            raise ValueError("AttentionWeights: give the q, k, v (and gate) biases together, or none")
        self.qkv_bias = None if self.q_bias is None else torch.cat(biases)
        if self.qkv_bias is not None:
            parts = self.qkv_bias.split(self.qkv_rows)
            self.q_bias, self.k_bias, self.v_bias = parts[:3]
            self.gate_bias = parts[3] if self.gate is not None else None


@dataclass
class MoEWeights:
    """One MoE block's device weights: router [E, H], shared (gate_up [2Is, H], down [H, Is], gate_w
    [1, H], or None for GLM-4.5's ungated shared experts) or None, router_bias [E] (gpt-oss) or None,
    score_bias [E] float32 (GLM-4.5's e_score_correction_bias) or None. Its routed experts live in the HostStore at
    keys index * E .. index * E + E - 1 (with their biases, where the block has them: EXPERT_BIAS_BANKS)."""

    index: int
    router: torch.Tensor
    shared: SharedWeights | None
    router_bias: torch.Tensor | None = None
    score_bias: torch.Tensor | None = None


@dataclass
class DenseWeights:
    """A dense MLP (mlp_only / non-sparse layer): gate_up [2Id, H], down [H, Id]."""

    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H] (float32 1 + w for Qwen3-Next)
    post_norm: torch.Tensor  # [H]
    attn: AttentionWeights | LinearAttentionWeights  # the token mixer: full or (Qwen3-Next) linear attention
    mlp: MoEWeights | DenseWeights


@dataclass
class ModelWeights:
    """A loaded checkpoint: spec, device tensors, and the routed experts in `store`."""

    spec: ModelSpec
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    layers: list[LayerWeights]
    store: HostStore  # the banks of spec.moe.expert_format ("gate_up" [L_moe*E, 2I, H], "down" [L_moe*E, H, I] in bf16)
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]


class TensorReader:
    """Checked reads from a checkpoint's safetensors files: name -> tensor of the expected shape.
    quant: the checkpoint's quantization (ModelSpec.quant); a quantized linear's `.weight` is then read
    through its parts and dequantized."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, quant=None) -> None:
        self.path, self.dtype, self.device, self.quant = path, dtype, device, quant
        self.files = _tensor_files(path)
        self._handles = {f: safe_open(str(f), framework="pt") for f in set(self.files.values())}
        self._quant: dict[str, list[str]] = {}  # weight name -> the quantization tensors beside it
        for name in sorted(self.files) if quant is None else ():
            weight = _quantized_weight(name)
            if weight is not None:
                self._quant.setdefault(weight, []).append(name)

    def has(self, name: str) -> bool:
        return name in self.files

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The CPU tensor `name` in the file's dtype (BF16 / F16 / F32 / F64). Raises CheckpointError
        naming a quantization tensor beside it, a missing tensor (and the files searched), a quantized
        dtype, or a wrong shape (expected and got)."""
        self._refuse_quantized_or_missing(name)
        handle = self._handles[self.files[name]]
        stored = handle.get_slice(name)
        if stored.get_dtype() not in FLOAT_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} is stored as {stored.get_dtype()}, a quantized "
                                  f"or packed weight (the loader reads {'/'.join(FLOAT_DTYPES)}); {UNQUANTIZED_ONLY}")
        got = tuple(stored.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(got)}, expected "
                                  f"{list(shape)} from config.json")
        return handle.get_tensor(name)

    def _refuse_quantized_or_missing(self, name: str) -> None:
        """Raise when a quantization tensor sits beside `name`, or `name` is missing (naming the nearest
        quantization tensor when the checkpoint holds any: a quantized layout that renamed it)."""
        if name in self._quant:
            raise CheckpointError(f"{self.path}: tensor {self._quant[name][0]!r} beside {name!r} is a "
                                  f"quantization scale or packed weight; {UNQUANTIZED_ONLY}")
        if name in self.files:
            return
        if self._quant:
            near = max((q for qs in self._quant.values() for q in qs),
                       key=lambda q: len(os.path.commonprefix([q, name])))
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing and the checkpoint holds "
                                  f"quantization tensors instead (e.g. {near!r}); {UNQUANTIZED_ONLY}")
        where = sorted({f.name for f in self.files.values()})
        raise CheckpointError(f"{self.path}: tensor {name!r} is missing (searched {where}); the "
                              "checkpoint does not match its config.json")

    def raw_quantized(self, name: str, shape: tuple[int, ...] | None, dtypes: tuple[str, ...]) -> torch.Tensor:
        """The CPU tensor `name` of a quantized layout, stored as one of the safetensors `dtypes` ("F8_E4M3",
        "U8", "I32", ...) and of `shape` (None: any). Raises CheckpointError naming the tensor."""
        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing; {self.quant.source} says the module is "
                                  f"quantized ({self.quant.method})")
        stored = self._handles[self.files[name]].get_slice(name)
        if stored.get_dtype() not in dtypes:
            raise CheckpointError(f"{self.path}: tensor {name!r} is stored as {stored.get_dtype()}, expected "
                                  f"{' or '.join(dtypes)} ({self.quant.method})")
        if shape is not None and tuple(stored.get_shape()) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(stored.get_shape())}, expected "
                                  f"{list(shape)} ({self.quant.method}, from config.json)")
        return self._handles[self.files[name]].get_tensor(name)

    def parts(self, module: str, out: int, inn: int) -> dict[str, torch.Tensor] | None:
        """Linear `module` [out, in] as the parts of the checkpoint's format, or None when it is stored
        as a plain float `.weight` (or the checkpoint is unquantized)."""
        return None if self.quant is None else read_parts(self.quant, self, module, out, inn)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """`name` converted to the model dtype on the device (a quantized linear's weight dequantized)."""
        if len(shape) == 2 and name.endswith(".weight"):
            parts = self.parts(name.removesuffix(".weight"), *shape)
            if parts is not None:
                w = self.quant.format.dequantize(parts)
                return w.to(device=self.device, dtype=self.dtype).contiguous()
        return self.raw(name, shape).to(device=self.device, dtype=self.dtype).contiguous()

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return self.get(name, shape) if present else None


def _quantized_weight(name: str) -> str | None:
    """The weight that quantization tensor `name` belongs to, or None when `name` is not one."""
    module, _, last = name.rpartition(".")
    if last in MODULE_QUANT_NAMES:  # <module>.weight_scale_inv, <module>.qweight, ...
        return f"{module}.weight"
    if last.endswith(("_blocks", "_scales")):  # gpt-oss: experts.gate_up_proj_blocks / _scales
        return name.rsplit("_", 1)[0]
    bnb = BNB_QUANT.fullmatch(name)  # bitsandbytes: <module>.weight.absmax, .SCB, .quant_state.*
    return bnb.group(1) if bnb else None


def _tensor_files(path: Path) -> dict[str, Path]:
    """name -> safetensors file, from model.safetensors.index.json or else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file (nor model.safetensors.index.json)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update(dict.fromkeys(handle.keys(), f))
    return out


def write_experts(store: HostStore, fmt: ExpertFormat, name: str, weights: torch.Tensor, first: int,
                  stack: int) -> None:
    """Quantize weights [n, out, in] (each expert `stack` stacked matrices, each quantized alone) into
    store rows first .. first + n - 1 of matrix `name`'s banks in `fmt`. Cost: one quantize per matrix."""
    n, out, inn = weights.shape
    parts = fmt.quantize(weights.reshape(n * out, inn), stack=n * stack)
    for p in fmt.layout(out, inn, stack):
        store.tensor(bank_name(name, p.suffix))[first:first + n].copy_(parts[p.suffix].reshape(n, *p.shape))


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", *, dtype: str | None = None,
                    pin: bool | None = None, progress: bool = True, copy_overlap: bool = False,
                    expert_format: str | None = None, keys=None) -> ModelWeights:
    """Load a qwen2_moe / qwen3_moe / qwen3_next / gpt_oss checkpoint directory, unquantized or quantized
    (module docstring).

    device: where everything but the routed experts goes. dtype: "float32" / "float16" / "bfloat16"
    (default: the config's). expert_format: the routed experts' storage (--moe-expert-format, one of
    expertcache.formats.format_names; default the checkpoint's own). pin: pin the HostStore (default: when
    CUDA is available). progress: a tqdm bar over the layers. keys: the routed experts to keep, as global
    keys (MoE layer * E + expert, distinct) in the store's row order (a rank's: expertcache.ranks.rank_keys);
    each MoE layer's experts are read into a one-layer buffer and the kept ones copied out. Default: all.
    Cost: reads every tensor once, plus a dequantize / quantize per expert matrix when the format changes;
    host memory = the kept routed experts (and one layer's).
    Raises CheckpointError naming the config key or field, file or tensor that is missing or wrong
    (before any tensor is read for config.json's fields), or --moe-expert-format.
    """
    path, device = Path(path), torch.device(device)
    spec = ModelSpec.from_hf(read_config(path), dtype=dtype, copy_overlap=copy_overlap, expert_format=expert_format)
    reader = TensorReader(path, TORCH_DTYPES[spec.dtype], device, spec.quant)
    kept = None if keys is None else _kept_rows(keys, spec.num_moe_layers, spec.moe.num_experts)
    banks = spec.moe.expert_banks()
    store = HostStore.empty(banks, spec.num_moe_layers * spec.moe.num_experts if keys is None else len(keys), pin=pin)
    layer_rows = None if keys is None else HostStore.empty(banks, spec.moe.num_experts, pin=False)
    h, v = spec.hidden, spec.vocab_size
    embed = reader.get("model.embed_tokens.weight", (v, h))
    layers = []
    for i in tqdm(range(spec.num_layers), desc=f"loading {path.name}", disable=not progress):
        if kept is None or not spec.sparse[i]:
            layers.append(_load_layer(reader, spec, store, i))
            continue
        layers.append(_load_layer(reader, spec, layer_rows, i, rows_at=0))
        experts, rows = kept[spec.moe_index(i)]
        for b in banks:
            store.tensor(b.name)[rows] = layer_rows.tensor(b.name)[experts]
    lm_head = embed if spec.tie_word_embeddings else reader.get("lm_head.weight", (v, h))
    return ModelWeights(spec, embed, _norm(reader, spec, "model.norm.weight", h), lm_head, layers, store, device)


def _kept_rows(keys, layers: int, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer m, (its kept experts, their rows in the store) from global `keys`. Raises
    CheckpointError naming keys when they are not distinct integers in [0, layers * experts)."""
    k = torch.as_tensor(keys, dtype=torch.int64)
    bad = k.dim() != 1 or k.numel() == 0 or bool((k < 0).any()) or bool((k >= layers * experts).any())
    if bad or k.unique().numel() != k.numel():
        raise CheckpointError(f"keys must be distinct expert keys in [0, {layers} x {experts}), got {len(k)} of them")
    rows = torch.arange(k.numel())
    return [(k[k // experts == m] % experts, rows[k // experts == m]) for m in range(layers)]


def _norm(reader: TensorReader, spec: ModelSpec, name: str, n: int) -> torch.Tensor:
    """An RMSNorm weight [n]: in the model dtype, or for a (1 + w) norm (Qwen3-Next) the float32 1 + w of
    the model-dtype w, the factor transformers computes each call (moe.engine.attention.rms_norm)."""
    w = reader.get(name, (n,))
    if spec.norm_one_plus:
        return 1.0 + w.float()
    return w.float() if spec.norm_float32 else w


def _load_layer(reader: TensorReader, spec: ModelSpec, store: HostStore, layer: int,
                rows_at: int | None = None) -> LayerWeights:
    """Layer `layer`; an MoE layer's routed experts into store rows rows_at .. rows_at + E - 1 (default
    its MoE index * E)."""
    p, h = f"model.layers.{layer}.", spec.hidden
    if spec.sparse[layer]:
        mlp = _load_moe(reader, spec, store, layer, rows_at)
    else:
        i = spec.dense_intermediate
        gate_up = torch.cat([reader.get(p + "mlp.gate_proj.weight", (i, h)),
                             reader.get(p + "mlp.up_proj.weight", (i, h))])
        mlp = DenseWeights(gate_up, reader.get(p + "mlp.down_proj.weight", (h, i)))
    mixer = (_load_linear_attention(reader, spec, p + "linear_attn.") if spec.layer_types[layer] == LINEAR
             else _load_attention(reader, spec, p + "self_attn."))
    return LayerWeights(_norm(reader, spec, p + "input_layernorm.weight", h),
                        _norm(reader, spec, p + "post_attention_layernorm.weight", h), mixer, mlp)


def _load_attention(reader: TensorReader, spec: ModelSpec, p: str) -> AttentionWeights:
    h, d = spec.hidden, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    bias, norm = spec.qkv_bias, spec.qk_norm or spec.qk_norm_full
    q_norm_rows, k_norm_rows = (q_rows, kv_rows) if spec.qk_norm_full else (d, d)  # OLMoE's: the whole projection
    gated = 2 if spec.attn_gate else 1  # Qwen3-Next's q_proj: per head D query rows, then D gate rows
    q = reader.get(p + "q_proj.weight", (gated * q_rows, h))
    q_bias = reader.optional(p + "q_proj.bias", (gated * q_rows,), bias)
    gate = gate_bias = None
    if spec.attn_gate:
        q, gate = q.view(spec.num_heads, 2, d, h).unbind(1)
        q, gate = q.reshape(q_rows, h), gate.reshape(q_rows, h)
        if q_bias is not None:
            q_bias, gate_bias = (b.reshape(q_rows) for b in q_bias.view(spec.num_heads, 2, d).unbind(1))
    return AttentionWeights(
        q=q, k=reader.get(p + "k_proj.weight", (kv_rows, h)),
        v=reader.get(p + "v_proj.weight", (kv_rows, h)), o=reader.get(p + "o_proj.weight", (h, q_rows)),
        q_bias=q_bias,
        k_bias=reader.optional(p + "k_proj.bias", (kv_rows,), bias),
        v_bias=reader.optional(p + "v_proj.bias", (kv_rows,), bias),
        o_bias=reader.optional(p + "o_proj.bias", (h,), spec.o_bias),
        q_norm=_norm(reader, spec, p + "q_norm.weight", q_norm_rows) if norm else None,
        k_norm=_norm(reader, spec, p + "k_norm.weight", k_norm_rows) if norm else None,
        gate=gate, gate_bias=gate_bias,
        sinks=reader.get(p + "sinks", (spec.num_heads,)) if spec.sinks else None,
    )


def _load_linear_attention(reader: TensorReader, spec: ModelSpec, p: str) -> LinearAttentionWeights:
    """Qwen3-Next's Gated DeltaNet layer (linear_attn.*) in the model dtype."""
    s, h = spec.linear, spec.hidden
    kd, vd = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    return LinearAttentionWeights(
        in_proj_qkvz=reader.get(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, h)),
        in_proj_ba=reader.get(p + "in_proj_ba.weight", (2 * s.value_heads, h)),
        conv_w=reader.get(p + "conv1d.weight", (s.channels, 1, s.conv_kernel))[:, 0].contiguous(),
        a_log=reader.get(p + "A_log", (s.value_heads,)), dt_bias=reader.get(p + "dt_bias", (s.value_heads,)),
        norm_w=reader.get(p + "norm.weight", (s.value_dim,)), out_proj=reader.get(p + "out_proj.weight", (h, vd)))


def _load_moe(reader: TensorReader, spec: ModelSpec, store: HostStore, layer: int,
              rows_at: int | None = None) -> MoEWeights:
    cfg, p = spec.moe, f"model.layers.{layer}.mlp."
    at = spec.moe_index(layer) * cfg.num_experts if rows_at is None else rows_at  # its experts' first store row
    if spec.model_type == "mixtral" and not reader.has(p + "gate.weight"):  # the release's (and save_pretrained's)
        q = f"model.layers.{layer}.block_sparse_moe."                        # names: experts.{e}.w1 / w3 / w2
        _load_experts(reader, spec, store, q + "experts.", at, names=("w1", "w3", "w2"))
        return MoEWeights(spec.moe_index(layer), reader.get(q + "gate.weight", (cfg.num_experts, cfg.hidden)), None)
    h, e, s = cfg.hidden, cfg.num_experts, cfg.shared_intermediate
    index = spec.moe_index(layer)
    if cfg.expert_bias:  # gpt-oss: mlp.router.{weight,bias}, interleaved gate / up columns, expert biases
        _load_oai_experts(reader, spec, store, p + "experts.", at)
        return MoEWeights(index, reader.get(p + "router.weight", (e, h)), None, reader.get(p + "router.bias", (e,)))
    _load_experts(reader, spec, store, p + "experts.", at)
    shared = None
    if cfg.has_shared_expert:  # Qwen: shared_expert.* and its gate; GLM-4.5: shared_experts.*, ungated
        q = p + ("shared_expert." if cfg.shared_gate else "shared_experts.")
        gate_up, down = _shared_quantized(reader, q, h, s)
        if gate_up is None:
            gate_up = torch.cat([reader.get(q + "gate_proj.weight", (s, h)), reader.get(q + "up_proj.weight", (s, h))])
            down = reader.get(q + "down_proj.weight", (h, s))
        shared = (gate_up, down, reader.get(p + "shared_expert_gate.weight", (1, h)) if cfg.shared_gate else None)
    score_bias = None  # GLM-4.5's e_score_correction_bias: float32, as transformers keeps it
    if cfg.score_bias:
        score_bias = reader.raw(p + "gate.e_score_correction_bias", (e,)).float().to(reader.device)
    return MoEWeights(index, reader.get(p + "gate.weight", (e, h)), shared, score_bias=score_bias)


def _shared_quantized(reader: TensorReader, p: str, h: int, s: int) -> tuple[SlotMatrix | None, SlotMatrix | None]:
    """The shared expert in the checkpoint's format, as one-slot SlotMatrix on the reader's device (gate_up:
    gate_proj's parts over up_proj's), when the checkpoint quantized all three of its linears; else
    (None, None) and it is read in the model dtype."""
    gate, up = reader.parts(p + "gate_proj", s, h), reader.parts(p + "up_proj", s, h)
    down = reader.parts(p + "down_proj", h, s)
    if gate is None or up is None or down is None:
        return None, None
    fmt = reader.quant.format
    stacked = tuple(torch.cat([gate[q.suffix], up[q.suffix]])[None].to(reader.device) for q in fmt.layout(s, h))
    return (SlotMatrix(fmt, stacked, 2 * s, h, 2),
            SlotMatrix(fmt, tuple(down[q.suffix][None].to(reader.device) for q in fmt.layout(h, s)), h, s))


def _load_experts(reader: TensorReader, spec: ModelSpec, store: HostStore, p: str, base: int,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Fill HostStore rows base .. base + E - 1 from the per-expert layout (each expert's gate, up and down
    linears under `names`: Mixtral's release calls them w1, w3, w2) or the fused one."""
    cfg, fmt = spec.moe, spec.moe.format
    h, e, i = cfg.hidden, cfg.num_experts, cfg.expert_intermediate
    if reader.has(p + "gate_up_proj") and not reader.has(p + f"0.{names[0]}.weight"):
        gate_up = reader.raw(p + "gate_up_proj", (e, 2 * i, h))
        down = reader.raw(p + "down_proj", (e, h, i))
        if fmt.dense:
            store.tensor("gate_up")[base:base + e] = gate_up
            store.tensor("down")[base:base + e] = down
        else:
            write_experts(store, fmt, "gate_up", gate_up, base, 2)
            write_experts(store, fmt, "down", down, base, 1)
        return
    for x in range(e):
        q = f"{p}{x}."
        gate = _expert_parts(reader, fmt, q + names[0], i, h)
        up = _expert_parts(reader, fmt, q + names[1], i, h)
        down = _expert_parts(reader, fmt, q + names[2], h, i)
        for part in fmt.layout(i, h):  # gate_up's part: gate's over up's (its stack of 2)
            row = store.tensor(bank_name("gate_up", part.suffix))[base + x]
            row[:part.shape[0]], row[part.shape[0]:] = gate[part.suffix], up[part.suffix]
        for part in fmt.layout(h, i):
            store.tensor(bank_name("down", part.suffix))[base + x] = down[part.suffix]


def _load_oai_experts(reader: TensorReader, spec: ModelSpec, store: HostStore, p: str, base: int) -> None:
    """gpt-oss's experts into HostStore rows base ..: gate_up_proj [E, H, 2I] holds gate in its even
    columns and up in its odd ones, down_proj is [E, I, H] (both the transpose of this project's [out, in]);
    the biases gate_up_proj_bias [E, 2I] (interleaved alike) and down_proj_bias [E, H] go to the bias
    banks in the model dtype. The experts are stored in spec.moe's format (a cast for a dense one)."""
    cfg, fmt = spec.moe, spec.moe.format
    h, e, i = cfg.hidden, cfg.num_experts, cfg.expert_intermediate
    dtype = TORCH_DTYPES[cfg.dtype]
    if reader.quant is not None and reader.quant.method == "mxfp4":
        for name, out, inn, stack in (("gate_up", 2 * i, h, 2), ("down", h, i, 1)):
            _write_mxfp4_experts(reader, store, fmt, p + f"{name}_proj", name, out, inn, stack, base, e)
    else:
        _write_oai_dense(reader, store, fmt, p, base, e, h, i)
    bias = reader.raw(p + "gate_up_proj_bias", (e, 2 * i)).to(dtype)
    store.tensor(EXPERT_BIAS_BANKS[0])[base:base + e] = torch.cat([bias[:, ::2], bias[:, 1::2]], dim=-1)
    store.tensor(EXPERT_BIAS_BANKS[1])[base:base + e] = reader.raw(p + "down_proj_bias", (e, h)).to(dtype)


def _write_mxfp4_experts(reader: TensorReader, store: HostStore, fmt: ExpertFormat, name: str, bank: str,
                         out: int, inn: int, stack: int, base: int, e: int) -> None:
    """gpt-oss's MXFP4 experts `name`_blocks [E, out, in/32, 16] / `name`_scales [E, out, in/32] (gate_up's
    rows interleave gate and up: de-interleaved, a permutation of whole rows) into the store: their own
    bytes when the store is mxfp4, else decoded (float32, exact) and quantized to `fmt`."""
    q = reader.raw_quantized(name + "_blocks", (e, out, inn // 32, 16), ("U8",)).reshape(e, out, inn // 2)
    s = reader.raw_quantized(name + "_scales", (e, out, inn // 32), ("U8",))
    if stack == 2:
        q, s = (torch.cat([t[:, ::2], t[:, 1::2]], dim=1) for t in (q, s))
    mx = reader.quant.format
    if fmt.key == mx.key:
        parts = {"q": q, "s": s}
        try:
            mx.check({k: v.reshape(e * out, -1) for k, v in parts.items()}, e * out, inn)  # every expert's codes
        except FormatError as err:
            raise CheckpointError(f"{reader.path}: {name}: {err}") from None
        for part in fmt.layout(out, inn, stack):
            store.tensor(bank_name(bank, part.suffix))[base:base + e] = parts[part.suffix].reshape(e, *part.shape)
        return
    w = torch.stack([mx.dequantize({"q": q[x], "s": s[x]}) for x in range(e)])  # [E, out, in] float32
    if fmt.dense:
        store.tensor(bank)[base:base + e] = w
    else:
        write_experts(store, fmt, bank, w, base, stack)


def _write_oai_dense(reader: TensorReader, store: HostStore, fmt: ExpertFormat, p: str, base: int, e: int, h: int,
                     i: int) -> None:
    """gpt-oss's unquantized experts (gate_up_proj [E, H, 2I], down_proj [E, I, H]) into the store."""
    gu = reader.raw(p + "gate_up_proj", (e, h, 2 * i))
    gate_up = torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2)  # [E, 2I, H]
    down = reader.raw(p + "down_proj", (e, i, h)).transpose(1, 2)  # [E, H, I]
    if fmt.dense:
        store.tensor("gate_up")[base:base + e] = gate_up
        store.tensor("down")[base:base + e] = down
    else:
        write_experts(store, fmt, "gate_up", gate_up.contiguous(), base, 2)
        write_experts(store, fmt, "down", down.contiguous(), base, 1)


def _expert_parts(reader: TensorReader, fmt: ExpertFormat, module: str, out: int, inn: int) -> dict[str, torch.Tensor]:
    """Linear `module` [out, in] of an expert as the parts of `fmt`: the checkpoint's own bytes when it
    stores the module in `fmt`, else its float32 dequantize (or its float weight) quantized to `fmt`."""
    parts = reader.parts(module, out, inn)
    if parts is not None and reader.quant.format.key == fmt.key:
        return parts
    w = reader.raw(module + ".weight", (out, inn)) if parts is None else reader.quant.format.dequantize(parts)
    if fmt.dense:  # a cast (round to nearest even), as the store's dtype
        return {"": w.to(TORCH_DTYPES[fmt.dtype])}
    return fmt.quantize(w)
