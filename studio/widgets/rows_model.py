"""A table model over a data set's raw rows that stays fast at 100,000+ rows.

Rows are exposed to the view in batches (canFetchMore / fetchMore) as it scrolls, and each
row is read from the source only when a cell of it is drawn, through a small cache. The
source is anything with `num_rows`, `columns` and `row(i) -> dict` (engine.data.preview).
`RowsTable` is the view for it: Ctrl+End (and End) go to the last row of the data set, not of
the batches fetched so far, which is where Qt's own table view stops.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Optional

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor, QValidator
from PySide6.QtWidgets import QAbstractItemView, QSpinBox, QTableView

from engine.api import shown_row

BATCH = 1000
CACHE_ROWS = 2000
CELL_CHARS = 160


def cell_text(value: Any, limit: int = CELL_CHARS) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = str(value)
    text = text.replace("\n", " ⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class RowsModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self._source = None
        self._columns: list[str] = []
        self._total = 0
        self._loaded = 0
        self._cache: "OrderedDict[int, dict]" = OrderedDict()
        self._problems: dict[int, str] = {}
        self.reads = 0  # rows read from the source (tests check laziness)

    def set_source(self, source, problems: Optional[dict[int, str]] = None) -> None:
        self.beginResetModel()
        self._source = source
        self._columns = list(getattr(source, "columns", []) or []) if source is not None else []
        self._total = int(getattr(source, "num_rows", 0) or 0) if source is not None else 0
        self._loaded = min(BATCH, self._total)
        self._cache.clear()
        self._problems = dict(problems or {})
        self.reads = 0
        self.endResetModel()

    @property
    def total_rows(self) -> int:
        return self._total

    # -- lazy growth ------------------------------------------------------------------------
    def canFetchMore(self, parent=QModelIndex()) -> bool:
        return not parent.isValid() and self._loaded < self._total

    def fetchMore(self, parent=QModelIndex()) -> None:
        if parent.isValid():
            return
        more = min(BATCH, self._total - self._loaded)
        if more <= 0:
            return
        self.beginInsertRows(QModelIndex(), self._loaded, self._loaded + more - 1)
        self._loaded += more
        self.endInsertRows()

    def fetch_to_end(self) -> None:
        """Make every row known to the view in one insertion. Cheap at any size: a row is still
        read only when a cell of it is drawn."""
        if self._loaded < self._total:
            self.beginInsertRows(QModelIndex(), self._loaded, self._total - 1)
            self._loaded = self._total
            self.endInsertRows()

    # -- model interface --------------------------------------------------------------------
    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else self._loaded

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._columns)

    def _row(self, i: int) -> dict:
        row = self._cache.get(i)
        if row is None:
            self.reads += 1
            try:
                row = self._source.row(i)
            except Exception as exc:  # a bad row must not break the table
                row = {c: f"<cannot read: {exc}>" for c in self._columns}
            if not isinstance(row, dict):
                row = {self._columns[0] if self._columns else "value": row}
            self._cache[i] = row
            if len(self._cache) > CACHE_ROWS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(i)
        return row

    def data(self, index: QModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        r, c = index.row(), index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return cell_text(self._row(r).get(self._columns[c]))
        if role == Qt.ItemDataRole.ToolTipRole:
            text = cell_text(self._row(r).get(self._columns[c]), limit=2000)
            problem = self._problems.get(r)
            return f"Cannot be used: {problem}\n\n{text}" if problem else text
        if role == Qt.ItemDataRole.BackgroundRole and r in self._problems:
            return QBrush(QColor("#fdecea"))
        return None

    def headerData(self, section: int, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if orientation == Qt.Orientation.Horizontal:
            return self._columns[section] if section < len(self._columns) else None
        return str(shown_row(section))  # rows count from 1 where a person reads them


class RowsTable(QTableView):
    """The table over a RowsModel. Qt's view moves Ctrl+End to the last row the model has
    fetched (row 999 of a 100,000-row file); here the rest is fetched first, so the key means
    what it says."""

    def moveCursor(self, action, modifiers):
        model = self.model()
        if action == QAbstractItemView.CursorAction.MoveEnd and isinstance(model, RowsModel):
            model.fetch_to_end()
        return super().moveCursor(action, modifiers)


class RowSpinBox(QSpinBox):
    """A row picker whose value is the row's 0-based index and whose text is the row's number as
    a person reads it (from 1, engine.api.shown_row): the Data page's Example box."""

    def textFromValue(self, value: int) -> str:
        return str(shown_row(value))

    def valueFromText(self, text: str) -> int:
        return int(text) - shown_row(0) if text.strip().isdigit() else self.value()

    def validate(self, text: str, pos: int):
        # Qt's own check parses the typed number against the range of indices: "1" to "n" must pass.
        typed = text.strip()
        if typed.isdigit() and self.minimum() <= int(typed) - shown_row(0) <= self.maximum():
            return QValidator.State.Acceptable, text, pos
        return (QValidator.State.Intermediate if typed.isdigit() or not typed else QValidator.State.Invalid), text, pos
