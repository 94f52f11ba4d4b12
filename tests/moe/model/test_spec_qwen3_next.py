"""ModelSpec.from_hf for qwen3_next: the fields of its mixed linear / full attention stack read as transformers
reads them (layer_types or full_attention_interval, partial_rotary_factor from rope_parameters or the top level,
the linear_* shape, norm_topk_prob's default), and bad values refused naming the key, checked against
transformers' own Qwen3NextConfig where it decides."""

from __future__ import annotations

import pytest
from transformers import Qwen3NextConfig

from moe.model.errors import CheckpointError
from moe.model.spec import FULL, LINEAR, ModelSpec
from moe.testing.random_decoder import qwen3_next

TINY = dict(qwen3_next(8, vocab_size=64), hidden_size=64, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8)


def _spec(**edits) -> ModelSpec:
    config = {**TINY, **edits}
    return ModelSpec.from_hf({k: v for k, v in config.items() if v is not None})


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 8])
def test_layer_types_from_the_interval_are_transformers_own(interval):
    spec = _spec(full_attention_interval=interval)
    config = Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=interval)
    assert list(spec.layer_types) == config.layer_types
    assert spec.full_layers == tuple(i for i in range(8) if (i + 1) % interval == 0)
    assert set(spec.linear_layers) | set(spec.full_layers) == set(range(8))
    assert (spec.linear is None) == (interval == 1)


def test_the_default_is_every_fourth_layer_full_and_a_quarter_rotated():
    spec = _spec(full_attention_interval=None, partial_rotary_factor=None)
    assert spec.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert spec.rotary_dim == 8 and spec.attn_gate and spec.norm_one_plus and spec.qk_norm
    assert (spec.linear.key_heads, spec.linear.value_heads, spec.linear.key_dim, spec.linear.value_dim,
            spec.linear.conv_kernel) == (2, 4, 8, 8, 4)


def test_explicit_layer_types_and_rope_parameters_win():
    types = [FULL, LINEAR, LINEAR, FULL, LINEAR, FULL, LINEAR, LINEAR]
    spec = _spec(layer_types=types, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.5})
    assert list(spec.layer_types) == types and spec.rotary_dim == 16 and spec.rope_theta == 1e4


@pytest.mark.parametrize("given, want", [(None, True), (False, False), (True, True)])
def test_norm_topk_prob_defaults_to_true_as_transformers_config(given, want):
    assert Qwen3NextConfig().norm_topk_prob is True
    assert _spec(norm_topk_prob=given).moe.norm_topk_prob is want


def test_the_other_families_are_unchanged():
    spec = ModelSpec.from_hf({**TINY, "model_type": "qwen2_moe"})
    assert spec.layer_types == (FULL,) * 8 and spec.rotary_dim == 32 and spec.linear is None
    assert not spec.attn_gate and not spec.norm_one_plus and spec.moe.norm_topk_prob


@pytest.mark.parametrize("edit, pattern", [
    ({"layer_types": [FULL] * 7}, r"layer_types must list 'full_attention' or 'linear_attention' for each of the 8"),
    ({"layer_types": [FULL] * 7 + ["sliding_attention"]}, r"layer_types must list .* got \[.*'sliding_attention'\]"),
    ({"full_attention_interval": 0}, r"full_attention_interval must be an int >= 1, got 0"),
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor must be in \(0, 1\], got 0"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\], got 1\.5"),
    ({"partial_rotary_factor": 0.01}, r"partial_rotary_factor gives 0 rotated dims of head_dim=32"),
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    ({"linear_key_head_dim": 0}, r"linear_key_head_dim must be >= 1, got 0"),
])
def test_bad_qwen3_next_fields_are_refused_naming_the_key(edit, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        _spec(**edit)
