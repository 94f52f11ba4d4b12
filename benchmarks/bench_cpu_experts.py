"""CPU routed experts (moe.kernels.cpu_experts) read in place from host memory: weight GB/s per format,
beside torch, and beside the host -> device link when both run at once.

    per format: a HostStore of >= --store-gib of experts (a few random experts quantized with the
    format's own `quantize`, repeated to fill it; calls take the next --experts keys in turn, so no
    call finds its weights in the CPU caches)
    -> CpuExperts.moe of --experts experts at each --tokens T, on --threads threads (the caller and its
       pool, which spins --spin waits between calls as a decode's hand-off keeps it):
       GB/s = expert_bytes * experts / time (the format's bytes read)
    -> baselines on the same calls (each timed in its own loop, after the kernel's): torch's bf16 matmul on the bf16
       store, torch's float32 matmul on a float32 store (the "upper" row: decoded weights, float32 bytes),
       and numpy's float32 matmul on one thread (OpenBLAS): one core's streaming rate
    -> with CUDA and --with-link: a thread copying 64 MiB chunks back to back from a separate pinned
       region (>= 4 GiB) to the device (copy engine), alone, then while the kernel runs: each one's GB/s
       alone and together, their sum, and (link + cpu together) / link alone (target >= 1.8)
    -> table (last) and JSON (default benchmarks/results/cpu-experts.json): every figure as median and
       [min, max] over the repetitions, the CPU model, core count, numba / torch versions, the commit

Run: python benchmarks/bench_cpu_experts.py [--geometry qwen3-30b|gpt-oss] [--formats bf16,fp8,...]
     [--experts 4] [--tokens 1] [--store-gib 2] [--threads N] [--spin N] [--reps 30] [--with-link] [--out FILE]
Runs without CUDA (no link rows then). The script runs itself again with THREAD_ENV set where it is not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import benchmeta
import numba
import numpy as np
import torch

from expertcache.formats import resolve_format
from expertcache.pool import HostStore
from moe.kernels.cpu_experts import MAX_TOKENS, SPIN_PAUSES, CpuExperts, set_threads
from moe.model.checkpoint import write_experts
from moe.model.config import EXPERT_BIAS_BANKS, MoEConfig
from moe.model.reference import gated_activation

GEOMETRIES = {  # hidden, expert_intermediate, activation, expert biases
    "qwen3-30b": (2048, 768, "silu", False),
    "gpt-oss": (2880, 2880, "swiglu_clamped", True),
}
FORMATS = ("bf16", "fp8", "int4", "nvfp4", "mxfp4")
BASE_EXPERTS = 8  # distinct random experts, repeated to fill a store
LINK_CHUNK = 64 << 20
LINK_REGION = 4 << 30
TARGET = "target: (link + cpu together) / link alone >= 1.8 in every format"


def stats(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def make_store(cfg: MoEConfig, gib: float, seed: int = 0) -> HostStore:
    """A store of cfg's banks holding >= gib GiB: BASE_EXPERTS random experts (N(0, 1/fan_in)) quantized in
    cfg.expert_format, repeated. Pinned where CUDA is present."""
    h, i = cfg.hidden, cfg.expert_intermediate
    per = sum(b.row_bytes for b in cfg.expert_banks())
    keys = max(2 * BASE_EXPERTS, math.ceil(gib * (1 << 30) / per))
    g = torch.Generator().manual_seed(seed)
    base = HostStore.empty(cfg.expert_banks(), BASE_EXPERTS, pin=False)
    write_experts(base, cfg.format, "gate_up", torch.randn(BASE_EXPERTS, 2 * i, h, generator=g) * h ** -0.5, 0, 2)
    write_experts(base, cfg.format, "down", torch.randn(BASE_EXPERTS, h, i, generator=g) * i ** -0.5, 0, 1)
    if cfg.expert_bias:
        for name, width in zip(EXPERT_BIAS_BANKS, (2 * i, h)):
            base.tensor(name).copy_(torch.randn(BASE_EXPERTS, width, generator=g) * 0.02)
    store = HostStore.empty(cfg.expert_banks(), keys)
    for b in cfg.expert_banks():
        src, dst = base.tensor(b.name), store.tensor(b.name)
        for first in range(0, keys, BASE_EXPERTS):
            n = min(BASE_EXPERTS, keys - first)
            dst[first:first + n].copy_(src[:n])
    return store


class Calls:
    """Rotating calls of `experts` keys at T tokens over one store: the kernel and the torch / numpy baselines."""

    def __init__(self, store: HostStore, cfg: MoEConfig, experts: int, tokens: int, spin: int) -> None:
        self.store, self.cfg, self.experts, self.tokens = store, cfg, experts, tokens
        self.kernel = CpuExperts(store, cfg)
        self.kernel.spin_pauses = spin
        self.turn = 0
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(tokens, cfg.hidden, generator=g)
        self.weights = torch.rand(tokens, experts, generator=g)
        self.out = np.empty((tokens, cfg.hidden), np.float32)

    def next_keys(self) -> list[int]:
        n = self.store.num_keys
        keys = [(self.turn * self.experts + j) % n for j in range(self.experts)]
        self.turn += 1
        return keys

    def run_kernel(self) -> None:
        ids = torch.tensor([self.next_keys()] * self.tokens, dtype=torch.int32)
        self.kernel.moe(0, self.x, ids, self.weights, self.out)

    def run_torch(self, lib: str = "torch") -> None:
        """The same experts with torch (or numpy) matmuls on the store's own dtype (bf16 / float32)."""
        cfg, keys = self.cfg, self.next_keys()
        gu, dn = self.store.tensor("gate_up"), self.store.tensor("down")
        x = self.x.to(gu.dtype)
        out = torch.zeros(self.tokens, cfg.hidden)
        for j, key in enumerate(keys):
            if lib == "numpy":
                h = torch.from_numpy(x.numpy() @ gu[key].numpy().T)
            else:
                h = x @ gu[key].T
            if cfg.expert_bias:
                h = h + self.store.tensor(EXPERT_BIAS_BANKS[0])[key]
            a = gated_activation(h.float(), cfg).to(gu.dtype)
            y = torch.from_numpy(a.numpy() @ dn[key].numpy().T) if lib == "numpy" else a @ dn[key].T
            out += self.weights[:, j:j + 1] * y.float()


def time_calls(fns: dict, reps: int, warmup: int) -> dict:
    """Seconds of each of fns (name -> call) per repetition, interleaved in a rotating order."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


class LinkLoad:
    """A thread copying LINK_CHUNK chunks of a pinned region to the device back to back (copy engine, one
    stream), counting bytes and seconds between `start` and `stop`."""

    def __init__(self) -> None:
        self.src = torch.empty(LINK_REGION, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(LINK_CHUNK, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.running = False

    def _loop(self) -> None:
        chunks, i = LINK_REGION // LINK_CHUNK, 0
        with torch.cuda.stream(self.stream):
            while self.running:
                for _ in range(8):
                    self.dst.copy_(self.src[(i % chunks) * LINK_CHUNK:(i % chunks + 1) * LINK_CHUNK], non_blocking=True)
                    i += 1
                self.stream.synchronize()
                self.bytes += 8 * LINK_CHUNK
        self.seconds = time.perf_counter() - self.t0

    def start(self) -> None:
        self.running, self.bytes = True, 0
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self) -> float:
        """Stop the copies; GB/s over the run."""
        self.running = False
        self.thread.join()
        return self.bytes / self.seconds / 1e9


def link_rows(link: LinkLoad, calls: Calls, nbytes: int, args) -> dict:
    """Link alone, the kernel alone, both at once (GB/s medians and spreads of --link-reps windows)."""
    alone, cpu_alone, cpu_with, link_with = [], [], [], []
    for _ in range(args.link_reps):
        link.start()
        time.sleep(args.link_seconds)
        alone.append(link.stop())
        cpu_alone += [nbytes / t / 1e9 for t in time_calls({"k": calls.run_kernel}, args.reps, 1)["k"]]
        link.start()
        cpu_with += [nbytes / t / 1e9 for t in time_calls({"k": calls.run_kernel}, args.reps, 1)["k"]]
        link_with.append(link.stop())
    both = float(np.median(link_with)) + float(np.median(cpu_with))
    return {"link_alone_gbps": stats(alone), "cpu_alone_gbps": stats(cpu_alone), "link_with_cpu_gbps": stats(link_with),
            "cpu_with_link_gbps": stats(cpu_with), "sum_gbps": both, "ratio": both / float(np.median(alone))}


def bench_format(name: str, args, link: LinkLoad | None) -> dict:
    h, i, activation, bias = args.shape
    cfg = MoEConfig(hidden=h, num_experts=args.experts, top_k=args.experts, expert_intermediate=i, expert_format=name,
                    activation=activation, expert_bias=bias)
    store = make_store(cfg, args.store_gib)
    cfg = MoEConfig(hidden=h, num_experts=store.num_keys, top_k=args.experts, expert_intermediate=i,
                    expert_format=name, activation=activation, expert_bias=bias)
    fmt = resolve_format(name)
    nbytes = fmt.expert_bytes(h, i) * args.experts
    row = {"format": name, "expert_bytes": fmt.expert_bytes(h, i), "store_keys": store.num_keys,
           "store_gib": store.nbytes / (1 << 30), "tokens": {}}
    for tokens in args.tokens:
        calls = Calls(store, cfg, args.experts, tokens, args.spin)
        fns = {"kernel": calls.run_kernel}
        if name in ("bf16", "float32"):
            fns["torch"] = calls.run_torch
        if name == "float32":
            fns["numpy"] = lambda calls=calls: calls.run_torch("numpy")
        # each on its own: the kernel's pool threads spin between its calls, beside which torch's would not run
        times = {v: time_calls({v: fn}, args.reps, args.warmup)[v] for v, fn in fns.items()}
        cell = {v: {"seconds": stats(t), "gbps": stats([nbytes / s / 1e9 for s in t])} for v, t in times.items()}
        if link is not None:
            cell["link"] = link_rows(link, calls, nbytes, args)
        row["tokens"][tokens] = cell
        print(f"{name} T={tokens}: " + ", ".join(f"{v} {c['gbps']['median']:.2f} GB/s" for v, c in cell.items()
                                                 if v != "link"), flush=True)
    return row


def table(rows: list[dict], threads: int) -> str:
    lines = [f"GB/s of weight bytes read, median [min, max]: the kernel on {threads} threads, torch on "
             f"{torch.get_num_threads()}, numpy on 1 (the same calls with their matmuls)"]
    if any("link" in c for r in rows for c in r["tokens"].values()):
        lines += [TARGET, "link: the copies alone; cpu|link: the kernel while they run; link|cpu: the copies while "
                  "the kernel runs; ratio: (cpu|link + link|cpu) / link"]
    lines += [f"{'format':>8} {'T':>2} {'expert MB':>9} {'kernel GB/s':>22} {'torch GB/s':>22} {'numpy GB/s':>22}"
             f" {'link':>6} {'cpu|link':>8} {'link|cpu':>8} {'ratio':>6}"]
    for r in rows:
        for tokens, c in r["tokens"].items():
            cells = [f"{r['format']:>8}", f"{tokens:>2}", f"{r['expert_bytes'] / 1e6:9.2f}"]
            for v in ("kernel", "torch", "numpy"):
                g = c.get(v, {}).get("gbps")
                cells.append(f"{g['median']:7.2f} [{g['min']:5.2f},{g['max']:6.2f}]" if g else f"{'-':>22}")
            lk = c.get("link")
            cells += ([f"{lk['link_alone_gbps']['median']:6.1f}", f"{lk['cpu_with_link_gbps']['median']:8.1f}",
                       f"{lk['link_with_cpu_gbps']['median']:8.1f}", f"{lk['ratio']:6.2f}"] if lk else
                      [f"{'-':>6}", f"{'-':>8}", f"{'-':>8}", f"{'-':>6}"])
            lines.append(" ".join(cells))
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3-30b", choices=sorted(GEOMETRIES))
    ap.add_argument("--hidden", type=int, help="override the geometry's hidden size")
    ap.add_argument("--intermediate", type=int, help="override the geometry's expert intermediate size")
    ap.add_argument("--formats", default=",".join(FORMATS) + ",float32",
                    help="expert formats (resolve_format keys); float32 is the decoded-weights upper row")
    ap.add_argument("--experts", type=int, default=4, help="experts a call")
    ap.add_argument("--tokens", default="1", help=f"comma list of tokens a call, each in 1..{MAX_TOKENS}")
    ap.add_argument("--store-gib", type=float, default=2.0, help="GiB of experts a store holds (>> the CPU caches)")
    ap.add_argument("--threads", type=int,
                    help="threads of the kernel, the caller's among them (default: all cores; with --with-link one "
                         "fewer, which leaves the copy thread a core)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--with-link", action="store_true", help="with CUDA: the copy-engine load beside the kernel")
    ap.add_argument("--link-reps", type=int, default=3, help="windows of link alone / both (--with-link)")
    ap.add_argument("--link-seconds", type=float, default=1.0, help="seconds of a link-alone window")
    ap.add_argument("--spin", type=int, default=SPIN_PAUSES,
                    help="waits a pool thread spins for the next call before it sleeps (0: sleep at once)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu-experts.json"))
    args = ap.parse_args(argv)
    h, i, activation, bias = GEOMETRIES[args.geometry]
    args.shape = (args.hidden or h, args.intermediate or i, activation, bias)
    args.formats = args.formats.split(",")
    for name in args.formats:
        try:
            resolve_format(name)
        except ValueError as e:
            ap.error(f"--formats: {e}")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: {args.tokens!r} is not a comma list of ints")
    if not all(1 <= t <= MAX_TOKENS for t in args.tokens):
        ap.error(f"--tokens: each in 1..{MAX_TOKENS}")
    if args.experts < 1 or args.reps < 1 or args.store_gib <= 0:
        ap.error("--experts and --reps must be >= 1 and --store-gib > 0")
    if args.threads is None:
        args.threads = max(1, numba.config.NUMBA_NUM_THREADS - args.with_link)
    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
        ap.error(f"--threads: in 1..{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    set_threads(args.threads)
    link = None
    if args.with_link:
        if not torch.cuda.is_available():
            print("--with-link needs CUDA; measuring the CPU alone", file=sys.stderr)
        else:
            link = LinkLoad()
    rows = [bench_format(name, args, link) for name in args.formats]
    h, i, activation, bias = args.shape
    doc = {"bench": "cpu_experts", "machine": benchmeta.cpu_machine(), "torch_threads": torch.get_num_threads(),
           "spin": args.spin, "kernel_threads": args.threads,
           "thread_env": {k: os.environ.get(k) for k in THREAD_ENV},
           "geometry": {"name": args.geometry, "hidden": h, "intermediate": i, "activation": activation,
                        "expert_bias": bias},
           "experts": args.experts, "reps": args.reps, "store_gib": args.store_gib, "with_link": link is not None,
           "target": TARGET, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    print(table(rows, args.threads))


# Thread pools that read their settings once, at load: torch's OpenMP workers sleep between the baseline's
# calls instead of spinning beside the kernel's pool; numpy's OpenBLAS baseline is the one-core streaming rate.
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}

if __name__ == "__main__":
    if any(k not in os.environ for k in THREAD_ENV):  # run again with them set (a value given is kept)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**THREAD_ENV, **os.environ})
    main()
