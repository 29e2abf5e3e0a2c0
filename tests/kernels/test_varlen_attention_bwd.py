"""One-pass attention backward (engine.kernels.varlen_attention_bwd) through the Triton interpreter.

dQ, dK and dV against torch's attention backward (per-document SDPA / explicit softmax in fp32 on
the same rounded inputs) in fp32 and fp16, with several documents of different lengths, GQA, documents
longer than one block and shorter than one, and every feature of the forward. bf16 is left to
tests/gpu/test_varlen_attention_bwd_gpu.py: the interpreter computes tl.dot on bf16 operands wrongly.
"""

import pytest
import torch

from engine import counters
from engine.fastpath.packed import PackedSeqInfo
from engine.kernels import varlen_attention_bwd as bwd
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3)}


def _inputs(lengths, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths)
    t = info.total_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return info, (rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d), rnd(t, hq, d))


def _grads(info, q, k, v, do, backward, *, blocks=None, use_info=True, **kw):
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
        backward=backward,
        **kw,
    )
    out.backward(do)
    return out, qt.grad, kt.grad, vt.grad


def _reference(info, q, k, v, do, **kw):
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen, **kw)
    ref.backward(do.float())
    return ref, qr.grad, kr.grad, vr.grad


def _assert_close(got, want, dtype):
    atol, rtol = TOL[dtype]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        scale = max(w.abs().max().item(), 1.0)
        err = (g.float() - w).abs().max().item()
        assert err <= atol * scale + rtol * scale, f"{name}: max error {err:.3e} (scale {scale:.2f})"


CASES = [
    # lengths, hq, hkv, d, extra kwargs. The interpreter's blocks are 16 x 16: 37 and 40 tokens span
    # three blocks (the last partial), 5 and 1 fit in one.
    pytest.param([37, 5, 1, 20], 4, 2, 16, {}, id="docs-gqa2"),
    pytest.param([17, 33, 8], 4, 1, 32, {"scale": 0.3}, id="gqa4-scale-d32"),
    pytest.param([40, 7, 26], 2, 1, 16, {"sliding_window": 7}, id="window"),
    pytest.param([3, 30, 17], 2, 2, 16, {"softcap": 5.0}, id="softcap"),
    pytest.param([9, 31, 24], 4, 2, 16, {"sliding_window": 5, "softcap": 2.0}, id="window-softcap"),
    pytest.param([12, 19], 2, 1, 16, {"causal": False}, id="bidirectional"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lengths,hq,hkv,d,kw", CASES)
def test_onepass_matches_torch_backward(lengths, hq, hkv, d, kw, dtype):
    info, (q, k, v, do) = _inputs(lengths, hq, hkv, d, dtype, seed=0)
    got = _grads(info, q, k, v, do, "onepass", **kw)
    _assert_close(got, _reference(info, q, k, v, do, **kw), dtype)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["keys32-queries16", "keys16-queries32"])
def test_uneven_blocks_and_long_document(blocks):
    # Key blocks and query steps of different sizes move the masked/unmasked phase boundaries; one
    # document of 70 tokens is several blocks long, beside documents shorter than one block.
    info, (q, k, v, do) = _inputs([70, 3, 21, 1], 4, 2, 16, torch.float32, seed=1)
    _assert_close(_grads(info, q, k, v, do, "onepass", blocks=blocks), _reference(info, q, k, v, do), torch.float32)


def test_device_built_tables_and_chunked_heads(monkeypatch):
    # No PackedSeqInfo: tables come padded from cu_seqlens on the device. A dQ buffer budget of one
    # key/value head's worth makes the backward run head by head (kv0 > 0 in the kernel).
    info, (q, k, v, do) = _inputs([5, 1, 20, 37], 6, 3, 16, torch.float32, seed=2)
    t = info.total_tokens
    monkeypatch.setattr(bwd, "DQ_BUFFER_BYTES", t * 2 * 16 * 4)
    assert bwd.kv_head_chunk(t, 3, 2, 16) == 1
    got = _grads(info, q, k, v, do, "onepass", use_info=False)
    _assert_close(got, _reference(info, q, k, v, do), torch.float32)


def test_onepass_agrees_with_split_backward():
    info, (q, k, v, do) = _inputs([45, 2, 19], 4, 2, 32, torch.float16, seed=3)
    one = _grads(info, q, k, v, do, "onepass")
    split = _grads(info, q, k, v, do, "split")
    assert torch.equal(one[0], split[0])  # same forward
    for name, a, b in zip(("dq", "dk", "dv"), one[1:], split[1:]):
        torch.testing.assert_close(a, b, atol=4e-3, rtol=4e-3, msg=name)


def test_auto_runs_the_split_backward_while_the_one_pass_one_is_slower(monkeypatch):
    # measured slower on the H200 at W6 and W1 (AUTO_ONEPASS's comment): auto never takes it
    monkeypatch.delenv(bwd.BACKWARD_ENV, raising=False)
    assert bwd.AUTO_ONEPASS is False
    assert bwd.resolve_backward(None, 32768, 32768 * 32 * 64 * 4) == "split"  # W6
    assert bwd.resolve_backward("onepass", 16) == "onepass"  # asked for by name


def test_choice_of_backward(monkeypatch):
    monkeypatch.delenv(bwd.BACKWARD_ENV, raising=False)
    monkeypatch.setattr(bwd, "AUTO_ONEPASS", True)
    assert bwd.resolve_backward(None, bwd.LONG_DOCUMENT) == "onepass"
    assert bwd.resolve_backward(None, bwd.LONG_DOCUMENT - 1) == "split"
    assert bwd.resolve_backward(None, None) == "split"  # length unknown: the reference path
    # A very long sequence whose fp32 dQ buffer would pass the budget keeps the split backward.
    assert bwd.resolve_backward(None, 196608, bwd.DQ_BUFFER_BYTES + 1) == "split"
    assert bwd.resolve_backward(None, 32768, 32768 * 32 * 64 * 4) == "onepass"  # W6
    monkeypatch.setenv(bwd.BACKWARD_ENV, "split")
    assert bwd.resolve_backward(None, 32768) == "split"
    assert bwd.resolve_backward("onepass", 10) == "onepass"  # the call's own choice wins
    monkeypatch.setenv(bwd.BACKWARD_ENV, "OnePass ")
    assert bwd.resolve_backward(None, 10) == "onepass"
    monkeypatch.setenv(bwd.BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="TUNESMITH_ATTN_BWD='fast'.*auto, split, onepass"):
        bwd.resolve_backward(None, 10)
    info = PackedSeqInfo.from_lengths([4])
    x = torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match="TUNESMITH_ATTN_BWD"):  # refused at the forward, before any work
        varlen_attention_triton(x, x, x, info.cu_seqlens, 4)


def test_kv_head_chunks_are_even():
    per_head = 1000 * 4 * 128 * 4
    assert bwd.kv_head_chunk(1000, 8, 4, 128, budget=8 * per_head) == 8
    assert bwd.kv_head_chunk(1000, 8, 4, 128, budget=7 * per_head) == 4  # 4 + 4, not 7 + 1
    assert bwd.kv_head_chunk(1000, 8, 4, 128, budget=3 * per_head) == 3  # 3 + 3 + 2
    assert bwd.kv_head_chunk(1000, 8, 4, 128, budget=1) == 1


def test_deterministic_mode_takes_the_split_backward():
    info, (q, k, v, do) = _inputs([21, 9], 2, 1, 16, torch.float32, seed=4)
    run = counters.Counters()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with run.active():
            got = _grads(info, q, k, v, do, "onepass")
    finally:
        torch.use_deterministic_algorithms(was)
    reasons = [key for key in run if key.startswith("fallback:attention_backward:")]
    assert reasons and "deterministic" in reasons[0], dict(run)
    split = _grads(info, q, k, v, do, "split")
    for a, b in zip(got, split):
        assert torch.equal(a, b)  # the split backward itself ran


@pytest.mark.parametrize(
    "env,long_document,want",
    [("onepass", 10**9, True), ("split", 16, False), ("auto", 16, True), ("auto", 10**9, False)],
    ids=["env-onepass", "env-split", "auto-long", "auto-short"],
)
def test_switch_reaches_the_engine_dispatch(monkeypatch, env, long_document, want):
    # Through engine.fastpath.attention (the model's path): the environment key and "auto" (the
    # longest document, from the PackedSeqInfo) decide; the real one-pass backward runs under a spy.
    from engine.fastpath.attention import varlen_attention

    calls = []
    real = bwd.onepass_backward

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(bwd, "onepass_backward", spy)
    monkeypatch.setattr(bwd, "LONG_DOCUMENT", long_document)
    monkeypatch.setattr(bwd, "AUTO_ONEPASS", True)  # the length rule, as if the one-pass path were faster
    monkeypatch.setenv(bwd.BACKWARD_ENV, env)
    info, (q, k, v, do) = _inputs([23, 6], 4, 2, 16, torch.float32, seed=5)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qt, kt, vt, info.cu_seqlens, None, backend="triton", info=info)
    out.backward(do)
    assert bool(calls) == want
    _assert_close((out, qt.grad, kt.grad, vt.grad), _reference(info, q, k, v, do), torch.float32)


def test_tokens_outside_every_document_get_zero_gradients():
    # cu_seqlens ends before the stream does (padding after the last document): those tokens get no
    # program; their dQ stays the buffer's zero and dK/dV are zeroed, the documents' match torch.
    info, (q, k, v, do) = _inputs([5, 19], 2, 1, 16, torch.float32, seed=6)
    t, pad = info.total_tokens, 7
    q, do = (torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (q, do))
    k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (k, v))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention_triton(qt, kt, vt, info.cu_seqlens, info.max_seqlen, backward="onepass")
    out.backward(do)
    for g in (qt.grad, kt.grad, vt.grad):
        assert torch.equal(g[t:], torch.zeros_like(g[t:]))
    got = (out[:t], qt.grad[:t], kt.grad[:t], vt.grad[:t])
    _assert_close(got, _reference(info, q[:t], k[:t], v[:t], do[:t]), torch.float32)
