"""RMSNorm as one Triton kernel each way, for Llama / Qwen / Mistral (weight) and Gemma (1 + weight).

    y = x / sqrt(mean(x^2) + eps) * (offset + weight)      computed in fp32, cast to x.dtype

The forward keeps one fp32 reciprocal-rms per row for the backward, which recomputes x_hat from
x instead of storing it. dW is only reduced when the weight requires grad (it is frozen under
LoRA, so the usual backward is a single pass producing dX).

Public: `rms_norm` (dispatcher), `rms_norm_triton`, `rms_norm_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.counters import count
from engine.kernels._common import as_rows, next_pow2, on_cuda, warps_for

# Rows a program handles together when a row is short (Qwen3's q/k norm runs over head_dim=128):
# about this many elements per program keeps loads wide and the grid reasonable.
_ELEMS_PER_PROGRAM = 4096


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    n_rows,
    n_cols,
    stride_x,
    stride_y,
    eps,
    offset,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    n_rows,
    n_cols,
    stride_dy,
    stride_x,
    stride_dx,
    offset,
    rows_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    # Each program walks a contiguous range of rows, so the dW partial sums stay in registers
    # and only one [n_programs, n_cols] fp32 partial buffer is written.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    dw_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        # d/dx of x*r with r = (mean(x^2)+eps)^-1/2:  r * (g - x_hat * mean(g * x_hat))
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * x_hat
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_c = next_pow2(n_cols)
    block_r = max(1, min(_ELEMS_PER_PROGRAM // block_c, next_pow2(n_rows)))
    return block_r, block_c


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}"
        )


def spare_empty(shape, spare: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor of `shape` whose rows have `spare` free columns after them in memory
    (a view of a wider buffer); `shape` itself when spare is 0. A norm's output made this way lets
    its consumer (engine.fastpath.lora_fold) put a row's LoRA product beside it without a copy."""
    if not spare:
        return torch.empty(shape, dtype=dtype, device=device)
    shape = tuple(shape)
    return torch.empty((*shape[:-1], shape[-1] + spare), dtype=dtype, device=device)[..., : shape[-1]]


def _fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, spare: int = 0):
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    # Allocate in x's shape and hand the kernel a 2-D view: returning a view from the
    # autograd.Function would forbid the in-place RoPE that follows Qwen3's q/k norm. (With
    # `spare` columns the output is a view of a wider buffer; only a layer's input norms, whose
    # outputs nothing modifies in place, ask for them.)
    y_full = spare_empty(x.shape, spare, x.dtype, x.device)
    y = y_full.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block_r, block_c = _blocks(n_rows, n_cols)
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
            x2,
            weight,
            y,
            rstd,
            n_rows,
            n_cols,
            x2.stride(0),
            y.stride(0),
            float(eps),
            float(offset),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps_for(block_r * block_c),
        )
    return y_full, x2, rstd


def _bwd(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, need_dw: bool):
    dy2 = as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    block_r, block_c = _blocks(n_rows, n_cols)
    row_blocks = triton.cdiv(n_rows, block_r)
    if need_dw:
        # Enough programs to fill the GPU a few times over; each reduces its rows' dW in registers.
        if x2.is_cuda:
            max_programs = 4 * _sm_count(
                x2.device.index if x2.device.index is not None else torch.cuda.current_device()
            )
        else:
            max_programs = 4
        n_programs = max(1, min(row_blocks, max_programs))
        rows_per_program = triton.cdiv(row_blocks, n_programs) * block_r
        n_programs = triton.cdiv(n_rows, rows_per_program) if n_rows else 1
        dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2.device)
    else:
        n_programs, rows_per_program = row_blocks, block_r
        dw_partial = rstd  # unused placeholder pointer
    if n_rows:
        _rms_norm_bwd_kernel[(n_programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dx,
            dw_partial,
            n_rows,
            n_cols,
            dy2.stride(0),
            x2.stride(0),
            dx.stride(0),
            float(offset),
            rows_per_program,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            COMPUTE_DW=need_dw,
            num_warps=warps_for(block_r * block_c),
        )
    dw = None
    if need_dw:
        dw = (dw_partial.sum(0) if n_rows else torch.zeros(n_cols, device=x2.device)).to(weight.dtype)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm; saves x, weight and the fp32 per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, spare=0):
        y, x2, rstd = _fwd(x, weight, eps, offset, spare)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset = float(offset)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dx or need_dw):
            return None, None, None, None, None
        dx, dw = _bwd(dy, x2, weight, rstd, ctx.offset, need_dw)
        return (dx.view(ctx.x_shape) if need_dx else None), dw, None, None, None


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, spare: int = 0
) -> torch.Tensor:
    """Plain torch: normalize in fp32, multiply by (offset + weight) in fp32, cast to x.dtype.
    `spare` is the kernel's option and is ignored here (a contiguous output)."""
    count("rmsnorm:torch")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.float())).to(x.dtype)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, spare: int = 0
) -> torch.Tensor:
    """The Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    _check(x, weight)
    count("rmsnorm:triton")
    return RMSNormFunction.apply(x, weight, eps, offset, spare)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, spare: int = 0
) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading dims). offset=1.0 gives Gemma's (1 + w) form.

    Runs the Triton kernel when x and weight are on CUDA, the torch reference otherwise. `spare`:
    the kernel's output rows get that many free columns after them (`spare_empty`).
    """
    if on_cuda(x, weight):
        return rms_norm_triton(x, weight, eps, offset, spare)
    return rms_norm_reference(x, weight, eps, offset)
