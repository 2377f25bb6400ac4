"""The benchmarks' layout: their modules import one another one way only, deferred imports included (no
circle), as the package's do (``test_package_layout.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_package_layout import cycles

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def modules() -> dict[str, Path]:
    found = {}
    for path in BENCHMARKS.rglob("*.py"):
        parts = path.relative_to(BENCHMARKS.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The benchmarks' modules that ``name`` imports anywhere in it (at the top, in a function, in a branch)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            module = resolve(target) if target.startswith("benchmarks") else None
            if module is not None and module != name:
                found.add(module)
    return found


def test_no_import_circle_among_the_benchmarks_deferred_imports_included():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert "benchmarks.b1_fragments" in graph["benchmarks.b1_sync_latency"]  # the scan sees a deferred import
    assert cycles(graph) == []


def test_the_scan_sees_relative_and_deferred_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\nfrom benchmarks.common import table\n"
                     "def later():\n    from .netem import links\n    import benchmarks.b1_report\n")
    assert imports("benchmarks.probe", probe, modules()) == {
        "benchmarks.common", "benchmarks.netem.links", "benchmarks.b1_report"}
