#!/usr/bin/env bash
# Install Tunesmith with its test dependencies and run the CPU test suite (GUI tests offscreen).
# GPU tests are marked `gpu` and run on a CUDA machine with: python -m pytest -m gpu tests/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export QT_QPA_PLATFORM=offscreen
exec "${PYTHON:-python3}" -m pytest -q "$@"
