"""The fused per-head q/k RMSNorm + RoPE kernel (through the interpreter on a CPU) against the
unfused references (each norm's, then transformers' apply_rotary_pos_emb), forward and backward:
through the projection's view, on packed positions, with Gemma's 1 + w, and with one output's
gradient missing."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.counters import reset_counters
from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from engine.kernels.rmsnorm import rms_norm_reference
from tests.kernels.test_rope import _cos_sin  # transformers' rotary module on packed or random positions

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
}


def _stock(q, k, wq, wk, cos, sin, eps, offset):
    """transformers' own ops: the norm in fp32 (Qwen3RMSNorm / Gemma3RMSNorm math), then the rotation."""
    return apply_rotary_pos_emb(
        rms_norm_reference(q, wq, eps, offset), rms_norm_reference(k, wk, eps, offset), cos, sin, unsqueeze_dim=2
    )


@pytest.mark.parametrize(
    "B,T,Hq,Hk,D,dtype,packed,offset,seed",
    [
        (2, 7, 4, 2, 16, torch.float32, False, 0.0, 1),  # per-row cos/sin [B, T, D]
        (1, 21, 16, 8, 32, torch.float32, True, 0.0, 2),  # packed positions (Qwen3's 2:1 heads)
        (1, 13, 5, 1, 24, torch.float16, True, 1.0, 3),  # odd heads, half dim 12, Gemma's 1 + w
        (3, 6, 6, 3, 64, torch.float16, False, 0.0, 4),
    ],
)
def test_matches_the_unfused_references_forward_and_backward(B, T, Hq, Hk, D, dtype, packed, offset, seed):
    cos, sin = _cos_sin(B, T, Hq, D, dtype, packed, seed)
    g = torch.Generator().manual_seed(seed + 100)
    proj_q = torch.randn(B, T, Hq * D, generator=g).mul(3).to(dtype).requires_grad_()
    proj_k = torch.randn(B, T, Hk * D, generator=g).to(dtype).requires_grad_()
    wq = (torch.rand(D, generator=g) + 0.5).to(dtype)
    wk = (torch.rand(D, generator=g) - 0.5).to(dtype)
    gq = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    gk = torch.randn(B, T, Hk, D, generator=g).to(dtype)

    def run(fn, upcast):
        proj_q.grad = proj_k.grad = None
        pq, pk = (proj_q.float(), proj_k.float()) if upcast else (proj_q * 1, proj_k * 1)
        q, k = pq.view(B, T, Hq, D), pk.view(B, T, Hk, D)  # the projection outputs viewed as heads
        w = (wq.float(), wk.float()) if upcast else (wq, wk)
        c = (cos.float(), sin.float()) if upcast else (cos, sin)
        qo, ko = fn(q, k, *w, *c, 1e-6, 1e-6, offset)
        ((qo.float() * gq.float()).sum() + (ko.float() * gk.float()).sum()).backward()
        return qo.detach(), ko.detach(), proj_q.grad.clone(), proj_k.grad.clone()

    reset_counters()
    got = run(qk_norm_rope, upcast=False)
    counts = reset_counters()
    assert counts.get("qk_norm_rope:triton") == 1 and counts.get("rope:triton") == 1
    assert counts.get("rmsnorm:triton") == 2
    # The reference in fp32 (the kernel's own precision), and the stock composition in the dtype.
    want = run(lambda *a: _stock(*a[:6], a[6], a[8]), upcast=True)
    for x, y in zip(got, want):
        assert x.dtype == dtype
        torch.testing.assert_close(x.float(), y.float(), **TOL[dtype])
    # The module's own reference function is the same math.
    ref = run(qk_norm_rope_reference, upcast=True)
    for x, y in zip(ref, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("warps", [1, 8])
def test_every_warp_count_matches(monkeypatch, warps):
    """The warp count (WARPS, bench.bandwidth's sweep) changes where the work runs, not what it computes."""
    import engine.kernels.qk_norm_rope as m

    g = torch.Generator().manual_seed(7)
    B, T, Hq, Hk, D = 1, 11, 4, 2, 16
    cos, sin = _cos_sin(B, T, Hq, D, torch.float32, True, 7)
    q, k = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    w = torch.rand(D, generator=g) + 0.5
    dq, dk = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)

    def both():
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        m._launch(q, k, qo, ko, qo, ko, w, w, cos, sin, 1e-6, 1e-6, 0.0, False)
        gq, gk = torch.empty_like(q), torch.empty_like(k)
        m._launch(q, k, dq, dk, gq, gk, w, w, cos, sin, 1e-6, 1e-6, 0.0, True)
        return qo, ko, gq, gk

    want = both()
    monkeypatch.setattr(m, "WARPS", {"forward": warps, "backward": warps})
    for x, y in zip(both(), want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_one_output_unused_and_inputs_left_alone():
    """k's output takes no part in the loss: its gradient arrives as None and dk is zero; the
    inputs are not rotated in place (unlike the plain RoPE kernel)."""
    B, T, H, D = 1, 9, 2, 8
    cos, sin = _cos_sin(B, T, H, D, torch.float32, False, 5)
    q = torch.randn(B, T, H, D, requires_grad=True)
    k = torch.randn(B, T, H, D, requires_grad=True)
    w = torch.ones(D)
    before = (q.detach().clone(), k.detach().clone())
    qo, ko = qk_norm_rope(q, k, w, w, cos, sin)
    assert torch.equal(q.detach(), before[0]) and torch.equal(k.detach(), before[1])
    qo.sum().backward()
    assert k.grad is not None and torch.count_nonzero(k.grad) == 0
    q2 = q.detach().clone().requires_grad_()
    ref_q, _ = qk_norm_rope_reference(q2, k.detach(), w, w, cos, sin)
    ref_q.sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-5, atol=1e-5)


def test_bad_shapes_name_what_does_not_fit():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="k_norm weight"):
        qk_norm_rope(q, k, torch.ones(8), torch.ones(6), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        qk_norm_rope(q, k, torch.ones(8), torch.ones(8), torch.randn(1, 5, 8), sin)
