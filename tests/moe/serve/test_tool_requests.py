"""A chat request with tools, from its body to its prompt (openai_schema, openai_api.prepare_chat).

    body ──parse_body──► 400 naming the field of every malformed tool, tool_choice, tool call and tool result
    messages + tools ──each tiny family's chat template (Qwen3's, GLM-4.5's, harmony)──► the same text as
        transformers' apply_chat_template, the history's calls in the family's syntax (arguments given as
        JSON text reach the template as a mapping), which the family's parser reads back
    tool_choice ──prepare_chat──► "none": tools rendered, nothing parsed; "auto": the reply parsed;
        "required" / named: the family's call opening after the generation prompt; a template without a
        call syntax: tools refused (400 naming tools) unless tool_choice is "none"
"""

from __future__ import annotations

import json

import pytest

from moe.serve.harmony import harmony_ids
from moe.serve.openai_api import prepare_chat
from moe.serve.openai_schema import ApiError, ChatBody, parse_body
from moe.serve.tokenizer import TextTokenizer
from moe.serve.tools import ToolSyntax, parse_glm, parse_hermes, parse_json_call
from moe.testing.tiny_checkpoint import TEMPLATES, write_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8 w9"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "w10"}]
USER = [{"role": "user", "content": "w8"}]


def _body(messages=USER, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def _parse(raw: bytes) -> ChatBody:
    return parse_body(ChatBody, raw)


BAD = [
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "d"}}]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get.weather"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 1}}}}]},
     "tools.0.function.parameters.properties"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "w8", "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]}, "messages.0.tool_calls.0.type"),
    ({"messages": HISTORY[:3] + [{"role": "tool", "content": "w10"}]}, "messages.3.tool_call_id"),
    ({"messages": HISTORY[:3] + [{"role": "tool", "tool_call_id": "call_2", "content": "w10"}]},
     "messages.3.tool_call_id"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "w10"}] + HISTORY}, "messages.0.tool_call_id"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_malformed_tool_fields_are_refused_by_name(case):
    extra, param = BAD[case]
    with pytest.raises(ApiError) as e:
        _parse(_body(**extra))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    assert e.value.message.startswith(param + ": ")


def test_the_errors_say_what_is_wrong():
    def message(**extra) -> str:
        with pytest.raises(ApiError) as e:
            _parse(_body(**extra))
        return e.value.message

    assert message(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "now"}}) == \
        "tool_choice: function 'now' is not in tools"
    assert "is already the name of tools.0" in message(tools=[WEATHER, WEATHER])
    assert "'call_2' is not the id of a tool call of an earlier assistant message" in message(
        messages=HISTORY[:3] + [{"role": "tool", "tool_call_id": "call_2", "content": "w10"}])
    with pytest.raises(ApiError) as e:  # the legacy function-calling fields stay unimplemented
        _parse(_body(functions=[WEATHER["function"]]))
    assert (e.value.param, e.value.code) == ("functions", "unsupported_parameter")


def _tokenizer(tmp_path, family: str | None) -> TextTokenizer:
    write_tokenizer(tmp_path, harmony=family == "gpt_oss", template=TEMPLATES.get(family))
    return TextTokenizer(tmp_path)


# the call of HISTORY as each family's template writes it, and how to read its body back
RENDERED = {
    "qwen3_moe": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                  lambda t: parse_hermes(t.split("<tool_call>")[1].split("</tool_call>")[0], {"get_weather": {}})),
    "glm4_moe": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                 lambda t: parse_glm(t.split("<tool_call>")[1].split("</tool_call>")[0], {"get_weather": {}})),
    "gpt_oss": ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                "<|call|>", lambda t: parse_json_call("get_weather", t.split("<|message|>")[1].split("<|call|>")[0],
                                                      {"get_weather": {}})),
}
RENDERED["qwen3_next"] = RENDERED["qwen3_moe"]


@pytest.mark.parametrize("family", sorted(RENDERED))
def test_each_template_renders_tools_and_calls_as_transformers_does(family, tmp_path):
    from transformers import AutoTokenizer

    tok = _tokenizer(tmp_path, family)
    body = _parse(_body(HISTORY, tools=[WEATHER, NOW]))
    messages, tools = [m.as_dict() for m in body.messages], body.tool_dicts()
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a mapping, not text
    text = tok.render_chat(messages, tools)
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tools=tools, tokenize=False,
                                                                        add_generation_prompt=True)
    assert text == want
    call, read_back = RENDERED[family]
    assert call in text and (read_back(call).name, json.loads(read_back(call).arguments)) == (
        "get_weather", {"city": "Paris"})
    assert "Weather of a city" in text and "The time" in text  # both tools described
    assert "w10" in text and text.count("get_weather") >= 2
    assert "get_weather" not in tok.render_chat(messages[:2])  # without tools, none is described
    bare = _parse(_body(USER, tools=[{"type": "function", "function": {"name": "now"}}])).tool_dicts()
    assert bare == [{"type": "function", "function": {"name": "now", "description": ""}}]
    assert "now" in tok.render_chat(USER, bare)  # every template renders a tool without a description


def _prepare(tok: TextTokenizer, **extra):
    return prepare_chat(_body(**extra), tok, served="m", max_seq_len=256)


def _prompt(tok: TextTokenizer, suffix: str = "", tools=(WEATHER,)) -> list[int]:
    return tok.encode(tok.render_chat(USER, list(tools) or None) + suffix, add_special_tokens=False)


def test_tool_choice_decides_the_prompt_and_the_parsing(tmp_path):
    tok = _tokenizer(tmp_path, "qwen3_moe")
    auto = _prepare(tok, tools=[WEATHER])
    assert auto.prompt == _prompt(tok) and auto.tools.syntax is ToolSyntax.HERMES and auto.tools.seed == ""
    assert auto.tools.parallel and set(auto.tools.schemas) == {"get_weather"}
    assert _prepare(tok, tools=[WEATHER], parallel_tool_calls=False).tools.parallel is False
    required = _prepare(tok, tools=[WEATHER], tool_choice="required")
    assert required.prompt == _prompt(tok, "<tool_call>\n") and required.tools.seed == "<tool_call>\n"
    named = _prepare(tok, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named.prompt == _prompt(tok, opening) and named.tools.seed == opening
    none = _prepare(tok, tools=[WEATHER], tool_choice="none")
    assert none.prompt == _prompt(tok) and none.tools is None  # described to the model, not parsed
    assert _prepare(tok, tools=[]).tools is None and _prepare(tok).prompt == _prompt(tok, tools=())


def test_forced_openings_of_glm_and_harmony(tmp_path):
    (tmp_path / "glm").mkdir()
    (tmp_path / "oss").mkdir()
    glm = _tokenizer(tmp_path / "glm", "glm4_moe")
    prep = _prepare(glm, tools=[WEATHER], tool_choice="required")
    assert prep.prompt == _prompt(glm, "\n<think></think>\n<tool_call>") and prep.tools.syntax is ToolSyntax.GLM
    assert prep.tools.seed == "<tool_call>"
    harmony = _tokenizer(tmp_path / "oss", "gpt_oss")
    assert harmony_ids(harmony) is not None
    prep = _prepare(harmony, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    opening = " to=functions.get_weather<|channel|>commentary json<|message|>"
    assert prep.prompt == _prompt(harmony, opening) and prep.channels and prep.tools.seed == opening


def test_a_template_without_a_call_syntax_refuses_tools(tmp_path):
    tok = _tokenizer(tmp_path, None)  # the tiny ChatML-like template (qwen2_moe, mixtral, olmoe)
    with pytest.raises(ApiError) as e:
        _prepare(tok, tools=[WEATHER])
    assert (e.value.status, e.value.param) == (400, "tools") and "tool_choice \"none\"" in e.value.message
    assert _prepare(tok, tools=[WEATHER], tool_choice="none").tools is None
