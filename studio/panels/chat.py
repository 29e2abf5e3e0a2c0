"""Chat page: talk to the result. Load a run's adapter onto its base model and compare the
fine-tuned reply with the base model's for the same prompt (greedy decoding, so the two
differ only by the adapter).

A run's best checkpoint by eval loss is listed first, labelled with its eval loss and step.
While a run in this window is paused, the first entry is "Talk to step N (paused)": the
session's own model answers on the training device, through the worker's probe on a pool
thread; it changes nothing the run trains with, so resuming stays exact.

Loading a model and generating cannot be interrupted inside transformers: Cancel lets the call go
(studio.tasks, interruptible=False), so the page is free at once, its answer is dropped, and the
next Load or Generate does not wait for it.

Tools… offers the model tool definitions from a JSON file (the form a training row's `tools`
column has): the chat template writes them into the prompt as training did, so a model fine-tuned
on tool calls can be asked to make one. The paused run's probe answers without them."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.api import ChatError, list_runs, load_tools, template_uses_tools, tool_name
from studio import chat_backend, tasks
from studio.panels.common import Banner, caption, card, title
from studio.tasks import run_task

# The source combo's data for the paused run's live weights.
PROBE = "probe:"
# The key of the page's one task (a load, a generation or a probe): a new one supersedes it.
TASK = "chat"


class ChatPanel(QWidget):
    replied = Signal(dict)

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.model = None
        self._loaded_source = None
        self._probe = None  # the worker's probe(prompt, max_new_tokens) while a run is paused
        self.probe_step = None
        self.banner = Banner()
        self.source = QComboBox()
        self.source.setObjectName("chatSource")
        self.source.setMinimumWidth(360)
        refresh = QPushButton("Refresh")
        refresh.clicked.connect(self.refresh)
        self.load_button = QPushButton("Load")
        self.load_button.clicked.connect(self.load_model)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop waiting: what the model is doing is dropped when it ends")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.hide()
        self.loaded = caption("Nothing loaded.")
        self.prompt = QPlainTextEdit()
        self.prompt.setObjectName("chatPrompt")
        self.prompt.setPlaceholderText("Type a prompt, e.g. What is 12 plus 7?")
        self.prompt.setMaximumHeight(90)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 4096)
        self.max_tokens.setValue(48)
        self.tools = None  # tool definitions offered to the model (load_tools), None: none
        self.tools_button = QPushButton("Tools…")
        self.tools_button.setToolTip(
            "Offer the model tool definitions from a JSON file (a list of OpenAI-style tools, as a data set's "
            "tools column): its chat template writes them into the prompt, as in training"
        )
        self.tools_button.clicked.connect(self._pick_tools)
        self.clear_tools_button = QPushButton("No tools")
        self.clear_tools_button.clicked.connect(self.clear_tools)
        self.clear_tools_button.hide()
        self.tools_label = caption("")
        self.tools_label.hide()
        self.with_base = QCheckBox("Compare with the base model")
        self.with_base.setChecked(True)
        self.send = QPushButton("Generate")
        self.send.setObjectName("primary")
        self.send.clicked.connect(self.generate)
        self.tuned = QPlainTextEdit()
        self.tuned.setReadOnly(True)
        self.tuned.setObjectName("tunedReply")
        self.base = QPlainTextEdit()
        self.base.setReadOnly(True)
        self.base.setObjectName("baseReply")

        row = QHBoxLayout()
        row.addWidget(QLabel("Adapter"))
        row.addWidget(self.source, 1)
        row.addWidget(refresh)
        row.addWidget(self.load_button)
        ask = QHBoxLayout()
        ask.addWidget(QLabel("Max new tokens"))
        ask.addWidget(self.max_tokens)
        ask.addWidget(self.with_base)
        ask.addWidget(self.tools_button)
        ask.addWidget(self.clear_tools_button)
        ask.addStretch(1)
        ask.addWidget(self.cancel_button)
        ask.addWidget(self.send)
        replies = QHBoxLayout()
        for label, box in (("<b>Fine-tuned</b>", self.tuned), ("<b>Base model</b>", self.base)):
            c, c_lay = card()
            c_lay.addWidget(QLabel(label))
            c_lay.addWidget(box, 1)
            replies.addWidget(c, 1)

        lay = QVBoxLayout(self)
        lay.addWidget(title("Chat", "Try the fine-tuned model on your own prompts, side by side with the base model."))
        lay.addWidget(self.banner)
        lay.addLayout(row)
        lay.addWidget(self.loaded)
        lay.addWidget(self.prompt)
        lay.addLayout(ask)
        lay.addWidget(self.tools_label)
        lay.addLayout(replies, 1)
        self._busy = False
        self.source.currentIndexChanged.connect(lambda _i: self._set_busy(self._busy))
        self._set_busy(False)

    def refresh(self, select: str | None = None) -> None:
        current = select or self.source.currentData()
        self.source.clear()
        if self._probe is not None:
            self.source.addItem(f"Talk to step {self.probe_step} (paused) — the run's current weights", PROBE)
        for run in list_runs(self.state.get("output.dir")):
            # The best checkpoint by eval loss comes first (RunInfo.sources), then the final adapter.
            for label, path in run.sources():
                self.source.addItem(f"{run.name} — {label}", str(path))
        if current:
            i = self.source.findData(str(current))
            if i < 0 and select:
                # A run folder without a final adapter (stopped): its newest checkpoint.
                i = next((j for j in range(self.source.count()) if _inside(self.source.itemData(j), str(select))), -1)
            if i >= 0:
                self.source.setCurrentIndex(i)
        self._set_busy(False)

    # -- the live probe of a paused run ------------------------------------------------------
    def set_probe(self, probe, step: int) -> None:
        """The run is paused at `step`: offer its current weights first (and select them)."""
        self._probe, self.probe_step = probe, int(step)
        self.refresh(select=PROBE)
        self.loaded.setText(
            f"The run is paused at step {step}: its current weights answer here, on the training device "
            "(greedy). Resume continues the run exactly as if it had not been asked."
        )

    def clear_probe(self) -> None:
        if self._probe is None:
            return
        self._probe, self.probe_step = None, None
        self.refresh()
        if self.model is None:
            self.loaded.setText("Nothing loaded.")

    # -- tools offered to the model ----------------------------------------------------------
    def _pick_tools(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Tool definitions", "", "JSON (*.json);;All files (*)")
        if path:
            self.set_tools_file(path)

    def set_tools_file(self, path: str) -> bool:
        """Offer the tools of `path` with every later prompt; a bad file is named in the banner and
        the tools offered before stay."""
        try:
            tools = load_tools(path)
        except ChatError as exc:
            self.banner.show_message(f"Tools not loaded: {exc}", "error")
            return False
        self.banner.clear()
        self.tools = tools
        names = ", ".join(tool_name(t) for t in tools)
        self.tools_label.setText(f"Tools offered to the model: {names} (from {path})")
        self.tools_label.show()
        self.clear_tools_button.show()
        self._warn_unused_tools()
        return True

    def clear_tools(self) -> None:
        self.tools = None
        self.tools_label.hide()
        self.clear_tools_button.hide()

    def _warn_unused_tools(self) -> None:
        if self.tools and self.model is not None and not template_uses_tools(self.model.tokenizer):
            self.banner.show_message(
                f"{self.model.base_name}'s chat template has no tools: they are not in the prompt.", "warning"
            )

    def _set_busy(self, busy: bool, what: str = "") -> None:
        self._busy = busy
        self.cancel_button.setVisible(busy)
        self.load_button.setEnabled(not busy and self.source.count() > 0 and self.source.currentData() != PROBE)
        self.send.setEnabled(not busy and self.source.count() > 0)
        if what:
            self.loaded.setText(what)

    def load_model(self, then_generate: bool = False) -> None:
        source = self.source.currentData()
        if not source:
            self.banner.show_message("Train a run first: there is no adapter to load.", "warning")
            return
        self.banner.clear()
        self._set_busy(True, f"Loading the base model and the adapter from {source}…")

        def done(model):
            self.model, self._loaded_source = model, source
            self._set_busy(False, f"Loaded {model.base_name} + adapter {model.adapter_dir} on {model.device}.")
            self._warn_unused_tools()
            if then_generate:
                self.generate()

        self._run(chat_backend.load_chat_model, source, on_done=done)

    def generate(self) -> None:
        prompt = self.prompt.toPlainText().strip()
        if not prompt:
            self.banner.show_message("Type a prompt first.", "warning")
            return
        if self.source.currentData() == PROBE:
            self._ask_probe(prompt)
            return
        if self.model is None or self._loaded_source != self.source.currentData():
            self.load_model(then_generate=True)
            return
        self._set_busy(True, "Generating…")
        self.tuned.setPlainText("…")
        self.base.setPlainText("…" if self.with_base.isChecked() else "")
        self._run(
            chat_backend.compare,
            self.model,
            prompt,
            self.max_tokens.value(),
            self.with_base.isChecked(),
            self.tools,
            on_done=self._replied,
        )

    def _ask_probe(self, prompt: str) -> None:
        if self._probe is None:
            self.banner.show_message("The run is no longer paused: pause it to talk to its current weights.", "warning")
            return
        self.banner.clear()
        self._set_busy(True, f"Step {self.probe_step} is answering…")
        self.tuned.setPlainText("…")
        self.base.setPlainText("(the base model is not loaded while talking to a paused run)")
        self._run(self._probe, prompt, self.max_tokens.value(), on_done=self._probed)

    def _run(self, fn, *args, on_done) -> None:
        """The page's one task, in the chat lane; Cancel lets it go (see the module)."""
        run_task(
            fn, *args, owner=self, lane="chat", key=TASK, interruptible=False, on_done=on_done, on_error=self._failed
        )

    def cancel(self) -> None:
        """Stop waiting for the load or the reply now; whatever it returns later is dropped."""
        if not tasks.cancel(TASK) and not self._busy:
            return
        for box in (self.tuned, self.base):
            if box.toPlainText() == "…":
                box.setPlainText("(cancelled)")
        after = (
            "Nothing loaded."
            if self.model is None
            else f"Loaded {self.model.base_name} + adapter {self.model.adapter_dir}."
        )
        self._set_busy(False, f"Cancelled. {after}")

    def _probed(self, result) -> None:
        step, reply = result
        self._set_busy(False, f"Step {step} (paused) answered with the run's current weights.")
        self.tuned.setPlainText(reply)
        self.replied.emit({"tuned": reply, "base": None, "step": step})

    def _replied(self, result: dict) -> None:
        self._set_busy(False, f"Loaded {self.model.base_name} + adapter {self.model.adapter_dir}.")
        self.tuned.setPlainText(result["tuned"])
        self.base.setPlainText(result["base"] if result["base"] is not None else "(not asked)")
        self.replied.emit(result)

    def _failed(self, message: str, detail: str) -> None:
        self._set_busy(False, "Nothing loaded." if self.model is None else self.loaded.text())
        self.banner.show_message(f"Chat failed: {message}", "error")


def _inside(path: str, folder: str) -> bool:
    from pathlib import Path

    return Path(folder) in Path(path).parents or Path(path) == Path(folder)
