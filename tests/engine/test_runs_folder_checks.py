"""A runs folder that cannot take a run is refused before anything loads, with one sentence naming
the folder and what to do (issue 28 item 7: a read-only folder was found after 31 s of loading, as
a raw "OSError: [Errno 30]"); a fixed run name in a config trains every time, the second run in
name-2 (it made every later Train fail, each leaving a failed-*.log.txt)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import yaml
from child_process import child_env
from unwritable import ordinary_user_prefix

from engine import runs
from engine.api import DEMO_PRESET, RunConfig, RunFolder, TrainingSession, new_run_folder, write_problem


def tiny_config(out_dir, run_name="auto", steps=2) -> dict:
    cfg = yaml.safe_load(DEMO_PRESET.read_text())
    cfg["data"]["max_examples"] = 16
    cfg["data"]["max_seq_len"] = 128
    cfg["training"].update(max_steps=steps, save_every=0, preflight="off", gallery_size=0)
    cfg["output"].update(dir=str(out_dir), run_name=run_name)
    return cfg


def cli_train(cfg: dict, tmp_path, prefix=()):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [*prefix, sys.executable, "-m", "engine", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        cwd=tmp_path,
    )


def test_the_cli_refuses_a_read_only_runs_folder_before_loading(tmp_path):
    prefix = ordinary_user_prefix()
    locked = tmp_path / "runs"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        out = cli_train(tiny_config(locked, "fixed"), tmp_path, prefix)
        # A missing runs folder under a folder that cannot be written is found the same way.
        below = cli_train(tiny_config(locked / "more" / "runs"), tmp_path, prefix)
    finally:
        locked.chmod(0o755)
    assert out.returncode == 1, out.stderr[-2000:]
    sentence = f"Runs cannot be saved: {locked} (where {locked / 'fixed'} would be made) is not writable by you."
    assert f"FAILED: {sentence}" in out.stderr
    assert "output.dir" in out.stderr and "Errno" not in out.stderr and "Traceback" not in out.stderr
    assert "Loading tokenizer" not in out.stdout  # nothing loaded before the refusal
    assert below.returncode == 1 and f"{locked} (where {locked / 'more' / 'runs' / 'run-'}" in below.stderr
    assert list(locked.iterdir()) == []


def test_a_full_disk_is_refused_before_loading(tmp_path, monkeypatch):
    free = shutil.disk_usage(tmp_path).free
    # What counts as full, raised past what this disk has: the refusal, not the disk, is tested.
    monkeypatch.setattr(runs.checks, "MIN_FREE_BYTES", free + 2**30)  # write_problem reads it there
    problem = write_problem(tmp_path / "runs")
    assert problem.startswith(f"Runs cannot be saved: the disk holding {tmp_path} is full (")
    events = []
    result = TrainingSession(RunConfig.from_dict(tiny_config(tmp_path / "runs")), events.append).run()
    assert result.kind == "Failed" and result.message == problem
    assert not any("Loading" in getattr(e, "message", "") for e in events)
    assert not (tmp_path / "runs").exists()


def test_a_writable_folder_has_no_problem(tmp_path):
    assert write_problem(tmp_path) == "" and write_problem(tmp_path / "not" / "yet") == ""


def test_new_run_folder_picks_the_next_free_name(tmp_path):
    def where(*args, **kwargs):
        folder, note = new_run_folder(tmp_path, *args, **kwargs)
        return folder.path, note

    assert where("fixed") == (tmp_path / "fixed", "")
    (tmp_path / "fixed").mkdir()  # an empty folder takes a run
    assert where("fixed") == (tmp_path / "fixed", "")
    (tmp_path / "fixed" / runs.CONFIG).write_text("{}\n")
    (tmp_path / "fixed-2").write_text("a file in the way\n")
    assert where("fixed") == (tmp_path / "fixed-3", f"{tmp_path / 'fixed'} already holds a run: this run is fixed-3")
    # output.overwrite: true keeps replacing the run, as it always did.
    assert where("fixed", overwrite=True) == (tmp_path / "fixed", "")
    assert where("auto")[0].name.startswith("run-")


def test_a_fixed_run_name_trains_twice(tmp_path):
    cfg = tiny_config(tmp_path / "runs", "fixed")
    outcomes = [TrainingSession(RunConfig.from_dict(cfg)).run() for _ in range(2)]
    assert [o.kind for o in outcomes] == ["Finished", "Finished"], [getattr(o, "message", "") for o in outcomes]
    assert [o.run_dir for o in outcomes] == [str(tmp_path / "runs" / "fixed"), str(tmp_path / "runs" / "fixed-2")]
    log = RunFolder(outcomes[1].run_dir).log.read_text()
    assert "already holds a run: this run is fixed-2" in log
    assert RunFolder(outcomes[0].run_dir).status() == RunFolder(outcomes[1].run_dir).status() == "finished"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["fixed", "fixed-2"]
