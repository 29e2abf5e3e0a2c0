"""MoE expert-row kernels (engine.kernels.moe): the gated activation forward, its one-pass
backward and the gather-combine, each through Triton's interpreter on a CPU against its torch
reference, for Qwen3-MoE's SiLU-GLU ([gate | up]) and GPT-OSS's clamped, interleaved, biased
GLU. fp32 and fp16 only: the interpreter computes bf16 wrongly in places."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import moe as K

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("needs TRITON_INTERPRET=1 without a GPU", allow_module_level=True)
if not K.TRITON_AVAILABLE:
    pytest.skip("triton is not installed", allow_module_level=True)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
N_EXP = 4
# (layout, act, alpha, limit, bias): the two architectures, and each feature on its own.
VARIANTS = {
    "qwen3_moe": ("concat", "silu", 0.0, 0.0, False),
    "gpt_oss": ("interleaved", "gptoss", 1.702, 0.75, True),
    "silu_interleaved_bias": ("interleaved", "silu", 0.0, 0.0, True),
    "gptoss_concat": ("concat", "gptoss", 1.702, 0.75, False),
}


def _glu_inputs(rows, inter, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    gu = (2 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)  # past the clamp limits
    eid = torch.randint(0, N_EXP, (rows,), generator=gen)
    b = torch.randn(N_EXP, 2 * inter, generator=gen).to(dtype) if bias else None
    gd = torch.randn(rows, inter, generator=gen).to(dtype)
    w_s = torch.rand(rows, generator=gen).to(dtype)
    return gu, (eid if bias else None), b, gd, w_s


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(37, 24), (3, 1030)])  # 1030: a second, masked column block
def test_glu_forward_matches_reference(variant, dtype, rows, inter):
    layout, act, alpha, limit, bias = VARIANTS[variant]
    gu, eid, b, _, _ = _glu_inputs(rows, inter, dtype, bias, 1)
    kw = dict(layout=layout, act=act, alpha=alpha, limit=limit)
    h_k = K.glu_forward_triton(gu, eid, b, **kw)
    h_r = K.glu_forward_reference(gu, eid, b, **kw)
    assert h_k.shape == (rows, inter) and h_k.dtype == dtype
    torch.testing.assert_close(h_k, h_r, **TOL[dtype])
    torch.testing.assert_close(K.glu_forward(gu, eid, b, **kw, use_triton=True), h_k, rtol=0, atol=0)
    torch.testing.assert_close(K.glu_forward(gu, eid, b, **kw), h_r, rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(37, 24), (3, 1030)])  # 1030: the row loop runs twice
def test_glu_backward_matches_reference(variant, dtype, rows, inter):
    layout, act, alpha, limit, bias = VARIANTS[variant]
    gu, eid, b, gd, w_s = _glu_inputs(rows, inter, dtype, bias, 2)
    kw = dict(layout=layout, act=act, alpha=alpha, limit=limit)
    saved = gu.clone()
    dgu_r, dot_r = K.glu_backward_reference(gd, w_s, gu, eid, b, **kw, need_dot=True)
    assert gu.equal(saved)  # the reference leaves the saved products alone
    dgu_k, dot_k = K.glu_backward_triton(gd, w_s, gu, eid, b, **kw, need_dot=True)
    assert dgu_k is gu  # the kernel writes d gate/up over them
    torch.testing.assert_close(dgu_k, dgu_r, **TOL[dtype])
    torch.testing.assert_close(dot_k, dot_r, rtol=1e-4, atol=1e-3)
    # Without the dot: the same gradients, and no dot at all.
    g2, none = K.glu_backward(gd, w_s, saved.clone(), eid, b, **kw, need_dot=False, use_triton=True)
    assert none is None and K.glu_backward(gd, w_s, saved, eid, b, **kw, need_dot=False)[1] is None
    torch.testing.assert_close(g2, dgu_k, rtol=0, atol=0)


def test_glu_backward_reference_is_autograd_of_forward():
    # The hand-written reference gradient against autograd through the forward reference.
    for layout, act, alpha, limit, bias in VARIANTS.values():
        gu, eid, b, gd, w_s = _glu_inputs(9, 20, torch.float32, bias, 3)
        kw = dict(layout=layout, act=act, alpha=alpha, limit=limit)
        x = gu.clone().requires_grad_()
        h = K.glu_forward_reference(x, eid, b, **kw)
        h.backward(gd * w_s[:, None])
        dgu, dot = K.glu_backward_reference(gd, w_s, gu, eid, b, **kw)
        torch.testing.assert_close(dgu, x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dot, (gd * h.detach()).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_tok,k,cols", [(12, 3, 40), (5, 1, 1030), (7, 4, 16)])
def test_combine_matches_reference(dtype, n_tok, k, cols):
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(n_tok * k, cols, generator=gen).to(dtype)
    inv = torch.randperm(n_tok * k, generator=gen)
    w = torch.rand(n_tok, k, generator=gen).to(dtype)
    base = torch.randn(n_tok, cols, generator=gen)  # fp32, as the GPT-OSS down bias term is
    for ww, bb in ((w, base), (w, None), (None, None)):
        got = K.combine_triton(src, inv, ww, bb, n_tok, k, dtype)
        ref = K.combine_reference(src, inv, ww, bb, n_tok, k, dtype)
        assert got.dtype == ref.dtype == dtype
        torch.testing.assert_close(got, ref, **TOL[dtype])
        torch.testing.assert_close(K.combine(src, inv, ww, bb, n_tok, k, dtype, use_triton=True), got, rtol=0, atol=0)


def test_combine_reads_a_strided_source_and_handles_no_tokens():
    src = torch.randn(6, 32)[:, ::2]  # non-unit last stride: copied before the launch
    inv = torch.randperm(6)
    torch.testing.assert_close(
        K.combine_triton(src, inv, None, None, 3, 2, torch.float32),
        K.combine_reference(src, inv, None, None, 3, 2, torch.float32),
    )
    empty = torch.empty(0, 8)
    assert K.combine_triton(empty, torch.empty(0, dtype=torch.int64), None, None, 0, 2, torch.float32).shape == (0, 8)
    assert K.glu_forward_triton(torch.empty(0, 8), None, None, layout="concat", act="silu").shape == (0, 4)
