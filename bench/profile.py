"""`--profile`: where a step's time goes, by op, for one implementation on one workload.

Runs two extra steps under torch.profiler after the timed ones and prints the top ops by GPU
time, plus how busy the GPU was over the step (GPU kernel time / wall time): a low figure
means the step is bound by the host (Python, launches), not by kernels.
"""

from __future__ import annotations

import time

from bench.report import progress


def profile_steps(prep, ctx, label: str, steps: int = 2, top: int = 30) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n = len(ctx.batches)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for j in range(steps):
            prep.step((ctx.warmup + j) % n)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    gpu_us = sum(getattr(e, attr, 0) for e in events) / steps if cuda else 0.0
    table = events.table(
        sort_by=sort.replace("cuda", "device") if attr.startswith("self_device") else sort,
        row_limit=top,
        max_name_column_width=60,
    )
    progress(
        f"{label} profile: wall {wall * 1e3:.1f} ms/step, GPU kernels {gpu_us / 1e3:.1f} ms/step "
        f"({100 * gpu_us / 1e3 / (wall * 1e3):.0f}% busy)\n{table}"
    )
    return {"profile_wall_ms": round(wall * 1e3, 2), "profile_gpu_ms": round(gpu_us / 1e3, 2)}
