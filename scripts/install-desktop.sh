#!/usr/bin/env bash
# Make or reuse the project's environment (scripts/install.sh), then put a `tunesmith` launcher in ~/.local/bin
# and Tunesmith in the desktop's menu with its icon. Undo with: tunesmith uninstall-desktop (runs stay).
set -euo pipefail
cd "$(dirname "$0")/.."
TUNESMITH_GGUF=${TUNESMITH_GGUF:-0} bash scripts/install.sh
if [ -x .venv/Scripts/python.exe ]; then VPY=.venv/Scripts/python.exe; else VPY=.venv/bin/python; fi
exec "$VPY" -m studio.cli install-desktop
