#!/usr/bin/env bash
# Make or reuse the project's own environment (.venv, scripts/install.sh) with the test extras, check the layer
# contracts and the lint, and run the CPU test suite (GUI tests offscreen). Each check fails the script.
# GPU tests are marked `gpu` and run on a CUDA machine with: .venv/bin/python -m pytest -m gpu tests/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ -x .venv/Scripts/python.exe ]; then VPY=.venv/Scripts/python.exe; else VPY=.venv/bin/python; fi
echo "== layer contracts (lint-imports, [tool.importlinter] in pyproject.toml)"
"$(dirname "$VPY")/lint-imports" --no-cache
echo "== lint (ruff check) and format (ruff format --check)"
"$VPY" -m ruff check .
"$VPY" -m ruff format --check .
echo "== tests"
export QT_QPA_PLATFORM=offscreen
# One worker per core, at most 4 (pytest-xdist); work stealing evens out the long tests at the end.
# The 25 slowest tests are printed so a test that grows shows up in the CI log.
exec "$VPY" -m pytest -q -n auto --maxprocesses 4 --dist worksteal --durations=25 "$@"
