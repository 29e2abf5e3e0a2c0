"""Per-token log-probs through the LM head (engine.kernels.token_logp): the chunked Triton path
(through the interpreter, fp32: the interpreter's bf16 tl.dot is broken) against full-logits
fp32 log_softmax, values and the gradients of hidden, weight and bias under a per-token upstream
weight, with ignored targets, softcap, logit_scale (GRPO's temperature) and chunking; and the
per-document sums over a packed stream."""

import pytest
import torch

from engine.kernels.token_logp import (
    document_index,
    fused_linear_token_logp,
    fused_linear_token_logp_reference,
    fused_linear_token_logp_triton,
    sum_per_document,
)


def _inputs(n, h, v, seed, ignore_every=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 2
    bias = 0.5 * torch.randn(v, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    row_w = torch.randn(n, generator=g)  # the upstream gradient: one weight per token
    return hidden, weight, bias, targets, row_w


def _run(fn, hidden, weight, bias, targets, row_w, grads, **kw):
    h = hidden.clone().requires_grad_("h" in grads)
    w = weight.clone().requires_grad_("w" in grads)
    b = bias.clone().requires_grad_("b" in grads)
    logp = fn(h, w, targets, bias=b, **kw)
    (logp * row_w).sum().backward()
    return logp.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize(
    "n,h,v,chunk,kw,grads",
    [
        (17, 16, 50, None, {}, ("h",)),
        (33, 32, 300, 8, {}, ("h",)),
        (20, 16, 64, 7, dict(softcap=3.0), ("h",)),
        (20, 16, 64, 5, dict(logit_scale=1 / 0.7), ("h", "w", "b")),
        (12, 16, 40, 4, {}, ("w",)),
    ],
)
def test_triton_matches_full_logits_reference(n, h, v, chunk, kw, grads):
    hidden, weight, bias, targets, row_w = _inputs(n, h, v, seed=n + v)
    out = _run(fused_linear_token_logp_triton, hidden, weight, bias, targets, row_w, grads, chunk_tokens=chunk, **kw)
    ref = _run(fused_linear_token_logp_reference, hidden, weight, bias, targets, row_w, grads, **kw)
    assert out[0].shape == (n,) and out[0].dtype == torch.float32
    assert (out[0][targets == -100] == 0).all()
    assert (out[0][targets != -100] < 0).all()
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("hidden", "weight", "bias"), out[1:], ref[1:]):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_reference_is_log_softmax_of_the_full_logits():
    hidden, weight, bias, targets, _ = _inputs(9, 8, 30, seed=3, ignore_every=0)
    logits = hidden @ weight.t() + bias
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    got = fused_linear_token_logp(hidden, weight, targets, bias=bias)
    torch.testing.assert_close(got, want)
    # The token losses of the fused cross-entropy are the negatives of these.
    from engine.kernels.fused_ce import fused_linear_cross_entropy_reference

    ce = fused_linear_cross_entropy_reference(hidden, weight, targets, bias=bias, normalizer=1.0)
    torch.testing.assert_close(-got.sum(), ce)


def test_sum_per_document_follows_the_packed_lengths():
    lengths = [3, 1, 4]
    values = torch.arange(8, dtype=torch.float32, requires_grad=True)
    sums = sum_per_document(values, lengths)
    assert sums.tolist() == [0 + 1 + 2, 3, 4 + 5 + 6 + 7]
    (sums * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert values.grad.tolist() == [1, 1, 1, 2, 3, 3, 3, 3]
    assert document_index(lengths).tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="7 values"):
        sum_per_document(values.detach()[:7], lengths)


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"3 targets for 4 hidden rows"):
        fused_linear_token_logp(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long))
