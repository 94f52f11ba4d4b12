"""gpt-oss's harmony replies split into reasoning and content (moe.serve.harmony), alone and served.

    HarmonyStream pushed token by token ≡ a reference that splits the whole reply at its specials and
    decodes each message body at once (random replies of messages on random channels, stop strings);
    served: a chat request to the tiny gpt-oss checkpoint (harmony tokenizer and template) whose engine's
    logits are replaced by a scripted harmony reply returns the analysis as message.reasoning_content and
    the final message as message.content, streamed and not; /v1/completions returns the raw text.
    tool calls: a message addressed to=functions.NAME (recipient before or after the channel) closed by
    <|end|> or the end-of-sequence <|call|> is a call; an unknown function, a body that is not a JSON
    object, a reply cut inside the call or a request without tools leave the body as content; a forced
    opening (named, "required") starts the reply inside the call's header.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from moe.serve.harmony import HarmonyStream, harmony_ids
from moe.serve.tokenizer import TextTokenizer
from moe.serve.tools import ToolParsing, ToolSyntax, forced_opening
from moe.testing.tiny_checkpoint import HARMONY_SPECIALS, HARMONY_WORDS, make_tiny_checkpoint, write_tokenizer
from tests.moe.serve.http_util import KEY, NAME, serve
from tests.moe.serve.serving_util import Scripted

SPECIAL = {t: HARMONY_SPECIALS.index(t) for t in HARMONY_SPECIALS}
WORD = {w: len(HARMONY_SPECIALS) + i for i, w in enumerate(HARMONY_WORDS)}
FIRST_W = len(HARMONY_SPECIALS) + len(HARMONY_WORDS)  # the id of w7, then w8, ...


def w(i: int) -> int:
    return FIRST_W + i - 7


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("harmony")
    write_tokenizer(path, harmony=True)
    return TextTokenizer(path)


def message(channel: str, body: list[int], first: bool) -> list[int]:
    head = [] if first else [SPECIAL["<|start|>"], WORD["assistant"]]
    return head + [SPECIAL["<|channel|>"], WORD[channel], SPECIAL["<|message|>"]] + body + [SPECIAL["<|end|>"]]


def reference(tok: TextTokenizer, reply: list[int], stop: tuple[str, ...]) -> tuple[str, str]:
    """(reasoning, content): each message's body decoded whole, the content cut at its first stop string."""
    reasoning, content = [], []
    i = 0
    while i < len(reply):
        if reply[i] == SPECIAL["<|start|>"]:  # <|start|> assistant
            i += 2
            continue
        channel = reply[i + 1] if reply[i] == SPECIAL["<|channel|>"] else None
        j = reply.index(SPECIAL["<|end|>"], i)
        text = tok.decode(reply[i + 3:j])
        if channel == WORD["analysis"]:
            reasoning.append(text)
        else:
            cut = [text.find(s) for s in stop if s in text]
            content.append(text[:min(cut)] if cut else text)
            if cut:
                return "".join(reasoning), "".join(content)
        i = j + 1
    return "".join(reasoning), "".join(content)


def run(tok: TextTokenizer, reply: list[int], stop: tuple[str, ...] = ()) -> tuple[str, str]:
    stream = HarmonyStream(tok, harmony_ids(tok), stop)
    reasoning, content = [], []
    for t in reply:
        text, stopped = stream.push(t)
        content.append(text)
        reasoning.append(stream.pop_reasoning())
        if stopped:
            return "".join(reasoning), "".join(content)
    content.append(stream.finish())
    reasoning.append(stream.pop_reasoning())
    return "".join(reasoning), "".join(content)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["analysis", "final"]), st.lists(st.integers(7, 40), min_size=0, max_size=6)),
                min_size=1, max_size=4),
       st.lists(st.integers(7, 40).map(lambda i: f"w{i}"), max_size=2))
def test_the_stream_equals_splitting_the_whole_reply(tok, messages, stop):
    reply = []
    for n, (channel, body) in enumerate(messages):
        reply += message(channel, [w(i) for i in body], first=n == 0)
    assert run(tok, reply, tuple(stop)) == reference(tok, reply, tuple(stop))


def test_a_reply_without_a_header_is_content_and_specials_never_show(tok):
    plain = [w(10), w(11), w(12)]
    assert run(tok, plain) == ("", "w10 w11 w12")
    reply = message("analysis", [w(20)], first=True) + message("final", [w(21), w(22)], first=False)
    assert run(tok, reply) == ("w20", "w21 w22")
    assert run(tok, reply[:-2]) == ("w20", "w21")  # cut before its end (max_tokens): what came is content
    assert run(tok, reply, ("w22",)) == ("w20", "w21 ")
    assert run(tok, message("analysis", [w(30)], True), ("w30",)) == ("w30", "")  # stops are the content's


def test_the_stop_string_that_ended_the_content_is_kept(tok):
    stream = HarmonyStream(tok, harmony_ids(tok), ("w9", "w22"))
    reply = message("analysis", [w(22)], True) + message("final", [w(21), w(22), w(23)], False)
    stops = [stream.push(t)[1] for t in reply]
    assert stops.index(True) == len(reply) - 3 and stream.stop_sequence == "w22"  # not at the analysis' w22
    plain = HarmonyStream(tok, harmony_ids(tok), ("w9",))
    assert not any(plain.push(t)[1] for t in reply) and plain.stop_sequence is None


def test_a_tokenizer_without_the_specials_is_not_harmony(tiny_dir):
    assert harmony_ids(TextTokenizer(tiny_dir)) is None


REPLY = (message("analysis", [w(10), w(11)], first=True) + message("final", [w(12), w(13)], first=False)[:-1]
         + [SPECIAL["<|return|>"]])


def test_a_served_harmony_reply_comes_as_reasoning_and_content(tmp_path):
    running = serve(make_tiny_checkpoint(tmp_path / "gpt_oss", "gpt_oss"))
    try:
        scheduler = running.state.scheduler
        scheduler.engine = Scripted(scheduler.engine, REPLY)
        body = {"model": NAME, "messages": [{"role": "user", "content": "w40"}], "temperature": 0, "max_tokens": 30}
        headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}
        with httpx.Client(base_url=running.url, headers=headers, timeout=30) as http:
            reply = http.post("/v1/chat/completions", json=body).json()
            choice = reply["choices"][0]
            assert choice["message"] == {"role": "assistant", "content": "w12 w13", "reasoning_content": "w10 w11"}
            assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == len(REPLY)
            chunks = running.client.chat.completions.create(**{**body, "stream": True})
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == "w12 w13"
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "w10 w11"
            raw = http.post("/v1/completions", json={"model": NAME, "prompt": "w40", "temperature": 0,
                                                     "max_tokens": 30}).json()
            text = raw["choices"][0]["text"]  # raw: every word of the reply, the headers' included
            assert "w10 w11" in text and "w12 w13" in text and "final" in text
    finally:
        running.stop()


# tool calls: messages addressed to=functions.NAME

TOOL_WORDS = ["commentary", "to=functions.get_weather", "to=functions.nope", "json", '{"city":', '"Paris"}', "to", "t"]
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = ToolParsing(ToolSyntax.HARMONY, SCHEMAS)
PARIS = ("get_weather", {"city": "Paris"})
CALL_BODY = '<|message|>{"city": "Paris"}'


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("harmony-tools")
    write_tokenizer(path, harmony=True, words=TOOL_WORDS)
    return TextTokenizer(path)


def run_tools(tok: TextTokenizer, reply: str, tools=TOOLS, eos: bool = True, stop=()) -> tuple[str, str, list]:
    """(reasoning, content, calls as (name, arguments)) of `reply` (text with the specials written out)."""
    stream = HarmonyStream(tok, harmony_ids(tok), stop, tools=tools)
    reasoning, content, calls = [], [], []
    for t in tok.encode(reply, add_special_tokens=False):
        text, stopped = stream.push(t)
        content.append(text)
        reasoning.append(stream.pop_reasoning())
        calls += stream.pop_calls()
        if stopped:
            break
    else:
        content.append(stream.finish(eos=eos))
    reasoning.append(stream.pop_reasoning())
    calls += stream.pop_calls()
    return "".join(reasoning), "".join(content), [(c.name, json.loads(c.arguments)) for c in calls]


def test_a_message_to_a_function_is_a_call(tool_tok):
    after_reasoning = ("<|channel|>analysis<|message|>w10 w11<|end|><|start|>assistant<|channel|>commentary "
                       "to=functions.get_weather json" + CALL_BODY)
    assert run_tools(tool_tok, after_reasoning) == ("w10 w11", "", [PARIS])  # <|call|> (eos) closes it
    # the recipient in the role part: first in the reply, and after a <|start|> (as the template writes it)
    assert run_tools(tool_tok, "to=functions.get_weather <|channel|>commentary json" + CALL_BODY) == ("", "", [PARIS])
    first = "<|channel|>final<|message|>w12<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
    assert run_tools(tool_tok, first + CALL_BODY + "<|end|>", eos=False) == ("", "w12", [PARIS])
    assert run_tools(tool_tok, first + CALL_BODY, stop=("w12",)) == ("", "", [])  # stops apply to content


def test_a_call_that_does_not_parse_is_content(tool_tok):
    header = "<|channel|>commentary to=functions.get_weather json<|message|>"
    assert run_tools(tool_tok, header.replace("get_weather", "nope") + '{"city": "Paris"}') == (
        "", '{"city": "Paris"}', [])
    assert run_tools(tool_tok, header + '{"city":') == ("", '{"city":', [])
    assert run_tools(tool_tok, header + '{"city": "Paris"}', eos=False) == ("", '{"city": "Paris"}', [])  # max_tokens
    assert run_tools(tool_tok, header + '{"city": "Paris"}', tools=None) == ("", '{"city": "Paris"}', [])
    assert run_tools(tool_tok, "to w10") == ("", "to w10", [])  # began like a recipient, was not one
    assert run_tools(tool_tok, "t") == ("", "t", [])


def test_a_forced_call_continues_from_the_prompt(tool_tok, tmp_path):
    named = ToolParsing(ToolSyntax.HARMONY, SCHEMAS, forced_opening(ToolSyntax.HARMONY, "get_weather")[1])
    assert run_tools(tool_tok, '{"city": "Paris"}', tools=named) == ("", "", [PARIS])
    # "required" leaves the name to the model: a tokenizer that spells words without spaces between them
    # (Fuse), as gpt-oss's does, so that " to=functions." and "get_weather" read as one recipient
    vocab = {t: i for i, t in enumerate([*HARMONY_SPECIALS, " to=functions.", "get_weather", "commentary", " json",
                                         '{"city": "Paris"}'])}
    fused = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    fused.decoder = decoders.Fuse()
    fused.add_special_tokens(HARMONY_SPECIALS)
    fused.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path)
    required = ToolParsing(ToolSyntax.HARMONY, SCHEMAS, forced_opening(ToolSyntax.HARMONY, None)[1])
    assert run_tools(tok, 'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}', tools=required) == (
        "", "", [PARIS])
