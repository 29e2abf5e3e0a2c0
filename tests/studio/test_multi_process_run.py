"""A run on two processes started from the window (issue 18): the Hardware page offers them
(here two gloo CPU processes, TUNESMITH_CPU_PROCESSES=2, as there is no GPU pair), the Monitor
shows the run's live charts from rank 0's events, pause holds every rank, and stop ends the run
with a checkpoint and no process left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from studio_helpers import EventRecorder, screenshot, short_config


@pytest.mark.slow  # two training processes (gloo) started from the window
def test_window_runs_on_two_processes(window, qtbot, runs_dir, monkeypatch):
    from studio.main_window import HARDWARE, MONITOR, TRAIN
    from studio.process_worker import ProcessWorker

    monkeypatch.setenv("TUNESMITH_CPU_PROCESSES", "2")
    qtbot.waitUntil(lambda: window.state.profile is not None, timeout=60_000)
    window.go_to(HARDWARE)
    window.hardware_panel.refresh()
    hp = window.hardware_panel
    assert hp.gpus_row.isVisible() and hp.gpus.maximum() == 2 and "gloo" in hp.gpus_unit.text()
    hp.gpus.setValue(2)

    short_config(window.state, runs_dir, "two", steps=400)
    window.state.set("training.grad_accum", 2)  # one micro-batch per process and step
    window.go_to(TRAIN)
    qtbot.mouseClick(window.training_panel.train, Qt.MouseButton.LeftButton)
    assert isinstance(window.worker, ProcessWorker) and window.pages.currentIndex() == MONITOR
    events = EventRecorder(window.worker)
    m = window.monitor_panel
    qtbot.waitUntil(lambda: m.loss.point_count() >= 3, timeout=240_000)
    m.refresh()
    assert m.tps.point_count() >= 3 and m.memory.point_count() >= 3
    assert m.status.text().endswith("on 2 CPU processes (DDP)"), m.status.text()
    screenshot(window, "monitor-two-processes")

    qtbot.mouseClick(m.pause, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: m.mode == "paused", timeout=60_000)
    paused_at = m.last_step
    qtbot.mouseClick(m.resume, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: m.last_step >= paused_at + 2, timeout=60_000)
    between = events.between("Paused", "Resumed")
    assert "StepMetrics" not in between, f"a step ran while paused: {between}"

    with qtbot.waitSignal(window.run_finished, timeout=180_000) as done:
        qtbot.mouseClick(m.stop, Qt.MouseButton.LeftButton)
    event = done.args[0]
    assert type(event).__name__ == "Finished" and event.stopped, event
    run_dir = Path(event.run_dir)
    assert run_dir == runs_dir / "two"
    assert any((run_dir / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
    assert window.worker is None and not window.is_training()
