"""Linear layer + cross-entropy without the [tokens x vocab] logits: the LM head's loss.

The forward walks the tokens in chunks. For each chunk, cuBLAS computes the chunk's logits
(hidden_chunk @ weight.T), then one Triton program per row streams that row twice: the first pass
finds the logsumexp (online max / sum, fp32) and the target's logit, the second writes the
gradient of the row's loss with respect to the raw logits over the logits themselves. cuBLAS then
turns that gradient into the chunk's grad_hidden (and grad_weight / grad_bias when those train).
So the forward already holds every gradient, the chunk buffer is reused, and the backward only
scales the stored grad_hidden by grad_output / normalizer (Liger-style).

Per-row math (x = raw logit, s = logit_scale, c = softcap):
    z = s * x;  z = c * tanh(z / c) if softcapped;  loss = logsumexp(z) - z[target]
    dloss/dx = (softmax(z) - onehot(target)) * (1 - tanh^2) * s
Rows whose target is ignore_index get loss 0 and a zero gradient, and are never read twice.

Public: `fused_linear_cross_entropy` (dispatcher), `fused_linear_cross_entropy_triton`,
`fused_linear_cross_entropy_reference`, `default_chunk_tokens`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.counters import count
from engine.kernels._common import next_pow2, on_cuda, tanh_f32

# Vocabulary values a program holds per step of its row loop, and its warps (at most; fewer for a small
# vocabulary). 8 warps passed a 512-row chunk of a 151,936 vocabulary in 0.187 ms against 0.197 with 16,
# graph-timed on an H100 (`python -m bench.bandwidth --only ce_rows`), about 0.3 ms a W1 step. A grid of a
# few programs per SM walking the rows, so that a row's second read might find it in L2, was no faster
# (bandwidth.jsonl).
CE_BLOCK_V = 8192
CE_NUM_WARPS = 8
# Upper bound on one chunk's logits buffer.
CHUNK_BUDGET_BYTES = 256 * 1024 * 1024
# grad_weight is accumulated in fp32; a low-precision chunk product is formed this many vocab
# rows at a time so the temporary stays small.
_GRAD_W_SLICE = 16384


@triton.jit
def _ce_rows_kernel(
    LOGITS,
    stride_row,
    TARGETS,
    LOSS,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    ptr = LOGITS + row.to(tl.int64) * stride_row
    target = tl.load(TARGETS + row).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    if target != ignore_index:
        # Pass 1: running max and rescaled sum of exponentials, one reduction per block.
        m = float("-inf")
        d = 0.0
        z_target = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            z = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
            if HAS_SOFTCAP:
                z = softcap * tanh_f32(z / softcap)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            z_target += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
        lse = m + tl.log(d)
        tl.store(LOSS + row, lse - z_target)
        if COMPUTE_GRAD:
            # Pass 2: d loss / d raw logit, written over the logits (the buffer is not needed
            # afterwards, and cuBLAS reads the gradient from it).
            inv_d = 1.0 / d
            for start in range(0, n_cols, BLOCK):
                cols = start + offs
                mask = cols < n_cols
                z = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
                if HAS_SOFTCAP:
                    t = tanh_f32(z / softcap)
                    z = softcap * t
                g = tl.exp(z - m) * inv_d
                g = tl.where(cols == target, g - 1.0, g)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                g = g * logit_scale
                tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)
    else:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=tl.float32).to(LOGITS.dtype.element_ty)
            for start in range(0, n_cols, BLOCK):
                cols = start + offs
                tl.store(ptr + cols, zeros, mask=cols < n_cols)


def default_chunk_tokens(vocab_size: int, element_size: int) -> int:
    """Tokens per chunk: a power of two whose logits fit CHUNK_BUDGET_BYTES, within [256, 8192].

    bf16 logits of a 151,936 vocabulary give 512 tokens (155 MB), still a tall enough matmul to
    run near peak.
    """
    rows = max(1, CHUNK_BUDGET_BYTES // max(1, vocab_size * element_size))
    p = 1 << (rows.bit_length() - 1)
    return int(min(max(p, 256), 8192))


def _ce_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_rows: torch.Tensor,
    ignore_index: int,
    logit_scale: float,
    softcap: float | None,
    compute_grad: bool,
) -> None:
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = min(CE_BLOCK_V, next_pow2(n_cols))
    _ce_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        targets,
        loss_rows,
        n_cols,
        int(ignore_index),
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        HAS_SOFTCAP=bool(softcap),
        COMPUTE_GRAD=compute_grad,
        BLOCK=block,
        num_warps=min(CE_NUM_WARPS, max(2, block // 512)),
    )


def _chunked_forward(
    hidden, weight, targets, bias, ignore_index, softcap, logit_scale, chunk_tokens, need_h, need_w, need_b
):
    """Sum of row losses (fp32 0-dim) and the unnormalized gradients that were asked for."""
    n, h_dim = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    loss_rows = torch.empty(n, dtype=torch.float32, device=device)
    compute_grad = need_h or need_w or need_b
    grad_h = torch.empty((n, h_dim), dtype=hidden.dtype, device=device) if need_h else None
    grad_w = torch.zeros((v, h_dim), dtype=torch.float32, device=device) if need_w else None
    grad_b = torch.zeros(v, dtype=torch.float32, device=device) if need_b else None
    w_tmp = None
    if need_w and weight.dtype != torch.float32:
        w_tmp = torch.empty((min(v, _GRAD_W_SLICE), h_dim), dtype=weight.dtype, device=device)

    dtype = weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(v, torch.finfo(dtype).bits // 8)
    chunk = max(1, min(int(chunk), n)) if n else 1
    logits_buf = torch.empty((chunk, v), dtype=dtype, device=device)
    w_t = weight.t()
    bias_c = None if bias is None else bias.to(dtype)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h_c = hidden[s:e]
        logits = logits_buf[: e - s]
        if bias is None:
            torch.mm(h_c, w_t, out=logits)
        else:
            torch.addmm(bias_c, h_c, w_t, out=logits)
        _ce_rows(logits, targets[s:e], loss_rows[s:e], ignore_index, logit_scale, softcap, compute_grad)
        if need_h:
            torch.mm(logits, weight, out=grad_h[s:e])
        if need_w:
            if w_tmp is None:
                grad_w.addmm_(logits.t(), h_c)
            else:
                for vs in range(0, v, _GRAD_W_SLICE):
                    ve = min(vs + _GRAD_W_SLICE, v)
                    part = w_tmp[: ve - vs]
                    torch.mm(logits[:, vs:ve].t(), h_c, out=part)
                    grad_w[vs:ve] += part
        if need_b:
            grad_b += logits.sum(0, dtype=torch.float32)
    return loss_rows.sum(), grad_h, grad_w, grad_b


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Loss and all gradients in the forward; the backward rescales the stored gradients."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        bias,
        normalizer,
        ignore_index,
        softcap,
        logit_scale,
        chunk_tokens,
        need_h,
        need_w,
        need_b,
    ):
        total, grad_h, grad_w, grad_b = _chunked_forward(
            hidden,
            weight,
            targets,
            bias,
            ignore_index,
            softcap,
            logit_scale,
            chunk_tokens,
            need_h,
            need_w,
            need_b,
        )
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        if isinstance(normalizer, torch.Tensor):
            ctx.save_for_backward(grad_h, grad_w, grad_b, normalizer)
            ctx.normalizer = None
        else:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
            ctx.normalizer = float(normalizer)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.normalizer is None:
            grad_h, grad_w, grad_b, normalizer = ctx.saved_tensors
        else:
            (grad_h, grad_w, grad_b), normalizer = ctx.saved_tensors, ctx.normalizer
        scale = grad_out.float() / normalizer
        # The stored gradients are used exactly once, so they are scaled in place (fp32 scale,
        # one rounding into the gradient's dtype). A second backward (retain_graph) is refused by
        # autograd's version check on the saved tensors.
        dh = grad_h.mul_(scale) if grad_h is not None else None
        dw = grad_w.mul_(scale).to(ctx.weight_dtype) if grad_w is not None else None
        db = grad_b.mul_(scale).to(ctx.bias_dtype) if grad_b is not None else None
        return dh, dw, None, db, None, None, None, None, None, None, None, None


def _prepare(hidden, weight, targets, bias, ignore_index, normalizer):
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "must be [N, H] and [V, H]"
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    if t1.shape[0] != h2.shape[0]:
        raise ValueError(f"fused_linear_cross_entropy: {t1.shape[0]} targets for {h2.shape[0]} hidden rows")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    if normalizer is None:
        # A device tensor, so no host sync; at least 1 so an all-ignored batch gives 0, not NaN.
        normalizer = (t1 != ignore_index).sum().clamp_min(1).to(torch.float32)
    elif isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.detach().to(device=hidden.device, dtype=torch.float32)
    else:
        normalizer = float(normalizer)
    return h2, t1, normalizer


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    softcap=None,
    logit_scale=1.0,
    normalizer=None,
    chunk_tokens=None,
):
    """Plain torch in fp32 with the full logits: sum of token losses / normalizer."""
    count("fused_ce:torch")
    h2, t1, normalizer = _prepare(hidden, weight, targets, bias, ignore_index, normalizer)
    logits = h2.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    total = torch.nn.functional.cross_entropy(logits, t1, ignore_index=ignore_index, reduction="sum")
    return total / normalizer


def fused_linear_cross_entropy_triton(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    softcap=None,
    logit_scale=1.0,
    normalizer=None,
    chunk_tokens=None,
):
    """The chunked Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    count("fused_ce:triton")
    h2, t1, normalizer = _prepare(hidden, weight, targets, bias, ignore_index, normalizer)
    if h2.dtype != weight.dtype:  # cuBLAS wants one dtype; the cast is differentiable
        h2 = h2.to(weight.dtype)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    t1 = t1.contiguous()
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    need_b = grad_on and bias is not None and bias.requires_grad
    loss = FusedLinearCrossEntropyFunction.apply(
        h2,
        weight,
        t1,
        bias,
        normalizer,
        int(ignore_index),
        softcap,
        float(logit_scale),
        chunk_tokens,
        need_h,
        need_w,
        need_b,
    )
    return loss


def fused_linear_cross_entropy(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    ignore_index=-100,
    softcap=None,
    logit_scale=1.0,
    normalizer=None,
    chunk_tokens=None,
):
    """sum over non-ignored tokens of CE(softcap(logit_scale * (hidden @ weight.T + bias)), target)
    / normalizer, as an fp32 scalar. hidden [N, H], weight [V, H], targets [N] int64 (already
    shifted). normalizer: float or 0-dim tensor; default the count of non-ignored targets (>= 1).

    Triton on CUDA (never materializes [N, V] logits), the fp32 torch reference elsewhere.
    """
    fn = fused_linear_cross_entropy_triton if on_cuda(hidden, weight, targets) else fused_linear_cross_entropy_reference
    return fn(
        hidden,
        weight,
        targets,
        bias=bias,
        ignore_index=ignore_index,
        softcap=softcap,
        logit_scale=logit_scale,
        normalizer=normalizer,
        chunk_tokens=chunk_tokens,
    )
