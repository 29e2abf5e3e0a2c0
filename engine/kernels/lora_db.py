"""LoRA's B gradient, dB = s dy^T xa, as a token-split reduction that reads dy once at full bandwidth.

dB is [out, r]: a GEMM of depth tokens (16,384 in the workloads) and width r (16), so it does almost
no arithmetic and is bound by reading dy, the projection's output gradient ([tokens, out], the
largest tensor a LoRA backward reads). cuBLAS runs such a tall, thin product with few programs
per output tile; here the tokens are cut into splits, every (out block, split) program reduces its
rows of dy^T xa in fp32 on the tensor cores, and the splits' partial sums are added in a fixed order
afterwards (no atomics: the result is the same on every run).

    dB[n, j] = s * sum_t dy[t, n] * xa[t, j]

dy and xa may be column slices of wider buffers (side-by-side gradients, a group's stacked xa): any
row stride is taken, the columns must be unit-strided.

Public: `lora_db` (Triton on CUDA, the reference elsewhere), `lora_db_triton` (any device; the CPU
needs TRITON_INTERPRET=1, for tests) and `lora_db_reference` (the torch GEMM it replaces).
"""

from __future__ import annotations

import torch

from engine.counters import count
from engine.kernels._common import jit, next_pow2, on_cuda, tl, triton

# Tile of one program: BLOCK_N output rows of dB, BLOCK_T tokens a step of its loop.
BLOCK_N = 128
BLOCK_T = 64
# Programs to aim for: a few per SM of a large card, so every SM streams dy at once.
_TARGET_PROGRAMS = 512


@jit
def _db_kernel(
    DY,
    XA,
    PART,
    n_tokens,
    n_out,
    rank,
    tokens_per_split,
    s_dy,
    s_xa,
    s_part,
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
        dy = tl.load(DY + rows[:, None] * s_dy + n_offs[None, :], mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        xa = tl.load(XA + rows[:, None] * s_xa + r_offs[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(dy), xa)
    out = PART + split.to(tl.int64) * s_part + n_offs[:, None] * rank + r_offs[None, :]
    tl.store(out, acc * scale, mask=n_mask[:, None] & r_mask[None, :])


def _splits(n_tokens: int, n_blocks: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the card, each split a whole number of
    BLOCK_T steps."""
    steps = triton.cdiv(n_tokens, BLOCK_T)
    want = max(1, min(steps, triton.cdiv(_TARGET_PROGRAMS, n_blocks)))
    per = triton.cdiv(steps, want) * BLOCK_T
    return triton.cdiv(n_tokens, per), per


def _check(dy: torch.Tensor, xa: torch.Tensor) -> None:
    if dy.dim() != 2 or xa.dim() != 2 or dy.shape[0] != xa.shape[0]:
        raise ValueError(
            f"lora_db: dy [tokens, out] and xa [tokens, r] must share tokens, got "
            f"{tuple(dy.shape)} and {tuple(xa.shape)}"
        )


def lora_db_reference(dy: torch.Tensor, xa: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """s * dy^T xa in `dtype`, one GEMM (the scale rides on alpha; beta=0 ignores the uninitialized
    buffer), cast when `dtype` differs from the inputs'."""
    _check(dy, xa)
    out = torch.empty((dy.shape[1], xa.shape[1]), dtype=dy.dtype, device=dy.device)
    out.addmm_(dy.t(), xa, beta=0, alpha=scale)
    return out if out.dtype == dtype else out.to(dtype)


def lora_db_triton(dy: torch.Tensor, xa: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """s * dy^T xa in `dtype` through the split kernel; the fp32 partial sums are added in split order."""
    _check(dy, xa)
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    if xa.stride(1) != 1:
        xa = xa.contiguous()
    n_tokens, n_out = dy.shape
    rank = xa.shape[1]
    n_blocks = triton.cdiv(n_out, BLOCK_N)
    splits, per = _splits(max(n_tokens, 1), n_blocks)
    part = torch.empty((splits, n_out, rank), dtype=torch.float32, device=dy.device)
    if n_tokens == 0:
        part.zero_()
    else:
        _db_kernel[(n_blocks, splits)](
            dy,
            xa,
            part,
            n_tokens,
            n_out,
            rank,
            per,
            dy.stride(0),
            xa.stride(0),
            part.stride(0),
            float(scale),
            BLOCK_N=BLOCK_N,
            BLOCK_T=BLOCK_T,
            BLOCK_R=max(16, next_pow2(rank)),
            num_warps=4,
            num_stages=3,
        )
    out = part[0] if splits == 1 else part.sum(0)
    return out if out.dtype == dtype else out.to(dtype)


def lora_db(dy: torch.Tensor, xa: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dB = s dy^T xa in `dtype`: the split kernel on CUDA (counted lora_db:triton), the GEMM elsewhere."""
    if on_cuda(dy, xa) and dy.dtype in (torch.float16, torch.bfloat16) and xa.dtype == dy.dtype:
        count("lora_db:triton")
        return lora_db_triton(dy, xa, scale, dtype)
    return lora_db_reference(dy, xa, scale, dtype)
