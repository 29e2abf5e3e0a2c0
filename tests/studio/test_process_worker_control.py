"""The window's pause, resume and stop for a run under torchrun: the control file that rank 0
reads between steps, written whole through engine.runs (RunFolder.write_control)."""

from __future__ import annotations

from engine import api
from engine.train.distributed import read_control


def test_pause_resume_and_stop_reach_the_run_folders_control_file(qapp, tmp_path):
    from studio.process_worker import ProcessWorker

    run_dir = tmp_path / "run"
    worker = ProcessWorker(api.RunConfig(), nproc=2, run_dir=str(run_dir))
    control = api.RunFolder(run_dir).control_file
    worker.pause()  # rank 0 has not made the folder yet: nothing is written, the request is kept
    assert not run_dir.exists()
    run_dir.mkdir()
    for ask, request in ((worker.pause, "pause"), (worker.resume, "resume"), (worker.stop, "stop")):
        ask()
        assert read_control(control) == request
    assert [p.name for p in run_dir.iterdir()] == [control.name]  # no half-written file left beside it
