"""More than one process, one run: torch.distributed under torchrun, DDP over the adapters.

`DistContext.from_env()` reads what ``torchrun`` (or ``accelerate launch``) sets (RANK,
WORLD_SIZE, LOCAL_RANK); with one process every method is a no-op, so the session calls them
unconditionally. With several:

- each rank loads the same model and data (deterministic), and trains on its share of every
  optimizer step: the step's micro-batches (the single-process step plan, from the seed) are
  dealt round-robin, micro-batch k to rank k mod world. The global batch is the config's
  ``rows_per_micro_batch x grad_accum``, so a run on 1, 2 or 4 processes takes the same steps on
  the same rows, and a checkpoint of one resumes exactly on another.
- the loss is normalised by the trained tokens of the whole step (every rank computes it, they
  all have the plan), and DDP all-reduces only the adapter gradients (the frozen base is
  ignored), bucketed and overlapped with backward; `no_sync` skips the all-reduce for all but
  each rank's last micro-batch. DDP averages, so each rank's loss is scaled by the world size:
  the sum of the ranks' gradients is then exactly the single-process gradient.
- rank 0 alone writes the run folder (metrics, log, checkpoints, adapter) and emits events;
  every rank restores from the same checkpoint.
- pause and stop reach rank 0 (signals, the window's control file) and are agreed on by all
  ranks once per step (one small all-reduce), so no rank waits in a collective the others left.

`launch_command` builds the ``torchrun`` command line that `tunesmith train --gpus N` and the
window run; nothing here starts processes or talks to the network itself.
"""

from __future__ import annotations

import datetime
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

from engine.runs import CONTROL

# The control file the window writes into the run folder (its name is engine.runs').
CONTROL_FILE = CONTROL


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env=None) -> "DistContext":
        env = os.environ if env is None else env
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError:
            return cls()
        return cls(rank, world, local) if world > 1 else cls()

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- setting up ---------------------------------------------------------------------------
    def device(self, requested: str) -> str:
        """The device this rank trains on: its own GPU under torchrun, else what was asked."""
        if self.enabled and requested.startswith("cuda"):
            return f"cuda:{self.local_rank}"
        return requested

    def init(self, device) -> None:
        """Join the process group (NCCL on GPUs, gloo on CPUs); idempotent."""
        if not self.enabled:
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        # A paused run holds the other ranks in their next collective: allow long pauses.
        timeout = datetime.timedelta(days=7)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)

    def check_plan(self, grad_accum: int) -> Optional[str]:
        """Why this step plan cannot be dealt to the ranks (None: it can)."""
        if self.enabled and grad_accum % self.world_size:
            return (
                f"training.grad_accum ({grad_accum}) must be a multiple of the number of processes "
                f"({self.world_size}): each optimizer step's micro-batches are shared out among them"
            )
        return None

    def wrap(self, model, loss_fn, device):
        """A DDP module over `model` whose forward(batch, normalizer) is `loss_fn(model, batch,
        normalizer)`; only the parameters that require grad are synchronised. None with one
        process (the session then calls loss_fn directly)."""
        if not self.enabled:
            return None
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        class _Loss(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, batch, normalizer):
                return loss_fn(self.inner, batch, normalizer)

        module = _Loss(model)
        frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
        frozen += [name for name, _ in module.named_buffers()]
        # The frozen base is loaded identically on every rank; DDP leaves it alone.
        DDP._set_params_and_buffers_to_ignore_for_model(module, frozen)
        ids = [device.index] if device.type == "cuda" else None
        return DDP(module, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)

    # -- each step ----------------------------------------------------------------------------
    def my_share(self, micro: list) -> list[tuple[int, object]]:
        """(index in the step, micro-batch) of this rank's micro-batches."""
        return [(k, mb) for k, mb in enumerate(micro) if k % self.world_size == self.rank]

    def sync_context(self, ddp, last: bool):
        """DDP's no_sync for all but this rank's last micro-batch of the step."""
        if ddp is None or last:
            return nullcontext()
        return ddp.no_sync()

    def sum(self, tensor):
        """The sum over ranks (in place, returned); the tensor itself with one process."""
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def agree(self, pause: bool, stop: bool) -> tuple[bool, bool]:
        """Rank 0's pause and stop, known to every rank (one all-reduce of two ints)."""
        if not self.enabled:
            return pause, stop
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flags = torch.tensor([int(pause), int(stop)] if self.is_main else [0, 0], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def launch_command(nproc: int, engine_args: list[str], *, python: str | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m engine <args>``:
    torchrun starts the ranks, forwards signals, and ends them all when one dies."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "engine",
        *engine_args,
    ]


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA); imports torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def read_control(path) -> Optional[str]:
    """The window's last request in a run folder's control file, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text if text in ("pause", "resume", "stop") else None


def share_from_main(ctx: DistContext, value):
    """Rank 0's `value` on every rank (a run name, ...); `value` itself with one process."""
    if not ctx.enabled:
        return value
    import torch.distributed as dist

    box = [value if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
