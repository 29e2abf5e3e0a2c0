"""The Data page's rows table: Ctrl+End goes to the data set's last row, not the last row of the
batches fetched so far (issue 28: it stopped at row 999), and still reads only the rows drawn."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtTest import QTest


class _Source:
    columns = ["instruction", "output"]
    num_rows = 25_000

    def __init__(self):
        self.reads = 0

    def row(self, i):
        self.reads += 1
        return {"instruction": f"question {i}", "output": f"answer {i}"}


def test_ctrl_end_reaches_the_last_row(qtbot):
    from studio.widgets.rows_model import BATCH, RowsModel, RowsTable

    src = _Source()
    model = RowsModel()
    model.set_source(src)
    view = RowsTable()
    qtbot.addWidget(view)
    view.setModel(model)
    view.resize(600, 400)
    view.show()
    qtbot.waitExposed(view)
    view.setCurrentIndex(model.index(0, 0))
    assert model.rowCount() == BATCH  # lazy: the first batch only

    QTest.keyClick(view, Qt.Key.Key_End, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: view.currentIndex().row() == src.num_rows - 1, timeout=5_000)
    assert model.data(view.currentIndex()) in ("question 24999", "answer 24999")
    assert src.reads < 500  # still only the rows drawn were read

    QTest.keyClick(view, Qt.Key.Key_Home, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: view.currentIndex().row() == 0, timeout=5_000)


def test_data_page_table_is_the_rows_table(qtbot, settings, runs_dir):
    from studio.panels.dataset import DataPanel
    from studio.state import StudioState
    from studio.widgets.rows_model import RowsTable

    panel = DataPanel(StudioState(str(runs_dir)), settings)
    qtbot.addWidget(panel)
    assert isinstance(panel.table, RowsTable) and panel.table.model() is panel.rows_model


def test_rows_are_numbered_from_1_where_a_person_reads_them(qtbot):
    """Issue 28 item 10: rows counted from 0 while the file's lines count from 1. The table's row
    headers and the Example box show 1..n; the indices behind them stay 0-based."""
    from studio.widgets.rows_model import RowsModel, RowSpinBox

    model = RowsModel()
    model.set_source(_Source())
    assert model.headerData(0, Qt.Orientation.Vertical) == "1"
    box = RowSpinBox()
    qtbot.addWidget(box)
    box.setRange(0, 24_999)
    box.setValue(0)
    assert box.text() == "1"
    box.lineEdit().selectAll()
    QTest.keyClicks(box, "25000")
    QTest.keyClick(box, Qt.Key.Key_Return)
    assert box.value() == 24_999  # the last row, typed as a person counts it
    box.lineEdit().selectAll()
    QTest.keyClicks(box, "0")  # there is no row 0
    QTest.keyClick(box, Qt.Key.Key_Return)
    assert box.value() == 24_999
