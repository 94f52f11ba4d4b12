"""Serving a tiny checkpoint over real HTTP on loopback, for the server tests and the fault battery.

    serve(tiny_dir, flags...) ─moe.cli parser → serve_cli.build_state─► ServeState
        ─uvicorn in a thread on a pre-bound 127.0.0.1 socket─► Running (url, openai client, scheduler)
    slow_decode(running, s): every decode step takes at least s seconds and no token ends a request
        early, so that a test can act while a request is still generating.
"""

from __future__ import annotations

import socket
import threading
import time

import openai

from moe.cli import build_parser
from moe.serve.cli import build_state
from moe.serve.server import make_server
from tests.moe.serve.serving_util import wait_until

KEY = "sk-test-key"
NAME = "tiny-moe"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Running:
    """A served ServeState: uvicorn in a thread on a pre-bound loopback socket."""

    def __init__(self, state) -> None:
        self.state, self.sock = state, socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(state, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, what="uvicorn to start")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    @property
    def scheduler(self):
        return self.state.scheduler

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def serve(tiny_dir, *extra: str, key: str | None = KEY, max_seq_len: int = 64) -> Running:
    """Serve the tiny checkpoint on the CPU with 6 slots, 3 rows, `max_seq_len` and the API key."""
    argv = ["serve", "--model", str(tiny_dir), "--moe-slots", "6", "--max-batch", "3",
            "--max-seq-len", str(max_seq_len), "--device", "cpu", "--served-model-name", NAME, *extra]
    if key is not None:
        argv += ["--api-key", key]
    return Running(build_state(build_parser().parse_args(argv)))


def slow_decode(running: Running, seconds: float) -> None:
    """Make every decode step of `running`'s engine take at least `seconds`, and empty its scheduler's
    eos ids: a sampled eos would otherwise end a request before the test acts on it."""
    running.scheduler.eos_ids = frozenset()
    engine = running.scheduler.engine
    step = engine.decode_step

    def slow(tokens):
        start = time.monotonic()
        out = step(tokens)
        time.sleep(max(0.0, seconds - (time.monotonic() - start)))
        return out

    engine.decode_step = slow
