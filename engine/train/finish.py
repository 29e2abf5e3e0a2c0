"""The run's end in numbers: the summary the Finished event carries (steps, final loss, time,
median tokens per second, where the adapter and the checkpoints are, the best eval).

The session writes the last checkpoint and the adapter first; `run_summary` only reads what the
parts remember.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional


def run_summary(
    step: int,
    total: int,
    final_loss: float,
    started: float,
    tok_per_s: list[float],
    adapter: Optional[Path],
    last_checkpoint: Optional[Path],
    evaluator,
) -> dict:
    """The summary of a run that ended at `step` of `total`, started at `started` (time.time());
    `adapter`: the final adapter, None for a run stopped before it was written; `evaluator`:
    engine.train.evaluator.Evaluator (early stopping, the best eval)."""
    best = evaluator.best
    return {
        "steps": step,
        "total_steps": total,
        "final_loss": final_loss,
        "seconds": round(time.time() - started, 2),
        "median_tokens_per_second": median(tok_per_s),
        "adapter": str(adapter) if adapter is not None else None,
        "last_checkpoint": str(last_checkpoint),
        "early_stopped": evaluator.early_stopped,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_step": best["step"] if best else None,
        "best_checkpoint": best.get("checkpoint") if best else None,
    }


def median(values: list[float]) -> float:
    """The upper median (the middle value, or the higher of the two middle ones); 0.0 for none."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[len(s) // 2]
