"""The Monitor tells the truth about the run in front of it (issue 28, items 4 and 5): no step
count before any run, no ETA while paused, the status bar says "Training…" once a resumed run
trains, and a run resumed from the Runs page continues its charts instead of starting them over."""

from __future__ import annotations

from test_runs_page import configure, pause_at, stop_when_paused


def test_no_step_count_before_any_run(qtbot):
    from studio.panels.monitor import MonitorPanel

    m = MonitorPanel()
    qtbot.addWidget(m)
    assert "100" not in m.progress.text() and "steps" not in m.progress.text()


def xs(window, name="loss"):
    return [int(x) for x in window.monitor_panel.loss.series(name).view()[0]]


def test_a_run_resumed_from_runs_keeps_its_history(window, qtbot, runs_dir):
    configure(window, runs_dir, "kept", steps=6)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    assert window.start_training()
    pause_at(window.worker, 3)
    qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=240_000)
    assert window.monitor_panel.eta.text() == "", "step 'Pause': an ETA is shown while nothing runs"
    stop_when_paused(window, qtbot, 3)
    assert xs(window) == [1, 2, 3]

    with qtbot.waitSignal(window.run_finished, timeout=240_000):
        assert window.resume_run(str(runs_dir / "kept"))
        qtbot.waitUntil(lambda: window.monitor_panel.last_step >= 4, timeout=240_000)
        message = window.statusBar().currentMessage()
        assert message == "Training…", f"step 'Resume from Runs': the status bar said {message!r}"
    # The charts continue steps 1-3 from metrics.jsonl; they did not start over at step 4.
    assert xs(window) == [1, 2, 3, 4, 5, 6], "step 'Resume from Runs': the history was wiped"
