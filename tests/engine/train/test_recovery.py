"""Recovery on the CPU through the real TrainingSession, with failures injected by the
session's documented `Faults` seam where the real ones arise:

- running out of memory mid-step: partial gradients dropped, the micro-batch lowered (or
  checkpointing, then offload, turned on), the step run again; the losses equal an
  uninterrupted run with the same global batch;
- a NaN or a spiking loss: back to the last good snapshot with half the learning rate; a
  second time the run stops with the last good state saved;
- a full disk at a checkpoint: no `step-N.tmp` left, one sentence on the disk, a pause that
  continues once there is room; a resume past a stray `.tmp` works. One test fills a real tiny
  tmpfs (a private mount namespace; skipped where `unshare` may not mount).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.events import (
    CheckpointSaved,
    DiskFull,
    Failed,
    Finished,
    LogLine,
    MemoryAdjusted,
    Paused,
    Resumed,
    RolledBack,
    StepMetrics,
)
from engine.resources import DEMO_PRESET
from engine.train.session import Faults, TrainingSession

ROOT = Path(__file__).resolve().parents[3]


def config(tmp_path, steps=5, rows=2, accum=2, **training) -> RunConfig:
    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.dtype = "float32"
    cfg.data.max_examples = 60
    cfg.data.max_seq_len = 128
    t = cfg.training
    t.max_steps, t.rows_per_micro_batch, t.grad_accum, t.save_every = steps, rows, accum, 0
    t.preflight = "off"
    for k, v in training.items():
        setattr(t, k, v)
    cfg.output.dir = str(tmp_path)
    return cfg


def train(cfg, run_dir, faults=None, on_event=None, **kw):
    events = []
    session = TrainingSession(cfg, None, run_dir=run_dir, faults=faults, **kw)

    def record(e):
        events.append(e)
        if on_event is not None:
            on_event(session, e)

    session.on_event = record
    return session, session.run(), events


def losses(events) -> list[float]:
    return [e.loss for e in events if isinstance(e, StepMetrics)]


def finished(result) -> Finished:
    assert isinstance(result, Finished), getattr(result, "message", "") + "\n" + getattr(result, "detail", "")
    return result


def no_partials(run_dir: Path) -> None:
    left = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert not left and not (run_dir / "adapter.tmp").exists(), left


# -- out of memory ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the recovered ones must equal: 2 rows x 2 micro-batches per step."""
    tmp = tmp_path_factory.mktemp("straight")
    _, result, events = train(config(tmp), tmp / "run")
    finished(result)
    assert not [e for e in events if isinstance(e, (MemoryAdjusted, RolledBack))]
    return losses(events)


def test_out_of_memory_mid_step_lowers_the_micro_batch_and_loses_nothing(tmp_path, straight):
    # Step 3's second micro-batch runs out of memory after the first left its gradients.
    session, result, events = train(config(tmp_path), tmp_path / "run", Faults(oom_at_steps=[3]))
    finished(result)
    changes = [e for e in events if isinstance(e, MemoryAdjusted)]
    assert len(changes) == 1, changes
    c = changes[0]
    assert (c.step, c.phase, c.setting, c.before, c.after) == (3, "step", "micro_batch", 2, 1)
    assert c.rows_per_micro_batch == 1 and c.micro_batches_per_step == 4
    assert "micro-batch 2 → 1 row" in c.message and "runs again" in c.message
    steps = [e.step for e in events if isinstance(e, StepMetrics)]
    assert steps == [1, 2, 3, 4, 5]  # the curve continues: step 3 once, nothing skipped
    # Same global batch, partial gradients dropped: the optimisation is unchanged.
    assert losses(events) == pytest.approx(straight, rel=1e-4)
    # A resume keeps the lowered setting.
    state = json.loads((session.run_dir / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    assert state["recovery"]["rows_per_forward"] == 1


def test_out_of_memory_at_one_row_turns_on_checkpointing_then_offload(tmp_path, straight):
    def needs_offload(attempt):  # from step 2 on, only one row with checkpointing and offload fits
        return attempt["step"] >= 2 and attempt["offload"] == "off"

    cfg = config(tmp_path, gradient_checkpointing=False, offload="off")
    _, result, events = train(cfg, tmp_path / "run", Faults(oom_when=needs_offload))
    finished(result)
    changes = [(e.step, e.setting, e.before, e.after) for e in events if isinstance(e, MemoryAdjusted)]
    assert changes == [
        (2, "micro_batch", 2, 1),
        (2, "gradient_checkpointing", False, True),
        (2, "offload", "off", "single"),
    ]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5]
    assert "single" in [e for e in events if isinstance(e, StepMetrics)][-1].offload
    # The planned micro-batches run as single rows (same global batch); checkpointing and
    # offload recompute the same forward.
    assert losses(events) == pytest.approx(straight, rel=1e-4)


def test_out_of_memory_with_nothing_left_to_lower_names_only_what_is_left(tmp_path):
    # Nothing fits from step 2 on: the run lowers all it can, then ends with advice that does
    # not repeat what is already on (checkpointing, offload, one row).
    cfg = config(tmp_path, gradient_checkpointing=False, offload="off")
    _, result, events = train(cfg, tmp_path / "run", Faults(oom_when=lambda a: a["step"] >= 2 and not a["rehearsal"]))
    assert isinstance(result, Failed), result
    assert [e.setting for e in events if isinstance(e, MemoryAdjusted)] == [
        "micro_batch",
        "gradient_checkpointing",
        "offload",
    ]
    msg = result.message
    assert msg.startswith("Out of GPU memory. To fit: lower data.max_seq_len (now 128)"), msg
    assert "rows_per_micro_batch" not in msg and "checkpointing" not in msg and "offload" not in msg
    assert "model.load_in_4bit: true" in msg


# -- NaN and loss spikes ------------------------------------------------------------------------------


def test_nan_rolls_back_halves_the_lr_and_continues(tmp_path):
    """A NaN at step 3 poisons the update; the run goes back to the start (the only good
    snapshot), halves the LR and continues: from there it is exactly a run at half the LR."""
    cfg = config(tmp_path / "nan", steps=5)
    _, result, events = train(cfg, tmp_path / "nan" / "run", Faults(nan_at_steps=[3]))
    finished(result)
    back = [e for e in events if isinstance(e, RolledBack)]
    assert len(back) == 1
    b = back[0]
    assert (b.step, b.to_step, b.reason) == (3, 0, "nan")
    assert b.lr_after == pytest.approx(b.lr_before / 2)
    assert "NaN" in b.message and "halved" in b.message
    after = [e for e in events if isinstance(e, StepMetrics) and e.time > b.time]
    assert [e.step for e in after] == [1, 2, 3, 4, 5]
    assert all(e.loss == e.loss for e in after)  # finite again

    half = config(tmp_path / "half", steps=5, lr=cfg.training.lr / 2)
    _, ref, ref_events = train(half, tmp_path / "half" / "run")
    finished(ref)
    assert [e.loss for e in after] == pytest.approx(losses(ref_events), rel=1e-4)
    assert [e.lr for e in after] == pytest.approx([e.lr for e in ref_events if isinstance(e, StepMetrics)])


def test_a_spike_rolls_back_to_the_last_trusted_snapshot(tmp_path):
    """After warm-up a loss 50x the recent median is a spike. Steps 11..13 ran from the snapshot
    taken at step 10 (trusted once step 11 was good): the run goes back there."""
    cfg = config(tmp_path, steps=14, rows=1, accum=1, warmup_steps=2)
    _, result, events = train(cfg, tmp_path / "run", Faults(spike_at_steps=[13]))
    finished(result)
    (b,) = [e for e in events if isinstance(e, RolledBack)]
    assert (b.step, b.to_step, b.reason) == (13, 10, "spike")
    assert "spiked" in b.message and "median" in b.message
    metrics = [e for e in events if isinstance(e, StepMetrics)]
    first = {e.step: e.loss for e in metrics if e.time < b.time}
    again = {e.step: e.loss for e in metrics if e.time > b.time}
    assert sorted(again) == [11, 12, 13, 14]
    # Step 11 starts from the same state, so its loss is the same; the LR is halved after it.
    assert again[11] == pytest.approx(first[11], rel=1e-5)
    assert 13 not in first  # the spiking step is not reported as a step


def test_a_second_bad_loss_stops_with_the_last_good_state_saved(tmp_path):
    cfg = config(tmp_path, steps=5)
    session, result, events = train(cfg, tmp_path / "run", Faults(nan_at_steps=[3, 3]))
    assert isinstance(result, Failed), result
    assert "already halved the learning rate" in result.message
    assert result.last_checkpoint and result.last_checkpoint.endswith("step-0")
    assert len([e for e in events if isinstance(e, RolledBack)]) == 1
    state = json.loads((Path(result.last_checkpoint) / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["recovery"]["rollbacks"] == 1
    no_partials(session.run_dir)
    assert not (session.run_dir / "adapter").exists()  # no final adapter from a diverged run


# -- a full disk -----------------------------------------------------------------------------------------


class FakeFree:
    """Stands in for the disk's free space (Faults.disk_free): `free` bytes until set to None. The
    first reading, the check before the run starts (which refuses a full disk), sees the real disk:
    these tests are about a disk that fills during the run."""

    def __init__(self, free):
        self.free = free
        self.readings = 0

    def __call__(self, path):
        self.readings += 1
        return shutil.disk_usage(path).free if self.free is None or self.readings == 1 else self.free


def test_too_little_space_for_a_checkpoint_pauses_then_continues(tmp_path):
    free = FakeFree(2**20)
    pauses = []

    def make_room(session, e):
        if isinstance(e, Paused) and e.reason:
            pauses.append(e)
            free.free = None  # the person freed some space
            session.request_resume()

    cfg = config(tmp_path, steps=4, save_every=2)
    session, result, events = train(cfg, tmp_path / "run", Faults(disk_free=free), on_event=make_room)
    finished(result)
    (full,) = [e for e in events if isinstance(e, DiskFull)]
    assert full.step == 2 and full.what == "checkpoint" and full.free == 2**20 and full.needed > full.free
    sentence = full.message.split(". ")[0]
    assert (
        f"The disk at {full.mount} is full" in sentence and "needs about" in sentence and "1.0 MiB is free" in sentence
    )
    assert pauses and pauses[0].reason == full.message
    assert any(isinstance(e, Resumed) for e in events)
    saved = [e.step for e in events if isinstance(e, CheckpointSaved)]
    assert saved == [2, 4]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4]
    no_partials(session.run_dir)
    assert (session.run_dir / "adapter" / "adapter_model.safetensors").is_file()

    # A stray step-N.tmp (a write a full disk cut short) does not stop a resume.
    stray = session.run_dir / "checkpoints" / "step-5.tmp"
    (stray / "adapter").mkdir(parents=True)
    (stray / "optimizer.pt").write_bytes(b"\0" * 1000)
    more = config(tmp_path, steps=5, save_every=2)
    _, resumed, resumed_events = train(more, None, resume_from=session.run_dir)
    assert finished(resumed).summary["steps"] == 5
    assert not stray.exists()
    assert any(isinstance(e, LogLine) and "step-5.tmp" in e.message for e in resumed_events)


def test_stop_while_waiting_for_disk_space_keeps_the_last_good_checkpoint(tmp_path):
    def stop(session, e):
        if isinstance(e, Paused) and e.reason:
            session.request_stop()

    cfg = config(tmp_path, steps=4, save_every=2)
    session, result, events = train(cfg, tmp_path / "run", Faults(disk_free=FakeFree(1000)), on_event=stop)
    assert finished(result).stopped
    assert not [e for e in events if isinstance(e, CheckpointSaved)]
    no_partials(session.run_dir)
    assert any(isinstance(e, LogLine) and "stops without it" in e.message for e in events)


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


TINY_DISK = """
import json, os, shutil, sys
from pathlib import Path
from engine.config import RunConfig
from engine.events import DiskFull, Finished, LogLine, Paused
from engine.resources import DEMO_PRESET
from engine.train.session import Faults, TrainingSession

disk = Path(sys.argv[1])
def cfg(steps):
    c = RunConfig.load(DEMO_PRESET)
    c.model.dtype = "float32"; c.data.max_examples = 60; c.data.max_seq_len = 128
    t = c.training
    t.max_steps, t.rows_per_micro_batch, t.grad_accum, t.save_every, t.preflight = steps, 2, 1, 2, "off"
    return c
ballast = disk / "ballast"
ballast.write_bytes(b"\\1" * (shutil.disk_usage(disk).free - 1024 * 1024))  # ~1 MiB left
# The free-space checks are told there is room twice, before the run starts and before the checkpoint at
# step 2: the real write then fails.
probes = [1 << 40, 1 << 40]
faults = Faults(disk_free=lambda p: probes.pop() if probes else shutil.disk_usage(p).free)
out = {"events": []}
session = TrainingSession(cfg(3), None, run_dir=disk / "run", faults=faults)
def on_event(e):
    out["events"].append([e.kind, getattr(e, "message", "")])
    if isinstance(e, Paused) and e.reason:
        out["tmp_while_paused"] = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
        ballast.unlink()
        session.request_resume()
session.on_event = on_event
r = session.run()
out["first"] = [r.kind, getattr(r, "message", ""), getattr(r, "detail", "")[-2000:]]
# A write cut short again: a stray step-N.tmp fills the disk; the resume must clear it and go on.
stray = disk / "run" / "checkpoints" / "step-4.tmp"
stray.mkdir()
with open(stray / "optimizer.pt", "wb", buffering=0) as f:  # unbuffered: no write is left for close to flush
    try:
        while True:
            f.write(b"\\2" * 65536)
    except OSError as exc:
        out["filled"] = exc.errno
r = TrainingSession(cfg(4), None, resume_from=disk / "run").run()
out["resumed"] = [r.kind, getattr(r, "message", ""), getattr(r, "detail", "")[-2000:]]
out["left"] = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # three CLI runs in a child process
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and unshare to mount a private tmpfs")
def test_a_real_full_disk_during_a_checkpoint(tmp_path):
    """On an 80 MiB tmpfs (above the 64 MiB a run asks for at its start): the checkpoint write
    really fails with ENOSPC (torch/safetensors), the partial step-2.tmp is removed, the run
    pauses, and continues once space is freed; a stray tmp that fills the disk does not stop
    `--resume` (its room counts as free: the run removes it before writing)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "tiny_disk.py"
    script.write_text(textwrap.dedent(TINY_DISK))
    cmd = f"mount -t tmpfs -o size=80m tmpfs {disk} && {sys.executable} {script} {disk}"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["first"][0] == "Finished", res["first"]
    kinds = [k for k, _ in res["events"]]
    assert "DiskFull" in kinds and "Resumed" in kinds
    failed_write = [m for k, m in res["events"] if k == "LogLine" and "Writing the checkpoint at step 2 failed" in m]
    assert failed_write, res["events"]
    assert res["tmp_while_paused"] == []  # no step-2.tmp kept the disk full
    full = next(m for k, m in res["events"] if k == "DiskFull")
    assert "is full: the checkpoint at step 2 needs about" in full
    assert res["filled"] == 28  # ENOSPC: the stray tmp really filled the disk
    assert res["resumed"][0] == "Finished", res["resumed"]
    assert "step-4" in res["left"] and not [n for n in res["left"] if n.endswith(".tmp")]
