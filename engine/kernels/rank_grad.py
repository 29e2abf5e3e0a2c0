"""LoRA's rank-wide gradients, s a^T b with b r columns wide, as a token-split reduction that reads a once.

Both adapter gradients of a LoRA projection are such a product over the tokens:

    dB   = s dy^T xa    (a = dy, the output gradient [tokens, out]; b = xa = x A^T [tokens, r])
    dA^T = x^T g        (a = x, the input [tokens, in];             b = g = dy sB  [tokens, r])

[out or in, r]: a GEMM of depth tokens (16,384 in the workloads) and width r (16), with almost no
arithmetic, bound by reading a. cuBLAS runs these tall, thin products at 73-76% of a device copy's
bandwidth on W1's 1,024-wide tensors (H100, graph-timed, `python -m bench.bandwidth`). Here the
tokens are cut into splits, about one program per SM (out block, split), each reducing its rows on
the tensor cores in fp32, and the splits' partial sums are added in a fixed order afterwards (no
atomics: the result is the same on every run): 97-102% of the copy's bandwidth there (80% against
75% at 2,048 wide). The result is fp32, so an fp32 adapter's gradient needs no cast and keeps fp32's
precision.

a and b may be column slices of wider buffers (side-by-side gradients, an input with spare columns,
a group's stacked xa): any row stride is taken; the columns must be unit-strided. A card whose shared
memory cannot hold the kernel's three pipeline stages gets fewer, found at its first launch and kept.

Public: `rank_grad` (the kernel on CUDA in 16-bit for ranks up to MAX_RANK unless
TUNESMITH_RANK_GRAD=0, bench.ours's `rank_grad=false`; the reference otherwise: see `_kernel_takes`),
`rank_grad_triton` (any device; the CPU needs TRITON_INTERPRET=1, for tests) and `rank_grad_reference`
(the cuBLAS GEMM it replaces).
"""

from __future__ import annotations

import functools
import os

import torch

from engine.counters import count
from engine.kernels._common import jit, next_pow2, on_cuda, tl, triton
from engine.kernels._common import triton_runs_on as _triton_runs_on  # the tests patch it here

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: the kernel is never launched

    class OutOfResources(Exception):
        pass


# Tile of one program: BLOCK_N output rows, BLOCK_T tokens a step of its loop. About one program per
# SM was the fastest of 1, 2 and 4 per SM, with steps of 64 tokens rather than 128 (bench.bandwidth).
BLOCK_N = 128
BLOCK_T = 64
_TARGET_PROGRAMS = None  # None: the device's SM count (bench.bandwidth sets it to time others)
# Pipeline stages fitted to a card's shared memory, {(device, BLOCK_R): stages}; 3 where nothing is said.
_STAGES: dict = {}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few splits, as on a small card
    return torch.cuda.get_device_properties(device).multi_processor_count


@jit
def _rank_grad_kernel(
    A,
    B,
    PART,
    n_tokens,
    n_out,
    rank,
    tokens_per_split,
    s_a,
    s_b,
    s_part,
    s_pn,
    s_pr,
    scale,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_offs = tl.arange(0, BLOCK_R)
    n_mask = n_offs < n_out
    r_mask = r_offs < rank
    t_lo = split * tokens_per_split
    t_hi = tl.minimum(t_lo + tokens_per_split, n_tokens)
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t_offs = t0 + tl.arange(0, BLOCK_T)
        t_mask = t_offs < t_hi
        rows = t_offs.to(tl.int64)
        a = tl.load(A + rows[:, None] * s_a + n_offs[None, :], mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        b = tl.load(B + rows[:, None] * s_b + r_offs[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(a), b)
    out = PART + split.to(tl.int64) * s_part + n_offs[:, None] * s_pn + r_offs[None, :] * s_pr
    tl.store(out, acc * scale, mask=n_mask[:, None] & r_mask[None, :])


def _splits(n_tokens: int, n_blocks: int, programs: int) -> tuple[int, int]:
    """(splits, tokens per split): about `programs` programs, each split a whole number of BLOCK_T steps."""
    steps = triton.cdiv(n_tokens, BLOCK_T)
    want = max(1, min(steps, triton.cdiv(programs, n_blocks)))
    per = triton.cdiv(steps, want) * BLOCK_T
    return triton.cdiv(n_tokens, per), per


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"rank_grad: a [tokens, n] and b [tokens, r] must share tokens, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def rank_grad_reference(a, b, scale: float, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """s * a^T b in `dtype` (s * b^T a when `transposed`), one GEMM (the scale rides on alpha; beta=0
    ignores the uninitialized buffer), cast when `dtype` differs from the inputs'."""
    _check(a, b)
    first, second = (b, a) if transposed else (a, b)
    out = torch.empty((first.shape[1], second.shape[1]), dtype=a.dtype, device=a.device)
    out.addmm_(first.t(), second, beta=0, alpha=scale)
    return out if out.dtype == dtype else out.to(dtype)


def rank_grad_triton(a, b, scale: float, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """s * a^T b in `dtype` (its transpose, contiguous, when `transposed`) through the split kernel;
    the fp32 partial sums are added in split order."""
    _check(a, b)
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    n_tokens, n_out = a.shape
    rank = b.shape[1]
    n_blocks = triton.cdiv(n_out, BLOCK_N)
    splits, per = _splits(max(n_tokens, 1), n_blocks, _TARGET_PROGRAMS or _sm_count(a.device))
    shape = (splits, rank, n_out) if transposed else (splits, n_out, rank)
    part = torch.empty(shape, dtype=torch.float32, device=a.device)
    s_pn, s_pr = (1, n_out) if transposed else (rank, 1)
    if n_tokens == 0:
        part.zero_()
    else:
        args = (a, b, part, n_tokens, n_out, rank, per, a.stride(0), b.stride(0), part.stride(0), s_pn, s_pr)
        block_r = max(16, next_pow2(rank))
        while True:
            stages = _STAGES.get((a.device, block_r), 3)
            try:
                _rank_grad_kernel[(n_blocks, splits)](
                    *args,
                    float(scale),
                    BLOCK_N=BLOCK_N,
                    BLOCK_T=BLOCK_T,
                    BLOCK_R=block_r,
                    num_warps=4,
                    num_stages=stages,
                )
                break
            except OutOfResources:  # raised when the kernel is loaded, before anything runs
                if stages == 1:
                    raise
                # A card with less shared memory than Hopper's (a Turing card's 64 KiB): fewer stages, kept
                # for the process so a step graph's capture launches the fitted one with no retry.
                _STAGES[(a.device, block_r)] = stages - 1
    out = part[0] if splits == 1 else part.sum(0)
    return out if out.dtype == dtype else out.to(dtype)


# The widest b the kernel takes (LoRA's rank). Its tiles grow with the rank ([BLOCK_N, rank] of fp32 sums,
# [BLOCK_T, rank] of b each stage): up to 32 the sums take at most 32 registers a thread (a card short of
# shared memory gets fewer stages, above), and the speed was measured at 16. Wider ranks are less bound
# by reading a: cuBLAS takes them.
MAX_RANK = 32


def _kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        on_cuda(a, b)
        and a.dtype in (torch.float16, torch.bfloat16)
        and b.dtype == a.dtype
        and b.shape[-1] <= MAX_RANK
        and _enabled()
        and _triton_runs_on(a.device)
    )


def _enabled() -> bool:
    """On unless TUNESMITH_RANK_GRAD=0 (bench.ours's `rank_grad=false`, the cuBLAS before), read at each
    call so one process can time both ways. On the GPU (H100, W1, run 20261207T005208-844) a bf16 run
    with it followed the cuBLAS run's loss within 2e-5 nats at each of 11 steps, across a 1.26-nat fall:
    every LoRA site's dB and dA went through it (widths 1,024 to 6,144). Its own test at real shapes
    against the fp64 product (tests/gpu/test_kernels_gpu.py::test_rank_grad_at_real_shapes) is still to
    run: its first run called cuBLAS by mistake. The interpreter checks fp32 and fp16, not bf16 dots."""
    return os.environ.get("TUNESMITH_RANK_GRAD", "1") != "0"


def rank_grad(a, b, scale: float, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
    """s a^T b ([n, r]; [r, n] when `transposed`) in `dtype`: the split kernel on CUDA in 16-bit
    (counted rank_grad:triton), the GEMM elsewhere."""
    if _kernel_takes(a, b):
        count("rank_grad:triton")
        return rank_grad_triton(a, b, scale, dtype, transposed)
    return rank_grad_reference(a, b, scale, dtype, transposed)
