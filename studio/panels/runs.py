"""Runs page: every run in the runs folder, as a table (name, date, model, data, status, steps,
final and best loss, duration, tokens/s), with its charts read back from metrics.jsonl.

Select one run to see its curves; select several to overlay them, with a table of the config
keys whose values differ. A stopped or failed run can be resumed from its last checkpoint (the
window runs it, as `tunesmith train --resume` would); runs can be renamed, deleted (after a
confirmation) and opened in the file manager. The run (and checkpoint) picked here is the one
Chat and Export use. "Continue with" starts a new run of another method (GRPO after an SFT cold
start, DPO, ...) from a run's adapter: the Train page gets the run's model and settings, the
method and `lora.init_adapter`, and the person picks the new method's data.

Everything is read through `engine.api` (summarize_runs, RunFolder.history), on pool threads:
a long run's metrics file is megabytes of JSON. A broken run folder is a row with status
"corrupt" and the reason in its tooltip, never an exception.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from PySide6.QtCore import QItemSelectionModel, Qt, QUrl, Signal
from PySide6.QtGui import QBrush, QColor, QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.api import RunFolder, RunFolderError, config_differences, shown_status, summarize_runs
from studio.panels.common import Banner, caption, fmt_seconds, title
from studio.tasks import run_task
from studio.widgets.history_chart import HistoryChart, color_for
from studio.widgets.method_picker import METHODS
from studio.widgets.metric_overlay import MetricOverlay

# "Best train loss": the lowest training loss logged; the Monitor's "best" is the eval loss's.
COLUMNS = ("Name", "Date", "Model", "Data", "Status", "Steps", "Final loss", "Best train loss", "Duration", "Tokens/s")
NAME, DATE, MODEL, DATA, STATUS, STEPS, FINAL, BEST, DURATION, SPEED = range(len(COLUMNS))
STATUS_COLORS = {
    "running": "#2e6fd1",
    "finished": "#1e8449",
    "stopped": "#b9770e",
    "failed": "#c0392b",
    "corrupt": "#c0392b",
    "incomplete": "#6b7480",
}
# The charts of the selected runs: (curve in RunHistory, chart title, y axis label).
CHARTS = (
    ("loss", "Loss", ""),
    ("lr", "Learning rate", ""),
    ("grad_norm", "Gradient norm", ""),
    ("tokens_per_second", "Tokens / s", ""),
)
SORT_KEY = Qt.ItemDataRole.UserRole + 1  # what a column sorts by (numbers sort as numbers)
# How "Continue with" names a method (training.method's names, studio.widgets.method_picker).
METHOD_LABELS = {"sft": "SFT", "dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "kto": "KTO", "grpo": "GRPO"}


def _histories(paths: list[str]) -> dict[str, object]:
    """Pool-thread body: {path: RunHistory} of the selected runs."""
    return {p: RunFolder(p).history() for p in paths}


class _Item(QTableWidgetItem):
    """A cell that sorts by its SORT_KEY (a number or a string) instead of its text."""

    def __lt__(self, other: QTableWidgetItem) -> bool:
        a, b = self.data(SORT_KEY), other.data(SORT_KEY)
        if a is None or b is None or type(a) is not type(b):
            return super().__lt__(other)
        return a < b


def _cell(text: str, key=None, tip: str = "") -> _Item:
    item = _Item(text)
    item.setData(SORT_KEY, key if key is not None else text.lower())
    item.setFlags(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled)
    if tip:
        item.setToolTip(tip)
    return item


def _loss(v) -> str:
    return "—" if v is None or v != v else f"{v:.4f}"


def _short(source: str) -> str:
    """A model or data source as the table shows it: a file's or folder's name, a Hub id whole."""
    p = Path(source)
    return p.name if (p.is_absolute() or source.startswith((".", "~"))) else source


def _runs_table() -> QTableWidget:
    """One row per run, sortable, several selectable; newest first."""
    table = QTableWidget(0, len(COLUMNS))
    table.setObjectName("runsTable")
    table.setHorizontalHeaderLabels(list(COLUMNS))
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.verticalHeader().setVisible(False)
    table.setSortingEnabled(True)
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    header.setStretchLastSection(True)
    header.setSortIndicator(DATE, Qt.SortOrder.DescendingOrder)  # newest first
    table.setMinimumHeight(140)
    return table


def _method_box() -> QComboBox:
    """The method "Continue with" starts: GRPO first (the SFT -> GRPO recipe), then the others."""
    box = QComboBox()
    box.setObjectName("continueMethod")
    for name in sorted(METHODS, key=lambda m: m != "grpo"):
        box.addItem(METHOD_LABELS.get(name, name), name)
    box.setToolTip("The training method of the new run that starts from this run's adapter")
    return box


def why_not_continued(summary, status: str) -> str:
    """Why a new run cannot start from this run's adapter, in one sentence ("" when it can)."""
    if status == "running":
        return f"{summary.name} is still training: stop it or let it finish first"
    if not summary.config:
        return f"{summary.name} has no readable config.yaml to take the model and settings from"
    if summary.adapter is None and not summary.checkpoints:
        return f"{summary.name} saved no adapter (it ended before its first checkpoint): there is nothing to start from"
    return ""


def _diff_table() -> QTableWidget:
    """The config keys that differ between the selected runs: a row per key, a column per run."""
    diff = QTableWidget(0, 1)
    diff.setObjectName("configDiff")
    diff.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    diff.verticalHeader().setVisible(False)
    diff.horizontalHeader().setStretchLastSection(True)
    diff.setMinimumWidth(260)
    return diff


class RunsPanel(QWidget):
    resume_requested = Signal(str)  # a run folder to resume from its last checkpoint
    continue_requested = Signal(str, str)  # an adapter (a run or checkpoint folder), the new run's method
    source_selected = Signal(str)  # the run or checkpoint folder Chat and Export should use
    runs_changed = Signal()  # a run was renamed or deleted
    refreshed = Signal()  # the table shows the runs folder as it is now
    charts_ready = Signal()  # the charts show the selected runs

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.summaries: list = []  # engine.api.RunSummary, in table order
        self.histories: dict[str, object] = {}  # path -> RunHistory of the runs on the charts
        self.active_run: Optional[str] = None  # the window's run in progress (always "running")
        self._filling = False  # the table is being rebuilt: selection changes are not the user's
        self._chart_request = 0  # the newest charts request; older answers are dropped
        self._last_source: Optional[str] = None
        # Seams for dialogs, replaced by tests so they answer without a modal window.
        self.confirm: Callable[[str, str], bool] = self._ask
        self.ask_name: Callable[[str], Optional[str]] = self._ask_name
        self.open_url: Callable[[QUrl], object] = QDesktopServices.openUrl

        self.banner = Banner()
        self.folder_label = caption("")
        self.refresh_button = QPushButton("Refresh")
        self.resume_button = QPushButton("Resume")
        self.resume_button.setObjectName("primary")
        self.resume_button.setToolTip("Continue a stopped or failed run from its last checkpoint")
        self.continue_button = QPushButton("Continue with")
        self.continue_button.setObjectName("continueButton")
        self.continue_method = _method_box()
        self.rename_button = QPushButton("Rename…")
        self.delete_button = QPushButton("Delete…")
        self.delete_button.setObjectName("danger")
        self.open_button = QPushButton("Open folder")
        self.table = _runs_table()
        self.source = QComboBox()
        self.source.setObjectName("runsSource")
        self.source.setToolTip("The adapter Chat and Export use: the final one, or a checkpoint")
        self.details = caption("Select a run to see its curves; select several to compare them.")
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.charts = {curve: HistoryChart(name, unit) for curve, name, unit in CHARTS}
        # One metric picked from what the selected runs logged (any method: loss, reward margin, KL...).
        self.overlay = MetricOverlay()
        self.diff_title = QLabel("<b>Config differences</b>")
        self.diff = _diff_table()
        self.diff_note = caption("")
        self._lay_out()
        self._connect()
        self._update_buttons()

    def _lay_out(self) -> None:
        """The tools row, the runs table above, the charts beside the source, details and config
        differences below."""
        grid = QGridLayout()
        grid.setSpacing(6)
        for i, chart in enumerate(self.charts.values()):
            grid.addWidget(chart, i // 2, i % 2)
        grid.addWidget(self.overlay, (len(self.charts) + 1) // 2, 0, 1, 2)
        grid_host = QWidget()
        grid_host.setLayout(grid)
        # Five charts stacked three high ask for more height than a 768-px laptop screen gives the
        # page: they scroll inside their pane instead of making the window taller than the screen.
        charts = QScrollArea()
        charts.setWidgetResizable(True)
        charts.setFrameShape(QFrame.Shape.NoFrame)
        charts.setWidget(grid_host)

        side = QWidget()
        side_lay = QVBoxLayout(side)
        side_lay.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(QLabel("Chat and Export use"))
        row.addWidget(self.source, 1)
        side_lay.addLayout(row)
        side_lay.addWidget(self.details)
        side_lay.addWidget(self.diff_title)
        side_lay.addWidget(self.diff_note)
        side_lay.addWidget(self.diff, 1)

        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.addWidget(charts)
        bottom.addWidget(side)
        bottom.setStretchFactor(0, 3)
        bottom.setStretchFactor(1, 2)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(bottom)
        split.setStretchFactor(0, 2)
        split.setStretchFactor(1, 3)
        split.setSizes([240, 460])

        tools = QHBoxLayout()
        tools.addWidget(self.folder_label, 1)
        for button in (self.refresh_button, self.open_button, self.rename_button, self.delete_button):
            tools.addWidget(button)
        tools.addWidget(self.continue_button)
        tools.addWidget(self.continue_method)
        tools.addWidget(self.resume_button)

        lay = QVBoxLayout(self)
        lay.addWidget(title("Runs", "Every run in the runs folder. Select several to overlay their curves."))
        lay.addWidget(self.banner)
        lay.addLayout(tools)
        lay.addWidget(split, 1)

    def _connect(self) -> None:
        """Every signal the page listens to, in one place."""
        self.refresh_button.clicked.connect(self.refresh)
        self.resume_button.clicked.connect(self.resume_selected)
        self.continue_button.clicked.connect(lambda: self.continue_selected())
        self.continue_method.currentIndexChanged.connect(lambda _i: self._update_buttons())
        self.rename_button.clicked.connect(lambda: self.rename_selected())
        self.delete_button.clicked.connect(self.delete_selected)
        self.open_button.clicked.connect(self.open_folder)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.source.currentIndexChanged.connect(self._source_changed)

    # -- the list ---------------------------------------------------------------------------
    def runs_dir(self) -> str:
        return str(self.state.get("output.dir"))

    def refresh(self) -> None:
        """Read the runs folder again (off the GUI thread); `refreshed` when the table shows it."""
        folder = self.runs_dir()
        self.folder_label.setText(folder)
        run_task(
            summarize_runs,
            folder,
            owner=self,
            lane="runs",
            key="runs.list",
            on_done=self._listed,
            on_error=lambda m, _d: self.banner.show_message(f"Cannot read the runs folder {folder}: {m}", "error"),
        )

    def is_ours(self, summary) -> bool:
        """The run this window is training now."""
        return bool(self.active_run) and Path(self.active_run) == summary.path

    def status_of(self, summary) -> str:
        """The status shown (the engine's rule): the window's own run in progress is "running"
        whatever its files say (a resumed run's metrics end with the earlier stop until its new
        RunStarted lands)."""
        return shown_status(summary.status, ours=self.is_ours(summary))

    def _listed(self, summaries: list) -> None:
        keep = {str(s.path) for s in self.selected()}
        current = self.current()
        self._filling = True
        try:
            self.table.setSortingEnabled(False)
            self.table.setRowCount(0)
            self.summaries = list(summaries)
            for row, s in enumerate(self.summaries):
                self.table.insertRow(row)
                self._fill_row(row, s)
            self.table.setSortingEnabled(True)
            self.table.resizeColumnsToContents()
            self.table.setColumnWidth(NAME, max(140, min(self.table.columnWidth(NAME), 260)))
            for row in range(self.table.rowCount()):
                if self._path_at(row) in keep:
                    self._add_row_to_selection(row)
            if current is not None:
                self._set_current_row(self._row_of(str(current.path)))
        finally:
            self._filling = False
        if not self.summaries:
            self.details.setText(f"No runs in {self.runs_dir()} yet: train one on the Train page.")
        self._selection_changed(user=False)
        self.refreshed.emit()

    def _fill_row(self, row: int, s) -> None:
        status = self.status_of(s)
        date = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.started)) if s.started else "—"
        steps = f"{s.steps} / {s.total_steps}" if s.total_steps else (str(s.steps) if s.steps else "—")
        speed = f"{s.tokens_per_second:,.0f}" if s.tokens_per_second else "—"
        cells = {
            NAME: _cell(s.name, tip=str(s.path)),
            DATE: _cell(date, key=float(s.started or 0.0)),
            MODEL: _cell(_short(s.model) or "—", tip=s.model),
            DATA: _cell(_short(s.data) or "—", tip=s.data),
            STATUS: _cell(status, tip=s.problem or _status_help(status)),
            STEPS: _cell(steps, key=float(s.steps)),
            FINAL: _cell(_loss(s.final_loss), key=float(s.final_loss if s.final_loss is not None else 1e30)),
            BEST: _cell(
                _loss(s.best_loss),
                key=float(s.best_loss if s.best_loss is not None else 1e30),
                tip=f"at step {s.best_step}" if s.best_step is not None else "",
            ),
            DURATION: _cell(fmt_seconds(s.seconds) if s.seconds else "—", key=float(s.seconds)),
            SPEED: _cell(speed, key=float(s.tokens_per_second or 0.0)),
        }
        cells[NAME].setData(Qt.ItemDataRole.UserRole, str(s.path))
        cells[STATUS].setForeground(QBrush(QColor(STATUS_COLORS.get(status, "#23272f"))))
        for col, item in cells.items():
            self.table.setItem(row, col, item)

    def _add_row_to_selection(self, row: int) -> None:
        index = self.table.model().index(row, 0)
        flags = QItemSelectionModel.SelectionFlag.Select | QItemSelectionModel.SelectionFlag.Rows
        self.table.selectionModel().select(index, flags)

    def _set_current_row(self, row: int) -> None:
        """Make `row` the current one (what the buttons act on) without changing the selection."""
        if row >= 0:
            flag = QItemSelectionModel.SelectionFlag.NoUpdate
            self.table.selectionModel().setCurrentIndex(self.table.model().index(row, NAME), flag)

    def _path_at(self, row: int) -> str:
        item = self.table.item(row, NAME)
        return item.data(Qt.ItemDataRole.UserRole) if item is not None else ""

    def _row_of(self, path: str) -> int:
        return next((r for r in range(self.table.rowCount()) if self._path_at(r) == str(path)), -1)

    def summary(self, name_or_path: str):
        """The RunSummary of a run shown, by folder name or path (None when not listed)."""
        return next((s for s in self.summaries if s.name == name_or_path or str(s.path) == str(name_or_path)), None)

    def row_text(self, name: str) -> dict[str, str]:
        """What the table shows for a run, {column title: text} (tests and screenshots read it)."""
        row = self._row_of(str(self.summary(name).path)) if self.summary(name) else -1
        if row < 0:
            return {}
        return {COLUMNS[c]: self.table.item(row, c).text() for c in range(len(COLUMNS))}

    # -- selection ----------------------------------------------------------------------------
    def select_runs(self, names: list[str]) -> None:
        """Select these runs (names or paths), the first being the current one."""
        rows = [self._row_of(str(self.summary(n).path)) for n in names if self.summary(n) is not None]
        self._filling = True  # one update at the end, not one per row
        try:
            self.table.clearSelection()
            for row in rows:
                self._add_row_to_selection(row)
            self._set_current_row(rows[0] if rows else -1)
        finally:
            self._filling = False
        self._selection_changed()

    def selected(self) -> list:
        """The selected runs, in table order."""
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        out = [self.summary(self._path_at(r)) for r in rows]
        return [s for s in out if s is not None]

    def current(self):
        """The run the buttons act on: the current row if it is selected, else the first selected."""
        chosen = self.selected()
        row = self.table.currentRow()
        if row >= 0 and self.table.selectionModel().isRowSelected(row, self.table.rootIndex()):
            s = self.summary(self._path_at(row))
            if s is not None:
                return s
        return chosen[0] if chosen else None

    def _selection_changed(self, user: bool = True) -> None:
        if self._filling:
            return
        chosen = self.selected()
        run = self.current()
        self._update_buttons()
        self._fill_sources(run)
        self._show_diff(chosen)
        if run is None:
            self.details.setText("Select a run to see its curves; select several to compare them.")
        else:
            self.details.setText(self._describe(run))
        self._load_charts(chosen)
        if user:
            self._source_changed()

    def _describe(self, s) -> str:
        status = self.status_of(s)
        lines = [f"{s.name}: {status}" + (f" — {s.problem}" if s.problem else "")]
        if s.checkpoints:
            lines.append(f"Checkpoints at steps {', '.join(str(step) for step, _p in s.checkpoints)}.")
        elif status != "running":
            lines.append("No checkpoint: nothing to resume, chat with or export.")
        if s.adapter is not None:
            lines.append("Final adapter saved.")
        return "\n".join(lines)

    def _update_buttons(self) -> None:
        run = self.current()
        running = run is not None and self.status_of(run) == "running"
        why = run.why_not_resumable(ours=self.is_ours(run)) if run is not None else ""
        self.resume_button.setEnabled(run is not None and not why)
        self.rename_button.setEnabled(run is not None and not running)
        self.delete_button.setEnabled(
            bool(self.selected()) and not any(self.status_of(s) == "running" for s in self.selected())
        )
        self.open_button.setEnabled(run is not None)
        if why:
            self.resume_button.setToolTip(f"Cannot resume: {why}")
        else:
            self.resume_button.setToolTip("Continue the run from its last checkpoint, exactly where it stopped")
        label = self.continue_method.currentText()
        stop = why_not_continued(run, self.status_of(run)) if run is not None else "select a run"
        self.continue_button.setEnabled(not stop)
        self.continue_button.setToolTip(
            f"Cannot continue with {label}: {stop}"
            if stop
            else f"A new {label} run that starts from this run's adapter (the one Chat and Export use), "
            "with its model and settings: set up on the Train page, where you pick its data"
        )

    # -- what Chat and Export use -----------------------------------------------------------
    def _fill_sources(self, run) -> None:
        previous = self.source.currentData()
        self.source.blockSignals(True)
        self.source.clear()
        for label, path in run.sources() if run is not None else []:
            self.source.addItem(label, str(path))
        i = self.source.findData(previous) if previous else -1
        self.source.setCurrentIndex(i if i >= 0 else 0)
        self.source.setEnabled(self.source.count() > 0)
        self.source.blockSignals(False)

    def selected_source(self) -> Optional[str]:
        return self.source.currentData()

    def select_source(self, path: str) -> bool:
        i = self.source.findData(str(path))
        if i >= 0:
            self.source.setCurrentIndex(i)
        return i >= 0

    def _source_changed(self, _index: int = -1) -> None:
        if self._filling:
            return
        src = self.source.currentData()
        if src and src != self._last_source:
            self._last_source = src
            self.source_selected.emit(src)

    # -- charts and differences ----------------------------------------------------------------
    def _load_charts(self, chosen: list) -> None:
        self._chart_request += 1
        request = self._chart_request
        paths = [str(s.path) for s in chosen]
        if not paths:
            self.histories = {}
            self._draw([])
            self.charts_ready.emit()
            return

        def done(histories: dict) -> None:
            if request != self._chart_request:
                return  # the selection moved on while this was read
            self.histories = histories
            self._draw(chosen)
            self.charts_ready.emit()

        run_task(
            _histories,
            paths,
            owner=self,
            lane="runs",
            key="runs.charts",
            on_done=done,
            on_error=lambda m, _d: self.banner.show_message(f"Cannot read the runs' metrics: {m}", "error"),
        )

    def _draw(self, chosen: list) -> None:
        for curve, chart in self.charts.items():
            lines = []
            for i, s in enumerate(chosen):
                hist = self.histories.get(str(s.path))
                if hist is None:
                    continue
                steps, values = hist.curve(curve)
                lines.append((s.name, steps, values, color_for(i)))
                if curve == "loss" and any(v == v for v in hist.curves.get("eval_loss", [])):
                    # The held-out eval loss, dashed in the run's colour (NaN between evals).
                    lines.append((f"{s.name} eval", *hist.curve("eval_loss"), color_for(i), True))
            chart.show_curves(lines)
        picked = [(s.name, self.histories.get(str(s.path)), color_for(i)) for i, s in enumerate(chosen)]
        self.overlay.show_runs([r for r in picked if r[1] is not None])

    def _show_diff(self, chosen: list) -> None:
        """The config keys whose values differ between the selected runs, one column per run."""
        self.diff.clear()
        if len(chosen) < 2:
            self.diff.setRowCount(0)
            self.diff.setColumnCount(1)
            self.diff.setHorizontalHeaderLabels(["Setting"])
            self.diff_note.setText("Select two or more runs to compare their configs.")
            return
        unreadable = [s.name for s in chosen if not s.config]
        rows = config_differences([s.config for s in chosen])
        self.diff.setColumnCount(1 + len(chosen))
        self.diff.setHorizontalHeaderLabels(["Setting"] + [s.name for s in chosen])
        self.diff.setRowCount(len(rows))
        for r, (key, values) in enumerate(rows):
            self.diff.setItem(r, 0, QTableWidgetItem(key))
            for c, value in enumerate(values, start=1):
                item = QTableWidgetItem("—" if value is None else str(value))
                item.setForeground(QBrush(QColor(color_for(c - 1))))
                self.diff.setItem(r, c, item)
        self.diff.resizeColumnsToContents()
        if not rows:
            note = "Same config in every setting."
        else:
            note = "1 setting differs." if len(rows) == 1 else f"{len(rows)} settings differ."
        if unreadable:
            note += f" No readable config.yaml in {', '.join(unreadable)}."
        self.diff_note.setText(note)

    def differences(self) -> dict[str, dict[str, str]]:
        """The differences table as {setting: {run name: text}} (tests read it)."""
        runs = [self.diff.horizontalHeaderItem(c).text() for c in range(1, self.diff.columnCount())]
        out = {}
        for r in range(self.diff.rowCount()):
            texts = [self.diff.item(r, c).text() for c in range(1, self.diff.columnCount())]
            out[self.diff.item(r, 0).text()] = dict(zip(runs, texts))
        return out

    # -- actions ------------------------------------------------------------------------------
    def resume_selected(self) -> bool:
        run = self.current()
        if run is None:
            self.banner.show_message("Select a stopped or failed run to resume.", "warning")
            return False
        why = run.why_not_resumable(ours=self.is_ours(run))
        if why:
            self.banner.show_message(f"Cannot resume: {why}", "warning")
            return False
        self.banner.clear()
        self.resume_requested.emit(str(run.path))
        return True

    def continue_selected(self, method: Optional[str] = None) -> bool:
        """Ask for a new run of `method` (default: the one picked beside the button) that starts
        from the selected run's adapter: the source picked for Chat and Export (the final adapter,
        the best or another checkpoint)."""
        run = self.current()
        if method is not None:
            i = self.continue_method.findData(method)
            if i < 0:
                self.banner.show_message(f"Unknown training method {method!r}.", "error")
                return False
            self.continue_method.setCurrentIndex(i)
        label = self.continue_method.currentText()
        stop = why_not_continued(run, self.status_of(run)) if run is not None else "select a finished run first"
        if stop:
            self.banner.show_message(f"Cannot continue with {label}: {stop}.", "warning")
            return False
        self.banner.clear()
        self.continue_requested.emit(self.selected_source() or str(run.path), self.continue_method.currentData())
        return True

    def rename_selected(self, new_name: Optional[str] = None) -> bool:
        run = self.current()
        if run is None or self.status_of(run) == "running":
            self.banner.show_message("Select a run that is not running to rename it.", "warning")
            return False
        if new_name is None:
            new_name = self.ask_name(run.name)
            if new_name is None:
                return False  # cancelled
        try:
            moved = RunFolder(run.path).rename(new_name)
        except (RunFolderError, OSError) as exc:
            self.banner.show_message(f"Cannot rename {run.name}: {exc}", "error")
            return False
        self.banner.show_message(f"Renamed {run.name} to {moved.path.name}.", "success")
        self._after_change(select=str(moved.path))
        return True

    def delete_selected(self) -> bool:
        chosen = [s for s in self.selected() if self.status_of(s) != "running"]
        if not chosen:
            self.banner.show_message("Select runs that are not running to delete them.", "warning")
            return False
        names = ", ".join(s.name for s in chosen)
        what = "this run" if len(chosen) == 1 else f"these {len(chosen)} runs"
        if not self.confirm(
            "Delete runs?", f"Delete {what} and all their checkpoints? {names}\n\nThis cannot be undone."
        ):
            return False
        failed = []
        for s in chosen:
            try:
                RunFolder(s.path).delete()
            except (RunFolderError, OSError) as exc:
                failed.append(f"{s.name}: {exc}")
        if failed:
            self.banner.show_message("Not deleted: " + "; ".join(failed), "error")
        else:
            self.banner.show_message(f"Deleted {names}.", "success")
        self._after_change()
        return not failed

    def _after_change(self, select: Optional[str] = None) -> None:
        self._last_source = None
        if select:
            # Select the renamed run once the new list is in.
            def reselect() -> None:
                self.refreshed.disconnect(reselect)
                self.select_runs([select])

            self.refreshed.connect(reselect)
        self.refresh()
        self.runs_changed.emit()

    def open_folder(self) -> Optional[str]:
        run = self.current()
        if run is None:
            return None
        self.open_url(QUrl.fromLocalFile(str(run.path)))
        return str(run.path)

    # -- dialogs ------------------------------------------------------------------------------
    def _ask(self, title_text: str, text: str) -> bool:
        answer = QMessageBox.question(
            self,
            title_text,
            text,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        return answer == QMessageBox.StandardButton.Yes

    def _ask_name(self, current: str) -> Optional[str]:
        name, ok = QInputDialog.getText(
            self, "Rename run", "New name for the run folder:", QLineEdit.EchoMode.Normal, current
        )
        return name if ok else None


def _status_help(status: str) -> str:
    return {
        "running": "Training now (a live process on this machine holds its running.lock).",
        "finished": "Trained to the end; the final adapter is saved.",
        "stopped": "Stopped before the end; Resume continues from its last checkpoint.",
        "failed": "The run failed; its log.txt says why. Resume retries from its last checkpoint.",
        "incomplete": "Its process ended without finishing (killed or crashed); Resume continues it.",
    }.get(status, "")
