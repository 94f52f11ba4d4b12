"""`expertcache serve`: serve a Hugging Face MoE checkpoint over OpenAI- and Anthropic-compatible HTTP APIs.

    --model DIR ─► TextTokenizer (tokenizer.json, chat template) + load_model (weights, expert cache of
    --moe-slots slots, or of the slots --moe-cache-gb GiB hold (moe.engine.budget, resolved from
    config.json before the weights load) of experts in --moe-expert-format, under --moe-cache-policy,
    --max-batch rows of --max-seq-len)
    ─► Scheduler (continuous batching thread) ─► uvicorn on --host:--port until SIGINT / SIGTERM
    --record-routing PATH: the decode routing of every request, an expertcache-trace/1 file written
    at shutdown, for `expertcache sim PATH`.

Access: the server listens on loopback unless --host says otherwise. With an API key (from
--api-key-file, or --api-key, which other users of the machine can read in `ps`, else the
EXPERTCACHE_API_KEY environment variable), /v1/* and /metrics need 'Authorization: Bearer KEY'
(or 'x-api-key: KEY'); /health is always open, and /metrics is open with --metrics-public.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from expertcache import policy_names
from expertcache.formats import format_names
from expertcache.split import MISS_SERVICE_CHOICES
from expertcache.words import counted
from moe.model.config import DTYPES

if TYPE_CHECKING:
    from moe.serve.server import ServeState

API_KEY_ENV = "EXPERTCACHE_API_KEY"
DEFAULT_MAX_SEQ_LEN = 2048

# torch, the model and the HTTP stack are imported when `serve` runs, so that `expertcache sim`
# (and --help) start without them.


DESCRIPTION = """\
Serve a Hugging Face MoE checkpoint over an OpenAI-compatible HTTP API
(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) and
Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens; /v1/models in
Anthropic's form for a request with an anthropic-version header).
Every routed expert stays in host memory; a pool of expert slots on the GPU
(--moe-slots, or --moe-cache-gb) holds those in use, evicted by
--moe-cache-policy. Without a GPU (--device cpu) the same cache runs on the CPU.

example:
  hf download Qwen/Qwen1.5-MoE-A2.7B --local-dir models/Qwen1.5-MoE-A2.7B
  expertcache serve --model models/Qwen1.5-MoE-A2.7B --moe-cache-gb 8
"""
EPILOG = f"""\
The server listens on 127.0.0.1 unless --host says otherwise. With an API key
(--api-key-file, --api-key or ${API_KEY_ENV}), /v1/* and /metrics need
the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY'); /health is
always open. SIGINT or SIGTERM stops it once the open requests finish
(--shutdown-timeout)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over OpenAI- and Anthropic-compatible HTTP APIs",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model and expert cache")
    model.add_argument("--model", required=True, metavar="DIR",
                       help="checkpoint directory: config.json, *.safetensors, tokenizer.json, "
                            "tokenizer_config.json (hf download REPO --local-dir DIR)")
    size = model.add_mutually_exclusive_group(required=True)
    size.add_argument("--moe-slots", type=int, metavar="N",
                      help="expert slots of the pool (at least --max-batch x top_k, at most L x E)")
    size.add_argument("--moe-cache-gb", type=float, metavar="GIB",
                      help="slot memory in GiB (2**30 bytes) instead: floor(GIB * 2**30 / bytes per expert) "
                           "slots, at most L x E")
    model.add_argument("--moe-cache-policy", default="lru", choices=policy_names(),
                       help="eviction policy of the slots (default lru)")
    model.add_argument("--moe-expert-format", choices=format_names(),
                       help="how the routed experts are stored in host memory and the slots (default: as the "
                            "checkpoint stores them: its quantization's format, else the model dtype); another "
                            "format is made on load by round-to-nearest quantization (docs/formats.md)")
    model.add_argument("--moe-miss-service", default="copy", choices=MISS_SERVICE_CHOICES,
                       help="how misses are served: copy (every miss into a slot, default), hybrid (each "
                            "layer's misses split between the link and the CPU so both finish together, balanced "
                            "from both measured at start, docs/hybrid.md), cpu (every routed expert computed on "
                            "the CPU), auto (measures both at start and picks hybrid where it is predicted "
                            "faster, else copy; logged)")
    model.add_argument("--cpu-threads", type=int, metavar="N",
                       help="threads of the CPU expert kernels (default: every core; on a GPU with hybrid, "
                            "cpu or auto, every core but two)")
    model.add_argument("--moe-copy-overlap", action="store_true",
                       help="GPU: run the shared expert on a side stream while misses copy")
    model.add_argument("--device", metavar="DEVICE", help="cpu, cuda or cuda:INDEX (default cuda when available)")
    model.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                       help="processes the routed experts are spread over (default 1): expert e is cached by "
                            "rank e %% N, each rank with its own --moe-slots / --moe-cache-gb, the ranks' sums "
                            "added in rank order; attention and the dense weights run on every rank. N > 1 runs "
                            "on the CPU backend with --moe-miss-service copy (docs/serving.md)")
    model.add_argument("--dtype", choices=DTYPES, help="model dtype (default: config.json's)")
    model.add_argument("--max-batch", type=int, default=8, metavar="N",
                       help="sequences decoded together (default 8); more requests wait in order")
    model.add_argument("--max-seq-len", type=int, metavar="TOKENS",
                       help=f"context: prompt + new tokens (default {DEFAULT_MAX_SEQ_LEN}, or the model's "
                            "max_position_embeddings when that is smaller)")
    model.add_argument("--kv-cache-gb", type=float, metavar="GIB",
                       help="device memory in GiB kept for prompt prefixes (default none): a request that starts "
                            "with a kept prefix (an agent resending its conversation) computes only the rest; "
                            "kept in blocks of 64 tokens, the least recently used evicted; reported as "
                            "usage.prompt_tokens_details.cached_tokens (docs/serving.md)")
    model.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                       help="prompt tokens a prefill pass takes at once (default 16384); a longer prompt "
                            "runs in chunks, between which the rows already streaming take a decode step; with "
                            "--kv-cache-gb a multiple of its 64-token blocks")
    model.add_argument("--decode-share", type=float, metavar="FRACTION",
                       help="while a long prompt prefills chunk by chunk, the least share of the time the rows "
                            "already streaming get (default 0.2; 0 <= FRACTION < 1): short requests that join "
                            "meanwhile answer within a chunk or two; 0 gives one decode step a chunk")
    model.add_argument("--record-routing", metavar="PATH",
                       help="write the decode routing as a trace (.npz) at shutdown, for expertcache sim PATH")
    _add_http_flags(p)
    p.set_defaults(func=run)


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    http = p.add_argument_group("HTTP server")
    http.add_argument("--served-model-name", metavar="NAME", help="model id of the API (default: the directory name)")
    http.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000,
                      help="port (default 8000; 0 takes a free one, printed on the 'serving' line); bound "
                           "before the model loads, so a port in use fails at once")
    key = http.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", metavar="PATH",
                     help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 and /metrics, KEY "
                          "read from this file "
                          f"(default: the {API_KEY_ENV} environment variable, if set)")
    key.add_argument("--api-key", metavar="KEY", help="the same with KEY on the command line (visible in `ps`: "
                                                      f"prefer --api-key-file or {API_KEY_ENV})")
    http.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    http.add_argument("--max-body-mb", type=float, default=8.0, metavar="MIB",
                      help="largest request body in MiB (default 8); larger ones get 413")
    http.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="seconds a client has to send a whole request, headers and body (default 30)")
    http.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                      help="seconds an idle keep-alive connection stays open (default 5)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="seconds open requests get to finish at shutdown before they end with a 503 "
                           "shutting_down error (default 30)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                      help="server log level (default info); a request that ends in a 500 is logged with its "
                           "traceback at error")


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--max-batch", args.max_batch), ("--max-seq-len", args.max_seq_len),
                        ("--moe-slots", args.moe_slots)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    for flag, value in (("--moe-cache-gb", args.moe_cache_gb), ("--kv-cache-gb", args.kv_cache_gb)):
        if value is not None and not 0 < value < math.inf:
            raise SystemExit(f"error: {flag} must be a number of GiB > 0, got {value}")
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--read-timeout", args.read_timeout),
                        ("--keep-alive-timeout", args.keep_alive_timeout)):
        if not value > 0:
            raise SystemExit(f"error: {flag} must be > 0, got {value}")
    if args.decode_share is not None and not 0 <= args.decode_share < 1:
        raise SystemExit(f"error: --decode-share must be >= 0 and < 1, got {args.decode_share}")
    if not args.shutdown_timeout >= 0:
        raise SystemExit(f"error: --shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.tensor_parallel < 1:
        raise SystemExit(f"error: --tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be 0 to 65535 (0: a free one), got {args.port}")
    if not Path(args.model).is_dir():
        raise SystemExit(f"error: --model {args.model} is not a directory: pass a downloaded checkpoint, e.g. "
                         f"from the Hugging Face Hub with `hf download REPO --local-dir {args.model}`")
    if args.record_routing and not Path(args.record_routing).resolve().parent.is_dir():
        raise SystemExit(f"error: --record-routing {args.record_routing}: its folder does not exist")


def api_key(args: argparse.Namespace) -> str | None:
    """The API key: --api-key-file's contents (stripped) or --api-key, else $EXPERTCACHE_API_KEY, else
    None (open). Raises SystemExit naming the flag for an unreadable or empty key file or an empty key."""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"error: --api-key-file {args.api_key_file}: cannot be read ({e})") from None
        source = f"--api-key-file {args.api_key_file}"
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV].strip(), API_KEY_ENV
    else:
        return None
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise SystemExit(f"error: {source}: the API key must be one non-empty word of printable characters")
    return key


def resolve_device(flag: str | None):
    """torch.device of --device: cpu or cuda[:i] (default cuda when available). Raises SystemExit naming
    --device for another name, a CUDA device without CUDA, or an index beyond the GPUs present."""
    import torch

    if flag is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", flag.strip())
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise SystemExit(f"error: --device {flag!r}: expected cpu, cuda or cuda:INDEX")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise SystemExit(f"error: --device {flag}: no CUDA GPU is available (torch {torch.__version__}, {build}); "
                         "pass --device cpu or run where a GPU is visible")

    index, count = int(m.group(2) or 0), torch.cuda.device_count()
    if index >= count:
        raise SystemExit(f"error: --device {flag}: this machine has {counted(count, 'CUDA device')}: use cuda:0"
                         f"{f' to cuda:{count - 1}' if count > 1 else ''}")
    return torch.device("cuda", index)


def _context(args: argparse.Namespace) -> int:
    """--max-seq-len, or its default, within config.json's max_position_embeddings (the positions the
    model was trained for; beyond them its rotary positions are out of distribution). Raises SystemExit."""
    from moe.model.spec import read_config

    limit = read_config(args.model).get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return args.max_seq_len or DEFAULT_MAX_SEQ_LEN
    if args.max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit)
    if args.max_seq_len > limit:
        raise SystemExit(f"error: --max-seq-len {args.max_seq_len} is above the model's max_position_embeddings "
                         f"({limit}, config.json): pass --max-seq-len {limit} or less")
    return args.max_seq_len


def build_state(args: argparse.Namespace) -> ServeState:
    """Tokenizer, engine, scheduler and options from the parsed flags. Raises SystemExit naming the flag
    or file on a bad value, a checkpoint that cannot be served or a pool that does not fit."""
    from expertcache.ranks import local_experts
    from moe.engine.budget import check_slots, prefix_blocks_for, resolve_slots
    from moe.engine.engine import PREFILL_CHUNK
    from moe.engine.loading import load_model
    from moe.engine.prefix import PREFIX_BLOCK_TOKENS
    from moe.engine.ranked import free_init_method, load_ranked
    from moe.model.errors import CheckpointError
    from moe.model.spec import ModelSpec, read_config
    from moe.serve.http_guard import GuardOptions
    from moe.serve.scheduler import DECODE_SHARE, Scheduler
    from moe.serve.server import ServeOptions, ServeState
    from moe.serve.tokenizer import TextTokenizer, TokenizerError

    _check(args)
    key = api_key(args)
    device = resolve_device(args.device)
    try:
        max_seq_len = _context(args)
        spec = ModelSpec.from_hf(read_config(args.model), dtype=args.dtype, expert_format=args.moe_expert_format)
        ranks = _check_ranks(args, spec, device)
        # every rank holds the same slots: at most the fewest keys a rank has, at least what the most need
        budget = resolve_slots(spec, args.moe_slots, args.moe_cache_gb, max_batch=args.max_batch,
                               experts=None if ranks == 1 else local_experts(spec.moe.num_experts, ranks, ranks - 1))
        if ranks > 1:
            most = local_experts(spec.moe.num_experts, ranks, 0)
            check_slots(budget.slots, spec.num_moe_layers, most, min(spec.moe.top_k, most), args.max_batch)
        blocks = 0 if args.kv_cache_gb is None else prefix_blocks_for(spec, args.kv_cache_gb, PREFIX_BLOCK_TOKENS,
                                                                      max_seq_len)
        tokenizer = TextTokenizer(args.model)
        load = dict(device=device, num_slots=budget.slots, policy=args.moe_cache_policy,
                    dtype=args.dtype, expert_format=args.moe_expert_format, max_batch=args.max_batch,
                    max_seq_len=max_seq_len,
                    record_routing=bool(args.record_routing),
                    copy_overlap=True if args.moe_copy_overlap else None,
                    miss_service=args.moe_miss_service, cpu_threads=args.cpu_threads,
                    prefix_blocks=blocks, prefix_block_tokens=PREFIX_BLOCK_TOKENS,
                    prefill_chunk=PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk)
        followers = []
        if ranks == 1:
            engine = load_model(args.model, **load)
        else:
            engine, followers = load_ranked(args.model, ranks, free_init_method(), load)
    except (CheckpointError, TokenizerError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if tokenizer.vocab_size > engine.spec.vocab_size:
        raise SystemExit(f"error: {args.model}/tokenizer.json has {tokenizer.vocab_size:,} tokens but config.json "
                         f"vocab_size is {engine.spec.vocab_size:,}: the tokenizer belongs to another model")
    name = args.served_model_name or Path(args.model).resolve().name
    guard = GuardOptions(api_key=key, metrics_public=args.metrics_public,
                         max_body_bytes=int(args.max_body_mb * 2**20))
    options = ServeOptions(served_name=name, max_seq_len=max_seq_len, guard=guard,
                           record_routing=Path(args.record_routing) if args.record_routing else None,
                           trace_meta={"policy": args.moe_cache_policy, "slots": budget.slots,
                                       "max_batch": args.max_batch},
                           shutdown_timeout=args.shutdown_timeout, read_timeout=args.read_timeout,
                           keep_alive_timeout=args.keep_alive_timeout, slot_budget=budget)
    share = DECODE_SHARE if args.decode_share is None else args.decode_share
    state = ServeState(Scheduler(engine, tokenizer, decode_share=share), tokenizer, options)
    state.followers = followers
    return state


def _ranks_note(ranks: int) -> str:
    return "" if ranks == 1 else f" on each of {ranks} ranks (expert e on rank e % {ranks})"


def _check_ranks(args: argparse.Namespace, spec, device) -> int:
    """--tensor-parallel N, checked against the model and the other flags. Raises ValueError naming them."""
    ranks = args.tensor_parallel
    if ranks == 1:
        return 1
    if ranks > spec.moe.num_experts:
        raise ValueError(f"--tensor-parallel {ranks} is above the model's {spec.moe.num_experts} experts a layer: "
                         f"a rank would own none")
    if device.type != "cpu":
        raise ValueError(f"--tensor-parallel {ranks} runs on the CPU backend: pass --device cpu")
    if args.moe_miss_service != "copy":
        raise ValueError(f"--tensor-parallel {ranks} serves misses by copy: drop --moe-miss-service "
                         f"{args.moe_miss_service}")
    return ranks


def _access(state: ServeState) -> str:
    guard = state.options.guard
    if guard.api_key is None:
        return "no API key: every endpoint is open"
    return f"API key required on /v1/*{'' if guard.metrics_public else ' and /metrics'}; /health is open"


@contextmanager
def serve_logging(level: str):
    """For the with-block, show the records of the package's loggers (moe.*, expertcache.*) on stderr as
    uvicorn shows its own: warnings and errors (a request that ended in a 500, with its traceback) at
    --log-level info and warning, every record at debug, only errors (critical ones) at error (critical)."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
    chosen = logging.getLevelName(level.upper())
    loggers = [logging.getLogger(name) for name in ("moe", "expertcache")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(chosen if chosen == logging.DEBUG else max(chosen, logging.WARNING))
    try:
        yield
    finally:
        for log, old in zip(loggers, levels):
            log.removeHandler(handler)
            log.setLevel(old)


def run(args: argparse.Namespace) -> int:
    cpu_worker_env(args.moe_miss_service)
    with serve_logging(args.log_level):
        return _serve(args)


def cpu_worker_env(service: str) -> None:
    """Before torch loads: where the CPU computes misses, torch's OpenMP threads sleep between parallel
    regions instead of spinning (OMP_WAIT_POLICY=PASSIVE, unless set), so they leave the cores to the CPU
    experts' pool and the decode's launching and hand-off threads (docs/hybrid.md has the measurement)."""
    if service in ("hybrid", "cpu", "auto"):  # auto may pick hybrid
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket on host:port (port 0: a free one the system picks), bound before the
    model loads so that a port in use or an address not on this machine fails in a second, not after
    the load. Raises SystemExit naming --host / --port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"error: --host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebind past TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: --host {host} --port {port}: cannot listen there ({e.strerror}): pass another "
                         "--port (0 takes a free one) or stop the process that holds it") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    _check(args)  # the flags first, then the port, then the load (build_state)
    sock = listen(args.host, args.port)
    try:
        return _serve_on(args, sock)
    finally:
        sock.close()


def _serve_on(args: argparse.Namespace, sock: socket.socket) -> int:
    from moe.engine.budget import memory_split
    from moe.engine.ranked import stop_ranked
    from moe.serve.server import make_server

    state = build_state(args)
    port = sock.getsockname()[1]
    engine = state.scheduler.engine
    spec, slots = engine.spec, state.options.slot_budget.slots
    print(state.options.slot_budget.describe(), flush=True)
    prefix = engine.prefix
    kept = {} if prefix is None else {"prefix_blocks": prefix.num_blocks, "prefix_block_tokens": prefix.block_tokens}
    print(memory_split(state.options.slot_budget, spec, engine.max_batch, engine.max_seq_len, **kept,
                       scratch_slots=engine.moe.extra_slots), flush=True)
    if args.moe_miss_service != "copy":
        print(engine.miss_service, flush=True)
    print(f"serving {state.options.served_name} ({spec.model_type}, {counted(spec.num_moe_layers, 'MoE layer')} x "
          f"{counted(spec.moe.num_experts, 'expert')}, top-{spec.moe.top_k}) on http://{_netloc(args.host, port)} with "
          f"{counted(slots, 'slot')}{_ranks_note(args.tensor_parallel)}, policy {args.moe_cache_policy}, "
          f"device {engine.weights.device}; "
          f"{_access(state)}", flush=True)
    try:
        make_server(state, args.host, port, args.log_level).run(sockets=[sock])
    finally:
        if state.followers:
            codes = stop_ranked(engine, state.followers)
            print(f"ranks 1-{len(codes)} stopped, exit codes {codes}", flush=True)
    if state.options.record_routing is not None:
        print(f"routing trace: {state.options.record_routing} (replay: expertcache sim "
              f"{state.options.record_routing} --policies {args.moe_cache_policy} --slots {slots})")
    return 0
