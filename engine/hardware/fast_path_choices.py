"""The defaults policy's decisions about the fast paths: the fused cross-entropy chunk, the
kernels (with lora_autograd and fused_ce), packed attention and MoE grouping. Each returns its
value and the reason for it. `lean_recompute_planned` tells the estimate whether offload's
recompute will be lean.
"""

from __future__ import annotations

from typing import Any

from engine.config import AUTO
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
from engine.models.arch import arch_for

# fast_paths.lean_recompute "auto" is on from this hidden size: engine.train.step's
# LEAN_RECOMPUTE_MIN_HIDDEN, which imports torch (tests/engine/models/test_estimate_lean_recompute.py
# holds the two equal).
LEAN_RECOMPUTE_MIN_HIDDEN = 4096


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


def lean_recompute_planned(fast: Any, lora_dropout: float, info: est.ModelInfo | None, kernels_usable: bool) -> bool:
    """Whether offload's recompute will be lean (engine.fastpath.recompute), so the estimate may
    count the MLP backward's row tiles instead of the whole gate and up. True only where the
    engine will take that path: the setting on (auto: hidden size >= LEAN_RECOMPUTE_MIN_HIDDEN,
    as engine.train.step.lean_recompute_choice), a family whose decoder layer the patches fuse
    (engine.models.patches), the kernels, the fused add+norm and the fused LoRA MLP not switched
    off (`kernels_usable`: what "auto" gives on this machine) and no LoRA dropout. Otherwise the
    estimate keeps the full recompute (erring high)."""
    if info is None or lora_dropout:
        return False
    setting = fast.lean_recompute
    on = setting is True or (setting == AUTO and info.hidden_size >= LEAN_RECOMPUTE_MIN_HIDDEN)
    arch = arch_for(info.model_type)
    if not on or arch is None or not (arch.fast_paths and arch.fused_add_norm):
        return False
    switches = (fast.kernels, fast.add_rmsnorm, fast.lora_autograd)
    return all(s is True or (s == AUTO and kernels_usable) for s in switches)


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
