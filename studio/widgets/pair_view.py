"""A preference row side by side, as training packs it: the prompt above, then the chosen and the
rejected answers next to each other (a KTO row: its one answer and whether it is desirable).

Each part is a TokenMaskView of the engine's own rendering (engine.api's `render_example` gives
a preference row's `sides`): the answer tokens are the ones the preference loss scores, the
prompt's are masked. Plain (text, trained) pieces in, so it depends on no tokenizer.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QSplitter, QVBoxLayout, QWidget

from studio.widgets.token_mask_view import TokenMaskView

TITLES = {
    "prompt": "Prompt (masked: the model reads it)",
    "chosen": "Chosen answer (preferred)",
    "rejected": "Rejected answer",
}


def _titled(name: str, view: TokenMaskView) -> tuple[QWidget, QLabel]:
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 0)
    head = QLabel(f"<b>{TITLES.get(name, name)}</b>")
    head.setObjectName(f"pairTitle:{name}")
    lay.addWidget(head)
    lay.addWidget(view, 1)
    return box, head


class PairView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("pairView")
        self.views = {name: TokenMaskView() for name in ("prompt", "chosen", "rejected")}
        for view in self.views.values():
            # Each view's legend does not wrap: two side by side would ask for 930 px and widen
            # the window past a laptop screen (issue 28). They narrow; the legend is cut instead.
            view.setMinimumWidth(160)
        self.titles = {}
        boxes = {}
        for name, view in self.views.items():
            boxes[name], self.titles[name] = _titled(name, view)
        answers = QSplitter(Qt.Orientation.Horizontal)
        answers.addWidget(boxes["chosen"])
        answers.addWidget(boxes["rejected"])
        self.rejected_box = boxes["rejected"]
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(boxes["prompt"])
        split.addWidget(answers)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 2)
        self.note = QLabel("")
        self.note.setObjectName("caption")
        self.note.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(split, 1)
        lay.addWidget(self.note)
        self.kind = ""

    def set_sides(self, sides: dict, label=None, note: str = "") -> None:
        """`sides`: {"prompt", "chosen", "rejected"} (a pair) or {"prompt", "completion"} (KTO,
        with `label` True for a desirable answer), each a list of (token text, trained)."""
        paired = "rejected" in sides
        self.kind = "paired" if paired else "unpaired"
        self.views["prompt"].set_pieces(sides.get("prompt", []))
        first = sides.get("chosen" if paired else "completion", [])
        self.views["chosen"].set_pieces(first)
        if paired:
            self.titles["chosen"].setText(f"<b>{TITLES['chosen']}</b>")
            self.views["rejected"].set_pieces(sides.get("rejected", []))
        else:
            verdict = "desirable" if label else "undesirable"
            self.titles["chosen"].setText(f"<b>Completion</b> — labelled <b>{verdict}</b> ({label!s})")
            self.views["rejected"].set_message("")
        self.rejected_box.setVisible(paired)
        self.note.setText(note)

    def label_text(self, name: str) -> str:
        """The title above a part, as plain text (tests read it)."""
        return self.titles[name].text().replace("<b>", "").replace("</b>", "")
