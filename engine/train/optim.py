"""The optimizer the engine trains LoRA parameters with, shared by the session and the bench.

On CUDA, AdamW's fused kernel updates every adapter tensor in one launch; the step loop is
host-bound on small models, so hundreds of per-tensor launches per step are worth saving.
The fused kernel does not bump the parameters' `_version`: nothing in the engine may key a
cache on it alone. The fused LoRA path's adapter cache also keys on the model's adapter
generation (engine.fastpath.lora_group.AdapterClock), which this optimizer advances after each
of its steps and each load of its state (watch_optimizer, hooked onto the optimizer made here
and no other): the optimizer is made for one model, so two models in one process never
invalidate each other's caches.
"""

from __future__ import annotations

import torch

from engine.fastpath.lora_group import watch_optimizer

OPTIMIZERS = ("auto", "adamw_fused", "adamw")


def make_optimizer(model, lr: float, weight_decay: float = 0.0, kind: str = "auto") -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters (its adapters; under FSDP, this rank's shards:
    make it after sharding). kind "auto": fused where every parameter is on CUDA, else the
    default (foreach/for-loop) implementation; "adamw_fused" / "adamw" force one."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; expected one of {OPTIMIZERS}")
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    fused = {"auto": True if on_cuda else None, "adamw_fused": True, "adamw": None}[kind]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
    watch_optimizer(optimizer, model)  # its steps and loads make the model's cached adapter weights stale
    return optimizer
