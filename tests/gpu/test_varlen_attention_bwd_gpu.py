"""GPU checks of the one-pass attention backward (engine.kernels.varlen_attention_bwd) in bf16 at the
workloads' shapes, against the split backward (the reference path) and against fp32 torch attention
where that fits in memory, with a timing print of both backwards (printed, not asserted).

Run on the GPU host: pytest -m gpu tests/gpu/test_varlen_attention_bwd_gpu.py -s
"""

import statistics

import pytest
import torch

from engine.fastpath.packed import PackedSeqInfo
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton
from engine.kernels.varlen_attention_bwd import tuned_config
from tests.gpu.test_attention_gpu import doc_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [
    # id, lengths, hq, hkv, head_dim
    pytest.param([32768], 32, 8, 64, id="W6-one-32k-doc-32/8x64"),
    pytest.param(doc_lengths(), 16, 8, 128, id="W1-packed-16k-16/8x128"),
    pytest.param([32768], 32, 8, 128, id="W7-like-one-32k-doc-32/8x128"),
]


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _inputs(lengths, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths).to("cuda")
    t = info.total_tokens
    shapes = ((t, hq, d), (t, hkv, d), (t, hkv, d), (t, hq, d))
    return info, [torch.randn(*s, device="cuda", dtype=dtype, generator=gen) for s in shapes]


def _run(info, q, k, v, do, backward, **kw):
    qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
    out = varlen_attention_triton(
        qt,
        kt,
        vt,
        info.cu_seqlens,
        info.max_seqlen,
        tables=info.block_table,
        covers_all_tokens=True,
        backward=backward,
        **kw,
    )
    out.backward(do)
    return out, qt.grad, kt.grad, vt.grad


def _backward_ms(info, q, k, v, do, backward, reps=5):
    """Median milliseconds of the backward alone (the forward runs outside the timed span)."""
    times = []
    for i in range(reps + 2):
        qt, kt, vt = (x.detach().requires_grad_() for x in (q, k, v))
        out = varlen_attention_triton(
            qt,
            kt,
            vt,
            info.cu_seqlens,
            info.max_seqlen,
            tables=info.block_table,
            covers_all_tokens=True,
            backward=backward,
        )
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.backward(do)
        end.record()
        end.synchronize()
        if i >= 2:  # two warm-ups: compilation and autotuning
            times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.mark.parametrize("lengths,hq,hkv,d", SHAPES)
def test_onepass_matches_split_backward_bf16(lengths, hq, hkv, d):
    info, (q, k, v, do) = _inputs(lengths, hq, hkv, d)
    # The first call of each autotunes (TUNESMITH_ATTN_AUTOTUNE): its gradients are checked too,
    # which is where a dQ buffer left dirty by the timed configs would show.
    one = _run(info, q, k, v, do, "onepass")
    split = _run(info, q, k, v, do, "split")
    errs = {name: _rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), one, split)}
    for x in one:
        assert torch.isfinite(x).all()
    assert errs["out"] == 0.0  # the same forward
    assert max(errs.values()) < 1e-2, errs
    ms_split = _backward_ms(info, q, k, v, do, "split")
    ms_one = _backward_ms(info, q, k, v, do, "onepass")
    print(
        f"\n{len(lengths)} docs, {info.total_tokens} tokens, {hq}/{hkv}x{d}: backward split {ms_split:.3f} ms, "
        f"onepass {ms_one:.3f} ms ({ms_split / ms_one:.2f}x, {tuned_config()}); rel. diff {errs}"
    )


FEATURES = [{}, {"sliding_window": 1000}, {"softcap": 30.0}, {"causal": False}]


@pytest.mark.parametrize(
    "d,kw",
    [(64, kw) for kw in FEATURES] + [(128, {})],
    ids=["d64-causal", "d64-window", "d64-softcap", "d64-bidir", "d128-causal"],
)
def test_onepass_long_document_matches_fp32_torch(monkeypatch, d, kw):
    # One 6,144-token document beside short ones, against fp32 torch attention on the same inputs.
    # The fixed block table (no autotuning: each feature set would tune its own kernels, minutes).
    monkeypatch.setenv("TUNESMITH_ATTN_AUTOTUNE", "0")
    info, (q, k, v, do) = _inputs([6144, 300, 17, 1], 16, 4, d, seed=1)
    got = _run(info, q, k, v, do, "onepass", **kw)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen, **kw)
    ref.backward(do.float())
    errs = {name: _rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, qr.grad, kr.grad, vr.grad))}
    assert max(errs.values()) < 1e-2, errs


def test_chunked_heads_match_one_launch(monkeypatch):
    # A dQ buffer budget of two key/value heads runs the backward in four launches (W7's long
    # sequences do this at the default budget); gradients must not change.
    from engine.kernels import varlen_attention_bwd as bwd

    info, (q, k, v, do) = _inputs([8192, 100], 32, 8, 128, seed=2)
    whole = _run(info, q, k, v, do, "onepass")
    monkeypatch.setattr(bwd, "DQ_BUFFER_BYTES", 2 * info.total_tokens * 4 * 128 * 4)
    chunked = _run(info, q, k, v, do, "onepass")
    for name, a, b in zip(("out", "dq", "dk", "dv"), whole, chunked):
        assert _rel(a, b) < 5e-3, name  # only the order of dQ's fp32 atomic adds differs
