"""The parts the session's loop calls, built once the model, the optimizer and the step plan exist:
the memory settings and the step (recovery, step_runner), the loss guard (rollback), saving, the
evaluator, the gallery, the pre-flight and the step's report (step_report).

`build_parts` wires them to one another and to the session's reporter and control; the session
keeps the recipe (which part runs when) and each part keeps its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from engine.counters import Counters
from engine.runs import step_of
from engine.train.control import RunControl
from engine.train.data_setup import LoadedData
from engine.train.distributed import DistContext, share_from_main
from engine.train.evaluator import Evaluator
from engine.train.faults import Faults
from engine.train.gallery import Gallery
from engine.train.model_setup import ModelSetup
from engine.train.preflight import Preflight
from engine.train.recovery import MemorySettings
from engine.train.reporting import Reporter
from engine.train.rollback import LossGuard
from engine.train.run_setup import RunSetup
from engine.train.saving import Saver
from engine.train.step_report import StepReport
from engine.train.step_runner import StepRunner


@dataclass
class Parts:
    memory: MemorySettings  # the memory settings out-of-memory recovery lowers, in order
    runner: StepRunner  # a step's forwards and backwards, and its retry
    loss_guard: LossGuard  # the NaN/spike guard, its snapshots and rollback
    saver: Saver  # checkpoints, the final adapter, the full-disk wait
    evaluator: Evaluator  # the eval loss, the best checkpoint, early stopping
    gallery: Gallery  # the prompts answered at each checkpoint
    preflight: Preflight  # the measured rehearsal of a step
    report: StepReport  # each step's counters and metrics
    plan: Any  # engine.train.schedule.StepPlan: which rows each step reads (its epoch)
    total: int  # the run's optimizer steps
    dist: DistContext
    fsdp: bool

    # -- what the parts remember, in each checkpoint ------------------------------------------------
    def save(self, step: int, gallery: bool = True) -> bool:
        """The checkpoint of `step` with what the parts remember (engine.train.saving); False
        when the run was stopped before it could be written. `gallery`: the gallery answers at
        it (not for a checkpoint written only as the best so far: those come with every
        improving eval, and the gallery would cost more than the eval)."""
        extra = {
            "total_steps": self.total,
            "epoch": self.plan.epoch_at(step),
            "recovery": {**self.memory.state(), "rollbacks": self.loss_guard.rollbacks},
            "eval": self.evaluator.state(),
        }
        # Under FSDP the gallery's forwards need every rank: rank 0 tells the others whether it
        # wrote the checkpoint the gallery answers at.
        written = self.saver.checkpoint(step, extra)
        answer = written and gallery
        if gallery and self.fsdp and self.gallery:
            answer = share_from_main(self.dist, answer)
        if answer:
            self.gallery.run(step, self.saver.last_checkpoint)
        return written

    def save_best(self, step: int) -> bool:
        """The checkpoint of the best eval so far (without the gallery)."""
        return self.save(step, gallery=False)

    def last(self) -> Optional[Path]:
        """The last checkpoint written (or resumed from), None before the first."""
        return self.saver.last_checkpoint

    def save_good(self, good_step: int) -> str:
        """After a second bad loss: the good state just reloaded, saved unless a checkpoint at or
        after it exists; how the message names it."""
        last = self.saver.last_checkpoint
        if last is None or step_of(last) < good_step:
            return f"; its checkpoint is {self.saver.last_checkpoint}" if self.save(good_step) else ""
        return f"; the last good checkpoint is {last}"

    def restore(self, state: dict) -> None:
        """What a resumed checkpoint's `state` says the parts remembered: the lowered memory
        settings, the rollbacks, the best eval."""
        recovery = state.get("recovery") or {}
        self.loss_guard.rollbacks = int(recovery.get("rollbacks", 0))
        self.memory.restore(recovery)
        self.evaluator.restore(state.get("eval") or {})


def build_parts(
    run: RunSetup,
    loaded: LoadedData,
    built: ModelSetup,
    dist: DistContext,
    plan,
    optimizer,
    scheduler,
    total: int,
    control: RunControl,
    reporter: Reporter,
    counters: Counters,
    faults: Optional[Faults],
    disk_poll_seconds: float,
) -> Parts:
    """The parts over the run's setup (`run`, `loaded`, `built`), its optimizer, LR `scheduler`
    and step `plan` (engine.train.schedule.StepPlan) of `total` steps. `faults`: failures to
    inject, for tests only; `disk_poll_seconds`: between looks at the free space on a full disk."""
    config, t, device, rep = run.config, run.config.training, run.device, reporter
    model, data, heldout, tokenizer = built.model, loaded.data, loaded.heldout, loaded.tokenizer
    memory = MemorySettings(model, device, config, plan, built.prepared, rep.emit, rep.log, dist.enabled)
    runner = StepRunner(
        run.objective,
        built.forward,
        model,
        built.ddp,
        run.fsdp,
        dist,
        device,
        data,
        plan,
        memory,
        optimizer,
        tokenizer,
        faults,
        graphs=built.graphs,
    )
    loss_guard = LossGuard(
        built.params,
        optimizer,
        scheduler,
        t,
        device,
        run.fsdp,
        rep.emit,
        rep.log,
        check_spikes=run.objective.loss_is_progress,
    )
    saver = Saver(
        run.folder,
        model,
        optimizer,
        scheduler,
        tokenizer,
        built.params,
        dist,
        run.fsdp,
        control,
        rep.emit,
        rep.log,
        faults.disk_free if faults else None,
    )
    saver.poll_seconds = disk_poll_seconds
    row_tokens = data.packing.row_tokens
    evaluator = Evaluator(runner, heldout, t, total, rep, run.folder, row_tokens)
    chat = data.spec.kind != "text"
    gallery = Gallery(
        runner, tokenizer, t, heldout, chat, int(config.data.max_seq_len), rep, run.folder, config.data.thinking
    )
    # The profile's total: an emulated card's cap (TUNESMITH_EMULATE_GPU), not the host GPU's.
    mem_total = run.profile.total_vram if device.type == "cuda" else host_total()
    preflight = Preflight(runner, built.params, run.profile, mem_total, config.auto_fields, rep.emit, rep.log, faults)
    report = StepReport(run.objective, memory, plan, scheduler, device, total, mem_total, t.log_every, counters, rep)
    return Parts(memory, runner, loss_guard, saver, evaluator, gallery, preflight, report, plan, total, dist, run.fsdp)


def host_total() -> int:
    """The host's memory: a CPU run's total beside its metrics."""
    import psutil

    return psutil.virtual_memory().total
