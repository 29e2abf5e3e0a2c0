"""The session's parts on their own (engine.train: control, reporting, recovery, rollback,
saving, evaluator, probe), without a training run; the session's own tests drive them together."""

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import RunConfig
from engine.events import CheckpointSaved, DiskFull, MemoryAdjusted, Paused, RolledBack
from engine.resources import DEMO_PRESET
from engine.runs import RunFolder
from engine.train.control import RunControl
from engine.train.distributed import DistContext
from engine.train.reporting import Reporter


class Recorder:
    """emit/log for a part: the events in order, and a threading.Event per kind seen."""

    def __init__(self):
        self.events, self.logs, self.seen = [], [], {}
        self.lock = threading.Lock()

    def emit(self, event):
        with self.lock:
            self.events.append(event)
            self.seen.setdefault(event.kind, threading.Event()).set()

    def log(self, message, level="info"):
        self.logs.append((level, message))

    def wait_for(self, kind):
        with self.lock:
            flag = self.seen.setdefault(kind, threading.Event())
        assert flag.wait(60), f"no {kind} event"

    def kinds(self):
        return [e.kind for e in self.events]


# -- run control -----------------------------------------------------------------------------------
def test_pause_then_resume_between_steps():
    rec = Recorder()
    control = RunControl(rec.emit, rec.log)
    control.request_pause()
    assert control.paused
    out = []
    t = threading.Thread(target=lambda: out.append(control.wait_if_paused(7, DistContext(), None)))
    t.start()
    rec.wait_for("Paused")
    assert control.paused_at == 7  # a probe may ask now
    control.request_resume()
    t.join(60)
    assert out == [False] and control.paused_at is None
    assert rec.kinds() == ["Paused", "Resumed"]


def test_stop_wakes_a_paused_run():
    rec = Recorder()
    control = RunControl(rec.emit, rec.log)
    control.request_pause()
    out = []
    t = threading.Thread(target=lambda: out.append(control.wait_if_paused(2, DistContext(), None)))
    t.start()
    rec.wait_for("Paused")
    control.request_stop()
    t.join(60)
    assert out == [True] and rec.kinds() == ["Paused"]  # no Resumed for a run that stops


def test_the_control_file_carries_the_windows_request(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    control = RunControl(Recorder().emit, Recorder().log)
    for request, paused, stopping in (("pause", True, False), ("resume", False, False), ("stop", False, True)):
        folder.control_file.write_text(request + "\n")
        control.read_control(folder.path)
        assert (control.paused, control.stopping) == (paused, stopping), request
    assert folder.control_file.name == "control"  # the name the window writes (engine.runs)


# -- reporting -----------------------------------------------------------------------------------------
def test_the_reporter_writes_the_run_files_and_other_ranks_say_nothing(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    seen = []
    main = Reporter(seen.append)
    main.open_files(folder)
    main.log("hello", "warning")
    main.emit(Paused(3))
    main.close()
    assert [e.kind for e in seen] == ["LogLine", "Paused"]
    assert folder.log.read_text().strip().endswith("warning: hello")
    assert len(folder.metrics.read_text().splitlines()) == 2
    quiet = []
    Reporter(quiet.append, is_main=False).log("not rank 0")
    assert quiet == []


# -- out-of-memory recovery: the order of the memory changes -------------------------------------------
@pytest.fixture(scope="module")
def demo_model():
    from engine.models.loading import load_model
    from engine.models.lora import attach_lora
    from engine.train.step import prepare_model

    cfg = RunConfig.load(DEMO_PRESET)
    cfg.model.dtype = "float32"
    cfg.training.gradient_checkpointing = False
    cfg.training.offload = "off"
    model = attach_lora(load_model(cfg.model, "cpu", "float32"), cfg.lora)
    return cfg, prepare_model(model, cfg.fast_paths, "cpu", False, offload="off")


def test_memory_changes_come_in_order_and_are_kept(demo_model):
    from engine.train.recovery import MemorySettings
    from engine.train.schedule import StepPlan

    cfg, prepared = demo_model
    rec = Recorder()
    plan = StepPlan(64, 4, 2, 0)
    memory = MemorySettings(prepared.model, torch.device("cpu"), cfg, plan, prepared, rec.emit, rec.log)
    assert memory.forwards_per_step() == 2
    changes = []
    while (change := memory.next_change()) is not None:
        memory.apply(change, "step", 5, "test")
        changes.append(change)
        assert len(changes) < 10
    assert changes == [
        ("micro_batch", 4, 2),
        ("micro_batch", 2, 1),
        ("gradient_checkpointing", False, True),
        ("offload", "off", "single"),
    ]
    assert [e.setting for e in rec.events if isinstance(e, MemoryAdjusted)] == [c[0] for c in changes]
    assert memory.rows == 1 and memory.forwards_per_step() == 8 and memory.checkpointing
    saved = memory.state()
    assert saved == {
        "rows_per_forward": 1,
        "gradient_checkpointing": True,
        "offload": "single",
        "host_embeddings": False,
        "tiled_mlp": False,
    }
    assert "lower training.rows_per_micro_batch" not in memory.advice()  # one row is the least


def test_is_oom_tells_memory_from_other_errors():
    from engine.train.recovery import is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


# -- the NaN/spike guard ---------------------------------------------------------------------------------
def guard_for(lr=0.1, spike_factor=3.0):
    from engine.train.rollback import LossGuard

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    training = SimpleNamespace(spike_factor=spike_factor, warmup_steps=0)
    rec = Recorder()
    return LossGuard([param], optimizer, scheduler, training, torch.device("cpu"), False, rec.emit, rec.log), rec


def step_once(guard):
    (param,) = guard.params
    param.grad = torch.ones_like(param)
    guard.optimizer.step()
    guard.scheduler.step()


def test_bad_losses_are_nan_inf_and_spikes_after_history():
    guard, _ = guard_for()
    assert guard.bad_loss(1, float("nan"))[0] == "nan" and guard.bad_loss(1, float("inf"))[0] == "inf"
    assert guard.bad_loss(1, 100.0) is None  # no history yet: no median to compare with
    for s in range(1, 6):
        guard.good_loss(s, 2.0)
    assert guard.bad_loss(6, 5.9) is None and guard.bad_loss(6, 6.1)[0] == "spike"


def test_a_loss_that_is_no_measure_of_progress_has_no_spikes_but_nan_is_guarded():
    from engine.train.rollback import LossGuard

    guard, rec = guard_for()
    quiet = LossGuard(guard.params, guard.optimizer, guard.scheduler, SimpleNamespace(spike_factor=3.0, warmup_steps=0),
                      torch.device("cpu"), False, rec.emit, rec.log, check_spikes=False)  # fmt: skip
    for s in range(1, 6):
        guard.good_loss(s, 1e-9)
        quiet.good_loss(s, 1e-9)
    assert guard.bad_loss(6, 1e-3)[0] == "spike" and quiet.bad_loss(6, 1e-3) is None
    assert quiet.bad_loss(6, float("nan"))[0] == "nan" and quiet.bad_loss(6, float("inf"))[0] == "inf"


def test_rollback_restores_the_good_state_and_halves_the_lr_then_gives_up():
    from engine.train.rollback import TrainingDiverged

    guard, rec = guard_for()
    guard.start(0)
    start = guard.params[0].detach().clone()
    for s in range(3):
        step_once(guard)
        guard.good_loss(s + 1, 1.0)
    assert not torch.equal(guard.params[0], start)
    back = guard.roll_back(4, "nan", float("nan"), "turned NaN", save_good=lambda s: pytest.fail("saved"))
    assert back == 0 and torch.equal(guard.params[0].detach(), start)
    assert guard.optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and guard.rollbacks == 1
    (event,) = [e for e in rec.events if isinstance(e, RolledBack)]
    assert (event.step, event.to_step, event.lr_after) == (4, 0, pytest.approx(0.05))
    saved = []
    with pytest.raises(TrainingDiverged):  # the second bad loss after a halving: the type says it
        guard.roll_back(2, "spike", 9.0, "spiked", save_good=lambda s: saved.append(s) or "; saved")
    assert saved == [0]


# -- saving: the wait on a full disk -----------------------------------------------------------------
def saver_for(tmp_path, free):
    from engine.train.saving import Saver

    rec = Recorder()
    control = RunControl(rec.emit, rec.log)
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    saver = Saver(folder, None, None, None, None, [], DistContext(), False, control, rec.emit, rec.log, free)
    saver.poll_seconds = 0.01  # how often the free space is looked at, not evidence of anything
    return saver, control, rec


def test_a_full_disk_pauses_until_there_is_room(tmp_path):
    frees = iter([10, 10, 10, 10_000])
    saver, _, rec = saver_for(tmp_path, lambda path: next(frees, 10_000))
    target = tmp_path / "run" / "out"
    written = saver.write_with_room(3, target, 1000, lambda: target, "checkpoint")
    assert written == target
    assert rec.kinds() == ["DiskFull", "Paused", "Resumed"]
    full = rec.events[0]
    assert isinstance(full, DiskFull) and (full.needed, full.free) == (1000, 10)


def test_a_stop_while_waiting_for_room_writes_nothing(tmp_path):
    saver, control, rec = saver_for(tmp_path, lambda path: 10)
    out = []
    target = tmp_path / "run" / "out"
    t = threading.Thread(target=lambda: out.append(saver.write_with_room(1, target, 1000, lambda: target, "adapter")))
    t.start()
    rec.wait_for("Paused")
    control.request_stop()
    t.join(60)
    assert out == [None] and "Resumed" not in rec.kinds()


# -- evaluation: schedule, best checkpoint, patience -------------------------------------------------
def test_the_best_eval_gets_a_checkpoint_and_patience_runs_out(tmp_path, monkeypatch):
    from engine.train.evaluation import HeldOut
    from engine.train.evaluator import Evaluator

    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    rec = Recorder()
    reporter = SimpleNamespace(emit=rec.emit, log=rec.log, loggers=None)
    held = HeldOut([[1, 2, 3]] * 4, [[False, True, True]] * 4, "split")
    training = SimpleNamespace(eval_every=2, early_stopping_patience=2)
    runner = SimpleNamespace(dist=DistContext())
    ev = Evaluator(runner, held, training, 10, reporter, folder, 64)
    assert [s for s in range(1, 11) if ev.due(s)] == [2, 4, 6, 8, 10]
    losses = iter([3.0, 2.0, 2.5, 2.4])
    monkeypatch.setattr(ev, "loss", lambda step=0: (next(losses), 12, {}))
    written = []

    def save(step):
        path = folder.checkpoint(step)
        path.mkdir(parents=True)
        written.append(path)
        return True

    stops = [ev.evaluate(s, save, lambda: written[-1] if written else None) for s in (2, 4, 6, 8)]
    assert stops == [False, False, False, True] and ev.early_stopped
    assert ev.best["step"] == 4 and folder.best()["step"] == 4
    assert not folder.checkpoint(2).exists()  # written only for an earlier best: removed
    assert ev.state()["best_only"] == [4]


# -- the probe ---------------------------------------------------------------------------------------
def test_the_probe_answers_only_while_paused():
    from engine.train.probe import ProbeUnavailable, probe

    control = RunControl(Recorder().emit, Recorder().log)
    with pytest.raises(ProbeUnavailable, match="not paused"):
        probe(control, None, False, "hi", 8)
    with pytest.raises(ProbeUnavailable, match="several processes"):
        probe(control, None, True, "hi", 8)


def test_saved_checkpoint_event_names_the_folder(tmp_path):
    """Saver.checkpoint on the demo model: CheckpointSaved with the step's folder, the state's
    extra kept."""
    import json

    from engine.models.loading import load_model, load_tokenizer
    from engine.models.lora import attach_lora, lora_parameters
    from engine.train.saving import Saver

    cfg = RunConfig.load(DEMO_PRESET)
    model = attach_lora(load_model(cfg.model, "cpu", "float32"), cfg.lora)
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    rec = Recorder()
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    control = RunControl(rec.emit, rec.log)
    saver = Saver(
        folder,
        model,
        optimizer,
        scheduler,
        load_tokenizer(cfg.model),
        params,
        DistContext(),
        False,
        control,
        rec.emit,
        rec.log,
    )
    assert saver.checkpoint(3, {"eval": {"best": None}})
    (event,) = [e for e in rec.events if isinstance(e, CheckpointSaved)]
    assert Path(event.path) == folder.checkpoint(3) == saver.last_checkpoint
    state = json.loads((folder.checkpoint(3) / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["eval"] == {"best": None}
    assert saver.adapter(3) and (folder.adapter / "adapter_model.safetensors").is_file()


# -- what a failed run says ------------------------------------------------------------------------
def test_failure_messages_say_what_to_do():
    import errno

    from engine.config import ConfigError
    from engine.train.failure import failure_message
    from engine.train.preflight import OverTheCard

    assert failure_message(ConfigError("training.lr", "must be > 0, got 0")) == "training.lr: must be > 0, got 0"
    oom = failure_message(torch.OutOfMemoryError("CUDA out of memory"), lambda: "turn on gradient checkpointing")
    assert oom == "Out of GPU memory. To fit: turn on gradient checkpointing."
    over = failure_message(OverTheCard("its peak is over the card"), lambda: "")  # nothing left: the generic advice
    assert over.startswith("Out of GPU memory from the second step on") and "load the model in 4 bits" in over
    full = failure_message(OSError(errno.ENOSPC, "No space left on device"))
    assert full == "The disk is full: free some space, then resume the run."
    assert failure_message(KeyError("x")) == "Training failed: KeyError: 'x'"
