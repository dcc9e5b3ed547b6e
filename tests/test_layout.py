"""The house's rules, read from the code's imports: no circle, no arrow up.

docs/ARCHITECTURE.md draws the map; this holds the code to it. Imports are
read as text (``ast``), whatever their position: inside a function or under
``TYPE_CHECKING`` they still tie two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "workers", "weight_sync", "api", "cli")

# Which package (or room of workers/) may import which; the ground floor of
# workers/ is "workers" itself.
MAY_IMPORT = {
    "workers.node": {"workers.node", "workers.engine", "workers.queue", "workers"},
    "workers.engine": {"workers.engine", "workers"},
    "workers.queue": {"workers.queue", "workers"},
    "workers": {"workers"},
}
NEVER = {
    "tasks": ("workers", "api", "cli"),
    "weight_sync": ("workers", "api", "cli"),
    "workers": ("api", "cli"),
    "api": ("workers", "cli"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules a file imports (a package's name counts as its ``__init__``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollout_queue."):
            base = node.module.removeprefix("rollout_queue.")
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("rollout_queue.") for a in node.names if a.name.startswith("rollout_queue.")]
        for name in names:
            if name in known:
                out.add(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "workers" and len(parts) > 2:
        return ".".join(parts[:2])
    if parts[0] == "workers" and len(parts) == 2 and parts[1] in ("node", "engine", "queue"):
        return module
    return parts[0]


def test_workers_rooms_import_only_down(graph: dict[str, set[str]]) -> None:
    up = [
        f"{a} -> {b}"
        for a, targets in graph.items() if a.startswith("workers")
        for b in targets if b.startswith("workers") and room(b) not in MAY_IMPORT[room(a)]
    ]
    assert up == []


def test_packages_keep_their_bounds(graph: dict[str, set[str]]) -> None:
    crossed = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets if b.split(".")[0] in NEVER.get(a.split(".")[0], ())
    ]
    assert crossed == []


def test_no_import_circle_between_the_files_of_workers(graph: dict[str, set[str]]) -> None:
    sub = {a: {b for b in targets if b.startswith("workers.")} for a, targets in graph.items()
           if a.startswith("workers.")}
    circles = [c for c in strongly_connected(sub) if len(c) > 1]
    assert circles == []


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"], ["d"]]
