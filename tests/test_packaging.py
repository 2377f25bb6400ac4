"""What the package declares: every runtime dependency's floor is the version CI tests it at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parents[1]


def test_every_floor_of_pyproject_is_pinned_for_the_floor_run():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for requirement in project["dependencies"] + project["optional-dependencies"]["elastic"]:
        name, floor = re.match(r"([A-Za-z0-9_.\-\[\]]+?)\s*(?:>=|==)\s*([0-9][^,;\s]*)", requirement).groups()
        declared[name.lower()] = floor
    pinned = {}
    for line in (ROOT / "scripts" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.strip().lower()] = version.strip()
    assert set(pinned) == set(declared)
    for name, floor in declared.items():
        assert pinned[name].startswith(floor) or pinned[name] == floor + ".0", (name, floor, pinned[name])
    assert "bash scripts/floors.sh" in (ROOT / ".ci" / "run").read_text()
