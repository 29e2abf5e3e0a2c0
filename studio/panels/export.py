"""Export page: pick a run (its final adapter) or one of its checkpoints, and write any of the
engine's export kinds (engine.api.EXPORTERS: today the LoRA adapter, a merged 16-bit model and a
GGUF with an Ollama Modelfile) to a folder. The page names no kind: each kind's row (`KindRow`,
built by `_kind_row`) is its checkbox, a list per option it takes (a GGUF's quantization), and,
when what it needs is missing and the kind can install it, an install button (pip, in the
background, its output shown as it comes). The engine's `export_and_check` runs the chosen kinds
off the GUI thread (the same flow as `tunesmith export`): each artefact is loaded in its own
runtime and compared with the trained model before it is published, and the page shows the
verdict per artefact (verified, verified with a drop of X, or failed with the reason), the files
written, each kind's notes and, when a kind offers one, the command to run next (`ollama create`)
with a copy button."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.api import (
    EXPORTERS,
    RUNNING_WINDOW_S,
    ExportKind,
    RunFolder,
    SelfCheckFailed,
    destinations,
    export_and_check,
    list_runs,
    read_export_report,
    run_folder_of,
    shown_status,
)
from studio.panels.common import Banner, caption, card, title
from studio.tasks import run_task


def do_export(src: str, dst: str, kinds: list[str], options=None, progress=None) -> dict:
    """Pool-thread body: the chosen kinds, into dst for one kind, dst/<kind> for each of several.
    Returns {"written", "verdicts", "extras", "error"}: a failed self-check comes back as a result
    (with the verdicts so far) so the page can show each artefact's verdict."""
    try:
        result = export_and_check(src, destinations(dst, kinds), progress=progress, options=options or {})
    except SelfCheckFailed as exc:
        return {"written": {}, "verdicts": [v.to_dict() for v in exc.verdicts], "extras": {}, "error": str(exc)}
    return {
        "written": result.written,
        "verdicts": [v.to_dict() for v in result.verdicts],
        "extras": result.extras,
        "error": "",
    }


def verdict_line(v: dict) -> str:
    """What the page says about one artefact."""
    return v.get("summary") or v.get("status", "")


def run_status(run, active: str | None) -> str:
    """A run's status as the page shows it (the engine's rule): an incomplete run is "running"
    when it is the run this window trains, or when its files were written in the last
    RUNNING_WINDOW_S (a run in another process)."""
    ours = bool(active) and Path(active) == Path(run.path)
    busy = ours or RunFolder(run.path).written_within(RUNNING_WINDOW_S)
    return shown_status(run.status, busy=busy)


def tick_message() -> str:
    titles = [k.title for k in EXPORTERS.values()]
    if len(titles) == 2:
        return f"Tick the {titles[0]}, the {titles[1]}, or both."
    return "Tick at least one of: " + ", ".join(f"the {t}" for t in titles) + "."


@dataclass
class KindRow:
    """One export kind's widgets: its checkbox, a list per option, the button that installs what
    it lacks (None when it cannot install) and the line that says what it lacks."""

    kind: ExportKind
    box: QCheckBox
    options: dict[str, QComboBox] = field(default_factory=dict)
    install: Optional[QPushButton] = None
    note: Optional[QLabel] = None

    def chosen_options(self) -> dict[str, str]:
        return {name: combo.currentText() for name, combo in self.options.items()}


def _kind_row(kind: ExportKind, on_install) -> KindRow:
    row = KindRow(kind, QCheckBox(kind.label), note=caption(""))
    for option in kind.options:
        combo = QComboBox()
        combo.addItems(list(option.choices))
        combo.setToolTip(option.help)
        row.options[option.name] = combo
    if kind.install is not None:
        row.install = QPushButton(kind.install_label or f"Install {kind.title} support…")
        row.install.setToolTip(kind.install_help)
        row.install.clicked.connect(lambda: on_install(kind.name))
    return row


def _lay_out_kind(row: KindRow, lay: QVBoxLayout) -> None:
    line = QHBoxLayout()
    line.addWidget(row.box, 1)
    for combo in row.options.values():
        line.addWidget(combo)
    if row.install is not None:
        line.addWidget(row.install)
    lay.addLayout(line)
    lay.addWidget(row.note)


def _verdicts_tree() -> QTreeWidget:
    tree = QTreeWidget()
    tree.setObjectName("exportVerdicts")
    tree.setHeaderLabels(["Artefact", "Self-check"])
    tree.setColumnWidth(0, 110)
    tree.setRootIsDecorated(False)
    tree.setWordWrap(True)
    tree.setMaximumHeight(150)
    return tree


def _runs_tree() -> QTreeWidget:
    tree = QTreeWidget()
    tree.setObjectName("runsTree")
    tree.setHeaderLabels(["Run / checkpoint", "Status", "Folder"])
    tree.setColumnWidth(0, 260)
    tree.setColumnWidth(1, 110)
    return tree


def _next_command_hint() -> str:
    kinds = [k for k in EXPORTERS.values() if k.next_command is not None]
    if not kinds:
        return ""
    return "; ".join(f"The command for {k.next_command_for} appears here after a {k.title} export." for k in kinds)


class ExportPanel(QWidget):
    exported = Signal(dict)
    failed = Signal(str)

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.active_run: str | None = None
        self.last_written: dict[str, list[str]] = {}
        self.last_verdicts: list[dict] = []
        self.banner = Banner()
        self.tree = _runs_tree()
        self.rows = {name: _kind_row(kind, self.install) for name, kind in EXPORTERS.items()}
        self.wants = {name: row.box for name, row in self.rows.items()}
        self.wants[next(iter(self.wants))].setChecked(True)  # the first kind (the cheapest) by default
        self.verdicts = _verdicts_tree()
        self.next_command = QLineEdit()
        self.next_command.setReadOnly(True)
        self.next_command.setObjectName("nextCommand")
        self.next_command.setPlaceholderText(_next_command_hint())
        self.copy_button = QPushButton("Copy")
        self.copy_button.setEnabled(False)
        self.dest = QLineEdit()
        self.dest.setPlaceholderText("Folder to write into")
        self.export_button = QPushButton("Export")
        self.export_button.setObjectName("primary")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.stage = caption("")
        self.result = QPlainTextEdit()
        self.result.setReadOnly(True)
        self.result.setObjectName("exportResult")
        self.result.setPlaceholderText("The files written appear here.")
        self.runs_dir_label = caption("")
        self._lay_out()
        self._connect()
        self.update_availability()

    def __getattr__(self, name: str):
        """`want_<kind>`: a kind's checkbox (for tests and scripts that name a kind)."""
        wants = self.__dict__.get("wants") or {}
        if name.startswith("want_") and name[len("want_") :] in wants:
            return wants[name[len("want_") :]]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _lay_out(self) -> None:
        runs, runs_lay = card()
        head = QHBoxLayout()
        head.addWidget(QLabel("<b>Runs</b>"))
        head.addWidget(self.runs_dir_label, 1)
        self.refresh_button = QPushButton("Refresh")
        head.addWidget(self.refresh_button)
        runs_lay.addLayout(head)
        runs_lay.addWidget(self.tree, 1)

        out, out_lay = card()
        out_lay.addWidget(QLabel("<b>Export to</b>"))
        row = QHBoxLayout()
        row.addWidget(self.dest, 1)
        self.browse_button = QPushButton("Browse…")
        row.addWidget(self.browse_button)
        out_lay.addLayout(row)
        for kind_row in self.rows.values():
            _lay_out_kind(kind_row, out_lay)
        row = QHBoxLayout()
        row.addWidget(self.progress, 1)
        row.addWidget(self.export_button)
        out_lay.addLayout(row)
        out_lay.addWidget(self.stage)
        out_lay.addWidget(QLabel("<b>Self-check</b> (each artefact against the trained model)"))
        out_lay.addWidget(self.verdicts)
        row = QHBoxLayout()
        row.addWidget(self.next_command, 1)
        row.addWidget(self.copy_button)
        out_lay.addLayout(row)
        self.next_command.setVisible(bool(self.next_command.placeholderText()))
        self.copy_button.setVisible(bool(self.next_command.placeholderText()))
        out_lay.addWidget(self.result, 1)

        lay = QVBoxLayout(self)
        lay.addWidget(
            title(
                "Export",
                "Write what the run learned in the formats other tools load (one box per kind below); "
                "each is checked against the trained model before it is called done.",
            )
        )
        lay.addWidget(self.banner)
        cols = QHBoxLayout()
        cols.addWidget(runs, 3)
        cols.addWidget(out, 2)
        lay.addLayout(cols, 1)

    def _connect(self) -> None:
        """Every signal the page listens to, in one place."""
        self.tree.currentItemChanged.connect(self._selected)
        self.refresh_button.clicked.connect(self.refresh)
        self.browse_button.clicked.connect(self._browse)
        self.export_button.clicked.connect(self.start_export)
        self.copy_button.clicked.connect(self.copy_command)
        self.state.run_dir_changed.connect(self._run_started)

    # -- runs -------------------------------------------------------------------------------
    def refresh(self, select: str | None = None) -> None:
        runs_dir = self.state.get("output.dir")
        self.runs_dir_label.setText(str(runs_dir))
        current = select or self.selected_source()
        self.tree.clear()
        chosen = None
        for run in list_runs(runs_dir):
            top = QTreeWidgetItem([run.name, run_status(run, self.active_run), str(run.path)])
            top.setData(0, Qt.ItemDataRole.UserRole, str(run.path) if (run.adapter or run.checkpoints) else None)
            if not (run.adapter or run.checkpoints):
                top.setForeground(0, Qt.GlobalColor.gray)
            self.tree.addTopLevelItem(top)
            for label, path in run.sources():
                if path == run.path:
                    continue  # the run item itself stands for its final adapter
                child = QTreeWidgetItem([label, "", str(path)])
                child.setData(0, Qt.ItemDataRole.UserRole, str(path))
                top.addChild(child)
            if current and str(run.path) == str(current):
                chosen = top
            for i in range(top.childCount()):
                if current and top.child(i).data(0, Qt.ItemDataRole.UserRole) == str(current):
                    chosen = top.child(i)
        self.tree.expandAll()
        if self.tree.topLevelItemCount() == 0:
            self.stage.setText(f"No runs in {runs_dir} yet: train one first.")
        self.tree.setCurrentItem(chosen or self.tree.topLevelItem(0))

    def selected_source(self) -> str | None:
        item = self.tree.currentItem()
        return item.data(0, Qt.ItemDataRole.UserRole) if item is not None else None

    def select_source(self, path: str) -> bool:
        for i in range(self.tree.topLevelItemCount()):
            top = self.tree.topLevelItem(i)
            for item in [top] + [top.child(j) for j in range(top.childCount())]:
                if item.data(0, Qt.ItemDataRole.UserRole) == str(path):
                    self.tree.setCurrentItem(item)
                    return True
        return False

    def _selected(self, item, _prev) -> None:
        src = item.data(0, Qt.ItemDataRole.UserRole) if item is not None else None
        self.export_button.setEnabled(bool(src))
        if src:
            p = Path(src)
            run = run_folder_of(p)
            suffix = "" if p == run else f"-{p.name}"
            self.dest.setText(str(run.parent.parent / "exports" / f"{run.name}{suffix}"))
            self.show_verdicts(list(read_export_report(run).values()), "last export")

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Export into", self.dest.text())
        if folder:
            self.dest.setText(folder)

    # -- export -----------------------------------------------------------------------------
    def start_export(self) -> None:
        src = self.selected_source()
        dst = self.dest.text().strip()
        if not src:
            self.banner.show_message("Pick a run or a checkpoint first.", "warning")
            return
        if not dst:
            self.banner.show_message("Choose a folder to export into.", "warning")
            return
        kinds = self.chosen_kinds()
        if not kinds:
            self.banner.show_message(tick_message(), "warning")
            return
        self.banner.clear()
        self.result.clear()
        self.verdicts.clear()
        self.next_command.clear()
        self.copy_button.setEnabled(False)
        self.export_button.setEnabled(False)
        self.progress.setRange(0, 0)
        self.stage.setText("Starting…")
        options = {name: self.rows[name].chosen_options() for name in kinds if self.rows[name].options}
        run_task(
            do_export,
            src,
            dst,
            kinds,
            options,
            owner=self,
            lane="export",
            on_done=self._done,
            on_error=self._failed,
            on_progress=lambda msg: self.stage.setText(str(msg)),
        )

    def chosen_kinds(self) -> list[str]:
        return [name for name, box in self.wants.items() if box.isChecked()]

    def _finish(self) -> None:
        self.export_button.setEnabled(True)
        self.progress.setRange(0, 1)

    def _done(self, outcome: dict) -> None:
        self._finish()
        self.show_verdicts(outcome["verdicts"])
        if outcome["error"]:
            self._failed(outcome["error"], "")
            return
        written = outcome["written"]
        self.progress.setValue(1)
        self.last_written = written
        lines = []
        for folder, files in written.items():
            lines.append(f"{folder}:")
            lines += [f"  {f}" for f in files]
        for name, extras in outcome["extras"].items():
            kind = EXPORTERS[name]
            command = kind.next_command(extras) if kind.next_command else ""
            if command:
                self.next_command.setText(command)
                self.next_command.setCursorPosition(0)  # show "ollama create NAME" rather than the path's end
                self.copy_button.setEnabled(True)
            lines += kind.notes(extras) if kind.notes else []
        self.result.setPlainText("\n".join(lines))
        self.stage.setText("Done.")
        drops = [v for v in outcome["verdicts"] if v.get("status") == "verified with a drop"]
        note = " (verified; see the drop below)" if drops else (" (verified)" if outcome["verdicts"] else "")
        self.banner.show_message(f"Exported to {', '.join(written)}{note}.", "success")
        self.exported.emit(written)

    def _failed(self, message: str, detail: str) -> None:
        self._finish()
        self.progress.setValue(0)
        self.stage.setText("")
        self.banner.show_message(f"Export failed: {message}", "error")
        self.failed.emit(message)

    # -- verdicts ---------------------------------------------------------------------------
    def show_verdicts(self, verdicts: list[dict], when: str = "") -> None:
        """One row per artefact: its kind and the self-check's sentence (green, amber or red)."""
        self.last_verdicts = list(verdicts)
        self.verdicts.clear()
        colors = {"verified": "#2e7d32", "verified with a drop": "#b26a00", "failed": "#c62828"}
        for v in verdicts:
            label = v.get("kind", "")
            if when:
                label += f" ({when})"
            item = QTreeWidgetItem([label, verdict_line(v)])
            item.setToolTip(1, "\n".join([verdict_line(v), v.get("artefact", ""), *v.get("notes", [])]))
            color = colors.get(v.get("status", ""))
            if color:
                from PySide6.QtGui import QColor

                item.setForeground(1, QColor(color))
            self.verdicts.addTopLevelItem(item)

    def verdict_texts(self) -> dict[str, str]:
        """{artefact kind: what the page shows} (for tests and screenshots)."""
        out = {}
        for i in range(self.verdicts.topLevelItemCount()):
            item = self.verdicts.topLevelItem(i)
            out[item.text(0).split(" (")[0]] = item.text(1)
        return out

    def copy_command(self) -> None:
        QApplication.clipboard().setText(self.next_command.text())
        self.stage.setText("Copied the command.")

    # -- what a kind needs installed ------------------------------------------------------------
    def update_availability(self) -> None:
        """Each kind's row is usable when what it needs is installed; otherwise its note says what
        is missing and, when the kind can install it, its install button shows."""
        for row in self.rows.values():
            missing = row.kind.missing()
            row.box.setEnabled(not missing)
            for combo in row.options.values():
                combo.setEnabled(not missing)
            if row.install is not None:
                row.install.setVisible(bool(missing))
            if missing:
                row.box.setChecked(False)
            row.note.setText(f"{row.kind.title} needs {', '.join(missing)}." if missing else "")
            row.note.setVisible(bool(missing))

    def install(self, name: str) -> None:
        row = self.rows[name]
        row.install.setEnabled(False)
        self.progress.setRange(0, 0)
        self.result.clear()
        self.stage.setText(row.kind.install_stage or f"Installing {row.kind.title} support…")
        run_task(
            row.kind.install,
            owner=self,
            lane="export",
            on_done=lambda _path: self._installed(name),
            on_error=lambda message, _detail: self._install_failed(name, message),
            on_progress=lambda line: self.result.appendPlainText(str(line)),
        )

    def _installed(self, name: str) -> None:
        row = self.rows[name]
        row.install.setEnabled(True)
        self.progress.setRange(0, 1)
        import importlib

        importlib.invalidate_caches()  # the new packages must be found without a restart
        self.update_availability()
        missing = row.kind.missing()
        self.stage.setText(f"{row.kind.title} support installed." if not missing else "")
        if missing:
            self.banner.show_message(f"{row.kind.title} support still lacks {', '.join(missing)}.", "warning")

    def _install_failed(self, name: str, message: str) -> None:
        row = self.rows[name]
        row.install.setEnabled(True)
        self.progress.setRange(0, 1)
        self.stage.setText("")
        self.banner.show_message(f"Installing {row.kind.title} support failed: {message}", "error")

    # -- the run in progress ----------------------------------------------------------------
    def _run_started(self, run_dir: str) -> None:
        self.active_run = str(run_dir)
        if self.isVisible():
            self.refresh()
