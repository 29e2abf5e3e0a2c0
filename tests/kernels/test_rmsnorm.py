"""RMSNorm: the Triton kernel (through the interpreter on a CPU) against the torch reference and
transformers' own norm modules, forward and backward, including dW when the weight trains."""

import pytest
import torch

from engine.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_triton

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _inputs(shape, dtype, seed, offset, weight_grad):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.3).to(dtype).requires_grad_()
    base = 0.0 if offset else 1.0
    w = (base + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_(weight_grad)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _run(fn, x, w, dy, offset):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_(w.requires_grad)
    y = fn(x, w, 1e-6, offset)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize(
    "shape,dtype,offset,weight_grad,seed",
    [
        ((3, 37, 100), torch.float32, 0.0, True, 1),  # 111 rows, several row blocks, H not 2^k
        ((300, 100), torch.float32, 1.0, True, 2),  # dW partials span several row blocks each
        ((2, 5, 8, 128), torch.float32, 0.0, False, 3),  # q/k-norm layout, frozen weight
        ((70, 1000), torch.float16, 0.0, True, 4),
        ((9, 3000), torch.float16, 1.0, False, 5),
        ((33, 200), torch.bfloat16, 0.0, True, 6),
    ],
)
def test_matches_reference(shape, dtype, offset, weight_grad, seed):
    x, w, dy = _inputs(shape, dtype, seed, offset, weight_grad)
    y, dx, dw = _run(rms_norm_triton, x, w, dy, offset)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, w, dy, offset)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    if weight_grad:
        assert dw is not None and dw.dtype == dtype
        # dW sums over every row, so compare relative to its scale.
        scale = dw_ref.float().abs().max().item()
        tol = TOL[dtype]
        torch.testing.assert_close(dw.float() / scale, dw_ref.float() / scale, rtol=tol["rtol"], atol=tol["atol"])
    else:
        assert dw is None


def test_matches_transformers_modules():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 19, 96, generator=g)
    qwen = Qwen3RMSNorm(96, eps=1e-6)
    gemma = GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        qwen.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
        gemma.weight.copy_(0.1 * torch.randn(96, generator=g))
    torch.testing.assert_close(rms_norm_triton(x, qwen.weight, 1e-6), qwen(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm_triton(x, gemma.weight, 1e-6, offset=1.0), gemma(x), rtol=1e-5, atol=1e-5)


def test_weight_only_grad():
    x, w, dy = _inputs((40, 72), torch.float32, 8, 0.0, True)
    x = x.detach()
    y = rms_norm_triton(x, w, 1e-6)
    y.backward(dy)
    w_ref = w.detach().clone().requires_grad_()
    rms_norm_reference(x, w_ref, 1e-6).backward(dy)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


def test_dispatcher_uses_reference_on_cpu():
    x, w, _ = _inputs((6, 50), torch.float32, 9, 0.0, True)
    y = rms_norm(x, w)
    assert "RMSNormFunction" not in type(y.grad_fn).__name__
    torch.testing.assert_close(y, rms_norm_reference(x, w), rtol=0, atol=0)
    assert "RMSNormFunction" in type(rms_norm_triton(x, w).grad_fn).__name__


def test_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_triton(torch.randn(3, 8), torch.ones(7))


@pytest.mark.parametrize("shape", [(3, 37, 100), (300, 64)])
def test_output_with_spare_columns(shape):
    """spare: the output is a view whose rows have free columns after them in memory (for a folded
    LoRA group to fill), with the same values and gradients as the plain output."""
    x, w, dy = _inputs(shape, torch.float32, 8, 0.0, True)
    plain = _run(rms_norm_triton, x, w, dy, 0.0)
    spare = _run(lambda *a: rms_norm_triton(*a, spare=24), x, w, dy, 0.0)
    y = rms_norm_triton(x.detach(), w.detach(), 1e-6, 0.0, 24)
    assert y.shape == x.shape and y.stride()[-2:] == (shape[-1] + 24, 1)
    assert y.untyped_storage().nbytes() == y.numel() // shape[-1] * (shape[-1] + 24) * 4
    for a, b in zip(spare, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rms_norm_reference(x.detach(), w.detach(), 1e-6, 0.0, 24).is_contiguous()  # ignored there
