"""Quantized checkpoints and --moe-expert-format, on the CPU, against transformers on the decoded weights.

    transformers Qwen3MoeForCausalLM (tiny, random) ─save_pretrained─► base (float32)
        ─tests/moe/model/quant_layouts.write_layout─► fp8 / modelopt NVFP4 / GPTQ / compressed-tensors int4 copy
    load_checkpoint: the HostStore rows are the checkpoint's own bytes in the format's layout (gate's
    part over up's); load_model (CPU backend, a pool of top_k slots: every decode call evicts): greedy
    tokens identical to, and logits within 1e-4 of, transformers running a float32 checkpoint of the
    weights the layout decodes to (attention dequantized too, as the loader serves it);
    --moe-expert-format on a float (or another quantized) checkpoint: the store holds the format's
    round-to-nearest quantize of each of gate_proj, up_proj, down_proj; bad quantization metadata is
    refused naming the tensor or the field.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from expertcache.formats import GIB, INT4, bank_name, get_format
from moe.engine.loading import CheckpointError, load_model
from moe.model.checkpoint import load_checkpoint
from moe.testing.tiny_checkpoint import randomize
from tests.moe.families import assert_near, broken_copy
from tests.moe.model.quant_layouts import CONFIGS, FORMATS, write_layout

CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
              norm_topk_prob=True, max_position_embeddings=64)
METHODS = sorted(CONFIGS)
PROMPT = [5, 17, 3, 60, 22, 9]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny float32 Qwen3-MoE checkpoint directory."""
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()
    randomize(model, seed=7)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def base_shared(tmp_path_factory):
    """A tiny float32 Qwen2-MoE checkpoint directory: a gated shared expert in every MoE layer, layer 1 dense."""
    config = {**{k: v for k, v in CONFIG.items() if k != "head_dim"}, "num_hidden_layers": 3}
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**config, shared_expert_intermediate_size=48,
                                               mlp_only_layers=[1])).eval()
    randomize(model, seed=8)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def base_next(tmp_path_factory):
    """A tiny float32 Qwen3-Next checkpoint directory: linear / full / linear attention, a shared expert."""
    config = {**CONFIG, "num_hidden_layers": 3, "head_dim": 32, "partial_rotary_factor": 0.5,
              "shared_expert_intermediate_size": 48,
              "layer_types": ["linear_attention", "full_attention", "linear_attention"], "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config)).eval()
    randomize(model, seed=9)
    path = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def base_glm(tmp_path_factory):
    """A tiny float32 GLM-4.5 checkpoint directory: layer 0 dense, 6 experts in 3 groups, an ungated
    shared expert, q / k / v biases."""
    config = {k: v for k, v in CONFIG.items() if k != "num_experts"}
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**config, n_routed_experts=6, n_group=3, topk_group=2,
                                             n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
                                             routed_scaling_factor=1.5)).eval()
    randomize(model, seed=10)
    path = tmp_path_factory.mktemp("glm4_moe")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _quantized(base, tmp_path, method, asymmetric=False):
    """(dir in `method`'s layout, {weight name: decoded float32}, {weight name: parts written})."""
    out = {}

    def edit(tensors):
        out["decoded"], out["parts"] = write_layout(tensors, method, asymmetric=asymmetric)

    config = {**CONFIGS[method]}
    if asymmetric:
        config = json.loads(json.dumps(config).replace('"sym": true', '"sym": false')
                            .replace('"symmetric": true', '"symmetric": false'))
    path = broken_copy(base, tmp_path / method, edit, lambda c: c.update(quantization_config=config))
    return path, out["decoded"], out["parts"]


def _reference(base, tmp_path, decoded, cls=Qwen3MoeForCausalLM):
    """transformers on a float32 copy of `base` whose projections are `decoded`."""
    path = broken_copy(base, tmp_path / "decoded", lambda t: t.update(decoded))
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _generate(model, tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _check_engine(path, reference, **kw) -> None:
    """Greedy tokens identical and teacher-forced logits within 1e-4 of `reference`, the cache evicting."""
    engine = load_model(path, "cpu", num_slots=CONFIG["num_experts_per_tok"], max_seq_len=32, progress=False, **kw)
    want = _generate(reference, 6)
    assert engine.generate([PROMPT], max_new_tokens=6) == [want]
    seq = PROMPT + want
    engine = load_model(path, "cpu", num_slots=CONFIG["num_experts_per_tok"], max_seq_len=32, progress=False, **kw)
    got = [engine.prefill([PROMPT], all_logits=True)[0]] + [engine.decode_step([t]) for t in want[:-1]]
    with torch.no_grad():
        ref = reference(torch.tensor([seq[:-1]])).logits[0]
    assert_near(torch.cat(got), ref, rel=1e-4)
    assert int(engine.moe.cache.counters[:, 2].sum()) > 0


def _store_rows(store, fmt, key: int) -> dict[str, torch.Tensor]:
    h, i = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    names = [bank_name(m, p.suffix) for m, (o, n, st) in (("gate_up", (2 * i, h, 2)), ("down", (h, i, 1)))
             for p in fmt.layout(o, n, st)]
    return {n: store.tensor(n)[key] for n in names}


def _expected_rows(parts, fmt, layer: int, expert: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    gate, up, down = (parts[p + f"{m}_proj.weight"] for m in ("gate", "up", "down"))
    out = {bank_name("gate_up", k): torch.cat([gate[k], up[k]]) for k in gate}
    out.update({bank_name("down", k): v for k, v in down.items()})
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("method, asymmetric", [(m, False) for m in METHODS] + [("gptq", True),
                                                                               ("compressed-tensors", True)],
                         ids=METHODS + ["gptq-asym", "compressed-tensors-asym"])
def test_the_store_holds_the_checkpoints_bytes(base, tmp_path, method, asymmetric):
    path, _, parts = _quantized(base, tmp_path, method, asymmetric)
    weights = load_checkpoint(path, "cpu", pin=False, progress=False)
    fmt = FORMATS[method] if not asymmetric else INT4(scale_dtype=FORMATS[method].scale_dtype, zero_points=True)
    assert weights.spec.quant.method == method and weights.spec.moe.expert_format == fmt.key
    assert weights.store.banks == fmt.expert_banks(CONFIG["hidden_size"], CONFIG["moe_intermediate_size"])
    e = CONFIG["num_experts"]
    for layer, expert in ((0, 0), (1, 4)):
        got = _store_rows(weights.store, fmt, layer * e + expert)
        want = _expected_rows(parts, fmt, layer, expert)
        assert sorted(got) == sorted(want)
        for name in got:
            assert torch.equal(_bytes(got[name]), _bytes(want[name])), name
    q = weights.layers[1].attn.q  # attention is served dequantized, in the model dtype
    assert q.dtype == torch.float32


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_match_transformers_on_the_decoded_weights(base, tmp_path, method):
    path, decoded, _ = _quantized(base, tmp_path, method)
    _check_engine(path, _reference(base, tmp_path, decoded))


@pytest.mark.parametrize("name", ["nvfp4", "fp8", "int4", "mxfp4", "bf16"])
def test_moe_expert_format_quantizes_a_float_checkpoint(base, tmp_path, name):
    fmt = get_format(name)
    tensors = load_file(str(base / "model.safetensors"))
    experts = {n: t for n, t in tensors.items() if ".mlp.experts." in n and n.endswith("_proj.weight")}
    decoded = {n: fmt.dequantize(fmt.quantize(t)) for n, t in experts.items()}
    weights = load_checkpoint(base, "cpu", pin=False, progress=False, expert_format=name)
    assert weights.spec.moe.expert_format == name and weights.spec.quant is None
    parts = {n: fmt.quantize(t) for n, t in experts.items()}
    for name_ in _store_rows(weights.store, fmt, 7):
        assert torch.equal(_bytes(_store_rows(weights.store, fmt, 7)[name_]),
                           _bytes(_expected_rows(parts, fmt, 1, 1)[name_]))
    _check_engine(base, _reference(base, tmp_path, decoded), expert_format=name)


def test_a_quantized_checkpoint_served_in_another_format(base, tmp_path):
    path, decoded, _ = _quantized(base, tmp_path, "fp8")
    nvfp4 = get_format("nvfp4")
    weights = load_checkpoint(path, "cpu", pin=False, progress=False, expert_format="nvfp4")
    assert weights.spec.moe.expert_format == "nvfp4" and weights.spec.quant.method == "fp8"
    experts = {n: nvfp4.quantize(w) for n, w in decoded.items() if ".mlp.experts." in n}
    got, want = _store_rows(weights.store, nvfp4, 9), _expected_rows(experts, nvfp4, 1, 3)
    assert all(torch.equal(_bytes(got[n]), _bytes(want[n])) for n in want)


def test_modelopt_hf_quant_config_file_and_the_budget(base, tmp_path):
    """ModelOpt's hf_quant_config.json stands in for quantization_config; --moe-cache-gb prices nvfp4."""
    path, _, _ = _quantized(base, tmp_path, "modelopt")
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    per = get_format("nvfp4").expert_bytes(CONFIG["hidden_size"], CONFIG["moe_intermediate_size"])
    engine = load_model(path, "cpu", cache_gb=5 * per / GIB, progress=False)
    assert engine.moe.cache.geometry.num_slots == 5 and engine.spec.moe.expert_format == "nvfp4"


FIRST = "model.layers.0.mlp.experts.0.gate_proj"


def _edit(prefix: str, fn):
    def edit(tensors):
        for name in [n for n in tensors if n.startswith(prefix)]:
            fn(tensors, name)
    return edit


@pytest.mark.parametrize("method, edit_tensors, edit_config, pattern", [
    ("fp8", None, lambda q: q.update(weight_block_size=[64, 64]),
     r"quantization_config\.weight_block_size=\[64, 64\]: only fine-grained FP8 with 128 x 128"),
    ("fp8", lambda t: t.pop(FIRST + ".weight"), None, rf"tensor '{FIRST}\.weight' is missing"),
    ("fp8", lambda t: t.update({FIRST + ".weight_scale_inv": torch.ones(2, 1)}), None,
     rf"tensor '{FIRST}\.weight_scale_inv' has shape \[2, 1\], expected \[1, 1\]"),
    ("fp8", lambda t: t.update({FIRST + ".weight_scale_inv": torch.full((1, 1), float("nan"))}), None,
     rf"{FIRST}: fp8: parts\['s'\] holds NaN"),
    ("fp8", lambda t: t.update({FIRST + ".weight": t[FIRST + ".weight"].float()}), None,
     rf"tensor '{FIRST}\.weight' is stored as F32, expected F8_E4M3"),
    ("modelopt", None, lambda q: q.update(group_size=32), r"group_size=32: NVFP4 has one scale per 16"),
    ("modelopt", None, lambda q: q.update(quant_algo="FP8"), r"quant_algo='FP8': of ModelOpt's checkpoints only NVFP4"),
    ("modelopt", lambda t: t.update({FIRST + ".weight_scale_2": torch.zeros(())}), None,
     rf"{FIRST}: nvfp4: parts\['s2'\] \(weight_scale_2\) must be > 0"),
    ("gptq", None, lambda q: q.update(desc_act=True), r"desc_act=true: act-order GPTQ"),
    ("gptq", None, lambda q: q.update(bits=8), r"quantization_config\.bits=8: only bits=4"),
    ("gptq", None, lambda q: q.update(group_size=64), r"group_size=64: only group_size=128"),
    ("gptq", lambda t: t.update({FIRST + ".g_idx": torch.arange(64, dtype=torch.int32) % 2}), None,
     r"g_idx is not i // 128 in order"),
    ("gptq", lambda t: t.update({FIRST + ".qzeros": torch.zeros(1, 4, dtype=torch.int32) + 0x12345678}), None,
     r"zero points other than 8 in a checkpoint that says it is symmetric"),
    ("compressed-tensors", None, lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"),
     r"weights\.strategy='channel': only strategy='group'"),
    ("compressed-tensors", None, lambda q: q.update(format="nvfp4-pack-quantized"),
     r"format='nvfp4-pack-quantized': of compressed-tensors checkpoints only 'pack-quantized'"),
    ("compressed-tensors", lambda t: t.update({FIRST + ".weight_shape": torch.tensor([32, 32])}), None,
     r"weight_shape is \[32, 32\], expected \[32, 64\]"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_bad_quantization_metadata_is_refused_naming_it(base, tmp_path, method, edit_tensors, edit_config, pattern):
    path, _, _ = _quantized(base, tmp_path, method)
    if edit_config is not None:
        path = broken_copy(path, tmp_path / "config", None, lambda c: edit_config(c["quantization_config"]))
    if edit_tensors is not None:
        path = broken_copy(path, tmp_path / "tensors", edit_tensors)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(path, "cpu", num_slots=4, progress=False)


@pytest.mark.parametrize("bad", ["fp4", "float32", "int4-f16"])
def test_unknown_moe_expert_format_is_refused_by_flag(base, bad):
    with pytest.raises(CheckpointError, match=r"unknown expert format .* \(--moe-expert-format\)"):
        load_model(base, "cpu", num_slots=4, progress=False, expert_format=bad)


def test_a_quantized_shared_expert_stays_in_its_format(base_shared, tmp_path):
    """Qwen2-MoE in the fp8 layout: the shared expert is served as fp8 (one-slot SlotMatrix), the dense
    layer's MLP dequantized; greedy tokens identical to transformers on the decoded weights."""
    from moe.model.slot_matrix import SlotMatrix

    path, decoded, _ = _quantized(base_shared, tmp_path, "fp8")
    weights = load_checkpoint(path, "cpu", pin=False, progress=False)
    gate_up, down, gate_w = weights.layers[0].mlp.shared
    assert isinstance(gate_up, SlotMatrix) and gate_up.fmt.name == "fp8" and gate_up.stack == 2
    assert isinstance(down, SlotMatrix) and gate_w.dtype == torch.float32
    assert weights.layers[1].mlp.gate_up.dtype == torch.float32  # the dense layer, dequantized
    _check_engine(path, _reference(base_shared, tmp_path, decoded, Qwen2MoeForCausalLM))


def test_a_qwen3_next_fp8_checkpoint_as_the_family_ships_it(base_next, tmp_path):
    """Qwen3-Next in the fine-grained fp8 layout of its official FP8 release: every projection quantized,
    the linear-attention ones (in_proj_qkvz, in_proj_ba, out_proj) and the gated q_proj among them. The
    experts keep their fp8 bytes, the rest is dequantized; greedy tokens identical to transformers on the
    decoded weights, the cache evicting every decode call."""
    path, decoded, parts = _quantized(base_next, tmp_path, "fp8")
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.out_proj.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= set(parts)
    weights = load_checkpoint(path, "cpu", pin=False, progress=False)
    assert weights.spec.moe.expert_format == "fp8" and weights.spec.model_type == "qwen3_next"
    want = _expected_rows(parts, get_format("fp8"), 2, 5)
    got = _store_rows(weights.store, get_format("fp8"), 2 * CONFIG["num_experts"] + 5)
    assert all(torch.equal(_bytes(got[n]), _bytes(want[n])) for n in want)
    _check_engine(path, _reference(base_next, tmp_path, decoded, Qwen3NextForCausalLM))


def test_a_glm_fp8_checkpoint_as_the_family_ships_it(base_glm, tmp_path):
    """GLM-4.5 in the fine-grained fp8 layout of its FP8 releases (GLM-4.5-FP8, GLM-4.5-Air-FP8): the
    routed experts keep their fp8 bytes, the ungated shared experts stay fp8 (one-slot SlotMatrix), the
    router and its correction bias stay float; greedy tokens identical to transformers on the decoded
    weights, the cache evicting every decode call."""
    from moe.model.slot_matrix import SlotMatrix

    path, decoded, parts = _quantized(base_glm, tmp_path, "fp8")
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in parts
    assert not any(".mlp.gate." in n for n in parts)
    weights = load_checkpoint(path, "cpu", pin=False, progress=False)
    assert weights.spec.moe.expert_format == "fp8" and weights.spec.model_type == "glm4_moe"
    want = _expected_rows(parts, get_format("fp8"), 1, 4)
    got = _store_rows(weights.store, get_format("fp8"), 4)  # MoE layer 0 is decoder layer 1
    assert all(torch.equal(_bytes(got[n]), _bytes(want[n])) for n in want)
    gate_up, down, gate_w = weights.layers[1].mlp.shared
    assert isinstance(gate_up, SlotMatrix) and gate_up.fmt.name == "fp8" and gate_w is None
    assert weights.layers[1].mlp.score_bias.dtype == torch.float32
    _check_engine(path, _reference(base_glm, tmp_path, decoded, Glm4MoeForCausalLM))


@pytest.mark.cpu_only
def test_gpu_backend_on_the_cpu_serves_a_quantized_checkpoint(base_shared, tmp_path):
    """The GPU backend's kernels (Triton's interpreter) on a Qwen2-MoE NVFP4 layout, the routed and the
    shared experts in nvfp4: logits within 1e-4 of transformers on the decoded weights through evicting
    decode steps."""
    from moe.engine.backends import GpuMoE
    from moe.engine.engine import Engine

    path, decoded, _ = _quantized(base_shared, tmp_path, "modelopt")
    reference = _reference(base_shared, tmp_path, decoded, Qwen2MoeForCausalLM)
    weights = load_checkpoint(path, "cpu", pin=False, progress=False)
    engine = Engine(weights, GpuMoE(weights, CONFIG["num_experts_per_tok"], "lru"), max_seq_len=32)
    seq = PROMPT + [11, 2, 40]
    got = [engine.prefill([PROMPT], all_logits=True)[0]] + [engine.decode_step([t]) for t in seq[len(PROMPT):]]
    with torch.no_grad():
        ref = reference(torch.tensor([seq])).logits[0]
    assert_near(torch.cat(got), ref, rel=1e-4)
    assert int(engine.moe.slots.cache.counters[:, 2].sum()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8", "modelopt"])
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_gpu_quantized_checkpoint_with_a_shared_expert(base_shared, tmp_path, method, overlap):
    """On the GPU (CUDA graphs, the cache evicting every step), a Qwen2-MoE checkpoint in the fp8 / NVFP4
    layout, the routed and the shared experts in that format, the shared one on the side stream with the
    overlap on: greedy tokens identical to transformers on the decoded weights, logits within 1e-4."""
    path, decoded, _ = _quantized(base_shared, tmp_path, method)
    reference = _reference(base_shared, tmp_path, decoded, Qwen2MoeForCausalLM).to("cuda")
    k = CONFIG["num_experts_per_tok"]
    engine = load_model(path, "cuda", num_slots=k, max_seq_len=32, progress=False, copy_overlap=overlap)
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
        got = [engine.prefill([PROMPT])[0]]
        for t in want[:-1]:
            got.append(engine.decode_step([t])[0])
        ref = reference(torch.tensor([PROMPT + want[:-1]], device="cuda")).logits[0, len(PROMPT) - 1:]
    assert [int(g.argmax()) for g in got] == want
    assert_near(torch.stack(got), ref, rel=1e-4)
