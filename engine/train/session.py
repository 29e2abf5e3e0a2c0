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
`_restore` (a checkpoint when resuming), then `_train_loop` (pause/stop between steps;
`_train_step` with `_forward_backward_or_retry` for the kept-attention OOM retry, and
`_report_step` for counters and metrics) and `_finish` (last checkpoint, final adapter,
Finished). Where files lie in the run folder is engine.runs' business.
"""

from __future__ import annotations

import json
import random
import threading
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from engine.config import RunConfig
from engine.counters import requested_but_not_run, reset_counters, split_counts
from engine.data import plural
from engine.events import (
    CheckpointSaved,
    Event,
    Failed,
    Finished,
    LogLine,
    Paused,
    Resumed,
    RunStarted,
    StepMetrics,
)
from engine.runs import RunFolder, RunFolderError, publish, resume_checkpoint, step_of

__all__ = ["TrainingSession", "RunFolderError"]


class TrainingSession:
    def __init__(
        self,
        config: RunConfig,
        on_event: Optional[Callable[[Event], None]] = None,
        run_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
    ):
        """`resume_from`: a checkpoint folder, or a run folder (its latest checkpoint)."""
        self.config = config
        self.on_event = on_event
        self._run_dir = Path(run_dir) if run_dir else None
        self._resume_from = Path(resume_from) if resume_from else None
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._metrics_file = None
        self._log_file = None
        self.last_checkpoint: Optional[Path] = None
        self.run_dir: Optional[Path] = None

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
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(event.to_dict(), default=str) + "\n")
            self._metrics_file.flush()
        if isinstance(event, LogLine) and self._log_file is not None:
            stamp = datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
            self._log_file.write(f"{stamp} {event.level}: {event.message}\n")
            self._log_file.flush()
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
                _human_message(exc),
                traceback.format_exc(),
                str(self.last_checkpoint) if self.last_checkpoint else None,
            )
            try:
                self._emit(LogLine(event.message, "error"))
                self._emit(event)
            finally:
                self._close()
            return event

    def _close(self) -> None:
        for f in (self._metrics_file, self._log_file):
            if f is not None:
                f.close()
        self._metrics_file = self._log_file = None

    # -- the recipe ----------------------------------------------------------------------------
    def _run(self) -> Event:
        self._started = time.time()
        self._setup_config()
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()
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
            )
        )
        step, stopped = self._train_loop()
        return self._finish(step, stopped)

    def _setup_config(self) -> None:
        """Hardware defaults applied to the config, seeds set, the run folder chosen (not made)."""
        import torch

        from engine.hardware import policy
        from engine.hardware.profile import detect

        self._profile = detect()
        # Model shape from a config.json already on disk (never a download): the memory-based
        # defaults need it; without it the policy keeps to what it can decide safely.
        info = policy.model_info_for(self.config)
        self.config = config = policy.apply_defaults(self.config, self._profile, info)
        self._folder = self._plan_run_dir(config)
        self._device = torch.device(config.training.device)
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
            if name == "auto":
                name = datetime.now().strftime("run-%Y%m%d-%H%M%S")
            folder = RunFolder(Path(config.output.dir) / name)
        folder.check_free(config.output.overwrite)
        return folder

    def _setup_data(self) -> None:
        """Tokenizer and packed data set; then the run folder opens (bad data fails before it exists)."""
        from engine.data.dataset import prepare_dataset
        from engine.models.loading import load_tokenizer

        config = self.config
        self.log(f"Loading tokenizer and data ({config.data.source})")
        self._tokenizer = load_tokenizer(config.model)
        self._data = data = prepare_dataset(config.data, self._tokenizer)
        self._summary = summary = data.summary()
        self._open_run_dir()
        config.save(self._folder.config)
        self.log(f"Run folder: {self.run_dir}")
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

    def _open_run_dir(self) -> None:
        folder = self._folder.create(fresh=self._resume_from is None)
        self._metrics_file = open(folder.metrics, "a", encoding="utf-8")
        self._log_file = open(folder.log, "a", encoding="utf-8")
        self.run_dir = folder.path

    def _setup_model(self) -> None:
        """The model with LoRA attached and the fast paths on (engine.train.step.prepare_model)."""
        from engine.models.loading import load_model, quiet_third_party
        from engine.models.lora import attach_lora, lora_parameters
        from engine.train.step import forward_loss, prepare_model

        config, t, device = self.config, self.config.training, self._device
        self.log(f"Loading model {config.model.name_or_path} on {device} ({config.model.dtype})")
        model = load_model(config.model, device, config.model.dtype)
        with quiet_third_party():  # PEFT's FutureWarnings about transformers internals
            model = attach_lora(model, config.lora)
        prepared = prepare_model(model, config.fast_paths, device, bool(t.gradient_checkpointing), offload=t.offload)
        self._model, self._offloader, self._fast = prepared.model, prepared.offloader, prepared.report
        self._forward_loss = forward_loss
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

    def _save(self, step: int) -> None:
        from engine.train import checkpoint as ckpt

        path = ckpt.save_checkpoint(
            self._folder.checkpoint(step),
            self._model,
            self._optimizer,
            self._scheduler,
            step,
            {"total_steps": self._total, "epoch": self._plan.epoch_at(step)},
            self._tokenizer,
        )
        self.last_checkpoint = path
        self._emit(CheckpointSaved(step, str(path)))

    # -- the loop -------------------------------------------------------------------------------
    def _train_loop(self) -> tuple[int, bool]:
        """Optimizer steps from the start step to the total, honouring pause and stop between
        them; returns (steps done, whether it was stopped)."""
        import torch

        t, device = self.config.training, self._device
        self._is_cuda = device.type == "cuda"
        self._mem_total = torch.cuda.get_device_properties(device).total_memory if self._is_cuda else _host_total()
        self._use_fused = prepare_flag(self._fast.get("fused_ce", "on"))
        chunk = self.config.fast_paths.ce_chunk_tokens
        self._chunk = None if chunk == "auto" else int(chunk)
        self._last_loss = float("nan")
        self._tok_per_s = []
        self._said = set()  # fallbacks and missing fast paths already logged (once each)
        step = self._start_step
        reset_counters()
        while step < self._total:
            if self._wait_if_paused(step):
                return step, True
            step = self._train_step(step)
            if t.save_every and step % t.save_every == 0 and step < self._total:
                self._save(step)
        return step, False

    def _wait_if_paused(self, step: int) -> bool:
        """Blocks while paused; True when the run is to stop."""
        if not self._resume.is_set():
            self._emit(Paused(step))
            self.log(f"Paused at step {step}")
            self._resume.wait()
            if not self._stop.is_set():
                self._emit(Resumed(step))
                self.log(f"Resumed at step {step}")
        return self._stop.is_set()

    def _micro_batches(self, step: int) -> list:
        from engine.data.collate import PackedBatch

        data, rows = self._data, self._data.packing.rows
        micro = []
        for row_ids in self._plan.micro_batches(step):
            doc_ids = [d for r in row_ids for d in rows[r]]
            micro.append(
                PackedBatch.from_documents([data.docs[d] for d in doc_ids], [data.trained[d] for d in doc_ids])
            )
        return micro

    def _train_step(self, step: int) -> int:
        """One optimizer step (all its micro-batches), then its metrics; returns the new step."""
        import torch

        t, device = self.config.training, self._device
        t0 = time.perf_counter()
        micro = self._micro_batches(step)
        normalizer = max(1, sum(b.num_trained_tokens for b in micro))
        loss_sum = self._forward_backward_or_retry(micro, normalizer, step)
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        self._optimizer.step()
        self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._last_loss = float(loss_sum)  # one sync per optimizer step
        if self._is_cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step += 1
        self._report_step(step, micro, normalizer, grad_norm, dt)
        return step

    def _forward_backward(self, micro: list, normalizer: int):
        import torch

        device = self._device
        loss_sum = torch.zeros((), device=device)
        for batch in micro:
            batch = batch.to(device)
            loss = self._forward_loss(
                self._model,
                batch,
                normalizer,
                fused_ce=self._use_fused,
                cached_metadata=self.config.fast_paths.cached_metadata,
                ce_chunk_tokens=self._chunk,
                offloader=self._offloader,
            )
            loss.backward()
            loss_sum += loss.detach()
            batch.info.free()
        return loss_sum

    def _forward_backward_or_retry(self, micro: list, normalizer: int, step: int):
        import torch

        try:
            return self._forward_backward(micro, normalizer)
        except torch.cuda.OutOfMemoryError:
            # Kept attention outputs take at most half of the memory free at the step's
            # start; if the step still ran out, stop keeping them and run it once more
            # from scratch (partial LoRA gradients are dropped first).
            offloader = self._offloader
            if offloader is None or offloader.stats.attention_kept != "kept":
                raise
            self._optimizer.zero_grad(set_to_none=True)
            offloader.stop_keeping_attention()
            if self._is_cuda:
                torch.cuda.empty_cache()
            self.log(
                f"Step {step + 1} ran out of GPU memory with attention outputs kept for the "
                "recompute; they are no longer kept in this run, and the step runs again."
            )
            return self._forward_backward(micro, normalizer)

    def _report_step(self, step: int, micro: list, normalizer: int, grad_norm, dt: float) -> None:
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
            self._emit(
                StepMetrics(
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
                )
            )

    # -- the end --------------------------------------------------------------------------------
    def _finish(self, step: int, stopped: bool) -> Event:
        """Last checkpoint, the final adapter (not for a stopped run), and the Finished event."""
        if stopped:
            self.log(f"Stopped at step {step}; saving a checkpoint")
        if self.last_checkpoint is None or step_of(self.last_checkpoint) != step:
            self._save(step)
        folder = self._folder
        if not stopped:
            import shutil

            tmp = folder.adapter_tmp
            shutil.rmtree(tmp, ignore_errors=True)
            self._model.save_pretrained(tmp, safe_serialization=True)
            self._tokenizer.save_pretrained(tmp)
            publish(tmp, folder.adapter)
            self.log(f"Adapter saved to {folder.adapter}")
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
            },
            stopped=stopped,
        )
        self.model, self.tokenizer = self._model, self._tokenizer  # for callers that chat or export in-process
        self._emit(result)
        self._close()
        return result


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


def _human_message(exc: Exception) -> str:
    from engine.config import ConfigError
    from engine.data.sources import DataError
    from engine.models.loading import ModelLoadError

    if isinstance(exc, (ConfigError, DataError, ModelLoadError, RunFolderError, FileNotFoundError)):
        return str(exc)
    name = type(exc).__name__
    if "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return (
            "Out of GPU memory. Lower training.rows_per_micro_batch or data.max_seq_len, turn on "
            "gradient checkpointing, or load the model in 4 bits (model.load_in_4bit: true)."
        )
    return f"Training failed: {name}: {exc}"
