#!/usr/bin/env bash
# Install Tunesmith with its test dependencies, check the layer contracts and the lint, and run
# the CPU test suite (GUI tests offscreen). Each check fails the script on a violation.
# GPU tests are marked `gpu` and run on a CUDA machine with: python -m pytest -m gpu tests/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
echo "== layer contracts (lint-imports, [tool.importlinter] in pyproject.toml)"
lint-imports --no-cache
echo "== lint (ruff check) and format (ruff format --check)"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
echo "== tests"
export QT_QPA_PLATFORM=offscreen
exec "$PY" -m pytest -q "$@"
