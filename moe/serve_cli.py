"""`expertcache serve`: serve a Hugging Face MoE checkpoint over an OpenAI-compatible HTTP API.

    --model DIR ─► TextTokenizer (tokenizer.json, chat template) + load_model (weights, expert cache of
    --moe-slots slots under --moe-cache-policy, --max-batch rows of --max-seq-len tokens)
    ─► Scheduler (continuous batching thread) ─► uvicorn on --host:--port until SIGINT / SIGTERM
    --record-routing PATH: the decode routing of every request, an expertcache-trace/1 file written
    at shutdown, for `expertcache sim PATH`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from expertcache import policy_names
from moe.config import DTYPES
from sim.replay import ORACLES

if TYPE_CHECKING:
    from moe.server import ServeState

# torch, the model and the HTTP stack are imported when `serve` runs, so that `expertcache sim`
# (and --help) start without them.


def serve_policies() -> list[str]:
    """Policies a server can run: the registry's, without the simulator's oracles (they need the future)."""
    return sorted(p for p in policy_names() if p not in ORACLES)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint directory: config.json, *.safetensors, tokenizer.json, tokenizer_config.json")
    p.add_argument("--moe-cache-policy", default="lru", choices=serve_policies(), help="eviction policy (default lru)")
    p.add_argument("--moe-slots", type=int, required=True, metavar="N",
                   help="expert slots of the pool (at least --max-batch x top_k)")
    p.add_argument("--moe-copy-overlap", action="store_true",
                   help="GPU: run the shared expert on a side stream while misses copy")
    p.add_argument("--device", help="cpu or cuda[:i] (default cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, help="model dtype (default: config.json's)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context: prompt + new tokens (default 2048)")
    p.add_argument("--served-model-name", help="model id of the API (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--record-routing", metavar="PATH", help="write the decode routing as a trace (.npz) at shutdown")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish at shutdown (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--max-batch", args.max_batch), ("--max-seq-len", args.max_seq_len),
                        ("--moe-slots", args.moe_slots)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    if not Path(args.model).is_dir():
        raise SystemExit(f"error: --model {args.model} is not a directory: pass a downloaded checkpoint")
    if args.record_routing and not Path(args.record_routing).resolve().parent.is_dir():
        raise SystemExit(f"error: --record-routing {args.record_routing}: its folder does not exist")


def build_state(args: argparse.Namespace) -> ServeState:
    """Tokenizer, engine, scheduler and options from the parsed flags. Raises SystemExit naming the flag
    or file on a bad value, a checkpoint that cannot be served or a pool that does not fit."""
    import torch

    from moe.model import load_model
    from moe.scheduler import Scheduler
    from moe.server import ServeOptions, ServeState
    from moe.spec import CheckpointError
    from moe.tokenizer import TextTokenizer, TokenizerError

    _check(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = TextTokenizer(args.model)
        engine = load_model(args.model, device, num_slots=args.moe_slots, policy=args.moe_cache_policy,
                            dtype=args.dtype, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                            record_routing=bool(args.record_routing),
                            copy_overlap=True if args.moe_copy_overlap else None)
    except (CheckpointError, TokenizerError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if tokenizer.vocab_size > engine.spec.vocab_size:
        raise SystemExit(f"error: {args.model}/tokenizer.json has {tokenizer.vocab_size} tokens but config.json "
                         f"vocab_size is {engine.spec.vocab_size}: the tokenizer belongs to another model")
    name = args.served_model_name or Path(args.model).resolve().name
    options = ServeOptions(served_name=name, max_seq_len=args.max_seq_len, api_key=args.api_key,
                           record_routing=Path(args.record_routing) if args.record_routing else None,
                           trace_meta={"policy": args.moe_cache_policy, "slots": args.moe_slots,
                                       "max_batch": args.max_batch},
                           shutdown_timeout=args.shutdown_timeout)
    return ServeState(Scheduler(engine, tokenizer), tokenizer, options)


def run(args: argparse.Namespace) -> int:
    from moe.server import make_server

    state = build_state(args)
    spec = state.scheduler.engine.spec
    print(f"serving {state.options.served_name} ({spec.model_type}, {spec.num_moe_layers} MoE layers x "
          f"{spec.moe.num_experts} experts, top-{spec.moe.top_k}) on http://{args.host}:{args.port} with "
          f"{args.moe_slots} slots, policy {args.moe_cache_policy}, device {state.scheduler.engine.weights.device}",
          flush=True)
    make_server(state, args.host, args.port, args.log_level).run()
    if state.options.record_routing is not None:
        print(f"routing trace: {state.options.record_routing} (replay: expertcache sim "
              f"{state.options.record_routing} --policies {args.moe_cache_policy} --slots {args.moe_slots})")
    return 0
