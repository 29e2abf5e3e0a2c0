"""The residual add and the RMSNorm after it, as one Triton kernel each way.

    h = x + residual                                           rounded to x.dtype (the new residual)
    y = h / sqrt(mean(h^2) + eps) * (offset + weight)          computed in fp32, cast to x.dtype

A decoder layer does ``h = residual + attn_out; y = post_attention_layernorm(h)``: two launches
forward (the add, the norm) and three backward (the norm, the add's accumulate into the residual
stream's gradient). Here it is one each way. h is rounded to x.dtype before it is normalized, as
the stock add does, so h is bit-identical to the stock path and y follows the rules of
engine.kernels.rmsnorm (fp32 math, one rounding at the end; offset=1.0 gives Gemma's 1 + w).

Saved for the backward: h (it is the next residual, kept anyway) and one fp32 reciprocal-rms per
row. The backward takes dy and dh (the gradient reaching h from the residual stream) and gives
dx = dresidual = dh + d(norm)/dh . dy in one pass, summed in fp32 and rounded once; dW is only
reduced when the weight requires grad (frozen under LoRA).

Public: `add_rms_norm` (dispatcher), `add_rms_norm_triton`, `add_rms_norm_reference`; each returns
(y, h).

The layer's first norm has the same shape of gradient: its input x is also the residual the layer
adds to later, so x gets two gradients, the norm's and the residual stream's, which autograd adds
after the norm's backward (one more pass over the row per layer). `rms_norm_passing` returns
(rmsnorm(x), x) from one Function, whose backward is this file's kernel with the residual's gradient
as dh: the add happens inside it.
"""

from __future__ import annotations

import torch

from engine.counters import count
from engine.kernels._common import as_rows, jit, on_cuda, tl, triton, warps_for
from engine.kernels.rmsnorm import _blocks, _check, _sm_count, rms_norm_reference, spare_empty
from engine.kernels.rmsnorm import _bwd as _rms_norm_bwd
from engine.kernels.rmsnorm import _fwd as _rms_norm_fwd


@jit
def _add_rms_norm_fwd_kernel(
    X,
    R,
    W,
    Y,
    H,
    RSTD,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
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
    r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # The stock add rounds the sum to the activation dtype, and the norm reads that rounded value.
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
    hf = h.to(tl.float32)
    mean_sq = tl.sum(hf * hf, axis=1) / n_cols
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    y = hf * rstd[:, None] * w[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@jit
def _add_rms_norm_bwd_kernel(
    DY,
    DH,
    H,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    n_rows,
    n_cols,
    stride_dy,
    stride_dh,
    stride_h,
    stride_dx,
    offset,
    rows_per_program,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
):
    # engine.kernels.rmsnorm's backward plus the residual stream's gradient, added in fp32.
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
        h = tl.load(H + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        h_hat = h * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * h_hat, axis=1) / n_cols
        dx = (g - h_hat * c[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * h_hat
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=cmask)


def _check_pair(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )


def _fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, spare: int = 0):
    x2, r2 = as_rows(x), as_rows(residual)
    n_rows, n_cols = x2.shape
    # Outputs in x's shape (not views made here): the layer hands both on to other Functions. The
    # normed one may have `spare` free columns after each row (engine.kernels.rmsnorm.spare_empty).
    y_full = spare_empty(x.shape, spare, x.dtype, x.device)
    h_full = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y, h = y_full.view(n_rows, n_cols), h_full.view(n_rows, n_cols)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block_r, block_c = _blocks(n_rows, n_cols)
        _add_rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
            x2,
            r2,
            weight,
            y,
            h,
            rstd,
            n_rows,
            n_cols,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            h.stride(0),
            float(eps),
            float(offset),
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps_for(block_r * block_c),
        )
    return y_full, h_full, rstd


def _bwd(dy, dh, h2, weight, rstd, offset: float, need_dw: bool):
    dy2 = as_rows(dy)
    dh2 = as_rows(dh) if dh is not None else None
    n_rows, n_cols = h2.shape
    dx = torch.empty((n_rows, n_cols), dtype=h2.dtype, device=h2.device)
    block_r, block_c = _blocks(n_rows, n_cols)
    row_blocks = triton.cdiv(n_rows, block_r)
    if need_dw:
        # As in engine.kernels.rmsnorm: a few programs per SM, each reducing its rows' dW in registers.
        if h2.is_cuda:
            index = h2.device.index if h2.device.index is not None else torch.cuda.current_device()
            max_programs = 4 * _sm_count(index)
        else:
            max_programs = 4
        n_programs = max(1, min(row_blocks, max_programs))
        rows_per_program = triton.cdiv(row_blocks, n_programs) * block_r
        n_programs = triton.cdiv(n_rows, rows_per_program) if n_rows else 1
        dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=h2.device)
    else:
        n_programs, rows_per_program = row_blocks, block_r
        dw_partial = rstd  # unused placeholder pointer
    if n_rows:
        _add_rms_norm_bwd_kernel[(n_programs,)](
            dy2,
            dh2 if dh2 is not None else dy2,  # placeholder pointer when h got no gradient
            h2,
            weight,
            rstd,
            dx,
            dw_partial,
            n_rows,
            n_cols,
            dy2.stride(0),
            dh2.stride(0) if dh2 is not None else 0,
            h2.stride(0),
            dx.stride(0),
            float(offset),
            rows_per_program,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            HAS_DH=dh2 is not None,
            COMPUTE_DW=need_dw,
            num_warps=warps_for(block_r * block_c),
        )
    dw = None
    if need_dw:
        dw = (dw_partial.sum(0) if n_rows else torch.zeros(n_cols, device=h2.device)).to(weight.dtype)
    return dx, dw


class AddRMSNormFunction(torch.autograd.Function):
    """Triton add + RMSNorm; returns (y, h) and saves h, weight and the fp32 per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, spare=0):
        y, h, rstd = _fwd(x, residual, weight, eps, offset, spare)
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset = float(offset)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        need_x, need_r, need_dw = ctx.needs_input_grad[:3]
        if dy is None:  # only the residual stream carries a gradient: h = x + residual passes it on
            dx = dh if (need_x or need_r) else None
            dw = torch.zeros_like(weight) if need_dw else None
            return dx if need_x else None, dx if need_r else None, dw, None, None, None
        if not (need_x or need_r or need_dw):
            return None, None, None, None, None, None
        dx, dw = _bwd(dy, dh, as_rows(h), weight, rstd, ctx.offset, need_dw)
        dx = dx.view(h.shape)
        # x and residual get the same gradient (the same tensor, as Liger's fused add-norm returns).
        return dx if need_x else None, dx if need_r else None, dw, None, None, None


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    spare: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, op for op the stock layer's add and engine.kernels.rmsnorm's reference: (y, h).
    `spare` is the kernel's option and is ignored here."""
    count("add_rmsnorm:torch")
    count("rmsnorm:torch")  # a norm computed: every RMSNorm counts under rmsnorm (engine.counters)
    h = residual + x
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.float())).to(x.dtype), h


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    spare: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    _check_pair(x, residual, weight)
    count("add_rmsnorm:triton")
    count("rmsnorm:triton")
    return AddRMSNormFunction.apply(x, residual, weight, eps, offset, spare)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    spare: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * (offset + weight), x + residual) over the last dim.

    Runs the Triton kernel when every tensor is on CUDA, the torch reference otherwise. `spare`:
    the kernel's normed output gets that many free columns after each row.
    """
    if on_cuda(x, residual, weight):
        return add_rms_norm_triton(x, residual, weight, eps, offset, spare)
    return add_rms_norm_reference(x, residual, weight, eps, offset)


class RMSNormPassingFunction(torch.autograd.Function):
    """Triton RMSNorm returning (y, x): x's gradient is the norm's plus the one reaching the
    returned x, added in the backward kernel. Saves x, weight and the fp32 per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, spare=0):
        ctx.set_materialize_grads(False)
        y, x2, rstd = _rms_norm_fwd(x, weight, eps, offset, spare)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset = float(offset)
        ctx.x_shape = x.shape
        return y, x  # x comes back as a view of itself, with this Function as its grad_fn

    @staticmethod
    def backward(ctx, dy, dx_passed):
        x2, weight, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if dy is None:  # only the passed x carries a gradient
            dw = torch.zeros_like(weight) if need_dw else None
            return dx_passed if need_dx else None, dw, None, None, None
        if dx_passed is None:
            dx, dw = _rms_norm_bwd(dy, x2, weight, rstd, ctx.offset, need_dw)
        else:
            dx, dw = _bwd(dy, dx_passed, x2, weight, rstd, ctx.offset, need_dw)
        return (dx.view(ctx.x_shape) if need_dx else None), dw, None, None, None


def rms_norm_passing_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, spare: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x), x) through the Triton kernels regardless of device (CPU needs TRITON_INTERPRET=1)."""
    _check(x, weight)
    count("rmsnorm:triton")
    return RMSNormPassingFunction.apply(x, weight, eps, offset, spare)


def rms_norm_passing(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, spare: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x) * (offset + weight), x): the Triton Function on CUDA, else the torch reference
    and x itself (autograd then adds x's two gradients, as the stock layer does)."""
    if on_cuda(x, weight):
        return rms_norm_passing_triton(x, weight, eps, offset, spare)
    return rms_norm_reference(x, weight, eps, offset), x
