"""Registers, spills and code size of the device ensure kernel for sm_90 (no GPU needed).

    python benchmarks/probes/ensure_registers.py [--seq-max N] [--out FILE]

Compiles expertcache.device_ensure.ensure_kernel with Triton for sm_90a at the default tiles (512-slot
programs, 4 warps, k = 10 so a 16-wide query; the layer count is not compiled in) and
DeviceCache's default lean kernel with early reads, rule's growth table, mirror, late ranks and int32 score
(--wide-score: int64), for every policy, with
and without router logits (32 entries), on one program and on several, and prints ptxas's register
and spill counts and the number of SASS instructions (cuobjdump) per variant.
--seq-max: DeviceCache's seq_max (default expertcache.device_ensure.SEQ_MAX; 16 or more: no sort).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile

import triton

from expertcache.device import CHUNK, NUM_WARPS, DeviceCache
from expertcache.device_ensure import SEQ_MAX, ensure_kernel
from moe.kernels.triton_launch import compile_for_sm

TYPES = ("*i32", "*i32", "*fp32", "*i32", "*i32", "*i64", "*i64", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64",
         "*i32", "*i32", "*i32", "*i64", "*i32", "*i32", "*i64") + ("i32",) * 8
JIT = {"do_not_specialize": ["layer", "num_experts", "num_layers", "num_slots", "n_ids", "k", "rows", "T"]}


def ptxas_info(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    err = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, err)) else 0  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}


def sass_instructions(cubin: bytes) -> int:
    """Instructions in the cubin's SASS (cuobjdump -sass; each is 16 bytes of code on sm_90)."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return len(re.findall(r"/\*[0-9a-f]{4,}\*/", out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-max", type=int, default=SEQ_MAX)
    ap.add_argument("--chunk", type=int, default=CHUNK, help="slots per program (CHUNK)")
    ap.add_argument("--num-warps", type=int, default=NUM_WARPS)
    ap.add_argument("--policies", default="lru,rule,lfuda")
    ap.add_argument("--wide-score", action="store_true",
                    help="rule's score in int64 (DeviceCache(narrow_score=False)); the default is int32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = inspect.signature(ensure_kernel.fn).parameters
    defaults = inspect.signature(DeviceCache.__init__).parameters
    rows = []
    wanted = args.policies.split(",")
    for policy, name in ((0, "lru"), (1, "rule"), (2, "lfuda")):
        if name not in wanted:
            continue
        for logits in (False, True):
            for single in (True, False):
                grid = 1 if single else 32
                cx = dict(POLICY=policy, HAS_LOGITS=logits, CHUNK=args.chunk, BLOCK_Q=16, BLOCK_R=32 if logits else 1,
                          BLOCK_C=triton.next_power_of_2(grid * 16), SINGLE=single,
                          SEQ_MAX=args.seq_max)
                for flag, option in (("LEAN", "lean"), ("EARLY", "early_reads"), ("TABLE", "rule_table")):
                    if flag in params and option in defaults:
                        cx[flag] = defaults[option].default
                if "MIRROR" in params:  # rule_mirror=None: on for rule
                    cx["MIRROR"] = policy == 1 if defaults["rule_mirror"].default is None else defaults["rule_mirror"].default
                if "LATE_RANKS" in params:  # late_ranks=None: on for rule
                    cx["LATE_RANKS"] = policy == 1
                if "NARROW" in params:  # narrow_score=None: on for rule at its default constants
                    cx["NARROW"] = policy == 1 and not args.wide_score
                asm = compile_for_sm(ensure_kernel, TYPES, cx, args.num_warps, 90, JIT)
                info = dict(ptxas_info(asm["ptx"]), sass_instructions=sass_instructions(asm["cubin"]))
                rows.append({"policy": name, "logits": logits, "programs": "one" if single else "several", **info})
                print(f"{name:>5} logits={logits!s:5} {rows[-1]['programs']:>7}: {info['registers']:3d} registers, "
                      f"spills {info['spill_stores']} B stored / {info['spill_loads']} B loaded, "
                      f"{info['sass_instructions']} SASS instructions", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "ensure_registers", "arch": "sm_90a", "triton": triton.__version__,
                       "chunk": args.chunk, "num_warps": args.num_warps, "seq_max": args.seq_max,
                       "lean": defaults["lean"].default, "early_reads": defaults["early_reads"].default,
                       "rule_table": defaults["rule_table"].default, "rule_mirror": "on for rule",
                       "late_ranks": "on for rule", "narrow_score": "off" if args.wide_score else "on for rule",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
