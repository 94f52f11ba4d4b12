"""Continuous batching without HTTP: engine rows that join and leave, the scheduler, sampling, text.

    tiny checkpoint (tests/moe/serve/serving_util.py) ─load_model─► Engine(max_batch 3) ─► Scheduler thread
    checked against a second Engine that runs every sequence alone (Engine.generate / decode_step):
    logits of rows that join and leave mid-decode, greedy outputs under batching and queueing,
    eos / stop-string / max_tokens ends, cancellation, seeded sampling, tokenizer and chat template.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

from moe.engine.loading import load_model
from moe.serve.sampling import Sampler, SamplingParams
from moe.serve.scheduler import Request, Scheduler, SchedulerClosed
from moe.serve.tokenizer import TextStream, TextTokenizer, TokenizerError
from moe.testing.tiny_checkpoint import EOS
from tests.moe.serve.serving_util import held, wait_until


def _engine(path, max_batch=3, **kw):
    return load_model(path, "cpu", num_slots=2 * max_batch, max_batch=max_batch, max_seq_len=64,
                      progress=False, **kw)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """An engine that runs one sequence at a time: the reference of every batched result."""
    return _engine(tiny_dir, max_batch=1)


@pytest.fixture
def sched(tiny_dir):
    s = Scheduler(_engine(tiny_dir), TextTokenizer(tiny_dir))
    s.start()
    yield s
    s.stop()


class Sink:
    """Collects a request's Events (the scheduler calls it on its thread)."""

    def __init__(self) -> None:
        self.events, self.done = [], threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if ev.final:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    def wait(self):
        assert self.done.wait(20), "the request did not finish"
        return self.events[-1]


class Logged(Sink):
    """A Sink that also appends (its name, the event's completion_tokens) to a shared `order` list."""

    def __init__(self, name: str, order: list) -> None:
        super().__init__()
        self.name, self.order = name, order

    def __call__(self, ev) -> None:
        self.order.append((self.name, ev.completion_tokens))
        super().__call__(ev)


def _run(sched, prompt, **params) -> Sink:
    sink = Sink()
    sched.submit(Request(prompt, SamplingParams(**params), sink))
    sink.wait()
    return sink


def test_rows_that_join_and_leave_decode_like_single_sequences(tiny_dir, ref):
    eng = _engine(tiny_dir)
    seqs = {"a": list(range(10, 17)), "b": list(range(20, 27)), "c": list(range(30, 36))}
    start = {"a": 3, "b": 2, "c": 3}  # prompt lengths
    got = {name: [] for name in seqs}  # logits after each fed token, from the batched engine
    rows = []  # names by engine row
    pos = dict(start)

    def join(name):
        row, logits = eng.join(seqs[name][: start[name]])
        assert row == len(rows)
        rows.append(name)
        got[name].append(logits)

    def step():
        logits = eng.decode_step([seqs[n][pos[n]] for n in rows])
        for r, n in enumerate(rows):
            got[n].append(logits[r])
            pos[n] += 1

    join("a"), step(), step()
    join("b"), step(), step()
    assert eng.leave(0) == 1 and eng.lengths() == [4]  # a leaves; b moves from row 1 to row 0
    rows[0] = rows.pop()
    join("c"), step(), step(), step()
    assert eng.leave(1) is None and eng.batch == 1  # c (the last row) leaves: nothing moves
    for name, seq in seqs.items():
        want = [ref.prefill([seq[: start[name]]])[0]] + [ref.decode_step([t])[0] for t in
                                                         seq[start[name]: start[name] + len(got[name]) - 1]]
        torch.testing.assert_close(torch.stack(got[name]), torch.stack(want), rtol=1e-4, atol=1e-4)


def test_engine_join_and_leave_refuse_bad_rows(tiny_dir):
    eng = _engine(tiny_dir, max_batch=1)
    eng.join([5, 6])
    with pytest.raises(ValueError, match="max_batch=1"):
        eng.join([7])
    with pytest.raises(ValueError, match="row 1 is not an active row"):
        eng.leave(1)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        _engine(tiny_dir).join(list(range(10, 75)))


def test_queued_and_batched_requests_equal_generate(sched, ref):
    prompts = [[10 + i, 40, 70 + i] for i in range(5)]  # 5 requests, 3 rows: two wait for a row
    sinks = [Sink() for _ in prompts]
    with held(sched):
        for prompt, sink, n in zip(prompts, sinks, range(5)):
            sched.submit(Request(prompt, SamplingParams(max_tokens=4 + n), sink))
        wait_until(lambda: sched.waiting == 5, what="5 waiting requests")
    for prompt, sink, n in zip(prompts, sinks, range(5)):
        last = sink.wait()
        assert sink.text == sched.tokenizer.decode(ref.generate([prompt], 4 + n)[0])
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 3, 4 + n)
    wait_until(lambda: sched.active == 0, what="free rows")
    assert max(sched.stats.batch_steps) == 3 and sched.stats.finished["length"] == 5
    assert sched.stats.decode_tokens == sum(b * n for b, n in sched.stats.batch_steps.items())


def test_eos_stop_string_and_max_tokens_end_a_sequence(tiny_dir, ref):
    tok = TextTokenizer(tiny_dir)
    prompt = [15, 25, 35]
    tokens = ref.generate([prompt], 6)[0]
    end = next(i for i in range(2, 6) if tokens[i] not in tokens[:i])  # eos: the first new token from 2 on
    s = Scheduler(_engine(tiny_dir), tok, eos_ids=[tokens[end]])
    s.start()
    try:
        eos = _run(s, prompt, max_tokens=6)
        assert eos.text == tok.decode(tokens[:end]) and eos.events[-1].finish_reason == "stop"
        assert eos.events[-1].completion_tokens == end + 1  # the eos counts, adds no text
        full, stop_word = tok.decode(tokens[:end]), tok.decode(tokens[end - 1:end])
        by_stop = _run(s, prompt, max_tokens=6, stop=("zzz", stop_word))
        assert by_stop.text == full[: full.index(stop_word)] and by_stop.events[-1].finish_reason == "stop"
        one = _run(s, prompt, max_tokens=1)
        assert one.text == tok.decode(tokens[:1]) and one.events[-1].finish_reason == "length"
    finally:
        s.stop()
    assert s.stats.finished == {"stop": 2, "length": 1}


def test_cancel_frees_the_row_and_shutdown_ends_waiting_requests(sched):
    first = threading.Event()
    sink = Sink()
    req = Request([10, 20], SamplingParams(max_tokens=60), lambda ev: (sink(ev), first.set()))
    sched.submit(req)
    assert first.wait(10)
    req.cancel()
    wait_until(lambda: sched.active == 0, what="the cancelled row to be freed")
    assert sched.stats.finished["cancelled"] == 1 and not sink.done.is_set()
    late = [Sink() for _ in range(4)]
    with held(sched):
        for s in late:
            sched.submit(Request([10, 20], SamplingParams(max_tokens=60), s))
        threading.Thread(target=sched.stop).start()
        wait_until(lambda: sched.closing, what="stop() to start")
    for s in late:
        assert s.wait().error == "server shutting down"
    with pytest.raises(SchedulerClosed):
        sched.submit(Request([1], SamplingParams(max_tokens=1), Sink()))


def test_stop_with_a_timeout_lets_running_requests_finish(sched):
    sinks = [Sink() for _ in range(4)]  # 3 rows and one waiting request, all finish within the timeout
    with held(sched):
        for s in sinks:
            sched.submit(Request([10, 20], SamplingParams(max_tokens=5), s))
        threading.Thread(target=sched.stop, kwargs={"timeout": 30}).start()
        wait_until(lambda: sched.closing, what="stop() to start")
    assert [s.wait().finish_reason for s in sinks] == ["length"] * 4
    wait_until(lambda: not sched.running, what="the thread to end")
    assert sched.call(lambda: sched.active).result() == 0  # runs inline once stopped


def test_an_engine_that_cannot_release_rows_still_answers_every_request(tiny_dir, monkeypatch):
    """stop() without a timeout aborts the running requests; when the engine's leave raises (a rank gone
    under --tensor-parallel), every request is still answered with an error and the thread ends."""
    s = Scheduler(_engine(tiny_dir), TextTokenizer(tiny_dir))
    step = s.engine.decode_step
    monkeypatch.setattr(s.engine, "decode_step", lambda tokens: time.sleep(0.05) or step(tokens))  # still running
    s.start()
    sinks = [Sink() for _ in range(4)]
    for sink in sinks:
        s.submit(Request([10, 20], SamplingParams(max_tokens=60), sink))
    wait_until(lambda: len(s.engine.lengths()) == 3 and all(len(k.events) > 1 for k in sinks[:3]),
               what="three rows streaming")
    monkeypatch.setattr(s.engine, "leave", lambda row: (_ for _ in ()).throw(RuntimeError("rank 1 is gone")))
    threading.Thread(target=s.stop).start()
    assert all(sink.wait().error for sink in sinks)
    wait_until(lambda: not s.running, what="the thread to end")
    assert s.call(lambda: s.active).result() == 0


def test_seeded_sampling_repeats_and_tiny_top_p_is_greedy(sched, ref):
    prompt = [12, 13, 14]
    a = _run(sched, prompt, max_tokens=8, temperature=1.0, seed=5).text
    b = _run(sched, prompt, max_tokens=8, temperature=1.0, seed=5).text
    assert a == b
    assert _run(sched, prompt, max_tokens=8, temperature=1.0, top_p=1e-6).text == \
        sched.tokenizer.decode(ref.generate([prompt], 8)[0])
    gen = Sampler(SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=1))
    logits = torch.tensor([2.0, 1.9, -5.0, 0.0])  # probabilities .52, .45, 0, .03: top_p .9 keeps 0 and 1
    assert {gen.sample(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("field, kw", [("max_tokens", dict(max_tokens=0)), ("temperature", dict(temperature=3.0)),
                                       ("top_p", dict(top_p=0.0)), ("seed", dict(seed=-1))])
def test_sampling_params_name_the_bad_field(field, kw):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{"max_tokens": 4, **kw})


def test_text_stream_holds_back_stop_prefixes(tiny_dir):
    tok = TextTokenizer(tiny_dir)
    stream = TextStream(tok, stop=["w9 w1"])
    ids = [tok.encode(w)[0] for w in ("w8", "w9", "w10")]
    assert stream.push(ids[0]) == ("w8", False)
    assert stream.push(ids[1]) == (" ", False)  # "w9" could start "w9 w1": held back
    assert stream.push(ids[2]) == ("", True)  # "w8 w9 w10" holds the stop string at 3
    assert stream.text == "w8 "


def test_tokenizer_chat_template_and_eos_sources(tiny_dir, tmp_path):
    tok = TextTokenizer(tiny_dir)
    assert tok.eos_ids == {EOS}
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8 w9"}]
    assert tok.render_chat(messages) == ("<|im_start|>system w7<|im_end|> <|im_start|>user w8 w9<|im_end|> "
                                         "<|im_start|>assistant ")
    assert tok.encode_chat(messages) == [2, 6, 7, 3, 2, 4, 8, 9, 3, 2, 5]
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    (other / "chat_template.jinja").write_text("{{ raise_exception('only ' + bos_token) }}")
    tok2 = TextTokenizer(other)
    assert tok2.eos_ids == {1, 3, 9}
    with pytest.raises(TokenizerError, match="refused the messages: only"):
        tok2.render_chat(messages)
    (other / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        TextTokenizer(other).render_chat(messages)
    (other / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json does not exist"):
        TextTokenizer(other)


@pytest.mark.gpu
def test_logprobs_on_a_gpu_engine_match_its_own_logits(tiny_dir):
    """The scheduler's logprobs on a CUDA engine (CUDA-graph decode, evictions every step) against
    log_softmax of the same engine's prefill logits over prompt + generated tokens."""
    engine = load_model(tiny_dir, "cuda", num_slots=2, max_batch=1, max_seq_len=64, dtype="float32",
                        progress=False)
    s = Scheduler(engine, TextTokenizer(tiny_dir))
    s.start()
    try:
        sink, prompt = Sink(), [11, 22, 33]
        s.submit(Request(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), sink))
        sink.wait()
    finally:
        s.stop()
    lps = [e.logprob for e in sink.events]
    tokens = [lp.token for lp in lps]
    logits = engine.prefill([prompt + tokens[:-1]], all_logits=True)[0]  # [P + 5, V]
    ref = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:].cpu()
    assert tokens == ref.argmax(dim=-1).tolist()
    assert [lp.logprob for lp in lps] == pytest.approx(ref.max(dim=-1).values.tolist(), abs=1e-4)
    for lp, row in zip(lps, ref):
        values, ids = row.topk(3)
        assert [i for i, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_choose_draws_each_sampled_row_on_the_logits_device_whatever_shares_the_step(device):
    from moe.serve.sampling import choose

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g).to(device)
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=11),
              SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=1.3, seed=12)]
    together = [Sampler(p) for p in params]
    alone = [Sampler(p) for p in params]
    for _ in range(5):
        got = choose(together, logits)
        assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())
        assert [got[1], got[3]] == [alone[1].sample(logits[1]), alone[3].sample(logits[3])]
    assert set(together[1]._generators) == {logits.device}


def test_a_long_prompt_joins_chunk_by_chunk_beside_streaming_rows(tiny_dir, ref):
    """A prompt longer than the engine's prefill chunk (8) joins one chunk a loop turn in the spare row:
    the row already streaming gets a token after each chunk, a short request submitted after the long
    one joins and answers before it, a second long prompt waits for the spare row, and every text is
    the one each prompt gives alone."""
    engine = _engine(tiny_dir, max_batch=3, prefill_chunk=8)
    sched = Scheduler(engine, TextTokenizer(tiny_dir))
    order = []  # (name, token index) of every event, in the order the scheduler emitted them

    prompts = {"a": list(range(10, 15)), "long": list(range(20, 50)), "short": list(range(30, 34)),
               "long2": list(range(40, 60))}
    sinks = {name: Logged(name, order) for name in prompts}
    sched.start()
    try:
        with held(sched):
            for name, prompt in prompts.items():
                sched.submit(Request(prompt, SamplingParams(max_tokens=12 if name == "a" else 4), sinks[name]))
        for name, prompt in prompts.items():
            want = sched.tokenizer.decode(ref.generate([prompt], 12 if name == "a" else 4)[0])
            assert sinks[name].wait().finish_reason == "length" and sinks[name].text == want, name
    finally:
        sched.stop()
    firsts = {name: order.index((name, 1)) for name in prompts}
    # long (30 tokens, 4 chunks): row a streamed a token after each of its first 3 chunks
    a_between = [i for i, (name, _) in enumerate(order) if name == "a" and firsts["long"] > i > firsts["a"]]
    assert len(a_between) >= 3, order
    assert firsts["short"] < firsts["long"] < firsts["long2"], order


def test_a_burst_of_short_requests_joins_in_one_pass(tiny_dir, ref):
    """Three short requests submitted together beside a streaming row join in one prefill pass (one
    join_many of the three, in order); the first ends at its first token (its row leaves while the
    others' are seated), and every text is the one its prompt gives alone. A burst whose tokens pass
    the prefill chunk is split into passes that fit."""
    engine = _engine(tiny_dir, max_batch=4, prefill_chunk=16)
    passes, join_many = [], engine.join_many

    def logged(prompts):
        passes.append([len(p) for p in prompts])
        return join_many(prompts)

    engine.join_many = logged
    sched = Scheduler(engine, TextTokenizer(tiny_dir))
    prompts = {"a": (list(range(10, 15)), 8), "one": (list(range(30, 34)), 1), "b": (list(range(40, 46)), 5),
               "c": (list(range(50, 53)), 6)}
    sinks = {name: Sink() for name in prompts}
    sched.start()
    try:
        sched.submit(Request(prompts["a"][0], SamplingParams(max_tokens=8), sinks["a"]))
        wait_until(lambda: sched.active == 1)
        with held(sched):
            for name in ("one", "b", "c"):
                sched.submit(Request(prompts[name][0], SamplingParams(max_tokens=prompts[name][1]), sinks[name]))
        for name, (prompt, n) in prompts.items():
            assert sinks[name].wait().finish_reason == "length", name
            assert sinks[name].text == sched.tokenizer.decode(ref.generate([prompt], n)[0]), name
        assert passes == [[4, 6, 3]]
        passes.clear()
        burst = {name: Sink() for name in ("d", "e", "f")}
        with held(sched):
            for k, name in enumerate(burst):
                sched.submit(Request(list(range(20 + k, 27 + k)), SamplingParams(max_tokens=2), burst[name]))
        for k, name in enumerate(burst):
            burst[name].wait()
            want = sched.tokenizer.decode(ref.generate([list(range(20 + k, 27 + k))], 2)[0])
            assert burst[name].text == want, name
        assert passes == [[7, 7]]  # 21 tokens: two in one pass (14 <= 16), the third joins by itself
    finally:
        sched.stop()


def test_a_pass_that_fails_answers_every_request_it_held(tiny_dir):
    """join_many failing with something other than a refusal (a device out of memory): the requests of
    that pass and a long prompt passed over while another joins in chunks each get an error Event, the
    streaming one too, and the scheduler stops."""
    engine = _engine(tiny_dir, max_batch=4, prefill_chunk=8)
    sched = Scheduler(engine, TextTokenizer(tiny_dir))
    sinks = {name: Sink() for name in ("a", "long", "long2", "s1", "s2")}
    sched.start()
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=40), sinks["a"]))
        wait_until(lambda: sched.active == 1)
        engine.join_many = lambda prompts: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))
        with held(sched):
            sched.submit(Request(list(range(20, 50)), SamplingParams(max_tokens=2), sinks["long"]))
            sched.submit(Request(list(range(21, 51)), SamplingParams(max_tokens=2), sinks["long2"]))
            sched.submit(Request([30, 31, 32], SamplingParams(max_tokens=2), sinks["s1"]))
            sched.submit(Request([33, 34, 35], SamplingParams(max_tokens=2), sinks["s2"]))
        for name, sink in sinks.items():
            assert "CUDA out of memory" in (sink.wait().error or ""), name
        wait_until(lambda: not sched.running)
    finally:
        sched.stop()


@pytest.mark.parametrize("share", [0.0, 0.6])
def test_streaming_rows_get_their_share_of_the_time_while_a_long_prompt_joins(tiny_dir, ref, share):
    """Each chunk of a long prompt (4 chunks of 8) made to take 0.4 s: with decode_share 0 the row
    already streaming gets one token a chunk; with 0.6 (owed 1.5x a chunk's time in decode steps) it
    finishes its 8 tokens before the second chunk (some before the first: its own join, beside the long
    prompt's start, is owed its share too). Every text is the one its prompt gives alone, whatever the
    schedule."""
    engine = _engine(tiny_dir, max_batch=2, prefill_chunk=8)
    order = []
    advance = engine.advance

    def slow_advance(joining):
        time.sleep(0.4)
        order.append(("chunk", 0))
        return advance(joining)

    engine.advance = slow_advance
    sched = Scheduler(engine, TextTokenizer(tiny_dir), decode_share=share)
    prompts = {"a": list(range(10, 15)), "long": list(range(20, 50))}
    sinks = {name: Logged(name, order) for name in prompts}
    sched.start()
    try:
        with held(sched):
            for name, prompt in prompts.items():
                sched.submit(Request(prompt, SamplingParams(max_tokens=8), sinks[name]))
        for name, prompt in prompts.items():
            assert sinks[name].wait().finish_reason == "length", name
            assert sinks[name].text == sched.tokenizer.decode(ref.generate([prompt], 8)[0]), name
    finally:
        sched.stop()
    chunks = [i for i, (name, _) in enumerate(order) if name == "chunk"]
    assert len(chunks) == 4, order
    a_tokens = [i for i, (name, _) in enumerate(order) if name == "a"]
    between = [sum(c < i < d for i in a_tokens) for c, d in zip(chunks, chunks[1:])]
    if share == 0:
        assert between == [1, 1, 1], order
    else:
        assert len(a_tokens) == 8 and max(a_tokens) < chunks[1] and between[0] >= 1, order
    with pytest.raises(ValueError, match="--decode-share"):
        Scheduler(engine, TextTokenizer(tiny_dir), decode_share=1.0)


def test_a_long_prompt_whose_prefix_is_kept_joins_at_once(tiny_dir, ref):
    """With a prefix cache, a prompt counts by the tokens it must compute: one resending a kept 32-token
    prefix plus 4 (8-token chunks) joins at once and answers while a new long prompt is still joining in
    the spare row, with the text each prompt gives alone."""
    engine = _engine(tiny_dir, max_batch=3, prefill_chunk=8, prefix_blocks=32, prefix_block_tokens=4)
    sched = Scheduler(engine, TextTokenizer(tiny_dir))
    kept = list(range(10, 43))  # 33 tokens: 8 whole blocks kept after it joins
    order = []

    sched.start()
    try:
        first = Logged("first", order)
        sched.submit(Request(kept, SamplingParams(max_tokens=1), first))
        first.wait()
        assert engine.tokens_to_compute(kept[:32] + [5, 6, 7, 8]) == 4 and engine.tokens_to_compute(kept) == 1
        prompts = {"new": list(range(20, 56)), "resent": kept[:32] + [5, 6, 7, 8]}
        sinks = {name: Logged(name, order) for name in prompts}
        with held(sched):
            for name, prompt in prompts.items():
                sched.submit(Request(prompt, SamplingParams(max_tokens=3), sinks[name]))
        for name, prompt in prompts.items():
            assert sinks[name].wait().finish_reason == "length", name
            assert sinks[name].text == sched.tokenizer.decode(ref.generate([prompt], 3)[0]), name
        assert sinks["resent"].events[-1].timing.cached_prompt_tokens == 32
    finally:
        sched.stop()
    assert order.index(("resent", 1)) < order.index(("new", 1)), order


def _timed_engine(tiny_dir, order: list, chunk_s: float, join_s: float, step_s: float, max_batch: int = 3):
    """The tiny engine with each chunk, each join of 3-token prompts (alone or in one pass) and each decode
    step made to take at least these seconds; ("chunk", 0), ("joined", 0) and ("step", its seconds) appended
    to `order`."""
    engine = _engine(tiny_dir, max_batch=max_batch, prefill_chunk=8)
    advance, join, join_many, decode_step = engine.advance, engine.join, engine.join_many, engine.decode_step

    def slow_advance(joining):
        time.sleep(chunk_s)
        order.append(("chunk", 0))
        return advance(joining)

    def slow_join(prompt):
        if len(prompt) == 3:
            time.sleep(join_s)
            order.append(("joined", 0))
        return join(prompt)

    def slow_join_many(prompts):
        if all(len(p) == 3 for p in prompts):
            time.sleep(join_s)
            order.append(("joined", 0))
        return join_many(prompts)

    def slow_step(tokens):
        start = time.perf_counter()
        time.sleep(step_s)
        out = decode_step(tokens)
        order.append(("step", time.perf_counter() - start))
        return out

    engine.advance, engine.join, engine.decode_step = slow_advance, slow_join, slow_step
    engine.join_many = slow_join_many
    return engine


def test_short_prompts_joining_during_a_long_one_count_against_the_decode_share(tiny_dir):
    """decode_share 0.6 while a long prompt joins in chunks of 0.3 s: a short prompt's join of 0.3 s before
    a chunk adds its share to the decode steps owed after it (0.9 s in all, 0.45 for the chunk alone)."""
    order = []
    sched = Scheduler(_timed_engine(tiny_dir, order, 0.3, 0.3, 0.05), TextTokenizer(tiny_dir), decode_share=0.6)
    sinks = {name: Logged(name, order) for name in ("a", "long", "s")}
    sched.start()
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=60), sinks["a"]))
        wait_until(lambda: sched.active == 1)
        with held(sched):
            sched.submit(Request(list(range(20, 50)), SamplingParams(max_tokens=2), sinks["long"]))
            sched.submit(Request([30, 31, 32], SamplingParams(max_tokens=2), sinks["s"]))
        for name in sinks:
            assert sinks[name].wait().finish_reason == "length", name
    finally:
        sched.stop()
    chunks = [i for i, (name, _) in enumerate(order) if name == "chunk"]
    after = next(c for c in chunks if c > order.index(("joined", 0)))
    following = next((c for c in chunks if c > after), len(order))
    stepped = sum(s for name, s in order[after:following] if name == "step")
    assert stepped >= 0.8, order  # 0.9 s owed, less what the scheduler times beyond the steps themselves


def _long_prompt_under_short_requests(sched: Scheduler, order: list, settle_s: float, stream_tokens: int,
                                      longs: tuple[int, ...] = (32,)):
    """Beside one streaming row (`stream_tokens` to answer), 3-token requests arriving every 0.05 s from
    `settle_s` before long prompts of `longs` tokens (chunks of 8) are submitted at once until they
    answered: (seconds they took, the index in `order` they were submitted at, whether the requests still
    arrived when they answered)."""
    stop, sinks = threading.Event(), [Sink() for _ in longs]

    def feed():
        n = 0
        while not stop.is_set():
            sched.submit(Request([40 + n % 20, 41, 42], SamplingParams(max_tokens=1), Sink()))
            n += 1
            time.sleep(0.05)

    sched.start()
    feeder = threading.Thread(target=feed, daemon=True)
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=stream_tokens), Sink()))
        wait_until(lambda: sched.active == 1)
        feeder.start()
        time.sleep(settle_s)
        began, at = time.monotonic(), len(order)
        for k, (n, sink) in enumerate(zip(longs, sinks)):
            sched.submit(Request(list(range(20 + k, 20 + k + n)), SamplingParams(max_tokens=1), sink))
        for sink in sinks:
            assert sink.wait().finish_reason == "length"
        return time.monotonic() - began, at, feeder.is_alive()
    finally:
        stop.set()
        feeder.join(timeout=10)
        sched.stop()


def test_a_stream_of_short_requests_does_not_hold_a_long_prompt_back(tiny_dir):
    """Short requests keep arriving for 4 s, each join 0.2 s, while a long prompt (4 chunks) joins beside a
    streaming row at decode_share 0.2: the long prompt still answers while they arrive."""
    order = []
    sched = Scheduler(_timed_engine(tiny_dir, order, 0.0, 0.2, 0.02), TextTokenizer(tiny_dir), decode_share=0.2)
    took, _, arriving = _long_prompt_under_short_requests(sched, order, 0.3, 400)
    assert arriving and took < 3.5, (took, order[-20:])


def test_joins_between_two_chunks_stop_at_a_chunks_time(tiny_dir):
    """Short requests keep arriving, each join 0.3 s, while a long prompt (4 chunks of 0.3 s) joins beside a
    streaming row at decode_share 0.2: joins after a chunk stop once they took a chunk's time, so two chunks
    are at most a chunk of joins, the join passing it and the owed steps apart (not as many joins as the
    owed steps take turns)."""
    order = []
    sched = Scheduler(_timed_engine(tiny_dir, order, 0.3, 0.3, 0.01), TextTokenizer(tiny_dir), decode_share=0.2)
    _, began, _ = _long_prompt_under_short_requests(sched, order, 0.5, 5000)
    joins = _joins_between_chunks(order, began)
    assert len(joins) == 3 and max(joins) <= 2, joins  # 0.15 s of steps owed: 15 turns, each with a join, before


def _joins_between_chunks(order: list, began: int) -> list[int]:
    chunks = [i for i, (name, _) in enumerate(order) if name == "chunk" and i >= began]
    return [sum(name == "joined" for name, _ in order[a:b]) for a, b in zip(chunks, chunks[1:])]


def test_joins_before_the_next_long_prompts_first_chunk_stop_at_a_chunks_time(tiny_dir):
    """Two long prompts of 2 chunks back to back under the same stream of short requests: the steps the
    first one's last chunk owes are paid before the second's first chunk, with joins capped by that chunk's
    time there too (not a join a step)."""
    order = []
    sched = Scheduler(_timed_engine(tiny_dir, order, 0.3, 0.3, 0.01), TextTokenizer(tiny_dir), decode_share=0.2)
    _, began, _ = _long_prompt_under_short_requests(sched, order, 0.5, 5000, longs=(16, 16))
    joins = _joins_between_chunks(order, began)
    assert len(joins) == 3 and max(joins) <= 2, joins


def test_a_burst_of_short_requests_after_a_chunk_joins_a_chunks_time_of_them(tiny_dir):
    """8 short requests arriving at once after a long prompt's first chunk (0.3 s), 8 rows, so one turn
    could join them all in 4 passes of 2 (a prefill chunk of 8 tokens), each pass 0.3 s: it joins passes
    only until they took the chunk's time; the rest join after the next chunks, so the streaming row and
    the long prompt keep their share."""
    order = []
    engine = _timed_engine(tiny_dir, order, 0.3, 0.3, 0.01, max_batch=8)
    sched = Scheduler(engine, TextTokenizer(tiny_dir), decode_share=0.2)
    long_sink, sinks = Sink(), [Sink() for _ in range(8)]
    sched.start()
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=5000), Sink()))
        wait_until(lambda: sched.active == 1)
        began = len(order)
        sched.submit(Request(list(range(20, 52)), SamplingParams(max_tokens=1), long_sink))
        wait_until(lambda: ("chunk", 0) in order[began:])
        for n, sink in enumerate(sinks):
            sched.submit(Request([40 + n, 41, 42], SamplingParams(max_tokens=1), sink))
        for sink in (long_sink, *sinks):
            assert sink.wait().finish_reason == "length"
    finally:
        sched.stop()
    joins = _joins_between_chunks(order, began)
    assert len(joins) == 3 and max(joins) <= 2, joins


def test_the_first_long_prompts_first_chunk_comes_before_a_burst_sent_with_it(tiny_dir):
    """A fresh scheduler (no chunk yet to cap joins by) given a long prompt and 6 short requests at once,
    8 rows: the long prompt's first chunk runs after one pass of them at most, not after all three."""
    order = []
    engine = _timed_engine(tiny_dir, order, 0.3, 0.3, 0.01, max_batch=8)
    sched = Scheduler(engine, TextTokenizer(tiny_dir), decode_share=0.2)
    sinks = [Sink() for _ in range(7)]
    sched.start()
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=5000), Sink()))
        wait_until(lambda: sched.active == 1)
        began = len(order)
        with held(sched):
            sched.submit(Request(list(range(20, 52)), SamplingParams(max_tokens=1), sinks[0]))
            for n, sink in enumerate(sinks[1:]):
                sched.submit(Request([40 + n, 41, 42], SamplingParams(max_tokens=1), sink))
        for sink in sinks:
            assert sink.wait().finish_reason == "length"
    finally:
        sched.stop()
    names = [name for name, _ in order[began:] if name != "step"]
    assert names.index("chunk") <= 1, names


def test_the_steps_a_prompts_last_chunk_owes_come_before_the_next_prompt(tiny_dir):
    """Three long prompts of 2 chunks (0.3 s each) queued beside a streaming row at decode_share 0.6: every
    chunk, the last of a prompt too, is followed by its 0.45 s of decode steps before the next chunk."""
    order = []
    sched = Scheduler(_timed_engine(tiny_dir, order, 0.3, 0.0, 0.05), TextTokenizer(tiny_dir), decode_share=0.6)
    sinks = [Sink() for _ in range(3)]
    sched.start()
    try:
        sched.submit(Request(list(range(10, 15)), SamplingParams(max_tokens=400), Sink()))
        wait_until(lambda: sched.active == 1)
        for k, sink in enumerate(sinks):
            sched.submit(Request(list(range(20 + k, 32 + k)), SamplingParams(max_tokens=1), sink))
        for sink in sinks:
            assert sink.wait().finish_reason == "length"
    finally:
        sched.stop()
    chunks = [i for i, (name, _) in enumerate(order) if name == "chunk"]
    assert len(chunks) == 6, order
    for a, b in zip(chunks, chunks[1:]):
        stepped = sum(s for name, s in order[a:b] if name == "step")
        assert stepped >= 0.35, (a, order[a:b])  # 0.45 s owed, less the scheduler's own time
