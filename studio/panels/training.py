"""Train page: presets, the hyperparameter form with the engine's validation next to each
field, the values hardware detection chose (marked "auto"), save/load of the resolved config
as YAML, the Train button, and what the last run's pre-flight measured (peak, step time, ETA,
and any setting it had to lower). The gallery's prompts are typed one per line in a box of
their own, the only place they are edited (training.gallery_prompts; a prompt may hold commas,
which a list field would split on). A step count above 0 wins over epochs: the epochs field says
so. `continue_from` sets the form up for a new run that starts from an earlier run's adapter
(the Runs page's "Continue with": GRPO after an SFT cold start, or any other method)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.api import AUTO, ConfigError, RunConfig, RunFolder
from studio import presets
from studio.config_form import ConfigForm
from studio.panels.common import Banner, caption, card, title
from studio.state import deep_merge
from studio.widgets.method_picker import WHAT, MethodPicker


class TrainingPanel(QWidget):
    train_requested = Signal()
    gate_changed = Signal(bool, str)  # Train allowed, and why not (or what it does)

    def __init__(self, state, settings, parent=None):
        super().__init__(parent)
        self.state, self.settings = state, settings
        self.banner = Banner()
        self.preset = QComboBox()
        self.preset.setObjectName("presetBox")
        self._presets = presets.list_presets()
        for name, path in self._presets.items():
            self.preset.addItem(name)
            tip = presets.describe(path)
            try:
                note = presets.dropout_note(presets.lora_dropout(presets.load_preset(path)))
            except Exception:  # an unreadable preset says so when applied
                note = ""
            self.preset.setItemData(self.preset.count() - 1, f"{tip} {note}".strip(), Qt.ItemDataRole.ToolTipRole)
        apply = QPushButton("Apply preset")
        apply.clicked.connect(lambda: self.apply_preset(self.preset.currentText()))
        save = QPushButton("Save config…")
        save.clicked.connect(self._save_dialog)
        load = QPushButton("Load config…")
        load.clicked.connect(self._load_dialog)
        self.train = QPushButton("Train")
        self.train.setObjectName("primary")
        self.train.setMinimumWidth(120)
        self.train.clicked.connect(self.train_requested)
        # Why Train is disabled, beside it (the window sets the model and data reasons).
        self.train_reason = QLabel("")
        self.train_reason.setObjectName("trainReason")
        self.train_reason.setWordWrap(True)
        self.train_reason.setMaximumWidth(420)
        self.train_reason.setStyleSheet("color: #c0392b;")
        self.train_reason.hide()
        self.blocker = ""  # the model or data reason Train is disabled for ("" when none)
        self._preflight_changes: list[str] = []  # the rehearsal's MemoryAdjusted messages
        self.running = False  # a run is in progress: Train stays disabled

        top = QHBoxLayout()
        top.addWidget(QLabel("Preset"))
        top.addWidget(self.preset)
        top.addWidget(apply)
        top.addStretch(1)
        top.addWidget(load)
        top.addWidget(save)
        top.addWidget(self.train)

        self.form = ConfigForm(state)
        self.form.edited.connect(lambda _p: self.validate())
        # training.method and the method's own settings (preference beta, GRPO's rewards).
        self.method = MethodPicker(state)
        self.method.edited.connect(lambda _p: self.validate())
        scroll = QScrollArea()
        scroll.setWidget(self.form)
        scroll.setWidgetResizable(True)

        side, side_lay = card()
        side_lay.addWidget(QLabel("<b>Chosen for this machine</b>"))
        side_lay.addWidget(caption("Fields left at auto are filled by hardware detection when the run starts."))
        self.auto_text = QPlainTextEdit()
        self.auto_text.setReadOnly(True)
        self.auto_text.setObjectName("autoText")
        side_lay.addWidget(self.auto_text, 1)
        self.summary = caption("")
        side_lay.addWidget(self.summary)
        # Filled by the run's measured pre-flight (show_preflight); the estimate above is a formula.
        self.preflight = caption("")
        self.preflight.setObjectName("preflightMeasured")
        self.preflight.hide()
        side_lay.addWidget(self.preflight)
        side_lay.addWidget(QLabel("<b>Gallery prompts</b>"))
        side_lay.addWidget(
            caption(
                "One per line: answered at every checkpoint (the Monitor's Gallery tab). Empty: up to "
                "'gallery examples' (Training section) of the held-out examples."
            )
        )
        self.gallery_prompts = QPlainTextEdit()
        self.gallery_prompts.setObjectName("galleryPrompts")
        self.gallery_prompts.setPlaceholderText("e.g. What is 12 plus 7?")
        self.gallery_prompts.setMaximumHeight(90)
        self.gallery_prompts.textChanged.connect(self._gallery_edited)
        side_lay.addWidget(self.gallery_prompts)
        self._load_gallery_prompts()

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(scroll)
        split.addWidget(side)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)

        lay = QVBoxLayout(self)
        lay.addWidget(
            title("Train", "Set the hyperparameters, or start from a preset. Hover a field for what it does.")
        )
        lay.addWidget(self.banner)
        lay.addLayout(top)
        # Why Train is off, on a row of its own: beside the buttons a long column name in it
        # widened the whole window past a laptop screen.
        lay.addWidget(self.train_reason, 0, Qt.AlignmentFlag.AlignRight)
        lay.addWidget(self.method)
        lay.addWidget(split, 1)

        state.changed.connect(self._state_changed)
        state.profile_changed.connect(lambda _p: self.validate())
        self.validate()

    # -- the measured pre-flight ------------------------------------------------------------
    def show_preflight(self, ev) -> None:
        """A PreflightResult (or a MemoryAdjusted of the rehearsal, which comes first): what the
        run measured before its first step, beside the formula's choices."""
        from studio.panels.common import fmt_bytes, fmt_seconds

        if getattr(ev, "kind", "") == "MemoryAdjusted":
            self._preflight_changes.append(ev.message)
            return
        if ev.peak_bytes and ev.mem_total:
            peak = f"peak {fmt_bytes(ev.peak_bytes)} of {fmt_bytes(ev.mem_total)}"
        else:
            peak = "peak not measured on a CPU"
        lines = [
            f"<b>Measured before step 1</b>: {peak}, {ev.step_seconds:.2f} s per step, "
            f"ETA {fmt_seconds(ev.eta_seconds)} ({ev.rows_per_micro_batch} rows × {ev.micro_batches_per_step} "
            f"per step, checkpointing {'on' if ev.gradient_checkpointing else 'off'}, offload {ev.offload})."
        ]
        lines += [f"Changed: {c}" for c in self._preflight_changes]
        self._preflight_changes = []
        self.preflight.setText("<br>".join(lines))
        self.preflight.setToolTip(ev.message)
        self.preflight.show()

    def clear_preflight(self) -> None:
        self._preflight_changes = []
        self.preflight.setText("")
        self.preflight.hide()

    # -- presets and files ------------------------------------------------------------------
    def apply_preset(self, name: str, quiet: bool = False) -> None:
        path = self._presets.get(name)
        if path is None:
            return
        try:
            data = presets.load_preset(path)
        except Exception as exc:
            self.banner.show_message(f"Cannot read preset {path}: {exc}", "error")
            return
        # Only the config's sections (a preset's stray top-level keys are ignored).
        sections = {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(self.state.data.get(k), dict)}
        merged = deep_merge(self.state.data, sections)
        self.state.replace(merged)
        self.preset.setCurrentText(name)
        note = presets.dropout_note(presets.lora_dropout(merged))
        if note:  # said even when quiet: it changes what the run can do
            self.banner.show_message(f"Preset '{name}' applied; your model and data are unchanged. {note}", "warning")
        elif not quiet:
            self.banner.show_message(f"Preset '{name}' applied; your model and data are unchanged.", "info")

    def save_config(self, path: str | Path) -> RunConfig:
        """Write the resolved config (auto values filled and listed in auto_fields)."""
        cfg = self.state.resolved()
        cfg.save(path)
        return cfg

    def load_config(self, path: str | Path) -> None:
        cfg = RunConfig.load(path)
        data = cfg.to_dict()
        # Values the hardware policy chose become "auto" again, so they follow this machine.
        data.pop("auto_reasons", None)
        for dotted in data.pop("auto_fields", []) or []:
            section, _, name = dotted.partition(".")
            if section in data and name in data[section]:
                data[section][name] = AUTO
        self.state.replace(data)

    def continue_from(self, adapter: str, method: str, label: str = "") -> bool:
        """A new run of `method` that starts from `adapter` (a run folder, its final adapter, or
        one of its checkpoints): the run's config (model, LoRA shape, settings) in the form, the
        method picked as the person would pick it (GRPO with no reward starts with the format
        one), `lora.init_adapter` set and a new run name. The data stays as it is: the person
        picks the method's data (the Data page checks it, and Train says why not while it
        cannot be read as that method's data)."""
        folder = RunFolder.of(adapter)
        label = label or method.upper()
        try:
            self.load_config(folder.config)
        except (ConfigError, OSError) as exc:
            self.banner.show_message(f"Cannot continue {folder.path.name}: {exc}", "error")
            return False
        self.state.set("lora.init_adapter", str(adapter))
        self.state.set("output.run_name", "auto")  # the earlier run's name is taken
        self.method.set_method(method)
        data = WHAT.get(method, "").partition("Data: ")[2].rstrip(".") or "instructions with their answers"
        self.banner.show_message(
            f"Continuing {folder.path.name} with {label}: the new run starts from its adapter ({adapter}) with its "
            f"model and settings. Choose {label}'s data on the Data page: {data}. The data is still "
            f"{self.state.get('data.source')}.",
            "info",
        )
        return True

    def _save_dialog(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save the run config", "run.yaml", "YAML (*.yaml *.yml)")
        if not path:
            return
        try:
            self.save_config(path)
        except (ConfigError, OSError) as exc:
            self.banner.show_message(f"Cannot save the config: {exc}", "error")
            return
        self.banner.show_message(f"Saved the resolved config to {path}.", "success")

    def _load_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load a run config", "", "YAML (*.yaml *.yml)")
        if not path:
            return
        try:
            self.load_config(path)
        except ConfigError as exc:
            self.banner.show_message(f"Cannot load {path}: {exc}", "error")
            return
        self.banner.show_message(f"Loaded {path}.", "success")

    # -- the gallery's prompts ---------------------------------------------------------------
    def gallery_prompt_list(self) -> list[str]:
        return [line.strip() for line in self.gallery_prompts.toPlainText().splitlines() if line.strip()]

    def _gallery_edited(self) -> None:
        prompts = self.gallery_prompt_list()
        if prompts != list(self.state.get("training.gallery_prompts") or []):
            self.state.set("training.gallery_prompts", prompts)

    def _load_gallery_prompts(self) -> None:
        prompts = list(self.state.get("training.gallery_prompts") or [])
        if prompts != self.gallery_prompt_list():
            self.gallery_prompts.blockSignals(True)
            self.gallery_prompts.setPlainText("\n".join(prompts))
            self.gallery_prompts.blockSignals(False)

    # -- validation -------------------------------------------------------------------------
    def _state_changed(self, path: str) -> None:
        if path in ("", "training.gallery_prompts", "training"):
            self._load_gallery_prompts()
        if path in ("", "training.gallery_prompts") or path in self.form.fields or path.startswith(("model.", "data.")):
            self.form.load_from_state()
            self.validate()

    def set_blocker(self, reason: str) -> None:
        """The model or data reason Train cannot start ("" when there is none)."""
        if reason != self.blocker:
            self.blocker = reason
            self.validate()

    def set_running(self, running: bool) -> None:
        self.running = running
        self.validate()

    def _show_gate(self, reason: str) -> None:
        allowed = not reason and not self.running
        self.train.setEnabled(allowed)
        if self.running:
            tip = "A run is in progress: see the Monitor page"
        else:
            tip = f"Fix this first: {reason}" if reason else "Start training with these settings"
        self.train.setToolTip(tip)
        self.train_reason.setText(reason)
        self.train_reason.setToolTip(reason)
        self.train_reason.setVisible(bool(reason))
        self.gate_changed.emit(allowed, tip)

    def validate(self) -> bool:
        exc = self.state.error()
        owned = self.form.show_error(exc)
        if exc is not None:
            self._show_gate(f"the config is not valid: {exc}")
            if not owned:
                self.banner.show_message(f"The config is not valid: {exc}", "error")
            self.auto_text.setPlainText("")
            return False
        self._show_gate(self.blocker)
        if self.banner.level == "error":
            self.banner.clear()
        self._show_auto()
        self._show_which_wins()
        return True

    def _show_which_wins(self) -> None:
        """max steps > 0 wins over epochs (the engine's rule): the epochs field says so, greyed with
        a note beside it, instead of keeping a value the run silently ignores."""
        epochs = self.form.fields.get("training.epochs")
        if epochs is None:
            return
        steps = self.state.get("training.max_steps")
        wins = isinstance(steps, int) and steps > 0
        epochs.editor.setEnabled(not wins)
        if wins:
            epochs.badge.setText(f"not used: {steps} steps win")
            epochs.badge.setToolTip(
                f"training.max_steps is {steps}, and a step count wins over epochs. Set steps to 0 to train by epochs."
            )
        epochs.badge.setVisible(wins)

    def _show_auto(self) -> None:
        if self.state.profile is None:
            self.auto_text.setPlainText("Detecting hardware…")
            return
        try:
            from engine.api import resolve_defaults

            # The whole resolution, not only the filled config: its notes and warnings show too.
            defaults = resolve_defaults(self.state.config(), self.state.profile)
            resolved, lines = defaults.config, defaults.explain()
        except Exception as exc:  # the policy must never take the form down
            self.auto_text.setPlainText(f"Cannot work out the defaults: {exc}")
            return
        self.form.mark_auto(resolved.to_dict(), list(resolved.auto_fields))
        self.auto_text.setPlainText("\n\n".join(lines) or "Nothing is automatic: every value was set by you.")
        t = resolved.training
        dropout = float(resolved.lora.dropout or 0.0)
        self.summary.setText(
            f"device {t.device} · {t.max_steps or f'{t.epochs:g} epoch(s)'} {'steps' if t.max_steps else ''} · "
            f"rows per micro-batch {t.rows_per_micro_batch} · grad accum {t.grad_accum}"
            + (f" · {presets.FUSED_LORA_OFF}" if dropout > 0 else "")
        )
        self.summary.setToolTip(presets.dropout_note(dropout))
