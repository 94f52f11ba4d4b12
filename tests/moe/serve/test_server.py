"""`expertcache serve` end to end over real HTTP on loopback, on the CPU backend.

    tiny checkpoint ─expertcache serve flags (moe.cli parser → serve_cli.build_state)─► ServeState
        ─uvicorn in a thread on a pre-bound 127.0.0.1 socket─► the openai client / httpx
    checked: greedy text == Engine.generate's, streaming == non-streaming, concurrent requests share
    decode steps, OpenAI-style errors, /metrics == the cache's counters, a closed stream frees its row,
    graceful shutdown, and the --record-routing trace replayed by sim.replay with the server's policy
    and slots giving the server's miss counts exactly.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe.cli import build_parser
from moe.engine.cachestats import cache_stats
from moe.engine.loading import load_model
from moe.serve.cli import build_state
from moe.serve.metrics import snapshot
from sim.replay import replay
from sim.trace import load_trace
from tests.moe.serve.http_util import KEY, NAME, Running, serve
from tests.moe.serve.serving_util import held, wait_until


def _serve(tiny_dir, *extra: str) -> Running:
    return serve(tiny_dir, *extra)


@pytest.fixture(scope="module")
def srv(tiny_dir):
    running = _serve(tiny_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return load_model(tiny_dir, "cpu", num_slots=16, max_seq_len=64, progress=False)


def _greedy(srv, ref, prompt_ids: list[int], n: int) -> str:
    return srv.state.tokenizer.decode(ref.generate([prompt_ids], n)[0])


def _complete(srv, prompt, **kw):
    return srv.client.completions.create(model=NAME, prompt=prompt, temperature=0, **kw)


def test_completions_and_chat_equal_engine_generate(srv, ref):
    tok = srv.state.tokenizer
    out = _complete(srv, "w10 w20 w30", max_tokens=6)
    assert out.choices[0].text == _greedy(srv, ref, tok.encode("w10 w20 w30"), 6)
    assert out.choices[0].finish_reason == "length" and out.model == NAME
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 6, 9)
    assert _complete(srv, [11, 22], max_tokens=4).choices[0].text == _greedy(srv, ref, [11, 22], 4)
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w40 w41"}]
    chat = srv.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == _greedy(srv, ref, tok.encode_chat(messages), 5)
    assert chat.usage.prompt_tokens == len(tok.encode_chat(messages)) and chat.usage.completion_tokens == 5


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss", "glm4_moe", "mixtral", "olmoe"])
def test_every_family_is_served_end_to_end(family, tiny_family):
    """The other families behind the same server (the fixtures' is qwen2_moe): completions and chat,
    streamed and not, through the openai client, each the engine's own greedy text."""
    path = tiny_family(family)
    running = _serve(path)
    try:
        assert running.state.scheduler.engine.spec.model_type == family
        ref = load_model(path, "cpu", num_slots=16, max_seq_len=64, progress=False)
        tok = running.state.tokenizer
        out = _complete(running, "w10 w20 w30", max_tokens=6)
        assert out.choices[0].text == _greedy(running, ref, tok.encode("w10 w20 w30"), 6)
        chunks = list(_complete(running, "w10 w20 w30", max_tokens=6, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
        messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w40 w41"}]
        chat = running.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=5)
        assert chat.choices[0].message.content == _greedy(running, ref, tok.encode_chat(messages), 5)
        stream = running.client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                        max_tokens=5, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    finally:
        running.stop()


def test_streaming_equals_non_streaming(srv):
    whole = _complete(srv, "w50 w51", max_tokens=7).choices[0].text
    chunks = list(_complete(srv, "w50 w51", max_tokens=7, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    messages = [{"role": "user", "content": "w60"}]
    chat = srv.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=6)
    stream = srv.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=6,
                                                stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_concurrent_requests_share_decode_steps(srv, ref):
    prompts = [f"w{70 + i} w{90 + i}" for i in range(4)]  # 4 requests, 3 rows: one waits for a row
    results = {}

    def call(i: int) -> None:
        results[i] = _complete(srv, prompts[i], max_tokens=5 + i).choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    with held(srv.scheduler):
        for t in threads:
            t.start()
        wait_until(lambda: srv.scheduler.waiting == 4, what="4 waiting requests")
    for t in threads:
        t.join(30)
    tok = srv.state.tokenizer
    assert results == {i: _greedy(srv, ref, tok.encode(p), 5 + i) for i, p in enumerate(prompts)}
    assert max(srv.scheduler.stats.batch_steps) == 3  # steps ran with every row in use


@pytest.mark.parametrize("path, body, key, status, param, code", [
    ("/v1/completions", {"model": NAME}, KEY, 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", {"model": NAME}, KEY, 400, "messages", "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "w9", "n": 2}, KEY, 400, "n", "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "w9", "temperature": 9}, KEY, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 500]}, KEY, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "w9"}, KEY, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": NAME, "prompt": "w9"}, "wrong", 401, None, "invalid_api_key"),
    ("/v1/completions", {"model": NAME, "prompt": "w9 " * 64}, KEY, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w9 " * 70}]}, KEY, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": "w9", "max_tokens": 64}, KEY, 400, "max_tokens",
     "context_length_exceeded"),
])
def test_bad_requests_get_openai_style_errors(srv, path, body, key, status, param, code):
    r = httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and (err["param"], err["code"]) == (param, code)
    assert param is None or param in err["message"]


def test_openai_client_raises_its_typed_errors(srv):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        srv.client.completions.create(model="other", prompt="w9")
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        srv.client.completions.create(model=NAME, prompt="w9", n=2)
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_health_and_metrics(srv):
    assert [m.id for m in srv.client.models.list().data] == [NAME]
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    _complete(srv, "w30 w31", max_tokens=6)
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    stats = srv.scheduler.call(lambda: cache_stats(srv.scheduler.engine.moe)).result()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    layers = range(len(stats.misses))
    assert samples[("expertcache_hit_rate", ())] == pytest.approx(stats.hit_rate)
    assert [samples[("expertcache_cache_misses_total", (("layer", str(i)),))] for i in layers] == list(stats.misses)
    assert [samples[("expertcache_misses_per_layer_per_token", (("layer", str(i)),))] for i in layers] == \
        pytest.approx(list(stats.misses / stats.calls))
    assert samples[("expertcache_bytes_copied_total", ())] == stats.total_misses * stats.bytes_per_expert > 0
    assert samples[("expertcache_slots_in_use", ())] == 6 == samples[("expertcache_slots", ())]
    assert samples[("expertcache_decode_tokens_per_second", ())] > 0
    assert samples[("expertcache_active_sequences", ())] == 0
    assert samples[("expertcache_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    streamed = samples[("expertcache_prefill_experts_total", (("source", "store"),))]
    from_slots = samples[("expertcache_prefill_experts_total", (("source", "slot"),))]
    assert (streamed, from_slots) == (stats.prefill_streamed, stats.prefill_from_slots) and streamed > 0


def test_closing_a_stream_cancels_it_and_frees_its_row(srv):
    before = dict(srv.scheduler.stats.finished)
    stream = _complete(srv, "w8 w9", max_tokens=60, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    wait_until(lambda: srv.scheduler.active == 0 and srv.scheduler.waiting == 0, what="the row to be freed")
    after = srv.scheduler.stats.finished
    assert after["cancelled"] == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)  # it did not run to its 60 tokens


def test_a_waiting_request_whose_client_leaves_is_dropped(srv):
    before = dict(srv.scheduler.stats.finished)
    gone = {"endpoint": "/v1/completions", "status": "499"}
    count = srv.state.metrics.registry.get_sample_value("expertcache_requests_total", gone) or 0
    with held(srv.scheduler):  # the request waits for the scheduler while its client times out
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "w9", "max_tokens": 60},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=0.2)
        wait_until(lambda: srv.state.metrics.registry.get_sample_value("expertcache_requests_total", gone)
                   == count + 1, what="the server to see the disconnect")
    wait_until(lambda: srv.scheduler.active == 0 and srv.scheduler.waiting == 0, what="the request to be dropped")
    after = srv.scheduler.stats.finished
    assert after["cancelled"] == before.get("cancelled", 0) + 1 and after.get("length") == before.get("length")


def test_record_simulate_loop_and_graceful_shutdown(tiny_dir, tmp_path):
    path = tmp_path / "routing.npz"
    run = _serve(tiny_dir, "--moe-cache-policy", "rule", "--record-routing", str(path))
    for i in range(2):  # sequential
        _complete(run, f"w{20 + i} w{30 + i}", max_tokens=5)
    threads = [threading.Thread(target=_complete, args=(run, f"w{40 + i}"), kwargs={"max_tokens": 4 + i})
               for i in range(3)]
    with held(run.scheduler):  # concurrent, in shared steps
        for t in threads:
            t.start()
        wait_until(lambda: run.scheduler.waiting == 3, what="3 waiting requests")
    for t in threads:
        t.join(30)
    mid = run.state.write_routing(tmp_path / "mid.npz").result()  # on demand, while serving
    assert load_trace(tmp_path / "mid.npz") == mid and mid.num_tokens == run.scheduler.stats.steps
    run.state.draining = True  # the first moment of a shutdown: new requests get 503
    r = httpx.post(run.url + "/v1/completions", json={"model": NAME, "prompt": "w9"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(run.url + "/health").status_code == 503
    run.state.draining = False
    stream = _complete(run, "w50", max_tokens=12, stream=True)
    chunks = [next(iter(stream))]
    run.server.should_exit = True  # graceful: the open stream runs to its end
    chunks += list(stream)
    run.stop()
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 12
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.APIConnectionError):
        _complete(run, "w9", max_tokens=1)
    _check_trace_replays_to_the_server_counts(run, path)


def _check_trace_replays_to_the_server_counts(run, path) -> None:
    trace = load_trace(path)
    steps = run.scheduler.stats.steps
    assert trace.experts.shape == (steps, 2, 3, 2) and trace.meta.phase == "decode"
    assert trace.meta.expert_bytes == run.scheduler.engine.moe.store.bytes_per_expert
    assert (trace.meta.extra["policy"], trace.meta.extra["slots"]) == ("rule", 6)
    used = trace.req_index >= 0  # [N, B]
    assert np.array_equal(used, (trace.experts >= 0).all(axis=(1, 3)))
    assert set(np.unique(trace.req_index[used])) == set(range(6))  # every request decoded (2 + 3 + 1)
    assert used.sum(axis=1).max() == 3
    served = snapshot(run.scheduler)  # the counters /metrics reports
    assert (served.cache.calls == steps).all()  # only decode steps reach the cache: prefill bypasses it
    sim = replay(trace, "rule", 6)
    assert sim.misses > 0 and sim.accesses > sim.misses
    assert list(sim.layer_misses) == list(served.cache.misses)
    assert list(sim.layer_accesses) == list(served.cache.accesses)
    families = {f.name: f for f in text_string_to_metric_families(run.state.metrics.render(served).decode())}
    assert sum(s.value for s in families["expertcache_cache_misses"].samples) == sim.misses


def test_serve_flags_and_missing_tokenizer_are_refused(tiny_dir, tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", str(tiny_dir), "--moe-slots", "6",
                                   "--moe-cache-policy", "belady"])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((tiny_dir / f).read_bytes())
    args = build_parser().parse_args(["serve", "--model", str(bare), "--moe-slots", "6", "--max-batch", "3",
                                      "--device", "cpu"])
    with pytest.raises(SystemExit, match="tokenizer.json does not exist"):
        build_state(args)
    args = build_parser().parse_args(["serve", "--model", str(tiny_dir), "--moe-slots", "5", "--max-batch", "3",
                                      "--device", "cpu"])
    with pytest.raises(SystemExit, match="--moe-slots 5 is below"):
        build_state(args)


def test_usage_reports_the_request_s_timing_and_metrics_histogram_it(srv):
    def counts():
        text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = counts()
    t0 = time.monotonic()
    out = _complete(srv, "w10 w11 w12 w13", max_tokens=5)
    wall = time.monotonic() - t0
    ext = out.usage.model_extra["expertcache"]
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 <= ext["queue_s"] <= ext["time_to_first_token_s"] <= wall
    assert ext["time_to_first_token_s"] == pytest.approx(ext["queue_s"] + ext["prefill_s"])
    assert ext["prefill_tokens_per_s"] == pytest.approx(4 / ext["prefill_s"])
    assert ext["decode_tokens_per_s"] == pytest.approx(4 / ext["decode_s"])  # the 4 tokens after the first
    chunks = list(_complete(srv, "w20", max_tokens=1, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1].usage.model_extra["expertcache"]
    assert last["decode_tokens_per_s"] == 0 and last["prefill_tokens_per_s"] > 0  # ended at its first token
    after = counts()
    for name, added in (("expertcache_request_time_to_first_token_seconds_count", 2),
                        ("expertcache_request_prefill_tokens_per_second_count", 2),
                        ("expertcache_request_decode_tokens_per_second_count", 1),
                        ("expertcache_request_cached_prompt_tokens_count", 2)):
        assert after[(name, ())] - before.get((name, ()), 0) == added, name
    le = (("le", "0.0"),)
    assert after[("expertcache_request_cached_prompt_tokens_bucket", le)] == after[
        ("expertcache_request_cached_prompt_tokens_count", ())]
