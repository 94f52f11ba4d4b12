"""`expertcache sim` run as a user runs it: the installed console script in a child process, with the
environment of a shell (no TRITON_INTERPRET), this checkout's packages first on its path.

    argv ──subprocess [bin/expertcache, "sim", ...] (or python -m moe.cli)──► exit status, stdout, stderr
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.replay import COMPILE_NOTICE, warm_up
from sim.synthetic import SyntheticConfig, generate, preset
from sim.trace import format_bytes, load_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]


def user_env(**extra: str) -> dict[str, str]:
    """os.environ without TRITON_INTERPRET, this checkout first on PYTHONPATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def command(*argv: str) -> list[str]:
    """The expertcache console script beside this Python, or python -m moe.cli without one."""
    script = Path(sys.executable).parent / "expertcache"
    return [str(script), *argv] if script.is_file() else [sys.executable, "-m", "moe.cli", *argv]


def expertcache_sim(*argv: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command("sim", *argv), capture_output=True, text=True, env=user_env(**env),
                          cwd=cwd or ROOT, timeout=600, check=False)


def test_no_arguments_replays_the_embedded_gemma_trace_and_says_where_it_is_from(tmp_path):
    proc = expertcache_sim("--workers", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gemma4-decode.npz (embedded default, sim/data): gemma-4-26B-A4B-it")
    assert "128 tokens, 30 layers x 128 experts, top-6, batch 1, 23,040 accesses" in lines[0]
    assert lines[1].startswith("source: github.com/Indoroid/DriftWood@31466a1 ")
    assert "; license: Apache-2.0" in lines[1]
    slots = {int(line.split()[1]) for line in lines if line.split()[:1] in (["lru"], ["belady"])}
    assert slots == {384, 768, 1152}
    for policy in ("lru", "rule", "lfuda", "markov", "next-token", "belady"):
        assert sum(line.split()[0] == policy for line in lines if line.strip()) == 3, policy
    assert lines[2] == ("expert shape assumed: 4,336,640 B per routed expert (meta.expert_bytes) and a hidden size "
                        "of 2048 for the router's bytes, as the trace's meta has no hidden_size / "
                        "moe_intermediate_size and no built-in model has 128 experts top-6")
    at = lines.index(DEFAULT_CHOICES.splitlines()[0])
    assert lines[at:at + 4] == DEFAULT_CHOICES.splitlines()
    assert lines[at + 4].startswith("miss service, modeled on host h100-host")
    assert lines[-5:] == DEFAULT_SERVICE_CHOICES.splitlines() + [""]


# The choice lines of `expertcache sim` on its embedded default (gemma-4, cost model `engine`).
DEFAULT_CHOICES = """\
choice by modeled tok/s (no overlap), never an oracle; belady (knows the whole future) is the limit, \
next-token (knows the next token) an oracle to compare with:
  384 slots (10.0 %): markov 133.3 tok/s, 1.190x lru's; limit: belady 191.6; oracle: next-token 130.3
  768 slots (20.0 %): lfuda 204.2 tok/s, 1.104x lru's; limit: belady 304.3; oracle: next-token 195.4
  1,152 slots (30.0 %): lfuda 301.7 tok/s, 1.081x lru's; limit: belady 404.3; oracle: next-token 285.7
"""
# ... and of its miss services on the default host (copy and hybrid)
DEFAULT_SERVICE_CHOICES = """\
choice of miss service by modeled tok/s (never an oracle):
  384 slots: hybrid with rule, 198.9 tok/s, 1.49x the best copy (markov, 133.3)
  768 slots: hybrid with rule, 256.6 tok/s, 1.26x the best copy (lfuda, 204.2)
  1,152 slots: hybrid with lfuda, 332.4 tok/s, 1.10x the best copy (lfuda, 301.7)
"""


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, str]:
    """Small traces: Mixtral's E and k without an expert size, a shape no built-in model has, one layer."""
    d = tmp_path_factory.mktemp("user")
    configs = {"unsized-8x2": preset("mixtral-like", num_tokens=40, seed=1),
               "unpriced": SyntheticConfig(6, 10, 2, 60, seed=2),
               "one": SyntheticConfig(1, 2, 1, 1, seed=2)}
    for name, cfg in configs.items():
        save_trace(generate(cfg), d / f"{name}.npz")
    return {name: str(d / f"{name}.npz") for name in configs}


def test_an_unsized_trace_says_which_shape_prices_it_and_expert_shape_changes_it(traces):
    """No expert_bytes and no shape in the meta: the header names the released model whose E and k price
    it, its H x I and bytes, and --expert-shape; given alone, --expert-shape prices the table."""
    argv = [traces["unsized-8x2"], "--policies", "lru", "--slots", "64", "--workers", "1"]
    proc = expertcache_sim(*argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1] == (
        "expert shape assumed: mixtral-8x7b's, the built-in model with 8 experts top-2: hidden 4096 x "
        "intermediate 14336, 352,321,536 B (bf16) per routed expert, as the trace's meta has no expert_bytes, "
        "hidden_size or moe_intermediate_size: give --expert-shape H,I if the trace is of another model")
    shaped = expertcache_sim(*argv, "--expert-shape", "2048,768")
    assert shaped.returncode == 0, shaped.stderr
    assert ("expert shape: hidden 2048 x intermediate 768 (--expert-shape), 9,437,184 B per routed expert "
            "(bf16)") in shaped.stdout
    (assumed,) = json.loads(expertcache_sim(*argv, "--json").stdout)
    (given,) = json.loads(expertcache_sim(*argv, "--json", "--expert-shape", "2048,768").stdout)
    assert given["misses"] == assumed["misses"]
    bf16 = format_bytes(2048, 768)["bf16"]
    assert given["mb_copied_per_token"] == pytest.approx(given["misses_per_token"] * bf16 / 1e6)
    assert assumed["mb_copied_per_token"] == pytest.approx(assumed["misses_per_token"] * 352_321_536 / 1e6)


def test_an_unpriced_choice_reads_as_misses_against_lrus(traces):
    """No price: the choice goes by misses, and its ratio is the choice's misses over lru's (below 1)."""
    argv = [traces["unpriced"], "--slots", "20", "--workers", "1"]
    proc = expertcache_sim(*argv)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("not priced: the trace's meta has no expert_bytes, hidden_size or "
                               "moe_intermediate_size and no built-in model has 10 experts top-2")
    misses = {r["policy"]: r["misses"] for r in json.loads(expertcache_sim(*argv, "--json").stdout)}
    best = min(("lfuda", "lru", "markov", "rule"), key=lambda p: (misses[p], p))
    head = lines.index(next(line for line in lines if line.startswith("choice by fewest misses")))
    assert lines[head + 1] == (f"  20 slots (33.3 %): {best} {misses[best]} misses, "
                               f"{misses[best] / misses['lru']:.3f}x lru's; limit: belady {misses['belady']}; "
                               f"oracle: next-token {misses['next-token']}")
    assert misses[best] / misses["lru"] < 1


def test_counts_of_one_are_singular(traces):
    proc = expertcache_sim(traces["one"], "--slots", "1", "--workers", "1", "--policies", "lru,belady")
    assert proc.returncode == 0, proc.stderr
    assert ": synthetic, 1 token, 1 layer x 2 experts, top-1, batch 1, 1 access\n" in proc.stdout
    assert "  1 slot (50.0 %): lru 1 miss, 1.000x lru's; limit: belady 1\n" in proc.stdout


def test_help_lists_the_json_lines_fields():
    proc = subprocess.run(command("sim", "--help"), capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    epilog = proc.stdout[proc.stdout.index("JSON-lines traces (FILE.jsonl)"):]
    for field in ("layer", "token_idx", "experts", "problem_id", "dataset", "gating_probs", "logit_idx", "logit_val"):
        assert f"\n  {field} " in epilog, field
    assert "Any other field is refused" in epilog


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def records(layers: int = 3, tokens: int = 4, **extra) -> list[dict]:
    return [{"problem_id": 0, "layer": layer, "token_idx": tok, "experts": [tok % 4, 4 + layer % 4], **extra}
            for layer in range(layers) for tok in range(tokens)]


def test_a_request_field_is_refused_by_name_not_ignored(tmp_path):
    """`request` was silently ignored, then every line reported as a duplicate: now line 1 names it."""
    path = write_jsonl(tmp_path / "run.jsonl", [{"request": r.pop("problem_id"), **r} for r in records()])
    proc = expertcache_sim(path, "--workers", "1")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(
        f"error: {path}:1: field 'request' is not read by this layout, whose fields are problem_id, dataset, "
        f"layer, token_idx, experts, gating_probs, logit_idx, logit_val: if 'request' is the problem_id field, "
        f"rename it 'problem_id' on every line")


def test_tokens_missing_from_a_layer_are_named_on_stderr_and_the_rest_replays(tmp_path):
    rows = [r for r in records(tokens=6) if (r["layer"], r["token_idx"]) not in {(1, 2), (2, 5), (0, 5)}]
    proc = expertcache_sim(write_jsonl(tmp_path / "run.jsonl", rows), "--slots", "8", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (f"warning: {tmp_path / 'run.jsonl'}: dropped 2 tokens without a record in every "
                           f"layer 0..2: (request 0, token 2, missing from layer 1), (request 0, token 5, missing "
                           f"from layers 0, 2); meta.dropped_tokens counts them\n")
    assert ": run, 4 tokens, 3 layers x 7 experts" in proc.stdout


def test_the_real_json_lines_file_loads_with_its_dropped_tokens_named():
    from tests.conftest import real_trace

    proc = expertcache_sim(str(real_trace("mixtral-gsm8k.raw.jsonl")), "--policies", "lru", "--slots", "64",
                           "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 3 tokens without a record in every layer 0..31: (request gsm8k/0, token 166, " in proc.stderr
    assert "244 tokens, 32 layers x 8 experts, top-2, batch 1, 15,616 accesses" in proc.stdout


def _first_stderr_line(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    """The first line the command writes to stderr, a terminal (so its progress bar is on); then the command
    is stopped (a compile it announced is not waited for)."""
    import pty

    master, tty = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=tty, env=env, cwd=ROOT)
    os.close(tty)
    got = b""
    try:
        deadline = time.monotonic() + timeout
        while b"\n" not in got and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    got += os.read(master, 4096)
                except OSError:  # the command ended and the terminal closed
                    break
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    return got.decode(errors="replace").split("\n")[0].rstrip("\r")


@pytest.mark.parametrize("source, notice", [
    ("file", COMPILE_NOTICE),
    ("preset", "compiling the synthetic trace generator (first run only; cached after)"),
])
def test_a_first_run_says_it_compiles_before_compiling_and_before_its_progress_bar(traces, tmp_path, source,
                                                                                   notice):
    """An empty numba cache (NUMBA_CACHE_DIR): the first line on stderr is the notice, before the progress
    bar, printed as the compile starts (the command is stopped there, not waited for)."""
    what = [traces["unsized-8x2"]] if source == "file" else ["--preset", "mixtral-like", "--tokens", "5"]
    argv = command("sim", *what, "--policies", "lru", "--slots", "64", "--workers", "2")
    line = _first_stderr_line(argv, user_env(NUMBA_CACHE_DIR=str(tmp_path / "numba-cache")))
    assert line == notice


def test_a_run_whose_kernels_are_cached_says_nothing_of_compiling(traces):
    """Once numba's cache holds the kernels (compiled here, in this process, if it did not), the command
    announces no compile and its stderr is clean."""
    trace = load_trace(traces["unsized-8x2"])
    warm_up(trace, ["lru", "belady"])  # the command's replays: --policies and the lru / belady references
    proc = expertcache_sim(traces["unsized-8x2"], "--policies", "lru", "--slots", "64", "--workers", "2")
    assert proc.returncode == 0 and proc.stderr == ""


def test_a_reader_that_leaves_early_stops_the_command_without_a_traceback(tmp_path):
    """`expertcache sim --per-layer | head -1`: the pipe, one page deep so that the 12 KB of output cannot
    all fit in it, closes after one line; the command exits 141 (cut off by its pipe) and says nothing."""
    import fcntl

    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(command("sim", "--workers", "1", "--per-layer"), stdout=write_fd,
                            stderr=subprocess.PIPE, env=user_env(), cwd=tmp_path)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        first = reader.readline()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141 and first.startswith(b"gemma4-decode.npz")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_help_is_for_users_with_examples_and_no_diagram():
    proc = expertcache_sim("--help")
    assert proc.returncode == 0, proc.stderr
    assert "  expertcache sim                " in proc.stdout and "--slots-frac" in proc.stdout
    assert not any(line.lstrip().startswith("->") for line in proc.stdout.splitlines())
    assert "─" not in proc.stdout and "►" not in proc.stdout
