"""The loader and decode engine against Hugging Face transformers, on the CPU.

    transformers Qwen2MoeForCausalLM / Qwen3MoeForCausalLM (tiny, random, every weight and bias drawn)
        ─save_pretrained─► tmp dir ─moe.engine.loading.load_model─► Engine (CpuCachedMoE: HostCache + CPU pool)
    compared: logits of prefill and of teacher-forced decode steps (float32 tight, bfloat16 loose),
    greedy tokens, recorded routing vs transformers' router; and the loader's error messages.

qwen2: 3 layers (layer 1 dense via mlp_only_layers), 8 experts top-2, shared expert, q/k/v bias, GQA 4/2.
qwen3: 3 layers, 16 experts top-4, norm_topk_prob, q/k norms, attention bias, head_dim 32 != H / heads,
tied embeddings.
qwen3_next: 4 layers, linear / linear / full / linear attention (Gated DeltaNet with 2 key and 4 value
heads of 16, conv kernel 4; gated full attention of head_dim 32, half of it rotated), layer 1 dense,
8 experts top-3 with a sigmoid-gated shared expert, (1 + w) norms.
glm4_moe: 3 layers (layer 0 dense: first_k_dense_replace), 8 experts top-2 in 4 groups of which 2 are
chosen, sigmoid scores with a drawn correction bias, routed_scaling_factor 2.5, an ungated shared
expert, q/k/v bias, q/k norms, half of each head rotated.
mixtral: 3 layers, 8 experts top-2 (softmax over the top-k), the release's expert names (w1 / w3 / w2),
no sliding window (the releases'); a windowed variant has its own test.
olmoe: 3 layers, 16 experts top-4 without renormalisation (the releases'), q / k RMSNorms over the whole
projection, attention biases (o_proj's too), GQA 4/2; clip_qkv has its own test.
Router comparisons use each family's choice scores (router_choice: the router logits, or GLM's biased sigmoid
scores within its chosen groups), whose top-k is the choice.
Slot counts of top_k (or batch * top_k) make every decode call evict.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from expertcache.formats import GIB, get_format
from expertcache.host import ACCESSES, CALLS, MISSES
from moe.engine.loading import CheckpointError, load_model
from moe.testing.tiny_checkpoint import randomize
from tests.moe.families import (
    COMMON,
    EXPERT,
    FAMILIES,
    assert_near,
    broken_copy,
    hf_logits,
    hf_logits_and_router,
    hf_run,
    moe_layers,
    num_experts,
    random_tokens,
    router_choice,
    routing_alike,
)


def _teacher_forced(engine, seq: list[int], prompt_len: int) -> torch.Tensor:
    """Engine logits after every token of seq: prefill seq[:prompt_len], decode the rest one at a time."""
    out = [engine.prefill([seq[:prompt_len]], all_logits=True)[0]]
    out += [engine.decode_step([t]) for t in seq[prompt_len:]]
    return torch.cat(out)


def test_float32_logits_match_transformers_through_evicting_decode(checkpoint):
    name, model, path = checkpoint
    top_k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=top_k, max_seq_len=32, progress=False)
    seq = random_tokens(12, seed=1)
    ref = hf_logits(model, seq).logits[0]  # [12, V]
    got = _teacher_forced(engine, seq, prompt_len=7)
    assert_near(got, ref, rel=1e-4)
    counters = engine.moe.cache.counters  # [L_moe, 3]: decode calls only (prefill bypasses the cache)
    assert (counters[:, CALLS] == 5).all()
    assert (counters[:, MISSES] == counters[:, ACCESSES]).all() and counters[:, MISSES].sum() > 0


def test_bfloat16_logits_within_bf16_tolerance(checkpoint):
    """Teacher-forced bf16 logits within bf16 tolerance of transformers' own bf16 run, and as close to
    the float32 truth as that run, at every token both route alike (a decode token whose routing differs
    must differ where the engine chose the float32 router's experts or crossed a gap within
    transformers' own bf16 noise: routing_alike)."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=2 * k, dtype="bfloat16", max_seq_len=32, progress=False,
                        record_routing=True)
    seq, plen = random_tokens(10, seed=2), 6
    ref32, router32 = hf_logits_and_router(model, seq)
    ref16, router16 = hf_logits_and_router(copy.deepcopy(model).to(torch.bfloat16), seq)
    got = _teacher_forced(engine, seq, prompt_len=plen)
    assert got.dtype == torch.float32 and engine.weights.embed.dtype == torch.bfloat16
    ours = torch.as_tensor(engine.routing())[:, :, 0]  # [decode steps, L_moe, k]
    # a prompt token is compared where transformers' bf16 router chose its float32 router's experts (the
    # engine's prefill routing is not recorded; GLM-4.5's rounded correction bias flips one such token)
    alike = [all(set(router16[m, t].topk(k).indices.tolist()) == set(router32[m, t].topk(k).indices.tolist())
                 for m in range(router16.shape[0])) for t in range(plen)]
    alike += [routing_alike(ours[j], router16[:, t], router32[:, t], k) for j, t in enumerate(range(plen, len(seq)))]
    assert sum(alike) >= len(seq) - 2, alike  # a flip is rare: at most 2 tokens of 10
    keep = torch.tensor(alike)
    assert_near(got[keep], ref16[keep], rel=0.06)
    own, theirs = (got - ref32).abs().mean().item(), (ref16 - ref32).abs().mean().item()
    assert own <= 1.5 * theirs + 2**-8 * ref32.abs().mean().item()


def test_greedy_generation_token_identical_while_evicting(checkpoint):
    name, model, path = checkpoint
    top_k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=top_k, max_seq_len=32, progress=False)
    prompt = random_tokens(6, seed=3)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                             pad_token_id=0)[0, len(prompt):].tolist()
    got = engine.generate([prompt], max_new_tokens=8)
    assert got == [ref]
    counters = engine.moe.cache.counters
    assert (counters[:, CALLS] == 7).all()  # 7 decode steps after the prefill's token
    assert (counters[:, MISSES] == counters[:, ACCESSES]).all()  # num_slots = top_k: every call evicts


def test_batch_of_unequal_prompts_decodes_like_single_sequences(checkpoint):
    name, model, path = checkpoint
    engine = load_model(path, "cpu", num_slots=2 * model.config.num_experts_per_tok, max_batch=2,
                        max_seq_len=32, progress=False)
    seqs = [random_tokens(9, seed=4), random_tokens(13, seed=5)]  # prompts of 5 and 9 tokens, 4 decode steps each
    prompts = [seqs[0][:5], seqs[1][:9]]
    first = engine.prefill(prompts)  # [2, V]
    steps = [engine.decode_step([seqs[0][5 + j], seqs[1][9 + j]]) for j in range(4)]  # 4 x [2, V]
    for row, seq in enumerate(seqs):
        ref = hf_logits(model, seq).logits[0]
        got = torch.stack([first[row]] + [s[row] for s in steps])
        assert_near(got, ref[len(prompts[row]) - 1:], rel=1e-4)
    assert engine.moe.cache.counters[:, MISSES].sum() > 0


def test_rows_joining_and_leaving_keep_each_sequence_its_own_context(checkpoint):
    """Continuous batching: a row that leaves hands its place to the last row, whose KV cache (and, for a
    model with linear-attention layers, their state) moves with it; a row that joins starts from a fresh state.
    Every sequence's logits stay transformers' own."""
    name, model, path = checkpoint
    engine = load_model(path, "cpu", num_slots=3 * model.config.num_experts_per_tok, max_batch=3,
                        max_seq_len=32, progress=False)
    seqs = [random_tokens(n, seed=s) for n, s in ((10, 40), (11, 41), (9, 42), (8, 43))]
    got: dict[int, list[torch.Tensor]] = {}
    rows = []  # sequence index per row
    fed = {}  # tokens of each sequence in the engine so far

    def join(s: int, n: int) -> None:
        row, logits = engine.join(seqs[s][:n])
        assert row == len(rows)
        rows.append(s)
        fed[s], got[s] = n, [logits]

    def step() -> None:
        out = engine.decode_step([seqs[s][fed[s]] for s in rows])
        for row, s in enumerate(rows):
            got[s].append(out[row])
            fed[s] += 1

    join(0, 4)
    join(1, 6)
    join(2, 3)
    step()
    step()
    assert engine.leave(0) == 2  # sequence 2 moves into row 0
    rows[0] = rows.pop()
    step()
    join(3, 5)  # into the freed row 2, after a sequence that left: a fresh state
    step()
    assert engine.leave(1) == 2
    rows[1] = rows.pop()
    step()
    for s, outs in got.items():
        start = fed[s] - len(outs)  # the first logits came after token start (the prompt's last)
        assert_near(torch.stack(outs), hf_logits(model, seqs[s][:fed[s]]).logits[0, start:], rel=1e-4)


def test_prefill_touching_every_expert_keeps_the_decode_working_set(checkpoint):
    name, model, path = checkpoint
    cfg = model.config
    engine = load_model(path, "cpu", num_slots=cfg.num_experts_per_tok + 1, max_seq_len=128, progress=False)
    engine.generate([random_tokens(5, seed=6)], max_new_tokens=4)
    before, counted = engine.moe.cache.snapshot(), list(engine.moe.prefill_counts)
    long = random_tokens(120, seed=7)
    out, router = hf_run(model, long)
    e = num_experts(cfg)
    used = {m * e + x for m, choice in enumerate(router_choice(model, router))  # [T, E] per MoE layer
            for x in torch.unique(choice.topk(cfg.num_experts_per_tok, dim=-1).indices).tolist()}
    assert len(used) >= 0.85 * engine.spec.num_moe_layers * e  # the prompt routes to (nearly) every expert
    got = engine.prefill([long], all_logits=True)[0]
    assert_near(got, out.logits[0], rel=1e-4)
    assert engine.moe.cache.snapshot().equals(before)
    # every used expert was computed once: the resident ones read from their slots, the rest streamed
    resident = len(used & set(engine.moe.cache.key_of[engine.moe.cache.key_of >= 0].tolist()))
    streamed, reused = (n - c for n, c in zip(engine.moe.prefill_counts, counted))
    assert (streamed, reused) == (len(used) - resident, resident)
    assert resident > 0
    cold = load_model(path, "cpu", num_slots=cfg.num_experts_per_tok + 1, max_seq_len=128, progress=False)
    assert torch.equal(cold.prefill([long], all_logits=True)[0], got)  # slots hold the store's bytes
    assert cold.moe.prefill_counts == [len(used), 0]


def test_recorded_routing_is_transformers_router_topk(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=k, max_seq_len=32, record_routing=True, progress=False)
    seq = random_tokens(10, seed=8)
    _teacher_forced(engine, seq, prompt_len=6)
    routing = engine.routing()  # [N, L_moe, B, k]
    assert routing.dtype == np.int32 and routing.shape == (4, engine.spec.num_moe_layers, 1, k)
    choice = router_choice(model, hf_run(model, seq)[1])  # [L_moe, T, E]
    ref = choice[:, 6:].topk(k, dim=-1).indices.permute(1, 0, 2).numpy()  # [N, L_moe, k]
    np.testing.assert_array_equal(routing[:, :, 0], ref)


def test_recorded_routing_pads_smaller_batches(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engine = load_model(path, "cpu", num_slots=2 * k, max_batch=2, max_seq_len=16, record_routing=True,
                        progress=False)
    assert engine.routing().shape == (0, engine.spec.num_moe_layers, 0, k)
    engine.generate([random_tokens(3, seed=10)], max_new_tokens=2)  # one decode step of one row
    engine.generate([random_tokens(3, seed=11), random_tokens(4, seed=12)], max_new_tokens=2)  # one step of two rows
    routing = engine.routing()
    assert routing.shape == (2, engine.spec.num_moe_layers, 2, k)
    assert (routing[0, :, 1] == -1).all() and (routing[0, :, 0] >= 0).all() and (routing[1] >= 0).all()


def test_fused_expert_layout_and_sharded_index_load_identically(checkpoint, tmp_path):
    name, model, path = checkpoint
    seq = random_tokens(8, seed=9)

    def logits(p):
        return load_model(p, "cpu", num_slots=16, max_seq_len=16, progress=False).prefill([seq], all_logits=True)[0]

    fused = tmp_path / "fused"  # transformers >= 5's in-memory names: mlp.experts.gate_up_proj [E, 2I, H]
    fused.mkdir()
    shutil.copy(path / "config.json", fused)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    base = logits(path)
    assert torch.equal(logits(fused), base) and torch.equal(logits(sharded), base)


def test_mixtral_with_a_sliding_window_slides_every_layer(tmp_path):
    """A Mixtral config with sliding_window (older copies of the releases set 4096): every layer attends
    to the last `window` keys, through prefill and evicting decode, as transformers masks them."""
    config_cls, model_cls, extra = FAMILIES["mixtral"]
    model = model_cls(config_cls(**{**COMMON, **extra, "sliding_window": 4})).eval()
    randomize(model, seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = load_model(tmp_path, "cpu", num_slots=2, max_seq_len=32, progress=False)
    assert set(engine.spec.layer_types) == {"sliding_attention"} and engine.spec.sliding_window == 4
    seq = random_tokens(13, seed=6)
    assert_near(_teacher_forced(engine, seq, prompt_len=6), hf_logits(model, seq).logits[0], rel=1e-4)
    unwindowed = model_cls(config_cls(**{**COMMON, **extra})).eval()
    unwindowed.load_state_dict(model.state_dict())
    assert (hf_logits(unwindowed, seq).logits[0] - hf_logits(model, seq).logits[0]).abs().max() > 1e-2


def test_olmoe_clip_qkv_clamps_as_transformers_does(tmp_path):
    """OLMoE with clip_qkv set (null in the releases): q and k after their whole-projection norms, and v,
    clamped before RoPE, through prefill and evicting decode, as transformers clamps them; the clamp bites
    (the logits move without it)."""
    config_cls, model_cls, extra = FAMILIES["olmoe"]
    model = model_cls(config_cls(**{**COMMON, **extra, "clip_qkv": 0.6})).eval()
    randomize(model, seed=9)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = load_model(tmp_path, "cpu", num_slots=4, max_seq_len=32, progress=False)
    assert engine.spec.clip_qkv == 0.6 and engine.spec.qk_norm_full and not engine.spec.qk_norm
    seq = random_tokens(12, seed=3)
    assert_near(_teacher_forced(engine, seq, prompt_len=5), hf_logits(model, seq).logits[0], rel=1e-4)
    unclipped = model_cls(config_cls(**{**COMMON, **extra})).eval()
    unclipped.load_state_dict(model.state_dict())
    assert (hf_logits(unclipped, seq).logits[0] - hf_logits(model, seq).logits[0]).abs().max() > 1e-2


@pytest.mark.parametrize("clip", [0, -1.0, float("inf"), True, "1"])
def test_bad_olmoe_clip_qkv_is_refused_naming_it(tmp_path, clip):
    config_cls, model_cls, extra = FAMILIES["olmoe"]
    model_cls(config_cls(**{**COMMON, **extra})).save_pretrained(tmp_path / "olmoe", safe_serialization=True)
    broken = broken_copy(tmp_path / "olmoe", tmp_path, edit_config=lambda c: c.update(clip_qkv=clip))
    with pytest.raises(CheckpointError, match=r"config.json clip_qkv must be a finite number > 0 or null, got"):
        load_model(broken, "cpu", num_slots=8, progress=False)


def test_glm_multi_token_prediction_layers_are_not_read(tmp_path):
    """GLM-4.5's releases carry num_nextn_predict_layers more decoder layers (draft heads) past
    num_hidden_layers: the loader reads none of their tensors, so the model is the same."""
    config_cls, model_cls, extra = FAMILIES["glm4_moe"]
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    randomize(model, seed=3)
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    tensors = load_file(str(tmp_path / "base" / "model.safetensors"))
    last = COMMON["num_hidden_layers"] - 1
    extra_layer = {k.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): v.clone()
                   for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    extra_layer[f"model.layers.{last + 1}.eh_proj.weight"] = torch.randn(64, 128)  # the MTP head's own
    mtp = tmp_path / "mtp"
    shutil.copytree(tmp_path / "base", mtp)
    save_file({**tensors, **extra_layer}, str(mtp / "model.safetensors"))
    config = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    seq = random_tokens(7, seed=5)
    got = [load_model(p, "cpu", num_slots=4, max_seq_len=16, progress=False).prefill([seq], all_logits=True)[0]
           for p in (tmp_path / "base", mtp)]
    assert torch.equal(got[0], got[1])
    assert_near(got[1], hf_logits(model, seq).logits[0], rel=1e-4)


@pytest.mark.parametrize("edit, pattern", [
    ({"n_group": 3}, r"MoEConfig.n_group=3 must divide num_experts=8"),
    ({"topk_group": 5}, r"topk_group=5 may not exceed it"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, r"top_k=3 exceeds the 2 experts of the 1 group kept"),
    ({"routed_scaling_factor": 0.0}, r"routed_scaling must be a finite number > 0"),
    ({"first_k_dense_replace": 3}, r"first_k_dense_replace must be an int in \[0, num_hidden_layers=3\)"),
    ({"partial_rotary_factor": 0.05, "rope_parameters": {"rope_theta": 1e4}}, r"partial_rotary_factor gives 0"),
])
def test_bad_glm_fields_are_refused_naming_them(tmp_path, edit, pattern):
    config_cls, model_cls, extra = FAMILIES["glm4_moe"]
    model_cls(config_cls(**{**COMMON, **extra})).save_pretrained(tmp_path / "glm", safe_serialization=True)
    broken = broken_copy(tmp_path / "glm", tmp_path, edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=pattern):
        load_model(broken, "cpu", num_slots=8, progress=False)


@pytest.mark.parametrize(
    "case, edit_tensors, edit_config, pattern",
    [
        (
            "missing tensor",
            lambda t: t.pop(next(k for k in sorted(t) if k.endswith(EXPERT))),
            None,
            r"tensor 'model\.layers\.\d\.(mlp|block_sparse_moe)\.experts\.3\.(up_proj|w3)\.weight' is missing",
        ),
        (
            "wrong shape",
            lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 64)}),
            None,
            r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \[16, 64\], expected \[\d+, 64\]",
        ),
        (
            "unsupported model_type",
            None,
            lambda c: c.update(model_type="llama"),
            r"model_type='llama' is not supported; supported: \['glm4_moe', 'gpt_oss', 'mixtral', 'olmoe', "
            r"'qwen2_moe', 'qwen3_moe', "
            r"'qwen3_next'\]",
        ),
        ("missing config key", None, lambda c: c.pop("num_attention_heads"), r"missing 'num_attention_heads'"),
        (
            "scaled rope",
            None,
            lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            r"rope_type='yarn'",
        ),
    ],
)
def test_load_errors_name_the_culprit(checkpoint, tmp_path, case, edit_tensors, edit_config, pattern):
    name, model, path = checkpoint
    broken = broken_copy(path, tmp_path, edit_tensors, edit_config)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(broken, "cpu", num_slots=16, progress=False)


def test_too_few_slots_for_the_batch_names_the_flag(checkpoint):
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    with pytest.raises(ValueError, match="--moe-slots"):
        load_model(path, "cpu", num_slots=2 * k - 1, max_batch=2, progress=False)


# --moe-cache-gb: G GiB of slot memory -> floor(G * 2**30 / P) slots, P = one expert's HostStore bytes

@pytest.mark.parametrize("dtype, itemsize", [(None, 4), ("float16", 2), ("bfloat16", 2)])
def test_cache_gb_gives_the_floor_of_the_budget_and_the_same_tokens(checkpoint, caplog, dtype, itemsize):
    name, model, path = checkpoint
    cfg = model.config
    h, i, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    per = 3 * i * h * itemsize  # gate_up [2I, H] + down [H, I] in the model dtype (the checkpoint is float32)
    if dtype == "bfloat16":
        assert per == get_format("bf16").expert_bytes(h, i)
    gib = (k + 1.5) * per / GIB
    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        engine = load_model(path, "cpu", cache_gb=gib, dtype=dtype, max_seq_len=32, progress=False)
    slots = math.floor(gib * 2**30 / per)
    assert slots == k + 1 and engine.moe.cache.geometry.num_slots == engine.moe.pool.num_slots == slots
    assert engine.moe.store.bytes_per_expert == per
    keys = moe_layers(cfg) * num_experts(cfg)
    assert f"expert cache: {slots} slots x {per:,} bytes per {'bf16' if dtype == 'bfloat16' else dtype or 'float32'} " \
           f"expert" in caplog.text and f"for {keys} experts" in caplog.text
    ref = load_model(path, "cpu", num_slots=slots, dtype=dtype, max_seq_len=32, progress=False)
    prompt = random_tokens(5, seed=9)
    assert engine.generate([prompt], max_new_tokens=8) == ref.generate([prompt], max_new_tokens=8)
    assert np.array_equal(engine.moe.cache.counters, ref.moe.cache.counters)


def test_a_budget_that_holds_every_expert_gives_each_a_slot_and_says_so(checkpoint, caplog):
    name, model, path = checkpoint
    keys = moe_layers(model.config) * num_experts(model.config)
    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        engine = load_model(path, "cpu", cache_gb=1, max_seq_len=32, progress=False)
    assert engine.moe.cache.geometry.num_slots == keys
    record, split = [r for r in caplog.records if r.name == "moe.engine.loading"]
    assert record.levelno == logging.WARNING and split.message.startswith("device memory for the cache and the context")
    assert f"budget --moe-cache-gb 1 holds {GIB // engine.moe.store.bytes_per_expert:,}" in record.message
    assert f"capped at {keys} slots, every expert resident" in record.message


@pytest.mark.parametrize("kw, pattern", [
    ({}, r"exactly one of --moe-slots N \(num_slots=\) and --moe-cache-gb G \(cache_gb=\), got neither"),
    ({"num_slots": 8, "cache_gb": 1.0}, r"exactly one of --moe-slots .* got both"),
    ({"cache_gb": 0}, r"--moe-cache-gb must be a number of GiB > 0, got 0"),
    ({"cache_gb": -1.0}, r"--moe-cache-gb must be a number of GiB > 0, got -1\.0"),
    ({"cache_gb": float("nan")}, r"--moe-cache-gb must be a number of GiB > 0, got nan"),
    ({"cache_gb": float("inf")}, r"--moe-cache-gb must be a number of GiB > 0, got inf"),
    ({"cache_gb": "1"}, r"--moe-cache-gb must be a number of GiB > 0, got '1'"),
    ({"cache_gb": 1e-9}, r"--moe-cache-gb 1e-09 holds no float32 expert of 24,576 bytes \(H 64, I 32\): "
                         r"give at least 0\.0001"),
    ({"cache_gb": 1e-9, "dtype": "bfloat16"}, r"--moe-cache-gb 1e-09 holds no bf16 expert of 12,288 bytes"),
])
def test_cache_size_refusals_name_the_flag_before_any_tensor_is_read(checkpoint, monkeypatch, kw, pattern):
    name, model, path = checkpoint
    monkeypatch.setattr("moe.engine.loading.load_checkpoint", lambda *a, **k: pytest.fail("tensors were read"))
    with pytest.raises(ValueError, match=pattern):
        load_model(path, "cpu", progress=False, **kw)


def test_a_budget_below_the_batch_names_the_flag_and_the_budget_that_fits(checkpoint, monkeypatch):
    name, model, path = checkpoint
    cfg = model.config
    k, per = cfg.num_experts_per_tok, 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    monkeypatch.setattr("moe.engine.loading.load_checkpoint", lambda *a, **k: pytest.fail("tensors were read"))
    with pytest.raises(ValueError, match=rf"--moe-cache-gb \S+ holds {2 * k - 1} float32 experts of {per:,} bytes, "
                                         rf"below --max-batch 2 x top_k {k} = {2 * k}: .* give --moe-cache-gb (\S+) "
                                         "or more") as e:
        load_model(path, "cpu", cache_gb=(2 * k - 0.5) * per / GIB, max_batch=2, progress=False)
    enough = float(str(e.value).split("give --moe-cache-gb ")[1].split()[0])
    assert int(enough * GIB) // per >= 2 * k  # the budget the message gives does fit the batch


@pytest.mark.parametrize("dtype, itemsize", [(None, 4), ("bfloat16", 2)])
def test_the_kv_cache_is_priced_as_allocated_and_reported_beside_the_slots(checkpoint, caplog, dtype, itemsize):
    from moe.engine.budget import kv_cache_bytes, recurrent_state_bytes

    name, model, path = checkpoint
    cfg = model.config
    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        engine = load_model(path, "cpu", num_slots=12, dtype=dtype, max_batch=3, max_seq_len=40, progress=False)
    allocated = sum(t.numel() * t.element_size() for t in engine.kv.k + engine.kv.v if t is not None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = types.count("full_attention")
    assert kv_cache_bytes(engine.spec, 3, 40) == allocated == (
        2 * full * 3 * cfg.num_key_value_heads * 40 * head_dim * itemsize)
    (split,) = [r.message for r in caplog.records if r.message.startswith("device memory")]
    per_token = allocated // (3 * 40)
    assert (f"expert slots {12 * engine.moe.store.bytes_per_expert / GIB:.3g} GiB (--moe-slots 12) + KV cache "
            f"{allocated / GIB:.3g} GiB (--max-batch 3 x --max-seq-len 40 tokens x {per_token:,} bytes a token: "
            f"{full} layer{'s' * (full != 1)} x k, v x {cfg.num_key_value_heads} heads x {head_dim} x {itemsize} bytes)"
            ) in split
    state = 0 if engine.recurrent is None else sum(
        t.numel() * t.element_size() for st in engine.recurrent.states.values() for t in (st.conv, st.delta))
    assert recurrent_state_bytes(engine.spec, 3) == state
    if name == "qwen3_next":  # 3 linear layers x (conv [C = 2*2*16 + 4*16, K - 1 = 3] + delta [4, 16, 16] f32)
        assert state == 3 * 3 * (128 * 3 * itemsize + 4 * 16 * 16 * 4)
        assert f"+ linear-attention state {state / GIB:.3g} GiB (--max-batch 3 x {state // 3:,} bytes a " \
               "sequence: 3 layers)" in split


@pytest.mark.gpu
def test_a_kv_cache_beyond_the_free_device_memory_names_the_flags(checkpoint):
    name, model, path = checkpoint
    with pytest.raises(ValueError, match=r"the KV cache needs \S+ GiB \(--max-batch 1 x --max-seq-len 1000000000\) but "
                                         r".* lower --max-seq-len or --max-batch, or --moe-cache-gb / --moe-slots"):
        load_model(path, "cuda", num_slots=12, max_seq_len=10 ** 9, progress=False)
