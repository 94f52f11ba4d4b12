"""Tool calls read out of a reply's text (moe.serve.tools), on hand-written replies in each syntax.

    parse_hermes / parse_glm / parse_json_call on call bodies: valid, malformed JSON, an unknown tool,
        GLM-4.5's values typed by the tool's schema, stray text
    CallParser fed a reply whole ≡ fed in two pieces split at every position ≡ fed a character at a time:
        the same content and calls (text around calls, several calls, malformed and unknown calls left in
        the content, a call the reply ends inside, a partial opening at the end): no delta ever held any
        of a parsed call's text
    the forced openings ("required", a named function), parallel_tool_calls false, stop strings before,
    inside and around a call through ToolStream, and which syntax each tiny checkpoint's template writes
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer

from moe.serve.tokenizer import TextTokenizer
from moe.serve.tools import (
    CallParser,
    ToolParsing,
    ToolStream,
    ToolSyntax,
    forced_opening,
    parse_glm,
    parse_hermes,
    parse_json_call,
    template_syntax,
)
from moe.testing.tiny_checkpoint import QWEN3_TEMPLATE, write_tokenizer

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "hours": {"type": "array"},
                                                            "note": {"type": ["string", "null"]}}},
           "now": {}}
HERMES = ToolParsing(ToolSyntax.HERMES, SCHEMAS)
GLM = ToolParsing(ToolSyntax.GLM, SCHEMAS)


def _args(call) -> tuple[str, dict]:
    return call.name, json.loads(call.arguments)


def test_hermes_bodies():
    body = '\n{"name": "get_weather", "arguments": {"city": "Pärís", "days": 2}}\n'
    call = parse_hermes(body, SCHEMAS)
    assert _args(call) == ("get_weather", {"city": "Pärís", "days": 2}) and "Pärís" in call.arguments
    assert call.id.startswith("call_") and call.as_dict() == {
        "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
    assert _args(parse_hermes('{"name": "now"}', SCHEMAS)) == ("now", {})
    for bad in ('{"name": "get_weather", "arguments": {"city": "Paris"}', '{"name": "nope", "arguments": {}}',
                '{"name": "now", "arguments": "{}"}', '["now"]', '{"arguments": {}}', "now()"):
        assert parse_hermes(bad, SCHEMAS) is None, bad
    assert parse_json_call("get_weather", '{"city": "Paris"}', SCHEMAS).arguments == '{"city": "Paris"}'
    assert parse_json_call("nope", "{}", SCHEMAS) is None and parse_json_call("now", "{", SCHEMAS) is None


def test_glm_bodies_type_values_by_the_schema():
    # as GLM-4.5's template writes a call in the history: NAME, then each pair on its own lines
    body = ("get_weather\n<arg_key>city</arg_key>\n<arg_value>2</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>2</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
            "<arg_key>note</arg_key>\n<arg_value>null</arg_value>\n<arg_key>other</arg_key>\n<arg_value>{x</arg_value>\n")
    assert _args(parse_glm(body, SCHEMAS)) == ("get_weather", {"city": "2", "days": 2, "hours": [1, 2],
                                                               "note": "null", "other": "{x"})
    assert _args(parse_glm("now", SCHEMAS)) == ("now", {})
    assert _args(parse_glm(" get_weather <arg_key>city</arg_key> <arg_value> Rome </arg_value> ", SCHEMAS)) == (
        "get_weather", {"city": " Rome "})  # a string value is the text between its markers
    for bad in ("nope\n<arg_key>a</arg_key><arg_value>1</arg_value>", "get_weather\nstray text",
                "get_weather\n<arg_key>city</arg_key><arg_value>a</arg_value><arg_key>city</arg_key>"
                "<arg_value>b</arg_value>", "get_weather\n<arg_key>city</arg_key>", ""):
        assert parse_glm(bad, SCHEMAS) is None, bad


H_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H_BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # a brace short
H_UNKNOWN = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
G_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
G_UNKNOWN = "<tool_call>nope\n</tool_call>"
PARIS = ("get_weather", {"city": "Paris"})
NOW = ("now", {})

# (parsing, reply, content, calls)
REPLIES = [
    (HERMES, "plain text, no call < tool", "plain text, no call < tool", []),
    (HERMES, H_CALL, "", [PARIS]),
    (HERMES, "Let me check.\n" + H_CALL + "\n" + H_CALL.replace("Paris", "Rome") + "\n", "Let me check.\n",
     [PARIS, ("get_weather", {"city": "Rome"})]),
    (HERMES, "a " + H_BAD + " b " + H_CALL + " c", "a " + H_BAD + " b c", [PARIS]),
    (HERMES, H_UNKNOWN + "\n" + '<tool_call>{"name": "now"}</tool_call>', H_UNKNOWN + "\n", [NOW]),
    (HERMES, "x " + H_CALL + " y <tool_call>\n{\"name\": \"now\"", "x y <tool_call>\n{\"name\": \"now\"", [PARIS]),
    (HERMES, "ends with a partial opening <tool_c", "ends with a partial opening <tool_c", []),
    (GLM, "Checking. " + G_CALL + "\n" + G_CALL.replace("Paris", "Rome"), "Checking. ",
     [PARIS, ("get_weather", {"city": "Rome"})]),
    (GLM, G_UNKNOWN + G_CALL + "<tool_call>get_weather\n<arg_key>ci", G_UNKNOWN + "<tool_call>get_weather\n<arg_key>ci",
     [PARIS]),
]


def _run(parsing: ToolParsing, pieces: list[str]) -> tuple[str, list, list[str]]:
    parser, deltas = CallParser(parsing), []
    for piece in pieces:
        deltas.append(parser.feed(piece))
    deltas.append(parser.close())
    return "".join(deltas), [_args(c) for c in parser.calls], deltas


@pytest.mark.parametrize("case", range(len(REPLIES)))
def test_a_reply_split_anywhere_parses_as_the_whole(case):
    parsing, reply, content, calls = REPLIES[case]
    assert _run(parsing, [reply])[:2] == (content, calls)
    for cut in range(len(reply) + 1):
        assert _run(parsing, [reply[:cut], reply[cut:]])[:2] == (content, calls), cut
    assert _run(parsing, list(reply))[:2] == (content, calls)  # the deltas add up to content without the calls


def test_a_held_opening_goes_out_once_it_cannot_open_a_call():
    parser = CallParser(HERMES)
    assert parser.feed("a <tool") == "a "  # may still become <tool_call>
    assert parser.feed("box> b") == "<toolbox> b"
    assert parser.feed("<") == "" and parser.close() == "<"


def test_forced_openings_start_the_reply_inside_a_call():
    assert forced_opening(ToolSyntax.HERMES, None) == ("<tool_call>\n", "<tool_call>\n")
    named = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert forced_opening(ToolSyntax.HERMES, "get_weather") == (named, named)
    assert forced_opening(ToolSyntax.GLM, None) == ("\n<think></think>\n<tool_call>", "<tool_call>")
    assert forced_opening(ToolSyntax.GLM, "now") == ("\n<think></think>\n<tool_call>now\n", "<tool_call>now\n")
    assert forced_opening(ToolSyntax.HARMONY, "now") == (" to=functions.now<|channel|>commentary json<|message|>",) * 2
    assert forced_opening(ToolSyntax.HARMONY, None) == (" to=functions.",) * 2
    for parsing, rest in ((HERMES, '{"name": "now", "arguments": {}}\n</tool_call>'), (GLM, "now\n</tool_call>")):
        seeded = ToolParsing(parsing.syntax, SCHEMAS, forced_opening(parsing.syntax, None)[1])
        assert _run(seeded, [rest, " after"])[:2] == ("after", [NOW])
        assert _run(seeded, ["not a call"])[:2] == (seeded.seed + "not a call", [])  # unclosed: its text
    named = ToolParsing(ToolSyntax.HERMES, SCHEMAS, forced_opening(ToolSyntax.HERMES, "get_weather")[1])
    assert _run(named, ['{"city": "Paris"}}\n</tool_call>'])[:2] == ("", [PARIS])
    named = ToolParsing(ToolSyntax.GLM, SCHEMAS, forced_opening(ToolSyntax.GLM, "get_weather")[1])
    assert _run(named, ["<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"])[:2] == ("", [PARIS])


def test_without_parallel_calls_the_parser_stops_at_the_first_call():
    single = ToolParsing(ToolSyntax.HERMES, SCHEMAS, parallel=False)
    parser = CallParser(single)
    assert parser.feed("a " + H_BAD + " " + H_CALL + " b " + H_CALL) == "a " + H_BAD + " "
    assert parser.done and [_args(c) for c in parser.calls] == [PARIS]
    assert parser.feed("more") == "" and parser.close() == ""


TOOL_WORDS = ["<tool_call>", "</tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}',
              "STOP"]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("qwen3-tools")
    write_tokenizer(path, template=QWEN3_TEMPLATE, words=TOOL_WORDS)
    return TextTokenizer(path)


def _stream(tok, words: str, parsing=HERMES, stop=(), eos=True) -> tuple[str, list, bool]:
    stream, out = ToolStream(tok, parsing, stop), []
    calls = []
    for token in tok.encode(words):
        text, stopped = stream.push(token)
        out.append(text)
        calls += stream.pop_calls()
        if stopped:
            return "".join(out), [_args(c) for c in calls], True
    out.append(stream.finish(eos=eos))
    calls += stream.pop_calls()
    return "".join(out), [_args(c) for c in calls], False


CALL_WORDS = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'


def test_tool_stream_parses_calls_and_keeps_stop_strings(qwen_tok):
    assert _stream(qwen_tok, f"w10 {CALL_WORDS} w11") == ("w10 w11", [PARIS], False)
    assert _stream(qwen_tok, f"w10 STOP {CALL_WORDS}", stop=("STOP",)) == ("w10 ", [], True)
    stream = ToolStream(qwen_tok, HERMES, ("w9", "STOP"))
    assert [stream.push(t)[1] for t in qwen_tok.encode("w10 STOP")] == [False, True]
    assert stream.stop_sequence == "STOP"
    # a stop string inside a call ends the reply there: the call's text so far is content
    assert _stream(qwen_tok, f"w10 {CALL_WORDS}", stop=('"arguments"',)) == (
        'w10 <tool_call> {"name": "get_weather", ', [], True)
    # TextStream holds "</tool_call>" back (it may begin the stop string) until the end flushes it
    assert _stream(qwen_tok, f"{CALL_WORDS}", stop=("</tool_call> STOP",)) == ("", [PARIS], False)
    assert _stream(qwen_tok, f"{CALL_WORDS} STOP w9", stop=("</tool_call> STOP",)) == (
        '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} ', [], True)
    single = ToolParsing(ToolSyntax.HERMES, SCHEMAS, parallel=False)
    assert _stream(qwen_tok, f"w10 {CALL_WORDS} w11 {CALL_WORDS}", single) == ("w10 ", [PARIS], True)
    assert _stream(qwen_tok, f"w10 {CALL_WORDS[:-13]}", eos=False) == ("w10 " + CALL_WORDS[:-13], [], False)


def test_the_syntax_comes_from_the_template(tiny_family, tmp_path):
    syntax = {family: template_syntax(TextTokenizer(tiny_family(family)))
              for family in ("qwen2_moe", "qwen3_moe", "qwen3_next", "glm4_moe", "mixtral")}
    assert syntax == {"qwen2_moe": None, "qwen3_moe": ToolSyntax.HERMES, "qwen3_next": ToolSyntax.HERMES,
                      "glm4_moe": ToolSyntax.GLM, "mixtral": None}
    write_tokenizer(tmp_path, template=QWEN3_TEMPLATE)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<tool_call>", special=True)])  # decoding would skip it
    tok.save(str(tmp_path / "tokenizer.json"))
    assert template_syntax(TextTokenizer(tmp_path)) is None
