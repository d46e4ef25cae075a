"""ep_core's modules import each other without a circle (module level and function level alike): each step of the
road from the call to the launch depends only on the steps below it."""

from __future__ import annotations

import ast
from pathlib import Path

import ep_core

SRC = Path(ep_core.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("ep_core", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = {
        m: {d for d in deps if d != "ep_core"} for m, deps in _imports().items()
    }  # the package root re-exports
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_the_kernels_import_no_transport():
    graph = _imports()
    for m in graph:
        if m.startswith("ep_core.kernels"):
            assert not {d for d in graph[m] if d.startswith("ep_core.transports")}, m
