"""Varlen attention kernel (Triton; through the interpreter on CPU) against per-document SDPA.

Forward and backward (dQ, dK, dV) in fp32 and fp16. bf16 is left to the GPU tests: the Triton
interpreter here computes tl.dot on bf16 operands wrongly.
"""

import pytest
import torch

from engine.fastpath.packed import PackedSeqInfo
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3)}


def _compare(lengths, hq, hkv, d, dtype, *, blocks=None, use_info=True, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths)
    t = info.total_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v, do = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, hq, d)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention_triton(
        qt,
        kt,
        vt,
        info.cu_seqlens,
        info.max_seqlen,
        blocks=blocks,
        tables=info.block_table if use_info else None,
        covers_all_tokens=use_info,
        **kw,
    )
    out.backward(do)
    # The reference runs in fp32 on the same (rounded) inputs: it is the truth for both dtypes.
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen, **kw)
    ref.backward(do.float())
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (t, hq, d)
    for name, got, want in (
        ("out", out, ref),
        ("dq", qt.grad, qr.grad),
        ("dk", kt.grad, kr.grad),
        ("dv", vt.grad, vr.grad),
    ):
        scale = max(want.abs().max().item(), 1.0)
        err = (got.float() - want).abs().max().item()
        assert err <= atol * scale + rtol * scale, f"{name}: max error {err:.3e} (scale {scale:.2f})"


CASES = [
    # lengths, hq, hkv, d, extra kwargs
    pytest.param([37], 2, 2, 16, {}, id="one-doc"),  # not a block multiple
    pytest.param([5, 1, 20, 1, 37], 4, 2, 16, {}, id="one-token-docs-gqa2"),
    pytest.param([1] * 9 + [3, 2, 4], 2, 1, 16, {}, id="tiny-docs-mqa"),
    pytest.param([17, 33, 8], 4, 1, 32, {"scale": 0.3}, id="gqa4-scale-d32"),
    pytest.param([40, 7, 26], 2, 1, 16, {"sliding_window": 7}, id="window"),
    pytest.param([3, 30, 17], 2, 2, 16, {"softcap": 5.0}, id="softcap"),
    pytest.param([9, 31, 24], 4, 2, 16, {"sliding_window": 5, "softcap": 2.0}, id="window-softcap"),
    pytest.param([12, 19], 2, 1, 16, {"causal": False}, id="bidirectional"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lengths,hq,hkv,d,kw", CASES)
def test_matches_reference(lengths, hq, hkv, d, kw, dtype):
    _compare(lengths, hq, hkv, d, dtype, **kw)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_uneven_block_pairs(blocks):
    # Query and key tiles of different sizes exercise the masked/unmasked phase boundaries.
    _compare([5, 1, 40, 37, 16], 4, 2, 16, torch.float32, blocks=blocks)
    _compare([50, 3], 2, 1, 16, torch.float32, blocks=blocks, sliding_window=9)


def test_device_built_tables():
    # Without PackedSeqInfo the tables come from cu_seqlens on the device (padded, sync-free).
    _compare([5, 1, 20, 37], 4, 2, 16, torch.float32, use_info=False, seed=1)


def test_head_dim_64():
    _compare([20, 13], 2, 1, 64, torch.float32, seed=2)


def test_strided_inputs_and_no_cross_document_leak():
    # q/k/v as transposed views of [T, H, D] storage (the layout transformers hands over), and a
    # perturbation of one document must leave every other document's output untouched.
    info = PackedSeqInfo.from_lengths([6, 11, 5])
    t, h, d = info.total_tokens, 2, 16
    base = torch.randn(3, h, t, d)
    q, k, v = (x.transpose(0, 1) for x in base)  # [T, H, D], non-contiguous
    assert not q.is_contiguous()
    out = varlen_attention_triton(q, k, v, info.cu_seqlens, tables=info.block_table)
    ref = varlen_attention_reference(q, k, v, info.cu_seqlens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    base2 = base.clone()
    base2[:, :, 6:17] += 1.0  # only document 2
    q2, k2, v2 = (x.transpose(0, 1) for x in base2)
    out2 = varlen_attention_triton(q2, k2, v2, info.cu_seqlens, tables=info.block_table)
    torch.testing.assert_close(out2[:6], out[:6])
    torch.testing.assert_close(out2[17:], out[17:])
    assert (out2[6:17] - out[6:17]).abs().max() > 1e-3


def test_rejects_bad_shapes():
    info = PackedSeqInfo.from_lengths([4])
    q = torch.randn(4, 3, 16)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention_triton(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), info.cu_seqlens)
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention_triton(torch.randn(4, 2, 24), torch.randn(4, 2, 24), torch.randn(4, 2, 24), info.cu_seqlens)
