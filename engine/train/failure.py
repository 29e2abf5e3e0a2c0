"""What a failed run says: one sentence the person can act on for every way a run ends
early (bad config, data or model; a full disk; out of memory, with the settings still left to
lower; a diverged loss), and the exception's own words for the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.runs import RunFolderError
from engine.train.preflight import OverTheCard
from engine.train.rollback import TrainingDiverged
from engine.train.units import size


def failure_message(exc: Exception, oom_advice: Callable[[], str] | None = None) -> str:
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
                f"The disk at {mount_of(Path(where))} is full ({size(disk_free(Path(where)))} free) while writing "
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
