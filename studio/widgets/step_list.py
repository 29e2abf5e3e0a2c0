"""The left-hand list that shows where a person is in the flow: Model → Data → Train →
Monitor → Chat → Export, each step marked pending, current, done or failed."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import QListWidget, QListWidgetItem

MARKS = {"pending": "○", "done": "✓", "active": "●", "failed": "✕"}


class StepList(QListWidget):
    step_selected = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("stepList")
        self.setFixedWidth(190)
        self.setIconSize(QSize(0, 0))
        self._titles: list[str] = []
        self._states: list[str] = []
        self.currentItemChanged.connect(self._on_current)

    def _on_current(self, item, _previous) -> None:
        if item is not None and item.data(Qt.ItemDataRole.UserRole) is not None:
            self.step_selected.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    def add_step(self, title: str, subtitle: str = "", separated: bool = False) -> int:
        if separated:
            spacer = QListWidgetItem("")
            spacer.setFlags(Qt.ItemFlag.NoItemFlags)
            spacer.setSizeHint(QSize(10, 18))
            self.addItem(spacer)
        item = QListWidgetItem()
        item.setData(Qt.ItemDataRole.UserRole, len(self._titles))
        item.setToolTip(subtitle)
        item.setSizeHint(QSize(10, 44))
        self._titles.append(title)
        self._states.append("pending")
        self.addItem(item)
        self._render(len(self._titles) - 1)
        return len(self._titles) - 1

    def _item(self, step: int) -> QListWidgetItem:
        for row in range(self.count()):
            item = self.item(row)
            if item.data(Qt.ItemDataRole.UserRole) == step:
                return item
        raise IndexError(step)

    def _render(self, step: int) -> None:
        mark = MARKS[self._states[step]]
        self._item(step).setText(f"  {mark}   {self._titles[step]}")

    def set_state(self, step: int, state: str) -> None:
        self._states[step] = state
        self._render(step)

    def state(self, step: int) -> str:
        return self._states[step]

    def select_step(self, step: int) -> None:
        self.setCurrentItem(self._item(step))

    def current_step(self) -> int:
        item = self.currentItem()
        return -1 if item is None else int(item.data(Qt.ItemDataRole.UserRole))
