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


class LatencyProbe:
    """Measures event-loop latency: a 10 ms timer records how late each tick arrives."""

    def __init__(self, interval_ms: int = 10):
        import time

        from PySide6.QtCore import QTimer

        self._time = time.perf_counter
        self.interval = interval_ms / 1000
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.last = None
        self.worst = 0.0
        self.ticks = 0
        self.stalls: list[tuple[float, int]] = []  # (seconds since start, ms late) above 30 ms

    def _tick(self) -> None:
        now = self._time()
        if self.last is not None:
            late = now - self.last - self.interval
            self.worst = max(self.worst, late)
            if late > 0.03:
                self.stalls.append((round(now - self.t0, 3), round(late * 1000)))
        self.last = now
        self.ticks += 1

    def start(self) -> None:
        self.t0 = self._time()
        self.last = None
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    @property
    def worst_ms(self) -> float:
        return self.worst * 1000
