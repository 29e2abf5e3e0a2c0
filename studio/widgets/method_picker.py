"""The Train page's method selector: training.method (sft | dpo | orpo | simpo | kto | grpo) and
the chosen method's own settings, written into the studio state like the form's fields.

Preference methods show their strength (preference.beta: DPO's and KTO's beta, ORPO's lambda,
SimPO's reward scale). GRPO shows its group, completion length, KL weight and reward functions:
a format regular expression, an exact match against a data column, a length penalty, and the
person's own Python file picked with a file dialog, with a sentence that says it runs their code.
Typed values go to the config as typed (numbers parsed when they parse): the engine's validation,
shown by the Train page, says what is wrong.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

# training.method's names (engine.train.objectives registers them; the window may not import the
# engine's training code, and tests/studio/test_methods_window.py checks the two agree).
METHODS = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")
PREFERENCE = ("dpo", "orpo", "simpo", "kto")
WHAT = {
    "sft": "Supervised fine-tuning: learn to give the answers in the data.",
    "dpo": "DPO: prefer the chosen answer over the rejected one, staying near the base model. Data: "
    "prompt / chosen / rejected.",
    "orpo": "ORPO: supervised learning on the chosen answer plus an odds-ratio penalty on the rejected one "
    "(no reference model). Data: prompt / chosen / rejected.",
    "simpo": "SimPO: a length-normalised preference margin, no reference model. Data: prompt / chosen / rejected.",
    "kto": "KTO: answers labelled good or bad, one at a time. Data: prompt / completion / label.",
    "grpo": "GRPO: the model samples a group of answers per prompt; the reward functions below score them "
    "and it learns from the better ones. Data: prompts (other columns go to the rewards).",
}
USER_CODE = (
    "This runs your own Python code: the file's reward(prompt, completion, **row) -> float is called in "
    "the training process, with your permissions, for every sampled completion."
)


def number(text: str):
    """An int or float when the text is one, else the text (the engine's validation explains)."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


class MethodPicker(QWidget):
    edited = Signal(str)  # the dotted path written

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.setObjectName("methodPicker")
        self.state = state
        self._loading = False
        self.box = QComboBox()
        self.box.setObjectName("methodBox")
        for name in METHODS:
            self.box.addItem(name, name)
        self.box.currentIndexChanged.connect(lambda _=None: self._method_chosen())
        self.what = QLabel("")
        self.what.setObjectName("methodWhat")
        self.what.setWordWrap(True)
        # Wraps into the width it is given: a long sentence must not widen the page (issue 28).
        self.what.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.what.setMinimumHeight(34)
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(QLabel("Method"))
        top.addWidget(self.box)
        top.addWidget(self.what, 1)

        # Preference methods: their strength.
        self.preference = QWidget()
        p_lay = QHBoxLayout(self.preference)
        p_lay.setContentsMargins(0, 0, 0, 0)
        self.beta = self._edit("preference.beta", "auto: 0.1 (2.0 for SimPO)")
        p_lay.addWidget(QLabel("beta"))
        p_lay.addWidget(self.beta)
        p_lay.addWidget(QLabel("how strongly the preference pulls (auto: 0.1, SimPO 2.0)"), 1)

        # GRPO: the group, the completions, the KL weight and the reward functions.
        self.grpo = QWidget()
        g = QGridLayout(self.grpo)
        g.setContentsMargins(0, 0, 0, 0)
        self.group_size = self._edit("grpo.group_size")
        self.max_new_tokens = self._edit("grpo.max_new_tokens")
        self.grpo_beta = self._edit("grpo.beta")
        for col, (label, edit) in enumerate(
            (("group size", self.group_size), ("max new tokens", self.max_new_tokens), ("KL beta", self.grpo_beta))
        ):
            g.addWidget(QLabel(label), 0, 2 * col)
            g.addWidget(edit, 0, 2 * col + 1)
        # Short labels (the page must fit a 1,280-px laptop screen); the full sentence is the tooltip.
        self.use_regex = QCheckBox("Format (regex)")
        self.use_regex.setToolTip("Format: a regular expression the whole completion matches")
        self.regex = QLineEdit(r"Answer: .+")
        self.use_exact = QCheckBox("Exact match")
        self.use_exact.setToolTip("Exact match against the column")
        self.exact_column = QLineEdit("answer")
        self.exact_pattern = QLineEdit(r"Answer: (.+)")
        self.exact_pattern.setToolTip("Optional: compare this regular expression's first group, not the whole text")
        self.use_length = QCheckBox("Length penalty")
        self.use_length.setToolTip("Length penalty above this many characters")
        self.max_chars = QLineEdit("200")
        self.use_python = QCheckBox("Your reward (.py)")
        self.use_python.setToolTip("Your own reward function (a Python file)")
        self.python_file = QLineEdit("")
        self.python_file.setObjectName("rewardFile")
        self.python_file.setPlaceholderText("a .py file defining reward(prompt, completion, **row) -> float")
        self.pick = QPushButton("Choose file…")
        self.pick.clicked.connect(self._pick_file)
        self.user_code = QLabel(USER_CODE)
        self.user_code.setObjectName("userCodeWarning")
        self.user_code.setWordWrap(True)
        self.user_code.setStyleSheet("color: #b9770e;")
        rows = [
            (self.use_regex, [self.regex]),
            (self.use_exact, [self.exact_column, self.exact_pattern]),
            (self.use_length, [self.max_chars]),
            (self.use_python, [self.python_file, self.pick]),
        ]
        for r, (check, edits) in enumerate(rows, start=1):
            g.addWidget(check, r, 0, 1, 2)
            check.toggled.connect(lambda _=None: self._rewards_edited())
            for c, w in enumerate(edits):
                g.addWidget(w, r, 2 + 2 * c, 1, 2)
                if isinstance(w, QLineEdit):
                    w.textEdited.connect(lambda _=None: self._rewards_edited())
        g.addWidget(self.user_code, len(rows) + 1, 0, 1, 6)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.preference)
        lay.addWidget(self.grpo)
        state.changed.connect(self._state_changed)
        self.load_from_state()

    def _edit(self, path: str, placeholder: str = "") -> QLineEdit:
        edit = QLineEdit()
        edit.setObjectName(f"field:{path}")
        edit.setPlaceholderText(placeholder)
        edit.setMaximumWidth(110)
        edit.textEdited.connect(lambda text, path=path: self._set(path, number(text)))
        return edit

    def _set(self, path: str, value) -> None:
        if self._loading:
            return
        self.state.set(path, value)
        self.edited.emit(path)

    # -- the method ---------------------------------------------------------------------------
    def method(self) -> str:
        return self.box.currentData()

    def set_method(self, name: str) -> None:
        self.box.setCurrentIndex(max(0, self.box.findData(name)))

    def _method_chosen(self) -> None:
        self._show_fields()
        if self._loading:
            return
        self._set("training.method", self.method())
        if self.method() == "grpo" and not self.state.get("grpo.rewards"):
            self.use_regex.setChecked(True)  # GRPO needs at least one reward: start with the format
            self._rewards_edited()

    def _show_fields(self) -> None:
        name = self.method()
        self.what.setText(WHAT.get(name, ""))
        self.preference.setVisible(name in PREFERENCE)
        self.grpo.setVisible(name == "grpo")
        self.user_code.setVisible(name == "grpo")

    # -- GRPO's rewards -------------------------------------------------------------------------
    def set_reward_file(self, path: str) -> None:
        """The user's reward file (what the file dialog gives): ticked and written to the config."""
        self.python_file.setText(path)
        self.use_python.setChecked(True)
        self._rewards_edited()

    def _pick_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Your reward function", "", "Python (*.py)")
        if path:
            self.set_reward_file(path)

    def rewards(self) -> list[dict]:
        """grpo.rewards as the ticked boxes say (RewardConfig's fields)."""
        out = []
        if self.use_regex.isChecked():
            out.append({"kind": "regex", "pattern": self.regex.text()})
        if self.use_exact.isChecked():
            out.append({"kind": "exact", "column": self.exact_column.text(), "pattern": self.exact_pattern.text()})
        if self.use_length.isChecked():
            out.append({"kind": "length", "max_chars": number(self.max_chars.text())})
        if self.use_python.isChecked():
            out.append({"kind": "python", "file": self.python_file.text().strip()})
        return out

    def _rewards_edited(self) -> None:
        self._set("grpo.rewards", self.rewards())

    # -- sync with the state (a preset or a loaded config) ----------------------------------------
    def _state_changed(self, path: str) -> None:
        if path == "" or path.split(".")[0] in ("preference", "grpo") or path == "training.method":
            self.load_from_state()

    def load_from_state(self) -> None:
        self._loading = True
        try:
            self.set_method(str(self.state.get("training.method")))
            for edit, path in (
                (self.beta, "preference.beta"),
                (self.group_size, "grpo.group_size"),
                (self.max_new_tokens, "grpo.max_new_tokens"),
                (self.grpo_beta, "grpo.beta"),
            ):
                text = str(self.state.get(path))
                if edit.text() != text and not edit.hasFocus():
                    edit.setText(text)
            rewards = list(self.state.get("grpo.rewards") or [])
            if rewards != self.rewards():
                kinds = {r.get("kind"): r for r in rewards}
                for check, kind in (
                    (self.use_regex, "regex"),
                    (self.use_exact, "exact"),
                    (self.use_length, "length"),
                    (self.use_python, "python"),
                ):
                    check.setChecked(kind in kinds)
                if "regex" in kinds:
                    self.regex.setText(kinds["regex"].get("pattern", ""))
                if "exact" in kinds:
                    self.exact_column.setText(kinds["exact"].get("column", ""))
                    self.exact_pattern.setText(kinds["exact"].get("pattern", ""))
                if "length" in kinds:
                    self.max_chars.setText(str(kinds["length"].get("max_chars", 200)))
                if "python" in kinds:
                    self.python_file.setText(kinds["python"].get("file", ""))
        finally:
            self._loading = False
        self._show_fields()
