"""The NaN/spike guard: in-memory snapshots of the trained state, and the rollback to the last
good one when a step's loss is NaN/inf or spikes.

A loss above `training.spike_factor` x the median of recent good losses (after warm-up) is a
spike, for objectives whose loss measures progress (`Objective.loss_is_progress`; not GRPO's).
The run goes back to the last good snapshot (adapters, optimizer, schedule, RNG; taken every
SNAPSHOT_EVERY steps into host memory, and trusted once the step after it had a good loss) with
the learning rate halved (RolledBack); a second time the run stops (TrainingDiverged) with the
last good state saved. The check reads the loss already fetched for the metrics: no new sync.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

from engine.counters import reset_counters
from engine.events import RolledBack
from engine.train.step_runner import rng_state, set_rng_state

# Steps between the in-memory snapshots a NaN or a loss spike rolls back to.
SNAPSHOT_EVERY = 10
# Recent good losses the spike check takes the median of, and how many it needs first.
SPIKE_WINDOW = 20
SPIKE_MIN_HISTORY = 5


class TrainingDiverged(RuntimeError):
    """The loss went bad again after a rollback had halved the learning rate."""


class LossGuard:
    """Snapshots and rollbacks over the trained `params`, `optimizer` and `scheduler`.

    `fsdp`: each rank keeps its own shards. `emit`, `log`: the session's reporter.
    `rollbacks` is kept in checkpoints, so a resumed run remembers it already halved the LR.
    `check_spikes`: the objective's `loss_is_progress`; False leaves only the NaN/inf check (a
    loss whose value is not a measure of progress, like GRPO's, has no spikes to catch)."""

    def __init__(
        self,
        params,
        optimizer,
        scheduler,
        training,
        device,
        fsdp: bool,
        emit: Callable,
        log: Callable,
        check_spikes: bool = True,
    ):
        self.params, self.optimizer, self.scheduler = params, optimizer, scheduler
        self.spike_factor = training.spike_factor if check_spikes else 0.0
        self.warmup_steps = training.warmup_steps
        self.device, self.is_cuda, self.fsdp = device, device.type == "cuda", fsdp
        self._emit, self._log = emit, log
        self.rollbacks = 0
        self.history: list[tuple[int, float]] = []  # (step, loss) of good steps, for the spike check
        self.good: Optional[dict] = None  # the snapshot a rollback goes back to
        self.pending: Optional[dict] = None  # taken, not yet trusted
        self._spare: Optional[dict] = None  # a released snapshot whose host buffers the next one reuses

    # -- snapshots ----------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Where the run starts is good by definition."""
        self.good = self.take_snapshot(step)

    def before_step(self, step: int, start_step: int) -> None:
        """A snapshot every SNAPSHOT_EVERY steps from the start (`step` 0-based, before it runs)."""
        if step > start_step and (step - start_step) % SNAPSHOT_EVERY == 0:
            self.pending = self.take_snapshot(step)

    def take_snapshot(self, step: int) -> dict:
        """The adapters, optimizer and schedule state and RNG at `step`, in host memory (pinned
        on CUDA; the copies are queued, not waited for). Reuses a released snapshot's buffers."""
        spare, self._spare = self._spare or {}, None
        params, optimizer = [p.detach() for p in self.params], self.optimizer.state_dict()
        if self.fsdp:  # each rank keeps its own shards
            from engine.train import fsdp

            params, optimizer = fsdp.local_tree(params), fsdp.local_tree(optimizer)
        return {
            "step": step,
            "params": copy_tree(params, spare.get("params")),
            "optimizer": copy_tree(optimizer, spare.get("optimizer")),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "rng": rng_state(),
        }

    def load_snapshot(self, snap: dict) -> None:
        import torch

        from engine.train import fsdp

        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # the snapshot's queued copies are done
        with torch.no_grad():
            for p, saved in zip(self.params, snap["params"]):
                fsdp.local(p).copy_(saved)
        # Loading the optimizer's state below advances the model's adapter generation (the hook of
        # engine.fastpath.lora_group.watch_optimizer): the fused path's cached adapter copies of
        # the weights just written go stale with it.
        # Fresh copies: on the CPU load_state_dict would keep the snapshot's tensors as the state.
        if self.fsdp:
            fsdp.restore_optimizer_local(self.optimizer, copy_tree(snap["optimizer"]))
        else:
            self.optimizer.load_state_dict(copy_tree(snap["optimizer"]))
        self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        self.optimizer.zero_grad(set_to_none=True)
        set_rng_state(snap["rng"])
        self.history = [(s, v) for s, v in self.history if s <= snap["step"]]
        self.pending = None
        reset_counters()  # the bad step's calls are not the next step's

    # -- the check ----------------------------------------------------------------------------------
    def bad_loss(self, step: int, loss: float) -> Optional[tuple[str, float, str]]:
        """(reason, loss, how it reads) when this step's loss is NaN/inf or a spike, else None."""
        if math.isnan(loss):
            return ("nan", loss, "turned NaN")
        if math.isinf(loss):
            return ("inf", loss, "turned infinite")
        recent = [v for _, v in self.history[-SPIKE_WINDOW:]]
        if self.spike_factor > 0 and step > self.warmup_steps and len(recent) >= SPIKE_MIN_HISTORY:
            median = sorted(recent)[len(recent) // 2]
            if loss > self.spike_factor * median:
                return (
                    "spike",
                    loss,
                    f"spiked to {loss:.4g} ({loss / median:.1f}× the median {median:.4g} of recent steps)",
                )
        return None

    def good_loss(self, step: int, loss: float) -> None:
        self.history.append((step, loss))
        del self.history[: -4 * SPIKE_WINDOW]
        # A snapshot taken before this step is trusted once the step it started had a good loss.
        if self.pending is not None and self.pending["step"] == step - 1:
            self._spare, self.good, self.pending = self.good, self.pending, None

    def roll_back(self, step: int, reason: str, loss: float, how: str, save_good: Callable[[int], str]) -> int:
        """Back to the last good snapshot with half the learning rate; returns its step. A second
        time the run stops (TrainingDiverged): `save_good(step)` saves the good state reloaded
        and returns how the message names its checkpoint ("" when none)."""
        good = self.good
        if self.rollbacks >= 1:
            self.load_snapshot(good)
            saved = save_good(good["step"])
            raise TrainingDiverged(
                f"The loss {how} at step {step}, after a rollback had already halved the learning rate; "
                f"the run stopped with the adapters of step {good['step']}{saved}. "
                "Try a lower training.lr or a longer warm-up."
            )
        self.rollbacks += 1
        lr_before = max(self.scheduler.base_lrs)
        self.load_snapshot(good)
        scheduler = self.scheduler
        scheduler.base_lrs = [lr * 0.5 for lr in scheduler.base_lrs]
        for group, base, fn in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        lr_after = max(scheduler.base_lrs)
        message = (
            f"The loss {how} at step {step}: back to the good state of step {good['step']}, learning rate "
            f"halved ({lr_before:.3g} → {lr_after:.3g}); steps {good['step'] + 1}–{step} run again."
        )
        self._log(message, "warning")
        self._emit(RolledBack(step, good["step"], reason, loss, lr_before, lr_after, message))
        return good["step"]


def copy_tree(obj, into=None):
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
        return {k: copy_tree(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(copy_tree(v, i) for v, i in zip(obj, into))
    return copy.deepcopy(obj)
