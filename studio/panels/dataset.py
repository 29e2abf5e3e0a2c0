"""Data page: load the demo set, a file (JSON, JSONL, CSV, Parquet) or a Hub data set; browse
its raw rows; check the detected format and column mapping; see one example through the chat
template with its trained and masked tokens; see how the examples pack into rows; and list
the rows that cannot be used, with the reason.

Loading the rows, the tokenizer, rendering and packing all run on pool threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QButtonGroup,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QSplitter,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.api import DATA_FILE_SUFFIXES, DATA_FILE_WORDS, DATA_FINDINGS, METHOD_DATA, PACKING_SAMPLE, shown_row
from studio import data_bridge
from studio.field_help import HELP
from studio.panels.common import Banner, caption, card, title
from studio.tasks import cancel, run_task
from studio.widgets.column_mapping import ColumnMappingEditor
from studio.widgets.data_xray import DataXRay
from studio.widgets.packing_view import PackingView
from studio.widgets.pair_view import PairView
from studio.widgets.rows_model import RowsModel, RowSpinBox, RowsTable
from studio.widgets.token_mask_view import TokenMaskView

FILE_FILTER = f"Data sets ({' '.join('*' + suffix for suffix in DATA_FILE_SUFFIXES)});;All files (*)"
MAX_PROBLEMS_SHOWN = 2000
EXAMPLE_TAB, XRAY_TAB = 1, 4  # indices in the page's tabs: Rows, Example, Packing, Problems, X-ray
# data.thinking's choices: the combo's words and the config's values.
THINKING_CHOICES = (("auto: on when answers carry reasoning", "auto"), ("on", True), ("off", False))


def _get(obj, *names, default=None):
    for n in names:
        if isinstance(obj, dict) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


def _same(a, b) -> bool:
    """Two data.thinking values alike ("auto", True, False: True is not 1 here)."""
    return type(a) is type(b) and a == b


def _sentence(text: str) -> str:
    """The first line of a message: one sentence for a label or a tooltip."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= 300 else line[:297] + "…"


def _columns_text(columns: dict) -> str:
    """A prompt row's other columns, short: answer = 12 · source = gsm8k."""
    return " · ".join(f"{k} = {str(v)[:60]}" for k, v in columns.items())


class DataPanel(QWidget):
    preview_ready = Signal(object)
    example_ready = Signal(object)
    packing_ready = Signal(object)
    xray_ready = Signal(object)
    failed = Signal(str)
    status_changed = Signal()  # loading started, or the data turned out usable or not

    def __init__(self, state, settings, parent=None):
        super().__init__(parent)
        self.state, self.settings = state, settings
        self.preview = None
        self.example = None
        self.layout_info = None
        self.tokenizer = None
        self._tokenizer_for = None
        self._gen = 0
        # What the Train button needs to know: loading, or the reason the data cannot be used.
        self.loading = False
        self._problem = ""  # from the rows (unreadable file, unknown columns, no usable row)
        self._packing_problem = ""  # from tokenizing them (nothing left to train on)
        self.usable_examples: Optional[int] = None
        self.checked_source: Optional[str] = None

        self.banner = Banner()
        self.demo = QRadioButton("Demo data set")
        self.file = QRadioButton("File")
        self.hub = QRadioButton("Hub data set")
        group = QButtonGroup(self)
        for b in (self.demo, self.file, self.hub):
            group.addButton(b)
        self.path = QLineEdit()
        self.path.setPlaceholderText(f"{DATA_FILE_WORDS} file, or a data set folder")
        self.path.textEdited.connect(lambda: self.file.setChecked(True))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("owner/name")
        self.hub_id.textEdited.connect(lambda: self.hub.setChecked(True))
        # A Hub data set's (or a data set folder's) subset and split; a single file has neither.
        self.subset = QLineEdit()
        self.subset.setObjectName("dataSubset")
        self.subset.setFixedWidth(90)
        self.subset.setPlaceholderText("subset")
        self.subset.setToolTip(HELP["data.subset"])
        self.split = QLineEdit("train")
        self.split.setFixedWidth(80)
        self.split.setToolTip(HELP["data.split"])
        self.recent = QComboBox()
        self.recent.setPlaceholderText("Recent data sets")
        self.recent.textActivated.connect(self.load_source)
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self._load_clicked)

        src, src_lay = card()
        row = QHBoxLayout()
        row.addWidget(self.demo)
        row.addSpacing(12)
        row.addWidget(self.file)
        row.addWidget(self.path, 2)
        row.addWidget(browse)
        row.addSpacing(12)
        row.addWidget(self.hub)
        row.addWidget(self.hub_id, 1)
        row.addWidget(self.subset)
        row.addWidget(self.split)
        src_lay.addLayout(row)
        row = QHBoxLayout()
        self.summary = caption("No data loaded yet.")
        row.addWidget(self.summary, 1)
        row.addWidget(self.recent)
        row.addWidget(self.load_button)
        src_lay.addLayout(row)
        # GRPO's prompts: the columns beside the prompt, and which rewards read them.
        self.reward_columns = caption("")
        self.reward_columns.setObjectName("rewardColumns")
        self.reward_columns.setWordWrap(True)
        self.reward_columns.hide()
        src_lay.addWidget(self.reward_columns)

        # Rows table: lazy model, uniform rows so scrolling 100k rows is cheap.
        self.rows_model = RowsModel(self)
        self.table = RowsTable()  # Ctrl+End reaches the last row, not the last fetched
        self.table.setModel(self.rows_model)
        self.table.setObjectName("rowsTable")
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.table.verticalHeader().setDefaultSectionSize(22)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.table.horizontalHeader().setDefaultSectionSize(260)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.doubleClicked.connect(lambda idx: self.show_example(idx.row()))

        self.mapping = ColumnMappingEditor()
        self.mapping.applied.connect(self._apply_mapping)
        map_card, map_lay = card()
        map_lay.addWidget(QLabel("<b>Format and columns</b>"))
        map_lay.addWidget(self.mapping)
        # The chat template's thinking switch (data.thinking): the example, packing and X-ray follow it.
        self.thinking = QComboBox()
        for text, value in THINKING_CHOICES:
            self.thinking.addItem(text, value)
        self.thinking.setToolTip(f"<b>data.thinking</b><br>{HELP['data.thinking']}")
        think_row = QHBoxLayout()
        think_row.addWidget(QLabel("Thinking"))
        think_row.addWidget(self.thinking, 1)
        map_lay.addLayout(think_row)
        map_lay.addStretch(1)

        # Example tab.
        self.example_index = RowSpinBox()  # the row's index; its number read from 1
        self.example_index.setRange(0, 0)
        self.example_index.setKeyboardTracking(False)
        self.example_index.valueChanged.connect(self.show_example)
        self.mask_view = TokenMaskView()
        # A preference row: prompt, chosen and rejected side by side (KTO: its answer and label).
        self.pair_view = PairView()
        self.example_stack = QStackedWidget()
        self.example_stack.addWidget(self.mask_view)
        self.example_stack.addWidget(self.pair_view)
        ex = QWidget()
        ex_lay = QVBoxLayout(ex)
        row = QHBoxLayout()
        row.addWidget(QLabel("Example"))
        row.addWidget(self.example_index)
        row.addWidget(caption("rendered through the model's chat template (double-click a row to pick it)"), 1)
        ex_lay.addLayout(row)
        ex_lay.addWidget(self.example_stack, 1)

        # Packing tab.
        self.packing_view = PackingView()
        self.packing_stats = caption("—")
        pk = QWidget()
        pk_lay = QVBoxLayout(pk)
        pk_lay.addWidget(self.packing_stats)
        pk_lay.addWidget(self.packing_view, 1)

        # Problems tab.
        self.problems = QTableWidget(0, 2)
        self.problems.setHorizontalHeaderLabels(["Row", "Why it cannot be used"])
        self.problems.horizontalHeader().setStretchLastSection(True)
        self.problems.verticalHeader().hide()
        self.problems.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.problems.cellDoubleClicked.connect(lambda r, _c: self._jump_to_problem(r))

        self.tabs = QTabWidget()
        self.tabs.addTab(self.table, "Rows")
        self.tabs.addTab(ex, "Example")
        self.tabs.addTab(pk, "Packing")
        self.tabs.addTab(self.problems, "Problems")
        # X-ray tab: rows worth a look before training (engine.data.xray).
        self.xray_view = DataXRay()
        self.xray_view.row_chosen.connect(self._show_row)
        self.xray = None
        # A whole-file check takes minutes on a big file: it says how far it is and can be stopped.
        self.xray_progress = QProgressBar()
        self.xray_progress.setFormat("%v / %m rows checked")
        self.xray_cancel = QPushButton("Cancel X-ray")
        self.xray_cancel.clicked.connect(self.cancel_xray)
        xr = QWidget()
        xr_lay = QVBoxLayout(xr)
        xr_lay.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(self.xray_progress, 1)
        row.addWidget(self.xray_cancel)
        xr_lay.addLayout(row)
        xr_lay.addWidget(self.xray_view, 1)
        self._xray_running(False)
        self.tabs.addTab(xr, "X-ray")

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.tabs)
        split.addWidget(map_card)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        split.setSizes([900, 300])
        self.map_split = split

        lay = QVBoxLayout(self)
        lay.addWidget(title("Data", "Load examples to train on and check how the model will see them."))
        lay.addWidget(self.banner)
        lay.addWidget(src)
        lay.addWidget(split, 1)
        self._sync_from_state()
        self._fill_recent()
        # The method decides what the data is read as (pairs, KTO rows, GRPO's prompts, or SFT's).
        self._read_for = METHOD_DATA.get(self.method())
        state.changed.connect(self._method_changed)
        self._show_thinking()
        self.thinking.currentIndexChanged.connect(self._thinking_chosen)
        state.changed.connect(lambda path: self._show_thinking() if path in ("", "data.thinking") else None)

    def method(self) -> str:
        return str(self.state.get("training.method") or "sft")

    def _method_changed(self, path: str) -> None:
        if path not in ("", "training.method") or METHOD_DATA.get(self.method()) == self._read_for:
            return
        self._read_for = METHOD_DATA.get(self.method())
        if self.preview is not None or self.loading:
            self.reload()

    def _show_thinking(self) -> None:
        value = self.state.get("data.thinking")
        index = next((i for i, (_, v) in enumerate(THINKING_CHOICES) if _same(v, value)), 0)
        self.thinking.blockSignals(True)
        self.thinking.setCurrentIndex(index)
        self.thinking.blockSignals(False)

    def _thinking_chosen(self, index: int) -> None:
        value = THINKING_CHOICES[index][1]
        if _same(self.state.get("data.thinking"), value):
            return
        self.state.set("data.thinking", value)
        if self.preview is not None or self.loading:
            self.reload()  # the example, the packing and the X-ray render with the new switch

    # -- choosing the source ----------------------------------------------------------------
    def _browse(self) -> None:
        start = self.path.text() or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Open a data set", start, FILE_FILTER)
        if path:
            self.path.setText(path)
            self.file.setChecked(True)
            self.load_source(path)

    def _load_clicked(self) -> None:
        if self.demo.isChecked():
            self.load_source("demo")
        elif self.file.isChecked():
            if not self.path.text().strip():
                self.banner.show_message("Type or browse to a data file first.", "warning")
                return
            self._take_subset_and_split()  # a data set folder has them too
            self.load_source(self.path.text().strip())
        else:
            if not self.hub_id.text().strip():
                self.banner.show_message("Type a Hub data set id first.", "warning")
                return
            self._take_subset_and_split()
            self.load_source(self.hub_id.text().strip())

    def _take_subset_and_split(self) -> None:
        self.state.set("data.subset", self.subset.text().strip())
        self.state.set("data.split", self.split.text().strip() or "train")

    def _sync_from_state(self) -> None:
        source = self.state.get("data.source")
        if source == "demo":
            self.demo.setChecked(True)
        elif Path(source).suffix.lower() in DATA_FILE_SUFFIXES or Path(source).expanduser().exists():
            self.file.setChecked(True)
            self.path.setText(source)
        else:
            self.hub.setChecked(True)
            self.hub_id.setText(source)
        self.subset.setText(self.state.get("data.subset"))
        self.split.setText(self.state.get("data.split"))

    def _fill_recent(self) -> None:
        self.recent.clear()
        self.recent.addItems(self.settings.recent_datasets())

    def load_source(self, source: str) -> None:
        """Point data.source at `source` (a fresh mapping) and load its preview."""
        if source != self.state.get("data.source"):
            self.state.set("data.format", "auto")
            self.state.set("data.columns", {})
        self.state.set("data.source", source)
        self._sync_from_state()
        self.reload()

    # -- what Train needs to know ---------------------------------------------------------
    @property
    def problem(self) -> str:
        """Why this data cannot be trained on, in one sentence ("" when it can, or is loading)."""
        return self._problem or self._packing_problem

    def _set_status(self, loading: bool, problem: Optional[str] = None) -> None:
        self.loading = loading
        if problem is not None:
            self._problem = problem
        self.status_changed.emit()

    # -- loading ----------------------------------------------------------------------------
    def reload(self) -> None:
        self._gen += 1
        gen = self._gen
        source = self.state.get("data.source")
        self.checked_source = source
        self.usable_examples = None
        self._packing_problem = ""
        self._set_status(True, "")
        self.banner.clear()
        self.summary.setText(f"Loading {source}…")
        self.load_button.setEnabled(False)
        # Whatever was still working on the previous data set stops: its answers are stale.
        for key in ("data.packing", "data.xray", "data.example", "data.tokenizer"):
            cancel(key)
        self._xray_running(False)
        self._read_for = METHOD_DATA.get(self.method())
        run_task(
            data_bridge.load_preview,
            dict(self.state.get("data")),
            self.method(),
            owner=self,
            lane="data",
            key="data.preview",
            on_done=lambda p: self._preview_done(gen, p),
            on_error=lambda m, d: self._failed(gen, f"Cannot load the data set: {m}", d),
        )

    def _failed(self, gen: int, message: str, detail: str = "") -> None:
        if gen != self._gen:
            return
        self.load_button.setEnabled(True)
        # Clear the views: rows of the previous data set under this error would mislead.
        self.preview = self.example = self.layout_info = None
        self.rows_model.set_source(None)
        self._fill_problems([])
        self._example_message("No data.")
        self.packing_view.set_layout([], 1)
        self.packing_stats.setText("—")
        self.banner.show_message(message, "error")
        self.summary.setText("The data could not be used: see the message above.")
        self.usable_examples = 0
        self._set_status(False, _sentence(message))
        self.failed.emit(message)

    def _preview_done(self, gen: int, preview) -> None:
        if gen != self._gen:
            return
        self.load_button.setEnabled(True)
        self.preview = preview
        problems = list(_get(preview, "problems", default=[]) or [])
        self.rows_model.set_source(preview, {int(i): str(r) for i, r in problems})
        n = int(_get(preview, "num_rows", default=0))
        spec = _get(preview, "format", "detected_format", default=None)
        kind = _get(spec, "kind", default=spec if isinstance(spec, str) else "")
        mapping = dict(
            _get(preview, "mapping", "column_mapping", default=None) or _get(spec, "mapping", default={}) or {}
        )
        columns = list(_get(preview, "columns", default=[]))
        # Columns that match no shape: open the mapping controls (usable under Format auto).
        unmatched = _get(preview, "error_detail", default=None)
        unmatched = unmatched if hasattr(unmatched, "kinds") else None
        self.mapping.set_detected(columns, kind or "", mapping, self.state.get("data.format"), unmatched is not None)
        source = self.state.get("data.source")
        self.settings.add_recent_dataset(source)
        self._fill_recent()
        self.summary.setText(
            f"<b>{n:,}</b> rows · {len(columns)} columns · format <b>{kind or '?'}</b> "
            f"({', '.join(f'{k} ← {v}' for k, v in mapping.items())}) · "
            f"{len(problems)} unusable row{'s' if len(problems) != 1 else ''}"
        )
        self._show_reward_columns(kind, list(_get(preview, "extra_columns", default=[]) or []))
        self._fill_problems(problems)
        self.example_index.blockSignals(True)
        self.example_index.setRange(0, max(0, n - 1))
        first_ok = next((i for i in range(min(n, len(problems) + 1)) if i not in {p[0] for p in problems}), 0)
        self.example_index.setValue(first_ok)
        self.example_index.blockSignals(False)
        error = _get(preview, "error", default=None)
        bad = {int(i) for i, _ in problems}
        self.usable_examples = 0 if error else max(0, n - len(bad))
        method_problem = _get(preview, "method_problem", default="")
        if unmatched is not None:
            problem = (
                f"The data's columns ({', '.join(columns) or 'none'}) match no known shape: map them on the Data page."
            )
            if unmatched.hint:  # a prompts file with SFT chosen: say why (and what trains it)
                problem += f" Note: {unmatched.hint}."
        elif method_problem:
            problem = _sentence(method_problem)
        elif error:
            problem = f"The data's columns cannot be used: {_sentence(str(error))}"
        elif n == 0:
            problem = "The data set has no rows."
        elif self.usable_examples == 0:
            first = f" (row {shown_row(problems[0][0])}: {problems[0][1]})" if problems else ""
            problem = f"None of the {n:,} rows can be used{first}; see the Problems tab."
        else:
            problem = ""
        self._set_status(False, problem)
        self.preview_ready.emit(preview)
        if unmatched is not None:
            self.banner.show_message(self._unmatched_message(unmatched, source), "error")
            self._open_mapping()
            return
        if error:
            self.banner.show_message(str(error), "error")
            return
        if problem:
            self.banner.show_message(problem, "error")
        self._analyse(gen)

    def _show_reward_columns(self, kind: str, extra: list[str]) -> None:
        """A GRPO prompts file: the columns the reward functions can read, or that there are none."""
        if "GRPO" not in str(kind):
            self.reward_columns.hide()
            return
        if extra:
            cols = ", ".join(f"<b>{c}</b>" for c in extra)
            text = (
                f"Prompts for GRPO: the model writes the answers. Columns for the rewards: {cols}. "
                f"The exact-match reward compares against one of them (its column field, e.g. "
                f"'{extra[0]}'); your own reward(prompt, completion, **row) receives them all as keywords. "
                "The format (regex) and length rewards read the completion only."
            )
        else:
            text = (
                "Prompts for GRPO: the model writes the answers. No other columns: the format (regex), "
                "length and your own rewards can score the completions; exact match needs a column to compare to."
            )
        self.reward_columns.setText(text)
        self.reward_columns.show()

    def _fill_problems(self, problems) -> None:
        shown = problems[:MAX_PROBLEMS_SHOWN]
        self.problems.setRowCount(len(shown))
        for r, (idx, reason) in enumerate(shown):
            number = QTableWidgetItem(str(shown_row(idx)))
            number.setData(Qt.ItemDataRole.UserRole, int(idx))  # the row's index, for the jump
            self.problems.setItem(r, 0, number)
            self.problems.setItem(r, 1, QTableWidgetItem(str(reason)))
        label = f"Problems ({len(problems)})" if problems else "Problems"
        self.tabs.setTabText(3, label)

    def _jump_to_problem(self, r: int) -> None:
        idx = int(self.problems.item(r, 0).data(Qt.ItemDataRole.UserRole))
        while self.rows_model.rowCount() <= idx and self.rows_model.canFetchMore():
            self.rows_model.fetchMore()
        self.tabs.setCurrentIndex(0)
        self.table.selectRow(idx)
        self.table.scrollTo(self.rows_model.index(idx, 0))

    # -- tokenizer-dependent views ----------------------------------------------------------
    def _analyse(self, gen: int) -> None:
        if self._packing_problem:
            self._packing_problem = ""
            self.status_changed.emit()
        model = dict(self.state.get("model"))
        if self.tokenizer is not None and self._tokenizer_for == model.get("name_or_path"):
            self._with_tokenizer(gen, self.tokenizer)
            return
        self._example_message("Loading the model's tokenizer…")
        self.packing_stats.setText("Loading the model's tokenizer…")

        def done(tok, name=model.get("name_or_path")):
            self.tokenizer, self._tokenizer_for = tok, name
            self._with_tokenizer(gen, tok)

        run_task(
            data_bridge.load_tokenizer,
            model,
            owner=self,
            lane="example",
            key="data.tokenizer",
            on_done=done,
            on_error=lambda m, d: self._tokenizer_failed(gen, m),
        )

    def _tokenizer_failed(self, gen: int, message: str) -> None:
        if gen != self._gen:
            return
        text = f"Cannot load the tokenizer of the chosen model, so the example and packing views are empty: {message}"
        self._example_message(text)
        self.packing_stats.setText(text)
        self.banner.show_message(text, "warning")

    def model_changed(self) -> None:
        """The base model changed: its tokenizer renders and packs differently."""
        self.tokenizer = None
        if self.preview is not None:
            self._gen += 1
            # What the banner said about the previous model's tokenizer or packing is stale:
            # keep only the data's own problem; the new model's analysis re-sets the rest.
            if self._problem:
                self.banner.show_message(self._problem, "error")
            else:
                self.banner.clear()
            self._analyse(self._gen)

    def _with_tokenizer(self, gen: int, tok) -> None:
        if gen != self._gen:
            return
        self.show_example(self.example_index.value())
        self.packing_stats.setText("Packing…")
        run_task(
            data_bridge.packing_layout,
            tok,
            dict(self.state.get("data")),
            owner=self,
            lane="data",
            key="data.packing",
            on_done=lambda result: self._packing_done(gen, *result),
            on_error=lambda m, d: self._packing_failed(gen, m),
            on_progress=lambda p: self._packing_progress(gen, *p),
            method=self.method(),
        )
        if "GRPO" in str(_get(_get(self.preview, "format", default=None), "kind", default="")):
            # The X-ray's findings are SFT's and the pairs'; a prompt's own problem (too long, empty)
            # shows in the Problems tab once packed, as training would skip it.
            self.xray_view.set_message(
                "The X-ray checks answers (SFT rows, preference pairs); GRPO's prompts have none. "
                "Prompts that cannot be used are listed in the Problems tab."
            )
            self.tabs.setTabText(XRAY_TAB, "X-ray (n/a)")
            self._xray_running(False)
            return
        self.xray_view.set_message("Checking every row…")
        self.tabs.setTabText(XRAY_TAB, "X-ray")
        self._xray_running(True)
        run_task(
            data_bridge.xray,
            tok,
            dict(self.state.get("data")),
            owner=self,
            lane="xray",
            key="data.xray",
            on_done=lambda x: self._xray_done(gen, x),
            on_error=lambda m, d: self._xray_failed(gen, m),
            on_progress=lambda p: self._xray_progress(gen, *p),
            on_cancelled=lambda: self._xray_cancelled(gen),
        )

    # -- the X-ray's progress and Cancel ------------------------------------------------------
    def _xray_running(self, on: bool) -> None:
        self.xray_progress.setVisible(on)
        self.xray_cancel.setVisible(on)
        if on:
            self.xray_progress.setRange(0, 0)  # busy until the first batch reports

    def _xray_progress(self, gen: int, done: int, total: int) -> None:
        if gen == self._gen:
            self.xray_progress.setRange(0, total)
            self.xray_progress.setValue(done)
            self.tabs.setTabText(XRAY_TAB, f"X-ray {100 * done // max(1, total)}%")

    def cancel_xray(self) -> None:
        cancel("data.xray")

    def _xray_cancelled(self, gen: int) -> None:
        if gen == self._gen:
            self._xray_running(False)
            self.tabs.setTabText(XRAY_TAB, "X-ray (cancelled)")
            self.xray_view.set_message("The X-ray was cancelled. Load the data again to check every row.")

    def _packing_progress(self, gen: int, done: int, total: int) -> None:
        if gen == self._gen:
            self.packing_stats.setText(f"Packing… {done:,} of {total:,} rows")

    def _xray_done(self, gen: int, x) -> None:
        if gen != self._gen:
            return
        self._xray_running(False)
        self.xray = x
        n = self.xray_view.set_xray(x, DATA_FINDINGS)
        self.tabs.setTabText(XRAY_TAB, f"X-ray ({n:,})" if n else "X-ray ✓")
        self.xray_ready.emit(x)

    def _xray_failed(self, gen: int, message: str) -> None:
        if gen == self._gen:
            self._xray_running(False)
            self.xray_view.set_message(f"Cannot check the rows: {message}")

    def _show_row(self, index: int) -> None:
        """Open a row found by the X-ray in the Example tab."""
        self.tabs.setCurrentIndex(EXAMPLE_TAB)
        self.show_example(index)

    def show_example(self, index: int) -> None:
        if self.tokenizer is None or self.preview is None:
            return
        if self.example_index.value() != index:
            self.example_index.blockSignals(True)
            self.example_index.setValue(index)
            self.example_index.blockSignals(False)
        gen = self._gen
        run_task(
            data_bridge.render_example,
            self.tokenizer,
            dict(self.state.get("data")),
            int(index),
            self.method(),
            owner=self,
            lane="example",
            key="data.example",
            on_done=lambda ex: self._example_done(gen, index, ex),
            on_error=lambda m, d: self._example_failed(gen, index, m),
        )

    def _example_done(self, gen: int, index: int, ex) -> None:
        if gen != self._gen or index != self.example_index.value():
            return
        self.example = ex
        pieces = _get(ex, "pieces", "tokens", default=[]) or []
        pairs = [
            (
                _get(p, "text", default=p[0] if isinstance(p, (tuple, list)) else str(p)),
                _get(p, "trained", default=p[1] if isinstance(p, (tuple, list)) else False),
            )
            for p in pieces
        ]
        note = []
        if _get(ex, "truncated", default=False):
            note.append("truncated to max seq len")
        if _get(ex, "fallback_template", "used_fallback_template", default=False):
            note.append("the tokenizer has no chat template: a ChatML fallback is used")
        sides = _get(ex, "sides", default=None)
        if sides:
            self.pair_view.set_sides(sides, _get(ex, "label", default=None), "; ".join(note))
            self.example_stack.setCurrentWidget(self.pair_view)
        else:
            columns = _get(ex, "columns", default=None) or {}
            if columns:  # GRPO: nothing trained in the prompt; the rewards read these
                note.append("GRPO samples the answers; for the rewards: " + _columns_text(columns))
            self.mask_view.set_pieces(pairs, "; ".join(note))
            self.example_stack.setCurrentWidget(self.mask_view)
        self.example_ready.emit(ex)

    def _example_message(self, text: str) -> None:
        """A sentence in place of the example (SFT or pair): loading, no data, a row that fails."""
        self.mask_view.set_message(text)
        self.example_stack.setCurrentWidget(self.mask_view)

    def _example_failed(self, gen: int, index: int, message: str) -> None:
        if gen != self._gen:
            return
        self._example_message(f"Row {shown_row(index)} cannot be rendered: {message}")

    def _packing_done(self, gen: int, lay, total_rows: int = 0) -> None:
        if gen != self._gen:
            return
        self.layout_info = lay
        rows = _get(lay, "rows", default=[]) or []
        row_len = int(_get(lay, "row_tokens", "max_seq_len", "row_len", default=self.state.get("data.max_seq_len")))
        self.packing_view.set_layout(rows, row_len)
        eff = _get(lay, "efficiency", default=None)
        if callable(eff):
            eff = eff()
        avoided = _get(lay, "padding_avoided", default=None)
        parts = [f"<b>{sum(len(r) for r in rows):,}</b> examples in <b>{len(rows):,}</b> rows of {row_len} tokens"]
        if eff is not None:
            parts.append(f"packing efficiency <b>{100 * float(eff):.1f}%</b>")
        if avoided is not None:
            parts.append(f"padding avoided <b>{int(avoided):,}</b> tokens")
        for key, label in (("truncated", "truncated"), ("dropped", "dropped")):
            v = _get(lay, key, f"num_{key}", default=None)
            if v:
                parts.append(f"{int(v)} {label}")
        if total_rows > PACKING_SAMPLE:
            # A big file: the view packs a leading sample; the run packs every row.
            parts.append(f"from the first {PACKING_SAMPLE:,} of {total_rows:,} rows")
        self.packing_stats.setText(" · ".join(parts))
        # Rows that cannot be trained on show up only once tokenized (empty replies, ...).
        skipped = list(_get(lay, "skipped", default=[]) or [])
        if skipped:
            known = {int(i) for i, _ in (_get(self.preview, "problems", default=[]) or [])}
            extra = [(int(i), str(r)) for i, r in skipped if int(i) not in known]
            if extra:
                merged = sorted(list(_get(self.preview, "problems", default=[]) or []) + extra)
                self._fill_problems(merged)
        examples = _get(lay, "examples", default=None)
        if examples is not None and int(examples) == 0 and not self._problem:
            self._packing_problem = "No example is left to train on once tokenized; see the Problems tab."
            self.banner.show_message(self._packing_problem, "error")
            self.status_changed.emit()
        self.packing_ready.emit(lay)

    def _packing_failed(self, gen: int, message: str) -> None:
        if gen != self._gen:
            return
        self.packing_stats.setText(f"Cannot pack this data: {message}")
        self.banner.show_message(f"Cannot pack this data: {message}", "error")
        self._packing_problem = f"Cannot pack this data: {_sentence(message)}"
        self.status_changed.emit()

    # -- format and column mapping ----------------------------------------------------------
    @staticmethod
    def _unmatched_message(err, source: str) -> str:
        """The engine's UnmatchedColumns (file, columns, shapes tried, hint) in the window's words,
        around the mapping controls beside the rows (the CLI prints the config key instead)."""
        name = Path(str(err.source or source)).name or str(source)
        cols = ", ".join(err.columns) or "(none)"
        kinds = list(err.kinds)
        pick = "which column holds the prompt and which the answer" if len(kinds) != 1 else err.what_to_pick()
        text = (
            f"The columns of {name} ({cols}) match no known shape, so map them: "
            f"pick {pick} below, then press Apply mapping."
        )
        if err.hint:
            text += f" Note: {err.hint}."
        return text

    def _open_mapping(self) -> None:
        """Make the mapping controls visible and put the focus on the first one."""
        sizes = self.map_split.sizes()
        if len(sizes) == 2 and sizes[1] == 0:
            self.map_split.setSizes([max(1, sizes[0] - 300), 300])
        self.mapping.setEnabled(True)
        if self.mapping.boxes:
            next(iter(self.mapping.boxes.values())).setFocus()

    def _apply_mapping(self, kind: str, columns: dict) -> None:
        self.state.set("data.format", kind)
        # Under auto a mapping still counts: detection uses the mapped columns first.
        self.state.set("data.columns", dict(columns))
        self.reload()
