"""TrainingSession: one fine-tuning run, from config to adapter, reported through events.

The loop is our own rather than transformers' Trainer: it has to honour pause and stop
between steps, emit typed events with memory and packing counters, feed packed micro-batches
with prebuilt metadata, and compute the loss from hidden states with the fused
cross-entropy, all of which the Trainer would need overriding piecemeal.

`run()` blocks (call it on a worker thread) and never raises for bad input: every outcome,
including failure, arrives as an event, and `run()` returns the last one.
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


class RunFolderError(RuntimeError):
    pass


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

    def _say_what_did_not_run(self, fast: dict, calls: dict, fallbacks: dict, device: str, step: int,
                              said: set) -> None:
        """Log each distinct fallback reason and each requested fast path that did not run (or
        ran on some layers only) once per run: a warning on a GPU, where it costs speed or
        memory; a note elsewhere."""
        level = "warning" if device.startswith("cuda") else "info"
        for entry, n in fallbacks.items():
            if ("fallback", entry) not in said:
                said.add(("fallback", entry))
                self.log(f"Fast path fallback in step {step}: {entry} ({n} calls took the stock path)", level)
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

    def _plan_run_dir(self, config: RunConfig) -> Path:
        """Where the run will live; refuses a folder that already holds a run (no silent overwrite)."""
        if self._resume_from is not None:
            src = self._resume_from
            run_dir = src.parent.parent if src.parent.name == "checkpoints" else src
        elif self._run_dir is not None:
            run_dir = self._run_dir
        else:
            name = config.output.run_name
            if name == "auto":
                name = datetime.now().strftime("run-%Y%m%d-%H%M%S")
            run_dir = Path(config.output.dir) / name
        if self._resume_from is None and run_dir.exists() and any(run_dir.iterdir()):
            if (run_dir / "config.yaml").exists() and not config.output.overwrite:
                raise RunFolderError(
                    f"the output folder {run_dir} already holds a run; choose another run name or "
                    "folder, resume it, or set output.overwrite: true"
                )
            if not (run_dir / "config.yaml").exists():
                raise RunFolderError(f"the output folder {run_dir} is not empty and holds no run; choose an empty folder")
        return run_dir

    def _open_run_dir(self, run_dir: Path) -> Path:
        if self._resume_from is None and (run_dir / "config.yaml").exists():
            import shutil

            shutil.rmtree(run_dir)  # only reached with output.overwrite: true
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        self._metrics_file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._log_file = open(run_dir / "log.txt", "a", encoding="utf-8")
        return run_dir

    def _run(self) -> Event:
        import torch

        from engine.hardware import policy
        from engine.hardware.profile import detect
        from engine.data.collate import PackedBatch
        from engine.data.dataset import prepare_dataset
        from engine.models.loading import load_model, load_tokenizer
        from engine.models.lora import attach_lora, lora_parameters
        from engine.train import checkpoint as ckpt
        from engine.train.optim import make_optimizer
        from engine.train.schedule import StepPlan, lr_lambda
        from engine.train.step import forward_loss, offloader_of, prepare_model

        started = time.time()
        profile = detect()
        # Model shape from a config.json already on disk (never a download): the memory-based
        # defaults need it; without it the policy keeps to what it can decide safely.
        info = policy.model_info_for(self.config)
        config = policy.apply_defaults(self.config, profile, info)
        self.config = config
        run_dir = self._plan_run_dir(config)
        t = config.training
        device = torch.device(t.device)
        torch.manual_seed(t.seed)
        random.seed(t.seed)

        # Bad data or a bad model folder fails here, before a run folder exists.
        self.log(f"Loading tokenizer and data ({config.data.source})")
        tokenizer = load_tokenizer(config.model)
        data = prepare_dataset(config.data, tokenizer)
        summary = data.summary()
        self.run_dir = self._open_run_dir(run_dir)
        config.save(run_dir / "config.yaml")
        self.log(f"Run folder: {run_dir}")
        if data.used_fallback_template:
            self.log("The tokenizer has no chat template; using a plain ChatML template", "warning")
        for idx, reason in data.skipped[:20]:
            self.log(f"Row {idx} skipped: {reason}", "warning")
        if len(data.skipped) > 20:
            self.log(f"... and {len(data.skipped) - 20} more rows skipped", "warning")
        if data.truncated:
            self.log(f"{data.truncated} examples were longer than {config.data.max_seq_len} tokens and were truncated", "warning")
        self.log(
            f"{summary['examples']} examples packed into {summary['packed_rows']} rows of "
            f"{summary['row_tokens']} tokens ({summary['packing_efficiency']:.1%} full)"
        )

        self.log(f"Loading model {config.model.name_or_path} on {device} ({config.model.dtype})")
        model = load_model(config.model, device, config.model.dtype)
        model = attach_lora(model, config.lora)
        fast = prepare_model(model, config.fast_paths, device, bool(t.gradient_checkpointing), offload=t.offload)
        offloader = offloader_of(model)
        model.train()
        params = lora_parameters(model)
        n_train = sum(p.numel() for p in params)
        self.log(f"LoRA: {n_train:,} trainable parameters; fast paths: " + ", ".join(f"{k}={v}" for k, v in fast.items()))

        optimizer = make_optimizer(params, t.lr, t.weight_decay, t.optimizer)
        plan = StepPlan(len(data.packing.rows), int(t.rows_per_micro_batch), t.grad_accum, t.seed)
        total = plan.total_steps(t.max_steps, t.epochs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.scheduler, t.warmup_steps, total))

        start_step = 0
        if self._resume_from is not None:
            source = self._resume_from
            if (source / "checkpoints").is_dir():
                source = ckpt.latest_checkpoint(source)
                if source is None:
                    raise FileNotFoundError(f"{self._resume_from} holds no checkpoint to resume from")
            state = ckpt.load_checkpoint(source, model, optimizer, scheduler)
            start_step = state["step"]
            self.last_checkpoint = source
            self.log(f"Resumed from {source} at step {start_step}")

        self._emit(
            RunStarted(
                str(run_dir), config.to_dict(), profile.to_dict(), total, fast, summary, start_step
            )
        )

        def save(step: int) -> None:
            path = ckpt.save_checkpoint(
                run_dir / "checkpoints" / f"step-{step}", model, optimizer, scheduler, step,
                {"total_steps": total, "epoch": plan.epoch_at(step)}, tokenizer,
            )
            self.last_checkpoint = path
            self._emit(CheckpointSaved(step, str(path)))

        is_cuda = device.type == "cuda"
        mem_total = torch.cuda.get_device_properties(device).total_memory if is_cuda else _host_total()
        use_fused = prepare_flag(fast.get("fused_ce", "on"))
        chunk = config.fast_paths.ce_chunk_tokens
        chunk = None if chunk == "auto" else int(chunk)
        last_loss = float("nan")
        tok_per_s = []
        step = start_step
        stopped = False
        rows = data.packing.rows
        said: set = set()  # fallbacks and missing fast paths already logged (once each)
        reset_counters()
        while step < total:
            if not self._resume.is_set():
                self._emit(Paused(step))
                self.log(f"Paused at step {step}")
                self._resume.wait()
                if not self._stop.is_set():
                    self._emit(Resumed(step))
                    self.log(f"Resumed at step {step}")
            if self._stop.is_set():
                stopped = True
                break
            t0 = time.perf_counter()
            micro = []
            for row_ids in plan.micro_batches(step):
                doc_ids = [d for r in row_ids for d in rows[r]]
                micro.append(
                    PackedBatch.from_documents([data.docs[d] for d in doc_ids], [data.trained[d] for d in doc_ids])
                )
            normalizer = max(1, sum(b.num_trained_tokens for b in micro))

            def forward_backward() -> torch.Tensor:
                loss_sum = torch.zeros((), device=device)
                for batch in micro:
                    batch = batch.to(device)
                    loss = forward_loss(
                        model, batch, normalizer, fused_ce=use_fused,
                        cached_metadata=config.fast_paths.cached_metadata, ce_chunk_tokens=chunk,
                    )
                    loss.backward()
                    loss_sum += loss.detach()
                    batch.info.free()
                return loss_sum

            try:
                loss_sum = forward_backward()
            except torch.cuda.OutOfMemoryError:
                # Kept attention outputs take at most half of the memory free at the step's
                # start; if the step still ran out, stop keeping them and run it once more
                # from scratch (partial LoRA gradients are dropped first).
                if offloader is None or offloader.stats.attention_kept != "kept":
                    raise
                optimizer.zero_grad(set_to_none=True)
                offloader.stop_keeping_attention()
                if is_cuda:
                    torch.cuda.empty_cache()
                self.log(f"Step {step + 1} ran out of GPU memory with attention outputs kept for the "
                         "recompute; they are no longer kept in this run, and the step runs again.")
                loss_sum = forward_backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            last_loss = float(loss_sum)  # one sync per optimizer step
            if is_cuda:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step += 1
            ntok = sum(b.num_tokens for b in micro)
            counters = reset_counters()
            calls, fallbacks = split_counts(counters)
            self._say_what_did_not_run(fast, calls, fallbacks, str(device), step, said)
            if step % t.log_every == 0 or step == total:
                tok_per_s.append(ntok / dt)
                if is_cuda:
                    mem = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                           torch.cuda.max_memory_allocated(device))
                else:
                    rss = _rss()
                    mem = (rss, rss, rss)
                self._emit(StepMetrics(
                    step=step, total_steps=total, epoch=plan.epoch_at(step), loss=last_loss,
                    lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm), tokens=ntok,
                    trained_tokens=normalizer, step_seconds=dt, tokens_per_second=ntok / dt,
                    mem_allocated=mem[0], mem_reserved=mem[1], mem_peak=mem[2], mem_total=mem_total,
                    device=str(device), metadata_builds=counters.get("metadata_builds", 0),
                    host_syncs=counters.get("host_syncs", 0),
                    offload=_offload_note(offloader), fast_path_calls=calls, fallbacks=fallbacks,
                ))
            if t.save_every and step % t.save_every == 0 and step < total:
                save(step)
        if stopped:
            self.log(f"Stopped at step {step}; saving a checkpoint")
        if self.last_checkpoint is None or read_step(self.last_checkpoint) != step:
            save(step)
        adapter_dir = run_dir / "adapter"
        if not stopped:
            import shutil

            tmp = run_dir / "adapter.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(adapter_dir, ignore_errors=True)
            tmp.rename(adapter_dir)
            self.log(f"Adapter saved to {adapter_dir}")
        result = Finished(
            str(run_dir),
            {
                "steps": step,
                "total_steps": total,
                "final_loss": last_loss,
                "seconds": round(time.time() - started, 2),
                "median_tokens_per_second": _median(tok_per_s),
                "adapter": str(adapter_dir) if not stopped else None,
                "last_checkpoint": str(self.last_checkpoint),
            },
            stopped=stopped,
        )
        self.model, self.tokenizer = model, tokenizer  # for callers that chat or export in-process
        self._emit(result)
        self._close()
        return result


def prepare_flag(status: str) -> bool:
    return status == "on"


def read_step(path) -> int:
    try:
        return int(Path(path).name.split("-")[1])
    except (IndexError, ValueError):
        return -1


def _offload_note(offloader) -> str:
    """"double", "single" or "single (why double was not possible)"; "" without offload."""
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
