"""Packed rows drawn as coloured segments, one colour per document, padding in grey.

Only the rows inside the visible rectangle are painted, so a layout of thousands of rows
scrolls as smoothly as a short one.
"""

from __future__ import annotations

from typing import Optional, Sequence

from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QScrollArea, QToolTip, QWidget

ROW_H = 14
GAP = 3
LEFT = 44
PALETTE = [
    "#5dade2",
    "#58d68d",
    "#f5b041",
    "#af7ac5",
    "#ec7063",
    "#48c9b0",
    "#f4d03f",
    "#85929e",
    "#5499c7",
    "#52be80",
    "#eb984e",
    "#a569bd",
]


class _Canvas(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[Sequence[int]] = []
        self.row_len = 1
        self.setMouseTracking(True)

    def sizeHint(self) -> QSize:
        return QSize(600, max(ROW_H, len(self.rows) * (ROW_H + GAP)))

    def _geometry(self):
        width = max(10, self.width() - LEFT - 8)
        return width / max(1, self.row_len)

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        p.fillRect(event.rect(), QColor("#ffffff"))
        scale = self._geometry()
        first = max(0, event.rect().top() // (ROW_H + GAP))
        last = min(len(self.rows), event.rect().bottom() // (ROW_H + GAP) + 1)
        doc_id = sum(len(r) for r in self.rows[:first])
        p.setPen(QPen(QColor("#78848f")))
        for r in range(first, last):
            y = r * (ROW_H + GAP)
            p.drawText(
                QRect(0, y, LEFT - 6, ROW_H), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, str(r)
            )
            full = QRect(LEFT, y, round(self.row_len * scale), ROW_H)
            p.fillRect(full, QColor("#e5e8e8"))  # padding (what packing leaves over)
            x = 0.0
            for length in self.rows[r]:
                w = length * scale
                p.fillRect(
                    QRect(round(LEFT + x), y, max(1, round(w) - 1), ROW_H), QColor(PALETTE[doc_id % len(PALETTE)])
                )
                x += w
                doc_id += 1
        p.end()

    def mouseMoveEvent(self, event) -> None:
        pos = event.position().toPoint()
        r = pos.y() // (ROW_H + GAP)
        if not (0 <= r < len(self.rows)) or pos.x() < LEFT:
            QToolTip.hideText()
            return
        offset = (pos.x() - LEFT) / self._geometry()
        acc = 0
        for k, length in enumerate(self.rows[r]):
            if acc <= offset < acc + length:
                QToolTip.showText(
                    event.globalPosition().toPoint(),
                    f"packed row {r + 1}, document {k + 1} of {len(self.rows[r])}: {length} tokens",
                )
                return
            acc += length
        QToolTip.showText(
            event.globalPosition().toPoint(), f"packed row {r + 1}: padding ({self.row_len - sum(self.rows[r])} tokens)"
        )


class PackingView(QScrollArea):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.canvas = _Canvas()
        self.setWidget(self.canvas)
        self.setWidgetResizable(True)
        self.setMinimumHeight(120)

    def set_layout(self, rows: Sequence[Sequence[int]], row_len: int) -> None:
        self.canvas.rows = [list(r) for r in rows]
        self.canvas.row_len = max(1, int(row_len))
        self.canvas.setMinimumHeight(self.canvas.sizeHint().height())
        self.canvas.updateGeometry()
        self.canvas.update()

    @property
    def num_rows(self) -> int:
        return len(self.canvas.rows)

    @staticmethod
    def efficiency(rows: Sequence[Sequence[int]], row_len: int) -> Optional[float]:
        if not rows:
            return None
        return sum(sum(r) for r in rows) / (len(rows) * row_len)
