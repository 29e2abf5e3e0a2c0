"""The Hardware page runs the checks of `tunesmith doctor` when asked and shows each line, with the fix for
what is missing: here a system library of Qt's X11 plugin, hidden through studio.system_libs' seam."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the checks compile a Triton kernel (interpreted here) and run an NF4 matmul


def test_hardware_page_shows_the_doctor_checks(window, qtbot, runs_dir, monkeypatch):
    # The window's own platform is offscreen; the check is asked about the desktop's X11 one.
    monkeypatch.setenv("TUNESMITH_HIDE_LIBS", "libxcb-icccm.so.4")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    card = window.hardware_panel.doctor
    assert card.verdict.text() == "Not checked yet."
    card.button.click()
    assert not card.button.isEnabled()
    qtbot.waitUntil(lambda: card.checks is not None, timeout=600_000)
    report = card.report.toPlainText()
    for name in ("Python", "environment", "torch", "Triton", "bitsandbytes", "Qt", "disk"):
        assert f" {name} " in report, report
    assert "libxcb-icccm.so.4" in report and "fix: sudo apt install libxcb-icccm4" in report
    assert str(runs_dir) in report  # the free disk of the runs folder the window uses
    assert card.verdict.text().startswith("✘ a run needs Qt"), card.verdict.text()
    assert card.button.isEnabled()
