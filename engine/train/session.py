"""TrainingSession: one fine-tuning run, from config to adapter, reported through events.

The loop is our own rather than transformers' Trainer: it has to honour pause and stop
between steps, emit typed events with memory and packing counters, feed packed micro-batches
with prebuilt metadata, and compute the loss from hidden states with the fused
cross-entropy, all of which the Trainer would need overriding piecemeal.

`run()` blocks (call it on a worker thread) and never raises for bad input: every outcome,
including failure, arrives as an event, and `run()` returns the last one.

This file is the recipe (`_run`): the named setup steps, then a short loop over parts that
each live in a module of their own:
- the setup steps: the config's defaults, the device and the run folder (run_setup), the data
  (data_setup), the model with LoRA and the run's forward (model_setup), the parts built and
  what they remember in a checkpoint (parts);
- what the run learns: the objective `training.method` names (engine.train.objectives: data,
  batches, loss, metrics, eval; the session never tests which method it runs);
- the step's forwards and backwards, and its retry (step_runner), over the memory settings
  that out-of-memory recovery lowers in a fixed order (recovery);
- the NaN/spike guard with its snapshots and rollback (rollback);
- the measured pre-flight and its growth (preflight);
- checkpoints, the final adapter and the wait on a full disk (saving);
- the eval loss, the best checkpoint and early stopping (evaluator);
- the gallery and the probe of a paused run (gallery, probe);
- pause, resume, stop and the control file (control); events to files and loggers (reporting);
- each step's metrics event (step_report) and the run's summary at the end (finish).
Where files lie in the run folder is engine.runs' business. The run folder holds running.lock
(this pid) while the session runs.

`Faults` (engine.train.faults) is the seam tests use to inject failures where they really arise.
"""

from __future__ import annotations

import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from engine.config import RunConfig
from engine.counters import Counters
from engine.events import Event, Failed, Finished, LogLine, RunStarted
from engine.runs import RunFolderError, resume_checkpoint, step_of
from engine.train.control import RunControl
from engine.train.distributed import DistContext
from engine.train.failure import failure_message
from engine.train.faults import Faults
from engine.train.finish import run_summary
from engine.train.guard import RunGuard
from engine.train.preflight import OverTheCard, grown_rows, over_the_card
from engine.train.probe import ProbeUnavailable
from engine.train.reporting import Reporter
from engine.train.rollback import SNAPSHOT_EVERY, TrainingDiverged

__all__ = ["TrainingSession", "RunFolderError", "Faults", "TrainingDiverged", "ProbeUnavailable"]
# Re-exported for callers and tests that knew them here.
_MOVED = (OverTheCard, grown_rows, over_the_card, SNAPSHOT_EVERY)


class TrainingSession:
    def __init__(
        self,
        config: RunConfig,
        on_event: Optional[Callable[[Event], None]] = None,
        run_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
        faults: Optional[Faults] = None,
    ):
        """`resume_from`: a checkpoint folder, or a run folder (its latest checkpoint).
        `faults`: failures to inject, for tests only (see Faults)."""
        self.config = config
        self.faults = faults
        # Seconds between looks at the free space while paused for a full disk.
        self.disk_poll_seconds = 5.0
        self._run_dir = Path(run_dir) if run_dir else None
        self._resume_from = Path(resume_from) if resume_from else None
        self.run_dir: Optional[Path] = None
        # Under torchrun: this process's rank (engine.train.distributed); one process: a no-op.
        self._dist = DistContext.from_env()
        self._reporter = Reporter(on_event, self._dist.is_main)
        self._control = RunControl(self._reporter.emit, self.log)
        self._fsdp = False  # FSDP2 over several processes (engine.train.fsdp)
        self._guard = None
        self._locked = False
        self._memory = self._saver = None
        self._resumed_from: Optional[Path] = None
        # This run's fast-path counts, active on the thread that runs it (engine.counters says
        # which thread's counts land here and why).
        self._counters = Counters()

    # -- control (thread-safe) ----------------------------------------------------------------
    def request_pause(self) -> None:
        self._control.request_pause()

    def request_resume(self) -> None:
        self._control.request_resume()

    def request_stop(self) -> None:
        self._control.request_stop()

    @property
    def paused(self) -> bool:
        return self._control.paused

    def probe(self, prompt: str, max_new_tokens: int = 64) -> tuple[int, str]:
        """(step, reply): the current weights answer `prompt` (greedy, through the chat template
        for a chat run) while the run is paused. Thread-safe; call it from any thread but the
        session's. It changes no weight, RNG state or data position, so resuming stays exact.
        ProbeUnavailable when the run is not paused between steps."""
        from engine.train.probe import probe

        return probe(self._control, getattr(self, "_gallery", None), self._dist.enabled, prompt, max_new_tokens)

    # -- events -------------------------------------------------------------------------------
    @property
    def on_event(self):
        return self._reporter.on_event

    @on_event.setter
    def on_event(self, callback) -> None:
        self._reporter.on_event = callback

    def _emit(self, event: Event) -> None:
        self._reporter.emit(event)

    def log(self, message: str, level: str = "info") -> None:
        self._reporter.log(message, level)

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self._saver.last_checkpoint if self._saver is not None else self._resumed_from

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> Event:
        with self._counters.active():
            return self._run_reporting_failure()

    def _run_reporting_failure(self) -> Event:
        try:
            return self._run()
        except Exception as exc:  # every failure becomes an event the person can act on
            event = Failed(
                failure_message(exc, self._oom_advice),
                traceback.format_exc(),
                str(self.last_checkpoint) if self.last_checkpoint else None,
            )
            try:
                self._emit(LogLine(event.message, "error"))
                self._emit(event)
            finally:
                self._close()
            return event

    def _oom_advice(self) -> str:
        if self._memory is not None:
            return self._memory.advice()
        from engine.train.recovery import oom_advice

        return oom_advice(self.config, None, self.config.training.gradient_checkpointing is True, None)

    def _close(self) -> None:
        self._reporter.close()
        graphs = getattr(getattr(self, "_runner", None), "graphs", None)
        if graphs is not None:  # their memory pool and gradients go with the run, not with a later gc
            graphs.close()
        if self._locked:  # the run is no longer trained by this process, whatever the outcome
            self._locked = False
            try:
                self._folder.unlock()
            except OSError:
                pass

    # -- the recipe ----------------------------------------------------------------------------
    def _run(self) -> Event:
        self._started = time.time()
        self._setup_config()
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
        self._setup_parts()
        self._restore()
        self._emit(
            RunStarted(
                str(self.run_dir),
                self.config.to_dict(),
                self._profile.to_dict(),
                self._total,
                self._memory.fast,
                self._summary,
                self._start_step,
                self._dist.world_size,
                ("fsdp" if self._fsdp else "ddp") if self._dist.enabled else "",
            )
        )
        self._preflight()
        # The sleep lock and battery/throttle warnings belong to the process that reports.
        guard_cm = (
            RunGuard(f"training {Path(self.run_dir).name}", gpu_index=self._gpu_index())
            if self._dist.is_main
            else nullcontext()
        )
        with guard_cm as guard:
            self._guard = guard
            if guard is not None:
                self.log(guard.note)
            step, stopped = self._train_loop()
        self._guard = None
        return self._finish(step, stopped)

    def _gpu_index(self) -> Optional[int]:
        if self._device.type != "cuda" or not self._dist.is_main:
            return None
        return self._device.index or 0

    def _setup_config(self) -> None:
        """Hardware defaults applied to the config, the objective, seeds set, the run folder
        chosen (not made): engine.train.run_setup."""
        from engine.train.run_setup import configure

        self._setup = setup = configure(self.config, self._dist, self._resume_from, self._run_dir, self._disk_free())
        self.config, self._profile, self._objective = setup.config, setup.profile, setup.objective
        self._device, self._fsdp, self._init_adapter = setup.device, setup.fsdp, setup.init_adapter
        self._folder, self._folder_note = setup.folder, setup.folder_note

    def _disk_free(self):
        """A test's stand-in for the free-space reading (engine.train.faults), or None."""
        return self.faults.disk_free if self.faults else None

    def _setup_data(self) -> None:
        """Tokenizer, the objective's data and held-out examples (engine.train.data_setup); then
        the run folder opens (bad data fails before it exists)."""
        from engine.train.data_setup import data_notes, load_data
        from engine.train.run_setup import open_run_folder

        config = self.config
        self._loaded = loaded = load_data(config, self._objective, self.log)
        self._tokenizer, self._data, self._heldout = loaded.tokenizer, loaded.data, loaded.heldout
        self._summary = loaded.summary
        self.run_dir = open_run_folder(
            self._folder, self._dist, self._resume_from is None, self._reporter, self._set_locked
        )
        if self._dist.is_main:
            config.save(self._folder.config)
        self.log(f"Run folder: {self.run_dir}" + (f" ({self._folder_note})" if self._folder_note else ""))
        self._reporter.open_loggers(config.output, self._folder, config.to_dict())
        for message, level in data_notes(loaded, config.data.max_seq_len):
            self.log(message, level)

    def _set_locked(self) -> None:
        self._locked = True

    def _setup_model(self) -> None:
        """The model with LoRA attached, the fast paths on and the run's forward
        (engine.train.model_setup)."""
        from engine.train.model_setup import setup_model

        self._built = setup = setup_model(
            self.config,
            self._device,
            self._dist,
            self._fsdp,
            self._init_adapter,
            self._objective,
            lambda: self._memory.offloader,  # recovery may install or change it mid-run
            self.log,
        )
        self._model, self._params = setup.model, setup.params

    def _setup_optimizer(self) -> None:
        """Optimizer, the step plan (which rows each step reads) and the LR schedule."""
        import torch

        from engine.train.optim import make_optimizer
        from engine.train.schedule import StepPlan, lr_lambda

        t = self.config.training
        self._optimizer = make_optimizer(self._model, t.lr, t.weight_decay, t.optimizer)
        self._plan = StepPlan(len(self._data.packing.rows), int(t.rows_per_micro_batch), t.grad_accum, t.seed)
        self._total = total = self._plan.total_steps(t.max_steps, t.epochs)
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lr_lambda(t.scheduler, t.warmup_steps, total)
        )

    def _setup_parts(self) -> None:
        """The parts the loop calls (engine.train.parts): memory settings and the step, the loss
        guard, saving, evaluation, the gallery, the pre-flight and the step's report."""
        from engine.train.parts import build_parts

        self._is_cuda = self._device.type == "cuda"
        self._parts = parts = build_parts(
            self._setup,
            self._loaded,
            self._built,
            self._dist,
            self._plan,
            self._optimizer,
            self._scheduler,
            self._total,
            self._control,
            self._reporter,
            self._counters,
            self.faults,
            self.disk_poll_seconds,
        )
        self._memory, self._runner, self._loss_guard = parts.memory, parts.runner, parts.loss_guard
        self._saver, self._evaluator, self._gallery = parts.saver, parts.evaluator, parts.gallery
        self._preflight_part, self._step_report = parts.preflight, parts.report
        self._last_loss = float("nan")

    def _restore(self) -> None:
        """Resuming: adapter, optimizer, scheduler and RNG states from the checkpoint, and what
        the parts remember (lowered memory settings, rollbacks, the best eval)."""
        from engine.train import checkpoint as ckpt

        self._start_step = 0
        if self._resume_from is None:
            return
        source = resume_checkpoint(self._resume_from)
        if source is None:
            raise FileNotFoundError(f"{self._resume_from} holds no checkpoint to resume from")
        state = ckpt.load_checkpoint(source, self._model, self._optimizer, self._scheduler)
        self._start_step = state["step"]
        self._resumed_from = self._saver.last_checkpoint = source
        self.log(f"Resumed from {source} at step {self._start_step}")
        self._parts.restore(state)

    def _preflight(self) -> None:
        """The measured rehearsal of one step (engine.train.preflight), single-process runs only."""
        from engine.train.preflight import wanted

        if not wanted(self.config.training.preflight, self._is_cuda) or self._start_step >= self._total:
            return
        if self._dist.enabled:
            # Each rank would measure its own card and could settle on other settings: the
            # ranks must run the same forwards, so several processes skip the rehearsal.
            self.log("Pre-flight skipped: it runs for single-process runs only")
            return
        self._preflight_part.run(self._total - self._start_step)

    # -- the loop -------------------------------------------------------------------------------
    def _train_loop(self) -> tuple[int, bool]:
        """Optimizer steps from the start step to the total, honouring pause and stop between
        them; returns (steps done, whether it was stopped)."""
        t, parts = self.config.training, self._parts
        step = self._start_step
        self._loss_guard.start(step)
        self._counters.reset()
        while step < self._total:
            if self._control.wait_if_paused(step, self._dist, self.run_dir):
                return step, True
            new = self._train_step(step)
            # After a rollback (new <= step) the steps run again and save when they get there.
            if new > step and t.save_every and new % t.save_every == 0 and new < self._total:
                parts.save(new)
            if new > step and self._evaluator.due(new) and self._evaluator.evaluate(new, parts.save_best, parts.last):
                return new, False  # early stopping: a finished run, with its adapter
            step = new
        return step, False

    def _train_step(self, step: int) -> int:
        """One optimizer step (all its micro-batches), then its metrics; returns the step to go
        on from: step + 1, or an earlier one after a rollback."""
        import torch

        t, guard = self.config.training, self._loss_guard
        t0 = time.perf_counter()
        guard.before_step(step, self._start_step)
        micro, normalizer, loss_sum, sums = self._runner.run(step)
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        if self._fsdp:  # a DTensor norm (every rank's shards counted), made a plain tensor
            from engine.train import fsdp

            grad_norm = fsdp.full(grad_norm)
        self._optimizer.step()
        self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._last_loss = float(loss_sum)  # one sync per optimizer step (the guard reads it too)
        if self._is_cuda:
            torch.cuda.synchronize(self._device)
        dt = time.perf_counter() - t0
        step += 1
        bad = guard.bad_loss(step, self._last_loss)
        if bad is not None:
            return guard.roll_back(step, *bad, save_good=self._parts.save_good)
        guard.good_loss(step, self._last_loss)
        self._step_report.step(step, [b for _, b in micro], normalizer, grad_norm, dt, sums, self._last_loss)
        if self._guard is not None:
            for warning in self._guard.check():  # battery, throttling: each said once
                self.log(warning, "warning")
        return step

    # -- the end --------------------------------------------------------------------------------
    def _finish(self, step: int, stopped: bool) -> Event:
        """Last checkpoint, the final adapter (not for a stopped run), and the Finished event."""
        if stopped:
            self.log(f"Stopped at step {step}; saving a checkpoint")
        last = self._saver.last_checkpoint
        # A Stop (or closing the window) ends the run now: the checkpoint only, no gallery, which
        # answers again at the next checkpoint after a resume (on a CPU it was 3 s of a 3.4 s close).
        if last is None or step_of(last) != step:
            self._parts.save(step, gallery=not stopped)
        elif step not in self._gallery.done and not stopped:  # written as the best so far, without it
            self._gallery.run(step, last)
        if not stopped:
            stopped = not self._saver.adapter(step)
        adapter = self._folder.adapter if not stopped else None
        summary = run_summary(
            step,
            self._total,
            self._last_loss,
            self._started,
            self._step_report.tok_per_s,
            adapter,
            self._saver.last_checkpoint,
            self._evaluator,
        )
        result = Finished(str(self._folder.path), summary, stopped=stopped)
        self.model, self.tokenizer = self._model, self._tokenizer  # for callers that chat or export in-process
        self._emit(result)
        self._close()
        self._dist.barrier()  # no rank leaves while rank 0 still writes
        self._dist.close()
        return result
