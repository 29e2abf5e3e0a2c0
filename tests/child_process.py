"""The environment of a child Python process a test starts (`python -m engine`, torchrun, the
studio): the checkout first on PYTHONPATH, ahead of what the parent had. A GPU host keeps its
extra wheels on PYTHONPATH, and a child that lost them fails to import them."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


# Prepended to a quitting child: Python's own teardown runs atexit handlers, studio.app.finish's
# os._exit does not, so this line in the child's output means the process ended the slow way.
_TEARDOWN_MARK = "PYTHON-TEARDOWN-RAN"
_MARK_TEARDOWN = f"import atexit; atexit.register(print, {_TEARDOWN_MARK!r}, flush=True)\n"


def end_after_quit(code: str, args: list[str], cwd: Path) -> tuple[int, str, bool]:
    """Run `code` (a studio child that prints QUITTING when it quits) offscreen and let it end:
    (exit code, stderr, whether it ended through Python's teardown rather than finish's os._exit).
    A child still alive a minute after QUITTING is killed and fails the test, so a hung Quit never
    hangs the suite; the minute is a guard, not the measure (what ends the process is)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _MARK_TEARDOWN + code, *args],
        cwd=cwd,
        env=child_env(QT_QPA_PLATFORM="offscreen"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while "QUITTING" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"the child ended before Quit: {proc.stderr.read()[-3000:]}")
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the process still ran a minute after Quit") from None
        # Read through the same buffered pipes readline used (communicate would skip their buffers).
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return exit_code, err, _TEARDOWN_MARK in out
