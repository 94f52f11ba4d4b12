"""The request bodies of the OpenAI-compatible API, parsed strictly from the raw JSON bytes.

    body bytes ──parse_body(CompletionBody | ChatBody)──► pydantic, strict JSON mode:
        no coercion ("5" is not an int, "yes" not a bool), unknown fields refused
        ──check_unsupported──► OpenAI fields this server does not implement are accepted only
        with the value that means "off" (many clients always send them); any other value is refused
        ──► a checked body, or ApiError 400 naming the field (param = "messages.0.content.1.type")

Implemented: model, prompt / messages (text or a list of text content parts), max_tokens
(max_completion_tokens), temperature, top_p, n = 1, stop, stream, stream_options.include_usage,
seed, logprobs (completions: an int 0-5; chat: a bool with top_logprobs 0-20) and user (an end-user
id: accepted, no effect). Limits: at most MAX_STOP stop strings of at most MAX_STOP_CHARS characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe.serve.sampling import MAX_TOP_LOGPROBS


class ApiError(Exception):
    """An error answered to the client: status, message, OpenAI type, the offending param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

MAX_STOP = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # each stop string is held back and searched on every token
MAX_LOGPROBS = 5  # completions: OpenAI's limit of `logprobs` (chat's top_logprobs: MAX_TOP_LOGPROBS, 20)


def _zero(v: Any) -> bool:
    return type(v) in (int, float) and v == 0


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def _empty(v: Any) -> bool:
    return v in ([], {}) and type(v) in (list, dict)


def _never(v: Any) -> bool:
    return False


Neutral = dict[str, tuple[Callable[[Any], bool], str]]
# OpenAI fields this server does not implement, per body: a field passes when it is null or its
# predicate holds (the value meaning "off"); any other field a body does not declare is unknown.
_COMMON: Neutral = {
    "frequency_penalty": (_zero, "0"),
    "presence_penalty": (_zero, "0"),
    "logit_bias": (_empty, "{}"),
    "tools": (_empty, "[]"),
    "tool_choice": (_is("none"), '"none"'),
    "functions": (_empty, "[]"),
    "function_call": (_is("none"), '"none"'),
    "parallel_tool_calls": (_is(True, False), "a bool (no tools are called)"),
    "response_format": (_is({"type": "text"}), '{"type": "text"}'),
    "store": (_is(False), "false"),
    "metadata": (_empty, "{}"),
    "service_tier": (_is("auto", "default"), '"auto"'),
}
_COMPLETION: Neutral = {**_COMMON, "best_of": (_is(1), "1"), "echo": (_is(False), "false"), "suffix": (_is(""), '""')}
_CHAT: Neutral = {**_COMMON, "modalities": (_is(["text"]), '["text"]')}
# what a client echoes back from a response message
_MESSAGE: Neutral = {"tool_calls": (_empty, "[]"), "function_call": (_empty, "null"), "annotations": (_empty, "[]"),
                     "refusal": (_never, "null"), "audio": (_never, "null")}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """A strict model that keeps undeclared fields (model_extra) for check_extra to judge by NEUTRAL."""

    model_config = ConfigDict(extra="allow", strict=True)
    NEUTRAL: ClassVar[Neutral] = {}


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Body(_Open):
    NEUTRAL: ClassVar[Neutral] = _COMMON
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    NEUTRAL: ClassVar[Neutral] = _COMPLETION

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives to report per sampled token, None for no logprobs."""
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    NEUTRAL: ClassVar[Neutral] = _MESSAGE

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template sees it: role, content text (parts joined), name."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        out.update({k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None})
        return out


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    NEUTRAL: ClassVar[Neutral] = _CHAT

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# a \\uD800-\\uDBFF escape not followed by a \\uDC00-\\uDFFF one, or the latter without the former
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def json_error(detail: str, raw: bytes = b"") -> ApiError:
    """400 invalid_json for a body (`raw`) the JSON parser refused with `detail`, saying what is wrong:
    an empty body, one that ends early (truncated), a lone UTF-16 surrogate escape, bytes that are not
    UTF-8, or else a syntax error; `detail` (with the parser's line and column) follows in parentheses."""
    if not raw.strip():
        what = "the body is empty; send a JSON object"
    elif detail.startswith("EOF while parsing"):
        what = "it ends before the JSON does (truncated?); send the whole document"
    elif ("surrogate" in detail or "hex escape" in detail) and _LONE_SURROGATE.search(raw):
        what = ("a string holds a lone UTF-16 surrogate escape (such as \\ud800), which is not text; send the "
                "character itself or its surrogate pair")
    elif detail.startswith("invalid unicode code point"):
        what = "it is not UTF-8 text; encode the body as UTF-8"
    else:
        what = "a syntax error"
    return ApiError(400, f"the request body is not valid JSON: {what} ({detail})", code="invalid_json")


def validation_error(errors: list[dict[str, Any]], raw: bytes = b"") -> ApiError:
    """A pydantic ValidationError's most specific error (the deepest location: for a union it is the
    member that came closest) as a 400 naming the field; invalid JSON as json_error of `raw`."""
    if not errors:
        return ApiError(400, "the request body is invalid", code="invalid_body")
    err = max(errors, key=lambda e: len(e.get("loc", ())))  # max keeps the first of equal depth
    if err.get("type") == "json_invalid":
        return json_error(err.get("ctx", {}).get("error", err["msg"]), raw)
    # loc: field, index, field, ... plus pydantic's union member tags ("str", "list[TextPart]")
    loc = [str(x) for x in err.get("loc", ()) if isinstance(x, int) or (str(x).isidentifier()
                                                                        and x not in _TYPE_TAGS)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field: this server does not implement it; remove it"
    elif err.get("type") == "model_type":
        msg = "the request body must be a JSON object"
    return ApiError(400, f"{param or 'body'}: {msg}", param=param,
                    code="unknown_parameter" if err.get("type") == "extra_forbidden"
                    else "invalid_value" if param else "invalid_body")


def check_extra(model: _Open, where: str = "") -> None:
    """Raise ApiError 400 naming the first undeclared field of `model`: unknown to its NEUTRAL table,
    or an unimplemented field set to something other than "off". `where` prefixes the param."""
    for name, value in (model.model_extra or {}).items():
        param = f"{where}{name}"
        if name not in model.NEUTRAL:
            raise ApiError(400, f"{param}: unknown field: this server does not implement it; remove it",
                           param=param, code="unknown_parameter")
        neutral, off = model.NEUTRAL[name]
        if value is not None and not neutral(value):
            raise ApiError(400, f"{param}: not supported by this server; leave it out or send {off}",
                           param=param, code="unsupported_parameter")


def check_unsupported(body: _Body) -> None:
    """Raise ApiError 400 naming the first field the server cannot honour as given."""
    check_extra(body)
    if body.n is not None and body.n != 1:
        raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n", code="invalid_value")
    stops = body.stops
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", param="stop",
                       code="invalid_value")
    long = [s for s in stops if len(s) > MAX_STOP_CHARS]
    if long:
        raise ApiError(400, f"stop: a stop string has {len(long[0])} characters; at most {MAX_STOP_CHARS}",
                       param="stop", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    if isinstance(body, ChatBody):
        for i, m in enumerate(body.messages):
            check_extra(m, f"messages.{i}.")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """The checked body of `raw` (JSON bytes). Raises ApiError 400 naming the field."""
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), raw) from None
    check_unsupported(body)
    return body
