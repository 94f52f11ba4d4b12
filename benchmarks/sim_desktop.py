"""The predicted desktop table of docs/hybrid.md: four models at a 24 GB card, each miss service.

    per model (--models: presets of sim/synthetic.py): `expertcache sim --preset MODEL --tokens N
        --policies lru,rule,markov --moe-cache-gb 20 --expert-format bf16,int4 --host desktop
        --miss-service copy,hybrid,cpu --json` (the real command, `python -m moe.cli`, a subprocess)
    -> per (model, format): each service's best policy and its modeled tokens/s at batch 1 (the MoE
       layers alone), hybrid / copy
    -> a markdown table (printed) and JSON (default benchmarks/results/sim-desktop.json) with every
       row of every run and the commit

The desktop profile's rates are assumed from spec sheets (sim/service.py: HOSTS["desktop"]), so these
are predictions of the cost model, not measurements.

Run: python benchmarks/sim_desktop.py [--models qwen3-30b-a3b,...] [--tokens 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import benchmeta

MODELS = ("qwen3-30b-a3b", "gpt-oss-120b", "qwen3-next", "glm-4.5-air")
SERVICES = ("copy", "hybrid", "cpu")
ROOT = Path(__file__).resolve().parent.parent


def sim_rows(model: str, tokens: int, budget_gb: float, formats: str, policies: str) -> list[dict]:
    argv = [sys.executable, "-m", "moe.cli", "sim", "--preset", model, "--tokens", str(tokens),
            "--policies", policies, "--moe-cache-gb", f"{budget_gb:g}", "--expert-format", formats,
            "--host", "desktop", "--miss-service", ",".join(SERVICES), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[1:])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def best(rows: list[dict]) -> list[dict]:
    """Per format: each service's best policy (highest modeled tokens/s) and hybrid / copy."""
    out = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        entry = {"format": fmt, "slots": mine[0]["slots"], "all_experts_fit": mine[0]["all_experts_fit"]}
        for service in SERVICES:
            top = max(mine, key=lambda r, s=service: r["miss_service"][s]["tokens_per_s"])
            entry[service] = {"policy": top["policy"], "tokens_per_s": top["miss_service"][service]["tokens_per_s"]}
        entry["hybrid_over_copy"] = entry["hybrid"]["tokens_per_s"] / entry["copy"]["tokens_per_s"]
        out.append(entry)
    return out


def table(result: dict) -> str:
    lines = ["| model | format (slots) | copy | hybrid | cpu | hybrid / copy |", "|---|---|---|---|---|---|"]
    for model in result["models"]:
        for e in result["best"][model]:
            slots = f"{e['slots']:,}" + (": every expert" if e["all_experts_fit"] else "")
            lines.append(f"| {model} | {e['format']} ({slots}) | " + " | ".join(
                f"{e[s]['tokens_per_s']:.1f}" for s in SERVICES) + f" | {e['hybrid_over_copy']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--moe-cache-gb", type=float, default=20.0)
    ap.add_argument("--expert-formats", default="bf16,int4")
    ap.add_argument("--policies", default="lru,rule,markov")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim-desktop.json"))
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    rows = {m: sim_rows(m, args.tokens, args.moe_cache_gb, args.expert_formats, args.policies) for m in models}
    result = {"bench": "sim_desktop", "host": "desktop", "tokens": args.tokens, "moe_cache_gb": args.moe_cache_gb,
              "policies": args.policies, "models": models, "best": {m: best(r) for m, r in rows.items()},
              "commit": benchmeta.commit(), "date": benchmeta.now(),
              "rows": {m: [{k: v for k, v in r.items() if not k.startswith("layer_")} for r in rs]
                       for m, rs in rows.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
