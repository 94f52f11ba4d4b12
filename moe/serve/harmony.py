"""gpt-oss's replies in the harmony format, split into reasoning and content for the chat API.

    prompt ... <|start|>assistant                       (the chat template's generation prompt)
    reply  <|channel|>analysis<|message|>…<|end|>       a message: header (channel) then body
           <|start|>assistant<|channel|>final<|message|>…<|return|>
    HarmonyStream.push(token) ──► content text delta (the bodies of messages on any channel but
        "analysis"), with TextStream's stop strings; pop_reasoning() ──► the "analysis" bodies' text

A chat request to a model whose tokenizer has the harmony specials (<|start|>, <|end|>, <|message|>,
<|channel|>) gets its reply parsed so: `message.content` is the final answer and
`message.reasoning_content` the analysis, as OpenAI-compatible servers return gpt-oss's reasoning.
The special tokens never reach the text (TextStream decodes without them); a header's role and
channel words are read, not shown. A reply whose first token is neither <|channel|> nor <|message|>
has no header: it is content from that token on. Completions
(/v1/completions) stay raw text. Stop strings apply to the content only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moe.serve.tokenizer import TextStream, TextTokenizer

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")
REASONING_CHANNEL = "analysis"


@dataclass(frozen=True)
class HarmonyIds:
    """Token ids of the harmony specials that structure a reply."""

    start: int
    end: int
    message: int
    channel: int


def harmony_ids(tokenizer: TextTokenizer) -> HarmonyIds | None:
    """The harmony specials' ids, or None when the tokenizer lacks any of them (not a harmony model)."""
    ids = [tokenizer.tokenizer.token_to_id(t) for t in SPECIALS]
    return None if any(i is None for i in ids) else HarmonyIds(*ids)


class HarmonyStream:
    """TextStream's interface (push, finish) over a harmony reply: push returns the content delta and
    whether a stop string ended it; pop_reasoning() returns (and clears) the analysis text decoded so
    far. Each message body is its own TextStream, flushed at its <|end|> (or a new <|start|>, or the
    end of the reply). Cost per push: that of TextStream.push on body tokens, O(1) on specials."""

    def __init__(self, tokenizer: TextTokenizer, ids: HarmonyIds, stop: Iterable[str] = ()) -> None:
        self.tokenizer, self.ids, self.stop = tokenizer, ids, tuple(stop)
        self.header: list[int] | None = []  # the reply opens in the generation prompt's header
        self.prompt_header = True  # that header: its role is the prompt's, so <|channel|> or <|message|> comes first
        self.body: TextStream | None = None
        self.reasoning_body = False
        self._reasoning: list[str] = []

    def push(self, token: int) -> tuple[str, bool]:
        ids = self.ids
        if token == ids.start:
            text = self._close()
            self.header, self.prompt_header = [], False
            return text, False
        if self.header is not None and self.prompt_header and not self.header and token not in (ids.channel,
                                                                                                 ids.message):
            self.header = None  # a reply without a harmony header: content from its first token
        if self.header is not None:
            if token == ids.message:
                self._open(self._channel(self.header))
                self.header = None
            else:
                self.header.append(token)
            return "", False
        if token == ids.end:
            return self._close(), False
        if self.body is None:  # body tokens outside any message: content
            self._open("")
        text, stopped = self.body.push(token)
        if self.reasoning_body:
            self._reasoning.append(text)
            return "", False
        return text, stopped

    def finish(self) -> str:
        """The text still held back at the end of the reply (the content's; the reasoning's goes to
        pop_reasoning)."""
        return self._close()

    def pop_reasoning(self) -> str:
        text = "".join(self._reasoning)
        self._reasoning = []
        return text

    def _channel(self, header: list[int]) -> str:
        """The word after <|channel|> in a header ("" without one)."""
        if self.ids.channel not in header:
            return ""
        words = self.tokenizer.decode(header[header.index(self.ids.channel) + 1:]).split()
        return words[0] if words else ""

    def _open(self, channel: str) -> None:
        self.reasoning_body = channel == REASONING_CHANNEL
        self.body = TextStream(self.tokenizer, () if self.reasoning_body else self.stop)

    def _close(self) -> str:
        """Flush the open body: its held-back text, as content (returned) or reasoning (kept)."""
        if self.body is None:
            return ""
        text, self.body = self.body.finish(), None
        if self.reasoning_body:
            self._reasoning.append(text)
            return ""
        return text
