"""Fixtures for the studio tests: a real main window on the demo model and data, with its own
settings file and runs folder, and a helper that saves panel screenshots (artifacts/screenshots/).

Nothing is mocked: the window drives the real engine on the bundled tiny model.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from studio import qt_compat  # noqa: E402

qt_compat.apply()  # the PySide6 refcount guard, before any Qt call

from studio_helpers import SHOT_SIZE  # noqa: E402


@pytest.fixture
def settings(tmp_path):
    from studio.settings import Settings

    return Settings(tmp_path / "studio.ini")


@pytest.fixture
def runs_dir(tmp_path):
    d = tmp_path / "runs"
    d.mkdir()
    return d


@pytest.fixture
def window(qtbot, qapp, settings, runs_dir):
    from studio.app import load_style
    from studio.main_window import MainWindow

    qapp.setStyle("Fusion")
    qapp.setStyleSheet(load_style())
    win = MainWindow(settings=settings, runs_dir=str(runs_dir))
    win.confirm = lambda *_: True  # closing during a run: answer "stop and close"
    qtbot.addWidget(win)
    win.resize(*SHOT_SIZE)
    win.show()
    qtbot.waitExposed(win)
    win.start_background()
    yield win
    if win.is_training():
        win.stop()
        qtbot.waitUntil(lambda: not win.is_training(), timeout=60_000)
    from studio.tasks import wait_all

    wait_all(60_000)


@pytest.fixture
def timed():
    t0 = time.perf_counter()
    yield lambda: time.perf_counter() - t0
