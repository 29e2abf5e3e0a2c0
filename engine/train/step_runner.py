"""One optimizer step's forwards and backwards: the step's rows as batches (the objective
collates them), this rank's share through DDP or FSDP, the summed loss and metrics, and the
retry after running out of memory (engine.train.recovery lowers a setting, the step runs again
from its start with the same RNG state). The pre-flight's rehearsal and the eval run their
forwards through here too, so every forward of a run is the same code.
"""

from __future__ import annotations

import random
from typing import Optional

from engine.counters import reset_counters
from engine.train.objectives.base import StepContext
from engine.train.recovery import is_oom


class StepRunner:
    """`model`: the PEFT model; `ddp`: what a training forward runs through (DDP, the FSDP2
    root, or None with one process); `memory`: the MemorySettings (rows per forward) recovery
    changes; `faults`: the test seam (engine.train.faults) or None."""

    def __init__(
        self,
        objective,
        forward,
        model,
        ddp,
        fsdp: bool,
        dist,
        device,
        data,
        plan,
        memory,
        optimizer,
        tokenizer,
        faults=None,
        graphs=None,
    ):
        self.objective, self.forward, self.model, self.ddp, self.fsdp = objective, forward, model, ddp, fsdp
        self.dist, self.device, self.data, self.plan, self.memory = dist, device, data, plan, memory
        self.optimizer, self.tokenizer, self.faults = optimizer, tokenizer, faults
        self.graphs = graphs  # engine.train.step_graph.StepGraphs, or None: every forward eager
        self.is_cuda = device.type == "cuda"

    # -- batches -----------------------------------------------------------------------------------
    def batch(self, row_ids: list[int]):
        rows = self.data.packing.rows
        return self.objective.collate(self.data, [d for r in row_ids for d in rows[r]])

    def row_tokens(self) -> list[int]:
        """Tokens of each packed row."""
        sizes = self.objective.example_tokens(self.data)
        return [sum(sizes[d] for d in row) for row in self.data.packing.rows]

    def step_tokens(self) -> float:
        """Tokens of an average optimizer step (the eval schedule's and the pre-flight's ETA)."""
        sizes = self.row_tokens()
        return sum(sizes) / max(1, len(sizes)) * self.plan.rows_per_mb * self.plan.grad_accum

    def micro_batches(self, step: int) -> list:
        """[(rows, batch)] of the forwards of optimizer step `step` (0-based): the plan's
        micro-batches, each split into forwards of at most `memory.rows` rows."""
        e, per_mb = self.memory.rows, self.plan.rows_per_mb
        planned = self.plan.micro_batches(step)
        if e > per_mb:  # the pre-flight found room: the step's rows, e to a forward
            planned = [[r for mb in planned for r in mb]]
        return [
            (len(row_ids[i : i + e]), self.batch(row_ids[i : i + e]))
            for row_ids in planned
            for i in range(0, max(1, len(row_ids)), e)
        ]

    def context(self, step: int, rehearsal: bool = False) -> StepContext:
        sharded = self.ddp if self.fsdp else None  # the FSDP2 root: generation gathers its weights
        return StepContext(self.model, self.device, self.tokenizer, self.forward, step, rehearsal, sharded)

    # -- forwards and backwards ------------------------------------------------------------------
    def loss(self, model, batch, normalizer):
        """One forward's LossOutput: the objective's loss through the run's forward (also what
        DDP's and FSDP's module runs)."""
        return self.objective.loss(self.forward, model, batch, normalizer)

    def forward_backward(self, micro: list, normalizer: int, step: int, rehearsal: bool = False):
        """Forward and backward over [(rows, batch)]; (the summed loss, the summed objective
        metrics), device tensors. `step`: the 1-based step it belongs to (for Faults)."""
        import torch

        device, faults, dist = self.device, self.faults, self.dist
        loss_sum = torch.zeros((), device=device)
        sums: dict = {}
        # Several processes: this rank's share of the step's forwards, through DDP (the
        # rehearsal measures one rank's forward alone, with no gradient exchange).
        ddp = None if rehearsal else self.ddp
        mine = micro if ddp is None else [mb for k, mb in enumerate(micro) if k % dist.world_size == dist.rank]
        scale = dist.world_size if ddp is not None else 1  # DDP averages; the step wants the sum
        # CUDA graphs replay training micro-batches; the rehearsal measures the eager step's peak,
        # and the fault seam's poisoned losses need the eager backward.
        graphs = self.graphs if ddp is None and not rehearsal and faults is None else None
        for i, (rows, batch) in enumerate(mine):
            last = i == len(mine) - 1
            if faults is not None:
                faults.check_oom(self.memory.attempt(step, rows, rehearsal), last_micro_batch=last)
            if graphs is not None:  # SFT only (engine.train.step_graph.graph_choice): no metrics
                loss_sum += graphs.forward_backward(batch, normalizer)
                continue
            batch = batch.to(device)
            with self._sync_context(ddp, last):
                out = ddp(batch, normalizer) if ddp is not None else self.loss(self.model, batch, normalizer)
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
        if ddp is not None and self.fsdp:
            from engine.train import fsdp

            return fsdp.sync_context(ddp, last)
        return self.dist.sync_context(ddp, last)

    def run(self, step: int):
        """The forwards and backwards of optimizer step `step` (0-based); on running out of
        memory, its partial gradients are dropped, one setting is lowered (MemoryAdjusted) and
        the step runs again from its start with the same RNG state. (micro-batches, normalizer,
        summed loss, summed metrics)."""
        rng = rng_state()
        while True:
            micro = self.objective.prepare_step(self.context(step + 1), self.micro_batches(step))
            normalizer = self.objective.normalizer([b for _, b in micro])
            try:
                return micro, normalizer, *self.forward_backward(micro, normalizer, step + 1)
            except Exception as exc:
                # Several processes: the others wait in the step's all-reduce, so a rank that
                # runs out of memory ends the run (torchrun stops them all; the checkpoint stays).
                change = self.memory.next_change() if is_oom(exc) and not self.dist.enabled else None
                if change is None:
                    raise
            # Out of the except block: the traceback, and the activations its frames hold, are gone.
            del micro
            self.drop_partial_step()
            set_rng_state(rng)
            self.memory.apply(change, "step", step + 1, f"step {step + 1} ran out of memory; it runs again")

    def drop_partial_step(self) -> None:
        import gc

        import torch

        self.optimizer.zero_grad(set_to_none=True)
        if self.graphs is not None:  # a memory setting changes: graphs are captured again under it
            self.graphs.reset()
        reset_counters()  # the failed attempt's calls are not the step's
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


def rng_state() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The current device's generator: a host-side copy of its seed and offset, no sync.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Optional[dict]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
