"""Tiled MLP: each decoder layer's gated MLP runs over tiles of the token stream.

On a long row the MLP's intermediates are the largest tensors of a layer: at Llama-3.1-8B's
width (intermediate 14,336) gate, up and their product take about 84 KiB a token in bf16,
5 GiB at 61k tokens, against 8 KiB a token for the layer's input. The MLP treats every token
on its own, so it can run a tile of tokens at a time:

- without autograd (the first forward under checkpointing, generation), a plain loop: only
  one tile's intermediates exist at once;
- with autograd, `TiledMLP` runs the forward tile by tile without autograd and keeps only its
  input; its backward recomputes each tile with autograd and backpropagates through it (the
  LoRA gradients accumulate into `.grad`, as in reentrant checkpointing), one tile at a time.

The arithmetic of each token is unchanged (the same matmuls on fewer rows); the price is one
more forward of the MLP in the backward, so the session turns it on only when memory runs
short and a row is longer than a tile (`fast_paths.tiled_mlp: auto`), or always with `true`.
LoRA dropout draws the same masks in the recompute: each tile's RNG state is restored.

Tiles are sized so that one tile's intermediates take about TILE_BYTES (a multiple of 1,024
tokens, at least 1,024). Dense gated MLPs only; mixture-of-experts blocks keep their own path.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.fastpath import patching
from engine.fastpath.offload import RngState

KIND = "tiled_mlp"
# One tile's MLP intermediates (gate, up, their product and the activation's output, bf16).
TILE_BYTES = 256 * 2**20
TILE_UNIT = 1024


def tile_tokens(intermediate_size: int, dtype_bytes: int = 2) -> int:
    """Tokens per tile for an MLP of this width: about TILE_BYTES of intermediates."""
    per_token = 4 * intermediate_size * dtype_bytes
    return max(TILE_UNIT, (TILE_BYTES // max(1, per_token)) // TILE_UNIT * TILE_UNIT)


class _Plan:
    __slots__ = ("inner", "tile", "anchor")

    def __init__(self, inner: Callable, tile: int, anchor: torch.Tensor):
        self.inner, self.tile, self.anchor = inner, tile, anchor


def _tiled_forward(module: nn.Module, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
    tokens = x.numel() // x.shape[-1]
    if tokens <= plan.tile:
        return plan.inner(x)
    if not torch.is_grad_enabled():
        flat = x.reshape(tokens, x.shape[-1])
        out = torch.cat([plan.inner(part) for part in flat.split(plan.tile)])
        return out.view(*x.shape[:-1], out.shape[-1])
    return TiledMLP.apply(plan.inner, plan.tile, plan.anchor, x)


class TiledMLP(torch.autograd.Function):
    """forward(inner, tile, anchor, x) -> inner(x), tile by tile, keeping only x for backward."""

    @staticmethod
    def forward(ctx, inner: Callable, tile: int, anchor, x: torch.Tensor):
        ctx.inner, ctx.tile = inner, tile
        flat = x.reshape(-1, x.shape[-1])
        ctx.rng, outs = [], []
        with torch.no_grad():
            for part in flat.split(tile):
                ctx.rng.append(RngState.capture(x.device))
                outs.append(inner(part))
        ctx.save_for_backward(x)
        out = torch.cat(outs)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[3]
        flat = x.reshape(-1, x.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        dx = torch.empty_like(flat) if need_dx else None
        for i, start in enumerate(range(0, flat.shape[0], ctx.tile)):
            part = flat[start : start + ctx.tile].detach().requires_grad_(need_dx)
            with torch.enable_grad(), ctx.rng[i].restored():
                out = ctx.inner(part)
            if out.requires_grad:
                torch.autograd.backward(out, grads[start : start + ctx.tile])
            if need_dx:
                dx[start : start + ctx.tile] = part.grad
        return None, None, None, dx.view_as(x) if need_dx else None


def enable_tiled_mlp(mlps: list[nn.Module], intermediate_size: int, device) -> str:
    """Tile these dense MLP modules (engine.models.patches.dense_mlps finds a model's); the
    report line ("on: ...")."""
    tile = tile_tokens(intermediate_size)
    # An input that always requires grad, so each tile's backward runs even when the MLP's
    # input needs no gradient (LoRA weights inside still do).
    anchor = torch.empty(0, device=device, requires_grad=True)
    for m in mlps:
        if not patching.installed(m, KIND):
            patching.install(m, _tiled_forward, _Plan(m.forward, tile, anchor), KIND)
    return f"on: tiles of {tile:,} tokens in {len(mlps)} layers"


def tile_of(model) -> int:
    """Tokens per tile of the model's tiled MLPs, or 0 when they are not tiled."""
    for m in model.modules():
        patch = patching.installed(m, KIND)
        if patch is not None:
            return patch.plan.tile
    return 0
