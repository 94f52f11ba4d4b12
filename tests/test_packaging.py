"""Packaging: what `pip install .` declares is what the installed commands import, and the Makefile
installs torch's CPU build before the package.

    pyproject.toml [project].dependencies ──Requirement──► declared distributions
    [project.scripts] expertcache = moe.cli:main ──static import walk (every first-party module it can
        reach, lazy imports in functions included; not `if TYPE_CHECKING:` blocks, nor imports guarded
        by `except ImportError`)──► third-party top-level modules
        ──importlib.metadata.packages_distributions──► distributions, each of which must be declared
    Makefile's `$(BIN)/.installed` recipe, run by make with a logging stand-in for python (and with /
        without a stand-in nvidia-smi) ──► the pip commands in order
    a copy of the sources ──pip wheel (this environment's setuptools)──► the wheel's file list
        ──pip install --target──► the installed `sim` package reads its embedded default trace

No network, no virtual environment: a few seconds, most of it building the wheel.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("expertcache", "moe", "sim")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _requirement(name: str) -> Requirement:
    return next(Requirement(r) for r in PROJECT["dependencies"] if canonicalize_name(Requirement(r).name) == name)


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


class _Imports(ast.NodeVisitor):
    """Absolute module names a first-party file imports: (module, optional) pairs. Optional: inside a
    try whose handlers catch ImportError / ModuleNotFoundError. `if TYPE_CHECKING:` bodies are skipped."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, bool]] = []
        self._optional = 0

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        names = {n for h in node.handlers if h.type is not None for n in ast.unparse(h.type).strip("()").split(", ")}
        guarded = bool(names & {"ImportError", "ModuleNotFoundError"})
        self._optional += guarded
        for child in node.body:
            self.visit(child)
        self._optional -= guarded
        for child in node.handlers + node.orelse + node.finalbody:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(alias.name, self._optional > 0) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module
        self.found.append((module, self._optional > 0))
        for alias in node.names:  # `from moe import openai_api`: a submodule
            if module.split(".")[0] in FIRST_PARTY and _module_file(f"{module}.{alias.name}"):
                self.found.append((f"{module}.{alias.name}", self._optional > 0))


def _walk(entry: str) -> tuple[set[str], dict[str, str]]:
    """(first-party modules reachable from `entry`, third-party top-level module -> first importer)."""
    seen: set[str] = set()
    third: dict[str, str] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            name = ".".join(parts[:i])
            if name in seen or _module_file(name) is None:
                continue
            seen.add(name)
            file = _module_file(name)
            visitor = _Imports(name, file.name == "__init__.py")
            visitor.visit(ast.parse(file.read_text(), str(file)))
            for imported, optional in visitor.found:
                top = imported.split(".")[0]
                if top in FIRST_PARTY:
                    todo.append(imported)
                elif not optional and top not in sys.stdlib_module_names:
                    third.setdefault(top, str(file.relative_to(ROOT)))
    return seen, third


def test_torch_and_triton_are_base_dependencies_and_cuda_python_stays_in_gpu():
    base = _names(PROJECT["dependencies"])
    assert {"torch", "triton"} <= base, "expertcache serve needs torch and triton without extras"
    triton = _requirement("triton")
    assert triton.marker is not None and "sys_platform" in str(triton.marker) and "linux" in str(triton.marker)
    gpu = _names(PROJECT["optional-dependencies"]["gpu"])
    assert "cuda-python" in gpu and "cuda-python" not in base


def test_every_module_the_expertcache_command_imports_is_a_declared_dependency():
    entry = PROJECT["scripts"]["expertcache"].split(":")[0]
    reached, third = _walk(entry)
    # the walk reaches both subcommands' code, the lazy imports of `serve` and the GPU path
    assert {
        "moe.serve.cli",
        "moe.serve.server",
        "moe.engine.loading",
        "moe.model.checkpoint",
        "moe.engine.backends",
        "moe.engine.layer",
        "expertcache.copy",
        "sim.cli",
    } <= reached
    assert {"torch", "triton", "fastapi", "uvicorn", "numpy"} <= set(third)
    declared = _names(PROJECT["dependencies"])
    owners = importlib.metadata.packages_distributions()
    missing = []
    for top, importer in sorted(third.items()):
        dists = {canonicalize_name(d) for d in owners.get(top, [])}
        if not dists & declared:
            missing.append(f"{top} (imported by {importer}; distribution {sorted(dists) or 'not installed'})")
    assert not missing, ("add to [project].dependencies in pyproject.toml (not only an extra), since "
                         f"`expertcache` imports them: {missing}")


def test_the_hf_command_the_messages_suggest_is_installed_with_the_package():
    """The README and serve's errors say `hf download`: huggingface-hub ships that command from 0.34, and
    it is a base dependency at that version, so the environment that runs `expertcache` has it."""
    from packaging.version import Version

    hub = _requirement("huggingface-hub")
    assert hub.specifier.contains("0.34") and not hub.specifier.contains("0.33.9")
    assert Version(importlib.metadata.version("huggingface-hub")) >= Version("0.34")
    assert (Path(sys.executable).parent / "hf").is_file()


def test_packages_are_only_the_three_first_party_ones():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == ["expertcache*", "moe*", "sim*"]  # never tests, benchmarks or docs


def _run_install_recipe(tmp_path: Path, gpu: bool) -> list[str]:
    """Run the Makefile's $(BIN)/.installed recipe with stand-ins; returns the python commands it ran."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir, venv, log = tmp_path / "bin", tmp_path / "venv", tmp_path / "log"
    bin_dir.mkdir()
    for tool in ("mkdir", "cp", "touch"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                    'if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi\n')
    fake.chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    subprocess.run([make, "-s", "-C", str(ROOT), f"PYTHON={fake}", f"VENV={venv}", f"{venv}/bin/.installed"],
                   env=env, check=True, capture_output=True, timeout=30)
    assert (venv / "bin" / ".installed").is_file()
    return log.read_text().splitlines()


def _installs(commands: list[str]) -> list[str]:
    return [c.removeprefix("-m pip install --quiet ") for c in commands if c.startswith("-m pip install")]


def test_makefile_installs_cpu_torch_before_the_package_without_a_gpu(tmp_path):
    installs = _installs(_run_install_recipe(tmp_path, gpu=False))
    torch_at = next(i for i, c in enumerate(installs) if "torch==" in c)
    package_at = [i for i, c in enumerate(installs) if c.startswith("-e .") or c.startswith(".")]
    assert package_at and all(torch_at < i for i in package_at), installs
    assert installs[package_at[0]] == "-e .[dev]"
    assert "triton==" in installs[torch_at]


def test_makefile_installs_the_gpu_extra_with_nvidia_smi(tmp_path):
    installs = _installs(_run_install_recipe(tmp_path, gpu=True))
    assert "-e .[dev,gpu]" in installs and not any("torch==" in c for c in installs), installs


def test_the_wheel_ships_the_embedded_trace_and_the_installed_package_reads_it(tmp_path):
    """`expertcache sim` with no trace replays sim/data/gemma4-decode.npz: the wheel must carry it and
    its attribution, and an installed copy (not this checkout) must find it."""
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools installed")
    src, dist, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in FIRST_PARTY:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("expertcache-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("sim/data/gemma4-decode.npz") == (ROOT / "sim" / "data" / "gemma4-decode.npz").read_bytes()
        assert "Apache" in z.read("sim/data/README.md").decode()
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    script = ("import sim; from sim.inputs import default_trace; t = default_trace(); "
              "print(sim.__file__); print(t.experts.shape, t.meta.license)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120).stdout.splitlines()
    assert Path(out[0]).is_relative_to(site)
    assert out[1].startswith("(128, 30, 1, 6) Apache-2.0")
