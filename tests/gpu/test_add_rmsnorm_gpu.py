"""The fused residual add + RMSNorm (engine.kernels.add_rmsnorm) on a CUDA GPU at the real shapes:
16,384 tokens at Qwen3-0.6B's hidden 1024 and Qwen3-8B's 4096 (Gemma's 1 + w too), bf16 and fp32,
forward and backward against the torch reference and against the stock pair (residual + x, then
transformers' Qwen3RMSNorm); h bit for bit (the GPU rounds to nearest, as torch's add does), plus a
timing line against the unfused kernels (printed, not asserted), and one patched Qwen3 layer's
step with the fusion on and off.

Run on the GPU host:  python -m pytest -m gpu tests/gpu/test_add_rmsnorm_gpu.py -q -s
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine.kernels.add_rmsnorm import add_rms_norm, add_rms_norm_reference  # noqa: E402
from engine.kernels.rmsnorm import rms_norm  # noqa: E402
from tests.gpu.timing import cuda_ms, rel  # noqa: E402

TOKENS = 16384
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(hidden, dtype, offset):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    shape = (1, TOKENS, hidden)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    r = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    w = (1.0 - offset + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    dh = torch.randn(shape, device="cuda", generator=g).to(dtype)
    return x, r, w, dy, dh


def _run(fn, x, r, w, dy, dh, offset, weight_grad):
    xi, ri = x.clone().requires_grad_(), r.clone().requires_grad_()
    wi = w.clone().requires_grad_(weight_grad)
    y, h = fn(xi, ri, wi, 1e-6, offset)
    kind = type(y.grad_fn).__name__
    torch.autograd.backward((y, h), (dy, dh))
    return y.detach(), h.detach(), xi.grad, ri.grad, wi.grad, kind


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,offset,weight_grad", [(1024, 0.0, False), (4096, 0.0, False), (2048, 1.0, True)])
def test_add_rmsnorm(hidden, offset, weight_grad, dtype):
    x, r, w, dy, dh = _inputs(hidden, dtype, offset)
    y, h, dx, dr, dw, kind = _run(add_rms_norm, x, r, w, dy, dh, offset, weight_grad)
    assert "AddRMSNormFunction" in kind  # the dispatcher chose the kernel on CUDA
    y_ref, h_ref, dx_ref, dr_ref, dw_ref, _ = _run(add_rms_norm_reference, x, r, w, dy, dh, offset, weight_grad)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    torch.testing.assert_close(dr, dr_ref, **TOL[dtype])
    assert rel(dx, dx_ref) < REL[dtype]
    if weight_grad:
        assert rel(dw, dw_ref) < REL[dtype]
    else:
        assert dw is None

    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()

    def fused():
        torch.autograd.backward(add_rms_norm(xg, rg, w, 1e-6, offset), (dy, dh))

    def unfused():  # the stock add around the RMSNorm kernel: 2 launches forward, 3 backward
        h = rg + xg
        torch.autograd.backward((rms_norm(h, w, 1e-6, offset), h), (dy, dh))

    ms, ms_ref = cuda_ms(fused), cuda_ms(unfused)
    print(f"\n[timing] add_rms_norm fwd+bwd {hidden} {dtype}: fused {ms:.3f} ms, add + rms_norm {ms_ref:.3f} ms")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_matches_the_stock_add_and_qwen3_norm_in_bf16(hidden):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, r, w, dy, dh = _inputs(hidden, torch.bfloat16, 0.0)
    norm = Qwen3RMSNorm(hidden, eps=1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    norm.weight.requires_grad_(False)

    def stock(x, r, w, eps, offset):
        h = r + x
        return norm(h), h

    y, h, dx, dr, _, _ = _run(add_rms_norm, x, r, norm.weight, dy, dh, 0.0, False)
    y_ref, h_ref, dx_ref, dr_ref, _, _ = _run(stock, x, r, norm.weight, dy, dh, 0.0, False)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])
    assert rel(dx, dx_ref) < 1e-2 and rel(dr, dr_ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_patched_qwen3_step_with_and_without_the_fusion(checkpointing):
    """A 4-layer Qwen3 at 0.6B's width, bf16, 4,096 packed tokens: same loss and LoRA gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config import FastPathConfig, LoraConfig
    from engine.counters import reset_counters, split_counts
    from engine.data.collate import PackedBatch
    from engine.models.lora import attach_lora
    from engine.train.step import forward_loss, prepare_model

    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 151936, (n,), generator=g).tolist() for n in (1500, 700, 1200, 696)]
    b = PackedBatch.from_documents(docs).to(torch.device("cuda"))
    out = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda()
        model = attach_lora(model, LoraConfig(r=16, alpha=16.0, dropout=0.0))
        prepared = prepare_model(
            model, FastPathConfig(add_rmsnorm=fused), torch.device("cuda"), gradient_checkpointing=checkpointing
        )
        assert prepared.report["add_rmsnorm"] == ("on" if fused else "off: fast_paths.add_rmsnorm is false")
        model.train()
        reset_counters()
        loss = forward_loss(prepared, b, normalizer=b.num_trained_tokens)
        loss.backward()
        calls, fallbacks = split_counts(reset_counters())
        assert fallbacks == {}
        assert calls.get("add_rmsnorm:triton", 0) == (4 * (2 if checkpointing else 1) if fused else 0)
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
        out[fused] = (loss.item(), grads)
        del model, prepared
        torch.cuda.empty_cache()
    (l1, g1), (l0, g0) = out[True], out[False]
    assert abs(l1 - l0) <= 1e-2 * abs(l0)
    worst = max(rel(g1[n], g0[n]) for n in g0)
    print(f"\n[add_rmsnorm] loss fused {l1:.5f} unfused {l0:.5f}; worst LoRA grad rel diff {worst:.2e}")
    assert worst < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,offset,weight_grad", [(1024, 0.0, False), (2048, 1.0, True)])
def test_rms_norm_passing(hidden, offset, weight_grad, dtype):
    # A layer's input norm returning (rmsnorm(x), x): x's gradient is the norm's plus the residual's,
    # added in the backward kernel, against the reference norm and autograd's add.
    from engine.kernels.add_rmsnorm import rms_norm_passing
    from engine.kernels.rmsnorm import rms_norm_reference

    x, _, w, dy, dh = _inputs(hidden, dtype, offset)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)
        y, passed = fn(xi, wi)
        kind = type(passed.grad_fn).__name__
        torch.autograd.backward((y, passed * 1), (dy, dh))
        return y.detach(), xi.grad, wi.grad, kind

    y, dx, dw, kind = run(lambda x, w: rms_norm_passing(x, w, 1e-6, offset))
    assert "RMSNormPassingFunction" in kind  # the dispatcher chose the kernel on CUDA
    y_ref, dx_ref, dw_ref, _ = run(lambda x, w: (rms_norm_reference(x, w, 1e-6, offset), x))
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    assert rel(dx, dx_ref) < REL[dtype]
    if weight_grad:
        assert rel(dw, dw_ref) < REL[dtype]
