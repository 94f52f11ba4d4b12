"""Helpers of the serving tests: a scheduler hold, polling (the tiny checkpoint: moe.testing.tiny_checkpoint).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


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
