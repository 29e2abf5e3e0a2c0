"""engine.train.guard: the sleep lock never fails a run and is released with it; battery state is
read from a power_supply tree of real files; NVML clock event reasons become sentences."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from engine.train.guard import (
    RunGuard,
    battery_state,
    battery_warning,
    describe_clock_reasons,
    inhibit_sleep,
)


def supply(root: Path, name: str, **files: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    for key, value in files.items():
        (d / key).write_text(value + "\n")


def laptop_tree(root: Path, status: str, online: str, capacity: str = "42") -> Path:
    supply(root, "BAT0", type="Battery", status=status, capacity=capacity, scope="System")
    supply(root, "AC", type="Mains", online=online)
    return root


# -- battery -----------------------------------------------------------------------------------


def test_laptop_on_battery_warns_with_the_charge(tmp_path):
    root = laptop_tree(tmp_path / "ps", "Discharging", "0")
    assert battery_state(root) == (True, 42)
    warning = battery_warning(root)
    assert warning and "on battery" in warning and "42%" in warning and "plug it in" in warning


def test_laptop_plugged_in_is_quiet(tmp_path):
    for status in ("Charging", "Full", "Not charging"):
        root = laptop_tree(tmp_path / status, status, "1", capacity="100")
        assert battery_state(root) == (False, 100)
        assert battery_warning(root) is None


def test_unplugged_adapter_counts_even_when_the_battery_does_not_say_discharging(tmp_path):
    # Some firmware reports "Not charging" for a while after the cable is pulled.
    root = laptop_tree(tmp_path / "ps", "Not charging", "0")
    assert battery_state(root)[0] is True


def test_desktops_and_peripheral_batteries_are_not_the_machine(tmp_path):
    desktop = tmp_path / "desktop"
    supply(desktop, "AC", type="Mains", online="1")
    supply(desktop, "hidpp_battery_0", type="Battery", status="Discharging", capacity="30", scope="Device")
    assert battery_state(desktop) is None and battery_warning(desktop) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert battery_state(empty) is None
    # A USB-C adapter counts as the adapter too.
    usb = tmp_path / "usbc"
    supply(usb, "BAT1", type="Battery", status="Unknown")
    supply(usb, "ucsi-source-psy-USBC000:001", type="USB", online="1")
    assert battery_state(usb) == (False, None)


def test_missing_tree_falls_back_quietly(tmp_path):
    # No power_supply tree (Windows, macOS, containers): psutil is asked; on a machine without a
    # battery it says nothing, and nothing raises either way.
    warning = battery_warning(tmp_path / "does-not-exist")
    assert warning is None or "on battery" in warning


# -- throttling --------------------------------------------------------------------------------


def test_clock_event_reasons_in_words():
    assert describe_clock_reasons(0) == []
    assert describe_clock_reasons(0x1 | 0x2) == []  # idle and application clocks are normal
    words = describe_clock_reasons(0x20 | 0x4)
    assert len(words) == 2 and any("thermal" in w for w in words) and any("power limit" in w for w in words)
    assert any("power brake" in w for w in describe_clock_reasons(0x80))
    assert any("too hot" in w for w in describe_clock_reasons(0x40))


# -- the sleep lock ----------------------------------------------------------------------------


def test_no_inhibitor_on_path_is_a_noop_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no systemd-inhibit, no caffeinate
    lock = inhibit_sleep("test", system="Linux")
    if lock.method == "dbus":  # a desktop session with jeepney: the D-Bus inhibitor took it
        lock.release()
        return
    assert lock.method == "none" and not lock.held
    assert "systemd-inhibit not found" in lock.note and "may sleep" in lock.note
    lock.release()  # releasing nothing is fine
    mac = inhibit_sleep("test", system="Darwin")
    assert mac.method == "none" and "caffeinate not found" in mac.note


def test_other_systems_never_raise():
    for system in ("Windows", "Plan9"):
        lock = inhibit_sleep("test", system=system)
        if sys.platform == "win32" and system == "Windows":
            assert lock.held
        else:
            assert lock.method == "none" and lock.note
        lock.release()


def test_this_machines_systemd_inhibit_is_held_or_refused_with_its_message():
    # Whatever this machine is: a granted lock, or a note saying why not (no logind in a
    # container: "Failed to connect to bus").
    with RunGuard("pytest", gpu_index=None, system="Linux") as guard:
        note = guard.note
        proc = guard.inhibitor._process
        if guard.inhibitor.method == "systemd-inhibit":
            assert proc.poll() is None
    assert note
    if proc is not None:
        assert proc.poll() is not None  # released with the block


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX shell script stands in for systemd-inhibit")
def test_lock_is_held_for_the_block_and_released_after(tmp_path, monkeypatch):
    # Where logind cannot be reached (this container), a tool that behaves like systemd-inhibit on
    # a desktop: it runs the command it is given and holds the lock while that runs.
    tool = tmp_path / "systemd-inhibit"
    tool.write_text('#!/bin/sh\nfor last; do :; done\nexec "$last"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    with RunGuard("pytest", gpu_index=None, system="Linux") as guard:
        assert guard.inhibitor.method == "systemd-inhibit", guard.note
        proc = guard.inhibitor._process
        assert proc.poll() is None  # held while training
        assert "inhibited" in guard.note
    assert proc.poll() is not None  # released when the run ends


def test_a_tool_that_fails_at_once_is_reported(tmp_path, monkeypatch):
    tool = tmp_path / "systemd-inhibit"
    tool.write_text('#!/bin/sh\necho "Failed to connect to bus: No such file or directory" >&2\nexit 1\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    if sys.platform == "win32":
        pytest.skip("a POSIX shell script stands in for systemd-inhibit")
    lock = inhibit_sleep("test", system="Linux")
    if lock.method == "dbus":
        lock.release()
        return
    assert lock.method == "none"
    assert "refused (exit 1): Failed to connect to bus" in lock.note


# -- check() -----------------------------------------------------------------------------------


def test_check_reports_each_condition_once_until_it_clears(tmp_path):
    root = laptop_tree(tmp_path / "ps", "Discharging", "0")
    guard = RunGuard("pytest", power_supply_root=root, gpu_index=None, system="Plan9")
    with guard:
        first = guard.check(force=True)
        assert len(first) == 1 and "on battery" in first[0]
        assert guard.check(force=True) == []  # still on battery: said once
        assert guard.check() == []  # within the interval: not even looked
        (root / "BAT0" / "status").write_text("Charging\n")
        (root / "AC" / "online").write_text("1\n")
        assert guard.check(force=True) == []
        (root / "BAT0" / "status").write_text("Discharging\n")
        (root / "AC" / "online").write_text("0\n")
        again = guard.check(force=True)
        assert len(again) == 1 and "on battery" in again[0]  # unplugged again: said again
