"""GPU checks of the varlen attention kernel: real W1-W3 shapes in bf16, no device syncs inside a
packed decoder stack, and a timing print against SDPA / flex_attention (printed, not asserted).

Run on the GPU host: pytest -m gpu tests/gpu/test_attention_gpu.py -s
"""

import math

import pytest
import torch

from engine.fastpath import packed
from engine.fastpath.attention import enable_packed_attention, varlen_attention
from engine.fastpath.packed import PackedSeqInfo
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton
from tests.tiny_models import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = 16384


def doc_lengths(total=TOKENS, seed=0):
    """WORKLOADS.md recipe: LogNormal(5.3, 0.7) clipped to [16, 2048], filling `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens, used = [], 0
    while used < total:
        n = int(min(max(math.exp(5.3 + 0.7 * torch.randn(1, generator=g).item()), 16), 2048))
        n = min(n, total - used)
        lens.append(n)
        used += n
    return lens


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _check(lengths, hq, hkv, d, dtype, seed=0, tol=1e-2, backend="auto", dv=None, **kw):
    torch.manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths).to("cuda")
    t = info.total_tokens
    dv = d if dv is None else dv
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(t, hkv, dv, device="cuda", dtype=dtype)
    do = torch.randn(t, hq, dv, device="cuda", dtype=dtype)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qt, kt, vt, info.cu_seqlens, info.max_seqlen, backend=backend, **kw)
    out.backward(do)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen, **kw)
    ref.backward(do.float())
    errs = {
        "out": _rel(out, ref),
        "dq": _rel(qt.grad, qr.grad),
        "dk": _rel(kt.grad, kr.grad),
        "dv": _rel(vt.grad, vr.grad),
    }
    assert torch.isfinite(out).all()
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.parametrize(
    "hq,hkv,d", [(16, 8, 128), (32, 8, 64), (32, 8, 128)], ids=["W1-16/8x128", "W2-32/8x64", "W3-32/8x128"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_real_shapes_bf16(hq, hkv, d, seed):
    print(_check(doc_lengths(seed=seed), hq, hkv, d, torch.bfloat16, seed=seed))


@pytest.mark.parametrize(
    "hq,hkv,d", [(16, 8, 128), (32, 8, 64), (32, 8, 128)], ids=["W1-16/8x128", "W2-32/8x64", "W3-32/8x128"]
)
def test_fused_delta_at_real_shapes_bf16(monkeypatch, hq, hkv, d):
    # TUNESMITH_ATTN_FUSED_DELTA=1 (the default): short documents' dQ runs first
    # and makes delta = rowsum(dO * O) itself, autotuned with O put back after each candidate.
    from engine.kernels import varlen_attention as va

    monkeypatch.setenv(va.FUSED_DELTA_ENV, "1")
    print(_check(doc_lengths(seed=3), hq, hkv, d, torch.bfloat16, seed=3))
    assert va._attn_bwd_dq_delta_tuned.best_config is not None  # the fused launch ran (autotuned)


@pytest.mark.parametrize(
    "hq,hkv,d,pack",
    [(16, 8, 128, 2), (32, 8, 64, 2), (32, 8, 64, 4), (32, 8, 128, 2)],
    ids=["W1-pack2", "W2-pack2", "W2-pack4", "W3-pack2"],
)
def test_gqa_packed_query_blocks_at_real_shapes_bf16(monkeypatch, hq, hkv, d, pack):
    # Forced packing (TUNESMITH_ATTN_PACK=n): the autotuner ranks only the packed candidates of the
    # forward and dQ, so the pick it makes is the one checked (the interpreter cannot check bf16 dots).
    from engine.kernels.varlen_attention import forget_tuning

    monkeypatch.setenv("TUNESMITH_ATTN_PACK", str(pack))
    forget_tuning()
    try:
        print(_check(doc_lengths(seed=2), hq, hkv, d, torch.bfloat16, seed=2))
        from engine.kernels import varlen_attention as va

        assert va._attn_fwd_tuned.best_config.kwargs["PACK"] == pack
        # With the fused delta (the default) short documents' dQ makes delta itself, ranked by its own autotuner.
        dq = va._attn_bwd_dq_delta_tuned if va.fused_delta_on() else va._attn_bwd_dq_tuned
        assert dq.best_config.kwargs["PACK"] == pack
    finally:
        forget_tuning()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kw",
    [{"sliding_window": 300}, {"softcap": 50.0}, {"sliding_window": 128, "softcap": 30.0}],
    ids=["window", "softcap", "both"],
)
def test_window_softcap_head_dim_256(dtype, kw):
    # Gemma-2-like: head_dim 256, GQA 2, softcap 50, sliding windows shorter than documents.
    _check(doc_lengths(total=4096, seed=3), 8, 4, 256, dtype, **kw)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 300}], ids=["causal", "window"])
def test_torch_flash_backend_matches_the_reference(kw):
    # torch's own flash varlen kernel, the backend the attention micro-benchmark compares ours
    # with (bench.attention_micro); GQA 32/8 as in W2.
    from engine.fastpath.attention import backend_available

    if not backend_available("torch_flash", torch.empty(1, 1, 64, device="cuda", dtype=torch.bfloat16)):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    _check(doc_lengths(seed=2), 32, 8, 64, torch.bfloat16, backend="torch_flash", **kw)


@pytest.mark.parametrize("d", [64, 128])
def test_one_long_document_and_tiny_documents(d):
    _check([TOKENS // 2], 16, 8, d, torch.bfloat16)
    _check([1] * 300 + [17] * 50 + [2048], 16, 8, d, torch.bfloat16)


@pytest.mark.parametrize(
    "lengths,kw",
    [
        (None, {}),
        (None, {"sliding_window": 128}),
        ([4096, 4096], {"backward": "onepass"}),  # the reference holds [64, n, n] scores,
    ],
    ids=["packed", "window128", "long-onepass"],
)
def test_sinks_at_gpt_oss_shapes_bf16(lengths, kw):
    # GPT-OSS-20B's attention: 64 query heads over 8 kv heads of 64, a learned sink per head,
    # sliding-window layers of 128. The sinks' gradient is checked with the rest.
    torch.manual_seed(7)
    info = PackedSeqInfo.from_lengths(lengths or doc_lengths(seed=4)).to("cuda")
    t = info.total_tokens
    q, do = (torch.randn(t, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(64, device="cuda", dtype=torch.bfloat16) * 2
    qt, kt, vt, st = (x.clone().requires_grad_() for x in (q, k, v, sinks))
    out = varlen_attention_triton(
        qt, kt, vt, info.cu_seqlens, info.max_seqlen, tables=info.block_table, covers_all_tokens=True, sinks=st, **kw
    )
    out.backward(do)
    kw.pop("backward", None)
    qr, kr, vr, sr = (x.float().requires_grad_() for x in (q, k, v, sinks))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, sinks=sr, **kw)
    ref.backward(do.float())
    errs = {
        name: _rel(got, want)
        for name, got, want in (
            ("out", out, ref),
            ("dq", qt.grad, qr.grad),
            ("dk", kt.grad, kr.grad),
            ("dv", vt.grad, vr.grad),
            ("dsinks", st.grad, sr.grad),
        )
    }
    print(errs)
    assert max(errs.values()) < 1e-2, errs


def test_mla_head_dims_bf16():
    # DeepSeek-V3's attention: queries and keys 192 wide (128 + 64 rotary), values 128; the Triton
    # backend pads them to 256 (engine.fastpath.attention.kernel_head_dim).
    errs = _check(doc_lengths(seed=5), 16, 16, 192, torch.bfloat16, dv=128)
    print(errs)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_head_dim_512_as_gemma4_global_layers(dtype, tol):
    # Gemma-4's global layers: 512-wide heads, run with the fixed small-tile configs (each must
    # fit the card's shared memory: a launch past it fails outright), packed and one long document.
    print(_check(doc_lengths(total=8192, seed=6), 16, 4, 512, dtype, tol=tol))
    print(_check([4096, 100], 8, 2, 512, dtype, tol=tol, sliding_window=1024))


def test_tiles_too_big_for_the_shared_memory_shrink_and_still_match():
    # Pinned 64x64 tiles of two stages at head dim 512 need more than a block's shared memory (on
    # an RTX card the fixed head-dim-256 and 512 configs do): the launch shrinks them until they fit.
    from engine.counters import Counters

    counters = Counters()
    info = PackedSeqInfo.from_lengths(doc_lengths(total=2048, seed=7)).to("cuda")
    t = info.total_tokens
    torch.manual_seed(7)
    q, k, v, do = (torch.randn(t, h, 512, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2, 8))
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    with counters.active():
        out = varlen_attention_triton(qt, kt, vt, info.cu_seqlens, info.max_seqlen, blocks=(64, 64))
        out.backward(do)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen)
    ref.backward(do.float())
    errs = [_rel(a, b) for a, b in ((out, ref), (qt.grad, qr.grad), (kt.grad, kr.grad), (vt.grad, vr.grad))]
    assert max(errs) < 1e-2, errs
    assert counters["attention:shrunk_tiles"] >= 1, dict(counters)


def test_fp32_on_gpu_is_tight():
    _check(doc_lengths(total=2048, seed=5), 8, 2, 64, torch.float32, tol=1e-4)


def test_device_built_tables_match_host_tables():
    lengths = doc_lengths(seed=7)
    info = PackedSeqInfo.from_lengths(lengths).to("cuda")
    q = torch.randn(info.total_tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(info.total_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    a = varlen_attention_triton(q, k, k, info.cu_seqlens, tables=info.block_table)
    b = varlen_attention_triton(q, k, k, info.cu_seqlens.clone())
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def _tiny_qwen3(layers=4):
    shape = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    model = tiny_model(
        "qwen3", dtype=torch.bfloat16, vocab_size=1024, max_position_embeddings=4096, num_hidden_layers=layers, **shape
    )
    return model.to("cuda")


def _step(model, lengths, seed):
    # One training step's attention side: metadata built once on the host, moved once, then a
    # packed forward + backward of the decoder stack.
    info = PackedSeqInfo.from_lengths(lengths).to("cuda")
    ids = torch.randint(
        0, 1024, (1, info.total_tokens), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)
    )
    return info, ids


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_sync_inside_packed_decoder_stack(checkpointing):
    model = _tiny_qwen3()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert enable_packed_attention(model) == "on"
    lengths = doc_lengths(total=8192, seed=11)

    def run(info, ids):
        out = model.model(input_ids=ids, use_cache=False, **info.model_kwargs())
        out.last_hidden_state.float().square().mean().backward()

    run(*_step(model, lengths, 0))  # warm-up: compile + autotune (these do synchronize)
    torch.cuda.synchronize()
    packed.reset_counters()
    info, ids = _step(model, lengths, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(info, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    counts = packed.reset_counters()
    assert {k: counts[k] for k in packed.BASE_KEYS} == {"metadata_builds": 1, "host_syncs": 0, "moe_calls": 0}, counts
    assert counts.get("attention:varlen_triton", 0) > 0 and "attention:reference" not in counts, counts


def test_rebuilt_per_layer_ablation_syncs_per_layer():
    model = _tiny_qwen3(layers=3)
    assert enable_packed_attention(model, cached_metadata=False) == "on"
    info, ids = _step(model, doc_lengths(total=4096, seed=12), 0)
    packed.reset_counters()
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False, **info.model_kwargs())
    counts = packed.reset_counters()
    assert {k: counts[k] for k in packed.BASE_KEYS} == {"metadata_builds": 3, "host_syncs": 3, "moe_calls": 0}, counts
    assert counts.get("attention:varlen_triton") == 3, counts


def test_flash_attn_backend_if_installed():
    pytest.importorskip("flash_attn")
    lengths = doc_lengths(total=4096, seed=13)
    info = PackedSeqInfo.from_lengths(lengths).to("cuda")
    q = torch.randn(info.total_tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(info.total_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    a = varlen_attention(q, k, k, info.cu_seqlens, info.max_seqlen, backend="flash_attn")
    b = varlen_attention(q, k, k, info.cu_seqlens, info.max_seqlen)
    assert _rel(a, b) < 1e-2


def test_the_autotuners_timing_allocates_nothing():
    # The autotuner ranks launch configs during the first step, often at its memory peak: its timing
    # (varlen_attention_configs._short_bench) must not allocate (triton's do_bench takes a 256 MB
    # L2-flush buffer), and returns the quantiles the autotuner asks for.
    from engine.kernels.varlen_attention_configs import _short_bench

    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = _short_bench(lambda: x.mul_(1.0), (0.5, 0.2, 0.8))
    assert torch.cuda.max_memory_allocated() - before < 1 << 20
    assert len(times) == 3 and 0 < times[1] <= times[0] <= times[2]
    assert _short_bench(lambda: x.mul_(1.0), None) > 0
