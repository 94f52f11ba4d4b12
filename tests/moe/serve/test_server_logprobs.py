"""Logprobs of ids whose own decode is not text, over real HTTP on loopback (CPU backend).

    the tiny checkpoint with a byte-level tokenizer of 80 tokens (tiny_bytes_dir): ids 0..31 specials and
    words, 32..79 single bytes 0x80..0xAF (pieces of multi-byte characters, each decoding to U+FFFD
    alone), 80..127 none (the model's vocabulary padded past the tokenizer's, as Qwen's checkpoints are)
    ─► /v1/completions logprobs=5, /v1/chat/completions top_logprobs=5
    checked: exactly 5 alternatives a token, each with its own logprob (the model's, from a reference
    prefill), named by its text, OpenAI's "bytes:\\x80" form or "token_id:N"; chat's `bytes` the
    piece's own byte, null for an id without a token
"""

from __future__ import annotations

import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from moe.engine.loading import load_model
from moe.serve.tokenizer import _byte_level_table
from moe.testing.tiny_checkpoint import SPECIALS, WORDS
from tests.moe.serve.http_util import NAME, serve
from tests.moe.serve.test_server_hardening import _reference_logprobs

WORD_IDS, BYTE_IDS = 32, 48  # ids 0..31 text, the next 48 one byte each, the rest of the 128 ids none
TOP = 5


@pytest.fixture(scope="module")
def tiny_bytes_dir(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bytes")
    for f in tiny_dir.iterdir():
        shutil.copy(f, path / f.name)
    char = {b: c for c, b in _byte_level_table().items()}
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS[:WORD_IDS - len(SPECIALS)])}
    vocab.update({char[0x80 + j]: WORD_IDS + j for j in range(BYTE_IDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def running(tiny_bytes_dir):
    srv = serve(tiny_bytes_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(tiny_bytes_dir):
    return load_model(tiny_bytes_dir, "cpu", num_slots=16, max_seq_len=64, progress=False)


def _named(tok, token: int) -> str:
    if token < WORD_IDS:
        return tok.decode([token]) or tok.token_text(token)
    return f"bytes:\\x{0x80 + token - WORD_IDS:02x}" if token < WORD_IDS + BYTE_IDS else f"token_id:{token}"


def test_completion_logprobs_report_every_alternative_asked_for(running, ref):
    tok = running.state.tokenizer
    out = running.client.completions.create(model=NAME, prompt="w10 w20", max_tokens=6, temperature=0, logprobs=TOP)
    tokens, lp = _reference_logprobs(ref, tok.encode("w10 w20"), 6)
    got = out.choices[0].logprobs
    assert got.tokens == [_named(tok, t) for t in tokens]
    named = []
    for i, top in enumerate(got.top_logprobs):
        values, ids = lp[i].topk(TOP)
        assert list(top) == [_named(tok, t) for t in ids.tolist()]  # TOP keys, in the model's order
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        named += list(top)
    assert any(n.startswith("bytes:") for n in named) and any(n.startswith("token_id:") for n in named)


def test_chat_logprobs_give_each_alternative_its_bytes(running, ref):
    tok = running.state.tokenizer
    messages = [{"role": "user", "content": "w30 w9"}]
    out = running.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=6,
                                                 logprobs=True, top_logprobs=TOP)
    tokens, lp = _reference_logprobs(ref, tok.encode_chat(messages), 6)
    kinds = set()
    for i, entry in enumerate(out.choices[0].logprobs.content):
        values, ids = lp[i].topk(TOP)
        assert [(a.token, a.logprob) for a in entry.top_logprobs] == [
            (_named(tok, t), pytest.approx(v, abs=1e-4)) for t, v in zip(ids.tolist(), values.tolist())]
        for a, t in zip(entry.top_logprobs, ids.tolist()):
            want = (list(a.token.encode()) if t < WORD_IDS else [0x80 + t - WORD_IDS] if t < WORD_IDS + BYTE_IDS
                    else None)
            assert a.bytes == want
            kinds.add(0 if t < WORD_IDS else 1 if t < WORD_IDS + BYTE_IDS else 2)
    assert kinds >= {1, 2}
