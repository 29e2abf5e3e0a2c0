"""The prompt gallery: the same prompts answered by the model at each checkpoint, one row per
prompt and one column per checkpoint, so the person sees the answers change as the run trains.

Fed by GalleryAnswers events during a run, or by a run folder's gallery.jsonl records
(`engine.api.RunFolder.gallery()`) for a past one.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget


class GalleryView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.hint = QLabel(
            "At every checkpoint the model answers the gallery's prompts (typed on the Train page, or taken "
            "from the held-out examples). The answers appear here, one column per checkpoint."
        )
        self.hint.setWordWrap(True)
        self.table = QTableWidget(0, 0)
        self.table.setObjectName("galleryTable")
        self.table.setWordWrap(True)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setDefaultSectionSize(260)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.hint)
        lay.addWidget(self.table, 1)
        self.prompts: list[str] = []
        self.steps: list[int] = []
        self._answers: dict[tuple[int, str], str] = {}

    def clear(self) -> None:
        self.prompts, self.steps, self._answers = [], [], {}
        self.table.setRowCount(0)
        self.table.setColumnCount(0)

    def add(self, step: int, prompts: list[str], answers: list[str]) -> None:
        """The answers of one checkpoint (a step answered again, after a rollback or a resume,
        replaces its column)."""
        for p, a in zip(prompts, answers):
            if p not in self.prompts:
                self.prompts.append(p)
            self._answers[(int(step), p)] = a
        if int(step) not in self.steps:
            self.steps.append(int(step))
            self.steps.sort()
        self._render()

    def load(self, records: list[dict]) -> None:
        """gallery.jsonl's records ({step, prompt, answer}) of a run."""
        self.clear()
        by_step: dict[int, tuple[list[str], list[str]]] = {}
        for r in records:
            ps, ans = by_step.setdefault(int(r["step"]), ([], []))
            ps.append(str(r.get("prompt", "")))
            ans.append(str(r.get("answer", "")))
        for step in sorted(by_step):
            self.add(step, *by_step[step])

    def answer(self, step: int, prompt: str) -> str | None:
        return self._answers.get((int(step), prompt))

    def _render(self) -> None:
        t = self.table
        t.setRowCount(len(self.prompts))
        t.setColumnCount(len(self.steps))
        t.setHorizontalHeaderLabels([f"step {s}" for s in self.steps])
        t.setVerticalHeaderLabels([_short(p) for p in self.prompts])
        for r, p in enumerate(self.prompts):
            t.verticalHeaderItem(r).setToolTip(p)
            for c, s in enumerate(self.steps):
                text = self._answers.get((s, p), "")
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                item.setTextAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
                t.setItem(r, c, item)
        self.hint.setVisible(not self.steps)
        if self.steps:  # the newest checkpoint in view
            t.scrollToItem(t.item(0, len(self.steps) - 1))


def _short(text: str, n: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= n else line[: n - 1] + "…"
