"""Calibrate the synthetic trace generator against the real traces; print a table, write JSON.

    python benchmarks/calibrate_synthetic.py            # compare the presets with the real traces
    python benchmarks/calibrate_synthetic.py --fit      # refit the shared routing parameters

Real traces: ../shared/traces (or --traces DIR). The comparison uses the `mixtral-like` and
`flame-like` presets, whose routing parameters (spread, reuse, reuse_decay, topic) are the
ones every preset shares; the synthetic curve is the mean over --seeds seeds. --fit runs a
coordinate descent on those four parameters, minimising the worse of the two traces' RMS
hit-rate error, and prints the result (paste it into sim/synthetic.py to adopt it).

Beyond the curves, per trace: the routing's predictability from the previous token
(sim.synthetic.predictability: transition, frequency, lift) and the deployable policies' shares of the
LRU-to-Belady gap at half the keys, real against synthetic (seed 0): the temporal structure the
curves do not pin down, and whether the synthetic trace ranks the policies as the real one does.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from sim import synthetic as syn
from sim.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
# trace file -> (preset, slot counts of the traces README)
CASES = {
    "mixtral-gsm8k.npz": ("mixtral-like", [32, 64, 96, 128, 160, 192, 224]),
    "flame-290m-a.npz": ("flame-like", [64, 128, 256, 384, 448]),
}
STEPS = {"spread": 0.04, "reuse": 0.02, "reuse_decay": 0.1, "topic": 0.1}
RANKED = ("rule", "lfuda", "markov", "next-token")  # the policies whose order the real traces set


def policy_shares(trace, slots: int) -> dict[str, float]:
    """Each of RANKED's share of the LRU-to-Belady gap at `slots` slots (cold start)."""
    from sim.replay import replay

    lru, opt = replay(trace, "lru", slots).misses, replay(trace, "belady", slots).misses
    return {p: (lru - replay(trace, p, slots).misses) / (lru - opt) if lru > opt else 0.0 for p in RANKED}


def _config(name: str, params: dict[str, float]) -> syn.SyntheticConfig:
    cfg = syn.preset(name)
    return replace(cfg, zipf=syn.zipf_for_spread(params["spread"], cfg.num_experts),
                   reuse=params["reuse"], reuse_decay=params["reuse_decay"], topic=params["topic"])


def _rms(rows: list[dict]) -> float:
    d = [r[f"{p}_real"] - r[f"{p}_synth"] for r in rows for p in syn.CURVE_POLICIES]
    return float(np.sqrt(np.mean(np.square(d))))


def fit(reals: dict, seeds: list[int], rounds: int = 4) -> dict[str, float]:
    """Coordinate descent on the shared routing parameters, from the current presets."""
    params = {"spread": syn.SPREAD, **syn.ROUTING}
    steps = dict(STEPS)

    def loss(p: dict[str, float]) -> float:
        return max(_rms(syn.calibration_table(real, _config(CASES[f][0], p), slots, seeds))
                   for f, (real, slots) in reals.items())

    best = loss(params)
    for _ in range(rounds):
        moved = False
        for key in steps:
            for sign in (1, -1):
                while True:
                    value = round(max(0.0, params[key] + sign * steps[key]), 4)
                    trial = dict(params, **{key: value})
                    if trial[key] == params[key] or trial[key] >= 0.95 and key != "spread":
                        break
                    value = loss(trial)
                    if value >= best - 1e-4:
                        break
                    params, best, moved = trial, value, True
                    print(f"  {params} rms {best:.4f}", flush=True)
        if not moved:
            steps = {k: v / 2 for k, v in steps.items()}
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--seeds", type=int, default=8, help="synthetic traces averaged per curve")
    ap.add_argument("--fit", action="store_true", help="refit the shared routing parameters")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results"
                    / "calibrate-synthetic.json")
    args = ap.parse_args()
    seeds = list(range(args.seeds))
    reals = {}
    for f, (_name, slots) in CASES.items():
        real = load_trace(args.traces / f)
        reals[f] = (real, syn.calibration_slots(real, slots))
    if args.fit:
        print("fit:", fit(reals, seeds))
    report = {"seeds": seeds, "spread": syn.SPREAD, "routing": syn.ROUTING, "traces": {}}
    for f, (real, slots) in reals.items():
        name = CASES[f][0]
        rows = syn.calibration_table(real, syn.preset(name), slots, seeds)
        per_seed = [syn.max_gap(syn.calibration_table(real, syn.preset(name, seed=s), slots))
                    for s in seeds]
        print(f"\n{f} vs preset {name!r} (zipf {syn.preset(name).zipf}), "
              f"mean of {len(seeds)} seeds")
        print("| slots | lru real | lru synthetic | belady real | belady synthetic |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['slots']} | {r['lru_real']:.4f} | {r['lru_synth']:.4f} | "
                  f"{r['belady_real']:.4f} | {r['belady_synth']:.4f} |")
        print(f"max gap {syn.max_gap(rows):.4f}, rms {_rms(rows):.4f}; single seeds: max gap "
              f"{min(per_seed):.4f} .. {max(per_seed):.4f}")
        pred = {"real": syn.predictability(real),
                "synthetic": {key: float(np.mean([syn.predictability(syn.generate(syn.preset(name, seed=s)))[key]
                                                  for s in seeds])) for key in ("transition", "frequency", "lift")}}
        half = real.num_layers * real.num_experts // 2
        ranks = {"real": policy_shares(real, half), "synthetic": policy_shares(syn.generate(syn.preset(name)), half)}
        print("predictability from the previous token, transition / frequency / lift: real "
              + " / ".join(f"{pred['real'][k]:.3f}" for k in ("transition", "frequency", "lift")) + ", synthetic "
              + " / ".join(f"{pred['synthetic'][k]:.3f}" for k in ("transition", "frequency", "lift")))
        print(f"share of the LRU-to-Belady gap at {half} slots, real / synthetic: "
              + ", ".join(f"{p} {ranks['real'][p]:+.3f} / {ranks['synthetic'][p]:+.3f}" for p in RANKED))
        report["traces"][f] = {"preset": name, "rows": rows, "max_gap": syn.max_gap(rows),
                               "rms": _rms(rows), "single_seed_max_gap": per_seed,
                               "predictability": pred, "gap_shares_at_half": {"slots": half, **ranks}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
