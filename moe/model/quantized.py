"""Quantized checkpoints: config.json's quantization_config, and one linear's tensors as an expert format's parts.

    config.json quantization_config ──parse_quantization──► CheckpointQuant | None
    CheckpointQuant, TensorReader, module "model.layers.0.mlp.experts.3.up_proj", [out, in]
        ──read_parts──► {suffix: tensor}: the parts of CheckpointQuant.format (expertcache.formats), the
                        checkpoint's bytes repacked without changing a value; None when the module is
                        stored unquantized (its `.weight`, read as a float tensor instead)

The tensors each `quant_method` stores, the format they become and what is refused: docs/formats.md,
"Serving a format".

Repacking (exact): GPTQ `qweight` holds 8 values along the input per int32 (value 8r + j in bits 4j..4j+3)
and `qzeros` 8 zero points along the output, stored minus one (AutoGPTQ's format; `checkpoint_format:
gptq_v2` stores them as they are); compressed-tensors `weight_packed` is already our byte order (8
values along the input, the lower index in the lower bits, each value + 8). A symmetric checkpoint
whose zero points are all 8 gets no zero-point part. The loader keeps the routed experts (and a
quantized shared expert) in the format and dequantizes everything else (attention, dense MLPs) to the
model dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from expertcache.formats import FP8, INT4, MXFP4, NVFP4, ExpertFormat, FormatError
from moe.model.errors import CheckpointError

QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")  # the latter: older compressed-tensors

# The safetensors dtype each quantized tensor must have, and what it becomes.
F8 = ("F8_E4M3",)
GROUP = 128


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint stores its quantized linears.

    method: quant_method ("fp8", "modelopt", "gptq", "compressed-tensors"). format: the ExpertFormat its
    parts become (int4 variants by scale dtype and zero points). marker: the tensor suffix whose presence
    beside a module says the module is quantized (else it is a plain `.weight`). gptq_v1: GPTQ zero
    points stored minus one. source: where the configuration was read (its config.json key).
    """

    method: str
    format: ExpertFormat
    marker: str
    gptq_v1: bool = True
    source: str = "config.json quantization_config"


def parse_quantization(config: Mapping[str, Any]) -> CheckpointQuant | None:
    """The checkpoint's quantization from config.json (quantization_config / compression_config;
    moe.model.spec.read_config folds ModelOpt's hf_quant_config.json in as quantization_config); None
    for an unquantized checkpoint. Raises CheckpointError naming the field and value it cannot serve."""
    for key in QUANT_CONFIG_KEYS:
        quant = config.get(key)
        if quant:
            if not isinstance(quant, Mapping):
                raise CheckpointError(f"config.json {key} must be an object, got {type(quant).__name__}")
            return _parse(dict(quant), f"config.json {key}")
    return None


def _parse(quant: dict[str, Any], where: str) -> CheckpointQuant:
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise CheckpointError(f"{where}.weight_block_size={block!r}: only fine-grained FP8 with 128 x 128 "
                                  "blocks ([128, 128]) is served (per-tensor FP8 is not)")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{where}.fmt={quant.get('fmt')!r}: only e4m3 FP8 weights are served")
        return CheckpointQuant("fp8", FP8(), "weight_scale_inv", source=where)
    if method == "modelopt":
        inner = quant.get("quantization") if isinstance(quant.get("quantization"), Mapping) else quant
        algo = inner.get("quant_algo")
        if algo != "NVFP4":
            raise CheckpointError(f"{where} quant_algo={algo!r}: of ModelOpt's checkpoints only NVFP4 is served")
        if inner.get("group_size", 16) != 16:
            raise CheckpointError(f"{where} group_size={inner.get('group_size')!r}: NVFP4 has one scale per 16 values")
        return CheckpointQuant("modelopt", NVFP4(), "weight_scale", source=where)
    if method == "gptq":
        _require_value(quant, where, "bits", 4)
        _require_value(quant, where, "group_size", GROUP)
        if quant.get("desc_act"):
            raise CheckpointError(f"{where}.desc_act=true: act-order GPTQ (input rows permuted by g_idx) is not "
                                  "served; use a checkpoint quantized with desc_act=false")
        fmt = INT4(scale_dtype="float16", zero_points=not quant.get("sym", True))
        v1 = quant.get("checkpoint_format", "gptq") != "gptq_v2"
        return CheckpointQuant("gptq", fmt, "qweight", gptq_v1=v1, source=where)
    if method == "compressed-tensors":
        return _parse_compressed(quant, where)
    if method == "mxfp4":  # gpt-oss: the routed experts' `*_blocks` / `*_scales`; no other linear is quantized
        return CheckpointQuant("mxfp4", MXFP4(), "blocks", source=where)
    raise CheckpointError(f"{where}.quant_method={method!r} is not served; the loader reads fp8 (fine-grained "
                          "128 x 128), modelopt (NVFP4), gptq (4-bit, group 128), compressed-tensors "
                          "(pack-quantized int4, group 128) and mxfp4 (gpt-oss's experts) checkpoints")


def _require_value(quant: Mapping[str, Any], where: str, key: str, want: Any) -> None:
    if quant.get(key) != want:
        raise CheckpointError(f"{where}.{key}={quant.get(key)!r}: only {key}={want} is served")


def _parse_compressed(quant: dict[str, Any], where: str) -> CheckpointQuant:
    if quant.get("format") != "pack-quantized":
        raise CheckpointError(f"{where}.format={quant.get('format')!r}: of compressed-tensors checkpoints only "
                              "'pack-quantized' (int4 weights in int32 words) is served")
    groups = quant.get("config_groups") or {}
    schemes = [g.get("weights") or {} for g in groups.values() if isinstance(g, Mapping)]
    if len(schemes) != 1:
        raise CheckpointError(f"{where}.config_groups has {len(schemes)} weight schemes; one is served")
    w = schemes[0]
    sub = f"{where}.config_groups.*.weights"
    for key, want in (("num_bits", 4), ("type", "int"), ("strategy", "group"), ("group_size", GROUP)):
        if w.get(key) != want:
            raise CheckpointError(f"{sub}.{key}={w.get(key)!r}: only {key}={want!r} is served")
    if w.get("actorder"):
        raise CheckpointError(f"{sub}.actorder={w.get('actorder')!r}: activation-ordered groups are not served")
    fmt = INT4(zero_points=not w.get("symmetric", True))  # the scale dtype comes from the tensors
    return CheckpointQuant("compressed-tensors", fmt, "weight_packed", source=where)


def read_parts(quant: CheckpointQuant, reader, module: str, out: int, inn: int) -> dict[str, torch.Tensor] | None:
    """The parts of linear `module` [out, in] in quant.format (CPU tensors), or None when the module is
    stored as a plain `.weight`. Raises CheckpointError naming the tensor whose dtype, shape or value is
    not what the scheme says."""
    if not reader.has(f"{module}.{quant.marker}"):
        return None
    if quant.method == "fp8":
        q = reader.raw_quantized(f"{module}.weight", (out, inn), F8).view(torch.float8_e4m3fn)
        s = reader.raw_quantized(f"{module}.weight_scale_inv", (-(-out // 128), -(-inn // 128)), ("F32", "BF16"))
        return _checked(quant, module, out, inn, {"q": q, "s": s.float()})
    if quant.method == "modelopt":
        q = reader.raw_quantized(f"{module}.weight", (out, inn // 2), ("U8",))
        s = reader.raw_quantized(f"{module}.weight_scale", (out, inn // 16), F8).view(torch.float8_e4m3fn)
        s2 = reader.raw_quantized(f"{module}.weight_scale_2", None, ("F32",)).reshape(-1)
        if s2.numel() != 1:
            raise CheckpointError(f"{reader.path}: tensor {module}.weight_scale_2 must hold one float32, got "
                                  f"{s2.numel()}")
        return _checked(quant, module, out, inn, {"q": q, "s": s, "s2": s2})
    if quant.method == "gptq":
        return _checked(quant, module, out, inn, _gptq_parts(quant, reader, module, out, inn))
    return _checked(quant, module, out, inn, _compressed_parts(quant, reader, module, out, inn))


def _checked(quant: CheckpointQuant, module: str, out: int, inn: int, parts: dict) -> dict[str, torch.Tensor]:
    """The parts, checked against the format's layout and values (CheckpointError naming the module)."""
    parts = {k: v.contiguous() for k, v in parts.items()}
    try:
        quant.format.check(parts, out, inn)
    except FormatError as e:
        raise CheckpointError(f"{module}: {e}") from None
    return parts


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]: the 4-bit values, value 8r + j from bits 4j..4j + 3 of word r."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _pack(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2k] values 0..15 -> [..., k] bytes, element 2j in the low nibble."""
    return values[..., 0::2] | (values[..., 1::2] << 4)


def _gptq_parts(quant, reader, module: str, out: int, inn: int) -> dict[str, torch.Tensor]:
    groups = -(-inn // GROUP)
    qweight = reader.raw_quantized(f"{module}.qweight", (inn // 8, out), ("I32",))
    qzeros = reader.raw_quantized(f"{module}.qzeros", (groups, -(-out // 8)), ("I32",))
    scales = reader.raw_quantized(f"{module}.scales", (groups, out), ("F16",))
    if reader.has(f"{module}.g_idx"):
        g_idx = reader.raw_quantized(f"{module}.g_idx", (inn,), ("I32",))
        if not torch.equal(g_idx.long(), torch.arange(inn) // GROUP):
            raise CheckpointError(f"{reader.path}: tensor {module}.g_idx is not i // {GROUP} in order: an act-order "
                                  "(desc_act) GPTQ checkpoint, which is not served")
    values = _nibbles(qweight.t().contiguous())  # [out, in]: row o holds input values in order
    zeros = _nibbles(qzeros)[:, :out].t().contiguous().to(torch.int16)  # [out, groups]
    if quant.gptq_v1:
        zeros = zeros + 1
    if bool((zeros > 15).any()):
        raise CheckpointError(f"{reader.path}: tensor {module}.qzeros holds a zero point above 15 "
                              f"(checkpoint_format {'gptq' if quant.gptq_v1 else 'gptq_v2'})")
    parts = {"q": _pack(values), "s": scales.t().contiguous()}
    return _zero_points(quant, reader, module, parts, zeros.to(torch.uint8))


def _compressed_parts(quant, reader, module: str, out: int, inn: int) -> dict[str, torch.Tensor]:
    groups = -(-inn // GROUP)
    packed = reader.raw_quantized(f"{module}.weight_packed", (out, -(-inn // 8)), ("I32",))
    scale = reader.raw_quantized(f"{module}.weight_scale", (out, groups), ("BF16", "F16"))
    if reader.has(f"{module}.weight_shape"):
        shape = reader.raw_quantized(f"{module}.weight_shape", (2,), ("I64", "I32")).tolist()
        if shape != [out, inn]:
            raise CheckpointError(f"{reader.path}: tensor {module}.weight_shape is {shape}, expected {[out, inn]}")
    q = packed.view(torch.uint8)[:, :inn // 2]  # little-endian words: already 2 values a byte, low first
    zeros = torch.full((out, groups), 8, dtype=torch.uint8)
    name = f"{module}.weight_zero_point"
    if reader.has(name):
        zp = reader.raw_quantized(name, None, ("I32", "I8", "U8"))
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out // 8), groups):  # packed along the output
            zeros = _nibbles(zp.t().contiguous())[:, :out].t().contiguous()
        elif tuple(zp.shape) == (out, groups):
            zeros = (zp.to(torch.int16) + (8 if zp.dtype == torch.int8 else 0)).to(torch.uint8)
        else:
            raise CheckpointError(f"{reader.path}: tensor {name} has shape {list(zp.shape)}, expected "
                                  f"{[-(-out // 8), groups]} int32 or {[out, groups]}")
    fmt = INT4(scale_dtype="float16" if scale.dtype == torch.float16 else "bfloat16",
               zero_points=quant.format.zero_points)
    if fmt != quant.format:
        raise CheckpointError(f"{reader.path}: tensor {module}.weight_scale is {scale.dtype}; the checkpoint's "
                              f"other scales are {quant.format.scale_dtype}")
    return _zero_points(quant, reader, module, {"q": q, "s": scale}, zeros)


def _zero_points(quant, reader, module: str, parts: dict, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Add the zero-point part where the format has one; else every zero point must be 8."""
    if quant.format.zero_points:
        return {**parts, "z": zeros}
    if not bool((zeros == 8).all()):
        raise CheckpointError(f"{reader.path}: {module} has zero points other than 8 in a checkpoint that says "
                              "it is symmetric (sym / symmetric true)")
    return parts
