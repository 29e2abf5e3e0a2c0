"""Rotary position embedding applied in place to q and k, in the rotate_half convention.

q [B, T, Hq, D] and k [B, T, Hkv, D] are the projection outputs before the head transpose;
cos/sin [B or 1, T, D] come straight from transformers' rotary embedding module, so packed rows
whose positions restart at 0 need nothing special. One program per token loads that token's
cos/sin once and rotates every q and k head, writing back over its input: no extra activation
memory, and nothing is saved for the backward except cos/sin, since the backward is the
transposed rotation (by -theta). The backward writes new gradient tensors: the incoming ones
may be shared (autograd hands one tensor to several consumers), so they are only read.

The usual q = q_proj(x).view(B, T, H, D) is rotated through the projection output it views
(`RoPEFunction` on the base): dirtying the view itself would make autograd rebase it on
CopySlices, whose backward clones, zero-fills and copies each whole gradient.

Public: `apply_rope` (dispatcher), `apply_rope_triton`, `apply_rope_reference`, and the torch math
`rope_reference` / `rotate_half` (uncounted).
"""

from __future__ import annotations

import torch

from engine.counters import count
from engine.kernels._common import jit, next_pow2, on_cuda, tl

# Values per half-head tile a program rotates at once (heads x D/2).
_TILE_ELEMS = 2048


@jit
def _rotate_heads(
    X, Y, stride_xh, stride_yh, n_heads, base_x, base_y, c1, c2, sa, sb, d_offs, d_mask, half, BLOCK_H: tl.constexpr
):
    # Y may be X itself (the in-place forward): each value is loaded before it is stored.
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        in1 = X + base_x + heads[:, None].to(tl.int64) * stride_xh + d_offs[None, :]
        out1 = Y + base_y + heads[:, None].to(tl.int64) * stride_yh + d_offs[None, :]
        x1 = tl.load(in1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(in1 + half, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1[None, :] - x2 * sa[None, :]
        o2 = x2 * c2[None, :] + x1 * sb[None, :]
        tl.store(out1, o1.to(Y.dtype.element_ty), mask=mask)
        tl.store(out1 + half, o2.to(Y.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    seq_len,
    n_q_heads,
    n_k_heads,
    half,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_qob,
    stride_qot,
    stride_qoh,
    stride_kob,
    stride_kot,
    stride_koh,
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    tok = tl.program_id(0)
    b = (tok // seq_len).to(tl.int64)
    t = (tok % seq_len).to(tl.int64)
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < half
    cos_ptr = COS + b * stride_cb + t * stride_ct + d_offs
    sin_ptr = SIN + b * stride_sb + t * stride_st + d_offs
    c1 = tl.load(cos_ptr, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + half, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + half, mask=d_mask, other=0.0).to(tl.float32)
    # Forward:  o1 = x1*c1 - x2*s1,  o2 = x2*c2 + x1*s2   (x*cos + rotate_half(x)*sin).
    # Backward is the transpose of that map: g1*c1 + g2*s2 and g2*c2 - g1*s1, i.e. the same
    # formula with the sine halves swapped and negated (rotation by -theta).
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    q_at, qo_at = b * stride_qb + t * stride_qt, b * stride_qob + t * stride_qot
    _rotate_heads(
        Q, QO, stride_qh, stride_qoh, n_q_heads, q_at, qo_at, c1, c2, sa, sb, d_offs, d_mask, half, BLOCK_H=BLOCK_HQ
    )
    k_at, ko_at = b * stride_kb + t * stride_kt, b * stride_kob + t * stride_kot
    _rotate_heads(
        K, KO, stride_kh, stride_koh, n_k_heads, k_at, ko_at, c1, c2, sa, sb, d_offs, d_mask, half, BLOCK_H=BLOCK_HK
    )


def _head_block(n_heads: int, block_d: int) -> int:
    # The largest power of two dividing n_heads (so no lanes idle, e.g. 40 heads -> 8),
    # capped so a tile stays about _TILE_ELEMS values.
    cap = max(1, _TILE_ELEMS // block_d)
    block = n_heads & -n_heads if n_heads > 0 else 1
    block = min(block, cap)
    if block < 4 and n_heads >= 4:  # odd head counts: accept a few masked lanes instead
        block = min(next_pow2(n_heads), cap)
    return max(block, 1)


def _as_btd(c: torch.Tensor, name: str) -> torch.Tensor:
    if c.dim() == 2:
        c = c.unsqueeze(0)
    if c.dim() != 3:
        raise ValueError(f"apply_rope: {name} must be [B or 1, T, D], got {tuple(c.shape)}")
    if c.stride(-1) != 1:
        c = c.contiguous()
    return c


def _launch(q, k, cos, sin, backward: bool, q_out=None, k_out=None) -> None:
    """Rotate q and k (or q alone when k is None) into q_out and k_out ([B, T, H, D] each), or in
    place where those are None; `backward` rotates by -theta (the transpose)."""
    B, T, Hq, D = q.shape
    Hk = 0 if k is None else k.shape[2]
    if k is None:
        k = q  # never touched: the k loop runs over zero heads
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    if B * T == 0:
        return
    half = D // 2
    block_d = next_pow2(half)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    block_hq, block_hk = _head_block(Hq, block_d), _head_block(Hk, block_d)
    tile = max(block_hq, block_hk) * block_d
    _rope_kernel[(B * T,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        T,
        Hq,
        Hk,
        half,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        q_out.stride(0),
        q_out.stride(1),
        q_out.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        k_out.stride(2),
        cb,
        cos.stride(1),
        sb,
        sin.stride(1),
        BLOCK_D=block_d,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BACKWARD=backward,
        num_warps=4 if tile >= 1024 else 2,
    )


def _check(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be [B, T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if D % 2:
        raise ValueError(f"apply_rope: head_dim must be even, got {D}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape[-1] != D or c.shape[-2] != T or (c.dim() == 3 and c.shape[0] not in (1, B)):
            raise ValueError(f"apply_rope: {name} {tuple(c.shape)} does not fit q {tuple(q.shape)}")


def _unit_last_stride(x: torch.Tensor) -> bool:
    return x.shape[-1] <= 1 or x.stride(-1) == 1


def _grad_heads(g: torch.Tensor, heads) -> torch.Tensor:
    """An incoming gradient as [B, T, H, D] with a unit stride along D (what the kernel reads)."""
    g = g.reshape(heads)
    return g if _unit_last_stride(g) else g.contiguous()


def _rotated_back(dq, dk, q_shape, k_shape, q_heads, k_heads, cos, sin):
    """The gradients of rotated q (and k) rotated back into new tensors of q's (k's) own shape, in
    one launch. The incoming ones may be shared (autograd hands one tensor to several consumers,
    or a caller passes its own), so they are only read; a missing one is zeros."""
    like = dq if dq is not None else dk
    outs = []
    for g, shape in ((dq, q_shape), (dk, k_shape)):
        if shape is None:
            outs.append(None)
        elif g is None:
            outs.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
        else:
            outs.append(torch.empty(shape, dtype=g.dtype, device=g.device))
    rotate = [(g, o, h) for g, o, h in ((dq, outs[0], q_heads), (dk, outs[1], k_heads)) if g is not None]
    (g1, o1, h1), rest = rotate[0], rotate[1:]
    g2, o2 = (_grad_heads(rest[0][0], rest[0][2]), rest[0][1].view(rest[0][2])) if rest else (None, None)
    _launch(_grad_heads(g1, h1), g2, cos, sin, backward=True, q_out=o1.view(h1), k_out=o2)
    return outs


class RoPEFunction(torch.autograd.Function):
    """In-place rotation of q and k in one launch; the backward rotates the gradients back into new tensors.

    q and k must own their storage (autograd refuses a Function that dirties a view and returns
    two tensors). They may come in any shape of the same numel, e.g. the projection outputs
    [B, T, H*D] behind the usual q = q_proj(x).view(B, T, H, D): `heads` gives the [B, T, H, D]
    shapes to rotate them as, and the gradients go back in the inputs' shapes.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, heads=None):
        q_heads, k_heads = heads or (q.shape, k.shape)
        _launch(q.view(q_heads), k.view(k_heads), cos, sin, backward=False)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        ctx.meta = (q.shape, k.shape, q_heads, k_heads)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _rotated_back(dq, dk, *ctx.meta, cos, sin)
        return dq, dk, None, None, None


class RoPESingleFunction(torch.autograd.Function):
    """In-place rotation of one tensor [B, T, H, D] that may be a partial view (autograd then
    rebases it on CopySlices, which copies its gradient); backward as above."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        _launch(x, None, cos, sin, backward=False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin = ctx.saved_tensors
        (dx, _) = _rotated_back(dx, None, dx.shape, None, dx.shape, None, cos, sin)
        return dx, None, None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] along the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' apply_rotary_pos_emb for [B, T, H, D] tensors (unsqueeze_dim=2), op for op
    (so bit-identical to the stock attention), out of place; cos/sin [B or 1, T, D]. Not counted:
    the stock-numerics fallback of engine.models.patches calls it too."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rope_reference` behind the dispatcher: cos/sin may also be [T, D]; counted."""
    count("rope:torch")
    return rope_reference(q, k, _as_btd(cos, "cos"), _as_btd(sin, "sin"))


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1); in place."""
    _check(q, k, cos, sin)
    if not (_unit_last_stride(q) and _unit_last_stride(k)):
        raise ValueError("apply_rope: q and k need a unit stride along head_dim to be rotated in place")
    cos, sin = _as_btd(cos, "cos"), _as_btd(sin, "sin")
    count("rope:triton")
    if not (q._is_view() or k._is_view()):
        return RoPEFunction.apply(q, k, cos, sin)
    qb, kb = _whole_base(q), _whole_base(k)
    if qb is not None and kb is not None and qb is not kb:
        # The usual case, q = q_proj(x).view(B, T, H, D): rotate the projection outputs
        # themselves. Dirtying the views instead makes autograd rebase them on CopySlices, whose
        # backward clones each whole gradient, zero-fills another and copies back (8 copies a
        # layer of a Llama step, about 1.6% of W2's).
        qb, kb = RoPEFunction.apply(qb, kb, cos, sin, (q.shape, k.shape))
        return qb.view(q.shape), kb.view(k.shape)
    # Partial views (q and k split from one fused qkv projection) take the per-view form.
    return RoPESingleFunction.apply(q, cos, sin), RoPESingleFunction.apply(k, cos, sin)


def _whole_base(x: torch.Tensor):
    """The tensor `x` views when `x` is all of it, contiguous and in its order (a plain reshape
    of a tensor that owns its storage); else None."""
    base = x._base
    if base is None or base._is_view() or not (x.is_contiguous() and base.is_contiguous()):
        return None
    if base.numel() != x.numel() or base.data_ptr() != x.data_ptr():
        return None
    return base


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [B, T, Hq, D] and k [B, T, Hkv, D] by cos/sin [B or 1, T, D]; returns (q, k).

    On CUDA the rotation happens in place and the returned tensors are q and k themselves; the
    CPU reference returns new tensors, so callers must always use the returned pair.
    """
    if on_cuda(q, k, cos, sin):
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_reference(q, k, cos, sin)
