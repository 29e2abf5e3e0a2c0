"""The README's two commands, tried as a new user would: a fresh clone of this commit, the system's own Python
(PYTHON=/usr/bin/python3, PEP 668-managed on Debian and Ubuntu), no environment made beforehand.

The app command makes the project's environment (.venv in the clone) and opens the window (under Xvfb when
xvfb-run is installed, as .ci/run installs it, else offscreen), which quits after its first paint; the test
command then reuses that environment and passes on a few tests. A half-finished environment is finished, not
rebuilt. Pip's cache is shared with the machine's (its downloads are reused); llama.cpp is not built
(TUNESMITH_GGUF=0). Also here: a Python without venv gets the one-sentence apt line, before anything happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "tunesmith"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    return clone


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "QT_QPA", "TRITON"))}
    env.update(
        PYTHON=SYSTEM_PYTHON,
        TUNESMITH_GGUF="0",
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        # The pytest run's own environment must not leak into the clone's commands.
        PATH=":".join(p for p in os.environ.get("PATH", "").split(":") if ".venv" not in p and "pyenv" not in p),
    )
    env.update(extra)
    return env


def _run(cmd, cwd, env, timeout):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


needs_system_python = pytest.mark.skipif(
    not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON} (.ci/run installs python3 and python3-venv)"
)


@needs_system_python
def test_python_without_venv_gets_the_apt_line_first(tmp_path):
    """Debian's python3 without python3-venv: one sentence naming the package, nothing made."""
    hide = tmp_path / "hide"
    (hide / "ensurepip").mkdir(parents=True)
    (hide / "ensurepip" / "__init__.py").write_text("raise ImportError('hidden by the test: python3-venv absent')\n")
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH={hide} exec {SYSTEM_PYTHON} "$@"\n')
    python.chmod(0o755)
    clone = _clone(tmp_path)
    env = _env(tmp_path, PYTHON=str(python), PATH=f"{python.parent}:/usr/bin:/bin")
    rc, out = _run(["bash", "scripts/run-app.sh", "--quit-after-paint"], clone, env, 120)
    assert rc == 1
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out
    assert "venv" in lines[0] and "sudo apt install python3-venv" in lines[0], out
    assert not (clone / ".venv").exists()


@pytest.mark.slow
@needs_system_python
def test_readme_commands_from_a_fresh_clone_with_the_system_python(tmp_path):
    clone = _clone(tmp_path)
    env = _env(tmp_path)
    app = ["bash", "scripts/run-app.sh", "--quit-after-paint", "--runs-dir", str(tmp_path / "runs")]
    app += ["--settings", str(tmp_path / "settings.ini")]
    if shutil.which("xvfb-run"):
        app = ["xvfb-run", "-a", "-s", "-screen 0 1280x800x24"] + app
    else:
        env["QT_QPA_PLATFORM"] = "offscreen"
    rc, out = _run(app, clone, env, 2400)
    assert rc == 0, out[-4000:]
    assert "making the environment .venv with Python" in out and SYSTEM_PYTHON in out, out[-4000:]
    assert "tunesmith: torch: " in out  # the one line saying which torch and why
    assert "tunesmith: window painted" in out, out[-4000:]
    cfg = (clone / ".venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg and "/usr/bin" in cfg
    assert (clone / ".venv" / "tunesmith-install.txt").read_text().startswith("extras=test ")

    # The test command: the same environment, reused as it is (nothing installed), lint and a few tests.
    rc, out = _run(["bash", "scripts/run-tests.sh", "-q", "tests/install/test_torch_choice.py"], clone, env, 1800)
    assert rc == 0, out[-4000:]
    assert "using the environment .venv (complete" in out and "passed" in out, out[-4000:]
    assert "Contracts:" in out and "broken" in out

    # A half-finished environment (a package gone, no record of a complete install) is finished, not rebuilt.
    vpy = str(clone / ".venv" / "bin" / "python")
    subprocess.run([vpy, "-m", "pip", "uninstall", "-y", "-q", "pyqtgraph"], check=True, timeout=300)
    (clone / ".venv" / "tunesmith-install.txt").unlink()
    rc, out = _run(["bash", "scripts/install.sh"], clone, env, 1800)
    assert rc == 0, out[-4000:]
    assert "finishing the environment .venv" in out and "making the environment" not in out, out
    assert "the environment .venv is complete" in out
    assert subprocess.run([vpy, "-c", "import pyqtgraph"], timeout=300).returncode == 0
