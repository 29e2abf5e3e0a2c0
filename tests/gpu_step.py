"""One measured forward + backward of a prepared model on the GPU, shared by the fast paths' GPU
tests (offload, host embeddings, tiled MLP): adapters with informative gradients, a step that
may be checked for device-to-host syncs, and its peak memory above what was allocated before."""

from __future__ import annotations

import torch

from engine.train.step import forward_loss

GIB = 2**30


def randomize_lora_b(model) -> None:
    """Nonzero LoRA B matrices, so every LoRA gradient is informative (PEFT starts B at zero)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)


def measured_step(prepared, batch, check_syncs: bool = False) -> tuple[torch.Tensor, float]:
    """(the loss, peak GiB above the memory allocated before the step) of one forward + backward
    of `prepared` (engine.train.step.PreparedModel) on `batch`; with `check_syncs`, any
    device-to-host sync in the step raises."""
    prepared.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if check_syncs:
        torch.cuda.set_sync_debug_mode("error")
    try:
        loss = forward_loss(prepared, batch, normalizer=batch.num_trained_tokens)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return loss.detach(), (torch.cuda.max_memory_allocated() - base) / GIB


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
