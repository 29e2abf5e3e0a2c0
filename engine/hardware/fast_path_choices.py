"""The defaults policy's decisions about the fast paths: the fused cross-entropy chunk, the
kernels (with lora_autograd and fused_ce), packed attention and MoE grouping. Each returns its
value and the reason for it.
"""

from __future__ import annotations

from engine.hardware.budget import (
    CE_BUDGET_CAP,
    CE_BUDGET_FRACTION,
    DEFAULT_VOCAB,
    Budget,
    Decision,
    _cap,
    _gib,
    _pow2_floor,
)
from engine.hardware.profile import MIN_FAST_PATH_CAPABILITY, HardwareProfile, MiB
from engine.models import estimate as est


def ce_chunk_default(info: est.ModelInfo | None, budget: Budget) -> Decision:
    """Tokens per fused cross-entropy chunk. Sized before anything that is estimated, because
    every estimate includes it."""
    vocab = info.vocab_size if info else DEFAULT_VOCAB
    budget_bytes = min(CE_BUDGET_FRACTION * budget.memory, CE_BUDGET_CAP)
    chunk = max(128, min(8192, _pow2_floor(budget_bytes / (vocab * 4))))
    return chunk, (
        f"{chunk} x {vocab} vocab x 4 B = {chunk * vocab * 4 / MiB:.0f} MiB of fp32 logits per chunk, "
        f"within {CE_BUDGET_FRACTION:.0%} of the {budget}, capped at {_gib(CE_BUDGET_CAP)}"
    )


def kernels_default(profile: HardwareProfile, budget: Budget) -> Decision:
    """Whether the Triton fast paths run: the value of kernels, lora_autograd and fused_ce."""
    if not budget.on_gpu:
        return False, "CPU: the plain-torch reference paths run (the Triton kernels need CUDA)"
    if not profile.triton_available:
        return False, "Triton is not installed: the plain-torch reference paths run"
    if profile.compute_capability and tuple(profile.compute_capability) < MIN_FAST_PATH_CAPABILITY:
        return False, (
            f"compute capability {_cap(profile)} is older than the Triton kernels support: "
            "the plain-torch reference paths run"
        )
    return True, "CUDA with Triton: the fused kernels apply"


def packed_attention_default(kernels_usable: bool) -> Decision:
    # It is also what keeps packed documents apart, so it is on everywhere: the Triton
    # varlen kernel where the fast paths run, per-document SDPA (the reference) elsewhere.
    return True, (
        "Triton varlen kernel"
        if kernels_usable
        else "per-document SDPA reference; documents never attend to each other"
    )


def moe_grouping_default() -> Decision:
    return True, (
        "plain torch (a stable sort by expert, group offsets by searchsorted, no host sync): helps on any device"
    )
