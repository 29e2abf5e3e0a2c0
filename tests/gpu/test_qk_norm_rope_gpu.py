"""The fused per-head q/k RMSNorm + RoPE (engine.kernels.qk_norm_rope) on a CUDA GPU at the real
shapes: 16,384 packed tokens at Qwen3-0.6B's 16 q / 8 kv heads, Qwen3-8B's 32 / 8 and Qwen3-14B's
40 / 8 (head_dim 128), Gemma-3's 1 + w at head_dim 256, in bf16 and fp32. Forward and backward
against the fp32 composition of the references; in bf16 the fused kernel's error must be no worse
than the unfused kernels' (RMSNorm kernel, copy, in-place RoPE kernel) it replaces. A timing line
against those unfused kernels is printed, not asserted.

Run on the GPU host:  python -m pytest -m gpu tests/gpu/test_qk_norm_rope_gpu.py -q -s
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference  # noqa: E402
from engine.kernels.rmsnorm import rms_norm  # noqa: E402
from engine.kernels.rope import apply_rope  # noqa: E402
from tests.gpu.timing import cuda_ms, rel  # noqa: E402

TOKENS = 16384


def _cos_sin(d, dtype):
    # Packed positions: four documents of a 16,384-token row, each restarting at 0.
    pos = torch.cat([torch.arange(n, device="cuda") for n in (5000, 7000, 3000, TOKENS - 15000)]).float()
    inv = 1.0 / (1_000_000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(hq, hk, d, dtype, offset):
    g = torch.Generator(device="cuda").manual_seed(hq * 1000 + d)
    q = (3 * torch.randn(1, TOKENS, hq * d, device="cuda", generator=g)).to(dtype)
    k = torch.randn(1, TOKENS, hk * d, device="cuda", generator=g).to(dtype)
    wq = (1.0 - offset + 0.2 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    wk = (1.0 - offset + 0.2 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    gq = torch.randn(1, TOKENS, hq, d, device="cuda", generator=g).to(dtype)
    gk = torch.randn(1, TOKENS, hk, d, device="cuda", generator=g).to(dtype)
    return q, k, wq, wk, gq, gk


def _unfused(q, k, wq, wk, cos, sin, eps_q, eps_k, offset):
    """What the attention forward runs without the fusion: the two norm kernels, a private copy,
    the in-place rotation."""
    qn, kn = rms_norm(q, wq, eps_q, offset).clone(), rms_norm(k, wk, eps_k, offset).clone()
    return apply_rope(qn, kn, cos, sin)


def _run(fn, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d):
    pq, pk = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = fn(pq.view(1, TOKENS, hq, d), pk.view(1, TOKENS, hk, d), wq, wk, cos, sin, 1e-6, 1e-6, offset)
    torch.autograd.backward((qo, ko), (gq, gk))
    return qo.detach(), ko.detach(), pq.grad, pk.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,d,offset", [(16, 8, 128, 0.0), (32, 8, 128, 0.0), (40, 8, 128, 0.0), (8, 4, 256, 1.0)])
def test_qk_norm_rope(hq, hk, d, offset, dtype):
    q, k, wq, wk, gq, gk = _inputs(hq, hk, d, dtype, offset)
    cos, sin = _cos_sin(d, dtype)
    got = _run(qk_norm_rope, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d)
    up = [t.float() for t in (q, k, wq, wk, cos, sin, gq, gk)]
    ref = _run(qk_norm_rope_reference, *up[:6], *up[6:], offset, hq, hk, d)
    apart = _run(_unfused, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d)
    names = ("q out", "k out", "dq", "dk")
    errs = {n: (rel(a, r), rel(b, r)) for n, a, b, r in zip(names, got, apart, ref)}
    print(
        f"\n[qk_norm_rope] {hq}/{hk} heads x {d}, offset {offset}, {dtype}: relative error fused / unfused "
        + ", ".join(f"{n} {f:.2e} / {u:.2e}" for n, (f, u) in errs.items())
    )
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    for n, (fused_err, apart_err) in errs.items():
        assert fused_err < limit, (n, fused_err)
        if dtype == torch.bfloat16:  # one rounding instead of two: never worse than the kernels it replaces
            assert fused_err <= 1.05 * apart_err + 1e-4, (n, fused_err, apart_err)

    if dtype == torch.bfloat16:
        fwd = {}
        for label, fn in (("fused", qk_norm_rope), ("unfused", _unfused)):
            pq, pk = q.view(1, TOKENS, hq, d), k.view(1, TOKENS, hk, d)
            fwd[label] = cuda_ms(lambda fn=fn, pq=pq, pk=pk: fn(pq, pk, wq, wk, cos, sin, 1e-6, 1e-6, offset))
        both = {
            label: cuda_ms(lambda fn=fn: _run(fn, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d))
            for label, fn in (("fused", qk_norm_rope), ("unfused", _unfused))
        }
        print(
            f"[qk_norm_rope] {TOKENS} tokens, {hq}/{hk} heads x {d}: forward fused {fwd['fused']:.3f} ms against "
            f"unfused {fwd['unfused']:.3f} ms; forward + backward {both['fused']:.3f} against {both['unfused']:.3f} ms"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,d,offset", [(16, 8, 128, 0.0), (32, 8, 128, 0.0), (8, 4, 256, 1.0)])
@pytest.mark.parametrize("warps", [1, 2, 8])
def test_every_warp_count_is_as_accurate_as_the_default(monkeypatch, hq, hk, d, offset, dtype, warps):
    """The warp count (WARPS; one warp forward was the fastest in bench.bandwidth) against the fp32
    reference: no worse than the default launch's error. Not bit for bit: the warp count changes the
    order of the per-row sum of squares (the twenty-third session's first GPU run: bits differed)."""
    import engine.kernels.qk_norm_rope as m

    q, k, wq, wk, gq, gk = _inputs(hq, hk, d, dtype, offset)
    cos, sin = _cos_sin(d, dtype)
    up = [t.float() for t in (q, k, wq, wk, cos, sin, gq, gk)]
    ref = _run(qk_norm_rope_reference, *up[:6], *up[6:], offset, hq, hk, d)
    monkeypatch.setattr(m, "WARPS", {"forward": None, "backward": None})  # the launch's own choice
    default = _run(qk_norm_rope, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d)
    monkeypatch.setattr(m, "WARPS", {"forward": warps, "backward": warps})
    got = _run(qk_norm_rope, q, k, wq, wk, cos, sin, gq, gk, offset, hq, hk, d)
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b, r in zip(("q out", "k out", "dq", "dk"), got, default, ref):
        err, default_err = rel(a, r), rel(b, r)
        print(f"[qk_norm_rope warps={warps}] {hq}/{hk}x{d} {dtype} {name}: {err:.3e} (default {default_err:.3e})")
        assert err < limit and err <= 1.02 * default_err + 1e-7, (name, err, default_err)
