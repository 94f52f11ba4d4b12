"""MoEConfig parsing and validation, routed plans, and the side-stream overlap decision table."""

import dataclasses

import pytest

from moe.model.config import COPY_OVERLAP_ENV, MoEConfig, copy_overlap_from_env
from moe.kernels.plan import (
    GEMV_BLOCK_I,
    GEMV_MAX_TOKENS,
    OverlapMode,
    RoutedPlan,
    decode_side_applies,
    make_routed_plan,
    plan_supports_aux_stream_overlap,
    select_overlap_mode,
)

QWEN2_MOE = {  # Qwen1.5-MoE-A2.7B
    "model_type": "qwen2_moe", "hidden_size": 2048, "num_experts": 60, "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE = {  # Qwen3-30B-A3B
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "torch_dtype": "bfloat16",
}
MIXTRAL = {  # Mixtral-8x7B
    "model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
    "intermediate_size": 14336, "torch_dtype": "bfloat16",
}
CFG = MoEConfig(hidden=2048, num_experts=60, top_k=4, expert_intermediate=1408, shared_intermediate=5632,
                copy_overlap=True)
SAFE = RoutedPlan("gemv-slots", 1, (4, 44), False, False)


# ---------------------------------------------------------------- config


def test_from_hf_qwen2_moe():
    cfg = MoEConfig.from_hf(QWEN2_MOE)
    assert cfg == MoEConfig(2048, 60, 4, 1408, 5632, False, "bfloat16", False)
    assert cfg.has_shared_expert


def test_from_hf_qwen3_moe_has_no_shared_expert():
    cfg = MoEConfig.from_hf(QWEN3_MOE)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_intermediate) == (128, 8, 768)
    assert cfg.shared_intermediate == 0 and not cfg.has_shared_expert and cfg.norm_topk_prob


def test_from_hf_mixtral_renormalises():
    cfg = MoEConfig.from_hf(MIXTRAL, copy_overlap=True)
    assert (cfg.hidden, cfg.num_experts, cfg.top_k, cfg.expert_intermediate) == (4096, 8, 2, 14336)
    assert cfg.norm_topk_prob and cfg.shared_intermediate == 0 and cfg.copy_overlap


def test_from_hf_infers_family_without_model_type():
    for src in (QWEN2_MOE, QWEN3_MOE, MIXTRAL):
        d = {k: v for k, v in src.items() if k != "model_type"}
        assert MoEConfig.from_hf(d) == MoEConfig.from_hf(src)


def test_from_hf_defaults():
    d = {k: v for k, v in QWEN2_MOE.items() if k not in ("norm_topk_prob", "torch_dtype")}
    cfg = MoEConfig.from_hf(d)
    assert cfg.norm_topk_prob is False and cfg.dtype == "bfloat16"
    assert MoEConfig.from_hf({**d, "dtype": "float16"}).dtype == "float16"


@pytest.mark.parametrize("src, key", [
    (QWEN2_MOE, "shared_expert_intermediate_size"), (QWEN2_MOE, "moe_intermediate_size"),
    (QWEN2_MOE, "hidden_size"), (QWEN3_MOE, "num_experts"), (QWEN3_MOE, "num_experts_per_tok"),
    (MIXTRAL, "num_local_experts"), (MIXTRAL, "intermediate_size"),
])
def test_from_hf_missing_key_is_named(src, key):
    with pytest.raises(KeyError, match=key):
        MoEConfig.from_hf({k: v for k, v in src.items() if k != key})


def test_from_hf_unknown_model_type():
    with pytest.raises(ValueError, match="model_type"):
        MoEConfig.from_hf({**QWEN3_MOE, "model_type": "llama"})


@pytest.mark.parametrize("field, value", [
    ("hidden", 0), ("num_experts", -1), ("top_k", 0), ("top_k", 61), ("expert_intermediate", 0),
    ("shared_intermediate", -1), ("norm_topk_prob", 1), ("copy_overlap", "yes"), ("pdl_chain", 1), ("dtype", "fp8"),
    ("hidden", 2.0), ("num_experts", True),
])
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **{field: value})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.top_k = 2


@pytest.mark.parametrize("value, default, expected", [
    (None, False, False), (None, True, True), ("", True, True), ("1", False, True), ("0", True, False),
    (" 1 ", False, True),
])
def test_copy_overlap_from_env(monkeypatch, value, default, expected):
    if value is None:
        monkeypatch.delenv(COPY_OVERLAP_ENV, raising=False)
    else:
        monkeypatch.setenv(COPY_OVERLAP_ENV, value)
    assert copy_overlap_from_env(default) is expected


@pytest.mark.parametrize("value", ["true", "2", "on", "yes", "-1"])
def test_copy_overlap_from_env_rejects(monkeypatch, value):
    monkeypatch.setenv(COPY_OVERLAP_ENV, value)
    with pytest.raises(ValueError, match=COPY_OVERLAP_ENV):
        copy_overlap_from_env()


# ---------------------------------------------------------------- plans


@pytest.mark.parametrize("field, value", [
    ("family", ""), ("family", None), ("tokens", 0), ("tokens", 1.0), ("grid", ()), ("grid", [4, 2]),
    ("grid", (4, 0)), ("grid", (1, 1, 1, 1)), ("grid", (True,)), ("needs_coresident_grid", 1),
    ("cooperative_launch", None),
])
def test_plan_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SAFE, **{field: value})


@pytest.mark.parametrize("coresident, cooperative, supported", [
    (False, False, True), (False, True, True), (True, True, True), (True, False, False),
])
def test_overlap_decision_table(coresident, cooperative, supported):
    plan = RoutedPlan("fused-barrier", 4, (132,), coresident, cooperative)
    assert plan_supports_aux_stream_overlap(plan) is supported


@pytest.mark.parametrize("tokens", range(1, GEMV_MAX_TOKENS + 1))
def test_make_plan_gemv_slots(tokens):
    plan = make_routed_plan(tokens, CFG)
    assert plan.family == "gemv-slots" and plan.tokens == tokens
    assert plan.grid == (tokens * CFG.top_k, -(-1408 // GEMV_BLOCK_I))  # (token, j) x gate rows tiles
    assert plan_supports_aux_stream_overlap(plan)


def test_make_plan_gemv_reads_repeated_slots_per_token():
    # gemv-slots does not deduplicate: 8 tokens x top-2 of 8 experts launch 16 (token, j) rows
    small = MoEConfig(hidden=64, num_experts=8, top_k=2, expert_intermediate=30)
    assert make_routed_plan(8, small).grid == (16, -(-30 // GEMV_BLOCK_I))


@pytest.mark.parametrize("tokens, num_sms", [(9, 132), (512, 132), (4096, 78), (9, 1)])
def test_make_plan_grouped_persistent(tokens, num_sms):
    plan = make_routed_plan(tokens, CFG, num_sms=num_sms)
    assert plan.family == "grouped-persistent" and len(plan.grid) == 1
    assert 1 <= plan.grid[0] <= num_sms and plan.num_ctas == plan.grid[0]
    assert plan_supports_aux_stream_overlap(plan)


@pytest.mark.parametrize("tokens, num_sms, name", [(0, 132, "tokens"), (-3, 132, "tokens"),
                                                   (1, 0, "num_sms"), (True, 132, "tokens")])
def test_make_plan_rejects(tokens, num_sms, name):
    with pytest.raises(ValueError, match=name):
        make_routed_plan(tokens, CFG, num_sms=num_sms)


# ---------------------------------------------------------------- decode_side_applies


def test_decode_side_applies_on_gpu_decode():
    for device in ("cuda", "cuda:1"):
        applies, reason = decode_side_applies("decode", device, 1, SAFE)
        assert applies and reason


@pytest.mark.parametrize("phase, device, tp, plan, hybrid, word", [
    ("prefill", "cuda", 1, SAFE, False, "prefill"),
    ("decode", "cpu", 1, SAFE, False, "cpu"),
    ("decode", "cuda", 1, SAFE, True, "hybrid"),
    ("decode", "cuda", 2, SAFE, False, "tp_size"),
    ("decode", "cuda", 1, RoutedPlan("fused-barrier", 1, (132,), True, False), False, "co-resident"),
])
def test_decode_side_declines(phase, device, tp, plan, hybrid, word):
    applies, reason = decode_side_applies(phase, device, tp, plan, hybrid=hybrid)
    assert not applies and word in reason


def test_decode_side_applies_with_cooperative_coresident_plan():
    plan = RoutedPlan("fused-barrier", 1, (132,), True, True)
    assert decode_side_applies("decode", "cuda", 1, plan)[0]


@pytest.mark.parametrize("args, name", [
    (("verify", "cuda", 1), "phase"), (("decode", "gpu", 1), "device"), (("decode", "cuda:x", 1), "device"),
    (("decode", "cuda", 0), "tp_size"), (("decode", "cuda", 1.0), "tp_size"),
])
def test_decode_side_unknown_values(args, name):
    with pytest.raises(ValueError, match=name):
        decode_side_applies(*args, SAFE)


def test_select_overlap_mode():
    assert select_overlap_mode(CFG, "decode", "cuda", 1, SAFE)[0] is OverlapMode.SIDE_STREAM
    off = dataclasses.replace(CFG, copy_overlap=False)
    mode, reason = select_overlap_mode(off, "decode", "cuda", 1, SAFE)
    assert mode is OverlapMode.NONE and COPY_OVERLAP_ENV in reason
    no_shared = dataclasses.replace(CFG, shared_intermediate=0)  # early hits are its side work
    assert select_overlap_mode(no_shared, "decode", "cuda", 1, SAFE)[0] is OverlapMode.SIDE_STREAM
    mode, reason = select_overlap_mode(dataclasses.replace(no_shared, early_hits=False), "decode", "cuda", 1, SAFE)
    assert mode is OverlapMode.NONE and "early_hits off" in reason
    assert select_overlap_mode(dataclasses.replace(no_shared, copy_overlap=False), "decode", "cuda", 1,
                               SAFE)[0] is OverlapMode.NONE
    assert select_overlap_mode(CFG, "prefill", "cuda", 1, SAFE)[0] is OverlapMode.NONE
