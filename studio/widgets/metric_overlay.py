"""The Runs page's overlay of one metric, picked from what the selected runs logged: the loss, the
eval loss, and each method's own (reward margin and accuracy for preference runs, mean reward,
spread, completion length and KL for GRPO...). Runs of different methods share a chart when they
logged the same metric; the caption names the runs that did not log it.

Takes (run name, RunHistory, colour) triples, so it reads nothing itself.
"""

from __future__ import annotations

import math

from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from studio.widgets.history_chart import HistoryChart

# Words for the metrics a run logs (engine.events StepMetrics, its `metrics`: TRL's names).
LABELS = {
    "loss": "Loss",
    "eval_loss": "Eval loss",
    "rewards/margins": "Reward margin (chosen − rejected)",
    "rewards/accuracies": "Reward accuracy",
    "rewards/chosen": "Reward of the chosen answer",
    "rewards/rejected": "Reward of the rejected answer",
    "logps/chosen": "Log-prob of the chosen answer",
    "logps/rejected": "Log-prob of the rejected answer",
    "reward": "Mean reward",
    "reward_std": "Reward spread (std)",
    "completion_length": "Completion length",
    "kl": "KL to the base",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm",
    "tokens_per_second": "Tokens / s",
}
# Timing and memory are the Runs page's other charts; the overlay compares what was learned.
SKIP = ("step_seconds", "mem_peak", "lr", "grad_norm", "tokens_per_second")


def label_of(name: str) -> str:
    if name in LABELS:
        return LABELS[name]
    if name.startswith("rewards/") and name.endswith(("/mean", "/std")):
        fn, what = name[len("rewards/") :].rsplit("/", 1)
        return f"Reward '{fn}' ({'mean' if what == 'mean' else 'spread'})"
    return name


def _logged(values) -> bool:
    return any(isinstance(v, float) and math.isfinite(v) for v in values)


class MetricOverlay(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("metricOverlay")
        self.box = QComboBox()
        self.box.setObjectName("overlayMetric")
        self.box.setToolTip("The metric to compare: whatever the selected runs logged")
        self.box.currentIndexChanged.connect(self._index_changed)
        self.chart = HistoryChart("Compare")
        self.note = QLabel("")
        self.note.setObjectName("caption")
        self.note.setWordWrap(True)
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(QLabel("Compare"))
        top.addWidget(self.box, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.chart, 1)
        lay.addWidget(self.note)
        self.runs: list[tuple] = []

    def logged(self) -> list[str]:
        """Every metric any selected run logged, the loss first, in the order runs logged them."""
        seen = {}
        for _name, hist, _color in self.runs:
            for key, values in hist.curves.items():
                if key not in SKIP and _logged(values):
                    seen.setdefault(key, None)
        order = [k for k in ("loss", "eval_loss") if k in seen]
        return order + [k for k in seen if k not in order]

    def show_runs(self, runs: list[tuple]) -> None:
        """`runs`: (run name, RunHistory, colour) of the selected runs; keeps the picked metric
        when the new selection logged it."""
        self.runs = list(runs)
        current = self.picked()
        self.box.blockSignals(True)
        self.box.clear()
        for key in self.logged():
            self.box.addItem(label_of(key), key)
        self.box.setCurrentIndex(max(0, self.box.findData(current)))
        self.box.blockSignals(False)
        self._draw()

    def picked(self) -> str:
        """The metric shown (its key in RunHistory.curves; "" when none). Not `metric`: QPaintDevice
        has a virtual of that name, which Qt calls while laying out."""
        return self.box.currentData() or ""

    def set_metric(self, key: str) -> bool:
        i = self.box.findData(key)
        if i >= 0:
            self.box.setCurrentIndex(i)
        return i >= 0

    def _index_changed(self, _index: int) -> None:
        self._draw()

    def _draw(self) -> None:
        key = self.picked()
        lines, missing = [], []
        for name, hist, color in self.runs:
            steps, values = hist.curve(key)
            if key and _logged(values):
                lines.append((name, steps, values, color))
            else:
                missing.append(name)
        self.chart.setTitle(label_of(key) if key else "Compare", size="10pt")
        self.chart.show_curves(lines)
        if not self.runs:
            self.note.setText("")
        elif missing:
            self.note.setText(f"Not logged by {', '.join(missing)}.")
        else:
            self.note.setText(f"Logged by all {len(self.runs)} runs." if len(self.runs) > 1 else "")
