"""Microseconds per routed_experts call under CUDA-graph replay, per expert format, against each
format's HBM floor, bf16 and a torch baseline.

    shape (qwen3-next: H 2048, I 512, k 10; qwen3-30b: H 2048, I 768, k 8; mixtral: H 4096, I 14336,
    k 2; gpt-oss-20b: H = I = 2880, k 4), S slots of random bf16 weights (N(0, 1 / fan_in)), once per shape
    -> one pool per --formats format, built once per shape: bf16 the weights themselves; fp8 / nvfp4
       / mxfp4 / int4 the same weights quantized on the GPU (expertcache.formats), as SlotMatrix
       gate_up (stack 2) and down (moe.model.slot_matrix)
    -> per T in --tokens: --calls routes, each token k distinct random slots (so consecutive calls
       read different experts and L2 cannot serve them), each call its own hidden/slots/weights/out,
       the same routes for every format
    -> check first: every (format, config) against routed_reference in float32 (a quantized pool
       dequantized by its format's torch reference; max error / max |ref|) and two calls bitwise
       equal; the torch baseline (bf16) against the same reference
    -> per variant (each format's configs: --configs names, "default" = the format's tiles
       DEFAULT_ROUTED_TILES for bf16, QUANTIZED_ROUTED_TILES for a quantized format; and "torch"
       for bf16: gather the T * k experts, bmm in bf16; and each --mma tile set of routed_experts_mma,
       the tensor-core kernels, at every T: the one-program-a-pair kernels run up to GEMV_MAX_TOKENS)
       one CUDA graph of --calls calls; per rep all variants of every format replayed in a rotating
       order, CUDA events around each replay; us/call = elapsed / calls; median, min, max over reps
    -> floor = distinct live slots per call * the format's bytes per expert (fmt.expert_bytes(H, I):
       values and scales) / device-to-device copy bandwidth (2 GiB copy, bytes read + written,
       measured in this run); ratio = median / floor; vs bf16 = bf16's default-config median at the
       same shape and T / this median
    -> each launch alone (gate_up, down), against its share of the format's bytes
    -> read calibration (--read-floor, every format): "read1" streams the same slots' bytes (every
       (token, j) pair's gate_up and down banks, values and scales, 16 KB per program, no arithmetic)
       in one launch, "read2" in two dependent launches (gate_up banks, then down banks): what bare
       streaming of the format's bytes reaches with one and two launches (the two the GEMM needs)
    -> table (last): one row per (shape, format, T, config), and JSON (GPU name, torch / triton
       versions, commit; one row per (shape, format, T, config))

Run on a GPU: python benchmarks/bench_routed.py [--shapes qwen3-next,qwen3-30b,mixtral,gpt-oss-20b]
    [--tokens 1,2,4,8,16,32,64] [--formats bf16,fp8,nvfp4,mxfp4,int4] [--configs default|sweep|NAME,NAME]
    [--mma none|default|sweep|NAME,NAME] [--read-floor] [--calls 20] [--reps 50] [--out FILE]
Config names: i<block_i>x<chunk_h>w<warps>-h<block_h>x<chunk_i>w<warps>[-dr][-pfN] (RoutedTiles;
-dr: routed_down's release, -pfN: its prefetch N, default DOWN_PREFETCH; a quantized format's down
prefetches nothing, so -pfN applies to bf16 only). Every name applies to every format; "default" is
each format's own tiles, and bf16 always times its default too (the baseline of "vs bf16").
mixtral runs every format as well: its five pools take about 18 GiB together, the float32 reference
of the check about 12 GB at T = 8 (--formats bf16 keeps it to the dense pool); gpt-oss-20b's check
takes T * k * 99.5 MB (25 GB at T = 64: keep its --tokens to 16 on an 80 GB card). Each (format, config)
compiles three kernels per shape (a few seconds each), so --configs sweep takes many minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import benchmeta
import numpy as np
import torch
import triton
import triton.language as tl

from expertcache.errors import FormatError
from expertcache.formats import ExpertFormat, format_names, get_format
from moe.kernels.plan import DEFAULT_ROUTED_TILES, DOWN_PREFETCH, GEMV_MAX_TOKENS, QUANTIZED_ROUTED_TILES
from moe.kernels.routed import routed_down, routed_experts, routed_gate_up, routed_reference
from moe.kernels.routed_host import routed_scratch
from moe.kernels.routed_mma import DEFAULT_MMA_TILES, MMA_MAX_TOKENS, routed_experts_mma
from moe.kernels.tiles import MmaTiles, RoutedTiles
from moe.model.slot_matrix import SlotMatrix

TARGET = ("target: per format, routed_experts at T=1 <= 1.3x the HBM floor of that format's bytes "
          "(qwen3-next, qwen3-30b)")
TARGET_RATIO = 1.3
MMA_TARGET = ("target (tensor cores): per quantized format, routed_experts_mma at T=1 <= 1.25x read2 and "
              "from T=8 <= 1.3x the HBM floor, in the same run")
MMA_READ2_RATIO, MMA_FLOOR_RATIO, MMA_FLOOR_FROM = 1.25, 1.3, 8
SHAPES = {  # name: (H, I, k, default slots: a pool several times L2 in every format)
    "qwen3-next": (2048, 512, 10, 512),
    "qwen3-30b": (2048, 768, 8, 512),
    "mixtral": (4096, 14336, 2, 24),
    "gpt-oss-20b": (2880, 2880, 4, 64),  # its expert shape, run as the SiLU block without biases
}
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4", "int4")
QUANT_CHUNK_ELEMENTS = 1 << 28  # bf16 weights quantized per step (the format's float32 work is per matrix)


@dataclass(frozen=True)
class Config:
    """One timed variant of routed_experts: its tiles and the down launch's options. down_prefetch
    None: the down prefetches nothing (a quantized format's)."""

    tiles: RoutedTiles = RoutedTiles()
    down_release: bool = False
    down_prefetch: int | None = DOWN_PREFETCH

    @property
    def name(self) -> str:
        pf = "" if self.down_prefetch in (None, DOWN_PREFETCH) else f"-pf{self.down_prefetch}"
        return self.tiles.name + ("-dr" if self.down_release else "") + pf

    @property
    def down_options(self) -> dict:
        return {"release": self.down_release, "prefetch": self.down_prefetch or 0}

    def for_format(self, fmt: ExpertFormat) -> Config:
        """This config as `fmt` runs it: a quantized format's down prefetches nothing."""
        return self if fmt.dense else dataclasses.replace(self, down_prefetch=None)


DEFAULT = Config(DEFAULT_ROUTED_TILES)  # bf16's default: the tiles the layer launches
QUANTIZED_DEFAULT = Config(QUANTIZED_ROUTED_TILES, down_prefetch=None)  # a quantized format's
SWEEP = (  # tile names (RoutedTiles.name); the first is bf16's default
    DEFAULT.name, "i8x512w8-h8x512w8", "i8x256w4-h8x256w4", "i2x1024w4-h2x512w2",
    "i16x256w8-h16x128w4", "i4x1024w8-h4x512w4", "i4x512w4-h8x512w8",
    "i4x1024w8-h8x512w4", "i4x1024w8-h8x256w8", "i4x1024w8-h16x256w8", "i4x1024w8-h2x512w4",
)
QUANT_SWEEP = (  # tiles for quantized weights (more rows per program); the first is their default
    QUANTIZED_DEFAULT.name, "i4x1024w4-h8x256w4", "i8x1024w4-h16x256w4", "i8x1024w4-h8x256w4",
    "i16x1024w8-h16x256w8", "i4x1024w4-h4x256w4", "i8x512w4-h8x512w4",
)
NAME_HELP = "i<block_i>x<chunk_h>w<warps>-h<block_h>x<chunk_i>w<warps>[-dr][-pfN]"
NAME = re.compile(r"^i(\d+)x(\d+)w(\d+)-h(\d+)x(\d+)w(\d+)(-dr)?(?:-pf(\d+))?$")
MMA_NAME_HELP = "m<block_m>-i<block_n>w<warps>-h<down_block_n>w<warps>-c<block_h>w<warps> (MmaTiles.name)"
MMA_SWEEP = (  # MmaTiles names; the first is the default. More rows a program issue fewer instructions a weight
    # (probe_routed_sass.py) but fill fewer SMs at one token
    DEFAULT_MMA_TILES.name, "m16-i64w4-h128w4-c256w2", "m16-i64w8-h128w8-c256w2", "m16-i32w2-h64w2-c256w2",
    "m16-i16w2-h32w2-c256w2", "m32-i32w4-h64w4-c256w2", "m64-i64w8-h128w8-c256w2",
)


@triton.jit
def _stream_read(banks, rows, firsts, slots_ptr, out_ptr, NBANK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (pair, blk): block blk of the concatenation of slot slots[pair]'s rows of the banks (banks: int32 [S,
    rows[b]] each; firsts[b]: bank b's first block, firsts[NBANK] the total); an xor of the words is stored so the
    loads stay."""
    pair = tl.program_id(0)
    blk = tl.program_id(1)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in tl.static_range(NBANK):
        if (blk >= firsts[b]) & (blk < firsts[b + 1]):
            col = (blk - firsts[b]) * BLOCK + offs
            acc = tl.load(banks[b] + slot * rows[b] + col, mask=col < rows[b], other=0)
    tl.store(out_ptr + pair * tl.num_programs(1) + blk, tl.xor_sum(acc, axis=0))


READ_BLOCK = 4096  # int32 words per program (16 KB)


def read_banks(matrix: torch.Tensor | SlotMatrix) -> list[torch.Tensor]:
    """A pool matrix's banks (a dense tensor, or a SlotMatrix's parts: values and scales) as int32
    [S, words] views (every format's slot rows are whole words: the miss copy needs it too)."""
    parts = matrix.parts if isinstance(matrix, SlotMatrix) else (matrix,)
    return [p.reshape(p.shape[0], -1).view(torch.int32) for p in parts]


def read_blocks(banks: list[torch.Tensor]) -> int:
    """Programs per pair of stream_read over `banks`."""
    return sum(-(-b.shape[1] // READ_BLOCK) for b in banks)


def stream_read(banks: list[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """One launch reading slot rows slots[...] of every bank (int32 [S, words] views), every byte once."""
    firsts = [0]
    for b in banks:
        firsts.append(firsts[-1] + -(-b.shape[1] // READ_BLOCK))
    _stream_read[(slots.numel(), firsts[-1])](tuple(banks), tuple(b.shape[1] for b in banks), tuple(firsts), slots,
                                         out, NBANK=len(banks), BLOCK=READ_BLOCK)


def parse_config(name: str) -> Config:
    """A config name (NAME_HELP) as a Config. Raises SystemExit naming --configs."""
    m = NAME.match(name)
    if not m:
        raise SystemExit(f"--configs: {name!r} is not like {DEFAULT.name} (or 'default', 'sweep')")
    b_i, c_h, w_a, b_h, c_i, w_b = map(int, m.groups()[:6])
    try:
        tiles = RoutedTiles(block_i=b_i, chunk_h=c_h, warps_gate_up=w_a, block_h=b_h, chunk_i=c_i, warps_down=w_b)
    except ValueError as e:
        raise SystemExit(f"--configs: {name!r}: {e}") from None
    return Config(tiles, down_release=m.group(7) is not None,
                  down_prefetch=int(m.group(8)) if m.group(8) else DOWN_PREFETCH)


def parse_mma(names: str) -> list[MmaTiles]:
    """--mma as MmaTiles: 'none', 'default', 'sweep' or a comma list of MMA_NAME_HELP names. Raises
    SystemExit naming --mma."""
    if names == "none":
        return []
    listed = {"default": [DEFAULT_MMA_TILES.name], "sweep": list(MMA_SWEEP)}.get(names, names.split(","))
    out = []
    for name in listed:
        try:
            out.append(MmaTiles.from_name(name))
        except ValueError as e:
            raise SystemExit(f"--mma: {e} (or 'none', 'default', 'sweep')") from None
    return list(dict.fromkeys(out))


def config_names(configs: str) -> list[str]:
    """--configs as a list of names ('default' kept as is, 'sweep' expanded), each name checked."""
    names = {"default": ["default"], "sweep": ["default", *SWEEP, *QUANT_SWEEP]}.get(configs, configs.split(","))
    for n in names:
        if n != "default":
            parse_config(n)
    return names


def default_config(fmt: ExpertFormat) -> Config:
    """The config `fmt` launches in the layer (moe.kernels.plan.resolve_launch_plan)."""
    return DEFAULT if fmt.dense else QUANTIZED_DEFAULT


def format_configs(names: list[str], fmt: ExpertFormat) -> list[Config]:
    """The configs `fmt` is timed with: each name of `names` as `fmt` runs it ('default': the format's
    own tiles), duplicates dropped (the first kept); bf16 always starts with its default."""
    default = default_config(fmt)
    names = ["default", *names] if fmt.dense and "default" not in names else names
    out: dict[str, Config] = {}
    for n in names:
        cfg = default if n == "default" else parse_config(n).for_format(fmt)
        out.setdefault(cfg.name, cfg)
    return list(out.values())


def call_bytes(fmt: ExpertFormat, distinct: float, hidden: int, inter: int) -> float:
    """Weight bytes a call reads at least: `distinct` live slots of one expert in `fmt` each."""
    return distinct * fmt.expert_bytes(hidden, inter)


def launch_shares(fmt: ExpertFormat, hidden: int, inter: int) -> dict[str, float]:
    """{"gate_up", "down"}: each launch's share of the format's bytes per expert (sum 1)."""
    total = fmt.expert_bytes(hidden, inter)
    return {"gate_up": fmt.matrix_bytes(2 * inter, hidden, 2) / total, "down": fmt.matrix_bytes(hidden, inter) / total}


@dataclass
class Pool:
    """One format's slot pool of a shape: gate_up [S, 2I, H] and down [S, H, I], plain bf16 tensors
    for bf16, else SlotMatrix (stack 2 and 1)."""

    fmt: ExpertFormat
    gate_up: torch.Tensor | SlotMatrix
    down: torch.Tensor | SlotMatrix


def dense_weights(shape: str, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 gate_up [S, 2I, H], down [S, H, I] on the GPU, N(0, 1 / fan_in)."""
    hid, inter, _, _ = SHAPES[shape]
    gate_up = torch.empty(num_slots, 2 * inter, hid, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(num_slots, hid, inter, dtype=torch.bfloat16, device="cuda")
    for s in range(num_slots):  # one slot at a time: no float32 temporary of the whole pool
        gate_up[s].normal_(0, hid ** -0.5)
        down[s].normal_(0, inter ** -0.5)
    return gate_up, down


def quantize_slots(fmt: ExpertFormat, w: torch.Tensor, stack: int) -> SlotMatrix:
    """w [S, out, in] (each slot `stack` stacked matrices) quantized with `fmt`, a few slots at a time,
    into parts [S, *part shape] on w's device."""
    num, out, inn = w.shape
    layout = fmt.layout(out, inn, stack)
    parts = tuple(torch.empty((num, *p.shape), dtype=getattr(torch, p.dtype), device=w.device) for p in layout)
    step = max(1, QUANT_CHUNK_ELEMENTS // (out * inn))
    for first in range(0, num, step):
        n = min(step, num - first)
        got = fmt.quantize(w[first:first + n].reshape(n * out, inn), stack=n * stack)  # each matrix alone
        for p, t in zip(layout, parts):
            t[first:first + n].copy_(got[p.suffix].reshape(n, *p.shape))
    return SlotMatrix(fmt, parts, out, inn, stack)


def make_pools(shape: str, num_slots: int, formats: list[str]) -> dict[str, Pool]:
    """One pool per format, all from the same random bf16 weights."""
    gate_up, down = dense_weights(shape, num_slots)
    pools = {}
    for name in formats:
        fmt = get_format(name)
        if fmt.dense:
            pools[name] = Pool(fmt, gate_up, down)
        else:
            pools[name] = Pool(fmt, quantize_slots(fmt, gate_up, 2), quantize_slots(fmt, down, 1))
    torch.cuda.synchronize()
    return pools


class Case:
    """One (shape, T): `calls` routes (the same for every format), their outputs, the variants' graphs."""

    def __init__(self, shape: str, tokens: int, num_slots: int, args) -> None:
        self.hid, self.inter, top_k, _ = SHAPES[shape]
        g = torch.Generator().manual_seed(tokens)
        self.inputs = []  # per call (hidden [T, H], slots [T, k], weights [T, k])
        for _ in range(args.calls):
            slots = torch.stack([torch.randperm(num_slots, generator=g)[:top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
            hidden = torch.randn(tokens, self.hid, generator=g).bfloat16()
            self.inputs.append((hidden.cuda(), slots.to(torch.int32).cuda(), weights.cuda()))
        self.outs = [torch.empty(tokens, self.hid, device="cuda") for _ in self.inputs]
        self.distinct = float(np.mean([len(set(s.view(-1).tolist())) for _, s, _ in self.inputs]))
        self.read_out: dict[str, torch.Tensor] = {}  # per format: the read calibration's output
        self.refs: dict[tuple[str, int], torch.Tensor] = {}  # (format, call): float32 reference

    def bytes_per_call(self, fmt: ExpertFormat) -> float:
        return call_bytes(fmt, self.distinct, self.hid, self.inter)

    def call(self, pool: Pool, variant, c: int) -> torch.Tensor:
        hidden, slots, weights = self.inputs[c]
        if variant in ("read1", "read2"):  # calibration: the same slots' bytes streamed, no arithmetic
            gate_up, down = read_banks(pool.gate_up), read_banks(pool.down)
            out = self.read_out.get(pool.fmt.name)
            if out is None:
                out = torch.empty(slots.numel() * read_blocks([*gate_up, *down]), dtype=torch.int32, device="cuda")
                self.read_out[pool.fmt.name] = out
            if variant == "read1":
                return stream_read([*gate_up, *down], slots, out)
            stream_read(gate_up, slots, out)
            return stream_read(down, slots, out)
        if isinstance(variant, MmaTiles):
            return routed_experts_mma(hidden, slots, weights, pool.gate_up, pool.down, out=self.outs[c], tiles=variant)
        if variant == "torch":
            return routed_reference(hidden, slots, weights, pool.gate_up, pool.down, compute_dtype=torch.bfloat16)
        if isinstance(variant, tuple):  # (config, "gate_up" | "down"): one of the two launches alone
            cfg, part = variant
            if part == "gate_up":
                return routed_gate_up(hidden, slots, weights, pool.gate_up, tiles=cfg.tiles)
            return routed_down(routed_scratch(hidden.device, slots.shape[1], self.inter), slots, pool.down,
                               out=self.outs[c], tiles=cfg.tiles, **cfg.down_options)
        return routed_experts(hidden, slots, weights, pool.gate_up, pool.down, out=self.outs[c],
                              tiles=variant.tiles, down_release=variant.down_release,
                              down_prefetch=variant.down_options["prefetch"])

    def check(self, pool: Pool, variant) -> dict:
        """Max error relative to max |float32 reference| over the first calls; bitwise repeat."""
        errs, repeat = [], True
        for c in range(min(3, len(self.inputs))):
            key = (pool.fmt.name, c)
            if key not in self.refs:
                self.refs[key] = routed_reference(*self.inputs[c], pool.gate_up, pool.down)
            want = self.refs[key]
            got = self.call(pool, variant, c).clone()
            errs.append(((got - want).abs().max() / want.abs().max()).item())
            repeat &= bool(torch.equal(got, self.call(pool, variant, c)))
        return {"max_rel_err": max(errs), "bitwise_repeat": repeat}

    def graph(self, pool: Pool, variant) -> torch.cuda.CUDAGraph:
        for c in range(len(self.inputs)):  # compile, make the scratch
            self.call(pool, variant, c)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in range(len(self.inputs)):
                self.call(pool, variant, c)
        return graph


def time_variants(graphs: dict, calls: int, reps: int, warmup: int) -> dict:
    """us/call per variant: every rep replays each graph once, in a rotating order ({} for no graphs: past
    GEMV_MAX_TOKENS only the tensor-core kernels run, and their launches are not timed alone)."""
    names = list(graphs)
    if not names:
        return {}
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


def run_case(pools: dict[str, Pool], shape: str, tokens: int, num_slots: int, bandwidth: float, args) -> list[dict]:
    """Rows of one (shape, T): one per (format, variant), every format's variants timed together."""
    case = Case(shape, tokens, num_slots, args)
    variants = {}  # (format, name) -> (pool, variant)
    for fname, pool in pools.items():
        for cfg in format_configs(args.configs, pool.fmt) if tokens <= GEMV_MAX_TOKENS else ():
            variants[(fname, cfg.name)] = (pool, cfg)
        for tiles in args.mma:
            variants[(fname, tiles.name)] = (pool, tiles)
        if pool.fmt.dense:
            variants[(fname, "torch")] = (pool, "torch")
    checks = {key: case.check(pool, v) for key, (pool, v) in variants.items()}
    for (fname, name), chk in checks.items():  # the torch baseline rounds to bf16 per linear: recorded only
        if name != "torch" and (chk["max_rel_err"] > 1e-3 or not chk["bitwise_repeat"]):
            raise SystemExit(f"{shape} T={tokens} {fname} {name}: check failed {chk}; not timing")
    if args.read_floor:
        for fname, pool in pools.items():
            for name in ("read1", "read2"):
                variants[(fname, name)] = (pool, name)
                checks[(fname, name)] = {"max_rel_err": None, "bitwise_repeat": None}
    graphs = {key: case.graph(pool, v) for key, (pool, v) in variants.items()}
    timed = time_variants(graphs, args.calls, args.reps, args.warmup)
    del graphs
    # each launch alone: which one is far from its share of the floor
    parts = {(*key, part): (pool, (v, part)) for key, (pool, v) in variants.items() if isinstance(v, Config)
             for part in ("gate_up", "down")}
    alone = time_variants({key: case.graph(pool, v) for key, (pool, v) in parts.items()}, args.calls,
                          args.reps, args.warmup)
    base = timed.get(("bf16", DEFAULT.name), {}).get("us_median")
    torch_us = timed.get(("bf16", "torch"), {}).get("us_median")
    rows = []
    for key, t in timed.items():
        fname, name = key
        pool, v = variants[key]
        nbytes = case.bytes_per_call(pool.fmt)
        floor_us = nbytes / bandwidth * 1e6
        read2 = timed.get((fname, "read2"), {}).get("us_median")
        row = {"shape": shape, "format": fname, "tokens": tokens, "config": name, "slots": num_slots,
               "kernel": "mma" if isinstance(v, MmaTiles) else ("gemv" if isinstance(v, Config) else name),
               "ratio_to_read2": t["us_median"] / read2 if read2 else None,
               "distinct_slots_per_call": case.distinct, "bytes_per_call": nbytes, "floor_us": floor_us, **t,
               "ratio_to_floor": t["us_median"] / floor_us, "gbps": nbytes / (t["us_median"] * 1e-6) / 1e9,
               "speedup_vs_bf16": base / t["us_median"] if base else None,
               "speedup_vs_torch": torch_us / t["us_median"] if torch_us else None, **checks[key]}
        if isinstance(v, Config):
            shares = launch_shares(pool.fmt, case.hid, case.inter)
            row.update(tiles=dataclasses.asdict(v.tiles), down_release=v.down_release, down_prefetch=v.down_prefetch,
                       default=v == default_config(pool.fmt),
                       launches={part: {**alone[(*key, part)], "ratio_to_floor":
                                        alone[(*key, part)]["us_median"] / (floor_us * shares[part])}
                                 for part in ("gate_up", "down")})
        elif isinstance(v, MmaTiles):
            row.update(tiles=dataclasses.asdict(v), default=v == DEFAULT_MMA_TILES)
        rows.append(row)
    return rows


def _speedup(x: float | None) -> str:
    return "      -" if x is None else f"{x:6.2f}x"


def table(rows: list[dict]) -> str:
    """The summary: each launch alone, then one line per (shape, format, T, config) (a group's lines
    fastest first), then each (shape, format) at T=1 against TARGET_RATIO."""
    lines = [TARGET,
             ("us per call under CUDA-graph replay (median [min..max]); floor = the format's weight bytes "
              "of the distinct slots / d2d copy bandwidth; ratio = median / floor; vs bf16 = bf16 default "
              "config's median / median (same shape, T)")]
    for r in rows:
        for part, v in r.get("launches", {}).items():
            lines.append(f"{r['shape']:>10} {r['format']:>5} {r['tokens']:>2} {r['config'] + '/' + part:>34} alone "
                         f"{v['us_median']:8.2f} us, {v['ratio_to_floor']:5.2f}x its share of the floor")
    lines.append(f"{'shape':>10} {'fmt':>5} {'T':>2} {'config':>26} {'median':>8} {'min..max':>15} {'floor':>7} "
                 f"{'ratio':>6} {'GB/s':>6} {'vs bf16':>7} {'vs torch':>8}")
    groups: dict[tuple, int] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["tokens"], r["format"]), len(groups))
    for r in sorted(rows, key=lambda r: (groups[(r["shape"], r["tokens"], r["format"])], r["us_median"])):
        lines.append(f"{r['shape']:>10} {r['format']:>5} {r['tokens']:>2} {r['config']:>26} {r['us_median']:8.2f} "
                     f"{r['us_min']:7.2f}..{r['us_max']:<7.2f} {r['floor_us']:7.2f} {r['ratio_to_floor']:6.2f} "
                     f"{r['gbps']:6.0f} {_speedup(r['speedup_vs_bf16'])} {_speedup(r['speedup_vs_torch']):>8}")
    lines += mma_targets(rows)
    for r in rows:  # the target: each format's default config at T=1
        if r["tokens"] == 1 and r.get("default") and r["kernel"] == "gemv":
            best = min((o for o in rows if (o["shape"], o["format"], o["tokens"]) == (r["shape"], r["format"], 1)
                        and "launches" in o), key=lambda o: o["us_median"])
            reads = {o["config"]: o["ratio_to_floor"] for o in rows if o["config"] in ("read1", "read2")
                     and (o["shape"], o["format"], o["tokens"]) == (r["shape"], r["format"], 1)}
            lines.append(f"T=1 {r['shape']} {r['format']}: default {r['config']} {r['ratio_to_floor']:.2f}x the floor "
                         f"({'meets' if r['ratio_to_floor'] <= TARGET_RATIO else 'misses'} {TARGET_RATIO}x)"
                         + ("" if best is r else f"; best {best['config']} {best['ratio_to_floor']:.2f}x")
                         + "".join(f"; {name} (bare streaming) {reads[name]:.2f}x" for name in sorted(reads)))
    return "\n".join(lines)


def mma_targets(rows: list[dict]) -> list[str]:
    """MMA_TARGET per (shape, quantized format, T): the fastest tensor-core row against read2 at T=1 and
    against the floor from T=MMA_FLOOR_FROM, beside the fastest one-program-per-pair row."""
    lines = [MMA_TARGET] if any(r["kernel"] == "mma" for r in rows) else []
    keys = dict.fromkeys((r["shape"], r["format"], r["tokens"]) for r in rows if r["kernel"] == "mma")
    for shape, fmt, tokens in keys:
        if get_format(fmt).dense or not (tokens == 1 or tokens >= MMA_FLOOR_FROM):
            continue
        mine = [r for r in rows if (r["shape"], r["format"], r["tokens"]) == (shape, fmt, tokens)]
        best = min((r for r in mine if r["kernel"] == "mma"), key=lambda r: r["us_median"])
        gemv = min((r for r in mine if r["kernel"] == "gemv"), key=lambda r: r["us_median"], default=None)
        if tokens == 1:
            got, limit, what = best["ratio_to_read2"], MMA_READ2_RATIO, "read2"
        else:
            got, limit, what = best["ratio_to_floor"], MMA_FLOOR_RATIO, "the floor"
        verdict = "not measured (no --read-floor)" if got is None else \
            f"{got:.2f}x {what} ({'meets' if got <= limit else 'misses'} {limit}x)"
        lines.append(f"T={tokens} {shape} {fmt}: mma {best['config']} {best['us_median']:.2f} us, {verdict}"
                     + ("" if gemv is None else f"; one program a pair {gemv['config']} {gemv['us_median']:.2f} us "
                        f"({gemv['us_median'] / best['us_median']:.2f}x the mma's time)"))
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-next,qwen3-30b", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma list of expert formats, of {format_names()} (mixtral: about 18 GiB of pools "
                         "for all five)")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--configs", default="default",
                    help="'default' (each format's own tiles), 'sweep' or comma list of config names "
                         f"({NAME_HELP}), applied to every format")
    ap.add_argument("--slots", type=int, default=None,
                    help="pool slots (default per shape: " + ", ".join(f"{n} {v[3]}" for n, v in SHAPES.items()) + ")")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mma", default="default",
                    help=f"tensor-core kernels (routed_experts_mma) timed beside: 'none', 'default', 'sweep' or a "
                         f"comma list of {MMA_NAME_HELP}")
    ap.add_argument("--read-floor", action="store_true",
                    help="also time read1 / read2 per format: the same slots' bytes (values and scales) streamed in "
                         "one / two launches, no arithmetic")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/routed-<date>.json)")
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",")
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    args.formats = list(dict.fromkeys(args.formats.split(",")))
    for f in args.formats:
        if f not in format_names():
            ap.error(f"--formats: {f!r} is not one of {format_names()}")
        for s in args.shapes:
            hid, inter, _, _ = SHAPES[s]
            try:
                get_format(f).expert_bytes(hid, inter)
            except FormatError as e:
                ap.error(f"--formats: {f} cannot store shape {s}: {e}")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: {args.tokens!r} is not a comma list of ints")
    if not all(1 <= t <= MMA_MAX_TOKENS for t in args.tokens):
        ap.error(f"--tokens: each in 1..{MMA_MAX_TOKENS} (the one-program-a-pair kernels run up to "
                 f"{GEMV_MAX_TOKENS}), got {args.tokens}")
    for name in ("slots", "calls", "reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    args.configs = config_names(args.configs)
    args.mma = parse_mma(args.mma)
    if not args.mma and any(t > GEMV_MAX_TOKENS for t in args.tokens):
        ap.error(f"--tokens above {GEMV_MAX_TOKENS} run only the tensor-core kernels: drop --mma none")
    return args


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_routed needs a CUDA GPU; see --help", file=sys.stderr)
        sys.exit(2)
    info = benchmeta.machine()
    bandwidth = benchmeta.d2d_bandwidth()
    print(f"{info['gpu']}: device-to-device copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in args.shapes:
        num_slots = args.slots or SHAPES[shape][3]
        start = time.perf_counter()
        pools = make_pools(shape, num_slots, args.formats)
        sizes = ", ".join(
            f"{f} {num_slots * p.fmt.expert_bytes(*SHAPES[shape][:2]) / 2**30:.2f}" for f, p in pools.items()
        )
        print(f"{shape}: {num_slots} slots, pools (GiB) {sizes}, built in {time.perf_counter() - start:.1f} s",
              flush=True)
        for tokens in args.tokens:
            case_rows = run_case(pools, shape, tokens, num_slots, bandwidth, args)
            rows += case_rows
            for fname in args.formats:
                mine = [r for r in case_rows if r["format"] == fname and r["kernel"] in ("gemv", "mma")]
                best = min(mine, key=lambda r: r["us_median"])
                print(f"{shape} T={tokens} {fname}: floor {best['floor_us']:.2f} us, best {best['config']} "
                      f"{best['us_median']:.2f} us ({best['ratio_to_floor']:.2f}x floor, "
                      f"{_speedup(best['speedup_vs_bf16']).strip()} bf16)", flush=True)
        del pools
        torch.cuda.empty_cache()
    out = Path(args.out or Path(__file__).parent / "results" / f"routed-{info['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "mma")}
    settings["mma"] = [t.name for t in args.mma]
    doc = {"bench": "routed", "machine": info, "copy_bandwidth_bytes_per_s": bandwidth,
           "settings": settings, "target": TARGET, "rows": rows}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    print(table(rows))


if __name__ == "__main__":
    main()
