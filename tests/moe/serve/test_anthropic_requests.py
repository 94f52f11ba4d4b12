"""An Anthropic Messages request, from its body to its prompt (anthropic_schema, anthropic_api).

    body ──parse_messages──► 400 naming the field of every malformed or unsupported part, in Anthropic's
        error form (anthropic_error: the type by HTTP status)
    a conversation with system blocks, text blocks, tool_use, tool_result and tools ──prepare_messages──►
        the same prompt ids, sampling params and tool parsing as the equivalent /v1/chat/completions body
        (prepare_chat), for each family's chat template and every tool_choice
    a last assistant message ──► its text after the generation prompt (refused in harmony); thinking
        accepted only where the model has a reasoning channel; max_tokens clipped to the context
    count_tokens ──► the length of the prompt prepare_messages renders, past the context too
"""

from __future__ import annotations

import json

import pytest

from moe.serve.anthropic_api import chat_body, count_tokens, prepare_messages
from moe.serve.anthropic_schema import CountBody, MessagesBody, anthropic_error, error_body, parse_messages
from moe.serve.openai_api import prepare_chat
from moe.serve.openai_schema import ApiError, ChatBody, parse_body
from moe.serve.tokenizer import TextTokenizer
from moe.testing.tiny_checkpoint import TEMPLATES, write_tokenizer

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                            "required": ["city"]}}
NOW = {"name": "now", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "w13"}]}
USER = [{"role": "user", "content": "w8"}]
# a conversation, and the same one as an OpenAI chat body
CONVERSATION = {
    "system": [{"type": "text", "text": "w7 "}, {"type": "text", "text": "w8", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "w9 "}, {"type": "text", "text": "w10"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "w11", "signature": "x"},
                                          {"type": "text", "text": "w12"}, USE]},
        {"role": "user", "content": [{**RESULT, "is_error": False}, {"type": "text", "text": "w14"}]},
        {"role": "assistant", "content": "w15"},
        {"role": "user", "content": "w16"}],
    "tools": [WEATHER, NOW], "stop_sequences": ["w99"], "temperature": 0.5, "top_p": 0.9, "max_tokens": 20,
    "metadata": {"user_id": "u"}}
OPENAI = {
    "messages": [
        {"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9 w10"},
        {"role": "assistant", "content": "w12", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "w13"}, {"role": "user", "content": "w14"},
        {"role": "assistant", "content": "w15"}, {"role": "user", "content": "w16"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": WEATHER["input_schema"]}},
              {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}],
    "stop": ["w99"], "temperature": 0.5, "top_p": 0.9, "max_tokens": 20}


def _raw(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def _body(messages=USER, **extra) -> bytes:
    return _raw(**{"max_tokens": 16, "messages": messages, **extra})


def _history(*tail) -> list[dict]:
    return [*USER, {"role": "assistant", "content": [USE]}, *tail]


BAD = [
    (_raw(messages=USER), "max_tokens"),
    (_body(max_tokens=0), "max_tokens"),
    (_body([]), "messages"),
    (_body([{"role": "system", "content": "w8"}]), "messages.0.role"),
    (_body([{"role": "user", "content": []}]), "messages.0.content"),
    (_body([{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages.0.content.0.type"),
    (_body([{"role": "user", "content": [{"text": "w8"}]}]), "messages.0.content.0.type"),
    (_body([{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (_body([{"role": "user", "content": [{"type": "text", "text": "w8", "citations": [1]}]}]),
     "messages.0.content.0.citations"),
    (_body([{"role": "user", "content": [USE]}]), "messages.0.content.0.type"),
    (_body([*USER, {"role": "assistant", "content": [RESULT]}, *USER]), "messages.1.content.0.type"),
    (_body(_history({"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_2"}]})),
     "messages.2.content.0.tool_use_id"),
    (_body([{"role": "user", "content": [RESULT]}]), "messages.0.content.0.tool_use_id"),
    (_body(_history({"role": "user", "content": [{**RESULT, "content": [{"type": "image"}]}]})),
     "messages.2.content.0.content.0.type"),
    (_body([*USER, {"role": "assistant", "content": [{**USE, "input": "Paris"}]}, *USER]),
     "messages.1.content.0.input"),
    (_body([*USER, {"role": "assistant", "content": "w9 "}]), "messages.1.content"),
    (_body(_history()), "messages.1.content.0.type"),
    (_body(tools=[{**WEATHER, "name": "get.weather"}]), "tools.0.name"),
    (_body(tools=[WEATHER, WEATHER]), "tools.1.name"),
    (_body(tools=[{"name": "f"}]), "tools.0.input_schema"),
    (_body(tools=[{"name": "f", "input_schema": {"type": "array"}}]), "tools.0.input_schema.type"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
    (_body(tool_choice={"type": "any"}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice.name"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "now"}), "tool_choice.name"),
    (_body(tools=[WEATHER], tool_choice={"type": "auto", "name": "get_weather"}), "tool_choice.name"),
    (_body(stop_sequences=["w1", "w2", "w3", "w4", "w5"]), "stop_sequences"),
    (_body(stop_sequences=["w" * 300]), "stop_sequences"),
    (_body(temperature=1.5), "temperature"),
    (_body(top_p=0), "top_p"),
    (_body(top_k=40), "top_k"),
    (_body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (_body(thinking={"type": "on"}), "thinking.type"),
    (_body(system=[{"type": "image"}]), "system.0.type"),
    (_body(metadata={"user": "u"}), "metadata.user"),
    (_body(stream="yes"), "stream"),
    (_body(n=2), "n"),
    (_body(container="c1"), "container"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_malformed_fields_are_refused_by_name(case):
    raw, param = BAD[case]
    with pytest.raises(ApiError) as e:
        parse_messages(MessagesBody, raw)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(param + ": ")
    assert anthropic_error(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                   "message": e.value.message}}


def test_the_errors_say_what_is_wrong():
    def message(raw: bytes, model=MessagesBody) -> str:
        with pytest.raises(ApiError) as e:
            parse_messages(model, raw)
        return e.value.message

    assert "samples with temperature and top_p only" in message(_body(top_k=40))
    assert "'image' blocks are not supported" in message(_body([{"role": "user", "content": [{"type": "image"}]}]))
    assert "'toolu_2' is not the id of a tool_use block of an earlier assistant message" in message(
        _body(_history({"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_2"}]})))
    assert "user messages hold text, tool_result blocks, not tool_use" in message(
        _body([{"role": "user", "content": [USE]}]))
    assert message(_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "now"})) == \
        "tool_choice.name: 'now' is not the name of a tool in tools"
    assert "unknown field" in message(_raw(messages=USER, max_tokens=16), CountBody)  # count_tokens takes no max_tokens
    assert parse_messages(MessagesBody, _body(service_tier="auto", mcp_servers=[], container=None)).max_tokens == 16


def test_errors_take_anthropic_s_form_under_v1_messages_only():
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (405, "invalid_request_error"), (413, "request_too_large"), (415, "invalid_request_error"),
                         (500, "api_error"), (503, "overloaded_error")):
        err = ApiError(status, "what went wrong", param="x")
        assert error_body("/v1/messages", err) == {"type": "error",
                                                   "error": {"type": kind, "message": "what went wrong"}}
        assert error_body("/v1/messages/count_tokens", err)["error"]["type"] == kind
        assert error_body("/v1/chat/completions", err) == err.body()
    assert error_body("/v1/messagesx", ApiError(404, "x")) == ApiError(404, "x").body()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> a TextTokenizer with its tiny chat template (None: the plain ChatML-like one, no tool syntax)."""
    made = {}
    for family in ("qwen3_moe", "glm4_moe", "gpt_oss", None):
        path = tmp_path_factory.mktemp(f"tok-{family}")
        write_tokenizer(path, harmony=family == "gpt_oss", template=TEMPLATES.get(family))
        made[family] = TextTokenizer(path)
    return made


CHOICES = [(None, None), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
           ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
           ({"type": "none"}, "none"), ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
           ({"type": "any", "disable_parallel_tool_use": True}, "required")]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss"])
@pytest.mark.parametrize("choice", range(len(CHOICES)))
def test_a_conversation_gives_the_chat_path_s_prompt_and_params(tokenizers, family, choice):
    tok = tokenizers[family]
    anthropic, openai = CHOICES[choice]
    extra_a = {} if anthropic is None else {"tool_choice": anthropic}
    extra_o = {} if openai is None else {"tool_choice": openai}
    if anthropic is not None and anthropic.get("disable_parallel_tool_use"):
        extra_o["parallel_tool_calls"] = False
    got = prepare_messages(_raw(**CONVERSATION, **extra_a), tok, served="m", max_seq_len=1024)
    want = prepare_chat(_raw(**OPENAI, **extra_o), tok, served="m", max_seq_len=1024)
    assert got.prep == want and got.max_tokens == 20 and not got.thinking
    assert want.params.temperature == 0.5 and want.params.stop == ("w99",) and want.params.max_tokens == 20
    assert "w11" not in tok.decode(got.prep.prompt)  # an earlier turn's thinking is not rendered
    chat, prefill = chat_body(parse_messages(MessagesBody, _raw(**CONVERSATION, **extra_a)))
    openai_body = parse_body(ChatBody, _raw(**OPENAI, **extra_o))
    assert [m.as_dict() for m in chat.messages] == [m.as_dict() for m in openai_body.messages] and prefill == ""
    assert chat.tool_dicts() == openai_body.tool_dicts()  # what the template gets, to the character
    assert count_tokens(_raw(**{k: v for k, v in CONVERSATION.items() if k in CountBody.model_fields}, **extra_a),
                        tok, served="m") == len(got.prep.prompt)


def test_a_template_without_a_call_syntax_refuses_tools_as_the_chat_path_does(tokenizers):
    tok = tokenizers[None]
    with pytest.raises(ApiError) as e:
        prepare_messages(_body(tools=[WEATHER]), tok, served="m", max_seq_len=256)
    assert (e.value.status, e.value.param) == (400, "tools")
    plain = prepare_messages(_body(tools=[WEATHER], tool_choice={"type": "none"}), tok, served="m", max_seq_len=256)
    assert plain.prep.tools is None and plain.prep.prompt == tok.encode_chat(USER)


def test_a_last_assistant_message_is_the_start_of_the_reply(tokenizers):
    tok = tokenizers["qwen3_moe"]
    body = _body([*USER, {"role": "assistant", "content": [{"type": "text", "text": "w20 "},
                                                           {"type": "text", "text": "w21"}]}])
    got = prepare_messages(body, tok, served="m", max_seq_len=256)
    assert got.prep.prompt == tok.encode(tok.render_chat(USER) + "w20 w21", add_special_tokens=False)
    forced = prepare_messages(_body([*USER, {"role": "assistant", "content": "w20"}], tools=[WEATHER],
                                    tool_choice={"type": "any"}), tok, served="m", max_seq_len=256)
    assert forced.prep.prompt == tok.encode(tok.render_chat(USER, [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER["input_schema"]}}]) +
        "w20<tool_call>\n", add_special_tokens=False)
    assert forced.prep.tools.seed == "<tool_call>\n"
    for messages, tokenizer, param in (([{"role": "assistant", "content": "w20"}], tok, "messages"),
                                       ([*USER, {"role": "assistant", "content": "w20"}], tokenizers["gpt_oss"],
                                        "messages.1")):
        with pytest.raises(ApiError) as e:
            prepare_messages(_body(messages), tokenizer, served="m", max_seq_len=256)
        assert (e.value.status, e.value.param) == (400, param)


def test_thinking_needs_a_reasoning_channel(tokenizers):
    enabled = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(ApiError) as e:
        prepare_messages(_body(thinking=enabled), tokenizers["qwen3_moe"], served="m", max_seq_len=256)
    assert (e.value.status, e.value.param) == (400, "thinking.type") and '"disabled"' in e.value.message
    off = prepare_messages(_body(thinking={"type": "disabled"}), tokenizers["qwen3_moe"], served="m", max_seq_len=256)
    assert not off.thinking
    for thinking in (enabled, {"type": "adaptive"}):
        harmony = prepare_messages(_body(thinking=thinking), tokenizers["gpt_oss"], served="m", max_seq_len=256)
        assert harmony.thinking and harmony.prep.channels
    assert not prepare_messages(_body(), tokenizers["gpt_oss"], served="m", max_seq_len=256).thinking


def test_max_tokens_is_clipped_to_the_context_and_the_model_is_checked(tokenizers):
    tok = tokenizers["qwen3_moe"]
    got = prepare_messages(_body(max_tokens=32000), tok, served="m", max_seq_len=256)
    assert got.max_tokens == 32000 and got.prep.params.max_tokens == 256 - len(got.prep.prompt)
    assert got.prep.params.temperature == 1.0 and got.prep.params.top_p == 1.0  # Anthropic's defaults
    with pytest.raises(ApiError) as e:
        prepare_messages(_body([{"role": "user", "content": "w9 " * 300}]), tok, served="m", max_seq_len=256)
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")
    with pytest.raises(ApiError) as e:
        prepare_messages(_body(), tok, served="other", max_seq_len=256)
    assert (e.value.status, anthropic_error(e.value)["error"]["type"]) == (404, "not_found_error")
    with pytest.raises(ApiError) as e:
        count_tokens(_raw(messages=USER), tok, served="other")
    assert e.value.status == 404


def test_count_tokens_counts_past_the_context(tokenizers):
    tok = tokenizers["qwen3_moe"]
    long = [{"role": "user", "content": "w9 " * 300}]
    assert count_tokens(_raw(messages=long), tok, served="m") == len(tok.encode_chat(long)) > 300
    assert count_tokens(_raw(messages=USER, system="w7"), tok, served="m") == len(
        tok.encode_chat([{"role": "system", "content": "w7"}, *USER]))


BILLING = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};"


@pytest.mark.parametrize("hash_", ["eb6c6", "74943"])
def test_claude_codes_billing_line_is_dropped_from_the_system_prompt(tokenizers, hash_):
    """The per-request billing line, as a block of its own or the first line of a string, renders to the
    prompt of the same system prompt without it (so a resent conversation keeps its prefix); the same
    words anywhere else are kept."""
    tok = tokenizers["qwen3_moe"]
    want = count_tokens(_raw(messages=USER, system="w7 w8"), tok, served="m")
    block = [{"type": "text", "text": BILLING.format(hash_)}, {"type": "text", "text": "w7 w8"}]
    for system in (block, BILLING.format(hash_) + "\nw7 w8"):
        body = parse_messages(CountBody, _raw(messages=USER, system=system))
        assert body.system_text == "w7 w8"
        assert count_tokens(_raw(messages=USER, system=system), tok, served="m") == want
    later = [{"type": "text", "text": "w7 w8"}, {"type": "text", "text": BILLING.format(hash_)}]
    assert parse_messages(CountBody, _raw(messages=USER, system=later)).system_text == "w7 w8" + BILLING.format(hash_)
    inline = "w7 " + BILLING.format(hash_)
    assert parse_messages(CountBody, _raw(messages=USER, system=inline)).system_text == inline
