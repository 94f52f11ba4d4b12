"""A tiny servable checkpoint of every family: random transformers weights, a word-level tokenizer, a chat
template; the serving tests and benchmarks/server_faults.py serve it.

    transformers Qwen2MoeForCausalLM (as tests/moe/engine/test_model.py builds it) ─save_pretrained─► dir
    tokenizers WordLevel over the model's 128 ids ─► dir/tokenizer.json
    dir/tokenizer_config.json: eos_token <|im_end|>, a ChatML-like chat_template

Vocabulary: 0 <unk>, 1 <|endoftext|>, 2 <|im_start|>, 3 <|im_end|> (special), 4 user, 5 assistant,
6 system, 7..127 the words w7..w127. Decoding joins words with spaces. The lm_head rows of the
special tokens are zero, so their logit is 0 while the words' spread over about ±6: greedy decoding
never picks eos, and every greedy request runs to max_tokens (tests of eos pass eos ids explicitly).
Model: 3 layers (layer 1 dense), 8 experts top-2, shared expert: 2 MoE layers, 16 cache keys. The other
families (FAMILY_CONFIGS) take the same sizes in their own classes: qwen3_moe (q / k norms, no shared
expert), qwen3_next (linear / dense-MLP full / linear attention, head_dim 32 half rotated) and gpt_oss
(sliding / full / sliding attention with sinks, YaRN, biased experts) and glm4_moe (layer 0 dense, grouped
sigmoid routing, an ungated shared expert, half-rotated heads), mixtral (every layer MoE, softmax over the
top-2, the release's w1 / w3 / w2 expert names) and olmoe (whole-projection q / k norms, top-2 of 8 not
renormalised); gpt_oss's tokenizer has the harmony
specials (<|start|>, <|end|>, <|message|>, <|channel|>, <|return|>, <|call|>) and a harmony chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB = 128
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(7, VOCAB)]
EOS = 3
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
# gpt-oss's harmony format, as its released template writes it: a system message (identity, dates,
# reasoning effort, channels), the request's system message as the developer's instructions, each turn
# as <|start|>role<|message|>text<|end|>, an assistant turn on a channel (its `thinking` on analysis
# where it follows the last user turn), and <|start|>assistant to generate. Written for these tests.
HARMONY_SPECIALS = ["<unk>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                    "<|call|>"]
HARMONY_WORDS = ["system", "developer", "user", "assistant", "analysis", "final", "Reasoning:", "low", "medium",
                 "high", "#", "Instructions", "Current", "date:"]
HARMONY_TEMPLATE = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}

Reasoning: {{ reasoning_effort | default('medium') }}<|end|>
{%- if messages and messages[0]['role'] in ('system', 'developer') -%}
<|start|>developer<|message|># Instructions

{{ messages[0]['content'] }}<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'user' -%}
<|start|>user<|message|>{{ m['content'] }}<|end|>
{%- elif m['role'] == 'assistant' -%}
{%- if m.get('thinking') and loop.index0 > ns.last_user -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>
{%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>
{%- elif m['role'] not in ('system', 'developer') -%}
{{ raise_exception('role ' ~ m['role'] ~ ' is not one this template writes') }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[1])

FAMILY_CONFIGS = {
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, CONFIG),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {**CONFIG, "head_dim": 16, "mlp_only_layers": [1]}),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   {**CONFIG, "head_dim": 32, "partial_rotary_factor": 0.5,
                    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16}),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM,
                {**{k: v for k, v in CONFIG.items() if k not in ("shared_expert_intermediate_size", "mlp_only_layers")},
                 "intermediate_size": 32, "num_local_experts": 8, "head_dim": 16, "sliding_window": 4,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                     "original_max_position_embeddings": 16, "truncate": False}}),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM,
                 {**{k: v for k, v in CONFIG.items() if k not in ("num_experts", "shared_expert_intermediate_size",
                                                                  "mlp_only_layers")},
                  "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                  "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "head_dim": 16}),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {**{k: v for k, v in CONFIG.items() if k not in ("num_experts", "shared_expert_intermediate_size",
                                                                 "mlp_only_layers")},
                 "num_local_experts": 8, "intermediate_size": 32, "sliding_window": None}),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM,
              {**{k: v for k, v in CONFIG.items() if k not in ("shared_expert_intermediate_size", "mlp_only_layers")},
               "intermediate_size": 32}),
}


def write_tokenizer(path, harmony: bool = False) -> None:
    """tokenizer.json (WordLevel, whitespace split, specials added) and tokenizer_config.json; with
    `harmony` (gpt-oss) the harmony specials and template, and generation_config.json's eos ids
    <|return|> and <|call|> as gpt-oss's release lists them."""
    specials = HARMONY_SPECIALS if harmony else SPECIALS
    words = HARMONY_WORDS + [f"w{i}" for i in range(7, VOCAB - len(specials) - len(HARMONY_WORDS) + 7)] if harmony \
        else WORDS
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    if harmony:
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "chat_template": HARMONY_TEMPLATE}))
        gen = (
            json.loads((path / "generation_config.json").read_text())
            if (path / "generation_config.json").exists()
            else {}
        )
        (path / "generation_config.json").write_text(json.dumps(
            {**gen, "eos_token_id": [vocab["<|return|>"], vocab["<|call|>"]]}))
        return
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))


def make_tiny_checkpoint(path: Path, family: str = "qwen2_moe") -> Path:
    """Write the tiny random checkpoint of `family` (a FAMILY_CONFIGS key) with its tokenizer into `path`;
    returns it."""
    config_cls, model_cls, config = FAMILY_CONFIGS[family]
    model = model_cls(config_cls(**config)).eval()
    randomize(model, seed=7)
    harmony = family == "gpt_oss"
    with torch.no_grad():
        model.lm_head.weight[: len(HARMONY_SPECIALS if harmony else SPECIALS)] = 0
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, harmony)
    return path


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter (norm scales around 1, biases too) so no term of the math is trivial. A
    (1 + w) RMSNorm (Qwen3-Next's, all but its linear attention's gated norm) gets w around 0, so its
    scale is around 1 as every other family's."""
    gen = torch.Generator().manual_seed(seed)
    one_plus = getattr(model.config, "model_type", "") == "qwen3_next"
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((0 if one_plus and "linear_attn" not in name else 1) + 0.2 * noise)
            else:
                p.copy_(0.3 * noise)
        for name, b in model.named_buffers():  # GLM-4.5's e_score_correction_bias, about a score's spread
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
