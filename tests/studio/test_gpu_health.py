"""The GPU's health beside its memory (issue 28, item 5): utilisation, temperature and power travel
in the step event (optional fields, None on a CPU), the Monitor shows them when they are known and
hides them otherwise, and the Hardware page shows a live "GPU now" row only where NVML answers."""

from __future__ import annotations

import dataclasses


def _step(**health):
    from engine import api

    return api.StepMetrics(
        step=3,
        total_steps=10,
        epoch=0.1,
        loss=2.5,
        lr=1e-4,
        grad_norm=0.7,
        tokens=4096,
        trained_tokens=2048,
        step_seconds=0.5,
        tokens_per_second=8192.0,
        **health,
    )


def test_the_health_fields_survive_the_event_stream():
    from engine import api

    ev = _step(gpu_util=87, gpu_temp=64, gpu_power=412.5, device="cuda:0", mem_total=150 * 1024**3)
    back = api.event_from_dict(ev.to_dict())
    assert (back.gpu_util, back.gpu_temp, back.gpu_power) == (87, 64, 412.5)
    # An event written before the fields existed reads back with them unknown.
    old = {k: v for k, v in ev.to_dict().items() if not k.startswith("gpu_")}
    assert api.event_from_dict(old).gpu_util is None


def test_monitor_shows_health_on_a_gpu_and_hides_it_on_a_cpu(qtbot):
    from studio.panels.monitor import MonitorPanel

    m = MonitorPanel()
    qtbot.addWidget(m)
    m.begin()
    m.step(_step(gpu_util=87, gpu_temp=64, gpu_power=412.5, device="cuda:0", mem_total=150 * 1024**3))
    assert m.health.isVisibleTo(m)
    assert m.health.text() == "GPU 87% busy · 64 °C · 412 W"
    m.begin()  # the next run, on the CPU
    m.step(_step())
    assert not m.health.isVisibleTo(m) and m.health.text() == ""


def test_without_nvml_nothing_is_shown_and_nothing_is_said(window, qtbot):
    from engine import api
    from studio.main_window import HARDWARE

    qtbot.waitUntil(lambda: window.state.profile is not None, timeout=120_000)
    window.go_to(HARDWARE)
    hp = window.hardware_panel
    health = api.gpu_health(0)
    assert hp._form.isRowVisible(hp._health_row) == (health is not None and bool(window.state.profile.gpu_name))
    if window.state.profile.gpu_name and health is not None:
        assert "°C" in hp.health.text() or "busy" in hp.health.text()
    assert dataclasses.fields(api.GpuHealth)
