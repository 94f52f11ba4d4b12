"""`expertcache serve --device cpu` run as a user runs it, once per served family.

    tiny checkpoint of each family (tiny_family) ─the console script `expertcache serve --device cpu`
        in a child process whose environment is this one's without TRITON_INTERPRET (the test suite
        sets it; a user's shell does not), the families in turn with --moe-miss-service copy, hybrid, auto
        ─► /health ─► a completion and a chat request over a socket ─► SIGTERM
        ─► exit status 0, no traceback or error in the output

Nothing of the CPU path may launch a Triton kernel: without a GPU driver or Triton's interpreter a
launch fails, so each family's prefill and decode steps here show that none does. The servers of the
collected families start together (their imports and loading overlap) and each test checks its own.

Tool calls: a qwen3_moe checkpoint whose weights make greedy decoding continue a fixed chain of words
(ending in a call of get_weather and <|im_end|>) from wherever the prompt ends in it, served the same way:
tool_choice "auto" (the chain from the generation prompt), "required" and a named function (the chain
from the forced opening), "none", streamed and not; and through Anthropic's /v1/messages with a prefix
cache: the call as a tool_use block, the SSE events in Anthropic's order, count_tokens, a resent
request's restored prompt tokens as cache_read_input_tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe.testing.served import served_url
from moe.testing.tiny_checkpoint import FAMILY_CONFIGS, make_tiny_checkpoint

SCRIPT = Path(sys.executable).parent / "expertcache"
MAX_TOKENS = 3
START_S = 180.0  # to import torch and the HTTP stack and load the checkpoint, several servers at once on 2 cores


class Served:
    """`expertcache serve --port 0` of `model` in a child process without TRITON_INTERPRET; its output in
    `log`, its address (`url`) read from its 'serving' line once healthy."""

    def __init__(self, model: Path, log: Path, service: str = "copy", extra: tuple[str, ...] = (),
                 max_seq_len: int = 64) -> None:
        self.log, self.url = log, ""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = [str(SCRIPT), "serve", "--model", str(model), "--device", "cpu", "--moe-slots", "6",
                "--max-batch", "2", "--max-seq-len", str(max_seq_len), "--port", "0",
                "--served-model-name", "tiny", "--moe-miss-service", service, "--cpu-threads", "2", *extra]
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"expertcache serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            self.url = served_url(self.output()) or ""
            try:
                if self.url and httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"expertcache serve did not answer /health in {START_S} s:\n{self.output()[-3000:]}")

    def post(self, path: str, body: dict) -> dict:
        reply = httpx.post(self.url + path, json=body, timeout=60)
        assert reply.status_code == 200, f"{path}: {reply.status_code} {reply.text}\n{self.output()[-3000:]}"
        return reply.json()

    def terminate(self) -> int | None:
        """SIGTERM, then the exit status (None: still running after 30 s, then killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


@contextlib.contextmanager
def beside(model: Path, tmp_path: Path, extra: tuple[str, ...]):
    """Two servers of `model` (max_seq_len 256), one with `extra` flags and one without, healthy; each
    must exit 0 at the end."""
    servers = (Served(model, tmp_path / "with.log", extra=extra, max_seq_len=256),
               Served(model, tmp_path / "without.log", max_seq_len=256))
    try:
        for served in servers:
            served.wait_healthy()
        yield servers
    finally:
        for served in servers:
            assert served.terminate() == 0, served.output()[-3000:]


# the families in turn: every miss copied, split between the slots and the CPU kernels (docs/hybrid.md), or
# auto, which on the CPU backend (no link to balance) copies and says so
SERVICE = {family: ("copy", "hybrid", "auto")[i % 3] for i, family in enumerate(sorted(FAMILY_CONFIGS))}


@pytest.fixture(scope="module")
def fleet(request, tiny_family, tmp_path_factory):
    """family -> its Served, every collected family's server started at once (the checkpoints first)."""
    wanted = sorted({item.callspec.params["family"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")})
    models = {family: tiny_family(family) for family in wanted}
    logs = tmp_path_factory.mktemp("serve-logs")
    servers = {family: Served(model, logs / f"{family}.log", SERVICE[family]) for family, model in models.items()}
    yield servers
    for served in servers.values():
        served.terminate()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_serve_on_the_cpu_without_triton(family, fleet):
    """A completion and a chat reply of MAX_TOKENS tokens each, then a clean exit on SIGTERM."""
    served = fleet[family]
    served.wait_healthy()
    out = served.post("/v1/completions", {"model": "tiny", "prompt": "w10 w20 w30", "max_tokens": MAX_TOKENS,
                                          "temperature": 0})
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["choices"][0]["text"].strip()
    chat = served.post("/v1/chat/completions", {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "messages": [{"role": "user", "content": "w40 w41"}]})
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == MAX_TOKENS
    status = served.terminate()
    log = served.output()
    assert status == 0, f"exit status {status}:\n{log[-3000:]}"
    assert "Finished server process" in log and "Traceback" not in log and "ERROR" not in log, log[-3000:]
    if SERVICE[family] == "auto":
        assert "--moe-miss-service auto: copy" in log, log[-3000:]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_resent_conversation_is_served_from_kept_prefixes(tiny_family, tmp_path, family):
    """`--kv-cache-gb`: a conversation whose every turn resends the last turn's prompt and answer, against
    the same server without it: the same greedy text every turn, cached_tokens 0 on the first turn and
    whole 64-token blocks of the resent part after it, the metrics counting them (Qwen3-Next: resumed at
    its linear-attention state's snapshots, the prompt's last block boundary and the answer's)."""
    with beside(tiny_family(family), tmp_path, ("--kv-cache-gb", "0.01")) as (kept, plain):
        prompt = " ".join(f"w{7 + (i * 13) % 100}" for i in range(70))
        cached, usage = [], []
        for turn in range(3):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            got, want = kept.post("/v1/completions", body), plain.post("/v1/completions", body)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
            usage.append(got["usage"])
            prompt = prompt + got["choices"][0]["text"] + " " + " ".join(f"w{20 + turn + i}" for i in range(12))
        # each turn restores the last one's prompt and fed answer tokens (all but the last) in whole blocks
        held = [u["prompt_tokens"] + u["completion_tokens"] - 1 for u in usage]
        want_cached = [0] + [min(h // 64, (u["prompt_tokens"] - 1) // 64) * 64 for h, u in zip(held, usage[1:])]
        assert cached == want_cached and cached[1] == 64, (cached, usage)
        metrics = httpx.get(kept.url + "/metrics", timeout=10).text
        assert f"expertcache_prefix_cached_tokens_total {float(sum(cached))}" in metrics
        assert "expertcache_prefix_blocks_max " in metrics, metrics
        assert "prefix cache" in kept.output(), kept.output()[-3000:]
        if family == "qwen3_next":
            assert "linear-attention state snapshots" in kept.output(), kept.output()[-3000:]
            assert "expertcache_prefix_states 1.0" in metrics, metrics  # the first prompt's, at 64, resumed since


def stream_beside(served: Served, prompt: str, tokens: int, long_prompt: str) -> tuple[str, str, int]:
    """Stream `tokens` greedy tokens of `prompt` and, once the stream has begun, complete `long_prompt` (6
    tokens) beside it: (the streamed text, the long prompt's text, its prompt tokens)."""
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", served.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # it streams
        got = served.post("/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 6,
                                              "temperature": 0})
        rest = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first, *rest]
                       if json.loads(line[6:])["choices"])
    return streamed, got["choices"][0]["text"], got["usage"]["prompt_tokens"]


def test_a_long_prompt_joins_in_chunks_beside_a_stream(tiny_family, tmp_path):
    """`--prefill-chunk 64`: a 200-token prompt joins in 4 chunks while another request streams; both
    texts are those of a server that prefills each prompt at once."""
    with beside(tiny_family("qwen3_moe"), tmp_path, ("--prefill-chunk", "64")) as (chunked, whole):
        long_prompt = " ".join(f"w{(i * 7) % 100}" for i in range(200))
        texts = {served is chunked: stream_beside(served, "w1 w2 w3", 24, long_prompt) for served in (chunked, whole)}
        assert texts[True] == texts[False] and texts[True][2] == 200, texts


def test_two_ranks_serve_what_one_serves(tiny_family, tmp_path):
    """`--tensor-parallel 2` (the routed experts over two processes, expert e on rank e % 2): a stream and a
    200-token prompt joining beside it in chunks give one rank's texts; /metrics answers (rank 0's cache);
    both processes end on SIGTERM and the routing trace is written."""
    trace = tmp_path / "routing.npz"
    with beside(tiny_family("qwen3_moe"), tmp_path, ("--tensor-parallel", "2", "--prefill-chunk", "64",
                                                     "--record-routing", str(trace))) as (ranked, one):
        long_prompt = " ".join(f"w{(i * 11) % 100}" for i in range(200))
        texts = {served is ranked: stream_beside(served, "w5 w6 w7", 16, long_prompt) for served in (ranked, one)}
        assert texts[True] == texts[False], texts
        assert "2 ranks" in ranked.output(), ranked.output()[-3000:]
        metrics = httpx.get(ranked.url + "/metrics", timeout=30)
        assert metrics.status_code == 200 and "expertcache_cache_misses_total" in metrics.text, metrics.text[-2000:]
    assert "ranks 1-1 stopped, exit codes [0]" in ranked.output(), ranked.output()[-3000:]
    assert trace.is_file(), ranked.output()[-3000:]


CALL_WORDS = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
CHAIN = ["assistant", "w50", *CALL_WORDS, "<|im_end|>"]  # "assistant" ends the generation prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def _calling_checkpoint(path: Path) -> Path:
    """The tiny qwen3_moe checkpoint (CALL_WORDS in its vocabulary) with every attention output and
    expert / MLP down projection zero, so the last hidden state is the current token's embedding; each
    CHAIN word's embedding is a one-hot column that lm_head maps to the next word (the final norm's
    scale 1): greedy decoding continues CHAIN from wherever the prompt ends in it."""
    make_tiny_checkpoint(path, "qwen3_moe", words=CALL_WORDS)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]})
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["model.norm.weight"].fill_(1.0)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # [V, H] each
    head.zero_()
    for k, (word, after) in enumerate(zip(CHAIN, CHAIN[1:])):
        embed[vocab[word]] = torch.nn.functional.one_hot(torch.tensor(k), embed.shape[1]).float()
        head[vocab[after], k] = 1.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_tool_calls_through_the_served_process(tmp_path):
    """The reply's call as message.tool_calls (finish_reason "tool_calls"), its text before the call as
    content; the forced openings make the model write the call from the prompt's end; "none" leaves it text."""
    served = Served(_calling_checkpoint(tmp_path / "calls"), tmp_path / "tools.log", max_seq_len=256)
    try:
        served.wait_healthy()
        base = {"model": "tiny", "messages": [{"role": "user", "content": "w40 w41"}], "tools": [WEATHER],
                "temperature": 0, "max_tokens": 16}
        for choice, content, tokens in (("auto", "w50 ", len(CHAIN) - 1), ("required", None, len(CALL_WORDS)),
                                        ({"type": "function", "function": {"name": "get_weather"}}, None, 4)):
            reply = served.post("/v1/chat/completions", {**base, "tool_choice": choice})
            message, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
            assert (message["content"], finish, reply["usage"]["completion_tokens"]) == (content, "tool_calls", tokens)
            assert [c["function"] for c in message["tool_calls"]] == [PARIS], choice
            assert message["tool_calls"][0]["id"].startswith("call_") and message["tool_calls"][0]["type"] == "function"
        text = served.post("/v1/chat/completions", {**base, "tool_choice": "none"})["choices"][0]
        assert text["message"]["content"] == "w50 " + " ".join(CALL_WORDS) and text["finish_reason"] == "stop"
        assert "tool_calls" not in text["message"]
        chunks = _sse(served.url, base)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == "w50 "
        calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"] == PARIS
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        status = served.terminate()
    assert status == 0 and "Traceback" not in served.output(), served.output()[-3000:]


def _anthropic_events(url: str, body: dict) -> list[tuple[str, dict]]:
    headers = {"anthropic-version": "2023-06-01"}
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = [e.split("\n") for e in r.read().decode().strip().split("\n\n")]
    assert all(name.startswith("event: ") and data.startswith("data: ") for name, data in events)
    return [(name[len("event: "):], json.loads(data[len("data: "):])) for name, data in events]


def test_anthropic_messages_through_the_served_process(tmp_path):
    """The calling checkpoint behind /v1/messages: text then a tool_use block (stop_reason "tool_use"), as one
    Message and as an SSE stream in Anthropic's order; count_tokens == input_tokens; the same request again
    restores whole 64-token blocks of its prompt from the prefix cache (cache_read_input_tokens)."""
    served = Served(_calling_checkpoint(tmp_path / "calls"), tmp_path / "anthropic.log", max_seq_len=256,
                    extra=("--kv-cache-gb", "0.01"))
    try:
        served.wait_healthy()
        fn = WEATHER["function"]
        tool = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "w40 w41"}], "tools": [tool]}
        body = {**ask, "max_tokens": 16, "temperature": 0}
        count = served.post("/v1/messages/count_tokens", ask)["input_tokens"]
        replies = [served.post("/v1/messages", body) for _ in range(2)]
        for reply in replies:
            text, use = reply["content"]
            assert text == {"type": "text", "text": "w50 "} and use["id"].startswith("toolu_")
            assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
            assert (reply["stop_reason"], reply["stop_sequence"]) == ("tool_use", None)
        cached = [r["usage"]["cache_read_input_tokens"] for r in replies]
        assert cached == [0, (count - 1) // 64 * 64] and cached[1] >= 64
        assert [r["usage"]["input_tokens"] + c for r, c in zip(replies, cached)] == [count, count]
        events = _anthropic_events(served.url, body)
        kinds = [k for i, (k, _) in enumerate(events) if i == 0 or k != events[i - 1][0] or k != "content_block_delta"]
        assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                         "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"], kinds
        assert events[0][1]["message"]["usage"]["input_tokens"] == count
        assert "".join(d["delta"].get("text", "") for k, d in events if k == "content_block_delta") == "w50 "
        starts = [d["content_block"] for k, d in events if k == "content_block_start"]
        assert starts[1]["type"] == "tool_use" and starts[1]["input"] == {} and starts[1]["name"] == "get_weather"
        assert json.loads(events[-4][1]["delta"]["partial_json"]) == {"city": "Paris"}
        assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    finally:
        status = served.terminate()
    assert status == 0 and "Traceback" not in served.output(), served.output()[-3000:]
