"""The simulator's modules import one another one way: no cycle, not even one hidden by an import
inside a function.

    sim/*.py ──ast, every `import sim.X` / `from sim[.X] import ...` at any depth──► edges module -> module
    ──depth-first search──► the first cycle found, printed as a path, or none
"""

from __future__ import annotations

import ast
from pathlib import Path

import sim

SIM = Path(sim.__file__).resolve().parent


def _sim_imports(path: Path) -> set[str]:
    """The sim modules `path` imports anywhere in its body (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sim.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("sim."):
                found.add(node.module)
            elif node.module == "sim":  # `from sim import cli`: a submodule
                found |= {f"sim.{a.name}" for a in node.names if (SIM / f"{a.name}.py").is_file()}
    return found


def _graph() -> dict[str, set[str]]:
    return {f"sim.{p.stem}": _sim_imports(p) for p in sorted(SIM.glob("*.py")) if p.stem != "__init__"}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as [a, b, ..., a], or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_sim_modules_import_one_another_one_way():
    graph = _graph()
    assert {"sim.trace", "sim.archive", "sim.budget", "sim.errors"} <= set(graph)
    assert "sim.archive" in graph["sim.trace"] and "sim.trace" in graph["sim.budget"]
    cycle = _cycle(graph)
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"
