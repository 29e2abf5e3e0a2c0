"""engine.runs.folder: RunFolder answers with the rule of the module that holds it (one status,
one resume decision, one summary), and changes a run folder: create, rename, delete; and
new_run_folder, the one rule for a new run's folder."""

from __future__ import annotations

import json

import pytest

from engine.runs import history, records, status
from engine.runs.folder import RunFolder, new_run_folder
from engine.runs.layout import RunFolderError


def _run(tmp_path, name="r", last=None) -> RunFolder:
    run = RunFolder(tmp_path / name).create(fresh=True)
    run.config.write_text("model:\n  name_or_path: demo\n")
    run.checkpoint(1).mkdir()
    lines = [{"event": "RunStarted", "time": 1.0}, {"event": "StepMetrics", "step": 1, "loss": 1.0, "time": 2.0}]
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in lines + ([last] if last else [])))
    return run


@pytest.mark.parametrize("last", [None, {"event": "Failed"}, {"event": "Finished", "stopped": False}])
def test_the_folder_asks_the_modules_that_hold_the_rules(tmp_path, last):
    run = _run(tmp_path, last=last)
    assert RunFolder.of(run.checkpoint(1)).path == run.path and repr(run) == f"RunFolder({str(run.path)!r})"
    assert run.status() == status.folder_status(run) == run.info().status
    assert run.info() == status.info_of(run)
    assert run.why_not_resumable() == status.why_not_resumable(run) == run.summary().why_not_resumable()
    assert run.last_event() == records.last_event(run)
    summary = run.summary()
    assert isinstance(summary, history.RunSummary) and summary.status == run.status()
    assert run.history().steps == [1]
    run.lock()
    assert run.is_running() and run.summary().status == ("running" if last is None else run.status())
    run.unlock()
    assert not run.is_running()


def test_records_go_through_the_folder(tmp_path):
    run = _run(tmp_path)
    run.write_best({"step": 1, "eval_loss": 0.5})
    run.append_gallery([{"step": 1, "prompt": "p", "answer": "a"}])
    run.write_control("pause")
    assert run.best() == {"step": 1, "eval_loss": 0.5} and run.gallery()[0]["answer"] == "a"
    assert run.control_file.read_text() == "pause"
    assert run.read_config() == ({"model": {"name_or_path": "demo"}}, "")
    assert run.written_within(60.0, now=run.last_write() + 1.0)
    assert not run.written_within(60.0, now=run.last_write() + 61.0)


def test_rename_and_delete(tmp_path):
    run = _run(tmp_path)
    moved = run.rename("  two words  ")
    assert moved.path == tmp_path / "two words" and moved.is_run() and not run.path.exists()
    assert moved.rename("two words") is moved
    _run(tmp_path, "taken")
    with pytest.raises(RunFolderError, match="already exists"):
        moved.rename("taken")
    with pytest.raises(RunFolderError, match="cannot be a folder name"):
        moved.rename("a/b")
    (tmp_path / "plain").mkdir()
    with pytest.raises(RunFolderError, match="nothing was deleted"):
        RunFolder(tmp_path / "plain").delete()
    moved.delete()
    assert not moved.path.exists() and (tmp_path / "plain").is_dir()


def test_create_fresh_clears_an_old_run_and_a_resume_keeps_it(tmp_path):
    run = _run(tmp_path)
    run.create(fresh=False)
    assert run.checkpoints() and run.metrics.exists()
    run.create(fresh=True)
    assert run.checkpoints_dir.is_dir() and not run.checkpoints() and not run.metrics.exists()


def test_a_new_runs_folder_takes_the_next_free_name(tmp_path):
    first, note = new_run_folder(tmp_path, "fixed")
    assert first.path == tmp_path / "fixed" and note == ""
    _run(tmp_path, "fixed")
    (tmp_path / "fixed-2").mkdir()  # empty: free
    second, note = new_run_folder(tmp_path, "fixed")
    assert second.path == tmp_path / "fixed-2" and "already holds a run" in note
    again, note = new_run_folder(tmp_path, "fixed", overwrite=True)
    assert again.path == tmp_path / "fixed" and note == ""
    auto, _ = new_run_folder(tmp_path, "auto")
    assert auto.path.name.startswith("run-")
    with pytest.raises(RunFolderError, match="output.run_name"):
        new_run_folder(tmp_path, "..")
