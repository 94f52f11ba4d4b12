"""gpt-oss's harmony replies split into reasoning and content (moe.serve.harmony), alone and served.

    HarmonyStream pushed token by token ≡ a reference that splits the whole reply at its specials and
    decodes each message body at once (random replies of messages on random channels, stop strings);
    served: a chat request to the tiny gpt-oss checkpoint (harmony tokenizer and template) whose engine's
    logits are replaced by a scripted harmony reply returns the analysis as message.reasoning_content and
    the final message as message.content, streamed and not; /v1/completions returns the raw text.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.serve.harmony import HarmonyStream, harmony_ids
from moe.serve.tokenizer import TextTokenizer
from moe.testing.tiny_checkpoint import HARMONY_SPECIALS, HARMONY_WORDS, make_tiny_checkpoint, write_tokenizer
from tests.moe.serve.http_util import KEY, NAME, serve

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


def test_a_tokenizer_without_the_specials_is_not_harmony(tiny_dir):
    assert harmony_ids(TextTokenizer(tiny_dir)) is None


class _Scripted:
    """The tiny engine with its logits replaced by a one-hot of the script's next token (one row)."""

    def __init__(self, engine, script: list[int]) -> None:
        self._engine, self.script, self.at = engine, script, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _next(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(like, -1e4)
        out[..., self.script[min(self.at, len(self.script) - 1)]] = 0.0
        self.at += 1
        return out

    def join(self, prompt):
        self.at = 0
        row, logits = self._engine.join(prompt)
        return row, self._next(logits)

    def decode_step(self, tokens):
        return self._next(self._engine.decode_step(tokens))


REPLY = (message("analysis", [w(10), w(11)], first=True) + message("final", [w(12), w(13)], first=False)[:-1]
         + [SPECIAL["<|return|>"]])


def test_a_served_harmony_reply_comes_as_reasoning_and_content(tmp_path):
    running = serve(make_tiny_checkpoint(tmp_path / "gpt_oss", "gpt_oss"))
    try:
        scheduler = running.state.scheduler
        scheduler.engine = _Scripted(scheduler.engine, REPLY)
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
