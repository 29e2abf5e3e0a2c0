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


def seconds_to_end_after_quit(code: str, args: list[str], cwd: Path) -> tuple[int, float, str]:
    """Run `code` (a studio child that prints QUITTING when it quits) offscreen and time how long
    the process lives after that line: (exit code, seconds, stderr). The child is killed if it
    outlives a minute, so a hung Quit fails the test instead of hanging the suite."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
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
        t0 = time.monotonic()
        exit_code = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    return exit_code, took, err
