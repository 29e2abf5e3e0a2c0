#!/usr/bin/env bash
# Make, reuse or finish the project's own environment, .venv in this checkout, and install Tunesmith into it
# (editable, so resources/ and the checkout's code are what runs). The system Python's site-packages are never
# touched (PEP 668): the system Python only creates the environment and decides which torch to install.
#
#   PYTHON=/usr/bin/python3   the Python 3.10-3.14 to build the environment from (default: the first found)
#   TUNESMITH_GGUF=0          skip the GGUF export's extra (llama.cpp builds from source, ~15 min once)
#
# Reuse: .venv/tunesmith-install.txt is written only after a complete install; with it, and with the
# environment's imports and requirements checked (scripts/env_check.py), nothing is installed. Without it the
# install is finished: only what is missing is installed. uv is used when it is on PATH, else venv + pip.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv
MARKER=$VENV/tunesmith-install.txt
say() { echo "tunesmith: $*" >&2; }

# -- a Python 3.10 to 3.14 to build from --------------------------------------------------------------
version_ok() { "$1" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 14)))' 2>/dev/null; }
PY=""
if [ -n "${PYTHON:-}" ]; then
  if ! command -v "$PYTHON" >/dev/null 2>&1; then say "PYTHON=$PYTHON is not an interpreter on this machine."; exit 1; fi
  if ! version_ok "$PYTHON"; then
    say "PYTHON=$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); Tunesmith needs 3.10 to 3.14."
    exit 1
  fi
  PY=$PYTHON
else
  for candidate in python3 python3.14 python3.13 python3.12 python3.11 python3.10 python; do
    if command -v "$candidate" >/dev/null 2>&1 && version_ok "$candidate"; then PY=$candidate; break; fi
  done
  if [ -z "$PY" ]; then
    say "no Python 3.10 to 3.14 found; install one (Debian/Ubuntu: sudo apt install python3 python3-venv) and run this again."
    exit 1
  fi
fi
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The environment's interpreter (Windows keeps it under Scripts\; not tried).
vpy() { if [ -x "$VENV/Scripts/python.exe" ]; then echo "$VENV/Scripts/python.exe"; else echo "$VENV/bin/python"; fi; }
EXTRAS=test
[ "${TUNESMITH_GGUF:-1}" != "0" ] && EXTRAS=test,gguf
# What a complete install is of: the project section of pyproject.toml (dependencies, extras, scripts).
STAMP="extras=$EXTRAS project=$("$PY" -c 'import hashlib; t = open("pyproject.toml", encoding="utf-8").read()
print(hashlib.sha256(t.split("\n[tool.")[0].encode()).hexdigest()[:16])')"
complete() {
  # The marker is of a superset of these extras and of this pyproject; the environment imports and satisfies it.
  [ -f "$MARKER" ] || return 1
  local have; have=$(cat "$MARKER")
  [ "${have#*project=}" = "${STAMP#*project=}" ] || return 1
  case "$have" in extras=test,gguf*) ;; "extras=$EXTRAS "*) ;; *) return 1 ;; esac
  "$(vpy)" scripts/env_check.py --root "$ROOT" --extras "$EXTRAS" >/dev/null 2>&1
}
if [ -x "$(vpy)" ] && complete; then
  say "using the environment $VENV (complete: $(cat "$MARKER"))"
  exit 0
fi

# -- make the environment, or repair one whose interpreter no longer runs -------------------------------
UV=$(command -v uv || true)
if [ -z "$UV" ] && ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  case "$PY" in
    /usr/bin/*) PKG="python$PYV-venv" ;;
    *) PKG="python3-venv" ;;
  esac
  say "$PY cannot make a virtual environment (its venv/ensurepip module is missing); install it with: sudo apt install $PKG"
  exit 1
fi
if [ -d "$VENV" ] && ! "$(vpy)" -c 'import sys' >/dev/null 2>&1; then
  say "the environment $VENV does not run (its Python was removed or moved); making it again"
  rm -rf "$VENV"
fi
if [ ! -d "$VENV" ]; then
  say "making the environment $VENV with Python $PYV ($PY)${UV:+ using uv}"
  if [ -n "$UV" ]; then "$UV" venv -q --python "$PY" "$VENV"; else "$PY" -m venv "$VENV"; fi
elif [ ! -f "$MARKER" ]; then
  say "finishing the environment $VENV (no record of a complete install)"
else
  say "updating the environment $VENV (pyproject.toml or the extras changed, or something is missing)"
fi
VPY=$(vpy)
if [ -z "$UV" ] && ! "$VPY" -m pip --version >/dev/null 2>&1; then
  "$VPY" -m ensurepip -q  # a venv made while ensurepip failed has no pip
fi
pip_install() {
  if [ -n "$UV" ]; then "$UV" pip install -q --python "$VPY" "$@"; else
    "$VPY" -m pip install --disable-pip-version-check -q "$@"; fi
}

# -- torch: the build this machine's driver runs, or the CPU one; a torch that works is kept ----------------
choice=$("$PY" engine/hardware/torch_choice.py --shell --venv-python "$VPY") || {
  say "could not decide which torch to install (engine/hardware/torch_choice.py failed)"; exit 1; }
eval "$choice"
say "$TORCH_LINE"
if [ "$TORCH_ACTION" = install ]; then
  # The configured sources first (a local wheel, a mirror); the pin's local tag (+cpu, +cu128) matches only
  # that build, so they cannot hand over another. Then the build's own index at download.pytorch.org.
  log=$(mktemp)
  if ! pip_install "$TORCH_SPEC" 2>"$log"; then
    pip_install "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX" || { cat "$log" >&2; rm -f "$log"; exit 1; }
  fi
  rm -f "$log"
fi

# -- the project and its test tools; only when something is missing ---------------------------------------
if ! "$VPY" scripts/env_check.py --root "$ROOT" --extras test >/dev/null 2>&1; then
  say "installing Tunesmith and its dependencies into $VENV"
  pip_install -e ".[test]"
fi
# The GGUF export's extra (tunesmith[gguf]): llama-cpp-python builds from source (about 15 minutes on 2 cores,
# once: pip caches the wheel), then llama.cpp's converter is taken from the same source distribution. A failed
# build leaves the rest installed and the GGUF tests skip, saying the extra is missing.
DONE=test
gguf_ready() { "$VPY" -c 'import sys; from engine.export.gguf import missing; sys.exit(bool(missing()))' >/dev/null 2>&1; }
if [ "$EXTRAS" = test,gguf ] && ! gguf_ready; then
  if ! "$VPY" scripts/env_check.py --root "$ROOT" --extras test,gguf >/dev/null 2>&1; then
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
      pip_install -e ".[test,gguf]" || say "warning: tunesmith[gguf] did not install; GGUF export is off (its tests skip)"
  fi
  if "$VPY" scripts/env_check.py --root "$ROOT" --extras test,gguf >/dev/null 2>&1; then
    "$VPY" -m engine.export fetch-converter || say "warning: llama.cpp's converter was not fetched; GGUF export is off"
  fi
fi
[ "$EXTRAS" = test,gguf ] && gguf_ready && DONE=test,gguf

# -- complete: check, then record it --------------------------------------------------------------------
if ! missing=$("$VPY" scripts/env_check.py --root "$ROOT" --extras "$DONE" 2>&1); then
  say "the environment $VENV is still incomplete: $missing"
  exit 1
fi
echo "extras=$DONE ${STAMP#* }" >"$MARKER"
say "the environment $VENV is complete ($(cat "$MARKER"))"
