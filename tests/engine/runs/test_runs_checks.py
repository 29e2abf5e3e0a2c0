"""engine.runs.checks: a run's name, a place where runs can be written (free disk, with what a
cut-short write left counted as free) and a folder a new run may start in; each refusal one
sentence naming the folder."""

from __future__ import annotations

import pytest

from engine.runs import checks
from engine.runs.layout import RunFolderError, RunLayout


@pytest.mark.parametrize("name", ["run 1", "café", "✨", "a.b", "x" * 255])
def test_a_folder_name_is_a_run_name(name):
    assert checks.run_name_problem(name) == ""


@pytest.mark.parametrize(
    "name,why",
    [
        ("", "other than"),
        ("..", "other than"),
        ("a/b", "'/'"),
        ("a\nb", "'\\n'"),
        ("x" * 256, "255"),
        ("r.tmp", ".tmp"),
    ],
)
def test_a_bad_name_is_refused_with_its_reason(name, why):
    assert why in checks.run_name_problem(name)


def test_a_disk_without_room_for_a_first_checkpoint_is_refused(tmp_path):
    enough = checks.MIN_FREE_BYTES
    assert checks.write_problem(tmp_path, disk_free=lambda p: enough) == ""
    problem = checks.write_problem(tmp_path / "runs" / "r", disk_free=lambda p: enough - 1)
    assert problem.startswith(f"Runs cannot be saved: the disk holding {tmp_path} is full (")
    assert "output.dir" in problem
    # What the run removes before it writes counts as free.
    assert checks.write_problem(tmp_path, disk_free=lambda p: enough - 1, reclaimable=1) == ""


def test_the_debris_of_a_cut_short_write_counts_as_free(tmp_path):
    run = RunLayout(tmp_path / "r")
    run.checkpoint_tmp(4).mkdir(parents=True)
    (run.checkpoint_tmp(4) / "optimizer.bin").write_bytes(b"\0" * 4096)
    short = checks.MIN_FREE_BYTES - 4096
    checks.check_writable(run, disk_free=lambda p: short)  # the 4096 bytes come back
    with pytest.raises(RunFolderError, match="is full"):
        checks.check_writable(run, disk_free=lambda p: short - 1)


def test_a_new_run_needs_an_empty_folder_or_its_own_run_with_overwrite(tmp_path):
    free = RunLayout(tmp_path / "new")
    checks.check_free(free)  # missing: fine
    free.path.mkdir()
    checks.check_free(free)  # empty: fine
    (free.path / "notes.txt").write_text("x")
    with pytest.raises(RunFolderError, match="is not empty and holds no run"):
        checks.check_free(free, overwrite=True)
    run = RunLayout(tmp_path / "run")
    run.path.mkdir()
    run.config.write_text("model: {}\n")
    with pytest.raises(RunFolderError, match="already holds a run"):
        checks.check_free(run)
    checks.check_free(run, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is a file"):
        checks.check_free(RunLayout(tmp_path / "file" / "below"))


def test_taken_means_something_a_run_may_not_be_written_into(tmp_path):
    assert not checks.taken(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert not checks.taken(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    assert checks.taken(tmp_path / "file") and checks.taken(tmp_path)
