"""Editor for the detected data format and its column mapping (data.format, data.columns).

Each format has a few canonical fields (instruction/input/output/system, messages, text);
the person maps each to one of the file's columns, or leaves it to detection. When detection
finds no shape, the prompt/answer fields open under Format auto, usable right away.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QFormLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

FIELDS = {
    "auto": [],
    "instruction": ["instruction", "input", "output", "system"],
    "conversations": ["messages"],
    "text": ["text"],
}
REQUIRED = {"instruction", "output", "messages", "text"}
# What each field holds, in the window's words.
LABELS = {"instruction": "prompt", "input": "extra input", "output": "answer", "system": "system prompt"}
NONE = "(none)"


class ColumnMappingEditor(QWidget):
    applied = Signal(str, dict)  # format, columns

    def __init__(self, parent=None):
        super().__init__(parent)
        self.format = QComboBox()
        self.format.addItems(list(FIELDS))
        self.format.setToolTip("auto: detect from the column names")
        self.format.currentTextChanged.connect(self._rebuild)
        self.detected = QLabel("—")
        self.detected.setObjectName("caption")
        self.detected.setWordWrap(True)  # "detected: none; pick …" must not set the page's width
        self.form = QFormLayout()
        self.apply = QPushButton("Apply mapping")
        self.apply.clicked.connect(self._apply)
        top = QHBoxLayout()
        top.addWidget(QLabel("Format"))
        top.addWidget(self.format)
        top.addWidget(self.detected, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addLayout(self.form)
        lay.addWidget(self.apply)
        self.columns: list[str] = []
        self.boxes: dict[str, QComboBox] = {}
        self.unmatched = False  # detection found no shape: auto shows the prompt/answer fields

    def fields(self, kind: str) -> list[str]:
        if kind == "auto" and self.unmatched:
            return FIELDS["instruction"]
        return FIELDS.get(kind, [])

    def set_detected(
        self, columns: list[str], kind: str, mapping: dict[str, str], chosen_format: str = "auto", unmatched=False
    ) -> None:
        """Show what was detected; `unmatched` (no shape found) opens the prompt/answer fields."""
        self.columns = list(columns)
        self.unmatched = bool(unmatched)
        self.detected.setText(
            "detected: none; pick the prompt and answer columns" if self.unmatched else f"detected: {kind or 'unknown'}"
        )
        self.format.blockSignals(True)
        self.format.setCurrentText(kind if kind in FIELDS else chosen_format)
        self.format.blockSignals(False)
        self._rebuild(self.format.currentText(), mapping)

    def _rebuild(self, kind: str, mapping: dict[str, str] | None = None) -> None:
        if mapping is None:
            mapping = {k: b.currentText() for k, b in self.boxes.items() if b.currentText() != NONE}
        while self.form.rowCount():
            self.form.removeRow(0)
        self.boxes = {}
        for name in self.fields(kind):
            box = QComboBox()
            # Sized to a short name, not the longest column: a 60-character column name made the
            # page ask for 1,250 px and widened the window past the screen (the list still shows it).
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(12)
            box.addItem(NONE)
            box.addItems(self.columns)
            for i, col in enumerate(self.columns, start=1):
                box.setItemData(i, col, Qt.ItemDataRole.ToolTipRole)
            box.setCurrentText(mapping.get(name, NONE) if mapping.get(name) in self.columns else NONE)
            box.setObjectName(f"map:{name}")
            label = (f"{LABELS[name]} ({name})" if name in LABELS else name) + (" *" if name in REQUIRED else "")
            self.form.addRow(label, box)
            self.boxes[name] = box

    def mapping(self) -> dict[str, str]:
        return {k: b.currentText() for k, b in self.boxes.items() if b.currentText() != NONE}

    def set_mapping(self, kind: str, mapping: dict[str, str]) -> None:
        self.format.setCurrentText(kind)
        for k, col in mapping.items():
            if k in self.boxes:
                self.boxes[k].setCurrentText(col)

    def _apply(self) -> None:
        self.applied.emit(self.format.currentText(), self.mapping())
