"""Small layout helpers shared by the panels (titles, captions, key/value grids)."""

from __future__ import annotations

from typing import Iterable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QFrame, QLabel, QVBoxLayout, QWidget

from studio.widgets.banner import Banner


def title(text: str, subtitle: str = "") -> QWidget:
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 6)
    head = QLabel(text)
    head.setObjectName("pageTitle")
    lay.addWidget(head)
    if subtitle:
        sub = QLabel(subtitle)
        sub.setObjectName("caption")
        sub.setWordWrap(True)
        lay.addWidget(sub)
    return box


def caption(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setObjectName("caption")
    label.setWordWrap(True)
    return label


def value_label(text: str = "—") -> QLabel:
    label = QLabel(text)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.setWordWrap(True)
    return label


def card(name: str = "card") -> tuple[QFrame, QVBoxLayout]:
    frame = QFrame()
    frame.setObjectName(name)
    lay = QVBoxLayout(frame)
    lay.setContentsMargins(12, 10, 12, 10)
    return frame, lay


def form_rows(form: QFormLayout, rows: Iterable[tuple[str, QWidget]]) -> None:
    for label, widget in rows:
        form.addRow(label, widget)


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def fmt_count(n) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{int(n)}"


def fmt_seconds(s) -> str:
    if s is None or s != s or s < 0:
        return "—"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


__all__ = ["Banner", "title", "caption", "value_label", "card", "form_rows", "fmt_bytes", "fmt_count", "fmt_seconds"]
