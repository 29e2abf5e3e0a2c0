"""The defaults policy's decisions about the device and the model: device, dtype, 4-bit loading,
DDP or FSDP under torchrun, and the warnings about the machine. Each returns its value and the
reason for it.
"""

from __future__ import annotations

from typing import Any

from engine.hardware.budget import (
    BUSY_CARD_FRACTION,
    BUSY_TOKENS,
    Budget,
    Decision,
    Sizer,
    _cap,
    _gib,
    documents_alone,
)
from engine.hardware.profile import HardwareProfile
from engine.models import estimate as est


def device_default(profile: HardwareProfile) -> Decision:
    if profile.has_gpu:
        return "cuda", f"{profile.gpu_name} ({profile.kind})"
    return "cpu", profile.kind_reason


def machine_warnings(device: str, profile: HardwareProfile, budget: Budget) -> list[str]:
    """What the user should know about the device the run got."""
    if device == "cuda" and not profile.has_gpu:
        return [f"training.device is cuda but {profile.kind_reason}"]
    warnings = []
    if profile.gpu_count > 1 and budget.on_gpu:
        warnings.append(f"{profile.gpu_count} GPUs found; training uses one (cuda:0)")
    used = budget.total - budget.free
    if budget.on_gpu and budget.where == "VRAM" and used > BUSY_CARD_FRACTION * budget.total:
        warnings.append(
            f"other programs use {_gib(used)} of this card's {_gib(budget.total)}; "
            "closing them lets the run take a larger micro-batch"
        )
    return warnings


def dtype_default(profile: HardwareProfile, budget: Budget) -> Decision:
    if not budget.on_gpu:
        return "float32", "CPU: 16-bit matmuls are slow or missing on CPUs"
    if profile.bf16_supported:
        return "bfloat16", f"compute capability {_cap(profile)} supports bf16"
    return "float16", f"compute capability {_cap(profile)} has no bf16"


def load_in_4bit_default(profile: HardwareProfile, budget: Budget, size: Sizer) -> Decision:
    """4-bit base weights when 16 bits do not fit; on a consumer card also when they fit but
    crowd out the micro-batch (above that model size 4 bits train more tokens per step)."""
    if not budget.on_gpu:
        return False, "bitsandbytes 4-bit needs a CUDA GPU"
    if size.info is None:
        return False, "model size not known yet; 16-bit (set load_in_4bit: true for a model near the VRAM size)"
    seq, rules = size.seq, budget.rules
    # Offload cannot help on unified memory, nor for a family whose documents run one by one.
    no_offload = profile.integrated_memory or documents_alone(size.info)
    lean = size("lora16", seq, True, "off" if no_offload else "single")
    if lean > budget.memory:
        return True, f"16-bit LoRA needs ~{_gib(lean)} even at one {seq}-token row, over the {budget}"
    if rules.prefer_4bit:
        useful = max(seq, BUSY_TOKENS)
        room = size("lora16", useful, True, "double")
        if room > budget.memory:
            return True, (
                f"{rules.label}: in 16 bits this {_params(size.info)} model needs ~{_gib(room)} for a micro-batch "
                f"of {useful} tokens, over the {budget}; 4-bit weights leave the card to the micro-batch"
            )
        return False, (
            f"{rules.label}: in 16 bits a micro-batch of {useful} tokens needs ~{_gib(room)}, within the "
            f"{budget}; 16-bit trains faster than 4-bit"
        )
    return False, (
        f"16-bit LoRA at one {seq}-token row needs ~{_gib(lean)}, within the {budget} "
        f"({rules.label}: 4-bit only when 16-bit does not fit)"
    )


def load_in_4bit_for_fsdp() -> Decision:
    return False, "training.distributed is fsdp: the 16-bit base is sharded across the GPUs (4-bit cannot be)"


# A 16-bit base over this share of one device's budget leaves too little for the training
# itself (adapters, optimizer, activations, the loss): several processes shard it (FSDP2).
FSDP_WEIGHTS_SHARE = 0.8


def distributed_default(
    budget: Budget, info: est.ModelInfo | None, load_in_4bit: Any, size: Sizer | None = None
) -> Decision:
    """How several processes share the work (one process ignores it): DDP (the whole base on
    every device, adapter gradients all-reduced) unless the 16-bit base alone takes more than
    FSDP_WEIGHTS_SHARE of one device's budget, then FSDP2 (the base sharded per decoder layer).
    A 4-bit base stays DDP. A family whose documents run one by one (its layers carry state along a
    row, or it is not checked to pack: engine.models.arch.packing) cannot be trained under FSDP
    (engine.train.fsdp.alone_refusal): it stays DDP while one row fits
    one device (`size`: the run's Sizer), and where it does not, the reason says so and the run's
    setup refuses it with that reason before anything loads. On a CPU it says what happens there:
    one process, nothing shared."""
    if not budget.on_gpu:
        return "ddp", (
            "CPU: one process trains and nothing is distributed (ddp and fsdp share the work of several "
            "GPUs under torchrun)"
        )
    if load_in_4bit is True:
        return "ddp", "a 4-bit base is not sharded: each GPU holds it whole"
    if info is None:
        return "ddp", "model size not known yet: each GPU holds the whole base"
    weights = info.num_params * 2
    if weights > FSDP_WEIGHTS_SHARE * budget.memory:
        alone = documents_alone(info)
        if alone:
            return _alone_distributed(budget, info, weights, size, alone)
        return "fsdp", (
            f"the 16-bit base of {_params(info)} parameters (~{_gib(weights)}) leaves too little of one device's "
            f"{budget} for training: FSDP2 shards it across the GPUs"
        )
    return "ddp", (
        f"the 16-bit base (~{_gib(weights)}) fits one device's {budget} with room to train: each GPU holds it, "
        "only the adapter gradients travel"
    )


def _alone_distributed(budget: Budget, info: est.ModelInfo, weights: int, size: Sizer | None, alone: str) -> Decision:
    """DDP or (refused) FSDP for a row-state family whose 16-bit base crowds one device: DDP when a
    checkpointed row fits the budget without offload (offload is off for these families: each
    document runs alone, engine.train.step), else "fsdp" with the reason the setup refuses it."""
    model_type = info.model_type
    carries = (
        f"{model_type}: {alone}, so each document is its own forward, and under FSDP "
        "GPUs holding different numbers of documents would wait on each other forever"
    )
    # Without the run's Sizer only the base itself can be weighed.
    sized = size is not None and size.info is not None
    need = size("lora16", size.seq, True, "off") if sized else weights
    what = f"one {size.seq}-token row" if sized else "the base alone"
    if need <= budget.memory:
        return "ddp", (
            f"{carries}: FSDP cannot train it. Its 16-bit base of {_params(info)} parameters (~{_gib(weights)}) "
            f"crowds one device's {budget}, but {what} fits (~{_gib(need)}): DDP, each GPU holds the base "
            "whole (smaller micro-batches)"
        )
    needs = f" ({what} needs ~{_gib(need)})" if sized else ""
    return "fsdp", (
        f"the 16-bit base of {_params(info)} parameters (~{_gib(weights)}) does not fit one device's {budget}"
        f"{needs}, and FSDP, which would shard it, cannot train {model_type}: {carries}. Set model.load_in_4bit: "
        "true (DDP, each GPU holding a 4-bit base), a shorter data.max_seq_len, or train on GPUs with more memory"
    )


def _params(info: est.ModelInfo) -> str:
    return f"{info.num_params / 1e9:.1f}B"
