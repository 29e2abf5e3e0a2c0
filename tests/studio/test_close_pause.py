"""Closing the window during a run (issue 28 item 8): the question pauses the run while it is up
(no step starts), No lets it go on (a run paused before stays paused), Yes stops it with a
checkpoint of the step it paused at and closes; the stop writes the checkpoint only, not the
gallery's answers, which took 3 s of a 3.4 s close on a CPU."""

from __future__ import annotations

from PySide6.QtCore import Qt
from studio_helpers import short_config

from engine.api import RunFolder
from studio.tasks import run_task


def start(window, qtbot, runs_dir, name: str) -> list[str]:
    """Train the demo in the window and return the names of the events the worker emits from now
    on, recorded on the worker's thread as they happen."""
    short_config(window.state, runs_dir, name, steps=5000)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=300_000)
    assert window.start_training()
    seen: list[str] = []
    window.worker.event.connect(lambda e: seen.append(type(e).__name__), Qt.ConnectionType.DirectConnection)
    qtbot.waitUntil(lambda: window.monitor_panel.last_step >= 2, timeout=300_000)
    return seen


def test_the_close_question_pauses_the_run_and_no_lets_it_go_on(window, qtbot, runs_dir):
    seen = start(window, qtbot, runs_dir, "asked")
    asked, probed = [], []

    def answer_no(title, text):
        asked.append(text)
        # While the question is up the run pauses after its current step ...
        qtbot.waitUntil(lambda: "Paused" in seen and window.chat_panel.probe_step is not None, timeout=300_000)
        # ... and the paused weights answer a prompt meanwhile (a forward pass of real time).
        run_task(window.worker.probe, "What is 12 plus 7?", 8, on_done=probed.append)
        qtbot.waitUntil(lambda: bool(probed), timeout=300_000)
        return False

    window.confirm = answer_no
    window.close()
    assert asked and "paused while you decide" in asked[0]
    assert window.isVisible() and window.is_training()
    qtbot.waitUntil(lambda: "Resumed" in seen, timeout=60_000)
    between = seen[seen.index("Paused") + 1 : seen.index("Resumed")]
    assert "StepMetrics" not in between, f"a step ran while the question was up: {between}"
    assert probed[0][0] == window.monitor_panel.last_step  # it answered at the paused step
    steps_after = seen.count("StepMetrics")
    qtbot.waitUntil(lambda: seen.count("StepMetrics") > steps_after, timeout=300_000)  # it goes on

    # A run the person paused stays paused when they keep the window.
    window.pause()
    qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=300_000)
    paused_events = len(seen)
    window.confirm = lambda *_: False
    window.close()
    assert window.isVisible() and window.monitor_panel.mode == "paused" and window.worker.pause_asked
    assert "Resumed" not in seen[paused_events:]


def test_yes_stops_with_a_checkpoint_of_the_paused_step_and_closes(window, qtbot, runs_dir):
    seen = start(window, qtbot, runs_dir, "closed")
    paused_at = []

    def answer_yes(title, text):
        qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=300_000)
        paused_at.append(window.monitor_panel.last_step)
        return True

    window.confirm = answer_yes
    with qtbot.waitSignal(window.run_finished, timeout=300_000) as done:
        window.close()
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=60_000)
    event = done.args[0]
    assert type(event).__name__ == "Finished" and event.stopped and event.summary["steps"] == paused_at[0]
    run = RunFolder(runs_dir / "closed")
    assert run.latest_checkpoint() == run.checkpoint(paused_at[0])
    assert (run.checkpoint(paused_at[0]) / "adapter" / "adapter_model.safetensors").is_file()
    assert run.status() == "stopped" and not run.is_running()
    # The stop wrote the checkpoint and nothing slow after it.
    after_stop = seen[seen.index("Paused") :]
    assert "CheckpointSaved" in after_stop and "GalleryAnswers" not in after_stop
