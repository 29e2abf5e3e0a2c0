"""engine.runs.status: the one status rule, the one resume decision and RunInfo, from the last
line of metrics.jsonl, the lock and the listing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.runs import ADAPTER_FILES, records
from engine.runs.layout import RunLayout
from engine.runs.status import (
    RunInfo,
    folder_status,
    info_of,
    list_runs,
    read_run,
    resume_refusal,
    shown_status,
    status_of,
    why_not_resumable,
)


def _run(root: Path, name: str, last: dict | None = None, steps=(), final=False) -> RunLayout:
    run = RunLayout(root / name)
    run.checkpoints_dir.mkdir(parents=True)
    run.config.write_text("model: {}\n")
    for s in steps:
        run.checkpoint(s).mkdir()
    if final:
        run.adapter.mkdir()
        for f in ADAPTER_FILES:
            (run.adapter / f).write_text("x")
    lines = [{"event": "RunStarted"}] + ([last] if last else [])
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in lines))
    return run


@pytest.mark.parametrize(
    "outcome,running,problem,status",
    [
        ({"event": "Finished", "stopped": False}, False, "", "finished"),
        ({"event": "Finished", "stopped": True}, True, "", "stopped"),  # an outcome wins over a lock
        ({"event": "Failed"}, False, "", "failed"),
        (None, True, "", "running"),
        (None, False, "", "incomplete"),
        ({"event": "StepMetrics"}, False, "", "incomplete"),
        ({"event": "Finished"}, False, "metrics.jsonl line 3 is not valid JSON", "corrupt"),
    ],
)
def test_the_status_rule(outcome, running, problem, status):
    assert status_of(outcome, running, problem) == status


@pytest.mark.parametrize(
    "status,has_checkpoint,refused",
    [
        ("stopped", True, ""),
        ("failed", True, ""),
        ("incomplete", True, ""),
        ("stopped", False, "has no checkpoint"),
        ("running", True, "is running"),
        ("finished", True, "nothing left to train"),
        ("corrupt", True, "cannot be read"),
    ],
)
def test_the_resume_decision(status, has_checkpoint, refused):
    why = resume_refusal("r", status, has_checkpoint)
    assert (refused in why and why.startswith("r ")) if refused else why == ""


def test_a_window_shows_its_own_run_and_a_busy_incomplete_run_as_running():
    assert shown_status("stopped", ours=True) == "running"
    assert shown_status("incomplete", busy=True) == "running"
    assert shown_status("failed", busy=True) == "failed"
    assert shown_status("finished") == "finished"


def test_a_folder_decides_from_its_files_and_its_lock(tmp_path):
    run = _run(tmp_path, "r", {"event": "Failed"}, steps=(2,))
    assert folder_status(run) == "failed" and why_not_resumable(run) == ""
    assert why_not_resumable(run, ours=True) == "r is running."
    records.write_lock(run)  # this process holds it: alive
    assert why_not_resumable(run) == "r is running."
    assert folder_status(run) == "failed"  # the cheap status reads the files only
    other = RunLayout(tmp_path / "plain")
    other.path.mkdir()
    assert "is not a run folder" in why_not_resumable(other)


def test_run_info_offers_the_best_checkpoint_first(tmp_path):
    run = _run(tmp_path, "r", {"event": "Finished"}, steps=(2, 4, 6), final=True)
    records.write_best(run, {"step": 4, "eval_loss": 0.5, "checkpoint": str(run.checkpoint(4))})
    info = info_of(run)
    assert isinstance(info, RunInfo) and info.status == "finished" and info.name == "r"
    assert info.best_checkpoint() == (4, run.checkpoint(4), 0.5)
    labels = [label for label, _ in info.sources()]
    assert labels == ["best (eval loss 0.5000 at step 4)", "final adapter", "checkpoint step 6", "checkpoint step 2"]
    assert info.why_not_resumable() == "r finished: there is nothing left to train." and not info.resumable
    # best.json naming a checkpoint that was removed: no best, every checkpoint listed
    info.best = {"step": 8, "eval_loss": 0.1}
    assert info.best_checkpoint() is None and len(info.sources()) == 4


def test_listing_reads_runs_only_newest_first(tmp_path):
    old = _run(tmp_path, "old", {"event": "Finished"})
    new = _run(tmp_path, "new", None, steps=(1,))
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "a-file").write_text("x")
    os.utime(old.path, (1000.0, 1000.0))
    assert [r.name for r in list_runs(tmp_path)] == ["new", "old"]
    assert read_run(tmp_path / "not-a-run") is None
    assert read_run(new.path).resumable
    assert list_runs(tmp_path / "missing") == []
