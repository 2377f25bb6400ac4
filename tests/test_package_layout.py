"""The package's layout: its modules import one way only, deferred imports included (no circle), and no
import hides behind ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_loco"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The package's modules that ``name`` imports anywhere in it (at the top, in a function, in a branch),
    and the imports it makes under ``if TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    typing_only: list[str] = []

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.extend(ast.unparse(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("lightning_loco")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names] if base.startswith("lightning_loco") else []
        else:
            targets = []
        for target in targets:
            module = resolve(target)
            if module is not None and module != name:
                found.add(module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found, typing_only


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_circle_inside_the_package_deferred_imports_included():
    known = modules()
    graph, typing_only = {}, {}
    for name, path in known.items():
        graph[name], typing_only[name] = imports(name, path, known)
    assert cycles(graph) == []
    assert {n: i for n, i in typing_only.items() if i} == {}  # nothing hides an import from the graph


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    """What the check reads: an import deferred into a function is an arrow too, and one under
    ``TYPE_CHECKING`` is told apart."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from lightning_loco.driver.driver import OuterStepDriver\n"
                     "def later():\n    from lightning_loco.elastic import plugin\n")
    found, typing_only = imports("lightning_loco.probe", probe, modules())
    assert found == {"lightning_loco.elastic.plugin"}
    assert typing_only == ["from lightning_loco.driver.driver import OuterStepDriver"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
