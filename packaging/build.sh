#!/usr/bin/env bash
# Build a desktop bundle with PyInstaller (one folder, with the demo resources inside) and
# install the .desktop entry for the current user. Run from a checkout with Tunesmith installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q pyinstaller
python3 -m PyInstaller --noconfirm --name tunesmith --windowed \
  --add-data "resources:resources" --add-data "studio/style.qss:studio" \
  --collect-submodules engine --collect-submodules studio \
  studio/cli.py
install -Dm644 packaging/tunesmith.desktop "$HOME/.local/share/applications/tunesmith.desktop"
echo "bundle in dist/tunesmith/; desktop entry installed"
