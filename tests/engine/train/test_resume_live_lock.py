"""Resuming a run that another live process is training is refused before anything is written
(engine.train.run_setup.plan_run_folder, engine.runs.records.locked_by_another_process); a lock
left by a dead process, or by this process's own earlier session, is no obstacle."""

import os
import subprocess
import sys

import pytest

from engine.config import RunConfig
from engine.resources import DEMO_PRESET
from engine.runs import RunFolder, RunFolderError
from engine.train.distributed import DistContext
from engine.train.run_setup import plan_run_folder


@pytest.fixture
def run(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    RunConfig.load(DEMO_PRESET).save(folder.config)  # a run folder: it has its config.yaml
    return folder


def _plan(folder):
    return plan_run_folder(RunConfig.load(DEMO_PRESET), DistContext(), folder.path, None, None)


def test_a_run_another_live_process_trains_is_refused_naming_the_lock(run):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run.lock(pid=other.pid)
        files = sorted(p.name for p in run.path.iterdir())
        with pytest.raises(RunFolderError, match="running.lock"):
            _plan(run)
        assert sorted(p.name for p in run.path.iterdir()) == files  # nothing written
    finally:
        other.kill()
        other.wait()
    # The same lock once that process is gone: an interrupted run, which resumes.
    assert _plan(run)[0].path == run.path


def test_this_process_own_lock_does_not_refuse(run):
    run.lock(pid=os.getpid())
    assert not run.trained_elsewhere()
    assert _plan(run)[0].path == run.path
