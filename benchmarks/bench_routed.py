"""Microseconds per routed_experts call under CUDA-graph replay, against the HBM floor and a torch baseline.

    shape (qwen3-next: H 2048, I 512, k 10; mixtral: H 4096, I 14336, k 2), a bf16 slot pool of S
    slots filled with random weights, T in --tokens:
      --calls routes per graph, each token k distinct random slots (so consecutive calls read
      different experts and L2 cannot serve them), each call its own hidden/slots/weights/out
    -> check first: every config against routed_reference in float32 (max error / max |ref|) and
       two calls bitwise equal; the torch baseline against the same reference
    -> per variant (each --configs tile config with its down options, and "torch": gather the T * k
       experts, bmm in bf16)
       one CUDA graph of --calls calls; per rep all variants replayed in a rotating order,
       CUDA events around each replay; us/call = elapsed / calls; median, min, max over reps
    -> floor = distinct live slots' weight bytes per call / device-to-device copy bandwidth
       (2 GiB copy, bytes read + written, measured in this run); ratio = median / floor
    -> read calibration (--read-floor): "read1" streams the same weight rows (every (token, j) pair's
       gate_up and down rows, 16 KB per program, no arithmetic) in one launch, "read2" in two dependent
       launches (gate_up bank, then down bank): what bare streaming reaches with one and two launches
    -> table (last) and JSON (GPU name, torch / triton versions, commit)

Run on a GPU: python benchmarks/bench_routed.py [--shapes qwen3-next,mixtral] [--tokens 1,2,4,8]
    [--configs default|sweep|NAME,NAME] [--calls 20] [--reps 50] [--out FILE]
Config names: i<block_i>x<chunk_h>w<warps>-h<block_h>x<chunk_i>w<warps>[-dr][-pfN] (RoutedTiles;
-dr: routed_down's release, -pfN: its prefetch N, default DOWN_PREFETCH).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import benchmeta
import numpy as np
import torch
import triton
import triton.language as tl

from moe.kernels.plan import DOWN_PREFETCH
from moe.kernels.routed import routed_down, routed_experts, routed_gate_up, routed_reference
from moe.kernels.routed_host import routed_scratch
from moe.kernels.tiles import RoutedTiles

TARGET = "target: routed_experts <= 1.3x the HBM floor at qwen3-next, T=1"
SHAPES = {  # name: (H, I, k, default slots)
    "qwen3-next": (2048, 512, 10, 512),
    "mixtral": (4096, 14336, 2, 24),
}


@dataclass(frozen=True)
class Config:
    """One timed variant of routed_experts: its tiles and the down launch's options."""

    tiles: RoutedTiles = RoutedTiles()
    down_release: bool = False
    down_prefetch: int = DOWN_PREFETCH

    @property
    def name(self) -> str:
        return (self.tiles.name + ("-dr" if self.down_release else "")
                + ("" if self.down_prefetch == DOWN_PREFETCH else f"-pf{self.down_prefetch}"))

    @property
    def down_options(self) -> dict:
        return {"release": self.down_release, "prefetch": self.down_prefetch}


DEFAULT = Config()
SWEEP = (  # tile names (RoutedTiles.name); the first is the default
    DEFAULT.name, "i8x512w8-h8x512w8", "i8x256w4-h8x256w4", "i2x1024w4-h2x512w2",
    "i16x256w8-h16x128w4", "i4x1024w8-h4x512w4", "i4x512w4-h8x512w8",
    "i4x1024w8-h8x512w4", "i4x1024w8-h8x256w8", "i4x1024w8-h16x256w8", "i4x1024w8-h2x512w4",
)
NAME = re.compile(r"^i(\d+)x(\d+)w(\d+)-h(\d+)x(\d+)w(\d+)(-dr)?(?:-pf(\d+))?$")


@triton.jit
def _stream_read(a_ptr, a_row, b_ptr, b_row, slots_ptr, out_ptr, A_BLOCKS: tl.constexpr, B_BLOCKS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program (pair, blk): block blk of bank a's row of slot slots[pair] (blk < A_BLOCKS), else block
    blk - A_BLOCKS of bank b's; an xor of the words is stored so the loads stay."""
    pair = tl.program_id(0)
    blk = tl.program_id(1)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if blk < A_BLOCKS:
        v = tl.load(a_ptr + slot * a_row + blk * BLOCK + offs)
    else:
        v = tl.load(b_ptr + slot * b_row + (blk - A_BLOCKS) * BLOCK + offs)
    tl.store(out_ptr + pair * (A_BLOCKS + B_BLOCKS) + blk, tl.xor_sum(v, axis=0))


READ_BLOCK = 4096  # int32 words per program (16 KB)


def stream_read(banks: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """One launch reading rows slots[...] of every bank in `banks` (one or two), viewed as int32."""
    words = [b.view(torch.int32).reshape(b.shape[0], -1) for b in banks]
    blocks = [w.shape[1] // READ_BLOCK for w in words]
    a, b = words[0], words[-1]
    nb = blocks[1] if len(banks) > 1 else 0
    _stream_read[(slots.numel(), blocks[0] + nb)](a, a.shape[1], b, b.shape[1], slots, out,
                                                 A_BLOCKS=blocks[0], B_BLOCKS=nb, BLOCK=READ_BLOCK)


def parse_config(name: str) -> Config:
    m = NAME.match(name)
    if not m:
        raise SystemExit(f"--configs: {name!r} is not like {DEFAULT.name} (or 'default', 'sweep')")
    b_i, c_h, w_a, b_h, c_i, w_b = map(int, m.groups()[:6])
    tiles = RoutedTiles(block_i=b_i, chunk_h=c_h, warps_gate_up=w_a, block_h=b_h, chunk_i=c_i, warps_down=w_b)
    return Config(tiles, down_release=m.group(7) is not None,
                  down_prefetch=int(m.group(8)) if m.group(8) else DOWN_PREFETCH)


def copy_bandwidth(reps: int = 20) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second, median of reps."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * src.nbytes / float(np.median(times[3:]))


class Case:
    """One (shape, T): the pool, `calls` routes, the variants' graphs."""

    def __init__(self, pool, shape: str, tokens: int, args) -> None:
        self.gate_up, self.down = pool
        hid, inter, top_k, _ = SHAPES[shape]
        num_slots = self.gate_up.shape[0]
        g = torch.Generator().manual_seed(tokens)
        self.inputs = []  # per call (hidden [T, H], slots [T, k], weights [T, k])
        for _ in range(args.calls):
            slots = torch.stack([torch.randperm(num_slots, generator=g)[:top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
            hidden = torch.randn(tokens, hid, generator=g).bfloat16()
            self.inputs.append((hidden.cuda(), slots.to(torch.int32).cuda(), weights.cuda()))
        self.outs = [torch.empty(tokens, hid, device="cuda") for _ in self.inputs]
        distinct = np.mean([len(set(s.view(-1).tolist())) for _, s, _ in self.inputs])
        self.bytes_per_call = distinct * 3 * hid * inter * self.gate_up.element_size()
        self.distinct = float(distinct)
        self.read_blocks = (self.gate_up[0].numel() + self.down[0].numel()) // 2 // READ_BLOCK
        self.read_out = torch.empty(tokens * top_k * self.read_blocks, dtype=torch.int32, device="cuda")

    def call(self, variant, c: int) -> torch.Tensor:
        if variant in ("read1", "read2"):  # calibration: the same rows streamed, no arithmetic
            slots = self.inputs[c][1]
            out = self.read_out[:slots.numel() * self.read_blocks]
            if variant == "read1":
                return stream_read([self.gate_up, self.down], slots, out)
            stream_read([self.gate_up], slots, out)
            return stream_read([self.down], slots, out)
        if variant == "torch":
            return routed_reference(*self.inputs[c], self.gate_up, self.down, compute_dtype=torch.bfloat16)
        if isinstance(variant, tuple):  # (config, "gate_up" | "down"): one of the two launches alone
            cfg, part = variant
            hidden, slots, weights = self.inputs[c]
            if part == "gate_up":
                return routed_gate_up(hidden, slots, weights, self.gate_up, tiles=cfg.tiles)
            return routed_down(routed_scratch(hidden.device, slots.shape[1], self.down.shape[2]), slots,
                               self.down, out=self.outs[c], tiles=cfg.tiles, **cfg.down_options)
        return routed_experts(*self.inputs[c], self.gate_up, self.down, out=self.outs[c], tiles=variant.tiles,
                              down_release=variant.down_release, down_prefetch=variant.down_prefetch)

    def check(self, variant) -> dict:
        """Max error relative to max |float32 reference| over the first calls; bitwise repeat."""
        errs, repeat = [], True
        for c in range(min(3, len(self.inputs))):
            want = routed_reference(*self.inputs[c], self.gate_up, self.down)
            got = self.call(variant, c).clone()
            errs.append(((got - want).abs().max() / want.abs().max()).item())
            repeat &= bool(torch.equal(got, self.call(variant, c)))
        return {"max_rel_err": max(errs), "bitwise_repeat": repeat}

    def graph(self, variant) -> torch.cuda.CUDAGraph:
        for c in range(len(self.inputs)):  # compile, make the scratch
            self.call(variant, c)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in range(len(self.inputs)):
                self.call(variant, c)
        return graph


def time_variants(graphs: dict, calls: int, reps: int, warmup: int) -> dict:
    """us/call per variant: every rep replays each graph once, in a rotating order."""
    names = list(graphs)
    times = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names[r % len(names):] + names[:r % len(names)]
        events = {}
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[n].replay()
            b.record()
            events[n] = (a, b)
        torch.cuda.synchronize()
        if r >= warmup:
            for n, (a, b) in events.items():
                times[n].append(a.elapsed_time(b) * 1e3 / calls)
    return {n: {"us_median": float(np.median(t)), "us_min": float(np.min(t)), "us_max": float(np.max(t))}
            for n, t in times.items()}


def run_case(pool, shape: str, tokens: int, configs: list[Config], bandwidth: float, args) -> dict:
    case = Case(pool, shape, tokens, args)
    variants = {cfg.name: cfg for cfg in configs}
    variants["torch"] = "torch"
    checks = {name: case.check(v) for name, v in variants.items()}
    for name, chk in checks.items():  # the torch baseline rounds to bf16 per linear: recorded only
        if name != "torch" and (chk["max_rel_err"] > 1e-3 or not chk["bitwise_repeat"]):
            raise SystemExit(f"{shape} T={tokens} {name}: check failed {chk}; not timing")
    if args.read_floor:
        variants.update(read1="read1", read2="read2")
        checks.update({n: {"max_rel_err": None, "bitwise_repeat": None} for n in ("read1", "read2")})
    graphs = {name: case.graph(v) for name, v in variants.items()}
    timed = time_variants(graphs, args.calls, args.reps, args.warmup)
    floor_us = case.bytes_per_call / bandwidth * 1e6
    for name, t in timed.items():
        t.update(checks[name], ratio_to_floor=t["us_median"] / floor_us,
                 gbps=case.bytes_per_call / (t["us_median"] * 1e-6) / 1e9)
    # each launch alone (gate_up reads 2/3 of the bytes, down 1/3): which one is far from its floor
    parts = {f"{cfg.name}/{part}": (cfg, part) for cfg in configs for part in ("gate_up", "down")}
    alone = time_variants({n: case.graph(v) for n, v in parts.items()}, args.calls, args.reps, args.warmup)
    for name, t in alone.items():
        share = 2 / 3 if name.endswith("/gate_up") else 1 / 3
        t["ratio_to_floor"] = t["us_median"] / (floor_us * share)
    return {"shape": shape, "tokens": tokens, "slots": pool[0].shape[0], "distinct_slots_per_call": case.distinct,
            "bytes_per_call": case.bytes_per_call, "floor_us": floor_us, "variants": timed, "launches": alone}


def make_pool(shape: str, num_slots: int):
    hid, inter, _, _ = SHAPES[shape]
    gate_up = torch.empty(num_slots, 2 * inter, hid, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(num_slots, hid, inter, dtype=torch.bfloat16, device="cuda")
    for s in range(num_slots):  # one slot at a time: no float32 temporary of the whole pool
        gate_up[s].normal_(0, hid ** -0.5)
        down[s].normal_(0, inter ** -0.5)
    return gate_up, down


def table(rows: list[dict]) -> str:
    lines = [TARGET,
             ("us per call under CUDA-graph replay (median [min..max]); floor = weight bytes / "
              "d2d copy bandwidth; ratio = median / floor"),
             (f"{'shape':>10} {'T':>2} {'variant':>22} {'median':>8} {'min..max':>15} {'floor':>7} "
              f"{'ratio':>6} {'GB/s':>6} {'vs torch':>8}")]
    for r in rows:
        for name, v in sorted(r.get("launches", {}).items()):
            lines.append(f"{r['shape']:>10} {r['tokens']:>2} {name:>30} alone {v['us_median']:8.2f} us, "
                         f"{v['ratio_to_floor']:5.2f}x its share of the floor")
    for r in rows:
        torch_us = r["variants"]["torch"]["us_median"]
        for name, v in sorted(r["variants"].items(), key=lambda kv: kv[1]["us_median"]):
            lines.append(f"{r['shape']:>10} {r['tokens']:>2} {name:>22} {v['us_median']:8.2f} "
                         f"{v['us_min']:7.2f}..{v['us_max']:<7.2f} {r['floor_us']:7.2f} "
                         f"{v['ratio_to_floor']:6.2f} {v['gbps']:6.0f} {torch_us / v['us_median']:7.2f}x")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-next", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--configs", default="default", help="'default', 'sweep' or comma list of config names")
    ap.add_argument("--slots", type=int, default=None, help="pool slots (default per shape: 512, 24)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--read-floor", action="store_true",
                    help="also time read1 / read2: the same weight rows streamed in one / two launches")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/routed-<date>.json)")
    args = ap.parse_args()
    args.shapes = args.shapes.split(",")
    for s in args.shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    names = {"default": [DEFAULT.name], "sweep": list(SWEEP)}.get(args.configs, args.configs.split(","))
    args.configs = [parse_config(n) for n in names]
    return args


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_routed needs a CUDA GPU; see --help", file=sys.stderr)
        sys.exit(2)
    info = benchmeta.machine()
    bandwidth = copy_bandwidth()
    print(f"{info['gpu']}: device-to-device copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in args.shapes:
        pool = make_pool(shape, args.slots or SHAPES[shape][3])
        for tokens in args.tokens:
            row = run_case(pool, shape, tokens, args.configs, bandwidth, args)
            rows.append(row)
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us_median"])
            print(f"{shape} T={tokens}: floor {row['floor_us']:.2f} us, best {best[0]} "
                  f"{best[1]['us_median']:.2f} us, torch {row['variants']['torch']['us_median']:.2f} us",
                  flush=True)
        del pool
        torch.cuda.empty_cache()
    out = Path(args.out or Path(__file__).parent / "results" / f"routed-{info['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "configs")}
    settings["configs"] = [c.name for c in args.configs]
    doc = {"bench": "routed", "machine": info, "copy_bandwidth_bytes_per_s": bandwidth,
           "settings": settings, "target": TARGET, "rows": rows}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    print(table(rows))


if __name__ == "__main__":
    main()
