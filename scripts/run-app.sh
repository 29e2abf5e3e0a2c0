#!/usr/bin/env bash
# Open the Tunesmith studio on the built-in demo model and data set. The first time it makes the project's
# own environment (.venv in this checkout, see scripts/install.sh); later it reuses it.
#   PYTHON=/usr/bin/python3 bash scripts/run-app.sh    build the environment from that Python (3.10-3.14)
set -euo pipefail
cd "$(dirname "$0")/.."
# The GGUF export's extra builds llama.cpp from source (about 15 minutes on 2 cores): not on the
# way to the window. The Export page offers to install it when a GGUF is first asked for.
TUNESMITH_GGUF=${TUNESMITH_GGUF:-0} bash scripts/install.sh
if [ -x .venv/Scripts/python.exe ]; then VPY=.venv/Scripts/python.exe; else VPY=.venv/bin/python; fi
exec "$VPY" -m studio.cli "$@"
