"""Persistent studio settings (QSettings): recent models and data sets, window geometry and
state, the folder runs are written to.

Tests pass an explicit INI path so they never touch the person's real settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from PySide6.QtCore import QByteArray, QSettings

MAX_RECENT = 10


class Settings:
    def __init__(self, path: Optional[str | Path] = None):
        if path is None:
            self._qs = QSettings("Tunesmith", "Tunesmith Studio")
        else:
            self._qs = QSettings(str(path), QSettings.Format.IniFormat)

    # -- recent lists -----------------------------------------------------------------------
    def _recent(self, key: str) -> list[str]:
        value = self._qs.value(key, [])
        if isinstance(value, str):  # QSettings returns a bare string for one-element lists
            value = [value]
        return [v for v in (value or []) if v]

    def _push(self, key: str, item: str) -> None:
        items = [item] + [v for v in self._recent(key) if v != item]
        self._qs.setValue(key, items[:MAX_RECENT])

    def recent_models(self) -> list[str]:
        return self._recent("recent/models")

    def add_recent_model(self, name: str) -> None:
        self._push("recent/models", name)

    def recent_datasets(self) -> list[str]:
        return self._recent("recent/datasets")

    def add_recent_dataset(self, source: str) -> None:
        self._push("recent/datasets", source)

    # -- window -----------------------------------------------------------------------------
    def geometry(self) -> Optional[QByteArray]:
        return self._qs.value("window/geometry")

    def window_state(self) -> Optional[QByteArray]:
        return self._qs.value("window/state")

    def save_window(self, geometry: QByteArray, state: QByteArray) -> None:
        self._qs.setValue("window/geometry", geometry)
        self._qs.setValue("window/state", state)

    # -- plain values -----------------------------------------------------------------------
    def value(self, key: str, default=None):
        return self._qs.value(key, default)

    def set_value(self, key: str, value) -> None:
        self._qs.setValue(key, value)

    def runs_dir(self) -> str:
        return str(self._qs.value("paths/runs", str(Path.home() / "Tunesmith" / "runs")))

    def sync(self) -> None:
        self._qs.sync()
