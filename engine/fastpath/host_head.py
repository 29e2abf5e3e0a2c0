"""A tied output head whose table lives in host memory: the loss streams it in vocabulary slices.

A model that ties its output head to its input embedding (Qwen3-0.6B to 4B, Llama-3.2) needs
the table on both ends: the input side looks rows up (engine.fastpath.host_embed does that from
host memory), the head multiplies every hidden state by the whole table. Qwen3-4B's is
151,936 x 2,560 bf16, 0.72 GiB: on a laptop card that is the difference between fitting and
not. `HostHead` takes the head's place and holds the same pinned host table as the input side's
`HostEmbedding`, so the model keeps one copy, on the host.

The loss (`streamed_linear_cross_entropy`) walks the vocabulary in slices. On CUDA each slice
is copied to one of two device buffers on a side stream while the previous slice computes (the
table crosses the bus once per micro-batch). Per slice:

    z = scale * (hidden @ w_slice.T)          [tokens x slice], softcapped if the model asks
    m' = max(m, rowmax z);  a = exp(m - m')   the running max and its rescale (online softmax)
    s  = a * s + rowsum exp(z - m')
    acc = a * acc + exp(z - m') @ w_slice     the softmax-weighted sum of the table's rows
    target logit and d z_target / d hidden    for rows whose target falls in the slice

so that after the last slice loss = m + log s - z_target and d loss / d hidden =
scale * acc / s - d z_target / d hidden (softcap's derivative folded in per element). Like the
fused cross-entropy (engine.kernels.fused_ce), the forward already holds grad_hidden and the
backward only scales it: one pass over the table per micro-batch. The table is frozen, so
there is no weight gradient. No host sync: slice bounds are host integers, the targets stay
on the device.

`HostHead.forward(hidden)` gives plain logits (generation, chat) over the same slices; it has
no backward (training goes through the loss).

Public: `HostHead`, `streamed_linear_cross_entropy`, `weight_slices`, `slice_rows`.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from engine.fastpath.streams import side_stream

# Bytes of one fp32 [tokens x slice] temporary: the slice's logits. The slice's device buffer
# is bounded too (generation has few tokens: the weight, not the logits, sets the size).
LOGITS_BUDGET_BYTES = 32 * 1024 * 1024
WEIGHT_BUDGET_BYTES = 64 * 1024 * 1024
MIN_SLICE_ROWS = 1024


def slice_rows(tokens: int, hidden: int, vocab: int, element_size: int) -> int:
    """Vocabulary rows per slice: fp32 logits within LOGITS_BUDGET_BYTES and the weight slice
    within WEIGHT_BUDGET_BYTES, a multiple of 256, at least MIN_SLICE_ROWS, at most the vocab."""
    by_logits = LOGITS_BUDGET_BYTES // max(1, tokens * 4)
    by_weight = WEIGHT_BUDGET_BYTES // max(1, hidden * element_size)
    rows = max(MIN_SLICE_ROWS, (min(by_logits, by_weight) // 256) * 256)
    return int(min(rows, vocab))


def weight_slices(
    host_weight: torch.Tensor, device: torch.device, rows: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, end, slice on `device`) over the table's rows, `rows` at a time.

    On CUDA the copies run on a side stream into two alternating buffers: slice j+1 is in
    flight while slice j computes, the first copy waits for the work already queued on the
    compute stream, and a buffer is written again only after the compute stream is done with
    it (events, no host sync). Elsewhere the slices are views of the table."""
    vocab = host_weight.shape[0]
    bounds = [(a, min(a + rows, vocab)) for a in range(0, vocab, rows)]
    if device.type != "cuda":
        for a, b in bounds:
            yield a, b, host_weight[a:b].to(device)
        return
    compute = torch.cuda.current_stream(device)
    copier = side_stream(device, "host_head")
    bufs = [torch.empty((rows, host_weight.shape[1]), dtype=host_weight.dtype, device=device) for _ in range(2)]
    # The buffers come from the compute stream's pool: their blocks may have been freed by
    # kernels still queued there (the forward runs ahead of the host). The copier must not
    # write into them before those kernels have run.
    copier.wait_stream(compute)
    ready = [torch.cuda.Event(), torch.cuda.Event()]
    done = [torch.cuda.Event(), torch.cuda.Event()]

    def issue(j: int) -> None:
        a, b = bounds[j]
        with torch.cuda.stream(copier):
            if j >= 2:  # the compute stream has finished with this buffer's previous slice
                copier.wait_event(done[j % 2])
            bufs[j % 2][: b - a].copy_(host_weight[a:b], non_blocking=True)
            ready[j % 2].record(copier)

    issue(0)
    for j, (a, b) in enumerate(bounds):
        if j + 1 < len(bounds):
            issue(j + 1)
        compute.wait_event(ready[j % 2])
        yield a, b, bufs[j % 2][: b - a]
        done[j % 2].record(compute)


def _streamed(hidden, host_weight, targets, ignore_index, softcap, scale, need_h, rows):
    """(sum of row losses as an fp32 0-dim tensor, unnormalized grad_hidden or None)."""
    n, h_dim = hidden.shape
    dev = hidden.device
    valid = targets != ignore_index
    t = torch.where(valid, targets, torch.zeros_like(targets))
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    s = torch.zeros(n, dtype=torch.float32, device=dev)
    z_t = torch.zeros(n, dtype=torch.float32, device=dev)
    acc = torch.zeros((n, h_dim), dtype=torch.float32, device=dev) if need_h else None
    d_t = torch.zeros((n, h_dim), dtype=torch.float32, device=dev) if need_h else None
    for a, b, w in weight_slices(host_weight, dev, rows):
        z = torch.mm(hidden, w.t()).float()
        if scale != 1.0:
            z.mul_(scale)
        slope = None  # d softcap(z) / d z, per element, when softcapped
        if softcap:
            z.div_(softcap).tanh_()
            slope = 1.0 - z * z
            z.mul_(softcap)
        here = (t >= a) & (t < b)  # rows whose target is in this slice
        local = (t - a).clamp_(0, b - a - 1).unsqueeze(1)
        z_t += torch.where(here, z.gather(1, local).squeeze(1), 0.0)
        m_new = torch.maximum(m, z.amax(1))
        alpha = torch.exp(m - m_new)  # 0 on the first slice (m = -inf)
        p = z.sub_(m_new.unsqueeze(1)).exp_()  # in place: z is not needed any more
        s = s * alpha + p.sum(1)
        if need_h:
            d_here = torch.full((n,), scale, dtype=torch.float32, device=dev)
            if slope is not None:
                d_here = d_here * slope.gather(1, local).squeeze(1)
                p.mul_(slope)
            acc.mul_(alpha.unsqueeze(1)).add_(torch.mm(p.to(w.dtype), w))
            rows_t = w.index_select(0, local.squeeze(1)).float()
            d_t += rows_t * torch.where(here, d_here, 0.0).unsqueeze(1)
        m = m_new
    loss_rows = torch.where(valid, m + torch.log(s) - z_t, 0.0)
    grad_h = None
    if need_h:
        grad_h = acc.mul_((scale / s).unsqueeze(1)).sub_(d_t)
        grad_h = torch.where(valid.unsqueeze(1), grad_h, 0.0).to(hidden.dtype)
    return loss_rows.sum(), grad_h


class _StreamedCE(torch.autograd.Function):
    """Loss and grad_hidden in the forward; the backward scales the stored gradient."""

    @staticmethod
    def forward(ctx, hidden, host_weight, targets, normalizer, ignore_index, softcap, scale, need_h, rows):
        total, grad_h = _streamed(hidden, host_weight, targets, ignore_index, softcap, scale, need_h, rows)
        if isinstance(normalizer, torch.Tensor):
            ctx.save_for_backward(grad_h, normalizer)
            ctx.normalizer = None
        else:
            ctx.save_for_backward(grad_h)
            ctx.normalizer = float(normalizer)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.normalizer is None:
            grad_h, normalizer = ctx.saved_tensors
        else:
            (grad_h,), normalizer = ctx.saved_tensors, ctx.normalizer
        dh = grad_h.mul_(grad_out.float() / normalizer) if grad_h is not None else None
        return dh, None, None, None, None, None, None, None, None


def streamed_linear_cross_entropy(
    hidden: torch.Tensor,
    host_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    normalizer=None,
    slice_rows_override: Optional[int] = None,
) -> torch.Tensor:
    """sum over non-ignored tokens of CE(softcap(logit_scale * hidden @ host_weight.T), target)
    / normalizer, as an fp32 scalar; `host_weight` [V, H] is frozen and may live in (pinned)
    host memory, `hidden` [N, H] on the device. Same contract as
    engine.kernels.fused_ce.fused_linear_cross_entropy without bias or weight gradient."""
    from engine.counters import count
    from engine.kernels.fused_ce import _prepare

    count("fused_ce:streamed")
    h2, t1, normalizer = _prepare(hidden, host_weight, targets, None, ignore_index, normalizer)
    if h2.dtype != host_weight.dtype:  # one dtype for the matmuls; the cast is differentiable
        h2 = h2.to(host_weight.dtype)
    h2 = h2.contiguous()
    rows = slice_rows_override or slice_rows(h2.shape[0], h2.shape[1], host_weight.shape[0], host_weight.element_size())
    need_h = torch.is_grad_enabled() and h2.requires_grad
    return _StreamedCE.apply(
        h2, host_weight, t1.contiguous(), normalizer, int(ignore_index), softcap, float(logit_scale), need_h, rows
    )


class HostHead(nn.Module):
    """A tied, bias-free output head whose table is in (pinned) host memory: the same tensor as
    the input side's HostEmbedding.host_weight, so the model holds one copy.

    forward(hidden) -> logits, for generation (no backward: training's loss streams the table
    through `streamed_linear_cross_entropy`, engine.train.step.forward_loss)."""

    def __init__(self, host_weight: torch.Tensor, device: torch.device):
        super().__init__()
        self.host_weight = host_weight  # a plain attribute: model.to() must not move it back
        self.out_features, self.in_features = host_weight.shape
        self.device = torch.device(device)
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """The table (on the host), for code that reads the head's dtype or shape."""
        return self.host_weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise RuntimeError(
                "HostHead gives logits for generation only; training's loss streams the table "
                "(engine.fastpath.host_head.streamed_linear_cross_entropy)"
            )
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.host_weight.dtype)
        rows = slice_rows(flat.shape[0], self.in_features, self.out_features, self.host_weight.element_size())
        out = torch.empty((flat.shape[0], self.out_features), dtype=flat.dtype, device=flat.device)
        for a, b, w in weight_slices(self.host_weight, flat.device, rows):
            out[:, a:b] = flat @ w.t()
        return out.view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, in host memory, tied"
