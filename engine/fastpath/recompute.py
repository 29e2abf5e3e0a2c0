"""What a decoder layer's recompute may skip when its output only roots the backward.

Offloaded checkpointing (engine.fastpath.offload) recomputes each layer in its backward and calls
``torch.autograd.backward(out, grad_out)``: the recompute exists for the tensors its backward
saves, and the output's values are never read. In a decoder layer the output is
``residual + mlp(norm(residual))``, and that tail's backward needs only ``residual`` and ``dy``.
The lean recompute (fast_paths.lean_recompute; engine.fastpath.lora.LoRAMLPUnread) can:

- skip the MLP's down projection in the recompute (a third of the MLP's matmuls, about 5% of a
  W3 step), since only the output needs it, and never make the output;
- keep neither the normed MLP input nor gate and up ([tokens, intermediate] each, 384 MiB
  apiece on W3) from the recompute to the backward: the backward remakes them a row tile at a
  time, where they are used at once (the same matmuls, moved, on fewer rows each);
- not keep the normed attention input either (`remade_when_unpacked`): the q/k/v projections'
  backward gets it remade from the layer's input, which is kept anyway (one norm, 128 MiB);
- and free it as soon as the q/k/v projections have read it (`release_remade`), rather than
  when the layer's forward returns: through the attention and o_proj of the recompute, where
  W7's trace put the backward's highest point, it held an activation of the row (1.5 GiB at
  196,608 tokens of Llama-3.1-8B).

Every offload recompute, lean or not, skips the MLP's down projection and the output: a layer
tail that is a fused LoRA MLP (engine.fastpath.lora.LoRAMLPTail) saves what LoRAMLP's backward
reads (gate, up and h @ A_down^T) and returns a stand-in, its backward giving dy to the residual
and to the MLP. No row tiles: that is all of it in eager runs below 4,096 wide, where auto keeps the
lean tiles off (more launches than they save); a down GEMM and an add of the row less per layer.
Under CUDA graphs auto takes the lean recompute (W1, W2), so the tail does not run there.
TUNESMITH_RECOMPUTE_TAIL=0 (`tail_on`; bench.ours's `recompute_tail=false`) recomputes the whole
layer there, for bench's before/after.

The flags are scoped to one call (a ContextVar, set and read on the thread that runs the
recompute): the offloader sets them around a layer's recompute (`recomputing`), and the patched
decoder layer (engine.models.patches), which knows how its output is made, reads them
(`layer_output_unused`, `lean`). A layer that does not read them computes as usual, so an
unpatched layer under them is still correct (it just saves nothing). Switch for the lean part:
fast_paths.lean_recompute.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from typing import Callable, Optional

import torch

from engine.fastpath import lora_fold

# None outside an offload recompute; inside one, whether it is lean (fast_paths.lean_recompute).
_RECOMPUTE: ContextVar[Optional[bool]] = ContextVar("tunesmith_recompute", default=None)


@contextlib.contextmanager
def recomputing(lean: bool = True):
    """Around a layer's recompute whose output only roots the backward (offload's); `lean`: the
    tiled tail and the remade normed input too."""
    token = _RECOMPUTE.set(bool(lean))
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def layer_output_unused() -> bool:
    """Whether the decoder layer now running is a recompute whose output nobody reads."""
    return _RECOMPUTE.get() is not None


def tail_on() -> bool:
    """Whether a recompute's layer tail skips the down projection's output and the add (LoRAMLPTail):
    on unless TUNESMITH_RECOMPUTE_TAIL=0 (read at each call, for bench's before/after)."""
    return os.environ.get("TUNESMITH_RECOMPUTE_TAIL", "1") != "0"


def lean() -> bool:
    """Whether the decoder layer now running is a lean recompute (row tiles, remade normed input)."""
    return bool(_RECOMPUTE.get())


class _Remade:
    """What a saved tensor became: how to remake it, and where it sat in its storage."""

    __slots__ = ("remake", "shape", "stride", "offset")

    def __init__(self, remake: Callable[[], torch.Tensor], t: torch.Tensor):
        self.remake, self.shape, self.stride, self.offset = remake, t.shape, t.stride(), t.storage_offset()


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is its storage's whole, or its rows with free columns after each: a norm's output
    made with spare columns for a folded LoRA group (engine.kernels.rmsnorm.spare_empty), marked
    for it (lora_fold.mark_spare; the group keeps what it writes there in a tensor of its own).
    An unmarked column slice of someone's rows is not: the other columns are theirs."""
    nbytes = t.untyped_storage().nbytes()
    if nbytes == t.numel() * t.element_size():
        return True
    if t.dim() < 2 or t.storage_offset() != 0 or t.stride(-1) != 1:
        return False
    if lora_fold.marked_spare(t) != t.stride(-2) - t.shape[-1]:
        return False
    rows = t.as_strided((*t.shape[:-1], t.stride(-2)), t.stride())
    return rows.is_contiguous() and nbytes == rows.numel() * t.element_size()


class _Block:
    """The tensor a `remade_when_unpacked` block remakes: its storage's address, its dtype, and
    whether `release_remade` may free it (and has)."""

    __slots__ = ("ptr", "dtype", "releasable", "released")

    def __init__(self, t: torch.Tensor, releasable: bool):
        self.ptr, self.dtype = t.untyped_storage().data_ptr(), t.dtype
        # Only a tensor that is its storage's whole: a view into memory shared with other tensors
        # would free theirs too.
        self.releasable = releasable and _owns_storage(t)
        self.released = False

    def matches(self, x: torch.Tensor) -> bool:
        # Once released, the allocator may hand the same address to a new tensor (the attention's
        # output): nothing matches any more, or that tensor would be "remade" as the normed input.
        return not self.released and x.dtype == self.dtype and x.untyped_storage().data_ptr() == self.ptr


_BLOCK: ContextVar[Optional[_Block]] = ContextVar("tunesmith_remade_block", default=None)


@contextlib.contextmanager
def remade_when_unpacked(
    t: torch.Tensor, remake: Callable[[], torch.Tensor], on: bool = True, releasable: bool = False
):
    """Within the block, a tensor autograd saves that is `t` or a view of it is not kept: its
    backward gets ``remake()`` (no grad) seen through the same view. `remake` must give `t`'s
    values in `t`'s layout from tensors kept anyway (the same function on the same input).
    `releasable`: the caller holds no other use of `t` after its readers in the block, so
    `release_remade` may free its memory there (the caller's own names then see an empty storage)."""
    if not on:
        yield
        return
    block = _Block(t, releasable)

    def pack(x: torch.Tensor):
        if block.matches(x):
            return _Remade(remake, x)
        # Every other saved tensor as it is, but detached: a hook that returns the tensor itself
        # makes a node that saves its own output (the attention kernel's O, a softmax's result)
        # hold that output with its grad_fn, the node: a cycle through C++ that Python's collector
        # cannot see. A backward that runs frees it; one that fails before reaching the node (an
        # out-of-memory error) left the layer's whole recompute allocated for the rest of the
        # process (5-6 GiB on W7's rows). Autograd unpacks with the grad_fn it recorded at save.
        return x.detach()

    def unpack(saved):
        if not isinstance(saved, _Remade):
            return saved
        with torch.no_grad():
            made = saved.remake()
        return made.as_strided(saved.shape, saved.stride, saved.offset)

    token = _BLOCK.set(block)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _BLOCK.reset(token)


def release_remade(x: torch.Tensor) -> bool:
    """Free `x`'s memory now if it is the releasable tensor of the enclosing `remade_when_unpacked`
    block (whatever saved it holds a remake, not the tensor): call where its last reader in the
    block has run. True when freed; a tensor of no such block is left alone."""
    block = _BLOCK.get()
    if block is None or not block.releasable or not block.matches(x):
        return False
    block.released = True
    x.untyped_storage().resize_(0)
    return True


def unread(like: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of `shape` standing for an output nobody reads: one zero, broadcast (no memory)."""
    return like.new_zeros(()).expand(*shape)
