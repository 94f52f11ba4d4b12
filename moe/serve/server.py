"""`expertcache serve`: an OpenAI- and Anthropic-compatible HTTP server over the continuous-batching Scheduler.

    client ─TCP─► uvicorn (TimedH11Protocol: --read-timeout, --keep-alive-timeout)
        ─► Guard (draining → 503, API key → 401, Content-Type → 415, body size → 413, counter)
        ─► FastAPI routes
        /v1/completions, /v1/chat/completions, /v1/messages: body bytes ─worker thread: parse, check,
            tokenize─► Prepared ─► Request ─► Scheduler.submit
            ◄─ Events on an asyncio.Queue (the scheduler thread puts them with call_soon_threadsafe)
            ─► one JSON body, or an SSE stream (_stream: openai_api.ChunkStream writes chunks `data: {...}`
               ending with `data: [DONE]`, a chat reply's tool calls as a delta each as they close;
               anthropic_api.MessageStream writes Anthropic's events, a tool_use block each)
        /v1/messages/count_tokens: body bytes ─worker thread─► the prompt's token count
        /v1/models, /v1/models/{id}: OpenAI's list and model object, Anthropic's for a request with an
            anthropic-version header; /health
        /metrics ─► Scheduler.call(snapshot) (read on the scheduler thread) ─► Prometheus text
    shutdown: draining (new /v1 requests → 503) ─► the scheduler runs the open requests for up to
        --shutdown-timeout, then ends the rest with "server shutting down": each gets a 503
        shutting_down error (JSON, or a final SSE error event and [DONE]) ─► uvicorn closes the
        connections ─► --record-routing trace written

A request whose client goes away is cancelled as soon as the disconnect arrives, streaming or not
(a watcher awaits the connection's disconnect while the request waits or generates); the scheduler
frees its batch row at its next turn. The engine is touched only by the scheduler thread. Every
error is a JSON body in the form of its path's API (Anthropic's under /v1/messages, OpenAI's elsewhere), or
an SSE error event once a stream has begun, never text/plain.
A request that ends in a 500 (a generation failed, or a route raised: the Guard answers those) is
logged at error level with its request id (the response id, also in the error's message) and the
exception's traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe.engine.budget import SlotBudget
from moe.serve import anthropic_api
from moe.serve import openai_api as api
from moe.serve.anthropic_schema import VERSION_HEADER, error_body
from moe.serve.http_guard import Guard, GuardOptions, timed_protocol, until_disconnect
from moe.serve.metrics import CONTENT_TYPE, ServerMetrics, snapshot
from moe.serve.recording import write_routing
from moe.serve.scheduler import Event, Request, Scheduler, SchedulerClosed
from moe.serve.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)
FINAL_WRITE_S = 5.0  # at shutdown, after every request has its last event: time to write the answers


@dataclass(frozen=True)
class ServeOptions:
    """served_name: the model id clients pass. max_seq_len: the context. guard: API key, /metrics
    access, body limit. record_routing: the trace path written at shutdown (None: off). trace_meta:
    extra meta keys of the trace (policy, slots). shutdown_timeout: seconds open requests get to finish
    at shutdown. read_timeout: seconds a client has to send a whole request. keep_alive_timeout: seconds
    an idle keep-alive connection stays open. slot_budget: the expert cache's size as --moe-slots /
    --moe-cache-gb resolved it (moe.engine.budget; the start line prints it), None when not given."""

    served_name: str
    max_seq_len: int
    guard: GuardOptions = field(default_factory=GuardOptions)
    record_routing: Path | None = None
    trace_meta: dict | None = None
    shutdown_timeout: float = 30.0
    read_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    slot_budget: SlotBudget | None = None


class ServeState:
    """What the routes share: the scheduler (and its engine), the tokenizer, options, metrics."""

    def __init__(self, scheduler: Scheduler, tokenizer: TextTokenizer, options: ServeOptions) -> None:
        self.scheduler, self.tokenizer, self.options = scheduler, tokenizer, options
        self.metrics = ServerMetrics()
        self.draining = False
        self.started = int(time.time())
        self.closed = False
        self.followers: list = []  # the other ranks' processes under --tensor-parallel (moe.engine.expert_parallel)

    def write_routing(self, path: str | Path | None = None):
        """Write the routing recorded so far (to `path`, default --record-routing) on the scheduler
        thread; returns a concurrent Future of the Trace. Raises ValueError without --record-routing."""
        target = path or self.options.record_routing
        if target is None:
            raise ValueError("no trace path: pass `path` or start the server with --record-routing PATH")
        return self.scheduler.call(lambda: write_routing(self.scheduler, target, self.options.served_name,
                                                         **(self.options.trace_meta or {})))

    def drain(self, timeout: float) -> None:
        """Refuse new requests; let the open ones run for up to `timeout` s, then end the rest with
        "server shutting down" (their clients get 503 shutting_down). Blocks; idempotent."""
        self.draining = True
        self.scheduler.stop(timeout)

    def close(self) -> None:
        """Drain at once (ending what is left), write the trace."""
        if self.closed:
            return
        self.drain(0.0)
        if self.options.record_routing is not None:
            self.write_routing().result()
        self.closed = True


def _json_error(err: api.ApiError, request: HttpRequest) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, err, VERSION_HEADER in request.headers), status_code=err.status)


_DISCONNECTED = Event(error="the client disconnected")


def _submit(state: ServeState, prep: api.Prepared) -> tuple[Request, asyncio.Queue]:
    """Queue a generation; its Events arrive on the returned asyncio.Queue. Raises ApiError 503."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    req = Request(prep.prompt, prep.params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  channels=prep.channels, tools=prep.tools)
    try:
        state.scheduler.submit(req)
    except SchedulerClosed as e:
        raise api.ApiError(503, str(e), type="server_error", code="shutting_down") from None
    return req, events


def _event_error(state: ServeState, ev: Event, rid: str) -> api.ApiError:
    """The error of response `rid` ended by `ev`: 503 while shutting down, else a 500, logged with the
    traceback of the exception behind it."""
    if state.draining or state.scheduler.closing:
        return api.ApiError(503, f"the server is shutting down: {ev.error}", type="server_error",
                            code="shutting_down")
    logger.error("request %s: generation failed: %s", rid, ev.error, exc_info=ev.cause)
    return api.ApiError(500, f"generation failed (request {rid}): {ev.error}", type="server_error",
                        code="internal_error")


@dataclass
class _Reply:
    """Every Event of a request gathered: text, logprobs, the last Event, reasoning text, tool calls."""

    text: str
    logprobs: list
    last: Event
    reasoning: str
    tool_calls: list


async def _collect(state: ServeState, req: Request, events: asyncio.Queue, http: HttpRequest,
                   rid: str) -> _Reply:
    """Wait for every Event of `req` (response `rid`). Cancels it the moment the client disconnects
    (ApiError 499)."""
    def gone(task: asyncio.Task) -> None:  # the disconnect arrived (or receive() failed: the same to us)
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not log it
            events.put_nowait(_DISCONNECTED)

    watcher = asyncio.create_task(until_disconnect(http.receive))
    watcher.add_done_callback(gone)
    parts, logprobs, reasoning, calls = [], [], [], []
    try:
        while True:
            ev = await events.get()
            if ev is _DISCONNECTED:
                raise api.ApiError(499, "the client disconnected", code="client_closed")
            parts.append(ev.text)
            reasoning.append(ev.reasoning)
            calls.extend(ev.tool_calls)
            if ev.logprob is not None:
                logprobs.append(ev.logprob)
            if ev.error is not None:
                raise _event_error(state, ev, rid)
            if ev.final:
                state.metrics.observe(ev.timing)
                return _Reply("".join(parts), logprobs, ev, "".join(reasoning), calls)
    finally:
        watcher.cancel()
        req.cancel()  # no-op once finished


class _EventStream(StreamingResponse):
    """An SSE response that cancels its generation request however the response ends (Starlette
    stops it when the client disconnects)."""

    def __init__(self, content: AsyncIterator[str], request: Request) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = request

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


class _Writer(Protocol):
    """What writes a stream's SSE text: openai_api.ChunkStream, anthropic_api.MessageStream."""

    def start(self) -> str: ...
    def take(self, ev: Event) -> str: ...
    def error(self, err: api.ApiError) -> str: ...
    def end(self) -> str: ...


async def _stream(state: ServeState, events: asyncio.Queue, rid: str, writer: _Writer) -> AsyncIterator[str]:
    """SSE text of response `rid` as `writer` writes it: its start, each Event of the request up to the
    final one, an error event when the request fails (or this stream does: a bug), its end."""
    try:
        if text := writer.start():
            yield text
        while True:
            ev: Event = await events.get()
            if ev.error is not None:
                yield writer.error(_event_error(state, ev, rid))
                break
            if ev.final:
                state.metrics.observe(ev.timing)
            if text := writer.take(ev):
                yield text
            if ev.final:
                break
    except Exception as e:  # a bug: the stream has begun, so end it with an error event
        logger.exception("request %s: the stream failed", rid)
        yield writer.error(api.ApiError(500, f"the stream failed (request {rid}): {e!r}", type="server_error",
                                        code="internal_error"))
    if text := writer.end():
        yield text


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI app of `state`; its lifespan starts the scheduler and, on exit, closes the state."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.add_middleware(Guard, options=state.options.guard, is_draining=lambda: state.draining,
                       count=lambda endpoint, status: state.metrics.requests.labels(endpoint, status).inc())

    @app.exception_handler(api.ApiError)
    async def api_error(request: HttpRequest, e: api.ApiError):
        return _json_error(e, request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException):
        return _json_error(api.ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                        code="not_found" if e.status_code == 404 else None), request)

    _add_routes(app, state)
    _add_anthropic_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServeState) -> None:
    opts, tok = state.options, state.tokenizer
    vocab = state.scheduler.engine.spec.vocab_size

    async def generate(http: HttpRequest, prepare: Callable, chunk: Callable, first: dict | None, obj: str,
                       body: Callable, logprobs: Callable):
        rid = api.new_id("cmpl" if obj == "text_completion" else "chatcmpl")
        http.state.request_id = rid  # the id the Guard logs should the route raise
        prep: api.Prepared = await asyncio.to_thread(prepare, await http.body())
        req, events = _submit(state, prep)
        if prep.stream:
            writer = api.ChunkStream(rid, opts.served_name, chunk, first, obj, prep.include_usage, logprobs)
            return _EventStream(_stream(state, events, rid, writer), req)
        reply = await _collect(state, req, events, http, rid)
        extra = {"reasoning": reply.reasoning} if prep.channels else {}
        if reply.tool_calls:
            extra["tool_calls"] = reply.tool_calls
        ev = reply.last
        return body(rid, opts.served_name, reply.text, ev.finish_reason,
                    api.usage(ev.prompt_tokens, ev.completion_tokens, ev.timing), logprobs(reply.logprobs), **extra)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        prepare = partial(api.prepare_completion, tokenizer=tok, vocab_size=vocab, served=opts.served_name,
                          max_seq_len=opts.max_seq_len)
        return await generate(http, prepare, api.completion_chunk, None, "text_completion", api.completion_body,
                              partial(api.completion_logprobs, tok))

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        prepare = partial(api.prepare_chat, tokenizer=tok, served=opts.served_name, max_seq_len=opts.max_seq_len)
        return await generate(http, prepare, api.chat_chunk, {"role": "assistant", "content": ""},
                              "chat.completion.chunk", api.chat_body, partial(api.chat_logprobs, tok))

    def model_object(anthropic: bool) -> dict:
        if anthropic:  # Anthropic's model object: its clients send anthropic-version
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started))
            return {"type": "model", "id": opts.served_name, "display_name": opts.served_name, "created_at": created}
        return {"id": opts.served_name, "object": "model", "created": state.started, "owned_by": "expertcache",
                "max_model_len": opts.max_seq_len}

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        if VERSION_HEADER in http.headers:
            name = opts.served_name
            return {"data": [model_object(True)], "has_more": False, "first_id": name, "last_id": name}
        return {"object": "list", "data": [model_object(False)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: HttpRequest):
        if model_id != opts.served_name:
            raise api.ApiError(404, f"model {model_id!r} does not exist: this server serves {opts.served_name!r}",
                               param="model", code="model_not_found")
        return model_object(VERSION_HEADER in http.headers)

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


def _add_anthropic_routes(app: FastAPI, state: ServeState) -> None:
    """/v1/messages and /v1/messages/count_tokens (moe.serve.anthropic_api), on the same scheduler."""
    opts, tok = state.options, state.tokenizer

    @app.post("/v1/messages")
    async def messages(http: HttpRequest):
        rid = http.state.request_id = anthropic_api.new_id()
        msg: anthropic_api.MessagesRequest = await asyncio.to_thread(
            anthropic_api.prepare_messages, await http.body(), tok, served=opts.served_name,
            max_seq_len=opts.max_seq_len)
        req, events = _submit(state, msg.prep)
        if msg.prep.stream:
            writer = anthropic_api.MessageStream(rid, opts.served_name, msg)
            return _EventStream(_stream(state, events, rid, writer), req)
        reply = await _collect(state, req, events, http, rid)
        return anthropic_api.message_body(rid, opts.served_name, msg, reply.text, reply.reasoning, reply.tool_calls,
                                          reply.last)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(http: HttpRequest):
        count = await asyncio.to_thread(anthropic_api.count_tokens, await http.body(), tok, served=opts.served_name)
        return {"input_tokens": count}


class Server(uvicorn.Server):
    """uvicorn's server that drains the scheduler before uvicorn closes the connections: open requests
    run up to --shutdown-timeout, then end with a 503 shutting_down error that reaches their clients."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    @contextmanager
    def capture_signals(self):
        """uvicorn's signal capture, without re-raising the signal after the graceful shutdown (which
        would end the process by SIGTERM, or with a KeyboardInterrupt traceback on Ctrl-C): a served
        process that shut down cleanly exits 0."""
        with super().capture_signals():
            yield
            getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        await asyncio.to_thread(self.state.drain, self.state.options.shutdown_timeout)
        await super().shutdown(sockets)


def make_server(state: ServeState, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Server:
    """A uvicorn Server of create_app(state); run() blocks until SIGINT / SIGTERM (or should_exit)."""
    o = state.options
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            http=timed_protocol(o.read_timeout), timeout_keep_alive=o.keep_alive_timeout,
                            timeout_graceful_shutdown=FINAL_WRITE_S)
    return Server(config, state)
