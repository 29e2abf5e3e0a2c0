#!/usr/bin/env bash
# Install (first time) and open the Tunesmith studio on the built-in demo model and data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m studio.cli "$@"
