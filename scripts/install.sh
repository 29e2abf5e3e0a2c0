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
# The GGUF export's extra (tunesmith[gguf]): llama-cpp-python builds from source (about 15 minutes
# on 2 cores, once: pip caches the wheel), then llama.cpp's converter is taken from the same source
# distribution. TUNESMITH_GGUF=0 skips it; a failed build leaves the rest installed and the GGUF
# tests skip, saying the extra is missing.
if [ "${TUNESMITH_GGUF:-1}" != "0" ]; then
  if CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
      "$PY" -m pip install --disable-pip-version-check -q -e ".[test,gguf]"; then
    "$PY" -m engine.export fetch-converter || echo "warning: llama.cpp's converter was not fetched; GGUF export is off" >&2
  else
    echo "warning: tunesmith[gguf] did not install; GGUF export is off (its tests skip)" >&2
  fi
fi
