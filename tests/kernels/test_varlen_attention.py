"""Varlen attention kernel (Triton; through the interpreter on CPU) against per-document SDPA.

Forward and backward (dQ, dK, dV) in fp32 and fp16. bf16 is left to the GPU tests: the Triton
interpreter here computes tl.dot on bf16 operands wrongly.
"""

import pytest
import torch

from engine.fastpath.packed import PackedSeqInfo
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3)}


def _compare(lengths, hq, hkv, d, dtype, *, blocks=None, use_info=True, seed=0, sinks=None, backward=None, **kw):
    """Kernel against the fp32 reference: output and every gradient (the sinks' too, when given;
    their reference gradient is returned)."""
    gen = torch.Generator().manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths)
    t = info.total_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v, do = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, hq, d)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    st = sinks.clone().requires_grad_() if sinks is not None else None
    out = varlen_attention_triton(
        qt,
        kt,
        vt,
        info.cu_seqlens,
        info.max_seqlen,
        blocks=blocks,
        tables=info.block_table if use_info else None,
        covers_all_tokens=use_info,
        sinks=st,
        backward=backward,
        **kw,
    )
    out.backward(do)
    # The reference runs in fp32 on the same (rounded) inputs: it is the truth for both dtypes.
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    sr = sinks.clone().requires_grad_() if sinks is not None else None
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen, sinks=sr, **kw)
    ref.backward(do.float())
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (t, hq, d)
    pairs = [("out", out, ref), ("dq", qt.grad, qr.grad), ("dk", kt.grad, kr.grad), ("dv", vt.grad, vr.grad)]
    if sinks is not None:
        pairs.append(("dsinks", st.grad, sr.grad))
    for name, got, want in pairs:
        scale = max(want.abs().max().item(), 1.0)
        err = (got.float() - want).abs().max().item()
        assert err <= atol * scale + rtol * scale, f"{name}: max error {err:.3e} (scale {scale:.2f})"
    return sr.grad if sinks is not None else None


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_head_dim_512_as_gemma4_global_layers(dtype):
    # The widest the kernels tile (its GPU launches take the fixed small-tile configs); with a
    # window and a softcap so every masked path runs at this width too.
    _compare([21, 3, 12], 2, 1, 512, dtype, seed=4)
    _compare([21, 3, 12], 2, 1, 512, dtype, seed=5, sliding_window=6, softcap=3.0)


def test_head_dims_past_the_widest_tile_are_refused():
    q = torch.zeros(4, 1, 1024)
    with pytest.raises(ValueError, match=r"head_dim must be a power of two in \[16, 512\], got 1024"):
        varlen_attention_triton(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4)


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


# -- attention sinks (GPT-OSS): one logit per query head in every row's softmax, with no value ---


def _hf_sink_attention(q, k, v, sinks, lengths, sliding_window=None):
    """transformers' own GPT-OSS eager attention, one document at a time: the truth the reference
    and the kernel answer to."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, hq // hkv
    module.eval()
    outs, s = [], 0
    for n in lengths:
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        keep = (j <= i) & ((i - j) < sliding_window if sliding_window else True)
        mask = torch.zeros(n, n).masked_fill(~keep, float("-inf"))[None, None]
        x = [t[s : s + n].transpose(0, 1)[None] for t in (q, k, v)]
        out, _ = eager_attention_forward(module, *x, mask, scaling=d**-0.5)
        outs.append(out[0])
        s += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
def test_the_reference_with_sinks_is_transformers_gpt_oss_attention(window):
    lengths = [7, 1, 19]
    gen = torch.Generator().manual_seed(5)
    t = sum(lengths)
    q, k, v = torch.randn(t, 4, 16, generator=gen), torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, 16)
    sinks = torch.tensor([0.0, 2.5, -3.0, 8.0])  # a sink far above the scores takes most of a row
    info = PackedSeqInfo.from_lengths(lengths)
    got = varlen_attention_reference(q, k, v, info.cu_seqlens, sinks=sinks, sliding_window=window)
    torch.testing.assert_close(got, _hf_sink_attention(q, k, v, sinks, lengths, window), atol=1e-5, rtol=1e-5)
    plain = varlen_attention_reference(q, k, v, info.cu_seqlens, sliding_window=window)
    assert (got - plain).abs().max() > 1e-2  # the sinks do something


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "lengths,hq,hkv,kw",
    [
        pytest.param([5, 1, 40, 23], 4, 2, {}, id="gqa2"),
        pytest.param([40, 7, 26], 2, 1, {"sliding_window": 7}, id="window"),
        pytest.param([33, 9], 2, 2, {"scale": 0.2}, id="scale"),
    ],
)
@pytest.mark.parametrize(
    "use_info,backward", [(True, "split"), (False, "split"), (True, "onepass")], ids=["host", "device", "onepass"]
)
def test_sinks_match_the_reference_with_their_gradient(lengths, hq, hkv, kw, dtype, use_info, backward):
    sinks = torch.linspace(-2.0, 4.0, hq)
    grad = _compare(lengths, hq, hkv, 16, dtype, use_info=use_info, seed=6, sinks=sinks, backward=backward, **kw)
    assert grad.abs().min() > 1e-4  # every head's sink has a gradient to check


PACKED_CASES = [
    # lengths, hq, hkv, pack, extra kwargs: every case's GQA group takes the forced pack
    pytest.param([5, 1, 20, 1, 37], 4, 2, 2, {}, id="gqa2-pack2"),
    pytest.param([17, 33, 8], 8, 2, 4, {"scale": 0.3}, id="gqa4-pack4"),
    pytest.param([17, 33, 8], 8, 2, 2, {}, id="gqa4-pack2"),
    pytest.param([40, 7, 26], 4, 2, 2, {"sliding_window": 7, "softcap": 2.0}, id="window-softcap-pack2"),
    pytest.param([12, 19], 4, 2, 2, {"causal": False}, id="bidirectional-pack2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lengths,hq,hkv,pack,kw", PACKED_CASES)
@pytest.mark.parametrize("use_info", [True, False], ids=["host", "device"])
def test_gqa_packed_query_blocks_match_the_reference(monkeypatch, lengths, hq, hkv, pack, kw, dtype, use_info):
    # TUNESMITH_ATTN_PACK=n: the forward and dQ programs own n query heads of one group each.
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", str(pack))
    _compare(lengths, hq, hkv, 16, dtype, use_info=use_info, seed=3, **kw)


def test_gqa_packing_keeps_the_sinks_of_each_head(monkeypatch):
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "2")
    grad = _compare([5, 1, 40, 23], 4, 2, 16, torch.float32, seed=6, sinks=torch.linspace(-2.0, 4.0, 4))
    assert grad.abs().min() > 1e-4


def test_gqa_pack_setting_is_checked(monkeypatch):
    from engine.kernels.varlen_attention_configs import _FWD_CONFIGS, _packable, fixed_pack

    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "4")
    assert fixed_pack(4) == 4 and fixed_pack(2) == 1  # a count that does not divide the group packs nothing
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "0")
    assert {c.kwargs["PACK"] for c in _packable(_FWD_CONFIGS[64], 4)} == {1}
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "1")
    assert {c.kwargs["PACK"] for c in _packable(_FWD_CONFIGS[64], 4)} == {1, 2, 4}
    assert {c.kwargs["PACK"] for c in _packable(_FWD_CONFIGS[64], 2)} == {1, 2}  # 4 does not divide 2
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "4")
    assert {c.kwargs["PACK"] for c in _packable(_FWD_CONFIGS[64], 2)} == {1}  # forced where it cannot: none
    monkeypatch.setenv("TUNESMITH_ATTN_PACK", "two")
    with pytest.raises(ValueError, match="TUNESMITH_ATTN_PACK='two'"):
        fixed_pack(2)


def test_frozen_sinks_get_no_gradient_and_tokens_past_the_documents_are_left_out():
    # cu_seqlens covering 30 of 34 tokens: the last four belong to no document.
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    q, k, v = (torch.randn(34, 2, 16).requires_grad_() for _ in range(3))
    sinks = torch.tensor([1.0, -1.0])
    out = varlen_attention_triton(q, k, v, cu, sinks=sinks)
    out[:30].sum().backward()
    assert sinks.grad is None and torch.isfinite(q.grad).all()
    st = sinks.clone().requires_grad_()
    out = varlen_attention_triton(q, k, v, cu, sinks=st)
    (out[:30] * 1.0).sum().backward()
    sr = sinks.clone().requires_grad_()
    varlen_attention_reference(q.detach(), k.detach(), v.detach(), cu, sinks=sr)[:30].sum().backward()
    torch.testing.assert_close(st.grad, sr.grad, atol=1e-5, rtol=1e-5)


def test_a_kept_output_takes_dq_and_a_retained_graph_cannot_read_it_twice():
    # The offloader's recompute hands the first forward's output back (KeptAttention "reuse"): the
    # backward writes dQ into that output's memory, with the same gradients, and bumps its version,
    # so a second backward through a retained graph stops instead of reading dQ as the output.
    from engine.kernels.varlen_attention import KeptAttention

    gen = torch.Generator().manual_seed(2)
    info = PackedSeqInfo.from_lengths([19, 33, 12])
    t = info.total_tokens
    q, k, v, do = (torch.randn(t, h, 16, generator=gen) for h in (4, 2, 2, 4))

    def run(kept):
        qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
        out = varlen_attention_triton(qt, kt, vt, info.cu_seqlens, info.max_seqlen, kept=kept)
        return out, (qt, kt, vt)

    out, leaves = run(None)
    out.backward(do)
    want = [x.grad for x in leaves]
    kept = KeptAttention(mode="keep")
    with torch.no_grad():
        run(kept)
    kept.mode = "reuse"
    out, leaves = run(kept)
    o_ptr = out.data_ptr()
    out.backward(do, retain_graph=True)
    assert leaves[0].grad.data_ptr() == o_ptr  # dQ in the kept output's memory
    for got, exp in zip([x.grad for x in leaves], want):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inplace operation"):
        out.backward(do)


def _grads(lengths, hq, hkv, d, max_seqlen, seed=3, **kw):
    gen = torch.Generator().manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths)
    t = info.total_tokens
    q, k, v, do = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention_triton(*leaves, info.cu_seqlens, max_seqlen, tables=info.block_table, **kw)
    out.backward(do)
    return [x.grad for x in leaves]


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5, "softcap": 2.0}], ids=["causal", "window-softcap"])
def test_dq_makes_delta_for_short_documents_with_the_same_gradients(monkeypatch, kw):
    # Packed short documents (TUNESMITH_ATTN_FUSED_DELTA unset or 1): the dQ kernel runs first and makes
    # delta itself, so _bwd_delta never launches; the gradients are those of the three-kernel backward.
    import engine.kernels.varlen_attention as va

    launched = []

    class Recorder:  # stands in for the _bwd_delta kernel: notes each launch and runs it
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(grid)
            return self.kernel[grid]

    lengths, shape = [5, 1, 40, 37, 16], (4, 2, 16)
    monkeypatch.setattr(va, "_bwd_delta", Recorder(va._bwd_delta))
    monkeypatch.setenv(va.FUSED_DELTA_ENV, "0")
    separate = _grads(lengths, *shape, max(lengths), **kw)
    assert len(launched) == 1  # the switch off: one _bwd_delta launch
    monkeypatch.delenv(va.FUSED_DELTA_ENV)
    fused = _grads(lengths, *shape, max(lengths), **kw)
    assert len(launched) == 1  # on by default: no _bwd_delta launch
    monkeypatch.setenv(va.FUSED_DELTA_ENV, "1")
    _grads(lengths, *shape, max(lengths), **kw)
    assert len(launched) == 1
    for name, a, b in zip("qkv", separate, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"d{name}: fused delta against _bwd_delta")


def test_long_or_unknown_documents_keep_the_separate_delta(monkeypatch):
    # The fused kernel's autotuning copies O per candidate, a long row's largest activation: long
    # documents, and calls whose longest document is not a host int, launch _bwd_delta.
    from engine.kernels.varlen_attention import FUSED_DELTA_ENV, LONG_DOCUMENT, fuse_delta

    monkeypatch.setenv(FUSED_DELTA_ENV, "1")
    assert fuse_delta(8) and fuse_delta(LONG_DOCUMENT - 1)
    assert not fuse_delta(LONG_DOCUMENT) and not fuse_delta(None)
    monkeypatch.setenv(FUSED_DELTA_ENV, "0")
    assert not fuse_delta(8)
