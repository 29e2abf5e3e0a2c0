"""`--profile`: where a step's time goes, by op, and how many kernels a step launches.

After the timed steps, two more steps are timed plainly (no profiler: its own overhead would be
counted as host time), then two more run under torch.profiler, one profiler session per step:

- ``host_cpu_ms``: the process's CPU time per plain step (time.process_time: Python, dispatch,
  launches, on every thread, the autograd engine's included; on CUDA also any spinning in a sync
  the step makes), beside ``step_wall_ms``, the same steps' wall time between device syncs. A
  host-bound step has host_cpu_ms close to step_wall_ms.
- ``kernel_launches``: device kernels each profiled step ran (CUDA kernel events of the profiler:
  every kernel whether launched by cuBLAS, torch or Triton; memcpy and memset not counted), and
  ``launch_calls``, the host's launch API calls seen (cudaLaunchKernel and friends, cuLaunchKernel
  for Triton), per step. Both lists are empty on a CPU, where nothing is launched. Kernels a CUDA
  graph replays are device kernels but no launch call; ``graph_launches`` counts the replays
  (cudaGraphLaunch) per step.
- ``profile_wall_ms`` / ``profile_gpu_ms``: wall and GPU-kernel time per profiled step; their ratio
  is how busy the GPU was (a low figure: bound by the host, not by kernels). The top ops by GPU
  time (CPU time on a CPU) of the last profiled step are printed.

`--ours-variants all-on,add_rmsnorm=false` then shows a lever's launches and host time before
and after in one run.

`--profile-stacks` records shapes and Python stacks in the profiled steps and also prints the torch
ops other than the matmuls by GPU time, one row per op, input shapes and stack: which line of ours
launched a copy or elementwise kernel. An op run by a backward node is shown as "backward of <node>"
with the frames of the forward op that node differentiates. A CUDA graph replay hides its ops, so
attribute with `--ours-variants cuda_graphs=false`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.report import progress

# Host-side names of a kernel launch in the profiler (runtime and driver API; Triton uses the driver).
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)


def is_kernel(event) -> bool:
    """Whether a profiler event is a device kernel (not a memcpy or memset)."""
    from torch.autograd import DeviceType

    if getattr(event, "device_type", None) != DeviceType.CUDA:
        return False
    return not event.name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def launch_counts(events) -> tuple[int, int, int]:
    """(device kernels, host launch calls, CUDA graph replays) among one step's profiler events."""
    kernels = sum(1 for e in events if is_kernel(e))
    calls = sum(1 for e in events if e.name in LAUNCH_CALLS)
    graphs = sum(1 for e in events if e.name == "cudaGraphLaunch")
    return kernels, calls, graphs


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def profile_steps(prep, ctx, label: str, steps: int = 2, top: int = 30, stacks: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n = len(ctx.batches)
    attr = None

    host_ms, wall_ms = [], []
    for j in range(steps):
        _sync(cuda)
        t0, c0 = time.perf_counter(), time.process_time()
        prep.step((ctx.warmup + j) % n)
        c1 = time.process_time()
        _sync(cuda)
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        host_ms.append((c1 - c0) * 1e3)

    kernels, calls, graphs, prof_wall, gpu_us, tables = [], [], [], [], [], []
    for j in range(steps):
        _sync(cuda)
        t0 = time.perf_counter()
        with profile(activities=activities, record_shapes=stacks, with_stack=stacks) as prof:
            prep.step((ctx.warmup + steps + j) % n)
            _sync(cuda)
        prof_wall.append(time.perf_counter() - t0)
        if cuda:
            k, c, g = launch_counts(prof.events())
            kernels.append(k)
            calls.append(c)
            graphs.append(g)
        events = prof.key_averages()
        if attr is None:
            attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        gpu_us.append(sum(getattr(e, attr, 0) for e in events) if cuda else 0.0)
        sort = attr if cuda else "self_cpu_time_total"
        tables.append(events.table(sort_by=sort, row_limit=top, max_name_column_width=60))
        if stacks and j == steps - 1:
            tables[-1] += "\n" + _stack_table(prof, cuda, top)

    wall = statistics.fmean(prof_wall)
    gpu = statistics.fmean(gpu_us)
    progress(
        f"{label} profile: wall {wall * 1e3:.1f} ms/step, GPU kernels {gpu / 1e3:.1f} ms/step "
        f"({100 * gpu / 1e3 / (wall * 1e3):.0f}% busy); kernels launched per step {kernels}, "
        f"launch calls {calls}, graph replays {graphs}; "
        f"unprofiled steps: host CPU {[round(h, 1) for h in host_ms]} ms, "
        f"wall {[round(w, 1) for w in wall_ms]} ms\n{tables[-1]}"
    )
    return {
        "profile_wall_ms": round(wall * 1e3, 2),
        "profile_gpu_ms": round(gpu / 1e3, 2),
        "kernel_launches": kernels,
        "launch_calls": calls,
        "graph_launches": graphs,
        "host_cpu_ms": [round(h, 2) for h in host_ms],
        "step_wall_ms": [round(w, 2) for w in wall_ms],
    }


# Ops whose GPU time is a matmul's (cuBLAS): the by-stack table leaves them out, so what remains is
# the glue between the matmuls.
_MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "aten::_grouped_mm",
)


def _python_frames(event, limit: int = 6) -> tuple[str, ...]:
    """The Python frames above a profiler event (its parents that the Python tracer recorded),
    innermost first, leaving out torch's own files and built-ins."""
    frames = []
    p = event.cpu_parent
    while p is not None and len(frames) < limit:
        name = p.name
        if ".py(" in name and "torch/" not in name.split(".py(")[0]:
            frames.append(name)
        p = p.cpu_parent
    return tuple(frames)


# The profiler's event for an autograd node's backward; its sequence_nr is the one its forward op
# (or custom Function) was recorded with on the forward's thread (fwd_thread).
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _forward_ops(events) -> dict[tuple[int, int], Any]:
    """{(thread, sequence_nr): the outermost forward event recorded with it}."""
    forward: dict[tuple[int, int], Any] = {}
    for e in events:
        if e.sequence_nr < 0 or e.name.startswith(_BACKWARD_NODE):
            continue
        key = (e.thread, e.sequence_nr)
        if key not in forward or e.time_range.start < forward[key].time_range.start:
            forward[key] = e
    return forward


def _frames(event, forward: dict, limit: int = 6) -> tuple[str, ...]:
    """Where an op came from: for an op a backward node ran, the node's name and the Python frames of
    the forward op it differentiates (on a GPU the backward runs on the autograd engine's own thread,
    which has no Python frames); else the frames above the op."""
    p = event.cpu_parent
    while p is not None and not p.name.startswith(_BACKWARD_NODE):
        p = p.cpu_parent
    if p is None:
        return _python_frames(event, limit)
    origin = forward.get((p.fwd_thread, p.sequence_nr))
    return (f"backward of {p.name.removeprefix(_BACKWARD_NODE)}",) + (
        _python_frames(origin, limit - 1) if origin is not None else ()
    )


def _stack_table(prof, cuda: bool, top: int) -> str:
    """Torch ops other than the matmuls, outermost aten op of each call, grouped by (op, input
    shapes, Python stack), by GPU time (CPU time on a CPU): one line per group with its count,
    then its frames."""
    groups: dict[tuple, list] = {}
    events = prof.events()
    forward = _forward_ops(events)
    for e in events:
        if not e.name.startswith("aten::") or e.name in _MATMUL_OPS:
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # a nested op: its time is in the op that called it
        frames = _frames(e, forward) or ("(no Python frame: C++ only)",)
        t = e.device_time_total if cuda else e.cpu_time_total
        key = (e.name, str(e.input_shapes), frames)
        slot = groups.setdefault(key, [0.0, 0])
        slot[0] += t
        slot[1] += 1
    rows = sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    lines = [f"torch ops outside the matmuls by {'GPU' if cuda else 'CPU'} time, with stacks (top {top}):"]
    for (name, shapes, frames), (t, n) in rows:
        lines.append(f"{t / 1e3:9.3f} ms  x{n:<5} {name}  shapes {shapes}")
        lines.extend(f"              {frame}" for frame in frames)
    return "\n".join(lines)
