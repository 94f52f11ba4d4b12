"""The followers of expert parallelism (moe.engine.ranked) on the CPU, in a process of their own each: they
ignore the terminal's signals (rank 0 decides), end when a call fails on them with anything but a refusal
(so the leader's next call fails instead of waiting), and end when the process that started them is gone.

    python -c DRIVER  (rank 0: load_ranked over a tiny checkpoint, 2 ranks) ──spawn──► rank 1 (_follower)
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe.testing.tiny_checkpoint import make_tiny_checkpoint

DRIVER = r"""
import json, os, signal, sys, threading, time
from moe.engine.ranked import free_init_method, load_ranked, stop_ranked

def say(**kw):
    print(json.dumps(kw), flush=True)

leader, procs = load_ranked(sys.argv[1], 2, free_init_method(),
                            {"device": "cpu", "num_slots": 8, "max_batch": 2, "max_seq_len": 48, "progress": False})
follower = procs[0]
say(follower=follower.pid)
if sys.argv[2] == "orphan":
    time.sleep(600)  # the test kills this process
os.kill(follower.pid, signal.SIGINT)
os.kill(follower.pid, signal.SIGTERM)
time.sleep(1.0)
tokens = leader.generate([[1, 2, 3]], max_new_tokens=3)
say(alive_after_signals=follower.is_alive(), tokens=tokens)
if sys.argv[2] == "fail":
    try:
        leader.decode_step(None)  # fails on both ranks, and not as a refusal
    except Exception as e:
        say(leader_raised=type(e).__name__)
    follower.join(timeout=60)
    say(follower_exit=follower.exitcode)
    box = {}
    def call():
        try:
            leader.generate([[4, 5]], max_new_tokens=2)
            box["next"] = "answered"
        except Exception as e:
            box["next"] = type(e).__name__
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=60)
    say(next_call=box.get("next", "still waiting"))
    os._exit(0)
say(codes=stop_ranked(leader, procs))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ranked"), "qwen3_moe")


def _driver(tiny: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(tiny), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3],
                            start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    """Kill the driver's whole session (its follower too), whatever state the test left it in."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _said(proc: subprocess.Popen, timeout: float = 300) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _end(proc)
    said = {}
    for line in out.splitlines():
        if line.startswith("{"):
            said.update(json.loads(line))
    return said | {"stderr": err[-2000:]}


def test_followers_ignore_the_terminals_signals_and_stop_when_told(tiny):
    said = _said(_driver(tiny, "stop"))
    assert said.get("alive_after_signals") is True and len(said["tokens"][0]) == 3, said
    assert said.get("codes") == [0], said


def test_a_follower_that_fails_ends_and_the_leaders_next_call_fails(tiny):
    said = _said(_driver(tiny, "fail"))
    assert said.get("leader_raised") and said.get("follower_exit") == 1, said
    assert said.get("next_call") not in (None, "answered", "still waiting"), said


def test_a_follower_ends_when_its_leader_is_gone(tiny):
    proc = _driver(tiny, "orphan")
    pid = None
    try:
        deadline = time.monotonic() + 300
        while pid is None and time.monotonic() < deadline:  # rank 0 says its follower's pid once both loaded
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                assert line, "the driver ended before its follower loaded"
                if line.startswith("{"):
                    pid = json.loads(line)["follower"]
        assert pid is not None, "the ranks did not load in 300 s"
        os.kill(proc.pid, signal.SIGKILL)  # rank 0 alone: the follower is left to notice
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.2)
        assert not _running(pid), "the follower outlived its leader"
    finally:
        _end(proc)
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by its new parent) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
