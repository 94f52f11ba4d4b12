"""A request that ends in a 500 leaves its trace in the server's log, over real HTTP on loopback.

    engine.decode_step raises ─► scheduler ends the request (Event.cause) ─► 500 generation failed (JSON,
        or an SSE error event) naming the response id ─► an error record of moe.serve.server with that
        id and the exception's traceback
    a route raises (openai_api.prepare_completion patched) ─► the Guard's 500 internal_error naming the
        request id ─► one error record of moe.serve.http_guard with the traceback (uvicorn logs nothing)
    `expertcache serve`'s logging (serve_logging): those records reach stderr at --log-level debug
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from moe.serve import openai_api
from moe.serve.cli import serve_logging
from tests.moe.serve.http_util import AUTH, NAME, serve

BODY = {"model": NAME, "prompt": "w10 w20", "max_tokens": 3}


@pytest.fixture(scope="module")
def srv(tiny_dir):
    running = serve(tiny_dir)
    yield running
    running.stop()


def _request_id(message: str) -> str:
    found = re.search(r"\(request ((?:chatcmpl|cmpl|req)-[0-9a-f]{32})\)", message)
    assert found, f"no request id in {message!r}"
    return found.group(1)


def _failing_decode(monkeypatch, srv) -> None:
    def exploding_step(tokens):
        raise RuntimeError("the decode step exploded")

    monkeypatch.setattr(srv.scheduler.engine, "decode_step", exploding_step)


def _logged(caplog, logger: str, rid: str) -> logging.LogRecord:
    records = [r for r in caplog.records if r.name == logger and rid in r.getMessage()]
    assert len(records) == 1, [(r.name, r.getMessage()) for r in caplog.records]
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None
    return records[0]


def test_a_failed_decode_step_is_logged_with_its_traceback(srv, monkeypatch, caplog):
    _failing_decode(monkeypatch, srv)
    with caplog.at_level(logging.ERROR):
        reply = httpx.post(srv.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    rid = _request_id(reply.json()["error"]["message"])
    record = _logged(caplog, "moe.serve.server", rid)
    assert isinstance(record.exc_info[1], RuntimeError) and "exploding_step" in caplog.text


def test_a_failed_stream_is_logged_with_its_traceback(srv, monkeypatch, caplog):
    _failing_decode(monkeypatch, srv)
    with caplog.at_level(logging.ERROR):
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": NAME, "messages": [{"role": "user", "content": "w9"}], "max_tokens": 3,
                                "stream": True}) as reply:
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error"
    rid = _request_id(error["message"])
    assert rid == json.loads(events[0])["id"]  # the response's own id
    assert isinstance(_logged(caplog, "moe.serve.server", rid).exc_info[1], RuntimeError)


def test_a_route_that_raises_is_one_logged_500_and_the_server_goes_on(srv, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise KeyError("a bug in prepare")

    uvicorn_records: list[logging.LogRecord] = []
    sink = logging.Handler()
    sink.emit = uvicorn_records.append
    logging.getLogger("uvicorn.error").addHandler(sink)
    monkeypatch.setattr(openai_api, "prepare_completion", broken)
    try:
        with caplog.at_level(logging.ERROR):
            reply = httpx.post(srv.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(sink)
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error"
    assert "KeyError" in reply.json()["error"]["message"]
    rid = _request_id(reply.json()["error"]["message"])
    assert rid.startswith("cmpl-")
    assert isinstance(_logged(caplog, "moe.serve.http_guard", rid).exc_info[1], KeyError)
    assert not [r for r in uvicorn_records if r.levelno >= logging.ERROR], "logged twice"
    monkeypatch.undo()
    assert httpx.post(srv.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30).status_code == 200


def test_serve_shows_a_500s_traceback_on_stderr_at_debug(capsys):
    with serve_logging("debug"):
        try:
            raise RuntimeError("the decode step exploded")
        except RuntimeError as e:
            logging.getLogger("moe.serve.server").error("request cmpl-0: generation failed", exc_info=e)
        logging.getLogger("moe.engine.loading").debug("a debug record")
    logging.getLogger("moe.serve.server").error("after the block")
    err = capsys.readouterr().err
    assert "ERROR" in err and "request cmpl-0: generation failed" in err and "Traceback" in err
    assert "the decode step exploded" in err and "a debug record" in err and "after the block" not in err
