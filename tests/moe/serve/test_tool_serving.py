"""Tool calls served over HTTP: each family's tiny checkpoint with an engine that replies with a script.

    tiny checkpoint of qwen3_moe (hermes), glm4_moe (glm45), gpt_oss (harmony), the call's pieces added to
    its vocabulary ─expertcache serve flags─► the server, its engine's logits replaced by a scripted
    reply (serving_util.Scripted: some text, then a call of get_weather, then the end of the sequence)
    checked through the openai client and raw HTTP: message.tool_calls with an id, the arguments as JSON
    text, the text outside the call as content, finish_reason "tool_calls"; streamed: the text as content
    deltas, the call as one tool_calls delta once it closed, none of its text as content; tool_choice
    "none", a tool the request does not offer, and parallel_tool_calls false with two calls
"""

from __future__ import annotations

import json

import httpx
import pytest

from moe.testing.tiny_checkpoint import EOS, HARMONY_SPECIALS, make_tiny_checkpoint
from tests.moe.serve.http_util import AUTH, NAME, serve
from tests.moe.serve.serving_util import Scripted

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
USER = [{"role": "user", "content": "w40 w41"}]
ARGS = '{"city": "Paris"}'

HERMES_CALL = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
# family: (vocabulary added, the words of a call, the content beside it: the text before it, None for harmony,
# whose text before the call is reasoning)
FAMILIES = {
    "qwen3_moe": (HERMES_CALL, HERMES_CALL, "w50 "),
    "glm4_moe": (["<tool_call>", "</tool_call>", "get_weather", "<arg_key>city</arg_key>",
                  "<arg_value>Paris</arg_value>"],
                 ["<tool_call>", "get_weather", "<arg_key>city</arg_key>", "<arg_value>Paris</arg_value>",
                  "</tool_call>"], "w50 "),
    "gpt_oss": (["commentary", "to=functions.get_weather", "json", '{"city":', '"Paris"}'],
                ["<|end|>", "<|start|>", "assistant", "<|channel|>", "commentary", "to=functions.get_weather", "json",
                 "<|message|>", '{"city":', '"Paris"}'], None),
}


class Family:
    """A served family: its server, tokenizer and the script of a reply (prefix text, one call, eos)."""

    def __init__(self, family: str, path) -> None:
        words, call, self.content = FAMILIES[family]
        self.running = serve(make_tiny_checkpoint(path, family, words=words), max_seq_len=256)
        tok = self.running.state.tokenizer
        ids = tok.tokenizer.token_to_id
        if family == "gpt_oss":  # reasoning "w50", then the call, ended by <|call|> (an eos of gpt-oss)
            self.prefix = [ids("<|channel|>"), ids("analysis"), ids("<|message|>"), ids("w50")]
            self.end = [HARMONY_SPECIALS.index("<|call|>")]
        else:
            self.prefix, self.end = [ids("w50")], [EOS]
        self.closer = int(family == "gpt_oss")  # a harmony call closes at the token after its body
        self.call = [ids(w) for w in call]
        assert None not in self.call + self.prefix
        self.engine = self.running.state.scheduler.engine

    def script(self, *parts: list[int]) -> None:
        self.running.state.scheduler.engine = Scripted(self.engine, [t for p in parts for t in p])

    def post(self, **extra) -> dict:
        body = {"model": NAME, "messages": USER, "temperature": 0, "max_tokens": 40, **extra}
        r = httpx.post(self.running.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = Family(request.param, tmp_path_factory.mktemp(request.param))
    yield family
    family.running.stop()


def test_a_call_comes_as_tool_calls(served):
    served.script(served.prefix, served.call, served.end)
    finished = served.running.state.scheduler.stats.finished
    before = dict(finished)
    reply = served.post(tools=[WEATHER, NOW])
    # the scheduler counts the request as the API answers it
    assert finished["tool_calls"] == before.get("tool_calls", 0) + 1 and finished["stop"] == before.get("stop", 0)
    choice = reply["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert call["id"].startswith("call_") and call == {
        "id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    assert len(choice["message"]["tool_calls"]) == 1 and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == served.content
    if served.content is None:  # harmony: the analysis before the call is reasoning
        assert choice["message"]["reasoning_content"] == "w50"
    assert reply["usage"]["completion_tokens"] == len(served.prefix) + len(served.call) + 1


def test_a_streamed_call_is_one_delta_after_the_text(served):
    served.script(served.prefix, served.call, served.end)
    stream = served.running.client.chat.completions.create(model=NAME, messages=USER, temperature=0, max_tokens=40,
                                                           tools=[WEATHER], stream=True)
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == (served.content or "")
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and len(deltas[0]) == 1
    call = deltas[0][0]
    assert (call.index, call.type, call.function.name, call.function.arguments) == (0, "function", "get_weather", ARGS)
    assert call.id.startswith("call_")
    at = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert all(not c.choices[0].delta.content for c in chunks[at:])  # the call's text never came as content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_tool_choice_none_and_an_unknown_tool_leave_the_call_as_text(served):
    served.script(served.prefix, served.call, served.end)
    plain = served.post(tools=[WEATHER], tool_choice="none")["choices"][0]
    served.script(served.prefix, served.call, served.end)
    unknown = served.post(tools=[NOW])["choices"][0]  # the reply calls get_weather, which is not offered
    for choice in (plain, unknown):
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
        assert "Paris" in choice["message"]["content"]


def test_without_parallel_calls_the_reply_ends_at_its_first_call(served):
    served.script(served.prefix, served.call, served.call, served.end)
    both = served.post(tools=[WEATHER])["choices"][0]
    served.script(served.prefix, served.call, served.call, served.end)
    first = served.post(tools=[WEATHER], parallel_tool_calls=False)
    assert [c["function"]["arguments"] for c in both["message"]["tool_calls"]] == [ARGS, ARGS]
    assert len(first["choices"][0]["message"]["tool_calls"]) == 1
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert first["usage"]["completion_tokens"] == len(served.prefix) + len(served.call) + served.closer


def test_a_bad_tool_choice_is_a_400_over_http(served):
    body = {"model": NAME, "messages": USER, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "now"}}}
    r = httpx.post(served.running.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert json.loads(r.text)["error"]["message"] == "tool_choice: function 'now' is not in tools"
