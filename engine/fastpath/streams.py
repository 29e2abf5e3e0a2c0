"""The process's side CUDA streams: one per device and role, made once and reused by every run.

torch keeps a cuBLAS workspace per (handle, stream) that has run a GEMM, counted as allocated and
never freed. On an H100 three trainings in one process ended 128, 192 and 256 MiB above where they
started (tests/gpu/test_memory_release_gpu.py, fourteenth session), 64 MiB more each run at small
shapes and at W1's alike, and the bench's W1 peak grew with each `--repeat`: the workspace of the
stream each run made for its CUDA graphs. The window trains many times in one process,
so the streams are the process's, not the run's.

Roles in use: "graphs" (engine.train.step_graph captures and replays the step on it), "offload"
(the offloader's copies to and from the host), "host_head" (the streamed output head's slices).
Everything that orders work across them is an event or `wait_stream`, so a stream shared by
successive runs carries nothing from one run into the next.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()


def side_stream(device, role: str) -> torch.cuda.Stream:
    """The process's side stream for `role` on CUDA `device`, made on first use."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, role)
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(torch.device("cuda", index))
        return stream
