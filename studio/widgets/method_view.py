"""The Monitor's view of a training method's own metrics (StepMetrics.metrics) and of GRPO's
sampled completions (CompletionSamples).

Charts are made for the keys a run reports, so the view does not ask which method runs:
preference runs (DPO, ORPO, SimPO, KTO) report reward margins, accuracy and the chosen and
rejected log-probs; GRPO reports the reward's mean and spread overall and per reward function,
the completion length and the KL. A key no group names gets a chart of its own.

The completions table shows one log step's samples (the latest by default; earlier steps stay
in the step box), one row per completion with its summed reward and each function's score.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from studio.widgets.live_chart import LiveChart

COLORS = ["#2471a3", "#cb4335", "#1e8449", "#7d3c98", "#ca6f1e", "#17a589", "#7f8c8d", "#b7950b"]


def chart_of(key: str) -> tuple[str, str]:
    """(chart title, series name) of a metric key."""
    if key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        return "Rewards (preference)", key.split("/")[1]
    if key == "rewards/accuracies":
        return "Reward accuracy", "accuracy"
    if key.startswith("logps/"):
        return "Log-probs", key.split("/")[1]
    if key == "reward" or (key.startswith("rewards/") and key.endswith("/mean")):
        return "Reward mean", "total" if key == "reward" else key.split("/")[1]
    if key == "reward_std" or (key.startswith("rewards/") and key.endswith("/std")):
        return "Reward spread (std)", "total" if key == "reward_std" else key.split("/")[1]
    if key == "completion_length":
        return "Completion length", "tokens"
    if key == "kl":
        return "KL to the base", "kl"
    return key, key


class MethodView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.hint = QLabel(
            "The training method's own measures appear here: reward margins, accuracy and log-probs for "
            "preference runs (DPO, ORPO, SimPO, KTO); rewards per function, completion lengths, KL and the "
            "sampled completions for GRPO. Supervised runs (SFT) have only the charts above."
        )
        self.hint.setWordWrap(True)
        self.grid = QGridLayout()
        self.grid.setSpacing(6)
        charts = QWidget()
        charts.setLayout(self.grid)
        self.step_box = QComboBox()
        self.step_box.setObjectName("completionStep")
        self.step_box.currentIndexChanged.connect(lambda _=None: self._show_samples())
        self.table = QTableWidget(0, 0)
        self.table.setObjectName("completionsTable")
        self.table.setWordWrap(True)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setDefaultSectionSize(150)
        samples = QWidget()
        s_lay = QVBoxLayout(samples)
        s_lay.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(QLabel("Sampled completions at step"))
        row.addWidget(self.step_box)
        row.addStretch(1)
        s_lay.addLayout(row)
        s_lay.addWidget(self.table, 1)
        self.samples_panel = samples
        samples.hide()
        split = QSplitter()
        split.addWidget(charts)
        split.addWidget(samples)
        split.setStretchFactor(0, 3)  # the charts keep most of the width; the table scrolls
        split.setStretchFactor(1, 2)
        split.setSizes([600, 400])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.hint)
        lay.addWidget(split, 1)
        self.charts: dict[str, LiveChart] = {}
        self.samples: dict[int, list[dict]] = {}  # log step -> its completions
        self.span = None
        # Redrawn from a timer, like the Monitor's charts: one dirty chart per tick.
        self._timer = QTimer(self, interval=100)
        self._timer.timeout.connect(self._refresh_one)
        self._timer.start()

    def clear(self) -> None:
        for chart in self.charts.values():
            self.grid.removeWidget(chart)
            chart.hide()  # gone at once, not when the event loop gets to the deletion
            chart.deleteLater()
        self.charts = {}
        self.samples = {}
        self.step_box.blockSignals(True)
        self.step_box.clear()
        self.step_box.blockSignals(False)
        self.table.setRowCount(0)
        self.table.setColumnCount(0)
        self.samples_panel.hide()
        self.span = None

    def set_x_span(self, steps) -> None:
        self.span = steps
        for chart in self.charts.values():
            chart.set_x_span(steps)

    def add(self, step: int, metrics: dict, held_out: bool = False) -> None:
        """One StepMetrics.metrics: a point per key on its chart. `held_out`: an EvalMetrics'
        metrics (the same measures over the held-out examples), a dashed series beside the
        training one ("held-out margins", "held-out total" reward...)."""
        for key, value in (metrics or {}).items():
            title, name = chart_of(key)
            if held_out:
                name = f"held-out {name}"
            chart = self.charts.get(title) or self._new_chart(title)
            if name not in chart._series:
                chart.add_series(name, COLORS[len(chart._series) % len(COLORS)], dashed=held_out)
            chart.append(name, float(step), float(value))

    def _new_chart(self, title: str) -> LiveChart:
        chart = LiveChart(title)
        chart.setMinimumSize(180, 160)
        if self.span:
            chart.set_x_span(self.span)
        n = len(self.charts)
        self.grid.addWidget(chart, n // 3, n % 3)
        self.charts[title] = chart
        return chart

    def _refresh_one(self) -> None:
        for chart in self.charts.values():
            if chart.dirty:
                chart.refresh()
                return

    def refresh(self) -> None:
        for chart in self.charts.values():
            chart.refresh()

    # -- GRPO's completions -------------------------------------------------------------------
    def add_samples(self, step: int, samples: list[dict]) -> None:
        """A CompletionSamples: shown at once (the latest step), kept in the step box."""
        self.samples[int(step)] = list(samples)
        self.samples_panel.show()
        self.step_box.addItem(str(step), int(step))
        self.step_box.setCurrentIndex(self.step_box.count() - 1)
        self._show_samples()

    def _show_samples(self) -> None:
        step = self.step_box.currentData()
        rows = self.samples.get(step, [])
        names = []
        for r in rows:
            names += [k for k in r if k not in ("prompt", "completion", "reward") and k not in names]
        columns = ["prompt", "completion", "reward", *names]
        self.table.setColumnCount(len(columns))
        self.table.setHorizontalHeaderLabels(columns)
        self.table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            for j, col in enumerate(columns):
                value = r.get(col, "")
                text = f"{value:.3g}" if isinstance(value, float) else str(value)
                self.table.setItem(i, j, QTableWidgetItem(text))

    def cell(self, row: int, column: str) -> str:
        """The table's text at `row` under the header `column` (for tests and screenshots)."""
        for j in range(self.table.columnCount()):
            if self.table.horizontalHeaderItem(j).text() == column:
                item = self.table.item(row, j)
                return item.text() if item else ""
        raise KeyError(column)
