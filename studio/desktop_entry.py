"""`tunesmith install-desktop` / `uninstall-desktop`: a launcher on the user's PATH and the app in the desktop's menu.

install writes three files for the current user, and a list of them:
  ~/.local/bin/tunesmith                                   runs this environment's interpreter (or the bundle)
  $XDG_DATA_HOME/applications/tunesmith.desktop            the menu entry (XDG Desktop Entry), Exec= the launcher
  $XDG_DATA_HOME/icons/hicolor/scalable/apps/tunesmith.svg the icon (hicolor theme, found by name)
  $XDG_DATA_HOME/tunesmith/desktop-install.txt             what install wrote: uninstall removes exactly these
XDG_DATA_HOME defaults to ~/.local/share. A file that is there already and was not written by install is
left alone and install stops, naming it. uninstall removes only the files in the list that still hold what
install wrote, then the list; runs (~/Tunesmith/runs), settings and the environment stay.

No Qt here: this runs from a terminal and from a headless test.
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
from pathlib import Path

from engine.api import RESOURCES

LAUNCHER_TAG = "# tunesmith launcher (written by `tunesmith install-desktop`)"
ENTRY_TAG = "X-Tunesmith-Installed=true"


def home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def data_home() -> Path:
    value = os.environ.get("XDG_DATA_HOME", "")
    # The spec: a relative or empty XDG_DATA_HOME is ignored.
    return Path(value) if value and os.path.isabs(value) else home() / ".local" / "share"


def paths() -> dict[str, Path]:
    data = data_home()
    return {
        "launcher": home() / ".local" / "bin" / "tunesmith",
        "entry": data / "applications" / "tunesmith.desktop",
        "icon": data / "icons" / "hicolor" / "scalable" / "apps" / "tunesmith.svg",
        "record": data / "tunesmith" / "desktop-install.txt",
    }


def command() -> list[str]:
    """What the launcher runs: this environment's interpreter on studio.cli, or the bundle's program."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "studio.cli"]


def launcher_text() -> str:
    return f'#!/bin/sh\n{LAUNCHER_TAG}\nexec {" ".join(shlex.quote(p) for p in command())} "$@"\n'


def _desktop_quote(path: Path) -> str:
    # Desktop Entry Exec quoting: double quotes around an argument with reserved characters.
    text = str(path)
    if any(c in text for c in " \t\n\"'\\><~|&;$*?#()`"):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`").replace("$", "\\$") + '"'
    return text


def entry_text(launcher: Path) -> str:
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=Tunesmith\n"
        "GenericName=LLM fine-tuning studio\n"
        "Comment=Fine-tune open LLMs with LoRA on your own GPU\n"
        f"Exec={_desktop_quote(launcher)}\n"
        "Icon=tunesmith\n"
        "Terminal=false\n"
        "Categories=Development;\n"
        "Keywords=LLM;LoRA;QLoRA;fine-tuning;training;\n"
        "StartupNotify=true\n"
        f"{ENTRY_TAG}\n"
    )


def _ours(kind: str, path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if kind == "launcher":
        return LAUNCHER_TAG in text
    if kind == "entry":
        return ENTRY_TAG in text
    return text == icon_text()


def icon_text() -> str:
    return (RESOURCES / "icons" / "tunesmith.svg").read_text(encoding="utf-8")


class DesktopError(Exception):
    pass


def install() -> list[Path]:
    """Write the launcher, the menu entry and the icon; return what was written."""
    p = paths()
    contents = {"launcher": launcher_text(), "entry": entry_text(p["launcher"]), "icon": icon_text()}
    for kind in contents:
        if p[kind].exists() and not _ours(kind, p[kind]):
            raise DesktopError(f"{p[kind]} is there already and was not written by Tunesmith: move it away, run again")
    written = []
    for kind, text in contents.items():
        p[kind].parent.mkdir(parents=True, exist_ok=True)
        p[kind].write_text(text, encoding="utf-8")
        written.append(p[kind])
    mode = p["launcher"].stat().st_mode
    p["launcher"].chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    p["record"].parent.mkdir(parents=True, exist_ok=True)
    p["record"].write_text("".join(f"{kind}\t{p[kind]}\n" for kind in contents), encoding="utf-8")
    return written


def uninstall() -> list[Path]:
    """Remove what install wrote (as its record lists it, where it still holds what install wrote)."""
    p = paths()
    removed = []
    try:
        rows = p["record"].read_text(encoding="utf-8").splitlines()
    except OSError:
        rows = [f"{kind}\t{p[kind]}" for kind in ("launcher", "entry", "icon")]  # no record: the default places
    for row in rows:
        kind, _, where = row.partition("\t")
        path = Path(where)
        if path.is_file() and _ours(kind, path):
            path.unlink()
            removed.append(path)
    if p["record"].exists():
        p["record"].unlink()
        removed.append(p["record"])
    # Folders install made and left empty go too; a folder holding anything else stays.
    for kind in ("record", "icon", "entry", "launcher"):
        folder = p[kind].parent
        while folder != home() and folder != data_home() and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return removed


def main(argv: list[str]) -> int:
    action = argv[0]
    argparse.ArgumentParser(
        prog=f"tunesmith {action}",
        description="Put a `tunesmith` launcher in ~/.local/bin and the app in the desktop's menu"
        if action == "install-desktop"
        else "Remove the launcher and the menu entry that install-desktop added (runs stay)",
    ).parse_args(argv[1:])
    if action == "install-desktop":
        try:
            written = install()
        except DesktopError as exc:
            print(f"tunesmith: {exc}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}")
        bin_dir = str(paths()["launcher"].parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            print(f"note: {bin_dir} is not on PATH in this shell; it is on the next login's on most desktops")
        print("Tunesmith is in the desktop's menu; `tunesmith` starts it from a terminal")
        return 0
    removed = uninstall()
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("nothing to remove: install-desktop wrote nothing here")
    return 0
