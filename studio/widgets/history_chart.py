"""A pyqtgraph plot of finished curves: one line per run, for the Runs page.

Unlike the Monitor's LiveChart (points arriving one by one, axes managed by hand so they move
rarely), these curves are complete when shown, so the plot simply ranges over them. Each call
to `show_curves` replaces everything shown, so switching the selection never leaves a stale
line behind.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

# One colour per run, in selection order; distinct on white and for most colour vision.
PALETTE = ("#2471a3", "#cb4335", "#1e8449", "#b9770e", "#7d3c98", "#17a589", "#5d6d7e", "#d35400")


def color_for(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


class HistoryChart(pg.PlotWidget):
    def __init__(self, title: str, y_label: str = "", parent=None):
        super().__init__(parent=parent)
        self.setObjectName("historyChart")
        self.setTitle(title, size="10pt")
        item = self.getPlotItem()
        item.showGrid(x=True, y=True, alpha=0.15)
        item.setLabel("bottom", "step")
        if y_label:
            item.setLabel("left", y_label)
        for name in ("left", "bottom"):
            item.getAxis(name).enableAutoSIPrefix(False)
        item.setDownsampling(auto=True, mode="peak")
        item.setClipToView(True)
        self.legend = item.addLegend(offset=(-10, 10), labelTextSize="8pt")
        self.setMinimumHeight(150)
        self.curves: dict[str, pg.PlotDataItem] = {}  # label -> the line shown

    def show_curves(self, curves: list[tuple]) -> None:
        """Replace what is shown by `curves`: (label, steps, values, colour[, dashed]) each. Points
        that are not finite (a NaN loss, the steps without an eval) are left out rather than
        breaking the line's range; a dashed line is a run's eval loss beside its training loss."""
        item = self.getPlotItem()
        for line in self.curves.values():
            item.removeItem(line)
        self.legend.clear()
        self.curves = {}
        for label, xs, ys, color, *dashed in curves:
            x = np.asarray(xs, dtype=np.float64)
            y = np.asarray(ys, dtype=np.float64)
            keep = np.isfinite(y)
            style = Qt.PenStyle.DashLine if dashed and dashed[0] else Qt.PenStyle.SolidLine
            line = item.plot(x[keep], y[keep], pen=pg.mkPen(color=color, width=1.8, style=style), name=label)
            line.setCurveClickable(False)
            self.curves[label] = line
        item.enableAutoRange(x=True, y=True)

    def point_count(self, label: str) -> int:
        line = self.curves.get(label)
        if line is None or line.yData is None:
            return 0
        return int(len(line.yData))

    def values(self, label: str) -> list[float]:
        line = self.curves.get(label)
        return [] if line is None or line.yData is None else [float(v) for v in line.yData if math.isfinite(v)]
