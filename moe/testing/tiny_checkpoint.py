"""A tiny servable checkpoint of every family: random transformers weights, a word-level tokenizer, a chat
template; the serving tests and benchmarks/server_faults.py serve it.

    transformers Qwen2MoeForCausalLM (as tests/moe/engine/test_model.py builds it) ─save_pretrained─► dir
    tokenizers WordLevel over the model's 128 ids ─► dir/tokenizer.json
    dir/tokenizer_config.json: eos_token <|im_end|>, a ChatML-like chat_template (TEMPLATES: qwen3_moe and
        qwen3_next Qwen3's, glm4_moe GLM-4.5's, gpt_oss a harmony one; each writes tools and tool calls
        as the family's release does)

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
`words` adds vocabulary (a tool call's pieces, for tests that script one) in place of the last w-words.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
# Qwen3's template (Qwen3-30B-A3B, Qwen3-Next) without its thinking branches: the system message with the
# tools (their instructions as the release writes them), each turn as <|im_start|>role\ntext<|im_end|>, an
# assistant turn's calls as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, tool results as a
# user turn of <tool_response> blocks, and <|im_start|>assistant\n to generate. The tool parts are the release's
# (its long strings written in pieces).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": " }}
    {{- "<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
# GLM-4.5's template (GLM-4.5-Air) without its thinking branches and content-part handling: [gMASK]<sop>,
# the tools in a system turn (the release's instructions), <|role|>\ntext turns, an assistant turn's empty
# thinking and its calls as <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>
# (the arguments a mapping), tool results as <|observation|> <tool_response> blocks, <|assistant|> to
# generate. The tool parts are the release's.
GLM_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{{- '\n<think></think>' }}
{%- if m.content.strip() -%}
{{ '\n' + m.content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- elif m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>
{%- endif -%}"""
# gpt-oss's harmony format, as its released template writes it: a system message (dates, reasoning effort,
# the tools' channel), the request's system message as the developer's instructions with the tools as a
# TypeScript namespace `functions` (scalar parameter types only), each turn as <|start|>role<|message|>text
# <|end|>, an assistant turn on a channel (its `thinking` on analysis where it follows the last user turn),
# a call as <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>, its result
# as <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"..."<|end|>, and <|start|>assistant
# to generate (a call's content on analysis unless a final answer follows). Written for these tests; the
# tool parts follow the release's.
HARMONY_SPECIALS = ["<unk>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                    "<|call|>"]
HARMONY_WORDS = ["system", "developer", "user", "assistant", "analysis", "final", "Reasoning:", "low", "medium",
                 "high", "#", "Instructions", "Current", "date:"]
HARMONY_TEMPLATE = """{%- macro render_type(spec) -%}
{%- if spec.type == "string" and spec.enum -%}{{- '"' + spec.enum|join('" | "') + '"' -}}
{%- elif spec.type in ("string", "boolean") -%}{{- spec.type -}}
{%- elif spec.type in ("number", "integer") -%}{{- "number" -}}
{%- else -%}{{- "any" -}}
{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\\n\\n" }}
    {{- "namespace " + namespace_name + " {\\n\\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + tool.description + "\\n" }}
        {{- "type "+ tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}
                    {{- "// " + param_spec.description + "\\n" }}
                {%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{- render_type(param_spec) }}
                {{- ",\\n" }}
            {%- endfor %}
            {{- "}) => any;\\n\\n" }}
        {%- else -%}
            {{- "() => any;\\n\\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1, last_tool=none) -%}
{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}

Reasoning: {{ reasoning_effort | default('medium') }}
{%- if tools %}

Calls to these tools must go to the commentary channel: 'functions'.
{%- endif -%}
<|end|>
{%- set instructions = messages and messages[0]['role'] in ('system', 'developer') -%}
{%- if instructions or tools -%}
<|start|>developer<|message|>
{%- if instructions -%}
# Instructions

{{ messages[0]['content'] }}{{ "\\n\\n" }}
{%- endif -%}
{%- if tools -%}
# Tools

{{ render_tool_namespace("functions", tools) }}
{%- endif -%}
<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m['role'] == 'user' -%}
<|start|>user<|message|>{{ m['content'] }}<|end|>
{%- elif m['role'] == 'assistant' and 'tool_calls' in m -%}
{%- set later = namespace(final=false) -%}
{%- for future in messages[loop.index:] -%}
{%- if future['role'] == 'assistant' and 'tool_calls' not in future -%}{%- set later.final = true -%}{%- endif -%}
{%- endfor -%}
{%- set call = m['tool_calls'][0] -%}
{%- if call.function -%}{%- set call = call.function -%}{%- endif -%}
{%- if m['content'] and not later.final -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m['content'] }}<|end|>
{%- endif -%}
{{- "<|start|>assistant to=" }}
{{- "functions." + call.name + "<|channel|>commentary " }}
{{- "json<|message|>" }}
{{- call.arguments|tojson }}
{{- "<|call|>" }}
{%- set ns.last_tool = call.name -%}
{%- elif m['role'] == 'assistant' -%}
{%- if m.get('thinking') and loop.index0 > ns.last_user -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>
{%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>
{%- set ns.last_tool = none -%}
{%- elif m['role'] == 'tool' -%}
{%- if ns.last_tool is none -%}
{{ raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
{%- endif -%}
{{- "<|start|>functions." + ns.last_tool }}
{{- " to=assistant<|channel|>commentary<|message|>" + m['content']|tojson + "<|end|>" }}
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


TEMPLATES = {"qwen3_moe": QWEN3_TEMPLATE, "qwen3_next": QWEN3_TEMPLATE, "glm4_moe": GLM_TEMPLATE,
             "gpt_oss": HARMONY_TEMPLATE}


def write_tokenizer(path, harmony: bool = False, template: str | None = None, words: Sequence[str] = ()) -> None:
    """tokenizer.json (WordLevel, whitespace split, specials added) and tokenizer_config.json with
    `template` (default CHAT_TEMPLATE); with `harmony` (gpt-oss) the harmony specials and template, and
    generation_config.json's eos ids <|return|> and <|call|> as gpt-oss's release lists them. `words` come
    after the specials and the role words, in place of as many of the last w-words."""
    specials = HARMONY_SPECIALS if harmony else SPECIALS
    named = [*(HARMONY_WORDS if harmony else WORDS[:3]), *words]
    vocab = {tok: i for i, tok in enumerate(specials + named + [f"w{i}" for i in range(7, 7 + VOCAB - len(specials)
                                                                                          - len(named))])}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    if harmony:
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "chat_template": template or HARMONY_TEMPLATE}))
        gen = (
            json.loads((path / "generation_config.json").read_text())
            if (path / "generation_config.json").exists()
            else {}
        )
        (path / "generation_config.json").write_text(json.dumps(
            {**gen, "eos_token_id": [vocab["<|return|>"], vocab["<|call|>"]]}))
        return
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": template or CHAT_TEMPLATE}))


def make_tiny_checkpoint(path: Path, family: str = "qwen2_moe", words: Sequence[str] = ()) -> Path:
    """Write the tiny random checkpoint of `family` (a FAMILY_CONFIGS key) with its tokenizer (and extra
    `words`) into `path`; returns it."""
    config_cls, model_cls, config = FAMILY_CONFIGS[family]
    model = model_cls(config_cls(**config)).eval()
    randomize(model, seed=7)
    harmony = family == "gpt_oss"
    with torch.no_grad():
        model.lm_head.weight[: len(HARMONY_SPECIALS if harmony else SPECIALS)] = 0
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, harmony, TEMPLATES.get(family), words)
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
