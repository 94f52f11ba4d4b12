"""The Anthropic Messages API, served through the OpenAI chat path's prompt, scheduler and tool parsing.

    body bytes ──prepare_messages / count_tokens (on a worker thread)──► anthropic_schema.parse_messages
        (400 naming the field) ──model (404), thinking──► chat_body: the same conversation as an OpenAI
        chat body ──openai_api.chat_tools, chat_prompt, prepare──► Prepared: the prompt ids of the
        equivalent /v1/chat/completions request, max_tokens clipped to the context
    Events of the scheduler ──message_body──► one Message (JSON)
                            ──MessageStream──► SSE: message_start, per block content_block_start, its
                              deltas, content_block_stop, then message_delta and message_stop; an error event

    Anthropic request                             OpenAI chat request
    system (a string, or text blocks)             a system message, first
    user text blocks                              a user message (consecutive blocks joined as they are)
    user tool_result {tool_use_id, content}       a tool message {tool_call_id, content}
    assistant text and tool_use {id, name, input} an assistant message: content, tool_calls (arguments: input)
    assistant thinking, redacted_thinking         nothing (the chat path takes no reasoning back either)
    a last assistant message                      its text follows the generation prompt: the reply continues it
    tools [{name, description, input_schema}]     tools [{"type": "function", "function": {.., "parameters"}}]
    tool_choice auto / any / tool NAME / none     "auto" / "required" / {"function": {"name"}} / "none"
    tool_choice.disable_parallel_tool_use         parallel_tool_calls: false
    stop_sequences, temperature, top_p            stop, temperature, top_p

Reply: a thinking block (the analysis channel of a harmony model, with thinking enabled), text, tool_use
blocks (id toolu_..., input the call's arguments); stop_reason "tool_use" once a call came, else
"stop_sequence" (with stop_sequence), "max_tokens", "model_context_window_exceeded" (the context ended
the reply before max_tokens did) or "end_turn". usage: input_tokens computed, cache_read_input_tokens
restored from the prefix cache (--kv-cache-gb), output_tokens, and the extension field "expertcache".
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moe.serve import openai_api as api
from moe.serve.anthropic_schema import (
    CountBody,
    Message,
    MessagesBody,
    anthropic_error,
    join_text,
    parse_messages,
)
from moe.serve.harmony import harmony_ids
from moe.serve.openai_schema import ApiError, ChatBody, invalid
from moe.serve.tokenizer import TextTokenizer
from moe.serve.tools import ToolCall, ToolParsing

if TYPE_CHECKING:
    from moe.serve.scheduler import Event

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(frozen=True)
class MessagesRequest:
    """A checked /v1/messages request: what to generate; the max_tokens asked for (a reply the context
    ends before it stops with model_context_window_exceeded); whether reasoning comes as thinking blocks."""

    prep: api.Prepared
    max_tokens: int
    thinking: bool = False


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _assistant(message: Message) -> dict[str, Any]:
    blocks = message.content
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if b.type == "tool_use"]
    text = join_text([b for b in blocks if b.type == "text"])
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(message: Message) -> list[dict[str, Any]]:
    """A user message's blocks in order: each run of text blocks a user message, each tool_result a tool
    message."""
    out, texts = [], []
    for block in [*message.content, None]:
        if block is not None and block.type == "text":
            texts.append(block)
            continue
        if texts:
            out.append({"role": "user", "content": join_text(texts)})
            texts = []
        if block is not None:
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
    return out


def chat_messages(body: CountBody) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (the table in the module docstring)."""
    out = [{"role": "system", "content": body.system_text}] if body.system_text else []
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m))
        else:
            out.extend(_user(m))
    return out


def chat_body(body: CountBody) -> tuple[ChatBody, str]:
    """The OpenAI chat body of the same request, and the text the reply continues (a last assistant
    message's; "" when the user has the last word). Raises ApiError 400 for a conversation of that
    assistant message alone."""
    messages, prefill = chat_messages(body), ""
    if body.messages[-1].role == "assistant":
        prefill = messages.pop()["content"] or ""
        if not messages:
            raise invalid("messages", "the reply continues the last message, an assistant's: the conversation "
                          "needs a message before it")
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, **({} if t.description is None else {"description": t.description}),
            "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = _CHOICES.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesBody):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, stream=body.stream)
    return ChatBody.model_validate(fields), prefill


def _chat(body: CountBody, tokenizer: TextTokenizer, served: str) -> tuple[ChatBody, str, ToolParsing | None, bool]:
    """(the chat body, the text after the generation prompt, how to read the reply's calls, whether the
    model is a harmony one) of a checked body. Raises ApiError 404 for another model, 400 for thinking
    without a reasoning channel or a continued assistant message in harmony."""
    api.check_model(body, served)
    harmony = harmony_ids(tokenizer) is not None
    if body.thinks and not harmony:
        raise invalid("thinking.type", f"{body.thinking.type!r}: this model has no reasoning channel this server "
                      'reads (gpt-oss\'s harmony analysis channel); send {"type": "disabled"} or leave thinking out')
    chat, prefill = chat_body(body)
    if prefill and harmony:
        raise invalid(f"messages.{len(body.messages) - 1}", "this model's harmony format cannot continue an "
                      "assistant message; end the conversation with a user message")
    forced, tools = api.chat_tools(chat, tokenizer)
    return chat, prefill + forced, tools, harmony


def prepare_messages(raw: bytes, tokenizer: TextTokenizer, *, served: str, max_seq_len: int) -> MessagesRequest:
    """A /v1/messages body (JSON bytes) as a MessagesRequest; max_tokens is clipped to the context's room
    after the prompt. Raises ApiError."""
    body = parse_messages(MessagesBody, raw)
    chat, suffix, tools, harmony = _chat(body, tokenizer, served)
    prompt = api.chat_prompt(chat, tokenizer, max_seq_len, suffix)
    chat = chat.model_copy(update={"max_tokens": min(body.max_tokens, max(1, max_seq_len - len(prompt)))})
    prep = api.prepare(chat, prompt, max_seq_len=max_seq_len, default_max=None)
    return MessagesRequest(dataclasses.replace(prep, channels=harmony, tools=tools), body.max_tokens, body.thinks)


def count_tokens(raw: bytes, tokenizer: TextTokenizer, *, served: str) -> int:
    """The token count of the prompt a /v1/messages/count_tokens body (JSON bytes) renders (with its
    tools and forced call opening), however long. Raises ApiError."""
    body = parse_messages(CountBody, raw)
    chat, suffix, _, _ = _chat(body, tokenizer, served)
    return len(api.chat_prompt(chat, tokenizer, None, suffix))


def usage(ev: Event) -> dict[str, Any]:
    """Anthropic's usage of a request's final Event: input_tokens computed, cache_read_input_tokens
    restored from the prefix cache, output_tokens; the extension field "expertcache" (openai_api.timing_fields)."""
    cached = ev.timing.cached_prompt_tokens if ev.timing is not None else 0
    out: dict[str, Any] = {"input_tokens": ev.prompt_tokens - cached, "output_tokens": ev.completion_tokens,
                           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    if ev.timing is not None:
        out["expertcache"] = api.timing_fields(ev.timing)
    return out


def stop_reason(ev: Event, called: bool, max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply ended by `ev`, `called`: whether it made a tool call."""
    if called:
        return "tool_use", None
    if ev.finish_reason == "length":
        return "max_tokens" if ev.completion_tokens >= max_tokens else "model_context_window_exceeded", None
    if ev.stop_sequence is not None:
        return "stop_sequence", ev.stop_sequence
    return "end_turn", None


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a tool_use block; its id is the call's, as toolu_<hex>."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def message_body(rid: str, model: str, req: MessagesRequest, text: str, reasoning: str,
                 calls: list[ToolCall], last: Event) -> dict[str, Any]:
    """The Message of a finished reply: a thinking block (when asked for), the text (none where only
    whitespace is left beside tool calls), the tool_use blocks."""
    content: list[dict[str, Any]] = []
    if req.thinking and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text and (text.strip() or not calls):
        content.append({"type": "text", "text": text})
    content.extend(tool_use(c) for c in calls)
    reason, sequence = stop_reason(last, bool(calls), req.max_tokens)
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(last)}


class MessageStream:
    """The SSE text of an Anthropic stream, written Event by Event (server._stream reads the Events).

    start: message_start (empty content; usage.input_tokens the whole prompt, as whether the prefix cache
    restores part of it is known once the request runs: message_delta's usage has the split). Then each
    block as content_block_start, its deltas, content_block_stop: a thinking block's thinking_delta, a text
    block's text_delta, a tool_use block's whole input as one input_json_delta once its call closed. Text
    that is only whitespace and opens no block yet is held back: it is dropped where a call follows it (as
    message_body drops it beside calls). At the final Event: message_delta (stop_reason, stop_sequence,
    usage) and message_stop. An error: `event: error` with Anthropic's error body, and nothing after it.
    """

    def __init__(self, rid: str, model: str, req: MessagesRequest) -> None:
        self.rid, self.model, self.req = rid, model, req
        self.index = 0  # the index of the open block, or of the next one
        self.open: str | None = None  # the type of the open block
        self.held = ""  # whitespace not sent yet
        self.called = False

    def _event(self, kind: str, **fields: Any) -> str:
        return api.sse({"type": kind, **fields}, kind)

    def start(self) -> str:
        use = {"input_tokens": len(self.req.prep.prompt), "output_tokens": 0, "cache_read_input_tokens": 0,
               "cache_creation_input_tokens": 0}
        return self._event("message_start", message={
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": use})

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open, self.index = None, self.index + 1
        return self._event("content_block_stop", index=self.index - 1)

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> str:
        """A delta of the open block of type `kind`, after closing another and starting it (`block`)."""
        out = ""
        if self.open != kind:
            out = self._close() + self._event("content_block_start", index=self.index, content_block=block)
            self.open = kind
        return out + self._event("content_block_delta", index=self.index, delta=delta)

    def _text(self, text: str, final: bool = False) -> str:
        text, self.held = self.held + text, ""
        if self.open != "text" and not text.strip() and not final:
            self.held = text
            return ""
        return self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text}) if text else ""

    def _call(self, call: ToolCall) -> str:
        self.held, self.called = "", True
        block = tool_use(call)
        out = self._close() + self._event("content_block_start", index=self.index, content_block={**block, "input": {}})
        out += self._event("content_block_delta", index=self.index,
                           delta={"type": "input_json_delta", "partial_json": call.arguments})
        self.index += 1
        return out + self._event("content_block_stop", index=self.index - 1)

    def take(self, ev: Event) -> str:
        out = []
        if ev.reasoning and self.req.thinking:
            out.append(self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking_delta", "thinking": ev.reasoning}))
        if ev.text:
            out.append(self._text(ev.text))
        out.extend(self._call(c) for c in ev.tool_calls)
        if ev.final:
            if not self.called:
                out.append(self._text("", final=True))
            reason, sequence = stop_reason(ev, self.called, self.req.max_tokens)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            out += [self._close(), self._event("message_delta", delta=delta, usage=usage(ev)),
                    self._event("message_stop")]
        return "".join(out)

    def error(self, err: ApiError) -> str:
        return api.sse(anthropic_error(err), "error")

    def end(self) -> str:
        return ""
