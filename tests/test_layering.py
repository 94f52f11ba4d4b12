"""The import graph of the tree: no cycle between files, and every package imports only the floors below it.

    every .py file of expertcache/, moe/, sim/, benchmarks/, tests/ ─ast─► its imports of first-party
    modules, at any depth (a function-level import counts: it hides a cycle, it does not break it)
    ─► cycles (Tarjan's strongly connected components) and the layering rules below

The floors, lowest first: expertcache (imports neither moe nor sim); sim (never moe); moe.model, the
ground floor of moe; moe.kernels (moe.model only); moe.engine (no serving); moe.serve; moe.cli. Nothing
outside tests/ imports tests, and nothing of the product imports moe.testing (fixtures of the tests and
benchmarks). Reads the source only: nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("expertcache", "moe", "sim", "tests")


def _module_name(path: Path) -> str:
    """benchmarks/x.py is the top-level module x (the scripts import each other by name)."""
    rel = path.relative_to(ROOT).with_suffix("")
    if rel.parts[0] == "benchmarks":
        return rel.name
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [p for d in PACKAGES + ("benchmarks",) for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The first-party modules `path` imports anywhere in it (the longest known prefix of each name)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    if candidate != name:
                        found.add(candidate)
                    break
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files(graph):
    assert _cycles(graph) == [], "files that import each other (a function-level import hides, not breaks, a cycle)"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# (importer package, packages it must not import)
FORBIDDEN = [
    ("expertcache", ("moe", "sim", "tests")),
    ("sim", ("moe", "tests")),
    ("moe", ("tests",)),
    ("moe.model", ("moe.kernels", "moe.engine", "moe.serve", "moe.testing", "moe.cli")),
    ("moe.kernels", ("moe.engine", "moe.serve", "moe.testing", "moe.cli")),
    ("moe.engine", ("moe.serve", "moe.testing", "moe.cli")),
    ("moe.serve", ("moe.testing",)),
]


@pytest.mark.parametrize("importer, forbidden", FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_each_package_imports_only_the_floors_below_it(graph, importer, forbidden):
    wrong = sorted((name, target) for name, targets in graph.items() if _within(name, importer)
                   for target in targets if any(_within(target, f) for f in forbidden))
    assert wrong == []


def test_nothing_outside_tests_imports_tests(graph):
    wrong = sorted((name, target) for name, targets in graph.items() if not _within(name, "tests")
                   for target in targets if _within(target, "tests"))
    assert wrong == []
