"""The text side of serving: windowed detokenization with stop strings, and bounded encoding.

    TextStream (windowed decode, incremental stop search) ≡ a reference that decodes every id so far
    and searches the whole text on every push, on random byte-level token sequences (multi-byte
    characters split across tokens) and on SentencePiece-style words with special tokens between them,
    with random stop strings; push decodes a bounded window.
    encode_within: exact ids under the limit; past it, refused after tokenizing a bounded prefix.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from moe.serve.tokenizer import PREFIX_CHARS_PER_TOKEN, TextStream, TextTokenizer, TooManyTokens

TEXT = "ab c€é 😀x\n"  # 1-, 2-, 3- and 4-byte characters


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory) -> TextTokenizer:
    """A byte-level BPE tokenizer without merges: one token per UTF-8 byte, so characters split."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("bytes")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return TextTokenizer(path)


class FullStream:
    """The reference: decode every id so far on each push, search the whole text for every stop."""

    def __init__(self, tokenizer, stop) -> None:
        self.tokenizer, self.stop, self.ids, self.text, self.full = tokenizer, [s for s in stop if s], [], "", ""

    def push(self, token):
        self.ids.append(token)
        self.full = self.tokenizer.decode(self.ids)
        hits = [i for i in (self.full.find(s) for s in self.stop) if i >= 0]
        if hits:
            return self._send(min(hits)), True
        hold = 0
        complete = self.full.rstrip("\ufffd")
        for s in self.stop:
            for n in range(min(len(s) - 1, len(complete)), 0, -1):
                if complete.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._send(len(complete) - hold), False

    def finish(self):
        return self._send(len(self.full))

    def _send(self, end):
        end = max(end, len(self.text))
        delta = self.full[len(self.text):end]
        self.text += delta
        return delta


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=TEXT, min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet=TEXT, min_size=1, max_size=4), max_size=4))
def test_windowed_stream_equals_full_decoding(byte_tok, text, stops):
    ids = byte_tok.encode(text)
    fast, ref = TextStream(byte_tok, stops), FullStream(byte_tok, stops)
    for token in ids:
        got, want = fast.push(token), ref.push(token)
        assert got == want
        if got[1]:
            # the stop string that ended it: at the cut, none earlier, the first in `stops` of those there
            at = len(fast.text)
            found = {s: fast.decoded.find(s) for s in stops if s in fast.decoded}
            assert min(found.values()) == at and fast.stop_sequence == next(s for s in stops if found.get(s) == at)
            break
    else:
        assert fast.finish() == ref.finish() and fast.stop_sequence is None
    assert fast.text == ref.text


@pytest.fixture(scope="module")
def sentencepiece_tok(tmp_path_factory) -> TextTokenizer:
    """Words with SentencePiece's space marker (Metaspace, Mixtral's and Llama's scheme: the decoder
    strips the leading space of the text's first token) and two special tokens, skipped in decoding."""
    vocab = {"<unk>": 0, "\u2581a": 1, "\u2581b": 2, "c": 3, "\u2581\u00e9": 4, "\u2581": 5}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</x>", special=True)])
    path = tmp_path_factory.mktemp("sentencepiece")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return TextTokenizer(path)


def test_a_special_token_between_words_keeps_the_space(sentencepiece_tok):
    """"a </x> b" decodes to "a b": the window after the special reaches back to "a", so "b" is not the
    first token of what it decodes (whose leading space the decoder would strip: "ab")."""
    special = sentencepiece_tok.tokenizer.token_to_id("</x>")
    ids = [1, special, 2, 3, special, special, 4]
    stream = TextStream(sentencepiece_tok)
    text = "".join(stream.push(t)[0] for t in ids) + stream.finish()
    assert text == sentencepiece_tok.decode(ids) == "a bc \u00e9"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(1, 7), min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="ab c\u00e9", min_size=1, max_size=3), max_size=3))
def test_sentencepiece_words_and_specials_stream_as_full_decoding(sentencepiece_tok, ids, stops):
    """Random words, bare space markers and special tokens (ids 6, 7), stop strings among them."""
    fast, ref = TextStream(sentencepiece_tok, stops), FullStream(sentencepiece_tok, stops)
    for token in ids:
        got, want = fast.push(token), ref.push(token)
        assert got == want
        if got[1]:
            # the stop string that ended it: at the cut, none earlier, the first in `stops` of those there
            at = len(fast.text)
            found = {s: fast.decoded.find(s) for s in stops if s in fast.decoded}
            assert min(found.values()) == at and fast.stop_sequence == next(s for s in stops if found.get(s) == at)
            break
    else:
        assert fast.finish() == ref.finish() and fast.stop_sequence is None
    assert fast.text == ref.text


def test_a_push_decodes_a_bounded_window(byte_tok, monkeypatch):
    lengths = []
    decode = type(byte_tok).decode
    monkeypatch.setattr(type(byte_tok), "decode", lambda self, ids: lengths.append(len(ids)) or decode(self, ids))
    stream = TextStream(byte_tok, ["zz"])
    ids = byte_tok.encode("é€😀 " * 100)
    text = "".join(stream.push(t)[0] for t in ids) + stream.finish()
    assert text == "é€😀 " * 100 and len(ids) == 1000
    assert max(lengths) <= 8  # a 4-byte character and its context, not the 1000 ids so far


def test_encode_within_is_exact_under_the_limit(tiny_dir):
    tok = TextTokenizer(tiny_dir)
    assert tok.encode_within("w10 w20 w30", 3) == tok.encode("w10 w20 w30")
    with pytest.raises(TooManyTokens) as e:
        tok.encode_within("w10 w20 w30", 2)
    assert (e.value.count, e.value.exact) == (3, True)


def test_encode_within_refuses_a_long_text_from_its_prefix(tiny_dir, monkeypatch):
    tok, lengths = TextTokenizer(tiny_dir), []
    encode = type(tok).encode
    monkeypatch.setattr(
        type(tok), "encode", lambda self, text, **kw: lengths.append(len(text)) or encode(self, text, **kw)
    )
    with pytest.raises(TooManyTokens) as e:
        tok.encode_within("w10 " * 100_000, 50)
    assert not e.value.exact and e.value.count > 50
    assert lengths == [lengths[0]] and lengths[0] <= PREFIX_CHARS_PER_TOKEN * 51
    spaced = "w10" + " " * 5000 + "w20"  # long in characters, 2 tokens: the prefix does not refuse it
    want = tok.encode("w10 w20")
    lengths.clear()
    assert tok.encode_within(spaced, 50) == want
    assert len(lengths) == 2 and lengths[-1] == len(spaced)


HARMONY_CHATS = [
    [{"role": "user", "content": "w10 w11"}],
    [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w12"},
     {"role": "assistant", "content": "w13", "thinking": "w14 w15"}, {"role": "user", "content": "w16"}],
    [{"role": "developer", "content": "w30"}, {"role": "user", "content": "w31"},
     {"role": "assistant", "content": "w32", "thinking": "w33"}],
]


@pytest.mark.parametrize("chat", range(len(HARMONY_CHATS)))
def test_the_harmony_template_renders_as_transformers_renders_it(tmp_path, chat):
    """gpt-oss's harmony chat template (the tests' own, with the release's constructs: a namespace set in a
    loop, strftime_now, a filter default, raise_exception, whitespace control) rendered by the server
    equals transformers' apply_chat_template; the ids come out as the harmony specials; the eos ids are
    generation_config.json's <|return|> and <|call|> (and the tokenizer's eos_token, <|return|>)."""
    from transformers import AutoTokenizer

    from moe.testing.tiny_checkpoint import HARMONY_SPECIALS, write_tokenizer

    write_tokenizer(tmp_path, harmony=True)
    ours = TextTokenizer(tmp_path)
    messages = HARMONY_CHATS[chat]
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    text = ours.render_chat(messages)
    assert text == want and text.endswith("<|start|>assistant")
    assert ("<|channel|>analysis<|message|>w33<|end|>" in text) == (chat == 2)  # thinking after the last user turn
    assert "w14" not in text  # thinking before the last user turn is dropped
    ids = ours.encode_chat(messages)
    assert ids.count(HARMONY_SPECIALS.index("<|start|>")) == text.count("<|start|>")
    assert ours.eos_ids == {HARMONY_SPECIALS.index("<|return|>"), HARMONY_SPECIALS.index("<|call|>")}


# the constructs transformers' sandbox adds to plain Jinja: loop controls, the generation tag, dict, namespace
LOOP_TEMPLATE = (
    "{% set ns = namespace(seen=0) %}{% set roles = dict(user='U', assistant='A') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if ns.seen == 3 %}{% break %}{% endif %}{% set ns.seen = ns.seen + 1 %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ roles[m['role']] }}: {{ m['content'] }} {% endgeneration %}"
    "{% else %}{{ roles[m['role']] }}: {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def test_loop_controls_the_generation_tag_and_namespace_render_as_transformers_renders_them(tmp_path):
    """A template with {% break %}, {% continue %}, {% generation %}, dict(...) and a namespace set in a loop
    loads and renders exactly as transformers' apply_chat_template renders it; a namespace refuses an
    underscore-prefixed name as a TokenizerError, as transformers refuses it."""
    from transformers import AutoTokenizer

    from moe.serve.tokenizer import TokenizerError
    from moe.testing.tiny_checkpoint import write_tokenizer

    write_tokenizer(tmp_path, template=LOOP_TEMPLATE)
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w10"},
                {"role": "assistant", "content": "w11"}, {"role": "user", "content": "w12"},
                {"role": "assistant", "content": "w13"}]
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert TextTokenizer(tmp_path).render_chat(messages) == want == "U: w10 A: w11 U: w12 A:"
    write_tokenizer(tmp_path, template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(TokenizerError, match="underscore-prefixed attribute '_x'"):
        TextTokenizer(tmp_path).render_chat(messages)


def test_the_harmony_template_refuses_a_tool_result_without_a_call(tmp_path):
    """The template's own raise_exception (the release's message) comes out as a TokenizerError."""
    from moe.serve.tokenizer import TokenizerError
    from moe.testing.tiny_checkpoint import write_tokenizer

    write_tokenizer(tmp_path, harmony=True)
    with pytest.raises(TokenizerError, match="chat template refused the messages: Message has tool role, but there "
                                             "was no previous assistant message with a tool call"):
        TextTokenizer(tmp_path).render_chat([{"role": "tool", "content": "w9"}])


def test_token_text_of_byte_pieces_and_missing_ids(byte_tok, tmp_path):
    """Byte-level: each byte of "€" (e2 82 ac) alone is OpenAI's bytes form, a whole ASCII byte its text,
    an id past the vocabulary token_id:N. SentencePiece byte fallback (<0xE2>) the same."""
    ids = byte_tok.encode("€a")
    assert [byte_tok.token_text(i) for i in ids] == ["bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", "a"]
    assert [byte_tok.token_bytes(i) for i in ids] == [b"\xe2", b"\x82", b"\xac", b"a"]
    missing = byte_tok.vocab_size + 3
    assert byte_tok.token_text(missing) == f"token_id:{missing}" and byte_tok.token_bytes(missing) is None
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<0xE2>": 1, "▁x": 2, "\ufffd": 3}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    sp = TextTokenizer(tmp_path)
    assert [sp.token_text(i) for i in range(4)] == ["<unk>", "bytes:\\xe2", " x", "\ufffd"]
    assert [sp.token_bytes(i) for i in range(4)] == [b"<unk>", b"\xe2", b" x", "\ufffd".encode()]
