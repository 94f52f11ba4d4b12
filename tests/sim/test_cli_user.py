"""`expertcache sim` run as a user runs it: the installed console script in a child process, with the
environment of a shell (no TRITON_INTERPRET), this checkout's packages first on its path.

    argv ──subprocess [bin/expertcache, "sim", ...] (or python -m moe.cli)──► exit status, stdout, stderr
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert "128 tokens, 30 layers x 128 experts, top-6, batch 1, 23040 accesses" in lines[0]
    assert lines[1].startswith("source: github.com/Indoroid/DriftWood@31466a1 ")
    assert "; license: Apache-2.0" in lines[1]
    slots = {int(line.split()[1]) for line in lines if line.split()[:1] in (["lru"], ["belady"])}
    assert slots == {384, 768, 1152}
    for policy in ("lru", "rule", "lfuda", "markov", "next-token", "belady"):
        assert sum(line.split()[0] == policy for line in lines if line.strip()) == 3, policy
