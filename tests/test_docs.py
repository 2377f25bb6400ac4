import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_docs_build_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "metrics" / "index.html").exists()


def test_readme_links_and_commands_point_at_real_files():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    first_lines = readme.splitlines()[:6]
    assert any("examples/shakespeare/noloco.yaml" in line for line in first_lines)
    assert any("pytest" in line for line in first_lines)
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_benchmark_commands_and_plots_in_the_docs_exist():
    text = (ROOT / "docs" / "benchmarks.md").read_text() + (ROOT / "README.md").read_text()
    modules = set(re.findall(r"python -m benchmarks\.(\w+)", text))
    assert {"b1_sync_latency", "b2_time_to_loss", "b3_uneven_bandwidth", "b4_overhead"} <= modules
    for module in modules:  # a script, or a package that runs as one (its __main__.py)
        script, package = ROOT / "benchmarks" / f"{module}.py", ROOT / "benchmarks" / module / "__main__.py"
        assert script.exists() or package.exists(), module
    for image in re.findall(r"\]\((img/[^)]+)\)", text):
        assert (ROOT / "docs" / image).exists(), image


def _internals_rows() -> list[tuple[list[str], str]]:
    """The module table of docs/internals.md: (paths named in the first column, the Lightning? column)."""
    text = (ROOT / "docs" / "internals.md").read_text()
    table = text.split("## One concern per module", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        paths = []
        for name in re.findall(r"`([^`]+)`", cells[0]):
            braces = re.fullmatch(r"(.*)\{([^}]+)\}(.*)", name)
            paths += [braces[1] + part + braces[3] for part in braces[2].split(",")] if braces else [name]
        rows.append((paths, cells[-1]))
    return rows


def _imports_lightning(path: Path) -> bool:
    return re.search(r"^\s*(import lightning(\.| |$)|from lightning(\.| ))", path.read_text(), re.M) is not None


def test_the_internals_module_table_matches_the_package_tree():
    """Every module of the package has its row, every row names real modules, and the Lightning column
    says whether the row's modules import Lightning."""
    package = ROOT / "lightning_loco"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}
    covered: set[str] = set()
    rows = _internals_rows()
    assert rows, "docs/internals.md has no module table"
    for paths, lightning in rows:
        files: set[str] = set()
        for name in paths:
            if name.endswith("/"):
                inside = {m for m in modules if m.startswith(name)}
                assert inside, f"docs/internals.md names {name}, which holds no module"
                files |= inside
            else:
                assert name in modules, f"docs/internals.md names {name}, which is not a module of the package"
                files.add(name)
        covered |= files
        imports = any(_imports_lightning(package / f) for f in files)
        assert lightning in ("yes", "no"), (paths, lightning)
        assert imports == (lightning == "yes"), f"{paths}: the table says Lightning? {lightning}"
    assert modules <= covered, f"modules without a row in docs/internals.md: {sorted(modules - covered)}"
