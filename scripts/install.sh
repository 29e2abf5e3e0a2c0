#!/usr/bin/env bash
# Install Tunesmith into the current Python environment (editable, so resources/ is found).
# torch comes first and pinned: left to the resolver, an unpinned torch can pull a multi-GB
# build that this machine does not need. A torch that is already installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --disable-pip-version-check -q "torch==2.13.0"
fi
"$PY" -m pip install --disable-pip-version-check -q -e ".[test]"
