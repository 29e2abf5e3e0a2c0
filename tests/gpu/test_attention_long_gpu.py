"""GPU checks of the varlen attention kernel's long-document launch choices (LONG_DOCUMENT), bf16.

- Every candidate of the long lists (the autotuner may pick any) against fp32 torch attention on
  one 8,192-token document, at head_dim 64 (W6) and 128, GQA 32/8.
- The untuned long defaults at W6's real shape, one 32,768-token document, head_dim 64 and 128.
- The dK/dV kernel's rebuilt addresses (the default) against its carried ones
  (TUNESMITH_ATTN_TUNING=old) at the same blocks: bit for bit.
Untuned launches (TUNESMITH_ATTN_AUTOTUNE=0) keep the compile count small; bench.attention_micro
times the autotuned ones.

Run on the GPU host: pytest -m gpu tests/gpu/test_attention_long_gpu.py -q
"""

import pytest
import torch

from engine.fastpath.packed import PackedSeqInfo
from engine.kernels import varlen_attention as va

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_LONG_LISTS = {"fwd": va._FWD_LONG_CONFIGS, "dkdv": va._DKDV_LONG_CONFIGS, "dq": va._DQ_LONG_CONFIGS}
_MOST = max(len(cs) for table in _LONG_LISTS.values() for cs in table.values())


@pytest.fixture(autouse=True)
def _untuned(monkeypatch):
    monkeypatch.setenv("TUNESMITH_ATTN_AUTOTUNE", "0")
    monkeypatch.setenv("TUNESMITH_ATTN_BWD", "split")


def _inputs(t, hq, hkv, d, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    info = PackedSeqInfo.from_lengths([t]).to("cuda")
    shapes = ((t, hq, d), (t, hkv, d), (t, hkv, d), (t, hq, d))
    return info, [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in shapes]


def _run(info, q, k, v, do, blocks=None):
    ins = [x.detach().requires_grad_() for x in (q, k, v)]
    out = va.varlen_attention_triton(
        *ins, info.cu_seqlens, info.max_seqlen, tables=info.block_table, covers_all_tokens=True, blocks=blocks
    )
    out.backward(do)
    return [out.detach()] + [x.grad for x in ins]


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def _reference_by_head(info, q, k, v, do):
    """fp32 reference output and grads, one query head at a time: the dense reference holds a
    [heads, T, T] fp32 score matrix, 128 GiB for 32 heads at 32k tokens; one head is 4 GiB."""
    hq, hkv = q.shape[1], k.shape[1]
    out, dq = torch.empty_like(q, dtype=torch.float32), torch.empty_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for h in range(hq):
        g = h // (hq // hkv)  # the kv head this query head reads (GQA)
        ins = [x[:, i : i + 1].float().requires_grad_() for x, i in ((q, h), (k, g), (v, g))]
        o = va.varlen_attention_reference(*ins, info.cu_seqlens, info.max_seqlen)
        o.backward(do[:, h : h + 1].float())
        out[:, h], dq[:, h] = o.detach()[:, 0], ins[0].grad[:, 0]
        dk[:, g] += ins[1].grad[:, 0]
        dv[:, g] += ins[2].grad[:, 0]
        del o, ins
    return [out, dq, dk, dv]


def _check_against_fp32(info, q, k, v, do, tol=1e-2):
    got = _run(info, q, k, v, do)
    want = _reference_by_head(info, q, k, v, do)
    errs = {name: _rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)}
    assert all(torch.isfinite(x).all() for x in got)
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("i", range(_MOST))
def test_every_long_candidate_matches_fp32(monkeypatch, d, i):
    # The i-th candidate of each kernel's long list (its last where the list is shorter) as the untuned config.
    for kind, table in _LONG_LISTS.items():
        c = table[d][min(i, len(table[d]) - 1)]
        cfg = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        monkeypatch.setitem(va._LONG_DEFAULTS[kind], d, cfg)
    info, (q, k, v, do) = _inputs(8192, 32, 8, d, seed=i)
    assert info.max_seqlen >= va.LONG_DOCUMENT
    print(d, i, _check_against_fp32(info, q, k, v, do))


@pytest.mark.parametrize("d", [64, 128], ids=["W6-32/8x64", "32/8x128"])
def test_one_32k_document_matches_fp32(d):
    info, (q, k, v, do) = _inputs(32768, 32, 8, d)
    print(d, _check_against_fp32(info, q, k, v, do))


@pytest.mark.parametrize("d", [64, 128])
def test_rebuilt_addresses_match_carried_ones_bit_for_bit(monkeypatch, d):
    # (key block 128, query step 32): the old head_dim-64 default's tiles, at 4 warps.
    blocks = (128, 32)
    info, (q, k, v, do) = _inputs(8192, 32, 8, d, seed=3)
    monkeypatch.setenv(va.TUNING_ENV, "old")
    old = _run(info, q, k, v, do, blocks=blocks)
    monkeypatch.setenv(va.TUNING_ENV, "new")
    new = _run(info, q, k, v, do, blocks=blocks)
    for name, a, b in zip(("out", "dq", "dk", "dv"), old, new):
        assert torch.equal(a, b), f"{name}: max difference {(a.float() - b.float()).abs().max().item()}"
