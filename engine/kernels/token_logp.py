"""Per-token log-probabilities of the targets through the LM head, without the [tokens x vocab] logits.

Preference training (DPO, ORPO, SimPO, KTO) and GRPO need each answer's log-probability, a sum
of per-token log-probs over the answer's own tokens, and GRPO needs the per-token values
themselves (its ratios and KL are per token). This is the per-token output of the fused linear
cross-entropy (engine.kernels.fused_ce): the same chunked walk, the same Triton row kernel
(`_ce_rows`: online logsumexp, then the row's gradient written over its logits), but the rows'
values come back as a [tokens] vector, logp[t] = z[t, target[t]] - logsumexp(z[t]), and 0 where
the target is ignored.

Backward. The upstream gradient is a vector now, one weight per token, not one scalar; the
forward still forms each row's gradient with respect to its hidden state (grad_hidden row t
depends on row t only), so the backward scales the stored rows by -grad_output[t]. A trainable
head (rare with LoRA) cannot be rescaled afterwards, its gradient sums over rows: the backward
then recomputes it chunk by chunk in fp32 with the row weights known.

`sum_per_document` turns per-token values into per-document sums through the packed metadata's
lengths (known on the host, so no sync).

Public: `fused_linear_token_logp` (dispatcher), `fused_linear_token_logp_triton`,
`fused_linear_token_logp_reference`, `sum_per_document`, `document_index`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.counters import count
from engine.kernels._common import on_cuda
from engine.kernels.fused_ce import _ce_rows, default_chunk_tokens


def _check(hidden, weight, targets, bias):
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_token_logp: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "must be [N, H] and [V, H]"
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    if t1.shape[0] != h2.shape[0]:
        raise ValueError(f"fused_linear_token_logp: {t1.shape[0]} targets for {h2.shape[0]} hidden rows")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_token_logp: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")
    return h2, t1


def _transform(logits, logit_scale, softcap):
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def fused_linear_token_logp_reference(
    hidden, weight, targets, *, bias=None, ignore_index=-100, softcap=None, logit_scale=1.0, chunk_tokens=None
):
    """Plain torch in fp32 with the full logits: [N] fp32 log p(target), 0 where ignored."""
    count("token_logp:torch")
    h2, t1 = _check(hidden, weight, targets, bias)
    logits = h2.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    logp = torch.log_softmax(_transform(logits, logit_scale, softcap), dim=-1)
    keep = t1 != ignore_index
    picked = logp.gather(1, torch.where(keep, t1, 0).unsqueeze(1)).squeeze(1)
    return torch.where(keep, picked, torch.zeros_like(picked))


def _chunked_forward(hidden, weight, targets, bias, ignore_index, softcap, logit_scale, chunk_tokens, need_h):
    """(-loss rows = logp [N] fp32, d loss_t / d hidden_t rows or None)."""
    n, h_dim = hidden.shape
    v = weight.shape[0]
    loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty((n, h_dim), dtype=hidden.dtype, device=hidden.device) if need_h else None
    dtype = weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(v, torch.finfo(dtype).bits // 8)
    chunk = max(1, min(int(chunk), n)) if n else 1
    logits_buf = torch.empty((chunk, v), dtype=dtype, device=hidden.device)
    w_t = weight.t()
    bias_c = None if bias is None else bias.to(dtype)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        logits = logits_buf[: e - s]
        if bias_c is None:
            torch.mm(hidden[s:e], w_t, out=logits)
        else:
            torch.addmm(bias_c, hidden[s:e], w_t, out=logits)
        _ce_rows(logits, targets[s:e], loss_rows[s:e], ignore_index, logit_scale, softcap, need_h)
        if need_h:
            torch.mm(logits, weight, out=grad_h[s:e])
    return loss_rows.neg_(), grad_h


def _head_grads(hidden, weight, targets, bias, row_w, ignore_index, softcap, logit_scale, chunk, need_w, need_b):
    """Gradients of sum_t row_w[t] * logp[t] for a trainable head, recomputed chunk by chunk in fp32."""
    v = weight.shape[0]
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if need_b else None
    w32 = weight.float()
    for s in range(0, hidden.shape[0], chunk):
        e = min(s + chunk, hidden.shape[0])
        h = hidden[s:e].float()
        raw = h @ w32.t()
        if bias is not None:
            raw = raw + bias.float()
        with torch.enable_grad():
            raw = raw.detach().requires_grad_()
            t = targets[s:e]
            keep = t != ignore_index
            logp = torch.log_softmax(_transform(raw, logit_scale, softcap), -1)
            picked = logp.gather(1, torch.where(keep, t, 0).unsqueeze(1)).squeeze(1)
            (g_raw,) = torch.autograd.grad((picked * keep * row_w[s:e]).sum(), raw)
        if need_w:
            grad_w.addmm_(g_raw.t(), h)
        if need_b:
            grad_b += g_raw.sum(0)
    return grad_w, grad_b


class FusedLinearTokenLogpFunction(torch.autograd.Function):
    """Per-token log-probs in the forward with each row's hidden gradient; the backward weights the rows."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, ignore_index, softcap, logit_scale, chunk_tokens, need_h):
        logp, grad_h = _chunked_forward(
            hidden, weight, targets, bias, ignore_index, softcap, logit_scale, chunk_tokens, need_h
        )
        need_head = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[3])
        ctx.args = (ignore_index, softcap, logit_scale, chunk_tokens or default_chunk_tokens(weight.shape[0], 4))
        if need_head:  # the rare trainable head is recomputed in the backward
            ctx.save_for_backward(grad_h, hidden, weight, targets, bias)
        else:
            ctx.save_for_backward(grad_h)
        ctx.need_head = need_head
        return logp

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        grad_h = saved[0]
        row_w = grad_out.float()
        dh = dw = db = None
        if grad_h is not None:
            # d logp_t / d h_t = -(d loss_t / d h_t): one fp32 weight per row, one rounding.
            if grad_h.dtype == torch.float32:
                dh = grad_h.mul_(row_w.neg().unsqueeze(1))
            else:
                dh = (grad_h.float() * row_w.neg().unsqueeze(1)).to(grad_h.dtype)
        if ctx.need_head:
            _, hidden, weight, targets, bias = saved
            ignore_index, softcap, logit_scale, chunk = ctx.args
            need_w = ctx.needs_input_grad[1]
            need_b = bias is not None and ctx.needs_input_grad[3]
            gw, gb = _head_grads(
                hidden, weight, targets, bias, row_w, ignore_index, softcap, logit_scale, chunk, need_w, need_b
            )
            dw = None if gw is None else gw.to(weight.dtype)
            db = None if gb is None else gb.to(bias.dtype)
        return dh, dw, None, db, None, None, None, None, None


def fused_linear_token_logp_triton(
    hidden, weight, targets, *, bias=None, ignore_index=-100, softcap=None, logit_scale=1.0, chunk_tokens=None
):
    """The chunked Triton path regardless of device (CPU tensors need TRITON_INTERPRET=1)."""
    count("token_logp:triton")
    h2, t1 = _check(hidden, weight, targets, bias)
    if h2.dtype != weight.dtype:  # cuBLAS wants one dtype; the cast is differentiable
        h2 = h2.to(weight.dtype)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    need_h = torch.is_grad_enabled() and h2.requires_grad
    return FusedLinearTokenLogpFunction.apply(
        h2, weight, t1.contiguous(), bias, int(ignore_index), softcap, float(logit_scale), chunk_tokens, need_h
    )


def fused_linear_token_logp(
    hidden, weight, targets, *, bias=None, ignore_index=-100, softcap=None, logit_scale=1.0, chunk_tokens=None
):
    """log softmax(softcap(logit_scale * (hidden @ weight.T + bias)))[target] per token, as fp32 [N]
    (0 where the target is `ignore_index`). hidden [N, H], weight [V, H], targets [N] (already shifted).

    Triton on CUDA (never materializes [N, V] logits), the fp32 torch reference elsewhere.
    """
    fn = fused_linear_token_logp_triton if on_cuda(hidden, weight, targets) else fused_linear_token_logp_reference
    return fn(
        hidden,
        weight,
        targets,
        bias=bias,
        ignore_index=ignore_index,
        softcap=softcap,
        logit_scale=logit_scale,
        chunk_tokens=chunk_tokens,
    )


def document_index(lengths: Sequence[int], device=None) -> torch.Tensor:
    """int64 [sum(lengths)]: the document each token of a packed stream belongs to (built on the host)."""
    lens = torch.as_tensor(list(lengths), dtype=torch.int64)
    idx = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return idx if device is None else idx.to(device, non_blocking=True)


def sum_per_document(values: torch.Tensor, lengths: Sequence[int], doc_index: torch.Tensor | None = None):
    """[n_docs] sums of per-token `values` [T] over each packed document (differentiable)."""
    values = values.reshape(-1)
    if doc_index is None:
        doc_index = document_index(lengths, values.device)
    if doc_index.shape[0] != values.shape[0]:
        raise ValueError(f"sum_per_document: {values.shape[0]} values for documents of {doc_index.shape[0]} tokens")
    return values.new_zeros(len(lengths)).index_add(0, doc_index, values)
