"""Continuous batching: one thread owns the Engine and steps every active sequence together.

    any thread (the HTTP server)           the scheduler thread (the only one touching the Engine)
    submit(Request) ─┐                      loop:
    call(fn) ────────┴─► inbox ──────────►   run queued calls (metrics snapshot, trace write)
                        (queue.Queue)        drop cancelled sequences: engine.leave(row)
                                             admit waiting requests while a row is free:
                                                 engine.join_many(short prompts, a chunk of tokens
                                                 in all) → logits [V] each → first tokens
                                                 (more to compute than a prefill chunk: start_join,
                                                 then one chunk a loop turn, advance(), in the spare row)
                                             decode_step(every row's last token) → logits [B, V]
                                                 → choose (greedy / seeded top-p) → B tokens
                                                 → logprobs of the rows that asked for them
                                                 → per row: eos? TextStream (stop strings)? length?
                                                   (a chat request with tools: ToolStream / HarmonyStream
                                                   also read its tool calls out of the text)
                                             finished rows: engine.leave(row) (descending rows)
    Request.emit(Event) ◄── one Event per token (text delta), the last one with finish_reason

A request joins between decode steps and runs in the same steps as every other active sequence
(rows 0..B-1 of the engine, B <= max_batch); requests beyond max_batch wait in FIFO order. The short
requests waiting at a loop turn join in one prefill pass (each layer's experts fetched once for them),
as many as fit the free rows and a prefill chunk of tokens. A prompt
with more tokens to compute than the engine's prefill chunk (its length, less the prefix the prefix
cache restores) joins chunk by chunk instead (one such prompt at a time, in the
engine's spare row): one chunk per loop turn, with a decode step of the active rows after it, so the
sequences already streaming keep streaming and shorter requests keep joining (they pass a long
prompt waiting for the spare row; long ones keep their order among themselves). While rows stream,
loop turns after a chunk run decode steps only until their time reaches decode_share / (1 -
decode_share) of the chunk's and of the short prompts' joins before it (both stall the streaming rows).
Short requests join in those turns as usual until their joins since the chunk took as long as the
chunk did (the pass that passes that time completes); later ones wait for the next chunk. Before a long
prompt's first chunk the last long prompt's chunk time caps them the same way, and the first long
prompt's first chunk waits for one pass at most. So under any stream or burst of short requests the
streaming rows keep about decode_share of the scheduler's time and the long prompt about half the rest
or more, and a short request that joins during a long prefill finishes within a chunk or two instead
of one token a chunk. The schedule depends on time; the tokens do not (a row's
tokens are the same whatever shares its steps). A request
whose consumer went away (`cancel()`, or an `emit` that raises) leaves at the next loop turn and
frees its row. `emit` runs on the scheduler thread: it must be quick and thread-safe (the server's
puts onto an asyncio queue with loop.call_soon_threadsafe). Token accounting: completion_tokens counts
every sampled token, an eos included; the eos itself adds no text. Timing: the final Event of a request
that finished carries its RequestTiming (time in the queue, prefill, time to first token, decode), on
the scheduler thread's monotonic clock.
Legend: B = active sequences, V = vocab.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from moe.engine.engine import Engine, Joining
from moe.serve.harmony import HarmonyStream, harmony_ids
from moe.serve.sampling import Sampler, SamplingParams, TokenLogprob, choose, logprobs_of
from moe.serve.tokenizer import TextStream, TextTokenizer
from moe.serve.tools import ToolCall, ToolParsing, ToolStream

logger = logging.getLogger(__name__)


DECODE_SHARE = 0.2  # the streaming rows' least share of the time while a long prompt joins (--decode-share)


class SchedulerClosed(RuntimeError):
    """submit() after stop(): the server is shutting down."""


@dataclass(frozen=True)
class RequestTiming:
    """How one finished request's time went, in seconds: queue_s from submit to its prefill's start,
    prefill_s the prefill and its first token's choice, time_to_first_token_s = queue_s + prefill_s,
    decode_s from the first token to the last. prompt_tokens of the prompt, decode_tokens produced by
    decode steps (every token after the first), cached_prompt_tokens of the prompt restored from the
    engine's prefix cache instead of computed (--kv-cache-gb; OpenAI's cached_tokens)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    decode_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def time_to_first_token_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (those not restored from the prefix cache) per second of prefill."""
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens per second of this request (0 when it ended at its first token)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else 0.0


@dataclass(frozen=True)
class Event:
    """What a request's consumer receives: a text delta, and on the last event the finish_reason
    ("stop": eos, a stop string (then stop_sequence holds it) or, without parallel_tool_calls, a first
    call; "length": max_tokens or max_seq_len) or an error message. logprob: the sampled token's
    TokenLogprob when the request asked for logprobs (an event per token). tool_calls: the calls of a
    request with tools (Request.tools) that closed with this token."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprob: TokenLogprob | None = None
    timing: RequestTiming | None = None  # on the final event of a request that finished
    reasoning: str = ""  # a harmony reply's analysis text decoded with this token (Request.channels)
    tool_calls: tuple[ToolCall, ...] = ()
    cause: BaseException | None = None  # the exception behind `error`, for the server's log (with its traceback)
    stop_sequence: str | None = None  # on the final event: the stop string that ended the text

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Request:
    """One generation request: prompt token ids, sampling params, and `emit` for its Events (with
    `channels`, a harmony model's reply comes as Event.reasoning and Event.text apart; with `tools`,
    its tool calls as Event.tool_calls). `number` (set by submit) is its index in submission order, the
    trace's req_index."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, emit: Callable[[Event], Any], *,
                 channels: bool = False, tools: ToolParsing | None = None) -> None:
        self.prompt, self.params, self.emit = list(prompt), params, emit
        self.channels = channels  # split a harmony reply into reasoning and content (moe.serve.harmony)
        self.tools = tools  # read tool calls out of the reply (moe.serve.tools)
        self.number = -1
        self.submitted = time.monotonic()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the scheduler to drop this request (thread-safe, idempotent; no-op once finished)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class SchedulerStats:
    """Counters of the scheduler thread. batch_steps: decode steps by batch size; finished:
    requests by outcome ("stop", "length", "cancelled", "error"). Decode time is the wall time of
    decode_step plus sampling and detokenization; prefill is not in it. prefill_tokens: prompt tokens
    computed; cached_tokens: prompt tokens restored from the prefix cache instead."""

    steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    batch_steps: Counter = field(default_factory=Counter)
    finished: Counter = field(default_factory=Counter)
    window: deque = field(default_factory=lambda: deque(maxlen=64))  # (tokens, seconds) per step

    def tokens_per_second(self) -> float:
        """Decode tokens per second over the last 64 decode steps (0 before any)."""
        seconds = sum(s for _, s in self.window)
        return sum(t for t, _ in self.window) / seconds if seconds > 0 else 0.0


@dataclass(eq=False)
class _Seq:
    request: Request
    sampler: Sampler
    stream: TextStream | HarmonyStream | ToolStream
    generated: int = 0
    last: int = -1
    admitted: float = 0.0  # monotonic time its prefill started
    first_token: float = 0.0  # monotonic time its first token was chosen
    cached: int = 0  # prompt tokens restored from the prefix cache
    called: bool = False  # a tool call came in its reply (it ends with finish_reason "tool_calls")


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.future = fn, Future()

    def run(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn())
            except BaseException as e:  # handed to the caller through the future
                self.future.set_exception(e)


class Scheduler:
    """Owns `engine` (max_batch rows) and generates for submitted Requests in one background thread.

    eos_ids: token ids that end a sequence (default: the tokenizer's). decode_share (0 <= x < 1): the
    least share of the scheduler's time the streaming rows get while a long prompt joins chunk by
    chunk (0: one decode step a chunk). `rows` mirrors the engine's
    rows: rows[b] is the sequence in row b. With engine.record_routing, `req_rows` keeps the request
    number of every row of every decode step (the trace's req_index). Counters are in `stats`.
    """

    def __init__(self, engine: Engine, tokenizer: TextTokenizer, *, eos_ids: Sequence[int] | None = None,
                 poll_s: float = 0.1, decode_share: float = DECODE_SHARE) -> None:
        if not 0.0 <= decode_share < 1.0:  # also refuses NaN
            raise ValueError(f"decode_share must be in [0, 1), not {decode_share} (--decode-share)")
        self.engine, self.tokenizer = engine, tokenizer
        self.decode_share = decode_share
        self._decode_owed = 0.0  # seconds of decode steps still owed before the next chunk
        self._stalled = 0.0  # seconds of short prompts' joins since the last chunk, while a prompt joins
        # seconds the last long prompt's chunk took; none yet: 0, so before the first chunk ever only the
        # pass under way joins (that chunk runs the same turn, nothing being owed)
        self._last_chunk = 0.0
        self.eos_ids = frozenset(tokenizer.eos_ids if eos_ids is None else eos_ids)
        self.harmony = harmony_ids(tokenizer)  # a harmony model's specials (gpt-oss), or None
        self.poll_s = poll_s
        self.stats = SchedulerStats()
        self.rows: list[_Seq] = []
        self.req_rows: list[list[int]] = []
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[Request] = deque()
        self._joining: tuple[Request, Joining, float] | None = None  # a long prompt joining chunk by chunk
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = self._stopped = False
        self._deadline = 0.0
        self._submitted = self._queued = 0  # requests numbered / in the inbox

    @property
    def active(self) -> int:
        """Sequences in the engine's rows now."""
        return len(self.rows)

    @property
    def waiting(self) -> int:
        """Requests submitted whose sequence is not in a row yet (queued, or joining chunk by chunk)."""
        return len(self._waiting) + self._queued + (self._joining is not None)

    @property
    def closing(self) -> bool:
        """True once stop() was called: submit() refuses new requests."""
        return self._closing

    def start(self) -> None:
        """Start the scheduler thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="expertcache-scheduler", daemon=True)
            self._thread.start()

    def submit(self, request: Request) -> int:
        """Queue `request`; returns its number. Thread-safe. Raises SchedulerClosed after stop()."""
        with self._lock:
            if self._closing:
                raise SchedulerClosed("the server is shutting down: retry on another replica")
            request.number = self._submitted
            self._submitted += 1
            self._queued += 1
            self._inbox.put(request)
        return request.number

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn() on the scheduler thread between two steps (inline when the thread is not running);
        its result or exception arrives in the returned Future. Thread-safe."""
        item = _Call(fn)
        with self._lock:
            inline = self._thread is None or self._stopped
            if not inline:
                self._inbox.put(item)
        if inline:
            item.run()
        return item.future

    def stop(self, timeout: float = 0.0) -> None:
        """Stop taking requests, let the active and waiting ones run for up to `timeout` seconds,
        end the rest with an error Event ("server shutting down"), and join the thread."""
        with self._lock:
            self._closing = True
            self._deadline = time.monotonic() + timeout
        self._inbox.put(None)  # wake an idle loop
        if self._thread is not None:
            self._thread.join()

    @property
    def running(self) -> bool:
        """True while the scheduler thread runs (False before start(), after stop() or a failure)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def _run(self) -> None:
        message, cause = "server shutting down", None
        try:
            self._loop()
        except Exception as e:  # a bug: end every request with it rather than leave them hanging
            logger.exception("the scheduler thread failed")
            message, cause = f"the scheduler failed: {e!r}", e
            with self._lock:
                self._closing = True
        finally:
            try:
                self._abort_all(message, cause=cause)
            finally:
                with self._lock:
                    self._stopped = True
                self._drain_inbox(block=False)

    def _loop(self) -> None:
        while True:
            self._drain_inbox(block=not self._busy)
            if self._closing and (time.monotonic() >= self._deadline or not self._busy):
                return
            self._drop_cancelled()
            if not self.rows:  # steps are owed to streaming rows only
                self._decode_owed = 0.0
            start = time.perf_counter()
            # while a prompt joins, short prompts join until their time since its last chunk reaches that
            # chunk's; later ones wait for the next chunk, so joins, chunks and steps each keep a share
            if not self._joins_spent(start):
                self._admit(start)
            if self._joining is not None:  # short prompts joining stall the streaming rows as a chunk does
                self._stalled += time.perf_counter() - start
            if self._joining is not None and (not self.rows or self._decode_owed <= 0.0):
                start = time.perf_counter()
                self._advance_joining()
                chunk = time.perf_counter() - start
                # owed for the chunk and the joins since the last one, these at most a chunk's worth: so
                # the long prompt still advances while short requests keep arriving
                self._decode_owed = (chunk + min(self._stalled, chunk)) * self.decode_share / (1.0 - self.decode_share)
                self._stalled, self._last_chunk = 0.0, chunk
            if self.rows:
                start = time.perf_counter()
                self._step()
                self._decode_owed -= time.perf_counter() - start

    @property
    def _busy(self) -> bool:
        return bool(self.rows or self._waiting) or self._joining is not None

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=self.poll_s) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Call):
                item.run()
            elif isinstance(item, Request):
                if self._stopped:
                    _emit(item, Event(error="server shutting down"))
                else:
                    self._waiting.append(item)
                with self._lock:
                    self._queued -= 1

    def _drop_cancelled(self) -> None:
        # each counted before its row or queue place goes, so whoever sees it gone sees it counted
        for row in reversed(range(len(self.rows))):
            if self.rows[row].request.cancelled:
                self.stats.finished["cancelled"] += 1
                self._leave(row)
        if self._joining is not None and self._joining[0].cancelled:
            self.stats.finished["cancelled"] += 1
            self.engine.abort_join(self._joining[1])
            self._joining = None
        kept = [r for r in self._waiting if not r.cancelled]
        if len(kept) < len(self._waiting):
            self.stats.finished["cancelled"] += len(self._waiting) - len(kept)
            self._waiting = deque(kept)

    def _joins_spent(self, start: float) -> bool:
        """Whether short prompts' joins since the joining prompt's last chunk (those of this turn counted from
        `start`) took as long as that chunk, while rows stream: the rest wait for the next chunk."""
        return (self._joining is not None and bool(self.rows)
                and self._stalled + (time.perf_counter() - start) >= self._last_chunk)

    def _admit(self, start: float) -> None:
        """Waiting requests into free rows, in order: a long prompt starts joining chunk by chunk (one at a
        time, in the spare row); the short ones join together, one prefill pass for as many as fit the
        free rows and one prefill chunk of tokens (so a burst of side calls fetches each layer's experts
        once, not once a request); `start`, the turn's start, from which a pass after the first counts
        against the joining prompt's share (`_joins_spent`): once spent, the rest wait in order. A failure
        other than a refusal puts every request not yet in a row back in the queue, in order, where the
        thread's end answers it."""
        engine = self.engine
        passed: deque[Request] = deque()  # long prompts left waiting for the spare row, in their order
        group: list[Request] = []  # short requests joining in one pass (each leaves it once in a row)
        current = None  # the request taken from the queue and not yet placed
        tokens = 0  # the tokens the group computes
        try:
            while self._waiting and engine.batch + len(group) < engine.max_batch:
                current = req = self._waiting.popleft()
                need = engine.tokens_to_compute(req.prompt)
                if need > engine.prefill_chunk:
                    if self._joining is None:
                        self._join_group(group)
                        tokens = 0
                        try:
                            self._joining = (req, engine.start_join(req.prompt), time.monotonic())
                            # what the last prompt's last chunk owes is still owed: its steps come first,
                            # joins beside them capped by that chunk's time (_last_chunk) as between chunks.
                            # Joins count from here, not from the turn's start (the loop adds the whole turn)
                            self._stalled = start - time.perf_counter()
                        except ValueError as e:
                            self._refuse(req, e)
                    else:
                        passed.append(req)
                    current = None
                    continue
                if engine.batch + len(group) >= engine.free_rows_limit:  # the rows left: the spare one, joining
                    passed.append(req)
                    current = None
                    break
                if tokens + need > engine.prefill_chunk:
                    self._join_group(group)
                    tokens = 0
                    if self._joins_spent(start):  # one pass more than the share: the rest wait
                        passed.append(req)
                        current = None
                        break
                group.append(req)
                current = None
                tokens += need
            self._join_group(group)
        except BaseException:
            self._waiting = deque([*passed, *group, *([current] if current is not None else []), *self._waiting])
            raise
        passed.extend(self._waiting)
        self._waiting = passed

    def _join_group(self, group: list[Request]) -> None:
        """Join `group`'s prompts in one prefill pass (each alone when that pass refuses, so a bad prompt
        is refused by itself) and choose each one's first token; `group` is emptied as they are placed.
        On a failure other than a refusal, the engine rows no sequence mirrors are released and `group`
        keeps the requests that have no row."""
        if not group:
            return
        admitted = time.monotonic()
        try:
            try:
                joined = self.engine.join_many([req.prompt for req in group]) if len(group) > 1 else None
            except ValueError:
                joined = None
            if joined is not None:  # every row seated before any leaves (a leave moves the last row)
                done = [row for req, (row, logits) in zip(list(group), joined)
                        if self._seat(req, row, logits, admitted)]
                group.clear()
                for row in reversed(done):
                    self._leave(row)
                return
            while group:
                req = group[0]
                try:
                    row, logits = self.engine.join(req.prompt)  # logits [V]
                except ValueError as e:
                    group.pop(0)
                    self._refuse(req, e)
                    continue
                self._first_token(req, row, logits, admitted)
                group.pop(0)
        except BaseException:
            seated = {id(seq.request) for seq in self.rows}
            group[:] = [req for req in group if id(req) not in seated]
            for row in reversed(range(len(self.rows), self.engine.batch)):
                _released(self.engine.leave, row)
            raise

    def _advance_joining(self) -> None:
        """One prefill chunk of the long prompt joining chunk by chunk; its first token after the last."""
        if self._joining is None:
            return
        req, joining, admitted = self._joining
        try:
            done = self.engine.advance(joining)
        except ValueError as e:
            self._joining = None
            self._refuse(req, e)
            return
        if done is not None:
            self._joining = None
            self._first_token(req, *done, admitted)

    def _refuse(self, req: Request, e: ValueError) -> None:
        self.stats.finished["error"] += 1
        _emit(req, Event(error=str(e), prompt_tokens=len(req.prompt), cause=e))

    def _first_token(self, req: Request, row: int, logits, admitted: float) -> None:
        """A request whose prompt is now in `row` (logits [V] after its last token): its sequence, its
        first token chosen and emitted; its row left when that token ends it."""
        if self._seat(req, row, logits, admitted):
            self._leave(row)

    def _seat(self, req: Request, row: int, logits, admitted: float) -> bool:
        """_first_token but for leaving: True when the first token ends the request (its row stays)."""
        engine = self.engine
        seq = _Seq(req, Sampler(req.params), self._stream(req), admitted=admitted, cached=engine.cached_tokens(row))
        self.rows.append(seq)
        self.stats.prefill_tokens += len(req.prompt) - seq.cached
        self.stats.cached_tokens += seq.cached
        token = choose([seq.sampler], logits[None])[0]
        seq.first_token = time.monotonic()
        logprob = logprobs_of([seq.sampler], logits[None], [token])[0]
        return self._advance(seq, token, engine.lengths()[row], logprob)

    def _stream(self, req: Request) -> TextStream | HarmonyStream | ToolStream:
        """The detokenizer of `req`'s reply: harmony channels, tool calls, or plain text."""
        stop = req.params.stop
        if req.channels and self.harmony:
            return HarmonyStream(self.tokenizer, self.harmony, stop, tools=req.tools)
        if req.tools is not None:
            return ToolStream(self.tokenizer, req.tools, stop)
        return TextStream(self.tokenizer, stop)

    def _step(self) -> None:
        start = time.perf_counter()
        seqs = list(self.rows)
        try:
            logits = self.engine.decode_step([s.last for s in seqs])  # [B, V]
        except Exception as e:  # an engine failure ends every active request with its message
            self._abort_all(f"decode step failed: {e}", reason="error", cause=e)
            return
        if self.engine.record_routing:
            self.req_rows.append([s.request.number for s in seqs])
        samplers = [s.sampler for s in seqs]
        tokens = choose(samplers, logits)
        logprobs = logprobs_of(samplers, logits, tokens)
        lengths = self.engine.lengths()
        done = [row for row, (s, t, lp) in enumerate(zip(seqs, tokens, logprobs))
                if self._advance(s, t, lengths[row], lp)]
        seconds = time.perf_counter() - start
        st = self.stats
        st.steps += 1
        st.decode_tokens += len(seqs)
        st.decode_seconds += seconds
        st.batch_steps[len(seqs)] += 1
        st.window.append((len(seqs), seconds))
        for row in reversed(done):
            self._leave(row)

    def _advance(self, seq: _Seq, token: int, length: int, logprob: TokenLogprob | None = None) -> bool:
        """Take one sampled token of `seq` (whose row caches `length` tokens); emit; True when done."""
        seq.generated += 1
        seq.last = token
        if token in self.eos_ids:
            reason, text = "stop", seq.stream.finish(eos=True)
        else:
            text, stopped = seq.stream.push(token)
            full = seq.generated >= seq.request.params.max_tokens or length >= self.engine.max_seq_len
            reason = "stop" if stopped else "length" if full else None
            if reason == "length":
                text += seq.stream.finish()
        timing = None
        if reason is not None:
            req = seq.request
            timing = RequestTiming(queue_s=seq.admitted - req.submitted, prefill_s=seq.first_token - seq.admitted,
                                   decode_s=time.monotonic() - seq.first_token, prompt_tokens=len(req.prompt),
                                   decode_tokens=seq.generated - 1, cached_prompt_tokens=seq.cached)
        reasoning = seq.stream.pop_reasoning() if isinstance(seq.stream, HarmonyStream) else ""
        calls = seq.stream.pop_calls() if isinstance(seq.stream, (HarmonyStream, ToolStream)) else ()
        matched = seq.stream.stop_sequence if reason == "stop" else None
        seq.called = seq.called or bool(calls)
        if reason is not None:  # counted as the API answers it ("tool_calls" once a call came), before the
            self.stats.finished["tool_calls" if seq.called else reason] += 1  # client can see the answer
        ok = _emit(seq.request, Event(text, reason, len(seq.request.prompt), seq.generated, logprob=logprob,
                                      timing=timing, reasoning=reasoning, tool_calls=calls, stop_sequence=matched))
        if reason is None and not ok:
            seq.request.cancel()
        return reason is not None

    def _leave(self, row: int) -> None:
        moved = self.engine.leave(row)
        last = self.rows.pop()
        if moved is not None:
            self.rows[row] = last

    def _abort_all(self, message: str, reason: str = "cancelled", cause: BaseException | None = None) -> None:
        """End every active and waiting request with an error Event carrying `message` (and `cause`), each
        answered before its row is released: an engine that fails to release (a rank gone under
        --tensor-parallel) leaves no request unanswered; its failure is logged."""
        for row in reversed(range(len(self.rows))):
            seq = self.rows[row]
            self.stats.finished[reason] += 1
            _emit(seq.request, Event(error=message, prompt_tokens=len(seq.request.prompt),
                                     completion_tokens=seq.generated, cause=cause))
            _released(self._leave, row)
        self.rows.clear()
        if self._joining is not None:
            req, joining, _ = self._joining
            self._joining = None
            self.stats.finished[reason] += 1
            _emit(req, Event(error=message, prompt_tokens=len(req.prompt), cause=cause))
            _released(self.engine.abort_join, joining)
        while self._waiting:
            req = self._waiting.popleft()
            self.stats.finished[reason] += 1
            _emit(req, Event(error=message, prompt_tokens=len(req.prompt), cause=cause))


def _released(release, *args) -> None:
    """Run an engine call that releases an aborted request's row, logging instead of raising."""
    try:
        release(*args)
    except Exception:
        logger.exception("releasing an aborted request's row failed")


def _emit(request: Request, event: Event) -> bool:
    """Deliver `event`; False when the consumer's sink raised (it went away)."""
    try:
        request.emit(event)
        return True
    except Exception:
        return False
