"""Helpers of the serving tests: a scheduler hold, polling, an engine that replies with a script (the tiny
checkpoint: moe.testing.tiny_checkpoint).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` every 5 ms; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@contextmanager
def held(scheduler):
    """Block `scheduler`'s thread between two steps (through Scheduler.call) for the with-block, so
    that requests submitted inside it are all waiting when it resumes and join the same steps."""
    entered, release = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        release.wait(30)

    scheduler.call(block)
    assert entered.wait(10), "the scheduler thread did not reach the hold"
    try:
        yield
    finally:
        release.set()


def words(*ids: int) -> str:
    """The text of word ids (7..127), as the tiny tokenizer decodes them."""
    return " ".join(f"w{i}" for i in ids)


class Scripted:
    """An engine with its logits replaced by a one-hot of the script's next token (one row): every
    request's reply is the script (from its start at each join), whatever the prompt."""

    def __init__(self, engine, script: list[int]) -> None:
        self._engine, self.script, self.at = engine, script, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _next(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(like, -1e4)
        out[..., self.script[min(self.at, len(self.script) - 1)]] = 0.0
        self.at += 1
        return out

    def join(self, prompt):
        self.at = 0
        row, logits = self._engine.join(prompt)
        return row, self._next(logits)

    def decode_step(self, tokens):
        return self._next(self._engine.decode_step(tokens))
