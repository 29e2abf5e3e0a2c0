"""Model page: choose the bundled demo, a local folder, or a Hub id, and see from the config
alone what it is, how much memory LoRA / QLoRA would need here, and which fast paths apply."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from studio import presets
from studio.model_report import OFFLINE_HINT, POPULAR_MODELS, for_this_machine, model_report
from studio.panels.common import Banner, caption, card, fmt_bytes, fmt_count, title, value_label
from studio.state import model_problems
from studio.tasks import cancel, run_task

VERDICT_STYLE = {"fits": "good", "tight": "warn", "will not fit": "bad", "needs CUDA": "bad", "—": "muted"}


class ModelPanel(QWidget):
    model_chosen = Signal(str)
    report_ready = Signal(object)

    def __init__(self, state, settings, parent=None):
        super().__init__(parent)
        self.state, self.settings = state, settings
        self.report = None
        self.problem = ""  # why the chosen model cannot be trained on ("" when it can)
        self._generation = 0
        self._reported_name = None  # the model the page's report and banner are about
        self._syncing = False

        self.banner = Banner()
        self.demo = QRadioButton("Bundled demo model (tiny, trains in seconds on a CPU)")
        self.local = QRadioButton("Local folder")
        self.hub = QRadioButton("Hugging Face Hub")
        group = QButtonGroup(self)
        for b in (self.demo, self.local, self.hub):
            group.addButton(b)
        self.folder = QLineEdit()
        self.folder.setPlaceholderText("A folder with config.json, *.safetensors and a tokenizer")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.hub_id = QComboBox()
        self.hub_id.setEditable(True)
        self.hub_id.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.hub_id.lineEdit().setPlaceholderText("owner/name")
        for repo, desc in POPULAR_MODELS:
            self.hub_id.addItem(repo)
            self.hub_id.setItemData(self.hub_id.count() - 1, desc, Qt.ItemDataRole.ToolTipRole)
        self.recent = QComboBox()
        self.recent.setPlaceholderText("Recent models")
        self.recent.textActivated.connect(self.choose)
        self.seq_len = QSpinBox()
        self.seq_len.setRange(64, 131072)
        self.seq_len.setSingleStep(256)
        self.seq_len.setToolTip("Tokens per packed training row (data.max_seq_len); memory estimates use it.")
        # While a Hub id is read: a busy bar and a Cancel (the read itself gives up after one
        # short try when offline; Cancel frees the page at once in any case).
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumHeight(10)
        self.busy.setTextVisible(False)
        self.busy.hide()
        self.cancel_read = QPushButton("Cancel")
        self.cancel_read.hide()
        self.cancel_read.clicked.connect(self._cancel_read)
        self.use = QPushButton("Use this model")
        self.use.setObjectName("primary")
        self.use.clicked.connect(self._use_clicked)

        src, src_lay = card()
        src_lay.addWidget(QLabel("<b>Source</b>"))
        src_lay.addWidget(self.demo)
        row = QHBoxLayout()
        row.addWidget(self.local)
        row.addWidget(self.folder, 1)
        row.addWidget(browse)
        src_lay.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(self.hub)
        row.addWidget(self.hub_id, 1)
        row.addWidget(self.busy)
        row.addWidget(self.cancel_read)
        src_lay.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(QLabel("Sequence length"))
        row.addWidget(self.seq_len)
        row.addSpacing(20)
        row.addWidget(self.recent, 1)
        row.addWidget(self.use)
        src_lay.addLayout(row)
        self.folder.textEdited.connect(lambda: self.local.setChecked(True))
        self.hub_id.lineEdit().textEdited.connect(lambda: self.hub.setChecked(True))
        self.hub_id.activated.connect(lambda: self.hub.setChecked(True))
        # A message about the previous source (a missing folder, ...) is stale once the source
        # is being changed; the next report re-sets it only if the new source has a problem.
        self.folder.textEdited.connect(self._source_edited)
        self.hub_id.lineEdit().textEdited.connect(self._source_edited)
        self.hub_id.activated.connect(self._source_edited)
        group.buttonToggled.connect(lambda _b, checked: checked and self._source_edited())

        # What the config says.
        info, info_lay = card()
        info_lay.addWidget(QLabel("<b>Model</b>"))
        form = QFormLayout()
        self.fields = {
            k: value_label() for k in ("name", "architecture", "params", "layers", "context", "shape", "lora")
        }
        for key, label in (
            ("name", "Model"),
            ("architecture", "Architecture"),
            ("params", "Parameters"),
            ("layers", "Layers"),
            ("context", "Context length"),
            ("shape", "Shape"),
            ("lora", "LoRA parameters"),
        ):
            form.addRow(label, self.fields[key])
        info_lay.addLayout(form)
        info_lay.addStretch(1)

        mem, mem_lay = card()
        self.mem_title = QLabel("<b>Memory estimate</b>")
        mem_lay.addWidget(self.mem_title)
        self.mem_grid = QGridLayout()
        self.vram_labels = {}
        for r, (mode, label) in enumerate((("lora16", "16-bit LoRA"), ("qlora4", "4-bit QLoRA"))):
            need, verdict = value_label(), QLabel("—")
            verdict.setObjectName("verdict")
            self.mem_grid.addWidget(QLabel(label), r, 0)
            self.mem_grid.addWidget(need, r, 1)
            self.mem_grid.addWidget(verdict, r, 2)
            self.vram_labels[mode] = (need, verdict)
        mem_lay.addLayout(self.mem_grid)
        self.device_label = caption()
        mem_lay.addWidget(self.device_label)

        fp, fp_lay = card()
        fp_lay.addWidget(QLabel("<b>Fast paths for this architecture</b>"))
        self.fast_paths = value_label("—")
        fp_lay.addWidget(self.fast_paths)
        fp_lay.addWidget(
            caption("Whether each one runs on this machine is the hardware policy's call: see Train and Hardware.")
        )
        fp_lay.addStretch(1)

        lay = QVBoxLayout(self)
        lay.addWidget(
            title("Model", "Pick the base model to fine-tune. Nothing is loaded yet: the numbers come from its config.")
        )
        lay.addWidget(self.banner)
        lay.addWidget(src)
        cols = QHBoxLayout()
        cols.addWidget(info, 1)
        right = QVBoxLayout()
        right.addWidget(mem)
        right.addWidget(fp, 1)
        cols.addLayout(right, 1)
        lay.addLayout(cols, 1)

        self._seq_timer = QTimer(self, singleShot=True, interval=300)
        self._seq_timer.timeout.connect(self.refresh)
        self.seq_len.valueChanged.connect(self._seq_changed)
        state.changed.connect(self._state_changed)
        state.profile_changed.connect(lambda _p: self.refresh())
        self._sync_from_state()
        self._fill_recent()

    # -- choosing ---------------------------------------------------------------------------
    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a model folder", self.folder.text())
        if folder:
            self.folder.setText(folder)
            self.local.setChecked(True)
            self.choose(folder)

    def _use_clicked(self) -> None:
        if self.demo.isChecked():
            self.choose("demo")
        elif self.local.isChecked():
            text = self.folder.text().strip()
            if not text:
                self.banner.show_message("Type or browse to a model folder first.", "warning")
                return
            self.choose(text)
        else:
            text = self.hub_id.currentText().strip()
            if not text:
                self.banner.show_message("Type a Hub id such as Qwen/Qwen2.5-0.5B-Instruct.", "warning")
                return
            self.choose(text)

    def choose(self, name_or_path: str) -> None:
        self.state.set("model.name_or_path", name_or_path)
        self._sync_from_state()
        self.refresh()
        self.model_chosen.emit(name_or_path)

    def _source_edited(self, *_args) -> None:
        if not self._syncing:
            self.banner.clear()

    def _sync_from_state(self) -> None:
        self._syncing = True
        try:
            self._sync_radio_and_fields()
        finally:
            self._syncing = False

    def _sync_radio_and_fields(self) -> None:
        name = self.state.get("model.name_or_path")
        if name == "demo":
            self.demo.setChecked(True)
        elif "/" in name and not name.startswith(("/", ".", "~")) and name.count("/") == 1 and not _exists(name):
            self.hub.setChecked(True)
            self.hub_id.setEditText(name)
        else:
            self.local.setChecked(True)
            self.folder.setText(name)
        self.seq_len.blockSignals(True)
        self.seq_len.setValue(int(self.state.get("data.max_seq_len")))
        self.seq_len.blockSignals(False)

    def _fill_recent(self) -> None:
        self.recent.clear()
        self.recent.addItems(self.settings.recent_models())

    def _seq_changed(self, value: int) -> None:
        self.state.set("data.max_seq_len", int(value))
        self._seq_timer.start()

    def _state_changed(self, path: str) -> None:
        if (path in ("", "lora.dropout") or path.startswith("fast_paths")) and self.report is not None:
            self._show_fast_paths(self.report)
        if path in ("", "model.name_or_path", "data.max_seq_len", "lora.r"):
            self._sync_from_state()
            if path != "data.max_seq_len" or not self._seq_timer.isActive():
                self._seq_timer.start()

    # -- report -----------------------------------------------------------------------------
    def refresh(self) -> None:
        self._seq_timer.stop()  # this read covers what a pending timer would have asked for
        self._generation += 1
        gen = self._generation
        name = self.state.get("model.name_or_path")
        if name != self._reported_name:
            # A new model: nothing said about the previous one stays up while this one is read.
            self._reported_name = name
            self.banner.clear()
            self._clear_estimates()
        self.fields["name"].setText(f"{name}  <i>(reading config…)</i>")
        self._set_reading(not _is_local_name(name))
        try:
            r = int(self.state.get("lora.r"))
            seq = int(self.state.get("data.max_seq_len"))
        except (TypeError, ValueError):
            r, seq = 16, 512
        run_task(
            model_report,
            name,
            seq,
            max(1, r),
            self.state.profile,
            owner=self,
            # A Hub lookup can retry for most of a minute offline: it must not hold up a local folder.
            lane="model" if _is_local_name(name) else "hub",
            key="model.report",
            # huggingface_hub's retries cannot be told to stop: Cancel lets the read go, and the
            # next read runs on a fresh thread instead of queueing behind it.
            interruptible=False,
            on_done=lambda rep: self._show(gen, rep),
            on_error=lambda msg, _d: self._fail(gen, name, msg),
        )

    def _set_reading(self, on: bool) -> None:
        self.busy.setVisible(on)
        self.cancel_read.setVisible(on)

    def _cancel_read(self) -> None:
        """Stop waiting for the Hub: the answer, when it comes, is ignored."""
        self._generation += 1
        cancel("model.report")
        self._set_reading(False)
        name = self.state.get("model.name_or_path")
        self.report = None
        self.problem = f"Reading '{name}' was cancelled."
        self.fields["name"].setText(f"{name}  <i>(cancelled)</i>")
        self.banner.show_message(f"Stopped reading '{name}' from the Hub. {OFFLINE_HINT}", "warning")
        self.report_ready.emit(None)

    def _fail(self, gen: int, name: str, message: str) -> None:
        if gen != self._generation:
            return
        self._set_reading(False)
        self.report = None
        self.problem = message
        self.banner.show_message(message, "error")
        self.fields["name"].setText(name)
        for k in ("architecture", "params", "layers", "context", "shape", "lora"):
            self.fields[k].setText("—")
        self._clear_estimates()
        self.report_ready.emit(None)

    def _clear_estimates(self) -> None:
        """Memory badges and fast paths back to "—": they described another model."""
        self.mem_title.setText("<b>Memory estimate</b>")
        for need, verdict in self.vram_labels.values():
            need.setText("—")
            verdict.setText("—")
            verdict.setProperty("tone", VERDICT_STYLE["—"])
            verdict.style().unpolish(verdict)
            verdict.style().polish(verdict)
        self.device_label.setText("")
        self.fast_paths.setText("—")
        self.fast_paths.setToolTip("")

    def _show(self, gen: int, rep: dict) -> None:
        if gen != self._generation:
            return  # a newer choice superseded this one
        self._set_reading(False)
        self.report = rep
        problems = model_problems(dict(self.state.get("model")))
        self.problem = "; ".join(problems)
        if problems:
            self.banner.show_message(f"This model cannot be trained on: {self.problem}.", "error")
        else:
            self.banner.clear()
        info = rep["info"]
        self.settings.add_recent_model(rep["name"])
        self._fill_recent()
        self.fields["name"].setText(rep["name"])
        self.fields["architecture"].setText(f"{info.architecture or '—'}  ({info.model_type})")
        params = fmt_count(info.num_params)
        if info.is_moe:
            params += (
                f"  ({fmt_count(info.active_params)} active per token, {info.num_experts} experts, "
                f"top-{info.experts_per_token})"
            )
        self.fields["params"].setText(params)
        self.fields["layers"].setText(str(info.num_layers))
        self.fields["context"].setText(f"{info.context_length:,} tokens" if info.context_length else "—")
        self.fields["shape"].setText(
            f"hidden {info.hidden_size}, heads {info.num_heads}/{info.num_kv_heads} (q/kv), vocab {info.vocab_size:,}"
        )
        self.fields["lora"].setText(
            f"{fmt_count(rep['lora_params'])} at rank {self.state.get('lora.r')} (all linear layers)"
        )
        self.mem_title.setText(f"<b>Memory estimate</b> at {rep['seq_len']} tokens per row")
        for row in rep["vram"]:
            need, verdict = self.vram_labels[row["mode"]]
            need.setText(fmt_bytes(row["bytes"]))
            # No verdict for a model that cannot load: "fits" would say it is ready.
            text = "—" if problems else row["verdict"]
            verdict.setText(text)
            verdict.setProperty("tone", VERDICT_STYLE.get(text, "muted"))
            verdict.style().unpolish(verdict)
            verdict.style().polish(verdict)
        if self.state.profile is None:
            self.device_label.setText("Detecting hardware…")
        elif "CPU" in rep["device"]:
            self.device_label.setText(
                f"vs {rep['device']}: {fmt_bytes(rep['device_total'])} available. "
                "Training runs on the CPU, slowly: fine for the demo model."
            )
        else:
            self.device_label.setText(f"vs {rep['device']}: {fmt_bytes(rep['device_total'])}")
        self._show_fast_paths(rep)
        self.report_ready.emit(rep)

    def _show_fast_paths(self, rep: dict) -> None:
        fps = rep["fast_paths"]
        if self.state.profile is None:
            # What runs depends on the machine: without its profile "on" could be wrong (a CPU
            # runs the references), so nothing is claimed until the hardware is known.
            self.fast_paths.setText("Detecting hardware…")
            return
        if fps is None:
            self.fast_paths.setText("The engine does not report fast paths for this architecture yet.")
            return
        try:
            dropout = float(self.state.get("lora.dropout") or 0.0)
        except (TypeError, ValueError):
            dropout = 0.0
        fps = presets.with_dropout(fps, dropout)
        fps = for_this_machine(fps, self.state.profile, dict(self.state.get("fast_paths") or {}))
        lines = [f"{'✓' if v.startswith(('on', 'applies')) else '–'} <b>{k}</b>: {v}" for k, v in fps.items()]
        self.fast_paths.setText("<br>".join(lines) or "none")
        self.fast_paths.setToolTip(presets.dropout_note(dropout))


def _is_local_name(name: str) -> bool:
    """The demo or a path: read from disk, never from the Hub."""
    return name == "demo" or name.startswith(("/", ".", "~")) or name.count("/") != 1 or _exists(name)


def _exists(name: str) -> bool:
    from pathlib import Path

    return Path(name).expanduser().exists()
