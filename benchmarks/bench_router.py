"""Microseconds per router_topk call under CUDA-graph replay: router tiles side by side, against the
HBM floor and torch in the same run.

    shape (qwen3-next: E 512, H 2048, k 10; qwen3-30b: E 128, H 2048, k 8; mixtral: E 8, H 4096, k 2)
    -> --calls router weights (one per layer, so L2 cannot hold them all at Qwen3-Next size) and
       --calls hidden batches of T tokens
    -> check first: every variant's ids equal the default tiles' and its weights agree within float32
       rounding of the renormalising sum, and the default's ids equal router_reference's on rows
       decided by a clear margin
    -> per variant (RouterTiles: block_e, warps; and "torch": matmul, softmax, topk, renormalise)
       one CUDA graph of --calls calls, replayed in a rotating order (bench_routed's
       timing); us/call = elapsed / calls; median, min, max over reps
    -> floor = router weight bytes per call / device-to-device copy bandwidth (measured in this run)
    -> table (last) and JSON (GPU name, torch / triton versions, commit)

Run on a GPU: python benchmarks/bench_router.py [--shapes qwen3-next,qwen3-30b,mixtral]
    [--tokens 1,2,4,8] [--variants NAME,...] [--calls 48] [--reps 40] [--out FILE]
Variant names: b<block_e>w<warps> (block_e experts per program at every T, e.g. b4w4) or
b<small>-<block_e>w<warps> (small up to 4 tokens, block_e above; b2-4w4 is the default, RouterTiles()).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import benchmeta
import torch
from bench_routed import time_variants

from moe.kernels.router import router_reference, router_scratch, router_topk
from moe.kernels.tiles import RouterTiles

SHAPES = {"qwen3-next": (512, 2048, 10), "qwen3-30b": (128, 2048, 8), "mixtral": (8, 4096, 2)}  # E, H, k
DEFAULT = RouterTiles().name
VARIANTS = (DEFAULT, "b2w4", "b4w4", "b8w4", "b4w2", "b2w2")
NAME = re.compile(r"^b(\d+)(?:-(\d+))?w(\d+)$")


def parse_variant(name: str) -> RouterTiles:
    m = NAME.match(name)
    if not m:
        raise SystemExit(f"--variants: {name!r} is not like b4w4 or {DEFAULT}")
    small = int(m.group(1))
    return RouterTiles(block_e_small=small, block_e=int(m.group(2) or small), warps=int(m.group(3)))


def torch_router(x, w, k):
    probs = torch.softmax(torch.nn.functional.linear(x, w).float(), dim=-1)
    vals, ids = torch.topk(probs, k, dim=-1)
    return vals / vals.sum(dim=-1, keepdim=True), ids


def run_case(shape: str, tokens: int, variants: list[str], bandwidth: float, args) -> dict:
    num_experts, hid, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    ws = [(torch.randn(num_experts, hid, generator=g) / hid ** 0.5).bfloat16().cuda() for _ in range(args.calls)]
    xs = [torch.randn(tokens, hid, generator=g).bfloat16().cuda() for _ in range(args.calls)]
    outs = [(torch.empty(tokens, top_k, device="cuda"), torch.empty(tokens, top_k, dtype=torch.int32,
                                                                     device="cuda")) for _ in range(args.calls)]
    router_scratch("cuda", num_experts)
    configs = {v: parse_variant(v) for v in variants}

    def call(name, c):
        if name == "torch":
            return torch_router(xs[c], ws[c], top_k)
        return router_topk(xs[c], ws[c], top_k, True, weights=outs[c][0], ids=outs[c][1], tiles=configs[name])

    checks = {}
    for name in variants:
        same = True
        for c in range(3):
            base = router_topk(xs[c], ws[c], top_k, True)
            got = call(name, c)
            same &= bool(torch.allclose(got[0], base[0], rtol=2e-6, atol=0) and torch.equal(got[1], base[1]))
        checks[name] = {"same_as_default": same}
    ref_ok = True
    for c in range(3):
        base_ids = router_topk(xs[c], ws[c], top_k, True)[1]
        want_w, want_i = router_reference(xs[c], ws[c], top_k, True)
        probs = torch.softmax(xs[c].float() @ ws[c].float().T, dim=-1)
        top = torch.topk(probs, min(top_k + 1, num_experts), dim=-1).values
        keep = (top[:, top_k - 1] - top[:, top_k] > 1e-4 * top[:, top_k - 1]) if top_k < num_experts \
            else torch.ones(tokens, dtype=torch.bool, device="cuda")
        ref_ok &= bool(torch.equal(base_ids[keep], want_i[keep]))
    graphs = {}
    for name in [*variants, "torch"]:
        for c in range(args.calls):
            call(name, c)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in range(args.calls):
                call(name, c)
        graphs[name] = graph
    timed = time_variants(graphs, args.calls, args.reps, args.warmup)
    floor_us = num_experts * hid * 2 / bandwidth * 1e6
    for v in timed.values():
        v["ratio_to_floor"] = v["us_median"] / floor_us
    return {"shape": shape, "tokens": tokens, "experts": num_experts, "hidden": hid, "top_k": top_k,
            "floor_us": floor_us, "default_matches_reference": ref_ok, "checks": checks, "variants": timed}


def table(rows: list[dict]) -> str:
    lines = ["us per router call under CUDA-graph replay (median [min..max]); floor = router weight bytes "
             "/ d2d copy bandwidth; same = ids equal to the default tiles', weights within 2e-6 relative",
             f"{'shape':>10} {'T':>2} {'variant':>12} {'median':>8} {'min..max':>15} {'floor':>6} {'ratio':>6} same"]
    for r in rows:
        for name, v in sorted(r["variants"].items(), key=lambda kv: kv[1]["us_median"]):
            same = r["checks"].get(name, {}).get("same_as_default", "-")
            lines.append(f"{r['shape']:>10} {r['tokens']:>2} {name:>12} {v['us_median']:8.2f} "
                         f"{v['us_min']:7.2f}..{v['us_max']:<7.2f} {r['floor_us']:6.2f} "
                         f"{v['ratio_to_floor']:6.2f} {same}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-next,qwen3-30b,mixtral")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--calls", type=int, default=48, help="calls (router weights) per CUDA graph")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/router-<date>.json)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    if not torch.cuda.is_available():
        print("bench_router needs a CUDA GPU; see --help", file=sys.stderr)
        sys.exit(2)
    info = benchmeta.machine()
    bandwidth = benchmeta.d2d_bandwidth()
    rows = []
    for shape in shapes:
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = run_case(shape, tokens, variants, bandwidth, args)
            rows.append(row)
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us_median"])
            print(f"{shape} T={tokens}: floor {row['floor_us']:.2f} us, best {best[0]} "
                  f"{best[1]['us_median']:.2f} us", flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / f"router-{info['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "router", "machine": info, "copy_bandwidth_bytes_per_s": bandwidth,
                               "settings": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")
    print(table(rows))


if __name__ == "__main__":
    main()
