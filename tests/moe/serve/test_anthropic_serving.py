"""/v1/messages and /v1/messages/count_tokens over HTTP, the engine replying with a script.

    tiny qwen3_moe checkpoint (the hermes call's pieces in its vocabulary) ─expertcache serve flags─► the
        server, its engine's logits replaced by a scripted reply (serving_util.Scripted)
    checked with raw HTTP as Anthropic's clients send it (x-api-key, anthropic-version): a text reply, a
        tool_use, a stop sequence, max_tokens and the context's end, each as one Message and as an SSE
        stream whose events come in Anthropic's order and add up to the same Message; count_tokens ==
        usage.input_tokens; errors in Anthropic's form (400 by field, 401, 404, 405, 415, 503, a failed
        generation as a 500 or an `event: error`); a closed stream cancels its request; the request counter
    a gpt_oss checkpoint: the analysis channel as a thinking block when thinking is on, dropped when off
    MessageStream alone: whitespace beside a call opens no block
"""

from __future__ import annotations

import json

import httpx
import pytest

from moe.serve.anthropic_api import MessagesRequest, MessageStream, message_body
from moe.serve.openai_api import Prepared
from moe.serve.openai_schema import ApiError
from moe.serve.sampling import SamplingParams
from moe.serve.scheduler import Event
from moe.serve.tools import ToolCall
from moe.testing.tiny_checkpoint import EOS, HARMONY_SPECIALS, make_tiny_checkpoint
from tests.moe.serve.http_util import KEY, NAME, serve, slow_decode
from tests.moe.serve.serving_util import Scripted, wait_until
from tests.moe.serve.test_tool_serving import HERMES_CALL

HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "fine-grained-tool-streaming"}
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = [{"role": "user", "content": "w40 w41"}]
MAX_SEQ_LEN = 256


class Served:
    """A served tiny checkpoint and the script of its replies."""

    def __init__(self, family: str, path, words=()) -> None:
        self.running = serve(make_tiny_checkpoint(path, family, words=words), max_seq_len=MAX_SEQ_LEN)
        self.url, self.scheduler = self.running.url, self.running.scheduler
        self.ids = self.running.state.tokenizer.tokenizer.token_to_id
        self.engine = self.scheduler.engine

    def script(self, *words: str | int) -> None:
        self.scheduler.engine = Scripted(self.engine, [w if isinstance(w, int) else self.ids(w) for w in words])

    def post(self, path: str = "/v1/messages", headers=HEADERS, **body) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30)

    def message(self, **extra) -> dict:
        r = self.post(**{"model": NAME, "max_tokens": 40, "messages": USER, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, **extra) -> list[tuple[str, dict]]:
        body = {"model": NAME, "max_tokens": 40, "messages": USER, **extra, "stream": True}
        with httpx.stream("POST", self.url + "/v1/messages", json=body, headers=HEADERS, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            text = r.read().decode()
        out = []
        for event in text.strip().split("\n\n"):
            name, data = event.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), event
            out.append((name[len("event: "):], json.loads(data[len("data: "):])))
            assert out[-1][0] == out[-1][1]["type"]
        return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    served = Served("qwen3_moe", tmp_path_factory.mktemp("anthropic-qwen3"), HERMES_CALL)
    yield served
    served.running.stop()


def _assemble(events: list[tuple[str, dict]]) -> dict:
    """The Message an SSE stream adds up to, checking the order of its events on the way."""
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    message = events[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    blocks, open_at = [], None
    for kind, data in events[1:-2]:
        if kind == "content_block_start":
            assert open_at is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_at = data["index"]
        elif kind == "content_block_delta":
            assert data["index"] == open_at
            delta, block = data["delta"], blocks[open_at]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]]
            block[field] = block.get(field, "") + delta[field]
        else:
            assert kind == "content_block_stop" and data["index"] == open_at
            open_at = None
    assert open_at is None
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["input"] == {}
            block["input"] = json.loads(block.pop("partial_json"))
    delta = events[-2][1]
    return {**message, "content": blocks, **delta["delta"], "usage": delta["usage"]}


def _same(streamed: dict, whole: dict) -> None:
    for message in (streamed, whole):
        assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
        for block in message["content"]:
            if block["type"] == "tool_use":
                assert block.pop("id").startswith("toolu_")
        assert message["usage"].pop("expertcache")["decode_s"] >= 0  # timings differ between two runs
    assert {k: v for k, v in streamed.items() if k != "id"} == {k: v for k, v in whole.items() if k != "id"}


def test_a_text_reply_and_its_usage(qwen):
    qwen.script("w50", "w51", EOS)
    whole = qwen.message()
    assert whole["content"] == [{"type": "text", "text": "w50 w51"}] and whole["model"] == NAME
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", None)
    count = qwen.post("/v1/messages/count_tokens", model=NAME, messages=USER)
    assert count.status_code == 200 and count.json() == {"input_tokens": whole["usage"]["input_tokens"]}
    assert {k: whole["usage"][k] for k in ("output_tokens", "cache_read_input_tokens",
                                           "cache_creation_input_tokens")} == {
        "output_tokens": 3, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    qwen.script("w50", "w51", EOS)
    events = qwen.events()
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    _same(_assemble(events), whole)


def test_a_tool_use_block(qwen):
    qwen.script("w50", *HERMES_CALL, EOS)
    whole = qwen.message(tools=[WEATHER])
    text, use = whole["content"]
    assert text == {"type": "text", "text": "w50 "} and whole["stop_reason"] == "tool_use"
    assert use["id"].startswith("toolu_") and use == {"type": "tool_use", "id": use["id"], "name": "get_weather",
                                                      "input": {"city": "Paris"}}
    qwen.script("w50", *HERMES_CALL, EOS)
    events = qwen.events(tools=[WEATHER])
    assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "content_block_start",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    _same(_assemble(events), whole)
    qwen.script(*HERMES_CALL[4:], EOS)  # forced: the prompt ends in the call's opening up to its arguments
    forced = qwen.message(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert [b["type"] for b in forced["content"]] == ["tool_use"] and forced["stop_reason"] == "tool_use"


def test_a_stop_sequence_max_tokens_and_the_context_s_end(qwen):
    for stream in (False, True):
        qwen.script("w50", "w51", "w52", "w53", EOS)
        reply = qwen.message(stop_sequences=["w9", "w52"]) if not stream else _assemble(qwen.events(
            stop_sequences=["w9", "w52"]))
        assert reply["content"] == [{"type": "text", "text": "w50 w51 "}]
        assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", "w52")
        qwen.script("w50")
        reply = qwen.message(max_tokens=4) if not stream else _assemble(qwen.events(max_tokens=4))
        assert reply["content"] == [{"type": "text", "text": "w50 w50 w50 w50"}]
        assert (reply["stop_reason"], reply["stop_sequence"], reply["usage"]["output_tokens"]) == (
            "max_tokens", None, 4)
        qwen.script("w50")
        long = {"max_tokens": 32000, "messages": [{"role": "user", "content": "w9 " * (MAX_SEQ_LEN - 16)}]}
        reply = qwen.message(**long) if not stream else _assemble(qwen.events(**long))
        use = reply["usage"]
        assert reply["stop_reason"] == "model_context_window_exceeded"
        assert use["input_tokens"] + use["output_tokens"] == MAX_SEQ_LEN and use["output_tokens"] < 16


def _error(r: httpx.Response, status: int, kind: str, says: str = "") -> str:
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert says in body["error"]["message"], body
    return body["error"]["message"]


def test_errors_come_in_anthropic_s_form(qwen):
    base = {"model": NAME, "max_tokens": 8, "messages": USER}
    _error(qwen.post(**{**base, "model": "claude-sonnet-4-5"}), 404, "not_found_error", "'claude-sonnet-4-5' does not")
    bad = {**base, "messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}]}
    assert _error(qwen.post(**bad), 400, "invalid_request_error").startswith("messages.1.content.0.name: ")
    _error(qwen.post(**{**base, "top_k": 5}), 400, "invalid_request_error", "top_k: not supported")
    _error(qwen.post(headers={"x-api-key": "nope"}, **base), 401, "authentication_error", "x-api-key")
    _error(qwen.post("/v1/messages/count_tokens", headers={}, model=NAME, messages=USER), 401, "authentication_error")
    qwen.script("w50", EOS)
    assert qwen.post(headers={"Authorization": f"Bearer {KEY}"}, **base).status_code == 200  # either header
    _error(httpx.get(qwen.url + "/v1/messages", headers=HEADERS), 405, "invalid_request_error")
    _error(httpx.post(qwen.url + "/v1/messages", content=json.dumps(base), headers={**HEADERS, "Content-Type":
           "text/plain"}), 415, "invalid_request_error", "Content-Type")
    _error(qwen.post(**{**base, "thinking": {"type": "enabled", "budget_tokens": 2048}}), 400,
           "invalid_request_error", "thinking.type")
    qwen.running.state.draining = True
    try:
        _error(qwen.post(**base), 503, "overloaded_error", "shutting down")
    finally:
        qwen.running.state.draining = False
    assert "error" in qwen.post("/v1/chat/completions", headers=HEADERS, model="x", messages=USER).json()  # OpenAI's


def test_models_answer_in_the_form_of_the_api_that_asks(qwen):
    """/v1/models and /v1/models/{id}: Anthropic's list and model object for a request with anthropic-version
    (its clients always send it), OpenAI's without; a model this server does not serve is a 404 in the
    asker's form, and so is a missing key."""
    import datetime

    listed = httpx.get(qwen.url + "/v1/models", headers=HEADERS, timeout=30)
    assert listed.status_code == 200, listed.text
    body = listed.json()
    assert set(body) == {"data", "has_more", "first_id", "last_id"} and body["has_more"] is False
    assert body["first_id"] == body["last_id"] == NAME and len(body["data"]) == 1
    model = body["data"][0]
    assert set(model) == {"type", "id", "display_name", "created_at"}
    assert model["type"] == "model" and model["id"] == NAME
    assert datetime.datetime.fromisoformat(model["created_at"].replace("Z", "+00:00")).year >= 2024
    assert httpx.get(f"{qwen.url}/v1/models/{NAME}", headers=HEADERS, timeout=30).json() == model
    _error(httpx.get(qwen.url + "/v1/models/claude-sonnet-4-5", headers=HEADERS, timeout=30), 404, "not_found_error",
           "'claude-sonnet-4-5' does not exist")
    _error(httpx.get(qwen.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}, timeout=30), 401,
           "authentication_error")
    openai = {"Authorization": f"Bearer {KEY}"}
    listed = httpx.get(qwen.url + "/v1/models", headers=openai, timeout=30).json()
    assert listed["object"] == "list" and listed["data"][0]["object"] == "model" and listed["data"][0]["id"] == NAME
    assert httpx.get(f"{qwen.url}/v1/models/{NAME}", headers=openai, timeout=30).json() == listed["data"][0]
    missing = httpx.get(qwen.url + "/v1/models/gpt-5", headers=openai, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_failed_generation_is_a_500_or_an_error_event(qwen, monkeypatch):
    def exploding_step(tokens):
        raise RuntimeError("the decode step exploded")

    monkeypatch.setattr(qwen.engine, "decode_step", exploding_step)
    qwen.script("w50", "w51")  # a first token that is not the end, so a decode step runs (and explodes)
    _error(qwen.post(model=NAME, max_tokens=8, messages=USER), 500, "api_error", "generation failed (request msg_")
    events = qwen.events(max_tokens=8)
    assert [k for k, _ in events][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error" and "message_stop" not in [k for k, _ in events]


def test_a_closed_stream_cancels_its_request_and_requests_are_counted(qwen, monkeypatch):
    qwen.scheduler.engine = qwen.engine
    monkeypatch.setattr(qwen.scheduler, "eos_ids", qwen.scheduler.eos_ids)  # restored after the test, as is
    monkeypatch.setattr(qwen.engine, "decode_step", qwen.engine.decode_step)  # the step slow_decode slows
    slow_decode(qwen.running, 0.01)
    registry = qwen.running.state.metrics.registry
    counted = [("/v1/messages", "200"), ("/v1/messages/count_tokens", "200"), ("/v1/messages", "404")]

    def requests() -> list[float]:
        return [registry.get_sample_value("expertcache_requests_total", {"endpoint": e, "status": c}) or 0.0
                for e, c in counted]

    at_start = requests()
    before, ran = (qwen.scheduler.stats.finished.get(k, 0) for k in ("cancelled", "length"))
    body = {"model": NAME, "max_tokens": 200, "messages": USER, "stream": True}
    with httpx.stream("POST", qwen.url + "/v1/messages", json=body, headers=HEADERS, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
    wait_until(lambda: qwen.scheduler.stats.finished["cancelled"] == before + 1, what="the request to be cancelled")
    wait_until(lambda: qwen.scheduler.active == 0 and qwen.scheduler.waiting == 0, what="the row to be freed")
    assert qwen.scheduler.stats.finished.get("length", 0) == ran  # it did not run to its 200 tokens
    assert qwen.post("/v1/messages/count_tokens", model=NAME, messages=USER).status_code == 200
    assert qwen.post("/v1/messages", model="nope", max_tokens=4, messages=USER).status_code == 404
    # at least its own (an earlier test's stream may be counted as its connection closes); the guard counts a
    # request once its response is sent, which may come just after the client has read it
    wait_until(lambda: all(b - a >= 1 for a, b in zip(at_start, requests())),
               what="each of its requests to be counted")


def test_harmony_s_analysis_is_a_thinking_block_when_thinking_is_on(tmp_path):
    oss = Served("gpt_oss", tmp_path)
    try:
        reply = ("<|channel|>", "analysis", "<|message|>", "w50", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                 "final", "<|message|>", "w51", HARMONY_SPECIALS.index("<|return|>"))
        thinking = {"type": "enabled", "budget_tokens": 1024}
        oss.script(*reply)
        whole = oss.message(thinking=thinking)
        assert whole["content"] == [{"type": "thinking", "thinking": "w50", "signature": ""},
                                    {"type": "text", "text": "w51"}] and whole["stop_reason"] == "end_turn"
        oss.script(*reply)
        _same(_assemble(oss.events(thinking=thinking)), whole)
        oss.script(*reply)
        assert oss.message()["content"] == [{"type": "text", "text": "w51"}]  # thinking off: the analysis is not sent
    finally:
        oss.running.stop()


def _writer(thinking: bool = False) -> MessageStream:
    return MessageStream("msg_1", NAME, MessagesRequest(Prepared([5, 6], SamplingParams(max_tokens=8)), 8, thinking))


def test_whitespace_beside_a_call_opens_no_block():
    call = ToolCall("get_weather", '{"city": "Paris"}')
    final = Event(finish_reason="stop", prompt_tokens=2, completion_tokens=4)
    cases = [([Event(text="\n\n"), Event(tool_calls=(call,)), final], ["tool_use"], ""),
             ([Event(text=" "), Event(text="w1"), Event(tool_calls=(call,)), final], ["text", "tool_use"], " w1"),
             ([Event(text="w1"), Event(text=" "), Event(tool_calls=(call,)), final], ["text", "tool_use"], "w1 "),
             ([Event(text=" "), final], ["text"], " "),
             ([Event(reasoning="w2"), Event(text="w1"), final], ["text"], "w1")]
    for events, types, text in cases:
        writer = _writer()
        sse = writer.start() + "".join(writer.take(ev) for ev in events)
        parsed = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
                  for e in sse.strip().split("\n\n")]
        streamed = _assemble(parsed)
        assert [b["type"] for b in streamed["content"]] == types
        assert "".join(b.get("text", "") for b in streamed["content"]) == text
        whole = message_body("msg_1", NAME, writer.req, "".join(e.text for e in events), "w2",
                             [c for e in events for c in e.tool_calls], final)
        assert [b["type"] for b in whole["content"]] == types
    assert _writer().error(ApiError(500, "x")) == (
        'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n')
