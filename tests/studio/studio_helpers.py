"""Helpers shared by the studio tests (imported by name; tests/studio is on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
# Every test run keeps its screenshots in artifacts/screenshots/ (git-ignored). To refresh the
# README's pictures: TUNESMITH_SCREENSHOTS=docs/screenshots python -m pytest tests/studio
SCREENSHOTS = _ROOT / os.environ.get("TUNESMITH_SCREENSHOTS", "artifacts/screenshots")
SHOT_SIZE = (1200, 800)


def short_config(state, runs_dir: Path, name: str, steps: int = 40) -> None:
    """A run of a few seconds on the demo: short rows, one row per step, no periodic saves."""
    for path, value in (
        ("data.max_seq_len", 128),
        ("training.max_steps", steps),
        ("training.rows_per_micro_batch", 1),
        ("training.grad_accum", 1),
        ("training.warmup_steps", 2),
        ("training.save_every", 0),
        ("training.log_every", 1),
        ("training.lr", 0.003),
        ("output.dir", str(runs_dir)),
        ("output.run_name", name),
    ):
        state.set(path, value)


def screenshot(widget, name: str) -> Path:
    """Save `widget` as <SCREENSHOTS>/<name>.png at 1200x800."""
    from PySide6.QtCore import Qt

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    widget.repaint()
    pix = widget.grab()
    if (pix.width(), pix.height()) != SHOT_SIZE:
        pix = pix.scaled(*SHOT_SIZE, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)
    path = SCREENSHOTS / f"{name}.png"
    pix.save(str(path), "PNG", 9)
    return path


class EventRecorder:
    """The engine's events as the training worker emits them (a direct connection: the slot runs on
    the emitting thread): their names in order, and those emitted on the GUI thread. A step run on
    the GUI thread would freeze the window for its whole length; a worker thread never does."""

    def __init__(self, worker):
        from PySide6.QtCore import Qt

        self.names: list[str] = []
        self.on_gui_thread: list[str] = []
        worker.event.connect(self._record, Qt.ConnectionType.DirectConnection)

    def _record(self, event) -> None:
        import threading

        name = type(event).__name__
        self.names.append(name)
        if threading.current_thread() is threading.main_thread():
            self.on_gui_thread.append(name)

    def between(self, first: str, last: str) -> list[str]:
        """The events after the first `first` and before the first `last` after it."""
        start = self.names.index(first) + 1
        return self.names[start : self.names.index(last, start)]
