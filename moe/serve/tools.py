"""Tool calls of a chat reply: each served family's call syntax, read out of the reply as it streams.

    request tools, tool_choice ──openai_api.chat_tools──► tools handed to the chat template;
        "required" / a named function: forced_opening appended to the prompt; ToolParsing (the syntax,
        each tool's parameter schema, the opening the reply starts inside, parallel_tool_calls)
    reply ids ──TextStream (stop strings)──► text ──CallParser──► content deltas + ToolCalls
        (ToolStream: the two together, with TextStream's push / finish)
    a harmony reply (gpt-oss): moe.serve.harmony.HarmonyStream reads a message addressed
        `to=functions.NAME` as a call (parse_json_call)

The syntaxes, as each family's chat template writes a call in the history (template_syntax tells them
apart by the template's text; harmony by its special tokens):

    hermes   Qwen3, Qwen3-Next, Hermes  <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>
    glm45    GLM-4.5                    <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>
    harmony  gpt-oss                    <|start|>assistant<|channel|>commentary to=functions.NAME
                                        <|constrain|>json<|message|>{...}<|call|>

A call becomes a ToolCall when it closes, parses and names a tool of the request; a call that does not
parse or names another tool stays in the content as the text it was (nothing is dropped), and so does a
call the reply ends inside. GLM-4.5's values are text where the property's schema type is (or includes)
"string", else JSON where they parse as JSON, else text. A call's arguments are re-serialized JSON.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moe.serve.tokenizer import TextStream, TextTokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
GLM_MARKERS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
FUNCTIONS = "functions."  # harmony's namespace of the request's tools


class ToolSyntax(enum.Enum):
    """How a family writes a call (the module docstring shows each)."""

    HERMES = "hermes"
    GLM = "glm45"
    HARMONY = "harmony"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        """The call as a message's tool_calls entry (a stream's delta adds its "index")."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolParsing:
    """How to read one request's reply: its family's syntax, the parameter schema of each tool it may
    call (by name; {} for a tool without one), the call opening the prompt ends with when tool_choice
    forces a call (the reply continues inside it; "" otherwise), and parallel_tool_calls (False: the
    reply ends when its first call closes)."""

    syntax: ToolSyntax
    schemas: Mapping[str, Mapping[str, Any]]
    seed: str = ""
    parallel: bool = True


def template_syntax(tokenizer: TextTokenizer) -> ToolSyntax | None:
    """The call syntax the chat template writes (hermes or glm45), or None: the template writes no call
    this module parses, or the tokenizer registers a marker as a special token, which decoding skips."""
    template = tokenizer.chat_template or ""
    if OPEN not in template:
        return None
    syntax = ToolSyntax.GLM if GLM_MARKERS[0] in template else ToolSyntax.HERMES
    markers = (OPEN, CLOSE, *GLM_MARKERS) if syntax is ToolSyntax.GLM else (OPEN, CLOSE)
    return None if any(m in tokenizer.special_tokens for m in markers) else syntax


def forced_opening(syntax: ToolSyntax, name: str | None) -> tuple[str, str]:
    """(text to append to the rendered prompt, the part of it the reply's parser starts inside) that make
    the model write a call (tool_choice "required") or a call of `name`: the opening the family's template
    writes for a call in the history (GLM-4.5's after the empty thinking its template writes for it)."""
    if syntax is ToolSyntax.HERMES:
        seed = OPEN + "\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')
        return seed, seed
    if syntax is ToolSyntax.GLM:
        seed = OPEN + ("" if name is None else name + "\n")
        return "\n<think></think>\n" + seed, seed
    seed = " to=" + FUNCTIONS + ("" if name is None else name + "<|channel|>commentary json<|message|>")
    return seed, seed


def _call(name: Any, arguments: Any, schemas: Mapping[str, Any]) -> ToolCall | None:
    if not isinstance(name, str) or name not in schemas or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def parse_hermes(body: str, schemas: Mapping[str, Any]) -> ToolCall | None:
    """The call of `body` (the text between <tool_call> and </tool_call>): a JSON object with a "name" of
    `schemas` and an object "arguments" (absent: {}); None for anything else."""
    ok, obj = _json(body)
    if not ok or not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj.get("arguments", {}), schemas)


_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(text: str, schema: Mapping[str, Any]) -> Any:
    types = schema.get("type")
    if types == "string" or (isinstance(types, list) and "string" in types):
        return text
    ok, value = _json(text)
    return value if ok else text


def parse_glm(body: str, schemas: Mapping[str, Any]) -> ToolCall | None:
    """The call of `body` (between <tool_call> and </tool_call>): NAME up to the first newline or
    <arg_key>, then only <arg_key>K</arg_key><arg_value>V</arg_value> pairs (whitespace between), each
    key once; None for anything else."""
    cut = min(i for i in (body.find("\n"), body.find(GLM_MARKERS[0]), len(body)) if i >= 0)
    name = body[:cut].strip()
    if name not in schemas:
        return None
    properties = schemas[name].get("properties") or {}
    args, pos = {}, cut
    while (pair := _GLM_PAIR.match(body, pos)) is not None:
        key = pair.group(1).strip()
        if key in args:
            return None
        args[key] = _glm_value(pair.group(2), properties.get(key) or {})
        pos = pair.end()
    return None if body[pos:].strip() else _call(name, args, schemas)


def parse_json_call(name: str, body: str, schemas: Mapping[str, Any]) -> ToolCall | None:
    """A harmony call: the message to functions.`name` whose body is a JSON object; None otherwise."""
    ok, obj = _json(body)
    return _call(name, obj, schemas) if ok else None


_PARSERS = {ToolSyntax.HERMES: parse_hermes, ToolSyntax.GLM: parse_glm}


def _opening_overlap(text: str) -> int:
    """Characters at the end of `text` that begin OPEN (a call opening that later text may complete)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class CallParser:
    """Reply text in (feed, in pieces), content out, calls kept in `calls` (hermes and glm45 syntaxes).

    Text that may begin a call opening is held back until it cannot; a call's text from its opening on
    is held back until it closes, then parsed: a ToolCall, or (malformed, unknown tool) its text as
    content. Whitespace right after a parsed call (what separates calls) is not content. Without
    `parsing.parallel` the parser is `done` at its first call and takes nothing more. close() ends the
    text: what is held back (a partial opening, an unclosed call) comes out as content.
    Cost per feed: O(len(text)) (an open call's pieces are kept apart, its closing marker looked for in
    the new text and the few characters before it), plus the parse of a call that closes.
    """

    def __init__(self, parsing: ToolParsing) -> None:
        self.parsing, self.parse = parsing, _PARSERS[parsing.syntax]
        self.pending = ""  # outside a call: the end of the text that may begin an opening
        self.inside = bool(parsing.seed)  # the reply starts inside the forced opening
        self.call = [parsing.seed] if parsing.seed else []  # the open call's text, from its opening on
        self.tail = parsing.seed[-(len(CLOSE) - 1):]  # its last characters, which may begin the closing
        self.after_call = False
        self.done = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        """Take the next piece of the reply; returns the content it releases."""
        out: list[str] = []
        while text and not self.done:
            text = self._inside(text, out) if self.inside else self._outside(text, out)
        return "".join(out)

    def close(self) -> str:
        """The end of the reply: the held text as content ("" once done)."""
        text = "" if self.done else "".join(self.call) if self.inside else self.pending
        self.pending, self.inside, self.call, self.tail = "", False, [], ""
        return text

    def _outside(self, text: str, out: list[str]) -> str:
        """Release the content before a call opening; returns the text after the opening ("" if none)."""
        text, self.pending = self.pending + text, ""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        start = text.find(OPEN)
        if start < 0:
            cut = len(text) - _opening_overlap(text)
            out.append(text[:cut])
            self.pending = text[cut:]
            return ""
        out.append(text[:start])
        self.inside, self.call, self.tail = True, [OPEN], ""
        return text[start + len(OPEN):]

    def _inside(self, text: str, out: list[str]) -> str:
        """Take text of the open call; at its closing marker parse it (a ToolCall, or its text as
        content). Returns the text after the call ("" while it is open)."""
        window = self.tail + text
        end = window.find(CLOSE)
        if end < 0:
            self.call.append(text)
            self.tail = window[-(len(CLOSE) - 1):]
            return ""
        cut = end + len(CLOSE) - len(self.tail)
        self.call.append(text[:cut])
        whole = "".join(self.call)
        self.inside, self.call, self.tail = False, [], ""
        call = self.parse(whole[len(OPEN):-len(CLOSE)], self.parsing.schemas)
        if call is None:
            out.append(whole)
        else:
            self.calls.append(call)
            self.after_call, self.done = True, not self.parsing.parallel
        return text[cut:]


class ToolStream:
    """TextStream's interface over a hermes or glm45 reply to a request with tools: push(token) ->
    (content delta, stopped), finish(eos) -> the held content; pop_calls() -> the ToolCalls closed
    since the last pop. Stop strings apply to the reply's text (calls included) before it is parsed, as
    TextStream applies them; a stop string, or the end of the reply, inside a call makes its text
    content. `stopped` is also True once the first call closes without parsing.parallel."""

    def __init__(self, tokenizer: TextTokenizer, parsing: ToolParsing, stop: Iterable[str] = ()) -> None:
        self.text = TextStream(tokenizer, stop)
        self.parser = CallParser(parsing)

    def push(self, token: int) -> tuple[str, bool]:
        delta, stopped = self.text.push(token)
        content = self.parser.feed(delta)
        if self.parser.done:
            return content, True
        if stopped:
            content += self.parser.close()
        return content, stopped

    def finish(self, eos: bool = False) -> str:
        """The rest of the content at the end of the reply (`eos` changes nothing: a call closes only
        with its closing marker)."""
        return self.parser.feed(self.text.finish()) + self.parser.close()

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the reply (TextStream.stop_sequence), None if none did."""
        return self.text.stop_sequence

    def pop_calls(self) -> tuple[ToolCall, ...]:
        calls, self.parser.calls = tuple(self.parser.calls), []
        return calls
