"""Registers and spills of the device ensure kernel for sm_90, from ptxas -v (no GPU needed).

    python benchmarks/ensure_registers.py [--out FILE]

Compiles expertcache.device_ensure.ensure_kernel with Triton for sm_90a at the default tiles (512-slot
programs, 4 warps, k = 10 so a 16-wide query), for every policy, with and without router logits (32
entries), on one program and on several, and prints ptxas's register and spill counts per variant.
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

from expertcache.device import CHUNK, NUM_WARPS
from expertcache.device_ensure import ensure_kernel
from moe.triton_launch import compile_for_sm

TYPES = ("*i32", "*i32", "*fp32", "*i32", "*i32", "*i64", "*i64", "*i64", "*i64", "*fp32", "*i64", "*i64",
         "*i32", "*i32", "*i32", "*i64", "*i32", "*i32") + ("i32",) * 8
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = inspect.signature(ensure_kernel.fn).parameters
    rows = []
    for policy, name in ((0, "lru"), (1, "rule"), (2, "lfuda")):
        for logits in (False, True):
            for single in (True, False):
                grid = 1 if single else 32
                cx = dict(POLICY=policy, HAS_LOGITS=logits, CHUNK=CHUNK, BLOCK_Q=16, BLOCK_R=32 if logits else 1,
                          BLOCK_C=triton.next_power_of_2(grid * 16), BLOCK_L=64, SINGLE=single)
                if "SEQ_MAX" in params:
                    cx["SEQ_MAX"] = 4
                info = ptxas_info(compile_for_sm(ensure_kernel, TYPES, cx, NUM_WARPS, 90, JIT)["ptx"])
                rows.append({"policy": name, "logits": logits, "programs": "one" if single else "several", **info})
                print(f"{name:>5} logits={logits!s:5} {rows[-1]['programs']:>7}: {info['registers']:3d} registers, "
                      f"spills {info['spill_stores']} B stored / {info['spill_loads']} B loaded", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "ensure_registers", "arch": "sm_90a", "triton": triton.__version__,
                       "chunk": CHUNK, "num_warps": NUM_WARPS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
