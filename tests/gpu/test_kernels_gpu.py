"""The Triton kernels on a CUDA GPU at the reference workloads' shapes (16,384 tokens; hidden
1024 / 2048 / 4096; vocabulary 151,936 and 128,256), bf16 and fp32, forward and backward against
the torch references, plus a timing line per case against the reference (printed, not asserted).

Run on the GPU host:  python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -s
"""

import contextlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine.kernels.activations import (  # noqa: E402
    gated_act_backward,
    gated_act_backward_and_output,
    gated_act_forward,
    geglu,
    geglu_reference,
    swiglu,
    swiglu_reference,
)
from engine.kernels.fused_ce import (  # noqa: E402
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from engine.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from engine.kernels.rope import apply_rope, apply_rope_reference  # noqa: E402
from tests.gpu.timing import cuda_ms, rel  # noqa: E402

TOKENS = 16384
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
# Norm-relative error allowed on gradients that sum over many terms in a different order.
REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _strict_fp32():
    # fp32 comparisons mean fp32: no TF32 in either path.
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
    torch.cuda.empty_cache()


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _report(name, ms_ours, ms_ref, nbytes=None):
    bw = f", {nbytes / ms_ours / 1e6:.0f} GB/s" if nbytes else ""
    print(f"\n[timing] {name}: triton {ms_ours:.3f} ms, reference {ms_ref:.3f} ms ({ms_ref / ms_ours:.2f}x){bw}")


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape,offset,weight_grad",
    [
        ((1, TOKENS, 1024), 0.0, False),
        ((1, TOKENS, 2048), 1.0, True),
        ((1, TOKENS, 4096), 0.0, True),
        ((1, TOKENS, 16, 128), 0.0, False),  # Qwen3 q_norm over heads
    ],
)
def test_rmsnorm(shape, offset, weight_grad, dtype):
    g = _gen(1)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    w = (1.0 - offset + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype)
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)

    def run(fn):
        xi = x.clone().requires_grad_()
        wi = w.clone().requires_grad_(weight_grad)
        y = fn(xi, wi, 1e-6, offset)
        kind = type(y.grad_fn).__name__
        y.backward(dy)
        return y.detach(), xi.grad, wi.grad, kind

    y, dx, dw, kind = run(rms_norm)
    assert "RMSNormFunction" in kind  # the dispatcher chose the kernel on CUDA
    y_ref, dx_ref, dw_ref, _ = run(rms_norm_reference)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    if weight_grad:
        assert rel(dw, dw_ref) < REL[dtype]
    else:
        assert dw is None

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_(weight_grad)
    ms = cuda_ms(lambda: rms_norm(xg, wg, 1e-6, offset).backward(dy))
    ms_ref = cuda_ms(lambda: rms_norm_reference(xg, wg, 1e-6, offset).backward(dy))
    nbytes = 5 * x.numel() * x.element_size()  # fwd: read x, write y; bwd: read dy, x, write dx
    _report(f"rms_norm fwd+bwd {tuple(shape)} {dtype} dW={weight_grad}", ms, ms_ref, nbytes)


# ---------------------------------------------------------------- RoPE


def _cos_sin(T, D, dtype, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=32 * D, num_attention_heads=32, head_dim=D, rope_theta=theta)
    rot = LlamaRotaryEmbedding(cfg).cuda()
    lengths, total = [], 0
    gen = torch.Generator().manual_seed(2)
    while total < T:  # packed documents: positions restart at every start
        n = int(torch.randint(16, 2048, (1,), generator=gen))
        n = min(n, T - total)
        lengths.append(n)
        total += n
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
    return rot(torch.empty(1, device="cuda", dtype=dtype), pos)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,d,theta", [(16, 8, 128, 1e6), (32, 8, 64, 5e5), (40, 8, 128, 1e6)])
def test_rope(hq, hk, d, theta, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _cos_sin(TOKENS, d, dtype, theta)
    g = _gen(3)
    pq = torch.randn(1, TOKENS, hq * d, device="cuda", generator=g).to(dtype).requires_grad_()
    pk = torch.randn(1, TOKENS, hk * d, device="cuda", generator=g).to(dtype).requires_grad_()
    gq = torch.randn(1, TOKENS, hq, d, device="cuda", generator=g).to(dtype)
    gk = torch.randn(1, TOKENS, hk, d, device="cuda", generator=g).to(dtype)

    def run(fn):
        pq.grad = pk.grad = None
        q, k = (pq * 1).view(1, TOKENS, hq, d), (pk * 1).view(1, TOKENS, hk, d)
        qo, ko = fn(q, k, cos, sin)
        torch.autograd.backward((qo, ko), (gq, gk))
        return qo.detach(), ko.detach(), pq.grad.clone(), pk.grad.clone(), q.data_ptr() == qo.data_ptr()

    qo, ko, dq, dk, inplace = run(apply_rope)
    assert inplace
    ref = run(lambda q, k, c, s: apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=2))
    for a, b in zip((qo, ko, dq, dk), ref[:4]):
        torch.testing.assert_close(a, b, **TOL[dtype])

    q0, k0 = pq.detach().view(1, TOKENS, hq, d).clone(), pk.detach().view(1, TOKENS, hk, d).clone()
    ms = cuda_ms(lambda: apply_rope(q0, k0, cos, sin))
    ms_ref = cuda_ms(lambda: apply_rope_reference(q0, k0, cos, sin))
    _report(f"rope fwd Hq={hq} Hkv={hk} D={d} {dtype}", ms, ms_ref, 2 * (q0.numel() + k0.numel()) * q0.element_size())


# ---------------------------------------------------------------- SwiGLU / GeGLU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "inter,op",
    [(3072, "swiglu"), (8192, "swiglu"), (12288, "swiglu"), (8192, "geglu"), (8192, "geglu_tanh")],
)
def test_gated_activation(inter, op, dtype):
    if op == "swiglu":
        fn, ref_fn = swiglu, swiglu_reference
    else:
        approx = "tanh" if op == "geglu_tanh" else "none"
        fn = lambda g, u, **kw: geglu(g, u, approx, **kw)  # noqa: E731
        ref_fn = lambda g, u: geglu_reference(g, u, approx)  # noqa: E731
    g = _gen(4)
    gate0 = (3 * torch.randn(TOKENS, inter, device="cuda", generator=g)).to(dtype)
    up0 = torch.randn(TOKENS, inter, device="cuda", generator=g).to(dtype)
    dh = torch.randn(TOKENS, inter, device="cuda", generator=g).to(dtype)

    def run(f, grad, **kw):
        gl, ul = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        out = f(gl * 1, ul * 1, **kw)
        kind = type(out.grad_fn).__name__
        out.backward(grad)
        return gl.grad, ul.grad, kind

    h = fn(gate0, up0)
    torch.testing.assert_close(h, ref_fn(gate0, up0), **TOL[dtype])
    dg, du, kind = run(fn, dh, inplace_backward=True)
    assert "GatedActFunction" in kind
    # Gold gradients: autograd through the reference in fp32 on the same inputs.
    dg_ref, du_ref, _ = run(lambda a, b: ref_fn(a.float(), b.float()), dh.float())
    # The tanh-GELU derivative goes through tanh twice; Triton's tanh and torch's differ in
    # the last fp32 bits (seen on the H200: 14 of 134M elements off by 1.2e-5).
    tol = dict(TOL[dtype])
    if op == "geglu_tanh" and dtype == torch.float32:
        tol["atol"] = max(tol["atol"], 5e-5)
    torch.testing.assert_close(dg, dg_ref, **tol)
    torch.testing.assert_close(du, du_ref, **tol)

    # The LoRA MLP's backward pass: d_gate, d_up and h from one kernel, bit for bit as the
    # forward and backward kernels make them.
    kind = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}[op]
    g1, u1, dh1 = gate0.clone(), up0.clone(), dh.clone()
    dg1, du1, h1 = gated_act_backward_and_output(dh1, g1, u1, kind)
    assert torch.equal(h1, gated_act_forward(gate0, up0, kind))
    for a, b in zip((dg1, du1), gated_act_backward(dh, gate0, up0, kind)):
        assert torch.equal(a, b)

    gq, uq = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    ms = cuda_ms(lambda: fn(gq * 1, uq * 1, inplace_backward=True).backward(dh))
    ms_ref = cuda_ms(lambda: ref_fn(gq * 1, uq * 1).backward(dh))
    _report(f"{op} fwd+bwd [{TOKENS}, {inter}] {dtype} (incl. 2 copies)", ms, ms_ref)


# ---------------------------------------------------------------- fused linear cross-entropy


@contextlib.contextmanager
def _peak_extra():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = {}
    yield out
    torch.cuda.synchronize()
    out["bytes"] = torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden_size,vocab", [(1024, 151936), (2048, 128256), (4096, 151936)])
def test_fused_ce_frozen_head(hidden_size, vocab, dtype):
    g = _gen(5)
    n = TOKENS
    hidden = torch.randn(n, hidden_size, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) / hidden_size**0.5 * 2).to(dtype)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    targets[torch.rand(n, device="cuda", generator=g) < 0.25] = -100
    normalizer = torch.tensor(float((targets != -100).sum()) * 1.5, device="cuda")

    h = hidden.clone().requires_grad_()
    with _peak_extra() as peak:
        loss = fused_linear_cross_entropy(h, weight, targets, normalizer=normalizer)
        loss.backward()
    assert "FusedLinearCrossEntropy" in type(loss.grad_fn).__name__
    full_logits = n * vocab * hidden.element_size()
    assert peak["bytes"] < full_logits / 4, f"peak {peak['bytes'] / 2**20:.0f} MiB: logits materialized?"

    hr = hidden.clone().requires_grad_()
    loss_ref = fused_linear_cross_entropy_reference(hr, weight, targets, normalizer=normalizer)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=REL[dtype] / 2, atol=0)
    assert h.grad.dtype == dtype
    assert rel(h.grad, hr.grad) < REL[dtype]

    del loss_ref, hr
    torch.cuda.empty_cache()
    hb = hidden.clone().requires_grad_()
    ms = cuda_ms(lambda: fused_linear_cross_entropy(hb, weight, targets).backward(), iters=5, warmup=2)

    def hf_style():  # what HF does: logits in the model dtype, then fp32 cross-entropy
        logits = hb @ weight.t()
        torch.nn.functional.cross_entropy(logits.float(), targets).backward()

    ms_ref = cuda_ms(hf_style, iters=3, warmup=1)
    _report(
        f"fused CE fwd+bwd N={n} H={hidden_size} V={vocab} {dtype} "
        f"(peak extra {peak['bytes'] / 2**20:.0f} MiB) vs HF-style full logits",
        ms,
        ms_ref,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_ce_trained_head_bias_softcap(dtype):
    g = _gen(6)
    n, hs, vocab = 4096, 1024, 151936
    hidden = torch.randn(n, hs, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(vocab, hs, device="cuda", generator=g) / hs**0.5 * 2).to(dtype)
    bias = (0.5 * torch.randn(vocab, device="cuda", generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    targets[::5] = -100
    kw = dict(softcap=30.0, logit_scale=1.5, chunk_tokens=1000)

    def run(fn):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss = fn(h, w, targets, bias=b, **kw)
        loss.backward()
        return loss.detach(), h.grad, w.grad, b.grad

    out, ref = run(fused_linear_cross_entropy), run(fused_linear_cross_entropy_reference)
    torch.testing.assert_close(out[0], ref[0], rtol=REL[dtype] / 2, atol=0)
    for a, b in zip(out[1:], ref[1:]):
        assert a.dtype == dtype
        assert rel(a, b) < REL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["dB", "dA"])
@pytest.mark.parametrize("out", [1024, 2048, 6144, 12288 * 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rank_grad_at_real_shapes(out, dtype, transposed):
    """s a^T b over 16,384 tokens, a a column slice of a wider buffer (side-by-side gradients, an input
    with spare columns): the split kernel against the fp64 product (bf16 tl.dot is only right on a
    GPU), as dB ([out, r]) and as dA ([r, in], transposed)."""
    from engine.kernels.rank_grad import rank_grad_reference, rank_grad_triton

    g = torch.Generator(device="cuda").manual_seed(out)
    wide = torch.randn(16384, out + 128, device="cuda", dtype=dtype, generator=g)
    a = wide[:, 128:]
    b = torch.randn(16384, 48, device="cuda", dtype=dtype, generator=g)[:, 16:32]
    # The kernel itself (rank_grad dispatches to it only when it is switched on). cuBLAS's reference
    # rounds the product to the inputs' dtype before the fp32 cast (1.7e-3 in bf16, 2.1e-4 in fp16 on
    # an H100): the kernel's fp32 sums are held to fp32 accuracy.
    got = rank_grad_triton(a, b, 2.0, torch.float32, transposed=transposed)
    want = 2.0 * a.double().t() @ b.double()
    want = want.t() if transposed else want
    err = rel(got.double(), want)
    ref_err = rel(rank_grad_reference(a, b, 2.0, torch.float32, transposed=transposed).double(), want)
    print(f"rank_grad out={out} {dtype} transposed={transposed}: rel err {err:.2e} (cuBLAS {ref_err:.2e})")
    assert err < 5e-5 and got.dtype == torch.float32 and got.is_contiguous() and got.shape == want.shape


@pytest.mark.gpu
@pytest.mark.parametrize("out,rank,width", [(1024, 16, 16), (2048, 16, 16), (1024, 12, 16), (4096, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_rows_at_real_shapes(out, rank, width, dtype):
    """[dy | dy sB | 0] over 16,384 rows (o's and down's input gradient folded by rows): dy copied bit
    for bit, dy sB no further from the fp64 product than cuBLAS's own bf16/fp16 GEMM (bf16 tl.dot is
    only right on a GPU), the alignment columns zero."""
    from engine.kernels.wide_rows import wide_rows, wide_rows_reference

    g = torch.Generator(device="cuda").manual_seed(out + rank)
    dy = torch.randn(16384, out, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(out, rank, device="cuda", dtype=dtype, generator=g) / out**0.5
    got = wide_rows(dy, b, width)
    assert torch.equal(got[:, :out], dy) and not got[:, out + rank :].any()
    want = dy.double() @ b.double()
    err = rel(got[:, out : out + rank].double(), want)
    ref_err = rel(wide_rows_reference(dy, b, width)[:, out : out + rank].double(), want)
    print(f"wide_rows out={out} r={rank} {dtype}: rel err {err:.2e} (cuBLAS {ref_err:.2e})")
    assert err <= 1.25 * ref_err + 1e-6


@pytest.mark.gpu
def test_row_folded_input_gradient_at_w1_shapes(monkeypatch):
    """o_proj (2,048 -> 1,024) and down_proj (3,072 -> 1,024) of Qwen3-0.6B in bf16, a PEFT adapter of
    rank 16, 16,384 tokens: [dy | dy sB] [W; A] in one GEMM against (dy sB) A then dy W, each against
    the fp64 truth; g = dy sB as the two-pass path makes it."""
    from peft import LoraConfig, get_peft_model

    from engine.fastpath import lora_fold
    from engine.fastpath.lora_group import LoRAGroup, lora_parts

    class Proj(torch.nn.Module):
        def __init__(self, k_in):
            super().__init__()
            self.proj = torch.nn.Linear(k_in, 1024, bias=False)

    monkeypatch.setenv("TUNESMITH_FOLD_ROWS", "1")  # the default; set in case the environment says 0
    torch.manual_seed(0)
    for k_in in (2048, 3072):
        model = get_peft_model(Proj(k_in), LoraConfig(r=16, lora_alpha=32, target_modules=["proj"]))
        model = model.to("cuda", torch.bfloat16)
        torch.nn.init.normal_(model.base_model.model.proj.lora_B["default"].weight, std=0.1)
        group = LoRAGroup([lora_parts(model.base_model.model.proj)])
        assert lora_fold.fold_rows(group, True)
        a_all, (sb,), _ = group.weights(group.ab(), torch.bfloat16)  # writes A below W
        w = group.bases[0].weight
        dy = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16)
        truth = dy.double() @ w.double() + (dy.double() @ sb.double()) @ a_all.double()
        g_two = torch.mm(dy, sb)
        two_pass = torch.mm(g_two, a_all).addmm_(dy, w)
        dx, g = lora_fold.backward_dx_rows(group, dy, sb)
        err, ref_err = rel(dx.double(), truth), rel(two_pass.double(), truth)
        print(f"row-folded dx k_in={k_in}: rel err {err:.2e} (two passes {ref_err:.2e})")
        assert err <= 1.25 * ref_err + 1e-6
        assert rel(g.double(), g_two.double()) < 1e-2
