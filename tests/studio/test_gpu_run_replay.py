"""The window on a run recorded on the H200 (issue 15): the typed events that
`tunesmith train --events-json` printed for Qwen3-14B QLoRA under an emulated 16 GiB laptop card
(bench.laptop, commit e74f3c3) go through the same handler a live run's events take. The Monitor
and Train pages show the pre-flight's measured peak against the card, its step time and ETA, the
micro-batch it grew, and the run's loss, speed and memory charts.

The events are the run's own, unedited except for the run folder, which was on the GPU host."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from studio_helpers import screenshot

EVENTS = Path(__file__).parent / "data" / "h200-16gib-qwen3-14b-qlora.events.jsonl"


def _recorded_events(run_dir: Path) -> list:
    from engine import api

    events = []
    for line in EVENTS.read_text(encoding="utf-8").splitlines():
        event = api.event_from_dict(json.loads(line))
        if hasattr(event, "run_dir"):
            event = dataclasses.replace(event, run_dir=str(run_dir))
        events.append(event)
    return events


def test_window_shows_the_preflight_of_a_gpu_run(window, qtbot, runs_dir):
    from engine import api
    from studio.main_window import MONITOR, TRAIN

    run_dir = runs_dir / "16g-qwen3-14b-qlora"
    run_dir.mkdir()
    events = _recorded_events(run_dir)
    steps = [e for e in events if isinstance(e, api.StepMetrics)]
    assert len(steps) == 20 and any(isinstance(e, api.PreflightResult) for e in events)

    window.go_to(MONITOR)
    for event in events:
        if isinstance(event, api.Finished):
            break  # the charts as the run ends; the finished run's folder stayed on the GPU host
        window._on_event(event)
    m = window.monitor_panel
    m.refresh()

    line = m.preflight.text()
    assert "peak 12.5 GiB of 16.0 GiB (78%)" in line and "3.77 s per step" in line and "ETA 1:15" in line
    assert "10 rows × 2 per step" in line
    assert m.loss.point_count() == 20 and m.tps.point_count() >= 19 and m.memory.point_count() >= 19
    assert any("micro-batch 6 → 10 rows" in n for n in m.notices)
    screenshot(window, "monitor-preflight-h200")

    window.go_to(TRAIN)
    train_text = window.training_panel.preflight.text()
    assert "Measured before step 1</b>: peak 12.5 GiB of 16.0 GiB, 3.77 s per step" in train_text
    assert "Changed: micro-batch 6 → 10 rows" in train_text
