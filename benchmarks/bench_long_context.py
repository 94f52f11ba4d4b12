"""A long prompt (256K tokens by default) decoding through the scheduler, alone and beside short side calls.

    --layers L decoder layers at Qwen3-30B-A3B's geometry (moe.testing.random_decoder, random weights,
    a word-level tokenizer of --vocab tokens), the routed experts in --expert-format (default: the
    model's dtype), --slots-frac of the experts in slots, --max-batch rows of
    --prompt-tokens + --answer positions each (the KV cache is allocated per row: refused up front, naming
    the flags, where it does not fit the device)
    -> moe.serve.scheduler.Scheduler (in process): the long prompt joins chunk by chunk (its prefill
       chunks of --prefill-chunk tokens in the engine's spare row, the other rows' decode steps between
       them for at least --decode-share of the time), then streams --answer greedy tokens
    -> run "alone": the long request by itself; run "sides": the same request with --side-calls short
       requests (--side-tokens prompt tokens, --side-answer tokens) submitted while it prefills and as
       many again once its answer streams
    -> per run: the long request's time to first token, prefill tokens/s, decode tokens/s, worst gap
       between two streamed tokens; each side call's time to first token and latency (submit to last
       token) and whether it was submitted during the prefill or the decode; device memory peak
    -> table and --out JSON (machine, versions, commit)

A warm-up request first (compiles and lazy buffers in no figure). Both runs use one engine and one
scheduler, so the second starts from the expert cache the first left.

Run: python benchmarks/bench_long_context.py [--layers 48] [--prompt-tokens 262144] [--answer 128]
     [--side-calls 3] [--max-batch 4] [--device cuda] [--out long-context.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchmeta
import numpy as np
import torch
from bench_agent import GB, SMALL, Watch, _write, add_model_args, submit, write_word_tokenizer

from moe.engine.backends import make_backend
from moe.engine.budget import context_bytes
from moe.engine.engine import PREFILL_CHUNK, Engine
from moe.serve.scheduler import DECODE_SHARE, Scheduler
from moe.serve.tokenizer import TextTokenizer
from moe.testing import random_decoder as decoders


def _side(scheduler: Scheduler, args, rng, phase: str) -> dict:
    req, watch, t0 = submit(scheduler, rng.integers(1, args.vocab, args.side_tokens).tolist(), args.side_answer)
    return {"phase": phase, "watch": watch, "t0": t0}


def run_long(scheduler: Scheduler, args, prompt: list[int], rng, sides: bool) -> dict:
    """The long request, and with `sides` its side calls (module docstring); one row of figures."""
    device = scheduler.engine.weights.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _, watch, t0 = submit(scheduler, prompt, args.answer)
    calls = []
    if sides:
        while scheduler.engine.joining is None and not watch.times:  # its prefill has begun
            time.sleep(0.001)
        calls += [_side(scheduler, args, rng, "prefill") for _ in range(args.side_calls)]
        while len(watch.times) < 2 and not watch.done.is_set():  # its answer streams
            time.sleep(0.001)
        calls += [_side(scheduler, args, rng, "decode") for _ in range(args.side_calls)]
    final = watch.wait(args.timeout)
    if final.error:
        raise RuntimeError(f"the long request failed: {final.error}")
    out_sides = []
    for call in calls:
        ev: Watch = call["watch"]
        last = ev.wait(args.timeout)
        if last.error:
            raise RuntimeError(f"a side call failed: {last.error}")
        out_sides.append({"phase": call["phase"], "ttft_s": ev.times[0] - call["t0"],
                          "latency_s": ev.times[-1] - call["t0"]})
    timing = final.timing
    gaps = np.diff(watch.times) if len(watch.times) > 1 else np.zeros(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"prompt_tokens": len(prompt), "ttft_s": watch.times[0] - t0, "prefill_s": timing.prefill_s,
            "prefill_tokens_per_s": timing.prefill_tokens_per_s, "answer_tokens": final.completion_tokens,
            "decode_tokens_per_s": timing.decode_tokens_per_s, "worst_gap_s": float(gaps.max()),
            "sides": out_sides,
            "device_peak_gb": torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else 0.0}


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    device = torch.device(args.device)
    config = decoders.qwen3_30b_like(args.layers, vocab_size=args.vocab)
    if args.small:
        config = {**config, **SMALL}
    max_seq_len = args.prompt_tokens + args.answer
    weights = decoders.random_decoder(config, device, seed=args.seed, expert_format=args.expert_format)
    spec = weights.spec
    need = context_bytes(spec, args.max_batch, max_seq_len)  # allocated after the weights, as load_model does
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else need
    if need > free:
        raise SystemExit(f"the KV cache of --max-batch {args.max_batch} rows x (--prompt-tokens {args.prompt_tokens} "
                         f"+ --answer {args.answer}) positions needs {need / GB:.3g} GiB, more than the "
                         f"{free / GB:.3g} GiB free: lower --max-batch or --prompt-tokens")
    slots = max(args.max_batch * spec.moe.top_k, round(args.slots_frac * spec.num_moe_layers * spec.moe.num_experts))
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        tokenizer = TextTokenizer(write_word_tokenizer(Path(tmp), args.vocab))
    engine = Engine(weights, make_backend(weights, slots, "lru", max_batch=args.max_batch), max_batch=args.max_batch,
                    max_seq_len=max_seq_len, prefill_chunk=args.prefill_chunk)
    scheduler = Scheduler(engine, tokenizer, decode_share=args.decode_share)
    machine = benchmeta.machine() if device.type == "cuda" else benchmeta.cpu_machine()
    doc = {"bench": "long_context", "machine": machine,
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "expert_format": spec.moe.expert_format,
           "expert_bytes": weights.store.bytes_per_expert, "slots": slots,
           "kv_cache_gb": need / GB, "runs": {}}
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(1, args.vocab, args.prompt_tokens).tolist()
    scheduler.start()
    try:
        submit(scheduler, rng.integers(1, args.vocab, args.side_tokens).tolist(), 2)[1].wait(args.timeout)
        for name in ("alone", "sides"):
            doc["runs"][name] = run_long(scheduler, args, prompt, rng, sides=name == "sides")
            _write(doc, args.out)
    finally:
        scheduler.stop(timeout=30)
        doc["finished"] = dict(scheduler.stats.finished)
        _write(doc, args.out)
    report(doc)
    return doc


def report(doc: dict) -> None:
    print("run    prompt  ttft s  prefill tok/s  decode tok/s  worst gap s  side calls: phase ttft / latency s")
    for name, r in doc["runs"].items():
        sides = ", ".join(f"{s['phase']} {s['ttft_s']:.2f}/{s['latency_s']:.2f}" for s in r["sides"])
        print(f"{name:6s} {r['prompt_tokens']:7d} {r['ttft_s']:7.2f} {r['prefill_tokens_per_s']:14.1f} "
              f"{r['decode_tokens_per_s']:13.1f} {r['worst_gap_s']:12.3f}  {sides}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=262144)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK)
    ap.add_argument("--decode-share", type=float, default=DECODE_SHARE,
                    help="the streaming rows' least share of the time while the long prompt joins (serve's flag)")
    ap.add_argument("--side-calls", type=int, default=3, help="side calls during the prefill, and again during decode")
    ap.add_argument("--side-tokens", type=int, default=512)
    ap.add_argument("--side-answer", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a request may take before the run fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    for name in ("layers", "vocab", "max_batch", "prompt_tokens", "answer", "prefill_chunk", "side_tokens",
                 "side_answer"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.side_calls < 0:
        ap.error("--side-calls must be >= 0")
    if args.side_calls >= args.max_batch:
        ap.error(f"--side-calls {args.side_calls} need as many rows beside the long one: raise --max-batch above it")
    if not 0 < args.slots_frac <= 1:
        ap.error("--slots-frac must be in (0, 1]")
    if not 0 <= args.decode_share < 1:
        ap.error("--decode-share must be >= 0 and < 1")
    return args


if __name__ == "__main__":
    main()
