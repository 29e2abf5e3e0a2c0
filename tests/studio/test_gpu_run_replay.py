"""The window on runs recorded on H200s (issues 15 and 18): the typed events that
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
TWO_GPUS = Path(__file__).parent / "data" / "h200x2-ddp-qwen3-8b.events.jsonl"
HEALTH = Path(__file__).parent / "data" / "h200-demo-health.events.jsonl"


def _recorded_events(run_dir: Path, path: Path = EVENTS) -> list:
    from engine import api

    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        event = api.event_from_dict(json.loads(line))
        if hasattr(event, "run_dir"):
            event = dataclasses.replace(event, run_dir=str(run_dir))
        events.append(event)
    return events


def _replay(window, events) -> None:
    """The events through the window's own handler, up to the run's end (the charts as the run
    ends; the finished run's folder stayed on the GPU host)."""
    from engine import api

    for event in events:
        if isinstance(event, api.Finished):
            break
        window._on_event(event)


def test_window_shows_the_preflight_of_a_gpu_run(window, qtbot, runs_dir):
    from engine import api
    from studio.main_window import MONITOR, TRAIN

    run_dir = runs_dir / "16g-qwen3-14b-qlora"
    run_dir.mkdir()
    events = _recorded_events(run_dir)
    steps = [e for e in events if isinstance(e, api.StepMetrics)]
    assert len(steps) == 20 and any(isinstance(e, api.PreflightResult) for e in events)

    window.go_to(MONITOR)
    _replay(window, events)
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


def test_window_shows_a_two_gpu_run_recorded_on_two_h200s(window, qtbot, runs_dir):
    """Rank 0's events of `tunesmith train --gpus 2` (bench.ddp, Qwen3-8B, DDP on 2 H200s,
    commit e74f3c3: recorded before RunStarted carried the process count, so the header names
    one card) drive the Monitor's charts: the loss falls from 12.76 to 5.40 in 10 steps at the
    whole world's ~20k tokens/s."""
    from engine import api
    from studio.main_window import MONITOR

    run_dir = runs_dir / "ddp-qwen3-8b-2gpu"
    run_dir.mkdir()
    events = _recorded_events(run_dir, TWO_GPUS)
    window.go_to(MONITOR)
    _replay(window, events)
    m = window.monitor_panel
    m.refresh()
    steps = [e for e in events if isinstance(e, api.StepMetrics)]
    assert m.loss.point_count() == len(steps) == 10 and m.tps.point_count() >= 9
    assert steps[0].loss > 12.7 and steps[-1].loss < 5.5
    assert 18_000 < sorted(s.tokens_per_second for s in steps)[5] < 23_000  # the median step
    assert "NVIDIA H200" in m.status.text()
    screenshot(window, "monitor-two-gpus-h200")


def test_monitor_shows_the_health_of_an_h200_from_a_recorded_run(window, qtbot, runs_dir):
    """Issue 28 item 5: `tunesmith train resources/presets/demo.yaml --max-steps 60 --events-json` on
    an H200 (commit d40fd91, docs/gpu-test-log.md): every step event carries NVML's utilisation,
    temperature and power, and the Monitor shows the last step's beside the memory chart."""
    from engine import api
    from studio.main_window import MONITOR

    run_dir = runs_dir / "h200-demo"
    run_dir.mkdir()
    events = _recorded_events(run_dir, HEALTH)
    steps = [e for e in events if isinstance(e, api.StepMetrics)]
    assert len(steps) == 60 and all(s.gpu_util is not None and s.gpu_power for s in steps)
    window.go_to(MONITOR)
    _replay(window, events)
    m = window.monitor_panel
    m.refresh()
    last = steps[-1]
    assert m.health.isVisibleTo(m)
    assert m.health.text() == f"GPU {last.gpu_util}% busy · {last.gpu_temp} °C · {last.gpu_power:.0f} W"
    assert "NVIDIA H200" in m.status.text()
    assert m.progress.text() == "60 / 60 steps"
    screenshot(window, "monitor-gpu-health-h200")
