"""A scripted coding-agent session through the scheduler, with and without the prefix cache.

    --layers L decoder layers at --geometry (moe.testing.random_decoder, random weights, --vocab
    tokens, a word-level tokenizer of that vocabulary written beside), the routed experts in a
    HostStore in --expert-format (default: the model's dtype), --slots-frac of the L * E experts in
    slots, one Engine per run over the same weights
    -> moe.serve.scheduler.Scheduler (the server's continuous batching, in process: the GPU image has no
       HTTP stack), --max-batch rows
    -> a session of --turns turns: turn 0 sends --start-tokens random tokens, every later turn resends
       the whole conversation (the last prompt, its answer, and --grow new tokens), asks --answer greedy
       tokens and streams them; every --side-every turns --side-calls short requests (--side-tokens
       prompt tokens, --side-answer new tokens) are submitted while the turn decodes
    -> per turn: context tokens, time to first token (from submitting the turn to its first streamed
       token: the queue is empty but for side calls), the tokens restored from the prefix cache, decode
       tokens per second, the worst gap between two streamed tokens, the side calls' latency (submit to
       last token) and the device memory allocated after the turn; a warm-up request first, so the
       compiles are in no turn
    -> both runs (--kv-cache-gb GiB of prefix cache, and none) over the same session, the TTFT ratio per
       turn; the run without the cache resends the first run's prompts of every --baseline-every turns and
       the last (with no cache a turn's time is its own prompt's, whatever came before); --minutes M:
       repeat the session with the cache until M minutes have passed, checked after each turn (the soak:
       every request must end well, memory is sampled each turn); the JSON is rewritten after each turn,
       so a run stopped from outside leaves what it measured
    -> table and --out JSON (machine, versions, commit)

Run: python benchmarks/bench_agent.py [--layers 48] [--turns 30] [--start-tokens 8192] [--grow 1900]
     [--kv-cache-gb 8] [--baseline-every 5] [--minutes 10] [--device cpu] [--out agent.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path

import benchmeta
import numpy as np
import torch

from expertcache.formats import format_names
from moe.engine.backends import make_backend
from moe.engine.budget import prefix_blocks_for
from moe.engine.engine import Engine
from moe.engine.prefix import PREFIX_BLOCK_TOKENS
from moe.serve.sampling import SamplingParams
from moe.serve.scheduler import Event, Request, Scheduler
from moe.serve.tokenizer import TextTokenizer
from moe.testing import random_decoder as decoders

GB = 2**30
GEOMETRIES = {"qwen3-30b": "qwen3_30b_like", "gpt-oss-20b": "gpt_oss_20b", "glm-4.5-air": "glm_4_5_air"}
# --small: the geometry's family at a size a CPU runs a session of in seconds (the benchmark's own test)
SMALL = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_experts": 16,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def write_word_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer of `vocab` tokens ("t0" .. ) with <|endoftext|> as id 0 and eos, so random
    ids decode to text and the scheduler's streams run as they do for a real model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>"] + [f"t{i}" for i in range(1, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))
    return path


class Watch:
    """A request's emit: the monotonic time of every event, the streamed text, the final event."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.text = ""
        self.final: Event | None = None
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.times.append(time.monotonic())
        self.text += event.text
        if event.final:
            self.final = event
            self.done.set()

    def wait(self, timeout: float) -> Event:
        if not self.done.wait(timeout):
            raise TimeoutError(f"a request did not finish in {timeout} s")
        return self.final


def submit(scheduler: Scheduler, prompt: list[int], tokens: int) -> tuple[Request, Watch, float]:
    watch = Watch()
    req = Request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0), watch)
    t0 = time.monotonic()
    scheduler.submit(req)
    return req, watch, t0


def session_prompts(args, rng: np.random.Generator):
    """The session's new tokens: turn 0's prompt, then each turn's --grow tokens (ids 1..vocab-1: no eos)."""
    first = rng.integers(1, args.vocab, args.start_tokens).tolist()
    return first, [rng.integers(1, args.vocab, args.grow).tolist() for _ in range(args.turns)]


def run_session(scheduler: Scheduler, args, first: list[int], grows: list[list[int]], rng, timeout: float,
                rows: list[dict], deadline: float = float("inf"), contexts: list[list[int]] | None = None,
                turns: set[int] | None = None, saved=lambda: None) -> None:
    """One session (module docstring), a row per turn appended to `rows` as it ends (then `saved()`);
    stops after the turn that passes `deadline` (monotonic). `contexts`: each turn's prompt is recorded
    there; with `turns`, only those turns run, each sending the recorded prompt of its turn (the baseline
    of a session already run: without a prefix cache a turn's time is its own prompt's)."""
    context = list(first)
    device = scheduler.engine.weights.device
    for turn in range(args.turns):
        if time.monotonic() >= deadline:
            return
        if turns is not None:
            if turn not in turns:
                continue
            context = contexts[turn]
        elif contexts is not None:
            contexts.append(context)
        req, watch, t0 = submit(scheduler, context, args.answer)
        sides = []
        if args.side_every and turn % args.side_every == args.side_every - 1:
            while len(watch.times) < 2 and not watch.done.is_set():  # the long answer is streaming
                time.sleep(0.001)
            sides = [submit(scheduler, rng.integers(1, args.vocab, args.side_tokens).tolist(), args.side_answer)
                     for _ in range(args.side_calls)]
        final = watch.wait(timeout)
        if final.error:
            raise RuntimeError(f"turn {turn}: {final.error}")
        side_latency = []
        for _, side, s0 in sides:
            ev = side.wait(timeout)
            if ev.error:
                raise RuntimeError(f"turn {turn}: a side call failed: {ev.error}")
            side_latency.append(side.times[-1] - s0)
        timing = final.timing
        gaps = np.diff(watch.times) if len(watch.times) > 1 else np.zeros(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows.append({"turn": turn, "context_tokens": len(context), "ttft_s": watch.times[0] - t0,
                     "cached_tokens": timing.cached_prompt_tokens, "answer_tokens": final.completion_tokens,
                     "prefill_s": timing.prefill_s,
                     "decode_tokens_per_s": timing.decode_tokens_per_s, "worst_gap_s": float(gaps.max()),
                     "side_latency_s": side_latency,
                     "device_allocated_gb": torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else 0.0})
        saved()
        answer = scheduler.tokenizer.encode(watch.text, add_special_tokens=False)  # the answer's words back to ids
        context = context + answer + grows[turn]


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    device = torch.device(args.device)
    config = getattr(decoders, GEOMETRIES[args.geometry])(args.layers, vocab_size=args.vocab)
    if args.small:
        config = {**config, **SMALL}
    weights = decoders.random_decoder(config, device, seed=args.seed, expert_format=args.expert_format)
    spec = weights.spec
    slots = max(args.max_batch * spec.moe.top_k, round(args.slots_frac * spec.num_moe_layers * spec.moe.num_experts))
    blocks = prefix_blocks_for(spec, args.kv_cache_gb, PREFIX_BLOCK_TOKENS, args.max_seq_len)
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        tokenizer = TextTokenizer(write_word_tokenizer(Path(tmp), args.vocab))
    longest = args.start_tokens + args.turns * args.grow + (args.turns - 1) * args.answer
    if longest + args.answer > args.max_seq_len:
        raise SystemExit(f"the session's last prompt ({longest} tokens) and answer outgrow --max-seq-len "
                         f"{args.max_seq_len}: raise it or lower --turns / --grow / --start-tokens")
    doc = {"bench": "agent", "machine": benchmeta.machine() if device.type == "cuda" else benchmeta.cpu_machine(),
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "expert_format": spec.moe.expert_format,
           "expert_bytes": weights.store.bytes_per_expert, "slots": slots, "prefix_blocks": blocks,
           "block_tokens": PREFIX_BLOCK_TOKENS, "runs": {}}
    contexts: list[list[int]] = []  # the kept run's first session's prompts, which the baseline resends
    baseline = {t for t in range(args.turns) if t % args.baseline_every == 0 or t == args.turns - 1}
    doc["baseline_turns"] = sorted(baseline)
    for name, prefix in (("kept", blocks), ("none", 0)):
        if name == "none" and args.minutes:
            break  # the soak runs the cache alone
        engine = Engine(weights, make_backend(weights, slots, "lru", max_batch=args.max_batch),
                        max_batch=args.max_batch, max_seq_len=args.max_seq_len, prefix_blocks=prefix)
        scheduler = Scheduler(engine, tokenizer)
        run = doc["runs"][name] = {"prefix_blocks": prefix, "sessions": [], "finished": {}, "prefix_stats": None}
        scheduler.start()
        try:
            rng = np.random.default_rng(args.seed)
            first, grows = session_prompts(args, rng)
            # a warm-up request of other tokens first: the compiles and lazy buffers are in no turn's figures
            submit(scheduler, rng.integers(1, args.vocab, args.side_tokens).tolist(), 2)[1].wait(args.timeout)
            end = time.monotonic() + 60 * args.minutes
            while True:
                run["sessions"].append([])
                first_session = name == "kept" and len(run["sessions"]) == 1
                run_session(scheduler, args, first, grows, rng, args.timeout, run["sessions"][-1],
                            end if args.minutes else float("inf"),
                            contexts=contexts if first_session or name == "none" else None,
                            turns=baseline if name == "none" else None,
                            saved=lambda: _write(doc, args.out))  # what a run that is stopped later leaves
                if time.monotonic() >= end:
                    break
        finally:
            scheduler.stop(timeout=30)
            run["finished"] = dict(scheduler.stats.finished)
            run["prefix_stats"] = None if engine.prefix is None else vars(engine.prefix.stats)
            _write(doc, args.out)
        del engine, scheduler
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(doc)
    return doc


def _write(doc: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))


def report(doc: dict) -> None:
    kept = doc["runs"]["kept"]["sessions"][0]
    none = {r["turn"]: r for r in (doc["runs"].get("none", {}).get("sessions") or [[]])[0]}
    print("turn  context  cached   ttft kept   ttft none   ratio  decode tok/s  worst gap  side calls (s)")
    for row in kept:
        base = none[row["turn"]]["ttft_s"] if row["turn"] in none else float("nan")
        print(f"{row['turn']:4d} {row['context_tokens']:8d} {row['cached_tokens']:7d} {row['ttft_s']:10.3f} "
              f"{base:11.3f} {base / row['ttft_s']:7.1f} {row['decode_tokens_per_s']:13.1f} "
              f"{row['worst_gap_s']:10.3f}  {', '.join(f'{s:.2f}' for s in row['side_latency_s'])}")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The random model's and the engine's options, shared with bench_long_context."""
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--small", action="store_true", help="hidden 256, 16 experts of 64: the wiring, on a CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--slots-frac", type=float, default=0.25, help="share of the L * E experts in slots")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--expert-format", choices=format_names(), default=None,
                    help="the routed experts' format in the host store and the slots (default: the model's dtype)")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3-30b", choices=sorted(GEOMETRIES))
    add_model_args(ap)
    ap.add_argument("--max-seq-len", type=int, default=73728)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0, help="the prefix cache of the 'kept' run")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--start-tokens", type=int, default=8192)
    ap.add_argument("--grow", type=int, default=1900, help="new tokens a turn adds beside the answer")
    ap.add_argument("--answer", type=int, default=64, help="tokens a turn's answer streams")
    ap.add_argument("--side-every", type=int, default=5, help="side calls every this many turns (0: none)")
    ap.add_argument("--side-calls", type=int, default=3)
    ap.add_argument("--side-tokens", type=int, default=512)
    ap.add_argument("--side-answer", type=int, default=16)
    ap.add_argument("--baseline-every", type=int, default=1,
                    help="the run without a prefix cache resends every this many turns' prompts (and the last)")
    ap.add_argument("--minutes", type=float, default=0.0, help="soak: repeat the session with the cache this long")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before the run fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    for name in ("layers", "vocab", "max_batch", "max_seq_len", "turns", "start_tokens", "answer", "side_calls",
                 "side_tokens", "side_answer", "baseline_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.grow < 0 or args.side_every < 0 or args.minutes < 0 or not args.kv_cache_gb > 0:
        ap.error("--grow, --side-every and --minutes must be >= 0 and --kv-cache-gb > 0")
    if not 0 < args.slots_frac <= 1:
        ap.error("--slots-frac must be in (0, 1]")
    if args.small and args.geometry != "qwen3-30b":
        ap.error("--small shrinks the qwen3-30b geometry only")
    return args


if __name__ == "__main__":
    main()
