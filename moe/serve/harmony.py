"""gpt-oss's replies in the harmony format, split into reasoning, content and tool calls for the chat API.

    prompt ... <|start|>assistant                       (the chat template's generation prompt)
    reply  <|channel|>analysis<|message|>…<|end|>       a message: header (channel, recipient) then body
           <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>
           <|start|>assistant<|channel|>final<|message|>…<|return|>
    HarmonyStream.push(token) ──► content text delta (the bodies of messages on any channel but
        "analysis", not addressed to a tool), with TextStream's stop strings; pop_reasoning() ──► the
        "analysis" bodies' text; pop_calls() ──► the ToolCalls of messages addressed to=functions.NAME
        (with the request's tools: moe.serve.tools)

A chat request to a model whose tokenizer has the harmony specials (<|start|>, <|end|>, <|message|>,
<|channel|>) gets its reply parsed so: `message.content` is the final answer and
`message.reasoning_content` the analysis, as OpenAI-compatible servers return gpt-oss's reasoning.
The special tokens never reach the text (TextStream decodes without them); a header's role, channel
and recipient words are read, not shown. The recipient (`to=...`) may stand before the channel or after
it. A reply whose first tokens are neither <|channel|>, <|message|> nor a recipient before a
<|channel|> has no header: it is content from its first token on. Completions (/v1/completions) stay
raw text. Stop strings apply to the content only.

With tools, a message addressed to functions.NAME is a call: it closes at <|end|>, at the next
<|start|>, or where the reply ends at an end-of-sequence token (<|call|>, as gpt-oss ends a call); a
body that is a JSON object naming a tool of the request is a ToolCall, any other body (and one the
reply ends inside, at max_tokens) is content. Without parallel_tool_calls the reply ends at its first call.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from moe.serve.tokenizer import TextStream, TextTokenizer
from moe.serve.tools import FUNCTIONS, ToolCall, ToolParsing, parse_json_call

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")
REASONING_CHANNEL = "analysis"
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
_RECIPIENT_START = re.compile(r"\s*(?:t|to|to=\S*)\s*")  # what a header that names its recipient first begins with


@dataclass(frozen=True)
class HarmonyIds:
    """Token ids of the harmony specials that structure a reply, and every special token's id (decoding
    skips them; they separate a header's words)."""

    start: int
    end: int
    message: int
    channel: int
    specials: frozenset[int] = frozenset()


def harmony_ids(tokenizer: TextTokenizer) -> HarmonyIds | None:
    """The harmony specials' ids, or None when the tokenizer lacks any of them (not a harmony model)."""
    ids = [tokenizer.tokenizer.token_to_id(t) for t in SPECIALS]
    if any(i is None for i in ids):
        return None
    return HarmonyIds(*ids, specials=frozenset(tokenizer.special_tokens.values()))


class _Kind(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    CALL = "call"


class HarmonyStream:
    """TextStream's interface (push, finish) over a harmony reply: push returns the content delta and
    whether a stop string (or, without parallel_tool_calls, a call) ended it; pop_reasoning() and
    pop_calls() return (and clear) the analysis text and the ToolCalls so far. Each message body is its
    own TextStream, flushed at its <|end|> (or a new <|start|>, or the end of the reply). `tools`: read
    messages to functions.NAME as calls, the reply starting inside tools.seed (tool_choice "required" or
    a named function). Cost per push: that of TextStream.push on body tokens, O(1) on specials, a decode
    of the header so far while a first header may still name its recipient."""

    def __init__(self, tokenizer: TextTokenizer, ids: HarmonyIds, stop: Iterable[str] = (),
                 tools: ToolParsing | None = None) -> None:
        self.tokenizer, self.ids, self.stop, self.tools = tokenizer, ids, tuple(stop), tools
        self.header: list[int] | None = []  # the reply opens in the generation prompt's header
        self.prompt_header = True  # that header: its role is the prompt's; a channel or recipient comes first
        self.body: TextStream | None = None
        self.kind = _Kind.CONTENT
        self.call_name = ""
        self.done = False
        self.stop_sequence: str | None = None  # the stop string that ended the content, as TextStream's
        self._call_text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        for token in tokenizer.encode(tools.seed, add_special_tokens=False) if tools and tools.seed else ():
            self.push(token)

    def push(self, token: int) -> tuple[str, bool]:
        ids = self.ids
        if token == ids.start:
            text = self._close(ended=True)
            self.header, self.prompt_header = [], False
            return text, self.done
        if self.header is not None:
            return self._header_token(token)
        if token == ids.end:
            return self._close(ended=True), self.done
        if self.body is None:  # body tokens outside any message: content
            self._open(_Kind.CONTENT)
        text, stopped = self.body.push(token)
        if stopped:
            self.stop_sequence = self.body.stop_sequence
        if self.kind is _Kind.REASONING:
            self._reasoning.append(text)
            return "", False
        if self.kind is _Kind.CALL:
            self._call_text.append(text)
            return "", False
        return text, stopped

    def finish(self, eos: bool = False) -> str:
        """The text still held back at the end of the reply (the content's; the reasoning's goes to
        pop_reasoning). `eos`: the reply ended at an end-of-sequence token, which closes an open call;
        otherwise (max_tokens, the context) the call's text is content."""
        text = ""
        if self.header and self.prompt_header and self.ids.channel not in self.header:
            text, stopped = self._as_content(self.header)  # a first header that never came to a channel
            if stopped:
                return text
        return text + self._close(ended=eos)

    def pop_reasoning(self) -> str:
        text = "".join(self._reasoning)
        self._reasoning = []
        return text

    def pop_calls(self) -> tuple[ToolCall, ...]:
        calls, self._calls = tuple(self._calls), []
        return calls

    def _header_token(self, token: int) -> tuple[str, bool]:
        header, ids = self.header, self.ids
        if token == ids.message:
            self._open(self._kind(header))
            self.header = None
            return "", False
        if self.prompt_header and ids.channel not in header and token != ids.channel:
            # before a channel, the reply's first header can only name its recipient (" to=functions.x")
            if not _RECIPIENT_START.fullmatch(self.tokenizer.decode([*header, token])):
                return self._as_content([*header, token])
        header.append(token)
        return "", False

    def _as_content(self, tokens: list[int]) -> tuple[str, bool]:
        """Take `tokens`, held as a possible header, as the reply's content (it has no header)."""
        self.header, out = None, []
        for token in tokens:
            text, stopped = self.push(token)
            out.append(text)
            if stopped:
                return "".join(out), True
        return "".join(out), False

    def _words(self, header: list[int]) -> list[str]:
        """The header's text between its special tokens, each run decoded alone."""
        runs, run = [], []
        for token in header:
            if token in self.ids.specials:
                runs.append(run)
                run = []
            else:
                run.append(token)
        return [self.tokenizer.decode(r) for r in [*runs, run] if r]

    def _kind(self, header: list[int]) -> _Kind:
        """What the message of `header` is: a call (addressed to functions.NAME, with tools), reasoning
        (the analysis channel) or content."""
        recipient = next((m.group(1) for text in self._words(header) if (m := _RECIPIENT.search(text))), "")
        if self.tools is not None and recipient.startswith(FUNCTIONS):
            self.call_name = recipient[len(FUNCTIONS):]
            return _Kind.CALL
        return _Kind.REASONING if self._channel(header) == REASONING_CHANNEL else _Kind.CONTENT

    def _channel(self, header: list[int]) -> str:
        """The word after <|channel|> in a header ("" without one)."""
        if self.ids.channel not in header:
            return ""
        words = self.tokenizer.decode(header[header.index(self.ids.channel) + 1:]).split()
        return words[0] if words else ""

    def _open(self, kind: _Kind) -> None:
        self.kind, self._call_text = kind, []
        self.body = TextStream(self.tokenizer, self.stop if kind is _Kind.CONTENT else ())

    def _close(self, ended: bool) -> str:
        """Flush the open body: its held-back text, as content (returned), reasoning (kept) or, for a
        call that `ended` and parses, a ToolCall (kept)."""
        if self.body is None:
            return ""
        text, self.body = self.body.finish(), None
        if self.kind is _Kind.REASONING:
            self._reasoning.append(text)
            return ""
        if self.kind is _Kind.CALL:
            text = "".join(self._call_text) + text
            call = parse_json_call(self.call_name, text, self.tools.schemas) if ended else None
            if call is not None:
                self._calls.append(call)
                self.done = not self.tools.parallel
                return ""
        return text
