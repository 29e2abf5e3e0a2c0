"""Local experiment logs beside the run folder's own metrics.jsonl: TensorBoard scalars
(`output.tensorboard`, into <run>/tensorboard/) and Weights & Biases (`output.wandb`).

Both are optional and neither may end a run: a missing package is one log line saying how to
install it, and a logger that fails while writing says so once and is switched off. W&B runs
offline (files under <run>/wandb, `wandb sync` uploads them later) unless WANDB_MODE says
otherwise or WANDB_API_KEY is set, and the run says which. Only the reporting process (rank 0)
makes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

# StepMetrics fields written as scalars, under these tags.
STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_second": "perf/tokens_per_second",
    "step_seconds": "perf/step_seconds",
    "mem_allocated": "memory/allocated_bytes",
    "mem_reserved": "memory/reserved_bytes",
    "mem_peak": "memory/peak_bytes",
}
EVAL_TAG = "eval/loss"


class Loggers:
    """The run's TensorBoard writer and W&B run, each None when off or unavailable."""

    def __init__(self, say: Callable[[str, str], None]):
        self._say = say
        self.tensorboard = None
        self.wandb = None
        self.wandb_mode = ""

    @classmethod
    def open(cls, output, run_dir: Path, config: dict, say: Callable[[str, str], None]) -> "Loggers":
        """`say(message, level)`: the session's log. Returns Loggers (possibly with none open)."""
        self = cls(say)
        if output.tensorboard:
            from engine.runs import RunFolder

            self._open_tensorboard(RunFolder(run_dir).tensorboard_dir)
        if output.wandb:
            self._open_wandb(Path(run_dir), config)
        return self

    def _open_tensorboard(self, folder: Path) -> None:
        try:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self._say(
                "output.tensorboard is on but the tensorboard package is not installed: "
                "pip install tensorboard (this run writes no TensorBoard log)",
                "warning",
            )
            return
        try:
            self.tensorboard = SummaryWriter(log_dir=str(folder))
        except Exception as exc:
            self._say(f"TensorBoard log not written: {type(exc).__name__}: {exc}", "warning")
            return
        self._say(f"TensorBoard log: {folder} (tensorboard --logdir {folder})", "info")

    def _open_wandb(self, run_dir: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            self._say(
                "output.wandb is on but the wandb package is not installed: pip install wandb "
                "(this run logs nothing to Weights & Biases)",
                "warning",
            )
            return
        mode = wandb_mode(os.environ)
        try:
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tunesmith"),
                name=run_dir.name,
                dir=str(run_dir),
                config=config,
                mode=mode,
                resume="allow",
                id=_wandb_id(run_dir),
            )
        except Exception as exc:
            self._say(f"Weights & Biases not started: {type(exc).__name__}: {exc}", "warning")
            return
        self.wandb_mode = mode
        if mode == "offline":
            self._say(
                f"Weights & Biases is OFFLINE: logged to {run_dir / 'wandb'}; upload later with "
                f"wandb sync {run_dir / 'wandb'} (set WANDB_API_KEY or WANDB_MODE=online to log live)",
                "info",
            )
        else:
            self._say(f"Weights & Biases is logging ({mode})", "info")

    # -- writing -----------------------------------------------------------------------------
    def step(self, metrics) -> None:
        values = {tag: float(getattr(metrics, name)) for name, tag in STEP_SCALARS.items()}
        self._write(int(metrics.step), values)

    def eval(self, step: int, loss: float) -> None:
        self._write(int(step), {EVAL_TAG: float(loss)})

    def _write(self, step: int, values: dict[str, float]) -> None:
        if self.tensorboard is not None:
            try:
                for tag, v in values.items():
                    self.tensorboard.add_scalar(tag, v, step)
            except Exception as exc:
                self._say(f"TensorBoard log stopped: {type(exc).__name__}: {exc}", "warning")
                self._close_tensorboard()
        if self.wandb is not None:
            try:
                self.wandb.log(values, step=step)
            except Exception as exc:
                self._say(f"Weights & Biases logging stopped: {type(exc).__name__}: {exc}", "warning")
                self._close_wandb()

    def flush(self) -> None:
        if self.tensorboard is not None:
            try:
                self.tensorboard.flush()
            except Exception:
                self._close_tensorboard()

    def close(self) -> None:
        self._close_tensorboard()
        self._close_wandb()

    def _close_tensorboard(self) -> None:
        writer, self.tensorboard = self.tensorboard, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass

    def _close_wandb(self) -> None:
        run, self.wandb = self.wandb, None
        if run is not None:
            try:
                run.finish()
            except Exception:
                pass


def wandb_mode(env) -> str:
    """W&B's mode: WANDB_MODE when set, "online" with an API key, else "offline" (a run must
    never wait on a login prompt or a network it does not have)."""
    mode = (env.get("WANDB_MODE") or "").strip().lower()
    if mode:
        return mode
    return "online" if env.get("WANDB_API_KEY") else "offline"


def _wandb_id(run_dir: Path) -> Optional[str]:
    """One W&B run per run folder, so a resumed run continues its curves."""
    import re

    return re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:64] or None
