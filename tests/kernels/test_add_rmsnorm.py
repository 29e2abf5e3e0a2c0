"""The residual add fused with RMSNorm: the Triton kernel (through the interpreter on a CPU) against
its torch reference and against the stock pair (``residual + x`` then transformers' norm module),
forward and backward: h bit for bit, y and the gradients within engine.kernels.rmsnorm's tolerances."""

import pytest
import torch

from engine.counters import reset_counters
from engine.kernels.add_rmsnorm import add_rms_norm, add_rms_norm_reference, add_rms_norm_triton

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _inputs(shape, dtype, seed, offset, weight_grad):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype)
    r = (torch.randn(shape, generator=g) * 3 - 0.1).to(dtype)
    base = 0.0 if offset else 1.0
    w = (base + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_(weight_grad)
    dy = torch.randn(shape, generator=g).to(dtype)
    dh = torch.randn(shape, generator=g).to(dtype)
    return x, r, w, dy, dh


def _run(fn, x, r, w, dy, dh, offset):
    """Forward, then backward with dy into y and dh into h (the residual stream's gradient)."""
    x = x.detach().clone().requires_grad_()
    r = r.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_(w.requires_grad)
    y, h = fn(x, r, w, 1e-6, offset)
    torch.autograd.backward((y, h), (dy, dh))
    return y.detach(), h.detach(), x.grad, r.grad, w.grad


@pytest.mark.parametrize(
    "shape,dtype,offset,weight_grad,seed",
    [
        ((3, 37, 100), torch.float32, 0.0, False, 1),  # 111 rows, several row blocks, H not 2^k
        ((300, 100), torch.float32, 1.0, True, 2),  # Gemma's 1 + w, dW partials over several blocks
        ((70, 1000), torch.float16, 0.0, True, 4),
        ((9, 3000), torch.float16, 1.0, False, 5),
        ((2, 33, 200), torch.bfloat16, 0.0, False, 6),  # no tl.dot here: bf16 is exact in the interpreter
        ((40, 256), torch.bfloat16, 1.0, True, 7),
    ],
)
def test_matches_reference(shape, dtype, offset, weight_grad, seed):
    x, r, w, dy, dh = _inputs(shape, dtype, seed, offset, weight_grad)
    y, h, dx, dr, dw = _run(add_rms_norm_triton, x, r, w, dy, dh, offset)
    y_ref, h_ref, dx_ref, dr_ref, dw_ref = _run(add_rms_norm_reference, x, r, w, dy, dh, offset)
    assert y.dtype == h.dtype == dx.dtype == dtype and y.shape == h.shape == x.shape
    if dtype == torch.bfloat16 and not x.is_cuda:
        # Triton's interpreter casts fp32 to bf16 by truncation, the GPU rounds to nearest as torch
        # does (exact there: tests/gpu/test_add_rmsnorm_gpu.py): one bf16 ulp apart at most here.
        torch.testing.assert_close(h, h_ref, rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the new residual is the stock add's, exactly
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    torch.testing.assert_close(dr, dr_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dr, rtol=0, atol=0)
    if weight_grad:
        scale = dw_ref.float().abs().max().item()
        tol = TOL[dtype]
        torch.testing.assert_close(dw.float() / scale, dw_ref.float() / scale, rtol=tol["rtol"], atol=tol["atol"])
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_stock_add_and_transformers_norms(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, r, _, dy, dh = _inputs((4, 19, 96), dtype, 8, 0.0, False)
    g = torch.Generator().manual_seed(9)
    for norm, offset, base in ((Qwen3RMSNorm(96, eps=1e-6), 0.0, 1.0), (GemmaRMSNorm(96, eps=1e-6), 1.0, 0.0)):
        norm = norm.to(dtype)
        with torch.no_grad():
            norm.weight.copy_(base + 0.1 * torch.randn(96, generator=g))
        norm.weight.requires_grad_(False)  # frozen, as under LoRA

        def stock(x, r, w, eps, offset, norm=norm):
            h = r + x
            return norm(h), h

        y, h, dx, dr, _ = _run(add_rms_norm_triton, x, r, norm.weight, dy, dh, offset)
        y_ref, h_ref, dx_ref, dr_ref, _ = _run(stock, x, r, norm.weight, dy, dh, offset)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
        # Llama-style modules round x_hat before the weight; the kernel rounds once, as rmsnorm's.
        tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
        torch.testing.assert_close(dr, dr_ref, **tol)


def test_without_a_residual_gradient():
    """Only y carries a gradient (h unused after): dx is the norm's backward alone."""
    x, r, w, dy, _ = _inputs((30, 64), torch.float32, 10, 0.0, False)
    grads = []
    for fn in (add_rms_norm_triton, add_rms_norm_reference):
        xx, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, _ = fn(xx, rr, w, 1e-6, 0.0)
        y.backward(dy)
        grads.append((xx.grad, rr.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


def test_dispatcher_counts_and_uses_reference_on_cpu():
    x, r, w, _, _ = _inputs((6, 50), torch.float32, 11, 0.0, False)
    reset_counters()
    y, h = add_rms_norm(x, r, w)
    assert reset_counters().get("add_rmsnorm:torch") == 1
    y_ref, h_ref = add_rms_norm_reference(x, r, w)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    reset_counters()
    add_rms_norm_triton(x.requires_grad_(), r, w)
    assert reset_counters().get("add_rmsnorm:triton") == 1


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="weight shape"):
        add_rms_norm_triton(torch.randn(3, 8), torch.randn(3, 8), torch.ones(7))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float16), torch.ones(8))


def test_normed_output_with_spare_columns():
    """spare: the normed output's rows have free columns after them (for a folded LoRA group to
    fill); the residual stays contiguous; values and gradients as without."""
    x, r, w, dy, dh = _inputs((2, 33, 96), torch.float32, 9, 0.0, True)
    plain = _run(add_rms_norm_triton, x, r, w, dy, dh, 0.0)
    spare = _run(lambda *a: add_rms_norm_triton(*a, spare=16), x, r, w, dy, dh, 0.0)
    y, h = add_rms_norm_triton(x, r, w.detach(), 1e-6, 0.0, 16)
    assert y.stride()[-2:] == (96 + 16, 1) and h.is_contiguous()
    for a, b in zip(spare, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape,dtype,offset,weight_grad,passed_grad",
    [
        ((3, 37, 100), torch.float32, 0.0, False, True),  # a layer's input norm: y and x both take gradients
        ((300, 100), torch.float32, 1.0, True, True),  # Gemma's 1 + w, dW too
        ((70, 1000), torch.float16, 0.0, False, True),
        ((50, 64), torch.float32, 0.0, True, False),  # the passed x unused: the plain norm's backward
    ],
)
def test_the_passing_norm_adds_the_residual_gradient_in_its_backward(shape, dtype, offset, weight_grad, passed_grad):
    # rms_norm_passing returns (rmsnorm(x), x) from one Function: x's gradient is the norm's plus the
    # passed x's, as autograd gives the stock pair (a norm, and x read again as the residual).
    from engine.kernels.add_rmsnorm import rms_norm_passing_triton
    from engine.kernels.rmsnorm import rms_norm_reference

    x0, _, w0, dy, dh = _inputs(shape, dtype, 11, offset, weight_grad)

    def run(fn):
        x = x0.detach().clone().requires_grad_()
        w = w0.detach().clone().requires_grad_(weight_grad)
        y, passed = fn(x, w)
        outs, grads = ((y, passed * 1), (dy, dh)) if passed_grad else ((y,), (dy,))
        torch.autograd.backward(outs, grads)
        return y.detach(), x.grad, w.grad, passed.data_ptr() == x.data_ptr()

    y, dx, dw, same = run(lambda x, w: rms_norm_passing_triton(x, w, 1e-6, offset))
    y_ref, dx_ref, dw_ref, _ = run(lambda x, w: (rms_norm_reference(x, w, 1e-6, offset), x))
    assert same  # x itself comes back, no copy
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    if weight_grad:
        torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-3 if dtype == torch.float32 else 5e-2)


def test_the_passing_norm_with_only_the_residual_gradient():
    from engine.kernels.add_rmsnorm import rms_norm_passing_triton

    x = torch.randn(20, 48, requires_grad=True)
    w = torch.ones(48)
    y, passed = rms_norm_passing_triton(x, w)
    (passed * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
