"""The Memory chart's device-wide line (issue 14 item 10): during a GPU run the Monitor polls
engine.api.device_memory once a second and draws the card's used memory (every process)
against its total. Here on unified memory (DGX Spark's case: the card's memory is the OS's,
read from /proc/meminfo), which any Linux machine has; on a CPU run nothing is polled."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def monitor(qtbot):
    from studio.panels.monitor import MonitorPanel

    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.begin()
    yield panel
    panel.close()


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="needs Linux's /proc/meminfo")
def test_the_card_used_line_on_unified_memory(monitor, qtbot):
    from engine.api import device_memory

    monitor._watch_card({"gpu_name": "NVIDIA GB10", "integrated_memory": True}, "cuda")
    assert monitor._card_timer.isActive()
    qtbot.waitUntil(lambda: monitor.memory.point_count("card used") >= 2, timeout=5000)  # polled each second
    mem = device_memory(0, unified=True)
    used = monitor.memory.series("card used").view()[1]
    assert abs(used[-1] * 1024**3 - mem.used) < 0.2 * mem.total  # the same reading, moments apart
    assert monitor.card_memory.total == mem.total
    assert "free" in monitor.memory._limit.label.toPlainText()
    from engine.api import Finished

    monitor.finished(Finished("run", {"steps": 1}))
    assert not monitor._card_timer.isActive()


def test_nothing_is_polled_on_a_cpu_run(monitor):
    monitor._watch_card({"gpu_name": None, "integrated_memory": False}, "cpu")
    assert not monitor._card_timer.isActive() and monitor.memory.point_count("card used") == 0
