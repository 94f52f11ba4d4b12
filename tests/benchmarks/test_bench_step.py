"""benchmarks/bench_step.py on the CPU: the step's floor bytes, the kernel-name parts, the command line."""

from __future__ import annotations

import pytest

from moe.model.spec import ModelSpec
from moe.testing.random_decoder import qwen3_30b_like
from tests.conftest import load_bench


def _bench():
    return load_bench("bench_step")


def test_the_floor_counts_each_byte_a_step_must_read_once():
    spec = ModelSpec.from_hf(qwen3_30b_like(8, vocab_size=151936))
    got = _bench().step_bytes(spec, 1, 1024, distinct_experts=8 * 8)
    per_layer = (32 * 128 * 2048 * 2 + 4 * 128 * 2048 * 2) * 2 + (2 * 2048 + 2 * 128) * 2  # q, o, k, v, norms
    assert got["attention_weights"] == 8 * per_layer
    assert got["experts"] == 64 * 3 * 768 * 2048 * 2  # 9,437,184 bytes an expert
    assert got["kv_cache"] == 2 * 8 * 1 * 4 * 1024 * 128 * 2
    assert got["head"] == (151936 * 2048 + 2048) * 2 and got["embedding"] == 2048 * 2
    four = _bench().step_bytes(spec, 4, 32768, distinct_experts=8 * 30.5)
    assert four["kv_cache"] == 4 * 32 * got["kv_cache"] and four["experts"] == 8 * 30.5 * 3 * 768 * 2048 * 2
    packed = _bench().step_bytes(spec, 1, 1024, distinct_experts=8 * 8, expert_bytes=2_519_040)
    assert packed["experts"] == 64 * 2_519_040 and packed["attention_weights"] == got["attention_weights"]


@pytest.mark.parametrize("name, part", [
    ("_split_kernel", "attention"), ("_qk_rope_write_kernel", "attention"), ("_gate_up_kernel", "moe"),
    ("_down_kernel", "moe"), ("_router_kernel", "moe"), ("_gate_up_mma", "moe"), ("_down_mma", "moe"),
    ("_combine", "moe"), ("_combine_kernel", "attention"), ("_add_rms_norm_kernel", "norms"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"), ("void gemv2T_kernel_val<int, int, __nv_bfloat16>", "gemm"),
    ("elementwise_kernel", "other"),
])
def test_kernels_fall_into_the_parts_of_a_step(name, part):
    assert _bench().part_of(name) == part


@pytest.mark.parametrize("argv, message", [(["--batches", "0"], "--batches: each must be >= 1"),
                                           (["--contexts", "1024,x"], "--contexts: '1024,x' is not a comma list"),
                                           (["--contexts", "3"], "--contexts: each must be >= 6"),
                                           (["--steps", "0"], "--steps and --profile-steps must be >= 1"),
                                           (["--expert-formats", "bf16,q3"], "--expert-formats: unknown expert "
                                                                             "format 'q3'"),
                                           (["--routed", "pair,fast"], "--routed: 'pair,fast': each must be")])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench().parse(argv)
    assert message in capsys.readouterr().err


def test_defaults_are_the_issue_s_grid():
    args = _bench().parse([])
    assert (args.layers, args.vocab, args.batches, args.contexts) == (8, 151936, [1, 4], [1024, 8192, 32768, 131072])
    assert (args.expert_formats, args.routed) == (["bf16"], ["pair"])


def test_formats_and_routed_kernels_are_lists_without_repeats():
    args = _bench().parse(["--expert-formats", "int4, nvfp4,int4", "--routed", "mma,pair,mma"])
    assert (args.expert_formats, args.routed) == (["int4", "nvfp4"], ["mma", "pair"])
