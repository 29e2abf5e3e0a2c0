"""Runs from start to end through the window: a short demo run that finishes (adapter saved,
live charts filled), a bad data file that fails readably while the app keeps working, and
closing the window mid-run (asks, stops with a checkpoint, waits for the thread)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from studio_helpers import EventRecorder, screenshot, short_config

pytestmark = pytest.mark.slow


def test_short_run_finishes_with_an_adapter(window, qtbot, runs_dir):
    from studio.main_window import CHAT, MONITOR

    short_config(window.state, runs_dir, "full", steps=60)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    with qtbot.waitSignal(window.run_finished, timeout=240_000) as done:
        assert window.start_training()
        events = EventRecorder(window.worker)
        m = window.monitor_panel
        qtbot.waitUntil(lambda: m.loss.point_count() >= 1, timeout=120_000)
    event = done.args[0]
    assert type(event).__name__ == "Finished" and not event.stopped, event
    run = Path(event.run_dir)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "config.yaml").is_file()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in lines if e["event"] == "StepMetrics"]
    assert len(steps) == 60
    qtbot.waitUntil(lambda: not any(c.dirty for c in m.charts), timeout=10_000)
    assert m.loss.point_count() == 60 and m.memory.point_count() == 60
    assert steps[-1]["loss"] < steps[0]["loss"]  # the demo learns
    assert m.progress.value() == 60
    # Training runs on the worker thread: a step on the GUI thread would freeze the window for its length.
    assert "StepMetrics" in events.names and events.on_gui_thread == [], events.on_gui_thread
    window.go_to(MONITOR)
    screenshot(window, "monitor")

    # Chat with the finished adapter (the final adapter is the default choice).
    window.go_to(CHAT)
    cp = window.chat_panel
    assert cp.source.currentData() == str(run)
    cp.prompt.setPlainText("What is 10 minus 3?")
    cp.max_tokens.setValue(12)
    with qtbot.waitSignal(cp.replied, timeout=180_000):
        qtbot.mouseClick(cp.send, Qt.MouseButton.LeftButton)
    assert cp.tuned.toPlainText() and cp.base.toPlainText()
    screenshot(window, "chat")


def test_malformed_data_shows_an_error_and_the_app_keeps_working(window, qtbot, tmp_path, runs_dir):
    from studio.main_window import DATA, TRAIN

    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n', encoding="utf-8")
    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)  # the demo loaded first
    window.go_to(DATA)
    with qtbot.waitSignal(dp.failed, timeout=60_000) as failed:
        dp.load_source(str(bad))
    assert "line 2" in failed.args[0] and "broken.jsonl" in failed.args[0]
    assert dp.banner.isVisible() and dp.banner.level == "error"
    screenshot(window, "data-error")

    # Train refuses it, and says why beside the button (tests/studio/test_train_gate.py).
    short_config(window.state, runs_dir, "bad", steps=5)
    assert not window.start_training()
    assert not window.training_panel.train.isEnabled()
    assert "line 2" in window.training_panel.train_reason.text()
    assert window.pages.currentIndex() == TRAIN

    # The window still works: back to the demo data.
    with qtbot.waitSignal(dp.preview_ready, timeout=60_000):
        dp.load_source("demo")
    assert dp.rows_model.rowCount() == 413


def test_unusable_rows_are_listed_and_100k_rows_stay_fast(window, qtbot, tmp_path):
    from studio.main_window import DATA

    dp = window.data_panel
    qtbot.waitUntil(lambda: dp.preview is not None, timeout=60_000)
    path = tmp_path / "big.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(100_000):
            out = "" if i in (3, 70_000) else f"answer {i}"
            f.write(json.dumps({"question": f"what is {i}?", "answer": out}) + "\n")
    with qtbot.waitSignal(dp.preview_ready, timeout=120_000):
        dp.load_source(str(path))
    assert dp.rows_model.total_rows == 100_000
    assert dp.rows_model.rowCount() < 100_000  # rows are fetched as the view scrolls
    window.go_to(DATA)  # the table is drawn (and reads rows) only where it can be seen
    dp.tabs.setCurrentIndex(0)
    before = dp.rows_model.reads
    dp.table.scrollToBottom()
    qtbot.waitUntil(lambda: dp.rows_model.reads > before)  # the view has drawn the rows scrolled to
    assert dp.rows_model.reads < 2_000
    problems = {int(dp.problems.item(r, 0).text()) for r in range(dp.problems.rowCount())}
    assert {4, 70_001} <= problems  # indices 3 and 70,000, read from 1
    assert dp.mapping.mapping() == {"instruction": "question", "output": "answer"}


def test_closing_during_a_run_stops_with_a_checkpoint(window, qtbot, runs_dir):
    short_config(window.state, runs_dir, "closing", steps=5000)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    asked = []
    window.confirm = lambda title, text: asked.append(text) or True
    assert window.start_training()
    qtbot.waitUntil(lambda: window.monitor_panel.loss.point_count() >= 2, timeout=120_000)
    worker = window.worker
    window.close()
    assert asked and "checkpoint" in asked[0]
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=120_000)
    assert not worker.thread.isRunning()
    event = window.finished_event
    assert type(event).__name__ == "Finished" and event.stopped
    assert any((runs_dir / "closing" / "checkpoints").glob("step-*/adapter/adapter_model.safetensors"))
