"""engine.runs.records: the small files of a run folder read back as plain values (never raising
for a broken file) and written whole."""

from __future__ import annotations

import json
import os
import socket

import pytest

from engine.runs import records
from engine.runs.layout import RunLayout


@pytest.fixture
def run(tmp_path) -> RunLayout:
    run = RunLayout(tmp_path / "r")
    run.path.mkdir()
    return run


def test_last_event_reads_the_outcome_at_the_end_of_a_long_file(run):
    steps = "".join(json.dumps({"event": "StepMetrics", "step": i, "loss": 1.0}) + "\n" for i in range(2000))
    run.metrics.write_text(steps + json.dumps({"event": "Finished", "stopped": True}) + "\n")
    assert run.metrics.stat().st_size > 8192 * 4  # more than the tail it reads
    assert records.last_event(run) == {"event": "Finished", "stopped": True}


@pytest.mark.parametrize("text", [None, "", '{"event": "StepMe', "not json\n"])
def test_last_event_is_none_without_a_readable_last_line(run, text):
    if text is not None:
        run.metrics.write_text(text)
    assert records.last_event(run) is None


def test_last_write_is_the_newest_of_metrics_and_log(run):
    assert records.last_write(run) is None
    run.metrics.write_text("{}\n")
    run.log.write_text("x\n")
    os.utime(run.metrics, (1000.0, 1000.0))
    os.utime(run.log, (2000.0, 2000.0))
    assert records.last_write(run) == 2000.0


@pytest.mark.parametrize(
    "text,problem",
    [
        (None, "config.yaml is missing from"),
        ("model: [unclosed\n", "is not valid YAML (line"),
        ("- a list\n", "holds no settings"),
        (b"\xff\xfe\x00", "cannot be read"),
    ],
)
def test_read_config_names_what_is_wrong(run, text, problem):
    if isinstance(text, bytes):
        run.config.write_bytes(text)
    elif text is not None:
        run.config.write_text(text)
    data, why = records.read_config(run)
    assert data == {} and problem in why and str(run.path) in why


def test_read_config_gives_plain_data(run):
    run.config.write_text("model:\n  name_or_path: demo\n")
    assert records.read_config(run) == ({"model": {"name_or_path": "demo"}}, "")


def test_best_is_written_whole_and_read_back(run):
    assert records.read_best(run) is None
    records.write_best(run, {"step": 4, "eval_loss": 1.5, "checkpoint": run.checkpoint(4)})
    assert records.read_best(run) == {"step": 4, "eval_loss": 1.5, "checkpoint": str(run.checkpoint(4))}
    assert sorted(p.name for p in run.path.iterdir()) == [run.best_file.name]  # no .tmp left
    run.best_file.write_text("[1, 2]")
    assert records.read_best(run) is None  # not a dict


def test_gallery_skips_cut_lines_and_records_without_a_step(run):
    records.append_gallery(run, [{"step": 1, "prompt": "p", "answer": "a"}])
    with run.gallery_file.open("a", encoding="utf-8") as f:
        f.write('{"step": "two"}\n{"step": 3, "prompt": "q", "ans')  # a kill mid-line
    records.append_gallery(run, [{"step": 4, "prompt": "r", "answer": "b"}])
    assert [r["step"] for r in records.read_gallery(run)] == [1, 4]


def test_a_lock_is_live_while_its_process_is(run):
    assert not records.lock_is_live(run)
    records.write_lock(run)
    assert records.lock_is_live(run) and json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    records.write_lock(run, pid=2**22 + 12345)  # above Linux's pid_max: no such process
    assert not records.lock_is_live(run)
    run.lock_file.write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname() + "-other"}))
    assert records.lock_is_live(run)  # another machine's lock is taken at its word
    run.lock_file.write_text("garbage")
    assert not records.lock_is_live(run)
    records.remove_lock(run)
    records.remove_lock(run)  # twice is fine
    assert not run.lock_file.exists()


def test_the_control_file_is_written_whole_for_the_reader_under_torchrun(run):
    from engine.train.distributed import read_control

    assert read_control(run.control_file) is None
    for request in ("pause", "resume", "stop"):
        records.write_control(run, request)
        assert read_control(run.control_file) == request
    assert sorted(p.name for p in run.path.iterdir()) == [run.control_file.name]  # no .tmp left
