"""An inline message strip (info / success / warning / error) that a panel shows above its
content, so engine errors read as sentences in the window rather than console tracebacks."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QWidget


class Banner(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("banner")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.clicked.connect(self.hide)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 6, 6, 6)
        lay.addWidget(self.label, 1)
        lay.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.level = ""
        self.hide()

    def show_message(self, text: str, level: str = "info") -> None:
        self.level = level
        self.setProperty("level", level)
        # Re-polish so the stylesheet picks up the new level property.
        self.style().unpolish(self)
        self.style().polish(self)
        self.label.setText(text)
        self.show()

    def text(self) -> str:
        # isHidden, not isVisible: a banner on a page that is not shown still holds its message.
        return "" if self.isHidden() else self.label.text()

    def clear(self) -> None:
        self.level = ""
        self.label.clear()
        self.hide()
