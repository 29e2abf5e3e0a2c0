"""[dy | dy b | 0] in one pass over dy: the left operand of a row-folded LoRA input gradient.

A LoRA projection's input gradient is dx = dy W + (dy sB) A. Folded by rows (engine.fastpath.lora_fold,
`RowFold`) it is one GEMM, dx = [dy | dy sB] [W; A], whose left operand is dy with its rank product
dy sB in `width` more columns (the rank rounded up to 8, the alignment columns zero). Made with torch
that is a copy of dy into the wide buffer and a GEMM of depth `out` that reads dy again; here each
program copies a block of dy's rows a column block at a time and multiplies the same tiles by b on
the tensor cores as it goes, so dy is read once. fp32 sums, rounded once to dy's dtype, as cuBLAS
rounds its output.

Public: `wide_rows` (the kernel on CUDA in 16-bit with ranks up to MAX_RANK, the reference otherwise),
`wide_rows_triton` (any device; the CPU needs TRITON_INTERPRET=1, for tests) and `wide_rows_reference`.
"""

from __future__ import annotations

import torch

from engine.counters import count
from engine.kernels._common import jit, next_pow2, on_cuda, tl, triton, triton_runs_on

# A program's tile: BLOCK_T rows of dy, BLOCK_K columns a step. 64 x 128 in 16-bit is 16 KiB of dy a
# step; W1's 16,384 rows make 256 programs.
BLOCK_T = 64
BLOCK_K = 128
# The widest b (LoRA's rank, with its alignment columns) the kernel takes: [BLOCK_T, width] fp32 sums.
MAX_RANK = 64


@jit
def _wide_rows_kernel(
    DY,
    B,
    WIDE,
    n_rows,
    n_cols,
    rank,
    width,
    s_dy,
    s_b,
    s_wide,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    r64 = rows.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < n_cols
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(DY + r64[:, None] * s_dy + cols[None, :], mask=ok, other=0.0)
        tl.store(WIDE + r64[:, None] * s_wide + cols[None, :], x, mask=ok)
        b_ok = col_ok[:, None] & (offs_r[None, :] < rank)
        b = tl.load(B + cols[:, None] * s_b + offs_r[None, :], mask=b_ok, other=0.0)
        acc = tl.dot(x, b, acc, input_precision=DOT_PREC)
    # Columns past the rank hold zeros (b was masked there): the alignment columns come out zero.
    tail = WIDE + r64[:, None] * s_wide + n_cols + offs_r[None, :]
    tl.store(tail, acc.to(WIDE.dtype.element_ty), mask=row_ok[:, None] & (offs_r[None, :] < width))


def _check(dy: torch.Tensor, b: torch.Tensor, width: int) -> None:
    if dy.dim() != 2 or b.dim() != 2 or b.shape[0] != dy.shape[1]:
        shapes = f"{tuple(dy.shape)} and {tuple(b.shape)}"
        raise ValueError(f"wide_rows: dy [rows, out] and b [out, r] must share out, got {shapes}")
    if width < b.shape[1]:
        raise ValueError(f"wide_rows: width {width} is narrower than the rank {b.shape[1]}")


def wide_rows_reference(dy: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """[dy | dy b | 0] ([rows, out + width]) with torch: a copy of dy and a GEMM."""
    _check(dy, b, width)
    n, out = dy.shape
    wide = torch.empty((n, out + width), dtype=dy.dtype, device=dy.device)
    wide[:, :out].copy_(dy)
    r = b.shape[1]
    wide[:, out : out + r].copy_(torch.mm(dy, b))
    if r < width:
        wide[:, out + r :].zero_()
    return wide


def wide_rows_triton(dy: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """[dy | dy b | 0] through the kernel (any device; the CPU needs TRITON_INTERPRET=1)."""
    _check(dy, b, width)
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    n, out = dy.shape
    wide = torch.empty((n, out + width), dtype=dy.dtype, device=dy.device)
    if n == 0:
        return wide
    _wide_rows_kernel[(triton.cdiv(n, BLOCK_T),)](
        dy,
        b,
        wide,
        n,
        out,
        b.shape[1],
        width,
        dy.stride(0),
        b.stride(0),
        wide.stride(0),
        BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K,
        BLOCK_R=max(16, next_pow2(width)),
        DOT_PREC="ieee" if dy.dtype == torch.float32 else None,
        num_warps=4,
    )
    return wide


def wide_rows(dy: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """[dy | dy b | 0] ([rows, out + width], dy's dtype): the kernel on CUDA in 16-bit (counted
    wide_rows:triton), the reference elsewhere."""
    takes = (
        on_cuda(dy, b)
        and dy.dtype in (torch.float16, torch.bfloat16)
        and b.dtype == dy.dtype
        and width <= MAX_RANK
        and triton_runs_on(dy.device)
    )
    if takes:
        count("wide_rows:triton")
        return wide_rows_triton(dy, b, width)
    return wide_rows_reference(dy, b, width)
