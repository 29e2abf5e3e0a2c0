#!/usr/bin/env bash
# Install (first time) and open the Tunesmith studio on the built-in demo model and data set.
set -euo pipefail
cd "$(dirname "$0")/.."
# The GGUF export's extra builds llama.cpp from source (about 15 minutes on 2 cores): not on the
# way to the window. The Export page offers to install it when a GGUF is first asked for.
TUNESMITH_GGUF=${TUNESMITH_GGUF:-0} bash scripts/install.sh
exec "${PYTHON:-python3}" -m studio.cli "$@"
