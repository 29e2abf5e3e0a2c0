"""Learning-rate schedules (linear warm-up, then cosine, linear or constant) and the step plan.

The step plan fixes which packed rows go into which micro-batch of which optimizer step from
the seed alone, so a resumed run sees exactly the data the uninterrupted run would have.
"""

from __future__ import annotations

import math
import random


def lr_lambda(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class StepPlan:
    """Rows per micro-batch and micro-batches per step over epochs of shuffled packed rows."""

    def __init__(self, num_rows: int, rows_per_micro_batch: int, grad_accum: int, seed: int):
        self.num_rows = num_rows
        self.rows_per_mb = max(1, min(rows_per_micro_batch, num_rows))
        self.grad_accum = grad_accum
        self.seed = seed
        self.mb_per_epoch = math.ceil(num_rows / self.rows_per_mb)
        self.steps_per_epoch = max(1, math.ceil(self.mb_per_epoch / grad_accum))
        self._orders: dict[int, list[int]] = {}

    def total_steps(self, max_steps: int, epochs: float) -> int:
        return max_steps if max_steps > 0 else max(1, math.ceil(epochs * self.steps_per_epoch))

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.num_rows))
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: plans are walked forward
        return self._orders[epoch]

    def micro_batches(self, step: int) -> list[list[int]]:
        """Row indices of each micro-batch of optimizer step `step` (0-based)."""
        out = []
        for k in range(self.grad_accum):
            mb = step * self.grad_accum + k
            epoch, idx = divmod(mb, self.mb_per_epoch)
            order = self._order(epoch)
            rows = order[idx * self.rows_per_mb : (idx + 1) * self.rows_per_mb]
            out.append(rows)
        return out

    def epoch_at(self, step: int) -> float:
        return step / self.steps_per_epoch
