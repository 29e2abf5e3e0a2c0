"""studio/system_libs.py: the Linux check for the libraries Qt's platform plugin needs, and the
studio entry's clear exit (status 1, install lines) instead of Qt's abort.

No test depends on which libraries this machine has: the finder is injected, and the
subprocess test hides a library with TUNESMITH_HIDE_LIBS (so it is missing wherever it runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

from studio import system_libs as sl

X11 = {"DISPLAY": ":0"}


def everything(_name: str) -> bool:
    return True


def without(*hidden: str):
    return lambda name: name not in hidden


def no_plugin(_name: str) -> bool:
    return False


def test_everything_present_passes():
    result = sl.check(X11, finder=everything, system="linux")
    assert result.ok and result.platform == "xcb" and result.message() == ""


def test_hidden_library_gives_apt_and_dnf_lines():
    result = sl.check(X11, finder=without("libxcb-cursor.so.0", "libxcb-icccm.so.4"), system="linux")
    assert not result.ok
    assert result.missing == ["libxcb-cursor.so.0", "libxcb-icccm.so.4"]
    assert result.apt_command == "sudo apt install libxcb-cursor0 libxcb-icccm4"
    assert result.dnf_command == "sudo dnf install xcb-util-cursor xcb-util-wm"
    message = result.message()
    assert result.apt_command in message and result.dnf_command in message
    assert message.count("\n") == 3  # one sentence, the two install lines, the headless note


def test_packages_are_listed_once():
    result = sl.check(X11, finder=without("libxcb-randr.so.0", "libxcb-shape.so.0"), system="linux")
    assert result.apt_command == "sudo apt install libxcb-randr0 libxcb-shape0"
    assert result.dnf_command == "sudo dnf install libxcb"  # both are in Fedora's libxcb


def test_env_hides_a_library():
    env = {**X11, "TUNESMITH_HIDE_LIBS": "libxkbcommon-x11.so.0"}
    result = sl.check(env, finder=everything, system="linux")
    assert result.apt_command == "sudo apt install libxkbcommon-x11-0"
    assert result.dnf_command == "sudo dnf install libxkbcommon-x11"


def test_every_checked_library_has_packages():
    for name in sl.COMMON + sl.XCB + sl.WAYLAND:
        apt, dnf = sl.PACKAGES[name]
        assert apt and dnf


def test_no_check_off_linux_offscreen_or_skipped():
    hide_all = without(*sl.PACKAGES)
    assert sl.check(X11, finder=hide_all, system="darwin").ok
    assert sl.check({**X11, "QT_QPA_PLATFORM": "offscreen"}, finder=hide_all, system="linux").ok
    assert sl.check({**X11, "QT_QPA_PLATFORM": "minimal"}, finder=hide_all, system="linux").ok
    assert sl.check({**X11, "TUNESMITH_SKIP_SYSTEM_CHECK": "1"}, finder=hide_all, system="linux").ok
    # xcb asked for explicitly is checked
    assert not sl.check({"QT_QPA_PLATFORM": "xcb"}, finder=hide_all, system="linux").ok


def test_wayland_session_prefers_wayland_plugin():
    env = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland", "DISPLAY": ":0"}
    xcb_missing = without("libxcb-icccm.so.4")
    result = sl.prepare(env, finder=xcb_missing, system="linux", has_plugin=lambda name: name == "wayland")
    assert result.ok and result.platform == "wayland"
    assert env["QT_QPA_PLATFORM"] == "wayland;xcb"


def test_wayland_session_without_plugin_checks_xcb():
    env = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland", "DISPLAY": ":0"}
    result = sl.prepare(env, finder=without("libxcb-icccm.so.4"), system="linux", has_plugin=no_plugin)
    assert result.platform == "xcb" and result.apt_command == "sudo apt install libxcb-icccm4"
    assert "QT_QPA_PLATFORM" not in env


def test_wayland_libs_missing_falls_back_to_xwayland():
    env = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland", "DISPLAY": ":0"}
    result = sl.prepare(env, finder=without("libwayland-cursor.so.0"), system="linux", has_plugin=everything)
    assert result.ok and result.platform == "xcb" and "QT_QPA_PLATFORM" not in env
    # no XWayland: the wayland libraries are what is missing
    env = {"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}
    result = sl.check(env, finder=without("libwayland-cursor.so.0"), system="linux", has_plugin=everything)
    assert result.platform == "wayland" and result.apt_command == "sudo apt install libwayland-cursor0"


def test_app_entry_exits_1_with_the_message():
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    env.update(DISPLAY=":0", TUNESMITH_HIDE_LIBS="libxcb-cursor.so.0")
    env.pop("TUNESMITH_SKIP_SYSTEM_CHECK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "studio.cli"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the studio window cannot open" in proc.stderr
    assert "libxcb-cursor0" in proc.stderr and "xcb-util-cursor" in proc.stderr
    assert "sudo apt install" in proc.stderr and "sudo dnf install" in proc.stderr
    assert "could not load the Qt platform plugin" not in proc.stderr.lower()
