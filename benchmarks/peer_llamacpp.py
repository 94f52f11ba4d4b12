"""llama.cpp beside expertcache on one checkpoint: the source, its build, the shared checkpoint and its GGUFs.

    prepare (any machine with the package index): the llama-cpp-python sdist (pip download, or --sdist)
        -> its vendor/llama.cpp, the commit its git metadata records, stripped of what a build of the
           tools does not need (STRIP: models, docs, tests, web UI, ...) -> .peer/llama.cpp.tar.gz and
           .peer/llama.cpp.json (version, commit, the sdist's sha256, bytes). .peer/ is git-ignored: the
           device tool carries it (`carry: [".peer"]`).
    build (the GPU machine): .peer/llama.cpp.tar.gz -> cmake (CUDA for --cuda-arch only, no curl, no
        tests / examples / server) -> the --targets (llama-bench, llama-quantize) under --build-dir; the
        configure and build seconds recorded in <build-dir>/build.json.
    checkpoint: a random-weight Qwen3-MoE (transformers' Qwen3MoeForCausalLM, config GEOMETRY at
        --layers, bf16, seeded) with a byte-level BPE tokenizer trained by `tokenizers` on this
        repository's docs (--vocab tokens), saved as a Hugging Face directory: what both engines load.
    convert: llama.cpp's own convert_hf_to_gguf.py (from the extracted source) -> <dir>.bf16.gguf,
        then llama-quantize -> Q8_0 and Q4_K_M. The converter identifies a BPE tokenizer's
        pre-tokenizer by a hash of its output on a fixed text and refuses one it does not know; ours is
        a GPT-2 style byte-level one, so the converter is told the family (PRE_TOKENIZER = qwen2).

    bench-llama (the GPU machine): per GGUF (BF16, Q8_0, Q4_K_M) its experts' bytes per layer (gguf-py
        from the extracted source), then per GPU share of the experts (all, half, a quarter, none):
        llama-bench -ngl 99 --n-cpu-moe N (the first N layers' experts on the CPU) -p 0 -n --tokens
        -t --threads -r --reps -o json, run without OpenMP's settings (OPENMP_ENV: llama.cpp's defaults)
        -> tokens/s (median of the repetitions, min, max), the device memory nvidia-smi saw at its peak,
        and the expert bytes on the GPU; -> <out>/llama.json
    bench-ours (the GPU machine): per expertcache format paired with a GGUF type (FORMAT_PAIRS), the
        checkpoint's experts in that format (load_checkpoint), then per share the slots that llama.cpp's
        expert bytes on the GPU hold (at least top_k: llama.cpp's "none" has no GPU copy of any expert)
        -> decode at batch 1 under CUDA graphs (benchmarks/decode_gpu.measure, lru), routed by the
        model's own router and forced from a trace (--trace, else the synthetic Qwen3-30B-A3B preset
        calibrated on real traces) -> tokens/s, hit rate, misses and bytes copied per token
        -> <out>/ours.json
    limits: the host's memory read bandwidth (--threads threads summing 2 GiB) and the link's
        (pinned -> device copies of 256 MiB) -> <out>/limits.json
    report: llama.json + ours.json + limits.json -> a table (and <out>/peer-llamacpp.json): per bit
        width and share, both engines' tokens/s and what bounds each: llama.cpp's CPU experts read at
        the host's bandwidth (top_k experts a layer on the CPU, whatever the routing: its cost does not
        depend on routing locality), expertcache's misses copied at the link's speed.

Run: python benchmarks/peer_llamacpp.py prepare
     python benchmarks/peer_llamacpp.py build --build-dir /tmp/llama-build          (GPU machine)
     python benchmarks/peer_llamacpp.py checkpoint --out /tmp/qwen3moe --layers 12   (GPU machine)
     python benchmarks/peer_llamacpp.py convert --model /tmp/qwen3moe --build-dir /tmp/llama-build
     python benchmarks/peer_llamacpp.py bench-llama --model /tmp/qwen3moe --build-dir /tmp/llama-build --out OUT
     python benchmarks/peer_llamacpp.py bench-ours --model /tmp/qwen3moe --out OUT
     python benchmarks/peer_llamacpp.py limits --out OUT; python benchmarks/peer_llamacpp.py report --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from expertcache.split import MISS_SERVICE_CHOICES

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / ".peer"
SDIST = ("llama-cpp-python", "0.3.36")
# what a build of llama-bench / llama-quantize does not read (paths under vendor/llama.cpp)
STRIP = ("models", "docs", "tests", "media", "benches", "examples", "ci", ".devops", "pocs", "skills",
         "tools/server/webui", "tools/ui", ".github")
TARGETS = ("llama-bench", "llama-quantize")
PRE_TOKENIZER = "qwen2"
QUANTS = ("Q8_0", "Q4_K_M")
# each GGUF type beside the expertcache formats of the same bits per weight (Q4_K_M: 4.5-5 bits)
FORMAT_PAIRS = {"BF16": ("bf16",), "Q8_0": ("fp8",), "Q4_K_M": ("int4", "nvfp4")}
GPU_SHARES = (("all", 1.0), ("half", 0.5), ("quarter", 0.25), ("none", 0.0))  # of the layers' experts on the GPU
# Qwen3-30B-A3B's geometry (config.json of Qwen/Qwen3-30B-A3B), all but the layer count
GEOMETRY = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _run(cmd: list[str], cwd: Path | None = None) -> float:
    """Run `cmd`, its output through; seconds it took. Raises SystemExit naming the command on failure."""
    t0 = time.time()
    done = subprocess.run(cmd, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ...: exit {done.returncode}")
    return time.time() - t0


# ---------------------------------------------------------------------------------------------- prepare

def vendored_source(sdist_root: Path) -> tuple[Path, str]:
    """(vendor/llama.cpp, its commit) of an extracted llama-cpp-python sdist. The commit is the one the
    sdist's git metadata records for the submodule (.git/modules/vendor/llama.cpp/HEAD). Raises
    SystemExit naming the missing path."""
    src = sdist_root / "vendor" / "llama.cpp"
    head = sdist_root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    for p in (src / "CMakeLists.txt", src / "convert_hf_to_gguf.py", head):
        if not p.is_file():
            raise SystemExit(f"--sdist: {p.relative_to(sdist_root)} is missing; not a llama-cpp-python sdist")
    commit = head.read_text().strip()
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise SystemExit(f"--sdist: {head.relative_to(sdist_root)} holds {commit[:60]!r}, not a commit")
    return src, commit


def strip_source(src: Path, dest: Path) -> int:
    """Copy llama.cpp source `src` to `dest` without STRIP; returns the bytes kept."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    for rel in STRIP:
        p = dest / rel
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    # examples/ is a subdirectory CMake adds only with LLAMA_BUILD_EXAMPLES; keep an empty one
    (dest / "examples").mkdir(exist_ok=True)
    return sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())


def prepare(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.sdist:
            sdist = Path(args.sdist)
        else:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
                  f"{SDIST[0]}=={SDIST[1]}"])
            sdist = next(tmp.glob("*.tar.gz"))
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp / "x", filter="tar")
        (root,) = [p for p in (tmp / "x").iterdir() if p.is_dir()]
        src, commit = vendored_source(root)
        kept = strip_source(src, tmp / "llama.cpp")
        archive = out / "llama.cpp.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(tmp / "llama.cpp", arcname="llama.cpp")
    meta = {"sdist": f"{SDIST[0]}=={SDIST[1]}", "sdist_sha256": digest, "commit": commit,
            "stripped": list(STRIP), "source_bytes": kept, "archive_bytes": archive.stat().st_size}
    (out / "llama.cpp.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# ------------------------------------------------------------------------------------------------ build

def cmake_configure_args(src: Path, build: Path, cuda_arch: str | None) -> list[str]:
    """cmake's configure command: CUDA for `cuda_arch` only (None: a CPU build), no curl, no tests,
    examples or server."""
    args = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    if cuda_arch:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return args


def build(args: argparse.Namespace) -> dict:
    archive = Path(args.source)
    meta = json.loads(archive.with_suffix("").with_suffix(".json").read_text())
    work = Path(args.build_dir)
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="tar")
    src, build_dir = work / "llama.cpp", work / "build"
    configure = cmake_configure_args(src, build_dir, args.cuda_arch or None)
    configure.append(f"-DLLAMA_BUILD_COMMIT={meta['commit'][:12]}")
    seconds = {"configure": _run(configure)}
    seconds["build"] = _run(["cmake", "--build", str(build_dir), "-j", str(args.jobs), "--target", *args.targets])
    result = {**meta, "cuda_arch": args.cuda_arch, "targets": list(args.targets), "seconds": seconds,
              "bin": str(build_dir / "bin")}
    (work / "build.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# ------------------------------------------------------------------------------------------- checkpoint

def corpus() -> list[str]:
    """The tokenizer's training text: this repository's docs and README, one paragraph a line."""
    text = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    return [para for t in text for para in t.split("\n\n") if para.strip()]


def train_tokenizer(vocab: int):
    """A GPT-2 style byte-level BPE (tokenizers) of `vocab` tokens trained on corpus(), with the
    <|endoftext|> special token, as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def make_checkpoint(out: Path, layers: int, vocab: int, seed: int, device: str = "cpu",
                    geometry: dict | None = None) -> dict:
    """A random-weight Qwen3-MoE at `geometry` (default GEOMETRY) with `layers` layers, bf16, its
    vocabulary the trained tokenizer's, initialized by transformers on `device` from `seed`, saved
    with the tokenizer to `out`. Returns its config as a dict."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = train_tokenizer(vocab)
    config = Qwen3MoeConfig(**(geometry or GEOMETRY), num_hidden_layers=layers, vocab_size=len(tokenizer),
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            torch_dtype="bfloat16")
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of the weights first
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return config.to_dict()


def checkpoint(args: argparse.Namespace) -> dict:
    t0 = time.time()
    config = make_checkpoint(Path(args.out), args.layers, args.vocab, args.seed, args.device)
    return {"dir": args.out, "layers": args.layers, "vocab_size": config["vocab_size"], "seconds": time.time() - t0}


# ---------------------------------------------------------------------------------------------- convert

CONVERT_SHIM = """\
import sys
sys.path.insert(0, {src!r})
sys.argv = ["convert_hf_to_gguf.py"] + {argv!r}
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def convert_command(src: Path, model: Path, outfile: Path) -> list[str]:
    """python -c <the converter with get_vocab_base_pre answering PRE_TOKENIZER> for `model` -> bf16
    `outfile`."""
    shim = CONVERT_SHIM.format(src=str(src), argv=[str(model), "--outtype", "bf16", "--outfile", str(outfile)],
                               pre=PRE_TOKENIZER, script=str(src / "convert_hf_to_gguf.py"))
    return [sys.executable, "-c", shim]


def convert(args: argparse.Namespace) -> dict:
    model, work = Path(args.model), Path(args.build_dir)
    src, binary = work / "llama.cpp", work / "build" / "bin"
    gguf = {"BF16": Path(f"{model}.bf16.gguf")}
    seconds = {"BF16": _run(convert_command(src, model, gguf["BF16"]))}
    for q in args.quants:
        gguf[q] = Path(f"{model}.{q.lower()}.gguf")
        seconds[q] = _run([str(binary / "llama-quantize"), str(gguf["BF16"]), str(gguf[q]), q])
    return {"gguf": {k: str(v) for k, v in gguf.items()}, "bytes": {k: v.stat().st_size for k, v in gguf.items()},
            "seconds": seconds}


# ------------------------------------------------------------------------------------------ bench-llama

def gguf_expert_bytes(gguf: Path, src: Path) -> tuple[list[int], int]:
    """(bytes of the routed experts of each layer, bytes of every tensor) of a GGUF file, read with the
    gguf-py of llama.cpp source `src`."""
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGUFReader

    per: dict[int, int] = {}
    total = 0
    for t in GGUFReader(gguf).tensors:
        total += int(t.n_bytes)
        m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", t.name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + int(t.n_bytes)
    if sorted(per) != list(range(len(per))) or not per:
        raise SystemExit(f"{gguf}: routed experts in layers {sorted(per)}, not 0..L-1")
    return [per[i] for i in range(len(per))], total


def llama_configs(layer_bytes: list[int]) -> list[dict]:
    """Per GPU share (GPU_SHARES): --n-cpu-moe N (llama.cpp keeps the experts of the first N layers on
    the CPU) for round(L * share) layers' experts on the GPU, and those layers' expert bytes."""
    layers = len(layer_bytes)
    out = []
    for name, share in GPU_SHARES:
        n = layers - round(layers * share)
        out.append({"share": name, "n_cpu_moe": n, "gpu_expert_bytes": sum(layer_bytes[n:]),
                    "cpu_expert_bytes": sum(layer_bytes[:n])})
    return out


def llama_bench_command(binary: Path, gguf: Path, n_cpu_moe: int, tokens: int, reps: int, threads: int) -> list[str]:
    """llama-bench at batch 1, decode only (-p 0), every layer on the GPU but the first n_cpu_moe
    layers' experts, JSON out."""
    return [str(binary / "llama-bench"), "-m", str(gguf), "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe), "-p", "0",
            "-n", str(tokens), "-t", str(threads), "-r", str(reps), "-o", "json"]


# OpenMP's settings that change how llama.cpp's CPU threads wait between its graph's nodes: this project's
# hybrid runs set OMP_WAIT_POLICY=PASSIVE (moe.serve.cli.cpu_worker_env), under which llama.cpp's threads
# sleep at each barrier instead of spinning, which slows its CPU experts.
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES",
              "OMP_DYNAMIC", "KMP_BLOCKTIME")


def llama_bench_env(environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment llama-bench runs in: `environ` without OPENMP_ENV, so llama.cpp waits and places its
    threads as it does by default (-t sets their count), and the settings removed."""
    removed = {k: v for k, v in environ.items() if k in OPENMP_ENV}
    return {k: v for k, v in environ.items() if k not in OPENMP_ENV}, removed


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench's JSON (one test) -> tokens/s median / min / max over its repetitions and what it ran."""
    rows = json.loads(stdout)
    if len(rows) != 1:
        raise SystemExit(f"llama-bench printed {len(rows)} tests, expected 1")
    r = rows[0]
    ts = sorted(float(v) for v in r["samples_ts"])
    return {"tokens_per_s": float(np.median(ts)), "tokens_per_s_min": ts[0], "tokens_per_s_max": ts[-1],
            "reps": len(ts), "n_cpu_moe": int(r["n_cpu_moe"]), "n_gen": int(r["n_gen"]),
            "n_threads": int(r["n_threads"]), "model_size": int(r["model_size"]), "model_type": r["model_type"],
            "build_commit": r["build_commit"], "gpu_info": r.get("gpu_info", ""), "cpu_info": r.get("cpu_info", "")}


class DevicePeak:
    """The device memory used at its peak (MiB, nvidia-smi polled every `ms`) while the block runs;
    None where nvidia-smi is absent."""

    def __init__(self, ms: int = 100) -> None:
        self.cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"-lms={ms}"]
        self.peak_mib = None

    def __enter__(self) -> DevicePeak:
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:  # no NVIDIA driver (a CPU build): nothing to watch, peak_mib stays None
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
            self.peak_mib = peak_mib(out)


def peak_mib(nvidia_smi_lines: str) -> int | None:
    """The largest of nvidia-smi's memory.used lines (first GPU per sample: one GPU here)."""
    values = [int(line.split(",")[0]) for line in nvidia_smi_lines.splitlines() if line.strip().split(",")[0].isdigit()]
    return max(values) if values else None


def gguf_paths(model: Path) -> dict[str, Path]:
    """The GGUF of each type that `convert` wrote beside the checkpoint."""
    return {"BF16": Path(f"{model}.bf16.gguf"), **{q: Path(f"{model}.{q.lower()}.gguf") for q in QUANTS}}


def bench_llama(args: argparse.Namespace) -> dict:
    model, work = Path(args.model), Path(args.build_dir)
    src, binary = work / "llama.cpp", work / "build" / "bin"
    config = json.loads((model / "config.json").read_text())
    moe = {"top_k": config["num_experts_per_tok"],  # transformers 5 writes num_local_experts
           "num_experts": config.get("num_local_experts", config.get("num_experts"))}
    with DevicePeak() as idle:
        time.sleep(1)
    env, removed = llama_bench_env(dict(os.environ))
    if removed:
        print(f"llama-bench runs without {', '.join(f'{k}={v}' for k, v in removed.items())} (llama.cpp's defaults)",
              flush=True)
    rows = []
    for gtype, gguf in gguf_paths(model).items():
        layer_bytes, total = gguf_expert_bytes(gguf, src)
        for cfg in llama_configs(layer_bytes):
            cmd = llama_bench_command(binary, gguf, cfg["n_cpu_moe"], args.tokens, args.reps, args.threads)
            with DevicePeak() as peak:
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-2000:]}")
            rows.append({"gguf": gtype, **cfg, **moe, "layer_expert_bytes": layer_bytes, "file_bytes": total,
                         **parse_llama_bench(done.stdout), "device_peak_mib": peak.peak_mib,
                         "device_idle_mib": idle.peak_mib, "command": " ".join(cmd), "env_removed": removed})
            print(f"llama.cpp {gtype} {cfg['share']:>7} (--n-cpu-moe {cfg['n_cpu_moe']}): "
                  f"{rows[-1]['tokens_per_s']:.1f} tok/s, device {peak.peak_mib} MiB", flush=True)
    result = {"bench": "peer_llamacpp/llama", "rows": rows,
              "build": json.loads((work / "build.json").read_text()) if (work / "build.json").exists() else None}
    _write(Path(args.out) / "llama.json", result)
    return result


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


# ------------------------------------------------------------------------------------------- bench-ours

def cache_slots(gpu_expert_bytes: int, bytes_per_expert: int, layers: int, experts: int, top_k: int) -> int:
    """The slots llama.cpp's GPU expert bytes hold in expertcache's format: floor(bytes / bytes per
    expert), at most every expert, at least top_k (one token's experts: the least the cache runs with)."""
    return max(top_k, min(layers * experts, gpu_expert_bytes // bytes_per_expert))


def bench_ours(args: argparse.Namespace) -> dict:
    import torch
    from bench_decode import make_trace
    from decode_gpu import engine_split, measure

    from expertcache.split import split_for_slots
    from moe.model.checkpoint import load_checkpoint

    llama = json.loads((Path(args.out) / "llama.json").read_text())
    rows = []
    for gtype, formats in FORMAT_PAIRS.items():
        configs = [r for r in llama["rows"] if r["gguf"] == gtype and r["share"] in args.shares]
        for fmt in (f for f in formats if f in args.formats):
            t0 = time.time()
            weights = load_checkpoint(args.model, "cuda", expert_format=fmt, progress=False)
            spec = weights.spec
            layers, experts, top_k = spec.num_layers, spec.moe.num_experts, spec.moe.top_k
            run = argparse.Namespace(geometry="qwen3-30b", layers=layers, warmup=args.warmup, steps=args.steps,
                                     seed=args.seed, trace=args.trace, eager=False, chunks=4)
            trace = make_trace(run, 1)
            load_s = time.time() - t0
            bpe = weights.store.bytes_per_expert
            for service in args.miss_services:  # the engine's own split: measured at start, as the server does
                run.split, measured = engine_split(weights, service)
                channels = None if measured is None else {**dataclasses.asdict(measured), "gbps": measured.gbps()}
                for cfg in configs:
                    run.slots = cache_slots(cfg["gpu_expert_bytes"], bpe, layers, experts, top_k)
                    ran = split_for_slots(run.split, run.slots, layers * experts)  # as GpuMoE runs it
                    for routing in ("model", "trace"):
                        got = measure(weights, trace if routing == "trace" else None, run, "lru", False, 1)
                        rows.append({"gguf": gtype, "format": fmt, "share": cfg["share"], "routing": routing,
                                     "miss_service": service, "split": None if ran is None else ran.service,
                                     "channels": channels, "slots": run.slots, "bytes_per_expert": bpe,
                                     "slot_bytes": run.slots * bpe, "layers": layers, "load_seconds": load_s, **got})
                        print(f"expertcache {fmt} {service} {cfg['share']:>7} ({run.slots} slots) {routing:>5}: "
                              f"{got['tokens_per_s']:.1f} tok/s, hit rate {got['hit_rate']:.3f}", flush=True)
            del weights
            torch.cuda.empty_cache()
    result = {"bench": "peer_llamacpp/ours", "trace": args.trace or "synthetic:qwen3-30b-a3b",
              "warmup": args.warmup, "steps": args.steps, "rows": rows}
    path = Path(args.out) / "ours.json"
    if path.exists():  # another --formats / --miss-services run's rows are kept
        rows[:0] = [r for r in json.loads(path.read_text())["rows"]
                    if r["format"] not in args.formats or r.get("miss_service", "copy") not in args.miss_services
                    or r["share"] not in args.shares]
    _write(path, result)
    return result


# ----------------------------------------------------------------------------------------------- limits

def limits(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    x = torch.rand(2 ** 29)  # 2 GiB of float32
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    host = x.numel() * 4 / float(np.median(times[1:]))
    del x
    import benchmeta

    result = {"host_read_bytes_per_s": host, "host_threads": args.threads,
              "link_bytes_per_s": benchmeta.link_bandwidth(), "machine": benchmeta.machine()}
    _write(Path(args.out) / "limits.json", result)
    return result


# ----------------------------------------------------------------------------------------------- report

def _miss_bytes(o: dict) -> float:
    """The bytes of one token's misses (every layer's) of an expertcache row."""
    return o["misses_per_layer_per_step"] * o["layers"] * o["bytes_per_expert"]


def _split_ran(o: dict) -> bool:
    """Whether the row's engine ran a split: a service that measured the channels, unless its slots held
    every routed expert and it ran as copy (`split` None; rows from before that field: a split)."""
    return bool(o.get("channels")) and o.get("split", "hybrid") is not None


def _channels_bytes_per_s(o: dict, lim: dict) -> float:
    """What the row's misses move over: the link (copy, and a split that ran as copy), or the link and
    the CPU together at the rates the engine measured at start (a split)."""
    if _split_ran(o):
        g = o["channels"]["gbps"]
        return (g["link_together"] + g["cpu_together"]) * 1e9
    return lim["link_bytes_per_s"]


def resident_step_seconds(ours: dict, lim: dict) -> dict[tuple, float]:
    """Per (format, service, routing): the step's time less its misses' time over the channels, from its
    row with every expert in slots (share `all`, whose few cold misses are taken out): the GPU's part of
    a step, which runs before and after each layer's channels, not beside them."""
    out = {}
    for o in ours["rows"]:
        if o["share"] != "all":
            continue
        miss_s = _miss_bytes(o) / _channels_bytes_per_s(o, lim)
        out[(o["format"], o.get("miss_service", "copy"), o["routing"])] = max(1.0 / o["tokens_per_s"] - miss_s, 0.0)
    return out


def report_rows(llama: dict, ours: dict, lim: dict) -> list[dict]:
    """One row per (GGUF type, share): llama.cpp's figures and bound, and each paired expertcache
    format's tokens/s per routing and two bounds: its misses' bytes over the channels alone, and that
    time after the step's miss-free part (resident_step_seconds), where the same run has an `all` row."""
    rows = []
    resident = resident_step_seconds(ours, lim)
    for lr in llama["rows"]:
        layers = len(lr["layer_expert_bytes"])
        # a token reads top_k of the E experts of every layer whose experts are on the CPU
        cpu_bytes_per_token = lr["cpu_expert_bytes"] * lr["top_k"] / lr["num_experts"]
        mine = [o for o in ours["rows"] if (o["gguf"], o["share"]) == (lr["gguf"], lr["share"])]
        row = {"gguf": lr["gguf"], "share": lr["share"], "n_cpu_moe": lr["n_cpu_moe"], "layers": layers,
               "gpu_expert_gib": lr["gpu_expert_bytes"] / 2 ** 30, "llama_tokens_per_s": lr["tokens_per_s"],
               "llama_us_per_layer": 1e6 / lr["tokens_per_s"] / layers,
               "llama_device_gib": None if lr["device_peak_mib"] is None else lr["device_peak_mib"] / 1024,
               "llama_cpu_bytes_per_token": cpu_bytes_per_token,
               "llama_cpu_bound_tokens_per_s": (lim["host_read_bytes_per_s"] / cpu_bytes_per_token
                                                if cpu_bytes_per_token else None),
               "ours": {}}
        for o in mine:
            service = o.get("miss_service", "copy")
            miss_bytes = _miss_bytes(o)
            served = o.get("served_per_layer_per_step", 0.0) * o["layers"] * o["bytes_per_expert"]
            got = {"tokens_per_s": o["tokens_per_s"], "us_per_layer": 1e6 / o["tokens_per_s"] / o["layers"],
                   "slots": o["slots"], "hit_rate": o["hit_rate"], "miss_service": service,
                   "copied_bytes_per_token": miss_bytes - served, "served_bytes_per_token": served,
                   "link_bound_tokens_per_s": lim["link_bytes_per_s"] / miss_bytes if miss_bytes else None,
                   "vs_llama": o["tokens_per_s"] / lr["tokens_per_s"]}
            if _split_ran(o):  # the misses' bytes over both channels at the rates measured together
                got["channels_bound_tokens_per_s"] = _channels_bytes_per_s(o, lim) / miss_bytes if miss_bytes else None
            bound = got.get("channels_bound_tokens_per_s", got["link_bound_tokens_per_s"])
            got["vs_bound"] = o["tokens_per_s"] / bound if bound else None
            fixed = resident.get((o["format"], service, o["routing"]))
            if bound and fixed is not None and o["share"] != "all":  # at `all` it is its own row
                got["resident_step_us"] = fixed * 1e6
                got["step_bound_tokens_per_s"] = 1.0 / (1.0 / bound + fixed)
                got["vs_step_bound"] = o["tokens_per_s"] * (1.0 / bound + fixed)
            row["ours"].setdefault(o["format"] if service == "copy" else f"{o['format']}+{service}",
                                   {})[o["routing"]] = got
        rows.append(row)
    return rows


def _num(v: float | None, fmt: str = "7.1f") -> str:
    return f"{'-':>7}" if v is None else format(v, fmt)


def _bound(got: dict) -> str:
    bound = got.get("channels_bound_tokens_per_s", got["link_bound_tokens_per_s"])
    if bound is None:
        return "-"
    text = f"{bound:.0f}, x{got['vs_bound']:.2f} of it"
    if "step_bound_tokens_per_s" in got:
        text += f"; with the miss-free step {got['step_bound_tokens_per_s']:.0f}, x{got['vs_step_bound']:.2f}"
    return text


def table(rows: list[dict]) -> str:
    lines = ["tokens/s at batch 1; llama.cpp: llama-bench median, its CPU experts' bound (read at the host's "
             "bandwidth); expertcache: model routing / trace routing, the misses' bound (copy: at the link's speed; "
             "+hybrid: over the link and the CPU at the rates the engine measured together at start), and that "
             "time after the step's miss-free part (from the same format's row with every expert in slots)",
             f"{'gguf':>6} {'share':>7} {'ncmoe':>5} {'GiB':>6} {'llama':>7} {'bound':>7}  expertcache"]
    for r in rows:
        ours = "; ".join(f"{fmt} {v['model']['tokens_per_s']:.1f} / {v['trace']['tokens_per_s']:.1f} "
                         f"({v['model']['slots']} slots, x{v['model']['vs_llama']:.2f} / x{v['trace']['vs_llama']:.2f}"
                         f", bound {_bound(v['trace'])})"
                         for fmt, v in r["ours"].items() if {"model", "trace"} <= set(v))
        lines.append(f"{r['gguf']:>6} {r['share']:>7} {r['n_cpu_moe']:>5} {r['gpu_expert_gib']:6.2f} "
                     f"{r['llama_tokens_per_s']:7.1f} {_num(r['llama_cpu_bound_tokens_per_s'])}  {ours}")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    llama, ours, lim = (json.loads((out / f"{n}.json").read_text()) for n in ("llama", "ours", "limits"))
    rows = report_rows(llama, ours, lim)
    result = {"bench": "peer_llamacpp", "machine": lim.get("machine"), "limits": lim, "build": llama.get("build"),
              "rows": rows}
    _write(out / "peer-llamacpp.json", result)
    print(table(rows))
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="the stripped llama.cpp source -> .peer/")
    p.add_argument("--sdist", help=f"a downloaded {SDIST[0]} {SDIST[1]} sdist (default: pip download it)")
    p.add_argument("--out", default=str(PEER))
    p = sub.add_parser("build", help="build llama.cpp's tools from .peer/llama.cpp.tar.gz")
    p.add_argument("--source", default=str(PEER / "llama.cpp.tar.gz"))
    p.add_argument("--build-dir", required=True)
    p.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES ('' for a CPU-only build)")
    p.add_argument("--targets", default=",".join(TARGETS), type=lambda s: s.split(","))
    p.add_argument("--jobs", type=int, default=16)
    p = sub.add_parser("checkpoint", help="the random-weight Qwen3-MoE both engines load")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where transformers initializes the weights (cuda: faster)")
    p = sub.add_parser("convert", help="the checkpoint -> GGUF bf16, Q8_0, Q4_K_M")
    p.add_argument("--model", required=True)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--quants", default=",".join(QUANTS), type=lambda s: s.split(","))
    p = sub.add_parser("bench-llama", help="llama-bench per GGUF and GPU share of the experts")
    p.add_argument("--model", required=True)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=16)
    p = sub.add_parser("bench-ours", help="expertcache at llama.cpp's expert bytes on the GPU")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="the folder holding bench-llama's llama.json")
    p.add_argument("--trace", help="routing trace forced in the trace rows (default: the synthetic preset)")
    p.add_argument("--formats", default=",".join(f for fs in FORMAT_PAIRS.values() for f in fs),
                   type=lambda s: s.split(","), help="expertcache formats to run (rows of others in ours.json stay)")
    p.add_argument("--miss-services", default="copy,hybrid", type=lambda s: s.split(","),
                   help="--moe-miss-service values to run (rows of others in ours.json stay)")
    p.add_argument("--shares", default=",".join(name for name, _ in GPU_SHARES), type=lambda s: s.split(","),
                   help="GPU shares of the experts to run (rows of others in ours.json stay)")
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("limits", help="host memory and link bandwidth")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=16)
    p = sub.add_parser("report", help="the table of both engines")
    p.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    paired = [f for fs in FORMAT_PAIRS.values() for f in fs]
    if args.command == "bench-ours" and not set(args.formats) <= set(paired):
        ap.error(f"bench-ours: --formats {','.join(args.formats)}: each must be one of {paired}")
    if args.command == "bench-ours" and not set(args.miss_services) <= set(MISS_SERVICE_CHOICES):
        ap.error(f"bench-ours: --miss-services {','.join(args.miss_services)}: each must be one of "
                 f"{', '.join(MISS_SERVICE_CHOICES)}")
    shares = [name for name, _ in GPU_SHARES]
    if args.command == "bench-ours" and not set(args.shares) <= set(shares):
        ap.error(f"bench-ours: --shares {','.join(args.shares)}: each must be one of {', '.join(shares)}")
    if args.command == "checkpoint" and (args.layers < 1 or args.vocab < 300):
        ap.error("checkpoint: --layers must be >= 1 and --vocab >= 300 (the 256 bytes and merges)")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run one subcommand; prints and returns its result."""
    args = parse(argv)
    result = {"prepare": prepare, "build": build, "checkpoint": checkpoint, "convert": convert,
              "bench-llama": bench_llama, "bench-ours": bench_ours, "limits": limits,
              "report": report}[args.command](args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
