"""Long-document launch choices of the varlen attention kernel (through the Triton interpreter on CPU).

- The dK/dV kernel's per-step addresses (the default) give bit-for-bit the gradients of the carried
  addresses they replaced (TUNESMITH_ATTN_TUNING=old), at the same blocks.
- Long documents take their own candidate lists (LONG_DOCUMENT), whose tiles all have block tables.
- Causal block skipping is exact: the tile ranges the kernels walk (their own _key_range and
  _query_range, run here by a probe kernel) visit no wholly masked tile, run every unmasked-phase
  tile without a masked entry, and cover each visible (query, key) pair once.
fp32/fp16 only: the interpreter computes tl.dot on bf16 wrongly.
"""

import pytest
import torch
import triton
import triton.language as tl

from engine.fastpath.packed import PackedSeqInfo
from engine.kernels import varlen_attention as va
from engine.kernels import varlen_attention_configs as va_configs
from engine.kernels import varlen_attention_launch as va_launch
from engine.kernels.varlen_attention import varlen_attention_reference, varlen_attention_triton


def _grads(lengths, hq, hkv, d, dtype, *, blocks=None, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    info = PackedSeqInfo.from_lengths(lengths)
    t = info.total_tokens
    q, k, v, do = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention_triton(
        *ins, info.cu_seqlens, info.max_seqlen, blocks=blocks, tables=info.block_table, covers_all_tokens=True, **kw
    )
    out.backward(do)
    return [out.detach()] + [x.grad for x in ins], (q, k, v, do, info)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "lengths,hq,hkv,kw,blocks",
    [
        pytest.param([70, 5, 33], 4, 2, {}, (32, 16), id="causal-gqa2"),
        pytest.param([61], 4, 1, {}, (16, 32), id="one-doc-gqa4"),
        pytest.param([40, 27], 2, 1, {"sliding_window": 9}, (16, 16), id="window"),
        pytest.param([29, 18], 2, 2, {"softcap": 4.0, "causal": False}, (16, 16), id="softcap-bidirectional"),
    ],
)
def test_rebuilt_addresses_match_carried_ones_bit_for_bit(monkeypatch, dtype, lengths, hq, hkv, kw, blocks):
    monkeypatch.setenv(va.TUNING_ENV, "old")
    old, _ = _grads(lengths, hq, hkv, 16, dtype, blocks=blocks, **kw)
    monkeypatch.setenv(va.TUNING_ENV, "new")
    new, _ = _grads(lengths, hq, hkv, 16, dtype, blocks=blocks, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), old, new):
        assert torch.equal(a, b), f"{name} differs between carried and rebuilt addresses"


def test_long_documents_run_the_long_launch_path(monkeypatch):
    # LONG_DOCUMENT lowered so an interpreter-sized document takes the long bucket end to end.
    monkeypatch.setattr(va_launch, "LONG_DOCUMENT", 48)
    got, (q, k, v, do, info) = _grads([50, 20], 4, 2, 16, torch.float32)
    launch = va._Launch(q, k, info.cu_seqlens, info.block_table, None, True, None, None, None, True, 50)
    assert launch.long_docs == 1 and launch.rebuild_addr
    monkeypatch.setenv(va.TUNING_ENV, "old")
    old_launch = va._Launch(q, k, info.cu_seqlens, info.block_table, None, True, None, None, None, True, 50)
    assert old_launch.long_docs == 0 and not old_launch.rebuild_addr
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen)
    ref.backward(do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(a, b.detach(), atol=2e-5, rtol=2e-5, msg=name)


_LONG_LISTS = {"fwd": va._FWD_LONG_CONFIGS, "dkdv": va._DKDV_LONG_CONFIGS, "dq": va._DQ_LONG_CONFIGS}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("i", range(max(len(cs) for table in _LONG_LISTS.values() for cs in table.values())))
def test_every_long_candidate_is_exact_at_its_own_tiles(monkeypatch, d, i):
    # The GPU's config choice (INTERPRET off for _fixed only; the kernels still run in the
    # interpreter) with the i-th candidate of each long list as the untuned config, so each
    # candidate's real tile shapes are checked against the reference (fp16: fp32 would take
    # _fixed's exact-check tiles).
    monkeypatch.setattr(va_configs, "INTERPRET", False)
    monkeypatch.setenv("TUNESMITH_ATTN_AUTOTUNE", "0")
    monkeypatch.setattr(va_launch, "LONG_DOCUMENT", 64)
    for kind, table in _LONG_LISTS.items():
        c = table[d][min(i, len(table[d]) - 1)]
        monkeypatch.setitem(va._LONG_DEFAULTS[kind], d, (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], 4, 1))
        assert va._fixed(kind, d, None, long_docs=True)[:2] == (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
    got, (q, k, v, do, info) = _grads([150, 41, 70], 4, 1, d, torch.float16, seed=i)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_reference(qr, kr, vr, info.cu_seqlens, info.max_seqlen)
    ref.backward(do.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, qr.grad, kr.grad, vr.grad)):
        scale = max(b.abs().max().item(), 1.0)
        err = (a.float() - b.detach()).abs().max().item()
        assert err <= 8e-3 * scale, f"{name}: max error {err:.3e} (scale {scale:.2f})"


def test_bad_tuning_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(va.TUNING_ENV, "fastest")
    with pytest.raises(ValueError, match=va.TUNING_ENV):
        _grads([20], 2, 1, 16, torch.float32)


def test_long_lists_are_chosen_by_bucket_and_have_block_tables(monkeypatch):
    lists = {
        "fwd": (va._FWD_CONFIGS, va._FWD_LONG_CONFIGS, "BLOCK_M"),
        "dkdv": (va._DKDV_CONFIGS, va._DKDV_LONG_CONFIGS, "BLOCK_N"),
        "dq": (va._DQ_CONFIGS, va._DQ_LONG_CONFIGS, "BLOCK_M"),
    }
    monkeypatch.setattr(va_configs, "INTERPRET", False)  # _fixed answers the GPU's question
    for kind, (short, long, table_key) in lists.items():
        prune = va._prune(short, long)
        for d in (64, 128):
            assert prune([], {"HEAD_DIM": d, "long_docs": 1}) is long[d]
            # Short lists keep the packed candidates a group can take (GROUP 4: all; MHA: none).
            assert prune([], {"HEAD_DIM": d, "long_docs": 0, "GROUP": 4}) == short[d]
            assert all(c.kwargs.get("PACK", 1) == 1 for c in prune([], {"HEAD_DIM": d, "long_docs": 0, "GROUP": 1}))
            first = long[d][0]
            want = (first.kwargs["BLOCK_M"], first.kwargs["BLOCK_N"], first.num_warps, first.num_stages)
            assert va._fixed(kind, d, None, long_docs=True) == want
            assert va._fixed(kind, d, None, long_docs=False) == va._DEFAULTS[kind][d]
        # Head dims without a long list keep the short one.
        assert prune([], {"HEAD_DIM": 256, "long_docs": 1}) == short[256]
        # Every tile a long config may pick has a block table (PackedSeqInfo queues TABLE_BLOCKS).
        assert {c.kwargs[table_key] for cs in long.values() for c in cs} <= set(va.TABLE_BLOCKS)


# --------------------------------------------------------------------------------------------
# Causal block skipping, from the kernels' own range helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _ranges_probe(
    CU,
    TBL,
    OUT,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KEY_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    doc = tl.load(TBL + 2 * pid)
    start = tl.load(TBL + 2 * pid + 1)
    doc_start = tl.load(CU + doc)
    doc_end = tl.load(CU + doc + 1)
    if KEY_BLOCKS:  # dK/dV (and the one-pass backward): queries for a block of keys
        a, b, c, e = va._query_range(start, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    else:  # forward and dQ: keys for a block of queries
        a, b, e = va._key_range(start, doc_start, doc_end, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
        c = e
    tl.store(OUT + 4 * pid, a)
    tl.store(OUT + 4 * pid + 1, b)
    tl.store(OUT + 4 * pid + 2, c)
    tl.store(OUT + 4 * pid + 3, e)


def _visible(qs, ks, doc_start, doc_end, causal, window):
    """[len(qs), len(ks)] bool: query i sees key j (both inside the document)."""
    qi = torch.as_tensor(qs)[:, None]
    kj = torch.as_tensor(ks)[None, :]
    ok = (qi >= doc_start) & (qi < doc_end) & (kj >= doc_start) & (kj < doc_end)
    if causal:
        ok &= kj <= qi
    if window is not None:
        ok &= (qi - kj) < window
    return ok


@pytest.mark.parametrize("bm,bn", [(16, 16), (16, 32), (32, 16), (64, 16), (16, 64)])
@pytest.mark.parametrize(
    "causal,window", [(True, None), (True, 7), (False, None), (False, 20)], ids=["causal", "window", "full", "band"]
)
def test_tiles_walked_are_exactly_the_needed_ones(bm, bn, causal, window):
    lengths = [1, 37, 16, 100, 5, 64]
    info = PackedSeqInfo.from_lengths(lengths)
    cu = info.cu_seqlens
    bounds = cu.tolist()
    for key_blocks in (False, True):
        block, step = (bn, bm) if key_blocks else (bm, bn)
        table = va.host_block_table(lengths, block, "k" if key_blocks else "q")
        n = table.shape[0]
        out = torch.zeros(n, 4, dtype=torch.int32)
        _ranges_probe[(n,)](
            cu,
            table,
            out,
            window or 0,
            BLOCK_M=bm,
            BLOCK_N=bn,
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            KEY_BLOCKS=key_blocks,
        )
        seen = torch.zeros(bounds[-1], bounds[-1], dtype=torch.int32)  # [query, key] visits
        for (doc, first), (a, b, c, e) in zip(table.tolist(), out.tolist()):
            s, t = bounds[doc], bounds[doc + 1]
            own = list(range(first, first + block))
            # (start, end, masked) phases in the order the kernels walk them
            phases = [(a, b, True), (b, c, False), (c, e, True)] if key_blocks else [(a, b, False), (b, e, True)]
            for lo, hi, masked in phases:
                for x0 in range(lo, hi, step):
                    other = list(range(x0, x0 + step))
                    qs, ks = (other, own) if key_blocks else (own, other)
                    vis = _visible(qs, ks, s, t, causal, window)
                    where = f"doc {doc} block {first} {'keys' if key_blocks else 'queries'} tile at {x0}"
                    assert vis.any(), f"wholly masked tile visited: {where}"
                    if not masked:
                        rows = torch.as_tensor(qs) < t  # rows past the document are never stored
                        assert vis[rows].all(), f"unmasked phase holds masked entries: {where}"
                    qi = torch.as_tensor(qs)[:, None].expand_as(vis)[vis]
                    kj = torch.as_tensor(ks)[None, :].expand_as(vis)[vis]
                    seen.index_put_((qi, kj), torch.ones_like(qi, dtype=torch.int32), accumulate=True)
        everything = torch.arange(bounds[-1])
        need = torch.zeros_like(seen, dtype=torch.bool)
        for s, t in zip(bounds[:-1], bounds[1:]):
            need[s:t, s:t] = _visible(everything[s:t], everything[s:t], s, t, causal, window)
        assert torch.equal(seen, need.to(torch.int32)), "a visible pair is missed or visited twice"


def test_a_fixed_config_too_big_for_the_card_shrinks_to_the_least_tile():
    # One stage first, then the step block, then the table block (dK/dV's is BLOCK_N), to 16 rows.
    from engine.kernels.varlen_attention_configs import shrink

    steps, config = [], (64, 64, 8, 2)
    while config is not None:
        steps.append(config)
        config = shrink("fwd", config)
    assert steps == [(64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 8, 1), (64, 16, 8, 1), (32, 16, 8, 1), (16, 16, 8, 1)]
    assert shrink("dkdv", (32, 16, 8, 1)) == (16, 16, 8, 1)
    assert shrink("dkdv", (16, 32, 8, 1)) == (16, 16, 8, 1)
    assert shrink("dq", (16, 16, 4, 1)) is None
