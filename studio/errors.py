"""Last-resort error reporting: an uncaught exception anywhere (GUI thread, pool thread,
worker thread) becomes a readable dialog and a line in the log, never a silent console
traceback or a dead window."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Callable, Optional

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QMessageBox, QWidget


class _Bridge(QObject):
    # Exceptions on other threads are marshalled to the GUI thread through this signal.
    report = Signal(str, str)


class ErrorReporter:
    def __init__(self, parent: Optional[QWidget] = None, log: Optional[Callable[[str, str], None]] = None):
        self.parent = parent
        self.log = log
        self.dialogs: list[QMessageBox] = []
        self._bridge = _Bridge()
        self._bridge.report.connect(self.show, Qt.ConnectionType.QueuedConnection)
        self._previous = None

    def install(self) -> None:
        self._previous = (sys.excepthook, threading.excepthook)
        sys.excepthook = self._sys_hook
        threading.excepthook = self._thread_hook

    def uninstall(self) -> None:
        if self._previous:
            sys.excepthook, threading.excepthook = self._previous
            self._previous = None

    def _sys_hook(self, exc_type, exc, tb) -> None:
        detail = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(detail)
        self._bridge.report.emit(_summary(exc), detail)

    def _thread_hook(self, args) -> None:
        if args.exc_type is SystemExit:
            return
        self._sys_hook(args.exc_type, args.exc_value, args.exc_traceback)

    def show(self, message: str, detail: str = "") -> QMessageBox:
        if self.log:
            self.log(f"Unexpected error: {message}", "error")
        box = QMessageBox(self.parent)
        box.setIcon(QMessageBox.Icon.Critical)
        box.setWindowTitle("Tunesmith: something went wrong")
        box.setText(f"<b>{message}</b>")
        box.setInformativeText(
            "The studio is still running. If this keeps happening, the details below help a bug report."
        )
        box.setDetailedText(detail)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.setModal(False)  # never block the window (or a test) behind a dialog
        box.finished.connect(lambda _r, b=box: self.dialogs.remove(b) if b in self.dialogs else None)
        self.dialogs.append(box)
        box.show()
        return box


def _summary(exc) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    if isinstance(exc, MemoryError):
        return "Out of memory. Close other programs or choose a smaller model or shorter rows."
    return f"{name}: {text}" if text else name
