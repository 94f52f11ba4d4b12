"""The text side of serving a checkpoint: tokenizer.json, the chat template, end-of-sequence ids.

    <dir>/tokenizer.json ──tokenizers.Tokenizer──► encode(text) -> ids,  decode(ids) -> text
    <dir>/tokenizer_config.json `chat_template` (or <dir>/chat_template.jinja), bos_token, eos_token
        ──jinja2 ImmutableSandboxedEnvironment (as transformers renders it)──►
        render(messages, add_generation_prompt=True, bos_token, eos_token) -> prompt text -> ids
    eos ids = config.json eos_token_id ∪ generation_config.json eos_token_id ∪ id(tokenizer_config eos_token)
    generated ids ──TextStream.push──► text deltas, held back while they could still become a stop
        string (or end inside an unfinished UTF-8 character), cut at the first stop string

The rendered chat prompt is encoded without the tokenizer's own special tokens (the template writes
them), a plain completion prompt with them, as transformers does. Decoding skips special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """A checkpoint whose text side cannot be served; the message names the file or field to fix."""


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


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in: trim_blocks, lstrip_blocks, the
    `raise_exception` and `strftime_now` globals, `tojson` without ASCII escaping."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TextTokenizer:
    """A checkpoint's tokenizer, chat template and eos ids, read from directory `path`.

    Attributes: eos_ids (frozenset of token ids that end a sequence), chat_template (Jinja text or
    None), bos_token / eos_token (strings or None). Cost: parses tokenizer.json once.
    Raises TokenizerError naming tokenizer.json when it is missing or unreadable.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} does not exist: serving needs the checkpoint's fast tokenizer; "
                                 "download tokenizer.json (and tokenizer_config.json) into the model "
                                 "directory, e.g. huggingface-cli download REPO tokenizer.json "
                                 "tokenizer_config.json --local-dir DIR")
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

    @property
    def vocab_size(self) -> int:
        """Tokens of the tokenizer, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The chat template rendered with `messages` and add_generation_prompt=True.

        Raises TokenizerError when the checkpoint has no chat template (name the file to add it to)
        or when the template refuses the messages (its own raise_exception message).
        """
        if self._template is None:
            raise TokenizerError("the model has no chat template (tokenizer_config.json `chat_template` "
                                 "or chat_template.jinja): add one, or use /v1/completions")
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TokenizerError(f"the chat template refused the messages: {e}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes the special tokens itself)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class TextStream:
    """Incremental detokenization of one sequence with stop strings.

    push(token) -> (text delta safe to send, stopped): the delta never holds a prefix of a stop string
    that later tokens could complete, nor a trailing U+FFFD (an unfinished multi-byte character);
    `stopped` is True once a stop string appears, and the text is cut before it. finish() -> the text
    held back at the end. `text` is everything sent. Cost per push: one decode of all tokens so far.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self._full = ""

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        self._full = full
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if hits:
            return self._send(min(hits)), True
        return self._send(len(full) - self._held_back(full)), False

    def finish(self) -> str:
        """The rest of the text, held back so far (at the end of the sequence nothing can follow)."""
        return self._send(len(self._full))

    def _send(self, end: int) -> str:
        end = max(end, len(self.text))
        delta = self._full[len(self.text):end]
        self.text += delta
        return delta

    def _held_back(self, full: str) -> int:
        """Characters at the end of `full` that may not be sent yet."""
        hold = 1 if full.endswith("\ufffd") else 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
