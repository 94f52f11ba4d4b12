"""`expertcache serve` against what real clients do, over real sockets on loopback (CPU backend).

    disconnects (non-streaming too) free the row at once · body size limit (413) · parsing and
    tokenizing off the event loop · long prompts refused before the rest is tokenized · bounded stop
    strings · shutdown past --shutdown-timeout answers every open request with 503 shutting_down ·
    invalid text and unhandled errors as JSON · strict types and unsupported fields refused ·
    logprobs · content parts (access, timeouts and serve flags: test_server_access.py)
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
import torch

from moe.engine.loading import load_model
from moe.serve import openai_api
from tests.moe.serve.http_util import AUTH, NAME, serve, slow_decode
from tests.moe.serve.serving_util import held, wait_until


@pytest.fixture(scope="module")
def srv(tiny_dir):
    running = serve(tiny_dir, "--max-body-mb", "0.05", "--read-timeout", "0.6", "--keep-alive-timeout", "0.6",
                    max_seq_len=256)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return load_model(tiny_dir, "cpu", num_slots=16, max_seq_len=256, progress=False)


def _post(srv, path: str, body, headers=None, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, headers={**AUTH, "Content-Type": "application/json",
                                                                 **(headers or {})}, timeout=30, **kw)


def _error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param and param.split(".")[0] in err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def _idle(srv) -> bool:
    return srv.scheduler.active == 0 and srv.scheduler.waiting == 0


# 1. disconnects

def test_a_non_streaming_client_that_disconnects_frees_its_row_at_once(srv):
    slow_decode(srv, 0.01)  # 200 tokens would take 2 s
    before = dict(srv.scheduler.stats.finished)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "w9", "max_tokens": 200},
                   headers=AUTH, timeout=0.4)
    gone = time.monotonic()
    wait_until(lambda: _idle(srv), timeout=5, what="the row to be freed")
    assert time.monotonic() - gone < 0.5  # a few decode steps of 10 ms, not the 1.6 s left
    after = srv.scheduler.stats.finished
    assert after["cancelled"] == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)


# 2. body size, the event loop, long prompts

def test_a_body_above_the_limit_gets_413_whether_or_not_it_declares_its_length(srv):
    big = json.dumps({"model": NAME, "prompt": "w9 " * 30000})  # 90 KB > 0.05 MiB
    _error(_post(srv, "/v1/completions", big), 413, code="request_too_large")

    def chunks():
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096].encode()

    chunked = httpx.post(srv.url + "/v1/completions", content=chunks(),  # no Content-Length
                         headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    _error(chunked, 413, code="request_too_large")
    assert _post(srv, "/v1/completions", {"model": NAME, "prompt": "w9", "max_tokens": 2}).status_code == 200


def test_tokenizing_a_prompt_does_not_block_the_event_loop(srv, monkeypatch):
    tok, slow = srv.state.tokenizer, threading.Event()
    encode = type(tok).encode

    def slow_encode(self, text, **kw):
        if "w77" in text:
            slow.set()
            time.sleep(1.5)
        return encode(self, text, **kw)

    monkeypatch.setattr(type(tok), "encode", slow_encode)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", _post(srv, "/v1/completions", {
        "model": NAME, "prompt": "w77", "max_tokens": 2})))
    t.start()
    assert slow.wait(10)
    start = time.monotonic()
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
    assert time.monotonic() - start < 0.5
    t.join(30)
    assert result["r"].status_code == 200


def test_a_long_prompt_is_refused_before_the_rest_of_it_is_tokenized(srv, monkeypatch):
    tok, lengths = srv.state.tokenizer, []
    encode = type(tok).encode
    monkeypatch.setattr(
        type(tok), "encode", lambda self, text, **kw: lengths.append(len(text)) or encode(self, text, **kw)
    )
    prompt = "w9 " * 15000  # 45,000 characters, 15,000 tokens, context 256
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": prompt})
    err = _error(r, 400, param="prompt", code="context_length_exceeded")
    assert "at least" in err["message"] and max(lengths) <= 16 * 256
    lengths.clear()
    r = _post(srv, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": prompt}]})
    _error(r, 400, param="messages", code="context_length_exceeded")
    assert max(lengths) <= 16 * 256
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": list(range(7, 100)) * 3})
    _error(r, 400, param="prompt", code="context_length_exceeded")


# 3. stop strings

@pytest.mark.parametrize("stop", [["w1", "w2", "w3", "w4", "w5"], ["x" * 257], ["w9"] * 4000])
def test_stop_strings_are_bounded(srv, stop):
    _error(_post(srv, "/v1/completions", {"model": NAME, "prompt": "w9", "stop": stop}), 400, param="stop")


def test_four_stop_strings_of_the_longest_length_work(srv, ref):
    tok = srv.state.tokenizer
    ids = ref.generate([tok.encode("w12 w13")], 8)[0]
    want = tok.decode(ids)
    stop = tok.decode(ids[3:5])
    out = srv.client.completions.create(model=NAME, prompt="w12 w13", max_tokens=8, temperature=0,
                                        stop=[stop, "q" * 256, "w200", "x"])
    assert out.choices[0].text == want[:want.index(stop)] and out.choices[0].finish_reason == "stop"


# 4. shutdown past --shutdown-timeout

class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_shutdown_past_its_timeout_answers_every_open_request_with_503(tiny_dir, caplog):
    run = serve(tiny_dir, "--shutdown-timeout", "0.3", max_seq_len=256)
    records = _Records()
    logging.getLogger("uvicorn").addHandler(records)
    try:
        slow_decode(run, 0.02)
        body = {"model": NAME, "prompt": "w9", "max_tokens": 200}
        plain, lines = {}, []
        t = threading.Thread(target=lambda: plain.setdefault("r", _post(run, "/v1/completions", body)))
        t.start()
        with httpx.stream("POST", run.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=30) as stream:
            it = stream.iter_lines()
            lines.append(next(it))
            wait_until(lambda: run.scheduler.active == 2, what="both requests generating")
            run.server.should_exit = True
            lines += list(it)
        t.join(30)
        run.thread.join(30)
        assert not run.thread.is_alive()
    finally:
        logging.getLogger("uvicorn").removeHandler(records)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    err = _error(plain["r"], 503, code="shutting_down")
    assert "shutting down" in err["message"]
    logged = records.records + caplog.records
    assert not [r for r in logged if r.exc_info or "Cancel" in r.getMessage()], [r.getMessage() for r in logged]


# 5. invalid text and unhandled errors

@pytest.mark.parametrize("path, raw, says", [
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"model": "tiny-moe", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
     "lone UTF-16 surrogate"),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "\xff"}', "not UTF-8 text"),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": ', "ends before the JSON does (truncated?)"),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "\\ud83d\\ude00 \\u12"}', "a syntax error (invalid escape"),
    ("/v1/completions", b'{"model": "tiny-moe" "prompt": "w9"}', "a syntax error (expected `,`"),
    ("/v1/completions", b' ', "the body is empty"),
    ("/v1/completions", b'[1, 2]', "the request body must be a JSON object"),
])
def test_invalid_text_and_json_get_a_400_json_error_saying_what_is_wrong(srv, path, raw, says):
    err = _error(_post(srv, path, raw), 400)
    assert says in err["message"] and (says.startswith("lone") or "surrogate" not in err["message"]), err["message"]


def test_an_unhandled_error_comes_back_as_json(srv, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(openai_api, "prepare_completion", broken)
    err = _error(_post(srv, "/v1/completions", {"model": NAME, "prompt": "w9"}), 500, code="internal_error")
    assert "boom" in err["message"]
    for path in ("/nope", "/v1/nope"):
        _error(httpx.get(srv.url + path, headers=AUTH), 404)
    _error(httpx.get(srv.url + "/v1/completions", headers=AUTH), 405)


# 6. strict types, unsupported fields, logprobs, content parts

@pytest.mark.parametrize("field, value, code", [
    ("max_tokens", "5", "invalid_value"), ("stream", "yes", "invalid_value"), ("temperature", "0.5", "invalid_value"),
    ("max_tokens", True, "invalid_value"), ("seed", 1.5, "invalid_value"), ("n", 2, "invalid_value"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "unsupported_parameter"),
    ("response_format", {"type": "json_object"}, "unsupported_parameter"),
    ("echo", True, "unsupported_parameter"), ("best_of", 2, "unsupported_parameter"),
    ("suffix", "w9", "unsupported_parameter"), ("presence_penalty", 0.5, "unsupported_parameter"),
    ("frequency_penalty", -1, "unsupported_parameter"), ("logit_bias", {"9": 5}, "unsupported_parameter"),
    ("logprobs", 6, "invalid_value"), ("top_k", 5, "unknown_parameter"),
    ("stream_options", {"include_usage": True}, "invalid_value"),
])
def test_unsupported_or_mistyped_fields_are_refused_by_name(srv, field, value, code):
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "w9", field: value})
    _error(r, 400, param=field, code=code)


def test_off_values_of_unsupported_fields_are_accepted(srv):
    body = {"model": NAME, "prompt": "w9", "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0,
            "logit_bias": {}, "echo": False, "best_of": 1, "suffix": None, "user": "u1", "temperature": 0,
            "top_p": None, "stream": False}
    assert _post(srv, "/v1/completions", body).status_code == 200
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w9"}], "max_tokens": 2, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": False}
    assert _post(srv, "/v1/chat/completions", chat).status_code == 200


def test_text_content_parts_work_and_other_parts_are_refused(srv):
    parts = [{"type": "text", "text": "w40"}, {"type": "text", "text": " w41"}]
    whole = srv.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w40 w41"}],
                                               temperature=0, max_tokens=5)
    split = srv.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}],
                                               temperature=0, max_tokens=5)
    assert split.choices[0].message.content == whole.choices[0].message.content
    image = parts + [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = _post(srv, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": image}]})
    _error(r, 400, param="messages.0.content.2.type")
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}
    r = _post(srv, "/v1/chat/completions", {"model": NAME, "messages": [call]})
    _error(r, 400, param="messages.0.tool_calls.0.function", code="invalid_value")


def _reference_logprobs(ref, prompt: list[int], n: int):
    """(tokens, their logprobs, logits rows) of greedy decoding, from one prefill of prompt + tokens."""
    tokens = ref.generate([prompt], n)[0]
    logits = ref.prefill([prompt + tokens[:-1]], all_logits=True)[0]  # [P + n - 1, V]
    lp = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:]
    return tokens, lp


def test_completion_logprobs_match_the_model(srv, ref):
    tok = srv.state.tokenizer
    out = srv.client.completions.create(model=NAME, prompt="w20 w21", max_tokens=5, temperature=0, logprobs=3)
    tokens, lp = _reference_logprobs(ref, tok.encode("w20 w21"), 5)
    got = out.choices[0].logprobs
    assert got.tokens == [tok.token_text(t) for t in tokens]
    assert got.token_logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    for i, top in enumerate(got.top_logprobs):
        values, ids = lp[i].topk(3)
        assert list(top) == [tok.token_text(t) for t in ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    text = out.choices[0].text
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    assert [text[o:].lstrip().startswith(t) for o, t in zip(got.text_offset, got.tokens)] == [True] * 5
    plain = srv.client.completions.create(model=NAME, prompt="w20 w21", max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == out.choices[0].text


def test_chat_logprobs_streamed_equal_non_streamed(srv, ref):
    tok = srv.state.tokenizer
    messages = [{"role": "user", "content": "w30"}]
    kw = dict(model=NAME, messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    out = srv.client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    tokens, lp = _reference_logprobs(ref, tok.encode_chat(messages), 4)
    assert [c.token for c in content] == [tok.token_text(t) for t in tokens]
    assert [c.logprob for c in content] == pytest.approx([lp[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = [e for ch in srv.client.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    _error(_post(srv, "/v1/chat/completions", {"model": NAME, "messages": messages, "top_logprobs": 2}), 400,
           param="top_logprobs")


def test_requests_queued_behind_a_held_scheduler_complete(srv):
    """Requests queued behind a held scheduler still complete once it resumes (the guard adds no stall)."""
    results = []
    with held(srv.scheduler):
        ts = [threading.Thread(target=lambda: results.append(_post(srv, "/v1/completions", {
            "model": NAME, "prompt": "w9", "max_tokens": 2}).status_code)) for _ in range(3)]
        for t in ts:
            t.start()
        wait_until(lambda: srv.scheduler.waiting == 3, what="3 waiting")
    for t in ts:
        t.join(30)
    assert results == [200, 200, 200]
