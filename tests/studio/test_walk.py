"""A scripted walk of the window as a new user takes it (issue 28, item 6), driven by the labels a
person sees (the step list's page names, the buttons' texts), waiting for events, never for fixed
times, and failing with the name of the step that broke:

open → Train the demo → watch steps → Pause (no step starts while paused) → Resume → Stop (a
checkpoint) → Resume from the Runs page to the end (history kept) → Chat → Export the adapter → a
bad data file that Train refuses with its reason → a 200 MB file whose preview and X-ray do not
block Chat or the Model page → Quit (the process ends through studio.app.finish, in a child process).

TUNESMITH_WALK_LOG=<file> appends each step's time to that file (docs/walk-log.md is made so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from child_process import child_env, end_after_quit
from PySide6.QtCore import Qt
from studio_helpers import short_config

pytestmark = pytest.mark.slow

BIG_MB = 200


# -- what a person sees -------------------------------------------------------------------------
def open_page(window, qtbot, name: str) -> None:
    """Click the step list's entry labelled `name`."""
    steps = window.steps
    for row in range(steps.count()):
        item = steps.item(row)
        if item.text().strip().endswith(name):
            steps.scrollToItem(item)
            qtbot.mouseClick(steps.viewport(), Qt.MouseButton.LeftButton, pos=steps.visualItemRect(item).center())
            assert window.pages.currentIndex() == int(item.data(Qt.ItemDataRole.UserRole)), f"page {name} did not open"
            return
    raise AssertionError(f"no page labelled {name!r} in the step list")


def button(root, text: str):
    """The visible button labelled `text` under `root`."""
    from PySide6.QtWidgets import QAbstractButton

    found = [b for b in root.findChildren(QAbstractButton) if b.text().replace("&", "") == text and b.isVisibleTo(root)]
    assert found, f"no visible button labelled {text!r} on {type(root).__name__}"
    return found[0]


def click(qtbot, root, text: str):
    b = button(root, text)
    assert b.isEnabled(), f"the button {text!r} is disabled: {b.toolTip()}"
    qtbot.mouseClick(b, Qt.MouseButton.LeftButton)
    return b


class Walk:
    """Names the step in progress, so a failure says where the walk broke; keeps the timings."""

    def __init__(self):
        self.times: list[tuple[str, float]] = []

    @contextmanager
    def step(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        except BaseException as exc:
            raise AssertionError(f"walk step '{name}' failed: {exc}") from exc
        self.times.append((name, time.monotonic() - t0))

    def write_log(self, outcome: str) -> None:
        path = os.environ.get("TUNESMITH_WALK_LOG")
        if not path:
            return
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"walk {time.strftime('%H:%M:%S')} load {load}: {outcome}; ")
            f.write(", ".join(f"{name} {secs:.1f} s" for name, secs in self.times) + "\n")


def big_jsonl(path: Path, megabytes: int) -> int:
    """An instruction set of about `megabytes` MB, rows of a few hundred tokens (generated here)."""
    pad_q, pad_a = "Explain the steps. " * 20, "Adding the ones first, then the tens. " * 20
    rows, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1_000_000:
            line = (
                json.dumps(
                    {
                        "instruction": f"What is {rows} plus {rows % 97}? {pad_q}",
                        "input": "",
                        "output": f"{rows + rows % 97}. {pad_a}",
                    }
                )
                + "\n"
            )
            f.write(line)
            size += len(line)
            rows += 1
    return rows


QUIT_CHILD = """
import sys
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from studio import app as studio_app, tasks
from studio.main_window import MainWindow
from studio.settings import Settings
w = MainWindow(Settings(sys.argv[1]), sys.argv[2])
w.state.set("data.source", sys.argv[3])
w.show()
w.start_background()
def quit_when_busy():
    if not (tasks.pending("data.preview") or tasks.pending("data.xray")):
        QTimer.singleShot(50, quit_when_busy)
        return
    quit = next(a for m in w.menuBar().actions() for a in m.menu().actions() if a.text() == "Quit")
    print("QUITTING", flush=True)
    quit.trigger()
QTimer.singleShot(0, quit_when_busy)
code = app.exec()
raise SystemExit(studio_app.finish(code))
"""


_IN_CHILD = os.environ.get("TUNESMITH_WALK_CHILD") == "1"


def test_walk_in_a_fresh_process():
    """The walk opens the app as a person does, in a process of its own: inside the whole suite the
    background lanes are the process's, and a task an earlier test left waiting (a Hub lookup) held
    the walk's first step for five minutes."""
    if _IN_CHILD:
        pytest.skip("this is the fresh process: test_walk runs here")
    test = f"{Path(__file__).resolve()}::test_walk"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=Path(__file__).resolve().parents[2],
        env=child_env(TUNESMITH_WALK_CHILD="1"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-8000:] + out.stderr[-3000:]


@pytest.mark.skipif(not _IN_CHILD, reason="run in a fresh process by test_walk_in_a_fresh_process")
def test_walk(window, qtbot, runs_dir, tmp_path):
    from studio import tasks

    walk = Walk()
    try:
        _walk(walk, window, qtbot, runs_dir, tmp_path, tasks)
    except BaseException as exc:
        walk.write_log(f"FAILED: {str(exc).splitlines()[0]}")
        raise
    walk.write_log("passed")


def _walk(walk, window, qtbot, runs_dir, tmp_path, tasks):
    from engine import api

    m = window.monitor_panel
    seen: list[str] = []  # the engine's events in the order the worker thread emitted them

    def record(event) -> None:
        seen.append(type(event).__name__)

    with walk.step("open"):
        qtbot.waitUntil(lambda: window.engine_warm and window.model_panel.report is not None, timeout=300_000)
        qtbot.waitUntil(lambda: not window.data_panel.loading, timeout=300_000)

    with walk.step("Train the demo"):
        short_config(window.state, runs_dir, "walk", steps=12)
        open_page(window, qtbot, "Train")
        click(qtbot, window.training_panel, "Train")
        assert window.is_training()
        window.worker.event.connect(record, Qt.ConnectionType.DirectConnection)
        assert window.pages.currentWidget() is m

    with walk.step("watch steps"):
        qtbot.waitUntil(lambda: m.last_step >= 2, timeout=300_000)
        assert "steps" in m.progress.text()

    with walk.step("Pause"):
        click(qtbot, m, "Pause")
        qtbot.waitUntil(lambda: m.mode == "paused", timeout=300_000)
        assert "Paused" in seen and m.eta.text() == ""
        # Something real to do while it is paused (the Runs page reads the folder), then check.
        open_page(window, qtbot, "Runs")
        with qtbot.waitSignal(window.runs_panel.refreshed, timeout=60_000):
            click(qtbot, window.runs_panel, "Refresh")
        assert window.runs_panel.row_text("walk")["Status"] == "running"
        open_page(window, qtbot, "Monitor")

    with walk.step("Resume"):
        click(qtbot, m, "Resume")
        qtbot.waitUntil(lambda: "Resumed" in seen and m.mode == "running", timeout=60_000)
        between = seen[seen.index("Paused") + 1 : seen.index("Resumed")]
        assert "StepMetrics" not in between, f"a step ran while paused: {between}"
        paused_at = m.last_step
        qtbot.waitUntil(lambda: m.last_step >= paused_at + 1, timeout=300_000)

    with walk.step("Stop"):
        with qtbot.waitSignal(window.run_finished, timeout=300_000) as done:
            click(qtbot, m, "Stop")
        event = done.args[0]
        assert isinstance(event, api.Finished) and event.stopped, event
        stopped_at = event.summary["steps"]
        assert 0 < stopped_at < 12
        assert (runs_dir / "walk" / "checkpoints" / f"step-{stopped_at}").is_dir()

    with walk.step("Resume from Runs"):
        open_page(window, qtbot, "Runs")
        page = window.runs_panel
        qtbot.waitUntil(lambda: page.row_text("walk").get("Status") == "stopped", timeout=60_000)
        with qtbot.waitSignal(page.charts_ready, timeout=60_000):
            page.select_runs(["walk"])
        with qtbot.waitSignal(window.run_finished, timeout=600_000) as done:
            click(qtbot, page, "Resume")
        event = done.args[0]
        assert isinstance(event, api.Finished) and not event.stopped, event
        xs = [int(x) for x in m.loss.series("loss").view()[0]]
        assert xs == list(range(1, 13)), f"the history was not kept: steps {xs}"
        open_page(window, qtbot, "Runs")
        qtbot.waitUntil(lambda: page.row_text("walk").get("Status") == "finished", timeout=60_000)

    with walk.step("Chat"):
        open_page(window, qtbot, "Chat")
        chat = window.chat_panel
        chat.prompt.setPlainText("What is 12 plus 7?")
        with qtbot.waitSignal(chat.replied, timeout=600_000) as replied:
            click(qtbot, chat, "Generate")
        assert replied.args[0]["tuned"].strip()

    with walk.step("Export the adapter"):
        open_page(window, qtbot, "Export")
        ep = window.export_panel
        assert ep.select_source(str(runs_dir / "walk"))
        ep.dest.setText(str(tmp_path / "exported"))
        for name, box in ep.wants.items():
            box.setChecked(name == "adapter")
        with qtbot.waitSignal(ep.exported, timeout=600_000) as exported:
            click(qtbot, ep, "Export")
        written = exported.args[0]
        assert any("adapter_model.safetensors" in files for files in written.values()), written

    with walk.step("a bad data file"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n', encoding="utf-8")
        open_page(window, qtbot, "Data")
        dp = window.data_panel
        dp.file.setChecked(True)
        dp.path.setText(str(bad))
        click(qtbot, dp, "Load")
        qtbot.waitUntil(lambda: not dp.loading and bool(dp.problem), timeout=120_000)
        open_page(window, qtbot, "Train")
        assert not window.training_panel.train.isEnabled()
        reason = window.training_panel.train_reason.text()
        assert "bad.jsonl" in reason and "line 2" in reason, reason

    with walk.step(f"a {BIG_MB} MB file"):
        big = tmp_path / "big.jsonl"
        rows = big_jsonl(big, BIG_MB)
        open_page(window, qtbot, "Data")
        dp.path.setText(str(big))
        click(qtbot, dp, "Load")
        assert tasks.pending("data.preview")
        # Chat answers while the file is read.
        open_page(window, qtbot, "Chat")
        chat.prompt.setPlainText("What is 3 plus 4?")
        with qtbot.waitSignal(chat.replied, timeout=300_000):
            click(qtbot, chat, "Generate")
        # The Model page reads its model while the file is read.
        open_page(window, qtbot, "Model")
        with qtbot.waitSignal(window.model_panel.report_ready, timeout=300_000):
            click(qtbot, window.model_panel, "Use this model")
        busy = tasks.pending("data.preview") or tasks.pending("data.xray") or tasks.pending("data.packing")
        assert busy, "the big file was done before Chat and the Model page were tried: nothing was shown"
        # Then the X-ray of every row starts, says how far it is, and Cancel stops it.
        qtbot.waitUntil(lambda: dp.xray_progress.maximum() == rows, timeout=900_000)
        open_page(window, qtbot, "Data")
        dp.tabs.setCurrentIndex(4)
        click(qtbot, dp, "Cancel X-ray")
        qtbot.waitUntil(lambda: dp.tabs.tabText(4) == "X-ray (cancelled)", timeout=60_000)

    with walk.step("Quit"):
        _, err, tore_down = end_after_quit(QUIT_CHILD, [str(tmp_path / "q.ini"), str(runs_dir), str(big)], tmp_path)
        assert not tore_down, "the process ended through Python's teardown, not finish's exit"
