"""Where a run cannot keep the machine awake, the Hardware page says so once, in plain words, with
how to prevent it, and a run's log says the same sentence, not the lock tools' D-Bus errors
(issue 28 item 11)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux sleep locks")

FAILING_TOOL = '#!/bin/sh\necho "Failed to connect to bus: No such file or directory" >&2\nexit 1\n'
HOLDING_TOOL = '#!/bin/sh\nfor last; do :; done\nexec "$last"\n'  # runs its command, as on a desktop


@pytest.fixture
def lock_tool(tmp_path, monkeypatch):
    """Put a stand-in systemd-inhibit first on PATH (and no desktop session bus)."""
    from engine.train import guard

    monkeypatch.setattr(guard, "_checked", {})
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)

    def install(script: str):
        tool = tmp_path / "bin" / "systemd-inhibit"
        tool.parent.mkdir(exist_ok=True)
        tool.write_text(script)
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}/usr/bin{os.pathsep}/bin")

    return install


def _page(qtbot, runs_dir):
    from studio.panels.hardware import HardwarePanel
    from studio.state import StudioState

    page = HardwarePanel(StudioState(str(runs_dir)))
    qtbot.addWidget(page)
    return page


def test_no_sleep_lock_is_said_once_in_plain_words(qtbot, runs_dir, lock_tool):
    from engine.train import guard

    lock_tool(FAILING_TOOL)
    page = _page(qtbot, runs_dir)
    page.check_sleep_lock()
    qtbot.waitUntil(lambda: page.sleep_note.isVisibleTo(page), timeout=30_000)
    text = page.sleep_note.text()
    assert "sleep" in text and "prevent" in text
    assert "bus" not in text.lower() and "systemd-inhibit" not in text and "Error" not in text
    page.check_sleep_lock()  # asked once: a second refresh does not ask again
    assert len(guard._checked) == 1

    with guard.RunGuard("pytest", gpu_index=None, system="Linux") as run_guard:
        assert run_guard.note == text  # what the run logs: the same sentence
        assert "Failed to connect to bus" in run_guard.inhibitor.note  # the detail kept, not shown


def test_a_machine_that_can_stay_awake_shows_nothing(qtbot, runs_dir, lock_tool):
    from engine.train import guard

    lock_tool(HOLDING_TOOL)
    page = _page(qtbot, runs_dir)
    page.check_sleep_lock()
    qtbot.waitUntil(lambda: page.sleep_known, timeout=30_000)
    assert guard._checked["Linux"] is None and not page.sleep_note.isVisibleTo(page)
