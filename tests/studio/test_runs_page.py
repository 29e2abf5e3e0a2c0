"""The Runs page (issue 14 item 4) on real runs of the bundled demo model: it lists a run with
its status and numbers as metrics.jsonl has them, overlays two runs with their config
differences, resumes a stopped run (from the page and from Run ▸ Resume) to the same per-step
losses as an uninterrupted run, renames and deletes runs, follows into Chat and Export, and
lists broken run folders as such. Plus the spin-box arrows (drawn as arrows, not as "—")."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import Qt
from studio_helpers import screenshot, short_config

pytestmark = pytest.mark.slow


# -- helpers ------------------------------------------------------------------------------------
def step_losses(run: Path) -> dict[int, float]:
    """{step: loss} straight from metrics.jsonl (a step logged twice keeps its later value)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event["event"] == "StepMetrics":
            out[event["step"]] = event["loss"]
    return out


def events(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def configure(window, runs_dir, name, steps, **extra) -> None:
    short_config(window.state, runs_dir, name, steps=steps)
    for path, value in extra.items():
        window.state.set(path, value)


def pause_at(worker, step: int) -> None:
    """Ask the session to pause right after `step`, on the worker thread itself (a direct
    connection), so the run holds at exactly that step whatever the machine's speed."""

    def on_event(event) -> None:
        if type(event).__name__ == "StepMetrics" and event.step == step:
            worker.pause()

    worker.event.connect(on_event, Qt.ConnectionType.DirectConnection)


def train(window, qtbot, timeout=240_000):
    """Press Train and wait for the outcome; returns the Finished event."""
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    with qtbot.waitSignal(window.run_finished, timeout=timeout) as done:
        assert window.start_training()
    event = done.args[0]
    assert type(event).__name__ == "Finished", event
    return event


def stop_when_paused(window, qtbot, step: int):
    """Wait for the pause after `step`, press Stop, wait for the stopped outcome."""
    qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=240_000)
    with qtbot.waitSignal(window.run_finished, timeout=120_000) as done:
        window.stop()
    event = done.args[0]
    assert type(event).__name__ == "Finished" and event.stopped, event
    assert event.summary["steps"] == step
    return event


def show_runs(window, qtbot):
    from studio.main_window import RUNS

    page = window.runs_panel
    with qtbot.waitSignal(page.refreshed, timeout=60_000):
        window.go_to(RUNS)
    return page


def select(page, qtbot, names):
    with qtbot.waitSignal(page.charts_ready, timeout=60_000):
        page.select_runs(names)


# -- tests --------------------------------------------------------------------------------------
def test_a_run_is_listed_with_its_numbers_charts_and_actions(window, qtbot, runs_dir):
    configure(window, runs_dir, "first", steps=6)
    train(window, qtbot)
    run = runs_dir / "first"
    losses = step_losses(run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    speeds = [e["tokens_per_second"] for e in events(run, "StepMetrics")]

    page = show_runs(window, qtbot)
    row = page.row_text("first")
    assert row["Status"] == "finished"
    assert row["Steps"] == "6 / 6"
    assert row["Model"] == "demo" and row["Data"] == "demo"
    assert row["Final loss"] == f"{losses[6]:.4f}"
    assert row["Best train loss"] == f"{min(losses.values()):.4f}"
    assert row["Tokens/s"] == f"{statistics.median(speeds):,.0f}"
    assert row["Date"] != "—" and row["Duration"] != "—"

    # Its charts: the loss per step as metrics.jsonl has it.
    select(page, qtbot, ["first"])
    loss_chart = page.charts["loss"]
    np.testing.assert_allclose(loss_chart.values("first"), [losses[s] for s in range(1, 7)], rtol=1e-12)
    assert page.charts["lr"].point_count("first") == 6
    assert not page.resume_button.isEnabled()  # finished: nothing left to train
    screenshot(window, "runs")

    # Chat and Export follow the run and the checkpoint picked here.
    checkpoint = str(run / "checkpoints" / "step-6")
    assert page.select_source(checkpoint)
    assert window.chat_panel.source.currentData() == checkpoint
    assert window.export_panel.selected_source() == checkpoint
    assert page.select_source(str(run))  # the final adapter
    assert window.chat_panel.source.currentData() == str(run)
    assert window.export_panel.selected_source() == str(run)

    # Open folder hands the run's folder to the desktop.
    opened = []
    page.open_url = opened.append
    qtbot.mouseClick(page.open_button, Qt.MouseButton.LeftButton)
    assert [u.toLocalFile() for u in opened] == [str(run)]

    # Rename: a taken or bad name is refused in one sentence; a good one moves the folder, and
    # the run stays whole (listed finished, its checkpoint offered by Chat under the new path).
    (runs_dir / "taken").mkdir()
    assert not page.rename_selected("taken")
    assert "already exists" in page.banner.text()
    assert not page.rename_selected("a/b")
    assert "cannot be a folder name" in page.banner.text()
    with qtbot.waitSignal(page.refreshed, timeout=60_000):
        assert page.rename_selected("renamed")
    assert not run.exists() and (runs_dir / "renamed" / "adapter").is_dir()
    assert page.summary("first") is None and page.row_text("renamed")["Status"] == "finished"
    qtbot.waitUntil(lambda: page.current() is not None and page.current().name == "renamed", timeout=10_000)
    # The first source is selected: the best checkpoint by eval loss (the demo holds out 21 examples).
    from engine.api import read_run

    label, first = read_run(runs_dir / "renamed").sources()[0]
    assert label.startswith("best (eval loss ") and page.selected_source() == str(first)
    assert window.chat_panel.source.findData(str(runs_dir / "renamed" / "checkpoints" / "step-6")) >= 0

    # Delete asks first; "no" keeps everything.
    asked = []
    page.confirm = lambda title, text: asked.append(text) or False
    assert not page.delete_selected()
    assert asked and "renamed" in asked[0] and (runs_dir / "renamed").is_dir()
    page.confirm = lambda *_: True
    with qtbot.waitSignal(page.refreshed, timeout=60_000):
        assert page.delete_selected()
    assert not (runs_dir / "renamed").exists()
    assert page.summary("renamed") is None
    assert window.chat_panel.source.findData(str(runs_dir / "renamed")) < 0


def test_two_runs_overlay_with_their_config_differences(window, qtbot, runs_dir):
    configure(window, runs_dir, "lr-high", steps=4)
    train(window, qtbot)
    configure(window, runs_dir, "lr-low", steps=4, **{"training.lr": 0.0005, "lora.r": 8})
    train(window, qtbot)

    page = show_runs(window, qtbot)
    select(page, qtbot, ["lr-high", "lr-low"])
    chart = page.charts["loss"]
    # Each run's loss, and its eval loss (dashed) on the held-out examples.
    assert set(chart.curves) == {"lr-high", "lr-low", "lr-high eval", "lr-low eval"}
    for name in ("lr-high", "lr-low"):
        losses = step_losses(runs_dir / name)
        np.testing.assert_allclose(chart.values(name), [losses[s] for s in sorted(losses)], rtol=1e-12)
    assert chart.values("lr-high") != chart.values("lr-low")
    diff = page.differences()
    assert diff["training.lr"] == {"lr-high": "0.003", "lr-low": "0.0005"}
    assert diff["lora.r"] == {"lr-high": "16", "lr-low": "8"}
    assert "output.run_name" not in diff  # the names head the columns already
    assert "model.name_or_path" not in diff  # the same in both
    screenshot(window, "runs-overlay")


def test_a_stopped_run_resumes_to_the_losses_of_an_uninterrupted_run(window, qtbot, runs_dir):
    # fp32 on the CPU: the resumed run must reproduce every step's loss.
    configure(window, runs_dir, "straight", steps=6)
    train(window, qtbot)
    straight = step_losses(runs_dir / "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]

    # The same config, stopped after step 2.
    configure(window, runs_dir, "halted", steps=6)
    qtbot.waitUntil(lambda: window.engine_warm, timeout=120_000)
    assert window.start_training()
    pause_at(window.worker, 2)
    qtbot.waitUntil(lambda: window.monitor_panel.mode == "paused", timeout=240_000)
    page = show_runs(window, qtbot)  # while it is paused, it is the running run
    assert page.row_text("halted")["Status"] == "running"
    select(page, qtbot, ["halted"])
    assert not page.resume_button.isEnabled() and not page.delete_button.isEnabled()
    stop_when_paused(window, qtbot, 2)

    # Listed as stopped; Resume on the Runs page continues it; stop it again after step 4.
    with qtbot.waitSignal(page.refreshed, timeout=60_000):
        page.refresh()
    assert page.row_text("halted")["Status"] == "stopped"
    assert page.row_text("halted")["Steps"] == "2 / 6"
    select(page, qtbot, ["halted"])
    assert page.resume_button.isEnabled()
    qtbot.mouseClick(page.resume_button, Qt.MouseButton.LeftButton)
    assert window.is_training()
    pause_at(window.worker, 4)
    stop_when_paused(window, qtbot, 4)

    # Run ▸ Resume continues the stopped run (the last run of this session) to the end.
    with qtbot.waitSignal(window.run_finished, timeout=240_000) as done:
        window.resume_action.trigger()
    event = done.args[0]
    assert type(event).__name__ == "Finished" and not event.stopped, event
    assert event.summary["steps"] == 6

    run = runs_dir / "halted"
    assert [e["resumed_from_step"] for e in events(run, "RunStarted")] == [0, 2, 4]
    resumed = step_losses(run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [resumed[s] for s in range(1, 7)], [straight[s] for s in range(1, 7)], rtol=1e-5, atol=1e-7
    )
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    with qtbot.waitSignal(page.refreshed, timeout=60_000):
        page.refresh()
    assert page.row_text("halted")["Status"] == "finished"
    assert page.row_text("halted")["Steps"] == "6 / 6"


def test_broken_run_folders_are_listed_as_such(window, qtbot, runs_dir):
    good_line = json.dumps({"event": "StepMetrics", "step": 1, "total_steps": 3, "loss": 2.5, "time": 1.0})
    corrupt = runs_dir / "corrupt-metrics"
    corrupt.mkdir()
    (corrupt / "config.yaml").write_text("model:\n  name_or_path: demo\n", encoding="utf-8")
    (corrupt / "metrics.jsonl").write_text(good_line + "\n{this is not json\n" + good_line + "\n", encoding="utf-8")
    bad_yaml = runs_dir / "bad-config"
    bad_yaml.mkdir()
    (bad_yaml / "config.yaml").write_text("model: [unclosed\n", encoding="utf-8")
    (bad_yaml / "metrics.jsonl").write_text(good_line + "\n", encoding="utf-8")
    leftover = runs_dir / "no-config"
    (leftover / "checkpoints").mkdir(parents=True)
    (runs_dir / "not-a-run").mkdir()  # an unrelated folder is not listed

    page = show_runs(window, qtbot)
    names = {s.name for s in page.summaries}
    assert names == {"corrupt-metrics", "bad-config", "no-config"}
    problems = {name: page.summary(name).problem for name in names}
    assert page.row_text("corrupt-metrics")["Status"] == "corrupt"
    assert "metrics.jsonl line 2 is not valid JSON" in problems["corrupt-metrics"]
    assert page.row_text("bad-config")["Status"] == "corrupt"
    assert "config.yaml is not valid YAML" in problems["bad-config"]
    assert page.row_text("no-config")["Status"] == "corrupt"
    assert "config.yaml is missing" in problems["no-config"]
    # The readable part is still shown; nothing can be resumed; the page keeps working.
    assert page.row_text("corrupt-metrics")["Final loss"] == "2.5000"
    select(page, qtbot, ["corrupt-metrics", "bad-config"])
    assert page.charts["loss"].point_count("corrupt-metrics") == 1
    assert not page.resume_button.isEnabled()
    assert "config.yaml" in page.diff_note.text()
    assert not page.resume_selected()
    assert page.banner.text()
    assert window.isVisible()


def test_spin_box_arrows_are_drawn_as_arrows(qapp, qtbot):
    """With the studio's stylesheet, each spin-box button holds a triangle (rows of ink that
    widen towards the base), not a flat "—" (rows of equal width)."""
    from PySide6.QtGui import QColor
    from PySide6.QtWidgets import QDoubleSpinBox, QSpinBox, QStyle, QStyleOptionSpinBox

    from studio.app import load_style

    qapp.setStyle("Fusion")
    qapp.setStyleSheet(load_style())
    for box in (QSpinBox(), QDoubleSpinBox()):
        qtbot.addWidget(box)
        box.setRange(0, 100)
        box.setValue(50)  # both arrows enabled
        box.resize(140, 28)
        box.show()
        qtbot.waitExposed(box)
        image = box.grab().toImage()
        opt = QStyleOptionSpinBox()
        box.initStyleOption(opt)
        for sub, widens_down in ((QStyle.SubControl.SC_SpinBoxUp, True), (QStyle.SubControl.SC_SpinBoxDown, False)):
            rect = box.style().subControlRect(QStyle.ComplexControl.CC_SpinBox, opt, sub, box).adjusted(1, 1, -1, -1)
            widths = []
            for y in range(rect.top(), rect.bottom() + 1):
                ink = sum(QColor(image.pixel(x, y)).lightness() < 200 for x in range(rect.left(), rect.right() + 1))
                if ink:
                    widths.append(ink)
            ordered = widths if widens_down else widths[::-1]
            assert len(widths) >= 3, (type(box).__name__, sub, widths)
            assert all(a < b for a, b in zip(ordered, ordered[1:])), (type(box).__name__, sub, widths)
