"""Registers, spills and code size of the device ensure kernel for sm_90 (no GPU needed).

    python benchmarks/probe_ensure_registers.py [--chunk N] [--num-warps N] [--seq-max N]
        [--layers L] [--wide-score] [--policies lru,rule,lfuda] [--out FILE]

Compiles expertcache.device.ensure.ensure_kernel with Triton for sm_90a as DeviceCache launches it
(expertcache.device.cache.resolve_launch for a pool of --layers layers, default 48: rule from its mirror up
to 127 layers, through the keys past that; --wide-score gives rule constants past Rule.int32_scores,
so its score is int64), for every policy, with and without router logits (32 entries), on one
program and on several, at k = 10 (a 16-wide query) and the tiles given (default: 512-slot programs
of 4 warps, seq_max 16: no sort), and prints ptxas's register and spill counts and the number of
SASS instructions (cuobjdump) per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton

from expertcache import CacheGeometry
from expertcache.device.cache import CHUNK, NUM_WARPS, EnsureTuning, resolve_launch
from expertcache.device.ensure import JIT_OPTIONS, KERNEL_TYPES, SEQ_MAX, ensure_kernel
from expertcache.policies import get_policy
from moe.kernels.triton_launch import compile_for_sm, sass

WIDE = {"w": 67.0}  # rule's constants past Rule.int32_scores (its score in int64)


def ptxas_info(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    err = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    def num(pat):
        return int(m.group(1)) if (m := re.search(pat, err)) else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}


def sass_instructions(cubin: bytes) -> int:
    """Instructions in the cubin's SASS (cuobjdump -sass; each is 16 bytes of code on sm_90)."""
    return len(sass(cubin))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-max", type=int, default=SEQ_MAX)
    ap.add_argument("--chunk", type=int, default=CHUNK, help="slots per program (EnsureTuning.chunk)")
    ap.add_argument("--num-warps", type=int, default=NUM_WARPS)
    ap.add_argument("--layers", type=int, default=48, help="the pool's layers (rule's mirror up to 127)")
    ap.add_argument("--policies", default="lru,rule,lfuda")
    ap.add_argument("--wide-score", action="store_true",
                    help=f"rule with constants {WIDE}, past Rule.int32_scores: its score in int64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tuning = EnsureTuning(args.chunk, args.num_warps, args.seq_max)
    rows = []
    for name in args.policies.split(","):
        for single in (True, False):
            grid = 1 if single else 32
            g = CacheGeometry(args.layers, 4 * grid * args.chunk, grid * args.chunk)
            constants = WIDE if args.wide_score and name == "rule" else {}
            launch = resolve_launch(g, get_policy(name, g, **constants), tuning)
            for logits in (False, True):
                cx = dict(launch.constexprs(), HAS_LOGITS=logits, BLOCK_Q=16, BLOCK_R=32 if logits else 1,
                          BLOCK_C=triton.next_power_of_2(grid * 16), SINGLE=single)
                asm = compile_for_sm(ensure_kernel, KERNEL_TYPES, cx, args.num_warps, 90, JIT_OPTIONS)
                info = dict(ptxas_info(asm["ptx"]), sass_instructions=sass_instructions(asm["cubin"]))
                rows.append({"policy": name, "logits": logits, "programs": "one" if single else "several",
                             "mirror": launch.mirror, "narrow": launch.narrow, **info})
                print(f"{name:>5} logits={logits!s:5} {rows[-1]['programs']:>7}: {info['registers']:3d} registers, "
                      f"spills {info['spill_stores']} B stored / {info['spill_loads']} B loaded, "
                      f"{info['sass_instructions']} SASS instructions", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "ensure_registers", "arch": "sm_90a", "triton": triton.__version__,
                       "chunk": args.chunk, "num_warps": args.num_warps, "seq_max": args.seq_max,
                       "layers": args.layers, "wide_score": args.wide_score, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
