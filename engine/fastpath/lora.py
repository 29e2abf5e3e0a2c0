"""Fused LoRA projections with hand-derived backward passes: MLP, QKV and O.

A LoRA projection is ``y = x W^T + b + s * (x A^T) B^T`` with the base ``W``/``b`` frozen and
``A`` [r, in], ``B`` [out, r] trained. Plain PEFT runs this as separate autograd ops, saving
every intermediate. Here one `torch.autograd.Function` covers a group of projections:

- `LoRALinears`: projections that share one input (q/k/v, gate/up, or o alone). The A
  matrices of the group are stacked so ``x`` is read once for all low-rank products, and in
  backward the three (or two) rank-r input gradients are one matmul against the stacked A.
- `LoRAMLP`: gate/up, the gated activation, and down. Saves x, gate and up (plus the tiny
  [N, r] products); the activation output is recomputed in backward instead of saved.

Products are bracketed so ``A B`` ([out, in]) is never formed. Gradients flow to x, A and B
only; the base weight is read through `base_operand` / `base_mm` (engine.fastpath.lora_group):
an NF4 (QLoRA) base is decoded inside the matmul by the fused NF4 kernel on CUDA, and
elsewhere dequantized once in forward and once more in backward for dx, each copy dropped
right after its matmul, never saved for backward.

What a projection is made of, whether it can fuse, and the per-step cache of its adapter
weights (`LoRAParts`, `LoRAGroup`, the adapter generation) live in engine.fastpath.lora_group;
this module is the math on top: the Functions, the gated activation, and the entry points
`lora_linears` / `lora_mlp`.

Gradients (``dy`` = upstream gradient, ``xa = x A^T``):

    dx = dy W + s (dy B) A        dA = s (dy B)^T x        dB = s dy^T xa

dA and dB reduce over the tokens into r-wide results, in engine.kernels.rank_grad (one GEMM each,
or with TUNESMITH_RANK_GRAD=1 a token-split kernel that reads x or dy once at the card's bandwidth).

Compute dtype: everything runs in the activation dtype (x.dtype); fp32 adapter weights (PEFT
casts adapters to fp32 for bf16 models) are cast down for the matmuls and their gradients are
returned in the adapter's dtype. PEFT instead runs the low-rank branch in the adapter dtype;
the difference is bf16 rounding of a rank-r term, and the matmuls stay on the fast bf16 path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.counters import count
from engine.fastpath import lora_fold, quant, recompute
from engine.fastpath.lora_group import (
    LoRAGroup,
    as_group,
    base_linear,
    base_mm,
    base_operand,
    dense_4bit_once,
    lora_linear_out,
)
from engine.kernels import activations as K
from engine.kernels.rank_grad import rank_grad

# -- the math shared by the Functions (plain tensors, no autograd) ----------------------------


def _group_forward(x, group: LoRAGroup, w, spare: int = 0):
    """Outputs of projections sharing input x [N, in], and xa = x @ [A_1; A_2; ...]^T [N, R].

    With the bases stacked (lora_group.stack_bases) the outputs are column blocks of one [N, sum
    of outs] tensor, made by one base GEMM. With them folded (engine.fastpath.lora_fold) each
    output is one GEMM over [x | xa]; `spare` is how many free columns x's producer left beside
    its rows for xa (lora_fold.claim_spare)."""
    a_all, bs, _ = w
    if group.fold is not None and a_all is not None:
        one_gemm = x.shape[1] <= STACKED_FORWARD_MAX_IN
        folded = lora_fold.forward(x, group, a_all, bs, spare, one_gemm)
        if folded is not None:
            return folded
    xa = None if a_all is None else torch.mm(x, a_all.t())
    stacked = group.stacked_weight()
    if stacked is not None and (all(B is not None for B in bs) or all(B is None for B in bs)):
        return _stacked_forward(x, xa, group, bs, stacked), xa
    ys, col = [], 0
    for base, B, r in zip(group.bases, bs, group.ranks):
        if B is None:
            ys.append(base_linear(x, base, group.nf4))
            continue
        ys.append(lora_linear_out(x, xa[:, col : col + r], B, base, group.nf4))
        col += r
    return ys, xa


# Inputs at most this wide take one forward GEMM over the stacked weight; wider ones one GEMM per
# projection into its column block of the same output. Measured on the H100 (bench.gemm_shapes,
# 16,384 tokens): [W_gate; W_up] at 1,024 wide (W1) 0.297 ms against 0.313 apart, but at 2,048
# (W2) 1.653 ms against 1.509, and q/k/v at 4,096 (W3) 1.173 against 1.111: cuBLAS picks a slower
# kernel for the wider stacked shapes. The input gradient gains at every width (W1-W3: q/k/v 0.189
# against 0.227, 0.281 against 0.361, 1.182 against 1.283 ms), so the output is one tensor either
# way, for the backward's one GEMM.
STACKED_FORWARD_MAX_IN = 1024


def _stacked_forward(x, xa, group: LoRAGroup, bs, stacked: torch.Tensor) -> list[torch.Tensor]:
    """_group_forward's outputs as column blocks of one [N, sum of outs] tensor: each projection's
    rank-r term (and bias) is written into its block first, then the base GEMM(s) add onto it."""
    one_gemm = x.shape[1] <= STACKED_FORWARD_MAX_IN
    if one_gemm:
        count("stacked_gemm")
    y = torch.empty((x.shape[0], stacked.shape[0]), dtype=x.dtype, device=x.device)
    sizes = [b.out_features for b in group.bases]
    ys = list(y.split(sizes, 1))
    biases = [None if b.bias is None else b.bias.to(x.dtype) for b in group.bases]
    if bs[0] is None and all(b is None for b in biases):  # the base alone
        if one_gemm:
            torch.mm(x, stacked.t(), out=y)
        else:
            for yi, w in zip(ys, stacked.split(sizes, 0)):
                torch.mm(x, w.t(), out=yi)
        return ys
    col = 0
    for yi, B, r, bias in zip(ys, bs, group.ranks, biases):
        if B is not None:  # with a LoRA term every projection of the group has one
            xa_i = xa[:, col : col + r]
            if bias is None:
                torch.mm(xa_i, B.t(), out=yi)
            else:
                torch.addmm(bias, xa_i, B.t(), out=yi)
            col += r
        elif bias is not None:
            yi.copy_(bias.expand_as(yi))
        else:
            yi.zero_()
    if one_gemm:
        y.addmm_(x, stacked.t())
    else:
        for yi, w in zip(ys, stacked.split(sizes, 0)):
            yi.addmm_(x, w.t())
    return ys


def _side_by_side(dys, stacked: torch.Tensor) -> Optional[torch.Tensor]:
    """The [N, sum of outs] tensor whose column blocks the gradients `dys` are, in order, when they
    are (the gated activation's backward writes d_gate and d_up over gate and up); else None."""
    total = stacked.shape[0]
    d0 = dys[0]
    if d0 is None or d0.dim() != 2 or d0.stride() != (total, 1):
        return None
    storage, ptr, col = d0.untyped_storage().data_ptr(), d0.data_ptr(), 0
    for dy in dys:
        if (
            dy is None
            or dy.dtype != d0.dtype
            or dy.stride() != (total, 1)
            or dy.shape[0] != d0.shape[0]
            or dy.data_ptr() != ptr + col * dy.element_size()
            or dy.untyped_storage().data_ptr() != storage
        ):
            return None
        col += dy.shape[1]
    return d0.as_strided((d0.shape[0], total), (total, 1)) if col == total else None


def _group_backward(dys, x, xa, group: LoRAGroup, w, ab, need_dx: bool, need_ab: Sequence[bool], dx_out=None):
    """Gradients for a projection group: (dx or None, [dA_1, dB_1, ...] with None where unneeded);
    dx is written into `dx_out` when given."""
    a_all, bs, _ = w
    dx = None
    dab: list[Optional[torch.Tensor]] = [None] * len(ab)
    stacked = group.stacked_weight() if need_dx else None
    dy_all = None if stacked is None else _side_by_side(dys, stacked)
    # Folded (lora_fold.backward_dx): dx's base part and every dy_i (s_i B_i) from one GEMM.
    folded = None
    if dy_all is not None and dx_out is None and group.fold is not None and a_all is not None:
        folded = lora_fold.backward_dx(group, a_all, bs, dy_all)
    elif need_dx and group.row_fold is not None:  # o_proj: [dy | dy sB] [W; A] (lora_fold.fold_rows)
        folded = lora_fold.backward_dx_rows(group, dys[0], bs[0], out=dx_out)
    g_parts = []  # dy_i (s_i B_i), stacked to [N, R] to pair with the stacked A
    col = 0
    for i, (B, r) in enumerate(zip(bs, group.ranks)):
        if B is None:
            continue
        dy = dys[i]
        if need_ab[2 * i + 1]:
            dab[2 * i + 1] = rank_grad(dy, xa[:, col : col + r], group.scales[i], ab[2 * i + 1].dtype)
        if folded is None:
            g_parts.append(torch.mm(dy, B))
        col += r
    g = None
    if folded is not None:
        dx, g = folded
    else:
        if g_parts:
            g = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, 1)
        if dy_all is not None:  # one base GEMM over the stacked weight
            count("stacked_gemm")
            dx = None if g is None else torch.mm(g, a_all, out=dx_out)
            dx = torch.mm(dy_all, stacked, out=dx_out) if dx is None else dx.addmm_(dy_all, stacked)
        elif need_dx:
            # The rank-R term first; every base GEMM then adds onto dx (see lora_linear_out).
            dx = None if g is None else torch.mm(g, a_all, out=dx_out)
            for dy, base in zip(dys, group.bases):
                wt = base_operand(base, dy, False, group.nf4)
                if dx is None:
                    dx = base_mm(dy, wt, False, out=dx_out)
                else:
                    dx = base_mm(dy, wt, False, out=dx, accumulate=True)
                del wt  # a dequantized 4-bit weight goes before the next one is made
    if g is not None:
        if any(need_ab[0::2]):
            da_all = rank_grad(x, g, 1.0, torch.float32, transposed=True)  # [R, in]: every dA of the group
            row = 0
            for i, r in enumerate(group.ranks):
                if not r:
                    continue
                if need_ab[2 * i]:
                    dab[2 * i] = da_all[row : row + r].to(ab[2 * i].dtype)
                row += r
    return dx, dab


# -- autograd Functions ------------------------------------------------------------------------


class LoRALinears(torch.autograd.Function):
    """Projections sharing one 2-D input: forward(x, group, spare, A_1, B_1, ...) -> (y_1, ...);
    `spare`: free columns beside x's rows (see _group_forward)."""

    @staticmethod
    def forward(ctx, x, group, spare, *ab):
        count("lora_linears")
        w = group.weights(ab, x.dtype)
        ys, xa = _group_forward(x, group, w, spare)
        # The cached low-precision weights are kept on ctx (they are not autograd inputs and
        # are never modified in place); only the activations go through save_for_backward,
        # which is what checkpointing recomputes.
        ctx.group, ctx.w = group, w
        ctx.ab_dtypes = [None if t is None else t.dtype for t in ab]
        ctx.save_for_backward(x, xa)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, xa = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dab = _group_backward(dys, x, xa, ctx.group, ctx.w, _DtypeOnly.wrap(ctx.ab_dtypes), need[0], need[3:])
        return (dx, None, None, *dab)


# The MLP's [tokens, intermediate] tensors are its largest: gate and up are saved, and the
# activation output h and its gradient dh would double that at the peak. Above this size h and
# dh are made and used a slice of rows at a time (never whole); the slices stay tall enough
# for full-speed matmuls. W3 (16k tokens x 12,288) runs in 3 slices, W1 (x 3,072) in 2.
MLP_SLICE_BYTES = 64 * 2**20


def _row_slices(n: int, inter: int, element_size: int) -> list[tuple[int, int]]:
    """Row ranges covering n rows with at most MLP_SLICE_BYTES of [rows, inter] each."""
    rows = max(256, MLP_SLICE_BYTES // max(1, inter * element_size))
    if rows >= n:
        return [(0, n)]
    rows = max(256, (rows // 64) * 64)
    return [(s, min(s + rows, n)) for s in range(0, n, rows)]


def _down_forward(gate, up, act, down: LoRAGroup, w_out):
    """y = down(act(gate, up)) and ha = h @ A_down^T, making h one row slice at a time."""
    a_all, (B,), _ = w_out
    base = down.bases[0]
    n = gate.shape[0]
    slices = _row_slices(n, gate.shape[1], gate.element_size())
    if len(slices) == 1:
        h = act.forward_raw(gate, up)
        (y,), ha = _group_forward(h, down, w_out)
        return y, ha
    # One operand for all slices: a 4-bit base is dequantized once, or read packed by the NF4 kernel.
    W = base_operand(base, gate, True, down.nf4)
    y = torch.empty((n, base.out_features), dtype=gate.dtype, device=gate.device)
    ha = None if a_all is None else torch.empty((n, a_all.shape[0]), dtype=gate.dtype, device=gate.device)
    for s, e in slices:
        h = act.forward_raw(gate[s:e], up[s:e])
        if ha is None:
            base_mm(h, W, out=y[s:e])
        else:  # the rank-r term first, the base GEMM adds onto it (see lora_linear_out)
            torch.mm(h, a_all.t(), out=ha[s:e])
            torch.mm(ha[s:e], B.t(), out=y[s:e])
            base_mm(h, W, out=y[s:e], accumulate=True)
        del h
    if base.bias is not None:
        y += base.bias.to(y.dtype)
    return y, ha


def _down_dx(dy: torch.Tensor, W, a_all, B, down: LoRAGroup):
    """(dh, g) for these rows of the down projection: dh = dy W + (dy sB) A and g = dy sB (None
    without LoRA). One GEMM through the weight folded by rows where it can (lora_fold.fold_rows), else
    the rank-r term first and the base GEMM adding onto it (see lora_linear_out)."""
    if B is None:
        return base_mm(dy, W, False), None
    folded = lora_fold.backward_dx_rows(down, dy, B)
    if folded is not None:
        return folded
    g = torch.mm(dy, B)  # dy (s B): [rows, r]
    return base_mm(dy, W, False, out=torch.mm(g, a_all), accumulate=True), g


def _down_backward(dy, gate, up, ha, act, down: LoRAGroup, w_out, ab, need_ab):
    """Gradients of the down projection and the activation, one row slice at a time.

    Overwrites gate and up with d_gate and d_up (they are the Function's own saved tensors);
    returns [dA_down, dB_down] (None where not needed). dh, then h in its memory, exist for one
    slice at a time.
    """
    a_all, (B,), _ = w_out
    base = down.bases[0]
    n = gate.shape[0]
    slices = _row_slices(n, gate.shape[1], gate.element_size())
    W = base_operand(base, dy, False, down.nf4)
    dab: list[Optional[torch.Tensor]] = [None, None]
    if B is not None and need_ab[1]:
        dab[1] = rank_grad(dy, ha, down.scales[0], ab[1].dtype)
    da = None
    for s, e in slices:
        dh, g = _down_dx(dy[s:e], W, a_all, B, down)
        # dh first, then d_gate, d_up and h from one pass over gate and up (h over dh's memory).
        dgate, dup, h = act.backward_raw(gate[s:e], up[s:e], dh)
        del dh
        if g is not None and need_ab[0]:
            part = rank_grad(h, g, 1.0, torch.float32, transposed=True)  # [r, inter]
            da = part if da is None else da.add_(part)  # slices are summed in fp32
        del h, g
        if dgate.data_ptr() != gate[s:e].data_ptr():  # the torch fallback returns new tensors
            gate[s:e].copy_(dgate)
            up[s:e].copy_(dup)
        del dgate, dup
    if da is not None:
        dab[0] = da.to(ab[0].dtype)
    return dab


def _down_ha(gate, up, act, down: LoRAGroup, w_out) -> Optional[torch.Tensor]:
    """ha = h @ A_down^T alone (None without LoRA on down), making h one row slice at a time: what
    the down projection's backward reads, for a recompute that never makes its output."""
    a_all = w_out[0]
    if a_all is None:
        return None
    n = gate.shape[0]
    ha = torch.empty((n, a_all.shape[0]), dtype=gate.dtype, device=gate.device)
    for s, e in _row_slices(n, gate.shape[1], gate.element_size()):
        torch.mm(act.forward_raw(gate[s:e], up[s:e]), a_all.t(), out=ha[s:e])
    return ha


def _mlp_forward(ctx, x, gate_up, down, act, spare, ab, output: bool = True) -> Optional[torch.Tensor]:
    """LoRAMLP's forward, saving on ctx what _mlp_backward reads; `output=False` skips the down
    projection's output (None is returned) and makes only what its backward needs."""
    count("lora_mlp")
    w_in = gate_up.weights(ab[:4], x.dtype)
    w_out = down.weights(ab[4:], x.dtype)
    (gate, up), xa = _group_forward(x, gate_up, w_in, spare)
    if output:
        y, ha = _down_forward(gate, up, act, down, w_out)
    else:
        y, ha = None, _down_ha(gate, up, act, down, w_out)
    ctx.groups, ctx.w, ctx.act = (gate_up, down), (w_in, w_out), act
    ctx.ab_dtypes = [None if t is None else t.dtype for t in ab]
    # h ([N, inter]) is not saved: one elementwise pass rebuilds it in backward.
    ctx.save_for_backward(x, xa, gate, up, ha)
    return y


def _mlp_backward(ctx, dy, need: Sequence[bool]) -> tuple:
    """(dx, dA/dB x3) for _mlp_forward's saved tensors; `need`: x's, then the six A/B's."""
    x, xa, gate, up, ha = ctx.saved_tensors
    gate_up, down = ctx.groups
    w_in, w_out = ctx.w
    need_ab = need[1:]
    ab = _DtypeOnly.wrap(ctx.ab_dtypes)
    # gate/up now hold d_gate/d_up (they are ours and used by nothing else).
    dab_down = _down_backward(dy, gate, up, ha, ctx.act, down, w_out, ab[4:], need_ab[4:])
    dx, dab_in = _group_backward((gate, up), x, xa, gate_up, w_in, ab[:4], need[0], need_ab[:4])
    return (dx, *dab_in, *dab_down)


class LoRAMLP(torch.autograd.Function):
    """down(act(gate(x), up(x))) with LoRA on each: forward(x, gate_up, down, act, spare, A/B x3);
    `spare`: free columns beside x's rows (see _group_forward)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, act, spare, *ab):
        return _mlp_forward(ctx, x, gate_up, down, act, spare, ab)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        dx, *dab = _mlp_backward(ctx, dy, (need[0], *need[5:]))
        return (dx, None, None, None, None, *dab)


class LoRAMLPTail(torch.autograd.Function):
    """A decoder layer's tail, residual + LoRAMLP(x), for a recompute whose layer output nobody
    reads (engine.fastpath.recompute): forward(residual, x, gate_up, down, act, spare, A/B x3).

    The forward is LoRAMLP's less the down projection's output (its base GEMM and LoRA term) and
    the add: it saves what LoRAMLP's backward reads and returns a stand-in for the output. The
    backward is LoRAMLP's, and the residual's gradient is dy itself, as an add's would be. Unlike
    LoRAMLPUnread it keeps the recompute's gate and up and tiles nothing."""

    @staticmethod
    def forward(ctx, residual, x, gate_up, down, act, spare, *ab):
        _mlp_forward(ctx, x, gate_up, down, act, spare, ab, output=False)
        return recompute.unread(residual, residual.shape)

    @staticmethod
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx, *dab = _mlp_backward(ctx, dy2, (need[1], *need[6:]))
        return (dy if need[0] else None, dx, None, None, None, None, *dab)


# The unread-output MLP's backward remakes gate and up a row tile at a time: one tile's gate, up
# and h (or dh) exist at once, about 3 x this (W3, 12,288 wide: 2,048 rows, 8 tiles of 16,384).
UNREAD_TILE_BYTES = 48 * 2**20


def mlp_can_skip_output(gate_up: LoRAGroup, down: LoRAGroup) -> bool:
    """Whether `LoRAMLPUnread` can stand in for these groups. A 4-bit (QLoRA) base is dequantized
    once for the backward's tiles (`dense_4bit_once`), which needs the dequantize path: with the
    fused NF4 matmul (fast_paths.nf4_matmul) each tile would decode the weight again, so such a
    base keeps LoRAMLP."""
    bases = (*gate_up.bases, *down.bases)
    return not any(quant.is_4bit(b) for b in bases) or (gate_up.nf4 == "off" and down.nf4 == "off")


def _tile_rows(inter: int, element_size: int) -> int:
    """Rows of a tile whose [rows, inter] tensor takes about UNREAD_TILE_BYTES (a multiple of 64)."""
    return max(64, UNREAD_TILE_BYTES // max(1, inter * element_size) // 64 * 64)


def _mlp_no_grad(x: torch.Tensor, gate_up: LoRAGroup, down: LoRAGroup, act: "GatedAct") -> torch.Tensor:
    """LoRAMLP's forward with no autograd (offload's first forward, reference passes, eval), a row
    tile at a time into one output: one tile's gate, up and h exist at once instead of the whole
    gate and up; the same products, on the same tiles as LoRAMLPUnread's backward."""
    count("lora_mlp")
    w_in = gate_up.weights(gate_up.ab(), x.dtype)
    a_down, (b_down,), _ = down.weights(down.ab(), x.dtype)
    base = down.bases[0]
    w = base_operand(base, x, True, down.nf4)
    n = x.shape[0]
    y = torch.empty((n, base.out_features), dtype=x.dtype, device=x.device)
    rows = _tile_rows(base.in_features, x.element_size())
    for s in range(0, n, rows):
        e = min(s + rows, n)
        (gate, up), _ = _group_forward(x[s:e], gate_up, w_in)
        h = act.forward_raw(gate, up)
        del gate, up
        if b_down is None:
            base_mm(h, w, out=y[s:e])
        else:  # the rank-r term first, the base GEMM adds onto it (see lora_linear_out)
            torch.mm(torch.mm(h, a_down.t()), b_down.t(), out=y[s:e])
            base_mm(h, w, out=y[s:e], accumulate=True)
        del h
    if base.bias is not None:
        y += base.bias.to(y.dtype)
    return y


def _add_f32(acc: Optional[torch.Tensor], part: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """acc + part in fp32 (the tiles' LoRA gradients are summed in fp32)."""
    if part is None:
        return acc
    return part.float() if acc is None else acc.add_(part)


class LoRAMLPUnread(torch.autograd.Function):
    """A decoder layer's tail, residual + MLP(norm(residual)) with LoRA on the MLP, for a
    recompute whose layer output nobody reads (engine.fastpath.recompute):
    forward(residual, norm, gate_up, down, act, A/B x3).

    The forward computes nothing: it keeps `residual` (the post-attention residual stream) and
    returns a stand-in for the output. The backward runs a row tile at a time: x = norm(residual)
    with autograd, gate/up, the activation, the down projection's and gate/up's gradients as
    LoRAMLP computes them, then the norm's backward; the residual's gradient is dy plus the
    norm's. So neither the normed input nor gate and up are kept from the recompute to the
    backward, neither the down projection's forward matmul nor the output is ever made, and each
    tile's products are the same rows' products as LoRAMLP's. LoRA gradients are summed over the
    tiles in fp32; a trainable norm weight gets its gradient by autograd, tile by tile.
    """

    @staticmethod
    def forward(ctx, residual, norm, gate_up, down, act, *ab):
        count("lora_mlp")
        w_in = gate_up.weights(ab[:4], residual.dtype)
        w_out = down.weights(ab[4:], residual.dtype)
        ctx.norm, ctx.groups, ctx.w, ctx.act = norm, (gate_up, down), (w_in, w_out), act
        ctx.ab_dtypes = [None if t is None else t.dtype for t in ab]
        ctx.save_for_backward(residual)
        return recompute.unread(residual, residual.shape)

    @staticmethod
    def backward(ctx, dy):
        (residual,) = ctx.saved_tensors
        gate_up, down = ctx.groups
        w_in, w_out = ctx.w
        need_ab = ctx.needs_input_grad[5:]
        ab = _DtypeOnly.wrap(ctx.ab_dtypes)
        a_down, (b_down,), _ = w_out
        shape = residual.shape
        r2 = residual.reshape(-1, shape[-1])
        dy = dy.reshape(-1, dy.shape[-1])
        n, inter = r2.shape[0], down.bases[0].in_features
        # A 4-bit base's dense copy is made once for all the tiles (mlp_can_skip_output): three
        # weights at once, where LoRAMLP's backward holds one, against the saved gate and up.
        with dense_4bit_once((*gate_up.bases, *down.bases), r2.dtype):
            w_down = base_operand(down.bases[0], dy, False, down.nf4)
            d_res = None
            if ctx.needs_input_grad[0]:
                # The residual's gradient goes into dy's memory, each tile's rows after their last read
                # of dy: this Function is only the root of offload's lean recompute, whose dy is the
                # layer's output gradient, handed to this layer's backward alone. So one activation
                # less is live through the rest of the layer's backward (its attention, W7's peak).
                own = dy.is_contiguous() and dy.dtype == r2.dtype and dy.shape == r2.shape
                d_res = dy if own else torch.empty_like(r2)
            acc: list[Optional[torch.Tensor]] = [None] * 6
            rows = _tile_rows(inter, r2.element_size())
            for s in range(0, n, rows):
                e = min(s + rows, n)
                with torch.enable_grad():
                    r = r2[s:e].detach().requires_grad_(d_res is not None)
                    xn = ctx.norm(r)
                x = xn.detach()
                (gate, up), xa = _group_forward(x, gate_up, w_in)
                dyt = dy[s:e]
                dh, g = _down_dx(dyt, w_down, a_down, b_down, down)
                # dh first, then d_gate, d_up and h from one pass over gate and up (h over dh's memory).
                dgate, dup, h = ctx.act.backward_raw(gate, up, dh)
                del dh
                if g is not None:
                    if need_ab[4]:
                        acc[4] = _add_f32(acc[4], rank_grad(h, g, 1.0, torch.float32, transposed=True))  # dA_down
                    if need_ab[5]:
                        ha = torch.mm(h, a_down.t())
                        acc[5] = _add_f32(acc[5], rank_grad(dyt, ha, down.scales[0], torch.float32))
                        del ha
                del h, g
                need_x = d_res is not None or xn.requires_grad
                dx, dab = _group_backward((dgate, dup), x, xa, gate_up, w_in, ab[:4], need_x, need_ab[:4])
                del dgate, dup, gate, up
                for i, part in enumerate(dab):
                    acc[i] = _add_f32(acc[i], part)
                if xn.requires_grad:  # the norm's backward (and a trainable norm weight's gradient)
                    torch.autograd.backward(xn, dx)
                    if d_res is not None:  # the tail's output is residual + MLP: dy reaches it directly too
                        torch.add(dyt, r.grad, out=d_res[s:e])
                del dx, xn, r
            dab_all = [None if a is None else a.to(t.dtype) for a, t in zip(acc, ab)]
            d_res = None if d_res is None else d_res.view(shape)
            return (d_res, None, None, None, None, *dab_all)


class _DtypeOnly:
    """Stands in for an adapter weight in backward, where only its dtype is read."""

    __slots__ = ("dtype",)

    def __init__(self, dtype):
        self.dtype = dtype

    @staticmethod
    def wrap(dtypes):
        return [None if d is None else _DtypeOnly(d) for d in dtypes]


# -- gated activations ---------------------------------------------------------------------------


class GatedAct:
    """act(gate) * up for the MLP, with the explicit forward/backward LoRAMLP needs.

    kind: "silu" (SwiGLU), "gelu" (GeGLU, erf) or "gelu_tanh" (GeGLU, tanh form).
    impl: "torch" (plain torch ops, bit-identical to transformers' MLP), "kernels"
    (engine.kernels.activations: Triton on CUDA, its torch reference elsewhere) or "triton"
    (the Triton kernel on any device; CPU needs TRITON_INTERPRET=1, used by tests).
    """

    KINDS = ("silu", "gelu", "gelu_tanh")

    def __init__(self, kind: str, impl: str = "torch"):
        if kind not in self.KINDS:
            raise ValueError(f"unknown gated activation {kind!r}; expected one of {self.KINDS}")
        if impl not in ("torch", "kernels", "triton"):
            raise ValueError(f"unknown activation impl {impl!r}")
        self.kind, self.impl = kind, impl

    def __repr__(self) -> str:
        return f"GatedAct({self.kind!r}, impl={self.impl!r})"

    def _raw_triton(self, t: torch.Tensor) -> bool:
        return self.impl == "triton" or (self.impl == "kernels" and t.is_cuda)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Autograd-capable act(gate) * up."""
        if self.impl == "torch":  # in the input dtype, as transformers' MLP computes it
            return K.gated_act_reference(gate, up, self.kind, upcast=False)
        approximate = "tanh" if self.kind == "gelu_tanh" else "none"
        if self.impl == "triton":
            if self.kind == "silu":
                return K.swiglu_triton(gate, up)
            return K.geglu_triton(gate, up, approximate)
        if self.kind == "silu":
            return K.swiglu(gate, up)
        return K.geglu(gate, up, approximate)

    def forward_raw(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up without autograd (inside a Function's forward)."""
        if self._raw_triton(gate):
            return K.gated_act_forward(gate, up, self.kind)
        with torch.no_grad():
            return self(gate, up)

    def backward_raw(self, gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor):
        """(d_gate, d_up, h) for the upstream gradient dh, h = act(gate) * up being what forward_raw
        makes. The kernel path reads gate and up once for all three and writes them over gate, up
        and dh (dh: a contiguous buffer of the caller's); elsewhere they may be new tensors."""
        if self._raw_triton(gate):
            return K.gated_act_backward_and_output(dh, gate, up, self.kind)
        # Elsewhere let autograd differentiate the same function the forward used.
        with torch.enable_grad():
            g_ = gate.detach().requires_grad_()
            u_ = up.detach().requires_grad_()
            h = self(g_, u_)
        dgate, dup = torch.autograd.grad(h, (g_, u_), dh)
        return dgate, dup, h.detach()


# -- entry points --------------------------------------------------------------------------------


def lora_linears(x: torch.Tensor, parts) -> tuple[torch.Tensor, ...]:
    """The projections in `parts` applied to x [..., in] (q/k/v together, or o alone).

    `parts` is a sequence of `LoRAParts` or, on hot paths, a `LoRAGroup` planned once (which
    also caches the adapter weights in the compute dtype across calls).
    """
    group = as_group(parts)
    spare = lora_fold.claim_spare(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ys = LoRALinears.apply(x2, group, spare, *group.ab())
    # Reshape outside the Function: a view returned from inside it could not be modified in
    # place later (the RoPE kernel rotates q/k in place).
    return tuple(y.view(*lead, y.shape[-1]) for y in ys)


def lora_mlp(x: torch.Tensor, gate, up=None, down=None, act: "GatedAct" = None) -> torch.Tensor:
    """down(act(gate(x), up(x))) for x [..., hidden].

    Either lora_mlp(x, gate_parts, up_parts, down_parts, act) or, planned once,
    lora_mlp(x, gate_up_group, down_group, act=act) with `LoRAGroup`s.
    """
    if isinstance(gate, LoRAGroup):
        gate_up, down_g = gate, up
    else:
        gate_up, down_g = LoRAGroup((gate, up)), LoRAGroup((down,))
    spare = lora_fold.claim_spare(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = _tile_rows(down_g.bases[0].in_features, x2.element_size())
    if not torch.is_grad_enabled() and x2.shape[0] > rows and mlp_can_skip_output(gate_up, down_g):
        y = _mlp_no_grad(x2, gate_up, down_g, act)
    else:
        y = LoRAMLP.apply(x2, gate_up, down_g, act, spare, *gate_up.ab(), *down_g.ab())
    return y.view(*lead, y.shape[-1])


def lora_mlp_tail(residual: torch.Tensor, x: torch.Tensor, gate_up: LoRAGroup, down: LoRAGroup, act: "GatedAct"):
    """A stand-in for a layer's tail, residual + down(act(gate(x), up(x))), for a recompute whose
    layer output nobody reads (see LoRAMLPTail); its backward is LoRAMLP's."""
    spare = lora_fold.claim_spare(x)
    x2 = x.reshape(-1, x.shape[-1])
    return LoRAMLPTail.apply(residual, x2, gate_up, down, act, spare, *gate_up.ab(), *down.ab())


def lora_mlp_unread(residual: torch.Tensor, norm, gate_up: LoRAGroup, down: LoRAGroup, act: "GatedAct"):
    """A stand-in for a layer's tail, residual + down(act(gate(x), up(x))) with x = norm(residual),
    for a recompute whose layer output nobody reads (see LoRAMLPUnread); its backward is exact."""
    return LoRAMLPUnread.apply(residual, norm, gate_up, down, act, *gate_up.ab(), *down.ab())
