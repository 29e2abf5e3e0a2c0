"""Helpers the kernel GPU tests share: a CUDA-event timing of a callable and a relative error."""

import torch


def cuda_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Mean milliseconds of `fn()` over `iters` calls after `warmup`, by CUDA events (printed by the
    tests beside their checks, never asserted)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
