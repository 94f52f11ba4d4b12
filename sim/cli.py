"""`expertcache sim`: replay routing traces through policies and slot counts, and report.

    TRACE ... (.npz, a FreeToken-style directory, or .jsonl) | --preset NAME (synthetic)
    -> sweep (policy x slots, parallel processes) -> table / JSON / PNG / per-layer view

With no arguments it replays the embedded default, a seeded Qwen3-Next-like synthetic
trace, at 25, 50 and 75 % of all experts as slots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertcache.errors import EnsureError, PolicyError
from sim.costmodel import H200, H200_SM_COPY, format_profile
from sim.replay import check_policies, sim_policy_names, sweep
from sim.report import build_rows, format_per_layer, format_table, plot_hit_rate
from sim.trace import Trace, TraceError, load_trace

DEFAULT_PRESET = "qwen3-next"
DEFAULT_POLICIES = "lru,rule,lfuda,belady"
DEFAULT_FRACS = "0.25,0.5,0.75"
PROFILES = {  # --profile: which H200 cost model prices the misses and the layer (sim/costmodel.py)
    "engine": H200_SM_COPY,  # this engine's measured path: SM miss copy, 20.3 us per layer beyond the bytes
    "copy-engine": H200,  # cudaMemcpy speeds from limits-h200.md, an assumed 10 us per layer
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="replay routing traces through cache policies",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", help="trace files (.npz, .jsonl) or FreeToken-style directories")
    p.add_argument("--preset", help="synthetic trace preset (default when no trace: "
                   f"{DEFAULT_PRESET})")
    p.add_argument("--tokens", type=int, help="tokens of the synthetic trace")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated, from: {', '.join(sim_policy_names())}")
    p.add_argument("--slots", help="comma-separated slot counts (overrides --slots-frac)")
    p.add_argument("--slots-frac", default=DEFAULT_FRACS,
                   help="comma-separated fractions of all experts (L*E) to use as slots")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per (policy, slots)")
    p.add_argument("--plot", metavar="PNG", help="write hit rate against slots to this PNG")
    p.add_argument("--per-layer", action="store_true", help="also print hit rate per layer")
    p.add_argument("--workers", type=int, help="parallel processes (default: CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-logits", action="store_true", help="ignore router logits (no near-miss refresh)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="engine",
                   help="cost model of the modeled us/tok and tok/s: 'engine' (default) is this engine on an "
                        "H200 as measured (SM miss copy, its MoE layer's time); 'copy-engine' prices misses "
                        "at cudaMemcpy speeds with an assumed 10 us layer overhead")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"error: {flag} needs positive integers, got {text!r}")
    return vals


def _slots_for(trace: Trace, args: argparse.Namespace) -> list[int]:
    if args.slots:
        return _ints(args.slots, "--slots")
    try:
        fracs = [float(v) for v in args.slots_frac.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: --slots-frac takes comma-separated numbers, got {args.slots_frac!r}") from None
    if not fracs or not all(0 < f <= 1 for f in fracs):
        raise SystemExit(f"error: --slots-frac needs fractions in (0, 1], got {args.slots_frac!r}")
    total = trace.num_layers * trace.num_experts
    return sorted({max(1, round(f * total)) for f in fracs})


def load_any(path: str) -> Trace:
    """A trace from an .npz file, a .jsonl file or a FreeToken-style directory."""
    from sim.importers import import_freetoken_dir, import_jsonl

    p = Path(path)
    if p.is_dir():
        return import_freetoken_dir(p)
    if p.suffix == ".jsonl":
        return import_jsonl(p, model=p.stem)
    return load_trace(p)


def _traces(args: argparse.Namespace) -> list[tuple[str, Trace]]:
    if args.traces and (args.preset or args.tokens):
        raise SystemExit("error: give trace files or --preset/--tokens, not both")
    if args.traces:
        return [(t, load_any(t)) for t in args.traces]
    from sim.synthetic import generate, preset

    name = args.preset or DEFAULT_PRESET
    overrides = {"seed": args.seed}
    if args.tokens:
        overrides["num_tokens"] = args.tokens
    try:
        cfg = preset(name, **overrides)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return [(f"synthetic:{name}", generate(cfg))]


def run(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p.strip()]
    try:
        check_policies(policies)
    except PolicyError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        traces = _traces(args)
    except (TraceError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    refs = [p for p in ("lru", "belady") if p not in policies]
    out_json: list[dict] = []
    for name, trace in traces:
        slots = _slots_for(trace, args)
        try:
            results = sweep(trace, policies + refs, slots, workers=args.workers,
                            progress=not args.no_progress and sys.stderr.isatty(),
                            use_logits=not args.no_logits)
        except (EnsureError, PolicyError) as exc:
            raise SystemExit(f"error: {name}: {exc}") from None
        profile = PROFILES[args.profile]
        rows = [r for r in build_rows(trace, results, profile) if r.result.policy in policies]
        if args.json:
            out_json += [dict(trace=name, **r.to_dict()) for r in rows]
            continue
        m = trace.meta
        label = name if name.endswith(m.model) else f"{name}: {m.model}"
        title = (f"{label}, {trace.num_tokens} tokens, {m.num_layers} layers x "
                 f"{m.num_experts} experts, top-{m.top_k}, batch {trace.batch}, "
                 f"{trace.accesses} accesses\ncost model: {format_profile(profile)}")
        print(format_table(rows, title))
        if args.per_layer:
            print(format_per_layer(rows))
        if args.plot:
            path = args.plot if len(traces) == 1 else f"{Path(args.plot).stem}-{len(out_json)}.png"
            plot_hit_rate(rows, path, title=f"{Path(name).name}\n{m.model}")
            print(f"plot: {path}")
        print()
    if args.json:
        print(json.dumps(out_json, indent=1))
    return 0
