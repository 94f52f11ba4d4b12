"""The OpenAI-compatible wire format: raw request bodies in, checked prompts and params out, response
bodies, stream chunks and OpenAI-style errors back.

    body bytes ──prepare_completion / prepare_chat (on a worker thread: parsing and tokenizing a long
        prompt never stalls the event loop)──► openai_schema.parse_body (400 naming the field)
        ──model (404), prompt: text tokenized within the context (TooManyTokens → 400 before the rest
        of a long text is tokenized), token ids range-checked, max_tokens──► Prepared
        chat with tools: chat_tools ──► the tools for the template, a forced call opening after the
        generation prompt (tool_choice "required" / named), ToolParsing of the reply (moe.serve.tools)
    Events of the scheduler ──completion_body / chat_body (+ logprobs, tool_calls)──► JSON
                            ──ChunkStream (*_chunk, the usage chunk, [DONE])──► SSE

Errors are {"error": {"message", "type", "param", "code"}} with the HTTP status of ApiError.status.
max_tokens defaults to 16 for /v1/completions (OpenAI's default) and to the rest of the context for
chat; prompt + max_tokens must fit in --max-seq-len. temperature defaults to 1 (OpenAI's default).
Logprobs are the model's (log_softmax of the logits, before temperature and top-p); a token's text is
its own decode, special tokens included, or where that is not text OpenAI's "bytes:\\x.." form or
"token_id:N" (TextTokenizer.token_text), so that every alternative asked for is reported, each with its
own logprob.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moe.serve.harmony import harmony_ids
from moe.serve.openai_schema import ApiError, ChatBody, CompletionBody, parse_body
from moe.serve.sampling import SamplingParams, TokenLogprob
from moe.serve.tokenizer import TextStream, TextTokenizer, TokenizerError, TooManyTokens
from moe.serve.tools import ToolCall, ToolParsing, ToolSyntax, forced_opening, template_syntax

if TYPE_CHECKING:
    from moe.serve.scheduler import Event, RequestTiming

__all__ = ["ApiError", "ChatBody", "CompletionBody", "Prepared", "prepare_chat", "prepare_completion"]


@dataclass(frozen=True)
class Prepared:
    """A checked request: prompt token ids, what to generate, and how to answer."""

    prompt: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    channels: bool = False  # a chat reply of a harmony model: split into reasoning and content (moe.serve.harmony)
    tools: ToolParsing | None = None  # read the reply's tool calls (moe.serve.tools)


def _too_long(param: str, count: str, max_seq_len: int) -> ApiError:
    return ApiError(400, f"{param}: the prompt has {count} tokens; this server's context is {max_seq_len} tokens "
                    "(--max-seq-len) and needs room for one new token", param=param, code="context_length_exceeded")


def _encode(tokenizer: TextTokenizer, text: str, param: str, max_seq_len: int, **kw) -> list[int]:
    try:
        return tokenizer.encode_within(text, max_seq_len - 1, **kw)
    except TooManyTokens as e:
        raise _too_long(param, str(e).removesuffix(" tokens"), max_seq_len) from None


def completion_prompt(body: CompletionBody, tokenizer: TextTokenizer, vocab_size: int, max_seq_len: int) -> list[int]:
    """The prompt's token ids: a string (encoded), a list of ids, or a one-element list of either."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one "
                           "prompt per request", param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, "prompt", max_seq_len)
    if len(prompt) >= max_seq_len:
        raise _too_long("prompt", str(len(prompt)), max_seq_len)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is outside [0, {vocab_size})", param="prompt",
                       code="invalid_value")
    return list(prompt)


def chat_tools(body: ChatBody, tokenizer: TextTokenizer) -> tuple[str, ToolParsing | None]:
    """(text to append after the generation prompt, how to read the reply's calls) of a chat request.

    tool_choice "none" (or no tools): nothing is parsed, the reply is content. "auto": calls are parsed
    where the model writes them. "required" and a named function are enforced by appending the family's
    call opening to the prompt (tools.forced_opening: Qwen's "<tool_call>\\n", or with the function's name
    already written), so that the model continues inside a call; there is no grammar-constrained
    decoding, so what it writes there is parsed like any other call. Raises ApiError 400 naming `tools`
    when the model's chat template writes no call syntax this server parses.
    """
    choice = body.choice
    if choice == "none":
        return "", None
    syntax = ToolSyntax.HARMONY if harmony_ids(tokenizer) is not None else template_syntax(tokenizer)
    if syntax is None:
        raise ApiError(400, "tools: this model's chat template writes no tool-call syntax this server parses "
                       "(Qwen3 / Hermes <tool_call> JSON, GLM-4.5 <arg_key> / <arg_value>, gpt-oss harmony); "
                       'leave tools out or send tool_choice "none"', param="tools", code="invalid_value")
    suffix, seed = "", ""
    if choice != "auto":
        suffix, seed = forced_opening(syntax, body.tool_choice.function.name if choice == "function" else None)
    schemas = {t.function.name: t.function.parameters or {} for t in body.tools}
    return suffix, ToolParsing(syntax, schemas, seed, parallel=body.parallel_tool_calls is not False)


def chat_prompt(body: ChatBody, tokenizer: TextTokenizer, max_seq_len: int | None, suffix: str = "") -> list[int]:
    """The chat template rendered with the messages and tools, then `suffix`, as token ids: within the
    context (ApiError 400 context_length_exceeded past it), or every one of them when max_seq_len is None
    (a count)."""
    try:
        text = tokenizer.render_chat([m.as_dict() for m in body.messages], body.tool_dicts())
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", param="messages", code="invalid_value") from None
    if max_seq_len is None:
        return tokenizer.encode(text + suffix, add_special_tokens=False)
    return _encode(tokenizer, text + suffix, "messages", max_seq_len, add_special_tokens=False)


def check_model(body, served: str) -> None:
    """Raise ApiError 404 model_not_found unless `body.model` is the served name."""
    if body.model != served:
        raise ApiError(404, f"model {body.model!r} does not exist: this server serves {served!r} (see /v1/models)",
                       param="model", code="model_not_found")


def prepare(body: CompletionBody | ChatBody, prompt: list[int], *, max_seq_len: int,
            default_max: int | None) -> Prepared:
    """Check the prompt's length and max_tokens; build the SamplingParams. Raises ApiError."""
    prompt_param = "messages" if isinstance(body, ChatBody) else "prompt"
    if not prompt:
        raise ApiError(400, f"{prompt_param}: the prompt is empty", param=prompt_param, code="invalid_value")
    if len(prompt) >= max_seq_len:
        raise _too_long(prompt_param, str(len(prompt)), max_seq_len)
    room = max_seq_len - len(prompt)
    explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if explicit is not None and explicit > room:
        raise ApiError(400, f"max_tokens: {len(prompt)} prompt tokens + max_tokens={explicit} exceed the "
                       f"context of {max_seq_len} tokens (--max-seq-len); ask for at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    max_tokens = explicit or min(room, default_max or room)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, stop=body.stops,
                            logprobs=body.top_logprobs_wanted())
    return Prepared(prompt, params, bool(body.stream), body.include_usage)


def prepare_completion(raw: bytes, tokenizer: TextTokenizer, *, vocab_size: int, served: str,
                       max_seq_len: int) -> Prepared:
    """A /v1/completions body (JSON bytes) as a Prepared request. Raises ApiError."""
    body = parse_body(CompletionBody, raw)
    check_model(body, served)
    return prepare(body, completion_prompt(body, tokenizer, vocab_size, max_seq_len), max_seq_len=max_seq_len,
                   default_max=16)


def prepare_chat(raw: bytes, tokenizer: TextTokenizer, *, served: str, max_seq_len: int) -> Prepared:
    """A /v1/chat/completions body (JSON bytes) as a Prepared request. Raises ApiError."""
    body = parse_body(ChatBody, raw)
    check_model(body, served)
    suffix, tools = chat_tools(body, tokenizer)
    prep = prepare(body, chat_prompt(body, tokenizer, max_seq_len, suffix), max_seq_len=max_seq_len,
                   default_max=None)
    return dataclasses.replace(prep, channels=harmony_ids(tokenizer) is not None, tools=tools)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, timing=None) -> dict:
    """OpenAI's usage; with the request's RequestTiming (moe.serve.scheduler), also OpenAI's
    prompt_tokens_details.cached_tokens and the extension field "expertcache": seconds in the queue,
    of prefill, to the first token and of decode, and prefill and decode tokens per second."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if timing is not None:
        out["prompt_tokens_details"] = {"cached_tokens": timing.cached_prompt_tokens}
        out["expertcache"] = timing_fields(timing)
    return out


def timing_fields(timing: RequestTiming) -> dict[str, float]:
    """The usage's extension field "expertcache" of a finished request: seconds in the queue, of prefill,
    to the first token and of decode, and prefill and decode tokens per second."""
    return {"queue_s": timing.queue_s, "prefill_s": timing.prefill_s,
            "time_to_first_token_s": timing.time_to_first_token_s, "decode_s": timing.decode_s,
            "prefill_tokens_per_s": timing.prefill_tokens_per_s, "decode_tokens_per_s": timing.decode_tokens_per_s}


def completion_logprobs(tokenizer: TextTokenizer, lps: Sequence[TokenLogprob], offset: int = 0) -> dict | None:
    """The legacy completions `logprobs` object of `lps`. text_offset: where each token's text starts
    in the generated text (decoded as the response's text is), counted from `offset`."""
    if not lps:
        return None
    stream, offsets = TextStream(tokenizer), []
    for lp in lps:
        offsets.append(offset + len(stream.decoded))
        stream.push(lp.token)
    return {"tokens": [tokenizer.token_text(lp.token) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [_top_texts(tokenizer, lp.top) for lp in lps], "text_offset": offsets}


def _top_texts(tokenizer: TextTokenizer, top: Sequence[tuple[int, float]]) -> dict[str, float]:
    """{text: logprob} of the alternatives, one key each: an id whose text an earlier one already holds
    (two tokens that spell the same text) is named "token_id:N", so no alternative is lost."""
    out: dict[str, float] = {}
    for token, logprob in top:
        text = tokenizer.token_text(token)
        out[f"token_id:{token}" if text in out else text] = logprob
    return out


def _chat_entry(tokenizer: TextTokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"token": tokenizer.token_text(token), "logprob": logprob, "bytes": None if raw is None else list(raw)}


def chat_logprobs(tokenizer: TextTokenizer, lps: Sequence[TokenLogprob]) -> dict | None:
    """The chat `logprobs` object of `lps`: {"content": [...], "refusal": None}."""
    if not lps:
        return None
    content = [dict(_chat_entry(tokenizer, lp.token, lp.logprob),
                    top_logprobs=[_chat_entry(tokenizer, i, v) for i, v in lp.top]) for lp in lps]
    return {"content": content, "refusal": None}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int],
                    logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int],
              logprobs: dict | None = None, reasoning: str | None = None,
              tool_calls: Sequence[ToolCall] = ()) -> dict:
    """A chat.completion; `reasoning` (a harmony model's analysis channel) as message.reasoning_content;
    with `tool_calls`, message.tool_calls, the content null where only whitespace is left beside them,
    and finish_reason "tool_calls"."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [c.as_dict() for c in tool_calls]
        message["content"] = text if text.strip() else None
        finish = "tool_calls"
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": use}


def tool_calls_delta(calls: Sequence[ToolCall], first_index: int) -> dict[str, list]:
    """A stream's delta of whole `calls`, numbered from `first_index` (the calls streamed before them)."""
    return {"tool_calls": [{"index": first_index + i, **c.as_dict()} for i, c in enumerate(calls)]}


def chat_chunk(rid: str, model: str, delta: dict[str, Any] | str, finish: str | None,
               logprobs: dict | None = None) -> dict:
    """A chat.completion.chunk of `delta` (a text as {"content": text})."""
    delta = {"content": delta} if isinstance(delta, str) else delta
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, int]) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event: `data: JSON`, after an `event: NAME` line when `event` is given."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(obj)}\n\n"


class ChunkStream:
    """The SSE text of an OpenAI stream, written Event by Event (server._stream reads the Events): `first`
    (if any) at the start, a chunk per text delta and per closed tool call (with the logprobs of their
    tokens), at the final Event a finish chunk ("tool_calls" once a call came) and, with include_usage,
    the usage chunk; an error as {"error": ...}; `data: [DONE]` at the end, whatever happened.
    chunk(rid, model, delta, finish, logprobs) writes one chunk; logprobs(TokenLogprobs) their object."""

    def __init__(self, rid: str, model: str, chunk: Callable, first: dict | None, obj: str, include_usage: bool,
                 logprobs: Callable) -> None:
        self.rid, self.model, self.chunk, self.first, self.obj = rid, model, chunk, first, obj
        self.include_usage, self.logprobs = include_usage, logprobs
        self.pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
        self.called = 0  # tool calls streamed

    def _chunk(self, delta, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse(self.chunk(self.rid, self.model, delta, finish, logprobs))

    def start(self) -> str:
        return "" if self.first is None else self._chunk(self.first)

    def take(self, ev: Event) -> str:
        out = []
        if ev.logprob is not None:
            self.pending.append(ev.logprob)
        if ev.reasoning:  # only a chat request of a harmony model has any
            out.append(self._chunk({"reasoning_content": ev.reasoning}))
        if ev.text:
            out.append(self._chunk(ev.text, None, self.logprobs(self.pending)))
            self.pending = []
        if ev.tool_calls:  # only a chat request with tools has any
            out.append(self._chunk(tool_calls_delta(ev.tool_calls, self.called), None, self.logprobs(self.pending)))
            self.pending, self.called = [], self.called + len(ev.tool_calls)
        if ev.final:
            finish = "tool_calls" if self.called else ev.finish_reason
            out.append(self._chunk("" if self.first is None else {}, finish, self.logprobs(self.pending)))
            if self.include_usage:
                out.append(sse(usage_chunk(self.rid, self.model, self.obj,
                                           usage(ev.prompt_tokens, ev.completion_tokens, ev.timing))))
        return "".join(out)

    def error(self, err: ApiError) -> str:
        return sse(err.body())

    def end(self) -> str:
        return "data: [DONE]\n\n"
