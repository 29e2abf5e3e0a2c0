#!/usr/bin/env bash
# Build the one-folder desktop bundle (PyInstaller, packaging/tunesmith.spec) into build/bundle/tunesmith/ from
# the project's own environment (.venv, made or reused by scripts/install.sh), with the torch that environment
# holds (the CPU build on a machine without an NVIDIA GPU). Then check it away from the checkout with:
#   bash packaging/check-bundle.sh build/bundle/tunesmith docs/bundle-check-log.md
set -euo pipefail
cd "$(dirname "$0")/.."
TUNESMITH_GGUF=${TUNESMITH_GGUF:-0} bash scripts/install.sh
if [ -x .venv/Scripts/python.exe ]; then VPY=.venv/Scripts/python.exe; else VPY=.venv/bin/python; fi
# Pinned: a bundle that builds today builds the same way next month.
"$VPY" -m pip install --disable-pip-version-check -q "pyinstaller==6.22.3"
"$VPY" -m PyInstaller --noconfirm --log-level WARN --distpath build/bundle --workpath build/bundle-work \
  packaging/tunesmith.spec
OUT=build/bundle/tunesmith
{
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- engine studio \
    resources packaging 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -sm)"
  echo "torch: $("$VPY" -c 'import torch; print(torch.__version__)'), Python $("$VPY" -c 'import platform; print(platform.python_version())'), PyInstaller 6.22.3"
  echo "size: $(du -sh "$OUT" | cut -f1) in $(find "$OUT" -type f | wc -l) files"
} >"$OUT/BUILD_INFO.txt"
cat "$OUT/BUILD_INFO.txt"
echo "bundle in $OUT/ (its program: $OUT/tunesmith)"
