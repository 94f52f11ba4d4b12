"""The request bodies of the Anthropic Messages API, parsed strictly, and the Anthropic form of errors.

    body bytes ──parse_messages(MessagesBody | CountBody)──► pydantic in strict JSON mode, as
        openai_schema.parse_body: no coercion, unknown fields refused, a field this server does not
        implement accepted only with the value meaning "off" (NEUTRAL) ──check_messages──► tools,
        tool_choice, stop_sequences, top_k, thinking, the blocks each role may hold, tool_result ids
        ──► a checked body, or ApiError 400 naming the field ("messages.2.content.0.tool_use_id")
    ApiError ──anthropic_error──► {"type": "error", "error": {"type", "message"}}, the type by HTTP status;
        error_body(path, err, anthropic_version) answers each path in its API's form (/v1/models in
        Anthropic's for a request with an anthropic-version header, as Anthropic's clients send)

Blocks: a user message holds text and tool_result blocks (a result's content a string or text blocks);
an assistant message text, tool_use, thinking and redacted_thinking blocks. cache_control is accepted
on every block, system block and tool and changes nothing (the prefix cache, --kv-cache-gb, keeps
prefixes by itself). Images, documents and server tools are refused: the served models read text.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from moe.serve.openai_schema import (
    ApiError,
    Neutral,
    OpenModel,
    StrictModel,
    check_extra,
    check_stops,
    check_tool_defs,
    empty,
    invalid,
    is_,
    never,
    validation_error,
)

MESSAGES_PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
MODELS_PATH = "/v1/models"
VERSION_HEADER = "anthropic-version"
# Anthropic's error type of each HTTP status this server answers with (others: by class, below)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def anthropic_error(err: ApiError) -> dict[str, Any]:
    """`err` as Anthropic's error body; its type by err.status (ERROR_TYPES; another 4xx is an
    invalid_request_error, another 5xx an api_error)."""
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def is_anthropic(path: str, anthropic_version: bool = False) -> bool:
    """Whether `path` answers in Anthropic's form: /v1/messages always, /v1/models (which both APIs have)
    for a request with an anthropic-version header."""
    def under(root: str) -> bool:
        return path == root or path.startswith(root + "/")
    return under(MESSAGES_PATH) or (anthropic_version and under(MODELS_PATH))


def error_body(path: str, err: ApiError, anthropic_version: bool = False) -> dict[str, Any]:
    """The body of `err` in the form of the API `path` belongs to (is_anthropic): Anthropic's under
    /v1/messages and, for a request with an anthropic-version header, /v1/models; OpenAI's elsewhere."""
    return anthropic_error(err) if is_anthropic(path, anthropic_version) else err.body()


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # what a client echoes back of a response's text block (this server cites nothing)


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None  # accepted: the result's text reaches the template as it is
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else join_text(self.content)


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


_TAGS = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
         "thinking": "ThinkingBlock", "redacted_thinking": "RedactedThinkingBlock"}


def _block_tag(value: Any) -> str | None:
    """The tag of a block: its class name, so that a validation error's location (which holds the tag)
    names fields only (validation_error drops capitalized tags); another type is its own tag (refused)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind, kind) if isinstance(kind, str) else None


Block = Annotated[
    Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")] | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
    | Annotated[RedactedThinkingBlock, Tag("RedactedThinkingBlock")], Discriminator(_block_tag)]


# Claude Code starts its system prompt with a telemetry line whose `cch=` hash changes on every
# request ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;"), as a block of its
# own or the first line of a string. It means nothing to the model; left in, the prompt would differ
# from the previous turn's at its first tokens and the prefix cache (--kv-cache-gb) would restore
# nothing, so it is dropped before the template renders the prompt (as vLLM and SGLang drop it).
BILLING_LINE = "x-anthropic-billing-header:"
_BILLING = re.compile(r"\A" + re.escape(BILLING_LINE) + r"[^\n]*(\n|\Z)")


def strip_billing(text: str) -> str:
    """`text` without a leading billing line (BILLING_LINE to the end of its line)."""
    return _BILLING.sub("", text, count=1)


def join_text(blocks: list) -> str:
    """The text of consecutive text blocks, joined as they are (as openai_schema joins text parts)."""
    return "".join(b.text for b in blocks)


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class Tool(StrictModel):
    type: Literal["custom"] | None = None  # first: a server tool's type is the error to report, not its schema
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(StrictModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class Metadata(StrictModel):
    user_id: str | None = None


# Anthropic fields this server does not implement: accepted when null or "off" (openai_schema.check_extra)
_COUNT: Neutral = {"mcp_servers": (empty, "[]"), "context_management": (never, "null")}
_MESSAGES: Neutral = {**_COUNT, "service_tier": (is_("auto", "standard_only"), '"auto"'),
                      "container": (never, "null")}


class CountBody(OpenModel):
    """A /v1/messages/count_tokens body: the conversation, its tools and tool_choice, thinking."""

    NEUTRAL: ClassVar[Neutral] = _COUNT
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @property
    def thinks(self) -> bool:
        """Whether the request asks for thinking blocks."""
        return self.thinking is not None and self.thinking.type != "disabled"

    @property
    def system_text(self) -> str:
        """The system prompt's text, less Claude Code's per-request billing line (BILLING_LINE)."""
        if isinstance(self.system, str):
            return strip_billing(self.system)
        texts = [b.text for b in self.system or []]  # joined as join_text joins them
        return "".join([strip_billing(texts[0]), *texts[1:]]) if texts else ""


class MessagesBody(CountBody):
    """A /v1/messages body."""

    NEUTRAL: ClassVar[Neutral] = _MESSAGES
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None  # refused by check_messages: sampling (moe.serve.sampling) has no top-k
    stream: bool | None = None
    metadata: Metadata | None = None  # accepted, no effect


def _tool_choice(body: CountBody) -> None:
    choice, names = body.tool_choice, {t.name for t in body.tools or ()}
    if choice is None:
        return
    if choice.type != "none" and not body.tools:
        raise invalid("tool_choice", f'type {choice.type!r} needs tools; send tools, or leave tool_choice out')
    if choice.type == "tool" and choice.name is None:
        raise invalid("tool_choice.name", 'type "tool" needs the name of the tool to call')
    if choice.type == "tool" and choice.name not in names:
        raise invalid("tool_choice.name", f"{choice.name!r} is not the name of a tool in tools")
    if choice.type != "tool" and choice.name is not None:
        raise invalid("tool_choice.name", f'only type "tool" names a tool, not type {choice.type!r}')


def _blocks(messages: list[Message]) -> None:
    """Each role's blocks; tool_result ids of earlier tool_use blocks; a last assistant message (the start
    of the reply, which continues it) of text only, not ending in whitespace."""
    uses: set[str] = set()
    for i, m in enumerate(messages):
        for j, block in enumerate([] if isinstance(m.content, str) else m.content):
            param = f"messages.{i}.content.{j}"
            if block.type not in ROLE_BLOCKS[m.role]:
                raise invalid(f"{param}.type", f"{m.role} messages hold {', '.join(ROLE_BLOCKS[m.role])} blocks, "
                              f"not {block.type}")
            if block.type == "tool_use":
                uses.add(block.id)
            if block.type == "tool_result" and block.tool_use_id not in uses:
                raise invalid(f"{param}.tool_use_id", f"{block.tool_use_id!r} is not the id of a tool_use block of "
                              "an earlier assistant message")
    last, i = messages[-1], len(messages) - 1
    if last.role != "assistant":
        return
    for j, block in enumerate([] if isinstance(last.content, str) else last.content):
        if block.type != "text":
            raise invalid(f"messages.{i}.content.{j}.type", "the last message, an assistant's that the reply "
                          f"continues, holds text blocks only, not {block.type}")
    text = last.content if isinstance(last.content, str) else join_text(last.content)
    if text != text.rstrip():
        raise invalid(f"messages.{i}.content", "the last message, an assistant's that the reply continues, "
                      "cannot end with whitespace")


def check_messages(body: CountBody) -> None:
    """Raise ApiError 400 naming the first field that cannot be served as given: an unknown or
    unimplemented field, a tool's name or input_schema, a tool_choice without tools or naming none of
    them, thinking "enabled" without budget_tokens, more or longer stop_sequences than the server takes,
    top_k, a block its role does not hold, a tool_result without an earlier tool_use of its id."""
    check_extra(body)
    check_tool_defs([(f"tools.{i}", t.name, t.input_schema) for i, t in enumerate(body.tools or ())],
                    "input_schema")
    _tool_choice(body)
    if body.thinking is not None and body.thinking.type == "enabled" and body.thinking.budget_tokens is None:
        raise invalid("thinking.budget_tokens", 'type "enabled" needs budget_tokens')
    if isinstance(body, MessagesBody):
        check_stops(body.stop_sequences or (), "stop_sequences")
        if body.top_k is not None:
            raise ApiError(400, "top_k: not supported: this server samples with temperature and top_p only; "
                           "leave top_k out", param="top_k", code="unsupported_parameter")
    _blocks(body.messages)


def _block_error(err: dict[str, Any]) -> dict[str, Any]:
    """A block whose type no block model has (or without a type), as an error of its `type` field."""
    if err.get("type") == "union_tag_not_found":
        return {**err, "loc": (*err["loc"], "type"), "msg": "Field required"}
    if err.get("type") == "union_tag_invalid":
        tag = err.get("ctx", {}).get("tag")
        return {**err, "loc": (*err["loc"], "type"), "msg": f"{tag!r} blocks are not supported: the served model "
                f"reads text; send {', '.join(_TAGS)} blocks"}
    return err


def parse_messages(model: type[CountBody], raw: bytes) -> CountBody:
    """The checked body of `raw` (JSON bytes). Raises ApiError 400 naming the field."""
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise validation_error([_block_error(err) for err in e.errors(include_url=False)], raw) from None
    check_messages(body)
    return body
