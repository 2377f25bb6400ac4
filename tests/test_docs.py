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
