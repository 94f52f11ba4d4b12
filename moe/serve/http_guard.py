"""What stands between a socket and the server's routes: connection timeouts and the request guard.

    TCP ──TimedH11Protocol (uvicorn's h11 protocol): a client that has not sent a whole request
        (headers and body) within --read-timeout seconds of connecting or of its last response is
        disconnected; idle keep-alive connections close after --keep-alive-timeout (uvicorn's timer);
        bytes that are not HTTP/1.1 get a JSON 400 invalid_http
    ──Guard (ASGI middleware), before any route runs, with JSON errors in the form of the path's API
        (Anthropic's under /v1/messages, OpenAI's elsewhere: anthropic_schema.error_body):
        /v1/* while draining → 503 shutting_down
        /v1/* and /metrics (unless --metrics-public) without 'Authorization: Bearer KEY' or
            'x-api-key: KEY' → 401 (the scheme is matched case-insensitively; /health is always open)
        POST without Content-Type application/json → 415 (so that a cross-site "simple" form or
            text/plain request cannot start a generation)
        POST body above --max-body-mb (Content-Length, or counted while it arrives) → 413, after
            reading and dropping the rest (up to 64 MiB) so that the client sees the answer
        otherwise the body is read whole and replayed to the route
    ──route: an exception it raises (a bug) becomes a 500 internal_error naming the request id (the
        route's response id, scope["state"]["request_id"], else a new one), logged at error level with
        its traceback, once (Starlette would re-raise it to uvicorn, which logs it again)
    and counts every answer by endpoint and status (expertcache_requests_total).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe.serve.anthropic_schema import COUNT_PATH, MESSAGES_PATH, VERSION_HEADER, error_body
from moe.serve.openai_schema import ApiError

logger = logging.getLogger(__name__)
DISCARD_BYTES = 64 * 2**20  # of a body past the limit, read and dropped before the 413
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", MESSAGES_PATH, COUNT_PATH, "/v1/models", "/health",
             "/metrics")


@dataclass(frozen=True)
class GuardOptions:
    """api_key: the Bearer token of /v1 and /metrics (None: open). metrics_public: /metrics needs no
    key. max_body_bytes: the largest POST body accepted."""

    api_key: str | None = None
    metrics_public: bool = False
    max_body_bytes: int = 8 * 2**20


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for receiving each request: `read_timeout` seconds from
    the connection (or the end of the last response) until the whole request has arrived. Past it the
    connection is closed; a route that was reading the body sees a disconnect."""

    read_timeout: float = 30.0
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._read_timer = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, as an OpenAI-style JSON error (not text)."""
        body = json.dumps(ApiError(400, f"{msg} Send an HTTP/1.1 request.", code="invalid_http").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _expired(self) -> None:
        self._read_timer = None
        if self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and not self.transport.is_closing():
            self.transport.close()


def timed_protocol(read_timeout: float) -> type[TimedH11Protocol]:
    """A TimedH11Protocol class with this deadline (uvicorn.Config takes a protocol class)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": float(read_timeout)})


def error_response(err: ApiError, path: str, close: bool = False, anthropic_version: bool = False) -> Callable:
    """An ASGI app answering `err` as JSON in the form of `path`'s API (anthropic_schema.error_body; with
    Connection: close when the body was left unread)."""
    body = json.dumps(error_body(path, err, anthropic_version)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class _Disconnected(Exception):
    pass


class Guard:
    """ASGI middleware: the refusals and body limit above, and the answer counter.

    is_draining() -> bool tells whether the server is shutting down; count(endpoint, status) records
    an answer."""

    def __init__(self, app, options: GuardOptions, is_draining: Callable[[], bool],
                 count: Callable[[str, str], None]) -> None:
        self.app, self.options, self.is_draining, self.count = app, options, is_draining, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = ["499"]  # no answer at all: the client went away first

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, counted)
        except Exception as e:  # a route's bug: answered here, so that it is logged once, with the request id
            await _internal_error(scope, e, counted, started=status[0] != "499")
        finally:
            path = scope["path"]
            self.count(path if path in ENDPOINTS else "other", status[0])

    async def _guarded(self, scope, receive, send) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        versioned = VERSION_HEADER.encode() in headers
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await error_response(refusal, scope["path"], close=scope["method"] == "POST",
                                        anthropic_version=versioned)(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await self._read_body(headers, receive)
        except ApiError as e:
            return await error_response(e, scope["path"], close=True, anthropic_version=versioned)(scope, receive, send)
        except _Disconnected:
            return None
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> ApiError | None:
        path = scope["path"]
        v1 = path.startswith("/v1/")
        if v1 and self.is_draining():
            return ApiError(503, "the server is shutting down: retry later", type="server_error", code="shutting_down")
        if (v1 or (path == "/metrics" and not self.options.metrics_public)) and not self._authorized(headers):
            return ApiError(401, "Incorrect API key provided: send the header 'Authorization: Bearer KEY' (or "
                            "'x-api-key: KEY') with the server's API key (--api-key-file, EXPERTCACHE_API_KEY or "
                            "--api-key)",
                            code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1") or "none"
                return ApiError(415, f"Content-Type: the body must be JSON sent as 'Content-Type: application/json' "
                                f"(got {shown})", param="Content-Type", code="unsupported_media_type")
        return None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """The API key as a Bearer token (OpenAI's clients) or in x-api-key (Anthropic's)."""
        key = self.options.api_key
        if key is None:
            return True
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
        bearer = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
        given = headers.get(b"x-api-key")
        return bearer or (given is not None and secrets.compare_digest(given.strip(), key.encode()))

    async def _read_body(self, headers: dict[bytes, bytes], receive) -> bytes:
        """The whole body, or ApiError 413 past the limit: the excess is read and dropped (up to
        DISCARD_BYTES) before the answer, so that a client still sending can read the 413."""
        limit = self.options.max_body_bytes
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        over = declared is not None and declared > limit
        chunks, size, more = [], 0, True
        while more and not (over and size >= DISCARD_BYTES):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            over = over or size > limit
            if not over:
                chunks.append(chunk)
        if over:
            raise _too_large(limit, declared if declared is not None else None if more else size)
        return b"".join(chunks)


async def _internal_error(scope, e: Exception, send, started: bool) -> None:
    """Log `e` with its traceback and the request id; answer a 500 internal_error unless the response
    has begun (then re-raise: the server closes the connection)."""
    state = scope.setdefault("state", {})
    rid = state.setdefault("request_id", f"req-{uuid.uuid4().hex}")
    logger.error("request %s: %s %s failed with an internal error", rid, scope["method"], scope["path"], exc_info=e)
    if started:
        raise e
    err = ApiError(500, f"internal error (request {rid}): {type(e).__name__}: {e}", type="server_error",
                   code="internal_error")
    versioned = any(k.lower() == VERSION_HEADER.encode() for k, _ in scope.get("headers") or [])
    await error_response(err, scope["path"], anthropic_version=versioned)(scope, None, send)


def _too_large(limit: int, size: int | None = None) -> ApiError:
    has = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ApiError(413, f"the request body has {has}; this server accepts at most {limit} bytes (--max-body-mb)",
                    code="request_too_large")


def _replay(body: bytes, receive) -> Callable:
    """A receive() that hands the route the body read already, then passes on (disconnects)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def until_disconnect(receive) -> None:
    """Return when the client of this request disconnects (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)
