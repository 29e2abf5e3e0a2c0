"""The Data page's X-ray tab: what the engine's data X-ray found, by kind, and token lengths.

A tree lists each kind of finding (truncated answers, missing end of turn, ...) with its count and,
under it, the rows with what is wrong; double-clicking a row emits `row_chosen(index)` so the
page can show that example. Beside it, a histogram of the rows' token lengths with a line at
``max_seq_len``: everything right of the line is cut.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QSplitter, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget

from engine.api import shown_row

MAX_ROWS_PER_KIND = 500  # a tree of 100k rows helps nobody; the count says how many there are


class DataXRay(QWidget):
    row_chosen = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.summary = QLabel("—")
        self.summary.setWordWrap(True)
        self.summary.setObjectName("caption")
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(["Finding", "Row", "Detail"])
        self.tree.setColumnWidth(0, 300)
        self.tree.setColumnWidth(1, 60)
        self.tree.itemDoubleClicked.connect(self._double_clicked)
        self.hist = pg.PlotWidget()
        self.hist.setObjectName("xrayHistogram")
        self.hist.setTitle("Token length per row", size="10pt")
        item = self.hist.getPlotItem()
        item.setLabel("bottom", "tokens")
        item.setLabel("left", "rows")
        item.showGrid(x=False, y=True, alpha=0.15)
        self.hist.setMinimumHeight(160)
        self.bars: pg.BarGraphItem | None = None
        self.limit_line: pg.InfiniteLine | None = None
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.tree)
        split.addWidget(self.hist)
        lay = QVBoxLayout(self)
        lay.addWidget(self.summary)
        lay.addWidget(split, 1)

    def set_message(self, text: str) -> None:
        self.summary.setText(text)
        self.tree.clear()

    def set_xray(self, x, kinds: dict[str, str]) -> int:
        """Show an engine XRay; `kinds` maps each kind to its sentence. Returns the finding count."""
        self.tree.clear()
        by, counts = x.by_kind(), x.counts()
        total = 0
        for kind, sentence in kinds.items():
            found = by.get(kind) or []
            n = counts.get(kind, len(found))  # the engine keeps a kind's first rows and counts them all
            if not n:
                continue
            total += n
            # The count goes with the sentence: the Row column holds row numbers only.
            rows = f"{n:,} row" + ("" if n == 1 else "s")
            node = QTreeWidgetItem([f"{sentence} ({rows})", "", ""])
            node.setData(0, Qt.ItemDataRole.UserRole, kind)
            for f in found[:MAX_ROWS_PER_KIND]:
                child = QTreeWidgetItem(["", str(shown_row(f.row)), f.detail])
                child.setData(1, Qt.ItemDataRole.UserRole, f.row)
                node.addChild(child)
            shown = min(len(found), MAX_ROWS_PER_KIND)
            if n > shown:
                node.addChild(QTreeWidgetItem(["", "…", f"{n - shown:,} more"]))
            self.tree.addTopLevelItem(node)
        longest = max(x.lengths) if x.lengths else 0
        over = x.over_limit()
        parts = [
            f"<b>{x.rows:,}</b> rows checked",
            f"longest <b>{longest:,}</b> tokens (max seq len {x.max_seq_len:,})",
        ]
        if over:
            parts.append(f"<b>{over:,}</b> longer than max seq len")
        parts.append(f"<b>{total:,}</b> findings" if total else "nothing to flag")
        self.summary.setText(" · ".join(parts))
        self._histogram(x)
        return total

    def _histogram(self, x) -> None:
        edges, counts = x.histogram(24)
        if self.bars is not None:
            self.hist.removeItem(self.bars)
        if self.limit_line is not None:
            self.hist.removeItem(self.limit_line)
        width = edges[1] - edges[0] if len(edges) > 1 else 1
        self.bars = pg.BarGraphItem(
            x0=edges[:-1], width=width * 0.9, height=counts, brush=pg.mkBrush("#5b8def"), pen=pg.mkPen(None)
        )
        self.hist.addItem(self.bars)
        self.limit_line = pg.InfiniteLine(
            pos=x.max_seq_len,
            angle=90,
            pen=pg.mkPen("#d9534f", width=2, style=Qt.PenStyle.DashLine),
            label="max seq len",
            labelOpts={"position": 0.9, "color": "#d9534f"},
        )
        self.hist.addItem(self.limit_line)

    def _double_clicked(self, item: QTreeWidgetItem, _col: int) -> None:
        row = item.data(1, Qt.ItemDataRole.UserRole)
        if row is not None:
            self.row_chosen.emit(int(row))
