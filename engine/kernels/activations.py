"""Gated MLP activations: SwiGLU (Llama, Qwen, Mistral) and GeGLU (Gemma), forward and backward.

    swiglu(gate, up) = silu(gate) * up
    geglu(gate, up)  = gelu(gate) * up         (approximate "none": erf form, "tanh": tanh form)

Both are computed in fp32 and cast once. The backward is one kernel that reads grad, gate and up
once and writes d_gate and d_up. With `inplace_backward=True` those are written over the saved
gate and up, which saves two [tokens, intermediate] buffers at the MLP's backward peak; that is
safe only when nothing else reads gate/up afterwards (true inside a gated MLP, where gate and up
are the projection outputs used only here), so it is an explicit choice of the caller.

Public: `swiglu`, `geglu` (dispatchers), `swiglu_triton`, `geglu_triton`, `swiglu_reference`,
`geglu_reference`, `gated_act_reference` (the torch math behind both references, also in the
stock MLP's own input-dtype numerics), and the raw launchers `gated_act_forward`,
`gated_act_backward` and `gated_act_backward_and_output` (the backward that also writes the
forward's output, over dh) for fused LoRA MLP code that manages its own autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.counters import count
from engine.kernels._common import jit, next_pow2, on_cuda, tanh_f32, tl, triton, warps_for

_BLOCK = 2048  # values per program along a row; several programs split a long row

# Activation codes shared with the kernels.
SILU, GELU, GELU_TANH = 0, 1, 2
_ACTS = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH}


@jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """Returns (act(g), act'(g)) in fp32; the derivative is zeros when NEED_GRAD is off."""
    # Constants are literals because Triton only captures constexpr globals.
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        a = g * sig
        if NEED_GRAD:
            da = sig * (1.0 + g * (1.0 - sig))
        else:
            da = tl.zeros_like(g)  # dead code once compiled; keeps the return type a tensor
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        if NEED_GRAD:
            da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        else:
            da = tl.zeros_like(g)  # dead code once compiled; keeps the return type a tensor
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = tanh_f32(inner)
        a = 0.5 * g * (1.0 + th)
        if NEED_GRAD:
            d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
            da = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * d_inner
        else:
            da = tl.zeros_like(g)  # dead code once compiled; keeps the return type a tensor
    return a, da


@jit
def _gated_fwd_kernel(
    G,
    U,
    H,
    n_cols,
    stride_g,
    stride_u,
    stride_h,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT, False)
    tl.store(H + row * stride_h + cols, (a * u).to(H.dtype.element_ty), mask=mask)


@jit
def _gated_bwd_kernel(
    DH,
    G,
    U,
    DG,
    DU,
    H,
    n_cols,
    stride_dh,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    stride_h,
    ACT: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT, True)
    # Every input value is in registers before the stores, so DG/DU may alias G/U and H may alias DH.
    tl.store(DG + row * stride_dg + cols, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dh * a).to(DU.dtype.element_ty), mask=mask)
    if STORE_H:  # the forward's output too, as _gated_fwd_kernel rounds it
        tl.store(H + row * stride_h + cols, (a * u).to(H.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # A [rows, cols] view with unit column stride; the row stride is passed to the kernel so
    # halves of a fused gate_up projection work without a copy.
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(_BLOCK, next_pow2(n_cols))
    return (n_rows, triton.cdiv(n_cols, block)), block


def gated_act_forward(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up, computed by the Triton kernel (no autograd)."""
    code = _ACTS[act]
    count("activations:triton")
    g2, u2 = _rows(gate), _rows(up)
    n_rows, n_cols = g2.shape
    h = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if h.numel():
        grid, block = _grid(n_rows, n_cols)
        _gated_fwd_kernel[grid](
            g2,
            u2,
            h,
            n_cols,
            g2.stride(0),
            u2.stride(0),
            h.stride(0),
            ACT=code,
            BLOCK=block,
            num_warps=warps_for(block),
        )
    return h.view(gate.shape)


def gated_act_backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu", inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of act(gate) * up in one pass (no autograd).

    inplace=True writes d_gate over gate and d_up over up (their old values are gone after).
    """
    dg, du, _ = _backward(dh, gate, up, act, inplace, store_h=False)
    return dg, du


def gated_act_backward_and_output(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gate, d_up, h) in one pass, with h = act(gate) * up exactly as gated_act_forward makes it
    (no autograd), written over dh, d_gate over gate and d_up over up: for a backward that needs
    h after dh (a LoRA down projection's dA), one pass over gate and up instead of two, and no
    memory beyond its inputs'. dh must be a contiguous buffer the caller owns."""
    if not dh.is_contiguous():
        raise ValueError("gated_act_backward_and_output: dh must be contiguous (h is written over it)")
    count("activations:triton")  # it makes the activation too, as gated_act_forward (counted) did here
    return _backward(dh, gate, up, act, inplace=True, store_h=True)


def _backward(dh, gate, up, act: str, inplace: bool, store_h: bool):
    code = _ACTS[act]
    dh2, g2, u2 = _rows(dh), _rows(gate), _rows(up)
    n_rows, n_cols = g2.shape
    if inplace:
        dg, du = g2, u2
    else:
        dg = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
        du = torch.empty((n_rows, n_cols), dtype=up.dtype, device=up.device)
    if dg.numel():
        grid, block = _grid(n_rows, n_cols)
        _gated_bwd_kernel[grid](
            dh2,
            g2,
            u2,
            dg,
            du,
            dh2,
            n_cols,
            dh2.stride(0),
            g2.stride(0),
            u2.stride(0),
            dg.stride(0),
            du.stride(0),
            dh2.stride(0),
            ACT=code,
            STORE_H=store_h,
            BLOCK=block,
            num_warps=warps_for(block),
        )
    return dg.view(gate.shape), du.view(up.shape), dh2.view(dh.shape)


class GatedActFunction(torch.autograd.Function):
    """act(gate) * up with the one-kernel backward; saves gate and up (not the output)."""

    @staticmethod
    def forward(ctx, gate, up, act, inplace_backward):
        ctx.act = act
        ctx.inplace = bool(inplace_backward)
        ctx.save_for_backward(gate, up)
        return gated_act_forward(gate, up, act)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = gated_act_backward(dh, gate, up, ctx.act, inplace=ctx.inplace)
        return dg, du, None, None


def _check(gate: torch.Tensor, up: torch.Tensor, name: str) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"{name}: gate ({gate.dtype}) and up ({up.dtype}) differ in dtype")


def _geglu_act(approximate: str) -> str:
    if approximate == "none":
        return "gelu"
    if approximate == "tanh":
        return "gelu_tanh"
    raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")


def gated_act_reference(
    gate: torch.Tensor, up: torch.Tensor, act: str = "silu", *, upcast: bool = True
) -> torch.Tensor:
    """act(gate) * up in plain torch (autograd-capable; not counted). act: "silu", "gelu" (erf
    form) or "gelu_tanh".

    upcast=True: in fp32 and cast once, the kernel's numerics. upcast=False: in the input dtype,
    op for op as transformers' gated MLP computes ``act_fn(gate) * up``, so a path that must
    match the stock module bit for bit (engine.fastpath.lora's "torch" GatedAct) uses this.
    """
    if act not in _ACTS:
        raise ValueError(f"unknown gated activation {act!r}; expected one of {tuple(_ACTS)}")
    if upcast:
        return (_act_torch(gate.float(), act) * up.float()).to(gate.dtype)
    return _act_torch(gate, act) * up


def _act_torch(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch, in fp32 and cast once (the kernel's numerics)."""
    count("activations:torch")
    return gated_act_reference(gate, up, "silu")


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    act = _geglu_act(approximate)
    count("activations:torch")
    return gated_act_reference(gate, up, act)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """The Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    _check(gate, up, "swiglu")
    return GatedActFunction.apply(gate, up, "silu", inplace_backward)


def geglu_triton(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *, inplace_backward: bool = False
) -> torch.Tensor:
    """The Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    _check(gate, up, "geglu")
    return GatedActFunction.apply(gate, up, _geglu_act(approximate), inplace_backward)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """silu(gate) * up; Triton on CUDA, the torch reference elsewhere.

    inplace_backward=True lets the backward overwrite gate and up with their gradients; pass it
    only when gate and up are used by nothing else.
    """
    if on_cuda(gate, up):
        return swiglu_triton(gate, up, inplace_backward=inplace_backward)
    return swiglu_reference(gate, up)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *, inplace_backward: bool = False
) -> torch.Tensor:
    """gelu(gate) * up (approximate "none" or "tanh"); Triton on CUDA, the torch reference elsewhere."""
    if on_cuda(gate, up):
        return geglu_triton(gate, up, approximate, inplace_backward=inplace_backward)
    return geglu_reference(gate, up, approximate)
