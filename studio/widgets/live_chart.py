"""A pyqtgraph plot of one or more growing series, redrawn at most a few times a second.

Points are appended as events arrive (cheap: a numpy store); `refresh()` pushes views of the
buffers into the curves only when something changed. Downsampling and clip-to-view keep a
10,000-step curve as cheap to draw as a short one.

The axis ranges are managed here rather than by pyqtgraph's auto-range: an axis re-renders
its tick labels (the bulk of a repaint) whenever its range moves, and auto-range moves it on
every new point. The x axis spans the run's planned steps; the y axis changes only when the
data leaves it or shrinks well inside it.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from studio.widgets.series import Series

pg.setConfigOptions(antialias=False, background="w", foreground="#3a3f4b")


class LiveChart(pg.PlotWidget):
    def __init__(self, title: str, y_label: str = "", parent=None):
        super().__init__(parent=parent)
        self.setObjectName("liveChart")
        self.setTitle(title, size="10pt")
        item = self.getPlotItem()
        item.showGrid(x=True, y=True, alpha=0.15)
        item.setLabel("bottom", "step")
        if y_label:
            item.setLabel("left", y_label)
        # Fixed axis sizes: an axis that widens to fit longer tick labels re-lays out the whole
        # plot, which costs a full redraw; 52 px fits labels like "1.5e-04" and "12,000".
        for name in ("left", "bottom"):
            item.getAxis(name).enableAutoSIPrefix(False)  # "GiB (x0.001)" reads badly
        item.getAxis("left").setWidth(52)
        item.getAxis("bottom").setHeight(36)
        item.setDownsampling(auto=True, mode="peak")
        item.setClipToView(True)
        item.addLegend(offset=(-10, 10), labelTextSize="8pt")
        self.setMinimumHeight(160)
        self._series: dict[str, Series] = {}
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._dirty: set[str] = set()
        self._limit: Optional[pg.InfiniteLine] = None
        self._x_span: Optional[float] = None
        self._xrange: Optional[tuple[float, float]] = None
        self._yrange: Optional[tuple[float, float]] = None
        item.enableAutoRange(x=False, y=False)
        item.setXRange(0, 10, padding=0)
        item.setYRange(0, 1, padding=0)

    def add_series(self, name: str, color: str, width: float = 1.5, dashed: bool = False) -> None:
        style = Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine
        pen = pg.mkPen(color=color, width=width, style=style)
        self._series[name] = Series()
        self._curves[name] = self.getPlotItem().plot([], [], pen=pen, name=name)

    def append(self, name: str, x: float, y: float) -> None:
        self._series[name].append(x, y)
        self._dirty.add(name)

    def series(self, name: str) -> Series:
        return self._series[name]

    def point_count(self, name: Optional[str] = None) -> int:
        name = name or next(iter(self._series))
        return self._series[name].n

    def set_limit(self, value: Optional[float], label: str = "") -> None:
        """A horizontal line, e.g. the card's total memory."""
        if value is None:
            if self._limit is not None:
                self.removeItem(self._limit)
                self._limit = None
            return
        if self._limit is None:
            self._limit = pg.InfiniteLine(
                angle=0,
                pen=pg.mkPen("#c0392b", width=1, style=Qt.PenStyle.DotLine),
                label=label,
                labelOpts={"position": 0.1, "color": "#c0392b"},
            )
            self.addItem(self._limit)
        self._limit.setValue(value)

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def set_x_span(self, steps: Optional[float]) -> None:
        """The run's planned steps: the x axis covers them from the start and never moves."""
        self._x_span = float(steps) if steps else None
        self._xrange = None

    def refresh(self) -> None:
        if not self._dirty:
            return
        for name in self._dirty:
            x, y = self._series[name].view()
            self._curves[name].setData(x, y)
        self._dirty.clear()
        self._update_ranges()

    def _update_ranges(self) -> None:
        item = self.getPlotItem()
        last_x = max((s.view()[0][-1] for s in self._series.values() if s.n), default=0.0)
        if self._x_span and last_x <= self._x_span:
            want_x = (0.0, self._x_span)
        else:  # unknown length (or past it): grow by doubling so the axis rarely moves
            hi = self._xrange[1] if self._xrange else 10.0
            while hi < last_x:
                hi *= 2
            want_x = (0.0, hi)
        if want_x != self._xrange:
            self._xrange = want_x
            item.setXRange(*want_x, padding=0.02)
        lo, hi = math.inf, -math.inf
        for s in self._series.values():
            if s.n:
                y = s.view()[1]
                finite = y[np.isfinite(y)]
                if finite.size:
                    lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
        if self._limit is not None:
            hi = max(hi, float(self._limit.value()))
        if not math.isfinite(lo):
            return
        cur = self._yrange
        if cur and cur[0] <= lo and hi <= cur[1] and (hi - lo) >= 0.3 * (cur[1] - cur[0]):
            return
        span = (hi - lo) or abs(hi) or 1.0
        new = (lo - 0.08 * span, hi + 0.08 * span)
        if lo >= 0 and new[0] < 0:
            new = (0.0, new[1])  # losses, rates and memory are never negative
        self._yrange = new
        item.setYRange(*new, padding=0)

    def clear_data(self) -> None:
        for name, series in self._series.items():
            series.clear()
            self._curves[name].setData([], [])
        self._dirty.clear()
        self.set_limit(None)
        self._x_span = self._xrange = self._yrange = None
