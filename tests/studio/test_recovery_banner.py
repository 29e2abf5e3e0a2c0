"""The window says what the session did to keep a run going. Real runs on the demo model, with
failures injected through the session's `Faults` seam, write their events to metrics.jsonl;
those lines, read back with engine.api.event_from_dict, drive the real Monitor and Train
pages: a banner for a setting lowered after running out of memory, for a rollback after a
NaN, and for a full disk (with the pause it causes); the measured pre-flight on both pages."""

from __future__ import annotations

import json

import pytest
from studio_helpers import screenshot

from engine.api import RunConfig, event_from_dict
from engine.resources import DEMO_PRESET
from engine.train.session import Faults, TrainingSession
from tests.engine.train.test_recovery import FakeFree


def run_events(tmp_path, faults, steps=3, rows=4, save_every=0, on_event=None, preflight="on"):
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.dtype = "float32"
    cfg.data.max_examples = 40
    cfg.data.max_seq_len = 128
    t = cfg.training
    t.max_steps, t.rows_per_micro_batch, t.grad_accum, t.save_every, t.preflight = steps, rows, 1, save_every, preflight
    session = TrainingSession(cfg, None, run_dir=tmp_path / "run", faults=faults)
    if on_event is not None:
        session.on_event = lambda e: on_event(session, e)
    result = session.run()
    assert result.kind == "Finished", getattr(result, "detail", result)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [event_from_dict(json.loads(line)) for line in lines]


def feed(monitor, events) -> None:
    """What the main window does with a run's events (plus the recovery notices)."""
    for e in events:
        if e.kind == "RunStarted":
            monitor.run_started(e)
        elif e.kind == "StepMetrics":
            monitor.step(e)
        elif e.kind == "Paused":
            monitor.paused(e.step, e.reason)
        elif e.kind == "Resumed":
            monitor.resumed(e.step)
        elif e.kind == "LogLine":
            monitor.append_log(e.message, e.level)
        elif e.kind == "Finished":
            monitor.finished(e)
        else:
            monitor.notice(e)


@pytest.fixture
def monitor(qtbot):
    from studio.panels.monitor import MonitorPanel

    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.resize(1200, 800)
    panel.show()
    qtbot.waitExposed(panel)
    panel.begin()
    yield panel
    panel.close()


def test_out_of_memory_and_the_preflight_show_on_the_monitor_and_train_pages(tmp_path, monitor, window):
    # The rehearsal of 4 rows does not fit (2 do); then step 2 runs out of memory anyway.
    events = run_events(tmp_path, Faults(oom_above_rows=2, oom_at_steps=[2]))
    feed(monitor, [e for e in events if e.kind != "Finished"])
    assert monitor.notices[0].startswith("Ran out of memory in the pre-flight rehearsal. Changed: micro-batch 4 → 2")
    text = monitor.banner.text()
    assert monitor.banner.level == "warning"
    assert "Ran out of memory at step 2" in text and "micro-batch 2 → 1 row" in text and "Nothing is lost" in text
    assert not monitor.preflight.isHidden()
    line = monitor.preflight.text()
    assert line.startswith("Pre-flight:") and "s per step" in line and "ETA" in line and "2 rows × 2 per step" in line
    assert [s for s in (monitor.loss.point_count("loss"),)] == [3]  # the curve went on: steps 1, 2, 3
    monitor.refresh()
    screenshot(monitor, "monitor-recovery")

    page = window.training_panel
    for e in events:
        if e.kind == "PreflightResult" or (e.kind == "MemoryAdjusted" and e.phase == "preflight"):
            page.show_preflight(e)
    assert not page.preflight.isHidden()
    shown = page.preflight.text()
    assert "Measured before step 1" in shown and "ETA" in shown and "micro-batch 4 → 2 rows" in shown


def test_a_rollback_and_a_full_disk_show_as_banners(tmp_path, monitor):
    # 4 KiB free from the first checkpoint on (the check before the run starts sees the real disk).
    disk_free = FakeFree(4096)

    def make_room(session, e):
        if e.kind == "Paused" and e.reason:
            disk_free.free = None  # the person freed some space
            session.request_resume()

    faults = Faults(nan_at_steps=[2], disk_free=disk_free)
    events = run_events(tmp_path, faults, rows=2, save_every=2, on_event=make_room, preflight="off")
    kinds = [e.kind for e in events]
    assert kinds.count("RolledBack") == 1 and kinds.count("DiskFull") == 1

    upto_pause = events[: kinds.index("Paused") + 1]
    feed(monitor, upto_pause)
    assert monitor.notices[0].startswith("The loss turned NaN at step 2") and "halved" in monitor.notices[0]
    assert monitor.banner.level == "error"
    assert "is full: the checkpoint at step 2 needs about" in monitor.banner.text()
    assert "4.0 KiB is free" in monitor.banner.text()
    assert monitor.mode == "paused" and monitor.resume.isEnabled()
    assert monitor.status.text().startswith("Paused at step 2: The disk at ")
    assert "Free some space" in monitor.banner.text() and "No checkpoint" in monitor.status.toolTip()
    # The rollback to step 0 cut the curve back: the rerun steps 1 and 2 are drawn once.
    assert list(monitor.loss.series("loss").view()[0]) == [1.0, 2.0]
    monitor.refresh()
    screenshot(monitor, "monitor-disk-full")
    feed(monitor, events[len(upto_pause) :])
    assert monitor.mode == "idle" and monitor.status.text().startswith("✓ Finished at step 3")


def test_the_window_routes_recovery_events_to_the_monitor_and_train_pages(tmp_path, window):
    # The same events, delivered as the worker delivers them: through MainWindow._on_event.
    events = run_events(tmp_path, Faults(oom_above_rows=2))
    window.monitor_panel.begin()
    for e in events:
        if e.kind != "Finished":
            window._on_event(e)
    m, page = window.monitor_panel, window.training_panel
    assert m.notices and m.notices[0].startswith("Ran out of memory in the pre-flight rehearsal")
    assert not m.preflight.isHidden() and m.preflight.text().startswith("Pre-flight:")
    assert "micro-batch 4 → 2 rows" in page.preflight.text()
    # A new run clears the last run's pre-flight from the Train page until its own arrives.
    window._on_event(next(e for e in events if e.kind == "RunStarted"))
    assert page.preflight.isHidden()
    # A pause the run took by itself says why.
    from engine.api import Paused

    window._on_event(Paused(3, reason="The disk at / is full"))
    assert m.status.text().startswith("Paused at step 3: The disk at / is full")


def test_a_preflight_that_found_room_is_news_not_a_warning(monitor):
    from engine.events import MemoryAdjusted

    grown = MemoryAdjusted(
        0,
        "preflight",
        "micro_batch",
        14,
        20,
        "micro-batch 14 → 20 rows (2 forwards per step, the same 28 rows per optimizer step): "
        "the rehearsal measured room in the 7.2 GiB VRAM budget.",
        20,
        2,
    )
    assert monitor.notice(grown)
    assert monitor.banner.level == "info"
    assert monitor.notices[-1].startswith("The pre-flight measured room on the card. Changed: micro-batch 14 → 20")
    assert "Ran out of memory" not in monitor.banner.text()
