"""The OpenAI-compatible wire format: request bodies in, checked prompts and params out, response
bodies and OpenAI-style errors back.

    JSON body ──pydantic (CompletionBody / ChatBody)──► fields (RequestValidationError → 400 naming
        the field) ──prepare──► Prepared(prompt ids, SamplingParams) or ApiError (400 n / prompt /
        max_tokens / context length, 404 model)
    Events of the scheduler ──completion_body / chat_body / *_chunk──► response JSON, SSE chunks

Errors are {"error": {"message", "type", "param", "code"}} with the HTTP status of ApiError.status.
max_tokens defaults to 16 for /v1/completions (OpenAI's default) and to the rest of the context for
chat; prompt + max_tokens must fit in --max-seq-len. temperature defaults to 1 (OpenAI's default).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moe.sampling import SamplingParams
from moe.tokenizer import TextTokenizer, TokenizerError


class ApiError(Exception):
    """An error answered to the client: status, message, OpenAI type, the offending param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """A pydantic RequestValidationError's first error as a 400 naming the field."""
    err = errors[0] if errors else {}
    # loc: ("body", field, index, field, ...) plus pydantic's union member tags ("str", "list[int]")
    loc = [str(x) for x in err.get("loc", ())[1:] if isinstance(x, int) or (str(x).isidentifier()
                                                                            and x not in _TYPE_TAGS)]
    if err.get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON", code="invalid_json")
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param,
                    code="invalid_value" if param else "invalid_body")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


@dataclass(frozen=True)
class Prepared:
    """A checked request: prompt token ids and what to generate."""

    prompt: list[int]
    params: SamplingParams


def completion_prompt(body: CompletionBody, tokenizer: TextTokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids: a string (encoded), a list of ids, or a one-element list of either."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one "
                           "prompt per request", param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"prompt: token id {bad[0]} is outside [0, {vocab_size})", param="prompt",
                       code="invalid_value")
    return list(prompt)


def chat_prompt(body: ChatBody, tokenizer: TextTokenizer) -> list[int]:
    """The chat template rendered with the messages, as token ids."""
    try:
        return tokenizer.encode_chat([m.as_dict() for m in body.messages])
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", param="messages", code="invalid_value") from None


def prepare(body: _Body, prompt: list[int], *, served: str, max_seq_len: int, default_max: int | None) -> Prepared:
    """Check model, n, prompt length and max_tokens; build the SamplingParams. Raises ApiError."""
    prompt_param = "messages" if isinstance(body, ChatBody) else "prompt"
    if body.model != served:
        raise ApiError(404, f"model {body.model!r} does not exist: this server serves {served!r} (see /v1/models)",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n", code="invalid_value")
    if not prompt:
        raise ApiError(400, f"{prompt_param}: the prompt is empty", param=prompt_param, code="invalid_value")
    if len(prompt) >= max_seq_len:
        raise ApiError(400, f"{prompt_param}: the prompt has {len(prompt)} tokens; this server's context is "
                       f"{max_seq_len} tokens (--max-seq-len) and needs room for one new token",
                       param=prompt_param, code="context_length_exceeded")
    room = max_seq_len - len(prompt)
    explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if explicit is not None and explicit > room:
        raise ApiError(400, f"max_tokens: {len(prompt)} prompt tokens + max_tokens={explicit} exceed the "
                       f"context of {max_seq_len} tokens (--max-seq-len); ask for at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    max_tokens = explicit or min(room, default_max or room)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            seed=body.seed, stop=stop)
    return Prepared(prompt, params)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int]) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int]) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, int]) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
