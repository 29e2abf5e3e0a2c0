"""Per-head q/k RMSNorm and the RoPE rotation that follows it, in one kernel each way.

Qwen3, Gemma-3, EXAONE-4 and the Qwen3 MoE / Next families normalize every head of q and k
(RMSNorm over head_dim, q_norm / k_norm) and then rotate them. Run apart, that is four passes
over q and k forward (two norms, a private copy for the in-place rotation, the rotation) and
two back; here one program per token loads each head once, normalizes it in fp32, rotates it,
and writes the attention's input once. The backward reads the incoming gradient and the saved
pre-norm q/k, rotates the gradient back (by -theta) and takes the norm's backward, again once
per element, recomputing each row's 1/rms from the saved input (nothing else is saved).

    y = x / sqrt(mean(x^2) + eps) * (offset + w)        (RMSNorm; Gemma's 1 + w via offset=1)
    o = y * cos + rotate_half(y) * sin                  (RoPE, rotate_half convention)

All math is fp32 with one rounding at the end (the unfused kernels round y to the activation
dtype in between; the stock path rounds after every op). The norm weights must be frozen
(LoRA never trains them); a trainable one keeps the unfused path (engine.models.patches).

Public: `qk_norm_rope` (Triton, CUDA or TRITON_INTERPRET=1) and `qk_norm_rope_reference`
(the composition of the two references, for tests).
"""

from __future__ import annotations

import torch

from engine.counters import count
from engine.kernels._common import jit, next_pow2, tl
from engine.kernels.rmsnorm import rms_norm_reference
from engine.kernels.rope import _as_btd, _head_block, rope_reference


@jit
def _heads(
    X,
    DO,
    Y,
    sx_h,
    sdo_h,
    sy_h,
    n_heads,
    xbase,
    dobase,
    ybase,
    W,
    eps,
    offset,
    c1,
    c2,
    s1,
    s2,
    d_offs,
    d_mask,
    half,
    BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    w1 = tl.load(W + d_offs, mask=d_mask, other=0.0).to(tl.float32) + offset
    w2 = tl.load(W + half + d_offs, mask=d_mask, other=0.0).to(tl.float32) + offset
    n_cols = 2 * half
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        hrow = heads[:, None].to(tl.int64)
        px = X + xbase + hrow * sx_h + d_offs[None, :]
        x1 = tl.load(px, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(px + half, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / n_cols + eps)
        py = Y + ybase + hrow * sy_h + d_offs[None, :]
        if BACKWARD:
            pdo = DO + dobase + hrow * sdo_h + d_offs[None, :]
            do1 = tl.load(pdo, mask=mask, other=0.0).to(tl.float32)
            do2 = tl.load(pdo + half, mask=mask, other=0.0).to(tl.float32)
            # The rotation's transpose: o1 = y1 c1 - y2 s1, o2 = y2 c2 + y1 s2.
            g1 = (do1 * c1[None, :] + do2 * s2[None, :]) * w1[None, :]
            g2 = (do2 * c2[None, :] - do1 * s1[None, :]) * w2[None, :]
            xh1 = x1 * rstd[:, None]
            xh2 = x2 * rstd[:, None]
            # d/dx of x*r with r = (mean(x^2)+eps)^-1/2:  r * (g - x_hat * mean(g * x_hat))
            c = (tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)) / n_cols
            dx1 = (g1 - xh1 * c[:, None]) * rstd[:, None]
            dx2 = (g2 - xh2 * c[:, None]) * rstd[:, None]
            tl.store(py, dx1.to(Y.dtype.element_ty), mask=mask)
            tl.store(py + half, dx2.to(Y.dtype.element_ty), mask=mask)
        else:
            y1 = x1 * rstd[:, None] * w1[None, :]
            y2 = x2 * rstd[:, None] * w2[None, :]
            o1 = y1 * c1[None, :] - y2 * s1[None, :]
            o2 = y2 * c2[None, :] + y1 * s2[None, :]
            tl.store(py, o1.to(Y.dtype.element_ty), mask=mask)
            tl.store(py + half, o2.to(Y.dtype.element_ty), mask=mask)


@jit
def _qk_norm_rope_kernel(
    Q,
    K,
    DQO,
    DKO,
    QO,
    KO,
    WQ,
    WK,
    COS,
    SIN,
    seq_len,
    n_q_heads,
    n_k_heads,
    half,
    eps_q,
    eps_k,
    offset,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sdq_b,
    sdq_t,
    sdq_h,
    sdk_b,
    sdk_t,
    sdk_h,
    sqo_b,
    sqo_t,
    sqo_h,
    sko_b,
    sko_t,
    sko_h,
    sc_b,
    sc_t,
    ss_b,
    ss_t,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # One program per token: its cos/sin are loaded once for all of its q and k heads.
    tok = tl.program_id(0)
    b = (tok // seq_len).to(tl.int64)
    t = (tok % seq_len).to(tl.int64)
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < half
    cos_ptr = COS + b * sc_b + t * sc_t + d_offs
    sin_ptr = SIN + b * ss_b + t * ss_t + d_offs
    c1 = tl.load(cos_ptr, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + half, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + half, mask=d_mask, other=0.0).to(tl.float32)
    _heads(
        Q,
        DQO,
        QO,
        sq_h,
        sdq_h,
        sqo_h,
        n_q_heads,
        b * sq_b + t * sq_t,
        b * sdq_b + t * sdq_t,
        b * sqo_b + t * sqo_t,
        WQ,
        eps_q,
        offset,
        c1,
        c2,
        s1,
        s2,
        d_offs,
        d_mask,
        half,
        BLOCK_H=BLOCK_HQ,
        BACKWARD=BACKWARD,
    )
    _heads(
        K,
        DKO,
        KO,
        sk_h,
        sdk_h,
        sko_h,
        n_k_heads,
        b * sk_b + t * sk_t,
        b * sdk_b + t * sdk_t,
        b * sko_b + t * sko_t,
        WK,
        eps_k,
        offset,
        c1,
        c2,
        s1,
        s2,
        d_offs,
        d_mask,
        half,
        BLOCK_H=BLOCK_HK,
        BACKWARD=BACKWARD,
    )


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


# Warps a program each way (None: 4 for tiles of 1,024 values or more, else 2). Graph-timed on an H100
# (`python -m bench.bandwidth`, W1's 16/8 and W3's 32/8 heads of 128 over 16,384 tokens), one warp
# forward is faster (W1 80.6-80.8 against 90.9-91.4 us in two sessions; W3 128.7 against 134.5). Its bits
# differ from the 4-warp launch's (the per-row sum of squares in another order); its error against fp32
# is checked by tests/gpu/test_qk_norm_rope_gpu.py::test_every_warp_count_is_as_accurate_as_the_default.
# The backward gained from no warp count. Several tokens a program, and q and k in programs of their
# own, were slower or no faster at every warp count (levers.md), so neither exists.
WARPS = {"forward": 1, "backward": None}


def _launch(q, k, dq_out, dk_out, q_out, k_out, wq, wk, cos, sin, eps_q, eps_k, offset, backward: bool, warps=None):
    """Forward: q_out/k_out = rotate(norm(q/k)). Backward: q_out/k_out = the inputs' gradients
    from dq_out/dk_out (the gradients of the rotated outputs). `warps` overrides WARPS."""
    warps = warps or WARPS["backward" if backward else "forward"]
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if B * T == 0:
        return
    half = D // 2
    block_d = next_pow2(half)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    block_hq, block_hk = _head_block(Hq, block_d), _head_block(Hk, block_d)
    tile = max(block_hq, block_hk) * block_d
    _qk_norm_rope_kernel[(B * T,)](
        q,
        k,
        dq_out,
        dk_out,
        q_out,
        k_out,
        wq,
        wk,
        cos,
        sin,
        T,
        Hq,
        Hk,
        half,
        float(eps_q),
        float(eps_k),
        float(offset),
        *_strides(q),
        *_strides(k),
        *_strides(dq_out),
        *_strides(dk_out),
        *_strides(q_out),
        *_strides(k_out),
        cb,
        cos.stride(1),
        sb,
        sin.stride(1),
        BLOCK_D=block_d,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BACKWARD=backward,
        num_warps=warps or (4 if tile >= 1024 else 2),
    )


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


class QKNormRoPEFunction(torch.autograd.Function):
    """forward(q, k, wq, wk, cos, sin, eps_q, eps_k, offset) -> (rotated normed q, same for k).

    Saves q and k (the norms' inputs: what the unfused RMSNorm saved too) and cos/sin; the
    outputs are new tensors, so nothing is modified in place."""

    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, eps_q, eps_k, offset):
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        # The gradient pointers are unread in the forward; the outputs stand in for them.
        _launch(q, k, q_out, k_out, q_out, k_out, wq, wk, cos, sin, eps_q, eps_k, offset, backward=False)
        ctx.save_for_backward(q, k, wq, wk, cos, sin)
        ctx.eps = (eps_q, eps_k, offset)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, wq, wk, cos, sin = ctx.saved_tensors
        dq_out = torch.zeros_like(q) if dq_out is None else _unit_last(dq_out)
        dk_out = torch.zeros_like(k) if dk_out is None else _unit_last(dk_out)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        _launch(q, k, dq_out, dk_out, dq, dk, wq, wk, cos, sin, *ctx.eps, backward=True)
        return dq, dk, None, None, None, None, None, None, None


def _check(q, k, wq, wk, cos, sin) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"qk_norm_rope: q and k must be [B, T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"qk_norm_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if D % 2:
        raise ValueError(f"qk_norm_rope: head_dim must be even, got {D}")
    for name, w in (("q_norm weight", wq), ("k_norm weight", wk)):
        if w.dim() != 1 or w.shape[0] != D:
            raise ValueError(f"qk_norm_rope: {name} {tuple(w.shape)} does not match head_dim {D}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape[-1] != D or c.shape[-2] != T or (c.dim() == 3 and c.shape[0] not in (1, B)):
            raise ValueError(f"qk_norm_rope: {name} {tuple(c.shape)} does not fit q {tuple(q.shape)}")


def qk_norm_rope(q, k, wq, wk, cos, sin, eps_q: float = 1e-6, eps_k: float = 1e-6, offset: float = 0.0):
    """RMSNorm each head of q [B, T, Hq, D] and k [B, T, Hkv, D] (weights wq/wk [D], Gemma's
    1 + w with offset=1), then rotate both by cos/sin [B or 1, T, D]; returns new (q, k).

    Counted as the two norms and the rotation it stands for (rmsnorm:triton x2, rope:triton),
    and as qk_norm_rope:triton."""
    _check(q, k, wq, wk, cos, sin)
    cos, sin = _as_btd(cos, "cos"), _as_btd(sin, "sin")
    q, k = _unit_last(q), _unit_last(k)
    for key in ("qk_norm_rope:triton", "rmsnorm:triton", "rmsnorm:triton", "rope:triton"):
        count(key)
    return QKNormRoPEFunction.apply(q, k, wq, wk, cos, sin, eps_q, eps_k, offset)


def qk_norm_rope_reference(q, k, wq, wk, cos, sin, eps_q: float = 1e-6, eps_k: float = 1e-6, offset: float = 0.0):
    """The unfused torch math: each norm's reference (counted as rmsnorm:torch), then
    transformers' rotation."""
    qn = rms_norm_reference(q, wq, eps_q, offset)
    kn = rms_norm_reference(k, wk, eps_k, offset)
    return rope_reference(qn, kn, _as_btd(cos, "cos"), _as_btd(sin, "sin"))
