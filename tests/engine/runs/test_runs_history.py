"""engine.runs.history: a run's curves and its row of the run list read back from its folder,
never raising for a broken one; and what differs between runs' configs."""

from __future__ import annotations

import json
import math
import os
import time

from engine.runs import history, records
from engine.runs.layout import RunLayout


def _write(run: RunLayout, events: list, tail: str = "") -> None:
    run.path.mkdir(parents=True, exist_ok=True)
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)


def _step(step: int, loss: float, t: float, **more) -> dict:
    return {"event": "StepMetrics", "step": step, "loss": loss, "time": t, "tokens_per_second": 100.0, **more}


def test_a_resumed_run_keeps_each_steps_latest_value_and_sums_its_sessions(tmp_path):
    run = RunLayout(tmp_path / "r")
    _write(
        run,
        [
            {"event": "RunStarted", "total_steps": 4, "time": 0.0},
            _step(1, 3.0, 10.0),
            _step(2, 2.5, 20.0, metrics={"reward": 0.5}),
            {"event": "EvalMetrics", "step": 2, "eval_loss": 2.7},
            {"event": "Finished", "stopped": True, "time": 30.0},
            {"event": "RunStarted", "total_steps": 4, "time": 100.0},
            _step(2, 2.4, 110.0),  # resumed from step 1's checkpoint: step 2 again
            _step(3, 2.0, 120.0, metrics={"reward": 0.7}),
        ],
    )
    hist = history.read_history(run)
    assert hist.steps == [1, 2, 3] and hist.curve("loss") == ([1, 2, 3], [3.0, 2.4, 2.0])
    assert hist.outcome is None  # the resumed session has not ended: the earlier stop is not the last word
    assert hist.seconds == 30.0 + 20.0 and hist.started == 0.0 and hist.total_steps == 4
    evals = hist.curves["eval_loss"]
    assert math.isnan(evals[0]) and evals[1] == 2.7 and math.isnan(evals[2])
    reward = hist.curves["reward"]  # the method's own metric; step 2's latest line has none
    assert math.isnan(reward[0]) and math.isnan(reward[1]) and reward[2] == 0.7
    assert hist.problems == []


def test_a_broken_line_is_named_and_a_line_being_written_is_not(tmp_path):
    run = RunLayout(tmp_path / "r")
    _write(run, [_step(1, 1.0, 1.0)], tail='not json\n{"event": "StepMetrics", "st')
    assert history.read_history(run).problems == ["metrics.jsonl line 2 is not valid JSON"]
    old = time.time() - 2 * history.RUNNING_WINDOW_S
    os.utime(run.metrics, (old, old))  # nobody writes it any more: the cut line is a problem too
    assert history.read_history(run).problems[1] == "metrics.jsonl line 3 is not valid JSON"
    assert history.read_history(RunLayout(tmp_path / "none")).problems == [
        f"metrics.jsonl is missing from {tmp_path / 'none'}"
    ]


def test_a_summary_is_a_run_info_with_the_historys_figures(tmp_path):
    run = RunLayout(tmp_path / "r")
    _write(run, [{"event": "RunStarted", "total_steps": 3, "time": 5.0}, _step(1, 2.0, 6.0), _step(2, 1.0, 7.0)])
    run.config.write_text("model:\n  name_or_path: demo\ndata:\n  source: rows.jsonl\n")
    run.checkpoint(2).mkdir(parents=True)
    s = history.summarize(run)
    assert (s.status, s.model, s.data, s.steps, s.total_steps) == ("incomplete", "demo", "rows.jsonl", 2, 3)
    assert (s.final_loss, s.best_loss, s.best_step, s.tokens_per_second) == (1.0, 1.0, 2, 100.0)
    assert s.resumable and s.problem == ""
    records.write_lock(run)
    assert history.summarize(run).status == "running"
    run.config.write_text("- not settings\n")
    broken = history.summarize(run)
    assert broken.status == "corrupt" and "holds no settings" in broken.problem


def test_every_run_like_folder_is_summarized_newest_first(tmp_path):
    for name, t in (("old", 1.0), ("new", 2.0)):
        _write(RunLayout(tmp_path / name), [{"event": "RunStarted", "time": t}])
    _write(RunLayout(tmp_path / "half.tmp"), [{"event": "RunStarted", "time": 3.0}])
    (tmp_path / "other").mkdir()
    assert [s.name for s in history.summarize_runs(tmp_path)] == ["new", "old"]  # partial runs too, no config
    assert history.summarize_runs(tmp_path / "missing") == []


def test_config_differences_leave_out_the_name_and_keep_a_column_mapping_whole():
    a = {"output": {"run_name": "a"}, "training": {"lr": 1e-4, "steps": 10}, "data": {"columns": {"q": "x"}}}
    b = {"output": {"run_name": "b"}, "training": {"lr": 2e-4, "steps": 10}, "data": {"columns": {"q": "y"}}}
    assert history.config_differences([a, b]) == [
        ("training.lr", [1e-4, 2e-4]),
        ("data.columns", [{"q": "x"}, {"q": "y"}]),
    ]
    assert history.config_differences([a, {}]) == [
        ("training.lr", [1e-4, None]),
        ("training.steps", [10, None]),
        ("data.columns", [{"q": "x"}, None]),
    ]
