"""Growable numpy series for live plots: amortised O(1) appends, views without copies.

A chart over 10,000+ steps must not rebuild its arrays per point: the buffer doubles when
full and hands pyqtgraph views of the filled part.
"""

from __future__ import annotations

import math

import numpy as np


class Series:
    def __init__(self, capacity: int = 1024):
        self._x = np.empty(capacity, dtype=np.float64)
        self._y = np.empty(capacity, dtype=np.float64)
        self.n = 0

    @property
    def capacity(self) -> int:
        return len(self._x)

    def append(self, x: float, y: float) -> None:
        if self.n == len(self._x):
            # Doubling keeps appends amortised O(1); old views stay valid (they own the old array).
            self._x = np.resize(self._x, 2 * self.n)
            self._y = np.resize(self._y, 2 * self.n)
        self._x[self.n] = x
        self._y[self.n] = y
        self.n += 1

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        return self._x[: self.n], self._y[: self.n]

    def last(self) -> float:
        return float(self._y[self.n - 1]) if self.n else math.nan

    def clear(self) -> None:
        self.n = 0


class Ema:
    """Debiased exponential moving average (the TensorBoard smoothing), updated per point."""

    def __init__(self, weight: float = 0.9):
        self.weight = weight
        self._acc = 0.0
        self._count = 0

    def update(self, value: float) -> float:
        if not math.isfinite(value):
            return self.value()
        self._count += 1
        self._acc = self._acc * self.weight + (1 - self.weight) * value
        return self.value()

    def value(self) -> float:
        if not self._count:
            return math.nan
        return self._acc / (1 - self.weight**self._count)

    def reset(self) -> None:
        self._acc, self._count = 0.0, 0
