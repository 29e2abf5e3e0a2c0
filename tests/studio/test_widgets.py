"""The studio's widgets on their own: growable chart buffers, the lazy rows table at 100,000
rows, the packing and token-mask views, the step list, settings persistence, the excepthook."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from studio.widgets.series import Ema, Series


def test_series_grows_by_doubling_and_views_do_not_copy():
    s = Series(capacity=4)
    for i in range(10):
        s.append(i, i * i)
    x, y = s.view()
    assert s.n == 10 and s.capacity == 16
    assert np.array_equal(x, np.arange(10)) and y[-1] == 81
    assert x.base is not None  # a view into the buffer, not a copy


def test_ema_is_debiased():
    e = Ema(0.9)
    assert e.update(5.0) == pytest.approx(5.0)
    for _ in range(200):
        v = e.update(1.0)
    assert v == pytest.approx(1.0, abs=1e-6)


def test_live_chart_takes_20000_points_without_rebuilding(qtbot):
    from studio.widgets.live_chart import LiveChart

    chart = LiveChart("loss")
    qtbot.addWidget(chart)
    chart.add_series("loss", "#000")
    chart.resize(600, 300)
    chart.show()
    curve = chart._curves["loss"]
    for i in range(20_000):
        chart.append("loss", i, np.sin(i / 100))
        if i % 1000 == 0:
            chart.refresh()
    # An append only marks the series; the curve is redrawn once per refresh (the last at i = 19,000).
    assert chart.dirty and len(curve.xData) == 19_001
    chart.refresh()
    assert not chart.dirty
    assert chart.point_count("loss") == 20_000
    assert chart._curves["loss"] is curve  # the same curve item throughout, never rebuilt
    assert len(curve.xData) == 20_000


class _BigSource:
    """100,000 synthetic rows, counting how many the table asked for."""

    columns = ["instruction", "output"]
    num_rows = 100_000

    def __init__(self):
        self.reads = 0
        self.highest = -1

    def row(self, i):
        self.reads += 1
        self.highest = max(self.highest, i)
        return {"instruction": f"question {i}", "output": f"answer {i}"}


def test_rows_model_is_lazy_at_100k_rows(qtbot):
    from PySide6.QtWidgets import QTableView

    from studio.widgets.rows_model import BATCH, RowsModel

    src = _BigSource()
    model = RowsModel()
    model.set_source(src, {5: "no output"})
    view = QTableView()
    qtbot.addWidget(view)
    view.setModel(model)
    view.resize(600, 400)
    view.show()
    qtbot.waitExposed(view)
    assert model.rowCount() == BATCH  # only the first batch is known to the view
    assert src.reads < 100  # only visible rows were read
    view.scrollToBottom()
    qtbot.waitUntil(lambda: model.rowCount() > BATCH)  # scrolling fetched more
    while model.canFetchMore():
        model.fetchMore()
    view.scrollToBottom()
    qtbot.waitUntil(lambda: src.highest > 99_000)  # the view has drawn the last rows
    assert model.rowCount() == 100_000
    assert src.reads < 500  # lazy: the rows a view shows, not 100,000
    assert model.data(model.index(99_999, 1)) == "answer 99999"
    assert "no output" in model.data(model.index(5, 0), role=3)  # tooltip names the problem


def test_packing_view_and_token_mask_view(qtbot):
    from studio.widgets.packing_view import PackingView
    from studio.widgets.token_mask_view import TokenMaskView

    pv = PackingView()
    qtbot.addWidget(pv)
    rows = [[60, 40, 20], [100], [30, 30]]
    pv.set_layout(rows, 128)
    pv.show()
    assert pv.num_rows == 3
    assert PackingView.efficiency(rows, 128) == pytest.approx(280 / 384)
    pv.grab()  # paints without error

    tv = TokenMaskView()
    qtbot.addWidget(tv)
    tv.set_pieces([("<user>", False), ("Hi", False), ("\n", False), ("Hello", True), (" there", True)])
    assert (tv.num_tokens, tv.num_trained) == (5, 2)
    assert "2 trained" in tv.counts.text()
    assert "Hello" in tv.text.toPlainText()


def test_step_list_marks_states(qtbot):
    from studio.widgets.step_list import StepList

    steps = StepList()
    qtbot.addWidget(steps)
    a = steps.add_step("Model")
    b = steps.add_step("Hardware", separated=True)
    seen = []
    steps.step_selected.connect(seen.append)
    steps.select_step(b)
    assert seen == [b] and steps.current_step() == b
    steps.set_state(a, "done")
    assert steps.state(a) == "done"


def test_settings_persist_recent_lists(tmp_path):
    from studio.settings import Settings

    s = Settings(tmp_path / "s.ini")
    s.add_recent_model("demo")
    s.add_recent_model("Qwen/Qwen3-0.6B")
    s.add_recent_model("demo")
    s.add_recent_dataset("/data/a.jsonl")
    s.sync()
    again = Settings(tmp_path / "s.ini")
    assert again.recent_models() == ["demo", "Qwen/Qwen3-0.6B"]
    assert again.recent_datasets() == ["/data/a.jsonl"]


def test_error_reporter_shows_a_dialog_not_a_traceback(qtbot):
    from studio.errors import ErrorReporter

    logged = []
    rep = ErrorReporter(log=lambda m, lvl: logged.append((m, lvl)))
    rep.install()
    try:
        try:
            raise MemoryError("tried to allocate 40 GiB")
        except MemoryError:
            sys.excepthook(*sys.exc_info())
        qtbot.waitUntil(lambda: bool(rep.dialogs), timeout=2000)
    finally:
        rep.uninstall()
    box = rep.dialogs[0]
    assert "Out of memory" in box.text()
    assert "tried to allocate" in box.detailedText()
    assert logged and logged[0][1] == "error"
    box.close()


def test_pyside_refcount_guard_keeps_none_alive(qapp):
    from PySide6.QtCore import QObject

    from studio import qt_compat

    obj = QObject()
    for _ in range(20_000):  # would abort the interpreter on an unguarded 3.11 + PySide6 6.12
        obj.setObjectName("x")
    assert sys.getrefcount(None) > 0
    assert qt_compat.applied or sys.version_info >= (3, 12) or not qt_compat._leaks()


def test_monitor_line_shows_packing_counters_and_offload_mode(qtbot):
    from engine.events import RunStarted, StepMetrics
    from studio.panels.monitor import MonitorPanel

    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.begin()
    panel.run_started(
        RunStarted("/tmp/run", {}, {"kind": "datacenter"}, 10, {"offload": "on: double buffer, 28 layers"})
    )
    common = dict(
        total_steps=10,
        epoch=0.1,
        loss=2.0,
        lr=1e-4,
        grad_norm=1.0,
        tokens=100,
        trained_tokens=90,
        step_seconds=0.1,
        tokens_per_second=1000.0,
        metadata_builds=1,
    )
    panel.step(StepMetrics(step=1, offload="single (free VRAM 100 MiB < 384 MiB for the second buffer)", **common))
    text = panel.eta.text()
    assert "packing meta 1×, 0 syncs" in text and "offload single (free VRAM" in text
    panel.step(StepMetrics(step=2, **common))  # offload off: nothing said about it
    assert "offload" not in panel.eta.text()
    panel.close()
