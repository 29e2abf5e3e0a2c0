"""TrainingSession: one fine-tuning run, from config to adapter, reported through events.

The loop is our own rather than transformers' Trainer: it has to honour pause and stop
between steps, emit typed events with memory and packing counters, feed packed micro-batches
with prebuilt metadata, and compute the loss from hidden states with the fused
cross-entropy, all of which the Trainer would need overriding piecemeal.

`run()` blocks (call it on a worker thread) and never raises for bad input: every outcome,
including failure, arrives as an event, and `run()` returns the last one.

This file is the recipe (`_run`): the named setup steps, then a short loop over parts that
each live in a module of their own:
- what the run learns: the objective `training.method` names (engine.train.objectives: data,
  batches, loss, metrics, eval; the session never tests which method it runs);
- the step's forwards and backwards, and its retry (step_runner), over the memory settings
  that out-of-memory recovery lowers in a fixed order (recovery);
- the NaN/spike guard with its snapshots and rollback (rollback);
- the measured pre-flight and its growth (preflight);
- checkpoints, the final adapter and the wait on a full disk (saving);
- the eval loss, the best checkpoint and early stopping (evaluator);
- the gallery and the probe of a paused run (gallery, probe);
- pause, resume, stop and the control file (control); events to files and loggers (reporting).
Where files lie in the run folder is engine.runs' business. The run folder holds running.lock
(this pid) while the session runs.

`Faults` (engine.train.faults) is the seam tests use to inject failures where they really arise.
"""

from __future__ import annotations

import random
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

from engine.config import ConfigError, RunConfig
from engine.counters import Counters, split_counts
from engine.data import plural, shown_row
from engine.events import CompletionSamples, Event, Failed, Finished, LogLine, RunStarted, StepMetrics
from engine.hardware.vram import gpu_health_fields as _gpu_health_fields
from engine.runs import RunFolder, RunFolderError, new_run_folder, resume_checkpoint, step_of
from engine.train.control import RunControl
from engine.train.distributed import DistContext, share_from_main
from engine.train.failure import failure_message
from engine.train.faults import Faults
from engine.train.guard import RunGuard
from engine.train.objectives import objective_for
from engine.train.objectives.base import Forward
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
        self._ddp = None  # DDP, or the FSDP2 root (self._fsdp): what a training forward runs through
        self._fsdp = False
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
        chosen (not made)."""
        import torch

        from engine.hardware import policy
        from engine.hardware.profile import cap_to_emulated_card, detect

        self._profile = detect()
        cap_to_emulated_card()  # an emulated laptop card (TUNESMITH_EMULATE_GPU): this run's own cap
        # Model shape from a config.json already on disk (never a download): the memory-based
        # defaults need it; without it the policy keeps to what it can decide safely.
        info = policy.model_info_for(self.config)
        self.config = config = policy.apply_defaults(self.config, self._profile, info, self._dist.world_size)
        # What the run learns (training.method): the session asks it and never tests which it is.
        self._objective = objective_for(config)
        self._device = torch.device(self._dist.device(config.training.device))
        self._dist.init(self._device)
        why = self._dist.check_plan(config.training.grad_accum)
        if why:
            raise ConfigError(why)
        # FSDP2 for a base over one card (engine.train.fsdp); one process ignores the setting.
        self._fsdp = self._dist.enabled and config.training.distributed == "fsdp"
        if self._fsdp and config.model.load_in_4bit is True:
            from engine.config import FSDP_4BIT_REFUSAL

            raise ConfigError("training.distributed", FSDP_4BIT_REFUSAL)
        self._folder = self._plan_run_dir(config)
        # An earlier adapter to start from (lora.init_adapter), found before the run folder is made;
        # a resume takes its adapter from the checkpoint instead.
        self._init_adapter = None
        if config.lora.init_adapter.strip() and self._resume_from is None:
            from engine.peft_model import init_adapter_path

            self._init_adapter = init_adapter_path(config.lora.init_adapter)
        torch.manual_seed(config.training.seed)
        random.seed(config.training.seed)

    def _plan_run_dir(self, config: RunConfig) -> RunFolder:
        """Where the run will live; refuses a folder given by path that already holds a run (no
        silent overwrite) and, before anything loads, a place where nothing can be written. A
        name from the config that is taken gets the next free one (engine.runs.new_run_folder)."""
        self._folder_note = ""
        if self._resume_from is not None:
            folder = RunFolder.of(self._resume_from)
            if self._dist.is_main:
                folder.check_writable(self._disk_free())
            return folder
        if self._run_dir is not None:
            folder = RunFolder(self._run_dir)
        else:
            out, path = config.output, None
            if self._dist.is_main:  # rank 0 picks the name (its clock, the folders it sees)
                folder, self._folder_note = new_run_folder(out.dir, out.run_name, out.overwrite)
                path = str(folder.path)
            folder = RunFolder(share_from_main(self._dist, path))  # every rank takes it
        if self._dist.is_main:  # the others would see rank 0's new folder
            folder.check_free(config.output.overwrite, self._disk_free())
        return folder

    def _disk_free(self):
        """A test's stand-in for the free-space reading (engine.train.faults), or None."""
        return self.faults.disk_free if self.faults else None

    def _setup_data(self) -> None:
        """Tokenizer, the objective's data and held-out examples; then the run folder opens (bad
        data fails before it exists)."""
        from engine.models.loading import load_tokenizer

        config = self.config
        self.log(f"Loading tokenizer and data ({config.data.source})")
        self._tokenizer = load_tokenizer(config.model)
        data = self._objective.prepare_data(self._tokenizer)
        self._data, self._heldout, heldout_note = self._objective.held_out(data, self._tokenizer)
        data = self._data
        self._summary = summary = data.summary()
        summary["eval_examples"] = len(self._heldout) if self._heldout is not None else 0
        self._open_run_dir()
        if self._dist.is_main:
            config.save(self._folder.config)
        self.log(f"Run folder: {self.run_dir}" + (f" ({self._folder_note})" if self._folder_note else ""))
        self._reporter.open_loggers(config.output, self._folder, config.to_dict())
        if heldout_note:
            self.log(heldout_note)
        if data.used_fallback_template:
            self.log("The tokenizer has no chat template; using a plain ChatML template", "warning")
        for note in data.notes:
            self.log(note, "warning")
        for idx, reason in data.skipped[:20]:
            self.log(f"Row {shown_row(idx)} skipped: {reason}", "warning")
        if len(data.skipped) > 20:
            self.log(f"... and {plural(len(data.skipped) - 20, 'more row', 'more rows')} skipped", "warning")
        if data.truncated:
            self.log(
                f"{plural(data.truncated, 'example')} {'was' if data.truncated == 1 else 'were'} longer than "
                f"{config.data.max_seq_len} tokens and {'was' if data.truncated == 1 else 'were'} truncated",
                "warning",
            )
        self.log(
            f"{plural(summary['examples'], 'example')} packed into {plural(summary['packed_rows'], 'row')} of "
            f"{summary['row_tokens']} tokens ({summary['packing_efficiency']:.1%} full)"
        )

    def _open_run_dir(self) -> None:
        from engine.train import checkpoint as ckpt

        if not self._dist.is_main:  # rank 0 alone writes the run folder
            self._dist.barrier()  # ... and has made it
            self.run_dir = self._folder.path
            return
        folder = self._folder.create(fresh=self._resume_from is None)
        # Before anything is written: a write cut short by a full disk left these, and on a
        # disk that is still nearly full they hold the room the resume needs.
        removed = ckpt.remove_partials(folder)
        folder.lock()  # "running" on the Runs page while this process lives (removed in _close)
        self._locked = True
        self._reporter.open_files(folder)
        self.run_dir = folder.path
        self._dist.barrier()
        for p in removed:
            self.log(f"Removed {p.name}, left behind by a write that did not finish")

    def _setup_model(self) -> None:
        """The model with LoRA attached and the fast paths on (engine.train.step.prepare_model)."""
        from engine.models.loading import load_model, quiet_third_party
        from engine.models.lora import attach_lora, lora_parameters
        from engine.train.step import prepare_model

        config, t, device = self.config, self.config.training, self._device
        # FSDP: the whole base goes to host memory once, then one decoder layer at a time to the
        # device, where each rank keeps its shard (engine.train.fsdp.shard).
        load_on = "cpu" if self._fsdp else device
        self.log(f"Loading model {config.model.name_or_path} on {load_on} ({config.model.dtype})")
        model = load_model(config.model, load_on, config.model.dtype)
        with quiet_third_party():  # PEFT's FutureWarnings about transformers internals
            model = attach_lora(model, config.lora)
        if self._init_adapter is not None:
            from engine.peft_model import load_init_adapter

            n = load_init_adapter(model, self._init_adapter)
            self.log(f"LoRA starts from the adapter in {self._init_adapter} ({n} tensors)")
        # Offloaded checkpointing works under FSDP too: the layer's FSDP hooks run inside the
        # offloader's Function, gathering the weights for the forward and again for the recompute.
        self._prepared = prepared = prepare_model(
            model,
            config.fast_paths,
            device,
            bool(t.gradient_checkpointing),
            offload=t.offload,
            auto_reasons=config.auto_reasons,  # an "off" the policy chose says so, with its reason
        )
        self._model = prepared.model
        chunk = config.fast_paths.ce_chunk_tokens
        self._forward = Forward(
            fused_ce=prepared.report.get("fused_ce", "on") == "on",
            cached_metadata=config.fast_paths.cached_metadata,
            ce_chunk_tokens=None if chunk == "auto" else int(chunk),
            offloader=lambda: self._memory.offloader,  # recovery may install or change it mid-run
        )
        loss = self._loss
        if self._fsdp:
            from engine.train import fsdp

            self._ddp = fsdp.shard(self._model, loss, device, self._dist.world_size)
            self.log(
                f"FSDP2: the base and the adapters are sharded across {self._dist.world_size} processes "
                f"({len(fsdp.decoder_layers(self._model))} decoder layers and the root)"
            )
        else:
            # Several processes: DDP over the adapters' gradients (None with one process).
            self._ddp = self._dist.wrap(self._model, loss, device)
        model.train()
        self._params = lora_parameters(model)
        n_train = sum(p.numel() for p in self._params)
        self.log(
            f"LoRA: {n_train:,} trainable parameters; fast paths: "
            + ", ".join(f"{k}={v}" for k, v in prepared.report.items())
        )

    def _loss(self, model, batch, normalizer):
        """What DDP's / FSDP's module runs: the objective's loss through the run's forward."""
        return self._objective.loss(self._forward, model, batch, normalizer)

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
        """The parts the loop calls: memory settings and the step, the loss guard, saving,
        evaluation, the gallery and the pre-flight."""
        from engine.train.evaluator import Evaluator
        from engine.train.gallery import Gallery
        from engine.train.preflight import Preflight
        from engine.train.recovery import MemorySettings
        from engine.train.rollback import LossGuard
        from engine.train.saving import Saver
        from engine.train.step_runner import StepRunner

        config, t, device, dist, rep = self.config, self.config.training, self._device, self._dist, self._reporter
        self._is_cuda = device.type == "cuda"
        self._memory = memory = MemorySettings(
            self._model, device, config, self._plan, self._prepared, rep.emit, rep.log, dist.enabled
        )
        self._runner = runner = StepRunner(
            self._objective,
            self._forward,
            self._model,
            self._ddp,
            self._fsdp,
            dist,
            device,
            self._data,
            self._plan,
            memory,
            self._optimizer,
            self._tokenizer,
            self.faults,
        )
        self._loss_guard = LossGuard(
            self._params,
            self._optimizer,
            self._scheduler,
            t,
            device,
            self._fsdp,
            rep.emit,
            rep.log,
            check_spikes=self._objective.loss_is_progress,
        )
        self._saver = Saver(
            self._folder,
            self._model,
            self._optimizer,
            self._scheduler,
            self._tokenizer,
            self._params,
            dist,
            self._fsdp,
            self._control,
            rep.emit,
            rep.log,
            self._disk_free(),
        )
        self._saver.poll_seconds = self.disk_poll_seconds
        row_tokens = self._data.packing.row_tokens
        self._evaluator = Evaluator(runner, self._heldout, t, self._total, rep, self._folder, row_tokens)
        chat = self._data.spec.kind != "text"
        self._gallery = Gallery(
            runner, self._tokenizer, t, self._heldout, chat, int(config.data.max_seq_len), rep, self._folder
        )
        # The profile's total: an emulated card's cap (TUNESMITH_EMULATE_GPU), not the host GPU's.
        mem_total = self._profile.total_vram if self._is_cuda else _host_total()
        self._mem_total = mem_total
        self._preflight_part = Preflight(
            runner, self._params, self._profile, mem_total, config.auto_fields, rep.emit, rep.log, self.faults
        )
        self._last_loss = float("nan")
        self._tok_per_s: list[float] = []

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
        recovery = state.get("recovery") or {}
        self._loss_guard.rollbacks = int(recovery.get("rollbacks", 0))
        self._memory.restore(recovery)
        self._evaluator.restore(state.get("eval") or {})

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
        t = self.config.training
        step = self._start_step
        self._loss_guard.start(step)
        self._counters.reset()
        while step < self._total:
            if self._control.wait_if_paused(step, self._dist, self.run_dir):
                return step, True
            new = self._train_step(step)
            # After a rollback (new <= step) the steps run again and save when they get there.
            if new > step and t.save_every and new % t.save_every == 0 and new < self._total:
                self._save(new)
            if new > step and self._evaluator.due(new) and self._evaluator.evaluate(new, self._save_best, self._last):
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
            return guard.roll_back(step, *bad, save_good=self._save_good)
        guard.good_loss(step, self._last_loss)
        self._report_step(step, [b for _, b in micro], normalizer, grad_norm, dt, sums)
        if self._guard is not None:
            for warning in self._guard.check():  # battery, throttling: each said once
                self.log(warning, "warning")
        return step

    def _report_step(self, step: int, micro: list, normalizer: int, grad_norm, dt: float, sums: dict) -> None:
        """The step's fast-path counters (warnings once each) and, every log_every steps, StepMetrics."""
        import torch

        t, device, memory = self.config.training, self._device, self._memory
        ntok = sum(b.num_tokens for b in micro)
        counters = self._counters.reset()
        calls, fallbacks = split_counts(counters)
        self._reporter.say_what_did_not_run(memory.fast, calls, fallbacks, str(device), step)
        if step % t.log_every != 0 and step != self._total:
            return
        self._tok_per_s.append(ntok / dt)
        if self._is_cuda:
            mem = (
                torch.cuda.memory_allocated(device),
                torch.cuda.memory_reserved(device),
                torch.cuda.max_memory_allocated(device),
            )
        else:
            rss = _rss()
            mem = (rss, rss, rss)
        metrics = StepMetrics(
            step=step,
            total_steps=self._total,
            epoch=self._plan.epoch_at(step),
            loss=self._last_loss,
            lr=self._scheduler.get_last_lr()[0],
            grad_norm=float(grad_norm),
            tokens=ntok,
            trained_tokens=normalizer,
            step_seconds=dt,
            tokens_per_second=ntok / dt,
            mem_allocated=mem[0],
            mem_reserved=mem[1],
            mem_peak=mem[2],
            mem_total=self._mem_total,
            device=str(device),
            metadata_builds=counters.get("metadata_builds", 0),
            host_syncs=counters.get("host_syncs", 0),
            offload=memory.offloader.stats.note() if memory.offloader is not None else "",
            fast_path_calls=calls,
            fallbacks=fallbacks,
            metrics=self._objective.step_metrics({k: float(v) for k, v in sums.items()}),
            # The card's utilisation, temperature and power beside its memory (NVML; none on a CPU).
            **(_gpu_health_fields(device.index or 0) if self._is_cuda else {}),
        )
        self._emit(metrics)
        samples = self._objective.step_samples()
        if samples:  # GRPO's completions with their rewards (the Monitor's table)
            self._emit(CompletionSamples(step, samples))
        if self._reporter.loggers is not None:
            self._reporter.loggers.step(metrics)

    # -- checkpoints ----------------------------------------------------------------------------
    def _save(self, step: int, gallery: bool = True) -> bool:
        """The checkpoint of `step` with what the parts remember (engine.train.saving); False
        when the run was stopped before it could be written. `gallery`: the gallery answers at
        it (not for a checkpoint written only as the best so far: those come with every
        improving eval, and the gallery would cost more than the eval)."""
        extra = {
            "total_steps": self._total,
            "epoch": self._plan.epoch_at(step),
            "recovery": {**self._memory.state(), "rollbacks": self._loss_guard.rollbacks},
            "eval": self._evaluator.state(),
        }
        # Under FSDP the gallery's forwards need every rank: rank 0 tells the others whether it
        # wrote the checkpoint the gallery answers at.
        written = self._saver.checkpoint(step, extra)
        answer = written and gallery
        if gallery and self._fsdp and self._gallery:
            answer = share_from_main(self._dist, answer)
        if answer:
            self._gallery.run(step, self._saver.last_checkpoint)
        return written

    def _save_best(self, step: int) -> bool:
        return self._save(step, gallery=False)

    def _last(self) -> Optional[Path]:
        return self._saver.last_checkpoint

    def _save_good(self, good_step: int) -> str:
        """After a second bad loss: the good state just reloaded, saved unless a checkpoint at or
        after it exists; how the message names it."""
        last = self._saver.last_checkpoint
        if last is None or step_of(last) < good_step:
            return f"; its checkpoint is {self._saver.last_checkpoint}" if self._save(good_step) else ""
        return f"; the last good checkpoint is {last}"

    # -- the end --------------------------------------------------------------------------------
    def _finish(self, step: int, stopped: bool) -> Event:
        """Last checkpoint, the final adapter (not for a stopped run), and the Finished event."""
        if stopped:
            self.log(f"Stopped at step {step}; saving a checkpoint")
        last = self._saver.last_checkpoint
        # A Stop (or closing the window) ends the run now: the checkpoint only, no gallery, which
        # answers again at the next checkpoint after a resume (on a CPU it was 3 s of a 3.4 s close).
        if last is None or step_of(last) != step:
            self._save(step, gallery=not stopped)
        elif step not in self._gallery.done and not stopped:  # written as the best so far, without it
            self._gallery.run(step, last)
        folder, best = self._folder, self._evaluator.best
        if not stopped:
            stopped = not self._saver.adapter(step)
        result = Finished(
            str(folder.path),
            {
                "steps": step,
                "total_steps": self._total,
                "final_loss": self._last_loss,
                "seconds": round(time.time() - self._started, 2),
                "median_tokens_per_second": _median(self._tok_per_s),
                "adapter": str(folder.adapter) if not stopped else None,
                "last_checkpoint": str(self._saver.last_checkpoint),
                "early_stopped": self._evaluator.early_stopped,
                "best_eval_loss": best["eval_loss"] if best else None,
                "best_step": best["step"] if best else None,
                "best_checkpoint": best.get("checkpoint") if best else None,
            },
            stopped=stopped,
        )
        self.model, self.tokenizer = self._model, self._tokenizer  # for callers that chat or export in-process
        self._emit(result)
        self._close()
        self._dist.barrier()  # no rank leaves while rank 0 still writes
        self._dist.close()
        return result


def _median(values):
    if not values:
        return 0.0
    s = sorted(values)
    return s[len(s) // 2]


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _host_total() -> int:
    import psutil

    return psutil.virtual_memory().total
