"""A form generated from the engine's config dataclasses: one editor per field, the engine's own
validation message under the field it names, and an "auto" badge on values the hardware
policy chose.

Numbers are typed into line edits rather than spin boxes on purpose: the engine, not the
widget, decides what is valid, so a person sees the same message the CLI would print.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Literal, Union

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QGridLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QVBoxLayout,
    QWidget,
)

from engine.api import AUTO, RunConfig
from studio.field_help import HELP, SECTION_TITLES, label

# Fields edited on other pages (Model, Data: its thinking switch too), by the Train page's method selector
# (studio.widgets.method_picker) or its gallery box (one prompt per line), or not meant for a form.
SKIP = {
    "model.name_or_path",
    "data.source",
    "data.format",
    "data.columns",
    "data.thinking",
    "training.method",
    "training.gallery_prompts",
}
SECTIONS = ["training", "lora", "data", "model", "fast_paths", "output"]


def _kind(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "bool"
    if origin is Literal:
        return "choice"
    if origin is Union:
        plain = [a for a in args if typing.get_origin(a) is not Literal]
        if plain == [bool]:
            return "auto_bool"
        if plain and typing.get_origin(plain[0]) is list:
            return "list"
        return "text"
    if origin is dict:
        return "skip"
    if origin is list:
        return "list"
    return "text"


def _parse(text: str, tp) -> Any:
    """Turn typed text into the value the engine expects; leave it a string when unsure so
    the engine's validation explains the problem."""
    text = text.strip()
    args = typing.get_args(tp)
    numeric = [a for a in (args or (tp,)) if a in (int, float)]
    if text == AUTO and typing.get_origin(tp) is Union:
        return text
    for a in numeric:
        try:
            return a(text) if a is int else float(text)
        except ValueError:
            continue
    return text


class _Field:
    def __init__(self, path: str, tp, editor: QWidget, get: Callable[[], Any], put: Callable[[Any], None]):
        self.path, self.tp, self.editor, self.get, self.put = path, tp, editor, get, put
        self.error = QLabel()
        self.error.setObjectName("fieldError")
        self.error.setWordWrap(True)
        self.error.hide()
        self.badge = QLabel("auto")
        self.badge.setObjectName("autoBadge")
        self.badge.hide()


class ConfigForm(QWidget):
    edited = Signal(str)

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.fields: dict[str, _Field] = {}
        self._loading = False
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        hints = typing.get_type_hints(RunConfig)
        for section in SECTIONS:
            group = QGroupBox(SECTION_TITLES.get(section, section))
            grid = QGridLayout(group)
            grid.setColumnStretch(1, 1)
            grid.setHorizontalSpacing(10)
            row = 0
            cls = hints[section]
            sub_hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                path = f"{section}.{f.name}"
                tp = sub_hints[f.name]
                if path in SKIP or _kind(tp) == "skip":
                    continue
                field = self._make(path, tp)
                # Words on the label, the config key (what YAML and the CLI use) in the tooltip.
                name = QLabel(label(path))
                tip = HELP.get(path, "")
                for w in (name, field.editor):
                    w.setToolTip(f"<b>{path}</b><br>{tip}" if tip else path)
                grid.addWidget(name, row, 0)
                grid.addWidget(field.editor, row, 1)
                grid.addWidget(field.badge, row, 2)
                grid.addWidget(field.error, row + 1, 1, 1, 2)
                row += 2
                self.fields[path] = field
            lay.addWidget(group)
        self.load_from_state()

    # -- editors ----------------------------------------------------------------------------
    def _make(self, path: str, tp) -> _Field:
        kind = _kind(tp)
        if kind == "bool":
            w = QCheckBox()
            field = _Field(path, tp, w, w.isChecked, lambda v: w.setChecked(bool(v)))
            w.toggled.connect(lambda _=None: self._commit(path))
        elif kind in ("choice", "auto_bool"):
            w = QComboBox()
            options = list(typing.get_args(tp)) if kind == "choice" else [AUTO, True, False]
            for opt in options:
                w.addItem(str(opt).lower() if isinstance(opt, bool) else str(opt), opt)
            field = _Field(path, tp, w, w.currentData, lambda v: w.setCurrentIndex(max(0, w.findData(v))))
            w.currentIndexChanged.connect(lambda _=None: self._commit(path))
        elif kind == "list":
            w = QLineEdit()

            def get_list(w=w):
                text = w.text().strip()
                if text == "all-linear":
                    return text
                return [p.strip() for p in text.split(",") if p.strip()]

            field = _Field(path, tp, w, get_list, lambda v: w.setText(v if isinstance(v, str) else ", ".join(v)))
            w.editingFinished.connect(lambda: self._commit(path))
        else:
            w = QLineEdit()
            field = _Field(path, tp, w, lambda w=w, tp=tp: _parse(w.text(), tp), lambda v: w.setText(_fmt(v)))
            # textEdited (not textChanged): only a person's typing commits, not load_from_state.
            w.textEdited.connect(lambda _=None: self._commit(path))
        w.setObjectName(f"field:{path}")
        return field

    def _commit(self, path: str) -> None:
        if self._loading:
            return
        self.state.set(path, self.fields[path].get())
        self.edited.emit(path)

    # -- sync with state --------------------------------------------------------------------
    def load_from_state(self) -> None:
        self._loading = True
        try:
            for path, field in self.fields.items():
                try:
                    value = self.state.get(path)
                except KeyError:
                    continue
                if field.get() != value:
                    field.put(value)
        finally:
            self._loading = False

    def show_error(self, exc) -> bool:
        """Show a ConfigError under its field; False when no field here owns the path."""
        owned = False
        for path, field in self.fields.items():
            hit = exc is not None and (exc.path == path or exc.path.startswith(path + "["))
            field.error.setVisible(hit)
            field.editor.setProperty("invalid", hit)
            field.editor.style().unpolish(field.editor)
            field.editor.style().polish(field.editor)
            if hit:
                field.error.setText(str(exc).split(": ", 1)[-1])
                owned = True
        return owned

    def mark_auto(self, resolved: dict[str, Any], auto_fields: list[str]) -> None:
        for path, field in self.fields.items():
            on = path in auto_fields
            field.badge.setVisible(on)
            if on:
                value = _lookup(resolved, path)
                field.badge.setText(f"auto → {_fmt(value)}")
                field.badge.setToolTip("Chosen by hardware detection for this machine; type a value to override.")

    def error_text(self, path: str) -> str:
        field = self.fields[path]
        return field.error.text() if field.error.isVisibleTo(self) else ""


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _lookup(data: dict, path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
