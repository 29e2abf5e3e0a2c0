"""LoRA's rank product folded into the base GEMM: one GEMM per projection instead of two.

A fused LoRA projection runs ``y = (x A^T)(sB)^T`` (a GEMM of depth r that writes all of y) and
then ``y += x W^T`` (the base GEMM, reading y back in its epilogue). Folded, the input carries
``xa = x A^T`` in spare columns beside it and the frozen weight carries ``sB`` beside it:

    y = [x | xa] [W | sB]^T

one GEMM of depth in + R, with no pass over y of its own. The weight side is free: the frozen
base weights move, once, into buffers R columns wider (`fold_bases`), each Parameter becoming a
view of its columns (the same object and values, like `lora_group.stack_bases`), and the group's
weight cache writes each projection's ``sB`` into its block of the spare columns whenever it
rebuilds (`Fold.write_tails`; every other block stays zero). The input side costs one copy of x
into a buffer with spare columns, unless x's producer left them (`claim_spare`).

Measured before it was built (bench.lora_fold, H100, 16,384 tokens): the forward of q/k/v 0.260
ms against 0.341 and of gate/up 0.337 against 0.422 on W1's shapes, where the input gradient as
[dy | dy sB] [W; A] gained nothing. So only the groups that read a normed hidden state (q/k/v,
gate/up) fold, and only above FOLD_MIN_ROWS rows: a decoding step's few rows keep the plain path.
Stacked gate/up's input gradient also reads the folded weight the other way (`backward_dx`:
dy [W | sB] makes dx's base part and dy sB in one GEMM).

o_proj and down_proj fold the other way, for their input gradient only (`fold_rows`, `RowFold`):
W sits in a buffer R rows taller with A below it, and dx = [dy | dy sB] [W; A] is one GEMM
(`backward_dx_rows`; the left operand made in one pass over dy by engine.kernels.wide_rows).
TUNESMITH_FOLD_ROWS=0 turns it off (`fold_rows_on`), for bench's before/after.

Inputs with spare columns: a norm patched for a folded consumer (engine.models.patches) writes its
output into a buffer with the consumer's spare width (engine.kernels.rmsnorm.spare_empty) and
returns the first columns as a view, marked (`mark_spare`); the consumer's entry point claims the
mark (`claim_spare`) once, so two consumers of one tensor never write the same columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from engine.counters import count
from engine.kernels.wide_rows import wide_rows

# Fewer rows than this keep the two-GEMM path: the copy into a wide buffer would cost more than the
# pass over y it saves, and decoding loops stay as they were.
FOLD_MIN_ROWS = 1024

# `fast_paths.fold_lora: auto` folds groups whose input is at most this wide. Measured end to end on an
# H100, in one run each with the fold on and off (the norms leaving the spare columns, 6c98e3a): W1
# (1,024 wide) 95,282 and 94,616 against 91,395 tok/s, W2 (2,048) 68,813 and 68,822 against 67,499, W3
# (4,096) 12,640 against 12,609, inside its spread. `true` folds at any width.
AUTO_MAX_IN = 2048

# The wide operands' rows are kept a multiple of 8 elements (16 bytes in bf16), as cuBLAS wants.
_ALIGN = 8

_SPARE = "_tunesmith_spare"  # attribute of a tensor whose row has this many spare columns after it
_FOLDED = "_tunesmith_fold_ld"  # attribute of a folded base weight: its buffer's row length


def fold_width(ranks: Sequence[int]) -> int:
    """Spare columns a group of these LoRA ranks needs: their sum, rounded up to the alignment."""
    total = sum(ranks)
    return -(-total // _ALIGN) * _ALIGN


def fold_reason(bases: Sequence[nn.Module], ranks: Sequence[int], setting="auto") -> Optional[str]:
    """None when these bases can fold (and `setting`, fast_paths.fold_lora, asks for it), else why not."""
    if not bases or any(type(m) is not nn.Linear for m in bases):
        return "a base is not a dense nn.Linear (4-bit bases are their own packed format)"
    if any(r == 0 for r in ranks):
        return "a projection of the group has no LoRA"
    w0 = bases[0].weight
    for m in bases:
        w = m.weight
        if w.requires_grad or w.dtype != w0.dtype or w.device != w0.device or m.in_features != bases[0].in_features:
            return "the group's bases differ in dtype, device or input, or one is trainable"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return "several processes (their wrappers manage the weights' memory)"
    if setting != "auto":
        return None if setting is True else "fast_paths.fold_lora is false"
    if bases[0].in_features > AUTO_MAX_IN:
        return f"auto folds inputs up to {AUTO_MAX_IN} wide, this one is {bases[0].in_features}"
    return None


@dataclass(frozen=True)
class Fold:
    """How a group's bases are folded: the buffers' row length and each projection's tail block."""

    in_features: int
    width: int  # spare columns of every buffer row (fold_width of the ranks)
    cols: tuple[int, ...]  # each projection's first spare column, relative to in_features
    ranks: tuple[int, ...]
    stacked: bool  # the group's weights are consecutive rows of one buffer

    @property
    def ld(self) -> int:
        return self.in_features + self.width

    def folded(self, bases: Sequence[nn.Module]) -> bool:
        """Whether the bases' weights are still the views `fold_bases` made (a model moved or cast
        afterwards has new weights, and the group then runs unfolded)."""
        ld = self.ld
        end = None
        for m in bases:
            w = m.weight
            if getattr(w, _FOLDED, None) != ld or w.stride() != (ld, 1) or w.shape[1] != self.in_features:
                return False
            if self.stacked:
                if end is not None and w.data_ptr() != end:
                    return False
                end = w.data_ptr() + w.shape[0] * ld * w.element_size()
        return True

    def operands(self, bases: Sequence[nn.Module]) -> list[torch.Tensor]:
        """[W | tails] of each projection ([out, ld]), or the one stacked [sum of outs, ld]."""
        ws = [m.weight.data for m in bases]
        ld = self.ld
        if self.stacked:
            rows = sum(w.shape[0] for w in ws)
            return [ws[0].as_strided((rows, ld), (ld, 1), ws[0].storage_offset())]
        return [w.as_strided((w.shape[0], ld), (ld, 1), w.storage_offset()) for w in ws]

    def write_tails(self, bases: Sequence[nn.Module], bs: Sequence[Optional[torch.Tensor]]) -> None:
        """Write each projection's s*B (the weight cache's) into its block of the spare columns.

        Through `.data`, so the base Parameters' version counters stay as they were: a stock-path
        autograd node that saved a base weight is not invalidated by an adapter update."""
        if not self.folded(bases):
            return
        with torch.no_grad():
            for m, B, col, r in zip(bases, bs, self.cols, self.ranks):
                if B is None or B.dtype != m.weight.dtype:
                    continue
                w = m.weight.data
                tail = w.as_strided((w.shape[0], r), (self.ld, 1), w.storage_offset() + self.in_features + col)
                tail.copy_(B)


def fold_bases(group, stacked: bool, setting="auto") -> bool:
    """Move the frozen weights of `group` (an engine.fastpath.lora_group.LoRAGroup) into buffers
    with the group's spare columns, each base Parameter becoming a view of its columns (stacked:
    all rows in one buffer, gate above up, as stack_bases lays them out); sets `group.fold`.
    `setting`: fast_paths.fold_lora (auto, true or false; see AUTO_MAX_IN). True when done, or
    already so from an earlier patch of the same model."""
    bases, ranks = group.bases, group.ranks
    if fold_reason(bases, ranks, setting) is not None:
        return False
    in_features = bases[0].in_features
    cols = tuple(sum(ranks[:i]) for i in range(len(ranks)))
    fold = Fold(in_features, fold_width(ranks), cols, tuple(ranks), stacked)
    if not fold.folded(bases):
        ld = fold.ld
        w0 = bases[0].weight
        with torch.no_grad():
            if stacked:
                rows = sum(m.weight.shape[0] for m in bases)
                buf = torch.zeros((rows, ld), dtype=w0.dtype, device=w0.device)
                row = 0
                for m in bases:
                    o = m.weight.shape[0]
                    buf[row : row + o, :in_features].copy_(m.weight)
                    m.weight.data = buf[row : row + o, :in_features]
                    row += o
            else:
                for m in bases:
                    buf = torch.zeros((m.weight.shape[0], ld), dtype=w0.dtype, device=w0.device)
                    buf[:, :in_features].copy_(m.weight)
                    m.weight.data = buf[:, :in_features]
        for m in bases:
            setattr(m.weight, _FOLDED, ld)
    group.fold = fold
    return True


# -- inputs with spare columns ----------------------------------------------------------------------


def mark_spare(t: torch.Tensor, spare: int) -> torch.Tensor:
    """Mark `t` as carrying `spare` free columns after each row for its consumer, when its layout
    has them (engine.kernels.rmsnorm.spare_empty made it); returns t."""
    if spare and t.dim() >= 2 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] + spare:
        setattr(t, _SPARE, spare)
    return t


def marked_spare(t: torch.Tensor) -> int:
    """The spare columns `t` is marked with and not yet claimed (0 if none), without claiming them."""
    return getattr(t, _SPARE, 0)


def claim_spare(x: torch.Tensor) -> int:
    """The spare columns x's producer left for its consumer (0 if none), claimed once: a second
    consumer of the same tensor finds none and copies instead of overwriting the first's."""
    spare = getattr(x, _SPARE, 0)
    if spare:
        delattr(x, _SPARE)
    return spare


# -- the folded forward -------------------------------------------------------------------------------


def forward(x: torch.Tensor, group, a_all: torch.Tensor, bs, spare: int = 0, one_gemm: bool = True):
    """(ys, xa) for the group's projections of x [N, in] folded, or None when this call cannot fold
    (the caller then runs the two-GEMM path). A stacked group's projections are one GEMM when
    `one_gemm`, else one GEMM each into their column blocks of one output.

    `spare`: columns x's rows have free after them (claim_spare); with fewer than the group needs,
    x is copied into a wide buffer that lives for this call only. xa is its own tensor, copied
    into the spare columns, so what the Function saves (x and xa) is what the two-GEMM path saves:
    the backward, checkpointing and offload's recompute see no difference."""
    fold: Optional[Fold] = group.fold
    n, k = x.shape
    if fold is None or n < FOLD_MIN_ROWS or any(B is None for B in bs) or not fold.folded(group.bases):
        return None
    if x.dtype != group.bases[0].weight.dtype:
        return None
    width, ld = fold.width, fold.ld
    xa = torch.mm(x, a_all.t())
    r_all = xa.shape[1]
    if spare >= width and x.stride() == (k + spare, 1):
        # Through `.data`: the spare columns are no part of x, and x's version counter (which a
        # node that saved x checks) stays as it was.
        wide = x.data.as_strided((n, ld), (k + spare, 1))
    else:
        count("folded_gemm:copied")
        wide = torch.empty((n, ld), dtype=x.dtype, device=x.device)
        wide[:, :k].copy_(x)
    wide[:, k : k + r_all].copy_(xa)
    if r_all < width:  # alignment columns: their weights are zero, but 0 x NaN garbage is NaN
        wide[:, k + r_all : ld].zero_()
    biases = [m.bias for m in group.bases]
    sizes = [m.out_features for m in group.bases]
    ops = fold.operands(group.bases)
    count("folded_gemm")
    if not fold.stacked:
        return [_one(wide, op, bias) for op, bias in zip(ops, biases)], xa
    y = torch.empty((n, sum(sizes)), dtype=x.dtype, device=x.device)
    ys = list(y.split(sizes, 1))
    if not one_gemm:
        for yi, op, bias in zip(ys, ops[0].split(sizes, 0), biases):
            _one(wide, op, bias, yi)
        return ys, xa
    count("stacked_gemm")
    bias = None
    if any(b is not None for b in biases):
        zeros = [torch.zeros(s, dtype=x.dtype, device=x.device) for s in sizes]
        bias = torch.cat([z if b is None else b for z, b in zip(zeros, biases)])
    _one(wide, ops[0], bias, y)
    return ys, xa


def _one(wide: torch.Tensor, op: torch.Tensor, bias: Optional[torch.Tensor], out=None) -> torch.Tensor:
    """wide @ op^T (+ bias), into `out` when given."""
    if bias is None:
        return torch.mm(wide, op.t()) if out is None else torch.mm(wide, op.t(), out=out)
    bias = bias.to(wide.dtype)
    return torch.addmm(bias, wide, op.t()) if out is None else torch.addmm(bias, wide, op.t(), out=out)


# -- the folded input gradient ------------------------------------------------------------------------


def _fold_backward() -> bool:
    """TUNESMITH_FOLD_BACKWARD=0 keeps the backward's separate passes: a before/after switch for
    measurements (bench.ours's `fold_backward=false`), read at each call so one process can time both."""
    return os.environ.get("TUNESMITH_FOLD_BACKWARD", "1") != "0"


def backward_dx(group, a_all: torch.Tensor, bs, dy_all: Optional[torch.Tensor]):
    """(dx, g) for a stacked folded group whose gradients lie side by side in `dy_all` ([N, sum of
    outs]: the gated activation's backward writes d_gate and d_up so), or None when this call cannot
    fold.

    The forward's folded weight read the other way: dy_all [W | tails] = [dy W | dy_1 sB_1 | dy_2 sB_2],
    each projection's tail block zero outside its own rows, so one GEMM makes dx's base part and g
    together, with no pass of its own over each dy for dy sB; then dx += g A. dx and g are column views
    of that [N, ld] output (row stride ld): dx's consumers (the norms' backward kernels, autograd's
    views) take strided rows.

    Only the stacked one-GEMM case folds: measured on the H100 (bench.lora_fold `*_dx_outfold`, 16,384
    tokens), gate/up's input gradient took 0.336 against 0.377 ms on W1 and 4.78 against 5.11 on W3,
    but q/k/v's three GEMMs into one wide output took longer than today's (W1 0.286 against 0.275,
    W2 0.481 against 0.400): the output is R columns wider and read back by each accumulation."""
    fold: Optional[Fold] = group.fold
    if dy_all is None or fold is None or not fold.stacked or not _fold_backward():
        return None
    if any(B is None for B in bs) or not fold.folded(group.bases):
        return None
    n = dy_all.shape[0]
    if n < FOLD_MIN_ROWS or dy_all.dtype != group.bases[0].weight.dtype:
        return None
    k, ld = fold.in_features, fold.ld
    out = torch.empty((n, ld), dtype=dy_all.dtype, device=dy_all.device)
    count("folded_gemm:dx")
    count("stacked_gemm")
    torch.mm(dy_all, fold.operands(group.bases)[0], out=out)
    g = out[:, k : k + sum(fold.ranks)]
    dx = out[:, :k]
    dx.addmm_(g, a_all)
    return dx, g


# -- a single projection's input gradient, folded by rows ----------------------------------------------
#
# o_proj and down_proj read no normed hidden state, so their forwards stay two GEMMs; their input
# gradients fold the other way: dx = dy W + (dy sB) A = [dy | dy sB] [W; A], one GEMM of depth
# out + width, with no rank-r term written over dx and read back by the base GEMM's epilogue.
# The weight side: W moves once into a buffer `width` rows taller, the Parameter a view of its first
# rows (contiguous, so every other reader of W sees no difference), and the weight cache writes A into
# the rows below at each rebuild (`RowFold.write_rows`). The input side: [dy | dy sB] is made in one
# pass over dy (engine.kernels.wide_rows). Measured before it was built (bench.lora_fold `*_dx_fold`,
# H100, W1's 16,384 tokens, dy's copy not counted): o 0.146 against 0.178 ms, down 0.206 against 0.259.

_ROW_FOLDED = "_tunesmith_row_fold"  # attribute of a base weight folded by rows: the rows below it


@dataclass(frozen=True)
class RowFold:
    """A single projection's base weight in a buffer `width` rows taller: [W; A; 0] ([out + width, in])."""

    out_features: int
    in_features: int
    width: int  # rows below W: the rank rounded up to the alignment (the extra rows stay zero)
    rank: int

    def folded(self, base: nn.Module) -> bool:
        """Whether the base's weight is still the view `fold_rows` made, with its rows below it (a model
        moved or cast afterwards has new weights, and the projection then runs unfolded)."""
        w = base.weight
        if getattr(w, _ROW_FOLDED, None) != self.width or w.shape != (self.out_features, self.in_features):
            return False
        if w.stride() != (self.in_features, 1):
            return False
        need = (w.storage_offset() + (self.out_features + self.width) * self.in_features) * w.element_size()
        return w.untyped_storage().nbytes() >= need

    def operand(self, base: nn.Module) -> torch.Tensor:
        """[W; A; 0] ([out + width, in])."""
        w = base.weight.data
        shape = (self.out_features + self.width, self.in_features)
        return w.as_strided(shape, (self.in_features, 1), w.storage_offset())

    def write_rows(self, base: nn.Module, a: Optional[torch.Tensor]) -> None:
        """Write A (the weight cache's, in the compute dtype) into the rows below W. Through `.data`, so
        the base Parameter's version counter stays as it was (see Fold.write_tails)."""
        if a is None or a.dtype != base.weight.dtype or not self.folded(base):
            return
        with torch.no_grad():
            self.operand(base)[self.out_features : self.out_features + self.rank].copy_(a)


def fold_rows(group, setting="auto") -> bool:
    """Move a single-projection group's frozen weight (o_proj, down_proj) into a buffer with the rows
    its input gradient folds through; sets `group.row_fold`. `setting`: fast_paths.fold_lora (auto
    folds models up to AUTO_MAX_IN wide, where it was measured); never with TUNESMITH_FOLD_ROWS=0
    (fold_rows_on). True when done, or already so."""
    bases, ranks = group.bases, group.ranks
    if not fold_rows_on() or len(bases) != 1 or setting not in ("auto", True):
        return False
    if fold_reason(bases, ranks, True) is not None:
        return False
    base = bases[0]
    if setting == "auto" and base.out_features > AUTO_MAX_IN:  # the dx GEMM's depth: the model's width
        return False
    width = fold_width(ranks)
    fold = RowFold(base.out_features, base.in_features, width, ranks[0])
    if not fold.folded(base):
        w = base.weight
        with torch.no_grad():
            buf = torch.zeros((fold.out_features + width, fold.in_features), dtype=w.dtype, device=w.device)
            buf[: fold.out_features].copy_(w)
            base.weight.data = buf[: fold.out_features]
        setattr(base.weight, _ROW_FOLDED, width)
    group.row_fold = fold
    return True


def fold_rows_on() -> bool:
    """Whether o's and down's bases fold by rows when the model is patched, and their input gradients
    run through the fold: on unless TUNESMITH_FOLD_ROWS=0 (bench.ours's `fold_rows=false`); read at
    patching and at each call, so one process can time both ways."""
    return os.environ.get("TUNESMITH_FOLD_ROWS", "1") != "0"


def backward_dx_rows(group, dy: torch.Tensor, b: Optional[torch.Tensor], out=None):
    """(dx, g) of a projection folded by rows: dx = [dy | dy sB] [W; A] in one GEMM (into `out` when
    given), and g = dy sB, a column view of the wide operand; or None when this call cannot fold (the
    caller then runs dx = (dy sB) A, dx += dy W)."""
    fold: Optional[RowFold] = group.row_fold
    if fold is None or b is None or not fold_rows_on() or dy.shape[0] < FOLD_MIN_ROWS:
        return None
    base = group.bases[0]
    if dy.dtype != base.weight.dtype or b.dtype != dy.dtype or not fold.folded(base):
        return None
    wide = wide_rows(dy, b, fold.width)
    count("folded_gemm:rows")
    dx = torch.mm(wide, fold.operand(base), out=out)
    return dx, wide[:, fold.out_features : fold.out_features + fold.rank]
