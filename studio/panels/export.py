"""Export page: pick a run (its final adapter) or one of its checkpoints, and write the LoRA
adapter and/or a merged 16-bit model to a folder. One checkbox per kind in the engine's export
registry (engine.api.EXPORTERS); the engine's `run_exports` runs them off the GUI thread (the
same flow as `tunesmith export`), and the page lists the files it wrote."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
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

from engine.api import EXPORTERS, destinations, list_runs, run_exports, run_folder_of
from studio.panels.common import Banner, caption, card, title
from studio.tasks import run_task


def do_export(src: str, dst: str, kinds: list[str], progress=None) -> dict[str, list[str]]:
    """Pool-thread body: the chosen kinds, into dst for one kind, dst/<kind> for each of several."""
    return run_exports(src, destinations(dst, kinds), progress=progress)


def tick_message() -> str:
    titles = [k.title for k in EXPORTERS.values()]
    if len(titles) == 2:
        return f"Tick the {titles[0]}, the {titles[1]}, or both."
    return "Tick at least one of: " + ", ".join(f"the {t}" for t in titles) + "."


class ExportPanel(QWidget):
    exported = Signal(dict)
    failed = Signal(str)

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.banner = Banner()
        self.tree = QTreeWidget()
        self.tree.setObjectName("runsTree")
        self.tree.setHeaderLabels(["Run / checkpoint", "Status", "Folder"])
        self.tree.setColumnWidth(0, 260)
        self.tree.setColumnWidth(1, 110)
        self.tree.currentItemChanged.connect(self._selected)
        refresh = QPushButton("Refresh")
        refresh.clicked.connect(self.refresh)
        self.dest = QLineEdit()
        self.dest.setPlaceholderText("Folder to write into")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.wants = {name: QCheckBox(kind.label) for name, kind in EXPORTERS.items()}
        self.want_adapter = self.wants.get("adapter")
        self.want_merged = self.wants.get("merged")
        if self.want_adapter is not None:
            self.want_adapter.setChecked(True)
        self.export_button = QPushButton("Export")
        self.export_button.setObjectName("primary")
        self.export_button.clicked.connect(self.start_export)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.stage = caption("")
        self.result = QPlainTextEdit()
        self.result.setReadOnly(True)
        self.result.setObjectName("exportResult")
        self.result.setPlaceholderText("The files written appear here.")

        runs, runs_lay = card()
        head = QHBoxLayout()
        head.addWidget(QLabel("<b>Runs</b>"))
        self.runs_dir_label = caption("")
        head.addWidget(self.runs_dir_label, 1)
        head.addWidget(refresh)
        runs_lay.addLayout(head)
        runs_lay.addWidget(self.tree, 1)

        out, out_lay = card()
        out_lay.addWidget(QLabel("<b>Export to</b>"))
        row = QHBoxLayout()
        row.addWidget(self.dest, 1)
        row.addWidget(browse)
        out_lay.addLayout(row)
        for box in self.wants.values():
            out_lay.addWidget(box)
        row = QHBoxLayout()
        row.addWidget(self.progress, 1)
        row.addWidget(self.export_button)
        out_lay.addLayout(row)
        out_lay.addWidget(self.stage)
        out_lay.addWidget(self.result, 1)

        lay = QVBoxLayout(self)
        lay.addWidget(
            title("Export", "Write the adapter for PEFT / transformers, or a merged model that needs no adapter.")
        )
        lay.addWidget(self.banner)
        cols = QHBoxLayout()
        cols.addWidget(runs, 3)
        cols.addWidget(out, 2)
        lay.addLayout(cols, 1)
        self.last_written: dict[str, list[str]] = {}

    # -- runs -------------------------------------------------------------------------------
    def refresh(self, select: str | None = None) -> None:
        runs_dir = self.state.get("output.dir")
        self.runs_dir_label.setText(str(runs_dir))
        current = select or self.selected_source()
        self.tree.clear()
        chosen = None
        for run in list_runs(runs_dir):
            top = QTreeWidgetItem([run.name, run.status, str(run.path)])
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
        self.export_button.setEnabled(False)
        self.progress.setRange(0, 0)
        self.stage.setText("Starting…")
        run_task(
            do_export,
            src,
            dst,
            kinds,
            owner=self,
            on_done=self._done,
            on_error=self._failed,
            on_progress=lambda msg: self.stage.setText(str(msg)),
        )

    def chosen_kinds(self) -> list[str]:
        return [name for name, box in self.wants.items() if box.isChecked()]

    def _finish(self) -> None:
        self.export_button.setEnabled(True)
        self.progress.setRange(0, 1)

    def _done(self, written: dict) -> None:
        self._finish()
        self.progress.setValue(1)
        self.last_written = written
        lines = []
        for folder, files in written.items():
            lines.append(f"{folder}:")
            lines += [f"  {f}" for f in files]
        self.result.setPlainText("\n".join(lines))
        self.stage.setText("Done.")
        self.banner.show_message(f"Exported to {', '.join(written)}.", "success")
        self.exported.emit(written)

    def _failed(self, message: str, detail: str) -> None:
        self._finish()
        self.progress.setValue(0)
        self.stage.setText("")
        self.banner.show_message(f"Export failed: {message}", "error")
        self.failed.emit(message)
