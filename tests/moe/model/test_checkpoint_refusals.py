"""Quantized layouts the loader does not serve are refused by name, never read as if they were bf16, on the CPU
(the ones it serves: tests/moe/model/test_checkpoint_quantized.py).

    transformers Qwen3MoeForCausalLM (tiny, random) ─save_pretrained─► base dir (float32, loads)
        ─rewrite──► a copy in a quantized layout: tensors (FP8 blocks + weight_scale_inv, GPTQ, W8A8,
                    modelopt NVFP4, bitsandbytes NF4, gpt-oss MXFP4) without a quantization_config, and / or
                    config.json (a quantization_config.quant_method or format not served, torch_dtype)
        ─moe.engine.loading.load_model─► CheckpointError naming quant_method, the tensor or the config key

Model: 2 layers, 4 experts top-2, q/k norms, head_dim 16. "Projections" are every 2-D `*_proj.weight`
(attention q/k/v/o and the experts' gate/up/down), what the official FP8 releases quantize; the router
(`mlp.gate.weight`), the norms and the embedding stay unquantized there too.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe.engine.loading import CheckpointError, load_model
from tests.moe.families import broken_copy

CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=64)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK = 128
FIRST = r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"  # the first projection the loader reads
UNQUANTIZED = r"a tensor that config.json does not declare quantized must be a bfloat16 / float16 / float32 tensor"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny unquantized Qwen3-MoE checkpoint directory (float32)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval().save_pretrained(path, safe_serialization=True)
    return path


def _load(path, **kw):
    return load_model(path, "cpu", num_slots=4, max_seq_len=16, progress=False, **kw)


def _rewrite(base, tmp_path, edit_tensors=None, edit_config=None):
    """A copy of `base` with its tensors (name -> tensor dict) and / or config.json edited in place."""
    return broken_copy(base, tmp_path, edit_tensors, edit_config)


def _projections(tensors) -> list[str]:
    return [n for n, t in tensors.items() if n.endswith("_proj.weight") and t.dim() == 2]


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], weight_scale_inv float32 [ceil(out/128), ceil(in/128)]) with
    w ~= e4m3 * scale_inv per 128 x 128 block, as the official fine-grained FP8 checkpoints store it."""
    rows, cols = math.ceil(w.shape[0] / BLOCK), math.ceil(w.shape[1] / BLOCK)
    pad = torch.zeros(rows * BLOCK, cols * BLOCK)
    pad[:w.shape[0], :w.shape[1]] = w
    blocks = pad.view(rows, BLOCK, cols, BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).view_as(pad)[:w.shape[0], :w.shape[1]]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.float().contiguous()


def fp8_block_layout(tensors) -> None:
    for name in _projections(tensors):
        tensors[name], tensors[name + "_scale_inv"] = _fp8_blocks(tensors[name])


def fp8_without_scales(tensors) -> None:
    for name in _projections(tensors):
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)


def gptq_layout(tensors) -> None:  # 4-bit, group 32: qweight [in/8, out], qzeros [in/32, out/8], scales, g_idx
    for name in _projections(tensors):
        out, inp = tensors.pop(name).shape
        m = name.removesuffix(".weight")
        tensors[m + ".qweight"] = torch.zeros(inp // 8, out, dtype=torch.int32)
        tensors[m + ".qzeros"] = torch.zeros(inp // 32, out // 8, dtype=torch.int32)
        tensors[m + ".scales"] = torch.ones(inp // 32, out, dtype=torch.float16)
        tensors[m + ".g_idx"] = torch.arange(inp, dtype=torch.int32) // 32


def w8a8_layout(tensors) -> None:  # compressed-tensors int8: weight int8 [out, in], weight_scale [out, 1]
    for name in _projections(tensors):
        w = tensors[name]
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        tensors[name] = (w / scale).round().to(torch.int8)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale


def int8_without_scales(tensors) -> None:
    for name in _projections(tensors):
        tensors[name] = tensors[name].round().to(torch.int8)


def nvfp4_layout(tensors) -> None:  # modelopt: weight uint8 [out, in/2], weight_scale e4m3 [out, in/16], ...
    for name in _projections(tensors):
        out, inp = tensors[name].shape
        m = name.removesuffix(".weight")
        tensors[name] = torch.zeros(out, inp // 2, dtype=torch.uint8)
        tensors[m + ".weight_scale"] = torch.ones(out, inp // 16).to(torch.float8_e4m3fn)
        tensors[m + ".weight_scale_2"] = torch.ones(())
        tensors[m + ".input_scale"] = torch.ones(())


def bnb_nf4_layout(tensors) -> None:  # bitsandbytes: weight uint8 [out*in/2, 1] + weight.absmax / quant_map / ...
    for name in _projections(tensors):
        out, inp = tensors[name].shape
        tensors[name] = torch.zeros(out * inp // 2, 1, dtype=torch.uint8)
        tensors[name + ".absmax"] = torch.ones(out * inp // 64)
        tensors[name + ".quant_map"] = torch.linspace(-1, 1, 16)
        tensors[name + ".quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)


def mxfp4_experts(tensors) -> None:  # gpt-oss: fused experts as <weight>_blocks / <weight>_scales, no weights
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        for name in [n for n in tensors if n.startswith(p)]:
            del tensors[name]
        for proj in ("gate_up_proj", "down_proj"):
            tensors[p + proj + "_blocks"] = torch.zeros(4, 64, 2, 16, dtype=torch.uint8)
            tensors[p + proj + "_scales"] = torch.zeros(4, 64, 2, dtype=torch.uint8)


def test_unquantized_checkpoint_loads(base, tmp_path):
    seq = [3, 5, 7, 11]
    ref = _load(base).prefill([seq], all_logits=True)[0]
    null = _rewrite(base, tmp_path, edit_config=lambda c: c.update(quantization_config=None))
    assert torch.equal(_load(null).prefill([seq], all_logits=True)[0], ref)
    assert torch.isfinite(ref).all()


@pytest.mark.parametrize("edit, pattern", [
    (fp8_block_layout, rf"tensor '{FIRST}\.weight_scale_inv' beside '{FIRST}\.weight' is a quantization scale"),
    (fp8_without_scales, rf"tensor '{FIRST}\.weight' is stored as F8_E4M3, a quantized or packed weight"),
    (gptq_layout, rf"tensor '{FIRST}\.(g_idx|qweight|qzeros|scales)' beside '{FIRST}\.weight'"),
    (w8a8_layout, rf"tensor '{FIRST}\.weight_scale' beside '{FIRST}\.weight'"),
    (int8_without_scales, rf"tensor '{FIRST}\.weight' is stored as I8"),
    (nvfp4_layout, rf"tensor '{FIRST}\.(input_scale|weight_scale|weight_scale_2)' beside '{FIRST}\.weight'"),
    (bnb_nf4_layout, rf"tensor '{FIRST}\.weight\.(absmax|quant_map|quant_state\.bitsandbytes__nf4)' beside"),
    (mxfp4_experts, rf"tensor '{FIRST}\.weight' is missing and the checkpoint holds quantization tensors "
                    r"instead \(e\.g\. 'model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales)'\)"),
], ids=["fp8-blocks", "fp8-bare", "gptq", "w8a8-int8", "int8-bare", "modelopt-nvfp4", "bnb-nf4", "gpt-oss-mxfp4"])
def test_quantized_tensors_without_quantization_config_are_refused_naming_the_tensor(base, tmp_path, edit, pattern):
    quantized = _rewrite(base, tmp_path, edit)
    assert "quantization_config" not in json.loads((quantized / "config.json").read_text())
    with pytest.raises(CheckpointError, match=rf"{pattern}.*{UNQUANTIZED}"):
        _load(quantized)


SERVED = (
    r"the loader reads fp8 \(fine-grained 128 x 128\), modelopt \(NVFP4\), gptq .*, compressed-tensors .* and mxfp4"
)


@pytest.mark.parametrize(
    "key, quant, pattern",
    [
        (
            "quantization_config",
            {"quant_method": "awq", "bits": 4, "version": "gemm"},
            rf"quant_method='awq' is not served; {SERVED}",
        ),
        (
            "quantization_config",
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
            r"format='nvfp4-pack-quantized': of compressed-tensors checkpoints only 'pack-quantized'",
        ),
        ("quantization_config", {"quant_method": "modelopt", "quant_algo": "FP8"}, r"quant_algo='FP8'"),
        (
            "quantization_config",
            {"quant_method": "mxfp4"},
            r"quant_method='mxfp4' is gpt-oss's expert layout; "
            r"model_type='qwen3_moe' does not ship it",
        ),
        ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'"),
        ("quantization_config", {"load_in_8bit": True}, r"quant_method=None is not served"),
        ("quantization_config", {"quant_method": "fp8", "weight_block_size": None}, r"weight_block_size=None"),
        ("compression_config", {"quant_method": "compressed-tensors"}, r"\.format=None"),
    ],
)
def test_quantization_config_not_served_is_refused_naming_the_field(base, tmp_path, key, quant, pattern):
    # the tensors are unquantized: config.json alone decides
    quantized = _rewrite(base, tmp_path, edit_config=lambda c: c.update({key: quant}))
    with pytest.raises(CheckpointError, match=rf"config\.json {key}.*{pattern}"):
        _load(quantized)


@pytest.mark.parametrize("key, value", [("dtype", "float8_e4m3fn"), ("torch_dtype", "int8"), ("dtype", "auto")])
def test_unsupported_config_dtype_is_refused_naming_the_key(base, tmp_path, key, value):
    odd = _rewrite(base, tmp_path, edit_config=lambda c: c.update({key: value}))
    with pytest.raises(CheckpointError, match=rf"config\.json {key}='{value}' is not a dtype the loader serves "
                                              r"\(float32, float16, bfloat16\).*set .* or pass --dtype"):
        _load(odd)
    engine = _load(odd, dtype="float32")  # the override names the dtype; the float32 tensors still load
    assert engine.weights.embed.dtype == torch.float32
