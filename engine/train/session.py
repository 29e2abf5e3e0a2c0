"""TrainingSession: one fine-tuning run, from config to adapter, reported through events.

The loop is our own rather than transformers' Trainer: it has to honour pause and stop
between steps, emit typed events with memory and packing counters, feed packed micro-batches
with prebuilt metadata, and compute the loss from hidden states with the fused
cross-entropy, all of which the Trainer would need overriding piecemeal.

`run()` blocks (call it on a worker thread) and never raises for bad input: every outcome,
including failure, arrives as an event, and `run()` returns the last one.

The run is a recipe of named steps (`_run`): `_setup_config` (hardware defaults, seeds, the
run folder chosen), `_setup_data` (tokenizer, packed data; the run folder opens),
`_setup_model` (LoRA, fast paths), `_setup_optimizer` (optimizer, step plan, schedule),
`_restore` (a checkpoint when resuming), `_preflight` (a measured rehearsal of one forward +
backward on the longest micro-batch), then `_train_loop` (pause/stop between steps;
`_train_step` with `_forward_backward_recovering`, and `_report_step` for counters and
metrics; `_evaluate` every eval_every steps) and `_finish` (last checkpoint, final adapter,
Finished). Where files lie in the run folder is engine.runs' business.

Between steps, without changing what the run trains (engine.train.evaluation: RNG saved and
restored, eval mode, no grad, data position untouched):
- the eval loss on held-out examples (`data.eval_fraction` split off with the seed, or
  `data.eval_source`) every `training.eval_every` steps (EvalMetrics); a new best eval loss gets
  a checkpoint and best.json; `training.early_stopping_patience` evals without a new best end
  the run with its checkpoint and adapter;
- the prompt gallery, answered greedily at every checkpoint (GalleryAnswers, gallery.jsonl);
- `probe(prompt)`: while paused, another thread talks to the current weights; the loop takes
  the same lock before it resumes, so a probe in flight finishes first.
The run folder holds running.lock (this pid) while the session runs.

Recovery, so that an unattended run on a small card does not end for reasons it can fix itself:
- Out of memory (in a step or the rehearsal): partial gradients are dropped, the RNG goes back
  to the step's start, and one setting is lowered, in this order: stop keeping attention
  outputs, double -> single offload, half the rows per forward (each planned micro-batch runs
  as more, smaller forwards: the step's rows and its token normalizer are unchanged, so the
  optimisation is too), gradient checkpointing, offload. The step then runs again
  (MemoryAdjusted). The lowered settings are kept in checkpoints, so a resume keeps them.
- NaN/inf or a spiking loss (`training.spike_factor` x the median of recent losses, after
  warm-up): back to the last good in-memory snapshot (adapters, optimizer, schedule, RNG; taken
  every SNAPSHOT_EVERY steps into host memory and trusted once the step after it had a good
  loss), the learning rate halved (RolledBack); a second time the run stops (Failed) with the
  last good state saved. The check reads the loss already fetched for the metrics: no new sync.
- A full disk at a checkpoint or the final adapter: free space is checked against the expected
  size first; a write that still fails leaves no `.tmp`; the run says which disk, how much is
  needed and free (DiskFull), and pauses until there is room (polled) or Resume/Stop.

`Faults` is the seam tests use to inject those failures where they really arise.
"""

from __future__ import annotations

import copy
import json
import math
import random
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from engine.config import ConfigError, RunConfig
from engine.counters import requested_but_not_run, reset_counters, split_counts
from engine.data import plural
from engine.events import (
    CheckpointSaved,
    DiskFull,
    EvalMetrics,
    Event,
    Failed,
    Finished,
    GalleryAnswers,
    LogLine,
    MemoryAdjusted,
    Paused,
    PreflightResult,
    Resumed,
    RolledBack,
    RunStarted,
    StepMetrics,
)
from engine.hardware.vram import gpu_health_fields as _gpu_health_fields
from engine.runs import RunFolder, RunFolderError, publish, resume_checkpoint, step_of
from engine.train.distributed import CONTROL_FILE, DistContext, read_control, share_from_main
from engine.train.guard import RunGuard
from engine.train.objectives import objective_for
from engine.train.objectives.base import Forward, StepContext

__all__ = ["TrainingSession", "RunFolderError", "Faults", "TrainingDiverged", "ProbeUnavailable"]

# Steps between the in-memory snapshots a NaN or a loss spike rolls back to.
SNAPSHOT_EVERY = 10
# The pre-flight grows an automatic micro-batch while its measured (allocated) peak stays under
# this share of the memory budget: the rest absorbs the allocator's cache and fragmentation.
GROW_FILL = 0.9
# ... and only by at least this factor: a few more rows per forward are not worth a rehearsal.
GROW_MIN = 1.1
# Recent good losses the spike check takes the median of, and how many it needs first.
SPIKE_WINDOW = 20
SPIKE_MIN_HISTORY = 5


class TrainingDiverged(RuntimeError):
    """The loss went bad again after a rollback had halved the learning rate."""


class OverTheCard(RuntimeError):
    """The pre-flight's rehearsal fitted, but with AdamW's state still to come the run would
    run out of memory from its second step on, and no setting is left to lower."""


class ProbeUnavailable(RuntimeError):
    """`TrainingSession.probe` was called while the run is not paused between steps (or it runs
    in several processes); the message says which."""


@dataclass
class Faults:
    """Failures injected for tests: `TrainingSession(config, ..., faults=Faults(...))`.

    A documented seam, not a mock: each fault is raised (or the loss poisoned) inside the
    session's own step at the place the real failure arises, so what a test sees is the
    session's real recovery. Steps are 1-based, as StepMetrics numbers them; each entry of a
    `*_at_steps` list fires once (list a step twice to make it fire on the step's rerun too).

    oom_at_steps: the step's last micro-batch raises torch.OutOfMemoryError before its forward
        (earlier micro-batches have left partial gradients by then).
    oom_above_rows: any forward (a step's or the pre-flight rehearsal's) over more packed rows
        than this raises torch.OutOfMemoryError, like a card that holds only that many.
    oom_when: a predicate over the forward about to run, {"step", "rows", "rehearsal",
        "gradient_checkpointing", "offload", "host_embeddings", "tiled_mlp"}; True raises
        torch.OutOfMemoryError.
    nan_at_steps / spike_at_steps: the step's loss is made NaN / 50x before its backward, so
        its update is poisoned as a real one would be.
    disk_free: replaces engine.train.checkpoint.disk_free(path) -> free bytes.
    rehearsal_peak / card_bytes: the pre-flight rehearsal measures rehearsal_peak(attempt) bytes
        (the attempt as for oom_when) on a card of card_bytes, where a CPU measures nothing.
    """

    oom_at_steps: list[int] = field(default_factory=list)
    oom_above_rows: Optional[int] = None
    oom_when: Optional[Callable[[dict], bool]] = None
    nan_at_steps: list[int] = field(default_factory=list)
    spike_at_steps: list[int] = field(default_factory=list)
    disk_free: Optional[Callable[[Path], int]] = None
    rehearsal_peak: Optional[Callable[[dict], int]] = None
    card_bytes: int = 0

    def check_oom(self, attempt: dict, last_micro_batch: bool) -> None:
        import torch

        step = attempt["step"]
        hit = last_micro_batch and not attempt["rehearsal"] and step in self.oom_at_steps
        if hit:
            self.oom_at_steps.remove(step)
        rows = self.oom_above_rows
        hit = hit or (rows is not None and attempt["rows"] > rows)
        hit = hit or (self.oom_when is not None and self.oom_when(attempt))
        if hit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by Faults: {attempt})")

    def poison(self, step: int, loss):
        for steps, factor in ((self.nan_at_steps, float("nan")), (self.spike_at_steps, 50.0)):
            if step in steps:
                steps.remove(step)
                return loss * factor
        return loss


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
        self.on_event = on_event
        self.faults = faults
        # Seconds between looks at the free space while paused for a full disk.
        self.disk_poll_seconds = 5.0
        self._run_dir = Path(run_dir) if run_dir else None
        self._resume_from = Path(resume_from) if resume_from else None
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._metrics_file = None
        self._log_file = None
        self.last_checkpoint: Optional[Path] = None
        self.run_dir: Optional[Path] = None
        # Under torchrun: this process's rank (engine.train.distributed); one process: a no-op.
        self._dist = DistContext.from_env()
        self._ddp = None  # DDP, or the FSDP2 root (self._fsdp): what a training forward runs through
        self._fsdp = False
        self._guard = None
        # The live probe: held by a probe while it runs the model and by the loop before it
        # leaves a pause, so the two never use the model at once. `_paused_at`: the step the
        # loop is paused after (set only while it waits in _wait_if_paused).
        self._probe_lock = threading.Lock()
        self._paused_at: Optional[int] = None
        self._locked = False
        self._loggers = None

    # -- control (thread-safe) ----------------------------------------------------------------
    def request_pause(self) -> None:
        self._resume.clear()

    def request_resume(self) -> None:
        self._resume.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._resume.set()  # a paused run must wake up to stop

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    # -- events -------------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        if not self._dist.is_main:
            return  # rank 0 reports for the run
        if self._metrics_file is not None:
            _append(self._metrics_file, json.dumps(event.to_dict(), default=str) + "\n")
        if isinstance(event, LogLine) and self._log_file is not None:
            stamp = datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
            _append(self._log_file, f"{stamp} {event.level}: {event.message}\n")
        if self.on_event is not None:
            self.on_event(event)

    def log(self, message: str, level: str = "info") -> None:
        self._emit(LogLine(message, level))

    def _say_what_did_not_run(
        self, fast: dict, calls: dict, fallbacks: dict, device: str, step: int, said: set
    ) -> None:
        """Log each distinct fallback reason and each requested fast path that did not run (or
        ran on some layers only) once per run: a warning on a GPU, where it costs speed or
        memory; a note elsewhere."""
        level = "warning" if device.startswith("cuda") else "info"
        for entry, n in fallbacks.items():
            if ("fallback", entry) not in said:
                said.add(("fallback", entry))
                self.log(f"Fast path fallback in step {step}: {entry} ({plural(n, 'call')} took the stock path)", level)
        for path, what in requested_but_not_run(fast, calls, fallbacks, device).items():
            key = ("missing", path, what.split(":")[0].split(";")[0])
            if key not in said:
                said.add(key)
                self.log(f"Fast path {path} was requested ({fast.get(path)}) but in step {step} {what}", level)

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> Event:
        try:
            return self._run()
        except Exception as exc:  # every failure becomes an event the person can act on
            event = Failed(
                _human_message(exc, self._oom_advice),
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
        """What is left to lower after running out of memory: only the settings not already at
        their leanest (telling someone with checkpointing on to turn it on helps nobody)."""
        cfg = self.config
        rows = getattr(self, "_exec_rows", None)
        ckpt = getattr(self, "_checkpointing", cfg.training.gradient_checkpointing is True)
        offloader = getattr(self, "_offloader", None)
        advice = []
        if rows is None or rows > 1:
            advice.append("lower training.rows_per_micro_batch" + (f" (now {rows})" if rows else ""))
        advice.append(f"lower data.max_seq_len (now {cfg.data.max_seq_len})")
        if not ckpt:
            advice.append("turn on gradient checkpointing")
        elif offloader is None:
            advice.append("turn on activation offload (training.offload: single)")
        if cfg.model.load_in_4bit is not True:
            advice.append("load the model in 4 bits (model.load_in_4bit: true)")
        if cfg.lora.r > 16:
            advice.append(f"use a smaller LoRA rank (lora.r, now {cfg.lora.r})")
        return "; ".join(advice)

    def _close(self) -> None:
        for f in (self._metrics_file, self._log_file):
            if f is not None:
                f.close()
        self._metrics_file = self._log_file = None
        if self._loggers is not None:
            self._loggers.close()
            self._loggers = None
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
        self._setup_loop_state()
        self._restore()
        self._emit(
            RunStarted(
                str(self.run_dir),
                self.config.to_dict(),
                self._profile.to_dict(),
                self._total,
                self._fast,
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
        """Hardware defaults applied to the config, seeds set, the run folder chosen (not made)."""
        import torch

        from engine.hardware import policy
        from engine.hardware.profile import detect

        self._profile = detect()
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
        torch.manual_seed(config.training.seed)
        random.seed(config.training.seed)

    def _plan_run_dir(self, config: RunConfig) -> RunFolder:
        """Where the run will live; refuses a folder that already holds a run (no silent overwrite)."""
        if self._resume_from is not None:
            return RunFolder.of(self._resume_from)
        if self._run_dir is not None:
            folder = RunFolder(self._run_dir)
        else:
            name = config.output.run_name
            if name == "auto":  # every rank takes rank 0's clock
                name = share_from_main(self._dist, datetime.now().strftime("run-%Y%m%d-%H%M%S"))
            folder = RunFolder(Path(config.output.dir) / name)
        if self._dist.is_main:  # the others would see rank 0's new folder
            folder.check_free(config.output.overwrite)
        return folder

    def _setup_data(self) -> None:
        """Tokenizer and packed data set; then the run folder opens (bad data fails before it exists)."""
        from engine.models.loading import load_tokenizer

        config = self.config
        self.log(f"Loading tokenizer and data ({config.data.source})")
        self._tokenizer = load_tokenizer(config.model)
        self._data = self._objective.prepare_data(self._tokenizer)
        heldout_note = self._setup_heldout()
        data = self._data
        self._summary = summary = data.summary()
        summary["eval_examples"] = len(self._heldout) if self._heldout is not None else 0
        self._open_run_dir()
        if self._dist.is_main:
            config.save(self._folder.config)
        self.log(f"Run folder: {self.run_dir}")
        self._open_loggers()
        if heldout_note:
            self.log(heldout_note)
        if data.used_fallback_template:
            self.log("The tokenizer has no chat template; using a plain ChatML template", "warning")
        for idx, reason in data.skipped[:20]:
            self.log(f"Row {idx} skipped: {reason}", "warning")
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

    def _setup_heldout(self) -> str:
        """The held-out examples (split off the data with the seed, or a separate file) and the
        gallery's prompts; returns the sentence the log gets once the run folder is open."""
        from engine.train import evaluation

        config = self.config
        self._data, self._heldout, note = self._objective.held_out(self._data, self._tokenizer)
        t = config.training
        chat = self._data.spec.kind != "text"
        if t.gallery_prompts:
            self._gallery = [(p, evaluation.encode_prompt(self._tokenizer, p, chat)) for p in t.gallery_prompts]
        elif self._heldout is not None and t.gallery_size:
            self._gallery = [
                (self._tokenizer.decode(ids, skip_special_tokens=True).strip(), ids)
                for ids in self._heldout.prompt_ids(t.gallery_size)
            ]
        else:
            self._gallery = []
        return note

    def _open_loggers(self) -> None:
        """TensorBoard / W&B when output asks for them (rank 0; never a reason to fail)."""
        out = self.config.output
        if not self._dist.is_main or not (out.tensorboard or out.wandb):
            return
        from engine.train.loggers import Loggers

        self._loggers = Loggers.open(out, self._folder.path, self.config.to_dict(), lambda m, lvl: self.log(m, lvl))

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
        self._metrics_file = open(folder.metrics, "a", encoding="utf-8")
        self._log_file = open(folder.log, "a", encoding="utf-8")
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
        # Offloaded checkpointing works under FSDP too: the layer's FSDP hooks run inside the
        # offloader's Function, gathering the weights for the forward and again for the recompute.
        prepared = prepare_model(model, config.fast_paths, device, bool(t.gradient_checkpointing), offload=t.offload)
        self._model, self._offloader, self._fast = prepared.model, prepared.offloader, prepared.report
        chunk = config.fast_paths.ce_chunk_tokens
        self._forward = Forward(
            fused_ce=prepare_flag(self._fast.get("fused_ce", "on")),
            cached_metadata=config.fast_paths.cached_metadata,
            ce_chunk_tokens=None if chunk == "auto" else int(chunk),
            offloader=lambda: self._offloader,  # recovery may install or change it mid-run
        )
        if self._fsdp:
            from engine.train import fsdp

            self._ddp = fsdp.shard(self._model, self._loss, device, self._dist.world_size)
            self.log(
                f"FSDP2: the base and the adapters are sharded across {self._dist.world_size} processes "
                f"({len(fsdp.decoder_layers(self._model))} decoder layers and the root)"
            )
        else:
            # Several processes: DDP over the adapters' gradients (None with one process).
            self._ddp = self._dist.wrap(self._model, self._loss, device)
        # What the out-of-memory recovery may change as the run goes (see _next_memory_change).
        self._checkpointing = bool(t.gradient_checkpointing)
        model.train()
        self._params = lora_parameters(model)
        n_train = sum(p.numel() for p in self._params)
        self.log(
            f"LoRA: {n_train:,} trainable parameters; fast paths: "
            + ", ".join(f"{k}={v}" for k, v in self._fast.items())
        )

    def _setup_optimizer(self) -> None:
        """Optimizer, the step plan (which rows each step reads) and the LR schedule."""
        import torch

        from engine.train.optim import make_optimizer
        from engine.train.schedule import StepPlan, lr_lambda

        t = self.config.training
        self._optimizer = make_optimizer(self._params, t.lr, t.weight_decay, t.optimizer)
        self._plan = StepPlan(len(self._data.packing.rows), int(t.rows_per_micro_batch), t.grad_accum, t.seed)
        self._total = total = self._plan.total_steps(t.max_steps, t.epochs)
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lr_lambda(t.scheduler, t.warmup_steps, total)
        )
        # Packed rows per forward: the plan's micro-batch, until running out of memory splits
        # each planned micro-batch into more, smaller forwards (same rows per optimizer step).
        self._exec_rows = self._plan.rows_per_mb
        self._rollbacks = 0

    def _setup_loop_state(self) -> None:
        """What every forward needs (the rehearsal's too), and the recovery's bookkeeping."""

        device = self._device
        self._is_cuda = device.type == "cuda"
        # The profile's total: an emulated card's cap (TUNESMITH_EMULATE_GPU), not the host GPU's.
        self._mem_total = self._profile.total_vram if self._is_cuda else _host_total()
        self._last_loss = float("nan")
        self._tok_per_s = []
        self._said = set()  # fallbacks and missing fast paths already logged (once each)
        self._history: list[tuple[int, float]] = []  # (step, loss) of good steps, for the spike check
        self._good = self._pending = None  # snapshots to roll back to (see _take_snapshot)
        self._spare = None  # a released snapshot whose host buffers the next one reuses
        self._last_ckpt_bytes = 0
        self._setup_eval_state()

    def _setup_eval_state(self) -> None:
        """When the eval runs and what it remembers (kept in checkpoints, so a resume goes on
        with the same best and patience)."""
        t = self.config.training
        every = t.eval_every
        if every == "auto":
            from engine.train.evaluation import auto_eval_every

            held = sum(len(d) for d in self._heldout.docs) if self._heldout is not None else 0
            sizes = self._row_tokens()
            step_tokens = sum(sizes) / max(1, len(sizes)) * self._plan.rows_per_mb * self._plan.grad_accum
            every = auto_eval_every(self._total, held, step_tokens)
        self._eval_every = int(every) if self._heldout is not None else 0
        if t.early_stopping_patience and not self._eval_every:
            why = "there are no held-out examples" if self._heldout is None else "training.eval_every is 0"
            self.log(f"Early stopping is off: {why}", "warning")
        self._eval_batches = None  # packed on first use
        self._best: Optional[dict] = None  # {"step", "eval_loss", "checkpoint"}
        self._bad_evals = 0
        self._best_only: list[int] = []  # checkpoints written only because they were the best
        self._early_stopped = False
        self._gallery_done: set[int] = set()  # steps the gallery answered at, this session

    def _restore(self) -> None:
        """Resuming: adapter, optimizer, scheduler and RNG states from the checkpoint."""
        from engine.train import checkpoint as ckpt

        self._start_step = 0
        if self._resume_from is None:
            return
        source = resume_checkpoint(self._resume_from)
        if source is None:
            raise FileNotFoundError(f"{self._resume_from} holds no checkpoint to resume from")
        state = ckpt.load_checkpoint(source, self._model, self._optimizer, self._scheduler)
        self._start_step = state["step"]
        self.last_checkpoint = source
        self.log(f"Resumed from {source} at step {self._start_step}")
        self._restore_recovery(state.get("recovery") or {})
        saved = state.get("eval") or {}
        self._best = saved.get("best")
        self._bad_evals = int(saved.get("bad_evals", 0))
        self._best_only = [int(s) for s in saved.get("best_only", [])]

    def _restore_recovery(self, saved: dict) -> None:
        """Settings an earlier part of the run lowered to fit, and its rollback count: kept, so
        the resumed run neither runs out of memory again nor forgets it already halved the LR."""
        from engine.train.step import enable_checkpointing, install_offload

        self._rollbacks = int(saved.get("rollbacks", 0))
        changed = []
        rows = int(saved.get("rows_per_forward", self._exec_rows))
        if rows < self._exec_rows:
            self._exec_rows = rows
            changed.append(f"{plural(rows, 'row')} per forward")
        if saved.get("gradient_checkpointing") and not self._checkpointing:
            self._checkpointing = enable_checkpointing(self._model)
            changed.append("gradient checkpointing")
        if saved.get("host_embeddings") and self._host_embeddings_possible():
            from engine.fastpath.host_embed import move_to_host

            self._fast["host_embeddings"] = move_to_host(self._model, self._device)
            changed.append("input embeddings in host memory")
        if saved.get("tiled_mlp") and self._tiled_mlp_possible():
            from engine.train.step import tile_mlps

            self._fast["tiled_mlp"] = tile_mlps(self._model, self._device)
            changed.append("tiled MLP")
        mode = saved.get("offload", "off")
        if mode != "off" and self._offloader is None and self._checkpointing:
            self._offloader, self._fast["offload"] = install_offload(
                self._model, mode, self._device, bool(self.config.fast_paths.keep_attention)
            )
            changed.append(f"{mode} offload")
        if changed:
            self.log("Kept what the run lowered to fit in memory: " + ", ".join(changed))

    def _save(self, step: int, gallery: bool = True) -> bool:
        """Write the checkpoint of `step`. On a full disk: nothing partial is left, the run says
        so and pauses until there is room, then tries again. False when the run was stopped
        before the checkpoint could be written (the last good one stays). `gallery`: the
        gallery answers at it (not for a checkpoint written only as the best so far: those come
        with every improving eval, and the gallery would cost more than the eval)."""
        from engine.train import checkpoint as ckpt

        # FSDP: every rank holds shards; all take part in gathering them whole for rank 0.
        adapter_state, optimizer_state = self._full_states(optimizer=True)
        # Under FSDP the gallery's forwards need every rank: rank 0 tells the others whether it
        # wrote the checkpoint the gallery answers at.
        gallery_together = gallery and self._fsdp and bool(self._gallery)
        if not self._dist.is_main:  # every rank holds the same adapters: rank 0 writes them
            # ... and every rank knows it is written, so all decide alike whether the next
            # checkpoint is due (under FSDP a rank alone in _save would wait in the gathering).
            self.last_checkpoint = self._folder.checkpoint(step)
            if gallery_together and share_from_main(self._dist, None):
                self._run_gallery(step, self.last_checkpoint)
            return True
        target = self._folder.checkpoint(step)
        recovery = {
            "rows_per_forward": self._exec_rows,
            "gradient_checkpointing": self._checkpointing,
            "offload": self._offloader.mode if self._offloader is not None else "off",
            "host_embeddings": bool(self._fast.get("host_embeddings", "").startswith("on")),
            "tiled_mlp": bool(self._fast.get("tiled_mlp", "").startswith("on")),
            "rollbacks": self._rollbacks,
        }
        evaluation = {"best": self._best, "bad_evals": self._bad_evals, "best_only": self._best_only}
        extra = {
            "total_steps": self._total,
            "epoch": self._plan.epoch_at(step),
            "recovery": recovery,
            "eval": evaluation,
        }

        def write() -> Path:
            return ckpt.save_checkpoint(
                target,
                self._model,
                self._optimizer,
                self._scheduler,
                step,
                extra,
                self._tokenizer,
                adapter_state=adapter_state,
                optimizer_state=optimizer_state,
            )

        need = ckpt.expected_bytes(self._params, self._optimizer, self._tokenizer_bytes(), self._last_ckpt_bytes)
        path = self._write_with_room(step, target, need, write, "checkpoint")
        if gallery_together:
            share_from_main(self._dist, path is not None)
        if path is None:
            return False
        self._last_ckpt_bytes = ckpt.folder_bytes(path)
        self.last_checkpoint = path
        self._emit(CheckpointSaved(step, str(path)))
        if gallery:
            self._run_gallery(step, path)
        return True

    def _full_states(self, optimizer: bool) -> tuple[Optional[dict], Optional[dict]]:
        """(adapter, optimizer state) as full tensors for an FSDP run, gathered by every rank
        (collectives); (None, None) otherwise: the checkpoint reads the model's own tensors."""
        if not self._fsdp:
            return None, None
        from engine.train import fsdp

        adapter = fsdp.full_adapter_state(self._model)
        return adapter, fsdp.full_optimizer_state(self._optimizer) if optimizer else None

    def _tokenizer_bytes(self) -> int:
        """Bytes of the tokenizer files a checkpoint copies (the model folder's files less its
        weights); 0 for a tokenizer from the Hub cache (the estimate's margin covers it)."""
        source = Path(getattr(self._tokenizer, "name_or_path", "") or "")
        if not source.is_dir():
            return 0
        weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
        return sum(f.stat().st_size for f in source.iterdir() if f.is_file() and not f.name.endswith(weights))

    def _disk_free(self, path: Path) -> int:
        from engine.train import checkpoint as ckpt

        probe = self.faults.disk_free if self.faults and self.faults.disk_free else ckpt.disk_free
        return int(probe(path))

    def _write_with_room(self, step: int, target: Path, need: int, write: Callable[[], Path], what: str):
        """write() once the disk has `need` bytes free for `target`; a write that fails on a full
        disk anyway (the estimate was short) is cleaned up and waited out the same way. The
        written path, or None when the run was stopped while waiting."""
        from engine.train import checkpoint as ckpt

        while True:
            free = self._disk_free(target.parent)
            if free >= need:
                try:
                    return write()
                except Exception as exc:
                    if not ckpt.is_disk_full(exc):
                        raise
                    first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
                    self.log(f"Writing the {what} at step {step} failed: {type(exc).__name__}: {first}", "warning")
                free = self._disk_free(target.parent)
                if free >= need:  # the estimate was short: wait for more than there is now
                    need = free + max(need // 2, 1 << 20)
            if not self._wait_for_disk(step, target, need, free, what):
                return None

    def _wait_for_disk(self, step: int, target: Path, need: int, free: int, what: str) -> bool:
        """Say which disk is full and pause until there is room (looked at every
        disk_poll_seconds) or the person resumes; False when the run is to stop instead."""
        from engine.train import checkpoint as ckpt

        last = (
            f" The last good checkpoint is {self.last_checkpoint}."
            if self.last_checkpoint
            else " No checkpoint has been written yet."
        )
        mount = ckpt.mount_of(target)
        sentence = (
            f"The disk at {mount} is full: the {what} at step {step} needs about {_size(need)} "
            f"and {_size(free)} is free."
        )
        if self._stop.is_set():
            self.log(f"{sentence} The run stops without it.{last}", "warning")
            return False
        message = f"{sentence} The run is paused: free some space and it continues by itself (or press Resume).{last}"
        self._emit(DiskFull(step, str(target), str(mount), int(need), int(free), message, what))
        self.log(message, "warning")
        self._resume.clear()
        self._emit(Paused(step, reason=message))
        while not self._resume.wait(self.disk_poll_seconds):
            try:
                room = self._disk_free(target.parent) >= need
            except OSError:
                room = False
            if room:
                self.log(f"The disk at {mount} has room again")
                self._resume.set()
        if self._stop.is_set():
            return False
        self._emit(Resumed(step))
        self.log(f"Resumed at step {step}")
        return True

    # -- the loop -------------------------------------------------------------------------------
    def _train_loop(self) -> tuple[int, bool]:
        """Optimizer steps from the start step to the total, honouring pause and stop between
        them; returns (steps done, whether it was stopped)."""
        t = self.config.training
        step = self._start_step
        self._good = self._take_snapshot(step)  # where the run started is good by definition
        reset_counters()
        while step < self._total:
            if self._wait_if_paused(step):
                return step, True
            new = self._train_step(step)
            # After a rollback (new <= step) the steps run again and save when they get there.
            if new > step and t.save_every and new % t.save_every == 0 and new < self._total:
                self._save(new)
            if new > step and self._eval_due(new) and self._evaluate(new):
                return new, False  # early stopping: a finished run, with its adapter
            step = new
        return step, False

    def _wait_if_paused(self, step: int) -> bool:
        """Blocks while paused; True when the run is to stop. Several processes: rank 0 reads
        the window's control file and waits; the others learn its decision in `agree`."""
        dist = self._dist
        if dist.enabled and dist.is_main:
            self._read_control()
        if dist.is_main and not self._resume.is_set():
            with self._probe_lock:  # before Paused is reported: a probe may follow at once
                self._paused_at = step
            self._emit(Paused(step))
            self.log(f"Paused at step {step}")
            while not self._resume.wait(0.5 if dist.enabled else None):
                self._read_control()
            with self._probe_lock:  # a probe in flight finishes before the model trains again
                self._paused_at = None
            if not self._stop.is_set():
                self._emit(Resumed(step))
                self.log(f"Resumed at step {step}")
        _, stop = dist.agree(False, self._stop.is_set())
        return stop

    def _read_control(self) -> None:
        """The window's request for a run under torchrun (a file in the run folder)."""
        if self.run_dir is None:
            return
        request = read_control(Path(self.run_dir) / CONTROL_FILE)
        if request == "pause":
            self.request_pause()
        elif request == "resume":
            self.request_resume()
        elif request == "stop":
            self.request_stop()

    def _batch(self, row_ids: list[int]):
        rows = self._data.packing.rows
        return self._objective.collate(self._data, [d for r in row_ids for d in rows[r]])

    def _micro_batches(self, step: int) -> list:
        """[(rows, PackedBatch)] of the forwards of optimizer step `step` (0-based): the plan's
        micro-batches, each split into forwards of at most `_exec_rows` rows."""
        e, per_mb = self._exec_rows, self._plan.rows_per_mb
        planned = self._plan.micro_batches(step)
        if e > per_mb:  # the pre-flight found room: the step's rows, e to a forward
            planned = [[r for mb in planned for r in mb]]
        return [
            (len(row_ids[i : i + e]), self._batch(row_ids[i : i + e]))
            for row_ids in planned
            for i in range(0, max(1, len(row_ids)), e)
        ]

    def _train_step(self, step: int) -> int:
        """One optimizer step (all its micro-batches), then its metrics; returns the step to go
        on from: step + 1, or an earlier one after a rollback."""
        import torch

        t, device = self.config.training, self._device
        t0 = time.perf_counter()
        if step > self._start_step and (step - self._start_step) % SNAPSHOT_EVERY == 0:
            self._pending = self._take_snapshot(step)
        micro, normalizer, loss_sum, sums = self._forward_backward_recovering(step)
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
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step += 1
        bad = self._bad_loss(step, self._last_loss)
        if bad is not None:
            return self._roll_back(step, *bad)
        self._good_loss(step, self._last_loss)
        self._report_step(step, [b for _, b in micro], normalizer, grad_norm, dt, sums)
        if self._guard is not None:
            for warning in self._guard.check():  # battery, throttling: each said once
                self.log(warning, "warning")
        return step

    def _forward_backward(self, micro: list, normalizer: int, step: int, rehearsal: bool = False):
        """Forward and backward over [(rows, batch)]; (the summed loss, the summed objective
        metrics), device tensors. `step`: the 1-based step it belongs to (for Faults)."""
        import torch

        device, faults, dist = self._device, self.faults, self._dist
        loss_sum = torch.zeros((), device=device)
        sums: dict = {}
        # Several processes: this rank's share of the step's forwards, through DDP (the
        # rehearsal measures one rank's forward alone, with no gradient exchange).
        ddp = None if rehearsal else self._ddp
        mine = micro if ddp is None else [mb for k, mb in enumerate(micro) if k % dist.world_size == dist.rank]
        scale = dist.world_size if ddp is not None else 1  # DDP averages; the step wants the sum
        for i, (rows, batch) in enumerate(mine):
            last = i == len(mine) - 1
            if faults is not None:
                faults.check_oom(self._attempt(step, rows, rehearsal), last_micro_batch=last)
            batch = batch.to(device)
            with self._sync_context(ddp, last):
                out = ddp(batch, normalizer) if ddp is not None else self._loss(self._model, batch, normalizer)
                loss = out.loss
                if faults is not None and i == 0 and not rehearsal:
                    loss = faults.poison(step, loss)
                (loss * scale if scale != 1 else loss).backward()
            loss_sum += loss.detach()
            for k, v in out.metrics.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
            batch.info.free()
        if ddp is None:
            return loss_sum, sums
        return dist.sum(loss_sum), {k: dist.sum(v) for k, v in sums.items()}

    def _sync_context(self, ddp, last: bool):
        if ddp is not None and self._fsdp:
            from engine.train import fsdp

            return fsdp.sync_context(ddp, last)
        return self._dist.sync_context(ddp, last)

    def _loss(self, model, batch, normalizer):
        """One forward's LossOutput: the objective's loss through the run's forward."""
        return self._objective.loss(self._forward, model, batch, normalizer)

    def _attempt(self, step: int, rows: int, rehearsal: bool) -> dict:
        return {
            "step": step,
            "rows": rows,
            "rehearsal": rehearsal,
            "gradient_checkpointing": self._checkpointing,
            "offload": self._offloader.mode if self._offloader is not None else "off",
            "host_embeddings": self._fast.get("host_embeddings", "").startswith("on"),
            "tiled_mlp": self._fast.get("tiled_mlp", "").startswith("on"),
        }

    def _forward_backward_recovering(self, step: int):
        """The step's forwards and backwards; on running out of memory, its partial gradients
        are dropped, one setting is lowered (MemoryAdjusted) and the step runs again from its
        start with the same RNG state. (micro-batches, normalizer, summed loss)."""
        rng = _rng_state()
        while True:
            micro = self._objective.prepare_step(self._step_context(step + 1), self._micro_batches(step))
            normalizer = self._objective.normalizer([b for _, b in micro])
            try:
                return micro, normalizer, *self._forward_backward(micro, normalizer, step + 1)
            except Exception as exc:
                # Several processes: the others wait in the step's all-reduce, so a rank that
                # runs out of memory ends the run (torchrun stops them all; the checkpoint stays).
                change = self._next_memory_change() if _is_oom(exc) and not self._dist.enabled else None
                if change is None:
                    raise
            # Out of the except block: the traceback, and the activations its frames hold, are gone.
            del micro
            self._drop_partial_step()
            _set_rng_state(rng)
            self._apply_memory_change(change, "step", step + 1, f"step {step + 1} ran out of memory; it runs again")

    def _step_context(self, step: int, rehearsal: bool = False) -> StepContext:
        return StepContext(self._model, self._device, self._tokenizer, self._forward, step, rehearsal)

    def _drop_partial_step(self) -> None:
        import gc

        import torch

        self._optimizer.zero_grad(set_to_none=True)
        reset_counters()  # the failed attempt's calls are not the step's
        gc.collect()
        if self._is_cuda:
            torch.cuda.empty_cache()

    # -- out of memory: what to lower ----------------------------------------------------------
    def _next_memory_change(self) -> Optional[tuple[str, Any, Any]]:
        """(setting, before, after) of the cheapest change left that saves memory, or None."""
        off = self._offloader
        if self._host_embeddings_possible(tied=False):  # costs no speed: first
            return ("host_embeddings", "device", "host")
        if off is not None and off.keep_attention_allowed and off.stats.attention_kept == "kept":
            return ("keep_attention", "kept", "not kept")
        if off is not None and off.mode == "double":
            return ("offload", "double", "single")
        if self._host_embeddings_possible(tied=True):  # a copy of the table per micro-batch
            return ("host_embeddings", "device", "host")
        if self._exec_rows > 1:
            return ("micro_batch", self._exec_rows, self._exec_rows // 2)
        if self._tiled_mlp_possible():
            return ("tiled_mlp", "off", "on")
        if not self._checkpointing and getattr(_hf(self._model), "supports_gradient_checkpointing", False):
            return ("gradient_checkpointing", False, True)
        if off is None and self._checkpointing:
            return ("offload", "off", "single")
        return None

    def _host_embeddings_possible(self, tied: Optional[bool] = None) -> bool:
        """May the embedding table still move to host memory? (auto, one process; `tied`: only
        if the head is (True) or is not (False) tied to it, None either way.)"""
        from engine.fastpath.host_embed import is_tied, why_not

        if self.config.fast_paths.host_embeddings != "auto" or self._dist.enabled:
            return False
        if tied is not None and is_tied(self._model) != tied:
            return False
        return not why_not(self._model, self._device)

    def _tiled_mlp_possible(self) -> bool:
        """May the MLPs still be tiled, and would it help? (auto, one process, rows longer than a tile.)"""
        from engine.fastpath.tiled_mlp import tile_of, tile_tokens
        from engine.models.patches import dense_mlps

        if self.config.fast_paths.tiled_mlp != "auto" or self._dist.enabled or tile_of(self._model):
            return False
        if not dense_mlps(self._model)[0]:
            return False
        inter = getattr(_hf(self._model).config, "intermediate_size", 0) or 0
        return self.config.data.max_seq_len * self._exec_rows > tile_tokens(inter)

    def _forwards_per_step(self) -> int:
        per_mb = self._plan.rows_per_mb
        if self._exec_rows > per_mb:
            return math.ceil(per_mb * self._plan.grad_accum / self._exec_rows)
        return self._plan.grad_accum * math.ceil(per_mb / self._exec_rows)

    def _apply_memory_change(self, change: tuple[str, Any, Any], phase: str, step: int, why: str) -> None:
        from engine.train.step import enable_checkpointing, install_offload

        setting, before, after = change
        if setting == "host_embeddings":
            from engine.fastpath.host_embed import move_to_host

            self._fast["host_embeddings"] = move_to_host(self._model, self._device)
            if self._is_cuda:  # the device table's blocks back to the card (a cap counts reserved)
                import torch

                torch.cuda.empty_cache()
            what = "input embeddings → host memory (" + self._fast["host_embeddings"].removeprefix("on: ") + ")"
        elif setting == "tiled_mlp":
            from engine.train.step import tile_mlps

            self._fast["tiled_mlp"] = tile_mlps(self._model, self._device)
            what = "tiled MLP " + self._fast["tiled_mlp"].split(" in ")[0]
        elif setting == "keep_attention":
            self._offloader.stop_keeping_attention()
            what = "attention outputs are no longer kept for the recompute"
        elif setting == "offload" and before == "double":
            self._offloader.mode = "single"
            self._fast["offload"] = self._fast.get("offload", "").replace("double", "single")
            what = "offload double → single buffer"
        elif setting == "micro_batch":
            self._exec_rows = after
            what = (
                f"micro-batch {before} → {after} {'row' if after == 1 else 'rows'} "
                f"({plural(self._forwards_per_step(), 'forward')} per step, the same "
                f"{plural(self._plan.rows_per_mb * self._plan.grad_accum, 'row')} per optimizer step)"
            )
        elif setting == "gradient_checkpointing":
            self._checkpointing = enable_checkpointing(self._model)
            what = "gradient checkpointing on"
        else:
            self._offloader, self._fast["offload"] = install_offload(
                self._model, after, self._device, bool(self.config.fast_paths.keep_attention)
            )
            what = f"{after} offload on"
        self._announce_memory_change(change, phase, step, what, why)

    def _announce_memory_change(self, change: tuple[str, Any, Any], phase: str, step: int, what: str, why: str):
        setting, before, after = change
        message = f"{what}: {why}."
        self.log(message, "warning")
        self._emit(
            MemoryAdjusted(step, phase, setting, before, after, message, self._exec_rows, self._forwards_per_step())
        )

    # -- NaN / spike: roll back -----------------------------------------------------------------
    def _bad_loss(self, step: int, loss: float) -> Optional[tuple[str, float, str]]:
        """(reason, loss, how it reads) when this step's loss is NaN/inf or a spike, else None."""
        if math.isnan(loss):
            return ("nan", loss, "turned NaN")
        if math.isinf(loss):
            return ("inf", loss, "turned infinite")
        t = self.config.training
        recent = [v for _, v in self._history[-SPIKE_WINDOW:]]
        if t.spike_factor > 0 and step > t.warmup_steps and len(recent) >= SPIKE_MIN_HISTORY:
            median = sorted(recent)[len(recent) // 2]
            if loss > t.spike_factor * median:
                return (
                    "spike",
                    loss,
                    f"spiked to {loss:.4g} ({loss / median:.1f}× the median {median:.4g} of recent steps)",
                )
        return None

    def _good_loss(self, step: int, loss: float) -> None:
        self._history.append((step, loss))
        del self._history[: -4 * SPIKE_WINDOW]
        # A snapshot taken before this step is trusted once the step it started had a good loss.
        if self._pending is not None and self._pending["step"] == step - 1:
            self._spare, self._good, self._pending = self._good, self._pending, None

    def _take_snapshot(self, step: int) -> dict:
        """The adapters, optimizer and schedule state and RNG at `step`, in host memory (pinned
        on CUDA; the copies are queued, not waited for). Reuses a released snapshot's buffers."""
        spare, self._spare = self._spare or {}, None
        params, optimizer = [p.detach() for p in self._params], self._optimizer.state_dict()
        if self._fsdp:  # each rank keeps its own shards
            from engine.train import fsdp

            params, optimizer = fsdp.local_tree(params), fsdp.local_tree(optimizer)
        return {
            "step": step,
            "params": _copy_tree(params, spare.get("params")),
            "optimizer": _copy_tree(optimizer, spare.get("optimizer")),
            "scheduler": copy.deepcopy(self._scheduler.state_dict()),
            "rng": _rng_state(),
        }

    def _load_snapshot(self, snap: dict) -> None:
        import torch

        from engine.fastpath.lora_group import adapters_changed

        if self._is_cuda:
            torch.cuda.synchronize(self._device)  # the snapshot's queued copies are done
        from engine.train import fsdp

        with torch.no_grad():
            for p, saved in zip(self._params, snap["params"]):
                fsdp.local(p).copy_(saved)
        adapters_changed()  # the fused LoRA path's cached adapter copies are stale now
        # Fresh copies: on the CPU load_state_dict would keep the snapshot's tensors as the state.
        if self._fsdp:
            fsdp.restore_optimizer_local(self._optimizer, _copy_tree(snap["optimizer"]))
        else:
            self._optimizer.load_state_dict(_copy_tree(snap["optimizer"]))
        self._scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        self._optimizer.zero_grad(set_to_none=True)
        _set_rng_state(snap["rng"])
        self._history = [(s, v) for s, v in self._history if s <= snap["step"]]
        self._pending = None
        reset_counters()  # the bad step's calls are not the next step's

    def _roll_back(self, step: int, reason: str, loss: float, how: str) -> int:
        """Back to the last good snapshot with half the learning rate; returns its step. A second
        time the run stops (TrainingDiverged) with the last good state saved."""
        good = self._good
        if self._rollbacks >= 1:
            self._load_snapshot(good)
            saved = ""
            if self.last_checkpoint is None or step_of(self.last_checkpoint) < good["step"]:
                if self._save(good["step"]):
                    saved = f"; its checkpoint is {self.last_checkpoint}"
            elif self.last_checkpoint is not None:
                saved = f"; the last good checkpoint is {self.last_checkpoint}"
            raise TrainingDiverged(
                f"The loss {how} at step {step}, after a rollback had already halved the learning rate; "
                f"the run stopped with the adapters of step {good['step']}{saved}. "
                "Try a lower training.lr or a longer warm-up."
            )
        self._rollbacks += 1
        lr_before = max(self._scheduler.base_lrs)
        self._load_snapshot(good)
        scheduler = self._scheduler
        scheduler.base_lrs = [lr * 0.5 for lr in scheduler.base_lrs]
        for group, base, fn in zip(self._optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in self._optimizer.param_groups]
        lr_after = max(scheduler.base_lrs)
        message = (
            f"The loss {how} at step {step}: back to the good state of step {good['step']}, learning rate "
            f"halved ({lr_before:.3g} → {lr_after:.3g}); steps {good['step'] + 1}–{step} run again."
        )
        self.log(message, "warning")
        self._emit(RolledBack(step, good["step"], reason, loss, lr_before, lr_after, message))
        return good["step"]

    # -- the measured pre-flight ----------------------------------------------------------------
    def _preflight_wanted(self) -> bool:
        mode = self.config.training.preflight
        return mode == "on" or (mode == "auto" and self._is_cuda)

    def _preflight(self) -> None:
        """Rehearse one forward + backward on the longest micro-batch at the run's settings:
        measure peak memory (CUDA) and time, and lower settings until it fits. Not a training
        step: gradients dropped, RNG restored, the data plan untouched."""
        if not self._preflight_wanted() or self._start_step >= self._total:
            return
        if self._dist.enabled:
            # Each rank would measure its own card and could settle on other settings: the
            # ranks must run the same forwards, so several processes skip the rehearsal.
            self.log("Pre-flight skipped: it runs for single-process runs only")
            return
        rng = _rng_state()
        attempts = 0
        while True:
            attempts += 1
            try:
                measured = self._rehearse()
            except Exception as exc:
                change = self._next_memory_change() if _is_oom(exc) else None
                if change is None:
                    raise
                why = "the rehearsal ran out of memory"
            else:
                # The rehearsal fitted, but AdamW's state arrives at the first optimizer step:
                # from the second step on, the same forward would run out of memory.
                peak, card = measured[0], self._mem_total if self._is_cuda else 0
                if self.faults and self.faults.rehearsal_peak:
                    peak = self.faults.rehearsal_peak(self._attempt(0, self._exec_rows, True))
                    card = self.faults.card_bytes
                why = over_the_card(peak, self._moments_to_come(), card)
                if not why:
                    break
                change = self._next_memory_change()
                if change is None:
                    raise OverTheCard(why)
            self._drop_partial_step()
            self._apply_memory_change(change, "preflight", 0, why)
        if attempts == 1:  # nothing had to be lowered: the measurement may show room to spare
            measured, grown = self._grow_to_fill(measured)
            attempts += grown
        self._optimizer.zero_grad(set_to_none=True)
        _set_rng_state(rng)
        reset_counters()
        self._emit_preflight(attempts, *measured)
        if self._is_cuda:
            # From here on the peak is the training steps': a rehearsal of a size that was then
            # dropped must not stand as the run's peak, nor make offload's measured choice of
            # double buffering (engine.fastpath.offload) more careful than the steps need.
            import torch

            torch.cuda.reset_peak_memory_stats(self._device)

    def _grow_to_fill(self, measured: tuple[int, float, int]) -> tuple[tuple[int, float, int], int]:
        """Where the policy's formula left much of the memory budget unused (it over-estimates,
        a 4-bit base most), run the step's rows in fewer, larger forwards: the same rows with
        the same loss normaliser, so the optimisation is unchanged and only the memory use and
        speed differ. Only when the micro-batch was the policy's choice; the grown size is
        rehearsed, and dropped again if it does not fit. Returns the measurement to report and
        the extra rehearsals run."""
        import torch

        from engine.hardware import policy

        rows, accum = self._plan.rows_per_mb, self._plan.grad_accum
        if (
            not self._is_cuda
            or accum < 2
            or self._exec_rows != rows
            or "training.rows_per_micro_batch" not in self.config.auto_fields
        ):
            return measured, 0
        budget = policy.budget_for("cuda", self._profile)
        moments = self._moments_to_come()
        resident = torch.cuda.memory_allocated(self._device) + moments  # weights, adapters, optimizer
        # Rows cost what the rehearsal allocated for them; what the allocator reserved beyond
        # that is cache and fragmentation, which does not grow row by row. Sizing from the
        # reserved peak left a third of a laptop card unused.
        per_row = max(1, (measured[0] + moments - resident) / rows)
        grown_to = grown_rows(resident, per_row, rows, accum, GROW_FILL * budget.memory)
        if grown_to == rows:
            return measured, 0
        before, tries = self._exec_rows, 0
        # The size is rehearsed, and what the process reserved must stay in the budget (a cap
        # applies to reserved memory). If it does not, halfway back once, then the old size.
        for size in (grown_to, (grown_to + before) // 2):
            if size < GROW_MIN * before:
                break
            tries += 1
            self._exec_rows = size
            out_of_memory = False
            try:
                grown = self._rehearse()
                if torch.cuda.max_memory_reserved(self._device) + moments <= budget.memory:
                    break
                self.log(f"Pre-flight: {plural(size, 'row')} per forward went over the {budget}")
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                out_of_memory = True
            grown = None
            if out_of_memory:  # out of the except block: its traceback held the activations
                self._drop_partial_step()
                self.log(f"Pre-flight: {plural(size, 'row')} per forward ran out of memory")
        if grown is None:
            self._exec_rows = before
            self.log(f"Pre-flight: kept {plural(before, 'row')} per forward")
            return measured, tries
        change = ("micro_batch", before, self._exec_rows)
        self._announce_memory_change(
            change,
            "preflight",
            0,
            f"micro-batch {before} → {self._exec_rows} rows ({plural(self._forwards_per_step(), 'forward')} "
            f"per step, the same {plural(rows * accum, 'row')} per optimizer step)",
            f"the rehearsal measured room in the {budget}",
        )
        return grown, tries

    def _row_tokens(self) -> list[int]:
        sizes = self._objective.example_tokens(self._data)
        return [sum(sizes[d] for d in row) for row in self._data.packing.rows]

    def _rehearse(self) -> tuple[int, float, int]:
        """(peak bytes or 0 on a CPU, seconds of one forward + backward, tokens) on the
        `_exec_rows` longest packed rows."""
        import torch

        sizes = self._row_tokens()
        longest = sorted(range(len(sizes)), key=lambda r: -sizes[r])[: self._exec_rows]
        device = self._device
        if self._is_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        # On CUDA the first pass also compiles and autotunes kernels: time a second one.
        seconds, tokens = 0.0, 0
        for _ in range(2 if self._is_cuda else 1):
            micro = self._objective.prepare_step(self._step_context(0, True), [(len(longest), self._batch(longest))])
            tokens = sum(b.num_tokens for _, b in micro)
            t0 = time.perf_counter()
            self._forward_backward(micro, self._objective.normalizer([b for _, b in micro]), 0, rehearsal=True)
            self._optimizer.zero_grad(set_to_none=True)
            if self._is_cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) if self._is_cuda else 0
        return peak, seconds, tokens

    def _moments_to_come(self) -> int:
        """Bytes of AdamW's two fp32 moments when the optimizer has not made them yet (they
        appear at the first optimizer step, after a rehearsal has measured); 0 once they exist."""
        return 0 if self._optimizer.state else 2 * sum(p.numel() * 4 for p in self._params)

    def _emit_preflight(self, attempts: int, peak: int, seconds: float, tokens: int) -> None:
        if peak:  # AdamW's moments appear at the first optimizer step: count them now
            peak += self._moments_to_come()
        sizes = self._row_tokens()
        step_tokens = sum(sizes) / max(1, len(sizes)) * self._plan.rows_per_mb * self._plan.grad_accum
        step_seconds = seconds * step_tokens / max(1, tokens)
        left = self._total - self._start_step
        eta = step_seconds * left
        mem_total = self._mem_total if self._is_cuda else 0
        offload = self._offloader.mode if self._offloader is not None else "off"
        peak_text = f"peak {_size(peak)} of {_size(mem_total)}" if self._is_cuda else "peak not measured on a CPU"
        message = (
            f"Pre-flight: {peak_text}, about {step_seconds:.2f} s per step, ETA {_duration(eta)} for "
            f"{plural(left, 'step')} ({plural(self._exec_rows, 'row')} per forward × {self._forwards_per_step()} "
            f"per step, checkpointing {'on' if self._checkpointing else 'off'}, offload {offload})"
        )
        self.log(message)
        self._emit(
            PreflightResult(
                int(peak),
                int(mem_total),
                float(step_seconds),
                float(eta),
                self._exec_rows,
                self._forwards_per_step(),
                self._checkpointing,
                offload,
                int(tokens),
                str(self._device),
                attempts,
                message,
            )
        )

    def _report_step(self, step: int, micro: list, normalizer: int, grad_norm, dt: float, sums: dict) -> None:
        """The step's fast-path counters (warnings once each) and, every log_every steps, StepMetrics."""
        import torch

        t, device = self.config.training, self._device
        ntok = sum(b.num_tokens for b in micro)
        counters = reset_counters()
        calls, fallbacks = split_counts(counters)
        self._say_what_did_not_run(self._fast, calls, fallbacks, str(device), step, self._said)
        if step % t.log_every == 0 or step == self._total:
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
                offload=_offload_note(self._offloader),
                fast_path_calls=calls,
                fallbacks=fallbacks,
                metrics=self._objective.step_metrics({k: float(v) for k, v in sums.items()}),
                # The card's utilisation, temperature and power beside its memory (NVML; none on a CPU).
                **(_gpu_health_fields(device.index or 0) if self._is_cuda else {}),
            )
            self._emit(metrics)
            if self._loggers is not None:
                self._loggers.step(metrics)

    # -- between steps: the eval loss, the gallery, the probe -----------------------------------
    def _eval_due(self, step: int) -> bool:
        every = self._eval_every
        return bool(every) and (step % every == 0 or step == self._total)

    def _eval_loss(self) -> tuple[float, int, dict]:
        """(mean loss per trained token, trained tokens) over the held-out examples, through the
        run's own forward (fast paths, fused CE); each rank takes a share of the batches."""
        import torch

        from engine.train import evaluation

        if self._eval_batches is None:
            self._eval_batches = self._objective.eval_batches(
                self._heldout, self._data.packing.row_tokens, self._exec_rows
            )
        batches, dist = self._eval_batches, self._dist
        tokens = self._objective.normalizer(batches)
        total = torch.zeros((), device=self._device)
        sums: dict = {}

        def add(out, keep: bool = True) -> None:
            nonlocal total
            loss = out.loss.detach()
            total += loss if keep else 0 * loss
            for k, v in out.metrics.items():
                v = v.detach() if keep else 0 * v.detach()
                sums[k] = sums[k] + v if k in sums else v

        with evaluation.side_effect_free(self._model):
            if self._fsdp:
                # Every forward gathers each layer from all ranks: every rank runs as many
                # forwards, a rank short of batches repeats its first one and drops its loss.
                rounds = math.ceil(len(batches) / dist.world_size) * dist.world_size
                for k in range(dist.rank, rounds, dist.world_size):
                    on_device = batches[k if k < len(batches) else 0].to(self._device)
                    add(self._ddp(on_device, tokens), k < len(batches))
                    on_device.info.free()
            for k, batch in enumerate(batches):
                if self._fsdp or (dist.enabled and k % dist.world_size != dist.rank):
                    continue
                on_device = batch.to(self._device)
                add(self._loss(self._model, on_device, tokens))
                on_device.info.free()
            if dist.enabled:
                total, sums = dist.sum(total), {k: dist.sum(v) for k, v in sums.items()}
            loss = float(total)
        return loss, tokens, self._objective.eval_metrics({k: float(v) for k, v in sums.items()})

    def _evaluate(self, step: int) -> bool:
        """The eval loss after `step` (EvalMetrics); a new best gets a checkpoint and best.json.
        True when early stopping ends the run here."""
        from engine.train import evaluation

        t0 = time.perf_counter()
        loss, tokens, metrics = self._eval_loss()
        seconds = time.perf_counter() - t0
        best = self._best
        if evaluation.best_improved(loss, best["eval_loss"] if best else None):
            self._bad_evals = 0
            self._mark_best(step, loss)
        else:
            self._bad_evals += 1
        patience = self.config.training.early_stopping_patience
        stop = bool(patience) and self._bad_evals >= patience and step < self._total
        _, stop = self._dist.agree(False, stop)  # every rank stops at the same step
        best = self._best or {}
        self._emit(
            EvalMetrics(
                step,
                loss,
                tokens,
                len(self._heldout),
                round(seconds, 3),
                best.get("eval_loss", float("nan")),
                best.get("step", 0),
                best.get("checkpoint"),
                self._bad_evals,
                stop,
                metrics,
            )
        )
        if self._loggers is not None:
            self._loggers.eval(step, loss)
        if stop:
            self._early_stopped = True
            self.log(
                f"Early stopping at step {step}: the eval loss has not improved for {plural(patience, 'eval')} "
                f"(best {best.get('eval_loss', float('nan')):.4f} at step {best.get('step')}, now {loss:.4f}); "
                "saving a checkpoint and the adapter"
            )
        return stop

    def _mark_best(self, step: int, loss: float) -> None:
        """Record the best eval loss: its checkpoint (written now when there is none for this
        step) in best.json; a checkpoint written only for an earlier best is removed."""
        import shutil

        had = self.last_checkpoint is not None and step_of(self.last_checkpoint) == step
        previous = list(self._best_only)
        self._best = {"step": step, "eval_loss": loss, "checkpoint": None}
        if not had:
            self._best_only = previous + [step]  # saved in the checkpoint's state as well
            if not self._save(step, gallery=False):
                self._best_only = previous
                return
        if self._dist.is_main and self.last_checkpoint is not None and step_of(self.last_checkpoint) == step:
            self._best["checkpoint"] = str(self.last_checkpoint)
            self._folder.write_best(self._best)
            for old in previous:
                if old != step:
                    shutil.rmtree(self._folder.checkpoint(old), ignore_errors=True)
            self._best_only = [s for s in self._best_only if s == step]

    def _run_gallery(self, step: int, checkpoint: Path) -> None:
        """The gallery's prompts answered greedily by the weights of `step` (GalleryAnswers and
        gallery.jsonl). Rank 0 answers and records; under FSDP every rank takes part in the
        forwards (each gathers its layers from all). A failure is logged, never the end of the
        run."""
        if not self._gallery or not (self._dist.is_main or self._fsdp):
            return
        self._gallery_done.add(step)
        try:
            answers = self._answers([ids for _, ids in self._gallery], None)
        except Exception as exc:
            self.log(f"The gallery at step {step} failed: {type(exc).__name__}: {exc}", "warning")
            return
        if not self._dist.is_main:
            return
        prompts = [p for p, _ in self._gallery]
        try:
            self._folder.append_gallery(
                [
                    {"step": step, "prompt": p, "answer": a, "checkpoint": str(checkpoint)}
                    for p, a in zip(prompts, answers)
                ]
            )
        except OSError as exc:
            self.log(f"gallery.jsonl was not written at step {step}: {exc}", "warning")
        self._emit(GalleryAnswers(step, prompts, answers, str(checkpoint)))

    def _answers(self, prompts: list[list[int]], max_new_tokens: Optional[int], device=None) -> list[str]:
        from engine.train import evaluation

        n = max_new_tokens or evaluation.GALLERY_NEW_TOKENS
        gathered, agree = nullcontext(), None
        if self._fsdp:
            from engine.train import fsdp

            gathered, agree = fsdp.root_gathered(self._ddp), partial(share_from_main, self._dist)
        with evaluation.side_effect_free(self._model, device), gathered:
            outs = evaluation.greedy_answers(
                self._model,
                prompts,
                n,
                evaluation.stop_token_ids(self._tokenizer),
                self._device,
                int(self.config.data.max_seq_len),
                agree,
            )
        return [self._tokenizer.decode(out, skip_special_tokens=True).strip() for out in outs]

    def probe(self, prompt: str, max_new_tokens: int = 64) -> tuple[int, str]:
        """(step, reply): the current weights answer `prompt` (greedy, through the chat template
        for a chat run) while the run is paused. Thread-safe; call it from any thread but the
        session's. It changes no weight, RNG state or data position, so resuming stays exact.
        ProbeUnavailable when the run is not paused between steps."""
        from engine.train import evaluation

        if self._dist.enabled:
            raise ProbeUnavailable("A run in several processes cannot be probed from the window.")
        with self._probe_lock:
            step = self._paused_at
            if step is None:
                raise ProbeUnavailable("The run is not paused: pause it to talk to its current weights.")
            chat = self._data.spec.kind != "text"
            ids = evaluation.encode_prompt(self._tokenizer, prompt, chat)
            return step, self._answers([ids], max_new_tokens, device=self._device)[0]

    # -- the end --------------------------------------------------------------------------------
    def _finish(self, step: int, stopped: bool) -> Event:
        """Last checkpoint, the final adapter (not for a stopped run), and the Finished event."""
        if stopped:
            self.log(f"Stopped at step {step}; saving a checkpoint")
        if self.last_checkpoint is None or step_of(self.last_checkpoint) != step:
            self._save(step)
        elif step not in self._gallery_done:  # written as the best so far, without the gallery
            self._run_gallery(step, self.last_checkpoint)
        folder = self._folder
        if not stopped:
            stopped = not self._write_adapter(step)
        result = Finished(
            str(folder.path),
            {
                "steps": step,
                "total_steps": self._total,
                "final_loss": self._last_loss,
                "seconds": round(time.time() - self._started, 2),
                "median_tokens_per_second": _median(self._tok_per_s),
                "adapter": str(folder.adapter) if not stopped else None,
                "last_checkpoint": str(self.last_checkpoint),
                "early_stopped": self._early_stopped,
                "best_eval_loss": self._best["eval_loss"] if self._best else None,
                "best_step": self._best["step"] if self._best else None,
                "best_checkpoint": self._best.get("checkpoint") if self._best else None,
            },
            stopped=stopped,
        )
        self.model, self.tokenizer = self._model, self._tokenizer  # for callers that chat or export in-process
        self._emit(result)
        self._close()
        self._dist.barrier()  # no rank leaves while rank 0 still writes
        self._dist.close()
        return result

    def _write_adapter(self, step: int) -> bool:
        """The final adapter, written as adapter.tmp and published; on a full disk the run
        pauses as for a checkpoint. False when stopped before it could be written."""
        import shutil

        from engine.train import checkpoint as ckpt

        folder = self._folder
        adapter_state, _ = self._full_states(optimizer=False)  # FSDP: gathered by every rank
        if not self._dist.is_main:
            return True
        tmp = folder.adapter_tmp

        def write() -> Path:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                ckpt.save_adapter(self._model, tmp, adapter_state)
                self._tokenizer.save_pretrained(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return publish(tmp, folder.adapter)

        adapter = sum(p.numel() * p.element_size() for p in self._params)
        need = int((adapter + self._tokenizer_bytes()) * 1.05) + (1 << 20)
        if self._write_with_room(step, folder.adapter, need, write, "adapter") is None:
            return False
        self.log(f"Adapter saved to {folder.adapter}")
        return True


def _append(f, text: str) -> None:
    """One line into the run's metrics or log file. On a full disk the line is dropped (the
    event still reaches on_event, and the checkpoint guard says the disk is full) rather than
    ending the run over its log."""
    from engine.train.checkpoint import is_disk_full

    try:
        f.write(text)
        f.flush()
    except OSError as exc:
        if not is_disk_full(exc):
            raise


def _hf(model):
    from engine.peft_model import hf_model

    return hf_model(model)


def _is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError that says CUDA (or another backend) ran out
    of memory (older code paths, cuBLAS / cuDNN allocation failures)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "cublas_status_alloc_failed" in text or "cudnn_status_alloc_failed" in text
    )


def over_the_card(peak: int, moments: int, card: int) -> str:
    """Why a rehearsal's measured `peak` plus AdamW's `moments` still to come do not fit the
    `card`'s bytes (its cap, for an emulated one), or "" when they do or nothing was measured."""
    if not peak or not card or peak + moments <= card:
        return ""
    return (
        f"its peak, {_size(peak)}, and AdamW's state still to come, {_size(moments)}, are over the "
        f"{_size(card)} of the card"
    )


def grown_rows(resident: float, per_row: float, rows: int, accum: int, target: float) -> int:
    """Rows per forward once the rehearsal measured the memory: as many of the step's
    `rows` x `accum` rows as stay under `target` bytes (`resident` + rows x `per_row`, both
    measured), or `rows` when that is not at least GROW_MIN times more. No token ceiling:
    more rows per forward shortens a step (the same rows in fewer forwards), so pause and stop
    answer as soon as before."""
    fit = int((target - resident) // max(per_row, 1.0))
    most = min(rows * accum, fit)
    return most if most >= GROW_MIN * rows else rows


def _rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The current device's generator: a host-side copy of its seed and offset, no sync.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _copy_tree(obj, into=None):
    """A copy of a nested state (dicts, lists, tensors) with every tensor in host memory
    (pinned when it comes from a GPU, copied without waiting); `into`: an earlier copy of the
    same structure whose tensors are reused."""
    import torch

    if isinstance(obj, torch.Tensor):
        if not (isinstance(into, torch.Tensor) and into.shape == obj.shape and into.dtype == obj.dtype):
            into = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
        into.copy_(obj.detach(), non_blocking=obj.is_cuda)
        return into
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _copy_tree(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_copy_tree(v, i) for v, i in zip(obj, into))
    return copy.deepcopy(obj)


def _size(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def prepare_flag(status: str) -> bool:
    return status == "on"


def _offload_note(offloader) -> str:
    """ "double", "single" or "single (why double was not possible)"; "" without offload."""
    if offloader is None:
        return ""
    return offloader.stats.note()


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


def _human_message(exc: Exception, oom_advice: Callable[[], str] | None = None) -> str:
    from engine.config import ConfigError
    from engine.data.sources import DataError
    from engine.models.loading import ModelLoadError

    if isinstance(exc, (ConfigError, DataError, ModelLoadError, RunFolderError, FileNotFoundError, TrainingDiverged)):
        return str(exc)
    from engine.train.checkpoint import disk_free, is_disk_full, mount_of

    if is_disk_full(exc):
        where = getattr(exc, "filename", None)
        if where:
            return (
                f"The disk at {mount_of(Path(where))} is full ({_size(disk_free(Path(where)))} free) while writing "
                f"{where}: free some space, then resume the run."
            )
        return "The disk is full: free some space, then resume the run."
    name = type(exc).__name__
    if isinstance(exc, OverTheCard) or "OutOfMemory" in name or "out of memory" in str(exc).lower():
        try:
            advice = oom_advice() if oom_advice is not None else ""
        except Exception:  # a failure early in the setup: the settings are not all known yet
            advice = ""
        advice = advice or (
            "lower training.rows_per_micro_batch or data.max_seq_len, turn on gradient checkpointing, "
            "or load the model in 4 bits (model.load_in_4bit: true)"
        )
        if isinstance(exc, OverTheCard):
            return f"Out of GPU memory from the second step on: the pre-flight measured {exc}. To fit: {advice}."
        return f"Out of GPU memory. To fit: {advice}."

    return f"Training failed: {name}: {exc}"
