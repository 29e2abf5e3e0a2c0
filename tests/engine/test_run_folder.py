"""engine.runs: the run folder layout, on plain files."""

import json
import shutil

import pytest

from engine import runs
from engine.runs import RunFolder, RunFolderError


def _adapter(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for f in runs.ADAPTER_FILES:
        (folder / f).write_text("x")


def _run(tmp_path, steps=(2, 10), final=True, last=None):
    run = RunFolder(tmp_path / "run-a").create(fresh=True)
    run.config.write_text("model: {}\n")
    for s in steps:
        _adapter(run.checkpoint(s) / runs.ADAPTER)
    run.checkpoint_tmp(12).mkdir()  # a checkpoint being written is not a checkpoint
    (run.checkpoints_dir / "notes").mkdir()
    if final:
        _adapter(run.adapter)
    if last is not None:
        run.metrics.write_text(json.dumps({"event": "StepMetrics"}) + "\n" + json.dumps(last) + "\n")
    return run


def test_layout_and_checkpoints(tmp_path):
    run = _run(tmp_path)
    assert run.checkpoints() == [(2, run.checkpoint(2)), (10, run.checkpoint(10))]
    assert run.latest_checkpoint() == run.path / "checkpoints" / "step-10"
    assert run.checkpoint_tmp(3).name == "step-3.tmp"
    assert run.adapter_tmp == run.path / "adapter.tmp"
    assert run.export_report("merged") == run.path / "exports" / "merged.json"
    assert run.final_adapter() == run.adapter
    assert runs.step_of(run.checkpoint(10)) == 10
    assert runs.step_of(run.checkpoint_tmp(10)) == -1
    assert runs.step_of(run.path) == -1


def test_run_folder_of_and_resume(tmp_path):
    run = _run(tmp_path)
    assert runs.run_folder_of(run.checkpoint(2)) == run.path
    assert runs.run_folder_of(run.checkpoint(2) / "adapter") == run.path
    assert runs.run_folder_of(run.adapter) == run.path
    assert runs.run_folder_of(run.path) == run.path
    assert runs.resume_checkpoint(run.path) == run.checkpoint(10)
    assert runs.resume_checkpoint(run.checkpoint(2)) == run.checkpoint(2)
    assert runs.adapter_in(run.path) == run.adapter
    assert runs.adapter_in(run.checkpoint(2)) == run.checkpoint(2) / "adapter"
    assert runs.config_for(run.checkpoint(2) / "adapter") == run.config
    empty = RunFolder(tmp_path / "b").create(fresh=True)
    assert runs.resume_checkpoint(empty.path) is None
    assert runs.adapter_in(empty.path) is None


def test_status_and_listing(tmp_path):
    _run(tmp_path, last={"event": "Finished", "stopped": True})
    (tmp_path / "not-a-run").mkdir()
    (found,) = runs.list_runs(tmp_path)
    assert found.status == "stopped" and found.name == "run-a"
    assert [label for label, _ in found.sources()] == ["final adapter", "checkpoint step 10", "checkpoint step 2"]
    assert runs.read_run(tmp_path / "not-a-run") is None
    assert RunFolder(tmp_path / "run-a").status() == "stopped"
    assert runs.list_runs(tmp_path / "missing") == []


def test_check_free_and_create(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(RunFolderError, match="already holds a run"):
        run.check_free(overwrite=False)
    run.check_free(overwrite=True)
    run.create(fresh=True)
    assert not run.is_run() and run.checkpoints_dir.is_dir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("y")
    with pytest.raises(RunFolderError, match="holds no run"):
        RunFolder(other).check_free(overwrite=True)
    RunFolder(tmp_path / "new").check_free()


def test_publish(tmp_path):
    final = tmp_path / "adapter"
    final.mkdir()
    (final / "old").write_text("1")
    tmp = runs.tmp_for(final)
    tmp.mkdir()
    (tmp / "new").write_text("2")
    runs.publish(tmp, final)
    assert not tmp.exists() and (final / "new").exists() and not (final / "old").exists()


@pytest.mark.parametrize(
    "last,status,why",
    [
        ({"event": "Finished", "stopped": False}, "finished", "nothing left to train"),
        ({"event": "Finished", "stopped": True}, "stopped", ""),
        ({"event": "Failed"}, "failed", ""),
        (None, "incomplete", ""),
    ],
)
def test_one_status_rule_and_one_resume_decision(tmp_path, last, status, why):
    """RunFolder.status(), the Runs page's summary and `resumable` read the same rule."""
    run = _run(tmp_path, final=False)
    lines = [{"event": "StepMetrics", "step": 1, "loss": 2.0}] + ([last] if last else [])
    run.metrics.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert run.status() == status == run.summary().status == runs.status_of(last)
    assert (why in run.why_not_resumable()) if why else run.why_not_resumable() == ""
    assert run.summary().resumable == (not why)
    for _, folder in run.checkpoints():
        shutil.rmtree(folder)
    assert run.why_not_resumable().endswith("has no checkpoint to resume from.") or why
    assert not run.summary().resumable


def test_status_rule_edges():
    assert runs.status_of(None, running=True) == "running"
    assert runs.status_of({"event": "Failed"}, running=True) == "failed"  # an outcome wins
    assert runs.status_of({"event": "Finished"}, problem="metrics.jsonl line 3 is not JSON") == "corrupt"
    assert runs.resume_refusal("r", "running", True) == "r is running."
    assert runs.resume_refusal("r", "corrupt", True) and runs.resume_refusal("r", "stopped", False)
    assert runs.CONTROL == "control" and RunFolder("x").control_file.name == runs.CONTROL
