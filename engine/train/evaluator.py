"""The eval loss between steps, the best checkpoint and early stopping.

Every `training.eval_every` steps (and at the run's last step) the held-out examples go
through the run's own forward without gradients (engine.train.evaluation.side_effect_free:
RNG, train mode and counters as they were), EvalMetrics reports it with the best so far; a new
best eval loss gets a checkpoint and best.json (a checkpoint written only for an earlier best
is removed); `training.early_stopping_patience` evals without a new best end the run with its
checkpoint and adapter. What it remembers is kept in checkpoints (`state()` / `restore()`), so
a resume goes on with the same best and patience.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from engine.data import plural
from engine.events import EvalMetrics
from engine.runs import step_of


class Evaluator:
    """`runner`: the StepRunner whose forward the eval runs; `held_out`: the objective's held-out
    examples or None; `reporter`: engine.train.reporting.Reporter; `folder`: the RunFolder."""

    def __init__(self, runner, held_out, training, total: int, reporter, folder, row_tokens: int):
        self.runner, self.held_out, self.training, self.total = runner, held_out, training, total
        self.reporter, self.folder, self.row_tokens = reporter, folder, row_tokens
        self.dist = runner.dist
        self.best: Optional[dict] = None  # {"step", "eval_loss", "checkpoint"}
        self.bad_evals = 0
        self.best_only: list[int] = []  # checkpoints written only because they were the best
        self.early_stopped = False
        self._batches = None  # packed on first use
        every = training.eval_every
        if every == "auto":
            from engine.train.evaluation import auto_eval_every

            held = sum(len(d) for d in held_out.docs) if held_out is not None else 0
            every = auto_eval_every(total, held, runner.step_tokens())
        self.every = int(every) if held_out is not None else 0
        if training.early_stopping_patience and not self.every:
            why = "there are no held-out examples" if held_out is None else "training.eval_every is 0"
            reporter.log(f"Early stopping is off: {why}", "warning")

    def state(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals, "best_only": self.best_only}

    def restore(self, saved: dict) -> None:
        self.best = saved.get("best")
        self.bad_evals = int(saved.get("bad_evals", 0))
        self.best_only = [int(s) for s in saved.get("best_only", [])]

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.total)

    def loss(self, step: int = 0) -> tuple[float, int, dict]:
        """(mean loss per trained token, trained tokens, the objective's metrics) over the
        held-out examples, through the run's own forward (fast paths, fused CE); each rank takes
        a share of the batches. For other methods "trained tokens" is the objective's normalizer
        (pairs, answers, completions) and the loss its own (GRPO's: minus the mean reward)."""
        import torch

        from engine.train import evaluation

        runner, dist, device = self.runner, self.dist, self.runner.device
        objective = runner.objective
        if self._batches is None:
            self._batches = objective.eval_batches(self.held_out, self.row_tokens, runner.memory.rows)
        total = torch.zeros((), device=device)
        sums: dict = {}

        def add(out, keep: bool = True) -> None:
            nonlocal total
            loss = out.loss.detach()
            total += loss if keep else 0 * loss
            for k, v in out.metrics.items():
                v = v.detach() if keep else 0 * v.detach()
                sums[k] = sums[k] + v if k in sums else v

        with evaluation.side_effect_free(runner.model):
            # What the objective evaluates: the held-out batches with what their loss needs
            # (DPO's reference log-probs), or batches made from them (GRPO's greedy answers).
            batches = objective.prepare_eval(runner.context(step), self._batches)
            tokens = objective.normalizer(batches)
            if runner.fsdp:
                # Every forward gathers each layer from all ranks: every rank runs as many
                # forwards, a rank short of batches repeats its first one and drops its loss.
                rounds = math.ceil(len(batches) / dist.world_size) * dist.world_size
                for k in range(dist.rank, rounds, dist.world_size):
                    on_device = batches[k if k < len(batches) else 0].to(device)
                    add(runner.ddp(on_device, tokens), k < len(batches))
                    on_device.info.free()
            for k, batch in enumerate(batches):
                if runner.fsdp or (dist.enabled and k % dist.world_size != dist.rank):
                    continue
                on_device = batch.to(device)
                add(runner.loss(runner.model, on_device, tokens))
                on_device.info.free()
            if dist.enabled:
                total, sums = dist.sum(total), {k: dist.sum(v) for k, v in sums.items()}
            loss = float(total)
        return loss, tokens, objective.eval_metrics({k: float(v) for k, v in sums.items()})

    def evaluate(self, step: int, save: Callable[[int], bool], last_checkpoint: Callable[[], Optional[Path]]) -> bool:
        """The eval loss after `step` (EvalMetrics); a new best gets a checkpoint (`save(step)`,
        without the gallery) and best.json. True when early stopping ends the run here."""
        from engine.train import evaluation

        t0 = time.perf_counter()
        loss, tokens, metrics = self.loss(step)
        seconds = time.perf_counter() - t0
        best = self.best
        if evaluation.best_improved(loss, best["eval_loss"] if best else None):
            self.bad_evals = 0
            self.mark_best(step, loss, save, last_checkpoint)
        else:
            self.bad_evals += 1
        patience = self.training.early_stopping_patience
        stop = bool(patience) and self.bad_evals >= patience and step < self.total
        _, stop = self.dist.agree(False, stop)  # every rank stops at the same step
        best = self.best or {}
        self.reporter.emit(
            EvalMetrics(
                step,
                loss,
                tokens,
                len(self.held_out),
                round(seconds, 3),
                best.get("eval_loss", float("nan")),
                best.get("step", 0),
                best.get("checkpoint"),
                self.bad_evals,
                stop,
                metrics,
            )
        )
        if self.reporter.loggers is not None:
            self.reporter.loggers.eval(step, loss)
        if stop:
            self.early_stopped = True
            self.reporter.log(
                f"Early stopping at step {step}: the eval loss has not improved for {plural(patience, 'eval')} "
                f"(best {best.get('eval_loss', float('nan')):.4f} at step {best.get('step')}, now {loss:.4f}); "
                "saving a checkpoint and the adapter"
            )
        return stop

    def mark_best(self, step: int, loss: float, save: Callable[[int], bool], last_checkpoint) -> None:
        """Record the best eval loss: its checkpoint (written now when there is none for this
        step) in best.json; a checkpoint written only for an earlier best is removed."""
        last = last_checkpoint()
        had = last is not None and step_of(last) == step
        previous = list(self.best_only)
        self.best = {"step": step, "eval_loss": loss, "checkpoint": None}
        if not had:
            self.best_only = previous + [step]  # saved in the checkpoint's state as well
            if not save(step):
                self.best_only = previous
                return
        last = last_checkpoint()
        if self.dist.is_main and last is not None and step_of(last) == step:
            self.best["checkpoint"] = str(last)
            self.folder.write_best(self.best)
            for old in previous:
                if old != step:
                    shutil.rmtree(self.folder.checkpoint(old), ignore_errors=True)
            self.best_only = [s for s in self.best_only if s == step]
