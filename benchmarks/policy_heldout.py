"""Policies on routing they were tuned on and on routing held out, as shares of the LRU-to-Belady gap.

    ../shared/traces: mixtral-gsm8k (problems 0 | 1), flame-290m-a (sequences 0-1 | 2-3), gemma4-decode
    -> each part replayed on its own from a cold start (sim.replay.replay), at 25 / 50 / 75 % of the
       keys (gemma, which touches about half of its keys: 10 / 20 / 30 %)
    -> per point: misses of every policy, and (lru - policy) / (lru - belady)
    -> markdown table (printed last), the averages per role, JSON (default
       benchmarks/results/policy-heldout.json)

The constants of the deployable policies were chosen on the "tuned" parts only (docs/policies.md).

Run: python benchmarks/policy_heldout.py [--traces DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sim.replay import replay
from sim.trace import load_trace

POLICIES = ("lru", "belady", "lfuda", "rule", "markov")


def parts(folder: Path) -> list[tuple[str, str, object, tuple[float, ...]]]:
    """(label, role, trace, fractions of the keys) of every part replayed."""
    out = []
    for name, cut, label in (("mixtral-gsm8k", 1, ("mixtral problem 0", "mixtral problem 1")),
                             ("flame-290m-a", 2, ("flame sequences 0-1", "flame sequences 2-3"))):
        trace = load_trace(folder / f"{name}.npz")
        req = np.asarray(trace.req_index).reshape(trace.num_tokens, -1)[:, 0]
        split = int((req < cut).sum())
        if not (np.diff(req) >= 0).all():
            raise SystemExit(f"{name}: req_index is not in order; cannot split it into halves")
        out.append((label[0], "tuned", trace.slice_tokens(0, split), (0.25, 0.5, 0.75)))
        out.append((label[1], "held out", trace.slice_tokens(split, None), (0.25, 0.5, 0.75)))
    out.append(("gemma-4", "held out", load_trace(folder / "gemma4-decode.npz"), (0.1, 0.2, 0.3)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/policy-heldout.json)")
    args = ap.parse_args()
    rows = []
    for label, role, trace, fracs in parts(Path(args.traces)):
        keys = trace.num_layers * trace.num_experts
        for f in fracs:
            s = round(f * keys)
            m = {p: replay(trace, p, s).misses for p in POLICIES}
            gap = max(1, m["lru"] - m["belady"])
            rows.append({"part": label, "role": role, "tokens": trace.num_tokens, "slots": s, "misses": m,
                         "gap_share": {p: (m["lru"] - m[p]) / gap for p in POLICIES}})
    lines = ["| part (role) | slots | lru | belady | " + " | ".join(POLICIES[2:]) + " |",
             "|---|---|---|---|" + "---|" * len(POLICIES[2:])]
    for r in rows:
        cells = " | ".join(f"{r['misses'][p]} / {r['gap_share'][p]:+.3f}" for p in POLICIES[2:])
        lines.append(f"| {r['part']} ({r['role']}) | {r['slots']} | {r['misses']['lru']} | "
                     f"{r['misses']['belady']} | {cells} |")
    avg = {role: {p: float(np.mean([r["gap_share"][p] for r in rows if r["role"] == role])) for p in POLICIES[2:]}
           for role in ("tuned", "held out")}
    out = Path(args.out or Path(__file__).parent / "results" / "policy-heldout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "policy_heldout", "rows": rows, "average_gap_share": avg}, indent=1))
    print("\n".join(lines))
    for role, a in avg.items():
        print(f"average share of the gap, {role}: " + ", ".join(f"{p} {v:+.3f}" for p, v in a.items()))
    print(f"json: {out}")


if __name__ == "__main__":
    main()
