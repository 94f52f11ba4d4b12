"""The text side of serving a checkpoint: tokenizer.json, the chat template, end-of-sequence ids.

    <dir>/tokenizer.json ──tokenizers.Tokenizer──► encode(text) -> ids,  decode(ids) -> text
    <dir>/tokenizer_config.json `chat_template` (or <dir>/chat_template.jinja), bos_token, eos_token
        ──jinja2 ImmutableSandboxedEnvironment (as transformers renders it)──►
        render(messages, tools, add_generation_prompt=True, bos_token, eos_token) -> prompt text -> ids
    eos ids = config.json eos_token_id ∪ generation_config.json eos_token_id ∪ id(tokenizer_config eos_token)
    prompt text ──encode_within(text, limit)──► ids, or TooManyTokens once a prefix of a long text
        already holds more than `limit` tokens (the rest of it is never tokenized)
    generated ids ──TextStream.push──► text deltas, held back while they could still become a stop
        string (or end inside an unfinished UTF-8 character), cut at the first stop string; each
        push decodes a window of the last few ids and checks only the new text against the stops

    one id of a logprobs entry ──token_text / token_bytes──► its own text, or where that is not text
        (a piece of a multi-byte character, an id the tokenizer lacks) OpenAI's "bytes:\\xe2\\x80" form
        of its bytes (byte-level and byte-fallback vocabularies) or "token_id:N"

The rendered chat prompt is encoded without the tokenizer's own special tokens (the template writes
them), a plain completion prompt with them, as transformers does. Decoding skips special tokens.
Encoding goes through `encode_batch`, which releases the GIL while the tokenizer runs, so that a long
prompt tokenized on a worker thread does not stall the server's event loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer

# encode_within: a text longer than this many characters per allowed token is first tokenized in a
# prefix of that length; SLACK tokens cover a word cut at the prefix's end.
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_SLACK = 16
_LAST_SPACE = re.compile(r"\s(?=\S*$)")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte in a ByteLevel vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


def _decodes_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's decoder is (or contains) ByteLevel: its tokens spell bytes."""
    if tokenizer.decoder is None:
        return False
    found = json.loads(tokenizer.decoder.__getstate__())
    decoders = found.get("decoders", [found]) if found.get("type") == "Sequence" else [found]
    return any(d.get("type") == "ByteLevel" for d in decoders)


class TokenizerError(ValueError):
    """A checkpoint whose text side cannot be served; the message names the file or field to fix."""


class TooManyTokens(ValueError):
    """A text with more tokens than allowed: `count` tokens (at least that many when not `exact`)."""

    def __init__(self, count: int, exact: bool) -> None:
        super().__init__(f"{'' if exact else 'at least '}{count} tokens")
        self.count, self.exact = count, exact


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    """eos_token_id of a config: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (a string, or a list of {name, template} where the one
    named "default" wins), else chat_template.jinja beside it (transformers >= 4.50 writes that)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template:
        return template
    file = path / "chat_template.jinja"
    return file.read_text() if file.is_file() else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' tag around the assistant's own text (for its
    training masks); a prompt renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type itself (as
    transformers' sandbox does)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes, as transformers' does: a template
    stores no name that reaches Python's internals."""

    def __init__(*args, **kwargs):  # Namespace's signature, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store the underscore-prefixed attribute {name!r} on a "
                                "namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in: trim_blocks, lstrip_blocks, `{% break %}` and
    `{% continue %}` (jinja2.ext.loopcontrols), the `{% generation %}` tag, the `raise_exception` and
    `strftime_now` globals, `dict` and a `namespace` that stores no underscore-prefixed name, `tojson`
    without ASCII escaping unless asked (GLM-4.5's template passes ensure_ascii=False)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class TextTokenizer:
    """A checkpoint's tokenizer, chat template and eos ids, read from directory `path`.

    Attributes: eos_ids (frozenset of token ids that end a sequence), chat_template (Jinja text or
    None), bos_token / eos_token (strings or None), special_tokens ({text: id} of the tokens registered
    as special, which decoding skips). Cost: parses tokenizer.json once.
    Raises TokenizerError naming tokenizer.json when it is missing or unreadable.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} does not exist: serving needs the checkpoint's fast tokenizer; "
                                 "download tokenizer.json (and tokenizer_config.json) into the model "
                                 "directory, e.g. hf download REPO tokenizer.json tokenizer_config.json "
                                 f"--local-dir {path}")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"{file} could not be read by the tokenizers library: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _chat_template(path, config)
        self._template = _environment().from_string(self.chat_template) if self.chat_template else None
        eos = _ids(_read_json(path / "config.json").get("eos_token_id"))
        eos |= _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        if self.eos_token is not None and self.tokenizer.token_to_id(self.eos_token) is not None:
            eos.add(self.tokenizer.token_to_id(self.eos_token))
        self.eos_ids = frozenset(eos)
        self.special_tokens = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        self._byte_level = _byte_level_table() if _decodes_byte_level(self.tokenizer) else None

    @property
    def vocab_size(self) -> int:
        """Tokens of the tokenizer, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Runs without the GIL (`encode_batch` of one text; `encode` holds it)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_within(self, text: str, limit: int, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, or TooManyTokens when it has more than `limit` tokens.

        A text longer than PREFIX_CHARS_PER_TOKEN * (limit + 1) characters is first tokenized in a
        prefix of that length, cut before its last whitespace; when the prefix alone has more than
        limit + PREFIX_SLACK tokens the text is refused without tokenizing the rest (count inexact).
        Cost: at most the prefix plus one full tokenization.
        """
        head = PREFIX_CHARS_PER_TOKEN * (limit + 1)
        if len(text) > head:
            space = _LAST_SPACE.search(text, 0, head)
            prefix = text[: space.start() if space and space.start() > 0 else head]
            count = len(self.encode(prefix, add_special_tokens=add_special_tokens))
            if count > limit + PREFIX_SLACK:
                raise TooManyTokens(count - PREFIX_SLACK, exact=False)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        if len(ids) > limit:
            raise TooManyTokens(len(ids), exact=True)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The `token` of a logprobs entry for one id: its own decode (special tokens included) when that
        is text; for a piece of a multi-byte character, which decodes to U+FFFD, OpenAI's "bytes:\\xe2\\x80"
        form of its bytes; for an id the tokenizer lacks (a model's vocabulary padded past the
        tokenizer's) or a piece whose bytes are unknown, "token_id:N". Distinct ids get distinct texts
        except where two tokens spell the same text."""
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if text and "\ufffd" not in text:
            return text
        raw = self.token_bytes(token)
        if raw is None:
            return f"token_id:{token}"
        try:
            return raw.decode("utf-8")  # text that holds U+FFFD itself, or the empty text of an empty token
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes one id stands for (the `bytes` of a chat logprobs entry): a piece of a multi-byte
        character as such in a byte-level or byte-fallback vocabulary, else its text's UTF-8; None for
        an id the tokenizer lacks or a piece whose bytes are unknown."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return None
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        unknown = "\ufffd" in text and "\ufffd" not in piece  # a replacement, not the token's own character
        return None if unknown else text.encode("utf-8")

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The chat template rendered with `messages`, `tools` (as transformers passes them: a list of
        {"type": "function", "function": {...}} dicts, or None) and add_generation_prompt=True.

        Raises TokenizerError when the checkpoint has no chat template (name the file to add it to)
        or when the template refuses the messages (its own raise_exception message, or a value of a
        type the template cannot use).
        """
        if self._template is None:
            raise TokenizerError("the model has no chat template (tokenizer_config.json `chat_template` "
                                 "or chat_template.jinja): add one, or use /v1/completions")
        try:
            return self._template.render(messages=list(messages), tools=None if tools is None else list(tools),
                                         add_generation_prompt=True, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except (TemplateError, TypeError) as e:
            raise TokenizerError(f"the chat template refused the messages: {e}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes the special tokens itself)."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


class TextStream:
    """Incremental detokenization of one sequence with stop strings.

    push(token) -> (text delta safe to send, stopped): the delta never holds a prefix of a stop string
    that later tokens could complete, nor an unfinished multi-byte character; `stopped` is True once a
    stop string appears, and the text is cut before it; `stop_sequence` is then that stop string (the
    earliest in the text; of two starting at the same character, the first in `stop`). finish() -> the
    text held back at the end. `text` is everything sent.

    Decoding is windowed (as vLLM and TGI detokenize): the new text of a push is the decode of the
    ids since the last settled one minus the decode of its context, so a push costs the decode of a
    few ids whatever the length; the window stays open while it ends inside a character (U+FFFD), and
    its context reaches back past special tokens (skipped in decoding) to the last text, so that a
    SentencePiece decoder, which strips the leading space of the text's first token, strips none.
    Only the new text, with the len(stop) - 1 characters before it, is searched for each stop string.
    Cost per push: two decodes of the window and O(sum of stop lengths) of string search.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self._full = ""  # every character decoded so far; text is a prefix of it
        self._start = self._read = 0  # ids[_start:_read]: the context of the open window
        self._context = ""  # decode(ids[_start:_read])
        self._taken = 0  # characters of the open window's new text already in _full
        self.stop_sequence: str | None = None

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        checked = len(self._full)
        self._full += self._window(final=False)
        hits = [(i, n) for n, i in enumerate(self._full.find(s, max(0, checked - len(s) + 1)) for s in self.stop)
                if i >= 0]
        if hits:
            at, n = min(hits)
            self.stop_sequence = self.stop[n]
            return self._send(at), True
        return self._send(len(self._full) - self._held_back()), False

    @property
    def decoded(self) -> str:
        """Every character decoded so far, sent or held back (not an unfinished character)."""
        return self._full

    def finish(self, eos: bool = False) -> str:
        """The rest of the text, held back so far (at the end of the sequence nothing can follow).
        `eos` (the sequence ended at an end-of-sequence token) changes nothing for plain text; the
        streams over it (HarmonyStream, ToolStream) take the same argument."""
        self._full += self._window(final=True)
        return self._send(len(self._full))

    def _window(self, final: bool) -> str:
        """The text the open window adds beyond what _full holds; settles the window unless it ends
        inside an unfinished character (then only the complete characters before it are taken)."""
        decoded = self.tokenizer.decode(self.ids[self._start:])
        open_end = decoded.endswith("\ufffd") and not final
        usable = decoded.rstrip("\ufffd") if open_end else decoded
        new = usable[len(self._context) + self._taken:]
        if open_end:
            self._taken += len(new)
        else:
            start = self._read
            context = self.tokenizer.decode(self.ids[start:])
            if not context and start > self._start:
                # the new context decodes to nothing (special tokens, skipped): keep the text before it, or
                # a SentencePiece decoder would strip the next token's leading space as the text's first
                start = self._start
                context = self.tokenizer.decode(self.ids[start:])
            self._start, self._read, self._taken = start, len(self.ids), 0
            self._context = context
        return new

    def _send(self, end: int) -> str:
        end = max(end, len(self.text))
        delta = self._full[len(self.text):end]
        self.text += delta
        return delta

    def _held_back(self) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        full, hold = self._full, 0
        for s in self.stop:
            tail = full[len(full) - min(len(s) - 1, len(full)):] if len(s) > 1 else ""
            i = tail.find(s[0])  # the longest suffix of tail that starts s
            while i >= 0 and not s.startswith(tail[i:]):
                i = tail.find(s[0], i + 1)
            if i >= 0:
                hold = max(hold, len(tail) - i)
        return hold
