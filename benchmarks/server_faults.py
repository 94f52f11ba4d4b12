"""Fault battery of `expertcache serve`: the bad requests real clients send and 16 concurrent clients
that disconnect at random, against a real server process on loopback, for a bounded time.

    a tiny random Qwen2-MoE checkpoint (tests/moe/serve/serving_util.py; or --model DIR with its prompts)
    ─► `python -m moe.cli serve` subprocess on a free 127.0.0.1 port, API key from a file, misses served as
       --moe-miss-service says (hybrid: the CPU computes part of every step's misses while requests arrive)
    1. solo: the greedy text of every prompt, one request at a time (the reference)
    2. for --seconds: --clients threads, each looping over requests (streaming or not; a share of
       them disconnect mid-way: a stream closed after a few events, a plain request timed out), and
       one thread sending every bad case of CASES in turn, each checked (status, JSON error code)
    3. checks: /health ok with active == waiting == 0, every surviving client's text == its solo text,
       the server's RSS growth under --max-rss-growth-mb, no traceback in its log
    4. shutdown: SIGTERM with requests open: each gets its text or a 503 shutting_down error (JSON,
       or an SSE error event before [DONE]); the process exits 0
Prints the counts (cases tried, handled cleanly, disconnects survived) and the checks; --json PATH
writes them. Exit status 1 when a check fails.

    python benchmarks/server_faults.py --seconds 30 --json benchmarks/results/server-faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from moe.testing.served import served_url

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-fault-battery"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPTS = [f"w{10 + 7 * i} w{11 + 5 * i} w{12 + 3 * i}" for i in range(8)]
MAX_TOKENS = 24
READ_TIMEOUT = 1.0


class Served:
    """`expertcache serve` in a subprocess; its log in a file."""

    def __init__(self, model: Path, workdir: Path, miss_service: str = "copy") -> None:
        key_file = workdir / "key"
        key_file.write_text(KEY + "\n")
        self.log, self.url = workdir / "server.log", ""
        argv = [sys.executable, "-m", "moe.cli", "serve", "--model", str(model), "--served-model-name", NAME,
                "--moe-slots", "8", "--max-batch", "4", "--max-seq-len", "256", "--device", "cpu",
                "--port", "0", "--api-key-file", str(key_file), "--read-timeout", str(READ_TIMEOUT),
                "--shutdown-timeout", "1", "--log-level", "warning", "--moe-miss-service", miss_service]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _up(self) -> bool:
        self.url = served_url(self.log.read_text()) or ""
        if not self.url:
            return False
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def _complete(url: str, prompt: str, stream: bool, timeout: float = 60, events: int | None = None) -> str | None:
    """Greedy text of `prompt`; None when the client left on purpose (timed out, or closed the stream
    after `events` events)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    try:
        if not stream:
            r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=timeout)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]
        parts = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=timeout) as r:
            r.raise_for_status()
            for n, line in enumerate(r.iter_lines()):
                if events is not None and n >= events:
                    return None
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "error" in data:
                        raise RuntimeError(f"stream error: {data['error']}")
                    parts.append(data["choices"][0]["text"])
        return "".join(parts)
    except httpx.TimeoutException:
        if timeout < 5:
            return None
        raise


def _json_error(status: int, code: str | None = None) -> Callable[[httpx.Response], bool]:
    def check(r: httpx.Response) -> bool:
        if r.status_code != status or not r.headers.get("content-type", "").startswith("application/json"):
            return False
        err = r.json().get("error", {})
        return set(err) == {"message", "type", "param", "code"} and (code is None or err["code"] == code)
    return check


def _post(path: str, body, headers=None) -> Callable[[str], httpx.Response]:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return lambda url: httpx.post(url + path, content=content, headers={**AUTH, **(headers or {})}, timeout=120)


def _closed_by_server(sent: bytes) -> Callable[[str], bool]:
    """A raw connection that sends `sent` and stalls must be closed within the read timeout."""
    def run(url: str) -> bool:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(sent)
            sock.settimeout(READ_TIMEOUT + 5)
            try:
                while sock.recv(65536):
                    pass
            except TimeoutError:
                return False
        return True
    return run


def _json_400_over_raw(sent: bytes) -> Callable[[str], bool]:
    """Bytes that are not HTTP/1.1 must get a JSON 400 invalid_http and a closed connection."""
    def run(url: str) -> bool:
        host, port = url.removeprefix("http://").split(":")
        raw = b""
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(sent)
            sock.settimeout(READ_TIMEOUT + 5)
            try:
                while chunk := sock.recv(65536):
                    raw += chunk
            except TimeoutError:
                return False
        head, _, body = raw.partition(b"\r\n\r\n")
        try:
            return head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http"
        except (ValueError, KeyError, TypeError):
            return False
    return run


def _chunked(size: int):
    def gen():
        chunk = b"w" * 65536
        for _ in range(size // len(chunk)):
            yield chunk
    return lambda url: httpx.post(url + "/v1/completions", content=gen(), headers=AUTH, timeout=120)


def _cases() -> dict[str, tuple[Callable, Callable]]:
    """name -> (request(url) -> response | bool, check(response) -> bool)."""
    m, p = {"model": NAME}, {"model": NAME, "prompt": "w9"}
    def raw(s):
        return _post("/v1/completions", s.encode() if isinstance(s, str) else s)
    def chat(content):
        return {**m, "messages": [{"role": "user", "content": content}]}
    cases = {
        "body 30 MB": (
            _post("/v1/completions", {**m, "prompt": "w9 " * 10_000_000}),
            _json_error(413, "request_too_large"),
        ),
        "chunked body 9 MB": (_chunked(9 * 2**20), _json_error(413, "request_too_large")),
        "prompt 6 MB": (
            _post("/v1/completions", {**m, "prompt": "w9 " * 2_000_000}),
            _json_error(400, "context_length_exceeded"),
        ),
        "4000 stops of 1000 chars": (_post("/v1/completions", {**p, "stop": ["x" * 1000] * 4000}), _json_error(400)),
        "lone surrogate prompt": (raw('{"model": "tiny", "prompt": "a\\ud800b"}'), _json_error(400, "invalid_json")),
        "lone surrogate chat": (
            raw('{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
            _json_error(400, "invalid_json"),
        ),
        "invalid UTF-8": (raw(b'{"model": "tiny", "prompt": "\xff\xfe"}'), _json_error(400)),
        "truncated JSON": (raw('{"model": "tiny", "prompt": '), _json_error(400, "invalid_json")),
        "JSON array": (raw("[1, 2]"), _json_error(400)),
        "empty body": (raw(""), _json_error(400)),
        "text/plain": (_post("/v1/completions", p, {"Content-Type": "text/plain"}), _json_error(415)),
        "form": (
            _post("/v1/completions", "model=tiny&prompt=w9", {"Content-Type": "application/x-www-form-urlencoded"}),
            _json_error(415),
        ),
        "no API key": (lambda url: httpx.post(url + "/v1/completions", json=p), _json_error(401, "invalid_api_key")),
        "/metrics without key": (lambda url: httpx.get(url + "/metrics"), _json_error(401, "invalid_api_key")),
        "lowercase bearer": (
            _post("/v1/completions", {**p, "max_tokens": 1}, {"Authorization": f"bearer {KEY}"}),
            lambda r: r.status_code == 200,
        ),
        "unknown field": (_post("/v1/completions", {**p, "top_k": 5}), _json_error(400, "unknown_parameter")),
        "max_tokens '5'": (_post("/v1/completions", {**p, "max_tokens": "5"}), _json_error(400)),
        "stream 'yes'": (_post("/v1/completions", {**p, "stream": "yes"}), _json_error(400)),
        "n 2": (_post("/v1/completions", {**p, "n": 2}), _json_error(400)),
        "wrong model": (
            _post("/v1/completions", {"model": "gpt-4", "prompt": "w9"}),
            _json_error(404, "model_not_found"),
        ),
        "token id out of range": (_post("/v1/completions", {**m, "prompt": [5, 10_000]}), _json_error(400)),
        "max_tokens past the context": (
            _post("/v1/completions", {**p, "max_tokens": 1000}),
            _json_error(400, "context_length_exceeded"),
        ),
        "image content part": (
            _post("/v1/chat/completions", chat([{"type": "image_url", "image_url": {"url": "x"}}])),
            _json_error(400),
        ),
        "GET on a POST endpoint": (lambda url: httpx.get(url + "/v1/completions", headers=AUTH), _json_error(405)),
        "unknown path": (lambda url: httpx.get(url + "/v2/nothing", headers=AUTH), _json_error(404)),
        "stalled headers": (_closed_by_server(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"), bool),
        "half-open body": (
            _closed_by_server(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b'application/json\r\nContent-Length: 1000\r\n\r\n{"mod'
            ),
            bool,
        ),
        "silent connection": (_closed_by_server(b""), bool),
        "not HTTP": (_json_400_over_raw(b"GARBAGE\r\n\r\n"), bool),
        "TLS handshake on the plain port": (_json_400_over_raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"), bool),
    }
    for field, value in (
        ("logprobs", 9),
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("echo", True),
        ("best_of", 3),
        ("suffix", "w9"),
        ("presence_penalty", 1.0),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"9": 1}),
    ):
        cases[f"unsupported {field}"] = (_post("/v1/completions", {**p, field: value}), _json_error(400))
    return cases


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "survived": 0, "mismatches": 0, "disconnects": 0, "client_errors": 0,
                       "cases_tried": 0, "cases_clean": 0}
        self.failed_cases: dict[str, int] = {}
        self.slowest: dict[str, float] = {}  # case -> its longest answer time, s
        self.errors: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n


def _client(url: str, solo: dict[str, str], deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        prompt, stream, leave = rng.choice(PROMPTS), rng.random() < 0.5, rng.random() < 0.3
        try:
            text = _complete(url, prompt, stream, timeout=rng.uniform(0.02, 0.3) if leave and not stream else 60,
                             events=rng.randint(1, 6) if leave and stream else None)
        except Exception as e:  # an error a well-behaved client should never see
            tally.add("client_errors")
            with tally.lock:
                tally.errors.append(f"{type(e).__name__}: {e}"[:300])
            continue
        tally.add("requests")
        if text is None:
            tally.add("disconnects")
        elif text == solo[prompt]:
            tally.add("survived")
        else:
            tally.add("mismatches")


def _bad(url: str, deadline: float, tally: Tally) -> None:
    """Every case in turn, in whole rounds, until a round ends past the deadline."""
    cases = _cases()
    while True:
        for name, (request, check) in cases.items():
            start = time.monotonic()
            try:
                ok = bool(check(request(url)))
            except httpx.HTTPError as e:
                ok = False
                name = f"{name} ({type(e).__name__})"
            with tally.lock:
                tally.slowest[name] = max(tally.slowest.get(name, 0.0), round(time.monotonic() - start, 3))
            tally.add("cases_tried")
            tally.add("cases_clean", int(ok))
            if not ok:
                with tally.lock:
                    tally.failed_cases[name] = tally.failed_cases.get(name, 0) + 1
        if time.monotonic() >= deadline:
            return


def _wait_idle(srv: Served, timeout: float = 15) -> dict:
    deadline, h = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        h = srv.health()
        if h.get("active") == 0 and h.get("waiting") == 0:
            return h
        time.sleep(0.1)
    return h


def _shutdown(srv: Served) -> dict:
    """SIGTERM with 3 plain and 2 streaming requests open; what each got and how the process ended."""
    outcomes: list[str] = []
    body = {"model": NAME, "prompt": "w9", "max_tokens": 200, "temperature": 0}

    def plain() -> None:
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        ok = r.status_code == 200 or _json_error(503, "shutting_down")(r)
        outcomes.append("ok" if ok else f"plain {r.status_code} {r.text[:200]}")

    def streamed() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(data[-2]) if len(data) >= 2 else {}
        ended = data[-1:] == ["[DONE]"] and (last.get("error", {}).get("code") == "shutting_down"
                                             or last.get("choices", [{}])[0].get("finish_reason") is not None)
        outcomes.append("ok" if ended else f"stream {data[-2:]}")

    def guarded(f) -> None:  # a client's exception is an outcome, not a thread's silent death
        try:
            f()
        except Exception as e:
            outcomes.append(f"{f.__name__} raised {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=guarded, args=(f,)) for f in (plain, plain, plain, streamed, streamed)]
    for t in threads:
        t.start()
    deadline, open_ = time.monotonic() + 30, 0  # a loaded machine may take a while to admit all five
    while open_ < 5 and time.monotonic() < deadline:
        h = srv.health()
        open_ = h.get("active", 0) + h.get("waiting", 0)
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code = srv.proc.wait(30)
    return {
        "requests": len(threads),
        "answered_cleanly": outcomes.count("ok"),
        "bad": [o for o in outcomes if o != "ok"],
        "open_at_sigterm": open_,
        "exit_code": code,
    }


def run(seconds: float, clients: int, model: Path | None, max_rss_growth_mb: float, seed: int = 0,
        miss_service: str = "copy") -> dict:
    """The whole battery against a server of --moe-miss-service `miss_service`; returns its counts and checks
    (checks["passed"])."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if model is None:
            from moe.testing.tiny_checkpoint import make_tiny_checkpoint

            model = make_tiny_checkpoint(work / "tiny")
        srv = Served(model, work, miss_service)
        try:
            solo = {p: _complete(srv.url, p, stream=False) for p in PROMPTS}
            rss0, tally = srv.rss_mb(), Tally()
            deadline = time.monotonic() + seconds
            threads = [threading.Thread(target=_client, args=(srv.url, solo, deadline, seed + i, tally))
                       for i in range(clients)] + [threading.Thread(target=_bad, args=(srv.url, deadline, tally))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(seconds + 120)
            health, rss1 = _wait_idle(srv), srv.rss_mb()
            shutdown = _shutdown(srv)
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
        log = srv.log.read_text()
    c = tally.counts
    checks = {
        "healthy_and_idle": health.get("status") == "ok" and health.get("active") == 0 and health.get("waiting") == 0,
        "every_case_clean": c["cases_tried"] > 0 and c["cases_clean"] == c["cases_tried"],
        "survivors_match_solo": c["mismatches"] == 0 and c["client_errors"] == 0 and c["survived"] > 0,
        "disconnects_happened": c["disconnects"] > 0,
        "rss_growth_bounded": rss1 - rss0 < max_rss_growth_mb,
        "no_traceback_logged": "Traceback" not in log,
        "shutdown_clean": shutdown["answered_cleanly"] == shutdown["requests"] and shutdown["exit_code"] == 0,
    }
    checks["passed"] = all(checks.values())
    return {"seconds": seconds, "clients": clients, "miss_service": miss_service, "counts": c,
            "failed_cases": tally.failed_cases,
            "case_seconds": tally.slowest,
            "client_errors": tally.errors[:10], "health": health, "rss_mb": [round(rss0, 1), round(rss1, 1)],
            "shutdown": shutdown, "checks": checks, "log_tail": log[-3000:] if not checks["passed"] else ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of the concurrent phase (default 30)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--model", type=Path, help="a servable checkpoint of the tiny vocabulary (default: made here)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=256.0, help="RSS growth allowed (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe-miss-service", default="copy", help="the server's --moe-miss-service (default copy)")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1:
        ap.error("--seconds must be > 0 and --clients >= 1")
    result = run(args.seconds, args.clients, args.model, args.max_rss_growth_mb, args.seed, args.moe_miss_service)
    c = result["counts"]
    print(f"bad cases: {c['cases_tried']} tried, {c['cases_clean']} handled cleanly "
          f"({len(_cases())} kinds); failed: {result['failed_cases'] or 'none'}")
    print(f"clients: {c['requests']} requests by {args.clients} clients in {args.seconds:g} s: {c['survived']} "
          f"complete and identical to their solo text, {c['mismatches']} different, {c['disconnects']} "
          f"disconnects survived, {c['client_errors']} client errors")
    slow = sorted(result["case_seconds"].items(), key=lambda kv: -kv[1])[:3]
    print("slowest cases: " + ", ".join(f"{k} {v:.2f} s" for k, v in slow))
    print(f"server RSS {result['rss_mb'][0]} -> {result['rss_mb'][1]} MB; health {result['health']}")
    s = result["shutdown"]
    print(
        f"shutdown: {s['answered_cleanly']}/{s['requests']} open requests answered cleanly, exit code {s['exit_code']}"
    )
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items()))
    if result["log_tail"]:
        print(result["log_tail"], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({**result, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "commit": _commit()}, indent=1))
    return 0 if result["checks"]["passed"] else 1


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False)
    return out.stdout.strip() or os.environ.get("EXPERTCACHE_COMMIT", "unknown")


if __name__ == "__main__":
    sys.exit(main())
