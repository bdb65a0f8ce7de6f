"""The package's modules import each other without a cycle, counting every
import: at module level, inside functions, and under ``if TYPE_CHECKING:``
(docs/architecture.md: imports go one way)."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_anarchon

PACKAGE = Path(celery_anarchon.__file__).parent


def module_graph(root: Path) -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (a package's
    ``__init__`` counts as the package), from the source, without importing."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        base = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    kept = base[: len(base) - node.level + 1]
                    module = ".".join(kept + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(module_graph(PACKAGE)) == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    (package / "c.py").write_text("def f():\n    from .a import y\n")
    assert cycles(module_graph(package)) == [["pkg.a", "pkg.b"]]


def test_the_beat_side_imports_neither_the_worker_nor_the_cli() -> None:
    graph = module_graph(PACKAGE)
    for name, imported in graph.items():
        if name.startswith("celery_anarchon.beat"):
            assert not imported & {"celery_anarchon.worker", "celery_anarchon.cli"}, name
