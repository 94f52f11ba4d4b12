"""`expertcache serve`: an OpenAI-compatible HTTP server over the continuous-batching Scheduler.

    client ─HTTP─► uvicorn ─► _Guard (API key, draining → 503, request counter) ─► FastAPI routes
        /v1/completions, /v1/chat/completions ─► openai_api.prepare ─► Request ─► Scheduler.submit
            ◄─ Events on an asyncio.Queue (the scheduler thread puts them with call_soon_threadsafe)
            ─► one JSON body, or SSE chunks `data: {...}` ending with `data: [DONE]`
        /v1/models, /health
        /metrics ─► Scheduler.call(snapshot) (read on the scheduler thread) ─► Prometheus text
    shutdown: draining (new /v1 requests → 503) ─► uvicorn finishes in-flight requests (up to
        --shutdown-timeout, then cancels them) ─► Scheduler.stop ─► --record-routing trace written

A request whose client goes away is cancelled: a stream when its response ends for any reason
(`_EventStream`), a non-streaming one when the disconnect is seen while it waits; the scheduler then
frees its batch row at its next turn. The engine is touched only by the scheduler thread.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe import openai_api as api
from moe.metrics import CONTENT_TYPE, ServerMetrics, snapshot
from moe.recording import write_routing
from moe.scheduler import Event, Request, Scheduler, SchedulerClosed
from moe.tokenizer import TextTokenizer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class ServeOptions:
    """served_name: the model id clients pass. max_seq_len: the context. api_key: the Bearer token
    /v1 requires (None: open). record_routing: the trace path written at shutdown (None: off).
    trace_meta: extra meta keys of the trace (policy, slots). shutdown_timeout: seconds in-flight
    requests get to finish at shutdown."""

    served_name: str
    max_seq_len: int
    api_key: str | None = None
    record_routing: Path | None = None
    trace_meta: dict | None = None
    shutdown_timeout: float = 30.0


class ServeState:
    """What the routes share: the scheduler (and its engine), the tokenizer, options, metrics."""

    def __init__(self, scheduler: Scheduler, tokenizer: TextTokenizer, options: ServeOptions) -> None:
        self.scheduler, self.tokenizer, self.options = scheduler, tokenizer, options
        self.metrics = ServerMetrics()
        self.draining = False
        self.started = int(time.time())
        self.closed = False

    def write_routing(self, path: str | Path | None = None):
        """Write the routing recorded so far (to `path`, default --record-routing) on the scheduler
        thread; returns a concurrent Future of the Trace. Raises ValueError without --record-routing."""
        target = path or self.options.record_routing
        if target is None:
            raise ValueError("no trace path: pass `path` or start the server with --record-routing PATH")
        return self.scheduler.call(lambda: write_routing(self.scheduler, target, self.options.served_name,
                                                         **(self.options.trace_meta or {})))

    def close(self) -> None:
        """Drain: refuse new requests, stop the scheduler (ending what is left), write the trace."""
        if self.closed:
            return
        self.draining = True
        self.scheduler.stop()
        if self.options.record_routing is not None:
            self.write_routing().result()
        self.closed = True


def _json_error(err: api.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _Guard:
    """ASGI middleware: counts every HTTP answer by endpoint and status; on /v1 paths refuses a
    draining server (503) and a missing or wrong API key (401) before any route runs."""

    def __init__(self, app, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], [500]

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope) if path.startswith("/v1/") else None
            if refusal is not None:
                return await _json_error(refusal)(scope, receive, counted)
            await self.app(scope, receive, counted)
        finally:
            label = path if path in ENDPOINTS else "other"
            self.state.metrics.requests.labels(label, str(status[0])).inc()

    def _refusal(self, scope) -> api.ApiError | None:
        if self.state.draining:
            return api.ApiError(503, "the server is shutting down: retry later", type="server_error",
                                code="shutting_down")
        key = self.state.options.api_key
        if key is None:
            return None
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return api.ApiError(401, "Incorrect API key provided: send the header "
                                "'Authorization: Bearer KEY' with the server's --api-key",
                                code="invalid_api_key")
        return None


class _EventStream(StreamingResponse):
    """An SSE response that cancels its generation request however the response ends."""

    def __init__(self, content: AsyncIterator[str], request: Request) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = request

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _submit(state: ServeState, prep: api.Prepared) -> tuple[Request, asyncio.Queue]:
    """Queue a generation; its Events arrive on the returned asyncio.Queue. Raises ApiError 503."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    req = Request(prep.prompt, prep.params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    try:
        state.scheduler.submit(req)
    except SchedulerClosed as e:
        raise api.ApiError(503, str(e), type="server_error", code="shutting_down") from None
    return req, events


def _event_error(state: ServeState, ev: Event) -> api.ApiError:
    if state.draining:
        return api.ApiError(503, f"the server is shutting down: {ev.error}", type="server_error",
                            code="shutting_down")
    return api.ApiError(500, f"generation failed: {ev.error}", type="server_error", code="internal_error")


async def _collect(state: ServeState, req: Request, events: asyncio.Queue, http: HttpRequest) -> tuple[str, Event]:
    """Wait for every Event of `req`: (text, last Event). Cancels it if the client disconnects."""
    parts: list[str] = []
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise api.ApiError(499, "the client disconnected", code="client_closed") from None
                continue
            parts.append(ev.text)
            if ev.error is not None:
                raise _event_error(state, ev)
            if ev.final:
                return "".join(parts), ev
    finally:
        req.cancel()  # no-op once finished


async def _stream(state: ServeState, events: asyncio.Queue, chunk, first: dict | None, obj: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE text: `first` (if any), a chunk per text delta, a finish chunk, usage, [DONE]."""
    rid, model = api.new_id("cmpl" if obj == "text_completion" else "chatcmpl"), state.options.served_name
    if first is not None:
        yield _sse(chunk(rid, model, first, None))
    while True:
        ev: Event = await events.get()
        if ev.error is not None:
            yield _sse(_event_error(state, ev).body())
            break
        if ev.text:
            yield _sse(chunk(rid, model, ev.text, None))
        if ev.final:
            yield _sse(chunk(rid, model, "" if first is None else {}, ev.finish_reason))
            if include_usage:
                yield _sse(api.usage_chunk(rid, model, obj, api.usage(ev.prompt_tokens, ev.completion_tokens)))
            break
    yield "data: [DONE]\n\n"


def _chat_chunk(rid: str, model: str, delta, finish: str | None) -> dict:
    return api.chat_chunk(rid, model, {"content": delta} if isinstance(delta, str) else delta, finish)


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI app of `state`; its lifespan starts the scheduler and, on exit, closes the state."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(api.ApiError)
    async def api_error(request: HttpRequest, e: api.ApiError):
        return _json_error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: HttpRequest, e: RequestValidationError):
        return _json_error(api.validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException):
        return _json_error(api.ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                        code="not_found" if e.status_code == 404 else None))

    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServeState) -> None:
    opts, tok = state.options, state.tokenizer
    vocab = state.scheduler.engine.spec.vocab_size

    @app.post("/v1/completions")
    async def completions(body: api.CompletionBody, http: HttpRequest):
        prep = api.prepare(body, api.completion_prompt(body, tok, vocab), served=opts.served_name,
                           max_seq_len=opts.max_seq_len, default_max=16)
        req, events = _submit(state, prep)
        if body.stream:
            return _EventStream(_stream(state, events, api.completion_chunk, None, "text_completion",
                                        body.include_usage), req)
        text, ev = await _collect(state, req, events, http)
        return api.completion_body(api.new_id("cmpl"), opts.served_name, text, ev.finish_reason,
                                   api.usage(ev.prompt_tokens, ev.completion_tokens))

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatBody, http: HttpRequest):
        prep = api.prepare(body, api.chat_prompt(body, tok), served=opts.served_name,
                           max_seq_len=opts.max_seq_len, default_max=None)
        req, events = _submit(state, prep)
        if body.stream:
            return _EventStream(_stream(state, events, _chat_chunk, {"role": "assistant", "content": ""},
                                        "chat.completion.chunk", body.include_usage), req)
        text, ev = await _collect(state, req, events, http)
        return api.chat_body(api.new_id("chatcmpl"), opts.served_name, text, ev.finish_reason,
                             api.usage(ev.prompt_tokens, ev.completion_tokens))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": opts.served_name, "object": "model", "created": state.started,
                                            "owned_by": "expertcache", "max_model_len": opts.max_seq_len}]}

    @app.get("/health")
    async def health():
        if state.draining or not state.scheduler.running:
            status = "shutting down" if state.draining else "scheduler stopped"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok", "active": state.scheduler.active, "waiting": state.scheduler.waiting}

    @app.get("/metrics")
    async def metrics():
        snap = await asyncio.wrap_future(state.scheduler.call(lambda: snapshot(state.scheduler)))
        return Response(state.metrics.render(snap), media_type=CONTENT_TYPE)


class Server(uvicorn.Server):
    """uvicorn's server that marks the state draining as soon as shutdown starts."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        await super().shutdown(sockets)


def make_server(state: ServeState, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Server:
    """A uvicorn Server of create_app(state); run() blocks until SIGINT / SIGTERM (or should_exit)."""
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=state.options.shutdown_timeout)
    return Server(config, state)
