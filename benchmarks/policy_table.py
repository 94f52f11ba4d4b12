"""Every policy against lru, belady and the next-token oracle on real traces, at 25, 50 and 75 % of all
experts (TRACE.npz@0.1,0.2,0.3 for other shares: a trace that touches few of its experts).

    trace files -> sim.replay.sweep (every simulator policy x 3 slot counts)
    -> markdown table (printed last) and JSON (default benchmarks/results/policy-table.json)

Run: python benchmarks/policy_table.py TRACE.npz[@FRACS] [TRACE.npz ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sim.replay import sim_policy_names, sweep
from sim.report import build_rows
from sim.trace import load_trace

FRACS = (0.25, 0.5, 0.75)


def table(arg: str) -> tuple[str, list[dict]]:
    path, _, fracs_text = arg.partition("@")
    try:
        fracs = tuple(float(f) for f in fracs_text.split(",")) if fracs_text else FRACS
    except ValueError:
        raise SystemExit(f"{arg!r}: the shares after @ must be a comma list of numbers, e.g. @0.1,0.2,0.3") from None
    trace = load_trace(path)
    total = trace.num_layers * trace.num_experts
    slots = [round(f * total) for f in fracs]
    rows = build_rows(trace, sweep(trace, sim_policy_names(), slots, progress=False))
    by = {(r.result.policy, r.result.slots): r for r in rows}
    head = "| policy | " + " | ".join(f"{s} slots ({int(100 * f)} %)" for s, f in zip(slots, fracs)) + " |"
    lines = [f"**{Path(path).name}** ({trace.meta.model}; {trace.num_tokens} tokens, "
             f"{trace.num_layers} x {trace.num_experts} experts, top-{trace.top_k}, "
             f"{trace.accesses} accesses). Cell: hit rate / misses / share of the LRU-to-Belady "
             "gap recovered.", "", head, "|---" * (len(slots) + 1) + "|"]
    for p in sim_policy_names():
        cells = []
        for s in slots:
            r = by[(p, s)]
            cells.append(f"{r.result.hit_rate:.4f} / {r.result.misses} / {r.gap_recovered:+.3f}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines), [dict(trace=Path(path).name, **r.to_dict()) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    md, data = [], []
    for t in args.traces:
        text, rows = table(t)
        md.append(text)
        data += rows
    date = time.strftime("%Y-%m-%d", time.gmtime())
    out = Path(args.out or Path(__file__).parent / "results" / "policy-table.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "policy_table", "date": date, "rows": data}, indent=1))
    print("\n\n".join(md))
    print(f"\njson: {out}")


if __name__ == "__main__":
    main()
