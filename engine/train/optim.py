"""The optimizer the engine trains LoRA parameters with, shared by the session and the bench.

On CUDA, AdamW's fused kernel updates every adapter tensor in one launch; the step loop is
host-bound on small models, so hundreds of per-tensor launches per step are worth saving.
"""

from __future__ import annotations

import torch


def make_optimizer(params, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    params = list(params)
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True if on_cuda else None)
