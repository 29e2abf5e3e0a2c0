"""Before Qt opens a window on Linux: are the system libraries its platform plugin needs there?

The PySide6 wheel ships Qt itself but not the X11 (xcb) libraries its `xcb` platform plugin
links against. On a fresh Debian/Ubuntu install several are missing (libxcb-cursor0,
libxcb-icccm4, libxkbcommon-x11-0, ...) and Qt aborts with "could not load the Qt platform
plugin xcb", naming no package. `check()` looks for each library the plugin needs (the
NEEDED entries of PySide6 6.x's libqxcb.so, libQt6XcbQpa.so.6 and libQt6Gui.so.6) by its
exact soname, the way the dynamic linker will, and turns the missing ones into the one-line
`sudo apt install ...` and `sudo dnf install ...` commands.

On a Wayland session with QT_QPA_PLATFORM unset, Qt is pointed at its wayland plugin
(QT_QPA_PLATFORM=wayland;xcb) when PySide6 ships that plugin and its libraries are present;
then the X11 libraries are not needed.

No Qt import here: this runs before Qt loads anything that needs a platform.

Environment:
  TUNESMITH_SKIP_SYSTEM_CHECK=1  skip the check (if it ever reports a library that is there).
  TUNESMITH_HIDE_LIBS=a.so.1,b.so.2  for tests only: treat these sonames as missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

# soname -> (Debian/Ubuntu package, Fedora package)
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor"),
}

# What QtGui and QtDBus need on any platform.
COMMON = ("libxkbcommon.so.0", "libGL.so.1", "libEGL.so.1", "libfontconfig.so.1", "libfreetype.so.6")
COMMON += ("libglib-2.0.so.0", "libdbus-1.so.3")
# What the xcb plugin (libqxcb.so, libQt6XcbQpa.so.6) adds.
XCB = tuple(name for name in PACKAGES if name.startswith(("libxcb", "libX11", "libxkbcommon-x11")))
# What the wayland plugin (libqwayland.so, libQt6WaylandClient.so.6) adds.
WAYLAND = ("libwayland-client.so.0", "libwayland-cursor.so.0")

Finder = Callable[[str], bool]


def dlopen_finder(soname: str) -> bool:
    """True when the dynamic linker can load `soname` (and what it links against)."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def pyside_ships_plugin(name: str) -> bool:
    """True when the installed PySide6 has Qt/plugins/platforms/libq<name>.so (no Qt import)."""
    try:
        spec = importlib.util.find_spec("PySide6")
    except (ImportError, ValueError):
        return False
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "Qt" / "plugins" / "platforms" / f"libq{name}.so").is_file():
            return True
    return False


@dataclass
class Result:
    platform: str  # "xcb", "wayland", or "" when nothing was checked (offscreen, not Linux, ...)
    missing: list[str] = field(default_factory=list)  # sonames, in PACKAGES order
    qpa_platform: str | None = None  # QT_QPA_PLATFORM to set before QApplication, if any

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def apt_packages(self) -> list[str]:
        return _unique(PACKAGES[name][0] for name in self.missing)

    @property
    def dnf_packages(self) -> list[str]:
        return _unique(PACKAGES[name][1] for name in self.missing)

    @property
    def apt_command(self) -> str:
        return "sudo apt install " + " ".join(self.apt_packages)

    @property
    def dnf_command(self) -> str:
        return "sudo dnf install " + " ".join(self.dnf_packages)

    def message(self) -> str:
        if self.ok:
            return ""
        plugin = "X11 (xcb)" if self.platform == "xcb" else "Wayland"
        return (
            f"tunesmith: the studio window cannot open because Qt's {plugin} platform plugin needs "
            f"system libraries that are missing ({', '.join(self.missing)}); install them and start again:\n"
            f"  Debian/Ubuntu:  {self.apt_command}\n"
            f"  Fedora:         {self.dnf_command}\n"
            "(Headless commands such as `tunesmith train` need none of these.)"
        )


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _missing(names, find: Finder) -> list[str]:
    wanted = set(names)
    return [name for name in PACKAGES if name in wanted and not find(name)]


def check(
    env: Mapping[str, str] | None = None,
    finder: Finder | None = None,
    system: str | None = None,
    has_plugin: Callable[[str], bool] | None = None,
) -> Result:
    """Decide which Qt platform will be used and report the libraries it lacks. Changes nothing."""
    env = os.environ if env is None else env
    system = sys.platform if system is None else system
    find = finder or dlopen_finder
    has_plugin = has_plugin or pyside_ships_plugin
    hidden = {name.strip() for name in env.get("TUNESMITH_HIDE_LIBS", "").replace(",", " ").split()}
    if hidden:
        real_find = find

        def find(name: str) -> bool:
            return name not in hidden and real_find(name)

    if not system.startswith("linux") or env.get("TUNESMITH_SKIP_SYSTEM_CHECK") == "1":
        return Result("")
    requested = env.get("QT_QPA_PLATFORM", "").strip()
    if requested:
        first = requested.split(";")[0].split(":")[0].strip()
        if first != "xcb":  # offscreen, minimal, wayland, eglfs, vnc, ...: the user chose
            return Result("")
        return Result("xcb", _missing(COMMON + XCB, find))
    wayland_session = bool(env.get("WAYLAND_DISPLAY")) and (
        env.get("XDG_SESSION_TYPE") == "wayland" or not env.get("DISPLAY")
    )
    if wayland_session and has_plugin("wayland"):
        wayland_missing = _missing(COMMON + WAYLAND, find)
        if not wayland_missing:
            return Result("wayland", qpa_platform="wayland;xcb")
        if not env.get("DISPLAY"):  # no XWayland to fall back on
            return Result("wayland", wayland_missing)
        xcb_missing = _missing(COMMON + XCB, find)
        if not xcb_missing:
            return Result("xcb")
        # Neither works: installing both sets lets the preferred wayland plugin load.
        return Result("xcb", _missing(COMMON + XCB + WAYLAND, find))
    return Result("xcb", _missing(COMMON + XCB, find))


def prepare(env: MutableMapping[str, str] | None = None, **kwargs) -> Result:
    """check(), and on success set QT_QPA_PLATFORM where the check chose a platform."""
    env = os.environ if env is None else env
    result = check(env, **kwargs)
    if result.ok and result.qpa_platform:
        env["QT_QPA_PLATFORM"] = result.qpa_platform
    return result
