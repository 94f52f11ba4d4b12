"""The request bodies of the OpenAI-compatible API, parsed strictly from the raw JSON bytes.

    body bytes ──parse_body(CompletionBody | ChatBody)──► pydantic, strict JSON mode:
        no coercion ("5" is not an int, "yes" not a bool), unknown fields refused
        ──check_unsupported──► OpenAI fields this server does not implement are accepted only
        with the value that means "off" (many clients always send them); any other value is refused
        ──► a checked body, or ApiError 400 naming the field (param = "messages.0.content.1.type")

Implemented: model, prompt / messages (text or a list of text content parts), max_tokens
(max_completion_tokens), temperature, top_p, n = 1, stop, stream, stream_options.include_usage,
seed, logprobs (completions: an int 0-5; chat: a bool with top_logprobs 0-20), user (an end-user
id: accepted, no effect) and, on chat, tools, tool_choice, parallel_tool_calls, assistant messages'
tool_calls and tool messages' tool_call_id (check_tools). Limits: at most MAX_STOP stop strings of at
most MAX_STOP_CHARS characters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
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


def is_(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def empty(v: Any) -> bool:
    return v in ([], {}) and type(v) in (list, dict)


def never(v: Any) -> bool:
    return False


Neutral = dict[str, tuple[Callable[[Any], bool], str]]
# OpenAI fields this server does not implement, per body: a field passes when it is null or its
# predicate holds (the value meaning "off"); any other field a body does not declare is unknown.
_COMMON: Neutral = {
    "frequency_penalty": (_zero, "0"),
    "presence_penalty": (_zero, "0"),
    "logit_bias": (empty, "{}"),
    "tools": (empty, "[]"),
    "tool_choice": (is_("none"), '"none"'),
    "functions": (empty, "[]"),
    "function_call": (is_("none"), '"none"'),
    "parallel_tool_calls": (is_(True, False), "a bool (no tools are called)"),
    "response_format": (is_({"type": "text"}), '{"type": "text"}'),
    "store": (is_(False), "false"),
    "metadata": (empty, "{}"),
    "service_tier": (is_("auto", "default"), '"auto"'),
}
_COMPLETION: Neutral = {**_COMMON, "best_of": (is_(1), "1"), "echo": (is_(False), "false"), "suffix": (is_(""), '""')}
_CHAT: Neutral = {**_COMMON, "modalities": (is_(["text"]), '["text"]')}
# what a client echoes back from a response message
_MESSAGE: Neutral = {"function_call": (empty, "null"), "annotations": (empty, "[]"),
                     "refusal": (never, "null"), "audio": (never, "null")}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OpenModel(BaseModel):
    """A strict model that keeps undeclared fields (model_extra) for check_extra to judge by NEUTRAL."""

    model_config = ConfigDict(extra="allow", strict=True)
    NEUTRAL: ClassVar[Neutral] = {}


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class _Body(OpenModel):
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


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallItem(StrictModel):
    """A call of an earlier assistant reply, as the response gave it."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    NEUTRAL: ClassVar[Neutral] = _MESSAGE

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, content text (parts joined), name,
        tool_call_id, and tool_calls with each call's arguments as a mapping (the JSON object its text
        holds: Qwen3's template prints it, GLM-4.5's iterates its items, gpt-oss's writes it with tojson)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        out.update({k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None})
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        return out


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    NEUTRAL: ClassVar[Neutral] = _CHAT

    @property
    def choice(self) -> str:
        """tool_choice as "none", "auto", "required" or "function" (a named one; its name in
        tool_choice.function.name); without it "auto" when there are tools, else "none"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (the fields the request gave, a missing description
        as "": gpt-oss's template writes each tool's description), None without any."""
        if not self.tools:
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        for tool in tools:
            tool["function"].setdefault("description", "")
        return tools

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
    # loc: field, index, field, ... plus pydantic's union member tags ("str", "list[TextPart]", a model's
    # class name such as "NamedToolChoice": no field of the API starts with a capital)
    loc = [str(x) for x in err.get("loc", ()) if isinstance(x, int) or (str(x).isidentifier()
                                                                        and x not in _TYPE_TAGS and not x[0].isupper())]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field: this server does not implement it; remove it"
    elif err.get("type") == "model_type":
        msg = "the request body must be a JSON object"
    return ApiError(400, f"{param or 'body'}: {msg}", param=param,
                    code="unknown_parameter" if err.get("type") == "extra_forbidden"
                    else "invalid_value" if param else "invalid_body")


def check_extra(model: OpenModel, where: str = "") -> None:
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


def check_stops(stops: Sequence[str], param: str) -> None:
    """Raise ApiError 400 naming `param` for more than MAX_STOP stop strings or one above MAX_STOP_CHARS."""
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"{param}: at most {MAX_STOP} stop strings, got {len(stops)}", param=param,
                       code="invalid_value")
    long = [s for s in stops if len(s) > MAX_STOP_CHARS]
    if long:
        raise ApiError(400, f"{param}: a stop string has {len(long[0])} characters; at most {MAX_STOP_CHARS}",
                       param=param, code="invalid_value")


def check_unsupported(body: _Body) -> None:
    """Raise ApiError 400 naming the first field the server cannot honour as given."""
    check_extra(body)
    if body.n is not None and body.n != 1:
        raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n", code="invalid_value")
    check_stops(body.stops, "stop")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    if isinstance(body, ChatBody):
        for i, m in enumerate(body.messages):
            check_extra(m, f"messages.{i}.")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
        check_tools(body)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _check_parameters(schema: dict[str, Any] | None, param: str) -> None:
    """A function's parameters: a JSON Schema of an object, its properties each a schema (object)."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise invalid(f"{param}.type", f"must be \"object\" (the arguments are a JSON object), got {schema['type']!r}")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict) for v in properties.values()):
        raise invalid(f"{param}.properties", "must be an object mapping each argument's name to its JSON Schema")


def check_tool_defs(tools: Sequence[tuple[str, str, dict[str, Any] | None]], schema_field: str) -> dict[str, int]:
    """Raise ApiError 400 naming the first tool whose name is outside OpenAI's (and Anthropic's) rule or
    given twice, or whose parameters are not an object's JSON Schema. `tools`: (the tool's param, such as
    "tools.0.function", its name, its schema) each; `schema_field`: the schema's field name. Returns
    {name: index}."""
    names: dict[str, int] = {}
    for i, (param, name, schema) in enumerate(tools):
        if not TOOL_NAME.fullmatch(name):
            raise invalid(f"{param}.name", f"{name!r} is not 1-64 letters, digits, underscores or dashes")
        if name in names:
            raise invalid(f"{param}.name", f"{name!r} is already the name of tools.{names[name]}")
        names[name] = i
        _check_parameters(schema, f"{param}.{schema_field}")
    return names


def check_tools(body: ChatBody) -> None:
    """Raise ApiError 400 naming the first tool field that cannot be served: a tool name outside OpenAI's
    rule or given twice, parameters that are not an object's schema, a tool_choice that needs tools or
    names a function not in them, tool_calls on a message that is not the assistant's or with arguments
    that are not a JSON object, a tool message without the id of a call of an earlier assistant message."""
    names = check_tool_defs([(f"tools.{i}.function", t.function.name, t.function.parameters)
                             for i, t in enumerate(body.tools or ())], "parameters")
    choice = body.choice
    if choice != "none" and not body.tools:
        raise invalid("tool_choice", f"{choice!r} needs tools; send tools, or leave tool_choice out")
    if choice == "function" and body.tool_choice.function.name not in names:
        raise invalid("tool_choice", f"function {body.tool_choice.function.name!r} is not in tools")
    calls: set[str] = set()
    for i, m in enumerate(body.messages):
        if m.tool_calls and m.role != "assistant":
            raise invalid(f"messages.{i}.tool_calls", f"only assistant messages carry tool_calls, not {m.role}")
        for j, call in enumerate(m.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as e:
                arguments = e
            if not isinstance(arguments, dict):
                raise invalid(f"messages.{i}.tool_calls.{j}.function.arguments",
                               f"must be the text of a JSON object, got {call.function.arguments[:80]!r}")
            calls.add(call.id)
        if m.role == "tool" and m.tool_call_id is None:
            raise invalid(f"messages.{i}.tool_call_id", "a tool message needs the id of the call it answers")
        if m.role == "tool" and m.tool_call_id not in calls:
            raise invalid(f"messages.{i}.tool_call_id",
                           f"{m.tool_call_id!r} is not the id of a tool call of an earlier assistant message")


def parse_body(model: type[_Body], raw: bytes) -> _Body:
    """The checked body of `raw` (JSON bytes). Raises ApiError 400 naming the field."""
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), raw) from None
    check_unsupported(body)
    return body
