"""SwiGLU / GeGLU: the Triton kernels (through the interpreter on a CPU) against torch, forward and
the one-kernel backward, with and without writing the gradients over gate/up."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.activations import (
    gated_act_backward,
    gated_act_backward_and_output,
    gated_act_forward,
    gated_act_reference,
    geglu,
    geglu_reference,
    geglu_triton,
    swiglu,
    swiglu_reference,
    swiglu_triton,
)

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}

OPS = {
    "swiglu": (swiglu_triton, lambda g, u: F.silu(g) * u),
    "geglu": (lambda g, u, **kw: geglu_triton(g, u, "none", **kw), lambda g, u: F.gelu(g) * u),
    "geglu_tanh": (lambda g, u, **kw: geglu_triton(g, u, "tanh", **kw), lambda g, u: F.gelu(g, approximate="tanh") * u),
}


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype)  # wide range: both tails of the activation
    up = torch.randn(shape, generator=g).to(dtype)
    dh = torch.randn(shape, generator=g).to(dtype)
    return gate, up, dh


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize(
    "shape,dtype,inplace,seed",
    [
        ((3, 5, 300), torch.float32, False, 1),
        ((4, 2500), torch.float32, True, 2),  # a row split over two programs, last one masked
        ((37, 300), torch.float16, True, 3),
        ((7, 100), torch.bfloat16, False, 4),
    ],
)
def test_matches_torch(op, shape, dtype, inplace, seed):
    kernel, torch_fn = OPS[op]
    gate0, up0, dh = _inputs(shape, dtype, seed)

    # Ground truth in fp32 from the same (rounded) inputs; the kernel rounds once at the end.
    g32, u32 = gate0.float().clone().requires_grad_(), up0.float().clone().requires_grad_()
    h32 = torch_fn(g32, u32)
    h32.backward(dh.float())

    g_leaf, u_leaf = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    gate, up = g_leaf * 1, u_leaf * 1  # non-leaf, like projection outputs
    h = kernel(gate, up, inplace_backward=inplace)
    h.backward(dh)
    assert h.dtype == dtype
    torch.testing.assert_close(h, h32.to(dtype), **TOL[dtype])
    torch.testing.assert_close(g_leaf.grad, g32.grad.to(dtype), **TOL[dtype])
    torch.testing.assert_close(u_leaf.grad, u32.grad.to(dtype), **TOL[dtype])
    if inplace:  # the gradients were written over the saved gate/up storage
        torch.testing.assert_close(gate.detach(), g_leaf.grad, rtol=0, atol=0)
        torch.testing.assert_close(up.detach(), u_leaf.grad, rtol=0, atol=0)
    else:
        torch.testing.assert_close(gate.detach(), gate0, rtol=0, atol=0)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_and_output_is_the_forward_and_backward_in_one_pass(act, dtype):
    """The backward that also writes h: h bit for bit as the forward kernel makes it (over dh's
    memory), d_gate/d_up bit for bit as the plain backward (over gate/up); halves of a fused
    gate_up projection as inputs."""
    g = torch.Generator().manual_seed(7)
    gate_up = (2 * torch.randn(9, 2 * 2500, generator=g)).to(dtype)  # rows split over two programs
    dh = torch.randn(9, 2500, generator=g).to(dtype)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    h_ref = gated_act_forward(gate, up, act)
    dg_ref, du_ref = gated_act_backward(dh, gate, up, act)
    dh_buf = dh.clone()
    dg, du, h = gated_act_backward_and_output(dh_buf, gate, up, act)
    assert h.data_ptr() == dh_buf.data_ptr() and dg.data_ptr() == gate.data_ptr() and du.data_ptr() == up.data_ptr()
    for a, b in ((h, h_ref), (dg, dg_ref), (du, du_ref)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contiguous"):
        gated_act_backward_and_output(dh.t(), gate.t(), up.t(), act)


def test_halves_of_fused_gate_up_projection():
    # gate and up as strided halves of one [N, 2I] projection output: no copies needed.
    g = torch.Generator().manual_seed(5)
    gu_leaf = torch.randn(11, 2 * 150, generator=g).requires_grad_()
    dh = torch.randn(11, 150, generator=g)
    gate, up = (gu_leaf * 1).chunk(2, dim=-1)
    assert not gate.is_contiguous()
    swiglu_triton(gate, up, inplace_backward=True).backward(dh)
    ref_leaf = gu_leaf.detach().clone().requires_grad_()
    rg, ru = ref_leaf.chunk(2, dim=-1)
    (F.silu(rg) * ru).backward(dh)
    torch.testing.assert_close(gu_leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)


def test_references_are_fp32_then_cast():
    gate, up, _ = _inputs((8, 64), torch.bfloat16, 6)
    torch.testing.assert_close(
        swiglu_reference(gate, up), (F.silu(gate.float()) * up.float()).bfloat16(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        geglu_reference(gate, up, "tanh"),
        (F.gelu(gate.float(), approximate="tanh") * up.float()).bfloat16(),
        rtol=0,
        atol=0,
    )


def test_stock_numerics_are_transformers_mlp_bit_for_bit():
    # upcast=False is what engine.fastpath.lora's "torch" GatedAct runs: act_fn(gate) * up in the
    # input dtype, as transformers' gated MLPs compute it, so the fused MLP matches them exactly.
    from transformers.activations import ACT2FN

    gate, up, _ = _inputs((8, 64), torch.bfloat16, 9)
    for act, name in (("silu", "silu"), ("gelu", "gelu"), ("gelu_tanh", "gelu_pytorch_tanh")):
        assert gated_act_reference(gate, up, act, upcast=False).equal(ACT2FN[name](gate) * up), act
        assert gated_act_reference(gate, up, act).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown gated activation"):
        gated_act_reference(gate, up, "relu")


def test_dispatcher_uses_reference_on_cpu():
    gate, up, _ = _inputs((4, 40), torch.float32, 7)
    gate.requires_grad_()
    for fn, name in ((lambda: swiglu(gate, up), "swiglu"), (lambda: geglu(gate, up, "tanh"), "geglu")):
        out = fn()
        assert "GatedActFunction" not in type(out.grad_fn).__name__, name
    assert "GatedActFunction" in type(swiglu_triton(gate, up).grad_fn).__name__


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="approximate"):
        geglu_triton(torch.randn(2, 4), torch.randn(2, 4), "erf")
    with pytest.raises(ValueError, match="differ in shape"):
        swiglu_triton(torch.randn(2, 4), torch.randn(2, 5))
