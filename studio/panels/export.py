"""Export page: pick a run (its final adapter) or one of its checkpoints, and write the LoRA
adapter, a merged 16-bit model and/or a GGUF (with an Ollama Modelfile) to a folder. One checkbox
per kind in the engine's export registry (engine.api.EXPORTERS); the engine's `export_and_check`
runs them off the GUI thread (the same flow as `tunesmith export`): each artefact is loaded in its
own runtime and compared with the trained model before it is published, and the page shows the
verdict per artefact (verified, verified with a drop of X, or failed with the reason), the files
written and, for a GGUF, the `ollama create` command with a copy button. When the GGUF extra is
not installed, a button installs it (pip, in the background, its output shown as it comes)."""

from __future__ import annotations

from pathlib import Path

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
    GGUF_QUANTS,
    SelfCheckFailed,
    destinations,
    export_and_check,
    gguf_missing,
    install_gguf_extra,
    list_runs,
    read_export_report,
    run_folder_of,
)
from studio.panels.common import Banner, caption, card, title
from studio.tasks import run_task

# A run with no outcome whose metrics.jsonl changed this recently is taken as still running.
RUNNING_WINDOW_S = 300.0


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


def shown_status(run, active: str | None) -> str:
    """A run's status as the page shows it: "running" for the run being trained (or one whose
    metrics are still being written), not "incomplete"."""
    import time

    if run.status != "incomplete":
        return run.status
    if active and Path(active) == Path(run.path):
        return "running"
    try:
        recent = time.time() - (Path(run.path) / "metrics.jsonl").stat().st_mtime < RUNNING_WINDOW_S
    except OSError:
        recent = False
    return "running" if recent else "incomplete"


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
        self.want_gguf = self.wants.get("gguf")
        self.quant = QComboBox()
        self.quant.addItems(list(GGUF_QUANTS))
        self.quant.setToolTip("GGUF type: q8_0 is close to the 16-bit model, q4_k_m smaller with a stated drop")
        self.install_button = QPushButton("Install GGUF support…")
        self.install_button.setToolTip("pip install tunesmith[gguf] (builds llama-cpp-python: several minutes)")
        self.install_button.clicked.connect(self.install_gguf)
        self.gguf_note = caption("")
        self.verdicts = QTreeWidget()
        self.verdicts.setObjectName("exportVerdicts")
        self.verdicts.setHeaderLabels(["Artefact", "Self-check"])
        self.verdicts.setColumnWidth(0, 110)
        self.verdicts.setRootIsDecorated(False)
        self.verdicts.setWordWrap(True)
        self.verdicts.setMaximumHeight(150)
        self.ollama = QLineEdit()
        self.ollama.setReadOnly(True)
        self.ollama.setObjectName("ollamaCommand")
        self.ollama.setPlaceholderText("The `ollama create` command appears here after a GGUF export.")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setEnabled(False)
        self.copy_button.clicked.connect(self.copy_ollama)
        self.active_run: str | None = None
        state.run_dir_changed.connect(self._run_started)
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
        for name, box in self.wants.items():
            if name == "gguf":
                row = QHBoxLayout()
                row.addWidget(box, 1)
                row.addWidget(self.quant)
                row.addWidget(self.install_button)
                out_lay.addLayout(row)
                out_lay.addWidget(self.gguf_note)
            else:
                out_lay.addWidget(box)
        row = QHBoxLayout()
        row.addWidget(self.progress, 1)
        row.addWidget(self.export_button)
        out_lay.addLayout(row)
        out_lay.addWidget(self.stage)
        out_lay.addWidget(QLabel("<b>Self-check</b> (each artefact against the trained model)"))
        out_lay.addWidget(self.verdicts)
        row = QHBoxLayout()
        row.addWidget(self.ollama, 1)
        row.addWidget(self.copy_button)
        out_lay.addLayout(row)
        out_lay.addWidget(self.result, 1)

        lay = QVBoxLayout(self)
        lay.addWidget(
            title(
                "Export",
                "Write the adapter for PEFT, a merged model for transformers, or a GGUF for llama.cpp / Ollama; "
                "each is checked against the trained model before it is called done.",
            )
        )
        lay.addWidget(self.banner)
        cols = QHBoxLayout()
        cols.addWidget(runs, 3)
        cols.addWidget(out, 2)
        lay.addLayout(cols, 1)
        self.last_written: dict[str, list[str]] = {}
        self.last_verdicts: list[dict] = []
        self.update_gguf_availability()

    # -- runs -------------------------------------------------------------------------------
    def refresh(self, select: str | None = None) -> None:
        runs_dir = self.state.get("output.dir")
        self.runs_dir_label.setText(str(runs_dir))
        current = select or self.selected_source()
        self.tree.clear()
        chosen = None
        for run in list_runs(runs_dir):
            top = QTreeWidgetItem([run.name, shown_status(run, self.active_run), str(run.path)])
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
        self.ollama.clear()
        self.copy_button.setEnabled(False)
        self.export_button.setEnabled(False)
        self.progress.setRange(0, 0)
        self.stage.setText("Starting…")
        options = {"gguf": {"quant": self.quant.currentText()}} if "gguf" in kinds else {}
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
        gguf = outcome["extras"].get("gguf")
        if gguf:
            self.ollama.setText(gguf.get("ollama_command", ""))
            self.ollama.setCursorPosition(0)  # show "ollama create NAME" rather than the path's end
            self.copy_button.setEnabled(bool(self.ollama.text()))
            if not gguf.get("template_translated"):
                lines.append(
                    f"Modelfile: no TEMPLATE, the chat template cannot be translated ({gguf.get('template_reason')}); "
                    "Ollama falls back to the GGUF's own template."
                )
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

    def copy_ollama(self) -> None:
        QApplication.clipboard().setText(self.ollama.text())
        self.stage.setText("Copied the ollama command.")

    # -- the GGUF extra ---------------------------------------------------------------------
    def update_gguf_availability(self) -> None:
        if self.want_gguf is None:
            self.install_button.hide()
            self.quant.hide()
            return
        missing = gguf_missing()
        self.want_gguf.setEnabled(not missing)
        self.quant.setEnabled(not missing)
        self.install_button.setVisible(bool(missing))
        if missing:
            self.want_gguf.setChecked(False)
            self.gguf_note.setText(f"GGUF needs {', '.join(missing)}.")
        else:
            self.gguf_note.setText("")
        self.gguf_note.setVisible(bool(missing))

    def install_gguf(self) -> None:
        self.install_button.setEnabled(False)
        self.progress.setRange(0, 0)
        self.result.clear()
        self.stage.setText("Installing GGUF support (llama-cpp-python builds from source: several minutes)…")
        run_task(
            install_gguf_extra,
            owner=self,
            lane="export",
            on_done=self._installed,
            on_error=self._install_failed,
            on_progress=lambda line: self.result.appendPlainText(str(line)),
        )

    def _installed(self, _path) -> None:
        self.install_button.setEnabled(True)
        self.progress.setRange(0, 1)
        import importlib

        importlib.invalidate_caches()  # the new packages must be found without a restart
        self.update_gguf_availability()
        self.stage.setText("GGUF support installed." if not gguf_missing() else "")
        if gguf_missing():
            self.banner.show_message(f"GGUF support still lacks {', '.join(gguf_missing())}.", "warning")

    def _install_failed(self, message: str, detail: str) -> None:
        self.install_button.setEnabled(True)
        self.progress.setRange(0, 1)
        self.stage.setText("")
        self.banner.show_message(f"Installing GGUF support failed: {message}", "error")

    # -- the run in progress ----------------------------------------------------------------
    def _run_started(self, run_dir: str) -> None:
        self.active_run = str(run_dir)
        if self.isVisible():
            self.refresh()
