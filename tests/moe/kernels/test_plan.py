"""MoEConfig parsing and validation, routed plans, the side-stream decision table, and the launch
plan's resolver against a table of the layer's launch choices before the plan existed."""

import dataclasses

import pytest

from moe.kernels.plan import (
    DEFAULT_MMA_TILES,
    GEMV_BLOCK_I,
    GEMV_MAX_TOKENS,
    LaunchPlan,
    OverlapMode,
    RoutedPlan,
    decode_side_applies,
    make_routed_plan,
    plan_supports_aux_stream_overlap,
    resolve_launch_plan,
)
from moe.kernels.tiles import RoutedTiles, RouterTiles
from moe.model.config import COPY_OVERLAP_ENV, ROUTED_MMA_ENV, MoEConfig, copy_overlap_from_env, routed_mma_from_env

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
OLMOE = {  # OLMoE-1B-7B-0924
    "model_type": "olmoe", "hidden_size": 2048, "num_experts": 64, "num_experts_per_tok": 8,
    "intermediate_size": 1024, "norm_topk_prob": False, "torch_dtype": "bfloat16",
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


def test_from_hf_olmoe_reads_intermediate_size_and_keeps_norm_topk_prob():
    cfg = MoEConfig.from_hf(OLMOE)
    assert (cfg.hidden, cfg.num_experts, cfg.top_k, cfg.expert_intermediate) == (2048, 64, 8, 1024)
    assert not cfg.norm_topk_prob and cfg.shared_intermediate == 0 and cfg.scoring == "softmax"
    assert MoEConfig.from_hf({**OLMOE, "norm_topk_prob": True}).norm_topk_prob
    with pytest.raises(KeyError, match="'intermediate_size'"):
        MoEConfig.from_hf({k: v for k, v in OLMOE.items() if k != "intermediate_size"})


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
    ("shared_intermediate", -1), ("norm_topk_prob", 1), ("copy_overlap", "yes"), ("dtype", "fp8"),
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


def test_make_plan_uses_the_tiles():
    tiles = RoutedTiles(block_i=16)
    assert make_routed_plan(3, CFG, tiles).grid == (3 * CFG.top_k, 1408 // 16)


@pytest.mark.parametrize("tokens", [0, -3, True, GEMV_MAX_TOKENS + 1, 512, 1.0])
def test_make_plan_rejects_non_decode_sizes(tokens):
    with pytest.raises(ValueError, match="tokens"):
        make_routed_plan(tokens, CFG)


# ---------------------------------------------------------------- decode_side_applies


def test_decode_side_applies_on_gpu_decode():
    for device in ("cuda", "cuda:1"):
        applies, reason = decode_side_applies("decode", device, 1, SAFE)
        assert applies and reason


@pytest.mark.parametrize("phase, device, tp, plan, hybrid, word", [
    ("prefill", "cuda", 1, SAFE, False, "prefill"),
    ("decode", "cpu", 1, SAFE, False, "cpu"),
    ("decode", "cuda", 2, SAFE, False, "tp_size"),
    ("decode", "cuda", 1, RoutedPlan("fused-barrier", 1, (132,), True, False), False, "co-resident"),
])
def test_decode_side_declines(phase, device, tp, plan, hybrid, word):
    applies, reason = decode_side_applies(phase, device, tp, plan, hybrid=hybrid)
    assert not applies and word in reason


def test_decode_side_applies_in_hybrid_decode_and_says_so():
    applies, reason = decode_side_applies("decode", "cuda", 1, SAFE, hybrid=True)
    assert applies and "CPU workers" in reason and "after the join" in reason
    for args in (("prefill", "cuda", 1, SAFE), ("decode", "cpu", 1, SAFE), ("decode", "cuda", 2, SAFE)):
        assert decode_side_applies(*args, hybrid=True) == decode_side_applies(*args), "hybrid changes no answer"


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




# ---------------------------------------------------------------- the launch plan's resolver


def _resolve(cfg=CFG, *, slots=100, keys=1000, device="cuda:0", sms=132, overlap=True, **kw) -> LaunchPlan:
    return resolve_launch_plan(cfg, num_slots=slots, num_keys=keys, device=device, num_sms=sms,
                               copy_overlap=overlap, **kw)


def _old_layer(cfg: MoEConfig, slots: int, keys: int, device: str, sms: int, overlap: bool) -> dict:
    """The launch choices of the layer before the plan existed, transcribed from MoELayer.refresh,
    MoELayer._launch_configs and plan.select_overlap_mode at commit 5101031 with every default:
    early_hits=None, front_release=None, pdl_chain=True, hits_first=False, RouterConfig() and
    RoutedConfig() (pdl on; programmatic launches take effect on CUDA only)."""
    early_hits = slots < keys  # early_hits=None
    side = (cfg.has_shared_expert or early_hits) and overlap and device != "cpu"
    front = not (side and early_hits)  # front_release=None: on unless the layer runs early hits
    k, e, h = cfg.top_k, cfg.num_experts, cfg.hidden
    def pow2(n):
        return 1 << (n - 1).bit_length()

    def fits(tokens):  # RouterConfig.early_weights=None: where block_e * H fits
        block_e = min(2 if tokens <= 4 else 4, pow2(e))
        chunk = min(1024, pow2(h))
        return block_e * -(-h // chunk) * chunk <= 16384

    return {"side": side, "shared_side": side and cfg.has_shared_expert, "hits_side": side and early_hits,
            "pdl": device != "cpu", "early_weights": tuple(front and fits(t) for t in range(1, GEMV_MAX_TOKENS + 1)),
            "front_release": front, "down_prefetch": min(2 if front else 4, k),
            "hits_programs": 8 * (sms if device != "cpu" else 4)}


def _choices(plan: LaunchPlan) -> dict:
    return {"side": plan.mode.side_stream, "shared_side": plan.mode.shared_on_side,
            "hits_side": plan.mode.hits_on_side, "pdl": plan.pdl, "early_weights": plan.router_early_weights,
            "front_release": plan.front_release, "down_prefetch": plan.down_prefetch,
            "hits_programs": plan.hits_programs}


# shared expert, pool full, overlap, device -> mode, front_release, prefetch at k = 4
RESOLVED = [
    (True, False, True, "cuda", OverlapMode.SHARED_AND_HITS_ON_SIDE, False, 4),
    (True, True, True, "cuda", OverlapMode.SHARED_ON_SIDE, True, 2),
    (False, False, True, "cuda", OverlapMode.HITS_ON_SIDE, False, 4),
    (False, True, True, "cuda", OverlapMode.INLINE, True, 2),
    (True, False, False, "cuda", OverlapMode.INLINE, True, 2),
    (False, False, False, "cuda:1", OverlapMode.INLINE, True, 2),
    (True, False, True, "cpu", OverlapMode.INLINE, True, 2),
    (False, True, True, "cpu", OverlapMode.INLINE, True, 2),
]


@pytest.mark.parametrize("shared, full, overlap, device, mode, release, prefetch", RESOLVED)
def test_resolver_table(shared, full, overlap, device, mode, release, prefetch):
    cfg = dataclasses.replace(CFG, shared_intermediate=5632 if shared else 0)
    plan = _resolve(cfg, slots=1000 if full else 999, keys=1000, device=device, overlap=overlap)
    assert plan.mode is mode, plan.reason
    assert (plan.front_release, plan.down_prefetch) == (release, prefetch)
    assert plan.router_early_weights == (release,) * GEMV_MAX_TOKENS  # H = 2048 fits at every T
    assert plan.pdl is (device != "cpu") and plan.router_tiles == RouterTiles() and plan.routed_tiles == RoutedTiles()


SHAPES = [(2048, 512, 10), (2048, 60, 4), (4096, 8, 2), (8192, 512, 8), (8192, 2, 1), (16384, 64, 6), (48, 5, 3)]


@pytest.mark.parametrize("hidden, experts, k", SHAPES)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no-shared"])
@pytest.mark.parametrize("full", [True, False], ids=["full", "misses"])
@pytest.mark.parametrize("overlap", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("device, sms", [("cuda", 132), ("cuda:3", 78), ("cpu", 4)])
def test_resolver_equals_the_layer_before_the_plan(hidden, experts, k, shared, full, overlap, device, sms):
    """Every launch choice, at every decode size T (the router's early weights fit at some T only
    where H is 8192: 2 experts per program up to 4 tokens, 4 above), equals the old layer's."""
    cfg = MoEConfig(hidden=hidden, num_experts=experts, top_k=k, expert_intermediate=64,
                    shared_intermediate=32 if shared else 0)
    keys = 3 * experts
    slots = keys if full else keys - 1
    plan = _resolve(cfg, slots=slots, keys=keys, device=device, sms=sms, overlap=overlap)
    assert _choices(plan) == _old_layer(cfg, slots, keys, device, sms, overlap)


def test_early_weights_follow_the_token_count():
    cfg = MoEConfig(hidden=8192, num_experts=512, top_k=8, expert_intermediate=64)
    plan = _resolve(cfg, slots=512, keys=512)  # no shared expert, full pool: inline, front release on
    assert plan.mode is OverlapMode.INLINE and plan.front_release
    assert plan.router_early_weights == (True,) * 4 + (False,) * 4


@pytest.mark.parametrize("kwargs, word", [
    ({"overlap": False}, "EXPERTCACHE_MOE_COPY_OVERLAP"), ({"device": "cpu"}, "cpu"),
    ({"tp_size": 2}, "tp_size"),
    ({"cfg": dataclasses.replace(CFG, shared_intermediate=0), "miss_service": "cpu"}, "fills no slot"),
    ({"cfg": dataclasses.replace(CFG, shared_intermediate=0), "slots": 1000}, "nothing to run"),
])
def test_resolver_reasons(kwargs, word):
    plan = _resolve(**kwargs)
    assert plan.mode is OverlapMode.INLINE and word in plan.reason


def test_resolver_accepts_with_a_reason():
    plan = _resolve()
    assert plan.mode is OverlapMode.SHARED_AND_HITS_ON_SIDE and "overlap-safe" in plan.reason
    assert (
        plan.summary()["mode"] == "shared_and_hits_on_side" and plan.summary()["routed_tiles"] == "i1x1024w2-h2x512w4"
    )


@pytest.mark.parametrize("service, mode", [
    ("copy", OverlapMode.SHARED_AND_HITS_ON_SIDE), ("hybrid", OverlapMode.SHARED_AND_HITS_ON_SIDE),
    ("cpu", OverlapMode.SHARED_ON_SIDE),  # nothing is ever resident: no early hits
])
def test_resolver_under_each_miss_service(service, mode):
    plan = _resolve(miss_service=service)
    assert plan.mode is mode and plan.cpu_share == (service != "copy") and plan.summary()["cpu_share"] == plan.cpu_share
    assert ("CPU workers" in plan.reason) == (service != "copy")
    no_overlap = _resolve(miss_service=service, overlap=False)  # the CPU share does not need the side stream
    assert no_overlap.mode is OverlapMode.INLINE and no_overlap.cpu_share == (service != "copy")
    # the releases and prefetch are those of the copy service with the same early hits (none under cpu)
    same = _resolve(slots=1000) if service == "cpu" else _resolve()
    assert (plan.front_release, plan.down_prefetch) == (same.front_release, same.down_prefetch)


@pytest.mark.parametrize("cfg, mode", [(CFG, OverlapMode.SHARED_ON_SIDE),
                                       (dataclasses.replace(CFG, shared_intermediate=0), OverlapMode.INLINE)])
def test_resolver_runs_the_tensor_core_kernels_without_early_hits(cfg, mode):
    plan = _resolve(cfg, routed_mma=True)
    assert plan.routed_mma == DEFAULT_MMA_TILES and plan.summary()["routed_mma"] == DEFAULT_MMA_TILES.name
    assert plan.mode is mode and not plan.mode.hits_on_side
    assert _resolve(cfg).routed_mma is None and _resolve(cfg).summary()["routed_mma"] is None
    with pytest.raises(ValueError, match=f"{ROUTED_MMA_ENV}=1 .* does not run with the hybrid miss service"):
        _resolve(cfg, routed_mma=True, miss_service="hybrid")
    with pytest.raises(ValueError, match="routed_mma must be a bool"):
        _resolve(cfg, routed_mma=1)
    with pytest.raises(ValueError, match="LaunchPlan.routed_mma: the tensor-core routed kernels run neither"):
        dataclasses.replace(_resolve(cfg), routed_mma=DEFAULT_MMA_TILES, cpu_share=True)
    with pytest.raises(ValueError, match="LaunchPlan.routed_mma must be a MmaTiles"):
        dataclasses.replace(plan, routed_mma=RoutedTiles())


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("1", True), ("0", False)])
def test_routed_mma_from_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(ROUTED_MMA_ENV, raising=False)
    else:
        monkeypatch.setenv(ROUTED_MMA_ENV, value)
    assert routed_mma_from_env() is expected
    monkeypatch.setenv(ROUTED_MMA_ENV, "yes")
    with pytest.raises(ValueError, match=f"{ROUTED_MMA_ENV}='yes': set it to 1"):
        routed_mma_from_env()


def test_resolver_refuses_a_cpu_share_on_the_cpu():
    with pytest.raises(ValueError, match="miss_service"):
        _resolve(device="cpu", miss_service="hybrid")
    with pytest.raises(ValueError, match="miss_service"):
        _resolve(miss_service="auto")  # resolved to copy or hybrid before a plan is made


@pytest.mark.parametrize("kwargs, name", [
    ({"slots": 0}, "num_slots"), ({"keys": True}, "num_keys"), ({"sms": 0}, "num_sms"),
    ({"overlap": 1}, "copy_overlap"), ({"device": "gpu"}, "device"), ({"tp_size": 0}, "tp_size"),
])
def test_resolver_rejects(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _resolve(**kwargs)


def test_modes_name_what_runs_on_the_side_stream():
    assert [m.side_stream for m in OverlapMode] == [False, True, True, True]
    assert [m.shared_on_side for m in OverlapMode] == [False, True, False, True]
    assert [m.hits_on_side for m in OverlapMode] == [False, False, True, True]


@pytest.mark.parametrize("field, value", [
    ("mode", "inline"), ("reason", ""), ("pdl", 1), ("router_early_weights", (True,) * 7),
    ("router_early_weights", [False] * GEMV_MAX_TOKENS), ("front_release", None), ("front_release", "yes"),
    ("down_prefetch", -1), ("down_prefetch", True), ("hits_programs", 0), ("router_tiles", RoutedTiles()),
    ("routed_tiles", None),
])
def test_launch_plan_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(_resolve(), **{field: value})


def test_launch_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _resolve().pdl = False


@pytest.mark.parametrize("cls, field, value", [
    (RouterTiles, "block_e_small", 3), (RouterTiles, "block_e", 0), (RouterTiles, "chunk_h", True),
    (RouterTiles, "warps", 32), (RoutedTiles, "block_i", 3), (RoutedTiles, "chunk_i", 2.0),
    (RoutedTiles, "warps_gate_up", 6), (RoutedTiles, "warps_down", 32), (RoutedTiles, "block_h", None),
])
def test_tiles_validation_names_field(cls, field, value):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field}"):
        cls(**{field: value})


def test_router_tiles_by_token_count():
    """2 experts per program up to 4 tokens and 4 above, capped at E's power of two."""
    tiles = RouterTiles()
    assert [tiles.block_e_for(t, 512) for t in range(1, 9)] == [2, 2, 2, 2, 4, 4, 4, 4]
    assert tiles.block_e_for(8, 2) == 2 and tiles.block_e_for(8, 3) == 4
    assert {RouterTiles(block_e_small=8, block_e=8).block_e_for(t, 512) for t in range(1, 9)} == {8}
    assert tiles.chunk_for(48) == 64 and tiles.early_weights_held(512, 48, 1) == 128
    assert tiles.name == "b2-4w4" and RouterTiles(block_e_small=8, block_e=8, warps=2).name == "b8w2"
