#!/usr/bin/env bash
# Check a built bundle away from the checkout: copy it to a new temporary folder, and there, with an empty HOME,
# a PATH of the system's tools only and no Python variables, run the bundle's own program:
#   1. the window opens (under Xvfb when xvfb-run is installed, else offscreen) and quits after its first paint;
#   2. `tunesmith doctor` (what the bundle finds on this machine);
#   3. `tunesmith demo`: the demo fine-tune trains to its last step (DEMO_STEPS=N: its preset cut to N steps);
#   4. `tunesmith export RUN --adapter DIR`: the adapter is copied and its self-check loads it with PEFT onto
#      the base and compares it with the trained model.
# Writes the log (markdown) to $2 (default: stdout). Exit status 1 when any step fails.
#   bash packaging/check-bundle.sh build/bundle/tunesmith docs/bundle-check-log.md
set -uo pipefail
BUNDLE=$(cd "$1" && pwd)
LOG=${2:-/dev/stdout}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tunesmith-bundle-check.XXXXXX")
cp -a "$BUNDLE" "$WORK/tunesmith"
mkdir -p "$WORK/home"
cd "$WORK"
EXE="$WORK/tunesmith/tunesmith"
# Nothing of a checkout or a Python environment reaches the bundle.
clean() { env -i HOME="$WORK/home" PATH=/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" "$@"; }
if command -v xvfb-run >/dev/null 2>&1; then
  SCREEN=(xvfb-run -a -s "-screen 0 1280x800x24"); DISPLAY_KIND="Xvfb (xcb)"
else
  SCREEN=(env QT_QPA_PLATFORM=offscreen); DISPLAY_KIND="offscreen"
fi
failed=0
step() {  # step TITLE EXPECT COMMAND...: run, keep the tail of its output, check for EXPECT
  local title=$1 expect=$2; shift 2
  local t0=$SECONDS out rc
  out=$("$@" 2>&1); rc=$?
  local verdict="ok"
  if [ $rc -ne 0 ] || ! grep -q -- "$expect" <<<"$out"; then verdict="FAILED (exit $rc)"; failed=1; fi
  {
    echo "### $title: $verdict ($((SECONDS - t0)) s)"
    echo
    echo '```'
    echo "\$ ${*#"$WORK"/}" | sed "s#$WORK#<tmp>#g"
    grep -v -E "^\s*$" <<<"$out" | grep -v "it/s\]$" | tail -n 25 | sed "s#$WORK#<tmp>#g"
    echo '```'
    echo
  } >>"$WORK/steps.md"
}
step "1. the window opens ($DISPLAY_KIND) and quits after its first paint" "window painted" \
  clean "${SCREEN[@]}" "$EXE" --quit-after-paint --runs-dir "$WORK/runs" --settings "$WORK/studio.ini"
step "2. tunesmith doctor: what the bundle finds here" "tunesmith doctor:" \
  clean "${SCREEN[@]}" "$EXE" doctor --runs-dir "$WORK/runs"
if [ -n "${DEMO_STEPS:-}" ]; then  # the demo's config, cut to DEMO_STEPS steps (a busy machine)
  step "3. the demo fine-tune (its preset, cut to $DEMO_STEPS steps) trains to its end" "finished:" clean "$EXE" \
    train "$WORK/tunesmith/_internal/resources/presets/demo.yaml" --max-steps "$DEMO_STEPS" --output "$WORK/runs/demo"
else
  step "3. the demo fine-tune trains to its end" "finished:" clean "$EXE" demo --output "$WORK/runs/demo"
fi
step "4. the adapter export: copied, loaded with PEFT, compared with the trained model" \
  "self-check adapter: verified" clean "$EXE" export "$WORK/runs/demo" --adapter "$WORK/adapter"
{
  echo "# Bundle check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  sed 's/^/- /' "$BUNDLE/BUILD_INFO.txt" 2>/dev/null || echo "- (no BUILD_INFO.txt in the bundle)"
  echo "- checked: a copy in a new temporary folder, HOME empty, PATH=/usr/bin:/bin, no Python variables"
  echo "- machine: $(uname -sm), $(nproc) CPUs, no GPU used; display: $DISPLAY_KIND"
  echo "- result: $([ $failed -eq 0 ] && echo 'every step passed' || echo 'FAILED')"
  echo
  cat "$WORK/steps.md"
} >"$LOG"
rm -rf "$WORK"
exit $failed
