"""SASS instructions per weight of the routed kernels, per expert format, for sm_90 (no GPU needed).

    python benchmarks/probe_routed_sass.py [--shape qwen3-30b|qwen3-next|gpt-oss-20b] [--formats LIST]
        [--tokens N] [--mma NAME,NAME] [--out FILE]

Compiles each format's routed gate_up and down as the decode layer launches them (moe.kernels.routed:
one program a (token, expert) pair and row tile, its tiles QUANTIZED_ROUTED_TILES or, for bf16,
DEFAULT_ROUTED_TILES) and the tensor-core kernels (moe.kernels.routed_mma, each --mma tile set), bf16
activations, and counts the SASS instructions (cuobjdump) a thread issues per weight element it covers:

    one program a pair:  every instruction of the kernel (its loops are unrolled) over the weights a
                         thread reads: 2 * block_i * H (gate_up) or block_h * k * I (down) / threads
    tensor cores:        the instructions of the innermost loop holding the tensor-core mma (HGMMA, or
                         HMMA where a tile is too small for wgmma), over the weights one of its
                         iterations reads a thread: 2 * block_n * 128 (gate_up) or down_block_n * 128
                         (down) / threads

A kernel bound by its arithmetic takes about that many issue slots per weight, so the count says how far
it is from streaming its bytes: at the H200's 132 SMs x 4 schedulers, the 4-bit formats' HBM floor
allows about 3 to 4 (docs/formats.md). Counts, not timings: the GPU benchmarks (bench_routed.py) say
what the kernels reach. JSON: one row per (format, kernel, launch) with the count, the instructions
and the weights they cover, the registers and the most common opcodes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

import triton

from moe.kernels.plan import DEFAULT_ROUTED_TILES, QUANTIZED_ROUTED_TILES
from moe.kernels.routed_host import compile_for_target
from moe.kernels.routed_mma import DEFAULT_MMA_TILES, compile_mma_for_target
from moe.kernels.tiles import MmaTiles
from moe.kernels.triton_launch import sass, sass_registers

SHAPES = {"qwen3-30b": (2048, 768, 8), "qwen3-next": (2048, 512, 10), "gpt-oss-20b": (2880, 2880, 4)}
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4", "int4")
BLOCK_K = 128  # the tensor-core kernels' columns an iteration (moe.kernels.routed_mma_kernels.BLOCK_K)
MMA_OPCODES = ("HGMMA", "HMMA")  # wgmma (its A operand the decoded weights, in registers) or mma.sync
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_OPCODE = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def innermost_loop(code: list[tuple[int, str]], marker: str | tuple[str, ...]) -> list[str]:
    """The instructions of the smallest loop (a backward branch's span) that holds an instruction whose
    opcode starts with `marker` (or one of them); [] when there is none."""
    loops = [(int(m.group(1), 16), addr) for addr, ins in code
             if (m := _BRANCH.search(ins)) and int(m.group(1), 16) < addr]
    spans = [[ins for a, ins in code if lo <= a <= hi] for lo, hi in loops]
    spans = [s for s in spans if any(_opcode(ins).startswith(marker) for ins in s)]
    return min(spans, key=len, default=[])


def _opcode(ins: str) -> str:
    m = _OPCODE.match(ins)
    return m.group(1).split(".")[0] if m else ""


def _row(fmt: str, kernel: str, launch: str, asm: dict, instructions: list[str], weights: float) -> dict:
    ops = collections.Counter(_opcode(i) for i in instructions)
    return {"format": fmt, "kernel": kernel, "launch": launch, "instructions": len(instructions),
            "weights_per_thread": weights, "per_weight": len(instructions) / weights,
            "registers": sass_registers(asm["cubin"]), "opcodes": dict(ops.most_common(8))}


def probe(shape: str, fmt: str, tokens: int, mma: list[MmaTiles]) -> list[dict]:
    """Rows of one format: the one-program-a-pair gate_up and down, then each tensor-core tile set's."""
    hidden, inter, top_k = SHAPES[shape]
    tiles = DEFAULT_ROUTED_TILES if fmt == "bf16" else QUANTIZED_ROUTED_TILES
    gemv = compile_for_target(top_k, hidden, inter, "bf16", tiles, expert_format=fmt)
    block_i, _, block_h, _ = tiles.capped(hidden, inter)
    rows = []
    for launch, name, weights, warps in (
            ("gate_up", "_gate_up_kernel", 2 * block_i * hidden, tiles.warps_gate_up),
            ("down", "_down_kernel", block_h * top_k * inter, tiles.warps_down)):
        code = [ins for _, ins in sass(gemv[name]["cubin"])]
        rows.append(_row(fmt, f"pair {tiles.name}", launch, gemv[name], code, weights / (32 * warps)))
    for t in mma:
        asm = compile_mma_for_target(top_k, hidden, inter, "bf16", tokens=tokens, tiles=t, expert_format=fmt)
        for launch, name, weights, warps in (
                ("gate_up", "_gate_up_mma", 2 * t.block_n * BLOCK_K, t.warps_gate_up),
                ("down", "_down_mma", t.down_block_n * BLOCK_K, t.warps_down)):
            loop = innermost_loop(sass(asm[name]["cubin"]), MMA_OPCODES)
            rows.append(_row(fmt, f"mma {t.name}", launch, asm[name], loop, weights / (32 * warps)))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'format':>6} {'kernel':>32} {'launch':>8} {'instr/weight':>12} {'regs':>5}  top opcodes"]
    for r in rows:
        top = " ".join(f"{k}:{v}" for k, v in list(r["opcodes"].items())[:5])
        lines.append(f"{r['format']:>6} {r['kernel']:>32} {r['launch']:>8} {r['per_weight']:12.2f} "
                     f"{r['registers'] or '-':>5}  {top}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    ap.add_argument("--tokens", type=int, default=1, help="T the tensor-core kernels are compiled for (1..64)")
    ap.add_argument("--mma", default=DEFAULT_MMA_TILES.name, help="comma list of MmaTiles names (MmaTiles.name)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/routed-sass.json)")
    args = ap.parse_args(argv)
    args.formats = args.formats.split(",")
    for f in args.formats:
        if f not in FORMATS:
            ap.error(f"--formats: {f!r} is not one of {list(FORMATS)}")
    if not 1 <= args.tokens <= 64:
        ap.error(f"--tokens must be in 1..64, got {args.tokens}")
    args.mma_tiles = []
    for name in args.mma.split(","):
        try:
            args.mma_tiles.append(MmaTiles.from_name(name))
        except ValueError as e:
            ap.error(f"--mma: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("probe_routed_sass compiles for sm_90: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    rows = [r for f in args.formats for r in probe(args.shape, f, args.tokens, args.mma_tiles)]
    out = Path(args.out or Path(__file__).parent / "results" / "routed-sass.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"shape": args.shape, "formats": args.formats, "tokens": args.tokens, "mma": args.mma,
                "activations": "bf16", "arch": "sm_90", "triton": triton.__version__}
    out.write_text(json.dumps({"bench": "routed-sass", "settings": settings, "rows": rows}, indent=1))
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
