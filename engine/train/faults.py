"""Failures injected for tests: the documented seam through which the CPU tests reach the
session's real recovery (out of memory, NaN and spikes, a full disk, a measured pre-flight
peak), each raised where the real failure arises."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


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
