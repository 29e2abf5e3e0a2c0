"""`tunesmith install-desktop` / `uninstall-desktop` in a temporary HOME: the launcher, the menu entry and the
icon are there after install, the launcher runs this environment's Tunesmith, and uninstall removes exactly
those files (what else is in the same folders, and the runs, stay)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tunesmith(args, home: Path, data_home: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_DATA_HOME",)}
    env["HOME"] = str(home)
    if data_home is not None:
        env["XDG_DATA_HOME"] = data_home
    return subprocess.run(
        [sys.executable, "-m", "studio.cli", *args], capture_output=True, text=True, env=env, cwd=home, timeout=300
    )


@pytest.mark.parametrize("custom_data_home", [False, True])
def test_install_then_uninstall_leaves_only_what_was_there(tmp_path, custom_data_home):
    home = tmp_path / "home"
    data = (tmp_path / "xdg-data") if custom_data_home else home / ".local" / "share"
    # What the user had before: another program's launcher and menu entry, and a run.
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "other-tool").write_text("#!/bin/sh\n")
    (data / "applications").mkdir(parents=True)
    (data / "applications" / "other.desktop").write_text("[Desktop Entry]\nName=Other\n")
    run = home / "Tunesmith" / "runs" / "demo-1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    before = sorted(p for p in tmp_path.rglob("*"))

    out = tunesmith(["install-desktop"], home, str(data) if custom_data_home else None)
    assert out.returncode == 0, out.stderr
    launcher = home / ".local" / "bin" / "tunesmith"
    entry = data / "applications" / "tunesmith.desktop"
    icon = data / "icons" / "hicolor" / "scalable" / "apps" / "tunesmith.svg"
    for path in (launcher, entry, icon):
        assert path.is_file(), f"{path} missing after install:\n{out.stdout}"
    assert os.access(launcher, os.X_OK)
    text = entry.read_text()
    assert f"Exec={launcher}\n" in text and "Icon=tunesmith\n" in text and "Type=Application\n" in text
    assert "<svg" in icon.read_text()
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(entry)], capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    # The launcher runs this environment's Tunesmith from any folder (its headless help needs no display).
    ran = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ran.returncode == 0 and "demo" in ran.stdout and "export" in ran.stdout, ran.stderr

    # Installing again is fine (same files); uninstall removes them and nothing else.
    assert tunesmith(["install-desktop"], home, str(data) if custom_data_home else None).returncode == 0
    out = tunesmith(["uninstall-desktop"], home, str(data) if custom_data_home else None)
    assert out.returncode == 0, out.stderr
    assert f"removed {launcher}" in out.stdout
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert (run / "config.yaml").read_text() == "model: {}\n"


def test_install_does_not_overwrite_a_file_it_did_not_write(tmp_path):
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    mine = home / ".local" / "bin" / "tunesmith"
    mine.write_text("#!/bin/sh\necho my own script\n")
    out = tunesmith(["install-desktop"], home)
    assert out.returncode == 1
    assert str(mine) in out.stderr and "not written by Tunesmith" in out.stderr
    assert mine.read_text() == "#!/bin/sh\necho my own script\n"
    assert not (home / ".local" / "share" / "applications" / "tunesmith.desktop").exists()
    # Nothing was installed, so uninstall finds nothing of ours, and the user's script stays.
    out = tunesmith(["uninstall-desktop"], home)
    assert out.returncode == 0 and mine.exists()
