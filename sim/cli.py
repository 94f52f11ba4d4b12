"""`expertcache sim`: replay routing traces through policies and slot counts, and report.

    flags checked (--policies, --tokens, --seed, --workers, --plot's folder)
    -> TRACE ... (.npz, a FreeToken-style directory, or .jsonl; sim/inputs.py) | --preset NAME
       (synthetic) | neither: the embedded default, a real gemma-4 decode trace (sim/data)
    -> slot counts checked against each trace (largest call <= slots <= L*E keys), or with
       --moe-cache-gb G per expert format (--expert-format) from the budget (sim/budget.py)
    -> sweep (policy x slots, parallel processes; with --ranks N, each rank count: sim/ranks.py)
    -> table / JSON / PNG / per-layer view

Every check runs before the first replay; a failure ends the command with
"error: <what, naming the flag or field>: <fix>" on stderr and exit status 1.
With no arguments it replays the embedded default, a real gemma-4-26B-A4B decode trace
(Apache-2.0, sim/data/README.md), at 10, 20 and 30 % of its keys as slots; a trace file or a
synthetic preset replays at 25, 50 and 75 % unless --slots / --slots-frac say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from expertcache.errors import EnsureError, PolicyError
from expertcache.words import counted
from sim import synthetic
from sim.budget import (
    BudgetError,
    BudgetFlags,
    FormatRun,
    describe,
    describe_pricing,
    expert_shape,
    parse_flags,
    plan_runs,
    trace_shape,
)
from sim.costmodel import ALLREDUCE_US, H200, H200_SM_COPY, HardwareProfile, format_profile
from sim.errors import TraceError, TraceWarning
from sim.inputs import DEFAULT_TRACE_FRACS, DEFAULT_TRACE_LABEL, default_trace, load_any, synthetic_config
from sim.jsonl import FIELDS_HELP
from sim.ranks import describe_ranks, min_rank_slots, sweep_ranks
from sim.replay import (
    COMPILE_NOTICE,
    ORACLES,
    announce_compiles,
    check_policies,
    check_replayable,
    sim_policy_names,
    sweep,
    sweep_splits,
)
from sim.report import (
    build_format_rows,
    build_rows,
    format_budget_table,
    format_choices,
    format_per_layer,
    format_table,
    plot_hit_rate,
)
from sim.service import (
    DEFAULT_HOST,
    HOSTS,
    HostProfile,
    check_services,
    format_service_choices,
    format_service_table,
    service_rows,
    split_for,
)
from sim.trace import Trace

DEFAULT_POLICIES = "lru,rule,lfuda,markov,next-token,belady"  # every policy and both oracles
DEFAULT_FRACS = "0.25,0.5,0.75"
PROFILES = {  # --profile: which H200 cost model prices the misses and the layer (sim/costmodel.py)
    "engine": H200_SM_COPY,  # this engine's measured path: the SM miss copy and its MoE layer's time
    "copy-engine": H200,  # the copy engine's speeds and an assumed per-layer overhead
}


DESCRIPTION = """\
Replay routing traces through the cache policies at several slot counts: the hit rate, the misses and
bytes copied a token, the share of the gap from lru to Belady's optimum each policy recovers, and a
modeled decode speed on an H200; under the table, the policy to choose at each slot count.

With no trace it replays the embedded default, a real gemma-4-26B-A4B decode trace (Apache-2.0,
sim/data/README.md), at 10, 20 and 30 % of its keys as slots; a trace file or a synthetic --preset
replays at 25, 50 and 75 % unless --slots or --slots-frac say otherwise. A bad flag or trace ends the
command before any replay with "error: <what, naming the flag or field>: <fix>" and exit status 1.

  expertcache sim                                    the embedded default
  expertcache sim run.npz --slots 64,128 --json      a recorded trace (expertcache serve --record-routing)
  expertcache sim --preset qwen3-30b-a3b --moe-cache-gb 8 --expert-format bf16,nvfp4
  expertcache sim --ranks 1,2                        one GPU and two, the same slots on each
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="replay routing traces through cache policies", description=DESCRIPTION,
                       epilog=FIELDS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", help="trace files (.npz, .jsonl) or FreeToken-style directories")
    p.add_argument("--preset", help="replay a synthetic trace of this preset instead of the embedded "
                   "default, e.g. qwen3-next (sim/synthetic.py)")
    p.add_argument("--tokens", type=int, help="tokens of the --preset trace (>= 1)")
    p.add_argument("--seed", type=int, help="seed of the --preset trace (>= 0, default 0)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated, from: {', '.join(sim_policy_names())}")
    p.add_argument("--slots", help="comma-separated slot counts of one GPU, at most L*E (overrides --slots-frac); "
                   "with --ranks N each GPU has this many")
    p.add_argument("--slots-frac", default=DEFAULT_FRACS, action=_Given,
                   help=f"comma-separated fractions of all experts (L*E) to use as slots on each GPU (default "
                        f"{DEFAULT_FRACS}; the embedded default trace: {DEFAULT_TRACE_FRACS})")
    p.add_argument("--moe-cache-gb", metavar="G[,G...]",
                   help="VRAM budget(s) of the slots in GiB, a GPU: each expert format gets the slots that "
                        "fit (not with --slots / --slots-frac)")
    p.add_argument("--expert-format", metavar="F[,F...]",
                   help="expert formats to price, one row each: bf16, fp8, int4, mxfp4, nvfp4 "
                        "(default with --moe-cache-gb: the trace's, from meta.expert_bytes, else bf16)")
    p.add_argument("--expert-shape", metavar="H,I",
                   help="hidden and MoE intermediate size of a routed expert, when the trace's meta has no "
                        "hidden_size / moe_intermediate_size: it prices the misses (bf16, or at "
                        "meta.expert_bytes) instead of the shape the header says was assumed")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per (policy, slots)")
    p.add_argument("--plot", metavar="PNG", help="write hit rate against slots to this PNG "
                   "(one trace; with several, NAME-0.png, NAME-1.png, ... in the same folder)")
    p.add_argument("--per-layer", action="store_true", help="also print hit rate per layer")
    p.add_argument("--workers", type=int, help="parallel processes (>= 1; default: CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-logits", action="store_true", help="ignore router logits (no near-miss refresh)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="engine",
                   help="cost model of the modeled us/tok and tok/s: 'engine' (default) is this engine on an "
                        "H200 as measured (SM miss copy, its MoE layer's time); 'copy-engine' prices misses "
                        "at cudaMemcpy speeds with an assumed 10 us layer overhead")
    p.add_argument("--miss-service", default="copy,hybrid", metavar="S[,S...]", action=_Given,
                   help="how misses are served, each priced on --host: copy (every miss over the link into a "
                        "slot), hybrid (each call's misses split between the link and the CPU so both finish "
                        "together), cpu (every routed expert on the CPU); default copy,hybrid (copy alone "
                        "with --ranks above 1)")
    p.add_argument("--host", choices=sorted(HOSTS), default=DEFAULT_HOST,
                   help=f"the machine the miss services are priced on (default {DEFAULT_HOST}): its link and "
                        "CPU bandwidths measured together, its GPU's cost model")
    p.add_argument("--link-gbps", type=float, metavar="GB/S",
                   help="the link's bandwidth, for copies alone and beside the CPU kernels, replacing --host's")
    p.add_argument("--cpu-gbps", type=float, metavar="GB/S",
                   help="the CPU kernels' weight-read bandwidth beside the link, replacing --host's")
    p.add_argument("--ranks", default="1", metavar="N[,N...]",
                   help="GPUs of one host to model, expert-parallel (expert e on GPU e %% N, each GPU with the "
                        "slots above and its own link), one row each; default 1; give 1,2 to see what a "
                        "second GPU buys at the same budget a GPU")
    p.add_argument("--allreduce-us", type=float, metavar="US",
                   help=f"microseconds of one all-reduce between the GPUs, two a layer with --ranks above 1 "
                        f"(default {ALLREDUCE_US:g}: NCCL's small-message latency over NVLink, assumed; cards "
                        f"on PCIe alone are slower)")
    p.set_defaults(func=run)


def _fail(message: object) -> NoReturn:
    raise SystemExit(f"error: {message}")


def _say(line: str):
    """A callable printing `line` on stderr at once (before a compile that keeps the command silent)."""
    return lambda: print(line, file=sys.stderr, flush=True)


class _Given(argparse.Action):
    """Store the value and note that the flag was given (`<dest>_given`), its default aside."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _budget_flags(args: argparse.Namespace) -> BudgetFlags:
    """The checked --expert-format / --moe-cache-gb / --expert-shape; a budget excludes slot flags."""
    if args.moe_cache_gb is not None:
        given = [f for f, on in (("--slots", args.slots is not None),
                                 ("--slots-frac", getattr(args, "slots_frac_given", False))) if on]
        if given:
            _fail(f"--moe-cache-gb and {given[0]} both set the slot count: give --moe-cache-gb G to "
                  f"turn a VRAM budget into slots per expert format, or {given[0]} alone")
    try:
        return parse_flags(args.expert_format, args.moe_cache_gb, args.expert_shape)
    except BudgetError as exc:
        _fail(exc)


def _policies(text: str) -> list[str]:
    """The distinct names of --policies, in order, each a known policy."""
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names:
        _fail(f"--policies names no policy (got {text!r}): give comma-separated names from "
              f"{', '.join(sim_policy_names())}")
    try:
        check_policies(names)
    except PolicyError as exc:
        _fail(exc)
    return names


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse out-of-range --tokens, --seed, --workers and a trace given with synthetic flags."""
    synth_flags = [f for f, v in (("--preset", args.preset), ("--tokens", args.tokens),
                                  ("--seed", args.seed)) if v is not None]
    if args.traces and synth_flags:
        _fail(f"give trace files or {'/'.join(synth_flags)}, not both: drop {synth_flags[0]} to "
              f"replay the files, or the files to replay a synthetic trace")
    if args.tokens is not None and args.tokens < 1:
        _fail(f"--tokens must be an integer >= 1, got {args.tokens}: give the decode steps of "
              f"the synthetic trace, or leave it out for the preset's")
    if args.seed is not None and args.seed < 0:
        _fail(f"--seed must be an integer >= 0, got {args.seed}: the generator (numpy PCG64) "
              f"takes non-negative seeds")
    if args.workers is not None and args.workers < 1:
        _fail(f"--workers must be an integer >= 1, got {args.workers}: give a process count, "
              f"or leave it out for the CPU count")
    if args.preset is None and not args.traces and synth_flags:
        _fail(f"{synth_flags[0]} sets up a synthetic trace: add --preset NAME (e.g. --preset qwen3-next), "
              f"or drop {synth_flags[0]} to replay the embedded default trace")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{flag} takes comma-separated integers, got {text!r}: e.g. {flag} 64,128")
    if not vals or min(vals) < 1:
        _fail(f"{flag} needs positive integers, got {text!r}: e.g. {flag} 64,128")
    return sorted(set(vals))


def _fracs(text: str) -> list[float]:
    try:
        fracs = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"--slots-frac takes comma-separated numbers, got {text!r}: e.g. --slots-frac "
              f"0.25,0.5")
    if not fracs or not all(0 < f <= 1 for f in fracs):
        _fail(f"--slots-frac needs fractions in (0, 1], got {text!r}: e.g. --slots-frac 0.25,0.5; "
              f"use --slots for absolute counts")
    return fracs


def _plot_paths(args: argparse.Namespace, count: int) -> list[Path]:
    """The PNG path of each of `count` traces; refuses a folder that is missing or read-only."""
    if not args.plot:
        return []
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(args.plot)
    if path.is_dir():
        _fail(f"--plot {path} is a folder: give a file name such as {path / 'hit-rate.png'}")
    path = path if path.suffix else path.with_suffix(".png")  # what savefig would write
    kinds = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in kinds:
        _fail(f"--plot {args.plot}: matplotlib cannot write {path.suffix} files: end the name "
              f"with .png (or one of {', '.join('.' + k for k in sorted(kinds))})")
    folder = path.parent
    if not folder.is_dir():
        _fail(f"--plot {args.plot}: folder {folder} does not exist: create it (mkdir -p "
              f"{folder}) or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        _fail(f"--plot {args.plot}: folder {folder} is not writable: choose a folder you can "
              f"write to")
    paths = [path] if count == 1 else [folder / f"{path.stem}-{i}{path.suffix}"
                                       for i in range(count)]
    for p in paths:
        if p.is_dir():
            _fail(f"--plot {p} is a folder: give a file name such as {p / 'hit-rate.png'}")
    return paths


def _embedded(args: argparse.Namespace) -> bool:
    """True when the command replays the embedded default trace (no trace, no --preset)."""
    return not args.traces and args.preset is None


def _slot_request(args: argparse.Namespace) -> tuple[str, list]:
    """("--slots", counts) or ("--slots-frac", fractions), checked; the embedded default trace has
    its own fractions unless --slots-frac is given."""
    if args.slots is not None:
        return "--slots", _ints(args.slots, "--slots")
    given = getattr(args, "slots_frac_given", False)
    return "--slots-frac", _fracs(DEFAULT_TRACE_FRACS if _embedded(args) and not given else args.slots_frac)


def _need(name: str, trace: Trace, ranks: list[int]) -> tuple[int, str]:
    """The fewest slots a GPU replays `trace` on at every rank count (sim.ranks.min_rank_slots) and who asks
    for them; the trace checked for decode steps and --ranks against its experts."""
    try:
        check_replayable(trace)
    except TraceError as exc:
        _fail(f"{name}: {exc}")
    if ranks[-1] > trace.num_experts:
        _fail(f"{name}: --ranks {ranks[-1]} is more than the trace's {counted(trace.num_experts, 'expert')} a "
              f"layer, so a GPU would own none: give --ranks <= {trace.num_experts}")
    needs = {n: min_rank_slots(trace, n) for n in ranks}
    n = max(needs, key=lambda n: (needs[n], -n))
    return needs[n], ("one call of this trace asks" if n == 1 else f"with --ranks {n}, one call of a GPU asks")


def _slots_for(name: str, trace: Trace, request: tuple[str, list], need: tuple[int, str]) -> list[int]:
    """The slot counts a GPU replays `trace` at: each >= `need` (_need) and <= its L*E keys."""
    total = trace.num_layers * trace.num_experts
    flag, values = request
    slots = values if flag == "--slots" else sorted({max(1, round(f * total)) for f in values})
    if slots[-1] > total:
        _fail(f"{name}: --slots {slots[-1]} is more than the trace's {trace.num_layers} x "
              f"{trace.num_experts} = {counted(total, 'key')} (layer, expert): a larger pool never fills; "
              f"give --slots <= {total}, or --slots-frac 1 for all of them")
    fewest, who = need
    if slots[0] < fewest:
        _fail(f"{name}: {flag} gives {counted(slots[0], 'slot')}, too few: {who} for "
              f"{counted(fewest, 'distinct expert')}; give at least {counted(fewest, 'slot')} (e.g. --slots {fewest})")
    return slots


def _synthetic(args: argparse.Namespace) -> tuple[str, Trace]:
    """The --preset trace, its flags checked; the generator's first compile announced on stderr."""
    try:
        cfg = synthetic_config(args.preset, args.tokens, args.seed)
    except ValueError as exc:
        _fail(exc)
    with announce_compiles(_say("compiling the synthetic trace generator (first run only; cached after)")):
        return f"synthetic:{args.preset}", synthetic.generate(cfg)


def _load_file(path: str) -> Trace:
    """load_any, each TraceWarning it raises (tokens an importer dropped) printed as 'warning: ...' on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        trace = load_any(path)
    for w in caught:
        if issubclass(w.category, TraceWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return trace


def _traces(args: argparse.Namespace) -> list[tuple[str, Trace]]:
    if _embedded(args):
        try:
            return [(DEFAULT_TRACE_LABEL, default_trace())]
        except TraceError as exc:
            _fail(exc)
    if not args.traces:
        return [_synthetic(args)]
    out = []
    for path in args.traces:
        try:
            out.append((path, _load_file(path)))
        except TraceError as exc:
            _fail(exc)
        except OSError as exc:
            _fail(f"{path}: cannot be read ({exc.strerror or exc}): check the path and its "
                  f"permissions")
    return out


def _title(name: str, trace: Trace, profile: HardwareProfile, pricing: str | None, ranks: list[int]) -> str:
    """The trace, its source and license, what prices the misses when its meta does not say, the cost model
    (and how rows of several GPUs read)."""
    m = trace.meta
    label = name if name.endswith(m.model) else f"{name}: {m.model}"
    lines = [f"{label}, {counted(trace.num_tokens, 'token')}, {counted(m.num_layers, 'layer')} x "
             f"{counted(m.num_experts, 'expert')}, top-{m.top_k}, batch {trace.batch}, "
             f"{counted(trace.accesses, 'access', 'accesses')}"]
    if not m.source.startswith("synthetic:"):  # a synthetic trace's source is its whole config
        lines.append(f"source: {m.source}; license: {m.license}")
    gpus = describe_ranks(ranks, profile.allreduce_us)
    return "\n".join(lines + ([pricing] if pricing else []) + [f"cost model: {format_profile(profile)}"]
                     + ([gpus] if gpus else []))


def _plan(args: argparse.Namespace, flags: BudgetFlags, request: tuple[str, list] | None,
          ranks: list[int]) -> list[tuple[str, Trace, list[int], list | None]]:
    """(name, trace, slot counts a GPU to replay, FormatRuns or None) of every trace, all checked."""
    plans = []
    for name, trace in _traces(args):
        need = _need(name, trace, ranks)
        slots = [] if request is None else _slots_for(name, trace, request, need)
        runs = None
        try:
            expert_shape(name, trace, flags.shape)  # --expert-shape against the meta's shape and bytes
        except BudgetError as exc:
            _fail(exc)
        if flags.active:
            try:
                runs = plan_runs(name, trace, flags, slots, need[0])
            except BudgetError as exc:
                _fail(exc)
            slots = sorted({s for r in runs for s in r.slots})
        plans.append((name, trace, slots, runs))
    return plans


def _rows(trace: Trace, results: list, runs: list[FormatRun] | None, policies: list[str],
          profile: HardwareProfile, flags: BudgetFlags) -> list:
    if runs is None:
        shape = trace_shape(trace, flags.shape)
        return [r for r in build_rows(trace, results, profile, shape) if r.result.policy in policies]
    return build_format_rows(trace, results, runs, profile, policies)


def _host(args: argparse.Namespace, ranks: list[int]) -> tuple[tuple[str, ...], HostProfile]:
    """The checked --miss-service list (copy alone where --ranks goes above 1 and it was not given; refused
    with a split service there) and the --host profile with --link-gbps / --cpu-gbps applied."""
    try:
        services = check_services(args.miss_service)
    except ValueError as exc:
        _fail(f"{exc}: e.g. --miss-service copy,hybrid")
    splits = [sv for sv in services if sv != "copy"]
    if ranks[-1] > 1 and splits and getattr(args, "miss_service_given", False):
        _fail(f"--miss-service {','.join(splits)} with --ranks {ranks[-1]}: the miss split is not modeled across "
              f"GPUs (they share one host's CPU cores and memory bandwidth): give --miss-service copy, or --ranks 1")
    if ranks[-1] > 1:
        services = ("copy",)
    for flag, v in (("--link-gbps", args.link_gbps), ("--cpu-gbps", args.cpu_gbps)):
        _check_rate(flag, v)
    return services, HOSTS[args.host].with_rates(args.link_gbps, args.cpu_gbps)


def _check_rate(flag: str, v: float | None) -> None:
    if v is not None and not (v > 0 and v < float("inf")):
        _fail(f"{flag} must be a bandwidth in GB/s > 0, got {v}: e.g. {flag} 25")


def _services(trace: Trace, results: list, runs: list[FormatRun] | None, policies: list[str],
              services: tuple[str, ...], host: HostProfile, flags: BudgetFlags, args: argparse.Namespace):
    """(the miss-service table and choices as text, their rows) of one trace: the replays of each split
    service (every policy but next-token, whose own pass has no split), priced beside copy's."""
    splits = [sv for sv in services if sv != "copy"]
    if not splits:
        return "", []
    plans = ([(None, trace_shape(trace, flags.shape), sorted({r.slots for r in results}))] if runs is None
             else [(run, run.shape, list(run.slots)) for run in runs])
    hosts = [host if run is None else host.for_format(run.fmt) for run, _, _ in plans]
    names = [p for p in dict.fromkeys(r.policy for r in results) if p != "next-token"]
    jobs, keys = [], []
    for i, (_run, shape, slots) in enumerate(plans):
        if shape is None:
            continue
        for sv in splits:
            split = split_for(hosts[i], sv, shape, _run)
            for p in names:
                for s in slots:
                    jobs.append((p, s, split))
                    keys.append((i, sv, p, s))
    if not jobs:
        return "miss service: the trace has no expert size to price the services by (--expert-shape H,I)", []
    try:
        done = sweep_splits(trace, jobs, workers=args.workers, progress=not args.no_progress and sys.stderr.isatty(),
                            use_logits=not args.no_logits)
    except (EnsureError, PolicyError, TraceError) as exc:
        _fail(exc)
    rows = []
    for i, (run, shape, slots) in enumerate(plans):
        if shape is None:
            continue
        by = {("copy", r.policy, r.slots): r for r in results}
        by.update({(sv, p, s): r for (j, sv, p, s), r in zip(keys, done) if j == i})
        rows += service_rows(by, shape, hosts[i], services, [p for p in policies if p in names], slots, run,
                             batch=trace.batch)
    text = format_service_table(rows, host, services)
    picks = format_service_choices(rows, ORACLES)
    return text + ("\n" + picks if picks else ""), rows


def _ranks_profile(args: argparse.Namespace) -> tuple[list[int], HardwareProfile]:
    """The checked --ranks counts and the --profile cost model with --link-gbps (its copies at that link,
    as the miss services price them) and --allreduce-us applied."""
    ranks = _ints(args.ranks, "--ranks")
    profile = PROFILES[args.profile]
    if args.link_gbps is not None:
        _check_rate("--link-gbps", args.link_gbps)
        profile = profile.at_link(args.link_gbps)
    if args.allreduce_us is not None:
        if not 0 <= args.allreduce_us < float("inf"):
            _fail(f"--allreduce-us must be microseconds >= 0, got {args.allreduce_us}: e.g. --allreduce-us 10")
        profile = replace(profile, allreduce_us=args.allreduce_us)
    return ranks, profile


def _replays(name: str, trace: Trace, policies: list[str], slots: list[int], ranks: list[int],
             args: argparse.Namespace) -> list:
    """The replays of one trace: every policy at every slot count a GPU, on one GPU (sweep) where --ranks
    has 1 and over each larger rank count (sweep_ranks)."""
    kw = dict(workers=args.workers, progress=not args.no_progress and sys.stderr.isatty(),
              use_logits=not args.no_logits, say_compiling=_say(COMPILE_NOTICE))
    try:
        one = sweep(trace, policies, slots, **kw) if ranks[0] == 1 else []
        return one + sweep_ranks(trace, policies, slots, ranks, **kw)
    except (EnsureError, PolicyError, TraceError) as exc:
        _fail(f"{name}: {exc}")


def run(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    _check_flags(args)
    ranks, profile = _ranks_profile(args)
    services, host = _host(args, ranks)
    flags = _budget_flags(args)
    request = None if flags.budgets is not None else _slot_request(args)
    plots = _plot_paths(args, max(1, len(args.traces)))
    plans = _plan(args, flags, request, ranks)
    refs = [p for p in ("lru", "belady") if p not in policies]
    out_json: list[dict] = []
    for i, (name, trace, slots, runs) in enumerate(plans):
        results = _replays(name, trace, policies + refs, slots, ranks, args)
        rows = _rows(trace, results, runs, policies, profile, flags)
        unique = list({(r.result.policy, r.result.slots, r.result.ranks): r for r in rows}.values())
        one = [r for r in results if r.ranks == 1]
        text, srows = _services(trace, one, runs, policies + refs, services, host, flags, args)
        if args.json:  # each row with its miss services' estimates, where they ran
            by = {(id(r.run), r.policy, r.slots): r for r in srows}
            for r in rows:  # the rank count of every row once the run models several GPUs
                d = {"trace": name, **({"ranks": r.result.ranks} if ranks[-1] > 1 else {}), **r.to_dict()}
                sr = by.get((id(r.run), r.result.policy, r.result.slots)) if r.result.ranks == 1 else None
                if sr is not None:
                    d["miss_service"] = {sv: est.to_dict() for sv, est in sr.estimates.items()}
                out_json.append(d)
        elif runs is None:
            print(format_table(rows, _title(name, trace, profile, describe_pricing(trace, flags.shape), ranks)))
        else:
            pricing = describe_pricing(trace, None) if flags.shape is None else None
            title = _title(name, trace, profile, pricing, ranks) + "\n" + describe(runs, trace, flags.shape)
            print(format_budget_table(rows, title))
        if not args.json and (picks := format_choices(rows, ORACLES)):
            print(picks)
        if text and not args.json:
            print(text)
        if args.per_layer and not args.json:
            print(format_per_layer(unique))
        if plots:
            plot_hit_rate(unique, str(plots[i]), title=f"{Path(name).name}\n{trace.meta.model}")
            print(f"plot: {plots[i]}", file=sys.stderr if args.json else sys.stdout)
        if not args.json:
            print()
    if args.json:
        print(json.dumps(out_json, indent=1))
    return 0
