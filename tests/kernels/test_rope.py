"""RoPE: the in-place Triton rotation (through the interpreter on a CPU) against transformers'
apply_rotary_pos_emb with cos/sin from its own rotary module, forward and backward."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.kernels.rope import apply_rope, apply_rope_reference, apply_rope_triton, rope_reference

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _cos_sin(B, T, Hq, D, dtype, packed, seed):
    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, head_dim=D, rope_theta=10000.0)
    rot = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(seed)
    if packed:  # one packed row: positions restart at every document start
        pos = torch.cat([torch.arange(n) for n in (5, T - 8, 3)])[None]
    else:
        pos = torch.randint(0, 4096, (B, T), generator=g)
    return rot(torch.empty(1, dtype=dtype), pos)


def _hf(q, k, cos, sin):
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)


@pytest.mark.parametrize(
    "B,T,Hq,Hk,D,dtype,packed,seed",
    [
        (2, 7, 4, 2, 16, torch.float32, False, 1),  # per-row cos/sin [B, T, D]
        (1, 21, 40, 8, 64, torch.float32, True, 2),  # packed positions, 40 heads in blocks of 8
        (1, 13, 5, 1, 24, torch.float16, True, 3),  # odd heads, half dim 12 (masked lanes)
        (3, 6, 6, 3, 32, torch.bfloat16, False, 4),
    ],
)
def test_forward_backward_through_views(B, T, Hq, Hk, D, dtype, packed, seed):
    cos, sin = _cos_sin(B, T, Hq, D, dtype, packed, seed)
    if packed:
        assert cos.shape[0] == 1 and B == 1
    g = torch.Generator().manual_seed(seed + 100)
    proj_q = torch.randn(B, T, Hq * D, generator=g).to(dtype).requires_grad_()
    proj_k = torch.randn(B, T, Hk * D, generator=g).to(dtype).requires_grad_()
    gq = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    gk = torch.randn(B, T, Hk, D, generator=g).to(dtype)

    def run(fn):
        proj_q.grad = proj_k.grad = None
        q = (proj_q * 1).view(B, T, Hq, D)  # the projection output viewed as heads
        k = (proj_k * 1).view(B, T, Hk, D)
        qo, ko = fn(q, k, cos, sin)
        ((qo.float() * gq.float()).sum() + (ko.float() * gk.float()).sum()).backward()
        return q, qo.detach(), ko.detach(), proj_q.grad.clone(), proj_k.grad.clone()

    q_in, qo, ko, dq, dk = run(apply_rope_triton)
    assert qo.data_ptr() == q_in.data_ptr()  # rotated in place
    _, qr, kr, dqr, dkr = run(_hf)
    for a, b in ((qo, qr), (ko, kr), (dq, dqr), (dk, dkr)):
        torch.testing.assert_close(a, b, **TOL[dtype])


def _graph_node_names(t: torch.Tensor) -> set:
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def test_whole_views_rotate_their_projection_outputs_without_copy_slices():
    """q = q_proj(x).view(B, T, H, D): the kernel rotates the projection output itself, so autograd
    does not rebase the view on CopySlices (whose backward clones, zero-fills and copies every
    gradient); q and k split from one fused projection still rotate as views, with the same values.
    The backward leaves the incoming gradients alone (they may be shared, here the caller's own)."""
    B, T, Hq, Hk, D = 1, 11, 4, 2, 16
    cos, sin = _cos_sin(B, T, Hq, D, torch.float32, True, 10)
    g = torch.Generator().manual_seed(11)
    proj = torch.randn(B, T, (Hq + Hk) * D, generator=g).requires_grad_()
    gq, gk = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    results = {}
    for form in ("whole", "split", "reference"):
        proj.grad = None
        y = proj * 1
        if form == "split":  # slices of one fused output: not whole, so rotated as views
            q, k = y[..., : Hq * D].view(B, T, Hq, D), y[..., Hq * D :].view(B, T, Hk, D)
        else:  # separate projection outputs, each viewed whole
            q, k = y[..., : Hq * D].contiguous().view(B, T, Hq, D), y[..., Hq * D :].contiguous().view(B, T, Hk, D)
        fn = _hf if form == "reference" else apply_rope_triton
        qo, ko = fn(q, k, cos, sin)
        names = _graph_node_names(qo) | _graph_node_names(ko)
        if form == "whole":
            assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()  # still in place
            assert not any("CopySlices" in n for n in names), sorted(names)
        elif form == "split":
            assert any("CopySlices" in n for n in names)
        gq_before, gk_before = gq.clone(), gk.clone()
        torch.autograd.backward((qo, ko), (gq, gk))  # the caller's own gradients: only read
        assert torch.equal(gq, gq_before) and torch.equal(gk, gk_before)
        results[form] = (qo.detach(), ko.detach(), proj.grad.clone())
    for form in ("whole", "split"):
        for a, b in zip(results[form], results["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_owned_tensors_and_unused_k():
    # q and k that own their storage take the one-launch pair path; k unused gives dk = None.
    B, T, Hq, Hk, D = 2, 9, 6, 2, 32
    cos, sin = _cos_sin(B, T, Hq, D, torch.float32, False, 5)
    g = torch.Generator().manual_seed(6)
    q0 = torch.randn(B, T, Hq, D, generator=g)
    k0 = torch.randn(B, T, Hk, D, generator=g)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    qa, ka = q * 1, k * 1
    qo, ko = apply_rope_triton(qa, ka, cos, sin)
    assert qo.data_ptr() == qa.data_ptr() and ko.data_ptr() == ka.data_ptr()
    # A non-contiguous upstream gradient (as from the head transpose before attention).
    gq = torch.randn(B, Hq, T, D, generator=g)
    (qo.transpose(1, 2) * gq).sum().backward()
    qr = q0.clone().requires_grad_()
    qr_out, kr_out = _hf(qr, k0, cos, sin)
    (qr_out.transpose(1, 2) * gq).sum().backward()
    torch.testing.assert_close(qo, qr_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, kr_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, qr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, torch.zeros_like(k0), rtol=0, atol=0)


def test_reference_matches_transformers():
    cos, sin = _cos_sin(2, 5, 4, 16, torch.float32, False, 7)
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    for a, b in zip(apply_rope_reference(q, k, cos, sin), _hf(q, k, cos, sin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The uncounted math (engine.models.patches' rotation when the rope kernel is off) is the
    # stock rotation bit for bit in bf16 too.
    cos, sin = cos.bfloat16(), sin.bfloat16()
    q, k = q.bfloat16(), k.bfloat16()
    for a, b in zip(rope_reference(q, k, cos, sin), _hf(q, k, cos, sin)):
        assert a.equal(b)


def test_dispatcher_uses_reference_on_cpu():
    cos, sin = _cos_sin(1, 6, 2, 8, torch.float32, False, 8)
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 1, 8)
    q_before = q.clone()
    qo, ko = apply_rope(q, k, cos, sin)
    assert qo.data_ptr() != q.data_ptr()
    torch.testing.assert_close(q, q_before, rtol=0, atol=0)  # the reference leaves inputs alone
    torch.testing.assert_close(qo, _hf(q, k, cos, sin)[0], rtol=0, atol=0)


def test_rejects_bad_shapes():
    cos, sin = torch.ones(1, 4, 8), torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="does not fit"):
        apply_rope_triton(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 1, 8), cos, sin)
    with pytest.raises(ValueError, match="does not match"):
        apply_rope_triton(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 6), cos, sin)


def test_backward_is_exact_transpose_for_arbitrary_cos_sin():
    # With unrelated cos/sin halves the backward must still be the transpose of the forward map
    # (what autograd derives from the reference), not just a rotation by -theta.
    g = torch.Generator().manual_seed(9)
    B, T, Hq, Hk, D = 2, 5, 3, 1, 12
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    proj_q = torch.randn(B, T, Hq * D, generator=g).requires_grad_()
    proj_k = torch.randn(B, T, Hk * D, generator=g).requires_grad_()
    gq, gk = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    grads = []
    for fn in (apply_rope_triton, apply_rope_reference):
        proj_q.grad = proj_k.grad = None
        qo, ko = fn((proj_q * 1).view(B, T, Hq, D), (proj_k * 1).view(B, T, Hk, D), cos, sin)
        ((qo * gq).sum() + (ko * gk).sum()).backward()
        grads.append((qo.detach(), proj_q.grad.clone(), proj_k.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
