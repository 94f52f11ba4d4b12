"""Quantized checkpoint layouts written from a float checkpoint's tensors, for the loader's tests.

    safetensors tensors (float) ──write_layout(method)──► the same tensors in that method's layout
        (every 2-D `*_proj.weight`: attention q/k/v/o and the experts' gate/up/down, as the official
        quantized releases do; router, norms, embedding stay float) + the config.json quantization_config
        + per projection the float32 weights the layout decodes to (for transformers' reference run)

Each layout is built from the expert format's own quantize (expertcache.formats), then laid out as
the checkpoint stores it: fp8 `weight` + `weight_scale_inv`; ModelOpt NVFP4 `weight` + `weight_scale`
+ `weight_scale_2` + `input_scale`; GPTQ `qweight` [in/8, out] + `qzeros` (zero points minus one,
8 along the output in an int32) + `scales` [groups, out] + `g_idx`; compressed-tensors
`weight_packed` [out, in/8] + `weight_scale` + `weight_shape` (+ `weight_zero_point` packed along the
output when asymmetric). Zero points of an asymmetric layout are drawn at random (0..15), the values
kept: the decode then differs from the float weights, which the reference takes from the decode.
"""

from __future__ import annotations

import torch

from expertcache.formats import FP8, INT4, NVFP4

CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"]},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                 "exclude_modules": ["lm_head"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
}
FORMATS = {"fp8": FP8(), "modelopt": NVFP4(), "gptq": INT4(scale_dtype="float16"), "compressed-tensors": INT4()}


def projections(tensors) -> list[str]:
    """The 2-D linear weights a quantized release stores quantized: every `*_proj.weight` (and Qwen3-Next's
    `in_proj_qkvz` / `in_proj_ba`)."""
    return sorted(n for n, t in tensors.items() if (n.endswith("_proj.weight") or ".in_proj_" in n) and t.dim() == 2)


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8n] values 0..15 -> int32 [..., n], value 8r + j in bits 4j..4j + 3 of word r."""
    v = values.reshape(*values.shape[:-1], -1, 8).to(torch.int64)
    word = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] bytes -> [out, in] values, element 2j from the low nibble."""
    return torch.stack((q & 15, q >> 4), dim=-1).flatten(-2)


def write_layout(tensors: dict, method: str, *, asymmetric: bool = False,
                 seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Rewrite every projection of `tensors` (in place) in `method`'s layout. Returns ({module weight name:
    float32 [out, in] the layout decodes to}, {module weight name: the format's parts written})."""
    gen = torch.Generator().manual_seed(seed)
    decoded, written = {}, {}
    for name in projections(tensors):
        w = tensors.pop(name).float()
        m = name.removesuffix(".weight")
        fmt = INT4(scale_dtype=FORMATS[method].scale_dtype, zero_points=True) if asymmetric else FORMATS[method]
        parts = fmt.quantize(w)
        if asymmetric:  # 1..15: GPTQ's zero - 1 has no room for a zero point of 0
            parts["z"] = torch.randint(1, 16, parts["z"].shape, dtype=torch.uint8, generator=gen)
        decoded[name], written[name] = fmt.dequantize(parts), parts
        tensors.update({f"{m}.{k}": v for k, v in _layout(method, parts, *w.shape).items()})
    return decoded, written


def _layout(method: str, parts: dict, out: int, inn: int) -> dict[str, torch.Tensor]:
    if method == "fp8":
        return {"weight": parts["q"], "weight_scale_inv": parts["s"]}
    if method == "modelopt":
        return {"weight": parts["q"], "weight_scale": parts["s"], "weight_scale_2": parts["s2"].reshape(()),
                "input_scale": torch.tensor(1.0)}
    groups = parts["s"].shape[1]
    zeros = parts.get("z", torch.full((out, groups), 8, dtype=torch.uint8))
    if method == "gptq":
        return {"qweight": pack_words(unpack(parts["q"])).t().contiguous(),  # 8 along the input: [in/8, out]
                "qzeros": pack_words((zeros - 1).t().contiguous()),  # AutoGPTQ stores zero - 1: [groups, out/8]
                "scales": parts["s"].t().contiguous(), "g_idx": torch.arange(inn, dtype=torch.int32) // 128}
    out_tensors = {"weight_packed": parts["q"].contiguous().view(torch.int32), "weight_scale": parts["s"],
                   "weight_shape": torch.tensor([out, inn], dtype=torch.int64)}
    if "z" in parts:
        out_tensors["weight_zero_point"] = pack_words(zeros.t().contiguous()).t().contiguous()
    return out_tensors
