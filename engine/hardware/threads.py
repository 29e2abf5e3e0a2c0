"""How many threads torch's CPU operators get for one run: a per-run decision made where a run
starts (the CLI's train command, the window's worker), never at import.

torch sizes its pool to the machine's cores and its OpenMP threads spin at every operator's
barrier. When another process holds a core, one thread is descheduled and the others spin on it:
the demo went from 0.3 s a step to 10–54 s at load average 4–10 (issue 28, item 9). So a CPU run
takes the cores this process may use (os.sched_getaffinity: a container or `taskset` limit, not
the host's count), shared among the local ranks under torchrun, less one left for the window's
thread and the data loading, and never fewer than one. OMP_NUM_THREADS, when set, is the person's
own choice and is kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def choose_cpu_threads(cores: int, local_ranks: int = 1, env_threads: str | None = None) -> ThreadChoice:
    if env_threads:
        try:
            n = int(env_threads)
        except ValueError:
            n = 0
        if n > 0:
            return ThreadChoice(n, f"OMP_NUM_THREADS={n} (set in the environment)")
    share = max(1, cores // max(1, local_ranks))
    # One core stays free for the window and the data pipeline; a lone core is used as it is.
    n = max(1, share - 1) if share > 1 else 1
    where = f"{cores} usable cores" + (f" shared by {local_ranks} processes" if local_ranks > 1 else "")
    return ThreadChoice(n, f"{n} CPU thread{'s' if n != 1 else ''} ({where}, one left for the rest)")


def apply_cpu_threads(device: str) -> ThreadChoice | None:
    """Size torch's intra-op pool for a run on `device` ("cpu", "cuda" or "auto"); None when the
    run uses a GPU (its host side keeps torch's default). Imports torch."""
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    choice = choose_cpu_threads(usable_cores(), local, os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(choice.threads)
    return choice
