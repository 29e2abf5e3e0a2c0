"""Fused linear + cross-entropy: the chunked Triton path (through the interpreter on a CPU) against
full-logits fp32 torch cross-entropy: loss and the gradients of hidden, weight and bias, with
ignore_index, softcap, logit_scale, normalizer and chunking."""

import pytest
import torch

from engine.kernels import fused_ce
from engine.kernels.fused_ce import (
    default_chunk_tokens,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    fused_linear_cross_entropy_triton,
)

# Low-precision logits carry one rounding each, so compare gradients relative to their scale.
TOL = {
    torch.float32: dict(loss=1e-5, grad=1e-5),
    torch.float16: dict(loss=2e-3, grad=4e-3),
    torch.bfloat16: dict(loss=1e-2, grad=2e-2),
}


def _inputs(n, h, v, dtype, seed, ignore_index=-100, ignore_every=3, scale=1.0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, h, generator=g)).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 2).to(dtype)
    b = (0.5 * torch.randn(v, generator=g)).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = ignore_index
    return hidden, weight, b, targets


def _run(fn, hidden, weight, bias, targets, grads=("h", "w", "b"), **kw):
    h = hidden.detach().clone().requires_grad_("h" in grads)
    w = weight.detach().clone().requires_grad_("w" in grads)
    b = None if bias is None else bias.detach().clone().requires_grad_("b" in grads)
    loss = fn(h, w, targets, bias=b, **kw)
    if loss.requires_grad:
        loss.backward()
    return loss.detach(), h.grad, w.grad, (None if b is None else b.grad)


def _close(a, b, rel, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype, what
    scale = max(b.float().abs().max().item(), 1e-12)
    err = (a.float() - b.float()).abs().max().item() / scale
    assert err <= rel, f"{what}: max error {err:.3g} of its scale > {rel}"


def _compare(hidden, weight, bias, targets, dtype, grads=("h", "w", "b"), **kw):
    out = _run(fused_linear_cross_entropy_triton, hidden, weight, bias, targets, grads, **kw)
    ref = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, targets, grads, **kw)
    assert out[0].dtype == torch.float32 and out[0].dim() == 0
    torch.testing.assert_close(out[0], ref[0], rtol=TOL[dtype]["loss"], atol=TOL[dtype]["loss"])
    for name, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), out[1:], ref[1:]):
        _close(a, b, TOL[dtype]["grad"], name)
    return out


@pytest.mark.parametrize(
    "n,h,v,dtype,kw,seed",
    [
        (37, 24, 501, torch.float32, {}, 1),
        (37, 24, 501, torch.float32, dict(chunk_tokens=8), 2),  # 5 chunks, last one short
        (29, 16, 300, torch.float32, dict(softcap=3.0, logit_scale=0.7, normalizer=13.0, chunk_tokens=10), 3),
        (40, 32, 300, torch.float16, dict(chunk_tokens=16), 4),
        (40, 32, 300, torch.bfloat16, dict(chunk_tokens=16, softcap=2.0), 5),
    ],
)
def test_matches_reference(n, h, v, dtype, kw, seed):
    hidden, weight, bias, targets = _inputs(n, h, v, dtype, seed)
    _compare(hidden, weight, bias, targets, dtype, **kw)


def test_rows_span_several_vocab_blocks(monkeypatch):
    # A small vocab block makes every row an online logsumexp over many blocks; large logits
    # check that running max rescaling stays stable.
    monkeypatch.setattr(fused_ce, "CE_BLOCK_V", 64)
    hidden, weight, bias, targets = _inputs(19, 16, 333, torch.float32, 6, scale=8.0)
    _compare(hidden, weight, bias, targets, torch.float32, softcap=30.0, chunk_tokens=7)
    _compare(hidden, weight, bias, targets, torch.float32, chunk_tokens=7)


def test_frozen_weight_no_bias_and_tensor_normalizer():
    # The LoRA case: lm_head frozen, only grad_hidden; normalizer from the whole accumulated step.
    hidden, weight, _, targets = _inputs(33, 24, 257, torch.float32, 7, bias=False)
    norm = torch.tensor(100.0)
    out = _compare(hidden, weight, None, targets, torch.float32, grads=("h",), normalizer=norm, chunk_tokens=9)
    assert out[2] is None
    # The loss is a sum / normalizer: twice the normalizer halves it.
    half = fused_linear_cross_entropy_triton(hidden, weight, targets, normalizer=200.0)
    torch.testing.assert_close(half, out[0] / 2, rtol=1e-6, atol=1e-7)


def test_ignore_index_and_default_normalizer():
    hidden, weight, bias, targets = _inputs(24, 16, 129, torch.float32, 8, ignore_index=-1, ignore_every=2)
    loss = _compare(hidden, weight, bias, targets, torch.float32, ignore_index=-1, chunk_tokens=5)[0]
    # Default normalizer = count of non-ignored targets (12 of 24).
    full = torch.nn.functional.cross_entropy(hidden @ weight.t() + bias, targets, ignore_index=-1)
    torch.testing.assert_close(loss, full, rtol=1e-5, atol=1e-5)
    # Ignored rows contribute no gradient to their hidden state.
    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy_triton(h, weight, targets, bias=bias, ignore_index=-1).backward()
    assert torch.all(h.grad[targets == -1] == 0) and torch.all(h.grad[targets != -1].abs().sum(-1) > 0)


def test_all_ignored_gives_zero_loss_and_grads():
    hidden, weight, bias, targets = _inputs(10, 8, 50, torch.float32, 9)
    targets[:] = -100
    loss, dh, dw, db = _run(fused_linear_cross_entropy_triton, hidden, weight, bias, targets)
    assert loss.item() == 0.0
    assert torch.all(dh == 0) and torch.all(dw == 0) and torch.all(db == 0)


def test_no_grad_and_batched_input():
    hidden, weight, bias, targets = _inputs(30, 16, 100, torch.float32, 10)
    ref = fused_linear_cross_entropy_reference(hidden, weight, targets, bias=bias)
    with torch.no_grad():
        got = fused_linear_cross_entropy_triton(hidden.requires_grad_(), weight, targets, bias=bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # [B, T, H] hidden with [B, T] targets flattens to the same loss.
    got3 = fused_linear_cross_entropy_triton(hidden.detach().view(3, 10, 16), weight, targets.view(3, 10), bias=bias)
    torch.testing.assert_close(got3, ref, rtol=1e-5, atol=1e-5)


def test_backward_twice_is_refused():
    hidden, weight, _, targets = _inputs(6, 8, 20, torch.float32, 11, bias=False)
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy_triton(h, weight, targets)
    loss.backward(retain_graph=True)
    # The stored gradients are scaled in place by the first backward; autograd's version check
    # must refuse a second one rather than hand back gradients scaled twice.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_default_chunk_tokens():
    assert default_chunk_tokens(151936, 2) == 512  # 155 MB of bf16 logits
    assert default_chunk_tokens(128256, 2) == 1024
    assert default_chunk_tokens(151936, 4) == 256
    assert default_chunk_tokens(1000, 2) == 8192
    assert default_chunk_tokens(10_000_000, 4) == 256


def test_dispatcher_uses_reference_on_cpu():
    hidden, weight, bias, targets = _inputs(12, 8, 40, torch.float32, 12)
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, targets, bias=bias)
    assert "FusedLinearCrossEntropy" not in type(loss.grad_fn).__name__
    torch.testing.assert_close(
        loss, fused_linear_cross_entropy_reference(h, weight, targets, bias=bias), rtol=0, atol=0
    )
    assert "FusedLinearCrossEntropy" in type(fused_linear_cross_entropy_triton(h, weight, targets).grad_fn).__name__


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="targets for"):
        fused_linear_cross_entropy_triton(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="must be"):
        fused_linear_cross_entropy_triton(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
