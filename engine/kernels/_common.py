"""Helpers shared by the Triton kernel files: dispatch between kernel and reference, block and
warp sizing, and small Triton math functions the language lacks (tanh).

Kept free of any op so every kernel file can import it without cycles.

Triton is optional at import time: where it is missing (torch wheels for macOS come without it)
`triton` and `tl` are None, `jit` leaves functions undecorated, and a kernel file still imports,
so its torch reference (what the dispatchers run off CUDA, and what the fallback paths of
engine.fastpath and engine.models use) keeps working. Its kernels are never launched there.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux and Windows
    triton = tl = None

TRITON_AVAILABLE = triton is not None


def jit(fn):
    """`triton.jit`, or `fn` unchanged where Triton is missing (then nothing launches it)."""
    return fn if triton is None else triton.jit(fn)


def on_cuda(*tensors: torch.Tensor | None) -> bool:
    """The dispatch rule: the Triton path runs only when every tensor given lives on CUDA."""
    present = [t for t in tensors if t is not None]
    return bool(present) and all(t.is_cuda for t in present)


@functools.lru_cache(maxsize=None)
def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can launch on this CUDA device. Triton compiles for Turing (sm_75) and
    newer (engine.hardware.profile.MIN_FAST_PATH_CAPABILITY); the LoRA Functions run wherever
    lora_autograd is on, which a user may force on an older card or without Triton: there the
    dispatchers that ask this run their torch references."""
    return TRITON_AVAILABLE and torch.cuda.get_device_capability(device) >= (7, 5)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def warps_for(elements_per_program: int) -> int:
    """Warps for a memory-bound program that touches `elements_per_program` values per pass.

    About 8-16 values per thread keeps loads vectorized (128-bit) without spilling registers.
    """
    if elements_per_program >= 16384:
        return 16
    if elements_per_program >= 4096:
        return 8
    if elements_per_program >= 1024:
        return 4
    return 2


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View `x` as [rows, last dim] with a unit last stride, copying only when unavoidable."""
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[-1]
    try:
        return x.view(-1, n)
    except RuntimeError:  # leading dims cannot be merged without a copy
        return x.reshape(-1, n)


@jit
def tanh_f32(x):
    # tl.math has no tanh in every Triton version we support (3.x); this form never overflows:
    # e = exp(-2|x|) lies in (0, 1], and the sign is restored afterwards. Its absolute error is a
    # few fp32 ulps of 1, which is what softcapping and tanh-GELU consume.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)
